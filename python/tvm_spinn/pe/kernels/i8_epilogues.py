"""The int8 GEMM kernel's last-chunk epilogues other than its own requantization, one
block of columns at a time: the dequantizing float32 epilogue and TFLite's
requantization (kernel ``("gemm_i8", ...)``, :mod:`.gemm`)."""

from __future__ import annotations

from tvm.script import tirx as T

from .common import _ZERO

#: ``gemm_i8`` job flag: the dequantizing epilogue adds the bias
I8_BIAS_FLAG = 1 << 20


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
