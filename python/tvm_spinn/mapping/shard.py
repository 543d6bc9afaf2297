"""Sharding a program over a mesh of chips: tensor, sequence and data parallelism in one pass.

A *shard plan* splits every layer of a program over the chips of a mesh that all run the same
shard (which is what lets the timing model simulate one chip and multiply, see
:mod:`tvm_spinn.timing.system`). The mesh is data
(:class:`~tvm_spinn.program.ops.sharding.Mesh`: named axes with sizes, ``tp x sp x dp`` or
``tp x ep``, each composed with pipeline stages ``pp``). Over each axis every tensor has a
placement, found by one pass through the layers in order (:func:`_propagate`) that asks each
layer's family rule once per axis:

``R`` replicated (every chip holds all of it), ``S(axis)`` split into equal blocks along
``axis``, ``P`` partial sums (every chip holds a full-size tensor that must be summed).

- **Tensor parallelism** (``tp``): a GEMM with a constant weight on an ``R`` input is
  *column-parallel* (weight split by output features, output ``S``); on an input split along
  its reduction axis it is *row-parallel* (weight split by input features, output ``P``);
  output features that ``tp`` does not divide are split unevenly (blocks of ``ceil(n / tp)``:
  the timing follows the largest block, the slowest chip). That is the Megatron split of a
  transformer block: Q/K/V and the first MLP GEMM column-parallel, the attention of the heads
  on each chip's heads (reshapes and transposes carry the split to the head axis, the score and
  context matmuls run per head), the output projection and the second MLP GEMM row-parallel,
  and one all-reduce where the partial sums meet the residual: one per attention block and one
  per MLP block. Convolutions split output channels, then input channels, the same way.
  Element-wise layers follow their operands' split (an ``R`` operand is sliced for free); row
  operators (softmax, layer norm, mean) keep a split that is not on their reduced axes; a
  split that cannot be carried is *all-gathered* to ``R``, partial sums are *all-reduced*.
- **Sequence parallelism** (``sp``, after ``tp``): each tensor-parallel group holds one of
  ``sp`` row blocks. A GEMM's rows are independent (a GEMM on replicated inputs starts a split:
  ``R`` operands are sliced for free), element-wise layers follow, row operators keep a split
  off their reduced axes, reshapes and transposes carry it; what a layer cannot take split (the
  keys of attention, a reduction axis) is all-gathered over the ``sp`` group. The axis is
  strict: no partial sums, and a split on a tensor axis ``tp`` splits is refused.
- **Data parallelism** (``dp``): the activation inputs whose leading extent is the program's
  batch start split along it and every family carries the batch split (weights replicated); a
  layer that cannot keep it gathers over the ``dp`` group. The program's outputs stay split
  (each replica returns its share of the batch).
- **Expert parallelism** (``ep``): the tokens start split over the group as the batch does on
  ``dp``, and each layer takes its family's expert rule
  (:meth:`~tvm_spinn.program.ops.sharding.ShardingRule.experts`,
  :data:`~tvm_spinn.program.ops.sharding.EXPERT_RULE`): a GEMM over experts stacked along a
  leading axis runs split along it (each chip its experts' weights), its input re-split from
  the tokens to the experts by an *all-to-all* (the dispatch; the combine is the all-to-all
  back where a later layer needs the tokens split again); every other layer is data-parallel.

- **Pipeline parallelism** (``pp``): the layers are cut into ``pp`` contiguous stages balanced
  by their families' work (:func:`pipeline_stages`, :meth:`OpFamily.work`); each stage runs on
  its own ``tp x sp x dp x ep`` chips with the placements above (the pass runs through the cuts
  unchanged). At each cut the tensors live across it (written before, read at or after it)
  move to the next stage by point-to-point sends, each chip its share to the chip of the same
  position (:attr:`ShardPlan.handovers`); :func:`stage_programs` cuts the functional program.

The program's outputs are made ``R`` over the tensor and sequence axes. A layer whose family
states no rule runs replicated (its inputs gathered), which is right for any operator; the plan
names those layers and why (:attr:`ShardPlan.replicated`, in the program's ``mapping["system"]``
and the report). The propagator never looks at a layer's kind: what each layer does is its
operator family's :class:`~tvm_spinn.program.ops.sharding.ShardingRule`. A collective runs over
one axis's group and moves what one chip holds of the tensor over the other axes
(:func:`_collectives`).

Bits: every all-reduce of floating-point partial sums is a *chain* reduction that continues one
accumulator in ascending ``k`` from chip to chip (see
:func:`tvm_spinn.timing.collectives.chain_all_reduce`); row blocks and batch shares are
computed whole with the one-chip kernels.
The plan is pure shape data: the functional program is unchanged whatever the mesh (integer
partial sums are exact in any order).

:func:`shard_program` builds the one-chip *shard program* (same layers, local tensor shapes)
that the one-chip mapper tiles, places and times.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..program import Program
from ..program.ops import family_of
from ..program.records import PlanCollective
from ..program.ops.sharding import (REPLICATE, ROW_ALWAYS, AllToAll, Mesh, MeshAxis, Placement, RowAllReduce,
                                    ShardContext, ShardDecision, ShardingRule, part, shard)

__all__ = ["Collective", "ShardPlan", "plan_shards", "plan_mesh", "Mesh", "shard_program", "recorded_plan", "ROW_ALWAYS", "part", "rule_of",
           "no_rule_reason", "pipeline_stages", "stage_programs"]

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


#: A collective the shard plan needs before layer ``layer`` (``len(layers)``: at the end):
#: the record the mapped program stores (``nbytes``: the full tensor, the gathered result or one
#: chip's full-size partial sums; ``exact``: integer partial sums; ``group``: ``"tp"``, ``"sp"``,
#: ``"dp"`` or ``"all"``; ``shape``: what one chip holds after an all-gather).
Collective = PlanCollective


@dataclass(frozen=True)
class ShardPlan:
    """How one program is split over the ``tp x sp x dp`` chips of a mesh (see the module docstring)."""

    tp: int
    dp: int
    row: bool | str                   # row-parallel GEMMs allowed (the Megatron split), or ROW_ALWAYS
    batch: int                        # the program's batch (axis 0 of its inputs)
    splits: tuple[str, ...]           # per layer: "col", "row", "split", "rep", "whole"
    collectives: tuple[Collective, ...]
    shapes: tuple[tuple[int, ...], ...]  # per tensor: the shape one chip holds
    sp: int = 1                       # sequence-parallel degree (row blocks)
    seq: tuple[bool, ...] = ()        # per layer: its output split into ``sp`` row blocks
    #: ``(layer name, reason)`` of the layers replicated because their family states no
    #: sharding rule (only on a mesh of more than one chip along ``tp`` or ``sp``)
    replicated: tuple[tuple[str, str], ...] = ()
    #: the mesh the plan was propagated over
    mesh: Mesh | None = None
    #: per tensor, its placement on each axis of ``mesh.axes`` as produced (before any gather)
    placements: tuple[tuple[Placement, ...], ...] = ()
    #: expert-parallel degree (the tokens spread over the group, stacked experts split)
    ep: int = 1
    #: pipeline stages: each runs a contiguous range of layers on its own ``tp x sp x dp x ep``
    #: chips (:func:`pipeline_stages`)
    pp: int = 1
    #: per layer, its pipeline stage (``()`` on one stage)
    stages: tuple[int, ...] = ()
    #: the hand-over at each cut between stages: one point-to-point ``"send"`` (group ``"pp"``)
    #: per live tensor crossing it, before the first layer of the receiving stage; ``nbytes``
    #: and ``shape``: what one chip sends to the chip of the same position in the next stage
    handovers: tuple[Collective, ...] = ()

    @property
    def chips(self) -> int:
        return self.tp * self.dp * self.sp * self.ep * self.pp

    def summary(self) -> dict:
        """JSON-ready summary (what the program's mapping records)."""
        counts: dict[str, int] = {}
        for s in self.splits:
            counts[s] = counts.get(s, 0) + 1
        ops: dict[str, int] = {}
        for c in self.collectives:
            ops[c.op] = ops.get(c.op, 0) + 1
        out = {"tp": self.tp, "dp": self.dp, "sp": self.sp, **({"ep": self.ep} if self.ep > 1 else {}),
               **({"pp": self.pp, "handovers": len(self.handovers)} if self.pp > 1 else {}),
               "row": self.row, "chips": self.chips,
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


class _AxisPass:
    """The placements of one mesh axis while the pass runs (see :func:`_propagate`)."""

    def __init__(self, program: Program, axis: MeshAxis, full, state: dict[int, Placement]):
        self.axis = axis
        self.state = state                   # tensor -> placement; absent: R
        self.ctx = ShardContext(program, full, axis, lambda layer, x: _row_pays(program, layer, full, x))
        self.part_bytes: dict[int, int] = {}
        self.part_exact: dict[int, bool] = {}
        self.splits: list[str] = []          # per layer: what it does on this axis
        self.placed: list[tuple] = []        # per layer: (rule, split, output placement)
        self.produced: dict[int, Placement] = dict(state)  # every tensor ever split (inputs too)

    def at(self, tid: int) -> Placement:
        return self.state.get(tid, REPLICATE)


def _propagate(program: Program, passes: list[_AxisPass], full, local, before_layer=None) -> list[tuple]:
    """One pass of placements over the layers for every mesh axis: each layer's family rule
    (:func:`rule_of`) is asked once per axis (in mesh order) to place the layer's output from
    its inputs' placements on that axis; the pass applies the rule's gathers and per-row
    all-reduces, keeps partial sums' bytes and writes the local shapes of the outputs
    (``local``, in place). A strict axis refuses a split on a tensor axis an earlier mesh axis
    splits, or shorter than the axis.

    Returns the collectives in issue order as ``(layer, axis index, op, tensor, nbytes, exact,
    others)``: ``len(layers)`` for the program's outputs (made replicated at the end over the
    axes that gather outputs), ``others`` the tensor's placements on the other axes when the
    collective runs (a layer's collectives of an earlier axis go first). ``before_layer(i)``,
    when given, is called before layer ``i`` is placed (the placements then are those the
    layers before it left: what a pipeline cut hands over).
    """
    t = program.tensors
    events: list[tuple] = []

    def nbytes(tid):
        numel = int(np.prod(full[tid], dtype=np.int64))
        return numel * max(1, t[tid].nbytes // max(1, numel))

    def record(i, k, op, tid, n, exact, target=None):
        others = tuple(p.at(tid) if j != k else REPLICATE for j, p in enumerate(passes))
        events.append((i, k, op, tid, n, exact, others, target))

    def gather(i, k, tid):
        ax = passes[k]
        s = ax.at(tid)
        if s.split:
            record(i, k, "all_gather", tid, nbytes(tid), True)
        elif s.partial:
            record(i, k, "all_reduce", tid, ax.part_bytes[tid], ax.part_exact[tid])
        ax.state.pop(tid, None)

    for i, layer in enumerate(program.layers):
        if before_layer is not None:
            before_layer(i)
        rule = rule_of(layer)
        acts = [tid for tid in layer.inputs if t[tid].role != "const"]
        out = layer.output
        rank = len(full[out])
        for k, ax in enumerate(passes):
            axis, n = ax.axis, ax.axis.size
            if not rule.accepts_partial(layer):
                for tid in acts:
                    if ax.at(tid).partial:
                        gather(i, k, tid)
            placed = [ax.at(tid) for tid in acts]
            # the expert axis asks each family's expert rule (its data-parallel rule but for
            # GEMMs over stacked experts); every other axis the family's rule
            d = rule.experts(ax.ctx, layer, placed) if axis.name == "ep" else rule.propagate(ax.ctx, layer, placed)
            for action in d.before:
                if isinstance(action, RowAllReduce):
                    record(i, k, "all_reduce", acts[action.pos], action.nbytes, action.exact)
                elif isinstance(action, AllToAll):
                    # one chip's share moves to the chips whose block of the new axis it holds
                    tid = acts[action.pos]
                    if ax.at(tid) != shard(action.axis):
                        record(i, k, "all_to_all", tid, -(-nbytes(tid) // n), True, shard(action.axis))
                        ax.state[tid] = shard(action.axis)
                else:
                    gather(i, k, acts[action.pos])
            if d.gather_all:
                for tid in acts:
                    gather(i, k, tid)
            res, split = d.output, d.split
            if axis.strict and res.split and (res.axis < 0 or res.axis >= rank or full[out][res.axis] < n
                                              or any(p.at(out) == res for p in passes[:k])):
                res, split = REPLICATE, "rep"  # too short, or an earlier axis's split
            if axis.strict and not res.split:
                for tid in acts:
                    gather(i, k, tid)
            if res.partial:
                if d.inherit_partial:  # a relabelling of partial sums stays partial
                    ax.part_bytes[out], ax.part_exact[out] = ax.part_bytes[acts[0]], ax.part_exact[acts[0]]
                else:
                    numel = int(np.prod(full[out], dtype=np.int64))
                    ax.part_bytes[out] = numel * (d.partial_elem or max(1, t[out].nbytes // max(1, numel)))
                    ax.part_exact[out] = d.partial_exact
            if res != REPLICATE:
                ax.state[out] = res
            if res.split:
                ax.produced[out] = res
                local[out][res.axis] = part(full[out][res.axis], n)
            ax.splits.append(split)
            ax.placed.append((rule, split, res))
    end = len(program.layers)
    for k, ax in enumerate(passes):
        if ax.axis.gather_outputs:
            for tid in program.outputs:
                gather(end, k, tid)
    return events


def _collectives(program: Program, passes: list[_AxisPass], events: list[tuple], full) -> list[Collective]:
    """The plan's :class:`Collective` list from the pass's events.

    A collective runs inside one group of its axis and moves what one chip holds of the tensor
    over the other axes at that moment: a split of an earlier axis (already applied when the
    layer's collectives of this axis run) cuts the tensor's shape, a later axis's split divides
    its bytes (every group of the later axis runs its own copy at once). The data axis's split
    does not divide the bytes: the replicas' groups are costed for the whole batch. The
    program's outputs leave whole (the next program reads them replicated): on a mesh with a
    strict axis that gathers outputs (row blocks), a tensor gathered at the end over any axis is
    one all-gather over all the chips of the axes that gather outputs, along one ring (group
    ``"all"``), not rounds over strided groups (each chip of a group holds the same block, so
    each can send a different part of it).
    """
    t = program.tensors
    end = len(program.layers)

    def elem(tid):
        return max(1, t[tid].nbytes // max(1, int(np.prod(t[tid].shape, dtype=np.int64))))

    # a gather's shape is recorded where a strict axis may cut the gathered tensor (on the
    # tensor axis alone it is the full tensor)
    shaped = any(p.axis.strict for p in passes)
    out: list[Collective] = []
    for i, k, op, tid, n, exact, others, target in events:
        shape = list(full[tid])
        if target is not None:  # an all-to-all: the shape one chip holds after it
            shape[target.axis] = part(shape[target.axis], passes[k].axis.size)
        cut = False
        for j, p in enumerate(others):
            if not p.split:
                continue
            size = passes[j].axis.size
            shape[p.axis] = part(shape[p.axis], size)
            if j < k:
                cut = True
            elif passes[j].axis.gather_outputs:
                n = -(-n // size)
        if cut and op == "all_gather":
            n = int(np.prod(shape, dtype=np.int64)) * elem(tid)
        out.append(Collective(i, op, tid, n, exact, passes[k].axis.name,
                              tuple(shape) if (op == "all_gather" and shaped) or target is not None else None))
    if any(p.axis.strict and p.axis.gather_outputs for p in passes):
        final = list(dict.fromkeys(c.tensor for c in out if c.layer >= end and c.op == "all_gather"))
        # (an output's partial sums are still all-reduced first: only its gathers merge)
        out = [c for c in out if not (c.layer >= end and c.tensor in final and c.op == "all_gather")]
        for tid in final:
            n = int(np.prod(full[tid], dtype=np.int64)) * elem(tid)
            out.append(Collective(end, "all_gather", tid, n, True, "all", None))
    return out


def plan_shards(program: Program, tp: int, dp: int = 1, row: bool | str = True, sp: int = 1) -> ShardPlan | None:
    """The shard plan of ``program`` on ``tp x dp x sp`` chips (:func:`plan_mesh` on
    ``Mesh.of(tp=tp, sp=sp, dp=dp, row=row)``)."""
    if row not in (True, False, ROW_ALWAYS):
        raise ValueError(f"plan_shards: row must be True, False or {ROW_ALWAYS!r}, got {row!r}")
    return plan_mesh(program, Mesh.of(tp=tp, sp=sp, dp=dp, row=row))


def plan_mesh(program: Program, mesh: Mesh) -> ShardPlan | None:
    """The shard plan of ``program`` on ``mesh``, or None when ``dp`` does not divide the batch or
    ``sp`` splits nothing (see the module docstring).

    The tensor axis's ``row=False``: no row-parallel GEMMs (an input split along the reduction
    axis is all-gathered and the GEMM is column-parallel again), which trades each all-reduce
    for an all-gather; the mapper costs both. ``row=ROW_ALWAYS`` (``"always"``): every GEMM on
    an input split along its reduction axis runs row-parallel, even where its partial sums are
    larger than that input, and the program inputs that reach only weight GEMMs' reduction
    axes (:func:`_reduction_inputs`) start split: each chip then holds ``k / tp`` rows of the
    weight instead of ``n / tp`` columns of length ``k``, a finer unit to spread over its PEs'
    SRAM (the mapper tries it when the chosen plan streams a weight GEMM). ``sp > 1``: each
    tensor-parallel group of ``tp`` chips holds one of ``sp`` blocks of rows; ``dp`` must then
    be 1. ``dp > 1``: the activation inputs whose leading extent is the program's batch start
    split along it. ``ep > 1`` (with ``sp = dp = 1``): the same inputs (the tokens) start split,
    and each layer takes its family's expert rule (None when the tokens are fewer than ``ep``).
    ``pp > 1``: the layers are cut into ``pp`` contiguous stages balanced by their families'
    work (:func:`pipeline_stages`), each stage on its own ``tp x sp x dp x ep`` chips; the
    other axes are propagated through the cuts unchanged (a stage starts from the placements
    the previous one left) and each cut hands its live tensors over as they are placed there
    (:attr:`ShardPlan.handovers`). None when there are fewer layers than stages.
    """
    tp, sp, dp, ep, pp = mesh.size("tp"), mesh.size("sp"), mesh.size("dp"), mesh.size("ep"), mesh.size("pp")
    if ep > 1 and (sp > 1 or dp > 1):
        raise ValueError(f"plan_mesh: the expert axis (ep={ep}) with sequence or data parallelism (sp={sp}, "
                         f"dp={dp}) is not supported")
    row = mesh.axis("tp").row if mesh.axis("tp") is not None else True
    if sp > 1 and dp > 1:
        raise ValueError(f"plan_shards: sequence parallelism (sp={sp}) with data parallelism (dp={dp}) is not supported")
    t = program.tensors
    # the batch: the leading extent every activation input shares (none: no data parallelism)
    leads = {t[tid].shape[0] for tid in program.inputs if t[tid].role != "const" and len(t[tid].shape) >= 2}
    batch = leads.pop() if len(leads) == 1 else None
    if dp > 1 and (not batch or batch % dp):
        return None
    if ep > 1 and (not batch or batch < ep):
        return None
    if pp > len(program.layers):
        return None
    full = [list(x.shape) for x in t]
    local = [list(x.shape) for x in t]
    passes: list[_AxisPass] = []
    for axis in mesh.active:
        if axis.name == "pp":  # not a placement: the stages cut the layers (below)
            continue
        state: dict[int, Placement] = {}
        if axis.name == "tp":
            for tid, (_, ax) in _cache_inputs(program, tp).items():
                state[tid] = shard(ax)
            if row == ROW_ALWAYS:
                for tid, ax in _reduction_inputs(program).items():
                    if tid not in state and full[tid][ax] >= tp:
                        state[tid] = shard(ax)
        elif axis.name in ("dp", "ep"):  # the tokens spread over the group (as the batch over replicas)
            for tid in program.inputs:
                if t[tid].role != "const" and full[tid] and full[tid][0] == batch:
                    state[tid] = shard(0)
        for tid, p in state.items():
            local[tid][p.axis] = part(local[tid][p.axis], axis.size)
        passes.append(_AxisPass(program, axis, full, state))
    stages = pipeline_stages(program, pp) if pp > 1 else ()
    handovers: list[Collective] = []
    hand_over = None
    if stages:
        crossing = _crossing(program, stages)

        def hand_over(i):
            if i in crossing:
                handovers.extend(_handover(program, passes, full, i, crossing[i]))

    events = _propagate(program, passes, full, local, hand_over)
    # the constants one chip holds, axis by axis in mesh order
    for ax in passes:
        for layer, (rule, split, res) in zip(program.layers, ax.placed):
            if not ax.axis.strict:
                if split in ("col", "row", "split"):
                    _shard_consts(program, layer, rule, split, ax.axis.size, full, local, res)
            elif ax.axis.name == "ep" and res == shard(0) and _expert_split(program, layer, rule, ax.axis.size, full):
                tid = rule.expert_weight(program, layer)  # each chip its experts' weights
                local[tid][0] = part(full[tid][0], ax.axis.size)
            elif res.split and rule.shrinks_row_consts(layer):
                _seq_consts(program, layer, res.axis, ax.axis.size, full, local)
    by_name = {ax.axis.name: ax for ax in passes}
    splits = tuple(by_name["tp"].splits) if "tp" in by_name else ("rep",) * len(program.layers)
    seq: tuple[bool, ...] = ()
    if "sp" in by_name:
        seq = tuple(s != "rep" for s in by_name["sp"].splits)
        if not any(seq):
            return None
    replicated = ()
    if tp > 1 or sp > 1:
        replicated = tuple((layer.name, reason) for layer in program.layers
                           if (reason := no_rule_reason(layer)) is not None)
    placements = tuple(tuple(by_name[a.name].produced.get(tid, REPLICATE) if a.name in by_name else REPLICATE
                             for a in mesh.axes) for tid in range(len(t)))
    return ShardPlan(tp=tp, dp=dp, ep=ep, row=row, batch=int(batch or 1), splits=splits,
                     collectives=tuple(_collectives(program, passes, events, full)),
                     shapes=tuple(tuple(s) for s in local), sp=sp, seq=seq, replicated=replicated,
                     mesh=mesh, placements=placements, pp=pp, stages=stages, handovers=tuple(handovers))


def _stage_cost(program: Program, layer) -> int:
    """A layer's weight in the stage balance: its family's work (:meth:`OpFamily.work`, the
    cost model's operations; a layer without a family: its recorded ``flops``)."""
    family = family_of(layer.kind)
    if family is None:
        return int(layer.flops)
    return int(family.work(program, layer, program.arch)[0])


def pipeline_stages(program: Program, pp: int) -> tuple[int, ...]:
    """Per layer, its pipeline stage: ``pp`` contiguous, non-empty ranges of layers in program
    order that minimise the largest stage's work (:func:`_stage_cost`); among cuts of equal
    largest work, the one whose largest stage has the fewest layers, then the earliest cuts.

    A stage is the unit the pipeline overlaps: the slowest stage bounds the throughput, so the
    cut balances the work (an exact linear partition, dynamic programming over the cut points).
    """
    n = len(program.layers)
    if not isinstance(pp, int) or isinstance(pp, bool) or not 1 <= pp <= n:
        raise ValueError(f"pipeline_stages: pp must be an int from 1 to the program's {n} layers, got {pp!r}")
    # each stage's key is (work, layers) packed in one integer: the max of packed keys is the
    # packed lexicographic max, so one min-max partition minimises work first, then layers
    cost = np.array([_stage_cost(program, layer) for layer in program.layers], dtype=np.int64) * (n + 1) + 1
    pre = np.concatenate([[0], np.cumsum(cost)])
    big = np.iinfo(np.int64).max
    best = np.full(n + 1, big, dtype=np.int64)
    best[0] = 0
    cut = np.zeros((pp + 1, n + 1), dtype=np.int64)
    for s in range(1, pp + 1):
        new = np.full(n + 1, big, dtype=np.int64)
        for i in range(s, n - (pp - s) + 1):
            j = np.arange(s - 1, i)
            key = np.maximum(best[j], pre[i] - pre[j])
            k = int(np.argmin(key))  # the first minimum: the earliest cut
            new[i], cut[s, i] = key[k], j[k]
        best = new
    stages = [0] * n
    i = n
    for s in range(pp, 0, -1):
        j = int(cut[s, i])
        stages[j:i] = [s - 1] * (i - j)
        i = j
    return tuple(stages)


def _crossing(program: Program, stages: tuple[int, ...]) -> dict[int, list[int]]:
    """``{cut: tensors}``: at each layer that starts a stage, the tensors live across the cut
    (written by a layer before it, read by it or a later layer), in tensor id order. Program
    inputs and constants reach every stage that reads them directly; an output leaves from the
    stage that writes it."""
    t = program.tensors
    writer = {layer.output: i for i, layer in enumerate(program.layers)}
    last = {}
    for i, layer in enumerate(program.layers):
        for tid in layer.inputs:
            if t[tid].role != "const" and tid in writer:
                last[tid] = i
    cuts = [i for i in range(1, len(stages)) if stages[i] != stages[i - 1]]
    return {b: sorted(tid for tid, r in last.items() if writer[tid] < b <= r) for b in cuts}


def _handover(program: Program, passes: list[_AxisPass], full, cut: int, tids: list[int]) -> list[Collective]:
    """The sends of cut ``cut``: each tensor as the other axes place it there (a split: one
    chip's block; partial sums: one chip's full-size partial sums, at their element size; a
    gathered tensor: whole), one chip to the chip of the same mesh position in the next stage."""
    t = program.tensors
    out = []
    for tid in tids:
        shape = list(full[tid])
        numel = int(np.prod(shape, dtype=np.int64))
        elem = max(1, t[tid].nbytes // max(1, int(np.prod(t[tid].shape, dtype=np.int64))))
        for ax in passes:
            p = ax.at(tid)
            if p.split:
                shape[p.axis] = part(shape[p.axis], ax.axis.size)
            elif p.partial:
                elem = max(1, ax.part_bytes[tid] // max(1, numel))
        out.append(Collective(cut, "send", tid, int(np.prod(shape, dtype=np.int64)) * elem, True, "pp", tuple(shape)))
    return out


def _stage_parts(program: Program, plan: ShardPlan) -> list[tuple[int, int, list[int], set, set, set]]:
    """Per stage of ``plan``: its layers ``[lo, hi)``, the tensors its program keeps (in id
    order: the new ids are their positions) and which of them are its inputs, outputs and
    constants (see :func:`stage_programs`)."""
    t = program.tensors
    sends: dict[int, set[int]] = {}
    for c in plan.handovers:
        sends.setdefault(c.layer, set()).add(c.tensor)
    bounds = [i for i in range(len(plan.stages)) if i == 0 or plan.stages[i] != plan.stages[i - 1]]
    bounds.append(len(plan.stages))
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        layers = program.layers[lo:hi]
        written = {layer.output for layer in layers}
        read = {tid for layer in layers for tid in layer.inputs if tid not in written}
        consts = {tid for layer in layers for tid in (*layer.consts.values(), *layer.inputs) if t[tid].role == "const"}
        inputs = {tid for tid in read if tid not in consts}
        outputs = {tid for tid in written if tid in program.outputs or tid in sends.get(hi, ())}
        out.append((lo, hi, sorted(written | read | consts), inputs, outputs, consts))
    return out


def stage_programs(program: Program, plan: ShardPlan) -> tuple[Program, ...]:
    """The functional program of each pipeline stage of ``plan`` (``(program,)`` on one stage).

    Stage ``s`` runs its layers over full tensors: its inputs are the program inputs its layers
    read and the tensors it receives and reads (:attr:`ShardPlan.handovers` at its first
    layer), its outputs the program outputs it writes and the tensors it sends on; tensors are
    renumbered in id order, constants kept. A tensor relayed through a stage that does not read
    it is forwarded as received (it is not an input of that stage's program).
    """
    if plan.pp == 1:
        return (program,)
    t = program.tensors
    out = []
    for s, (lo, hi, used, inputs, outputs, consts) in enumerate(_stage_parts(program, plan)):
        new = {tid: k for k, tid in enumerate(used)}
        role = {tid: "input" if tid in inputs else "output" if tid in outputs
                else "const" if tid in consts else "temp" for tid in used}
        tensors = [replace(t[tid], role=role[tid], offset=-1) for tid in used]
        staged = [replace(layer, inputs=[new[x] for x in layer.inputs], output=new[layer.output],
                          consts={k: new[v] for k, v in layer.consts.items()}) for layer in program.layers[lo:hi]]
        out.append(Program(symbol=f"{program.symbol}_stage{s}", arch=program.arch, tensors=tensors,
                           inputs=[new[x] for x in used if x in inputs], outputs=[new[x] for x in used if x in outputs],
                           layers=staged, constants={new[x]: program.constants[x] for x in used if x in consts and x in program.constants}))
    return tuple(out)


def _expert_split(program: Program, layer, rule: ShardingRule, ep: int, full) -> bool:
    """Whether ``layer`` is a GEMM over stacked experts that ``ep`` chips split (its family's
    :meth:`~ShardingRule.expert_weight`, the experts dividing evenly)."""
    tid = rule.expert_weight(program, layer)
    return tid is not None and full[tid][0] % ep == 0 and full[layer.output][0] == full[tid][0]


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


def recorded_plan(program: Program) -> ShardPlan:
    """The shard plan a system-mapped program's records name (``program.mapping.system``)."""
    info = program.mapping.system
    row = info.row
    return plan_shards(program, int(info.tp), int(info.dp), row if row == ROW_ALWAYS else bool(row), int(info.sp))


def shard_program(program: Program, plan: ShardPlan) -> Program:
    """The program one chip of the group runs: the same layers over the plan's local shapes.

    A tensor all-gathered before layer ``i`` is a new full-size tensor that layers ``i`` and
    later read (the producer still writes only its block), with the shape one chip holds of it
    over the other mesh axes. Timing-only: constants are not sliced (the one-chip mapper
    reads shapes, never values).
    """
    tensors = list(program.tensors)
    for tid, shape in zip(range(len(tensors)), plan.shapes):
        tensors[tid] = replace(tensors[tid], shape=list(shape))
    layers = list(program.layers)
    for i, split in zip(range(len(layers)), plan.splits):
        attrs = rule_of(layers[i]).local_attrs(layers[i], split, plan.tp)
        if attrs is not None:  # a grouped convolution: each chip has its groups
            layers[i] = replace(layers[i], attrs=attrs)
    current: dict[int, int] = {}  # a tensor gathered twice (tp, then sp): its latest copy
    for c in plan.collectives:
        if c.op not in ("all_gather", "all_to_all") or c.layer >= len(layers):
            continue
        new = program.tensors[c.tensor]
        shape = c.shape if c.shape is not None else program.tensors[c.tensor].shape
        suffix = "gathered" if c.op == "all_gather" else "resplit"
        new = replace(new, shape=list(shape), role="temp", name=f"{new.name}.{suffix}")
        tensors.append(new)
        nid = len(tensors) - 1
        old = current.get(c.tensor, c.tensor)
        for i in range(c.layer, len(layers)):
            if old in layers[i].inputs:
                layers[i] = replace(layers[i], inputs=[nid if tid == old else tid for tid in layers[i].inputs])
        current[c.tensor] = nid
    return replace(program, tensors=tensors, layers=layers, timing=None, mapping=None, memory=None, tiles=None)
