"""The vocabulary-parallel LM head and cross-entropy (:mod:`tvm_spinn.training.vocab_parallel`):
the loss and its gradient executed rank by rank give the PE kernels' bits for every split of the
vocabulary (Megatron's partial sums do not); the head's input gradient takes the vocabulary's
canonical leaves; a GPT-2 trained under three vocabulary splits has bitwise identical
parameters, within float32 error of PyTorch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import tvm_spinn
from tvm_spinn.program.ops.elementwise import exp_f32
from tvm_spinn.program.ops.loss import cross_entropy_grad, cross_entropy_rows
from tvm_spinn.training import TrainingError
from tvm_spinn.training.tp_chain import canonical_matmul, split_reduce, vocab_leaves
from tvm_spinn.training.vocab_parallel import VocabShard, split_cross_entropy, vocab_parallel, vocab_ranges
from test_training_lm import ADAMW, _assert_close, tokens
from training_models import LM, run_steps as _run, same_bits as _same_bits, torch_adamw

_F32 = np.float32


def _logits(rows: int = 6, classes: int = 300, seed: int = 0):
    rng = np.random.default_rng(seed)
    z = (4.0 * rng.standard_normal((rows, classes))).astype(_F32)
    return z, rng.integers(0, classes, rows).astype(np.int32)


# -- the leaves and the loss, rank by rank (fast) ----------------------------------------------
def test_vocab_ranges_cover_the_vocabulary_in_order():
    assert vocab_ranges(256, 4) == ((0, 64), (64, 128), (128, 192), (192, 256))
    # 50,257 (GPT-2) in 768 leaves of 66 rows: the last leaves a padded vocabulary's (empty)
    ranges = vocab_ranges(50257, 768)
    assert len(ranges) == 768 and ranges[0] == (0, 66) and ranges[-1] == (50257, 50257)
    assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:])) and ranges[761] == (50226, 50257)
    shard = VocabShard("lm_head.weight", "column", 0, 10, leaves=4)
    assert shard.leaf_ranges() == (((0, 3),), ((3, 6),), ((6, 9),), ((9, 10),))
    with pytest.raises(TrainingError, match="leaves must be a positive integer, got 0"):
        vocab_ranges(10, 0)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 7, 300])
def test_split_loss_gives_the_kernels_bits_for_every_split(tp):
    """Every rank from its own columns (uneven splits included): the ranks' maxima, their
    exponentials added to the running sum in rank order, the label owner's logit: the
    ``cross_entropy`` and ``cross_entropy_backward`` kernels' bits."""
    z, t = _logits()
    loss, grad = split_cross_entropy(z, t, tp, 6.0)
    assert loss.tobytes() == cross_entropy_rows(z, t).tobytes()
    assert grad.tobytes() == cross_entropy_grad(z, t, 6.0).tobytes()


def test_megatron_partial_sums_depend_on_the_split():
    """The order the chain fixes matters: Megatron's split, each rank's sum of exponentials from
    zero and the partial sums added, gives other bits for other splits (the test above would fail
    on it)."""
    z, t = _logits(rows=64, classes=1000)
    e = exp_f32(z - z.max(axis=1, keepdims=True))

    def megatron(tp):
        parts = []
        for cols in np.array_split(np.arange(z.shape[1]), tp):
            s = np.zeros(z.shape[0], _F32)
            for j in cols:
                s = s + e[:, j]
            parts.append(s)
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    sums = {tp: megatron(tp).tobytes() for tp in (1, 2, 4, 8)}
    assert len(set(sums.values())) > 1


def test_bad_splits_of_the_loss_are_named():
    z, t = _logits(rows=2, classes=5)
    with pytest.raises(TrainingError, match=r"tp must be an integer in \[1, 5\]"):
        split_cross_entropy(z, t, 6, 1.0)
    with pytest.raises(TrainingError, match=r"labels must lie in \[0, 5\)"):
        split_cross_entropy(z, np.array([0, 5], np.int32), 1, 1.0)


def test_head_input_gradient_in_vocab_leaves_is_split_independent():
    """The head's input gradient ``dZ @ W`` over the vocabulary's leaves: every split of the
    leaves over the ranks gives the one-chip canonical bits."""
    rng = np.random.default_rng(1)
    dz = rng.standard_normal((16, 256)).astype(_F32)
    w = rng.standard_normal((256, 32)).astype(_F32)
    leaves = vocab_leaves(4, 128, 256)
    assert leaves == 4
    one = canonical_matmul(dz, w, leaves)
    for tp in (1, 2, 4):
        assert split_reduce(dz, w, leaves, tp).tobytes() == one.tobytes(), tp


# -- the compiled step's layout (fast-ish: builds the gradient programs) -------------------------
def _gpt2(heads: int = 4, vocab: int = 256, layers: int = 1):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=32, n_layer=layers, n_head=heads,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return LM(transformers.GPT2LMHeadModel(cfg))


def _llama(vocab: int = 192):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
                                   use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return LM(transformers.LlamaForCausalLM(cfg))


@pytest.mark.parametrize("make, name, axis, vocab, leaves", [
    (_gpt2, "lm.transformer.wte.weight", 0, 256, 4),  # tied to the embedding: [vocab, hidden]
    (_llama, "lm.lm_head.weight", 0, 192, 4),  # an untied Linear: [vocab, hidden]
])
def test_the_head_weight_is_split_by_the_vocabulary(make, name, axis, vocab, leaves):
    from tvm_spinn.training.graph import build_train_graph
    from tvm_spinn.training.parallel import grad_module
    from tvm_spinn.training.tensor_parallel import split_gemms, tp_layout

    model = make()
    ids, _ = tokens(vocab)
    micro = build_train_graph(model, (torch.from_numpy(ids[:1]),), "cross_entropy", ADAMW)
    mod = grad_module(micro)
    layout = tp_layout(model, micro.param_names, micro.param_shapes, 2)
    marked = vocab_parallel(mod, len(micro.input_shapes), micro.param_names, layout, model)
    (head,) = [s for s, before in zip(marked, layout) if s != before]
    assert isinstance(head, VocabShard) and (head.name, head.axis, head.extent, head.leaves) == (
        name, axis, vocab, leaves)
    assert leaves == vocab_leaves(4, 64 if make is _llama else 128, vocab)
    # the head's input gradient becomes a reduction over the vocabulary in its leaves
    split = split_gemms(mod, len(micro.input_shapes), marked, 2)
    (red,) = [c for c in split.reductions if c.name == name]
    assert (red.m, red.k, red.n, red.leaves, red.parts) == (8, vocab, 32, leaves, 1)
    # the loss over the split head: 8 rows, each rank its half of the classes (two of the leaves)
    assert split.losses == ((8, vocab, vocab // 2),)
    assert split_gemms(mod, len(micro.input_shapes), layout, 2).losses == ()  # head not split: every rank
    # a model whose loss reads no head GEMM (an MLP classifier) keeps its layout
    no_loss = build_train_graph(
        torch.nn.Sequential(torch.nn.Linear(4, 3)), (torch.zeros(2, 4),), "mse", ("sgd", {"lr": 0.1}))
    assert vocab_parallel(grad_module(no_loss), 1, no_loss.param_names, (None, None), model) == (None, None)


def test_a_rank_prices_the_loss_over_its_own_classes():
    """``tp_compute`` charges a rank the cross-entropy kernels over its share of the classes (not
    the whole vocabulary) plus the chain of each row's three scalars over the ranks."""
    from tvm_spinn.target.registry import arch_of
    from tvm_spinn.target.topology import topology_of
    from tvm_spinn.timing.collectives import point_to_point
    from tvm_spinn.training.graph import build_train_graph
    from tvm_spinn.training.parallel import grad_module
    from tvm_spinn.training.tensor_parallel import split_gemms, tp_compute, tp_layout

    model = _gpt2(vocab=512)
    ids, _ = tokens(512)
    micro = build_train_graph(model, (torch.from_numpy(ids[:1]),), "cross_entropy", ADAMW)
    mod = grad_module(micro)
    topo = topology_of(arch_of("spinn/board"))
    cost = {}
    for tp in (2, 4):
        layout = vocab_parallel(mod, 1, micro.param_names, tp_layout(model, micro.param_names, micro.param_shapes, tp),
                                model)
        split = split_gemms(mod, 1, layout, tp)
        assert split.losses == ((8, 512, 512 // tp),)
        cost[tp] = tp_compute(split, 1.0, "spinn/board", topo)
    # the whole vocabulary's kernels on one chip, the same for every split; a rank's share scales
    # with its classes (the kernels' work is per class: within 20% of the share of the classes)
    assert cost[2]["loss_s"] == cost[4]["loss_s"] > cost[2]["rank_loss_s"] > cost[4]["rank_loss_s"] > 0
    for tp in (2, 4):
        assert cost[tp]["rank_loss_s"] == pytest.approx(cost[tp]["loss_s"] / tp, rel=0.2)
        # the chain at least moves each row's three scalars across one hop
        assert cost[tp]["loss_chain_s"] >= point_to_point(topo, [0], [1], 3 * 4 * 8).seconds > 0


# -- the step (slow: compiles three splits) --------------------------------------------------------
@pytest.mark.slow
def test_vocab_splits_give_bitwise_identical_parameters_close_to_pytorch():
    """A 2-layer GPT-2 with 4 heads and a tied head over 256 tokens (4 vocabulary leaves of 64),
    3 AdamW steps on a board with the head and loss split over 1, 2 and 4 ranks (and tp = 2 with
    2 micro-batches over 2 pipeline stages): the tp = 1 losses and parameters bit for bit,
    PyTorch's within float32 error; a rank updates its share of the head's rows."""
    model = _gpt2(layers=2)
    ids, labels = tokens(256)
    batches = [(ids, labels)] * 3
    compiled = {tp: tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn/board",
                                               parallel={"tp": tp, "microbatches": 1}) for tp in (1, 2, 4)}
    for tp, trainer in compiled.items():
        (head,) = [c for c in trainer._tp_split.reductions if c.name == "lm.transformer.wte.weight"]
        assert (head.k, head.leaves) == (256, 4), tp
    ref = _run(compiled[1].with_plan(), batches)
    _assert_close(ref, torch_adamw(model, batches, ADAMW[1]))
    plans = {"tp2": compiled[2].with_plan(), "tp4": compiled[4].with_plan(),
             "tp2 pp2 mb2": compiled[2].with_plan(pp=2, microbatches=2)}
    for name, plan in plans.items():
        assert _same_bits(_run(plan, batches), ref), name
    split = compiled[4]._tp_split
    wte = 256 * 32 * 4
    assert split.sharded_bytes >= wte  # the head's rows are split over the ranks, not replicated
