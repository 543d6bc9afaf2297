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
from tvm_spinn.training.tp_chain import (admissible_tp, canonical_leaves, canonical_matmul, direct_reduce,
                                         group_sum, layer_reductions, leaf_slices, split_reduce)
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
    64 leaves of the query and MLP axes and of its 8 key/value heads' 1,024 features (16 a leaf:
    tp 16, 32 and 64 replicate each key/value head); Llama-2-13B: gcd(40, 13,824); 12 heads over
    4 key/value heads of 8 features: 32 features take 4 leaves, so tp stops at 4."""
    assert canonical_leaves(12, 12, 3072, 64) == (12, 12)
    assert canonical_leaves(64, 8, 28672, 128) == (64, 64)
    assert canonical_leaves(40, 40, 13824, 128) == (8, 8)
    assert canonical_leaves(12, 4, 96, 8) == (12, 4)
    assert admissible_tp(64, 8, 28672, 128) == [1, 2, 4, 8, 16, 32, 64]
    assert admissible_tp(12, 4, 96, 8) == [1, 2, 4]
    assert admissible_tp(12, 4, 96, 6) == [1, 2, 4, 12]
    assert leaf_slices(12, 2, 3) == (((0, 2), (4, 6), (8, 10)), ((2, 4), (6, 8), (10, 12)))
    with pytest.raises(TrainingError, match=r"5 leaves do not divide the axis \(12 features in 1 part"):
        leaf_slices(12, 5)
    # parts of unequal extents (Llama's q, k, v input gradients summed): leaf l is each part's l-th
    assert leaf_slices(16, 2, (8, 4, 4)) == (((0, 4), (8, 10), (12, 14)), ((4, 8), (10, 12), (14, 16)))
    with pytest.raises(TrainingError, match=r"3 leaves do not divide the axis \(16 features in 3 part\(s\): 8, 4, 4"):
        leaf_slices(16, 3, (8, 4, 4))
    with pytest.raises(TrainingError, match=r"heads must be a positive integer, got 0"):
        canonical_leaves(0, 1, 4, 8)


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


def test_the_pes_sum_separate_projections_leaf_by_leaf():
    """Llama's q, k and v input gradients (k = 32, 16, 16: grouped-query attention) summed in one
    canonical reduction (:func:`~tvm_spinn.training.tensor_parallel.canonical_sum`, leaf ``l`` one
    GEMM over the ``l``-th leaf of each), built for a chip and run: the bits of the rank-by-rank
    execution of the concatenated operands with parts (32, 16, 16) under tp = 1, 2 and 4, both
    algorithms."""
    import tvm
    from tvm import relax

    from tvm_spinn.training.tensor_parallel import canonical_sum
    from tvm_spinn.training.trainer import _resolve_target

    widths, leaves = (32, 16, 16), 4
    a, w = _operands(8, sum(widths), 16, seed=7)
    cuts = np.cumsum((0,) + widths)
    args = [relax.Var(f"{v}{i}", relax.TensorType(shape, "float32")) for i in range(3)
            for v, shape in (("a", (8, widths[i])), ("w", (widths[i], 16)))]
    bb = relax.BlockBuilder()
    with bb.function("main", args):
        with bb.dataflow():
            out = canonical_sum(bb, [(args[2 * i], args[2 * i + 1], (8, widths[i]), leaf_slices(widths[i], leaves))
                                     for i in range(3)])
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    ex = relax.build(bb.get(), target=_resolve_target("spinn"))
    inputs = [tvm.runtime.tensor(np.ascontiguousarray(x)) for i in range(3)
              for x in (a[:, cuts[i]:cuts[i + 1]], w[cuts[i]:cuts[i + 1]])]
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](*inputs).numpy()
    assert np.allclose(got, a.astype(np.float64) @ w.astype(np.float64), rtol=1e-4, atol=1e-3)
    for tp in (1, 2, 4):
        assert got.tobytes() == split_reduce(a, w, leaves, tp, widths, segments=3).tobytes(), tp
        assert np.concatenate(direct_reduce(a, w, leaves, tp, widths)).tobytes() == got.tobytes(), tp


# -- the planner prices the same reductions (fast) -------------------------------------------------
@pytest.mark.parametrize("family, tp", [("gpt2", 2), ("llama", 2), ("llama", 4)])
def test_planner_reductions_are_the_compiled_steps(family, tp):
    """The planner's reductions of a block (:func:`layer_reductions`, from the sizes alone) are the
    GEMMs the compiled step's layout reduces, with the same leaves; and the collectives the
    planner prices (:func:`planner._tp_reductions`, sequence parallel) carry what executing the
    compiled step's reductions rank by rank sends: each reduction's direct reduce-scatter
    (:func:`direct_reduce`'s messages: the bytes of one leaf's pieces to all owners, the pieces a
    rank sends one owner), and, at tp = 4 over 2 key/value heads, the all-reduce of each replicated
    head's key and value gradients over its 2 replicas (the compiled layout's groups)."""
    from test_training_lm import gpt2
    from tvm_spinn.llm.spec import spec_of
    from tvm_spinn.target import make_system
    from tvm_spinn.training import planner
    from tvm_spinn.training.graph import build_train_graph
    from tvm_spinn.training.parallel import grad_module
    from tvm_spinn.training.tensor_parallel import split_gemms, tp_layout

    model = gpt2(layers=1, hidden=32, vocab=64) if family == "gpt2" else _gqa_llama(layers=1)
    ids, _ = tokens(64)
    micro = build_train_graph(model, (torch.from_numpy(ids),), "cross_entropy", ADAMW)
    layout = tp_layout(model, micro.param_names, micro.param_shapes, tp)
    split = split_gemms(grad_module(micro), len(micro.input_shapes), layout, tp)
    compiled = sorted((c.k, c.leaves, c.parts) for c in split.reductions)
    spec = spec_of(model.lm.config)
    h, i, q, kv = planner._widths(spec)
    (m,) = {c.m for c in split.reductions}  # the step's tokens
    reductions = layer_reductions(spec.family, h, q, kv, i, m, spec.heads, spec.kv_heads)
    assert sorted((k, leaves, parts) for _, _, k, _, leaves, parts in reductions) == compiled
    # what the compiled step's reductions send, executed rank by rank: (bytes of one of rank 0's
    # leaves, its pieces to every owner; the pieces rank 0 sends one owner)
    sent = []
    for c in split.reductions:
        a, w = _operands(c.m, c.k, c.n)
        log = []
        direct_reduce(a, w, c.leaves, tp, log=log)  # the messages do not depend on how k is cut
        mine = [msg for msg in log if msg[0] == 0]
        first = min(leaf for _, _, leaf, _ in mine)
        sent.append((float(sum(b for _, _, leaf, b in mine if leaf == first)), sum(1 for msg in mine if msg[1] == 0)))
    groups = [(tp // r, r, 4.0 * m * f) for _, m, f, r in split.groups]  # (heads, replicas, bytes) a weight
    arch = make_system("four-chips", chips=4)
    comms = planner._Comms(arch, True)
    calls, price = [], comms.collective_parts

    def record(op, g, nbytes, leaves=1, chain=False):
        out = price(op, g, nbytes, leaves, chain)
        calls.append((op, g.shape, float(nbytes), leaves, out[0], chain))
        return out

    comms.collective_parts = record
    got = planner._tp_reductions(spec, m, tp, np.array([list(range(tp))]), comms, arch, True)
    # a layer's reductions: one per compiled reduction (two a layer of each pass)
    assert len(split.reductions) == 4
    assert sorted((n, leaves) for op, _, n, leaves, _, _ in calls if op == "reduce_scatter") == sorted(sent)
    assert sorted((g[0], g[1], n) for op, g, n, _, _, _ in calls if op == "all_reduce") == sorted(groups)
    assert sorted(n for op, _, n, _, _, _ in calls if op == "all_gather") == [4.0 * m * h] * 1  # priced once, used 4 times
    # the compiled reductions' partial sums exist per rank (direct or chain); a replicated head's
    # gradient is group_sum's chain (each replica adds its query head's term in rank order, one
    # term a rank), as tp_compute prices group_s
    assert all(not chain for op, *_, chain in calls if op != "all_reduce")
    assert all(chain and leaves == 1 for op, _, _, leaves, _, chain in calls if op == "all_reduce")
    gather = next(s for op, *_, s, _ in calls if op == "all_gather")
    assert got["forward_s"] + got["backward_s"] == pytest.approx(
        sum(s for op, *_, s, _ in calls if op != "all_gather") + 4 * gather)
    if family == "llama" and tp == 4:
        assert len(groups) == 2  # k_proj and v_proj: 2 key/value heads of 8 features on 2 replicas each
    assert got["forward_add_s"] > 0 and got["backward_add_s"] > 0
    # a direct reduce-scatter of 2 leaves a rank carries twice the bytes of one
    pair = np.array([[0, 1]])
    one = comms._at("reduce_scatter", pair, "direct", 4096.0)
    two = comms._at("reduce_scatter", pair, "direct", 4096.0, 2)
    assert two[1] == pytest.approx(2 * one[1]) and two[0] > one[0]


def test_replicated_key_value_gradients_have_the_one_chip_bits():
    """A key/value head's gradient is a sum over its query heads (the backward of repeating it
    for each): the compiled ``sum`` over that axis, built for a chip and run, gives bit for bit
    the rank-by-rank chain of :func:`group_sum` for every replica count (Llama-2-70B: 8 query
    heads a key/value head, replicated on 1, 2, 4 or 8 ranks); pre-summing each replica's heads
    from zero, then adding the replicas, does not."""
    import tvm
    from tvm import relax

    from tvm_spinn.training.trainer import _resolve_target

    rng = np.random.default_rng(5)
    n = 8
    terms = (rng.standard_normal((2, 8, 8, n)) * np.exp2(rng.integers(-12, 12, (2, 8, 8, n)))).astype(np.float32)
    x = relax.Var("x", relax.TensorType(terms.shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.sum(x, axis=[3]))
        bb.emit_func_output(out)
    ex = relax.build(bb.get(), target=_resolve_target("spinn"))
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(terms)).numpy()
    for replicas in (1, 2, 4, 8):
        assert group_sum(terms, replicas).tobytes() == got.tobytes(), replicas
    halves = [group_sum(terms[..., :4], 1), group_sum(terms[..., 4:], 1)]
    assert (halves[0] + halves[1]).tobytes() != got.tobytes()
    with pytest.raises(TrainingError, match=r"3 replicas do not divide the 8 query heads"):
        group_sum(terms, 3)


# -- the compiled step (slow: compiles tp = 1, 2 and 4) --------------------------------------------
def _gqa_llama(layers: int = 2):
    """A Llama with grouped-query attention: 4 heads over 2 key/value heads of 8 features, 64
    MLP features."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return LM(transformers.LlamaForCausalLM(cfg))


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
             "tp2 pp2 mb2 zb": compiled[2].with_plan(pp=2, microbatches=2, zero_bubble=True),
             "tp2 dp2 zero1 mb4": compiled[2].with_plan(replicas=2, microbatches=4, zero=1),
             "tp4 dp2 mb2": compiled[4].with_plan(replicas=2, microbatches=2)}
    for name, plan in plans.items():
        assert _same_bits(_run(plan, batches), ref), name
    leaves = {c.leaves * c.parts for c in compiled[4]._tp_split.reductions}
    assert leaves == {4, 12}  # 4 heads; the fused QKV's 4 leaves of each of Q, K, V


@pytest.mark.slow
def test_llama_parameters_bitwise_identical_with_summed_input_gradients():
    """A 2-layer Llama with grouped-query attention (4 heads, 2 key/value heads of 8 features, 64
    MLP features): its q/k/v and gate/up input gradients each one reduction (4 leaves of each of
    q, k, v: a leaf of k or v is half a head; 4 of gate and up), 2 a backward per layer. 3 AdamW
    steps under tp = 1, tp = 2, tp = 4 (each key/value head replicated on 2 ranks), tp = 2 x pp = 2
    x 2 micro-batches, tp = 2 x dp = 2 with ZeRO-1 and tp = 4 x dp = 2: bit for bit those of tp =
    1, and PyTorch's within float32 error. At tp = 4 the simulated step prices the replicas' sums
    of the key/value gradients."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = LM(transformers.LlamaForCausalLM(cfg))
    ids, labels = tokens(64)
    batches = [(ids, labels)] * 3
    compiled = {tp: tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn/board",
                                               parallel={"tp": tp, "microbatches": 1}) for tp in (1, 2, 4)}
    found = sorted((c.k, c.leaves, c.parts, c.name.count("+")) for c in compiled[4]._tp_split.reductions)
    # + the LM head's input gradient over the vocabulary's 4 leaves
    assert found == sorted([(32, 4, 1, 0), (64, 4, 1, 0), (32 + 2 * 16, 4, 3, 2), (2 * 64, 4, 2, 1)] * 2
                           + [(64, 4, 1, 0)])
    assert compiled[1]._tp_split.reductions == compiled[2]._tp_split.reductions == compiled[4]._tp_split.reductions
    # tp = 4: every layer's k_proj and v_proj hold one key/value head (8 features) on 2 ranks each
    assert sorted((name.split(".")[-2], m, f, r) for name, m, f, r in compiled[4]._tp_split.groups) == sorted(
        [("k_proj", 8, 8, 2), ("v_proj", 8, 8, 2)] * 2)  # a granule: one sequence of 8 tokens
    assert compiled[2]._tp_split.groups == ()
    ref = _run(compiled[1].with_plan(), batches)
    _assert_close(ref, torch_adamw(model, batches, ADAMW[1]))
    plans = {"tp2": compiled[2].with_plan(), "tp4": compiled[4].with_plan(),
             "tp2 pp2 mb2": compiled[2].with_plan(pp=2, microbatches=2),
             "tp2 dp2 zero1 mb4": compiled[2].with_plan(replicas=2, microbatches=4, zero=1),
             "tp4 dp2 mb2": compiled[4].with_plan(replicas=2, microbatches=2)}
    for name, plan in plans.items():
        assert _same_bits(_run(plan, batches), ref), name
    cost = compiled[4].with_plan().simulated_step()["tp"]
    assert cost["group_s"] > 0 and compiled[2].with_plan().simulated_step()["tp"]["group_s"] == 0
