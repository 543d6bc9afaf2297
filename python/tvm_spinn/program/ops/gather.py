"""Gathers: ``take`` (an embedding lookup: rows of a table picked by integer indices).

- Arithmetic: none; each output element is one table element, fetched by the DMA engine from
  where the table lives (a model's embedding table is a constant in DRAM; only the gathered
  rows move). A tile's PE code resolves each index it uses (the mode's checks) and hands the
  engine one descriptor per run of one gathered row's elements (a segment); the timing model
  charges that code's run, its indices and segments (:data:`TAKE_CODE_RUN`,
  :data:`TAKE_CODE_INDEX`, :data:`TAKE_CODE_SEGMENT`: :func:`take_tile_cycles`) and the
  engine's element a cycle, the index bytes once per gathered slice, and the table bytes
  actually read.
- Indices are int32 (TVM's PyTorch importer casts token ids to int32 before ``take``).
  ``mode`` is TVM's: ``clip`` clamps an index into range, ``wrap`` takes it modulo the extent,
  and ``fast`` promises that every index is in ``[0, extent)``; TVM's ``fast`` kernel reads out of
  bounds when the promise is broken, the simulator raises an ``IndexError`` naming the layer,
  the index and the extent instead (and a ``take`` left on the fallback, e.g. with int64
  indices, has its indices checked first: :mod:`tvm_spinn.runtime.checked_take`).
- The table is the layer's ``table`` constant, or its first input when it is computed.
- Tiles: ``[elements]`` over the flattened output.
"""

from __future__ import annotations

import math

import numpy as np

from ..checks import check_int, fail
from ..model import Layer
from .base import ComputedFlat, itemsize, register
from .m4f import Mix, mix_cycles
from .sharding import REPLICATE, GatherInput, ShardDecision, ShardingRule, shard

__all__ = ["Gather", "gather", "TAKE_CODE_RUN", "TAKE_CODE_INDEX", "TAKE_CODE_SEGMENT", "take_tile_cycles"]

MODES = ("fast", "clip", "wrap")
#: table dtypes a gather moves (bytes are bytes)
TABLE_DTYPES = ("float32", "int8", "uint8")


#: The ``take`` PE kernel (:mod:`tvm_spinn.pe.kernels`) as it executes, by instruction class (loads
#: and stores unpaired and pipelined, integer instructions, taken branches), counted on its
#: executed blocks at 1 and 9 indices and 1 and 9 segments (per index and per segment: the
#: difference over 8) and priced by :func:`~.m4f.mix_cycles`: per run of a tile (start-up, the
#: job, the kernel's entry and exit, the DMA driver's), per index by mode (``fast``: the range
#: check; ``clip``: two compares and selects; ``wrap``: an SDIV, priced as the ISS prices it,
#: the TRM's worst case of 12 cycles, as integer cycles) and per segment (its row offset added
#: to its descriptor's source, the descriptor's words copied into the engine's registers, the
#: start, the poll). Indices in range; the other paths differ by a few cycles.
TAKE_CODE_RUN = Mix(loads=15.25, paired=41.75, alu=28.0, branches=4.0)
TAKE_CODE_INDEX = {"fast": Mix(loads=1.75, paired=0.25, alu=5.875, branches=0.875),
                   "clip": Mix(loads=1.5, alu=9.0),
                   "wrap": Mix(loads=1.5, paired=0.25, alu=7.125 + 12.0)}
TAKE_CODE_SEGMENT = Mix(loads=9.0, paired=24.0, alu=11.0, branches=3.0)


def take_tile_cycles(lo, hi, inner: int, count: int, mode: str, arch) -> np.ndarray:
    """Cycles of ``take`` tiles ``[lo, hi)`` (flat output ranges, int arrays) of a table whose
    gathered rows hold ``inner`` elements, with ``count`` indices: the PE code's run, the
    indices the tile uses (distinct among its consecutive (outer, index) slots, at most
    ``count``), its segments (one per slot it touches) and the DMA engine's element a cycle,
    which the M4F waits for."""
    from .movement import DMA_ELEMENT_CYCLES
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    inner = max(int(inner), 1)
    segments = np.where(hi > lo, (hi - 1) // inner - lo // inner + 1, 0)
    used = np.minimum(segments, max(int(count), 1))
    return (mix_cycles(TAKE_CODE_RUN, arch) + used * mix_cycles(TAKE_CODE_INDEX[mode], arch)
            + segments * mix_cycles(TAKE_CODE_SEGMENT, arch) + DMA_ELEMENT_CYCLES * (hi - lo))


def _mode(v, field: str) -> str:
    if v not in MODES:
        fail(field, f"expected one of {MODES}, got {v!r:.40}")
    return v


def gather(layer: Layer, table: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``take(table, indices, axis)`` with the layer's index mode (a new array)."""
    axis, mode = layer.attrs["axis"], layer.attrs.get("mode", "fast")
    extent = table.shape[axis]
    idx = indices.astype(np.int64, copy=False)
    if mode == "clip":
        idx = np.clip(idx, 0, extent - 1)
    elif mode == "wrap":
        idx = np.mod(idx, extent)
    elif idx.size and (idx.min() < 0 or idx.max() >= extent):  # fast: [0, extent) promised
        bad = int(idx[(idx < 0) | (idx >= extent)].reshape(-1)[0])
        raise IndexError(f"{layer.name}: take index {bad} is out of range for axis {axis} of extent {extent}")
    return np.take(table, idx, axis=axis)


class Gather(ComputedFlat):
    """``take`` of a table (constant or computed) by int32 indices."""

    kinds = ("take",)
    priority = 58

    # -- partition and codegen ---------------------------------------------------------------
    def patterns(self, kit) -> list[tuple]:
        from tvm.relax.dpl import is_op, wildcard

        table, indices = wildcard(), wildcard()
        root = is_op("relax.take")(table, indices)
        return [kit.entry("spinn.take", root, {"table": table, "indices": indices, "root": root}, self._check_pattern)]

    @staticmethod
    def _check_pattern(kit, op: str, ctx) -> bool:
        root = ctx.annotated_expr["root"]
        if str(root.attrs.mode) not in MODES:
            return kit.refuse(op, root, f"take mode {root.attrs.mode!r}")
        if not kit.check_tensors(op, ctx, ("table",), TABLE_DTYPES):
            return False
        indices = ctx.annotated_expr["indices"]
        if kit.static_shape(indices) is None or kit.dtype(indices) != "int32":
            return kit.refuse(op, root, f"indices of dtype {kit.dtype(indices)} (int32 with a static shape is supported)")
        return kit.check_nonempty(op, root, "indices", indices)

    def lower(self, lowerer, name: str, kind: str, calls: list, env: dict, layer: Layer) -> None:
        from tvm.ir.expr import Constant

        call = calls[0][1]
        table, indices = call.args
        rank = len(table.ty.shape)
        axis = int(call.attrs.axis) if call.attrs.axis is not None else 0
        layer.attrs["axis"] = axis + rank if axis < 0 else axis
        layer.attrs["mode"] = str(call.attrs.mode)
        if isinstance(table, Constant):  # an embedding table: a weight, read where it lives
            layer.consts["table"] = lowerer.operand(table, env)
            layer.inputs = [lowerer.operand(indices, env)]
        else:
            layer.inputs = [lowerer.operand(table, env), lowerer.operand(indices, env)]

    # -- validation -----------------------------------------------------------------------------
    def attr_schema(self, kind: str, mode: str):
        return {"axis": lambda v, f: check_int(v, f, 0), "mode": _mode}, {}

    def check(self, v, f, kind, mode, ins, consts, out, attrs):
        v.consts(f, consts, set(), {"table"})
        v.need(f"{f}.inputs", kind, ins, 1 if "table" in consts else 2)
        table = consts["table"] if "table" in consts else ins[0]
        indices = ins[-1]
        v.dtype(f"{f}.table", table, TABLE_DTYPES)
        v.dtype(f"{f}.indices", indices, ("int32",))
        v.dtype(f"{f}.output", out, (v.dtypes[table],))
        tshape, ishape = v.shapes[table], v.shapes[indices]
        axis = attrs["axis"]
        if axis >= len(tshape):
            fail(f"{f}.attrs.axis", f"{axis} is not an axis of the table {tshape}")
        v.shape(f"{f}.output", out, tshape[:axis] + ishape + tshape[axis + 1:])
        return (math.prod(v.shapes[out]),), None

    # -- mapping ------------------------------------------------------------------------------
    def work(self, program, layer, arch):
        return 0, None

    def cycles_per_element(self, layer, arch):
        """Not a per-element price: a tile's cycles depend on its indices and segments
        (:func:`take_tile_cycles`), so the flat families' per-element hook refuses."""
        raise NotImplementedError(f"{type(self).__name__} prices tiles by take_tile_cycles, "
                                  f"not per element ({layer.kind!r})")

    def _table(self, layer: Layer) -> int:
        return layer.consts["table"] if "table" in layer.consts else layer.inputs[0]

    def smallest_tile_bytes(self, program, layer, arch):
        return 2 * (itemsize(program, self._table(layer)) + itemsize(program, layer.inputs[-1])
                    + itemsize(program, layer.output))

    def tile_costs(self, program, layer, arch, tile, lo, hi):
        """Per output element: one table element read (from the table's home: a constant
        table counts as weight bytes), one written; an index per gathered slice; the PE code's
        run, indices and segments and the engine's element a cycle (:func:`take_tile_cycles`)."""
        table = self._table(layer)
        te, oe = itemsize(program, table), itemsize(program, layer.output)
        axis = layer.attrs["axis"]
        inner = max(1, math.prod(program.tensors[table].shape[axis + 1:]))
        e = (hi - lo)[:, 0]
        index_bytes = np.ceil(e / inner).astype(np.int64) * itemsize(program, layer.inputs[-1])
        table_bytes = te * e
        in_bytes, w_bytes = (index_bytes, table_bytes) if "table" in layer.consts else (index_bytes + table_bytes, 0)
        count = math.prod(program.tensors[layer.inputs[-1]].shape)
        cycles = np.ceil(take_tile_cycles(lo[:, 0], hi[:, 0], inner, count, layer.attrs.get("mode", "fast"), arch))
        return 2 * (te + oe) * e, in_bytes, w_bytes, oe * e, cycles

    # -- functional simulator -----------------------------------------------------------------
    def gathered_table(self, layer: Layer) -> int | None:
        return layer.consts.get("table")

    def values(self, layer: Layer, env) -> np.ndarray:
        return gather(layer, env[self._table(layer)], env[layer.inputs[-1]])

    def native(self, program, layer, nb, clip=None):
        """One ``gather`` instruction: the rows :func:`gather` takes, its index modes, and in
        ``fast`` mode an IndexError naming the layer (the native run reports the layer index,
        the simulator's plan its name)."""
        tensors = program.tensors
        table, indices = self._table(layer), layer.inputs[-1]
        item = np.dtype(tensors[table].dtype).itemsize
        if tensors[indices].dtype != "int32" or item not in (1, 2, 4, 8):
            return False
        shape = [int(d) for d in tensors[table].shape]
        axis = int(layer.attrs["axis"])
        count = math.prod(int(d) for d in tensors[indices].shape)
        mode = MODES.index(layer.attrs.get("mode", "fast"))
        nb.emit("gather", nb.read(table), nb.read(indices), nb.write(layer.output), item, math.prod(shape[:axis]),
                shape[axis], math.prod(shape[axis + 1:]), count, mode, program.layers.index(layer), axis)
        return True


class GatherSharding(ShardingRule):
    """``take(table, indices, axis)``: the output is ``table.shape[:axis] + indices.shape +
    table.shape[axis + 1:]``. A split of the indices carries to the output axis ``axis + a``; a
    split of the table on another axis carries to where that axis lands; a table split along
    the gathered axis is gathered (any chip's index may point into any block), and so is
    everything when both are split. On row blocks (``sp``) a gather of table rows by replicated
    indices splits the indices' rows: each block gathers its own."""

    def propagate(self, ctx, layer, ins):
        shape = ctx.full[layer.output]
        if ctx.axis.name == "sp":
            if all(not s.split for s in ins) and layer.attrs.get("axis", 0) == 0 and len(shape) >= 2 \
                    and shape[0] >= ctx.size:
                return ShardDecision(shard(0), "split")
            return ShardDecision(REPLICATE, "rep", gather_all=True)
        axis = layer.attrs.get("axis", 0)
        acts = ctx.acts(layer)
        if "table" in layer.consts:  # the indices are the one activation
            table, indices, n_idx = REPLICATE, ins[0], len(ctx.full[acts[0]])
        else:
            table, indices, n_idx = ins[0], ins[1], len(ctx.full[acts[1]])
        before = ()
        if table.split and table.axis == axis:
            before, table = (GatherInput(0),), REPLICATE
        if table.split and indices.split:
            return ShardDecision(REPLICATE, "rep", before, gather_all=True)
        if table.split:
            out = table.axis if table.axis < axis else table.axis + n_idx - 1
        elif indices.split:
            out = axis + indices.axis
        else:
            return ShardDecision(REPLICATE, "rep", before)
        return ShardDecision(shard(out), "split", before)

    def shrinks_row_consts(self, layer):
        return False  # the table is indexed, not split


Gather.sharding = GatherSharding()
register(Gather())
