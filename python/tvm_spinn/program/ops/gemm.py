"""GEMMs: ``conv2d`` (NCHW / OIHW, grouped and depthwise), ``dense`` (``x @ W``) and batched
``matmul``, in fp32 on the Cortex-M4F or int8 on the MAC array.

GEMM view ``C[b, m, n] = sum_k A[b, m, k] B[b, k, n]`` (:func:`gemm_shape`): conv2d uses ``A = weight[oc, ic*kh*kw]`` (m = output channel), ``B = im2col
(input)`` (n = output pixel), b = batch x group; dense and matmul use ``A = input`` and ``B =
weight``/rhs (matmul's batches broadcast).

- fp32 arithmetic: ``acc = fl(acc + fl(a * b))`` with k strictly ascending from 0 (VMLA.F32 is
  not fused); each output reduces on one PE whatever the tiling, so the result does not depend
  on it. Bias is added to the finished accumulator, then ReLU (``x > 0 ? x : +0``).
- int8 arithmetic (``mode="int8"``): raw int8 products into ``acc_bits``-bit wrapping
  accumulators, one k-chunk at a time (chunks of :func:`chunk_length`, at most
  :func:`safe_k_chunk` long); the M4F adds chunk sums in 32-bit,
  applies the zero-point terms and the epilogue (dequantize, or requantize with a fixed-point
  multiplier: :mod:`tvm_spinn.program.quant`). ``uint8`` operands have their top bit flipped.
- Tiles: ``[tm, tn, tk]``, regions ``[[b, b+1], [m0, m1], [n0, n1]]`` in ``b``, ``m0``, ``n0``
  order; the reduction streams through the tile's PE in ``k_splits = ceil(K / tk)`` chunks
  (output stationary). Tiles of one group share a weight block (conv2d: ``b * ceil(M / tm) +
  m0 // tm``; dense: ``n0 // tn``; matmul: none). Tile shapes are chosen by a cost model among
  candidates padded to the MAC array (:func:`choose_gemm_tile`).
- Reduction split over PEs (int8 only): tile ``[tm, tn, tk, p]`` cuts each output region's
  ``k_splits`` chunks into ``p`` contiguous parts (:func:`k_part_bounds`, on chunk boundaries),
  each a tile of its own with a fourth region axis ``[k0, k1]`` (parts innermost) and its own
  weight block (group ``g * p + j``). Every chunk stays within :func:`safe_k_chunk` products, so
  no accumulator wraps and the int32 sum of the parts' partial sums is the whole reduction's
  (integer adds are exact in any order): the bits do not depend on ``p``. The last part
  (``k1 = K``) reduces: it DMAs the other parts' ``vm*vn`` int32 partials over the NoC, adds them
  and runs the epilogue, after its own chunks (:func:`k_part_tail_cycles`; the partials' few
  bytes are costed there, in its DMA time, not in the chip's NoC traffic), with one more
  accumulator block of SRAM to receive them. fp32 tiles never split (their k order is the
  result).
- Compute cycles of a tile (:func:`gemm_tile_cycles`): fp32 ``vm * vn * K /
  m4f_flops_per_cycle``; int8: the tile padded to ``mac_rows x mac_cols`` blocks in the orientation
  that pads least (:func:`mac_passes`), each streaming
  its reduction one k-chunk at a time (1 cycle per k) then reading out its sums, overlapped with
  the M4F's share (:class:`Int8Side`: partial-sum adds, a dequantizing epilogue, zero-point sums
  of activation operands). ``layer.flops`` is ``2 * M * N * K`` in both modes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ... import _lib
from ... import options as _options
from ..checks import PAD4, POS2, POSINT, RELU, ZERO, check_bool, check_str, fail
from ..model import Layer
from ..noc import noc_port_cycles
from ..quant import (QUANT_RANGES, ROUNDINGS, quantize_multiplier, quantize_multiplier_tflite, requantize,
                     requantize_tflite, to_signed)
from . import native
from .base import ACC_BYTES, LoweringError, MappingError, OpFamily, ceil_div, gemm_tile_bytes, itemsize, register, starts, working_budget
from .elementwise import relu
from .sharding import (PARTIAL, REPLICATE, ROW_ALWAYS, GatherInput, PointwiseRule, ShardDecision, ShardingRule,
                       part, shard)

if TYPE_CHECKING:
    from ...target.arch import SpinnArch

__all__ = ["Gemm", "weight_matmuls_to_dense", "fuse_bias", "GemmShape", "gemm_shape", "safe_k_chunk", "Int8Side", "int8_side", "gemm_tile_cycles", "mac_passes", "choose_gemm_tile",
           "smallest_gemm_tile_bytes", "splits_of", "chunk_length", "k_part_bounds", "k_part_tail_cycles", "GEMM_KINDS"]

GEMM_KINDS = ("conv2d", "dense", "matmul")
_F32 = np.float32
_QRANGE = {"int8": (-128, 127), "uint8": (0, 255)}
_REQUANT = {"y_zero": ZERO, "y_min": ZERO, "y_max": ZERO}
_CONV = {"strides": POS2, "padding": PAD4, "dilation": POS2, "groups": POSINT}
_INT8 = {"x_zero": ZERO, "x_flip": check_bool, "relu": check_bool,
         "out": lambda v, f: check_str(v, f, ("float32", "int8", "uint8"))}


@dataclass(frozen=True)
class GemmShape:
    batch: int
    m: int
    n: int
    k: int


def gemm_shape(program, layer: Layer) -> GemmShape:
    """GEMM view of a conv2d / dense / matmul layer of ``program`` (see the module docstring)."""
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


def safe_k_chunk(arch, operand_bits: int = 8) -> int:
    """Longest reduction a MAC-array accumulator can take without overflowing.

    Each product of two signed ``operand_bits`` values is at most ``2**(2*(bits-1))`` in
    magnitude (-128 * -128 for int8), so ``k`` products fit a signed ``acc_bits`` accumulator when
    ``k * 2**(2*(bits-1)) <= 2**(acc_bits-1) - 1``: 511 for int8 into the production chip's 24
    bits, 16383 into the test chip's 29. Longer reductions are split into chunks whose partial
    sums the M4F adds in 32-bit.

    ``arch`` is a :class:`tvm_spinn.target.arch.SpinnArch` (only ``acc_bits`` is read).
    """
    return max(1, (2 ** (arch.acc_bits - 1) - 1) // 2 ** (2 * (operand_bits - 1)))


def splits_of(k: int, tk: int) -> int:
    """Reduction chunks of a GEMM tile with reduction ``k`` and tile depth ``tk``."""
    return -(-k // min(int(tk), k)) if k else 1


def chunk_length(k: int, tk: int) -> int:
    """Products per chunk, ``ceil(k / splits)``: what one accumulator takes (same for every
    chunk but possibly the last)."""
    return -(-k // splits_of(k, tk)) if k else 1


# -- costs ----------------------------------------------------------------------------------------
def _weight_is_a(kind: str) -> bool:
    """conv2d keeps weights in the A operand (rows = output channels); dense in B."""
    return kind == "conv2d"


def _operand_elems(kind: str, mode: str, elem_bytes) -> tuple[int, int, int, int]:
    """``(a, b, activation, output)`` element bytes; ``elem_bytes`` is ``(activation, weight,
    output)`` (matmul: lhs, rhs, output) or None for the mode's default (fp32: 4, 4, 4; int8:
    1, 1, 4)."""
    if elem_bytes is None:
        elem_bytes = (1, 1, ACC_BYTES) if mode == "int8" else (4, 4, 4)
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


def int8_side(program, layer: Layer) -> Int8Side:
    """What the M4F does for an int8 GEMM layer besides adding k-chunk partial sums."""
    fp32_out = program.tensors[layer.output].dtype == "float32"
    a = layer.attrs
    w_zero = "w_zero" in layer.consts
    if layer.kind == "conv2d":  # A = weight, B = im2col(x): x sums needed when zw != 0
        return Int8Side(fp32_out, False, w_zero)
    if layer.kind == "dense":  # A = x, B = weight
        return Int8Side(fp32_out, w_zero, False)
    return Int8Side(fp32_out, a.get("b_zero", 0) != 0, a.get("x_zero", 0) != 0)


def mac_passes(vm, vn, arch: "SpinnArch"):
    """Output blocks the MAC array computes for a ``vm x vn`` tile: the array's ``mac_rows x
    mac_cols`` (16 x 4) outputs hold either operand on either side, so the tile is cut the way
    that pads least (a batch-1 GEMV puts its one row on the 4-wide side: 1 of 4 array lanes
    used, where the 16-wide side would use 1 of 16). Timing only: the bits of an int8 GEMM do
    not depend on the order its sums are formed in. ``vm``, ``vn`` may be int64 arrays."""
    r, c = arch.mac_rows, arch.mac_cols
    return np.minimum(ceil_div(vm, r) * ceil_div(vn, c), ceil_div(vm, c) * ceil_div(vn, r))


def gemm_tile_cycles(vm: int, vn: int, k: int, k_splits: int, arch: "SpinnArch", mode: str = "fp32",
                     side: Int8Side | None = None) -> float:
    """Compute cycles of a ``vm x vn`` GEMM tile with reduction ``k`` in ``k_splits`` chunks
    (see the module docstring); a float, callers round up. ``vm`` and ``vn`` may be int64
    arrays (one entry per tile): the result is then a float64 array."""
    if mode != "int8":
        return vm * vn * k / arch.m4f_flops_per_cycle
    side = side or Int8Side()
    passes = mac_passes(vm, vn, arch)
    array = passes * (k + k_splits * arch.mac_readout_cycles)
    sums = side.row_sums or side.col_sums
    per_out = (k_splits - 1) + int(side.fp32_out) + int(sums)
    m4f = per_out * vm * vn * arch.m4f_elementwise_cycles + k * (vm * side.row_sums + vn * side.col_sums)
    longer = np.maximum(array, m4f)
    return longer.astype(np.float64) if isinstance(longer, np.ndarray) else float(longer)


def k_part_bounds(k: int, tk: int, parts: int) -> np.ndarray:
    """``[parts + 1]`` k bounds of a tile's reduction cut into ``parts`` contiguous runs of its
    :func:`splits_of` chunks (part ``j`` takes chunks ``j * S // parts`` up to ``(j + 1) * S //
    parts``): chunk boundaries, so every part streams the very chunks the whole tile would."""
    ks, c = splits_of(k, tk), chunk_length(k, tk)
    return np.minimum(np.arange(parts + 1, dtype=np.int64) * ks // parts * c, k)


def k_part_tail_cycles(vm, vn, parts: int, arch: "SpinnArch", side: Int8Side | None) -> float:
    """Cycles the reducing part of a split int8 tile spends after its own chunks: per other part
    a NoC DMA of its ``vm*vn`` int32 partial sums (``dma_setup_cycles`` + bytes /
    ``dma_bw_bytes_per_cycle``) and ``vm*vn`` 32-bit adds on the M4F (plus the zero-point sums'
    ``vm`` / ``vn`` adds), then the dequantizing epilogue (``fp32_out``). Serial: the partials
    are ready only when the other parts finish (taken to finish with it)."""
    side = side or Int8Side()
    others = parts - 1
    dma = others * (arch.dma_setup_cycles + ACC_BYTES * vm * vn / arch.dma_bw_bytes_per_cycle)
    adds = (others * (vm * vn + vm * side.row_sums + vn * side.col_sums) + int(side.fp32_out) * vm * vn)
    return dma + adds * arch.m4f_elementwise_cycles


def _part_side(side: Int8Side | None) -> Int8Side:
    """What one part of a split int8 reduction computes besides its MAC-array sums: its zero-point
    sums, not the dequantizing epilogue (the reducing part runs that, :func:`k_part_tail_cycles`)."""
    side = side or Int8Side()
    return Int8Side(row_sums=side.row_sums, col_sums=side.col_sums)


def _round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def choose_gemm_tile(g: GemmShape, arch: "SpinnArch", name: str = "gemm", pes: int | None = None,
                     kind: str = "dense", naive: bool = False,
                     input_bytes=None, mode: str = "fp32", elem_bytes=None,
                     int8: Int8Side | None = None, split_k: bool = False,
                     resident: bool = False) -> tuple[int, ...]:
    """Pick ``(tm, tn, tk)`` for a GEMM with the lowest estimated layer time; with ``split_k``
    (what the mapper asks), ``(tm, tn, tk, p)`` for an int8 GEMM whose tiles' reductions split
    over ``p`` PEs each (tried when the tiles leave PEs idle, ``tiles * p <= pes``; kept only
    when strictly faster).

    Candidates are multiples of the MAC array shape that fit ``arch.tile_sram_bytes``. The
    estimate spreads the tiles over ``pes`` PEs and takes ``max(per-PE compute and DMA, DRAM
    traffic / bandwidth + the last tile's compute)``, where the weight operand of a tile group is
    fetched once per PE (weight-stationary) and the activation operand once per tile
    (``input_bytes(vn)`` when given, e.g. a conv's input rows); ``resident`` weights are in SRAM
    before the inference and move no bytes. The NoC is costed as the timing model costs it
    (:func:`tvm_spinn.program.noc.noc_port_cycles`, the tiles spread evenly over the PEs).
    Ties go to fewer tiles, then to the larger tile (deterministic). ``naive`` returns the
    smallest MAC-shaped tile.

    ``elem_bytes`` is ``(activation, weight, output)`` element bytes (matmul: lhs, rhs, output),
    by default the mode's (fp32: 4, 4, 4; int8: 1, 1, 4); compute time follows ``mode``
    (:func:`gemm_tile_cycles`: the M4F for fp32, the MAC array for int8, with the M4F's share
    ``int8``, by default a dequantizing epilogue when the output takes 4 bytes).
    """
    budget = arch.tile_sram_bytes if naive else working_budget(arch)
    r, c = arch.mac_rows, arch.mac_cols
    pes = pes or arch.total_pes
    ae, be, _, oe = _operand_elems(kind, mode, elem_bytes)
    int8 = int8 or Int8Side(fp32_out=oe == 4)
    if naive:
        tk = min(g.k, max(r, (budget - ACC_BYTES * r * c) // (2 * (ae * r + be * c)) // r * r))
        if mode == "int8":
            tk = min(tk, safe_k_chunk(arch, 8))
        if gemm_tile_bytes(r, c, min(tk, g.k), ae, be) > budget:
            raise MappingError(f"layer {name}: a {r}x{c} tile does not fit {budget} bytes of SRAM")
        return r, c, tk
    m_cap, n_cap = _round_up(g.m, r), _round_up(g.n, c)
    # Powers of two, plus sizes that split the work into about k tiles per PE (load balance).
    tms = {min(r * 2**i, m_cap) for i in range(12)}
    tns = {min(c * 2**i, n_cap) for i in range(14)}
    for k in range(1, 9):
        tns.add(min(n_cap, _round_up(ceil_div(g.n * g.batch * ceil_div(g.m, m_cap), k * pes), c)))
        tms.add(min(m_cap, _round_up(ceil_div(g.m * g.batch, k * pes), r)))
    if mode != "int8":
        # fp32 runs on the M4F, which has no row or column granularity (the MAC array's shape
        # only matters to int8): tiles that split a few output columns (a decode step's
        # matrix-vector product) or a narrow shard's columns and rows exactly over the PEs
        # keep more PEs busy (each PE streams its own weight columns). Buffers stay MAC-shaped
        # (tile_costs pads them), so the SRAM check below pads too.
        if g.m * g.batch < r:
            tns.update({1, 2})
        tns.update(min(g.n, ceil_div(g.n * g.batch * ceil_div(g.m, m_cap), k * pes)) for k in range(1, 9))
    tms, tns = sorted(tms), sorted(tns)
    chips = max(1, -(-pes // arch.pes_per_chip))
    dram_bytes_per_cycle = arch.dram_bw_bytes_s * chips / arch.clock_hz
    pe_ids = np.arange(pes, dtype=np.int64)
    chip_ids = pe_ids // arch.pes_per_chip
    weight_a = _weight_is_a(kind)
    best, best_key = None, None
    for tm in tms:
        for tn in tns:
            pm, pn = _round_up(tm, r), _round_up(tn, c)  # the buffers tile_costs reserves
            fixed = ACC_BYTES * pm * pn
            per_k = 2 * (ae * pm + be * pn)
            if fixed + per_k > budget:
                continue
            tk_max = (budget - fixed) // per_k
            tk = g.k if tk_max >= g.k else max(r, (tk_max // r) * r)
            if tk > tk_max:
                continue
            if mode == "int8":  # the MAC array's acc_bits-bit accumulators must never wrap
                tk = min(tk, safe_k_chunk(arch, 8))
            mt, nt = ceil_div(g.m, tm), ceil_div(g.n, tn)
            tiles = g.batch * mt * nt
            groups = (g.batch * mt) if weight_a else nt
            per_pe = ceil_div(tiles, pes)
            vm, vn = min(tm, g.m), min(tn, g.n)
            a_bytes, b_bytes = ae * vm * g.k, be * g.k * vn
            w_bytes, x_bytes = (a_bytes, b_bytes) if weight_a else (b_bytes, a_bytes)
            if input_bytes is not None:
                x_bytes = input_bytes(vn)
            # A weight block stays in SRAM across its tiles only if it fits next to the buffers.
            ksplits = ceil_div(g.k, tk)
            # int8: the chunks of each output tile may be split over p PEs (module docstring)
            # when the tiles leave PEs idle; every part is a tile of its own.
            p_max = min(ksplits, pes // tiles) if mode == "int8" and split_k else 1
            if p_max > 1 and gemm_tile_bytes(pm, pn, min(tk, g.k), ae, be) + ACC_BYTES * pm * pn > budget:
                p_max = 1  # no room for the reducer's block of received partial sums
            for parts in range(1, max(1, p_max) + 1):
                tiles_p, groups_p = tiles * parts, groups * parts
                per_pe = ceil_div(tiles_p, pes)
                span = -(-ksplits // parts) * ceil_div(g.k, ksplits)  # the longest part's k
                frac = min(span, g.k) / g.k
                xb, wb = x_bytes * frac, (0.0 if resident else w_bytes * frac)
                stationary = wb + gemm_tile_bytes(tm, tn, min(tk, g.k), ae, be) <= budget
                w_loads = min(tiles_p, max(groups_p, pes)) if stationary else tiles_p
                if parts == 1:
                    compute = gemm_tile_cycles(vm, vn, g.k, ksplits, arch, mode, int8)
                else:
                    compute = (gemm_tile_cycles(vm, vn, min(span, g.k), -(-ksplits // parts), arch, mode, _part_side(int8))
                               + k_part_tail_cycles(vm, vn, parts, arch, int8))
                dma = (xb + oe * vm * vn + (wb * w_loads) / tiles_p) / arch.dma_bw_bytes_per_cycle
                pe_time = per_pe * (max(compute, dma) + arch.dma_setup_cycles * -(-ksplits // parts))
                # Weight blocks cross DRAM once per group (the NoC multicasts them); activations
                # are assumed on-chip (NoC). The last tile computes after its load: no overlap.
                dram_time = groups_p * wb / dram_bytes_per_cycle
                on_pe = tiles_p // pes + (pe_ids < tiles_p % pes)
                noc_time = noc_port_cycles(pe_ids, chip_ids, on_pe * (xb + wb * w_loads / tiles_p),
                                           on_pe * (oe * vm * vn), arch)
                key = (max(pe_time, max(dram_time, noc_time) + compute), tiles_p, -tm, -tn)
                if best_key is None or key < best_key:
                    best, best_key = ((tm, tn, tk, parts) if parts > 1 else (tm, tn, tk)), key
    if best is None:
        need = gemm_tile_bytes(r, c, r, ae, be)
        raise MappingError(
            f"layer {name}: even a {r}x{c}x{r} tile needs {need} bytes of SRAM, the PE has {budget}; "
            f"the smallest system that fits has sram_bytes >= {need + arch.sram_reserved_bytes}"
        )
    return best


def smallest_gemm_tile_bytes(arch: "SpinnArch", k: int, a_bytes: int = 4, b_bytes: int = 4) -> int:
    """SRAM of the smallest GEMM tile: one ``mac_rows x mac_cols`` block of outputs with
    reduction chunks of ``min(k, mac_rows)``, operands double-buffered (element bytes of the A
    and B operands: conv2d A = weight, B = im2col(input); dense/matmul A = input)."""
    return gemm_tile_bytes(arch.mac_rows, arch.mac_cols, min(k, arch.mac_rows), a_bytes, b_bytes)


def _conv_input_bytes(program, layer: Layer, p0, p1):
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
    return itemsize(program, layer.inputs[0]) * cg * rows * cols


def _cost_operands(program, layer: Layer):
    """``(weight tid, (activation, weight, output) element bytes, Int8Side or None)``."""
    w_tid = layer.inputs[1] if layer.kind == "matmul" else layer.consts["weight"]
    elems = tuple(itemsize(program, tid) for tid in (layer.inputs[0], w_tid, layer.output))
    side = int8_side(program, layer) if layer.mode == "int8" else None
    return w_tid, elems, side


# -- the functional simulator ------------------------------------------------------------------
def _rhs(layer: Layer, env) -> np.ndarray:
    return env[layer.consts["weight"]] if "weight" in layer.consts else env[layer.inputs[1]]


def _im2col_reference(runner, x: np.ndarray, wshape, fill) -> np.ndarray:
    """im2col is pure data movement (what the DMA gathers): rows ordered (c, kh, kw) like the
    OIHW weight, columns are output pixels; padding reads ``fill``."""
    n = x.shape[0]
    attrs = runner.layer.attrs
    groups = attrs["groups"]
    sh, sw = attrs["strides"]
    dh, dw = attrs["dilation"]
    pt, pl, pb, pr = attrs["padding"]
    _, cg, kh, kw = wshape
    oh, ow = runner.out.shape[2], runner.out.shape[3]
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=fill)
    cols = np.empty((n, groups, cg * kh * kw, oh * ow), dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]
            cols[:, :, (np.arange(cg) * kh * kw) + i * kw + j, :] = patch.reshape(n, groups, cg, oh * ow)
    return cols.reshape(n * groups, cg * kh * kw, oh * ow)


def _arrange(runner, x: np.ndarray, rhs: np.ndarray, pad_fill) -> None:
    """GEMM operands as the DMA lays them out: ``a`` [batch-or-group, m, k], ``b`` [batch, k, n].

    conv2d: ``a`` = weight per group, ``b`` = im2col(x) (padding reads ``pad_fill``); dense:
    ``a`` = x, ``b`` = weight; matmul: both broadcast over the batch dims."""
    layer = runner.layer
    g = runner.g = gemm_shape(runner.p, layer)
    if layer.kind == "conv2d":
        groups = layer.attrs["groups"]
        runner.a = np.ascontiguousarray(rhs.reshape(groups, rhs.shape[0] // groups, -1))
        runner.b = _im2col_reference(runner, x, rhs.shape, pad_fill)
        runner.a_index = lambda b: b % groups
    elif layer.kind == "dense":
        runner.a = np.ascontiguousarray(x).reshape(1, g.m, g.k)
        runner.b = np.ascontiguousarray(rhs).reshape(1, g.k, g.n)
        runner.a_index = lambda b: b
    else:
        batch_shape = tuple(runner.out.shape[:-2])
        runner.a = np.ascontiguousarray(np.broadcast_to(x, batch_shape + x.shape[-2:])).reshape(g.batch, g.m, g.k)
        runner.b = np.ascontiguousarray(np.broadcast_to(rhs, batch_shape + rhs.shape[-2:])).reshape(g.batch, g.k, g.n)
        runner.a_index = lambda b: b
    runner.c = runner.out.reshape(g.batch, g.m, g.n)


def _gemm_block(runner, b0: int, m0: int, m1: int, n0: int, n1: int, step: int) -> None:
    """Outputs ``[b0, m0:m1, n0:n1]``: k-chunks of ``step`` in ascending order into one fp32
    accumulator (the same bits for any ``step``), then bias and ReLU."""
    g, layer = runner.g, runner.layer
    a = runner.a[runner.a_index(b0), m0:m1]
    bm = runner.b[b0, :, n0:n1]
    acc = np.zeros((m1 - m0, n1 - n0), dtype=_F32)
    for k0 in range(0, g.k, step):
        _lib.gemm_f32(np.ascontiguousarray(a[:, k0:k0 + step]), np.ascontiguousarray(bm[k0:k0 + step]), acc)
    if runner.bias is not None:
        if layer.kind == "conv2d":
            oc0 = (b0 % layer.attrs["groups"]) * g.m
            acc = acc + runner.bias[oc0 + m0: oc0 + m1, None]
        else:
            acc = acc + runner.bias[None, n0:n1]
    if layer.attrs.get("relu"):
        acc = relu(acc)
    runner.c[b0, m0:m1, n0:n1] = acc


def _qgemm_sums(runner, a: np.ndarray, bm: np.ndarray, k0: int, k1: int, step: int) -> np.ndarray:
    """int32 sums of ``a[:, k0:k1] @ bm[k0:k1]``: one ``acc_bits`` accumulation per k-chunk of
    ``step`` from ``k0`` (a chunk boundary), the chunks' sums added in 32-bit."""
    acc = np.zeros((a.shape[0], bm.shape[1]), dtype=np.int32)
    part = np.empty_like(acc)
    for c0 in range(k0, k1, step):  # chunks fit the accumulator (safe_k_chunk)
        c1 = min(c0 + step, k1)
        part.fill(0)
        _lib.gemm_i8(np.ascontiguousarray(a[:, c0:c1]), np.ascontiguousarray(bm[c0:c1]), part, runner.acc_bits)
        acc += part  # M4F 32-bit adds (wrap like the hardware; never reached for int8 data)
    return acc


def _qgemm_part(runner, b0: int, m0: int, m1: int, n0: int, n1: int, k0: int, k1: int, step: int) -> None:
    """One part (reduction ``[k0, k1)``) of a tile split over PEs: its int32 partial sums wait
    in ``runner.partials`` until the parts cover the whole reduction; then the reducing part
    adds them (32-bit, any order: the same bits) and finishes like :func:`_qgemm_block`."""
    key = (b0, m0, m1, n0, n1)
    a = np.ascontiguousarray(runner.a[runner.a_index(b0), m0:m1])
    bm = np.ascontiguousarray(runner.b[b0, :, n0:n1])
    done, acc = runner.partials.pop(key, (0, None))
    part = _qgemm_sums(runner, a, bm, k0, k1, step)
    acc = part if acc is None else acc + part
    done += k1 - k0
    if done < runner.g.k:
        runner.partials[key] = (done, acc)
        return
    _qgemm_finish(runner, b0, m0, m1, n0, n1, a, bm, acc)


def _qgemm_block(runner, b0: int, m0: int, m1: int, n0: int, n1: int, step: int) -> None:
    """Outputs ``[b0, m0:m1, n0:n1]``: one ``acc_bits`` accumulation per k-chunk of ``step``
    (the wrap points depend on ``step``: callers pass the program's chunk length)."""
    a = np.ascontiguousarray(runner.a[runner.a_index(b0), m0:m1])
    bm = np.ascontiguousarray(runner.b[b0, :, n0:n1])
    _qgemm_finish(runner, b0, m0, m1, n0, n1, a, bm, _qgemm_sums(runner, a, bm, 0, runner.g.k, step))


def _qgemm_finish(runner, b0: int, m0: int, m1: int, n0: int, n1: int, a, bm, acc) -> None:
    """Zero-point terms and epilogue of outputs ``[b0, m0:m1, n0:n1]`` from their int32 sums."""
    g, attrs = runner.g, runner.layer.attrs
    acc = acc.astype(np.int64)
    if runner.layer.kind == "conv2d":
        oc0 = (b0 % attrs["groups"]) * g.m
        ch = np.arange(oc0 + m0, oc0 + m1)[:, None]
        za = runner.za[ch] if runner.za is not None else np.int64(0)
        zb = runner.zb
    else:
        ch = np.arange(n0, n1)[None, :]
        za = runner.za
        zb = runner.zb[ch] if isinstance(runner.zb, np.ndarray) and runner.zb.ndim else runner.zb
    runner.c[b0, m0:m1, n0:n1] = int8_finish(
        acc, za, zb, lambda: a.sum(axis=1, dtype=np.int64)[:, None],
        lambda: bm.sum(axis=0, dtype=np.int64)[None, :], g.k, runner.epi, attrs, ch)


def int8_finish(acc: np.ndarray, za, zb, a_sum, b_sum, k: int, epi: dict, attrs: dict, ch) -> np.ndarray:
    """The M4F's share of an int8 GEMM on the array's int32 sums ``acc`` (int64 array, updated
    in place): the zero-point terms ``sum (a - za)(b - zb) = sum ab - zb sum_k a - za sum_k b +
    K za zb`` in 32-bit registers, then the epilogue: dequantize (``fl(acc) * scale [+ bias]``,
    ReLU) or requantize (:func:`~tvm_spinn.program.quant.requantize`). ``a_sum``/``b_sum``
    return the operands' sums over k (called only when the other zero point is nonzero); ``ch``
    indexes the per-channel constants."""
    zb = np.int64(0) if zb is None else zb
    if np.any(zb != 0):
        acc -= zb * a_sum()
    if np.any(za != 0):
        acc -= za * b_sum()
    acc += np.int64(k) * za * zb
    acc = acc.astype(np.int32).astype(np.int64)  # 32-bit registers
    if attrs["out"] == "float32":
        y = acc.astype(_F32) * epi["scale"][ch]
        if "bias" in epi:
            y = y + epi["bias"][ch]
        if attrs["relu"]:
            y = np.maximum(y, _F32(0))
        return y
    v = acc + epi["bias_q"][ch].astype(np.int64)
    if attrs.get("rounding") == "tflite":
        return requantize_tflite(v, epi["multiplier"][ch], epi["shift"][ch], attrs["y_zero"], attrs["y_min"],
                                 attrs["y_max"])
    return requantize(v, epi["multiplier"][ch], epi["shift"][ch], attrs["y_zero"], attrs["y_min"], attrs["y_max"])


def _batched_operands(program, layer: Layer, out: np.ndarray, x: np.ndarray, rhs: np.ndarray, fill):
    """Batched GEMM operands without copies where the layout allows: ``a`` [a_count, m, k],
    ``b`` [b_count, k, n] and the int64 index vectors picking each output batch's operands (the
    same operands as :func:`_arrange`; conv2d ``b`` is the C++ im2col)."""
    g = gemm_shape(program, layer)
    if layer.kind == "conv2d":
        attrs = layer.attrs
        groups = attrs["groups"]
        a = np.ascontiguousarray(rhs).reshape(groups, rhs.shape[0] // groups, -1)
        _, cg, kh, kw = rhs.shape
        n, c, h, w = x.shape
        oh, ow = out.shape[2], out.shape[3]
        x = np.ascontiguousarray(x)
        if (kh, kw) == (1, 1) and tuple(attrs["strides"]) == (1, 1) and not any(attrs["padding"]) \
                and (oh, ow) == (h, w):
            b = x.reshape(n * groups, cg, h * w)  # 1x1 convolution: im2col is the input itself
        else:
            b = _lib.im2col(x, (kh, kw), attrs["strides"], attrs["dilation"], attrs["padding"],
                            groups, fill=fill, out_hw=(oh, ow))
        a_index = np.arange(g.batch, dtype=np.int64) % groups
        b_index = np.arange(g.batch, dtype=np.int64)
    elif layer.kind == "dense":
        a = np.ascontiguousarray(x).reshape(1, g.m, g.k)
        b = np.ascontiguousarray(rhs).reshape(1, g.k, g.n)
        a_index = b_index = np.zeros(1, dtype=np.int64)
    else:  # matmul: broadcast batches index their operand instead of copying it
        batch_shape = tuple(out.shape[:-2])

        def operand(t):
            lead = t.shape[:-2]
            index = np.arange(int(np.prod(lead, dtype=np.int64)), dtype=np.int64).reshape(lead)
            index = np.broadcast_to(index, batch_shape).reshape(-1)
            return np.ascontiguousarray(t).reshape(-1, t.shape[-2], t.shape[-1]), np.ascontiguousarray(index)

        a, a_index = operand(x)
        b, b_index = operand(rhs)
    return g, a, b, a_index, b_index


def _gemm_whole(program, layer: Layer, env, out: np.ndarray) -> None:
    x = env[layer.inputs[0]]
    g, a, b, a_index, b_index = _batched_operands(program, layer, out, x, _rhs(layer, env), 0)
    c = out.reshape(g.batch, g.m, g.n)
    c.fill(0)
    _lib.gemm_f32_batched(a, b, c, a_index, b_index)
    bias = layer.consts.get("bias")
    if bias is not None:
        bias = env[bias]
        if layer.kind == "conv2d":
            groups = layer.attrs["groups"]
            c4 = out.reshape(-1, groups, g.m, g.n)
            np.add(c4, bias.reshape(groups, g.m, 1), out=c4)
        else:
            np.add(c, bias.reshape(1, 1, -1), out=c)
    if layer.attrs.get("relu"):
        c[c <= 0] = _F32(0)  # relu: a > 0 ? a : +0, NaN kept (-0.0 gives +0)


def int8_chunk(program, index: int) -> int:
    """k-chunk length of int8 GEMM layer ``index``: ``ceil(K / k_splits)`` of its tiles (one
    tile shape per layer, so they never disagree)."""
    tile = program.mapping["layers"][index]["tile"]
    return chunk_length(gemm_shape(program, program.layers[index]).k, tile[2])


def _int8_operands(layer: Layer, env):
    """``(x, rhs, x_zero)`` of an int8 GEMM as the MAC array reads them (uint8 operands with
    their top bit flipped)."""
    attrs = layer.attrs
    x = env[layer.inputs[0]]
    x = to_signed(x) if attrs["x_flip"] else x
    rhs = _rhs(layer, env)
    if layer.kind == "matmul" and attrs["b_flip"]:
        rhs = to_signed(rhs)
    return x, rhs, np.int64(attrs["x_zero"])


def _qgemm_whole(program, layer: Layer, index: int, env, out: np.ndarray) -> None:
    step = int8_chunk(program, index)
    attrs = layer.attrs
    x, rhs, zx = _int8_operands(layer, env)
    fill = np.asarray(attrs["x_zero"]).astype(x.dtype)  # padding holds the zero point
    g, a, b, a_index, b_index = _batched_operands(program, layer, out, x, rhs, fill)
    acc32 = np.zeros((g.batch, g.m, g.n), dtype=np.int32)
    _lib.gemm_i8_batched(a, b, acc32, step, int(program.arch.get("acc_bits", 29)), a_index, b_index)
    acc = acc32.astype(np.int64)
    wz = env[layer.consts["w_zero"]].astype(np.int64) if "w_zero" in layer.consts else None
    if layer.kind == "conv2d":
        groups = attrs["groups"]
        acc = acc.reshape(-1, groups, g.m, g.n)
        ch = np.arange(groups * g.m).reshape(groups, g.m, 1)
        za = wz[ch] if wz is not None else np.int64(0)
        zb = zx
        a_sum = lambda: a.sum(axis=2, dtype=np.int64).reshape(groups, g.m, 1)  # noqa: E731
        b_sum = lambda: b.sum(axis=1, dtype=np.int64).reshape(-1, groups, 1, g.n)  # noqa: E731
    else:
        ch = np.arange(g.n)[None, :]
        if layer.kind == "dense":
            za, zb = zx, wz
        else:
            za, zb = zx, np.int64(attrs.get("b_zero", 0))
        zb = zb[ch] if isinstance(zb, np.ndarray) and zb.ndim else zb
        a_sum = lambda: a.sum(axis=2, dtype=np.int64)[a_index][:, :, None]  # noqa: E731
        b_sum = lambda: b.sum(axis=1, dtype=np.int64)[b_index][:, None, :]  # noqa: E731
    epi = {k: env[layer.consts[k]] for k in ("scale", "bias", "bias_q", "multiplier", "shift") if k in layer.consts}
    out.reshape(acc.shape)[...] = int8_finish(acc, za, zb, a_sum, b_sum, g.k, epi, attrs, ch)


#: "no bias" for the C++ epilogue (a bias with no elements)
_NO_BIAS = np.zeros(0, dtype=_F32)


def _operand(program, tid: int, prepare):
    """A getter ``env -> prepare(env[tid])``, evaluated once here for a constant."""
    if tid in program.constants:
        value = prepare(program.constants[tid])
        return lambda env: value
    return lambda env: prepare(env[tid])


def _fp32_step(program, layer: Layer, clip: Layer | None):
    """:func:`_gemm_whole` with its operand layout, index vectors and bias prepared; the bias,
    ReLU and ``clip`` (a clip layer fused by the simulator's plan) run in the C++ epilogue."""
    g = gemm_shape(program, layer)
    tensors = program.tensors
    shape = tuple(tensors[layer.output].shape)
    dtype = np.dtype(tensors[layer.output].dtype)
    rhs_tid = layer.consts["weight"] if "weight" in layer.consts else layer.inputs[1]
    x_tid = layer.inputs[0]
    cshape = (g.batch, g.m, g.n)
    do_relu = bool(layer.attrs.get("relu"))
    bias_tid = layer.consts.get("bias")
    bias = _NO_BIAS
    if bias_tid is not None:
        bias = _lib._input(np.ascontiguousarray(program.constants[bias_tid], dtype=_F32).reshape(-1))
    lo = hi = 0.0
    if clip is not None:
        lo, hi = float(_F32(clip.attrs["min"])), float(_F32(clip.attrs["max"]))
    epilogue = _lib._func("tvm_spinn.sim.epilogue_f32")
    if layer.kind == "conv2d":
        attrs = layer.attrs
        groups = int(attrs["groups"])
        wshape = tuple(tensors[rhs_tid].shape)
        _, cg, kh, kw = wshape
        n, c, h, w = tensors[x_tid].shape
        oh, ow = shape[2], shape[3]
        if bias.size not in (0, wshape[0]):
            return None
        # C viewed as [n, output channels, pixels]: the bias is per row
        ep_shape, on_rows = (n, wshape[0], oh * ow), True
        if cg == 1 and groups > 1 and rhs_tid in program.constants:
            return _depthwise_step(program, layer, shape, dtype, bias, do_relu, clip is not None, lo, hi)
        if _transposed_conv(g, groups) and rhs_tid in program.constants and dtype == _F32:
            return _transposed_step(program, layer, g, shape, bias, do_relu, clip is not None, lo, hi)
        get_a = _operand(program, rhs_tid, lambda w: _lib._input(np.ascontiguousarray(w).reshape(groups, wshape[0] // groups, -1)))
        if (kh, kw) == (1, 1) and tuple(attrs["strides"]) == (1, 1) and not any(attrs["padding"]) and (oh, ow) == (h, w):
            bshape = (n * groups, cg, h * w)
            get_b = _operand(program, x_tid, lambda x: _lib._input(np.ascontiguousarray(x).reshape(bshape)))
        else:
            im2col = _lib._func("tvm_spinn.sim.im2col")
            sh, sw = attrs["strides"]
            dh, dw = attrs["dilation"]
            pt, pl, _, _ = attrs["padding"]
            params = [int(v) for v in (max(groups, 1), kh, kw, sh, sw, dh, dw, pt, pl, max(int(oh), 0), max(int(ow), 0))]
            cols_shape = (n * max(groups, 1), (c // max(groups, 1)) * kh * kw, max(int(oh), 0) * max(int(ow), 0))

            def cols(x):
                x = np.ascontiguousarray(x)
                out = np.empty(cols_shape, dtype=x.dtype)
                im2col(_lib._input(x), out, np.zeros(1, dtype=x.dtype), params, 0)
                return out
            get_b = _operand(program, x_tid, cols)
        a_index = np.arange(g.batch, dtype=np.int64) % groups
        b_index = np.arange(g.batch, dtype=np.int64)
    else:
        if bias.size not in (0, g.n):
            return None
        ep_shape, on_rows = cshape, False  # the bias is per column
        if layer.kind == "dense":
            get_a = _operand(program, x_tid, lambda x: _lib._input(np.ascontiguousarray(x).reshape(1, g.m, g.k)))
            get_b = _operand(program, rhs_tid, lambda r: _lib._input(np.ascontiguousarray(r).reshape(1, g.k, g.n)))
            a_index = b_index = np.zeros(1, dtype=np.int64)
        else:
            batch_shape = shape[:-2]

            def operand(tid):
                tshape = tuple(tensors[tid].shape)
                lead = tshape[:-2]
                index = np.arange(int(np.prod(lead, dtype=np.int64)), dtype=np.int64).reshape(lead)
                index = np.array(np.broadcast_to(index, batch_shape).reshape(-1), dtype=np.int64)  # writable
                three = (-1, tshape[-2], tshape[-1])
                return _operand(program, tid, lambda t: _lib._input(np.ascontiguousarray(t).reshape(three))), index
            get_a, a_index = operand(x_tid)
            get_b, b_index = operand(rhs_tid)
    if dtype != _F32:
        return None
    finish = bias.size or do_relu or clip is not None
    gemm = _lib._func("tvm_spinn.sim.gemm_f32_batched")

    def into(program, env, out):
        if out is None:
            out = np.zeros(shape, dtype=dtype)
        else:  # the caller's output buffer (the plan checked it)
            out.fill(0)
        gemm(get_a(env), get_b(env), out.reshape(cshape), a_index, b_index, 0)
        if finish:  # fl(acc + bias), then ReLU (x > 0 ? x : +0), then the fused clip
            epilogue(out.reshape(ep_shape), bias, on_rows, do_relu, clip is not None, lo, hi, 0)
        return out

    def step(program, env):
        return into(program, env, None)
    step.into = into
    return step


def _transposed_step(program, layer: Layer, g: GemmShape, shape, bias, do_relu, clip, lo, hi):
    """A conv computed as C^T = X^T W^T (:func:`_transposed_conv`): the operations of the
    native run's copy, GEMM (bias per column) and copy."""
    attrs = layer.attrs
    x_tid = layer.inputs[0]
    n, c, h, w = program.tensors[x_tid].shape
    kh, kw = program.tensors[layer.consts["weight"]].shape[2:]
    p, k, m = g.n, g.k, g.m
    wt = _lib._input(np.ascontiguousarray(
        np.asarray(program.constants[layer.consts["weight"]], dtype=_F32).reshape(m, k).T).reshape(1, k, m))
    direct = (kh, kw) == (1, 1) and tuple(attrs["strides"]) == (1, 1) and not any(attrs["padding"]) and p == h * w
    params = None
    if not direct:
        sh, sw = attrs["strides"]
        dh, dw = attrs["dilation"]
        pt, pl, _, _ = attrs["padding"]
        params = [int(v) for v in (1, kh, kw, sh, sw, dh, dw, pt, pl, shape[2], shape[3])]
    a_index, b_index = np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    gemm = _lib._func("tvm_spinn.sim.gemm_f32_batched")
    epilogue = _lib._func("tvm_spinn.sim.epilogue_f32")
    im2col = _lib._func("tvm_spinn.sim.im2col")
    finish = bias.size or do_relu or clip

    def step(program, env):
        x = np.ascontiguousarray(env[x_tid])
        if direct:
            cols = x.reshape(n, k, p)
        else:
            cols = np.empty((n, k, p), dtype=_F32)
            im2col(_lib._input(x), cols, np.zeros(1, dtype=_F32), params, 0)
        xt = np.ascontiguousarray(cols.transpose(0, 2, 1))
        ct = np.zeros((n, p, m), dtype=_F32)
        gemm(xt, wt, ct, a_index, b_index, 0)
        if finish:  # the bias is per output channel: a column of C^T
            epilogue(ct, bias, False, do_relu, clip, lo, hi, 0)
        return np.ascontiguousarray(ct.transpose(0, 2, 1)).reshape(shape)
    return step


def _depthwise_step(program, layer: Layer, shape, dtype, bias, do_relu, clip, lo, hi):
    """A conv with one input channel per group, on the direct C++ kernel (no im2col): each
    output's taps in im2col order from +0.0, then the epilogue; the bits of the GEMM path."""
    attrs = layer.attrs
    tensors = program.tensors
    weight = program.constants[layer.consts["weight"]]
    cout, _, kh, kw = weight.shape
    weight = _lib._input(np.ascontiguousarray(weight, dtype=_F32).reshape(cout, kh, kw))
    x_tid = layer.inputs[0]
    if dtype != _F32 or np.dtype(tensors[x_tid].dtype) != _F32:
        return None
    sh, sw = attrs["strides"]
    dh, dw = attrs["dilation"]
    pt, pl, _, _ = attrs["padding"]
    geometry = [int(v) for v in (sh, sw, dh, dw, pt, pl)]
    conv = _lib._func("tvm_spinn.sim.depthwise_conv2d_f32")

    def into(program, env, out):
        if out is None:
            out = np.zeros(shape, dtype=dtype)
        else:
            out.fill(0)
        conv(_lib._input(np.ascontiguousarray(env[x_tid])), weight, out, bias, geometry, do_relu, clip, lo, hi, 0)
        return out

    def step(program, env):
        return into(program, env, None)
    step.into = into
    return step


#: Convolutions with at most this many output pixels per image are computed transposed.
NARROW_PIXELS = 4


def _transposed_conv(g: GemmShape, groups: int) -> bool:
    """Whether a conv (one group, weights [m, k], pixels [k, n]) is computed as C^T = X^T W^T:
    with at most :data:`NARROW_PIXELS` pixels (a late stage of a CNN on a small image) the
    kernel's register block would hold a few pixels by many output channels and pack the whole
    weight matrix every call; transposed, the weights are the operand it reads in place. Each
    output is the same sum in the same k order; the products are w * x instead of x * w (equal
    for all but two NaN operands, whose payload the product may then take from the other)."""
    return groups == 1 and g.n <= NARROW_PIXELS and g.m >= 16


def _batch_index(tensors, tid: int, batch_shape) -> np.ndarray:
    """Per batch of a batched matmul's output, the batch of operand ``tid`` it reads (its
    leading axes broadcast to ``batch_shape``), flattened: the native GEMM's operand index."""
    lead = tuple(tensors[tid].shape)[:-2]
    idx = np.arange(int(np.prod(lead, dtype=np.int64)), dtype=np.int64).reshape(lead)
    return np.array(np.broadcast_to(idx, batch_shape).reshape(-1), dtype=np.int64)


def _fp32_native(program, layer: Layer, nb, clip: Layer | None) -> bool:
    """:func:`_fp32_step` as instructions: the same operand layouts, index vectors, kernels
    (im2col, the batched GEMM, the epilogue; the direct depthwise kernel) and epilogue."""
    tensors = program.tensors
    if tensors[layer.output].dtype != "float32" or any(tensors[t].dtype != "float32" for t in layer.inputs):
        return False
    g = gemm_shape(program, layer)
    if min(g.batch, g.m, g.n, g.k) < 1:
        return False
    shape = tuple(int(d) for d in tensors[layer.output].shape)
    rhs_tid = layer.consts["weight"] if "weight" in layer.consts else layer.inputs[1]
    x_tid = layer.inputs[0]
    attrs = layer.attrs
    none = native.codes()["none"]
    bias_tid = layer.consts.get("bias")
    bias = none
    bias_len = 0
    if bias_tid is not None:
        bias_array = np.ascontiguousarray(program.constants[bias_tid], dtype=_F32).reshape(-1)
        bias_len = bias_array.size
    relu_flag = int(bool(attrs.get("relu")))
    lo = hi = 0
    if clip is not None:
        lo, hi = native.f32_bits(clip.attrs["min"]), native.f32_bits(clip.attrs["max"])
    clip_flag = int(clip is not None)
    if layer.kind == "conv2d":
        groups = int(attrs["groups"])
        wshape = tuple(int(d) for d in tensors[rhs_tid].shape)
        cout, cg, kh, kw = wshape
        n, c, h, w = (int(d) for d in tensors[x_tid].shape)
        oh, ow = shape[2], shape[3]
        if bias_len not in (0, cout) or rhs_tid not in program.constants:
            return False
        if bias_len:
            bias = nb.const(bias_array)
        sh, sw = (int(v) for v in attrs["strides"])
        dh, dw = (int(v) for v in attrs["dilation"])
        pt, pl = int(attrs["padding"][0]), int(attrs["padding"][1])
        x = nb.read(x_tid)
        if cg == 1 and groups > 1:  # the direct depthwise kernel (_depthwise_step)
            nb.emit("depthwise", x, nb.read(rhs_tid), nb.write(layer.output), n, groups, cout // groups,
                    h, w, kh, kw, oh, ow, sh, sw, dh, dw, pt, pl, bias, relu_flag, clip_flag, lo, hi)
            return True
        if (kh, kw) == (1, 1) and (sh, sw) == (1, 1) and not any(attrs["padding"]) and (oh, ow) == (h, w):
            b = x  # [n * groups, cg, h * w]: the input itself
        else:
            b = nb.temp(4 * n * groups * cg * kh * kw * oh * ow)
            nb.emit("im2col", x, b, n, groups, c // groups, h, w, kh, kw, oh, ow, sh, sw, dh, dw, pt, pl)
        if _transposed_conv(g, groups):
            # C^T = X^T W^T: the weights (pre-transposed once) are the kernel's wide operand,
            # read in place, and only the few pixels are packed (see _transposed_conv)
            p, k, m = g.n, g.k, g.m
            xt, ct = nb.temp(4 * n * p * k), nb.temp(4 * n * p * m)
            nb.emit("copy", b, xt, 4, 3, 0, 0, [n, p, k], [k * p, 1, p], [p * k, k, 1])
            wt = np.ascontiguousarray(program.constants[rhs_tid], dtype=_F32).reshape(m, k).T
            nb.emit("gemm", xt, nb.const(wt), ct, n, p, k, m, nb.const(np.arange(n, dtype=np.int64)),
                    nb.const(np.zeros(n, dtype=np.int64)), bias, 0, relu_flag, clip_flag, lo, hi, n, p, m)
            nb.emit("copy", ct, nb.write(layer.output), 4, 3, 0, 0, [n, m, p], [p * m, 1, m], [m * p, p, 1])
            return True
        a_index = np.arange(g.batch, dtype=np.int64) % groups
        b_index = np.arange(g.batch, dtype=np.int64)
        a = nb.read(rhs_tid)
        ep = (n, cout, oh * ow, 1)  # outer, rows, cols, bias on rows
    else:
        if bias_len not in (0, g.n):
            return False
        if bias_len:
            bias = nb.const(bias_array)
        if layer.kind == "dense":
            a, b = nb.read(x_tid), nb.read(rhs_tid)
            a_index = b_index = np.zeros(1, dtype=np.int64)
        else:
            a, b = nb.read(x_tid), nb.read(rhs_tid)
            a_index, b_index = (_batch_index(tensors, tid, shape[:-2]) for tid in (x_tid, rhs_tid))
        ep = (g.batch, g.m, g.n, 0)
    nb.emit("gemm", a, b, nb.write(layer.output), g.batch, g.m, g.k, g.n, nb.const(a_index), nb.const(b_index),
            bias, ep[3], relu_flag, clip_flag, lo, hi, ep[0], ep[1], ep[2])
    return True


def _int8_native(program, layer: Layer, nb) -> bool:
    """:func:`_qgemm_whole` as instructions: uint8 operands flipped (``flip8``), conv2d operands
    gathered by the 1-byte im2col (padding holds the zero point), the chunked MAC-array GEMM
    and :func:`int8_finish`'s zero-point terms and epilogue (``qgemm``), with the sums over k
    of a constant operand prepared once."""
    tensors = program.tensors
    attrs = layer.attrs
    g = gemm_shape(program, layer)
    if min(g.batch, g.m, g.n, g.k) < 1:
        return False
    index = next(i for i, other in enumerate(program.layers) if other is layer)
    step = int8_chunk(program, index)
    acc_bits = int(program.arch.get("acc_bits", 29))
    none = native.codes()["none"]
    consts = program.constants
    shape = tuple(int(d) for d in tensors[layer.output].shape)

    def signed(tid, flip):  # to_signed: a uint8 operand with its top bit flipped
        ref = nb.read(tid)
        if not flip:
            return ref
        count = native.numel(tensors[tid].shape)
        out = nb.temp(count)
        nb.emit("flip8", ref, out, count)
        return out

    x = signed(layer.inputs[0], attrs["x_flip"])
    wz = consts[layer.consts["w_zero"]].astype(np.int64).reshape(-1) if "w_zero" in layer.consts else None
    za, za_vec, zb, zb_vec = int(attrs["x_zero"]), none, 0, none
    a_sum = b_sum = none
    groups = 1
    if layer.kind == "conv2d":
        groups = int(attrs["groups"])
        weight = consts[layer.consts["weight"]]
        cout, cg, kh, kw = (int(d) for d in weight.shape)
        n, c, h, w = (int(d) for d in tensors[layer.inputs[0]].shape)
        oh, ow = shape[2], shape[3]
        sh, sw = (int(v) for v in attrs["strides"])
        dh, dw = (int(v) for v in attrs["dilation"])
        pt, pl = int(attrs["padding"][0]), int(attrs["padding"][1])
        if (kh, kw) == (1, 1) and (sh, sw) == (1, 1) and not any(attrs["padding"]) and (oh, ow) == (h, w):
            b = x  # [n * groups, cg, h * w]: the input itself
        else:
            b = nb.temp(n * groups * cg * kh * kw * oh * ow)
            fill = int(np.asarray(attrs["x_zero"]).astype(np.int8).view(np.uint8))
            nb.emit("im2col8", x, b, n, groups, cg, h, w, kh, kw, oh, ow, sh, sw, dh, dw, pt, pl, fill)
        a = nb.read(layer.consts["weight"])
        a_index = np.arange(g.batch, dtype=np.int64) % groups
        b_index = np.arange(g.batch, dtype=np.int64)
        # conv: the weight is A (rows = output channels, their zero points per row), x is B
        za, zb = 0, int(attrs["x_zero"])
        if wz is not None:
            za_vec = nb.const(wz.astype(np.int32))
        if zb != 0 or wz is not None:
            a_sum = nb.const(weight.reshape(cout, -1).sum(axis=1, dtype=np.int64))
        on_rows = 1
    else:
        if layer.kind == "dense":
            weight = consts[layer.consts["weight"]]
            b = nb.read(layer.consts["weight"])
            a_index = b_index = np.zeros(1, dtype=np.int64)
            if wz is not None:
                zb_vec = nb.const(wz.astype(np.int32))
            if za != 0:
                b_sum = nb.const(weight.reshape(g.k, g.n).sum(axis=0, dtype=np.int64))
        else:
            b = signed(layer.inputs[1], attrs["b_flip"])
            a_index, b_index = (_batch_index(tensors, tid, shape[:-2]) for tid in layer.inputs[:2])
            zb = int(attrs.get("b_zero", 0))
        a = x
        on_rows = 0
    out_kind = {"float32": 0, "int8": 1, "uint8": 2}[attrs["out"]]

    def opt(role):
        return nb.read(layer.consts[role]) if role in layer.consts else none

    nb.emit("qgemm", a, b, nb.write(layer.output), nb.temp(4 * g.batch * g.m * g.n), g.batch, g.m, g.k, g.n,
            nb.const(a_index), nb.const(b_index), step, acc_bits, za, za_vec, zb, zb_vec, a_sum, b_sum, groups,
            on_rows, out_kind, opt("scale"), opt("bias"), opt("bias_q"), opt("multiplier"), opt("shift"),
            int(bool(attrs["relu"])), int(attrs.get("rounding") == "tflite"), int(attrs.get("y_zero", 0)),
            int(attrs.get("y_min", 0)), int(attrs.get("y_max", 0)))
    return True


# -- the family -----------------------------------------------------------------------------------
class Gemm(OpFamily):
    """conv2d, dense and matmul, fp32 (M4F) and int8 (MAC array)."""

    kinds = GEMM_KINDS
    priority = 10
    modes = ("fp32", "int8")
    tile_arity = 3
    tile_optional = 1  # [tm, tn, tk, p]: the reduction split over p PEs (int8)
    #: a clip reading only this family's fp32 result runs in its epilogue (see :meth:`step`)
    fuses_clip = True
    #: the region axis a GEMM's weight operand varies along: conv2d's output channels
    #: (A = weight), dense's and matmul's output columns (B = weight)
    _WEIGHT_AXIS = {"conv2d": 1, "dense": 2, "matmul": 2}

    # -- operand traffic ------------------------------------------------------------------------
    def weight_region_axis(self, layer):
        return self._WEIGHT_AXIS[layer.kind]

    def streamed_inputs(self, program, layer):
        acts = super().streamed_inputs(program, layer)
        if layer.kind == "matmul":
            # a tile's ``in_bytes`` are the left operand's; the right one (``w_bytes``) has its
            # own source, so where it lives (e.g. a KV cache held in SRAM) does not send the
            # left operand to DRAM
            return [tid for tid in layer.inputs[:1] if tid in acts]
        return acts

    def weight_gemm(self, layer):
        return layer.kind == "dense" and "weight" in layer.consts

    def layouts(self, layer):
        if layer.kind == "dense":
            return frozenset(("resident", "split_k") if layer.mode == "int8" else ("resident",))
        if layer.kind == "matmul" and layer.mode != "int8":
            return frozenset(("one_round",))
        return frozenset()

    # -- partition ------------------------------------------------------------------------------
    def lowers(self, composite: str) -> bool:
        return composite.startswith(("conv2d", "dense", "matmul", "qconv2d", "qdense", "qmatmul"))

    def patterns(self, kit) -> list[tuple]:
        """int8 patterns (largest first) before the fp32 ones, so a quantized GEMM reaches the
        MAC array with its dequantizes, epilogue and requantize fused."""
        from tvm.relax.dpl import is_op, wildcard

        lhs, rhs = wildcard(), wildcard()
        matmul = is_op("relax.matmul")(lhs, rhs)
        return [
            *_qgemm_patterns(kit, "spinn.qconv2d", "relax.nn.conv2d", weight_const=True),
            *_qgemm_patterns(kit, "spinn.qdense", "relax.matmul", weight_const=True),
            *_qgemm_patterns(kit, "spinn.qmatmul", "relax.matmul", weight_const=False),
            *_gemm_patterns(kit, "spinn.conv2d", "relax.nn.conv2d", _check_conv2d),
            *_gemm_patterns(kit, "spinn.dense", "relax.matmul", _check_dense),
            kit.entry("spinn.matmul", matmul, {"lhs": lhs, "rhs": rhs, "root": matmul}, _check_matmul),
        ]

    def lower(self, lowerer, name: str, kind: str, calls: list, env: dict, layer: Layer) -> None:
        """Lower a GEMM composite (all its calls: the GEMM, its dequantizes and epilogue)."""
        if kind.startswith(("qconv2d", "qdense", "qmatmul")):
            _lower_qgemm(lowerer, layer, name, calls, env)
            return
        main = calls[0][1]
        ops = [c.op.name for _, c in calls]
        if kind == "matmul":
            layer.inputs = [lowerer.operand(x, env) for x in main.args]
            return
        base = "conv2d" if kind.startswith("conv2d") else "dense"
        layer.kind = base
        layer.inputs = [lowerer.operand(main.args[0], env)]
        layer.consts["weight"] = lowerer.operand(main.args[1], env)
        layer.attrs["relu"] = "relax.nn.relu" in ops
        if "relax.add" in ops:
            add = calls[ops.index("relax.add")][1]
            bias = add.args[1] if not add.args[1].same_as(calls[0][0]) else add.args[0]
            layer.consts["bias"] = _lower_bias(lowerer, bias, layer.output, base, name)
        if base == "conv2d":
            a = main.attrs
            layer.attrs.update(strides=[int(v) for v in a.strides], padding=[int(v) for v in a.padding],
                               dilation=[int(v) for v in a.dilation], groups=int(a.groups))

    # -- validation -----------------------------------------------------------------------------
    def attr_schema(self, kind: str, mode: str):
        if mode == "int8":
            req = dict(_INT8)
            if kind == "conv2d":
                req.update(_CONV)
            if kind == "matmul":
                req.update(b_zero=ZERO, b_flip=check_bool)
            return req, dict(_REQUANT, rounding=lambda v, f: check_str(v, f, ROUNDINGS))
        if kind == "conv2d":
            return dict(_CONV), dict(RELU)
        return {}, dict(RELU)

    def check(self, v, f, kind, mode, ins, consts, out, attrs):
        fo = f"{f}.output"
        int8 = mode == "int8"
        act = ("int8", "uint8") if int8 else ("float32",)
        v.need(f"{f}.inputs", kind, ins, 2 if kind == "matmul" else 1)
        for i, tid in enumerate(ins):
            v.dtype(f"{f}.inputs[{i}]", tid, act)
        if kind == "conv2d":
            n, c, h, w = v.rank(f"{f}.inputs[0]", ins[0], 4, 4)
            wt = consts.get("weight")
            if wt is None:
                fail(f"{f}.consts", "missing key(s) ['weight']")
            o, cg, kh, kw = v.rank(f"{f}.consts.weight", wt, 4, 4)
            groups = attrs["groups"]
            if c % groups or o % groups or c // groups != cg:
                fail(f"{f}.attrs.groups", f"{groups} groups do not split input {v.shapes[ins[0]]} "
                                          f"and weight {v.shapes[wt]}")
            (sh, sw), (dh, dw), (pt, pl, pb, pr) = attrs["strides"], attrs["dilation"], attrs["padding"]
            oh = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
            ow = (w + pl + pr - dw * (kw - 1) - 1) // sw + 1
            if oh < 1 or ow < 1:
                fail(f"{f}.consts.weight", f"the kernel is larger than the padded {h}x{w} input")
            v.shape(fo, out, [n, o, oh, ow])
            batch, m, nn, k, channels = n * groups, o // groups, oh * ow, cg * kh * kw, o
        elif kind == "dense":
            x = v.rank(f"{f}.inputs[0]", ins[0], 1)
            wt = consts.get("weight")
            if wt is None:
                fail(f"{f}.consts", "missing key(s) ['weight']")
            kk, nn = v.rank(f"{f}.consts.weight", wt, 2, 2)
            if x[-1] != kk:
                fail(f"{f}.consts.weight", f"{v.shapes[wt]} does not multiply input {x}")
            v.shape(fo, out, x[:-1] + [nn])
            batch, m, k, channels = 1, math.prod(x[:-1]), kk, nn
        else:
            a = v.rank(f"{f}.inputs[0]", ins[0], 2)
            b = v.rank(f"{f}.inputs[1]", ins[1], 2)
            bs = v.broadcast(a[:-2], b[:-2])
            if a[-1] != b[-2] or bs is None:
                fail(f"{f}.inputs", f"{a} and {b} do not multiply")
            v.shape(fo, out, bs + [a[-2], b[-1]])
            batch, m, nn, k, channels = math.prod(bs), a[-2], b[-1], a[-1], b[-1]
        if kind != "matmul":
            v.dtype(f"{f}.consts.weight", consts["weight"], ("int8",) if int8 else ("float32",))
        if int8:
            _check_int8_epilogue(v, f, kind, ins, consts, out, attrs, channels, k)
        else:
            v.dtype(fo, out, ("float32",))
            v.consts(f, consts, set() if kind == "matmul" else {"weight"},
                     set() if kind == "matmul" else {"bias"})
            if "bias" in consts:
                v.dtype(f"{f}.consts.bias", consts["bias"], ("float32",))
                v.shape(f"{f}.consts.bias", consts["bias"], [channels])
        return (batch, m, nn), [m, nn, k]

    def check_mapping(self, arch, f: str, mode: str, k: int | None, tile) -> None:
        """An int8 layer's k-chunks must fit the MAC array's accumulator."""
        if len(tile) > 3:
            parts = int(tile[3])
            if mode != "int8" and parts > 1:
                fail(f"{f}.tile[3]", f"a reduction split over {parts} PEs needs an int8 layer "
                                     f"(fp32 sums in ascending k on one PE)")
            if k is not None and parts > splits_of(k, tile[2]):
                fail(f"{f}.tile[3]", f"{parts} reduction parts exceed the tile's "
                                     f"{splits_of(k, tile[2])} k-chunks (K {k}, tk {tile[2]})")
        if mode != "int8":
            return
        chunk = chunk_length(k, tile[2])
        limit = safe_k_chunk(arch)
        if chunk > limit:
            fail(f"{f}.tile[2]", f"k-chunks of {chunk} products overflow the "
                                 f"{arch.acc_bits}-bit accumulator (at most {limit})")

    # -- tiles as data ------------------------------------------------------------------------
    def region_extent(self, program, layer):
        g = gemm_shape(program, layer)
        return (g.batch, g.m, g.n)

    def expand_regions(self, program, layer, tile):
        batch, m, n = self.region_extent(program, layer)
        tm, tn = int(tile[0]), int(tile[1])
        m0, m1 = starts(m, tm)
        n0, n1 = starts(n, tn)
        b = np.repeat(np.arange(batch, dtype=np.int64), len(m0) * len(n0))
        mi = np.tile(np.repeat(np.arange(len(m0)), len(n0)), batch)
        ni = np.tile(np.arange(len(n0)), batch * len(m0))
        lo = np.stack([b, m0[mi], n0[ni]], axis=1)
        hi = np.stack([b + 1, m1[mi], n1[ni]], axis=1)
        if layer.kind == "conv2d":
            group = b * len(m0) + mi
        elif layer.kind == "dense":
            group = ni.astype(np.int64)
        else:
            group = np.full(len(b), -1, dtype=np.int64)
        parts = int(tile[3]) if len(tile) > 3 else 1
        if parts == 1:
            return lo, hi, group
        # each region's reduction in ``parts`` tiles (parts innermost), each with its own block
        kb = k_part_bounds(gemm_shape(program, layer).k, int(tile[2]), parts)
        t = len(group)
        j = np.tile(np.arange(parts, dtype=np.int64), t)
        lo = np.concatenate([np.repeat(lo, parts, axis=0), kb[j][:, None]], axis=1)
        hi = np.concatenate([np.repeat(hi, parts, axis=0), kb[j + 1][:, None]], axis=1)
        group = np.repeat(group, parts)
        group = np.where(group >= 0, group * parts + j, -1)
        return lo, hi, group

    def k_splits(self, program, layer, tile) -> int:
        return splits_of(gemm_shape(program, layer).k, tile[2])

    # -- mapping ------------------------------------------------------------------------------
    def work(self, program, layer, arch):
        g = gemm_shape(program, layer)
        return 2 * g.batch * g.m * g.n * g.k, [g.m, g.n, g.k]

    def smallest_tile_bytes(self, program, layer, arch):
        _, elems, _ = _cost_operands(program, layer)
        ae, be, _, _ = _operand_elems(layer.kind, layer.mode, elems)
        return smallest_gemm_tile_bytes(arch, gemm_shape(program, layer).k, ae, be)

    def choose_tile(self, program, layer, arch, pes, naive, resident=False):
        g = gemm_shape(program, layer)
        in_fn = (lambda vn: int(_conv_input_bytes(program, layer, 0, vn))) if layer.kind == "conv2d" else None
        _, elems, side = _cost_operands(program, layer)
        return list(choose_gemm_tile(g, arch, layer.name, pes=pes, kind=layer.kind, naive=naive,
                                     input_bytes=in_fn, mode=layer.mode, elem_bytes=elems, int8=side,
                                     split_k=_options.current().mapping.split_k, resident=resident))

    def tile_costs(self, program, layer, arch, tile, lo, hi):
        t = program.tensors
        g = gemm_shape(program, layer)
        ks = self.k_splits(program, layer, tile)
        w_tid, elems, side = _cost_operands(program, layer)
        ae, be, _, oe = _operand_elems(layer.kind, layer.mode, elems)
        tk = min(int(tile[2]), g.k)
        ext = hi - lo
        vm, vn = ext[:, 1], ext[:, 2]
        split = lo.shape[1] > 3  # a reduction split over PEs: part k-ranges [k0, k1)
        kk = ext[:, 3] if split else g.k
        last = hi[:, 3] == g.k if split else True  # the reducing part (or the whole tile)
        pm, pn = -(-vm // arch.mac_rows) * arch.mac_rows, -(-vn // arch.mac_cols) * arch.mac_cols
        a_bytes, b_bytes = ae * vm * kk, be * kk * vn
        if layer.kind == "conv2d":
            in_b, w_b = _conv_input_bytes(program, layer, lo[:, 2], hi[:, 2]) * kk // g.k, a_bytes
        else:
            in_b, w_b = a_bytes, b_bytes
        # Per-channel epilogue data (bias; int8: acc_offset, multiplier, shift, scale...) travels
        # with the weight block (of the reducing part): the tile's output channels of every
        # const but the weight.
        channels = t[w_tid].shape[0] if layer.kind == "conv2d" else g.n
        v = vm if layer.kind == "conv2d" else vn
        for role, tid in sorted(layer.consts.items()):
            if role == "weight" or tid == w_tid:
                continue
            numel = int(np.prod(t[tid].shape, dtype=np.int64))
            size = itemsize(program, tid)
            w_b = w_b + last * (size * v * max(1, numel // channels) if numel >= channels else size * numel)
        if split:
            parts = int(tile[3])
            chunks = -(-kk // chunk_length(g.k, tk))
            cycles = gemm_tile_cycles(vm, vn, kk, chunks, arch, layer.mode, _part_side(side))
            cycles = np.ceil(cycles + last * k_part_tail_cycles(vm, vn, parts, arch, side))
            # a part's result is its int32 partial sums (the reducer's: the layer's output)
            out_b = np.where(last, oe, ACC_BYTES) * vm * vn
            # the reducer receives the partials one at a time into one more accumulator block
            sram = gemm_tile_bytes(pm, pn, tk, ae, be) + last * ACC_BYTES * pm * pn
        else:
            cycles = np.ceil(gemm_tile_cycles(vm, vn, g.k, ks, arch, layer.mode, side))
            out_b = oe * vm * vn
            sram = gemm_tile_bytes(pm, pn, tk, ae, be)
        return sram, in_b, w_b, out_b, cycles

    # -- functional simulator -----------------------------------------------------------------
    def prepare_tiles(self, runner) -> None:
        layer, env = runner.layer, runner.env
        if layer.mode != "int8":
            _arrange(runner, env[layer.inputs[0]], _rhs(layer, env), 0)
            bias = layer.consts.get("bias")
            runner.bias = env[bias] if bias is not None else None
            return
        attrs = layer.attrs
        x, rhs, zx = _int8_operands(layer, env)
        _arrange(runner, x, rhs, attrs["x_zero"])  # padding holds the zero point (real 0.0)
        wz = env[layer.consts["w_zero"]].astype(np.int64) if "w_zero" in layer.consts else None
        # zero points of the A rows / B columns: conv rows are output channels, dense columns are
        # output features, matmul's are per tensor
        runner.za, runner.zb = {"conv2d": (wz, zx), "dense": (zx, wz)}.get(
            layer.kind, (zx, np.int64(attrs.get("b_zero", 0))))
        runner.epi = {k: env[layer.consts[k]] for k in ("scale", "bias", "bias_q", "multiplier", "shift") if k in layer.consts}
        runner.acc_bits = int(runner.p.arch.get("acc_bits", 29))
        runner.partials = {}  # split reductions: region -> (k covered, int32 partial sums)

    def run_tile(self, runner, tile) -> None:
        (b0, _), (m0, m1), (n0, n1) = tile.region[:3]
        step = -(-runner.g.k // tile.k_splits)
        if len(tile.region) > 3:  # one part of a reduction split over PEs (int8 only)
            (k0, k1), = tile.region[3:]
            _qgemm_part(runner, b0, m0, m1, n0, n1, k0, k1, step)
            return
        block = _qgemm_block if runner.layer.mode == "int8" else _gemm_block
        block(runner, b0, m0, m1, n0, n1, step)

    def run_whole(self, program, index: int, layer: Layer, env, out: np.ndarray) -> np.ndarray:
        """The whole layer in one batched C++ call (int8: chunked at the program's length)."""
        if layer.mode == "int8":
            _qgemm_whole(program, layer, index, env, out)
        else:
            _gemm_whole(program, layer, env, out)
        return out

    def step(self, program, layer, clip: Layer | None = None):
        """The prepared fp32 step (int8 layers run :meth:`run_whole`); ``clip``: a clip layer
        whose operations the epilogue applies (it reads only this layer's result)."""
        return _fp32_step(program, layer, clip) if layer.mode == "fp32" else None

    def native(self, program, layer, nb, clip: Layer | None = None) -> bool:
        """fp32 layers as instructions (:func:`_fp32_native`), int8 layers too (:func:`_int8_native`)."""
        if layer.mode == "int8":
            return clip is None and _int8_native(program, layer, nb)
        return layer.mode == "fp32" and _fp32_native(program, layer, nb, clip)


# -- partition patterns and checks ----------------------------------------------------------------
def _epilogue(main, ann: dict, bias: bool, do_relu: bool):
    """Wrap a GEMM pattern in the optional constant bias add and ReLU (annotated in ``ann``)."""
    from tvm.relax.dpl import is_const, is_op

    pat = main
    if bias:
        ann["bias"] = b = is_const()
        pat = is_op("relax.add")(pat, b)
    if do_relu:
        pat = is_op("relax.nn.relu")(pat)
    return pat


def _gemm_patterns(kit, prefix: str, op: str, check) -> list:
    """``op(x, W const)`` with optional constant bias add and ReLU: four patterns, largest first."""
    from tvm.relax.dpl import is_const, is_op, wildcard

    out = []
    for bias in (True, False):
        for do_relu in (True, False):
            data, weight = wildcard(), is_const()
            main = is_op(op)(data, weight)
            # "conv" is the conv2d call itself (its attrs are checked); "main" is the GEMM output.
            ann = {"input": data, "weight": weight, "conv": main, "main": main}
            ann["root"] = pat = _epilogue(main, ann, bias, do_relu)
            name = prefix + ("_bias" if bias else "") + ("_relu" if do_relu else "")
            out.append(kit.entry(name, pat, ann, check))
    return out


def _qgemm_patterns(kit, prefix: str, op: str, weight_const: bool) -> list:
    """``op(dequantize(xq), dequantize(wq))`` with optional bias, ReLU and output ``quantize``.

    Eight patterns, largest first. With ``weight_const`` the weight is an int8 constant (conv2d,
    dense); otherwise both operands are activations (matmul, no bias/ReLU variants).
    """
    from tvm.relax.dpl import is_const, is_op, wildcard

    out = []
    for requant in (True, False):
        for bias in ((True, False) if weight_const else (False,)):
            for do_relu in ((True, False) if weight_const else (False,)):
                xq, sx, zx = wildcard(), is_const(), is_const()
                wq, sw, zw = (is_const() if weight_const else wildcard()), is_const(), is_const()
                xdq = is_op("relax.dequantize")(xq, sx, zx)
                wdq = is_op("relax.dequantize")(wq, sw, zw)
                main = is_op(op)(xdq, wdq)
                ann = {"xq": xq, "sx": sx, "zx": zx, "xdq": xdq, "wq": wq, "sw": sw, "zw": zw,
                       "wdq": wdq, "main": main}
                pat = _epilogue(main, ann, bias, do_relu)
                if requant:
                    sy, zy = is_const(), is_const()
                    pat = is_op("relax.quantize")(pat, sy, zy)
                    ann.update(quant=pat, sy=sy, zy=zy)
                ann["root"] = pat
                name = prefix + ("_bias" if bias else "") + ("_relu" if do_relu else "") + ("_requant" if requant else "")
                out.append(kit.entry(name, pat, ann, _check_qgemm))
    return out


def _check_gemm_fits(kit, op: str, root, k: int, elem_bytes: int) -> bool:
    # The tiler's own smallest tile: what passes here always tiles.
    return kit.check_fits(op, root, smallest_gemm_tile_bytes(kit.arch, k, elem_bytes, elem_bytes),
                          f"the smallest GEMM tile (K={k})")


def _check_channel_bias(kit, op: str, ctx, axis: int, rank: int) -> bool:
    root = ctx.annotated_expr["root"]
    out_shape = kit.static_shape(ctx.annotated_expr["main"])
    bshape = kit.static_shape(ctx.annotated_expr["bias"])
    channels = out_shape[axis]
    padded = (1,) * (rank - len(bshape)) + tuple(bshape)
    expect = tuple(channels if i == axis % rank else 1 for i in range(rank))
    if padded != expect and math.prod(bshape) != 1:
        return kit.refuse(op, root, f"bias shape {bshape} is not per-channel {expect}")
    return True


def _check_conv2d(kit, op: str, ctx) -> bool:
    if not kit.check_tensors(op, ctx, ("input", "weight", "bias")):
        return False
    root = ctx.annotated_expr["root"]
    attrs = ctx.annotated_expr["conv"].attrs
    if attrs.data_layout != "NCHW" or attrs.kernel_layout != "OIHW":
        return kit.refuse(op, root, f"layout {attrs.data_layout}/{attrs.kernel_layout} (need NCHW/OIHW)")
    if str(attrs.out_dtype) not in ("", "None", "float32"):
        return kit.refuse(op, root, f"out_dtype {attrs.out_dtype}")
    if "bias" in ctx.annotated_expr and not _check_channel_bias(kit, op, ctx, axis=1, rank=4):
        return False
    wshape = kit.static_shape(ctx.annotated_expr["weight"])
    return _check_gemm_fits(kit, op, root, wshape[1] * wshape[2] * wshape[3], 4)


def _check_dense(kit, op: str, ctx) -> bool:
    if not kit.check_tensors(op, ctx, ("input", "weight", "bias")):
        return False
    root = ctx.annotated_expr["root"]
    ashape = kit.static_shape(ctx.annotated_expr["input"])
    wshape = kit.static_shape(ctx.annotated_expr["weight"])
    if len(wshape) != 2 or len(ashape) < 1:
        return kit.refuse(op, root, f"weight rank {len(wshape)} (need a 2-D constant)")
    if "bias" in ctx.annotated_expr:
        oshape = kit.static_shape(ctx.annotated_expr["main"])
        bshape = kit.static_shape(ctx.annotated_expr["bias"])
        if tuple(d for d in bshape if d != 1) not in ((), (oshape[-1],)) or bshape[-1] not in (1, oshape[-1]):
            return kit.refuse(op, root, f"bias shape {bshape} is not per-output-feature")
    return _check_gemm_fits(kit, op, root, wshape[0], 4)


def _check_matmul(kit, op: str, ctx) -> bool:
    if not kit.check_tensors(op, ctx, ("lhs", "rhs")):
        return False
    root = ctx.annotated_expr["root"]
    a = kit.static_shape(ctx.annotated_expr["lhs"])
    b = kit.static_shape(ctx.annotated_expr["rhs"])
    if len(a) < 2 or len(b) < 2:
        return kit.refuse(op, root, "matmul operands must be at least 2-D")
    return _check_gemm_fits(kit, op, root, a[-1], 4)


def _check_qgemm(kit, op: str, ctx) -> bool:
    """``gemm(dequantize(xq), dequantize(wq))`` [+ bias] [relu] [quantize] on the MAC array."""
    ann = ctx.annotated_expr
    root = ann["root"]
    main = ann["main"]
    shape = kit.static_shape
    if shape(main) is None or shape(root) is None:
        return kit.refuse(op, root, "dynamic shape")
    for name in ("root", "main", "xq", "wq"):
        if not kit.check_nonempty(op, root, name, ann[name]):
            return False
    is_conv, is_dense = op.startswith("spinn.qconv2d"), op.startswith("spinn.qdense")
    out_shape = shape(main)
    channels = out_shape[1] if is_conv else out_shape[-1]
    for q, s, z, what in (("xq", "sx", "zx", "activation"), ("wq", "sw", "zw", "weight")):
        if not kit.check_quantized(op, root, ann[q], what):
            return False
        per_channel = channels if (what == "weight" and (is_conv or is_dense or len(shape(ann[q])) >= 2)) else None
        if not kit.check_qparams(op, root, ctx, s, z, per_channel, what):
            return False
    if not kit.check_dq_axis(op, root, ctx, "xdq", "sx", -1):
        return False
    w_axis = 0 if is_conv else -1
    if not kit.check_dq_axis(op, root, ctx, "wdq", "sw", w_axis):
        return False
    if is_conv:
        attrs = ann["main"].attrs
        if attrs.data_layout != "NCHW" or attrs.kernel_layout != "OIHW":
            return kit.refuse(op, root, f"layout {attrs.data_layout}/{attrs.kernel_layout} (need NCHW/OIHW)")
        wshape = shape(ann["wq"])
        if not _check_gemm_fits(kit, op, root, wshape[1] * wshape[2] * wshape[3], 1):
            return False
    elif is_dense and len(shape(ann["wq"])) != 2:
        return kit.refuse(op, root, "weight must be a 2-D constant")
    elif not is_dense and (len(shape(ann["xq"])) < 2 or len(shape(ann["wq"])) < 2):
        return kit.refuse(op, root, "matmul operands must be at least 2-D")
    if not is_conv:
        k = shape(ann["wq"])[0] if is_dense else shape(ann["xq"])[-1]
        if not _check_gemm_fits(kit, op, root, k, 1):
            return False
    if str(getattr(main.attrs, "out_dtype", "")) not in ("", "None", "float32", "void"):
        return kit.refuse(op, root, f"out_dtype {main.attrs.out_dtype}")
    if "bias" in ann:
        if kit.dtype(ann["bias"]) != "float32":
            return kit.refuse(op, root, f"bias dtype {kit.dtype(ann['bias'])}")
        if is_conv and not _check_channel_bias(kit, op, ctx, axis=1, rank=4):
            return False
        bshape = shape(ann["bias"])
        if not is_conv and (tuple(d for d in bshape if d != 1) not in ((), (channels,)) or bshape[-1] not in (1, channels)):
            return kit.refuse(op, root, f"bias shape {bshape} is not per-output-feature")
    if "quant" in ann:
        if str(ann["quant"].attrs.out_dtype) not in kit.QUANTIZED_DTYPES:
            return kit.refuse(op, root, f"output quantized to {ann['quant'].attrs.out_dtype}")
        if not kit.check_qparams(op, root, ctx, "sy", "zy", None, "output"):
            return False
    return True


# -- lowering -------------------------------------------------------------------------------------
def _lower_bias(lowerer, bias, out: int, base: str, name: str) -> int:
    from tvm.ir.expr import Constant

    if not isinstance(bias, Constant):
        raise LoweringError(f"{name}: bias must be a constant")
    channels = lowerer.program.tensors[out].shape[1 if base == "conv2d" else -1]
    value = np.broadcast_to(bias.value.numpy().reshape(-1), (channels,)).astype(np.float32)
    return lowerer.add_const("bias", value)


def _lower_qgemm(lowerer, layer: Layer, name: str, calls: list, env: dict) -> None:
    """An int8 GEMM (see :mod:`tvm_spinn.program.quant` for the arithmetic)."""
    from tvm.ir.expr import Constant

    by_var = dict(calls)
    ops = {c.op.name: c for _, c in calls}
    main = next(c for _, c in calls if c.op.name in ("relax.nn.conv2d", "relax.matmul"))
    xdq, wdq = by_var[main.args[0]], by_var[main.args[1]]
    base = "conv2d" if main.op.name == "relax.nn.conv2d" else ("dense" if layer.kind.startswith("qdense") else "matmul")
    layer.kind, layer.mode = base, "int8"
    layer.name = f"q{base}_{len(lowerer.program.layers)}"  # e.g. qconv2d_4 (fused epilogue in attrs)
    out_shape = [int(d.value) for d in main.ty.shape.values]
    channels = out_shape[1] if base == "conv2d" else out_shape[-1]

    def qparams(dq, per_channel: bool) -> tuple[np.ndarray, np.ndarray, str]:
        scale = np.asarray(dq.args[1].value.numpy(), dtype=np.float64).reshape(-1)
        zero = dq.args[2].value.numpy().astype(np.int64).reshape(-1)
        dtype = str(dq.args[0].ty.dtype)
        zero = zero - (128 if dtype == "uint8" else 0)  # the array sees uint8 with its top bit flipped
        if per_channel:
            scale, zero = np.broadcast_to(scale, (channels,)), np.broadcast_to(zero, (channels,))
        return scale, zero, dtype

    sx, zx, xdtype = qparams(xdq, False)
    sw, zw, wdtype = qparams(wdq, base != "matmul")
    layer.inputs = [lowerer.operand(xdq.args[0], env)]
    layer.attrs.update(x_zero=int(zx[0]), x_flip=xdtype == "uint8", relu="relax.nn.relu" in ops)
    if base == "matmul":  # both operands are activations, per-tensor
        layer.inputs.append(lowerer.operand(wdq.args[0], env))
        layer.attrs.update(b_zero=int(zw[0]), b_flip=wdtype == "uint8")
        s_acc = np.broadcast_to(sx[0] * sw[0], (channels,))
    else:
        weight = wdq.args[0]
        if not isinstance(weight, Constant):
            raise LoweringError(f"{name}: the int8 weight must be a constant")
        layer.consts["weight"] = lowerer.add_const("qweight", to_signed(weight.value.numpy()))
        if np.any(zw != 0):
            layer.consts["w_zero"] = lowerer.add_const("wzero", zw.astype(np.int32))
        if base == "conv2d":
            a = main.attrs
            layer.attrs.update(strides=[int(v) for v in a.strides], padding=[int(v) for v in a.padding],
                               dilation=[int(v) for v in a.dilation], groups=int(a.groups))
        s_acc = sx[0] * sw
    bias = None
    if "relax.add" in ops:
        add = ops["relax.add"]
        b = add.args[1] if isinstance(add.args[1], Constant) else add.args[0]
        bias = np.broadcast_to(b.value.numpy().astype(np.float64).reshape(-1), (channels,))
    quant = ops.get("relax.quantize")
    if quant is None:
        layer.attrs["out"] = "float32"
        layer.consts["scale"] = lowerer.add_const("qscale", s_acc.astype(np.float32))
        if bias is not None:
            layer.consts["bias"] = lowerer.add_const("bias", bias.astype(np.float32))
        return
    ydtype = str(quant.attrs.out_dtype)
    sy = float(np.asarray(quant.args[1].value.numpy(), dtype=np.float64).reshape(-1)[0])
    zy = int(quant.args[2].value.numpy().reshape(-1)[0])
    lo, hi = QUANT_RANGES[ydtype]
    # A composite named ``..._tflite`` (relax_rewrites.folds.TagRequantRounding) requantizes with
    # TFLite's rule (program/quant.py).
    rounding = "tflite" if name.endswith("_tflite") else "half_up"
    to_fixed = quantize_multiplier_tflite if rounding == "tflite" else quantize_multiplier
    mult, shift = np.zeros(channels, np.int32), np.zeros(channels, np.int32)
    for c in range(channels):
        try:
            mult[c], shift[c] = to_fixed(float(s_acc[c]) / sy)
        except ValueError as err:
            raise LoweringError(f"{name}: channel {c}: {err}") from None
    with np.errstate(divide="ignore", invalid="ignore"):
        bias_q = np.where(s_acc > 0, np.rint((bias if bias is not None else 0.0) / s_acc), 0.0)
    if np.any(np.abs(bias_q) >= 2**31):
        raise LoweringError(f"{name}: the quantized bias does not fit 32 bits (scales too small)")
    layer.attrs.update(out=ydtype, y_zero=zy, y_min=max(lo, zy) if layer.attrs["relu"] else lo, y_max=hi)
    if rounding != "half_up":
        layer.attrs["rounding"] = rounding
    layer.consts["bias_q"] = lowerer.add_const("biasq", bias_q.astype(np.int32))
    layer.consts["multiplier"] = lowerer.add_const("mult", mult)
    layer.consts["shift"] = lowerer.add_const("shift", shift)


# -- validation of the int8 epilogue --------------------------------------------------------------
def _check_int8_epilogue(v, f: str, kind: str, ins: list[int], consts: dict, out: int, attrs: dict,
                         channels: int, k: int) -> None:
    if attrs["x_flip"] != (v.dtypes[ins[0]] == "uint8"):
        fail(f"{f}.attrs.x_flip", f"must be {v.dtypes[ins[0]] == 'uint8'} for a {v.dtypes[ins[0]]} input")
    if kind == "matmul" and attrs["b_flip"] != (v.dtypes[ins[1]] == "uint8"):
        fail(f"{f}.attrs.b_flip", f"must be {v.dtypes[ins[1]] == 'uint8'} for a {v.dtypes[ins[1]]} input")
    for key in ("x_zero", "b_zero"):
        if key in attrs and not -128 <= attrs[key] <= 127:
            fail(f"{f}.attrs.{key}", f"{attrs[key]} is outside the signed int8 range")
    weight = set() if kind == "matmul" else {"weight"}
    odt = attrs["out"]
    v.dtype(f"{f}.output", out, (odt,))
    if odt == "float32":
        v.consts(f, consts, weight | {"scale"}, {"bias", "w_zero"})
        if (set(_REQUANT) | {"rounding"}) & attrs.keys():
            fail(f"{f}.attrs", f"y_zero/y_min/y_max belong to a requantizing epilogue, output is {odt}")
        roles = {"scale": "float32", "bias": "float32"}
    else:
        v.consts(f, consts, weight | {"bias_q", "multiplier", "shift"}, {"w_zero"})
        missing = sorted(set(_REQUANT) - attrs.keys())
        if missing:
            fail(f"{f}.attrs", f"missing key(s) {missing} of the requantizing epilogue")
        lo, hi = _QRANGE[odt]
        if not lo <= attrs["y_min"] <= attrs["y_max"] <= hi or not lo <= attrs["y_zero"] <= hi:
            fail(f"{f}.attrs.y_min", f"y_zero/y_min/y_max must lie in [{lo}, {hi}] with y_min <= y_max")
        roles = {"bias_q": "int32", "multiplier": "int32", "shift": "int32"}
    roles["w_zero"] = "int32"
    for role, dtype in roles.items():
        if role in consts:
            v.dtype(f"{f}.consts.{role}", consts[role], (dtype,))
            v.shape(f"{f}.consts.{role}", consts[role], [channels])
    if odt != "float32":
        # Fixed-point multiplier ranges of program/quant.py: a shift outside [1, 62] makes
        # the rounding term 1 << (shift - 1) negative or the shift exceed the int64 width.
        v.values(f"{f}.consts.multiplier", consts["multiplier"], 0, (1 << 31) - 1)
        v.values(f"{f}.consts.shift", consts["shift"], 1, 62)


# -- sharding ---------------------------------------------------------------------------------
class GemmSharding(ShardingRule):
    """How GEMMs split over a mesh axis.

    Tensor axis (``tp``): a dense layer or a convolution on an ``R`` input is *column-parallel*
    (weight split by output features, output ``S``); on an input split along its reduction axis
    it is *row-parallel* (weight split by input features, output ``P``) where the mesh allows it
    and the partial sums are no larger than the input; output features that ``tp`` does not
    divide are split unevenly. Grouped convolutions split their groups. A matmul of two
    activations keeps a batch axis (the heads) both operands share, the rows of ``A`` or the
    columns of ``B``, runs row-parallel on a reduction split of both, and otherwise gathers its
    operands and splits the heads or the rows (``R`` operands are sliced for free).

    Sequence axis (``sp``): rows are independent, so dense layers and matmuls keep (or start) a
    split of their rows; what a row block cannot take split (a reduction axis, the keys of
    attention) is gathered; convolutions are replicated.
    """

    def propagate(self, ctx, layer, ins):
        if len(ctx.acts(layer)) != 2 and layer.kind == "matmul":
            return PointwiseRule().propagate(ctx, layer, ins)  # a constant operand: follows A
        if ctx.axis.name == "sp":
            return self._rows(ctx, layer, ins)
        return self._tensor(ctx, layer, ins)

    @staticmethod
    def _tensor(ctx, layer, st):
        full, acts, tp, row = ctx.full, ctx.acts(layer), ctx.size, ctx.axis.row
        out = layer.output
        rank = len(full[out])
        kind = layer.kind
        if kind == "dense" or (kind == "conv2d" and layer.attrs.get("groups", 1) == 1):
            ax = rank - 1 if kind == "dense" else 1
            k_axis = len(full[acts[0]]) - 1 if kind == "dense" else 1
            n_out = full[out][ax]
            if st[0].split and st[0].axis == k_axis and row and (row == ROW_ALWAYS or ctx.row_pays(layer, acts[0])):
                return ShardDecision(PARTIAL, "row", partial_elem=ACC_BYTES if layer.mode == "int8" else None,
                                     partial_exact=layer.mode == "int8")
            if n_out >= tp:  # uneven: the last chips get a column fewer
                return ShardDecision(shard(ax), "col", (GatherInput(0),))
            return ShardDecision(REPLICATE, "rep", (GatherInput(0),))
        if kind == "conv2d":  # grouped / depthwise: channels split with their groups
            if layer.attrs["groups"] % tp == 0 and (not st[0].split or st[0] == shard(1)):
                return ShardDecision(shard(1), "split")  # an R input is sliced for free
            return ShardDecision(REPLICATE, "rep", (GatherInput(0),))
        a = (st[0].kind, st[0].axis - len(full[acts[0]]))
        b = (st[1].kind, st[1].axis - len(full[acts[1]]))
        m_ext = full[out][-2] if rank >= 2 else 1
        if a[0] == "S" and b[0] == "S" and a[1] == b[1] and a[1] <= -3:
            return ShardDecision(shard(rank + a[1]), "split")
        if a[0] == "S" and a[1] <= -3 and b[0] == "R" and len(full[acts[1]]) >= -a[1] \
                and full[acts[1]][a[1]] == full[acts[0]][a[1]]:
            return ShardDecision(shard(rank + a[1]), "split")
        if b[0] == "S" and b[1] <= -3 and a[0] == "R" and len(full[acts[0]]) >= -b[1] \
                and full[acts[0]][b[1]] == full[acts[1]][b[1]]:
            return ShardDecision(shard(rank + b[1]), "split")
        if a[0] == "S" and a[1] == -2 and b[0] == "R":
            return ShardDecision(shard(rank - 2), "split")
        if a[0] == "R" and b[0] == "S" and b[1] == -1:
            return ShardDecision(shard(rank - 1), "split")
        if a[0] == "S" and a[1] == -1 and b[0] == "S" and b[1] == -2 and row \
                and (row == ROW_ALWAYS or ctx.row_pays(layer, acts[0])):
            return ShardDecision(PARTIAL, "row", partial_elem=ACC_BYTES if layer.mode == "int8" else None,
                                 partial_exact=layer.mode == "int8")
        # R operands are sliced for free: split the outermost batch axis both operands share
        # (the heads), else the rows
        lead = [j for j in range(rank - 2) if full[out][j] % tp == 0 and full[out][j] >= tp
                and all(len(full[tid]) >= rank - j and full[tid][j - rank] == full[out][j] for tid in acts)]
        if lead:
            return ShardDecision(shard(lead[0]), "split", gather_all=True)
        if m_ext % tp == 0 and m_ext >= tp:
            return ShardDecision(shard(rank - 2), "split", gather_all=True)
        return ShardDecision(REPLICATE, "rep", gather_all=True)

    @staticmethod
    def _rows(ctx, layer, st):
        full, acts, sp = ctx.full, ctx.acts(layer), ctx.size
        shape = full[layer.output]
        rank = len(shape)
        rows = rank - 2 if rank >= 2 and shape[rank - 2] >= sp else None  # R operands: sliced for free
        if layer.kind == "conv2d":
            return ShardDecision(REPLICATE, "rep", gather_all=True)
        if layer.kind == "dense":
            if st[0].split and st[0].axis == len(full[acts[0]]) - 1:
                return _row_split(rows, (GatherInput(0),))  # split along the reduction axis
            return _row_split(st[0].axis if st[0].split else rows, ())
        a, b = acts
        before = []
        sa = st[0].axis - len(full[a]) if st[0].split else None
        sb = st[1].axis - len(full[b]) if st[1].split else None
        if sa == -1:
            before.append(GatherInput(0))
            sa = None
        if sb == -2:
            before.append(GatherInput(1))
            sb = None
        if sa is not None and sa <= -3 and (sb == sa or (sb is None and len(full[b]) >= -sa
                                                          and full[b][sa] == full[a][sa])):
            res = rank + sa  # a batch axis (heads) both operands share
        elif sa is None and sb == -1:
            res = rank - 1  # the columns of B
        else:
            if sa is not None and sa != -2:
                before.append(GatherInput(0))
            if sb is not None:
                before.append(GatherInput(1))  # the keys: every query row block needs all of them
            res = rank - 2 if shape[rank - 2] >= sp else None
        return _row_split(res, tuple(before))

    def reduction_reader(self, program, layer, tid):
        return layer.kind == "dense" and "weight" in layer.consts and layer.inputs[0] == tid \
            and tid not in layer.inputs[1:]

    def cache_operand(self, layer, pos):
        return layer.kind == "matmul" and pos == 1

    def shrinks_row_consts(self, layer):
        return False  # weights and per-feature constants are not on the rows

    def const_shape(self, layer, tid, split, parts, full):
        if tid != layer.consts.get("weight") or layer.kind == "matmul":
            return None
        shape = list(full[tid])
        if layer.kind == "dense":
            k = 1 if split == "col" else 0
        else:
            k = 0 if split in ("col", "split") else 1
        shape[k] = part(shape[k], parts)
        return shape

    def local_attrs(self, layer, split, parts):
        if layer.kind == "conv2d" and split == "split":  # grouped: each chip has its groups
            return dict(layer.attrs, groups=layer.attrs["groups"] // parts)
        return None


def _row_split(axis, before):
    """A row-split decision on ``axis`` (None: replicated)."""
    if axis is None:
        return ShardDecision(REPLICATE, "rep", before, gather_all=True)
    return ShardDecision(shard(axis), "split", before)



# -- descriptor programs (weights passed as inputs) -------------------------------------------------
def weight_matmuls_to_dense(program, weight_inputs: set, dtype: str, new_tensor, set_const) -> list:
    """The layers of ``program`` with every ``matmul`` of a 2-D activation by a weight input
    ``(K, N)``, or by the ``permute_dims`` of a weight ``(N, K)`` (``nn.Linear``), made a
    ``dense`` layer with that weight as its ``(K, N)`` constant (``int8``: a ``quantize`` of the
    activation, an int8 weight and per-channel scales): what the compiler makes of a GEMM with
    a bound weight. ``new_tensor(name, shape, dtype, role)`` adds a tensor; ``set_const(tid,
    shape, dtype)`` records a constant's value."""
    tensors = program.tensors
    users: dict[int, list[int]] = {}
    for i, layer in enumerate(program.layers):
        for t in layer.inputs:
            users.setdefault(t, []).append(i)
    transposed = {}  # output of permute_dims(weight (N, K)) -> the weight
    for layer in program.layers:
        if (layer.kind == "permute_dims" and len(layer.inputs) == 1 and layer.inputs[0] in weight_inputs
                and len(tensors[layer.inputs[0]].shape) == 2
                and all(program.layers[u].kind == "matmul" and program.layers[u].inputs[1:] == [layer.output]
                        for u in users.get(layer.output, []))):
            transposed[layer.output] = layer.inputs[0]

    layers = []
    for layer in program.layers:
        if layer.kind == "permute_dims" and layer.output in transposed:
            continue
        b = layer.inputs[1] if layer.kind == "matmul" and len(layer.inputs) == 2 else None
        x = layer.inputs[0]
        if b is not None and (b in transposed or (b in weight_inputs and len(tensors[b].shape) == 2)) \
                and len(tensors[x].shape) == 2:
            k, n = tensors[x].shape[1], tensors[layer.output].shape[-1]
            w_dtype = "int8" if dtype == "int8" else "float32"
            # the weight tensor itself becomes the dense layer's (K, N) constant: no orphan left
            weight = transposed.get(b, b)
            tensors[weight].shape, tensors[weight].dtype = [int(k), int(n)], w_dtype
            set_const(weight, (k, n), w_dtype)
            if dtype == "int8":
                xq = new_tensor(f"{layer.name}.xq", tensors[x].shape, "int8", "temp")
                layers.append(Layer(name=f"{layer.name}.quantize", kind="quantize", inputs=[x], output=xq,
                                    consts={"scale": new_tensor(f"{layer.name}.xs", (1,), "float32", "const"),
                                            "zero": new_tensor(f"{layer.name}.xz", (1,), "int32", "const")},
                                    attrs={"axis": 1}))
                layers.append(Layer(name=layer.name, kind="dense", inputs=[xq], output=layer.output,
                                    consts={"weight": weight,
                                            "scale": new_tensor(f"{layer.name}.ws", (n,), "float32", "const")},
                                    attrs={"x_zero": 0, "x_flip": False, "relu": False, "out": "float32"},
                                    mode="int8"))
            else:
                layers.append(Layer(name=layer.name, kind="dense", inputs=[x], output=layer.output,
                                    consts={"weight": weight}, attrs={"relu": False}))
            continue
        layers.append(layer)
    return layers


def fuse_bias(program, layers: list) -> list:
    """``dense`` then ``add`` of a constant vector (directly or after a reshape) -> ``dense`` with ``bias``,
    the form the compiler gives a GEMM with a bound bias."""
    tensors = program.tensors
    users: dict[int, list[int]] = {}
    for i, layer in enumerate(layers):
        for t in layer.inputs:
            users.setdefault(t, []).append(i)
    drop = set()
    for layer in layers:
        if layer.kind != "dense" or "bias" in layer.consts or layer.output in program.outputs:
            continue
        n = tensors[layer.output].shape[-1]
        chain, out = [], layer.output
        while len(users.get(out, [])) == 1 and layers[users[out][0]].kind == "reshape" and out not in program.outputs:
            chain.append(users[out][0])
            out = layers[users[out][0]].output
        nxt = users.get(out, [])
        if len(nxt) != 1 or layers[nxt[0]].kind != "add" or out in program.outputs:
            continue
        add = layers[nxt[0]]
        others = [t for t in add.inputs if t != out]
        if len(others) != 1 or tensors[others[0]].role != "const" or tensors[others[0]].shape != [n] \
                or tensors[add.output].shape != tensors[out].shape:
            continue
        layer.consts["bias"] = others[0]
        if chain:
            layers[chain[-1]].output = add.output
        else:
            layer.output = add.output
        drop.add(nxt[0])
    return [layer for i, layer in enumerate(layers) if i not in drop]


Gemm.sharding = GemmSharding()
register(Gemm())
