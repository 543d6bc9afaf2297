"""The GEMM PE kernels: fp32 on the Cortex-M4F in register blocks, int8 on the MAC array
(its float32 and TFLite epilogues in :mod:`.i8_epilogues`).

Kernels (the ``spec`` of :func:`~tvm_spinn.pe.kernels.kernel_object`):

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
  transposed by the host, see :mod:`tvm_spinn.pe.execute`), software-pipelined: the MAC array (drivers
  ``pe_mac_start``, ``pe_mac_wait`` and ``pe_mac_wait_next``, which starts the next block as
  soon as the array is done with the last) computes the chunk's ``acc_bits`` sums one block of
  ``flags >> 8`` columns at a time while the M4F finishes the block before; the sums go into
  the int32 accumulator ``acc`` on the first chunk (``flags`` bit 0), else into one of two
  alternating scratch blocks in ``p`` (``2 x m x cb`` int32), added in 32-bit to ``acc`` (the runtime's
  ``pe_i32_add_rows``: LDM/STM of four words), with the
  row sums of ``a`` (``flags`` bit 2) and the column sums of ``b`` (bit 3) where the zero-point
  terms need them at run time; on the last chunk the zero-point terms and the requantization
  (:func:`tvm_spinn.program.quant.requantize`; a ReLU is its clamp at the zero point) write
  int8 ``y`` column by column (:func:`~.i8_epilogues._i8_half_up_columns`): each output one ADD
  (and one MLS where the column has a weight zero point), QADD of the bias, one SMMLA onto the
  column's rounding and zero-point term, an ASR and USAT #8 (and one compare for a clamp
  narrower than the output type), for multipliers from 2**-22 to 1/4; other columns one SMLAL
  onto a 64-bit bias-and-rounding term (an int32 output is ``acc`` itself, bit 1 clear). Args
  ``a, b, p, acc, rowsum, colsum, consts, y, m, n, k, flags``; ``consts`` points at ``[zx, K, y_zero, y_min, y_max]``
  then per column ``zw, bias_q, multiplier, shift`` (int32 each), then the addresses of the two
  halves of A and of B and the next chunk's length, then the host's per-column table of the
  requantizations' DSP constants (:func:`~.i8_epilogues.i8_dsp_table`, ``I8_DSP_WORDS`` words a
  column: the column's set-up computed once by the host). ``flags``: bit 4, the chunk's first block
  is already running (the job before started it); bit 5, start the next chunk's first block
  after this chunk's last; bit 6, the scratch half of this chunk's first block; bit 7, this
  chunk's operand half; bits 8-19, the block's columns (:func:`tvm_spinn.pe.execute.gemm_i8_tile`
  is the reference host).
- ``("gemm_i8", "gemv")``: the one-rounding kernel of a layer whose tiles have one row (a
  matrix-vector product, :func:`tvm_spinn.program.ops.gemm.geometry.int8_gemv`): on a one-row
  tile each column runs one straight-line form of the DSP path (the row sum's MLS and the
  clamp's top whatever the column's zero point and the output's range: exact for all of them)
  with no row loop to select, enter or leave; a tile of more rows runs as ``("gemm_i8",)``.
- ``("gemm_i8", "tflite_gemv")``: the same for TFLite's requantization: a one-row tile's column
  runs one straight-line form of its DSP path; a tile of more rows runs as ``("gemm_i8", "tflite")``.
- ``("gemm_i8", "tflite")``: the same kernel with TFLite's requantization
  (:func:`tvm_spinn.program.quant.requantize_tflite`, ``rounding="tflite"``,
  :func:`~.i8_epilogues._i8_tflite_columns`): per output one ADD (the bias folded into the
  column's 32-bit term; an MLS too where the column has a weight zero point), SMMLAR
  (SaturatingRoundingDoublingHighMul), an ADD of its sign, QADD of the rounding and zero-point
  term, ASR (RoundingDivideByPOT) and USAT #8, for multipliers from 2**-21 to 1/2; other columns
  the left shift of multipliers of 1 and more, one SMULL and the 64-bit ``(x M0 + 2**30) >>
  31``, then RoundingDivideByPOT in 32 bits and the clamp.
- ``("gemm_i8", "f32", relu)``: the same kernel with the dequantizing epilogue of a float32
  output ``y`` (:func:`tvm_spinn.program.ops.gemm.reference.int8_finish`): ``fl(v) * scale[j]``
  (VCVT.F32.S32, VMUL), ``bias[j] + that`` (VADD, the bias its first operand) when ``flags``
  bit 20 is set, then ``y <= 0 ? +0 : y`` when ``relu``; the column constants are ``zw``, the
  bias's and the scale's float32 bits and an unused word.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ...program.ops.gemm.geometry import M4F_BLOCK
from .common import _ZERO
from .i8_epilogues import I8_DSP_WORDS, _i8_f32_columns, _i8_half_up_columns, _i8_tflite_columns

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


def _gemm_i8(epilogue: str = "half_up", relu: bool = False):
    """The int8 GEMM kernel with the last chunk's ``epilogue``: ``"half_up"`` (the one-rounding
    requantization), ``"gemv"`` (the same with a one-row tile's straight-line column loop),
    ``"tflite"`` (:func:`_i8_tflite_columns`), ``"tflite_gemv"`` (TFLite's with the one-row loop)
    or ``"f32"`` (:func:`_i8_f32_columns`, then the ReLU when ``relu``); the chunk's sums and
    zero-point terms are the same TIR for all."""
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
        Q = T.decl_buffer((10 + (4 + I8_DSP_WORDS) * n,), "int32", data=consts)
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
            if jb + 1 < nb:
                # the next block's start follows the wait in one driver call (its arguments formed
                # while the array runs): the array idles only for the writes of the four registers
                # that change from block to block (A, M, K and LDB keep the chunk's values)
                if first:
                    T.evaluate(T.call_extern("int32", "pe_mac_wait_next", T.address_of(B[j0 + cb]),
                                             T.address_of(ACC[j0 + cb]), T.min(cb, n - j0 - cb), n))
                else:
                    T.evaluate(T.call_extern("int32", "pe_mac_wait_next", T.address_of(B[j0 + cb]),
                                             T.address_of(P[T.bitwise_and(par + jb + 1, 1) * m * cb]),
                                             T.min(cb, n - j0 - cb), T.min(cb, n - j0 - cb)))
            else:
                T.evaluate(T.call_extern("int32", "pe_mac_wait"))
                if flags & 32 != 0:
                    # the next chunk's first block, from the other operand half (bit 7: this one's)
                    nxt = 5 + 4 * n + 1 - T.bitwise_and(T.shift_right(flags, 7), 1)
                    T.evaluate(T.call_extern("int32", "pe_mac_start", Q[nxt], Q[nxt + 2],
                                             T.address_of(P[T.bitwise_and(par + nb, 1) * m * cb]), m,
                                             T.min(cb, n), Q[5 + 4 * n + 4], n, T.min(cb, n)))
            if not first:
                # the runtime's LDM/STM loop (``pe_i32_add_rows``): four outputs a step in registers
                # (m >= 1 rows, 1 <= w <= n columns: its preconditions)
                T.evaluate(T.call_extern("int32", "pe_i32_add_rows", T.address_of(ACC[j0]),
                                         T.address_of(P[T.bitwise_and(par + jb, 1) * m * cb]), m, w, n))
            if epilogue == "f32":
                if flags & 2 != 0:
                    _i8_f32_columns(ACC, RS, CS, Q, Y, zx, j0, w, m, n, flags, relu)
            elif epilogue in ("tflite", "tflite_gemv"):
                if flags & 2 != 0:
                    _i8_tflite_columns(ACC, RS, CS, Q, Y, zx, lo, hi, j0, w, m, n, epilogue == "tflite_gemv")
            elif flags & 2 != 0:
                _i8_half_up_columns(ACC, RS, CS, Q, Y, zx, lo, hi, j0, w, m, n, epilogue == "gemv")
    return kernel
