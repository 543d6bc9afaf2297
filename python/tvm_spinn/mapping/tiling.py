"""Tiling: split every layer into units of work that fit one PE's SRAM.

Regions by layer kind (half-open ``[start, stop)`` ranges over the layer's output):

- ``conv2d``, ``dense``, ``matmul`` (GEMM view ``C[b, m, n] = sum_k A[b, m, k] B[b, k, n]``):
  ``[[b0, b1], [m0, m1], [n0, n1]]``; conv2d uses ``A = weight[oc, ic*kh*kw]`` (m = output
  channel), ``B = im2col(input)`` (n = output pixel), b = batch x group; dense and matmul use
  ``A = input`` and ``B = weight``/rhs. The reduction is split into ``k_splits`` chunks that
  stream through the same PE in ascending k, so partial sums never leave it (output stationary)
  and the reduction order is independent of the tiling.
- element-wise ops: ``[[e0, e1]]`` over the flattened (broadcast) output.
- pools: ``[[p0, p1], [r0, r1]]``: ``N*C`` planes and output rows (large planes are split
  into row bands with their input halo).
- softmax, layer_norm, mean: ``[[r0, r1]]`` over rows (all but the normalized/reduced axes).

Tile shapes for GEMMs are chosen by a cost model among candidates padded to the MAC array's
``mac_rows x mac_cols`` shape (see :func:`choose_gemm_tile`).

Bytes come from the tensors' dtypes (1 for int8/uint8, 4 for float32): a tile's ``in_bytes``,
``w_bytes``, ``out_bytes`` and the operand buffers in ``sram_bytes``. GEMM accumulators are
32-bit words in SRAM whatever the operands (fp32 sums on the M4F, int32 partial sums of the MAC
array), so they take :data:`ACC_BYTES` per output element; the output (fp32 after a dequantizing
epilogue, int8 after a requantizing one) is written over them.

Compute cycles of a GEMM tile follow the layer's ``mode``:

- ``fp32`` (Cortex-M4F): ``vm * vn * K / m4f_flops_per_cycle``.
- ``int8`` (MAC array, output stationary): the tile is padded to ``mac_rows x mac_cols`` blocks;
  each block streams its reduction through the array one k-chunk at a time (``k_splits`` chunks,
  at most :func:`safe_k_chunk` long), 1 cycle per k, then writes its 32-bit sums to SRAM
  (``mac_readout_cycles``): ``ceil(vm/rows) * ceil(vn/cols) * (K + k_splits * readout)``, i.e.
  ``pm * pn * K / macs_per_cycle`` plus the readout. Requantization and ReLU are free on the
  array's output stage; zero-point terms of constant operands (``zx * sum_k w``, ``K zx zw``) are
  per-channel constants folded into the epilogue (an ``acc_offset``), assumed free as well. The
  rest runs on the PE's M4F while the array computes the next block (see :class:`Int8Side`),
  and the tile takes the longer of the two: per output element ``m4f_elementwise_cycles`` for
  each extra k-chunk's 32-bit partial-sum add (:mod:`tvm_spinn.program.quant`), for a
  dequantizing (fp32) epilogue, and for zero-point terms of activation operands, whose sums
  over k cost one cycle per element.

``layer.flops`` stays ``2 * M * N * K`` operations in both modes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..program import Layer, Program
from ..program.gemm import GemmShape, gemm_shape, safe_k_chunk
from ..program.tiles import GEMM_KINDS, POOL_KINDS, ROW_KINDS, TileTable, expand_regions, k_splits
from ..target.arch import SpinnArch

__all__ = [
    "GemmShape", "gemm_shape", "choose_gemm_tile", "gemm_tile_cycles", "Int8Side", "int8_side",
    "safe_k_chunk", "tile_layer", "MappingError", "ACC_BYTES", "layer_work", "choose_tile", "tile_costs", "smallest_tile_bytes",
    "smallest_gemm_tile_bytes", "smallest_row_tile_bytes", "smallest_pool_tile_bytes",
]

_F32 = 4
#: Bytes of one GEMM accumulator word in SRAM (fp32 sums; int32 partial sums of the MAC array).
ACC_BYTES = 4


class MappingError(ValueError):
    """A layer that cannot be mapped onto the chosen system (names layer and size)."""


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil(a, b) * b


def _itemsize(program: Program, tid: int) -> int:
    return int(np.dtype(program.tensors[tid].dtype).itemsize)


def _gemm_tile_bytes(tm: int, tn: int, tk: int, a_elem: int = _F32, b_elem: int = _F32) -> int:
    # A and B chunks double-buffered (DMA of chunk i+1 overlaps compute of chunk i) + accumulators.
    return 2 * (a_elem * tm * tk + b_elem * tk * tn) + ACC_BYTES * tm * tn


def _operand_elems(kind: str, mode: str, elem_bytes) -> tuple[int, int, int, int]:
    """``(a, b, activation, output)`` element bytes; ``elem_bytes`` is ``(activation, weight,
    output)`` (matmul: lhs, rhs, output) or None for the mode's default (fp32: 4, 4, 4; int8:
    1, 1, 4)."""
    if elem_bytes is None:
        elem_bytes = (1, 1, ACC_BYTES) if mode == "int8" else (_F32, _F32, _F32)
    x, w, out = (int(v) for v in elem_bytes)
    a, b = (w, x) if _weight_is_a(kind) else (x, w)
    return a, b, x, out


@dataclass(frozen=True)
class Int8Side:
    """The M4F's share of an int8 GEMM tile (it overlaps the MAC array's passes).

    ``fp32_out``: dequantizing epilogue (``fl(acc) * scale [+ bias]``) on the M4F;
    ``row_sums`` / ``col_sums``: ``sum_k`` of the A rows / B columns is needed at run time (that
    operand is an activation and the other operand has a nonzero zero point).
    """

    fp32_out: bool = False
    row_sums: bool = False
    col_sums: bool = False


def int8_side(program: Program, layer: Layer) -> Int8Side:
    """What the M4F does for an int8 GEMM layer besides adding k-chunk partial sums."""
    fp32_out = program.tensors[layer.output].dtype == "float32"
    a = layer.attrs
    w_zero = "w_zero" in layer.consts
    if layer.kind == "conv2d":  # A = weight, B = im2col(x): x sums needed when zw != 0
        return Int8Side(fp32_out, False, w_zero)
    if layer.kind == "dense":  # A = x, B = weight
        return Int8Side(fp32_out, w_zero, False)
    return Int8Side(fp32_out, a.get("b_zero", 0) != 0, a.get("x_zero", 0) != 0)


def gemm_tile_cycles(vm: int, vn: int, k: int, k_splits: int, arch: SpinnArch, mode: str = "fp32",
                     side: Int8Side | None = None) -> float:
    """Compute cycles of a ``vm x vn`` GEMM tile with reduction ``k`` in ``k_splits`` chunks
    (see the module docstring); a float, callers round up. ``vm`` and ``vn`` may be int64
    arrays (one entry per tile): the result is then a float64 array."""
    if mode != "int8":
        return vm * vn * k / arch.m4f_flops_per_cycle
    side = side or Int8Side()
    passes = _ceil(vm, arch.mac_rows) * _ceil(vn, arch.mac_cols)
    array = passes * (k + k_splits * arch.mac_readout_cycles)
    sums = side.row_sums or side.col_sums
    per_out = (k_splits - 1) + int(side.fp32_out) + int(sums)
    m4f = per_out * vm * vn * arch.m4f_elementwise_cycles + k * (vm * side.row_sums + vn * side.col_sums)
    longer = np.maximum(array, m4f)
    return longer.astype(np.float64) if isinstance(longer, np.ndarray) else float(longer)


#: Share of a PE's tile SRAM a tile's working buffers may take when a smaller tile also fits;
#: the rest is left to the memory planner for resident weights and on-chip activations.
WORKING_SHARE = 0.5


def _working_budget(arch: SpinnArch) -> int:
    return max(int(arch.tile_sram_bytes * WORKING_SHARE), min(arch.tile_sram_bytes, _gemm_tile_bytes(
        arch.mac_rows, arch.mac_cols, 4 * arch.mac_rows)))


def _weight_is_a(kind: str) -> bool:
    """conv2d keeps weights in the A operand (rows = output channels); dense in B."""
    return kind == "conv2d"


def choose_gemm_tile(g: GemmShape, arch: SpinnArch, name: str = "gemm", pes: int | None = None,
                     kind: str = "dense", naive: bool = False,
                     input_bytes=None, mode: str = "fp32", elem_bytes=None,
                     int8: Int8Side | None = None) -> tuple[int, int, int]:
    """Pick ``(tm, tn, tk)`` for a GEMM with the lowest estimated layer time.

    Candidates are multiples of the MAC array shape that fit ``arch.tile_sram_bytes``. The
    estimate spreads the tiles over ``pes`` PEs and takes ``max(per-PE compute and DMA, DRAM
    traffic / bandwidth + the last tile's compute)``, where the weight operand of a tile group is
    fetched once per PE (weight-stationary) and the activation operand once per tile
    (``input_bytes(vn)`` when given, e.g. a conv's input rows). Ties go to fewer tiles, then to
    the larger tile (deterministic). ``naive`` returns the smallest MAC-shaped tile.

    ``elem_bytes`` is ``(activation, weight, output)`` element bytes (matmul: lhs, rhs, output),
    by default the mode's (fp32: 4, 4, 4; int8: 1, 1, 4); compute time follows ``mode``
    (:func:`gemm_tile_cycles`: the M4F for fp32, the MAC array for int8, with the M4F's share
    ``int8``, by default a dequantizing epilogue when the output takes 4 bytes).
    """
    budget = arch.tile_sram_bytes if naive else _working_budget(arch)
    r, c = arch.mac_rows, arch.mac_cols
    pes = pes or arch.total_pes
    ae, be, _, oe = _operand_elems(kind, mode, elem_bytes)
    int8 = int8 or Int8Side(fp32_out=oe == 4)
    if naive:
        tk = min(g.k, max(r, (budget - ACC_BYTES * r * c) // (2 * (ae * r + be * c)) // r * r))
        if mode == "int8":
            tk = min(tk, safe_k_chunk(arch, 8))
        if _gemm_tile_bytes(r, c, min(tk, g.k), ae, be) > budget:
            raise MappingError(f"layer {name}: a {r}x{c} tile does not fit {budget} bytes of SRAM")
        return r, c, tk
    m_cap, n_cap = _round_up(g.m, r), _round_up(g.n, c)
    # Powers of two, plus sizes that split the work into about k tiles per PE (load balance).
    tms = {min(r * 2**i, m_cap) for i in range(12)}
    tns = {min(c * 2**i, n_cap) for i in range(14)}
    for k in range(1, 9):
        tns.add(min(n_cap, _round_up(_ceil(g.n * g.batch * _ceil(g.m, m_cap), k * pes), c)))
        tms.add(min(m_cap, _round_up(_ceil(g.m * g.batch, k * pes), r)))
    tms, tns = sorted(tms), sorted(tns)
    chips = max(1, -(-pes // arch.pes_per_chip))
    dram_bytes_per_cycle = arch.dram_bw_bytes_s * chips / arch.clock_hz
    noc_bytes_per_cycle = arch.noc_bw_bytes_s * chips / arch.clock_hz
    weight_a = _weight_is_a(kind)
    best, best_key = None, None
    for tm in tms:
        for tn in tns:
            fixed = ACC_BYTES * tm * tn
            per_k = 2 * (ae * tm + be * tn)
            if fixed + per_k > budget:
                continue
            tk_max = (budget - fixed) // per_k
            tk = g.k if tk_max >= g.k else max(r, (tk_max // r) * r)
            if tk > tk_max:
                continue
            if mode == "int8":  # the MAC array's acc_bits-bit accumulators must never wrap
                tk = min(tk, safe_k_chunk(arch, 8))
            mt, nt = _ceil(g.m, tm), _ceil(g.n, tn)
            tiles = g.batch * mt * nt
            groups = (g.batch * mt) if weight_a else nt
            per_pe = _ceil(tiles, pes)
            vm, vn = min(tm, g.m), min(tn, g.n)
            a_bytes, b_bytes = ae * vm * g.k, be * g.k * vn
            w_bytes, x_bytes = (a_bytes, b_bytes) if weight_a else (b_bytes, a_bytes)
            if input_bytes is not None:
                x_bytes = input_bytes(vn)
            # A weight block stays in SRAM across its tiles only if it fits next to the buffers.
            w_stationary = w_bytes + _gemm_tile_bytes(tm, tn, min(tk, g.k), ae, be) <= budget
            w_loads = min(tiles, max(groups, pes)) if w_stationary else tiles
            ksplits = _ceil(g.k, tk)
            compute = gemm_tile_cycles(vm, vn, g.k, ksplits, arch, mode, int8)
            dma = (x_bytes + oe * vm * vn + (w_bytes * w_loads) / tiles) / arch.dma_bw_bytes_per_cycle
            pe_time = per_pe * (max(compute, dma) + arch.dma_setup_cycles * ksplits)
            # Weight blocks cross DRAM once per group (the NoC multicasts them); activations are
            # assumed on-chip (NoC). The last tile computes after its load: no overlap for it.
            dram_time = groups * w_bytes / dram_bytes_per_cycle
            noc_time = (tiles * (x_bytes + oe * vm * vn) + w_loads * w_bytes) / noc_bytes_per_cycle
            key = (max(pe_time, max(dram_time, noc_time) + compute), tiles, -tm, -tn)
            if best_key is None or key < best_key:
                best, best_key = (tm, tn, tk), key
    if best is None:
        need = _gemm_tile_bytes(r, c, r, ae, be)
        raise MappingError(
            f"layer {name}: even a {r}x{c}x{r} tile needs {need} bytes of SRAM, the PE has {budget}; "
            f"the smallest system that fits has sram_bytes >= {need + arch.sram_reserved_bytes}"
        )
    return best


# -- the smallest tile of each layer kind: one definition, used by the tiler (which refuses a
# layer whose smallest tile does not fit) and by the partitioner's checks (which keep such a
# layer on the host), so a layer the partition accepts always tiles.
def smallest_gemm_tile_bytes(arch: SpinnArch, k: int, a_bytes: int = _F32, b_bytes: int = _F32) -> int:
    """SRAM of the smallest GEMM tile: one ``mac_rows x mac_cols`` block of outputs with
    reduction chunks of ``min(k, mac_rows)``, operands double-buffered (element bytes of the A
    and B operands: conv2d A = weight, B = im2col(input); dense/matmul A = input)."""
    return _gemm_tile_bytes(arch.mac_rows, arch.mac_cols, min(k, arch.mac_rows), a_bytes, b_bytes)


def smallest_row_tile_bytes(row: int, in_bytes: int = _F32, out_bytes: int = _F32, reduce: bool = False) -> int:
    """SRAM of one row of a softmax / layer_norm (``reduce=False``) or mean (``reduce=True``:
    one output per row), input and output double-buffered."""
    return 2 * (in_bytes * row + out_bytes * (1 if reduce else row))


def smallest_pool_tile_bytes(in_w: int, out_w: int, pool_h: int, dilation_h: int, pad_w: int,
                             in_bytes: int = _F32, out_bytes: int = _F32) -> int:
    """SRAM of one output row of one pool plane: its input band (window height, padded width)
    and the output row, double-buffered."""
    khe = (pool_h - 1) * dilation_h + 1
    return 2 * (in_bytes * khe * (in_w + pad_w) + out_bytes * out_w)


def smallest_tile_bytes(program: Program, index: int, arch: SpinnArch) -> int:
    """SRAM of the smallest tile layer ``index`` can be cut into (the tiler raises
    :class:`MappingError` when it exceeds ``arch.tile_sram_bytes``)."""
    layer = program.layers[index]
    t = program.tensors
    if layer.kind in GEMM_KINDS:
        _, elems, _ = _gemm_operands(program, layer)
        ae, be, _, _ = _operand_elems(layer.kind, layer.mode, elems)
        return smallest_gemm_tile_bytes(arch, gemm_shape(program, layer).k, ae, be)
    ie = sum(_itemsize(program, tid) for tid in layer.inputs)
    oe = _itemsize(program, layer.output)
    if layer.kind in ROW_KINDS:
        row = layer.attrs["row"] if layer.kind == "mean" else t[layer.output].shape[-1]
        return smallest_row_tile_bytes(row, ie, oe, reduce=layer.kind == "mean")
    if layer.kind in POOL_KINDS:
        _, _, _, w, _, ow, kh, _, _, _, _ = _pool_geometry(program, layer)
        pad = layer.attrs["padding"][1] + layer.attrs["padding"][3]
        return smallest_pool_tile_bytes(w, ow, kh, layer.attrs["dilation"][0], pad, ie, oe)
    return 2 * (ie + oe)


def _check_fits(program: Program, index: int, arch: SpinnArch) -> None:
    need = smallest_tile_bytes(program, index, arch)
    if need > arch.tile_sram_bytes:
        layer = program.layers[index]
        raise MappingError(
            f"layer {layer.name}: its smallest tile needs {need} bytes of SRAM, a PE has "
            f"{arch.tile_sram_bytes}; the smallest system that fits has sram_bytes >= "
            f"{need + arch.sram_reserved_bytes}"
        )


def _conv_input_bytes(program: Program, layer: Layer, p0, p1):
    """Bytes of input a conv tile DMAs for output pixels [p0, p1) (ints or arrays): the input
    window under those output pixels (with the kernel halo) of one group's channels; im2col
    happens in SRAM."""
    _, _, h, w = program.tensors[layer.inputs[0]].shape
    _, cg, kh, kw = program.tensors[layer.consts["weight"]].shape
    ow = program.tensors[layer.output].shape[3]
    sh, sw = layer.attrs["strides"]
    dh, dw = layer.attrs["dilation"]
    khe, kwe = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    p0, p1 = np.asarray(p0, dtype=np.int64), np.asarray(p1, dtype=np.int64)
    pixels = p1 - p0
    # Part of one output row (two if it wraps): a strip of columns; else whole rows.
    strip_rows = khe * np.where(p0 // ow == (p1 - 1) // ow, 1, 2)
    strip_cols = np.minimum(w, (pixels - 1) * sw + kwe)
    band_rows = np.minimum(h, (-(-pixels // ow)) * sh + khe)
    rows = np.where(pixels < ow, strip_rows, band_rows)
    cols = np.where(pixels < ow, strip_cols, w)
    return _itemsize(program, layer.inputs[0]) * cg * rows * cols


def _flat_size(total: int, bytes_per_elem: int, arch: SpinnArch, pes: int) -> int:
    # Double-buffered in/out per element; spread over the PEs but never beyond SRAM.
    cap = max(1, _working_budget(arch) // (2 * bytes_per_elem))
    return max(1, min(cap, _ceil(total, pes)))


def _check_nonempty(program: Program, layer: Layer) -> None:
    # The partitioner keeps zero-size ops on the host; a program built by hand may not.
    t = program.tensors
    for tid in (*layer.inputs, layer.output):
        if 0 in tuple(t[tid].shape):
            raise MappingError(f"layer {layer.name}: tensor {tid} has a zero-size shape "
                               f"{tuple(t[tid].shape)} (dim {tuple(t[tid].shape).index(0)}); "
                               "zero-size ops run on the host")


def _gemm_operands(program: Program, layer: Layer):
    w_tid = layer.inputs[1] if layer.kind == "matmul" else layer.consts["weight"]
    elems = tuple(_itemsize(program, tid) for tid in (layer.inputs[0], w_tid, layer.output))
    side = int8_side(program, layer) if layer.mode == "int8" else None
    return w_tid, elems, side


def _pool_geometry(program: Program, layer: Layer):
    n, c, h, w = program.tensors[layer.inputs[0]].shape
    oh, ow = program.tensors[layer.output].shape[2:]
    kh, kw = layer.attrs["pool_size"]
    sh = layer.attrs["strides"][0]
    khe = (kh - 1) * layer.attrs["dilation"][0] + 1
    wp = w + layer.attrs["padding"][1] + layer.attrs["padding"][3]
    return n, c, h, w, oh, ow, kh, kw, sh, khe, wp


def _row_per_elem(kind: str, arch: SpinnArch) -> float:
    return {"softmax": 3.0 + arch.exp_unit_cycles, "layer_norm": 6.0, "mean": 1.0}[kind]


def _elementwise_per_elem(kind: str, arch: SpinnArch) -> float:
    transcendental = kind in ("gelu", "gelu_tanh", "sigmoid", "tanh")
    return arch.m4f_elementwise_cycles + (arch.exp_unit_cycles + 6 if transcendental else 0)


def layer_work(program: Program, index: int, arch: SpinnArch) -> None:
    """Set ``layer.gemm`` and ``layer.flops`` (operations of the layer, the cost model's work)."""
    layer = program.layers[index]
    out_shape = program.tensors[layer.output].shape
    n_out = int(np.prod(out_shape, dtype=np.int64))
    kind = layer.kind
    if kind in GEMM_KINDS:
        g = gemm_shape(program, layer)
        layer.gemm = [g.m, g.n, g.k]
        layer.flops = 2 * g.batch * g.m * g.n * g.k
    elif kind in ROW_KINDS:
        row = layer.attrs["row"] if kind == "mean" else out_shape[-1]
        rows = n_out if kind == "mean" else n_out // row
        layer.flops = int(rows * row * _row_per_elem(kind, arch))
    elif kind in POOL_KINDS:
        n, c, _, _, oh, ow, kh, kw, *_ = _pool_geometry(program, layer)
        layer.flops = n * c * oh * ow * kh * kw
    elif kind in ("reshape", "permute_dims", "broadcast_to"):
        layer.flops = 0
    else:
        layer.flops = n_out * (8 if kind in ("gelu", "gelu_tanh", "sigmoid", "tanh") else 1)


def choose_tile(program: Program, index: int, arch: SpinnArch, pes: int | None = None,
                naive: bool = False) -> list[int]:
    """The tile shape of layer ``index`` for ``pes`` PEs (see :mod:`tvm_spinn.program.tiles`)."""
    pes = pes or arch.total_pes
    layer = program.layers[index]
    _check_nonempty(program, layer)
    _check_fits(program, index, arch)
    t = program.tensors
    out_shape = t[layer.output].shape
    if layer.kind in GEMM_KINDS:
        g = gemm_shape(program, layer)
        in_fn = (lambda vn: int(_conv_input_bytes(program, layer, 0, vn))) if layer.kind == "conv2d" else None
        _, elems, side = _gemm_operands(program, layer)
        return list(choose_gemm_tile(g, arch, layer.name, pes=pes, kind=layer.kind, naive=naive,
                                     input_bytes=in_fn, mode=layer.mode, elem_bytes=elems, int8=side))
    n_out = int(np.prod(out_shape, dtype=np.int64))
    ie = sum(_itemsize(program, tid) for tid in layer.inputs)  # bytes per element of all inputs
    oe = _itemsize(program, layer.output)
    if layer.kind in ROW_KINDS:
        row = layer.attrs["row"] if layer.kind == "mean" else out_shape[-1]
        rows = n_out if layer.kind == "mean" else n_out // row
        cap = max(1, _working_budget(arch) // (2 * (ie + oe) * row))
        return [max(1, min(cap, _ceil(rows, pes)))]
    if layer.kind in POOL_KINDS:
        n, c, h, w, oh, ow, kh, kw, sh, khe, wp = _pool_geometry(program, layer)

        def band_bytes(rows: int) -> int:  # one plane's input band (with halo) and output rows
            return ie * ((rows - 1) * sh + khe) * wp + oe * rows * ow

        budget = _working_budget(arch)
        rows = oh
        while rows > 1 and 2 * band_bytes(rows) > budget:
            rows = _ceil(rows, 2)
        if 2 * band_bytes(rows) > arch.tile_sram_bytes:
            need = 2 * band_bytes(1)
            raise MappingError(
                f"layer {layer.name}: one output row of a {h}x{w} plane needs {need} bytes of SRAM, "
                f"a PE has {arch.tile_sram_bytes}; the smallest system that fits has sram_bytes >= "
                f"{need + arch.sram_reserved_bytes}"
            )
        planes = 1 if rows < oh else max(1, min(budget // (2 * band_bytes(oh)), _ceil(n * c, pes)))
        return [planes, rows]
    return [_flat_size(n_out, ie + oe, arch, pes)]


def tile_costs(program: Program, index: int, arch: SpinnArch, tile) -> TileTable:
    """The tiles of layer ``index`` cut by ``tile``, with their bytes, SRAM and cycles
    (vectorized; unplaced: ``pe = chip = -1``)."""
    layer = program.layers[index]
    t = program.tensors
    lo, hi, group = expand_regions(program, index, tile)
    count = len(group)
    ks = k_splits(program, index, tile)
    ext = hi - lo

    def table(sram, in_b, w_b, out_b, cycles) -> TileTable:
        full = lambda v: np.broadcast_to(np.asarray(v, dtype=np.int64), (count,)).copy()  # noqa: E731
        return TileTable(layer=index, k_splits=ks, lo=lo, hi=hi, group=group,
                         pe=np.full(count, -1, np.int64), chip=np.full(count, -1, np.int64),
                         sram_bytes=full(sram), in_bytes=full(in_b), w_bytes=full(w_b),
                         out_bytes=full(out_b), cycles=full(cycles))

    if layer.kind in GEMM_KINDS:
        g = gemm_shape(program, layer)
        w_tid, elems, side = _gemm_operands(program, layer)
        ae, be, _, oe = _operand_elems(layer.kind, layer.mode, elems)
        tk = min(int(tile[2]), g.k)
        vm, vn = ext[:, 1], ext[:, 2]
        pm, pn = -(-vm // arch.mac_rows) * arch.mac_rows, -(-vn // arch.mac_cols) * arch.mac_cols
        a_bytes, b_bytes = ae * vm * g.k, be * g.k * vn
        if layer.kind == "conv2d":
            in_b, w_b = _conv_input_bytes(program, layer, lo[:, 2], hi[:, 2]), a_bytes
        else:
            in_b, w_b = a_bytes, b_bytes
        # Per-channel epilogue data (bias; int8: acc_offset, multiplier, shift, scale...) travels
        # with the weight block: the tile's output channels of every const but the weight.
        channels = t[w_tid].shape[0] if layer.kind == "conv2d" else g.n
        v = vm if layer.kind == "conv2d" else vn
        for role, tid in sorted(layer.consts.items()):
            if role == "weight" or tid == w_tid:
                continue
            numel = int(np.prod(t[tid].shape, dtype=np.int64))
            size = _itemsize(program, tid)
            w_b = w_b + (size * v * max(1, numel // channels) if numel >= channels else size * numel)
        cycles = np.ceil(gemm_tile_cycles(vm, vn, g.k, ks, arch, layer.mode, side))
        return table(_gemm_tile_bytes(pm, pn, tk, ae, be), in_b, w_b, oe * vm * vn, cycles)
    ie = sum(_itemsize(program, tid) for tid in layer.inputs)
    oe = _itemsize(program, layer.output)
    if layer.kind in ROW_KINDS:
        out_shape = t[layer.output].shape
        row = layer.attrs["row"] if layer.kind == "mean" else out_shape[-1]
        r = ext[:, 0]
        n = r * row
        n_res = r if layer.kind == "mean" else n
        w_b = row * sum(_itemsize(program, tid) for tid in layer.consts.values())
        cycles = np.ceil(n * _row_per_elem(layer.kind, arch) * arch.m4f_elementwise_cycles / 2)
        return table(2 * (ie * n + oe * n_res), ie * n, w_b, oe * n_res, cycles)
    if layer.kind in POOL_KINDS:
        n, c, h, w, oh, ow, kh, kw, sh, khe, wp = _pool_geometry(program, layer)
        k, rows = ext[:, 0], ext[:, 1]
        band = ie * ((rows - 1) * sh + khe) * wp + oe * rows * ow
        cycles = np.floor(k * rows * ow * kh * kw * arch.m4f_elementwise_cycles / 2)
        return table(2 * band * k, ie * k * np.minimum(h, (rows - 1) * sh + khe) * w,
                     0, oe * k * rows * ow, cycles)
    e = ext[:, 0]
    if layer.kind in ("reshape", "permute_dims", "broadcast_to"):
        # Pure data movement: the DMA engine gathers with strides; ~1 cycle/element of setup.
        cycles = e
    else:  # element-wise (also quantize: fp32 -> int8/uint8, dequantize: int8/uint8 -> fp32)
        cycles = np.ceil(e * _elementwise_per_elem(layer.kind, arch))
    return table(2 * (ie + oe) * e, ie * e, 0, oe * e, cycles)


def tile_layer(program: Program, index: int, arch: SpinnArch, pes: int | None = None,
               naive: bool = False) -> TileTable:
    """Tiles (without PE assignment) of ``program.layers[index]`` for ``pes`` PEs: the tile
    shape :func:`choose_tile` picks, expanded with its costs (:func:`tile_costs`). Sets the
    layer's ``gemm`` and ``flops``."""
    layer_work(program, index, arch)
    return tile_costs(program, index, arch, choose_tile(program, index, arch, pes, naive))
