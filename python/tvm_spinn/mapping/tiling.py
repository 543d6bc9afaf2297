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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..program import Layer, Program, Tile
from ..target.arch import SpinnArch

__all__ = ["GemmShape", "gemm_shape", "choose_gemm_tile", "safe_k_chunk", "tile_layer", "MappingError"]

_F32 = 4


class MappingError(ValueError):
    """A layer that cannot be mapped onto the chosen system (names layer and size)."""


@dataclass(frozen=True)
class GemmShape:
    batch: int
    m: int
    n: int
    k: int


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil(a, b) * b


def gemm_shape(program: Program, layer: Layer) -> GemmShape:
    """GEMM view of a conv2d / dense / matmul layer."""
    t = program.tensors
    out = t[layer.output].shape
    if layer.kind == "conv2d":
        w = t[layer.consts["weight"]].shape
        groups = layer.attrs["groups"]
        return GemmShape(batch=out[0] * groups, m=w[0] // groups, n=out[2] * out[3], k=w[1] * w[2] * w[3])
    if layer.kind == "dense":
        w = t[layer.consts["weight"]].shape
        return GemmShape(batch=1, m=int(np.prod(out[:-1], dtype=np.int64)), n=w[1], k=w[0])
    a, b = t[layer.inputs[0]].shape, t[layer.inputs[1]].shape
    batch = int(np.prod(out[:-2], dtype=np.int64)) if len(out) > 2 else 1
    return GemmShape(batch=batch, m=a[-2], n=b[-1], k=a[-1])


def _gemm_tile_bytes(tm: int, tn: int, tk: int) -> int:
    # A and B chunks double-buffered (DMA of chunk i+1 overlaps compute of chunk i) + accumulators.
    return _F32 * (2 * (tm * tk + tk * tn) + tm * tn)


#: Share of a PE's tile SRAM a tile's working buffers may take when a smaller tile also fits;
#: the rest is left to the memory planner for resident weights and on-chip activations.
WORKING_SHARE = 0.5


def _working_budget(arch: SpinnArch) -> int:
    return max(int(arch.tile_sram_bytes * WORKING_SHARE), min(arch.tile_sram_bytes, _gemm_tile_bytes(
        arch.mac_rows, arch.mac_cols, 4 * arch.mac_rows)))


def _weight_is_a(kind: str) -> bool:
    """conv2d keeps weights in the A operand (rows = output channels); dense in B."""
    return kind == "conv2d"


def safe_k_chunk(arch: SpinnArch, operand_bits: int = 8) -> int:
    """Longest reduction a MAC-array accumulator can take without overflowing.

    Each product of two signed ``operand_bits`` values is at most ``2**(2*(bits-1))`` in
    magnitude (-128 * -128 for int8), so ``k`` products fit a signed ``acc_bits`` accumulator when
    ``k * 2**(2*(bits-1)) <= 2**(acc_bits-1) - 1``: 16383 for int8 into 29 bits. Longer reductions
    are split into chunks whose partial sums the M4F adds in 32-bit.
    """
    return max(1, (2 ** (arch.acc_bits - 1) - 1) // 2 ** (2 * (operand_bits - 1)))


def choose_gemm_tile(g: GemmShape, arch: SpinnArch, name: str = "gemm", pes: int | None = None,
                     kind: str = "dense", naive: bool = False,
                     input_bytes=None, mode: str = "fp32") -> tuple[int, int, int]:
    """Pick ``(tm, tn, tk)`` for a GEMM with the lowest estimated layer time.

    Candidates are multiples of the MAC array shape that fit ``arch.tile_sram_bytes``. The
    estimate spreads the tiles over ``pes`` PEs and takes ``max(per-PE compute and DMA, DRAM
    traffic / bandwidth + the last tile's compute)``, where the weight operand of a tile group is
    fetched once per PE (weight-stationary) and the activation operand once per tile
    (``input_bytes(vn)`` when given, e.g. a conv's input rows). Ties go to fewer tiles, then to
    the larger tile (deterministic). ``naive`` returns the smallest MAC-shaped tile.
    """
    budget = arch.tile_sram_bytes if naive else _working_budget(arch)
    r, c = arch.mac_rows, arch.mac_cols
    pes = pes or arch.total_pes
    if naive:
        tk = min(g.k, max(r, (budget - _F32 * r * c) // (_F32 * 2 * (r + c)) // r * r))
        if mode == "int8":
            tk = min(tk, safe_k_chunk(arch, 8))
        if _gemm_tile_bytes(r, c, min(tk, g.k)) > budget:
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
    rate = arch.m4f_flops_per_cycle
    chips = max(1, -(-pes // arch.pes_per_chip))
    dram_bytes_per_cycle = arch.dram_bw_bytes_s * chips / arch.clock_hz
    noc_bytes_per_cycle = arch.noc_bw_bytes_s * chips / arch.clock_hz
    weight_a = _weight_is_a(kind)
    best, best_key = None, None
    for tm in tms:
        for tn in tns:
            fixed = _F32 * tm * tn
            per_k = _F32 * 2 * (tm + tn)
            if fixed + per_k > budget:
                continue
            tk_max = (budget - fixed) // per_k
            tk = g.k if tk_max >= g.k else max(r, (tk_max // r) * r)
            if tk > tk_max:
                continue
            if mode == "int8":  # the MAC array's 29-bit accumulators must never wrap
                tk = min(tk, safe_k_chunk(arch, 8))
            mt, nt = _ceil(g.m, tm), _ceil(g.n, tn)
            tiles = g.batch * mt * nt
            groups = (g.batch * mt) if weight_a else nt
            per_pe = _ceil(tiles, pes)
            vm, vn = min(tm, g.m), min(tn, g.n)
            a_bytes, b_bytes = _F32 * vm * g.k, _F32 * g.k * vn
            w_bytes, x_bytes = (a_bytes, b_bytes) if weight_a else (b_bytes, a_bytes)
            if input_bytes is not None:
                x_bytes = input_bytes(vn)
            # A weight block stays in SRAM across its tiles only if it fits next to the buffers.
            w_stationary = w_bytes + _gemm_tile_bytes(tm, tn, min(tk, g.k)) <= budget
            w_loads = min(tiles, max(groups, pes)) if w_stationary else tiles
            compute = vm * vn * g.k / rate
            dma = (x_bytes + _F32 * vm * vn + (w_bytes * w_loads) / tiles) / arch.dma_bw_bytes_per_cycle
            ksplits = _ceil(g.k, tk)
            pe_time = per_pe * (max(compute, dma) + arch.dma_setup_cycles * ksplits)
            # Weight blocks cross DRAM once per group (the NoC multicasts them); activations are
            # assumed on-chip (NoC). The last tile computes after its load: no overlap for it.
            dram_time = groups * w_bytes / dram_bytes_per_cycle
            noc_time = (tiles * (x_bytes + _F32 * vm * vn) + w_loads * w_bytes) / noc_bytes_per_cycle
            key = (max(pe_time, max(dram_time, noc_time) + compute), tiles, -tm, -tn)
            if best_key is None or key < best_key:
                best, best_key = (tm, tn, tk), key
    if best is None:
        need = _gemm_tile_bytes(r, c, r)
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
    return _F32 * cg * rows * cols


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
    tiles: list[Tile] = []
    if layer.kind in ("conv2d", "dense", "matmul"):
        g = gemm_shape(program, layer)
        layer.gemm = [g.m, g.n, g.k]
        layer.flops = 2 * g.batch * g.m * g.n * g.k
        in_fn = (lambda vn: _conv_input_bytes(program, layer, 0, vn)) if layer.kind == "conv2d" else None
        tm, tn, tk = choose_gemm_tile(g, arch, layer.name, pes=pes, kind=layer.kind, naive=naive,
                                      input_bytes=in_fn, mode=layer.mode)
        ks = _ceil(g.k, tk)
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
                    a_bytes = _F32 * vm * g.k
                    b_bytes = _F32 * g.k * vn
                    in_b, w_b = (b_bytes, a_bytes) if layer.kind == "conv2d" else (a_bytes, b_bytes)
                    if layer.kind == "conv2d":
                        in_b = _conv_input_bytes(program, layer, n0, n0 + vn)
                    if "bias" in layer.consts:  # the bias slice travels with the weight block
                        w_b += _F32 * (vm if layer.kind == "conv2d" else vn)
                    tiles.append(Tile(
                        layer=index, pe=-1, region=[[b, b + 1], [m0, m0 + vm], [n0, n0 + vn]],
                        k_splits=ks, group=group, sram_bytes=_gemm_tile_bytes(pm, pn, min(tk, g.k)),
                        in_bytes=in_b, w_bytes=w_b, out_bytes=_F32 * vm * vn,
                        cycles=int(math.ceil(vm * vn * g.k / arch.m4f_flops_per_cycle)),
                    ))
        return tiles
    n_out = int(np.prod(out_shape, dtype=np.int64))
    if layer.kind in ("softmax", "layer_norm", "mean"):
        row = layer.attrs["row"] if layer.kind == "mean" else out_shape[-1]
        rows = n_out if layer.kind == "mean" else n_out // row
        per_elem = {"softmax": 3.0 + arch.exp_unit_cycles, "layer_norm": 6.0, "mean": 1.0}[layer.kind]
        layer.flops = int(rows * row * per_elem)
        cap = max(1, _working_budget(arch) // (2 * 2 * _F32 * row))
        size = max(1, min(cap, _ceil(rows, pes)))
        for r0 in range(0, rows, size):
            r1 = min(r0 + size, rows)
            n = (r1 - r0) * row
            n_res = (r1 - r0) if layer.kind == "mean" else n
            tiles.append(Tile(layer=index, pe=-1, region=[[r0, r1]], sram_bytes=2 * _F32 * (n + n_res),
                              in_bytes=_F32 * n, out_bytes=_F32 * n_res, w_bytes=_F32 * row * len(layer.consts),
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
            return _F32 * (((rows - 1) * sh + khe) * wp + rows * ow)

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
                    in_bytes=_F32 * k * min(h, (r1 - r0 - 1) * sh + khe) * w, out_bytes=_F32 * k * (r1 - r0) * ow,
                    cycles=int(k * (r1 - r0) * ow * kh * kw * arch.m4f_elementwise_cycles / 2)))
        return tiles
    if layer.kind in ("reshape", "permute_dims", "broadcast_to"):
        # Pure data movement: the DMA engine gathers with strides; ~1 cycle/element of setup.
        layer.flops = 0
        for region in _flat_tiles(n_out, 2 * _F32, arch, pes):
            e = region[0][1] - region[0][0]
            tiles.append(Tile(layer=index, pe=-1, region=region, sram_bytes=2 * 2 * _F32 * e,
                              in_bytes=_F32 * e, out_bytes=_F32 * e, cycles=e))
        return tiles
    # Element-wise.
    n_in = len(layer.inputs)
    transcendental = layer.kind in ("gelu", "gelu_tanh", "sigmoid", "tanh")
    per_elem = arch.m4f_elementwise_cycles + (arch.exp_unit_cycles + 6 if transcendental else 0)
    layer.flops = n_out * (8 if transcendental else 1)
    for region in _flat_tiles(n_out, _F32 * (n_in + 1), arch, pes):
        e = region[0][1] - region[0][0]
        tiles.append(Tile(layer=index, pe=-1, region=region, sram_bytes=2 * _F32 * (n_in + 1) * e,
                          in_bytes=_F32 * n_in * e, out_bytes=_F32 * e,
                          cycles=int(math.ceil(e * per_elem))))
    return tiles
