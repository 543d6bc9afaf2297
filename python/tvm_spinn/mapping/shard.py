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
  The program's outputs are made ``R``. A layer whose family states no rule runs replicated
  (its inputs gathered), which is right for any operator; the plan names those layers and why
  (:attr:`ShardPlan.replicated`, in the program's ``mapping["system"]`` and the report).

  What each layer does is its operator family's :class:`~tvm_spinn.program.ops.sharding.
  ShardingRule` (the propagator never looks at a layer's kind): the mesh is data, one
  :class:`~tvm_spinn.program.ops.sharding.MeshAxis` per parallel axis, and one pass
  (:func:`_propagate`) runs the rules over each axis in turn.

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
from ..program.ops import family_of
from ..program.ops.sharding import (REPLICATE, ROW_ALWAYS, MeshAxis, Placement, RowAllReduce, ShardContext,
                                    ShardDecision, ShardingRule, part, shard)

__all__ = ["Collective", "ShardPlan", "plan_shards", "shard_program", "ROW_ALWAYS", "part", "rule_of",
           "no_rule_reason"]

class _Replicated(ShardingRule):
    """The rule of a family that states none: its layers run whole on every chip (their inputs
    gathered first), which is right for any operator; splitting it like an element-wise layer
    would silently assume its output element ``e`` reads only element ``e`` of its inputs."""

    def propagate(self, ctx, layer, ins):
        return ShardDecision(REPLICATE, "rep", gather_all=True)


_FALLBACK = _Replicated()


def rule_of(layer) -> ShardingRule:
    """The sharding rule of ``layer``'s family (the replicating fallback where it states none)."""
    family = family_of(layer.kind)
    rule = family.sharding if family is not None else None
    return rule if rule is not None else _FALLBACK


def no_rule_reason(layer) -> str | None:
    """Why ``layer`` runs replicated whatever its inputs' placements (its family states no
    sharding rule), or None where its family has one."""
    family = family_of(layer.kind)
    if family is None:
        return f"layer kind {layer.kind!r} has no operator family"
    if family.sharding is None:
        return f"operator family {type(family).__name__} states no sharding rule"
    return None


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
    #: ``(layer name, reason)`` of the layers replicated because their family states no
    #: sharding rule (only on a mesh of more than one chip along ``tp`` or ``sp``)
    replicated: tuple[tuple[str, str], ...] = ()

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
        out = {"tp": self.tp, "dp": self.dp, "sp": self.sp, "row": self.row, "chips": self.chips,
               "splits": counts, "collectives": ops}
        if self.replicated:
            out["replicated"] = [list(x) for x in self.replicated]
        return out



def _acc_bytes(program: Program, layer) -> int:
    """Bytes per element of a GEMM's partial sums: the output's, or 4 (int32) for int8 GEMMs."""
    return 4 if layer.mode == "int8" else None


def _cache_inputs(program: Program, tp: int) -> dict[int, tuple[str, int]]:
    """Initial split of the inputs read only as a KV cache (the operands the readers' families
    call cache operands: K^T ``[b * kv_heads, head_dim, slots]``, V ``[b * kv_heads, slots,
    head_dim]`` of attention's matmuls), state the chips keep between calls where this plan's
    attention reads it, each chip writing the slots (or heads) it holds. Split by the heads when
    ``tp`` divides them (no collective in the attention), else along the longer of the last two
    axes (the slots: scores split by slot, the distributed softmax, the context matmul
    row-parallel)."""
    t = program.tensors
    users: dict[int, list] = {}
    for layer in program.layers:
        for pos, tid in enumerate(layer.inputs):
            users.setdefault(tid, []).append((layer, pos))
    out = {}
    for tid in program.inputs:
        shape = list(t[tid].shape)
        use = users.get(tid, [])
        if t[tid].role == "const" or len(shape) < 3 or not use \
                or not all(rule_of(layer).cache_operand(layer, pos) for layer, pos in use):
            continue
        lead = len(shape) - 3
        if shape[lead] % tp == 0 and shape[lead] >= tp:
            out[tid] = ("S", lead)
            continue
        ax = len(shape) - 1 if shape[-1] >= shape[-2] else len(shape) - 2
        if shape[ax] >= tp:
            out[tid] = ("S", ax)
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


def _reduction_inputs(program: Program) -> dict[int, int]:
    """``{input: axis}`` of the program inputs that reach only the reduction axis of weight
    GEMMs (their families' :meth:`~ShardingRule.reduction_reader`), through layers that pass a
    reduction split unchanged in shape (:meth:`~ShardingRule.passes_reduction`, quantize
    included): the inputs a :data:`ROW_ALWAYS` plan starts split along their last axis, so that
    those GEMMs run row-parallel. In a pipeline of stages this is what the previous stage's
    column-parallel output is: each chip keeps its share (a block's down projection cut into a
    stage of its own starts from the ``up * act(gate)`` product)."""
    t = program.tensors
    readers: dict[int, list] = {}
    for layer in program.layers:
        for tid in set(layer.inputs):
            readers.setdefault(tid, []).append(layer)
    memo: dict[int, bool] = {}

    def feeds(tid: int) -> bool:
        if tid not in memo:
            memo[tid] = False  # no cycles in a program; a guard all the same
            users = readers.get(tid, [])
            shape = list(t[tid].shape)
            ok = bool(users) and tid not in program.outputs
            for layer in users:
                rule = rule_of(layer)
                if rule.reduction_reader(program, layer, tid):
                    continue
                if not rule.passes_reduction(program, layer) or list(t[layer.output].shape) != shape \
                        or not feeds(layer.output):
                    ok = False
                    break
            memo[tid] = ok
        return memo[tid]

    return {tid: len(t[tid].shape) - 1 for tid in program.inputs
            if t[tid].role != "const" and len(t[tid].shape) >= 1 and feeds(tid)}


def _propagate(program: Program, axis: MeshAxis, full, local, state: dict, other: dict[int, int],
               consts) -> tuple[list, list, dict]:
    """One pass of placements over the layers on mesh axis ``axis``: every layer's family rule
    (:func:`rule_of`) places its output from its inputs' placements; the pass applies the
    rule's gathers and per-row all-reduces, keeps partial sums' bytes, writes the local shapes
    (``local``, in place) and shrinks constants with ``consts(layer, decision, output placement)``.

    ``state``: the initial placements (updated in place); ``other``: ``{tensor: axis}`` split by
    an earlier mesh axis (a strict axis does not split the same tensor axis). Returns
    ``(events, splits, produced)``: ``(layer, op, tensor, nbytes, exact)`` collectives in issue
    order (``len(layers)``: the program's outputs, made replicated at the end), per layer what
    it does, and ``{tensor: placement}`` of every split output.
    """
    t = program.tensors
    n = axis.size
    ctx = ShardContext(program, full, axis, lambda layer, x: _row_pays(program, layer, full, x))
    events: list = []
    splits: list[str] = []
    produced: dict[int, Placement] = {}
    part_bytes: dict[int, int] = {}
    part_exact: dict[int, bool] = {}

    def nbytes(tid):
        numel = int(np.prod(full[tid], dtype=np.int64))
        return numel * max(1, t[tid].nbytes // max(1, numel))

    def gather(i, tid):
        s = state.get(tid, REPLICATE)
        if s.split:
            events.append((i, "all_gather", tid, nbytes(tid), True))
        elif s.partial:
            events.append((i, "all_reduce", tid, part_bytes[tid], part_exact[tid]))
        state.pop(tid, None)

    for i, layer in enumerate(program.layers):
        rule = rule_of(layer)
        acts = [tid for tid in layer.inputs if t[tid].role != "const"]
        out = layer.output
        rank = len(full[out])
        if not rule.accepts_partial(layer):
            for tid in acts:
                if state.get(tid, REPLICATE).partial:
                    gather(i, tid)
        d = rule.propagate(ctx, layer, [state.get(tid, REPLICATE) for tid in acts])
        for action in d.before:
            if isinstance(action, RowAllReduce):
                events.append((i, "all_reduce", acts[action.pos], action.nbytes, action.exact))
            else:
                gather(i, acts[action.pos])
        if d.gather_all:
            for tid in acts:
                gather(i, tid)
        res, split = d.output, d.split
        if axis.strict and res.split and (res.axis < 0 or res.axis >= rank or full[out][res.axis] < n
                                          or other.get(out) == res.axis):
            res, split = REPLICATE, "rep"  # too short, or an earlier axis's split
        if axis.strict and not res.split:
            for tid in acts:
                gather(i, tid)
        if res.partial:
            if d.inherit_partial:  # a relabelling of partial sums stays partial
                part_bytes[out], part_exact[out] = part_bytes[acts[0]], part_exact[acts[0]]
            else:
                numel = int(np.prod(full[out], dtype=np.int64))
                part_bytes[out] = numel * (d.partial_elem or max(1, t[out].nbytes // max(1, numel)))
                part_exact[out] = d.partial_exact
        if res != REPLICATE:
            state[out] = res
        if res.split:
            produced[out] = res
            local[out][res.axis] = part(full[out][res.axis], n)
        splits.append(split)
        consts(layer, rule, split, res)
    end = len(program.layers)
    for tid in program.outputs:
        gather(end, tid)
    return events, splits, produced


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
    ``tp`` chips holds one of ``sp`` blocks of rows (:func:`_seq_pass`); ``dp`` must then be 1.

    The mesh is data: one :class:`~tvm_spinn.program.ops.sharding.MeshAxis` per parallel axis,
    each run through the same propagator (:func:`_propagate`)."""
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
    full = [list(x.shape) for x in t]
    local = [list(x.shape) for x in t]
    collectives: list[Collective] = []
    produced: dict[int, Placement] = {}
    if tp > 1:
        state: dict[int, Placement] = {}
        for tid, (_, ax) in _cache_inputs(program, tp).items():
            state[tid] = shard(ax)
            local[tid][ax] = part(local[tid][ax], tp)
        if row == ROW_ALWAYS:
            for tid, ax in _reduction_inputs(program).items():
                if tid not in state and full[tid][ax] >= tp:
                    state[tid] = shard(ax)
                    local[tid][ax] = part(local[tid][ax], tp)

        def consts(layer, rule, split, res):
            if split in ("col", "row", "split"):
                _shard_consts(program, layer, rule, split, tp, full, local, res)

        events, splits, produced = _propagate(program, MeshAxis("tp", tp, row=row), full, local, state, {}, consts)
        collectives = [Collective(i, op, tid, nb, exact) for i, op, tid, nb, exact in events]
    else:
        splits = ["rep"] * len(program.layers)
    seq: tuple[bool, ...] = ()
    if sp > 1:
        tp_axis = {tid: p.axis for tid, p in produced.items()}
        for tid, (_, ax) in (_cache_inputs(program, tp).items() if tp > 1 else ()):
            tp_axis[tid] = ax
        merged = _seq_pass(program, sp, full, local, tp_axis, collectives)
        if merged is None:
            return None
        collectives, seq = merged
    replicated = ()
    if tp > 1 or sp > 1:
        replicated = tuple((layer.name, reason) for layer in program.layers
                           if (reason := no_rule_reason(layer)) is not None)
    return ShardPlan(tp=tp, dp=dp, row=row, batch=int(batch or 1), splits=tuple(splits),
                     collectives=tuple(collectives), shapes=tuple(tuple(s) for s in local), sp=sp, seq=seq,
                     replicated=replicated)


def _seq_pass(program: Program, sp: int, full, local, tp_axis: dict[int, int], tp_colls: list):
    """Sequence parallelism: the second axis of a ``tp x sp`` mesh of chips.

    Each tensor is either replicated over the ``sp`` groups or split into ``sp`` blocks along
    one axis (its rows), propagated through the layers by the same pass and family rules as the
    tensor-parallel states (:func:`_propagate` on a strict ``sp`` axis): a GEMM's rows are
    independent (a dense layer or a matmul on row-split ``A`` gives row-split output; ``R``
    operands are sliced for free, so a GEMM on replicated inputs starts a split), element-wise
    layers follow their operands, row operators (softmax, layer norm) keep a split that is not
    on their reduced axes, reshapes and transposes carry it. What a layer cannot take split
    (the keys of attention, ``K^T``'s split columns, a reduction axis) is all-gathered over the
    ``sp`` group. So a transformer layer on ``tp x sp`` chips runs its LayerNorms on row blocks
    (no all-gather before them), its all-reduces over ``tp`` chips on ``1 / sp`` of the rows
    each, and its attention on heads x query-row blocks (each chip: ``softmax(Q_blk K^T) V``
    for its heads and rows, after gathering its heads' keys over the ``sp`` group). Bits: every
    layer computes whole rows with the one-chip kernels, the reductions of rows never cross
    chips, so the functional program is unchanged.

    Updates ``local`` (the row blocks one chip holds) in place and returns ``(collectives,
    seq)``: the tensor-parallel ``tp_colls`` (a row-split tensor's collective moves ``1 / sp``
    of its bytes, in each of the ``sp`` groups at once) merged with the sequence-parallel
    all-gathers in issue order, and per layer whether its output is row-split; None when no
    layer splits.
    """
    t = program.tensors

    def consts(layer, rule, split, res):
        if res.split and rule.shrinks_row_consts(layer):
            _seq_consts(program, layer, res.axis, sp, full, local)

    events, splits, placed = _propagate(program, MeshAxis("sp", sp, strict=True), full, local, {}, tp_axis, consts)
    produced = {tid: p.axis for tid, p in placed.items()}
    seq = [s != "rep" for s in splits]
    mine = [(i, tid) for i, op, tid, _, _ in events if op == "all_gather"]
    gathered_at: dict[int, int] = {}
    for i, tid in mine:
        gathered_at.setdefault(tid, i)
    end = len(program.layers)
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
    """Shrink the constants of a row-split layer along the split (a position embedding added to
    row blocks); the families whose constants are not on the rows opt out
    (:meth:`~ShardingRule.shrinks_row_consts`)."""
    t = program.tensors
    out_shape = full[layer.output]
    rel = axis - len(out_shape)
    for tid in list(layer.consts.values()) + [tid for tid in layer.inputs if t[tid].role == "const"]:
        shape = local[tid]
        if len(shape) >= -rel and full[tid][rel] == out_shape[axis] and out_shape[axis] > 1:
            shape[rel] = part(full[tid][rel], sp)


def _shard_consts(program: Program, layer, rule: ShardingRule, split: str, tp: int, full, local, result) -> None:
    """Shrink the constants one chip holds for a split layer: what the family's
    :meth:`~ShardingRule.const_shape` says (a GEMM's weight), else per-output-channel constants
    (bias, scales) and broadcast operands along the output's split."""
    t = program.tensors
    consts = list(layer.consts.values()) + [tid for tid in layer.inputs if t[tid].role == "const"]
    out_shape = full[layer.output]
    for tid in consts:
        shape = list(full[tid])
        if not shape:
            continue
        own = rule.const_shape(layer, tid, split, tp, full)
        if own is not None:
            shape = own
        elif split in ("col", "split") and result.split:
            ax = result.axis - len(out_shape)
            if len(shape) >= -ax and shape[ax] == out_shape[result.axis]:
                shape[ax] = part(shape[ax], tp)
            elif len(shape) == 1 and shape[0] == out_shape[result.axis]:
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
        attrs = rule_of(layer).local_attrs(layer, split, plan.tp)
        if attrs is not None:  # a grouped convolution: each chip has its groups
            layer.attrs = attrs
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
    shard.timing, shard.mapping, shard.memory, shard.tiles = None, None, None, None
    return shard
