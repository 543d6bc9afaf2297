"""The canonical order of a tensor-parallel reduction: one order of additions for every split.

A GEMM that reduces over a tensor-parallel sharded axis (a row-parallel projection's forward, a
column-parallel projection's input gradient) sums terms that live on different ranks. Megatron
all-reduces each rank's partial sum, so the additions, and the bits, depend on ``tp``. Here the
order is fixed by the model alone, batch-invariant-kernel style: the sharded axis is cut into
``leaves`` equal *leaves* (:func:`canonical_leaves`: a count every admissible ``tp`` divides, so
every split gives each rank whole, consecutive leaves), each leaf's partial sum is a GEMM from
zero over its ``k`` in ascending order, and the leaves' partial sums are added in ascending leaf
order into one accumulator: ``((l_0 + l_1) + l_2) + ...``. A fused projection of several parts
(GPT-2's ``c_attn``: Q, K and V, each split by heads) takes its leaf ``l`` as the ``l``-th slice
of every part, in part order (one GEMM from zero over the concatenated slices), so a rank's
leaves stay its own heads; so does the sum of separate projections' input gradients (Llama's
``q/k/v_proj``, parts of unequal widths, and ``gate/up_proj``), one reduction of their parts. The widths a model admits are one rule,
:func:`admissible_tp`, which the compiled step and the planner both apply; with more ranks than
key/value heads each head is replicated on ``tp / kv_heads`` ranks, the key/value leaves are
slices of a head's features, and the head's gradient is summed over its replicas' query heads in
one fixed order (:func:`group_sum`).

Every split computes exactly these additions (:func:`split_reduce` executes them rank by rank):
the ranks compute their leaves' GEMMs at once (the parallel ``1 / tp`` share of Megatron's
split), and the ordered sum of the leaves is a reduction over the ranks in rank order, pipelined
over row segments (the running sum of a segment enters rank ``r``, which adds its leaves to it
one by one and passes it on), or a *direct* reduce-scatter (every rank sends each row segment's
owner its leaves' partial sums, the owner adds them in leaf order). A rank never pre-adds its
leaves into one partial sum: that is the association Megatron's split changes with ``tp``. One
chip runs the same leaves and additions (:func:`canonical_matmul`), so parameters are bitwise
those of one chip under every TP x PP x DP split.

:func:`layer_reductions` lists one transformer block's reductions from its sizes (the GEMMs
:func:`~tvm_spinn.training.tensor_parallel.split_gemms` finds in a compiled GPT-2 or Llama
block); the planner prices each as the ranks' parallel GEMM shares, their leaf additions and a
fixed-order reduce-scatter (:class:`~tvm_spinn.training.planner._Comms`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .errors import TrainingError

__all__ = ["canonical_leaves", "admissible_tp", "kv_replicas", "group_sum", "vocab_leaves", "leaf_slices",
           "canonical_matmul", "split_reduce", "direct_reduce", "layer_reductions", "Reduction"]


def canonical_leaves(heads: int, kv_heads: int, intermediate: int, head_dim: int) -> tuple[int, int]:
    """``(leaves of the query-head and MLP axes, leaves of the query/key/value input gradient)``.

    A split ``tp`` must divide the attention heads and the MLP's hidden features, so it divides
    ``g = gcd(heads, intermediate)``: ``g`` leaves of either axis give every rank whole leaves
    under every admissible split. The query, key and value projections' input gradients are one
    reduction (leaf ``l``: the ``l``-th leaf of each), so the key/value features
    (``kv_heads * head_dim``) are cut into the same count: ``gcd(g, kv_heads * head_dim)``, at
    query-head granularity (``g`` itself for every model whose head size is a multiple of its
    query heads per key/value head). With more ranks than key/value heads a leaf of the
    key/value part is a slice of one head's features (:func:`admissible_tp`)."""
    for name, value in (("heads", heads), ("kv_heads", kv_heads), ("intermediate", intermediate),
                        ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise TrainingError(f"canonical_leaves: {name} must be a positive integer, got {value!r}")
    g = math.gcd(int(heads), int(intermediate))
    return g, math.gcd(g, int(kv_heads) * int(head_dim))


def admissible_tp(heads: int, kv_heads: int, intermediate: int, head_dim: int) -> list[int]:
    """The tensor-parallel widths a transformer block admits, in the compiled step and in the
    planner alike (one rule): ``tp`` divides every canonical leaf count
    (:func:`canonical_leaves`: so every rank owns whole leaves of every reduction) and either
    divides the key/value heads (each rank holds ``kv_heads / tp`` of them) or is a multiple of
    them (each key/value head replicated on ``tp / kv_heads`` consecutive ranks, Megatron's
    split of grouped-query attention: a rank's query heads all read its one key/value head)."""
    _, g_qkv = canonical_leaves(heads, kv_heads, intermediate, head_dim)
    return [t for t in range(1, g_qkv + 1) if g_qkv % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)]


def kv_replicas(kv_heads: int, tp: int) -> int:
    """Ranks holding each key/value head under ``tp`` (1 unless ``tp`` exceeds the heads)."""
    return tp // kv_heads if tp > kv_heads else 1


def group_sum(terms: np.ndarray, replicas: int) -> np.ndarray:
    """Execute a key/value head's gradient over its ``replicas`` ranks, rank by rank: ``terms``
    ``[..., n]`` holds the contributions of the head's ``n`` query heads (the last axis, in
    query-head order); replica ``j`` owns query heads ``j * n / replicas`` onwards, receives the
    running sum from replica ``j - 1`` (zeros at the first), adds its heads' terms one by one
    and passes it on. The additions are those of one chip's ``sum`` over the query heads
    (ascending, from zero), so the key/value projections' gradients have the one-chip bits for
    every ``tp``. Returns the sum (every replica's, after the chain's way back)."""
    terms = np.asarray(terms)
    n = terms.shape[-1]
    if replicas < 1 or n % replicas:
        raise TrainingError(f"canonical order: {replicas} replicas do not divide the {n} query heads of a key/value "
                            "head")
    running = np.zeros(terms.shape[:-1], terms.dtype)  # arrives at replica 0
    for j in range(replicas):
        for h in range(j * n // replicas, (j + 1) * n // replicas):
            running = running + terms[..., h]
    return running


#: fewest vocabulary rows a leaf of the LM head's canonical order takes
MIN_VOCAB_LEAF_ROWS = 64


def vocab_leaves(heads: int, intermediate: int, vocab: int) -> int:
    """Leaves of the vocabulary axis (a vocab-parallel LM head's input gradient and its loss'
    sums over the vocabulary): ``gcd(heads, intermediate)`` (every admissible ``tp``) doubled
    while a leaf keeps at least :data:`MIN_VOCAB_LEAF_ROWS` rows. A head stage's width must
    divide it (``tp`` times a power of two does, up to that count); the vocabulary is padded to a
    multiple of it (zero rows add nothing)."""
    leaves, _ = canonical_leaves(heads, heads, intermediate, 1)
    while 2 * leaves * MIN_VOCAB_LEAF_ROWS <= vocab:
        leaves *= 2
    return leaves


def leaf_slices(extent: int, leaves: int, parts=1) -> tuple:
    """The ``k`` ranges of each leaf of an axis of ``extent`` cut into ``parts`` (a count of
    equal parts, or the parts' extents in order: the summed input gradients of separate
    projections), each part cut into ``leaves``: ``((k0, k1), ...)`` per leaf, one range per
    part, in part order."""
    if isinstance(parts, (int, np.integer)):
        if parts < 1 or extent % parts:
            raise TrainingError(f"canonical order: {leaves} leaves do not divide the axis ({extent} features in "
                                f"{parts} part(s))")
        parts = (extent // parts,) * int(parts)
    parts = tuple(int(p) for p in parts)
    if sum(parts) != extent or any(p % leaves for p in parts):
        raise TrainingError(f"canonical order: {leaves} leaves do not divide the axis ({extent} features in "
                            f"{len(parts)} part(s): {', '.join(map(str, parts))})")
    starts = np.concatenate([[0], np.cumsum(parts)[:-1]]).astype(int).tolist()
    return tuple(tuple((s0 + l * (p // leaves), s0 + (l + 1) * (p // leaves)) for s0, p in zip(starts, parts))
                 for l in range(leaves))


def _leaf_gemm(a: np.ndarray, w: np.ndarray, ranges) -> np.ndarray:
    """One leaf's partial sum: a GEMM from zero over the leaf's ``k`` (its ranges in order), the
    simulator's fp32 GEMM kernel (ascending ``k``, rounding after every product and addition)."""
    from .. import _lib

    ak = np.ascontiguousarray(np.concatenate([a[:, k0:k1] for k0, k1 in ranges], axis=1))
    wk = np.ascontiguousarray(np.concatenate([w[k0:k1] for k0, k1 in ranges], axis=0))
    out = np.zeros((a.shape[0], w.shape[1]), np.float32)
    _lib.gemm_f32(ak, wk, out)
    return out


def _check(a: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, w = np.asarray(a), np.asarray(w)
    if a.ndim != 2 or w.ndim != 2 or a.shape[1] != w.shape[0]:
        raise TrainingError(f"canonical order: a {a.shape} @ w {w.shape} is not a GEMM ([M, K] @ [K, N])")
    if not a.dtype == w.dtype == np.float32:
        raise TrainingError(f"canonical order: float32 operands only, got {a.dtype}, {w.dtype}")
    return a, w


def canonical_matmul(a: np.ndarray, w: np.ndarray, leaves: int, parts: int = 1) -> np.ndarray:
    """``a @ w`` in the canonical order on one chip: the leaves' GEMMs from zero, added in leaf
    order (the bits every split of :func:`split_reduce` gives)."""
    a, w = _check(a, w)
    acc = None
    for ranges in leaf_slices(w.shape[0], leaves, parts):
        leaf = _leaf_gemm(a, w, ranges)
        acc = leaf if acc is None else acc + leaf  # float32 + float32: one IEEE rounding
    return acc


def _owners(leaves: int, tp: int) -> list[int]:
    if tp < 1 or leaves % tp:
        raise TrainingError(f"canonical order: tp={tp} does not divide the {leaves} leaves; tp may be "
                            f"{', '.join(str(d) for d in range(1, leaves + 1) if leaves % d == 0)}")
    return [l * tp // leaves for l in range(leaves)]


def split_reduce(a: np.ndarray, w: np.ndarray, leaves: int, tp: int, parts: int = 1, segments: int = 1) -> np.ndarray:
    """Execute the canonical reduction over ``tp`` ranks, rank by rank: each rank computes the
    partial sums of the leaves it owns (its ``k`` rows of ``w``, its columns of ``a``), without
    seeing any other rank's; then the rows, cut into ``segments`` segments, flow down the ranks
    in rank order, each rank adding its leaves to the arriving running sum one by one (the
    pipelined chain the planner prices). Returns the ``[M, N]`` sum (the last rank's)."""
    a, w = _check(a, w)
    owner = _owners(leaves, tp)
    slices = leaf_slices(w.shape[0], leaves, parts)
    # each rank's work, from its own operands only
    local = {r: [(l, _leaf_gemm(a, w, slices[l])) for l in range(leaves) if owner[l] == r] for r in range(tp)}
    rows = np.array_split(np.arange(a.shape[0]), segments)
    out = np.zeros((a.shape[0], w.shape[1]), np.float32)
    for seg in rows:
        running = None  # the segment's running sum, passed from rank to rank
        for r in range(tp):
            for _, leaf in local[r]:
                running = leaf[seg] if running is None else running + leaf[seg]
        out[seg] = running
    return out


def direct_reduce(a: np.ndarray, w: np.ndarray, leaves: int, tp: int, parts: int = 1,
                  log: "list | None" = None) -> list[np.ndarray]:
    """Execute the canonical reduction as a direct reduce-scatter over ``tp`` ranks: rank ``r``
    owns row block ``r`` of the result; every rank sends each owner its leaves' partial sums of
    the owner's rows (one message a leaf, not their sum), and the owner adds the pieces it
    receives in leaf order. Returns each rank's row block; ``log`` (a list) receives every
    message as ``(source rank, owner rank, leaf, bytes)``."""
    a, w = _check(a, w)
    owner = _owners(leaves, tp)
    slices = leaf_slices(w.shape[0], leaves, parts)
    local = {r: {l: _leaf_gemm(a, w, slices[l]) for l in range(leaves) if owner[l] == r} for r in range(tp)}
    blocks = np.array_split(np.arange(a.shape[0]), tp)
    out = []
    for r, rows in enumerate(blocks):
        inbox = sorted((l, local[src][l][rows]) for src in range(tp) for l in local[src])  # leaf order
        if log is not None:
            log.extend((src, r, l, local[src][l][rows].nbytes) for src in range(tp) for l in sorted(local[src]))
        acc = inbox[0][1]
        for _, piece in inbox[1:]:
            acc = acc + piece
        out.append(acc)
    return out


class Reduction(NamedTuple):
    """One reduction of a block: ``[m, k] @ [k, n]`` over the sharded ``k`` of ``parts`` parts,
    each cut into ``leaves`` leaves, in pass ``kind`` (``"forward"`` or ``"backward"``)."""

    kind: str
    m: int
    k: int
    n: int
    leaves: int
    parts: int = 1


def layer_reductions(family: str, hidden: int, q: int, kv: int, intermediate: int, m: int, heads: int,
                     kv_heads: int) -> tuple:
    """One transformer block's reductions over a sharded axis for ``m`` rows (every split's:
    the canonical order does not depend on ``tp``): the row-parallel projections' forwards
    (attention output, MLP down) and the column-parallel projections' input gradients. Llama's
    query, key and value input gradients are one reduction (their sum, leaf ``l`` one GEMM over
    the ``l``-th leaf of each, :func:`canonical_leaves`), and so are its gate's and up's: two a
    backward, as in Megatron's split.

    Parameters
    ----------
    family : {"gpt2", "llama"}
        GPT-2 (fused QKV ``c_attn``, ``c_fc``) or Llama (``q/k/v_proj``, ``gate/up_proj``).
    hidden, q, kv, intermediate : int
        The residual width, the queries' and the keys'/values' features (all heads), the MLP's
        hidden features.
    heads, kv_heads : int
        Attention and key/value heads (:func:`canonical_leaves`).
    """
    g, g_qkv = canonical_leaves(heads, kv_heads, intermediate, q // heads)
    h, i = hidden, intermediate
    forward = [Reduction("forward", m, q, h, g), Reduction("forward", m, i, h, g)]
    if family == "gpt2":
        backward = [Reduction("backward", m, q + 2 * kv, h, g, 3), Reduction("backward", m, i, h, g)]
    else:  # the separate projections' input gradients summed leaf by leaf (q, k, v: one count)
        backward = [Reduction("backward", m, q + 2 * kv, h, g_qkv, 3), Reduction("backward", m, 2 * i, h, g, 2)]
    return tuple(forward + backward)
