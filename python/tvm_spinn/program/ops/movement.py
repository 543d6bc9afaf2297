"""Data movement: ``reshape`` (also what ``expand_dims`` and ``squeeze`` lower to),
``permute_dims``, ``broadcast_to``, ``strided_slice``, ``concat`` and constant ``pad``, of any
dtype a program holds (bytes are bytes: int8 activations move like float32 ones; ``pad`` is
float32 only, its fill value being a float).

- Arithmetic: none; the DMA engine gathers with strides (one element read per element written).
  A tile of a strided view of the input (:data:`STRIDED_KINDS`) is a few strided descriptors
  (:func:`dma_descriptors`) that the PE's M4F hands the engine one after another; its cycles are
  the PE code's run and descriptors (:data:`DMA_CODE_RUN`, :data:`DMA_CODE_DESCRIPTOR`) and
  :data:`DMA_ELEMENT_CYCLES` per element. ``concat`` and ``pad`` write each input into a
  strided view of the output (:data:`SCATTER_KINDS`, :func:`scatter_targets`): a tile is, per
  input, the scatter descriptors of the input's elements that land in it
  (:func:`scatter_range`), after one constant-fill descriptor where a ``pad`` tile holds fill
  elements; the same code and rates (:func:`scatter_tile_cycles`). A reshape of a contiguous
  value is a relabelling.
- ``strided_slice`` holds, per sliced axis, the first index and the step (``begin``,
  ``strides``, normalized by the compiler to an in-range start); the output's extent on the axis
  is the element count. ``concat`` joins its inputs along ``axis``. ``pad`` (``nn.pad`` in
  constant mode) holds ``pad_width`` (before and after, per axis, as Relax's) and ``value``:
  the output holds the fill value (its bits: -0.0 stays -0.0), then the input is copied into
  its middle (natively a ``fill`` then a ``copy``; on a PE a fill descriptor then the
  input's scatter descriptors).
- Tiles: ``[elements]`` over the flattened output.
"""

from __future__ import annotations

import math

import numpy as np

from ..checks import check_int, check_list, check_num, fail
from . import native
from .base import itemsize
from ..model import Layer
from .base import FlatFamily, LoweringError, MappingError, dedupe_layers, register
from .m4f import Mix, mix_cycles
from .sharding import PARTIAL, REPLICATE, GatherInput, PointwiseRule, ShardDecision, reshape_axis, shard

__all__ = ["Movement", "dedupe_movement", "STRIDED_KINDS", "SCATTER_KINDS", "DMA_DIMS", "DMA_ELEMENT_CYCLES",
           "ShapeMismatch", "strided_source", "scatter_targets", "scatter_range",
           "dma_descriptors", "dma_descriptor_count", "DMA_CODE_RUN", "DMA_CODE_DESCRIPTOR", "strided_tile_cycles",
           "scatter_tile_cycles"]


def _axes(v, field: str) -> list[int]:
    return [check_int(x, f"{field}[{i}]", 0) for i, x in enumerate(check_list(v, field))]


#: ``concat`` patterns cover this many inputs (a longer concat stays on the host): 9 is a 3x3
#: kernel's im2col (a training step's convolutions, ``tvm_spinn.training``).
MAX_CONCAT_INPUTS = 9


#: the kinds whose output is a strided view of their one input (a strided DMA descriptor per
#: box of a tile: :func:`strided_source`, :func:`dma_descriptors`)
STRIDED_KINDS = ("reshape", "permute_dims", "broadcast_to", "strided_slice")
#: the kinds that write each input into a strided view of their output (scatter descriptors:
#: :func:`scatter_targets`, :func:`scatter_range`; a ``pad`` fills its output first)
SCATTER_KINDS = ("concat", "pad")
#: axes of one strided DMA descriptor (element counts and source strides)
DMA_DIMS = 4
#: assumption: cycles of the DMA engine per element of a strided descriptor (the element's read
#: and its write pipelined; 4 bytes a cycle for float32, within ``dma_bw_bytes_per_cycle``)
DMA_ELEMENT_CYCLES = 1


class ShapeMismatch(ValueError):
    """A strided layer's input shape cannot give its output shape (:func:`strided_source`)."""


def strided_source(program, layer: Layer) -> "tuple[tuple[int, ...], tuple[int, ...], int] | None":
    """A layer of :data:`STRIDED_KINDS` as a strided view of its input: ``(dims, strides,
    offset)``, the output's extents (outermost first) and the input elements one step along each
    moves, with unit extents dropped and axes that step through the input as one merged; None for
    the other kinds (``concat``, ``pad``). Read from numpy's own view of the simulator's movement
    (:func:`moved`) on a stand-in input, so the map is the simulator's by construction."""
    if layer.kind not in STRIDED_KINDS:
        return None
    ishape = tuple(int(d) for d in program.tensors[layer.inputs[0]].shape)
    oshape = tuple(int(d) for d in program.tensors[layer.output].shape)
    x, base = _stand_in(ishape)  # the view's strides and start are the element map
    try:
        v = moved(layer, [x], oshape)
    except (ValueError, IndexError) as e:  # numpy's refusal: the input cannot give the output
        raise ShapeMismatch(f"layer {layer.name!r}: its input {ishape} does not move to its output {oshape}: "
                            f"{e}") from e
    if v.shape != oshape:
        raise ShapeMismatch(f"layer {layer.name!r}: its input {ishape} moves to {v.shape}, not its output {oshape}")
    # a copy's strides would not be the input's element map; ``x``, not ``base``: a view need not
    # address the input's first element (the one byte ``base`` holds)
    if v.size and not np.shares_memory(v, x):
        raise ValueError(f"layer {layer.name!r} ({layer.kind}): the movement returned a copy, not a view of "
                         "its input; its DMA source map cannot be read from it")
    offset = v.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return (*_merged(v), int(offset))


def placements(layer: Layer, shapes) -> list[tuple]:
    """The numpy index of the output where each input of a ``concat`` or ``pad`` lands (the
    simulator's movement writes them there: :func:`moved`, :func:`padded`); ``shapes``: the
    inputs' shapes."""
    if layer.kind == "pad":
        return [_interior(layer.attrs["pad_width"], shapes[0])]
    axis, start, out = layer.attrs["axis"], 0, []
    for shape in shapes:
        out.append((slice(None),) * axis + (slice(start, start + shape[axis]),))
        start += shape[axis]
    return out


def scatter_targets(program, layer: Layer) -> "list[tuple[tuple[int, ...], tuple[int, ...], int]] | None":
    """A layer of :data:`SCATTER_KINDS` as its inputs written into strided views of its output:
    per input ``(dims, strides, offset)``, the input's extents (outermost first, unit extents
    dropped, axes that step through the output as one merged) and the output elements one step
    along each moves, and the output element its first lands on; None for the other kinds. Read
    from numpy's views of a stand-in output at the inputs' :func:`placements`, so the map is the
    simulator's by construction. Raises :class:`ShapeMismatch` where an input does not fit its
    place (a shard's tensors)."""
    if layer.kind not in SCATTER_KINDS:
        return None
    oshape = tuple(int(d) for d in program.tensors[layer.output].shape)
    shapes = [tuple(int(d) for d in program.tensors[t].shape) for t in layer.inputs]
    out, base = _stand_in(oshape)
    targets = []
    for i, (shape, index) in enumerate(zip(shapes, placements(layer, shapes))):
        try:
            v = out[index]
        except IndexError as e:
            raise ShapeMismatch(f"layer {layer.name!r}: input {i} {shape} has no place in its output {oshape}: "
                                f"{e}") from e
        if v.shape != shape:
            raise ShapeMismatch(f"layer {layer.name!r}: input {i} {shape} meets {v.shape} of its output {oshape}")
        targets.append((*_merged(v), int(v.__array_interface__["data"][0] - base.__array_interface__["data"][0])))
    return targets


def scatter_range(dims, strides, offset: int, e) -> np.ndarray:
    """How many elements of an input written into the strided view ``(dims, strides, offset)``
    of the output (:func:`scatter_targets`) land before output element ``e`` (int array, or an
    int): the tile ``[e0, e1)`` holds the input's elements ``[scatter_range(e0),
    scatter_range(e1))``, since a view of positive strides each larger than its inner axes' span
    keeps row-major order. Axis by axis, the indices wholly before ``e`` are counted and the one
    ``e`` falls in is descended into."""
    r = np.atleast_1d(np.asarray(e, dtype=np.int64)) - int(offset)
    count = np.zeros(r.shape, dtype=np.int64)
    live = r > 0
    rank = len(dims)
    for k in range(rank):
        unit = math.prod(dims[k + 1:])
        q = np.where(live, r // strides[k], 0)
        count += np.where(live, np.minimum(q, dims[k]) * unit, 0)
        live &= q < dims[k]
        r = r - q * strides[k]
        live &= r > 0
    return count + live  # the last axis's element at ``e - r`` itself, where it lies before ``e``


def _merged(view: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A view's extents and strides (outermost first) with unit extents dropped and axes that
    step through memory as one merged (row-major order kept)."""
    dims, strides = [], []
    for d, st in zip(view.shape, view.strides):
        if d == 1:
            continue
        if dims and strides[-1] == st * d:
            dims[-1], strides[-1] = dims[-1] * d, st
        else:
            dims.append(int(d))
            strides.append(int(st))
    return (tuple(dims) or (1,)), (tuple(strides) or (1,))


def _stand_in(shape) -> tuple[np.ndarray, np.ndarray]:
    """A byte per element and no data: a C-contiguous array of ``shape`` over one byte (its
    views' strides and starts are element maps) and that byte."""
    base = np.zeros(1, np.uint8)
    contiguous = tuple(math.prod(shape[k + 1:]) for k in range(len(shape)))
    return np.lib.stride_tricks.as_strided(base, shape=shape, strides=contiguous, writeable=False), base


def dma_descriptors(dims, strides, offset: int, e0: int, e1: int) -> list[tuple[int, int, tuple, tuple]]:
    """The strided DMA descriptors that move output elements ``[e0, e1)`` of a strided view
    (:func:`strided_source`): per descriptor ``(source element, first output element - e0,
    counts, strides)``, counts and strides innermost first (:data:`DMA_DIMS` of them, unused axes
    of extent 1). The range is cut into boxes, each the largest aligned block that fits (at most
    ``2 * len(dims) - 1``); a box of more than :data:`DMA_DIMS` axes is one descriptor per index
    of its outer axes."""
    rank = len(dims)
    units = [math.prod(dims[k + 1:]) for k in range(rank)]
    out, p = [], int(e0)
    while p < e1:
        k = next(k for k in range(rank) if p % units[k] == 0 and p + units[k] <= e1)
        m = min(dims[k] - (p // units[k]) % dims[k], (e1 - p) // units[k])
        src = offset + sum(((p // units[j]) % dims[j]) * strides[j] for j in range(rank))
        counts, steps = (m, *dims[k + 1:]), tuple(strides[k:])
        outer = len(counts) - DMA_DIMS
        inner_n = math.prod(counts[max(outer, 0):])
        pad = max(0, -outer)
        inner_c = (1,) * pad + counts[max(outer, 0):]
        inner_s = (0,) * pad + steps[max(outer, 0):]
        for n, idx in enumerate(np.ndindex(*counts[:max(outer, 0)])):
            start = src + sum(i * st for i, st in zip(idx, steps))
            out.append((start, p - e0 + n * inner_n, inner_c[::-1], inner_s[::-1]))
        p += m * units[k]
    return out


def _strided_dims(program, layer: Layer) -> tuple[int, ...]:
    """The extents of a strided view (:func:`strided_source`) for its descriptor count; where
    the tensors are a shard's whose input no longer fits the layer (a system plan times one
    shard, its output cut but not always its input), the output's non-unit extents unmerged
    (at least the merged view's descriptors)."""
    try:
        return strided_source(program, layer)[0]
    except ShapeMismatch:
        shape = tuple(int(d) for d in program.tensors[layer.output].shape if int(d) != 1)
        return shape or (1,)


def _scatter_targets(program, layer: Layer) -> list:
    """:func:`scatter_targets` for the descriptor count; where the tensors are a shard's whose
    inputs no longer fit the output (a system plan times one shard), the output as one input
    written in order (at least one descriptor a tile)."""
    try:
        return scatter_targets(program, layer)
    except ShapeMismatch:
        return [((max(1, math.prod(int(d) for d in program.tensors[layer.output].shape)),), (1,), 0)]


def dma_descriptor_count(dims, e0, e1) -> np.ndarray:
    """``len(dma_descriptors(dims, ..., e0, e1))`` for every range ``[e0[i], e1[i])`` at once
    (int arrays, or ints), without building them: the same cut into boxes, one step of every
    range at a time."""
    e0, e1 = np.atleast_1d(np.asarray(e0, dtype=np.int64)), np.atleast_1d(np.asarray(e1, dtype=np.int64))
    rank = len(dims)
    units = np.array([math.prod(dims[k + 1:]) for k in range(rank)], dtype=np.int64)
    extents = np.array(dims, dtype=np.int64)
    # per box's top axis k: how many descriptors one of its steps along k makes (its outer axes
    # beyond DMA_DIMS, axis k's own count aside)
    split = np.array([math.prod(dims[k + 1:max(rank - DMA_DIMS, k + 1)]) for k in range(rank)], dtype=np.int64)
    wide = np.array([rank - k > DMA_DIMS for k in range(rank)])
    count, p = np.zeros(e0.shape, dtype=np.int64), e0.copy()
    live = p < e1
    while live.any():
        fits = (p[:, None] % units == 0) & (p[:, None] + units <= e1[:, None])
        k = np.argmax(fits, axis=1)  # the outermost axis whose aligned block fits (the last always does)
        u = units[k]
        m = np.minimum(extents[k] - (p // u) % extents[k], (e1 - p) // u)
        count += np.where(live, np.where(wide[k], m * split[k], 1), 0)
        p = np.where(live, p + m * u, p)
        live = p < e1
    return count


#: The ``dma`` PE kernel (:mod:`tvm_spinn.pe.kernels`) as it executes, by instruction class
#: (loads and stores unpaired and pipelined, integer instructions, taken branches; a load or
#: store of N registers is one unpaired and N - 1 pipelined), counted on the executed blocks of
#: runs of one and two descriptors and priced by :func:`~.m4f.mix_cycles`: per run of a tile
#: (start-up, the job's arguments, the kernel's entry and exit) and per descriptor (its words
#: copied into the engine's registers, the start, the poll that waits for the engine).
DMA_CODE_RUN = Mix(loads=11.0, paired=29.0, alu=20.0, branches=1.0)
DMA_CODE_DESCRIPTOR = Mix(loads=6.0, paired=22.0, alu=9.0, branches=4.0)


def strided_tile_cycles(dims, lo, hi, arch) -> np.ndarray:
    """Cycles of tiles ``[lo, hi)`` (flat output ranges, int arrays) of a strided view with
    extents ``dims`` (:func:`strided_source`): the PE code's run, its descriptors and the DMA
    engine's element a cycle, which the M4F waits for."""
    run, per = mix_cycles(DMA_CODE_RUN, arch), mix_cycles(DMA_CODE_DESCRIPTOR, arch)
    counts = dma_descriptor_count(dims, lo, hi).astype(np.float64)
    return run + per * counts + DMA_ELEMENT_CYCLES * (np.asarray(hi) - np.asarray(lo))


def scatter_tile_cycles(targets, fill: bool, lo, hi, arch) -> np.ndarray:
    """Cycles of tiles ``[lo, hi)`` (flat output ranges, int arrays) of a layer whose inputs are
    written into the strided views ``targets`` of its output (:func:`scatter_targets`), the
    ``dma`` kernel's: its run, per input the scatter descriptors of the elements in the tile
    (:func:`scatter_range`, :func:`dma_descriptor_count`), and where ``fill`` (``pad``) one
    fill descriptor for a tile not wholly the input's, whose elements the engine writes too."""
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    run, per = mix_cycles(DMA_CODE_RUN, arch), mix_cycles(DMA_CODE_DESCRIPTOR, arch)
    descs, moved = np.zeros(lo.shape, np.float64), np.zeros(lo.shape, np.int64)
    for dims, strides, offset in targets:
        q0, q1 = scatter_range(dims, strides, offset, lo), scatter_range(dims, strides, offset, hi)
        descs += dma_descriptor_count(dims, q0, q1)
        moved += q1 - q0
    if fill:
        filled = moved < hi - lo
        descs += filled
        moved += np.where(filled, hi - lo, 0)
    return run + per * descs + DMA_ELEMENT_CYCLES * moved


def _ints(v, field: str, low: int | None = None) -> list[int]:
    return [check_int(x, f"{field}[{i}]", low) for i, x in enumerate(check_list(v, field))]


def _int_tuple(expr) -> list[int] | None:
    """The integers of a Relax tuple of constant PrimValues / IntImms, or None (symbolic)."""
    fields = getattr(expr, "fields", None)
    if fields is None:
        return None
    out = []
    for field in fields:
        value = getattr(field, "value", field)
        value = getattr(value, "value", value)
        if not isinstance(value, int):
            return None
        out.append(int(value))
    return out


def normalized_slice(call, shape: tuple[int, ...]) -> tuple[list[int], list[int], list[int]] | None:
    """``(axes, begin, strides)`` of a ``relax.strided_slice`` call on ``shape`` with every start
    in range (TVM's and numpy's clamping of out-of-range and negative bounds applied), or None
    where the bounds are symbolic. The output's extent on each axis is the element count."""
    args = list(call.args)
    axes, begin, end = (_int_tuple(a) for a in args[1:4])
    strides = _int_tuple(args[4]) if len(args) > 4 else None
    if axes is None or begin is None or end is None:
        return None
    strides = strides if strides is not None else [1] * len(axes)
    if not (len(axes) == len(begin) == len(end) == len(strides)) or 0 in strides:
        return None
    rank = len(shape)
    out_axes, out_begin, out_strides = [], [], []
    for axis, b, e, s in zip(axes, begin, end, strides):
        axis = axis + rank if axis < 0 else axis
        if not 0 <= axis < rank:
            return None
        start, _stop, step = slice(b, e, s).indices(shape[axis])
        out_axes.append(axis)
        out_begin.append(min(start, shape[axis] - 1) if shape[axis] else 0)
        out_strides.append(step)
    return out_axes, out_begin, out_strides


def _slice_index(shape, axes, begin, strides, out_shape) -> tuple:
    """The numpy index selecting a normalized strided slice's elements."""
    index = [slice(None)] * len(shape)
    for axis, start, step in zip(axes, begin, strides):
        stop = start + step * out_shape[axis]
        index[axis] = slice(start, stop if stop >= 0 else None, step)
    return tuple(index)


def _contiguous_slice(ishape, oshape, attrs) -> bool:
    """Whether a normalized strided slice of ``ishape`` selects one contiguous row-major range:
    the inner axes whole, one axis a unit-step run, the outer axes of extent 1."""
    step = dict(zip(attrs["axes"], attrs["strides"]))
    k = len(ishape) - 1
    while k >= 0 and oshape[k] == ishape[k] and (oshape[k] == 1 or step.get(k, 1) == 1):
        k -= 1
    if k >= 0 and oshape[k] != 1 and step.get(k, 1) != 1:
        return False
    return all(oshape[j] == 1 for j in range(max(k, 0)))


def moved(layer: Layer, xs: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """The values of a data-movement layer's output (a view where numpy gives one)."""
    kind, attrs = layer.kind, layer.attrs
    if kind == "permute_dims":
        return np.transpose(xs[0], attrs["axes"])
    if kind == "broadcast_to":
        return np.broadcast_to(xs[0], shape)
    if kind == "strided_slice":
        return xs[0][_slice_index(xs[0].shape, attrs["axes"], attrs["begin"], attrs["strides"], shape)]
    if kind == "concat":
        return np.concatenate(xs, axis=attrs["axis"])
    if kind == "pad":
        return padded(xs[0], attrs["pad_width"], attrs["value"])
    return np.reshape(xs[0], shape)


def padded(x: np.ndarray, pad_width: list[int], value: float) -> np.ndarray:
    """``x`` with ``pad_width[2k]`` elements of ``value`` before and ``pad_width[2k + 1]`` after
    it on axis ``k`` (a new array)."""
    shape = tuple(d + pad_width[2 * k] + pad_width[2 * k + 1] for k, d in enumerate(x.shape))
    out = np.full(shape, np.asarray(value, dtype=x.dtype), dtype=x.dtype)
    out[_interior(pad_width, x.shape)] = x
    return out


def _interior(pad_width: list[int], shape) -> tuple:
    """The numpy index of a padded output where the input of ``shape`` lies."""
    return tuple(slice(pad_width[2 * k], pad_width[2 * k] + d) for k, d in enumerate(shape))


class Movement(FlatFamily):
    """reshape (expand_dims, squeeze), permute_dims, broadcast_to, strided_slice, concat and pad."""

    kinds = ("reshape", "permute_dims", "broadcast_to", "strided_slice", "concat", "pad")
    moves_data = True
    composites = kinds + ("expand_dims", "squeeze")
    priority = 60

    # -- partition and codegen ---------------------------------------------------------------
    def patterns(self, kit) -> list[tuple]:
        from tvm.relax.dpl import is_op, is_tuple, wildcard

        entries = [
            kit.binary("spinn.reshape", "relax.reshape", self._check_pattern),  # (x, shape)
            kit.binary("spinn.broadcast_to", "relax.broadcast_to", self._check_pattern),
            kit.unary("spinn.permute_dims", "relax.permute_dims", self._check_pattern),
            kit.unary("spinn.expand_dims", "relax.expand_dims", self._check_pattern),
            kit.unary("spinn.squeeze", "relax.squeeze", self._check_pattern),
        ]
        x = wildcard()
        sliced = is_op("relax.strided_slice")(x, varg_default_wildcard=True)
        entries.append(kit.entry("spinn.strided_slice", sliced, {"input": x, "root": sliced}, self._check_slice))
        entries.append(kit.unary("spinn.pad", "relax.nn.pad", self._check_pad))
        for n in range(MAX_CONCAT_INPUTS, 1, -1):  # longest first
            parts = [wildcard() for _ in range(n)]
            root = is_op("relax.concat")(is_tuple(parts))
            annotations = {f"in{i}": p for i, p in enumerate(parts)}
            annotations["root"] = root
            entries.append(kit.entry("spinn.concat", root, annotations, self._check_concat))
        return entries

    @staticmethod
    def _check_pattern(kit, op: str, ctx) -> bool:
        names = ("lhs",) if op in ("spinn.reshape", "spinn.broadcast_to") else ("input",)
        return kit.check_tensors(op, ctx, names, kit.SUPPORTED_DTYPES + kit.QUANTIZED_DTYPES)

    @classmethod
    def _check_slice(cls, kit, op: str, ctx) -> bool:
        if not cls._check_pattern(kit, op, ctx):
            return False
        root = ctx.annotated_expr["root"]
        shape = kit.static_shape(ctx.annotated_expr["input"])
        if normalized_slice(root, shape) is None:
            return kit.refuse(op, root, "slice bounds are not constant integers")
        return True

    @staticmethod
    def _check_pad(kit, op: str, ctx) -> bool:
        root = ctx.annotated_expr["root"]
        if str(root.attrs.pad_mode) != "constant":
            return kit.refuse(op, root, f"pad mode {root.attrs.pad_mode} (only constant)")
        if not math.isfinite(float(root.attrs.pad_value)):  # a program header is strict JSON
            return kit.refuse(op, root, f"pad value {float(root.attrs.pad_value)} is not finite")
        if any(int(w) < 0 for w in root.attrs.pad_width):
            return kit.refuse(op, root, f"negative pad widths {[int(w) for w in root.attrs.pad_width]} (a crop)")
        return kit.check_tensors(op, ctx, ("input",))  # float32: the fill value is a float

    @staticmethod
    def _check_concat(kit, op: str, ctx) -> bool:
        names = tuple(k for k in ctx.annotated_expr if k.startswith("in"))
        dtypes = {kit.dtype(ctx.annotated_expr[k]) for k in names}
        if len(dtypes) != 1:
            return kit.refuse(op, ctx.annotated_expr["root"], f"inputs of several dtypes {sorted(dtypes)}")
        return kit.check_tensors(op, ctx, names, kit.SUPPORTED_DTYPES + kit.QUANTIZED_DTYPES)

    def lower(self, lowerer, name: str, kind: str, calls: list, env: dict, layer: Layer) -> None:
        call = calls[0][1]
        if kind == "concat":
            fields = call.args[0].fields
            layer.inputs = [lowerer.operand(x, env) for x in fields]
            rank = len(lowerer.tensors[layer.inputs[0]].shape)
            axis = int(call.attrs.axis)
            layer.attrs["axis"] = axis + rank if axis < 0 else axis
            return
        layer.inputs = [lowerer.operand(call.args[0], env)]
        shape = tuple(lowerer.tensors[layer.inputs[0]].shape)
        if kind in ("expand_dims", "squeeze"):  # a relabelling of the same elements
            layer.kind = "reshape"
        elif kind == "permute_dims":
            axes = call.attrs.axes
            layer.attrs["axes"] = [int(a) for a in axes] if axes is not None else list(range(len(shape)))[::-1]
        elif kind == "pad":
            layer.attrs["pad_width"] = [int(w) for w in call.attrs.pad_width]
            layer.attrs["value"] = float(call.attrs.pad_value)
        elif kind == "strided_slice":
            normalized = normalized_slice(call, shape)
            if normalized is None:
                raise LoweringError(f"{name}: slice bounds are not constant integers")
            layer.attrs["axes"], layer.attrs["begin"], layer.attrs["strides"] = normalized

    # -- validation -----------------------------------------------------------------------------
    def attr_schema(self, kind: str, mode: str):
        if kind == "permute_dims":
            return {"axes": _axes}, {}
        if kind == "strided_slice":
            return {"axes": _axes, "begin": lambda v, f: _ints(v, f, 0), "strides": _ints}, {}
        if kind == "concat":
            return {"axis": lambda v, f: check_int(v, f, 0)}, {}
        if kind == "pad":
            return {"pad_width": lambda v, f: _ints(v, f, 0), "value": check_num}, {}
        return {}, {}

    def check(self, v, f, kind, mode, ins, consts, out, attrs):
        fo = f"{f}.output"
        if kind == "concat":
            return self._check_concat_layer(v, f, ins, consts, out, attrs)
        v.need(f"{f}.inputs", kind, ins, 1)
        ishape, oshape = v.shapes[ins[0]], v.shapes[out]
        numel = math.prod(oshape)
        v.consts(f, consts, set())
        v.dtype(fo, out, (v.dtypes[ins[0]],))
        if kind == "strided_slice":
            self._check_slice_layer(f, ishape, oshape, attrs)
        if kind == "pad":
            v.dtype(f"{f}.inputs[0]", ins[0], ("float32",))
            width = attrs["pad_width"]
            if len(width) != 2 * len(ishape):
                fail(f"{f}.attrs.pad_width", f"{len(width)} widths for the {len(ishape)} axes of {ishape} (need 2 per axis)")
            v.shape(fo, out, [d + width[2 * k] + width[2 * k + 1] for k, d in enumerate(ishape)])
        if kind == "reshape" and math.prod(ishape) != numel:
            fail(fo, f"reshape of {ishape} to {oshape} changes the element count")
        if kind == "broadcast_to" and v.broadcast(ishape, oshape) != oshape:
            fail(fo, f"{ishape} does not broadcast to {oshape}")
        if kind == "permute_dims":
            axes = attrs["axes"]
            if sorted(axes) != list(range(len(ishape))):
                fail(f"{f}.attrs.axes", f"{axes} is not a permutation of the {len(ishape)} input axes")
            v.shape(fo, out, [ishape[a] for a in axes])
        return (numel,), None

    @staticmethod
    def _check_slice_layer(f: str, ishape, oshape, attrs) -> None:
        axes, begin, strides = attrs["axes"], attrs["begin"], attrs["strides"]
        if not len(axes) == len(begin) == len(strides):
            fail(f"{f}.attrs", f"axes {axes}, begin {begin} and strides {strides} differ in length")
        if len(oshape) != len(ishape) or len(set(axes)) != len(axes):
            fail(f"{f}.attrs.axes", f"{axes} do not slice {ishape} to {oshape}")
        for i, (axis, start, step) in enumerate(zip(axes, begin, strides)):
            if axis >= len(ishape) or step == 0:
                fail(f"{f}.attrs", f"axis {axis} with stride {step} does not slice {ishape}")
            last = start + step * (oshape[axis] - 1)
            if start >= ishape[axis] or not 0 <= last < ishape[axis]:
                fail(f"{f}.attrs.begin[{i}]", f"elements {start}..{last} step {step} leave axis {axis} of {ishape}")
        for axis, (a, b) in enumerate(zip(ishape, oshape)):
            if axis not in axes and a != b:
                fail(f"{f}.output", f"axis {axis} is not sliced but {ishape} becomes {oshape}")

    @staticmethod
    def _check_concat_layer(v, f, ins, consts, out, attrs):
        fo = f"{f}.output"
        if not ins:
            fail(f"{f}.inputs", "concat needs at least one input")
        v.consts(f, consts, set())
        dtype, axis = v.dtypes[ins[0]], attrs["axis"]
        oshape = v.shapes[out]
        v.dtype(fo, out, (dtype,))
        if axis >= len(oshape):
            fail(f"{f}.attrs.axis", f"{axis} is not an axis of {oshape}")
        total = 0
        for i, tid in enumerate(ins):
            v.dtype(f"{f}.inputs[{i}]", tid, (dtype,))
            shape = v.shapes[tid]
            if len(shape) != len(oshape) or any(a != b for j, (a, b) in enumerate(zip(shape, oshape)) if j != axis):
                fail(f"{f}.inputs[{i}]", f"shape {shape} does not join {oshape} along axis {axis}")
            total += shape[axis]
        if total != oshape[axis]:
            fail(fo, f"inputs give {total} along axis {axis}, the output has {oshape[axis]}")
        return (math.prod(oshape),), None

    # -- mapping ------------------------------------------------------------------------------
    def work(self, program, layer, arch):
        return 0, None

    def view_keeps_order(self, layer) -> bool:
        return layer.kind != "strided_slice"

    def aliases_input(self, program, layer) -> bool:
        # a reshape, a same-size broadcast_to, and a permute_dims that moves only unit axes
        # (:meth:`is_view`): in row-major order the output is the input's bytes unchanged
        acts = [x for x in layer.inputs if program.tensors[x].role != "const"]
        if len(acts) != 1 or program.tensors[acts[0]].nbytes != program.tensors[layer.output].nbytes:
            return False
        return layer.kind in ("reshape", "broadcast_to") or (layer.kind == "permute_dims"
                                                              and self.is_view(program, layer))

    def is_view(self, program, layer) -> bool:
        """A reshape; a ``broadcast_to`` that adds only unit axes; a ``permute_dims`` that moves
        only unit axes (the other axes keep their order); a ``strided_slice`` whose elements
        are one contiguous range of the input (GPT-2's Q, K and V from one GEMM row): in
        row-major order each is the input's bytes unchanged, or a contiguous run of them."""
        if layer.kind not in ("reshape", "permute_dims", "broadcast_to", "strided_slice"):
            return False
        ishape = tuple(program.tensors[layer.inputs[0]].shape)
        oshape = tuple(program.tensors[layer.output].shape)
        if layer.kind == "reshape":
            return True
        if layer.kind == "broadcast_to":
            return math.prod(ishape) == math.prod(oshape)
        if layer.kind == "permute_dims":
            kept = [a for a in layer.attrs["axes"] if ishape[a] != 1]
            return kept == sorted(kept)
        return _contiguous_slice(ishape, oshape, layer.attrs)

    def cycles_per_element(self, layer, arch):
        """Not a per-element price: a tile's cycles depend on its run's descriptors
        (:meth:`tile_costs`), so the flat families' per-element hook refuses."""
        raise NotImplementedError(f"{type(self).__name__} prices tiles by tile_costs (descriptors), "
                                  f"not per element ({layer.kind!r})")

    def smallest_tile_bytes(self, program, layer, arch):
        """One element read (from whichever input holds it) and one written, double-buffered."""
        return 2 * (itemsize(program, layer.inputs[0]) + itemsize(program, layer.output))

    def tile_costs(self, program, layer, arch, tile, lo, hi):
        """Each output element reads exactly one input element (of any input); a strided view's
        tile costs its PE code's run and descriptors (:func:`strided_tile_cycles`), a concat's or
        pad's its run and its scatter and fill descriptors (:func:`scatter_tile_cycles`)."""
        ie = itemsize(program, layer.inputs[0])
        oe = itemsize(program, layer.output)
        e = (hi - lo)[:, 0]
        if layer.kind in STRIDED_KINDS:
            cycles = np.ceil(strided_tile_cycles(_strided_dims(program, layer), lo[:, 0], hi[:, 0], arch))
        elif layer.kind in SCATTER_KINDS:
            cycles = np.ceil(scatter_tile_cycles(_scatter_targets(program, layer), layer.kind == "pad", lo[:, 0],
                                                 hi[:, 0], arch))
        else:
            raise MappingError(f"movement layer kind {layer.kind!r} is neither strided ({', '.join(STRIDED_KINDS)}) "
                               f"nor a scatter ({', '.join(SCATTER_KINDS)}): no tile cost")
        return 2 * (ie + oe) * e, ie * e, 0, oe * e, cycles

    # -- functional simulator -----------------------------------------------------------------
    def prepare_tiles(self, runner) -> None:
        xs = [runner.env[t] for t in runner.layer.inputs]
        runner.flat_in = [np.ascontiguousarray(moved(runner.layer, xs, runner.out.shape)).reshape(-1)]

    def run_tile(self, runner, tile) -> None:
        (e0, e1), = tile.region
        runner.out.reshape(-1)[e0:e1] = runner.flat_in[0][e0:e1]

    def run_whole(self, program, index, layer, env, out):
        x = env[layer.inputs[0]]
        if layer.kind == "reshape" and x.dtype == out.dtype and x.flags.c_contiguous and x.flags.writeable:
            return x.reshape(out.shape)  # pure relabelling: a view (values are never written after they are made)
        out[...] = moved(layer, [env[t] for t in layer.inputs], out.shape)
        return out

    def step(self, program, layer):
        tensors = program.tensors
        shape = tuple(tensors[layer.output].shape)
        dtype = np.dtype(tensors[layer.output].dtype)
        x_tid = layer.inputs[0]
        if layer.kind == "reshape":
            def step(program, env):  # a contiguous value is relabelled, never copied
                x = env[x_tid]
                if x.dtype == dtype and x.flags.c_contiguous and x.flags.writeable:
                    return x.reshape(shape)
                out = np.empty(shape, dtype=dtype)
                out[...] = np.reshape(x, shape)
                return out
            return step
        inputs = list(layer.inputs)

        def step(program, env):
            out = np.empty(shape, dtype=dtype)
            out[...] = moved(layer, [env[t] for t in inputs], shape)
            return out
        return step

    def native(self, program, layer, nb, clip=None):
        """A reshape is the same bytes (an alias); every other kind is one strided ``copy`` per
        input (what :func:`moved` selects), elements of any size; a float32 ``pad`` is a
        ``fill`` of the output with the value's bits, then a ``copy`` of the input into it."""
        tensors = program.tensors
        out_shape = [int(d) for d in tensors[layer.output].shape]
        item = np.dtype(tensors[layer.output].dtype).itemsize
        if layer.kind == "reshape":
            nb.alias(layer.output, layer.inputs[0])
            return True
        if len(out_shape) > 8 or item not in (1, 2, 4, 8):
            return False
        kind, attrs = layer.kind, layer.attrs
        x_tid = layer.inputs[0]
        in_shape = [int(d) for d in tensors[x_tid].shape]
        in_strides = native.contiguous_strides(in_shape)
        out_strides = native.contiguous_strides(out_shape)
        if kind == "pad":  # the fill value's bits everywhere, then the input copied into the middle
            if item != 4:
                return False
            width = attrs["pad_width"]
            dst = nb.write(layer.output)
            nb.emit("fill", dst, item, native.numel(out_shape), native.f32_bits(attrs["value"]))
            start = sum(width[2 * k] * out_strides[k] for k in range(len(out_shape)))
            nb.emit("copy", nb.read(x_tid), dst, item, len(in_shape), 0, start, in_shape, in_strides,
                    out_strides)
            return True
        if kind == "concat":
            axis, start = attrs["axis"], 0
            dst = nb.write(layer.output)
            for tid in layer.inputs:
                shape = [int(d) for d in tensors[tid].shape]
                nb.emit("copy", nb.read(tid), dst, item, len(shape), 0, start * out_strides[axis],
                        shape, native.contiguous_strides(shape), out_strides)
                start += shape[axis]
            return True
        offset = 0
        if kind == "permute_dims":
            src = [in_strides[a] for a in attrs["axes"]]
        elif kind == "broadcast_to":
            src = native.broadcast_strides(in_shape, out_shape)
            if src is None:
                return False
        else:  # strided_slice
            src = list(in_strides)
            for axis, begin, step in zip(attrs["axes"], attrs["begin"], attrs["strides"]):
                offset += begin * in_strides[axis]
                src[axis] = in_strides[axis] * step
        nb.emit("copy", nb.read(x_tid), nb.write(layer.output), item, len(out_shape), offset, 0,
                out_shape, src, out_strides)
        return True


def dedupe_movement(program, layers: list) -> list:
    """Drop repeated movement layers (same kind, input, shape and attributes), which the compiler
    merges when the weights are bound (e.g. one reshape of the hidden state for the q, k and v
    GEMMs); later readers use the first one's output."""
    import json

    def key(layer):
        if layer.kind not in ("reshape", "permute_dims", "broadcast_to"):
            return None
        return (layer.kind, tuple(layer.inputs), tuple(program.tensors[layer.output].shape),
                json.dumps(layer.attrs, sort_keys=True, default=str))

    return dedupe_layers(program, layers, key)


class MovementSharding(PointwiseRule):
    """Reshapes, transposes and broadcasts carry a split to the axis holding the same blocks
    (partial sums pass through a reshape or transpose unchanged); a split a reshape cannot carry
    is gathered. On row blocks (``sp``) a broadcast of replicated rows copies each block's own
    rows. Slices, concatenations and pads follow their operands on the tensor axis, on the data
    axis where the split axis keeps its extent (a slice, concatenation or pad of the batch is
    gathered), and are replicated on row blocks."""

    _CARRIERS = ("reshape", "permute_dims", "broadcast_to")

    def propagate(self, ctx, layer, ins):
        kind = layer.kind
        if kind not in self._CARRIERS:
            if ctx.axis.name == "sp":
                return ShardDecision(REPLICATE, "rep", gather_all=True)
            d = super().propagate(ctx, layer, ins)
            full, out = ctx.full, ctx.full[layer.output]
            if ctx.axis.name == "dp" and d.output.split and any(
                    s.split and full[tid][s.axis] != out[d.output.axis] for tid, s in zip(ctx.acts(layer), ins)):
                return ShardDecision(REPLICATE, "rep", gather_all=True)
            return d
        full, acts, n = ctx.full, ctx.acts(layer), ctx.size
        shape = full[layer.output]
        rank = len(shape)
        s = ins[0] if ins else REPLICATE
        src = full[acts[0]] if acts else []
        if s.partial and kind in ("reshape", "permute_dims"):
            return ShardDecision(PARTIAL, "split", inherit_partial=True)
        if s.split:
            if kind == "reshape":
                ax = reshape_axis(src, shape, s.axis, n)
            elif kind == "permute_dims":
                ax = list(layer.attrs["axes"]).index(s.axis)
            else:
                ax = s.axis + rank - len(src)  # broadcast_to: leading axes added
            if ax is None:
                return ShardDecision(REPLICATE, "rep", (GatherInput(0),), gather_all=ctx.axis.strict)
            return ShardDecision(shard(ax), "split")
        if ctx.axis.name == "sp" and kind == "broadcast_to" and acts and rank >= 2 \
                and rank - 2 >= rank - len(src) and shape[rank - 2] >= n:
            # a copy of replicated rows (attention probabilities for the context matmul): each
            # block copies its own rows, not all of them on every chip
            return ShardDecision(shard(rank - 2), "split")
        return ShardDecision(REPLICATE, "rep", gather_all=ctx.axis.strict)

    def accepts_partial(self, layer):
        return layer.kind in ("reshape", "permute_dims")

    def passes_reduction(self, program, layer):
        return False


Movement.sharding = MovementSharding()
register(Movement())
