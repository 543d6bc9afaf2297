"""Sharding a program over a group of chips: tensor parallelism (Megatron split) and data parallelism.

A *shard plan* splits every layer of a program over ``tp x dp`` chips that all run the same
shard (which is what lets the timing model simulate one chip and multiply, see
:mod:`tvm_spinn.timing.system`):

- **Data parallelism** (``dp``): axis 0 of every activation whose leading extent is the
  program's batch is divided by ``dp``; weights are replicated.
- **Tensor parallelism** (``tp``): each activation is in one of three states on the ``tp`` chips,
  found by propagating through the layers in order:

  ``R`` replicated (every chip holds all of it), ``S(axis)`` split into ``tp`` equal blocks along
  ``axis``, ``P`` partial sums (every chip holds a full-size tensor that must be summed).

  A GEMM with a constant weight on an ``R`` input is *column-parallel* (weight split by output
  features, output ``S``); on an input split along its reduction axis it is *row-parallel*
  (weight split by input features, output ``P``); output features that ``tp`` does not divide
  are split unevenly (blocks of ``ceil(n / tp)``: the timing follows the largest block, the
  slowest chip). That is the Megatron split of a transformer
  block: Q/K/V and the first MLP GEMM column-parallel, the attention of the heads on each chip's
  heads (reshapes and transposes carry the split to the head axis, the score and context
  matmuls run per head), the output projection and the second MLP GEMM row-parallel, and one
  all-reduce where the partial sums meet the residual: one per attention block and one per
  MLP block. Convolutions split output channels, then input channels, the same way.
  Element-wise layers follow their operands' split (an ``R`` operand is sliced for free); row
  operators (softmax, layer norm, mean) keep a split that is not on their reduced axes; a
  split that cannot be carried is *all-gathered* to ``R``, partial sums are *all-reduced*.
  The program's outputs are made ``R``.

The plan is pure shape data: the functional program is unchanged, because every all-reduce of
floating-point partial sums is a *chain* reduction that continues one accumulator in ascending
``k`` from chip to chip (see :func:`tvm_spinn.timing.collectives.chain_all_reduce`), so the bits
are those of the one-chip program whatever ``tp`` is; integer partial sums are exact in any
order.

:func:`shard_program` builds the one-chip *shard program* (same layers, local tensor shapes)
that the one-chip mapper tiles, places and times.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from ..program import Program
from ..program.ops.rows import Rows

__all__ = ["Collective", "ShardPlan", "plan_shards", "shard_program", "ROW_ALWAYS"]

R, S, P = "R", "S", "P"
#: the rows family's kinds (softmax, layer_norm, rms_norm, mean): one row per output row
_ROW_KINDS = Rows.kinds


@dataclass(frozen=True)
class Collective:
    """A collective the shard plan needs before layer ``layer`` (``len(layers)``: at the end).

    ``nbytes`` is the full tensor (the gathered result, or one chip's full-size partial sums);
    ``exact``: integer partial sums (any reduction order gives the same bits).
    """

    layer: int
    op: str  # "all_reduce" | "all_gather"
    tensor: int
    nbytes: int
    exact: bool
    #: the chips taking part: ``"tp"`` a tensor-parallel group (one per sequence block),
    #: ``"sp"`` a sequence-parallel group (the chips holding the other row blocks), ``"all"``
    #: all ``tp x sp`` chips
    group: str = "tp"
    #: shape one chip holds after an all-gather (None: the full tensor)
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ShardPlan:
    """How one program is split over ``tp x dp`` chips (see the module docstring)."""

    tp: int
    dp: int
    row: bool | str                   # row-parallel GEMMs allowed (the Megatron split), or ROW_ALWAYS
    batch: int                        # the program's batch (axis 0 of its inputs)
    splits: tuple[str, ...]           # per layer: "col", "row", "split", "rep", "whole"
    collectives: tuple[Collective, ...]
    shapes: tuple[tuple[int, ...], ...]  # per tensor: the shape one chip holds
    sp: int = 1                       # sequence-parallel degree (row blocks, see _seq_pass)
    seq: tuple[bool, ...] = ()        # per layer: its output split into ``sp`` row blocks

    @property
    def chips(self) -> int:
        return self.tp * self.dp * self.sp

    def summary(self) -> dict:
        """JSON-ready summary (what the program's mapping records)."""
        counts: dict[str, int] = {}
        for s in self.splits:
            counts[s] = counts.get(s, 0) + 1
        ops: dict[str, int] = {}
        for c in self.collectives:
            ops[c.op] = ops.get(c.op, 0) + 1
        return {"tp": self.tp, "dp": self.dp, "sp": self.sp, "row": self.row, "chips": self.chips,
                "splits": counts, "collectives": ops}


def _acc_bytes(program: Program, layer) -> int:
    """Bytes per element of a GEMM's partial sums: the output's, or 4 (int32) for int8 GEMMs."""
    return 4 if layer.mode == "int8" else None


def _cache_inputs(program: Program, tp: int) -> dict[int, tuple[str, int]]:
    """Initial split of the inputs read only as the second operand of matmuls: a KV cache
    (K^T ``[b * kv_heads, head_dim, slots]``, V ``[b * kv_heads, slots, head_dim]``), state the
    chips keep between calls where this plan's attention reads it, each chip writing the slots
    (or heads) it holds. Split by the heads when ``tp`` divides them (no collective in the
    attention), else along the longer of the last two axes (the slots: scores split by slot,
    the distributed softmax below, the context matmul row-parallel)."""
    t = program.tensors
    users: dict[int, list] = {}
    for layer in program.layers:
        for pos, tid in enumerate(layer.inputs):
            users.setdefault(tid, []).append((layer.kind, pos))
    out = {}
    for tid in program.inputs:
        shape = list(t[tid].shape)
        use = users.get(tid, [])
        if t[tid].role == "const" or len(shape) < 3 or not use or any(u != ("matmul", 1) for u in use):
            continue
        lead = len(shape) - 3
        if shape[lead] % tp == 0 and shape[lead] >= tp:
            out[tid] = (S, lead)
            continue
        ax = len(shape) - 1 if shape[-1] >= shape[-2] else len(shape) - 2
        if shape[ax] >= tp:
            out[tid] = (S, ax)
    return out


def _row_pays(program: Program, layer, full, x: int) -> bool:
    """Whether a GEMM on an input split along its reduction axis runs row-parallel (its partial
    sums all-reduced) rather than all-gathering the input and running column-parallel: row
    unless the partial sums are larger than the input. The Megatron GEMMs that meet the residual
    (``h -> h``, ``4h -> h``) stay row-parallel, one all-reduce per block half; a GEMM that
    widens its input (Llama's gate and up projections, ``h -> 3.5 h``, int32 partial sums of an
    int8 input) gathers the input instead of all-reducing a result several times its size."""
    t = program.tensors
    out = layer.output
    numel = int(np.prod(full[out], dtype=np.int64))
    elem = _acc_bytes(program, layer) or max(1, t[out].nbytes // max(1, int(np.prod(t[out].shape, dtype=np.int64))))
    x_bytes = int(np.prod(full[x], dtype=np.int64)) * max(1, t[x].nbytes // max(1, int(np.prod(t[x].shape, dtype=np.int64))))
    return numel * elem <= x_bytes


def part(n: int, tp: int) -> int:
    """Extent one chip holds of an axis of ``n`` split ``tp`` ways: the largest block (uneven
    splits give the last chips one fewer; the timing follows the largest, the slowest chip)."""
    return -(-int(n) // tp)


def _reshape_axis(src: list[int], dst: list[int], axis: int, parts: int) -> int | None:
    """The axis of ``dst`` carrying a split of ``src``'s ``axis`` into ``parts`` blocks, or None.

    The blocks are contiguous in the flat layout: the split survives when some axis of ``dst``
    starts at the same flat stride position and its extent is a multiple of ``parts``, or is the
    same axis (same extent, same elements after it: an uneven split carries over unchanged).
    """
    before = int(np.prod(src[:axis], dtype=np.int64))
    acc = 1
    for j, d in enumerate(dst):
        if acc == before:
            if (d % parts == 0 and d >= parts) or d == src[axis] and int(np.prod(dst[j + 1:], dtype=np.int64)) \
                    == int(np.prod(src[axis + 1:], dtype=np.int64)):
                return j
            if d == 1:
                continue
            return None
        acc *= d
        if acc > before:
            return None
    return None


#: ``plan_shards(row=ROW_ALWAYS)``: every GEMM on a reduction-split input row-parallel
ROW_ALWAYS = "always"


def _reduction_inputs(program: Program) -> dict[int, int]:
    """``{input: axis}`` of the program inputs that reach only the reduction axis of weight
    GEMMs (``dense`` with a constant weight), through element-wise layers of their own shape
    (``quantize`` included): the inputs a :data:`ROW_ALWAYS` plan starts split along their last
    axis, so that those GEMMs run row-parallel. In a pipeline of stages this is what the
    previous stage's column-parallel output is: each chip keeps its share (a block's down
    projection cut into a stage of its own starts from the ``up * act(gate)`` product)."""
    t = program.tensors
    readers: dict[int, list] = {}
    for layer in program.layers:
        for tid in set(layer.inputs):
            readers.setdefault(tid, []).append(layer)
    special = {"dense", "conv2d", "matmul", "reshape", "permute_dims", "broadcast_to", *_ROW_KINDS,
               "max_pool2d", "avg_pool2d", "take", "strided_slice", "concat", "pad"}
    memo: dict[int, bool] = {}

    def feeds(tid: int) -> bool:
        if tid not in memo:
            memo[tid] = False  # no cycles in a program; a guard all the same
            users = readers.get(tid, [])
            shape = list(t[tid].shape)
            ok = bool(users) and tid not in program.outputs
            for layer in users:
                if layer.kind == "dense" and "weight" in layer.consts and layer.inputs[0] == tid \
                        and tid not in layer.inputs[1:]:
                    continue
                if layer.kind in special or list(t[layer.output].shape) != shape or not feeds(layer.output):
                    ok = False
                    break
            memo[tid] = ok
        return memo[tid]

    return {tid: len(t[tid].shape) - 1 for tid in program.inputs
            if t[tid].role != "const" and len(t[tid].shape) >= 1 and feeds(tid)}


def plan_shards(program: Program, tp: int, dp: int = 1, row: bool | str = True, sp: int = 1) -> ShardPlan | None:
    """The shard plan of ``program`` on ``tp x dp x sp`` chips, or None when ``dp`` does not
    divide the batch or ``sp`` splits nothing (see the module docstring). ``row=False``: no
    row-parallel GEMMs (an input split along the reduction axis is all-gathered and the GEMM is
    column-parallel again), which trades each all-reduce for an all-gather; the mapper costs
    both. ``row=ROW_ALWAYS`` (``"always"``): every GEMM on an input split along its reduction
    axis runs row-parallel, even where its partial sums are larger than that input, and the
    program inputs that reach only weight GEMMs' reduction axes (:func:`_reduction_inputs`)
    start split: each chip then holds ``k / tp`` rows of the weight instead of ``n / tp``
    columns of length ``k``, a finer unit to spread over its PEs' SRAM (the mapper tries it
    when the chosen plan streams a weight GEMM). ``sp > 1``: each tensor-parallel group of
    ``tp`` chips holds one of ``sp`` blocks of rows (:func:`_seq_pass`); ``dp`` must then be 1."""
    if row not in (True, False, ROW_ALWAYS):
        raise ValueError(f"plan_shards: row must be True, False or {ROW_ALWAYS!r}, got {row!r}")
    if sp > 1 and dp > 1:
        raise ValueError(f"plan_shards: sequence parallelism (sp={sp}) with data parallelism (dp={dp}) is not supported")
    t = program.tensors
    # the batch: the leading extent every activation input shares (none: no data parallelism)
    leads = {t[tid].shape[0] for tid in program.inputs if t[tid].role != "const" and len(t[tid].shape) >= 2}
    batch = leads.pop() if len(leads) == 1 else None
    if dp > 1 and (not batch or batch % dp):
        return None
    state: dict[int, tuple[str, int]] = {tid: (R, -1) for tid in program.inputs}
    collectives: list[Collective] = []
    splits: list[str] = []
    full = [list(x.shape) for x in t]
    local = [list(x.shape) for x in t]
    if tp > 1:
        for tid, (kind, ax) in _cache_inputs(program, tp).items():
            state[tid] = (kind, ax)
            local[tid][ax] = part(local[tid][ax], tp)
        if row == ROW_ALWAYS:
            for tid, ax in _reduction_inputs(program).items():
                if state[tid][0] == R and full[tid][ax] >= tp:
                    state[tid] = (S, ax)
                    local[tid][ax] = part(local[tid][ax], tp)

    def nbytes(tid, elem=None):
        return int(np.prod(full[tid], dtype=np.int64)) * (elem or max(1, t[tid].nbytes // max(1, int(np.prod(full[tid], dtype=np.int64)))))

    def gather(i, tid):
        kind, _ = state.get(tid, (R, -1))
        if kind == S:
            collectives.append(Collective(i, "all_gather", tid, nbytes(tid), True))
        elif kind == P:
            collectives.append(Collective(i, "all_reduce", tid, state_bytes[tid], exact_of[tid]))
        state[tid] = (R, -1)

    state_bytes: dict[int, int] = {}
    exact_of: dict[int, bool] = {}
    produced: dict[int, tuple[str, int]] = {}
    for i, layer in enumerate(program.layers):
        acts = [tid for tid in layer.inputs if t[tid].role != "const"]
        out = layer.output
        rank = len(full[out])
        split, result = "rep", (R, -1)
        if tp > 1:
            for tid in acts:
                if state.get(tid, (R, -1))[0] == P and layer.kind not in ("reshape", "permute_dims"):
                    gather(i, tid)
            st = [state.get(tid, (R, -1)) for tid in acts]
            kind = layer.kind
            if kind == "dense" or (kind == "conv2d" and layer.attrs.get("groups", 1) == 1):
                ax = rank - 1 if kind == "dense" else 1
                k_axis = len(full[acts[0]]) - 1 if kind == "dense" else 1
                s = st[0]
                n_out = full[out][ax]
                if s[0] == S and s[1] == k_axis and row and (row == ROW_ALWAYS or _row_pays(program, layer, full, acts[0])):
                    split, result = "row", (P, -1)
                elif n_out >= tp:  # uneven: the last chips get a column fewer
                    gather(i, acts[0])
                    split, result = "col", (S, ax)
                else:
                    gather(i, acts[0])
            elif kind == "conv2d":  # grouped / depthwise: channels split with their groups
                if layer.attrs["groups"] % tp == 0 and (st[0][0] != S or st[0] == (S, 1)):
                    split, result = "split", (S, 1)  # an R input is sliced for free
                else:
                    gather(i, acts[0])
            elif kind == "matmul" and len(acts) == 2:
                a, b = (st[0][0], st[0][1] - len(full[acts[0]])), (st[1][0], st[1][1] - len(full[acts[1]]))
                m_ext = full[out][-2] if rank >= 2 else 1
                if a[0] == S and b[0] == S and a[1] == b[1] and a[1] <= -3:
                    split, result = "split", (S, rank + a[1])
                elif a[0] == S and a[1] <= -3 and b[0] == R and len(full[acts[1]]) >= -a[1] \
                        and full[acts[1]][a[1]] == full[acts[0]][a[1]]:
                    split, result = "split", (S, rank + a[1])
                elif b[0] == S and b[1] <= -3 and a[0] == R and len(full[acts[0]]) >= -b[1] \
                        and full[acts[0]][b[1]] == full[acts[1]][b[1]]:
                    split, result = "split", (S, rank + b[1])
                elif a[0] == S and a[1] == -2 and b[0] == R:
                    split, result = "split", (S, rank - 2)
                elif a[0] == R and b[0] == S and b[1] == -1:
                    split, result = "split", (S, rank - 1)
                elif a[0] == S and a[1] == -1 and b[0] == S and b[1] == -2 and row \
                        and (row == ROW_ALWAYS or _row_pays(program, layer, full, acts[0])):
                    split, result = "row", (P, -1)
                else:
                    for tid in acts:
                        gather(i, tid)
                    # R operands are sliced for free: split the outermost batch axis both
                    # operands share (the heads), else the rows
                    lead = [j for j in range(rank - 2) if full[out][j] % tp == 0 and full[out][j] >= tp
                            and all(len(full[tid]) >= rank - j and full[tid][j - rank] == full[out][j]
                                    for tid in acts)]
                    if lead:
                        split, result = "split", (S, lead[0])
                    elif m_ext % tp == 0 and m_ext >= tp:
                        split, result = "split", (S, rank - 2)
            elif kind in ("reshape", "permute_dims", "broadcast_to"):
                s = st[0] if st else (R, -1)
                src = full[acts[0]] if acts else []
                if s[0] == P and kind in ("reshape", "permute_dims"):
                    split, result = "split", (P, -1)
                elif s[0] == S:
                    if kind == "reshape":
                        ax = _reshape_axis(src, full[out], s[1], tp)
                    elif kind == "permute_dims":
                        ax = list(layer.attrs["axes"]).index(s[1])
                    else:
                        ax = s[1] + rank - len(src)
                    if ax is None:
                        gather(i, acts[0])
                    else:
                        split, result = "split", (S, ax)
            elif kind in _ROW_KINDS:
                s = st[0]
                src = full[acts[0]]
                rows = int(np.prod(full[out], dtype=np.int64))
                width = int(np.prod(src, dtype=np.int64)) // max(1, rows) if kind == "mean" else src[-1]
                reduced, acc = len(src), 1
                while reduced > 0 and acc < width:
                    reduced -= 1
                    acc *= src[reduced]
                if s[0] == S and s[1] < reduced:
                    split, result = "split", (S, s[1])  # leading axes keep their index
                elif s[0] == S and kind == "softmax" and s[1] == len(src) - 1 and src[-1] >= tp:
                    # Rows split along the reduced axis (attention over KV-cache slots spread
                    # over the chips): each chip keeps its slice. The row maxima are
                    # all-reduced (exact in any order), then the sums of exp(x - max) by the
                    # chain that continues one accumulator from chip to chip in slot order:
                    # the one-chip kernel's sequential left-to-right sum, the same bits.
                    n_rows = rows // max(1, src[-1])
                    collectives.append(Collective(i, "all_reduce", acts[0], n_rows * 4, True))
                    collectives.append(Collective(i, "all_reduce", acts[0], n_rows * 4, False))
                    split, result = "split", (S, s[1])
                elif s[0] == S:
                    gather(i, acts[0])
            elif kind in ("max_pool2d", "avg_pool2d"):
                if st[0] == (S, 1):
                    split, result = "split", (S, 1)
                elif st[0][0] == S:
                    gather(i, acts[0])
            else:  # element-wise and quantize/dequantize: follow the operands' common split
                axes = {(s[1] - len(full[tid])) for tid, s in zip(acts, st) if s[0] == S}
                ax = axes.pop() if len(axes) == 1 else None
                ok = ax is not None and rank >= -ax and all(
                    s[0] == S or len(full[tid]) < -ax or full[tid][ax] in (1, full[out][ax])
                    for tid, s in zip(acts, st))
                if ok:
                    split, result = "split", (S, rank + ax)
                else:
                    for tid in acts:
                        gather(i, tid)
        if result[0] == P:
            if split == "row":
                elem = _acc_bytes(program, layer) or max(1, t[out].nbytes // max(1, int(np.prod(full[out], dtype=np.int64))))
                state_bytes[out] = int(np.prod(full[out], dtype=np.int64)) * elem
                exact_of[out] = layer.mode == "int8"
            else:  # a reshape/transpose of partial sums stays partial
                src = acts[0]
                state_bytes[out], exact_of[out] = state_bytes[src], exact_of[src]
        state[out] = result
        produced[out] = result
        splits.append(split)
        # local shapes: the TP split, then the DP split of the batch axis
        shape = list(full[out])
        if result[0] == S:
            shape[result[1]] = part(shape[result[1]], tp)
        local[out] = shape
        if split in ("col", "row", "split"):
            _shard_consts(program, layer, split, tp, full, local, result)
    end = len(program.layers)
    for tid in program.outputs:
        if tp > 1:
            gather(end, tid)
    seq: tuple[bool, ...] = ()
    if sp > 1:
        tp_axis = {tid: ax for tid, (kind, ax) in produced.items() if kind == S}
        for tid, (kind, ax) in (_cache_inputs(program, tp).items() if tp > 1 else ()):
            tp_axis[tid] = ax
        merged = _seq_pass(program, sp, full, local, tp_axis, collectives)
        if merged is None:
            return None
        collectives, seq = merged
    return ShardPlan(tp=tp, dp=dp, row=row, batch=int(batch or 1), splits=tuple(splits),
                     collectives=tuple(collectives), shapes=tuple(tuple(s) for s in local), sp=sp, seq=seq)


def _seq_pass(program: Program, sp: int, full, local, tp_axis: dict[int, int], tp_colls: list):
    """Sequence parallelism: the second axis of a ``tp x sp`` mesh of chips.

    Each tensor is either replicated over the ``sp`` groups or split into ``sp`` blocks along
    one axis (its rows), propagated through the layers like the tensor-parallel states: a
    GEMM's rows are independent (a dense layer or a matmul on row-split ``A`` gives row-split
    output; ``R`` operands are sliced for free, so a GEMM on replicated inputs starts a split),
    element-wise layers follow their operands, row operators (softmax, layer norm) keep a split
    that is not on their reduced axes, reshapes and transposes carry it. What a layer cannot
    take split (the keys of attention, ``K^T``'s split columns, a reduction axis) is
    all-gathered over the ``sp`` group. So a transformer layer on ``tp x sp`` chips runs its
    LayerNorms on row blocks (no all-gather before them), its all-reduces over ``tp`` chips on
    ``1 / sp`` of the rows each, and its attention on heads x query-row blocks (each chip:
    ``softmax(Q_blk K^T) V`` for its heads and rows, after gathering its heads' keys over the
    ``sp`` group). Bits: every layer computes whole rows with the one-chip kernels, the
    reductions of rows never cross chips, so the functional program is unchanged.

    Updates ``local`` (the row blocks one chip holds) in place and returns ``(collectives,
    seq)``: the tensor-parallel ``tp_colls`` (a row-split tensor's collective moves ``1 / sp``
    of its bytes, in each of the ``sp`` groups at once) merged with the sequence-parallel
    all-gathers in issue order, and per layer whether its output is row-split; None when no
    layer splits.
    """
    t = program.tensors
    state: dict[int, int] = {}    # tid -> split axis (absent: replicated)
    produced: dict[int, int] = {}
    gathered_at: dict[int, int] = {}
    mine: list[tuple[int, int]] = []  # (layer, tensor) sequence-parallel all-gathers
    seq: list[bool] = []

    def gather(i, tid):
        if tid in state:
            mine.append((i, tid))
            gathered_at.setdefault(tid, i)
            del state[tid]

    def carried(src_shape, dst_shape, axis, kind, attrs):
        if kind == "reshape":
            return _reshape_axis(src_shape, dst_shape, axis, sp)
        if kind == "permute_dims":
            return list(attrs["axes"]).index(axis)
        return axis + len(dst_shape) - len(src_shape)  # broadcast_to: leading axes added

    for i, layer in enumerate(program.layers):
        acts = [tid for tid in layer.inputs if t[tid].role != "const"]
        out = layer.output
        shape = full[out]
        rank = len(shape)
        st = [state.get(tid) for tid in acts]
        kind = layer.kind
        res = None
        rows = rank - 2 if rank >= 2 and shape[rank - 2] >= sp else None  # R operands: sliced for free
        if kind == "dense":
            if st[0] is not None and st[0] == len(full[acts[0]]) - 1:
                gather(i, acts[0])  # split along the reduction axis
            res = state.get(acts[0], rows)
        elif kind == "matmul" and len(acts) == 2:
            a, b = acts
            sa = None if st[0] is None else st[0] - len(full[a])
            sb = None if st[1] is None else st[1] - len(full[b])
            if sa == -1:
                gather(i, a)
                sa = None
            if sb == -2:
                gather(i, b)
                sb = None
            if sa is not None and sa <= -3 and (sb == sa or (sb is None and len(full[b]) >= -sa
                                                              and full[b][sa] == full[a][sa])):
                res = rank + sa  # a batch axis (heads) both operands share
            elif sa is None and sb == -1:
                res = rank - 1  # the columns of B
            else:
                if sa is not None and sa != -2:
                    gather(i, a)
                if sb is not None:
                    gather(i, b)  # the keys: every query row block needs all of them
                res = rank - 2 if shape[rank - 2] >= sp else None
        elif kind in ("reshape", "permute_dims", "broadcast_to"):
            if acts and st[0] is not None:
                res = carried(full[acts[0]], shape, st[0], kind, layer.attrs)
            elif kind == "broadcast_to" and acts and rank - 2 >= len(shape) - len(full[acts[0]]):
                res = rows  # a copy of replicated rows (attention probabilities for the context
                # matmul): each block copies its own rows, not all of them on every chip
        elif kind in _ROW_KINDS:
            src = full[acts[0]]
            n_rows = int(np.prod(shape, dtype=np.int64))
            width = int(np.prod(src, dtype=np.int64)) // max(1, n_rows) if kind == "mean" else src[-1]
            reduced, acc = len(src), 1
            while reduced > 0 and acc < width:
                reduced -= 1
                acc *= src[reduced]
            if st[0] is not None and st[0] < reduced:
                res = st[0]
        elif kind == "take":
            if all(s is None for s in st) and layer.attrs.get("axis", 0) == 0 and rank >= 2 and shape[0] >= sp:
                res = 0  # the indices' rows: each block gathers its own
        elif kind in ("conv2d", "max_pool2d", "avg_pool2d", "strided_slice", "concat", "pad"):
            res = None
        else:  # element-wise, quantize/dequantize: follow the operands' common split
            axes = {s - len(full[tid]) for tid, s in zip(acts, st) if s is not None}
            ax = axes.pop() if len(axes) == 1 else None
            if ax is not None and rank >= -ax and all(
                    s is not None or len(full[tid]) < -ax or full[tid][ax] in (1, shape[ax])
                    for tid, s in zip(acts, st)):
                res = rank + ax
        if res is not None and (res < 0 or res >= rank or shape[res] < sp or tp_axis.get(out) == res):
            res = None  # too short, or the tensor-parallel split's axis
        if res is None:
            for tid in acts:
                gather(i, tid)
        else:
            state[out] = produced[out] = res
            local[out][res] = part(full[out][res], sp)
            _seq_consts(program, layer, res, sp, full, local)
        seq.append(res is not None)
    end = len(program.layers)
    for tid in program.outputs:
        gather(end, tid)
    if not any(seq):
        return None

    def elem(tid):
        return max(1, t[tid].nbytes // max(1, int(np.prod(t[tid].shape, dtype=np.int64))))

    def tp_split(tid, i):  # still split over the tp group when layer i's sp gathers run
        return tid in tp_axis and tp_gather.get(tid, end + 1) > i

    def sp_split(tid, i):  # still row-split when layer i's tp collectives run (they go first)
        return tid in produced and gathered_at.get(tid, end + 1) >= i

    tp_gather = {}
    for c in tp_colls:
        if c.op == "all_gather":
            tp_gather.setdefault(c.tensor, c.layer)
    out: list[tuple[int, int, Collective]] = []
    for c in tp_colls:
        shape = list(full[c.tensor])
        nbytes = c.nbytes
        if sp_split(c.tensor, c.layer):
            ax = produced[c.tensor]
            shape[ax] = part(shape[ax], sp)
            nbytes = -(-nbytes // sp)
        out.append((c.layer, 0, Collective(c.layer, c.op, c.tensor, nbytes, c.exact, "tp",
                                           tuple(shape) if c.op == "all_gather" else None)))
    for i, tid in mine:
        shape = list(full[tid])
        n = int(np.prod(shape, dtype=np.int64)) * elem(tid)
        if tp_split(tid, i):
            ax = tp_axis[tid]
            shape[ax] = local[tid][ax]
            n = int(np.prod(shape, dtype=np.int64)) * elem(tid)
        out.append((i, 1, Collective(i, "all_gather", tid, n, True, "sp", tuple(shape))))
    # The program's outputs leave whole (the next program reads them replicated): a tensor
    # gathered over both groups at the end, or over the sp group only (each chip of a tp group
    # holds the same row block, so each can send a different part of it), is one all-gather
    # over all the tp x sp chips along one ring, not two rounds over strided groups.
    final = {}
    for layer, order, c in out:
        if layer >= end and c.op == "all_gather":
            final.setdefault(c.tensor, []).append(c)
    out = [x for x in out if not (x[0] >= end and x[2].tensor in final)]
    for tid in final:
        n = int(np.prod(full[tid], dtype=np.int64)) * elem(tid)
        out.append((end, 2, Collective(end, "all_gather", tid, n, True, "all", None)))
    out.sort(key=lambda x: (x[0], x[1]))
    return [c for _, _, c in out], tuple(seq)


def _seq_consts(program: Program, layer, axis: int, sp: int, full, local) -> None:
    """Shrink the constants of a row-split element-wise layer along the split (a position
    embedding added to row blocks); GEMM weights and per-feature constants are not on it."""
    if layer.kind in ("dense", "conv2d", "matmul", "take", *_ROW_KINDS):
        return
    t = program.tensors
    out_shape = full[layer.output]
    rel = axis - len(out_shape)
    for tid in list(layer.consts.values()) + [tid for tid in layer.inputs if t[tid].role == "const"]:
        shape = local[tid]
        if len(shape) >= -rel and full[tid][rel] == out_shape[axis] and out_shape[axis] > 1:
            shape[rel] = part(full[tid][rel], sp)


def _shard_consts(program: Program, layer, split: str, tp: int, full, local, result) -> None:
    """Shrink the constants one chip holds for a split layer."""
    t = program.tensors
    consts = list(layer.consts.values()) + [tid for tid in layer.inputs if t[tid].role == "const"]
    out_shape = full[layer.output]
    for tid in consts:
        shape = list(full[tid])
        if not shape:
            continue
        if layer.kind == "dense" and tid == layer.consts.get("weight"):
            shape[1 if split == "col" else 0] = part(shape[1 if split == "col" else 0], tp)
        elif layer.kind == "conv2d" and tid == layer.consts.get("weight"):
            k = 0 if split in ("col", "split") else 1
            shape[k] = part(shape[k], tp)
        elif split in ("col", "split") and result[0] == S:
            # per-output-channel constants (bias, scales) and broadcast operands along the split
            ax = result[1] - len(out_shape)
            if len(shape) >= -ax and shape[ax] == out_shape[result[1]]:
                shape[ax] = part(shape[ax], tp)
            elif len(shape) == 1 and shape[0] == out_shape[result[1]]:
                shape[0] = part(shape[0], tp)
        local[tid] = shape


def shard_program(program: Program, plan: ShardPlan) -> Program:
    """The program one chip of the group runs: the same layers over the plan's local shapes.

    A tensor all-gathered before layer ``i`` is a new full-size tensor that layers ``i`` and
    later read (the producer still writes only its block). Axis 0 of the activations that hold
    the batch is divided by ``dp``. Timing-only: constants are not sliced (the one-chip mapper
    reads shapes, never values).
    """
    shard = copy.copy(program)
    shard.tensors = [copy.copy(x) for x in program.tensors]
    for x, shape in zip(shard.tensors, plan.shapes):
        x.shape = list(shape)
    shard.layers = [copy.copy(layer) for layer in program.layers]
    for layer, split in zip(shard.layers, plan.splits):
        if layer.kind == "conv2d" and split == "split":  # grouped: each chip has its groups
            layer.attrs = dict(layer.attrs, groups=layer.attrs["groups"] // plan.tp)
    current: dict[int, int] = {}  # a tensor gathered twice (tp, then sp): its latest copy
    for c in plan.collectives:
        if c.op != "all_gather" or c.layer >= len(shard.layers):
            continue
        new = copy.copy(program.tensors[c.tensor])
        shape = c.shape if c.shape is not None else program.tensors[c.tensor].shape
        new.shape, new.role = list(shape), "temp"
        new.name = f"{new.name}.gathered"
        shard.tensors.append(new)
        nid = len(shard.tensors) - 1
        old = current.get(c.tensor, c.tensor)
        for layer in shard.layers[c.layer:]:
            if old in layer.inputs:
                layer.inputs = [nid if tid == old else tid for tid in layer.inputs]
        current[c.tensor] = nid
    if plan.dp > 1:
        for x in shard.tensors:
            if x.role != "const" and x.shape and x.shape[0] == plan.batch:
                x.shape[0] //= plan.dp
    shard.timing, shard.mapping, shard.memory, shard.tiles = {}, {}, {}, None
    return shard
