"""The contract of an operator family: every stage's knowledge of a group of layer kinds.

An :class:`OpFamily` holds, for the layer kinds it names, what each stage of the compiler and
the runtime needs to know about them, so that adding or changing an operator touches one
module (:mod:`tvm_spinn.program.ops`). The stages stay generic drivers that look the family up
by layer kind (:func:`family_of`):

============================  =================================================================
stage                          hooks
============================  =================================================================
partition (relax patterns)     :meth:`~OpFamily.patterns`, the check of each pattern
codegen (relax -> Layer)       :meth:`~OpFamily.lower`
program validation             :meth:`~OpFamily.attr_schema`, :meth:`~OpFamily.check`
tiles as data                  :attr:`~OpFamily.tile_arity`, :meth:`~OpFamily.region_extent`,
                               :meth:`~OpFamily.expand_regions`
mapping (work, tiles, costs)   :meth:`~OpFamily.work`, :meth:`~OpFamily.smallest_tile_bytes`,
                               :meth:`~OpFamily.choose_tile`, :meth:`~OpFamily.tile_costs`
functional simulator           :meth:`~OpFamily.prepare_tiles` / :meth:`~OpFamily.run_tile`
                               (tile by tile, the reference), :meth:`~OpFamily.run_whole` and
                               :meth:`~OpFamily.step` (whole layer; the step prepared once per
                               program)
============================  =================================================================

Families live under :mod:`tvm_spinn.program` so that the runtime, which may import only
``program``, reaches its kernels; the compiler-side hooks import ``tvm.relax`` inside the
functions that build patterns and lower calls, and receive the partitioner's and the codegen's
helpers as arguments instead of importing them (no import of a higher layer).
"""

from __future__ import annotations

import dataclasses

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..model import Layer, LayerDraft

if TYPE_CHECKING:  # the target package imports tvm: only annotations here
    from ...target.arch import SpinnArch

__all__ = ["OpFamily", "FlatFamily", "flat_tile", "MappingError", "LoweringError", "register", "unregister", "family_of", "families", "itemsize", "ceil_div",
           "gemm_tile_bytes", "working_budget", "starts", "WORKING_SHARE", "ACC_BYTES"]


class MappingError(ValueError):
    """A layer that cannot be mapped onto the chosen system (names the layer and the size)."""


class LoweringError(ValueError):
    """A composite function the spinn layer set cannot express (names the composite)."""


#: Bytes of one GEMM accumulator word in SRAM (fp32 sums; int32 partial sums of the MAC array).
ACC_BYTES = 4

#: Share of a PE's tile SRAM a tile's working buffers may take when a smaller tile also fits;
#: the rest is left to the memory planner for resident weights and on-chip activations.
WORKING_SHARE = 0.5


def ceil_div(a, b):
    """``ceil(a / b)`` for non-negative integers (or int64 arrays)."""
    return -(-a // b)


def itemsize(program, tid: int) -> int:
    """Bytes per element of tensor ``tid``."""
    return int(np.dtype(program.tensors[tid].dtype).itemsize)


def gemm_tile_bytes(tm, tn, tk, a_elem: int = 4, b_elem: int = 4):
    """SRAM of a ``tm x tn`` GEMM tile with reduction chunks of ``tk``: the A and B chunks
    double-buffered (the DMA of chunk i+1 overlaps the compute of chunk i) and the
    accumulators (ints or int64 arrays)."""
    return 2 * (a_elem * tm * tk + b_elem * tk * tn) + ACC_BYTES * tm * tn


def working_budget(arch: "SpinnArch") -> int:
    """SRAM a tile's working buffers may use (see :data:`WORKING_SHARE`); never below what the
    smallest useful GEMM tile (one MAC-array block, four blocks deep) needs."""
    smallest = gemm_tile_bytes(arch.mac_rows, arch.mac_cols, 4 * arch.mac_rows)
    return max(int(arch.tile_sram_bytes * WORKING_SHARE), min(arch.tile_sram_bytes, smallest))


def starts(extent: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``[lo, hi)`` of consecutive blocks of ``size`` covering ``[0, extent)``."""
    lo = np.arange(0, extent, size, dtype=np.int64)
    return lo, np.minimum(lo + size, extent)


class OpFamily:
    """Base of an operator family; the defaults describe a flat element-wise layer.

    Subclasses set :attr:`kinds` and override the hooks their kinds need. Hooks take the
    program and the layer (never a layer index) and return plain values; the stages keep the
    loops, the error context and the order of work.
    """

    #: Layer kinds (``Layer.kind``) this family defines.
    kinds: tuple[str, ...] = ()
    #: Output element ``e`` reads element ``e`` of every activation input of the output's size
    #: (and nothing else of it): with the same flat tiles as that input's producer, a tile
    #: reads only what its own PE wrote, and needs no barrier (:mod:`tvm_spinn.timing.model`).
    pointwise: bool = False
    #: Composite names (``spinn.<name>``) the family lowers when they differ from its kinds
    #: (e.g. ``add_relu`` becomes an ``add`` layer with ``relu``).
    composites: tuple[str, ...] = ()
    #: Layer modes the family's kinds run in (``"int8"``: on the MAC array).
    modes: tuple[str, ...] = ("fp32",)
    #: Integers in a tile shape of the family's layers (see :mod:`tvm_spinn.program.tiles`).
    tile_arity: int = 1
    #: Pattern precedence: families with lower numbers are matched first. A family whose
    #: patterns contain another family's operators (an int8 GEMM fuses dequantize, bias add,
    #: ReLU and quantize) must come before that family.
    priority: int = 50
    #: Whether a clip reading only a layer's result may run in the layer's epilogue (the
    #: simulator's plan then passes the clip to :meth:`step`).
    fuses_clip: bool = False
    #: The family only moves data (reshapes, copies, slices): a program of such layers does no
    #: work that reads its inputs from DRAM beyond the copy (:mod:`tvm_spinn.timing.bounds`).
    moves_data: bool = False
    #: How the family's layers are placed over a mesh axis of chips
    #: (:class:`~tvm_spinn.program.ops.sharding.ShardingRule`); None: no rule (see
    #: :mod:`tvm_spinn.mapping.shard` for what the mapper does then).
    sharding: Any = None

    # -- partition and codegen (compiler side) ---------------------------------------------
    def patterns(self, kit: Any) -> list[tuple]:
        """``(name, pattern, annotations, check)`` entries for ``FuseOpsByPattern``, most
        specific first; ``kit`` is the partitioner's helper (:class:`~tvm_spinn.partition.
        patterns.PatternKit`: pattern builders, operand checks, the fallback-reason log)."""
        return []

    def lowers(self, composite: str) -> bool:
        """Whether this family lowers the composite ``spinn.<composite>`` (by default its
        :attr:`composites`, else its kinds)."""
        return composite in (self.composites or self.kinds)

    def lower(self, lowerer: Any, name: str, kind: str, calls: list, env: dict, layer: LayerDraft) -> None:
        """Fill the draft ``layer`` (kind, inputs, consts, attrs) from the composite ``name`` (``kind``:
        its name without ``spinn.``) whose ``calls`` are ``(var, call)`` in order, the main call
        first; ``lowerer`` is the codegen's (``operand(expr, env)``, ``add_const(name, value)``,
        ``program``). Raises :class:`LoweringError` for what the layer cannot express."""
        raise LoweringError(f"composite {name} has no spinn layer lowering")

    # -- program validation -----------------------------------------------------------------
    def attr_schema(self, kind: str, mode: str) -> tuple[dict[str, Callable], dict[str, Callable]]:
        """``(required, optional)`` attribute checkers of ``kind`` in ``mode``."""
        return {}, {}

    def check(self, v: Any, f: str, kind: str, mode: str, ins: list[int], consts: dict,
              out: int, attrs: dict) -> tuple[tuple[int, ...], list[int] | None]:
        """Check one layer's operands with the validator ``v``; return its tile index space and
        GEMM ``[m, n, k]`` (or None)."""
        raise NotImplementedError

    # -- tiles as data ------------------------------------------------------------------------
    def region_extent(self, program, layer: Layer) -> tuple[int, ...]:
        """The output space the layer's tiles partition: here the flattened output."""
        return (int(np.prod(program.tensors[layer.output].shape, dtype=np.int64)),)

    def expand_regions(self, program, layer: Layer, tile) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(lo, hi, group)`` of every tile cut by ``tile``: int64 ``[T, D]``, ``[T, D]``,
        ``[T]`` in tile order (``group`` -1: no shared weight block)."""
        e0, e1 = starts(self.region_extent(program, layer)[0], int(tile[0]))
        return e0[:, None], e1[:, None], np.full(len(e0), -1, dtype=np.int64)

    def is_view(self, program, layer: Layer) -> bool:
        """Whether the output holds the input's bytes in the same order (a relabelling): its
        consumers' DMA reads the producer's buffer in place, so the layer moves nothing and
        the timing model gives it no cycles and no barrier. The functional simulator still
        runs it (the values are the same either way)."""
        return False

    # -- operand traffic and residency (timing, system mapping) -------------------------------
    def weight_region_axis(self, layer: Layer) -> int | None:
        """The region axis along which a tile's weight operand varies while its input block stays
        the same (tiles differing only along it share one input block), or None."""
        return None

    def streamed_inputs(self, program, layer: Layer) -> list[int]:
        """The activation inputs whose bytes a tile's ``in_bytes`` count (by default all)."""
        return [tid for tid in layer.inputs if program.tensors[tid].role != "const"]

    def view_keeps_order(self, layer: Layer) -> bool:
        """Whether a view layer's output elements are written in its input's order (a slice
        is not: a later reader waits for the whole input)."""
        return True

    def aliases_input(self, program, layer: Layer) -> bool:
        """Whether the output holds the one activation input's bytes (same size, a relabelling):
        a collective of the output may start once the input is written."""
        return False

    def gathered_table(self, layer: Layer) -> int | None:
        """The constant table the layer reads only by the rows it gathers (an embedding), or
        None."""
        return None

    def layouts(self, layer: Layer) -> frozenset[str]:
        """The alternative tile layouts the mapper may try for the layer
        (:mod:`tvm_spinn.mapping.schedule`): ``"resident"`` (weight blocks spread for residency),
        ``"split_k"`` (the reduction split over PEs, integer sums), ``"one_round"`` (tiles re-cut
        to run in one round per PE, fp32 sums on one PE)."""
        return frozenset()

    def quantizes(self, layer: Layer) -> bool:
        """Whether the layer quantizes an activation (the prologue of an int8 GEMM)."""
        return False

    def weight_gemm(self, layer: Layer) -> bool:
        """Whether the layer is a GEMM of an activation by a constant weight (``dense``)."""
        return False

    def activation_gemm(self, layer: Layer) -> bool:
        """Whether the layer is a GEMM of two activations (``matmul``: the attention's scores
        and context), not of an activation by a constant weight."""
        return False

    def sums_inputs(self, layer: Layer) -> bool:
        """Whether the layer's output is the element-wise sum of its inputs and nothing more
        (a plain ``add``: a residual add the LLM planner cuts a block's slice at)."""
        return False

    def sums_squares_first(self, layer: Layer) -> bool:
        """Whether the layer is a row kernel whose first phase sums its row's squares into a
        chain of block sums (``rms_norm``: what an all-reduce's delivery may run ahead of it)."""
        return False

    def k_splits(self, program, layer: Layer, tile) -> int:
        """Reduction chunks each tile streams through its PE (1: no reduction split)."""
        return 1

    def check_mapping(self, arch: "SpinnArch", f: str, mode: str, k: int | None, tile) -> None:
        """Reject a recorded tile shape the hardware cannot run (field ``f``; ``k``: the GEMM
        reduction, or None)."""

    # -- mapping ------------------------------------------------------------------------------
    def work(self, program, layer: Layer, arch: "SpinnArch") -> tuple[int, list[int] | None]:
        """``(flops, gemm)``: operations of the layer (the cost model's work) and its GEMM
        ``[m, n, k]`` (None for non-GEMM kinds)."""
        raise NotImplementedError

    def smallest_tile_bytes(self, program, layer: Layer, arch: "SpinnArch") -> int:
        """SRAM of the smallest tile the layer can be cut into (the partition's checks and the
        tiler use the same rule, so what the partition accepts always tiles)."""
        ie = sum(itemsize(program, tid) for tid in layer.inputs)
        return 2 * (ie + itemsize(program, layer.output))

    def choose_tile(self, program, layer: Layer, arch: "SpinnArch", pes: int,
                    naive: bool) -> list[int]:
        """The tile shape for ``pes`` PEs (the smallest tile is known to fit)."""
        raise NotImplementedError

    def tile_costs(self, program, layer: Layer, arch: "SpinnArch", tile,
                   lo: np.ndarray, hi: np.ndarray) -> tuple:
        """``(sram, in, w, out, cycles)`` per tile (scalars or int64 arrays over the tiles
        ``[lo, hi)`` cut by ``tile``)."""
        raise NotImplementedError

    # -- functional simulator -----------------------------------------------------------------
    def prepare_tiles(self, runner: Any) -> None:
        """Lay out the operands for tile-by-tile execution on ``runner`` (the simulator's
        ``_LayerRunner``: ``p``, ``layer``, ``env``, ``out``)."""

    def run_tile(self, runner: Any, tile) -> None:
        """Execute one tile (``tile.region``, ``tile.k_splits``) into ``runner.out``."""
        raise NotImplementedError

    def run_whole(self, program, index: int, layer: Layer, env, out: np.ndarray) -> np.ndarray | None:
        """The whole layer's output (``out``, an empty array of the output's shape and dtype,
        filled, or a view holding the same values); None where the simulator runs the whole
        output as one tile instead (:meth:`whole_region`, :meth:`run_tile`)."""
        return None

    def whole_region(self, layer: Layer, out: np.ndarray) -> tuple:
        """The region of a pseudo-tile covering the whole output (see :meth:`run_tile`)."""
        return ((0, out.size),)

    def step(self, program, layer: Layer) -> Callable | None:
        """A prepared whole-layer step ``step(program, env) -> output``, or None where the
        simulator's generic path (the whole output as one tile) must run."""
        return None

    def native(self, program, layer: Layer, nb, clip: Layer | None = None) -> bool:
        """Describe the whole layer to ``nb`` (a :class:`~.native.NativeBuilder`) with the
        arithmetic of :meth:`step`, and return True; or return False, having emitted nothing,
        where the layer must run in Python. ``clip``: a clip layer the step would fuse
        (:attr:`fuses_clip`). The default: False."""
        return False


_FAMILIES: dict[str, OpFamily] = {}


def register(family: OpFamily) -> OpFamily:
    """Register ``family`` for its kinds (each kind has exactly one family)."""
    for kind in family.kinds:
        owner = _FAMILIES.get(kind)
        if owner is not None and owner is not family:
            raise ValueError(f"layer kind {kind!r} is already defined by {type(owner).__name__}")
        _FAMILIES[kind] = family
    return family


def unregister(family: OpFamily) -> None:
    """Remove ``family``'s kinds from the registry (for families registered by tests)."""
    for kind in family.kinds:
        if _FAMILIES.get(kind) is family:
            del _FAMILIES[kind]


def family_of(kind: str) -> OpFamily | None:
    """The family defining layer kind ``kind``, or None (a kind not yet moved to a family)."""
    return _FAMILIES.get(kind)


def families() -> list[OpFamily]:
    """Every registered family, once each, by :attr:`OpFamily.priority` (then registration)."""
    seen: list[OpFamily] = []
    for family in _FAMILIES.values():
        if family not in seen:
            seen.append(family)
    return sorted(seen, key=lambda family: family.priority)


class FlatFamily(OpFamily):
    """A family whose tiles are runs of the flattened output (element-wise work, data movement):
    tiles sized by :func:`flat_tile`, costed by :meth:`cycles_per_element`."""

    def cycles_per_element(self, layer: Layer, arch: "SpinnArch") -> float:
        """Cycles per output element."""
        return arch.m4f_elementwise_cycles

    def fixed_cycles(self, layer: Layer, arch: "SpinnArch") -> float:
        """Cycles of a tile besides its elements: one job of the PE's job loop."""
        return arch.m4f_job_cycles

    def choose_tile(self, program, layer, arch, pes, naive):
        return [flat_tile(program, layer, arch, pes)]

    def tile_costs(self, program, layer, arch, tile, lo, hi):
        ie = sum(itemsize(program, tid) for tid in layer.inputs)
        oe = itemsize(program, layer.output)
        e = (hi - lo)[:, 0]
        cycles = np.ceil(e * self.cycles_per_element(layer, arch) + self.fixed_cycles(layer, arch))
        return 2 * (ie + oe) * e, ie * e, 0, oe * e, cycles

    @staticmethod
    def broadcast_inputs(runner) -> None:
        """``runner.flat_in``: each input broadcast to the output's shape and flattened, so that a
        tile's run of output elements indexes every operand alike (the element-wise kinds)."""
        shape = runner.out.shape
        runner.flat_in = [np.ascontiguousarray(np.broadcast_to(runner.env[i], shape)).reshape(-1)
                          for i in runner.layer.inputs]


class ComputedFlat(FlatFamily):
    """A flat family whose layer's values come whole from :meth:`values` (a gather, a pooling
    gradient): the simulator's tiles copy their runs of the flattened result, so every tiling
    gives the values' bits."""

    def values(self, layer: Layer, env) -> np.ndarray:
        """The layer's output values (any layout numpy can flatten)."""
        raise NotImplementedError

    def prepare_tiles(self, runner) -> None:
        runner.flat_in = [np.ascontiguousarray(self.values(runner.layer, runner.env)).reshape(-1)]

    def run_tile(self, runner, tile) -> None:
        (e0, e1), = tile.region
        runner.out.reshape(-1)[e0:e1] = runner.flat_in[0][e0:e1]

    def run_whole(self, program, index, layer, env, out):
        out[...] = self.values(layer, env)
        return out

    def step(self, program, layer):
        return lambda program, env: np.ascontiguousarray(self.values(layer, env))


def flat_tile(program, layer: Layer, arch: "SpinnArch", pes: int) -> int:
    """Elements per tile of a flat layer: double-buffered inputs and output, spread over the
    PEs but never beyond the working SRAM."""
    total = int(np.prod(program.tensors[layer.output].shape, dtype=np.int64))
    per_elem = sum(itemsize(program, tid) for tid in layer.inputs) + itemsize(program, layer.output)
    cap = max(1, working_budget(arch) // (2 * per_elem))
    return max(1, min(cap, ceil_div(total, pes)))


def dedupe_layers(program, layers: list, key_of) -> list:
    """``layers`` without the repeats of an earlier layer: a layer whose ``key_of(layer)`` (None:
    never merged) equals an earlier one's, and whose output is not one of ``program``'s outputs,
    is dropped and its readers read the first one's output (inputs renamed as the walk goes, so
    a chain of repeats collapses)."""
    seen, alias, out = {}, {}, []
    for layer in layers:
        layer = dataclasses.replace(layer, inputs=[alias.get(t, t) for t in layer.inputs])
        key = key_of(layer) if layer.output not in program.outputs else None
        if key is not None:
            if key in seen:
                alias[layer.output] = seen[key]
                continue
            seen[key] = layer.output
        out.append(layer)
    return out

