"""The canonical order of a tensor-parallel reduction (:mod:`tvm_spinn.training.tp_chain`):
executed rank by rank under every split, it gives the one-chip bits; the compiled program runs
the same additions on the PEs; Megatron's per-rank partial sums do not; the planner prices one
reduce-scatter a reduction with a piece a leaf; and the compiled step's parameters are bitwise
identical under tensor-, pipeline- and data-parallel plans of 1, 2 and 4 ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import tvm_spinn
from tvm_spinn import _lib
from tvm_spinn.training import TrainingError
from tvm_spinn.training.tp_chain import (canonical_leaves, canonical_matmul, direct_reduce, layer_reductions,
                                         leaf_slices, split_reduce)
from test_training_lm import ADAMW, _assert_close, tokens
from training_models import LM, run_steps as _run, same_bits as _same_bits, torch_adamw


def _operands(m: int, k: int, n: int, seed: int = 3):
    """Values spanning 12 binades, so a changed order of additions shows in the bits."""
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-6, 6, (m, k)))).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    return a, w


def _gemm(a, w) -> np.ndarray:
    out = np.zeros((a.shape[0], w.shape[1]), np.float32)
    _lib.gemm_f32(np.ascontiguousarray(a), np.ascontiguousarray(w), out)
    return out


# -- the order (fast) ------------------------------------------------------------------------------
def test_leaves_every_admissible_split_refines():
    """GPT-2 small: 12 leaves (every tp dividing the heads and 3,072 divides 12); Llama-2-70B:
    64 leaves of the query and MLP axes, 8 of the key/value heads; Llama-2-13B: gcd(40, 13,824)."""
    assert canonical_leaves(12, 12, 3072) == (12, 12)
    assert canonical_leaves(64, 8, 28672) == (64, 8)
    assert canonical_leaves(40, 40, 13824) == (8, 8)
    assert leaf_slices(12, 2, 3) == (((0, 2), (4, 6), (8, 10)), ((2, 4), (6, 8), (10, 12)))
    with pytest.raises(TrainingError, match=r"5 leaves do not divide the axis \(12 features in 1 part"):
        leaf_slices(12, 5)
    with pytest.raises(TrainingError, match=r"heads must be a positive integer, got 0"):
        canonical_leaves(0, 1, 4)


@pytest.mark.parametrize("parts", [1, 3])
def test_every_split_executes_the_same_additions(parts):
    """A GEMM over k = 96 in 12 leaves (parts of Q, K, V: 4 leaves each... of 3 parts), executed
    rank by rank for tp = 1, 2, 3, 4, 6, 12 as the pipelined chain (1 and 5 row segments) and as
    the direct reduce-scatter: every one the one-chip canonical bits. The plain GEMM and
    Megatron's per-rank partial sums (one GEMM from zero a rank, then summed) differ, and differ
    between splits: the order shows in these values."""
    leaves = 12 if parts == 1 else 4
    a, w = _operands(10, 96, 7)
    ref = canonical_matmul(a, w, leaves, parts)
    assert np.allclose(ref, a.astype(np.float64) @ w.astype(np.float64), rtol=1e-4, atol=1e-3)
    assert ref.tobytes() != _gemm(a, w).tobytes()
    megatron = {}
    for tp in (1, 2, 3, 4, 6, 12):
        if leaves % tp:
            continue
        for segments in (1, 5):
            assert split_reduce(a, w, leaves, tp, parts, segments).tobytes() == ref.tobytes(), (tp, segments)
        assert np.concatenate(direct_reduce(a, w, leaves, tp, parts)).tobytes() == ref.tobytes(), tp
        ranges = leaf_slices(96, leaves, parts)
        per_rank = [[r for l, r in enumerate(ranges) if l * tp // leaves == rank] for rank in range(tp)]
        partials = [_gemm(np.concatenate([a[:, k0:k1] for rs in mine for k0, k1 in rs], axis=1),
                          np.concatenate([w[k0:k1] for rs in mine for k0, k1 in rs], axis=0)) for mine in per_rank]
        megatron[tp] = sum(partials[1:], partials[0]).tobytes()
    assert len(set(megatron.values())) > 1  # the usual split's bits depend on tp


def test_vocabulary_leaves_bound_the_head_widths():
    """The vocabulary's leaves: gcd(heads, intermediate) doubled while a leaf keeps 64 rows
    (GPT-2 small: 12 x 64 = 768 leaves of 66 rows; Llama-2-70B: 64 x 4 = 256 of 125); a head
    stage's width divides them, so every rank holds whole leaves."""
    from tvm_spinn.llm.spec import spec_of
    from tvm_spinn.training.planner import _head_widths
    from tvm_spinn.training.tp_chain import vocab_leaves

    assert vocab_leaves(12, 3072, 50257) == 768 and vocab_leaves(64, 28672, 32000) == 256
    assert vocab_leaves(2, 64, 64) == 2  # fewer rows than a leaf's least: the admissible tp alone
    spec = spec_of(transformers.GPT2Config())
    widths = _head_widths(spec, 12, 12, 4, 1152)
    assert widths == [0, 12, 24, 48, 96] and all(768 % w == 0 for w in widths[1:])
    assert _head_widths(spec, 12, 12, 1, 10**6)[-1] == 768  # the leaves, not the chips, end the list


def test_a_split_that_does_not_divide_the_leaves_is_refused():
    a, w = _operands(4, 24, 3)
    with pytest.raises(TrainingError, match=r"tp=5 does not divide the 12 leaves; tp may be 1, 2, 3, 4, 6, 12"):
        split_reduce(a, w, 12, 5)
    with pytest.raises(TrainingError, match=r"float32 operands only"):
        canonical_matmul(a.astype(np.float64), w, 12)


def test_the_pes_run_the_canonical_order():
    """The program :func:`~tvm_spinn.training.tensor_parallel.split_gemms` emits for a reduction
    (leaf GEMMs on the PEs, additions in leaf order), built for a chip and run: the bits of the
    rank-by-rank execution under tp = 2 and 4."""
    import tvm
    from tvm import relax

    from tvm_spinn.training.tensor_parallel import _gemm_module
    from tvm_spinn.training.trainer import _resolve_target

    a, w = _operands(8, 64, 16, seed=5)
    ex = relax.build(_gemm_module([(8, 64, 16)], leaves=4), target=_resolve_target("spinn"))
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(w))[0].numpy()
    for tp in (1, 2, 4):
        assert got.tobytes() == split_reduce(a, w, 4, tp, segments=3).tobytes(), tp


# -- the planner prices the same reductions (fast) -------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_planner_reductions_are_the_compiled_steps(family):
    """The planner's reductions of a block (:func:`layer_reductions`, from the sizes alone) are the
    GEMMs the compiled step's layout reduces, with the same leaves; the planner charges each a
    reduce-scatter (sequence parallel) carrying one piece a leaf for the direct algorithm."""
    from test_training_lm import gpt2, llama
    from tvm_spinn.llm.spec import spec_of
    from tvm_spinn.target import make_system
    from tvm_spinn.training import planner
    from tvm_spinn.training.tensor_parallel import tp_layout

    model = (gpt2 if family == "gpt2" else llama)(layers=1, hidden=32, vocab=64)
    names = [n for n, _ in model.named_parameters()]
    shapes = [tuple(p.shape) for _, p in model.named_parameters()]
    compiled = sorted((len(s.owner), s.leaves, s.parts) for s in tp_layout(model, names, shapes, 2) if s is not None)
    spec = spec_of(model.lm.config)
    h, i, q, kv = planner._widths(spec)
    reductions = layer_reductions(spec.family, h, q, kv, i, 8, spec.heads, spec.kv_heads)
    assert sorted((k, leaves, parts) for _, _, k, _, leaves, parts in reductions) == compiled
    arch = make_system("four-chips", chips=4)
    groups = np.array([[0, 1]])
    comms = planner._Comms(arch, True)
    got = planner._tp_reductions(spec, 8, 2, groups, comms, arch, True)
    gather = comms.collective_parts("all_gather", groups, 4 * 8 * h)
    expect = {"forward": 2 * gather[0], "backward": 2 * gather[0]}
    for kind, m, _, n, leaves, _ in reductions:
        expect[kind] += comms.collective_parts("reduce_scatter", groups, 4 * m * n, leaves // 2)[0]
    assert (got["forward_s"], got["backward_s"]) == pytest.approx((expect["forward"], expect["backward"]))
    assert got["forward_add_s"] > 0 and got["backward_add_s"] > got["forward_add_s"] * (family == "llama")
    # a direct reduce-scatter of 2 leaves a rank carries twice the bytes of one
    one = comms._at("reduce_scatter", groups, "direct", 4096.0)
    two = comms._at("reduce_scatter", groups, "direct", 4096.0, 2)
    assert two[1] == pytest.approx(2 * one[1]) and two[0] > one[0]


# -- the compiled step (slow: compiles tp = 1, 2 and 4) --------------------------------------------
def _gpt2_four_heads():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="eager")
    return LM(transformers.GPT2LMHeadModel(cfg))


@pytest.mark.slow
def test_parameters_bitwise_identical_across_tp_pp_dp_plans():
    """A 2-layer GPT-2 with 4 heads (4 leaves a reduction), 3 AdamW steps on a board, executed
    under tp = 1, tp = 2 (2 leaves a rank), tp = 4 (1 leaf a rank), tp = 2 x pp = 2 x 2
    micro-batches, tp = 2 x dp = 2 with ZeRO-1 and tp = 4 x dp = 2: losses and parameters bit for
    bit those of tp = 1, and PyTorch's within float32 error."""
    model = _gpt2_four_heads()
    ids, labels = tokens(64)
    batches = [(ids, labels)] * 3
    compiled = {tp: tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn/board",
                                               parallel={"tp": tp, "microbatches": 1}) for tp in (1, 2, 4)}
    ref = _run(compiled[1].with_plan(), batches)
    _assert_close(ref, torch_adamw(model, batches, ADAMW[1]))
    plans = {"tp2": compiled[2].with_plan(), "tp4": compiled[4].with_plan(),
             "tp2 pp2 mb2": compiled[2].with_plan(pp=2, microbatches=2),
             "tp2 dp2 zero1 mb4": compiled[2].with_plan(replicas=2, microbatches=4, zero=1),
             "tp4 dp2 mb2": compiled[4].with_plan(replicas=2, microbatches=2)}
    for name, plan in plans.items():
        assert _same_bits(_run(plan, batches), ref), name
    leaves = {c.leaves * c.parts for c in compiled[4]._tp_split.reductions}
    assert leaves == {4, 12}  # 4 heads; the fused QKV's 4 leaves of each of Q, K, V
