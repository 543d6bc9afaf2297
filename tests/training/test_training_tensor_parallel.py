"""Tensor parallelism of the compiled step (``parallel={"tp": ...}``): Megatron's column- and
row-parallel projections, the sums over a split axis in the canonical order (leaves every split
refines, added in leaf order); parameters bitwise identical to tp = 1 under pipeline and
data-parallel plans, within float32 error of PyTorch; bad splits named."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers

import tvm_spinn
from tvm_spinn.training import TrainingError
from tvm_spinn.training.tensor_parallel import tp_layout
from test_training_lm import ADAMW, _assert_close, gpt2, llama, tokens
from training_models import LM, run_steps as _run, same_bits as _same_bits, torch_adamw

STEPS = 3
#: (name, with_plan options) of a tp = 2 trainer compiled with one micro-batch
TP_PLANS = {
    "tp2": {},
    "tp2 pp2 mb2": {"pp": 2, "microbatches": 2},
    "tp2 pp2 mb2 zb": {"pp": 2, "microbatches": 2, "zero_bubble": True},
    "tp2 dp2 mb2": {"replicas": 2, "microbatches": 2},
    "tp2 dp2 mb4 zero1": {"replicas": 2, "microbatches": 4, "zero": 1},
}


# -- the layout (fast) -----------------------------------------------------------------------------
def test_megatron_layout_of_gpt2_and_llama():
    """GPT-2's Conv1D (in, out) and Llama's Linear (out, in): QKV / up column-parallel on the
    output features (the fused QKV by heads inside each of Q, K, V), out / down row-parallel on
    the input features; norms, embeddings, biases replicated."""
    model = gpt2(layers=1, hidden=32, vocab=64)
    names = [n for n, _ in model.named_parameters()]
    shapes = [tuple(p.shape) for _, p in model.named_parameters()]
    layout = dict(zip(names, tp_layout(model, names, shapes, 2)))
    qkv = layout["lm.transformer.h.0.attn.c_attn.weight"]
    assert (qkv.kind, qkv.axis, qkv.extent, qkv.replicas) == ("column", 1, 96, 1)
    # the canonical order: 2 heads, 2 leaves of each of Q, K, V; leaf l the l-th slice of each
    assert (qkv.leaves, qkv.parts) == (2, 3)
    assert qkv.leaf_ranges() == (((0, 16), (32, 48), (64, 80)), ((16, 32), (48, 64), (80, 96)))
    out = layout["lm.transformer.h.0.attn.c_proj.weight"]
    assert (out.kind, out.axis, out.extent, out.leaf_ranges()) == ("row", 0, 32, (((0, 16),), ((16, 32),)))
    assert layout["lm.transformer.h.0.mlp.c_fc.weight"].axis == 1
    down = layout["lm.transformer.h.0.mlp.c_proj.weight"]
    assert (down.extent, down.leaves) == (128, 2)
    assert layout["lm.transformer.h.0.ln_1.weight"] is None and layout["lm.transformer.wte.weight"] is None
    assert layout["lm.transformer.h.0.attn.c_attn.bias"] is None
    model = llama(layers=1, hidden=32, vocab=64)
    names = [n for n, _ in model.named_parameters()]
    shapes = [tuple(p.shape) for _, p in model.named_parameters()]
    layout = dict(zip(names, tp_layout(model, names, shapes, 2)))
    assert [(layout[f"lm.model.layers.0.{n}.weight"].kind, layout[f"lm.model.layers.0.{n}.weight"].axis)
            for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")] == [
        ("column", 0), ("row", 1), ("column", 0), ("row", 1)]


def test_key_value_heads_replicate_past_their_count():
    """Grouped-query attention (4 heads, 2 key/value heads of 8 features, 64 MLP features):
    tp = 4 holds each key/value head on 2 ranks; the q/k/v input gradient's leaves are the query
    heads (4 of each of q, k and v: a leaf of k or v is half a head), so each rank owns whole
    leaves; tp = 3 is no split of the heads, named with the widths that are."""
    model = _gqa_llama()
    names = [n for n, _ in model.named_parameters()]
    shapes = [tuple(p.shape) for _, p in model.named_parameters()]
    for tp, replicas in ((1, 1), (2, 1), (4, 2)):
        layout = dict(zip(names, tp_layout(model, names, shapes, tp)))
        k = layout["lm.model.layers.0.self_attn.k_proj.weight"]
        q = layout["lm.model.layers.0.self_attn.q_proj.weight"]
        assert (k.extent, k.leaves, k.replicas, q.extent, q.leaves, q.replicas) == (16, 4, replicas, 32, 4, 1)
        assert k.leaf_ranges()[1] == ((4, 8),)  # the second half of key/value head 0 (rank 1 of 4)
        assert layout["lm.model.layers.0.mlp.up_proj.weight"].leaves == 4
    with pytest.raises(TrainingError, match=r"tp=3 does not divide the output features of .*q_proj \(32\)"):
        tp_layout(model, names, shapes, 3)


def test_compiled_step_and_planner_admit_the_same_widths():
    """Every tensor-parallel width the planner searches for a config is one the compiled step's
    layout accepts, and every other width up to the heads is refused by both: Llama-2-70B's
    shape scaled down (16 heads over 2 key/value heads), plain multi-head attention, and 12 heads
    over 4 with heads of 6 features (tp = 12 replicates each key/value head on 3 ranks) or of 8
    (32 key/value features do not split into 12 leaves: tp stops at 4)."""
    from tvm_spinn.llm.spec import spec_of
    from tvm_spinn.training import planner
    from tvm_spinn.training.planner import TrainingPlanError

    for heads, kv, inter, head_dim in ((16, 2, 64, 8), (8, 8, 48, 8), (12, 4, 96, 6), (12, 4, 96, 8)):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=head_dim * heads, intermediate_size=inter,
                                       num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv,
                                       max_position_embeddings=16, use_cache=False)
        model = LM(transformers.LlamaForCausalLM(cfg))
        names = [n for n, _ in model.named_parameters()]
        shapes = [tuple(p.shape) for _, p in model.named_parameters()]
        spec = spec_of(cfg.to_dict())
        searched, _, _ = planner._axes(spec, 8, None, None, None, None)
        built = []
        for tp in range(1, heads + 1):
            try:
                tp_layout(model, names, shapes, tp)
                built.append(tp)
            except TrainingError:
                with pytest.raises(TrainingPlanError, match=f"tp={tp} does not divide"):
                    planner._axes(spec, 8, tp, None, None, None)
        assert searched == built, (heads, kv, inter, head_dim)
        # replicated key/value heads are among them where a head's features split by query heads
        assert (max(built) > kv) == (kv < heads and kv * head_dim % math.gcd(heads, inter) == 0)


def _gqa_llama(layers: int = 1):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return LM(transformers.LlamaForCausalLM(cfg))


# -- bad input (fast: checked before anything is compiled) -----------------------------------------
@pytest.mark.parametrize("options, target, message", [
    ({"tp": 3}, "spinn/board", r"tp=3 does not divide the attention heads \(2\); tp may be 1, 2"),
    ({"tp": 4}, "spinn/board", r"tp=4 does not divide the attention heads \(2\); tp may be 1, 2"),
    ({"tp": 2}, "spinn", r"parallel: dp=1 x pp=1 x tp=2 needs 2 chips, target .* has 1"),
    ({"tp": 2}, "llvm", r"parallel: tp=2 needs a spinn target"),
])
def test_bad_tensor_splits(options, target, message):
    ids, _ = tokens(64)
    with pytest.raises(TrainingError, match=message):
        tvm_spinn.training.compile(gpt2(layers=2, hidden=32, vocab=64), torch.from_numpy(ids), optimizer=ADAMW,
                                   target=target, parallel=options)


class _ConfiguredMLP(torch.nn.Module):
    """A transformers configuration naming heads and layers, but no projection to split."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.config = transformers.GPT2Config(n_head=2, n_layer=1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(x)


def test_tp_needs_a_projection_to_split():
    """Nothing to split: at tp = 1 the step compiles as it is (no split layout); at tp = 2 the
    error names the projections tp splits."""
    model = _ConfiguredMLP()
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32))
    one = tvm_spinn.training.compile(model, x, optimizer=ADAMW, target="spinn/board", parallel={"tp": 1})
    assert one._tp_split is None
    with pytest.raises(TrainingError, match=r"parallel: tp=2 splits a transformer's attention and MLP projections "
                                            r"\(GPT-2 c_attn/c_proj/c_fc, Llama .*\) by heads; the model has none"):
        tvm_spinn.training.compile(model, x, optimizer=ADAMW, target="spinn/board", parallel={"tp": 2})


def test_tp_must_divide_the_split_features():
    """A head count tp divides but an MLP width it does not: the error names the layer's features."""
    model = gpt2(layers=1, hidden=32, vocab=64)
    names = [n for n, _ in model.named_parameters()]
    shapes = [(32, 6) if n.endswith("mlp.c_fc.weight") else tuple(p.shape) for n, p in model.named_parameters()]
    with pytest.raises(TrainingError, match=r"tp=4 does not divide the output features of "
                                            r"lm.transformer.h.0.mlp.c_fc \(6\); tp may be 1, 2, 3, 6"):
        tp_layout(model, names, shapes, 4)


# -- the step (slow: compiles a tp = 1 and a tp = 2 step) ------------------------------------------
@pytest.mark.slow
def test_tensor_parallel_plans_bitwise_identical_and_close_to_pytorch(tmp_path):
    """A 2-layer GPT-2 (hidden 32, vocabulary 64; batch 4 of 8 tokens), 3 AdamW steps on a board:
    tp = 2 alone, with 2 pipeline stages, with 2 data-parallel replicas, with ZeRO-1: the tp = 1
    run's losses and parameters bit for bit, PyTorch's within float32 error; a tp = 2 checkpoint
    resumed at tp = 1 continues with the same bits; the simulated step prices a rank's share."""
    model = gpt2(layers=2, hidden=32, vocab=64)
    ids, labels = tokens(64)
    batches = [(ids, labels)] * STEPS
    one = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn/board",
                                     parallel={"microbatches": 1})
    ref = _run(one, batches)
    _assert_close(ref, torch_adamw(model, batches, ADAMW[1]))
    tp = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn/board",
                                    parallel={"tp": 2, "microbatches": 1})
    # the canonical reductions: each layer's attention-output and MLP-down forwards (2 leaves:
    # the heads), the QKV input gradient (2 leaves of each of Q, K, V) and the MLP-up input
    # gradient (2); the tp = 1 program is the same
    found = sorted((c.name.split(".")[-2], c.leaves * c.parts) for c in tp._tp_split.reductions)
    assert found == sorted([("c_proj", 2), ("c_proj", 2), ("c_attn", 6), ("c_fc", 2)] * 2 + [("wte", 2)])  # + the head
    # the same program for every tp: the same reductions in the same leaves (a rank's share,
    # rank_ranges, is the split's)
    def program(split):
        return [(c.name, c.m, c.k, c.n, c.leaves, c.parts, c.ranges) for c in split.reductions]

    assert program(one._tp_split) == program(tp._tp_split)
    for name, options in TP_PLANS.items():
        plan = tp.with_plan(**options)
        assert plan.plan()["tp"] == 2, name
        assert _same_bits(_run(plan, batches), ref), name
    first = tp.with_plan(pp=2, microbatches=2)
    _run(first, batches[:1])
    first.save(tmp_path / "tp2.npz")
    resumed = one.with_plan()
    resumed.load(tmp_path / "tp2.npz")
    assert _same_bits(_run(resumed, batches[1:]), (ref[0][1:], ref[1]))
    t1, t2 = one.with_plan().simulated_step(), tp.with_plan().simulated_step()
    cost = t2["tp"]
    assert 0 < cost["rank_parallel_s"] < cost["parallel_s"]
    assert 0 < cost["rank_canonical_s"] < cost["canonical_s"] and cost["reduce_s"] > 0
    # physical bounds, independent of how the share is priced: a rank computes at least half the
    # one-chip granule (2 ranks) and at most all of it, and its reductions at least move each
    # reduced [m, n] sum (as the compiled program's canonical GEMMs give it) to the other rank once
    from tvm_spinn.target.topology import topology_of
    from tvm_spinn.timing.collectives import point_to_point

    computed = cost["rank_s"] - cost["reduce_s"]
    assert cost["one_chip_s"] / 2 <= computed <= cost["one_chip_s"]
    topo = topology_of(tp._system)
    moved = sum(point_to_point(topo, [0], [1], 4 * c.m * c.n).seconds for c in tp._tp_split.reductions)
    assert cost["reduce_s"] >= moved > 0
    assert cost["one_chip_s"] == pytest.approx(t1["microbatch_s"] / 4)  # the tp = 1 granule (4 per micro-batch)
    assert 0 < cost["rank_share_s"] and cost["all_reduce_s"] > 0
    assert t2["update_s"] < t1["update_s"]
    with pytest.raises(TrainingError, match=r"split for tp=2; compile with parallel=\{'tp': 4\}"):
        tp.with_plan(tp=4)


@pytest.mark.slow
def test_llama_tensor_parallel_matches_tp1():
    """A 1-layer Llama (Linear weights stored (out, in); SwiGLU's gate and up both column-parallel):
    tp = 2 x dp = 2 gives the tp = 1 bits."""
    model = llama(layers=1, hidden=32, vocab=64)
    ids, labels = tokens(64)
    batches = [(ids, labels)] * 2
    ref = _run(tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn/board",
                                          parallel={"microbatches": 1}), batches)
    tp = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn/board",
                                    parallel={"tp": 2, "dp": 2, "microbatches": 2})
    assert _same_bits(_run(tp, batches), ref)
    _assert_close(ref, torch_adamw(model, batches, ADAMW[1]))


def test_odd_vocabulary_prices_the_head_leaves_it_compiles():
    """A 1-layer GPT-2 with a vocabulary of 251 at tp = 2: the LM head's reduction over the
    vocabulary has ceil-width leaves (the last one shorter, empty ones left out); the simulated
    step prices the leaves the compiled program adds, ``canonical_s`` equal to a direct build of
    every reduction's leaves, and a rank's share is its own leaves."""
    from tvm import relax

    from tvm_spinn.training.parallel import _replica_target
    from tvm_spinn.training.tensor_parallel import _gemm_module
    from tvm_spinn.training.timing import executable_latency
    from tvm_spinn.training.tp_chain import vocab_leaves

    vocab = 251
    model = gpt2(layers=1, hidden=32, vocab=vocab)
    ids, labels = tokens(vocab)
    tp = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn/board",
                                    parallel={"tp": 2, "microbatches": 1})
    tp.step(ids, labels)
    split = tp._tp_split
    (head,) = [c for c in split.reductions if c.k == vocab]
    # independent reference: the leaves tile [0, vocab) in order, every one but the last
    # ceil(vocab / L) rows wide, L the nominal leaf count (the first leaf's width gives it)
    flat = [r for leaf in head.ranges for r in leaf]
    width = flat[0][1] - flat[0][0]
    assert [a for a, _ in flat] == list(range(0, vocab, width)) and flat[-1][1] == vocab
    assert all(b - a == width for a, b in flat[:-1]) and 0 < flat[-1][1] - flat[-1][0] <= width
    assert head.leaves == len(flat) and vocab % head.leaves != 0
    # rank 0 owns the first half of the nominal leaves: the busier rank
    nominal = vocab_leaves(2, 4 * 32, vocab)  # 2 heads, 128 MLP features
    assert -(-vocab // nominal) == width
    assert head.rank_ranges == head.ranges[:nominal // 2]
    cost = tp.with_plan().simulated_step()["tp"]
    direct = 0.0
    with _replica_target(tp._target) as (replica, _):
        for leaves in sorted({r.leaves for r in split.reductions}):
            group = [r for r in split.reductions if r.leaves == leaves]
            direct += executable_latency(relax.build(_gemm_module([(r.m, r.k, r.n) for r in group],
                                                                  [r.ranges for r in group]), target=replica))
    assert cost["canonical_s"] == direct
    assert 0 < cost["rank_canonical_s"] < cost["canonical_s"]
