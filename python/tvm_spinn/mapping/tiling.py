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

from ..program import Layer, Program, Tile
from ..program.gemm import GemmShape, gemm_shape, safe_k_chunk
from ..target.arch import SpinnArch

__all__ = [
    "GemmShape", "gemm_shape", "choose_gemm_tile", "gemm_tile_cycles", "Int8Side", "int8_side",
    "safe_k_chunk", "tile_layer", "MappingError", "ACC_BYTES",
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
    (see the module docstring); a float, callers round up."""
    if mode != "int8":
        return vm * vn * k / arch.m4f_flops_per_cycle
    side = side or Int8Side()
    passes = _ceil(vm, arch.mac_rows) * _ceil(vn, arch.mac_cols)
    array = passes * (k + k_splits * arch.mac_readout_cycles)
    sums = side.row_sums or side.col_sums
    per_out = (k_splits - 1) + int(side.fp32_out) + int(sums)
    m4f = per_out * vm * vn * arch.m4f_elementwise_cycles + k * (vm * side.row_sums + vn * side.col_sums)
    return float(max(array, m4f))


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


def _conv_input_bytes(program: Program, layer: Layer, p0: int, p1: int) -> int:
    """Bytes of input a conv tile DMAs for output pixels [p0, p1): the input window under those
    output pixels (with the kernel halo) of one group's channels; im2col happens in SRAM."""
    _, _, h, w = program.tensors[layer.inputs[0]].shape
    _, cg, kh, kw = program.tensors[layer.consts["weight"]].shape
    ow = program.tensors[layer.output].shape[3]
    sh, sw = layer.attrs["strides"]
    dh, dw = layer.attrs["dilation"]
    khe, kwe = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    pixels = p1 - p0
    if pixels < ow:  # part of one output row (two if it wraps): a strip of columns
        rows = khe * (1 if p0 // ow == (p1 - 1) // ow else 2)
        cols = min(w, (pixels - 1) * sw + kwe)
    else:
        rows = min(h, (-(-pixels // ow)) * sh + khe)
        cols = w
    return _itemsize(program, layer.inputs[0]) * cg * rows * cols


def _flat_tiles(total: int, bytes_per_elem: int, arch: SpinnArch, pes: int) -> list[list[list[int]]]:
    # Double-buffered in/out per element; spread over the PEs but never beyond SRAM.
    cap = max(1, _working_budget(arch) // (2 * bytes_per_elem))
    size = max(1, min(cap, _ceil(total, pes)))
    return [[[s, min(s + size, total)]] for s in range(0, total, size)]


def tile_layer(program: Program, index: int, arch: SpinnArch, pes: int | None = None,
               naive: bool = False) -> list[Tile]:
    """Tiles (without PE assignment) of ``program.layers[index]`` for ``pes`` PEs.

    GEMM tiles carry ``group``: tiles of a group share one weight block (conv2d: batch x group
    and output-channel block; dense: output-feature block), so placing a group on one PE fetches
    that block once. Other tiles have ``group = -1``.
    """
    pes = pes or arch.total_pes
    layer = program.layers[index]
    t = program.tensors
    out_shape = t[layer.output].shape
    # The partitioner keeps zero-size ops on the host; a program built by hand may not.
    for tid in (*layer.inputs, layer.output):
        if 0 in tuple(t[tid].shape):
            raise MappingError(f"layer {layer.name}: tensor {tid} has a zero-size shape "
                               f"{tuple(t[tid].shape)} (dim {tuple(t[tid].shape).index(0)}); "
                               "zero-size ops run on the host")
    tiles: list[Tile] = []
    if layer.kind in ("conv2d", "dense", "matmul"):
        g = gemm_shape(program, layer)
        layer.gemm = [g.m, g.n, g.k]
        layer.flops = 2 * g.batch * g.m * g.n * g.k
        in_fn = (lambda vn: _conv_input_bytes(program, layer, 0, vn)) if layer.kind == "conv2d" else None
        w_tid = layer.inputs[1] if layer.kind == "matmul" else layer.consts["weight"]
        elems = tuple(_itemsize(program, tid) for tid in (layer.inputs[0], w_tid, layer.output))
        ae, be, _, oe = _operand_elems(layer.kind, layer.mode, elems)
        side = int8_side(program, layer) if layer.mode == "int8" else None
        tm, tn, tk = choose_gemm_tile(g, arch, layer.name, pes=pes, kind=layer.kind, naive=naive,
                                      input_bytes=in_fn, mode=layer.mode, elem_bytes=elems, int8=side)
        ks = _ceil(g.k, tk)
        # Per-channel epilogue data (bias; int8: acc_offset, multiplier, shift, scale...) travels
        # with the weight block: the tile's output channels of every const but the weight.
        channels = t[w_tid].shape[0] if layer.kind == "conv2d" else g.n
        epilogue = []  # (elements per output channel, or -1: all of it; itemsize; elements)
        for role, tid in sorted(layer.consts.items()):
            if role == "weight" or tid == w_tid:
                continue
            numel = int(np.prod(t[tid].shape, dtype=np.int64))
            per_channel = max(1, numel // channels) if numel >= channels else -1
            epilogue.append((per_channel, _itemsize(program, tid), numel))
        for b in range(g.batch):
            for m0 in range(0, g.m, tm):
                for n0 in range(0, g.n, tn):
                    if layer.kind == "conv2d":
                        group = b * _ceil(g.m, tm) + m0 // tm
                    elif layer.kind == "dense":
                        group = n0 // tn
                    else:
                        group = -1
                    vm, vn = min(tm, g.m - m0), min(tn, g.n - n0)
                    pm, pn = _round_up(vm, arch.mac_rows), _round_up(vn, arch.mac_cols)
                    a_bytes = ae * vm * g.k
                    b_bytes = be * g.k * vn
                    in_b, w_b = (b_bytes, a_bytes) if layer.kind == "conv2d" else (a_bytes, b_bytes)
                    if layer.kind == "conv2d":
                        in_b = _conv_input_bytes(program, layer, n0, n0 + vn)
                    v = vm if layer.kind == "conv2d" else vn
                    for per_channel, size, numel in epilogue:
                        w_b += size * (v * per_channel if per_channel > 0 else numel)
                    tiles.append(Tile(
                        layer=index, pe=-1, region=[[b, b + 1], [m0, m0 + vm], [n0, n0 + vn]],
                        k_splits=ks, group=group, sram_bytes=_gemm_tile_bytes(pm, pn, min(tk, g.k), ae, be),
                        in_bytes=in_b, w_bytes=w_b, out_bytes=oe * vm * vn,
                        cycles=int(math.ceil(gemm_tile_cycles(vm, vn, g.k, ks, arch, layer.mode, side))),
                    ))
        return tiles
    n_out = int(np.prod(out_shape, dtype=np.int64))
    ie = sum(_itemsize(program, tid) for tid in layer.inputs)  # bytes per element of all inputs
    oe = _itemsize(program, layer.output)
    if layer.kind in ("softmax", "layer_norm", "mean"):
        row = layer.attrs["row"] if layer.kind == "mean" else out_shape[-1]
        rows = n_out if layer.kind == "mean" else n_out // row
        per_elem = {"softmax": 3.0 + arch.exp_unit_cycles, "layer_norm": 6.0, "mean": 1.0}[layer.kind]
        layer.flops = int(rows * row * per_elem)
        cap = max(1, _working_budget(arch) // (2 * (ie + oe) * row))
        size = max(1, min(cap, _ceil(rows, pes)))
        for r0 in range(0, rows, size):
            r1 = min(r0 + size, rows)
            n = (r1 - r0) * row
            n_res = (r1 - r0) if layer.kind == "mean" else n
            tiles.append(Tile(layer=index, pe=-1, region=[[r0, r1]], sram_bytes=2 * (ie * n + oe * n_res),
                              in_bytes=ie * n, out_bytes=oe * n_res,
                              w_bytes=row * sum(_itemsize(program, tid) for tid in layer.consts.values()),
                              cycles=int(math.ceil(n * per_elem * arch.m4f_elementwise_cycles / 2))))
        return tiles
    if layer.kind in ("max_pool2d", "avg_pool2d"):
        n, c, h, w = t[layer.inputs[0]].shape
        oh, ow = out_shape[2], out_shape[3]
        kh, kw = layer.attrs["pool_size"]
        layer.flops = n * c * oh * ow * kh * kw
        sh = layer.attrs["strides"][0]
        khe = (kh - 1) * layer.attrs["dilation"][0] + 1
        wp = w + layer.attrs["padding"][1] + layer.attrs["padding"][3]

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
        planes_per = 1 if rows < oh else max(1, min(budget // (2 * band_bytes(oh)), _ceil(n * c, pes)))
        for p0 in range(0, n * c, planes_per):
            p1 = min(p0 + planes_per, n * c)
            for r0 in range(0, oh, rows):
                r1 = min(r0 + rows, oh)
                k = (p1 - p0)
                tiles.append(Tile(
                    layer=index, pe=-1, region=[[p0, p1], [r0, r1]], sram_bytes=2 * band_bytes(r1 - r0) * k,
                    in_bytes=ie * k * min(h, (r1 - r0 - 1) * sh + khe) * w, out_bytes=oe * k * (r1 - r0) * ow,
                    cycles=int(k * (r1 - r0) * ow * kh * kw * arch.m4f_elementwise_cycles / 2)))
        return tiles
    if layer.kind in ("reshape", "permute_dims", "broadcast_to"):
        # Pure data movement: the DMA engine gathers with strides; ~1 cycle/element of setup.
        layer.flops = 0
        for region in _flat_tiles(n_out, ie + oe, arch, pes):
            e = region[0][1] - region[0][0]
            tiles.append(Tile(layer=index, pe=-1, region=region, sram_bytes=2 * (ie + oe) * e,
                              in_bytes=ie * e, out_bytes=oe * e, cycles=e))
        return tiles
    # Element-wise (also quantize: fp32 -> int8/uint8, dequantize: int8/uint8 -> fp32).
    transcendental = layer.kind in ("gelu", "gelu_tanh", "sigmoid", "tanh")
    per_elem = arch.m4f_elementwise_cycles + (arch.exp_unit_cycles + 6 if transcendental else 0)
    layer.flops = n_out * (8 if transcendental else 1)
    for region in _flat_tiles(n_out, ie + oe, arch, pes):
        e = region[0][1] - region[0][0]
        tiles.append(Tile(layer=index, pe=-1, region=region, sram_bytes=2 * (ie + oe) * e,
                          in_bytes=ie * e, out_bytes=oe * e,
                          cycles=int(math.ceil(e * per_elem))))
    return tiles
