"""The PE kernels as TIR, one PrimFunc per role, lowered to Cortex-M4F objects by TVM's LLVM.

Every kernel is the C-ABI function ``pe_kernel`` (pointers and 32-bit integers in r0-r3, then
on the stack; no floating-point arguments) that the runtime's job loop calls once per job. A job
is one tile, or one reduction chunk of a GEMM tile, as the mapper cut the layer. The arithmetic
is spelled in the order the simulator defines it (:mod:`tvm_spinn.program.ops`), one IEEE fp32
operation per TIR operation: LLVM keeps it (no fast-math flags), so the executed instructions are
the single-precision VADD/VMUL/VCMP the simulator's numbers claim.

Kernels (the ``spec`` of :func:`kernel_object`):

- ``("binary", op, relu)``: ``c[i] = a[i] <op> b[i]`` (op ``add``/``subtract``/``multiply``/
  ``divide``), then ``x > 0 || x != x ? x : +0`` when ``relu``; args ``a, b, c, n``.
- ``("relu",)``: args ``x, y, n``.
- ``("clip",)``: ``y = x < hi || x != x ? x : hi``, then ``y > lo || y != y ? y : lo`` (TVM's
  ``max(min(x, hi), lo)`` as compare-and-select, a NaN kept); args ``x, y, n, lo, hi`` (the
  bounds as float32 bits).
- ``("where_less",)``: ``y[i] = a[i] < b[i] ? c[i] : d[i]`` (a compare and a select: the
  chosen operand's bits, a NaN compare false); args ``a, b, c, d, y, n``.
- ``("rope",)``: ``y[i] = x[i] * c[i] + (j < h ? -p[i] : p[i]) * s[i]`` with ``j`` the element's
  position in its row of ``2 h`` (``j0`` for the first, wrapping to 0 at the row's end) and
  ``p`` the DMA's run of partners (``x`` at ``e + h`` in a row's first half, ``e - h`` in its
  second; the sign bit flipped as ``negative`` does); args ``x, p, c, s, y, n, j0, h``.
- ``("gemm_f32", relu)``: one k-chunk of ``C[m, n] += A[m, k] B[k, n]`` in ascending k into
  the fp32 accumulator ``C``, in 4 x 4 register blocks of outputs (4 x 1 at the right edge, 1 x 4
  in the rows below, one at a time in the corner right of those; every output's products
  summed in ascending k, as one at a time),
  the operands in panels (:func:`tvm_spinn.pe.execute.gemm_f32_panels`: ``A`` transposed, both
  cut into ``[k, 4]`` panels, a narrower last one stored transposed, each of its rows or columns
  contiguous in k), a block's k loop unrolled by 4 with its 8 operands loaded together (``flags`` bit 0: first chunk, start from +0.0; bit 1: last
  chunk, add the bias when bit 2 is set -- ``bias[i]`` per row when bit 3 is set (conv2d's
  output channels), else ``bias[j]`` per column -- then the ReLU); args ``a, b, c, bias, m, n,
  k, flags``.
- ``("gemm_i8",)``: one k-chunk of an int8 GEMM (``dense``, ``matmul``, a ``conv2d`` tile
  transposed by the host, see :mod:`.execute`), software-pipelined: the MAC array (drivers
  ``pe_mac_start``, ``pe_mac_wait``) computes the chunk's ``acc_bits`` sums one block of
  ``flags >> 8`` columns at a time while the M4F finishes the block before; the sums go into
  the int32 accumulator ``acc`` on the first chunk (``flags`` bit 0), else into one of two
  alternating scratch blocks in ``p`` (``2 x m x cb`` int32), added in 32-bit to ``acc``, with the
  row sums of ``a`` (``flags`` bit 2) and the column sums of ``b`` (bit 3) where the zero-point
  terms need them at run time; on the last chunk the zero-point terms and the requantization
  (:func:`tvm_spinn.program.quant.requantize`; a ReLU is its clamp at the zero point) write
  int8 ``y`` column by column, as Cortex-M4 firmware requantizes: each output one MLS, one ADD
  and one SMLAL onto the column's 64-bit bias-and-rounding term, then for shifts of 32 and
  more the high word's arithmetic shift and a 32-bit clamp (a 64-bit shift and clamp below
  32, multipliers of 1/2 and more) (an int32 output is ``acc`` itself, bit 1 clear). Args ``a, b, p, acc, rowsum,
  colsum, consts, y, m, n, k, flags``; ``consts`` points at ``[zx, K, y_zero, y_min, y_max]``
  then per column ``zw, bias_q, multiplier, shift`` (int32 each), then the addresses of the two
  halves of A and of B and the next chunk's length. ``flags``: bit 4, the chunk's first block
  is already running (the job before started it); bit 5, start the next chunk's first block
  after this chunk's last; bit 6, the scratch half of this chunk's first block; bit 7, this
  chunk's operand half; bits 8-19, the block's columns (:func:`tvm_spinn.pe.execute.gemm_i8_tile`
  is the reference host).
- ``("gemm_i8", "tflite")``: the same kernel with TFLite's requantization
  (:func:`tvm_spinn.program.quant.requantize_tflite`, ``rounding="tflite"``): per output one
  MLS and ADD (the bias folded into the column's 32-bit term), the left shift of multipliers of
  1 and more, one SMULL and the 64-bit ``(x M0 + 2**30) >> 31`` (SaturatingRoundingDoublingHighMul),
  then RoundingDivideByPOT in 32 bits and the clamp.
- ``("gemm_i8", "f32", relu)``: the same kernel with the dequantizing epilogue of a float32
  output ``y`` (:func:`tvm_spinn.program.ops.gemm.reference.int8_finish`): ``fl(v) * scale[j]``
  (VCVT.F32.S32, VMUL), ``bias[j] + that`` (VADD, the bias its first operand) when ``flags``
  bit 20 is set, then ``y <= 0 ? +0 : y`` when ``relu``; the column constants are ``zw``, the
  bias's and the scale's float32 bits and an unused word.
- ``("dma",)``: data movement by the DMA engine: ``n`` strided descriptors
  (:data:`~.memory_map.DMA_DESC_WORDS` words each, the engine's register order) run one after
  another through the runtime's driver ``pe_dma`` (copy in, start, wait); args ``desc, n``. The
  host builds them from the layer's strided view of its input
  (:func:`tvm_spinn.program.ops.movement.dma_descriptors`: ``reshape``, ``permute_dims``,
  ``broadcast_to``, ``strided_slice``), or from each input's strided view of the output
  (scatter descriptors, :func:`tvm_spinn.program.ops.movement.scatter_targets`: ``concat``;
  ``pad`` after a fill descriptor whose source strides are 0); the elements go from the inputs,
  outside the PE's SRAM, to the tile's output in SRAM.
- ``("quantize", dtype)``: ``y[i] = clamp(rint(x[i] / s[c]) + fl(z[c]))`` (0 for a NaN) for
  element ``i`` of channel ``c`` (``s``, ``z``: the layer's tables; the job's elements run from
  offset ``off`` of a run of ``inner`` elements of channel ``c0``, channels cycling through
  ``channels``): per run one VDIV of ``1 / s`` and per element a Markstein-corrected quotient,
  VCVTR, QADD and SSAT/USAT; elements and runs outside that path's exact ranges, and a channel
  per element (``inner`` 1), take the simulator's operations (VDIV, the rounding to nearest
  even spelled as ``(v + 2^23) - 2^23``, ``(v - 2^23) + 2^23`` below 0, for ``|v| < 2^23``: FPv4
  has no VRINT; see :func:`_quantize`); args ``x, s, z, y, n, inner, channels, off, c0``.
- ``("dequantize", dtype)``: ``y[i] = fl(int32(q[i]) - z[i]) * s[i]`` (a 32-bit subtraction,
  VCVT, VMUL); args ``q, s, z, y, n``. Its per-channel scales and zero points come per element
  (the DMA broadcasts them).
- ``("pool", op)`` (``max``/``avg``): 2-D pooling of a band of padded input rows, the window
  visited row by row: max from the lowest finite float32 by ``acc > v || acc != acc ? acc :
  v``; average as an fp32 sum from the window's first element, divided by ``div[r, c]`` (the
  window size or its count of non-padding elements); args ``src, div, dst, geom`` with
  ``geom`` ``[planes, rows, ow, band_h, wp, kh, kw, sh, sw, dh, dw]`` (int32).
- ``("pool_grad",)``: ``max_pool2d_backward`` on a band of one plane's rows: the output
  elements ``[lo, hi)`` of the band set to +0.0, then the windows that may hold a band row
  visited from the last backwards (rows, then columns), each one's argmax found as TVM's
  ``pool_grad`` finds it (from the lowest float32, a tap taken unless ``best > v || best ==
  v``, so a NaN is taken; the best kept by ``best > v ? best : v``) and its gradient added to
  the element it takes where that lies in ``[lo, hi)`` and not in the padding (the VADD takes
  the gradient as its first operand); args ``x, dy, dx, geom`` with ``x`` the padded input rows
  under the windows, ``dy`` their gradients and ``geom`` ``[windows' rows, ow, padded width, kh,
  kw, sh, sw, the band's first element row relative to the windows' first padded row, w, lo,
  hi, left padding]`` (int32).
- ``("xent_grad",)``: ``cross_entropy_backward``, the softmax kernel's phases plus one: 0, the
  max (as softmax's); 1, ``y = exp(x - max)`` in one stream through the exp/log unit, and the
  sequential sum into ``st[2r + 1]``; 3, phase 1 without the sum (a streamed row's exps again for
  its output: the same bits); 2, ``y = (y / sum - (c0 + j == label[r] ? 1 : 0)) / n``; args ``x,
  y, st, labels, rows, cols, phase, flags, c0, n`` (``n``: float32 bits).
- ``("mean",)``: one chunk of each row's sequential fp32 sum, from +0.0 (``flags`` bit 0) or
  from the partial ``part[r]`` the previous chunk's PE passed on; the row's last chunk (bit 1)
  writes ``sum / fl(d)``, the others the partial; args ``x, part, y, rows, cols, flags, d``.
- ``("mean_tflite", dtype)``: TFLite's integer mean (``QuantizedMeanOrSum``) of int8/uint8
  rows: one chunk of each row's 32-bit wrapping sum, from 0 (``flags`` bit 0) or the partial
  ``part[r]``; the row's last chunk (bit 1) writes ``clamp(y_zero +
  MultiplyByQuantizedMultiplier(sum - x_zero * d, multiplier, 31 - shift))`` (TFLite's
  rounding: :func:`tvm_spinn.program.quant.requantize_tflite`), the others the partial; args
  ``x, part, y, rows, cols, flags, consts`` with ``consts`` ``[x_zero, d, multiplier, shift,
  y_zero, y_min, y_max]`` (int32).
- ``("softmax_tflite", dtype)``: TFLite's integer softmax (``Softmax<int8/uint8>``, gemmlowp's
  fixed point, :func:`tvm_spinn.program.ops.rows.softmax_tflite`) in three phases, each row's
  statistics chained in ``st`` (int32) like the fp32 softmax's: 0, the max; 1, the 32-bit sum of
  ``RoundingDivideByPOT(exp(d), 12)`` over the elements with ``d >= diff_min``; 2, the output
  from the sum's reciprocal (``one_over_one_plus_x``, count of leading zeros by CLZ). Phases 1
  and 2 both compute each element's exp from ``x`` (the same operations, the same bits);
  args ``x, y, st, rows, cols, phase, flags, consts`` with ``consts`` ``[multiplier,
  left_shift, diff_min, y_min, y_max]`` (int32).
- ``("softmax",)``: the row kernel ``e / sum(e)``, ``e = exp(x - max)`` in three phases
  (argument ``phase``), so that a row split over PEs chains its statistics in the row's order:
  0, the max (from -inf, or the chain's ``st[2r]`` when ``flags`` bit 0 is clear; the row's
  first NaN wins); 1, ``y = x - max``, the chunk's ``y = exp(y)`` in one stream through the
  exp/log unit (the runtime's ``pe_exp``, a modelled peripheral), then the sequential sum of
  ``y`` into ``st[2r + 1]`` (from +0.0 on the first chunk); 2, ``y = y / sum``; args ``x, y,
  st, rows, cols, phase, flags``.
- ``("layer_norm",)``: the row's blocked sums (:data:`~tvm_spinn.program.ops.rows.LAYER_NORM_BLOCK`
  elements per block, blocks aligned at the row's start, the chunk's first column ``c0``)
  carried as ``(sum, block partial)`` in ``st[4r], st[4r + 1]``: phase 0 sums ``x``, the
  last chunk (bit 1) writes ``mean = sum / fl(d)`` to ``st[4r + 2]``; phase 1 writes ``y = x -
  mean`` and sums ``y * y``, the last chunk writes ``den = sqrt(sum / fl(d) + eps)`` (VSQRT) to
  ``st[4r + 3]``; phase 2 writes ``y / den``, times ``gamma`` (bit 2), plus ``beta`` (bit 3);
  args ``x, y, st, gamma, beta, rows, cols, phase, flags, c0, d, eps`` (``eps``: float32 bits).
- ``("rms_norm",)``: phase 0 the blocked sum of ``x * x``, the last chunk writing ``1 / sqrt(q
  / fl(d) + eps)`` to ``st[4r + 2]``; phase 1 ``h = x * r``, times the weight (bit 2, as
  ``w * h``); args ``x, y, st, w, rows, cols, phase, flags, c0, d, eps``.
- ``("take",)``: the rows of an embedding lookup: each int32 index resolved by the layer's mode
  (``mode`` 0 ``fast``: an index outside ``[0, extent)`` sets ``err[0]`` and gives its value
  in ``err[1]``, the first one only; 1 ``clip``; 2 ``wrap``, the non-negative remainder) into
  ``rows``; then per segment of the tile (a run of one table row's elements: ``nseg`` records
  of a row's position in ``rows`` and a DMA descriptor whose source is the run's place in row 0)
  the row's offset (``rows[k] * row_bytes``) is added to the descriptor's source and the DMA
  engine copies the run into the tile; args ``idx, rows, err, n, extent, mode, seg, nseg,
  row_bytes``.
- ``("cross_entropy",)``: the per-row loss ``log(s) - (z[t] - m)`` of logits ``x`` with int32
  labels ``lab`` (:func:`tvm_spinn.program.ops.loss.cross_entropy_rows`) in three phases over a
  row's chunks, the statistics chained in ``st`` (4 per row): 0 and 1 as ``softmax``'s (the
  max into ``st[4r]``; ``x - max`` and its exps in ``y``, their sequential sum into ``st[4r +
  1]``); 2, where the chunk (first column ``c0``) holds the row's label, ``z[t] - max`` into
  ``st[4r + 2]``, and on the row's last chunk (``flags`` bit 1) the sums' logs in one stream
  through the exp/log unit (the runtime's ``pe_log``) and ``out[r] = log(s) - st[4r + 2]``
  (+0.0 where the label is ``ignore``); args ``x, y, st, lab, out, rows, cols, phase, flags,
  c0, ignore``.
- ``("unary", act)``: ``gelu`` (erf by Abramowitz-Stegun 7.1.26), ``gelu_tanh``, ``sigmoid``,
  ``tanh``, in the simulator's operation order, in two passes around one stream of exp
  arguments through the exp/log unit (``y`` holds the arguments, then their exps); ``negative`` (the sign
  bit flipped), ``sqrt`` (VSQRT), ``rsqrt`` (VSQRT, VDIV), ``square`` and ``cube`` (``power``
  by 2 or 3: ``x * x``, ``(x * x) * x``); args ``x, y, n``.
"""

from __future__ import annotations

import functools
import os
import tempfile

import numpy as np
import tvm
from tvm.script import tirx as T
from tvm.tirx.build import codegen_build

from .memory_map import DMA_DESC_WORDS

from ..program.ops.gemm.geometry import M4F_BLOCK
from ..program.ops.rows import LAYER_NORM_BLOCK

__all__ = ["PE_TARGET", "BINARY_OPS", "ACTIVATIONS", "I8_BIAS_FLAG", "kernel_func", "kernel_object"]

#: TVM's LLVM target for the SpiNNaker2 PE: Cortex-M4F, single-precision FPv4, hard-float ABI.
PE_TARGET = {"kind": "llvm", "mtriple": "thumbv7em-none-eabihf", "mcpu": "cortex-m4",
             "mattr": ["+vfp4d16sp"], "mfloat-abi": "hard"}

BINARY_OPS = {
    "add": lambda x, y: x + y,
    "subtract": lambda x, y: x - y,
    "multiply": lambda x, y: x * y,
    "divide": lambda x, y: x / y,
}

_ZERO = T.float32(0)
#: ``gemm_i8`` job flag: the dequantizing epilogue adds the bias
I8_BIAS_FLAG = 1 << 20
_BLOCK = LAYER_NORM_BLOCK


def _relu(v):
    """``v > 0 ? v : +0`` with a NaN kept (the simulator's :func:`~tvm_spinn.program.ops.elementwise.relu`)."""
    # !(v <= 0) is v > 0 or unordered: one compare keeps a NaN (not ``v != v``, which TVM's
    # arithmetic simplifier folds to false, assuming no NaN).
    return T.if_then_else(T.Not(v <= _ZERO), v, _ZERO)


def _binary(op: str, relu: bool):
    fn = BINARY_OPS[op]

    @T.prim_func
    def kernel(a: T.handle("float32"), b: T.handle("float32"), c: T.handle("float32"), n: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        A = T.decl_buffer((n,), "float32", data=a)
        B = T.decl_buffer((n,), "float32", data=b)
        C = T.decl_buffer((n,), "float32", data=c)
        for i in range(n):
            if relu:
                C[i] = _relu(fn(A[i], B[i]))
            else:
                C[i] = fn(A[i], B[i])
    return kernel


def _relu_kernel():
    @T.prim_func
    def kernel(x: T.handle("float32"), y: T.handle("float32"), n: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((n,), "float32", data=x)
        Y = T.decl_buffer((n,), "float32", data=y)
        for i in range(n):
            Y[i] = _relu(X[i])
    return kernel


def _where_less():
    @T.prim_func
    def kernel(a: T.handle("float32"), b: T.handle("float32"), c: T.handle("float32"), d: T.handle("float32"),
               y: T.handle("float32"), n: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        A = T.decl_buffer((n,), "float32", data=a)
        B = T.decl_buffer((n,), "float32", data=b)
        C = T.decl_buffer((n,), "float32", data=c)
        D = T.decl_buffer((n,), "float32", data=d)
        Y = T.decl_buffer((n,), "float32", data=y)
        for i in range(n):
            Y[i] = T.if_then_else(A[i] < B[i], C[i], D[i])
    return kernel


def _rope():
    @T.prim_func
    def kernel(x: T.handle("float32"), p: T.handle("float32"), c: T.handle("float32"), s: T.handle("float32"),
               y: T.handle("float32"), n: T.int32, j0: T.int32, h: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((n,), "float32", data=x)
        P = T.decl_buffer((n,), "float32", data=p)
        C = T.decl_buffer((n,), "float32", data=c)
        S = T.decl_buffer((n,), "float32", data=s)
        Y = T.decl_buffer((n,), "float32", data=y)
        j = T.decl_buffer((1,), "int32", scope="local")
        j[0] = j0
        for i in range(n):
            # the first half's partner with its sign bit flipped: an integer select of the
            # mask and an EOR, no branch; then the imported graph's order: x * cos,
            # rotate_half(x) * sin, their sum
            sign = T.if_then_else(j[0] < h, T.int32(-2147483648), T.int32(0))
            r = T.reinterpret("float32", T.bitwise_xor(T.reinterpret("int32", P[i]), sign))
            Y[i] = X[i] * C[i] + r * S[i]
            j[0] = T.if_then_else(j[0] + 1 == h + h, 0, j[0] + 1)
    return kernel


def _clip_kernel():
    @T.prim_func
    def kernel(x: T.handle("float32"), y: T.handle("float32"), n: T.int32, lo: T.int32, hi: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((n,), "float32", data=x)
        Y = T.decl_buffer((n,), "float32", data=y)
        v = T.decl_buffer((1,), "float32", scope="local")
        flo = T.reinterpret("float32", lo)
        fhi = T.reinterpret("float32", hi)
        for i in range(n):
            # !(x >= hi) is x < hi or unordered: one compare keeps a NaN
            v[0] = T.if_then_else(T.Not(X[i] >= fhi), X[i], fhi)
            Y[i] = T.if_then_else(T.Not(v[0] <= flo), v[0], flo)
    return kernel


#: the fp32 GEMM's register block: ``_MR x _NR`` accumulators live in FPU registers over k
_MR, _NR = M4F_BLOCK
#: k steps per trip of a full block's reduction loop (unrolled: the operands' offsets are
#: immediates, one pointer increment per operand and one compare and branch per trip)
_KU = 4


def _gemm_f32(relu: bool):
    @T.macro
    def finish(C, BIAS, fin, v, i, j, n, flags):
        """``C[i, j] = v``, after the last chunk with the bias and the ReLU (through the local
        ``fin[0]``: a macro's reassigned argument would not leave its ``if``)."""
        fin[0] = v
        if flags & 2 != 0:
            if flags & 4 != 0:
                fin[0] = fin[0] + T.if_then_else(flags & 8 != 0, BIAS[i], BIAS[j])
            if relu:
                # the ReLU as ``v <= 0 ? +0 : v`` (a NaN kept): the form the kernel's simplification
                # leaves alone (it rewrites ``!(v <= 0)`` to ``v > 0``, assuming no NaN)
                fin[0] = T.if_then_else(fin[0] <= _ZERO, _ZERO, fin[0])
        C[i * n + j] = fin[0]

    @T.macro
    def step(A, B, acc, av, bv, i0, j0, kk, k):
        """One k step of a full block: its ``_MR + _NR`` operands (contiguous in their panels),
        then the products in diagonals (``acc[ii, (ii + r) % _NR]`` for ``r = 0, 1, ...``): the
        first diagonal uses every operand, so the scheduler issues the loads back to back,
        where they pipeline. The order of the independent sums changes no bits."""
        for ii in T.unroll(_MR):
            av[ii] = A[i0 * _MR * k + kk * _MR + ii]
        for jj in T.unroll(_NR):
            bv[jj] = B[j0 * _NR * k + kk * _NR + jj]
        for r in T.unroll(_NR):
            for ii in T.unroll(_MR):
                acc[ii * _NR + T.truncmod(ii + r, _NR)] = (acc[ii * _NR + T.truncmod(ii + r, _NR)]
                                                           + av[ii] * bv[T.truncmod(ii + r, _NR)])

    @T.prim_func
    def kernel(a: T.handle("float32"), b: T.handle("float32"), c: T.handle("float32"),
               bias: T.handle("float32"), m: T.int32, n: T.int32, k: T.int32, flags: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        A = T.decl_buffer((m * k,), "float32", data=a)
        B = T.decl_buffer((k * n,), "float32", data=b)
        C = T.decl_buffer((m * n,), "float32", data=c)
        BIAS = T.decl_buffer((T.max(m, n),), "float32", data=bias)
        acc = T.decl_buffer((_MR * _NR,), "float32", scope="local")
        av = T.decl_buffer((_MR,), "float32", scope="local")
        bv = T.decl_buffer((_NR,), "float32", scope="local")
        one = T.decl_buffer((1,), "float32", scope="local")
        fin = T.decl_buffer((1,), "float32", scope="local")
        mb = T.truncdiv(m, _MR)
        nb = T.truncdiv(n, _NR)
        # full MR x NR blocks: each accumulator sums its products in ascending k, as the
        # one-at-a-time loop does, so blocking changes no bits
        for i0 in range(mb):
            for j0 in range(nb):
                for ii in T.unroll(_MR):
                    for jj in T.unroll(_NR):
                        acc[ii * _NR + jj] = T.if_then_else(flags & 1 != 0, _ZERO,
                                                            C[(i0 * _MR + ii) * n + j0 * _NR + jj])
                for k4 in range(T.truncdiv(k, _KU)):
                    for u in T.unroll(_KU):
                        step(A, B, acc, av, bv, i0, j0, k4 * _KU + u, k)
                for kk in range(T.truncdiv(k, _KU) * _KU, k):
                    step(A, B, acc, av, bv, i0, j0, kk, k)
                for ii in T.unroll(_MR):
                    for jj in T.unroll(_NR):
                        finish(C, BIAS, fin, acc[ii * _NR + jj], i0 * _MR + ii, j0 * _NR + jj, n, flags)
        # the columns right of the blocks (all of them in a tile narrower than _NR) in _MR x 1
        # blocks, then the rows below the blocks in 1 x _NR blocks, their last columns (the
        # corner right of the 1 x _NR blocks) one output at a time
        for i0 in range(mb):
            for j in range(nb * _NR, n):
                for ii in T.unroll(_MR):
                    acc[ii] = T.if_then_else(flags & 1 != 0, _ZERO, C[(i0 * _MR + ii) * n + j])
                for kk in range(k):
                    for ii in T.unroll(_MR):
                        acc[ii] = acc[ii] + A[i0 * _MR * k + kk * _MR + ii] * B[j * k + kk]
                for ii in T.unroll(_MR):
                    finish(C, BIAS, fin, acc[ii], i0 * _MR + ii, j, n, flags)
        for i in range(mb * _MR, m):
            for j0 in range(nb):
                for jj in T.unroll(_NR):
                    acc[jj] = T.if_then_else(flags & 1 != 0, _ZERO, C[i * n + j0 * _NR + jj])
                for kk in range(k):
                    for jj in T.unroll(_NR):
                        acc[jj] = acc[jj] + A[i * k + kk] * B[j0 * _NR * k + kk * _NR + jj]
                for jj in T.unroll(_NR):
                    finish(C, BIAS, fin, acc[jj], i, j0 * _NR + jj, n, flags)
            for j in range(nb * _NR, n):
                one[0] = T.if_then_else(flags & 1 != 0, _ZERO, C[i * n + j])
                for kk in range(k):
                    one[0] = one[0] + A[i * k + kk] * B[j * k + kk]
                finish(C, BIAS, fin, one[0], i, j, n, flags)
    return kernel

@T.macro
def _i8_f32_columns(ACC, RS, CS, Q, Y, zx, j0, w, m, n, flags, relu: bool):
    """The dequantizing epilogue (:func:`tvm_spinn.program.ops.gemm.reference.int8_finish`):
    ``y = fl(v) * scale[j]`` (VCVT.F32.S32, VMUL), ``+ bias[j]`` (VADD) where ``flags`` bit 20
    is set, then the ReLU as ``y <= 0 ? +0 : y`` (a NaN kept, -0.0 made +0.0), ``v`` the sum with
    its zero-point terms in 32 bits. The column's constants are ``zw``, the bias's and the
    scale's float32 bits; column by column, so that they stay in registers."""
    for jj in range(w):
        j = j0 + jj
        zw = Q[5 + 4 * j]
        c = T.Cast("uint32", Q[1] * zx * zw - zx * CS[j])
        scale = T.reinterpret("float32", Q[5 + 4 * j + 2])
        bias = T.reinterpret("float32", Q[5 + 4 * j + 1])
        for i in range(m):
            f = T.Cast("float32", T.Cast("int32", T.Cast("uint32", ACC[i * n + j])
                                          - T.Cast("uint32", zw) * T.Cast("uint32", RS[i]) + c)) * scale
            g = T.if_then_else(flags & I8_BIAS_FLAG != 0, f + bias, f)
            if relu:
                Y[i * n + j] = T.if_then_else(g <= _ZERO, _ZERO, g)
            else:
                Y[i * n + j] = g


@T.macro
def _i8_tflite_columns(ACC, RS, CS, Q, Y, zx, lo, hi, j0, w, m, n):
    """TFLite's requantization (:func:`tvm_spinn.program.quant.requantize_tflite`) per column:
    ``x = (v + bias_q) << left`` in 32 bits (the simulator's int32 of the int64 sum shifted: the
    low 32 bits depend only on the sum's), ``SaturatingRoundingDoublingHighMul(x, M0)`` as one
    SMULL and the 64-bit ``(x M0 + 2**30) >> 31`` (its nudge and truncating division by
    ``2**31`` are that floor for both signs; ``M0 >= 0`` never saturates), then
    ``RoundingDivideByPOT`` by ``right`` in 32 bits (multipliers below 1: ``left`` 0), and the
    clamp at ``[lo, hi] - zero`` before the zero point is added."""
    for jj in range(w):
        j = j0 + jj
        zw = Q[5 + 4 * j]
        m0 = T.Cast("int64", Q[5 + 4 * j + 2])
        e = 31 - Q[5 + 4 * j + 3]  # TFLite's shift: > 0 a left shift
        c = T.Cast("uint32", Q[1] * zx * zw - zx * CS[j] + Q[5 + 4 * j + 1])
        if e > 0:
            for i in range(m):
                x = T.Cast("int32", T.shift_left(T.Cast("uint32", ACC[i * n + j]) - T.Cast("uint32", zw)
                                                 * T.Cast("uint32", RS[i]) + c, T.Cast("uint32", e)))
                h = T.Cast("int32", T.shift_right(T.Cast("int64", x) * m0 + T.int64(1 << 30), T.int64(31)))
                Y[i * n + j] = T.Cast("int8", T.min(T.max(h, lo), hi) + Q[2])
        else:
            right = 0 - e
            mask = T.shift_right(T.int32(0x7FFFFFFF), 31 - right)  # 2**right - 1 without overflow
            half = T.shift_right(mask, 1)
            for i in range(m):
                x = T.Cast("int32", T.Cast("uint32", ACC[i * n + j]) - T.Cast("uint32", zw)
                           * T.Cast("uint32", RS[i]) + c)
                h = T.Cast("int32", T.shift_right(T.Cast("int64", x) * m0 + T.int64(1 << 30), T.int64(31)))
                r = T.shift_right(h, right) + T.Cast(
                    "int32", T.bitwise_and(h, mask) > half + T.Cast("int32", h < 0))
                Y[i * n + j] = T.Cast("int8", T.min(T.max(r, lo), hi) + Q[2])


def _gemm_i8(epilogue: str = "half_up", relu: bool = False):
    """The int8 GEMM kernel with the last chunk's ``epilogue``: ``"half_up"`` (the one-rounding
    requantization), ``"tflite"`` (:func:`_i8_tflite_columns`) or ``"f32"`` (:func:`_i8_f32_columns`,
    then the ReLU when ``relu``); the chunk's sums and zero-point terms are the same TIR for all."""
    ydt = "float32" if epilogue == "f32" else "int8"

    @T.prim_func
    def kernel(a: T.handle("int8"), b: T.handle("int8"), p: T.handle("int32"), acc: T.handle("int32"),
               rowsum: T.handle("int32"), colsum: T.handle("int32"), consts: T.handle("int32"),
               y: T.handle(ydt), m: T.int32, n: T.int32, k: T.int32, flags: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        A = T.decl_buffer((m * k,), "int8", data=a)
        B = T.decl_buffer((k * n,), "int8", data=b)
        P = T.decl_buffer((2 * m * n,), "int32", data=p)
        ACC = T.decl_buffer((m * n,), "int32", data=acc)
        RS = T.decl_buffer((m,), "int32", data=rowsum)
        CS = T.decl_buffer((n,), "int32", data=colsum)
        Q = T.decl_buffer((10 + 4 * n,), "int32", data=consts)
        Y = T.decl_buffer((m * n,), ydt, data=y)
        first = flags & 1 != 0
        # the software pipeline: the array computes the chunk's sums one block of ``cb``
        # columns at a time (bits 8-19), and the M4F adds and requantizes block ``jb`` while
        # the array computes block ``jb + 1``; after the chunk's last block the array starts
        # the next chunk's first (bit 5; its operands are already in the other half of the
        # double-buffered A and B, whose addresses and the next chunk's length follow the
        # column constants), so the next job finds it running (bit 4). The first chunk's sums
        # go straight into the accumulator's columns (the array writes them there, rows ``n``
        # apart); a later chunk's into one of two scratch blocks ``[m, cb]``, alternating over
        # the tile's blocks (bit 6: the parity of the chunk's first block), which the M4F adds
        # in 32-bit
        cb = T.max(T.bitwise_and(T.shift_right(flags, 8), 4095), 1)
        nb = T.truncdiv(n + cb - 1, cb)
        par = T.bitwise_and(T.shift_right(flags, 6), 1)
        if flags & 16 == 0:
            if first:
                T.evaluate(T.call_extern("int32", "pe_mac_start", a, b, acc, m, T.min(cb, n), k, n, n))
            else:
                T.evaluate(T.call_extern("int32", "pe_mac_start", a, b, T.address_of(P[par * m * cb]), m,
                                         T.min(cb, n), k, n, T.min(cb, n)))
        # an operand's sums are needed only where the other's zero point is nonzero (bit 2: the
        # rows of a, bit 3: the columns of b); the host gives a constant operand's sums. They
        # run while the array computes the first block
        if flags & 4 != 0:
            for i in range(m):
                s = T.decl_buffer((1,), "int32", scope="local")
                s[0] = T.if_then_else(first, 0, RS[i])
                for kk in range(k):
                    s[0] = s[0] + T.Cast("int32", A[i * k + kk])
                RS[i] = s[0]
        if flags & 8 != 0:
            for j in range(n):
                s = T.decl_buffer((1,), "int32", scope="local")
                s[0] = T.if_then_else(first, 0, CS[j])
                for kk in range(k):
                    s[0] = s[0] + T.Cast("int32", B[kk * n + j])
                CS[j] = s[0]
        zx = Q[0]
        lo = Q[3] - Q[2]
        hi = Q[4] - Q[2]
        for jb in range(nb):
            j0 = jb * cb
            w = T.min(cb, n - j0)
            T.evaluate(T.call_extern("int32", "pe_mac_wait"))
            if jb + 1 < nb:
                if first:
                    T.evaluate(T.call_extern("int32", "pe_mac_start", a, T.address_of(B[j0 + cb]),
                                             T.address_of(ACC[j0 + cb]), m, T.min(cb, n - j0 - cb), k, n, n))
                else:
                    T.evaluate(T.call_extern("int32", "pe_mac_start", a, T.address_of(B[j0 + cb]),
                                             T.address_of(P[T.bitwise_and(par + jb + 1, 1) * m * cb]), m,
                                             T.min(cb, n - j0 - cb), k, n, T.min(cb, n - j0 - cb)))
            elif flags & 32 != 0:
                # the next chunk's first block, from the other operand half (bit 7: this one's)
                nxt = 5 + 4 * n + 1 - T.bitwise_and(T.shift_right(flags, 7), 1)
                T.evaluate(T.call_extern("int32", "pe_mac_start", Q[nxt], Q[nxt + 2],
                                         T.address_of(P[T.bitwise_and(par + nb, 1) * m * cb]), m, T.min(cb, n),
                                         Q[5 + 4 * n + 4], n, T.min(cb, n)))
            if not first:
                for i in range(m):
                    for jj in range(w):
                        ACC[i * n + j0 + jj] = ACC[i * n + j0 + jj] + P[T.bitwise_and(par + jb, 1) * m * cb + i * w + jj]
            if epilogue == "f32":
                if flags & 2 != 0:
                    _i8_f32_columns(ACC, RS, CS, Q, Y, zx, j0, w, m, n, flags, relu)
            elif epilogue == "tflite":
                if flags & 2 != 0:
                    _i8_tflite_columns(ACC, RS, CS, Q, Y, zx, lo, hi, j0, w, m, n)
            elif flags & 2 != 0:
                # column by column, so that each column's constants stay in registers: the
                # zero-point terms that do not depend on the row folded into ``c`` (32-bit
                # wrapping, as the simulator's int32 cast: addition modulo 2**32 is associative),
                # the bias's product and the rounding term into the 64-bit ``t0`` (modulo 2**64,
                # likewise), so that each output is one MLS, one ADD and one SMLAL
                for jj in range(w):
                    j = j0 + jj
                    zw = Q[5 + 4 * j]
                    m0 = T.Cast("int64", Q[5 + 4 * j + 2])
                    sh = Q[5 + 4 * j + 3]
                    c = Q[1] * zx * zw - zx * CS[j]
                    b0 = T.Cast("int64", Q[5 + 4 * j + 1]) * m0
                    if sh >= 32:
                        # the rounded quotient is the high word shifted by ``sh - 32`` (floor
                        # divisions compose): a 32-bit value, clamped in 32 bits; the clamp at
                        # ``[lo, hi] - zero`` then the zero point is the simulator's clamp of the
                        # sum with the zero point (the bounds are int8); the rounding term
                        # ``2**(sh - 1)`` as ``2**(sh - 32)`` (32-bit) times ``2**31``
                        t0 = b0 + T.shift_left(T.Cast("int64", T.shift_left(1, sh - 32)), T.int64(31))
                        for i in range(m):
                            v = ACC[i * n + j] - zw * RS[i] + c
                            t = T.Cast("int64", v) * m0 + t0
                            r = T.shift_right(T.Cast("int32", T.shift_right(t, T.int64(32))), sh - 32)
                            Y[i * n + j] = T.Cast("int8", T.min(T.max(r, lo), hi) + Q[2])
                    else:
                        # a multiplier of 1/2 or more: the 64-bit quotient clamped in 64 bits
                        t0 = b0 + T.Cast("int64", T.shift_left(1, sh - 1))
                        for i in range(m):
                            v = ACC[i * n + j] - zw * RS[i] + c
                            t = T.Cast("int64", v) * m0 + t0
                            r = T.shift_right(t, T.Cast("int64", sh))
                            Y[i * n + j] = T.Cast("int8", T.Cast("int32", T.min(T.max(r, T.Cast("int64", lo)), T.Cast("int64", hi))) + Q[2])
    return kernel


def _dma():
    @T.prim_func
    def kernel(desc: T.handle("int32"), n: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        D = T.decl_buffer((n * DMA_DESC_WORDS,), "int32", data=desc)
        for d in range(n):
            T.evaluate(T.call_extern("int32", "pe_dma", T.address_of(D[d * DMA_DESC_WORDS])))
    return kernel


_TWO23 = T.float32(8388608.0)
_LOWEST = T.float32(-3.4028234663852886e38)


def _pool(op: str):
    is_max = op == "max"

    @T.prim_func
    def kernel(src: T.handle("float32"), div: T.handle("float32"), dst: T.handle("float32"), geom: T.handle("int32")):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        G = T.decl_buffer((11,), "int32", data=geom)
        planes, rows, ow, bh, wp = G[0], G[1], G[2], G[3], G[4]
        kh, kw, sh, sw, dh, dw = G[5], G[6], G[7], G[8], G[9], G[10]
        S = T.decl_buffer((planes * bh * wp,), "float32", data=src)
        DV = T.decl_buffer((rows * ow,), "float32", data=div)
        D = T.decl_buffer((planes * rows * ow,), "float32", data=dst)
        acc = T.decl_buffer((1,), "float32", scope="local")
        for p in range(planes):
            for r in range(rows):
                for c in range(ow):
                    if is_max:
                        acc[0] = _LOWEST
                    for i in range(kh):
                        for j in range(kw):
                            v = S[p * bh * wp + (r * sh + i * dh) * wp + c * sw + j * dw]
                            if is_max:
                                acc[0] = T.if_then_else(tvm.tirx.Or(acc[0] > v, T.isnan(acc[0])), acc[0], v)
                            else:
                                acc[0] = T.if_then_else(i == 0 and j == 0, v, acc[0] + v)
                    if is_max:
                        D[p * rows * ow + r * ow + c] = acc[0]
                    else:
                        D[p * rows * ow + r * ow + c] = acc[0] / DV[r * ow + c]
    return kernel


def _pool_grad():
    """``max_pool2d_backward`` on a band of one plane's input rows (see the module docstring)."""

    @T.prim_func
    def kernel(x: T.handle("float32"), dy: T.handle("float32"), dx: T.handle("float32"), geom: T.handle("int32")):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        G = T.decl_buffer((15,), "int32", data=geom)
        nwy, nwx, ow, wp, kh, kw, sh, sw = G[0], G[1], G[2], G[3], G[4], G[5], G[6], G[7]
        rbase, w, lo, hi, pl, ox0 = G[8], G[9], G[10], G[11], G[12], G[13]
        X = T.decl_buffer((((nwy - 1) * sh + kh) * wp,), "float32", data=x)
        DY = T.decl_buffer((nwy * ow,), "float32", data=dy)
        D = T.decl_buffer((hi,), "float32", data=dx)
        best = T.decl_buffer((1,), "float32", scope="local")
        tap = T.decl_buffer((2,), "int32", scope="local")
        for e in range(lo, hi):
            # +0.0 from the job's words (``G[14]``): a constant's store loop would become the
            # runtime's byte-wise memset, four stores per element
            D[e] = T.reinterpret("float32", G[14])
        # the windows from the last backwards (rows, then columns): each element's gradient
        # adds its windows' in that order (the +0.0 of a window not taking it changes no bits)
        for a in range(nwy):
            for b in range(nwx):
                best[0] = _LOWEST
                tap[0] = -1
                tap[1] = 0
                for i in range(kh):
                    for j in range(kw):
                        # TVM's argmax: the later tap unless the best is greater or equal (a NaN
                        # either side is taken); the best kept by ``best > v ? best : v``
                        if T.Not(tvm.tirx.Or(
                                best[0] > X[((nwy - 1 - a) * sh + i) * wp + (ox0 + nwx - 1 - b) * sw + j],
                                best[0] == X[((nwy - 1 - a) * sh + i) * wp + (ox0 + nwx - 1 - b) * sw + j])):
                            tap[0] = i
                            tap[1] = j
                        best[0] = T.if_then_else(
                            best[0] > X[((nwy - 1 - a) * sh + i) * wp + (ox0 + nwx - 1 - b) * sw + j], best[0],
                            X[((nwy - 1 - a) * sh + i) * wp + (ox0 + nwx - 1 - b) * sw + j])
                if tap[0] >= 0:
                    # the taken element: in the band's flat range and not in the padding columns
                    c = (ox0 + nwx - 1 - b) * sw + tap[1] - pl
                    f = ((nwy - 1 - a) * sh + tap[0] + rbase) * w + c
                    if c >= 0 and c < w and f >= lo and f < hi:
                        D[f] = D[f] + DY[(nwy - 1 - a) * ow + ox0 + nwx - 1 - b]
    return kernel


#: float32 bits of a quiet NaN: the reciprocal of a run the fast path does not hold for (see
#: :func:`_quantize`), so that every element of it takes the reference path
_QNAN_BITS = 0x7FC00000
#: the scales' biased exponents for which the quotient's corrections are exact (|s| in
#: [2^-64, 2^64): see :func:`_quantize`), and the zero points' bound there
_SCALE_EXP = (127 - 64, 127 + 63)
_ZERO_BOUND = 1 << 23


def _quantize(dtype: str):
    """``clamp(rint(x / s) + fl(z))`` with one VDIV per run of elements that share a channel.

    The quotient ``RN(x / s)`` comes from ``y = RN(1 / s)`` (the run's VDIV) and two Markstein
    corrections: ``q0 = RN(x y)``; ``r0 = fma(-q0, s, x)`` (exact), ``q1 = fma(r0, y, q0)``, which
    is faithful (within one ulp of ``x / s``); ``r1 = fma(-q1, s, x)`` (exact),
    ``q2 = fma(r1, y, q1)``, the correctly rounded quotient by Markstein's theorem. The theorem
    needs a start within one ulp of the quotient: ``q1`` is one, ``q0 = RN(x RN(1 / s))`` is not
    proven to be, so one correction is not proven to give ``RN(x / s)`` and the kernel runs two.
    This holds when no intermediate overflows or underflows, which is so for every ``x`` whose
    quotient is at least 1/4 in magnitude when ``|s|`` is in ``[2^-64, 2^64)`` (smaller quotients
    give a ``|q2|`` below 1/2 all the same, which rounds to 0 as the quotient does). ``q2`` is
    then rounded to an integer by VCVTR (round to nearest even, FPSCR's mode) and the zero point
    added with QADD and clamped by SSAT/USAT: for ``|z| <= 2^23`` that is the reference's
    ``clamp(rint(q) + fl(z))`` exactly (``fl(z)`` is exact, the sum is an integer whose fp32
    rounding cannot cross the bounds, and a quotient beyond int32 saturates anyway).
    A NaN ``q2`` (``x`` NaN or infinite, ``x y`` overflowing) and every element of a run whose
    scale or zero point is outside those ranges (``y`` is then NaN) take the reference's own
    operations (VDIV, the ``2^23`` rounding, the fp32 add and clamps, NaN to 0).
    """
    from ..program.quant import QUANT_RANGES
    lo, hi = (T.float32(v) for v in QUANT_RANGES[dtype])
    saturate = "llvm.arm.ssat" if QUANT_RANGES[dtype][0] < 0 else "llvm.arm.usat"
    e_lo, e_hi = _SCALE_EXP

    @T.macro
    def reference(Y, i, v, t, q, fz):
        """``Y[i]`` from the quotient ``q`` as the simulator computes it: the rounding to nearest
        even as ``(v + 2^23) - 2^23`` (a stored intermediate: TVM's simplifier would fold it),
        the fp32 add of the zero point, the clamps, NaN to 0."""
        v[0] = q
        t[0] = T.if_then_else(v[0] < _ZERO, v[0] - _TWO23, v[0] + _TWO23)
        if v[0] < _TWO23 and v[0] > -_TWO23:
            v[0] = T.if_then_else(v[0] < _ZERO, t[0] + _TWO23, t[0] - _TWO23)
        v[0] = v[0] + fz
        v[0] = T.if_then_else(v[0] < lo, lo, v[0])
        v[0] = T.if_then_else(v[0] > hi, hi, v[0])
        Y[i] = T.if_then_else(T.isnan(v[0]), T.Cast(dtype, 0), T.Cast(dtype, T.Cast("int32", v[0])))

    @T.prim_func
    def kernel(x: T.handle("float32"), s: T.handle("float32"), z: T.handle("int32"), y: T.handle(dtype), n: T.int32,
               inner: T.int32, channels: T.int32, off: T.int32, c0: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((n,), "float32", data=x)
        S = T.decl_buffer((channels,), "float32", data=s)
        SB = T.decl_buffer((channels,), "int32", data=s)
        Z = T.decl_buffer((channels,), "int32", data=z)
        Y = T.decl_buffer((n,), dtype, data=y)
        run = T.decl_buffer((2,), "float32", scope="local")  # the run's scale and RN(1 / s) (or NaN)
        cz = T.decl_buffer((2,), "int32", scope="local")  # the run's channel and zero point
        v = T.decl_buffer((1,), "float32", scope="local")
        t = T.decl_buffer((1,), "float32", scope="local")
        cz[0] = c0
        if inner == 1:
            # a channel per element (per-channel along the last axis): one VDIV each, as a
            # reciprocal per run would be; the elements row by row of ``channels``
            for r in range(T.truncdiv(c0 + n + channels - 1, channels)):
                for c in range(T.max(c0 - r * channels, 0), T.min(c0 + n - r * channels, channels)):
                    reference(Y, r * channels + c - c0, v, t, X[r * channels + c - c0] / S[c], T.Cast("float32", Z[c]))
        else:
            for r in range(T.truncdiv(off + n + inner - 1, inner)):
                run[0] = S[cz[0]]
                cz[1] = Z[cz[0]]
                e = T.bitwise_and(T.shift_right(SB[cz[0]], 23), 255)
                run[1] = T.if_then_else(e >= e_lo and e <= e_hi and cz[1] >= -_ZERO_BOUND and cz[1] <= _ZERO_BOUND,
                                        T.float32(1) / run[0], T.reinterpret("float32", T.int32(_QNAN_BITS)))
                for i in range(T.max(r * inner - off, 0), T.min(r * inner - off + inner, n)):
                    v[0] = X[i] * run[1]
                    for _ in T.unroll(2):  # q1 is faithful, q2 = RN(x / s) (Markstein; q0 is not proven within 1 ulp)
                        rem = T.call_llvm_pure_intrin("float32", "llvm.fma.f32", -v[0], run[0], X[i])
                        v[0] = T.call_llvm_pure_intrin("float32", "llvm.fma.f32", rem, run[1], v[0])
                    if T.isnan(v[0]):
                        reference(Y, i, v, t, X[i] / run[0], T.Cast("float32", cz[1]))
                    else:
                        rounded = T.reinterpret("int32", T.call_llvm_pure_intrin("float32", "llvm.arm.vcvtr.f32", v[0]))
                        Y[i] = T.Cast(dtype, T.call_llvm_pure_intrin(
                            "int32", saturate, T.call_llvm_pure_intrin("int32", "llvm.arm.qadd", rounded, cz[1]), 8))
                cz[0] = T.if_then_else(cz[0] + 1 == channels, 0, cz[0] + 1)
    return kernel


def _dequantize(dtype: str):
    @T.prim_func
    def kernel(q: T.handle(dtype), s: T.handle("float32"), z: T.handle("int32"), y: T.handle("float32"), n: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        Q = T.decl_buffer((n,), dtype, data=q)
        S = T.decl_buffer((n,), "float32", data=s)
        Z = T.decl_buffer((n,), "int32", data=z)
        Y = T.decl_buffer((n,), "float32", data=y)
        for i in range(n):
            Y[i] = T.Cast("float32", T.Cast("int32", Q[i]) - Z[i]) * S[i]
    return kernel


def _mean():
    @T.prim_func
    def kernel(x: T.handle("float32"), part: T.handle("float32"), y: T.handle("float32"),
               rows: T.int32, cols: T.int32, flags: T.int32, d: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((rows * cols,), "float32", data=x)
        P = T.decl_buffer((rows,), "float32", data=part)
        Y = T.decl_buffer((rows,), "float32", data=y)
        acc = T.decl_buffer((1,), "float32", scope="local")
        for r in range(rows):
            acc[0] = T.if_then_else(flags & 1 != 0, _ZERO, P[r])
            for j in range(cols):
                acc[0] = acc[0] + X[r * cols + j]
            if flags & 2 != 0:
                Y[r] = acc[0] / T.Cast("float32", d)
            else:
                P[r] = acc[0]
    return kernel


def _mean_tflite(dtype: str):
    i64 = "int64"

    @T.prim_func
    def kernel(x: T.handle(dtype), part: T.handle("int32"), y: T.handle(dtype), rows: T.int32, cols: T.int32,
               flags: T.int32, consts: T.handle("int32")):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((rows * cols,), dtype, data=x)
        P = T.decl_buffer((rows,), "int32", data=part)
        Y = T.decl_buffer((rows,), dtype, data=y)
        Q = T.decl_buffer((7,), "int32", data=consts)
        acc = T.decl_buffer((1,), "int32", scope="local")
        w = T.decl_buffer((4,), i64, scope="local")
        for r in range(rows):
            acc[0] = T.if_then_else(flags & 1 != 0, 0, P[r])
            for j in range(cols):
                acc[0] = acc[0] + T.Cast("int32", X[r * cols + j])
            if flags & 2 != 0:
                acc[0] = acc[0] - Q[0] * Q[1]
                # MultiplyByQuantizedMultiplier(acc, multiplier, 31 - shift): a left shift in a
                # 32-bit register, SaturatingRoundingDoublingHighMul, RoundingDivideByPOT
                w[3] = T.Cast(i64, 31 - Q[3])  # the exponent: > 0 shifts left
                w[0] = T.Cast(i64, T.shift_left(acc[0], T.Cast("int32", T.max(w[3], T.int64(0)))))
                w[0] = w[0] * T.Cast(i64, Q[2])
                w[0] = w[0] + T.if_then_else(w[0] >= T.int64(0), T.int64(1 << 30), T.int64(1 - (1 << 30)))
                w[0] = T.if_then_else(w[0] >= T.int64(0), T.shift_right(w[0], T.int64(31)),
                                      T.int64(0) - T.shift_right(T.int64(0) - w[0], T.int64(31)))
                w[3] = T.max(T.int64(0) - w[3], T.int64(0))  # the right shift
                w[1] = T.shift_left(T.int64(1), w[3]) - T.int64(1)  # mask
                w[2] = T.shift_right(w[1], T.int64(1)) + T.if_then_else(w[0] < T.int64(0), T.int64(1), T.int64(0))
                w[0] = T.shift_right(w[0], w[3]) + T.if_then_else(
                    T.bitwise_and(w[0], w[1]) > w[2], T.int64(1), T.int64(0)) + T.Cast(i64, Q[4])
                w[0] = T.if_then_else(w[0] < T.Cast(i64, Q[5]), T.Cast(i64, Q[5]), w[0])
                w[0] = T.if_then_else(w[0] > T.Cast(i64, Q[6]), T.Cast(i64, Q[6]), w[0])
                Y[r] = T.Cast(dtype, w[0])
            else:
                P[r] = acc[0]
    return kernel


# -- gemmlowp's fixed point (TFLite's integer softmax), on int64 slots of a local buffer ``w``
#    holding int32 values; each macro writes its result to slot ``dst``
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


def _i64(v):
    return T.int64(v)


def _wrap32(v):
    """``v`` (int64) reduced to int32 and widened again: the 32-bit register's wrap."""
    return T.Cast("int64", T.Cast("int32", v))


@T.macro
def _srdhm(w, dst, a, b):
    """SaturatingRoundingDoublingHighMul; uses slots 20-22."""
    w[20] = a
    w[21] = b
    w[22] = w[20] * w[21]
    w[22] = w[22] + T.if_then_else(w[22] >= _i64(0), _i64(1 << 30), _i64(1 - (1 << 30)))
    w[22] = T.if_then_else(w[22] >= _i64(0), T.shift_right(w[22], _i64(31)),
                           _i64(0) - T.shift_right(_i64(0) - w[22], _i64(31)))
    w[dst] = T.if_then_else(tvm.tirx.And(w[20] == w[21], w[20] == _i64(_I32_MIN)), _i64(_I32_MAX), w[22])


@T.macro
def _rdpot(w, dst, x, e):
    """RoundingDivideByPOT(x, e), ties away from zero; uses slots 23-24."""
    w[23] = x
    w[24] = T.shift_left(_i64(1), e) - _i64(1)
    w[dst] = T.shift_right(w[23], e) + T.if_then_else(
        T.bitwise_and(w[23], w[24]) > T.shift_right(w[24], _i64(1)) + T.if_then_else(w[23] < _i64(0), _i64(1), _i64(0)),
        _i64(1), _i64(0))


@T.macro
def _shl_sat(w, dst, x, e: int):
    """SaturatingRoundingMultiplyByPOT<e> for e > 0: a saturating left shift; uses slot 23."""
    w[23] = x
    w[dst] = T.if_then_else(w[23] > _i64((1 << (31 - e)) - 1), _i64(_I32_MAX),
                            T.if_then_else(w[23] < _i64(-((1 << (31 - e)) - 1)), _i64(_I32_MIN),
                                           _wrap32(T.shift_left(w[23], _i64(e)))))


@T.macro
def _barrel(w, exponent: int, multiplier: int):
    if T.bitwise_and(w[10], _i64(1 << (31 - 5 + exponent))) != _i64(0):
        _srdhm(w, 3, w[3], _i64(multiplier))


@T.macro
def _exp_on_negative_values(w):
    """``w[3] = exp_on_negative_values(w[0])`` for Q5.26 (5 integer bits), Q0.31 out."""
    w[1] = _wrap32(T.bitwise_and(w[0], _i64((1 << 24) - 1)) - _i64(1 << 24))
    _shl_sat(w, 2, w[1], 5)
    # exp on [-1/4, 0): the Taylor expansion around -1/8
    w[4] = _wrap32(w[2] + _i64(1 << 28))
    _srdhm(w, 5, w[4], w[4])
    _srdhm(w, 6, w[5], w[4])
    _srdhm(w, 7, w[5], w[5])
    _rdpot(w, 7, w[7], _i64(2))
    _srdhm(w, 8, _wrap32(w[7] + w[6]), _i64(715827883))
    _rdpot(w, 8, _wrap32(w[8] + w[5]), _i64(1))
    _srdhm(w, 9, _i64(1895147668), _wrap32(w[4] + w[8]))
    w[3] = _wrap32(_i64(1895147668) + w[9])
    w[10] = _wrap32(w[1] - w[0])
    _barrel(w, -2, 1672461947)
    _barrel(w, -1, 1302514674)
    _barrel(w, 0, 790015084)
    _barrel(w, 1, 290630308)
    _barrel(w, 2, 39332535)
    _barrel(w, 3, 720401)
    _barrel(w, 4, 242)
    if w[0] == _i64(0):
        w[3] = _i64(_I32_MAX)


@T.macro
def _softmax_tflite_exp(w, xv, mx, Q):
    """``w[3]`` = the element's exp and ``w[11]`` = 1 where ``d = x - max >= diff_min`` (else 0)."""
    w[11] = T.if_then_else(T.Cast("int64", xv) - T.Cast("int64", mx) >= T.Cast("int64", Q[2]), _i64(1), _i64(0))
    w[0] = T.if_then_else(w[11] != _i64(0), T.Cast("int64", xv) - T.Cast("int64", mx), _i64(0))
    _srdhm(w, 0, _wrap32(T.shift_left(w[0], T.Cast("int64", Q[1]))), T.Cast("int64", Q[0]))
    _exp_on_negative_values(w)


def _softmax_tflite(dtype: str):
    @T.prim_func
    def kernel(x: T.handle(dtype), y: T.handle(dtype), st: T.handle("int32"), rows: T.int32, cols: T.int32,
               phase: T.int32, flags: T.int32, consts: T.handle("int32")):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((rows * cols,), dtype, data=x)
        Y = T.decl_buffer((rows * cols,), dtype, data=y)
        S = T.decl_buffer((2 * rows,), "int32", data=st)
        Q = T.decl_buffer((5,), "int32", data=consts)
        acc = T.decl_buffer((1,), "int32", scope="local")
        w = T.decl_buffer((25,), "int64", scope="local")
        for r in range(rows):
            if phase == 0:
                acc[0] = T.if_then_else(flags & 1 != 0, _I32_MIN, S[2 * r])
                for j in range(cols):
                    acc[0] = T.max(acc[0], T.Cast("int32", X[r * cols + j]))
                S[2 * r] = acc[0]
            elif phase == 1:  # Rescale<12> of each exp, summed in 32-bit
                acc[0] = T.if_then_else(flags & 1 != 0, 0, S[2 * r + 1])
                for j in range(cols):
                    _softmax_tflite_exp(w, X[r * cols + j], S[2 * r], Q)
                    if w[11] != _i64(0):
                        _rdpot(w, 12, w[3], _i64(12))
                        acc[0] = acc[0] + T.Cast("int32", w[12])
                S[2 * r + 1] = acc[0]
            else:
                # the reciprocal of the sum: k = 12 - clz(sum) bits above one, the normalized
                # sum's 1 / (1 + x) by three Newton-Raphson steps
                w[13] = T.Cast("int64", T.call_llvm_pure_intrin("int32", "llvm.ctlz.i32", S[2 * r + 1], T.bool(False)))
                w[14] = _wrap32(T.shift_left(T.bitwise_and(T.Cast("int64", S[2 * r + 1]), _i64(0xFFFFFFFF)), w[13])
                                - _i64(1 << 31))
                w[15] = w[14] + _i64(_I32_MAX)
                w[15] = T.if_then_else(w[15] >= _i64(0), T.shift_right(w[15] + _i64(1), _i64(1)),
                                       _i64(0) - T.shift_right(_i64(1) - w[15], _i64(1)))
                _srdhm(w, 16, w[15], _i64(-1010580540))
                w[16] = _wrap32(_i64(1515870810) + w[16])
                for _it in range(3):
                    _srdhm(w, 17, w[15], w[16])
                    w[17] = _wrap32(_i64(1 << 29) - w[17])
                    _srdhm(w, 18, w[16], w[17])
                    _shl_sat(w, 18, w[18], 2)
                    w[16] = _wrap32(w[16] + w[18])
                _shl_sat(w, 16, w[16], 1)
                for j in range(cols):
                    _softmax_tflite_exp(w, X[r * cols + j], S[2 * r], Q)
                    _srdhm(w, 19, w[16], w[3])
                    _rdpot(w, 19, w[19], _i64(12) - w[13] + _i64(31 - 8))
                    w[19] = w[19] + T.Cast("int64", Q[3])
                    w[19] = T.max(T.min(w[19], T.Cast("int64", Q[4])), T.Cast("int64", Q[3]))
                    Y[r * cols + j] = T.Cast(dtype, T.if_then_else(w[11] != _i64(0), w[19], T.Cast("int64", Q[3])))
    return kernel


def _f(v) -> "tvm.tirx.FloatImm":
    """A float32 constant, rounded once from its decimal text (as the C++ literal ``v``f is)."""
    return T.float32(float(np.float32(v)))


_INF = T.float32(float("inf"))


def _vsqrt(v):
    """``sqrt(v)`` as LLVM's intrinsic (VSQRT.F32, correctly rounded; no libm call)."""
    return T.call_llvm_pure_intrin("float32", "llvm.sqrt.f32", v)


@T.macro
def _exp_unit(src, dst, n):
    """``dst[0:n] = exp(src[0:n])`` on the exp/log unit (the runtime's driver ``pe_exp``; the
    unit computes the simulator's exp model, see :mod:`.iss`). ``src`` may equal ``dst``."""
    T.evaluate(T.call_extern("int32", "pe_exp", src, dst, n))


@T.macro
def _row_max(X, S, acc, r, cols, flags, k):
    """``S[k]`` = the max of row ``r`` of ``X`` (``cols`` wide) carried on from ``S[k]`` (from
    -inf where ``flags`` bit 0 starts the row): the row's first NaN is its max, as the
    simulator's softmax statistics take it."""
    acc[0] = T.if_then_else(flags & 1 != 0, -_INF, S[k])
    for j in range(cols):
        if T.Not(T.isnan(acc[0])):
            if T.isnan(X[r * cols + j]) or X[r * cols + j] > acc[0]:
                acc[0] = X[r * cols + j]
    S[k] = acc[0]


@T.macro
def _row_sum(Y, S, acc, r, cols, flags, k):
    """``S[k]`` += the sum of row ``r`` of ``Y`` (``cols`` wide) in ascending order, from +0.0
    where ``flags`` bit 0 starts the row (the simulator's fixed reduction order)."""
    acc[0] = T.if_then_else(flags & 1 != 0, _ZERO, S[k])
    for j in range(cols):
        acc[0] = acc[0] + Y[r * cols + j]
    S[k] = acc[0]


def _softmax():
    @T.prim_func
    def kernel(x: T.handle("float32"), y: T.handle("float32"), st: T.handle("float32"),
               rows: T.int32, cols: T.int32, phase: T.int32, flags: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((rows * cols,), "float32", data=x)
        Y = T.decl_buffer((rows * cols,), "float32", data=y)
        S = T.decl_buffer((2 * rows,), "float32", data=st)
        acc = T.decl_buffer((1,), "float32", scope="local")
        for r in range(rows):
            if phase == 0:
                _row_max(X, S, acc, r, cols, flags, 2 * r)
            elif phase == 1:
                for j in range(cols):
                    Y[r * cols + j] = X[r * cols + j] - S[2 * r]
            else:
                for j in range(cols):
                    Y[r * cols + j] = Y[r * cols + j] / S[2 * r + 1]
        if phase == 1:  # the exps of the whole chunk in one stream, then each row's sum
            _exp_unit(T.address_of(Y[0]), T.address_of(Y[0]), rows * cols)
            for r in range(rows):
                _row_sum(Y, S, acc, r, cols, flags, 2 * r + 1)
    return kernel


def _xent_grad():
    """``cross_entropy_backward``: the softmax kernel's phases plus one (see the module docstring)."""

    @T.prim_func
    def kernel(x: T.handle("float32"), y: T.handle("float32"), st: T.handle("float32"), lab: T.handle("int32"),
               rows: T.int32, cols: T.int32, phase: T.int32, flags: T.int32, c0: T.int32, div: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((rows * cols,), "float32", data=x)
        Y = T.decl_buffer((rows * cols,), "float32", data=y)
        S = T.decl_buffer((2 * rows,), "float32", data=st)
        L = T.decl_buffer((rows,), "int32", data=lab)
        acc = T.decl_buffer((1,), "float32", scope="local")
        for r in range(rows):
            if phase == 0:
                _row_max(X, S, acc, r, cols, flags, 2 * r)
            elif phase == 2:
                # (p - onehot) / n with p = e / sum: the label's column subtracts 1.0, the others +0.0
                for j in range(cols):
                    Y[r * cols + j] = (Y[r * cols + j] / S[2 * r + 1]
                                       - T.if_then_else(c0 + j == L[r], _f(1.0), _ZERO)) / T.reinterpret("float32", div)
            else:
                for j in range(cols):
                    Y[r * cols + j] = X[r * cols + j] - S[2 * r]
        if phase == 1 or phase == 3:  # the chunk's exps in one stream; phase 1 also sums them
            _exp_unit(T.address_of(Y[0]), T.address_of(Y[0]), rows * cols)
            if phase == 1:
                for r in range(rows):
                    _row_sum(Y, S, acc, r, cols, flags, 2 * r + 1)
    return kernel


@T.macro
def _block_add(S, r, acc, v, c0, j, d):
    """One term ``v`` of a blocked row sum carried as ``(sum, block partial)`` in ``acc``; a
    block ends every LAYER_NORM_BLOCK columns of the row and at its end ``d``."""
    acc[1] = acc[1] + v
    if T.truncmod(c0 + j + 1, _BLOCK) == 0 or c0 + j + 1 == d:
        acc[0] = acc[0] + acc[1]
        acc[1] = _ZERO


def _layer_norm():
    @T.prim_func
    def kernel(x: T.handle("float32"), y: T.handle("float32"), st: T.handle("float32"),
               gamma: T.handle("float32"), beta: T.handle("float32"), rows: T.int32, cols: T.int32,
               phase: T.int32, flags: T.int32, c0: T.int32, d: T.int32, eps: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((rows * cols,), "float32", data=x)
        Y = T.decl_buffer((rows * cols,), "float32", data=y)
        S = T.decl_buffer((4 * rows,), "float32", data=st)
        G = T.decl_buffer((cols,), "float32", data=gamma)
        B = T.decl_buffer((cols,), "float32", data=beta)
        acc = T.decl_buffer((2,), "float32", scope="local")
        v = T.decl_buffer((1,), "float32", scope="local")
        for r in range(rows):
            if phase < 2:
                acc[0] = T.if_then_else(flags & 1 != 0, _ZERO, S[4 * r])
                acc[1] = T.if_then_else(flags & 1 != 0, _ZERO, S[4 * r + 1])
                for j in range(cols):
                    if phase == 0:
                        _block_add(S, r, acc, X[r * cols + j], c0, j, d)
                    else:
                        Y[r * cols + j] = X[r * cols + j] - S[4 * r + 2]
                        v[0] = Y[r * cols + j] * Y[r * cols + j]
                        _block_add(S, r, acc, v[0], c0, j, d)
                S[4 * r] = acc[0]
                S[4 * r + 1] = acc[1]
                if flags & 2 != 0:
                    if phase == 0:
                        S[4 * r + 2] = acc[0] / T.Cast("float32", d)
                    else:
                        v[0] = acc[0] / T.Cast("float32", d) + T.reinterpret("float32", eps)
                        S[4 * r + 3] = _vsqrt(v[0])
            else:
                for j in range(cols):
                    v[0] = Y[r * cols + j] / S[4 * r + 3]
                    if flags & 4 != 0:
                        v[0] = v[0] * G[j]
                    if flags & 8 != 0:
                        v[0] = v[0] + B[j]
                    Y[r * cols + j] = v[0]
    return kernel


def _rms_norm():
    @T.prim_func
    def kernel(x: T.handle("float32"), y: T.handle("float32"), st: T.handle("float32"),
               w: T.handle("float32"), rows: T.int32, cols: T.int32, phase: T.int32, flags: T.int32,
               c0: T.int32, d: T.int32, eps: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((rows * cols,), "float32", data=x)
        Y = T.decl_buffer((rows * cols,), "float32", data=y)
        S = T.decl_buffer((4 * rows,), "float32", data=st)
        W = T.decl_buffer((cols,), "float32", data=w)
        acc = T.decl_buffer((2,), "float32", scope="local")
        v = T.decl_buffer((1,), "float32", scope="local")
        for r in range(rows):
            if phase == 0:
                acc[0] = T.if_then_else(flags & 1 != 0, _ZERO, S[4 * r])
                acc[1] = T.if_then_else(flags & 1 != 0, _ZERO, S[4 * r + 1])
                for j in range(cols):
                    v[0] = X[r * cols + j] * X[r * cols + j]
                    _block_add(S, r, acc, v[0], c0, j, d)
                S[4 * r] = acc[0]
                S[4 * r + 1] = acc[1]
                if flags & 2 != 0:
                    v[0] = acc[0] / T.Cast("float32", d) + T.reinterpret("float32", eps)
                    v[0] = _vsqrt(v[0])
                    S[4 * r + 2] = _f(1.0) / v[0]
            else:
                for j in range(cols):
                    v[0] = X[r * cols + j] * S[4 * r + 2]
                    if flags & 4 != 0:
                        v[0] = W[j] * v[0]
                    Y[r * cols + j] = v[0]
    return kernel


def _fabs(v):
    """``|v|`` (VABS: clears the sign bit)."""
    return T.call_llvm_pure_intrin("float32", "llvm.fabs.f32", v)


def _neg(v):
    """``-v`` as C++'s unary minus (the sign bit flipped; TIR's ``-v`` is ``v * -1.0``, which
    keeps a NaN's sign)."""
    return T.reinterpret("float32", T.bitwise_xor(T.reinterpret("int32", v), T.int32(-2147483648)))


# The activations on exp run in two passes around one stream through the exp/log unit: the
# first (``*_arg``) writes each element's exp argument to ``t[8]``, the second (``*_finish``)
# recomputes what it needs from ``x`` (the same operations, so the same bits) and finishes
# from ``e``, the argument's exp, into ``t[8]``. Elements whose result does not use the exp
# (tanh's small or huge arguments) still stream an argument through the unit.


@T.macro
def _tanh_arg(t, x):
    """``2 |x|``, the exp argument of tanh's large branch (the C++ ``TanhModel``)."""
    t[6] = _fabs(x)
    t[8] = t[6] + t[6]


@T.macro
def _tanh_finish(t, x, e):
    """``t[8] = tanh(x)`` from ``e = exp(2 |x|)`` (the C++ ``TanhModel``); uses ``t[6..9]``."""
    t[9] = x
    t[6] = _fabs(t[9])
    if t[6] > _f(0.625):
        if t[6] > _f(44.0):
            t[8] = T.if_then_else(t[9] > _ZERO, _f(1.0), _f(-1.0))
        else:
            t[7] = _f(1.0) - _f(2.0) / (e + _f(1.0))
            t[8] = T.if_then_else(t[9] < _ZERO, _neg(t[7]), t[7])
    elif t[9] == _ZERO:
        t[8] = t[9]  # keeps the sign of zero
    else:
        t[6] = t[9] * t[9]
        t[7] = _f("-5.70498872745e-3")
        t[7] = t[7] * t[6] + _f("2.06390887954e-2")
        t[7] = t[7] * t[6] - _f("5.37397155531e-2")
        t[7] = t[7] * t[6] + _f("1.33314422036e-1")
        t[7] = t[7] * t[6] - _f("3.33332819422e-1")
        t[7] = t[7] * t[6]
        t[7] = t[7] * t[9]
        t[8] = t[7] + t[9]


@T.macro
def _gelu_arg(t, x):
    """``-a * a`` with ``a = |x / sqrt 2|``: the exp argument of erf (the C++ ``GeluModel``)."""
    t[10] = x * _f("0.70710678118654752")
    t[12] = _fabs(t[10])
    t[8] = _neg(t[12]) * t[12]


@T.macro
def _gelu_finish(t, x, e):
    """``t[8] = gelu(x)`` with erf by Abramowitz-Stegun 7.1.26 (the C++ ``GeluModel``), from
    ``e = exp(-a * a)``."""
    t[9] = x
    t[10] = t[9] * _f("0.70710678118654752")
    if t[10] > _ZERO:
        t[11] = _f(1.0)
    elif t[10] < _ZERO:
        t[11] = _f(-1.0)
    elif T.isnan(t[10]):
        t[11] = t[10]
    else:
        t[11] = _ZERO
    t[12] = _fabs(t[10])
    t[13] = _f("0.3275911") * t[12]
    t[13] = _f(1.0) / (_f(1.0) + t[13])
    t[14] = t[13] * _f("1.061405429")
    t[14] = _f("-1.453152027") + t[14]
    t[14] = t[13] * t[14]
    t[14] = _f("1.421413741") + t[14]
    t[14] = t[13] * t[14]
    t[14] = _f("-0.284496736") + t[14]
    t[14] = t[13] * t[14]
    t[14] = _f("0.254829592") + t[14]
    t[14] = t[13] * t[14]
    t[14] = t[14] * e
    t[14] = t[11] * (_f(1.0) - t[14])
    t[15] = _f(0.5) * t[9]
    t[8] = t[15] * (_f(1.0) + t[14])


@T.macro
def _gelu_tanh_inner(t, x):
    """``t[11] = 0.7978845608028654 (x + 0.044715 x^3)`` (the C++ ``GeluTanhModel``)."""
    t[10] = x
    t[11] = _f("0.044715") * t[10]
    t[11] = t[11] * t[10]
    t[11] = t[11] * t[10]
    t[11] = _f("0.7978845608028654") * (t[10] + t[11])


@T.macro
def _gelu_tanh_arg(t, x):
    _gelu_tanh_inner(t, x)
    _tanh_arg(t, t[11])


@T.macro
def _gelu_tanh_finish(t, x, e):
    """``t[8] = 0.5 x (1 + tanh(inner))`` from ``e = exp(2 |inner|)``."""
    _gelu_tanh_inner(t, x)
    t[12] = _f(0.5) * t[10]
    _tanh_finish(t, t[11], e)
    t[8] = t[12] * (_f(1.0) + t[8])


@T.macro
def _sigmoid_arg(t, x):
    t[8] = _neg(x)


@T.macro
def _sigmoid_finish(t, x, e):
    """``t[8] = 1 / (1 + exp(-x))`` (the C++ ``SigmoidModel``)."""
    t[8] = _f(1.0) / (_f(1.0) + e)


@T.macro
def _negative_into(t, x):
    t[8] = _neg(x)


@T.macro
def _sqrt_into(t, x):
    t[8] = _vsqrt(x)


@T.macro
def _rsqrt_into(t, x):
    """``1 / sqrt(x)``: VSQRT then VDIV (two roundings, the simulator's and TVM's llvm build's)."""
    t[9] = _vsqrt(x)
    t[8] = _f(1.0) / t[9]


@T.macro
def _square_into(t, x):
    t[8] = x * x


@T.macro
def _cube_into(t, x):
    t[9] = x
    t[10] = t[9] * t[9]
    t[8] = t[10] * t[9]


#: the functions of kernel ``("unary", act)`` that need no exp: act -> macro writing ``t[8]``
_PLAIN_ACTIVATIONS = {"negative": _negative_into, "sqrt": _sqrt_into, "rsqrt": _rsqrt_into, "square": _square_into,
                      "cube": _cube_into}
#: those on the exp/log unit: act -> (argument macro, finishing macro)
_EXP_ACTIVATIONS = {"gelu": (_gelu_arg, _gelu_finish), "gelu_tanh": (_gelu_tanh_arg, _gelu_tanh_finish),
                    "sigmoid": (_sigmoid_arg, _sigmoid_finish), "tanh": (_tanh_arg, _tanh_finish)}
#: every activation of kernel ``("unary", act)``
ACTIVATIONS = (*sorted(_EXP_ACTIVATIONS), *sorted(_PLAIN_ACTIVATIONS))


def _unary(act: str):
    if act in _PLAIN_ACTIVATIONS:
        into = _PLAIN_ACTIVATIONS[act]

        @T.prim_func
        def kernel(x: T.handle("float32"), y: T.handle("float32"), n: T.int32):
            T.func_attr({"tir.noalias": True, "calling_conv": 0})
            X = T.decl_buffer((n,), "float32", data=x)
            Y = T.decl_buffer((n,), "float32", data=y)
            t = T.decl_buffer((16,), "float32", scope="local")
            for i in range(n):
                into(t, X[i])
                Y[i] = t[8]
        return kernel
    arg, finish = _EXP_ACTIVATIONS[act]

    @T.prim_func
    def kernel_exp(x: T.handle("float32"), y: T.handle("float32"), n: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((n,), "float32", data=x)
        Y = T.decl_buffer((n,), "float32", data=y)
        t = T.decl_buffer((16,), "float32", scope="local")
        for i in range(n):  # the exp arguments, into y
            arg(t, X[i])
            Y[i] = t[8]
        _exp_unit(T.address_of(Y[0]), T.address_of(Y[0]), n)
        for i in range(n):
            finish(t, X[i], Y[i])
            Y[i] = t[8]
    return kernel_exp


def _take():
    @T.prim_func
    def kernel(idx: T.handle("int32"), rows: T.handle("int32"), err: T.handle("int32"), n: T.int32,
               extent: T.int32, mode: T.int32, seg: T.handle("int32"), nseg: T.int32, row_bytes: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        I = T.decl_buffer((n,), "int32", data=idx)
        R = T.decl_buffer((n,), "int32", data=rows)
        E = T.decl_buffer((2,), "int32", data=err)
        S = T.decl_buffer((nseg * (DMA_DESC_WORDS + 1),), "int32", data=seg)
        v = T.decl_buffer((1,), "int32", scope="local")
        E[0] = 0
        for i in range(n):
            v[0] = I[i]
            if mode == 1:  # clip
                v[0] = T.if_then_else(v[0] < 0, 0, T.if_then_else(v[0] >= extent, extent - 1, v[0]))
            elif mode == 2:  # wrap: the non-negative remainder
                v[0] = T.truncmod(v[0], extent)
                v[0] = T.if_then_else(v[0] < 0, v[0] + extent, v[0])
            elif v[0] < 0 or v[0] >= extent:  # fast: the first broken promise is reported
                if E[0] == 0:
                    E[0] = 1
                    E[1] = v[0]
                v[0] = 0
            R[i] = v[0]
        # each segment (a run of one table row's elements): its row's offset added to its
        # descriptor's source, then the DMA engine copies it
        for s in range(nseg):
            S[s * (DMA_DESC_WORDS + 1) + 1] = S[s * (DMA_DESC_WORDS + 1) + 1] + R[S[s * (DMA_DESC_WORDS + 1)]] * row_bytes
            T.evaluate(T.call_extern("int32", "pe_dma", T.address_of(S[s * (DMA_DESC_WORDS + 1) + 1])))
    return kernel


_BUILDERS = {"take": _take, "unary": _unary, "softmax": _softmax, "layer_norm": _layer_norm, "rms_norm": _rms_norm, "mean": _mean, "mean_tflite": _mean_tflite, "softmax_tflite": _softmax_tflite, "pool": _pool, "quantize": _quantize, "dequantize": _dequantize, "dma": _dma, "binary": _binary, "relu": _relu_kernel, "clip": _clip_kernel, "where_less": _where_less, "rope": _rope, "gemm_f32": _gemm_f32, "gemm_i8": _gemm_i8}
_BUILDERS.update(pool_grad=_pool_grad, xent_grad=_xent_grad)



@T.macro
def _log_unit(src, dst, n):
    """``dst[0:n] = log(src[0:n])`` on the exp/log unit (the runtime's driver ``pe_log``; the
    unit computes the simulator's log model, see :mod:`.iss`). ``src`` may equal ``dst``."""
    T.evaluate(T.call_extern("int32", "pe_log", src, dst, n))


def _cross_entropy():
    """The per-row cross-entropy (see the module docstring): phases 0 and 1 are the softmax
    kernel's (the same TIR, so the same max and sum of exps), phase 2 picks the label's
    ``z[t] - max`` and, on the row's last chunk, finishes ``log(sum) - (z[t] - max)``."""
    @T.prim_func
    def kernel(x: T.handle("float32"), y: T.handle("float32"), st: T.handle("float32"), lab: T.handle("int32"),
               out: T.handle("float32"), rows: T.int32, cols: T.int32, phase: T.int32, flags: T.int32,
               c0: T.int32, ignore: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((rows * cols,), "float32", data=x)
        Y = T.decl_buffer((rows * cols,), "float32", data=y)
        S = T.decl_buffer((4 * rows,), "float32", data=st)
        L = T.decl_buffer((rows,), "int32", data=lab)
        O = T.decl_buffer((rows,), "float32", data=out)
        acc = T.decl_buffer((1,), "float32", scope="local")
        for r in range(rows):
            if phase == 0:
                _row_max(X, S, acc, r, cols, flags, 4 * r)
            elif phase == 1:
                for j in range(cols):
                    Y[r * cols + j] = X[r * cols + j] - S[4 * r]
            elif L[r] != ignore and L[r] >= c0 and L[r] < c0 + cols:  # the label's logit in this chunk
                S[4 * r + 2] = X[r * cols + L[r] - c0] - S[4 * r]
        if phase == 1:  # the exps of the whole chunk in one stream, then each row's sum
            _exp_unit(T.address_of(Y[0]), T.address_of(Y[0]), rows * cols)
            for r in range(rows):
                _row_sum(Y, S, acc, r, cols, flags, 4 * r + 1)
        if phase == 2 and flags & 2 != 0:  # the rows' sums in one stream through the log
            for r in range(rows):
                Y[r] = S[4 * r + 1]
            _log_unit(T.address_of(Y[0]), T.address_of(Y[0]), rows)
            for r in range(rows):
                O[r] = T.if_then_else(L[r] == ignore, _ZERO, Y[r] - S[4 * r + 2])
    return kernel


_BUILDERS["cross_entropy"] = _cross_entropy


def kernel_func(spec: tuple) -> "tvm.tirx.PrimFunc":
    """The TIR PrimFunc ``pe_kernel`` of kernel ``spec`` (see the module docstring)."""
    kind, *params = spec
    func = _BUILDERS[kind](*params)
    return func.with_attr("global_symbol", "pe_kernel")


#: kernels whose ``T.unroll`` loops TIR unrolls itself and then simplifies (LLVM ignores the hint):
#: the fp32 GEMM's register block, whose unrolled indices must fold to constants for its
#: accumulators and operands to stay in FPU registers (the simplifier assumes no NaN: the
#: kernel's float compares are written in forms it leaves alone)
_UNROLLED = frozenset({"gemm_f32"})


@functools.lru_cache(maxsize=64)
def kernel_object(spec: tuple) -> bytes:
    """Kernel ``spec`` compiled by TVM's LLVM to a Cortex-M4F ELF object (bytes)."""
    target = tvm.target.Target(PE_TARGET)
    mod = tvm.IRModule({"pe_kernel": kernel_func(spec).with_attr("target", target)})
    if spec[0] in _UNROLLED:
        with tvm.transform.PassContext(opt_level=3, config={"tirx.UnrollLoop": {"explicit_unroll": True}}):
            mod = tvm.transform.Sequential([tvm.tirx.transform.UnrollLoop(), tvm.tirx.transform.StmtSimplify()])(mod)
    with tvm.transform.PassContext(opt_level=3):
        lib = codegen_build(mod, target)
    with tempfile.TemporaryDirectory(prefix="tvm_spinn_pe_") as tmp:
        path = os.path.join(tmp, "pe_kernel.o")
        lib.write_to_file(path)
        with open(path, "rb") as f:
            return f.read()
