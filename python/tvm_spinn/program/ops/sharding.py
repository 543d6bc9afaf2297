"""The sharding contract of operator families: placements over the axes of a chip mesh.

A mesh of chips is given as data: a :class:`Mesh` is a frozen record of named
:class:`MeshAxis` (tensor ``tp``, sequence ``sp``, data ``dp``, expert ``ep``; pipeline ``pp``
cuts the layers into stages rather than placing tensors, see :mod:`tvm_spinn.mapping.shard`).
Over each axis every tensor has a :class:`Placement`:

``R`` replicated (every chip holds all of it), ``S(axis)`` split into equal blocks along
``axis``, ``P`` partial sums (every chip holds a full-size tensor that must be summed).

Each family states, through its :class:`ShardingRule`, how a layer's output is placed given
its activation inputs' placements on one mesh axis and which collectives that needs first
(:class:`ShardDecision`: inputs to make replicated, per-row all-reduces). The rule reads the
axis it is asked about (``ctx.axis.name``): the tensor axis splits weights (column- and
row-parallel GEMMs, partial sums), the sequence axis splits rows, the data axis splits the
batch. The mapper's generic propagator (:mod:`tvm_spinn.mapping.shard`) runs one pass over the
layers, asks each layer's family once per mesh axis and keeps the placements, the local shapes
and the collectives; it never looks at a layer's kind.

A family without a rule (``OpFamily.sharding is None``) is handled by the propagator's
fallback rule: replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

__all__ = ["Placement", "REPLICATE", "PARTIAL", "shard", "MeshAxis", "Mesh", "AXIS_NAMES", "ROW_ALWAYS", "GatherInput",
           "RowAllReduce", "AllToAll", "EXPERT_RULE", "ShardDecision", "ShardContext", "ShardingRule", "PointwiseRule",
           "part", "reshape_axis"]


@dataclass(frozen=True)
class Placement:
    """Where a tensor lives over one mesh axis: ``kind`` ``"R"``, ``"S"`` (split along
    ``axis``, a non-negative tensor axis) or ``"P"`` (partial sums)."""

    kind: str
    axis: int = -1

    def __post_init__(self):
        if self.kind not in ("R", "S", "P"):
            raise ValueError(f"Placement: kind must be 'R', 'S' or 'P', got {self.kind!r}")

    @property
    def split(self) -> bool:
        return self.kind == "S"

    @property
    def partial(self) -> bool:
        return self.kind == "P"


REPLICATE = Placement("R")
PARTIAL = Placement("P")


def shard(axis: int) -> Placement:
    """``S(axis)``."""
    return Placement("S", int(axis))


#: ``MeshAxis.row``: every GEMM on an input split along its reduction axis runs row-parallel
ROW_ALWAYS = "always"


#: The mesh axes a :class:`Mesh` may name, in the order the propagator runs them: ``tp``
#: tensor parallel, ``sp`` sequence parallel, ``dp`` data parallel, ``ep`` expert parallel,
#: ``pp`` pipeline parallel.
AXIS_NAMES = ("tp", "sp", "dp", "ep", "pp")


@dataclass(frozen=True)
class MeshAxis:
    """One parallel axis of a chip mesh.

    ``name``: one of :data:`AXIS_NAMES`: ``"tp"`` (tensor parallel: weights split, partial
    sums allowed), ``"sp"`` (sequence parallel: row blocks, no partial sums), ``"dp"`` (data
    parallel: the batch), ``"ep"`` / ``"pp"`` (expert / pipeline parallel).
    ``size``: chips along the axis. ``row``: row-parallel GEMMs allowed (True, False or
    :data:`ROW_ALWAYS`; tensor axis only). ``strict``: a replicated output gathers every
    input, and a split shorter than the axis, or on a tensor axis an earlier mesh axis
    splits, is refused (the sequence and data axes, which run after the tensor axis).
    ``gather_outputs``: the program's outputs are made replicated over the axis at its end
    (not over the data axis: each replica returns its share of the batch).
    """

    name: str
    size: int
    row: bool | str = False
    strict: bool = False
    gather_outputs: bool = True

    def __post_init__(self):
        if self.name not in AXIS_NAMES:
            raise ValueError(f"MeshAxis: name must be one of {AXIS_NAMES}, got {self.name!r}")
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"MeshAxis {self.name}: size must be a positive int, got {self.size!r}")


@dataclass(frozen=True)
class Mesh:
    """A mesh of chips as data: its named axes (:class:`MeshAxis`, at most one per name), in
    propagation order (:data:`AXIS_NAMES`). ``chips`` is the product of the sizes."""

    axes: tuple[MeshAxis, ...]

    def __post_init__(self):
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"Mesh: each axis at most once, got {names}")
        if names != sorted(names, key=AXIS_NAMES.index):
            raise ValueError(f"Mesh: axes in the order {AXIS_NAMES}, got {names}")

    @classmethod
    def of(cls, tp: int = 1, sp: int = 1, dp: int = 1, ep: int = 1, pp: int = 1,
           row: bool | str = True) -> "Mesh":
        """The mesh ``tp x sp x dp x ep x pp`` with each axis's standard semantics (``row``:
        the tensor axis's row-parallel GEMMs)."""
        return cls((MeshAxis("tp", tp, row=row), MeshAxis("sp", sp, strict=True),
                    MeshAxis("dp", dp, strict=True, gather_outputs=False),
                    MeshAxis("ep", ep, strict=True, gather_outputs=False),
                    MeshAxis("pp", pp, strict=True)))

    def size(self, name: str) -> int:
        """Chips along axis ``name`` (1 where the mesh does not name it)."""
        return next((a.size for a in self.axes if a.name == name), 1)

    def axis(self, name: str) -> MeshAxis | None:
        return next((a for a in self.axes if a.name == name), None)

    @property
    def chips(self) -> int:
        return int(np.prod([a.size for a in self.axes], dtype=np.int64))

    @property
    def active(self) -> tuple[MeshAxis, ...]:
        """The axes of more than one chip, in propagation order."""
        return tuple(a for a in self.axes if a.size > 1)


@dataclass(frozen=True)
class GatherInput:
    """Make activation input ``pos`` replicated before the layer (all-gather a split,
    all-reduce partial sums; nothing for a replicated input)."""

    pos: int


@dataclass(frozen=True)
class RowAllReduce:
    """An all-reduce of per-row statistics of activation input ``pos`` (``nbytes``; ``exact``:
    any reduction order gives the same bits) before the layer."""

    pos: int
    nbytes: int
    exact: bool


@dataclass(frozen=True)
class AllToAll:
    """Re-split activation input ``pos`` from its split onto tensor axis ``axis`` before the
    layer: an all-to-all over the mesh axis's group (each chip keeps the block it needs of its
    own share and sends every other chip the part of its share in that chip's block). A mixture
    of experts' *dispatch* (tokens split over the chips, then each expert's rows on the chip
    holding the expert) and *combine* (the way back) are such re-splits."""

    pos: int
    axis: int


#: The expert axis (``ep``) as data: what a layer does with its inputs' placements over the
#: chips of an expert group. ``expert_gemm``: a GEMM whose constant weight is stacked over a
#: leading *expert* axis (``[E, k, n]``, the output ``[E, rows, n]``) runs split along that axis,
#: each chip its ``E / ep`` experts' weights; its activation arrives split along the experts
#: (kept), split otherwise (re-split: :class:`AllToAll`, the dispatch) or replicated (sliced
#: for free). ``otherwise``: every other layer follows the data-parallel rule of its family (the
#: tokens are independent: a split of the batch or rows is kept). A split the next layer cannot
#: take is gathered, as on every strict axis.
EXPERT_RULE = {
    "expert_gemm": {"S(experts)": ("S(experts)", None), "S(other)": ("S(experts)", "all_to_all"),
                    "R": ("S(experts)", None)},
    "otherwise": "dp",
}


@dataclass(frozen=True)
class ShardDecision:
    """A family's answer for one layer on one mesh axis.

    ``output``: the output's placement; ``split``: what the layer does (``"col"``, ``"row"``:
    GEMM column/row parallel, ``"split"``: the layer runs on blocks, ``"rep"``: whole);
    ``before``: actions in issue order; ``gather_all``: every activation input is made
    replicated after ``before``; ``partial_elem``: bytes per element of the partial sums a
    ``P`` output holds (None: the output's element size; inherit: ``P`` carried from input 0);
    ``partial_exact``: integer partial sums.
    """

    output: Placement = REPLICATE
    split: str = "rep"
    before: tuple = ()
    gather_all: bool = False
    partial_elem: int | None = None
    partial_exact: bool = False
    inherit_partial: bool = False


@dataclass(frozen=True)
class ShardContext:
    """What a rule may read: the program, every tensor's full shape, the mesh axis, and
    ``row_pays(layer, tid)`` (whether a row-parallel GEMM on ``tid`` beats gathering it)."""

    program: Any
    full: list = field(repr=False)
    axis: MeshAxis
    row_pays: Callable[[Any, int], bool] = field(repr=False)

    @property
    def size(self) -> int:
        return self.axis.size

    def acts(self, layer) -> list[int]:
        """The layer's activation (non-constant) inputs, in order."""
        t = self.program.tensors
        return [tid for tid in layer.inputs if t[tid].role != "const"]


def part(n: int, parts: int) -> int:
    """Extent one chip holds of an axis of ``n`` split ``parts`` ways: the largest block (uneven
    splits give the last chips one fewer; the timing follows the largest, the slowest chip)."""
    return -(-int(n) // parts)


def reshape_axis(src: list[int], dst: list[int], axis: int, parts: int) -> int | None:
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


class ShardingRule:
    """How a family's layers are placed over a mesh axis (see the module docstring).

    :meth:`propagate` is the rule; the other hooks are what the propagator and the mapper need
    beside it. Defaults: no partial sums accepted, constants shrunk along the output's split,
    no KV-cache operand, attributes unchanged.
    """

    def propagate(self, ctx: ShardContext, layer, ins: list[Placement]) -> ShardDecision:
        """The decision for ``layer`` whose activation inputs are placed ``ins`` on
        ``ctx.axis``."""
        raise NotImplementedError

    def accepts_partial(self, layer) -> bool:
        """Whether partial-sum inputs are carried through (a relabelling of the elements)
        rather than all-reduced first."""
        return False

    def passes_reduction(self, program, layer) -> bool:
        """Whether a reduction-split input may pass through this layer, unchanged in shape,
        on its way to a weight GEMM's reduction axis (point-wise layers)."""
        return False

    def reduction_reader(self, program, layer, tid: int) -> bool:
        """Whether ``layer`` reads ``tid`` only on the reduction axis of a constant weight."""
        return False

    def cache_operand(self, layer, pos: int) -> bool:
        """Whether input ``pos`` of ``layer`` may be state kept split between calls (the
        second operand of attention's matmuls: a KV cache)."""
        return False

    def shrinks_row_consts(self, layer) -> bool:
        """Whether constants along a row split (``sp``) shrink with the output (a position
        embedding added to row blocks); not for weights or per-feature constants."""
        return True

    def const_shape(self, layer, tid: int, split: str, parts: int, full: list) -> list[int] | None:
        """The shape one chip holds of constant ``tid`` of a tensor-split layer, or None for the
        generic rule (constants along the output's split shrink)."""
        return None

    def local_attrs(self, layer, split: str, parts: int) -> dict | None:
        """The layer's attributes on one chip of a ``split`` layer, or None (unchanged)."""
        return None

    def expert_weight(self, program, layer) -> "int | None":
        """The constant of ``layer`` stacked over a leading expert axis (an expert GEMM of
        :data:`EXPERT_RULE`), or None: only GEMM families have one."""
        return None

    def experts(self, ctx: ShardContext, layer, ins: list[Placement]) -> ShardDecision:
        """The decision on the expert axis (``ep``, :data:`EXPERT_RULE`): an expert GEMM runs
        split along its experts (:meth:`expert_weight`), its activation re-split there by an
        all-to-all where it is split along another axis; every other layer takes its family's
        data-parallel decision (:meth:`propagate` on the axis as ``dp``)."""
        tid = self.expert_weight(ctx.program, layer)
        acts = ctx.acts(layer)
        full = ctx.full
        if tid is not None and acts:
            experts = full[tid][0]
            out = full[layer.output]
            if len(out) >= 3 and out[0] == experts and experts % ctx.size == 0 and full[acts[0]][0] == experts:
                first = ins[0]
                key = "S(experts)" if first.split and first.axis == 0 else "S(other)" if first.split else "R"
                placed, action = EXPERT_RULE["expert_gemm"][key]
                before = (AllToAll(0, 0),) if action == "all_to_all" else ()
                return ShardDecision(shard(0) if placed == "S(experts)" else REPLICATE, "split", before)
        dp = ShardContext(ctx.program, full, MeshAxis(EXPERT_RULE["otherwise"], ctx.size, strict=True,
                                                      gather_outputs=False), ctx.row_pays)
        return self.propagate(dp, layer, ins)


class PointwiseRule(ShardingRule):
    """Element-wise layers: the output follows the operands' common split (an ``R`` operand, or
    one broadcast along the split axis, is sliced for free); otherwise everything is gathered."""

    def propagate(self, ctx, layer, ins):
        full = ctx.full
        acts = ctx.acts(layer)
        out = layer.output
        rank = len(full[out])
        axes = {(s.axis - len(full[tid])) for tid, s in zip(acts, ins) if s.split}
        ax = axes.pop() if len(axes) == 1 else None
        ok = ax is not None and rank >= -ax and all(
            s.split or len(full[tid]) < -ax or full[tid][ax] in (1, full[out][ax])
            for tid, s in zip(acts, ins))
        if ok:
            return ShardDecision(shard(rank + ax), "split")
        return ShardDecision(REPLICATE, "rep", gather_all=True)

    def passes_reduction(self, program, layer):
        return True
