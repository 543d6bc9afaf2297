"""The vocabulary-parallel LM head and cross-entropy (Megatron's vocab-parallel loss), bits independent of the split.

Megatron-LM splits a language model's head over its tensor-parallel ranks by the vocabulary:
rank ``r`` holds a slice of the head's weight rows and computes that slice of the logits (a
column-parallel GEMM: every logit is a sum over the hidden features on one rank, exactly as on
one chip). Four things then combine across the ranks, each row's:

- the softmax's max: the ranks' maxima, an exact reduction in any order;
- the target logit ``z[t]``: a selection, held by the one rank owning the label's column;
- the sum of ``exp(z - max)``: Megatron all-reduces the ranks' partial sums, so its additions
  depend on the split. Here it is the chain the one-chip ``cross_entropy`` kernel computes, the
  exponentials added one by one in ascending class order from zero, run over the ranks in rank
  order: rank ``r`` receives a row's running sum from rank ``r - 1`` and adds its own classes'
  exponentials to it (computed at once on every rank, from the max), pipelined over the rows
  (:func:`split_cross_entropy` executes it rank by rank). Every split, one chip included, makes
  the same additions;
- the head's input gradient ``dZ @ W`` (``dZ`` the logits' gradient, ``W`` the head's
  ``[vocab, hidden]`` rows): each rank's product over its vocabulary rows, summed by Megatron in a
  split-dependent order. Here it takes the canonical order of the vocabulary's leaves
  (:func:`~tvm_spinn.training.tp_chain.vocab_leaves`, a count every admissible split divides;
  :func:`vocab_ranges`): each leaf a GEMM from zero over its rows, the leaves added in ascending
  order, rank ``r`` of ``tp`` owning leaves ``r * leaves / tp`` onwards
  (:func:`~tvm_spinn.training.tp_chain.split_reduce` executes it rank by rank).

The softmax's gradient ``(exp(z - max) / sum - onehot(t)) / rows`` is element-wise given the max
and the sum, each rank its own columns. So the loss, the head's gradients and the parameters
after any number of steps are bitwise the same for every vocabulary split, one chip included.

:func:`vocab_parallel` marks the head's weight a :class:`VocabShard` in the tensor-parallel
layout, so that :func:`~tvm_spinn.training.tensor_parallel.split_gemms` puts its input gradient
in the canonical order (and prices the logits' GEMM and the head's weight gradient as the ranks'
``1 / tp`` shares); every plan, one chip included, runs that program.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import tvm
from tvm import relax

from .errors import TrainingError
from .tensor_parallel import MLP_COLUMN, TPShard, _module
from .tp_chain import vocab_leaves

__all__ = ["VocabShard", "vocab_ranges", "vocab_parallel", "split_cross_entropy"]


def vocab_ranges(vocab: int, leaves: int) -> tuple[tuple[int, int], ...]:
    """The vocabulary's ``leaves`` leaves ``((v0, v1), ...)``: ``ceil(vocab / leaves)`` rows each,
    the last ones shorter or empty (a padded vocabulary's zero rows, which add nothing)."""
    for name, value in (("vocab", vocab), ("leaves", leaves)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise TrainingError(f"vocab_ranges: {name} must be a positive integer, got {value!r}")
    width = -(-int(vocab) // int(leaves))
    return tuple((min(l * width, vocab), min((l + 1) * width, vocab)) for l in range(leaves))


@dataclass(frozen=True)
class VocabShard(TPShard):
    """The LM head's weight, split by the vocabulary (``axis``: the weight's vocabulary axis,
    ``extent`` the vocabulary): its input gradient's leaves are :func:`vocab_ranges`."""

    vocabulary: ClassVar[bool] = True

    def leaf_ranges(self) -> tuple:
        return tuple(((a, b),) for a, b in vocab_ranges(self.extent, self.leaves) if b > a)

    def rank_leaf_ranges(self, rank: int, tp: int) -> tuple:
        own = vocab_ranges(self.extent, self.leaves)[rank * self.leaves // tp:(rank + 1) * self.leaves // tp]
        return tuple(((a, b),) for a, b in own if b > a)


def _is(value, name: str) -> bool:
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == name


def _head(func: relax.Function, param_vars) -> tuple[int, int, int] | None:
    """``(parameter index, vocabulary axis, vocabulary)`` of the head weight whose GEMM gives the
    logits the loss' ``log_softmax`` reads (through reshapes), or None (no such loss)."""
    bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    index = {v: i for i, v in enumerate(param_vars)}
    for value in bindings.values():
        if not _is(value, "relax.nn.log_softmax"):
            continue
        z = value.args[0]
        while z in bindings and _is(bindings[z], "relax.reshape"):
            z = bindings[z].args[0]
        gemm = bindings.get(z)
        if not _is(gemm, "relax.matmul"):
            return None
        w, transposed = gemm.args[1], False
        if w in bindings and _is(bindings[w], "relax.permute_dims"):
            axes = bindings[w].attrs.axes
            if axes is not None and [int(a) for a in axes] != [1, 0]:
                return None
            w, transposed = bindings[w].args[0], True
        if w not in index or len(w.ty.shape) != 2:
            return None
        axis = 0 if transposed else 1  # the logits' axis: the weight's output features
        return index[w], axis, int(w.ty.shape[axis])
    return None


def vocab_parallel(grad_mod: tvm.IRModule, n_inputs: int, param_names, layout, model) -> tuple:
    """The tensor-parallel ``layout`` (one entry a parameter, named by ``param_names``) with the LM
    head's weight a :class:`VocabShard`: the weight whose GEMM gives the logits the
    cross-entropy's ``log_softmax`` reads in the gradient program ``grad_mod``
    (``main(inputs, params, targets)``), its leaves :func:`~tvm_spinn.training.tp_chain.vocab_leaves`
    of the model's attention heads and MLP features. Unchanged where the program has no such loss,
    or the head's weight is already split (a projection of a block).

    Raises
    ------
    TrainingError
        When the model names no attention heads (the leaves are counted from them).
    """
    func = grad_mod["main"]
    params = list(func.params)[n_inputs:n_inputs + len(layout)]
    head = _head(func, params)
    if head is None or layout[head[0]] is not None:
        return layout
    i, axis, vocab = head
    from .model_axes import model_axes

    heads = model_axes(model).heads
    mlp = [s.extent for s in layout if s is not None and s.kind == "column" and _module(s) in MLP_COLUMN]
    leaves = vocab_leaves(heads, math.gcd(*mlp) if mlp else heads, vocab)
    shard = VocabShard(param_names[i], "column", axis, vocab, leaves=leaves)
    return tuple(shard if k == i else s for k, s in enumerate(layout))


def _rank_columns(classes: int, tp: int) -> list[tuple[int, int]]:
    """Rank ``r``'s columns of the logits: ``np.array_split``'s blocks (any split of the classes
    into ``tp`` consecutive runs gives the same bits; this one is Megatron's, up to the remainder)."""
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or not 1 <= tp <= classes:
        raise TrainingError(f"vocabulary split: tp must be an integer in [1, {classes}] (the classes), got {tp!r}")
    bounds = np.cumsum([0] + [len(b) for b in np.array_split(np.arange(classes), int(tp))])
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def split_cross_entropy(z: np.ndarray, labels: np.ndarray, tp: int, divisor: float) -> tuple[np.ndarray, np.ndarray]:
    """Execute the cross-entropy and its gradient over ``tp`` ranks, rank by rank: rank ``r``
    holds columns ``r`` of the logits ``z`` [rows, classes] (consecutive runs, in rank order) and
    sees no other rank's; the ranks' maxima are combined (exact), each rank computes its
    exponentials ``exp(z - max)`` with the exp/log unit's model, a row's running sum passes the
    ranks in rank order, each adding its exponentials one by one, the label's owner contributes
    ``z[t]``, and each rank computes its columns of ``(exp(z - max) / sum - onehot(t)) / divisor``.
    Returns ``(per-row losses, gradient)``: the ``cross_entropy`` and ``cross_entropy_backward``
    layers' bits for every ``tp`` (labels in ``[0, classes)``, no NaN logits)."""
    from .. import _lib

    def unit(name: str, x) -> np.ndarray:
        # the exp/log unit's model, the kernels' (one fixed algorithm on every host); the same
        # call as program.ops.elementwise's, which training may not import (tests/test_layering.py)
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        _lib._func(name)(_lib._input(x), out)
        return out

    z = np.ascontiguousarray(z, dtype=np.float32)
    labels = np.asarray(labels)
    if z.ndim != 2 or labels.shape != (z.shape[0],):
        raise TrainingError(f"vocabulary split: logits {z.shape} and labels {labels.shape} (need [rows, classes] "
                            "and [rows])")
    if labels.size and (labels.min() < 0 or labels.max() >= z.shape[1]):
        raise TrainingError(f"vocabulary split: labels must lie in [0, {z.shape[1]})")
    cols = _rank_columns(z.shape[1], tp)
    # each rank from its own columns: its maxima, then (after the exact max reduction) its exps
    m = np.max(np.stack([z[:, a:b].max(axis=1) for a, b in cols]), axis=0)
    exps = [unit("tvm_spinn.sim.exp_f32", z[:, a:b] - m[:, None]) for a, b in cols]
    s = np.zeros(z.shape[0], np.float32)
    for e in exps:  # the running sum passes the ranks in rank order
        for j in range(e.shape[1]):
            s = s + e[:, j]
    target = np.empty(z.shape[0], np.float32)
    for (a, b) in cols:  # the label's owner contributes the target logit
        mine = (labels >= a) & (labels < b)
        target[mine] = z[mine, labels[mine]]
    log_s = unit("tvm_spinn.sim.log_f32", s)
    loss = log_s - (target - m)
    grad = np.empty_like(z)
    d = np.float32(divisor)
    for (a, b), e in zip(cols, exps):
        hot = (labels[:, None] == np.arange(a, b)[None, :]).astype(np.float32)
        grad[:, a:b] = (e / s[:, None] - hot) / d
    return loss, grad
