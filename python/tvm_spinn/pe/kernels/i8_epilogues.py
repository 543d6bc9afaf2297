"""The int8 GEMM kernel's last-chunk epilogues, one block of columns at a time: the
dequantizing float32 epilogue, the one-rounding requantization and TFLite's (kernel
``("gemm_i8", ...)``, :mod:`.gemm`). The requantizations run on the Cortex-M4's DSP
instructions (QADD, SMMLA, SMMLAR, USAT) wherever a column's constants allow their exact
reading of the rule, else on the exact 64-bit path."""

from __future__ import annotations

import numpy as np
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


# -- the requantizing epilogues' DSP paths ------------------------------------------------------
#: the DSP paths' largest final division (bits shifted out after the high word): up to it, every
#: sum the saturating add (QADD) moves saturates the output either way
#: (:func:`_i8_half_up_columns`, :func:`_i8_tflite_columns`)
I8_DSP_MAX_SHIFT = 20
#: the one-rounding fast path's largest quantized bias: below it ``(v + bias_q) M0 +
#: 2**(shift - 1)`` never reaches 2**63, where the simulator's int64 arithmetic wraps (its
#: documented rule, which the exact path's SMLAL keeps)
I8_DSP_MAX_BIAS = (1 << 31) - (1 << 21)
#: words per column of the DSP paths' table (:func:`i8_dsp_table`): the one-rounding
#: requantization's ``c0, M0, ra, s``, then TFLite's ``c0 + bias_q, M2, K, right``
I8_DSP_WORDS = 8


def _wrap32(x):
    return ((np.asarray(x, dtype=np.int64) + (1 << 31)) % (1 << 32) - (1 << 31)).astype(np.int64)


def i8_dsp_table(consts) -> np.ndarray:
    """The requantizations' per-column DSP constants the host derives from the kernel's
    ``consts`` (``[zx, K, y_zero, y_min, y_max]`` then ``zw, bias_q, multiplier, shift`` per
    column), :data:`I8_DSP_WORDS` int32 words per column, which the kernel reads after the
    consts' five trailing words: the column's set-up computed once by the host, not per tile
    on the PE. One-rounding (:func:`_i8_half_up_columns`): ``c0 = K zx zw`` (32-bit wrapping),
    ``M0``, ``ra = 2**(s - 1) + (y_zero - y_min) 2**s`` and ``s = shift - 32`` where the column
    takes the DSP path, else ``s = 0`` (the exact path). TFLite's (:func:`_i8_tflite_columns`):
    ``c0 + bias_q``, ``M2 = 2 M0`` (as int32), ``K = 2**(right - 1) + (y_zero - y_min)
    2**right`` and ``right = shift - 31`` where the column takes the DSP path, else ``right =
    0``. Returns int64 values in the int32 range, ``[columns * I8_DSP_WORDS]``.

    Raises ValueError where ``consts`` is not ``5 + 4 * columns`` words long."""
    q = np.asarray(consts, dtype=np.int64).reshape(-1)
    if q.size < 5 or (q.size - 5) % 4:
        below = 5 + 4 * max((q.size - 5) // 4, 0)  # the nearest valid lengths around it
        near = f"{below}" if q.size < 5 else f"{below} or {below + 4}"
        raise ValueError(f"i8_dsp_table: consts must hold 5 + 4 * columns words (expected {near}), "
                         f"got {q.size}")
    zx, k, y_zero, y_min = q[0], q[1], q[2], q[3]
    zw, bq, mult, sh = q[5:].reshape(-1, 4).T
    c0 = _wrap32(_wrap32(k * zx) * zw)
    dsp = (sh > 32) & (sh <= 32 + I8_DSP_MAX_SHIFT) & (mult >= 1 << 30) & (bq <= I8_DSP_MAX_BIAS)
    s = np.where(dsp, sh - 32, 0)
    ra = np.where(dsp, _wrap32((1 << np.maximum(s - 1, 0)) + ((y_zero - y_min) << s)), 0)
    right = np.where((sh > 31) & (sh <= 31 + I8_DSP_MAX_SHIFT) & (mult >= 1 << 30), sh - 31, 0)
    kt = np.where(right > 0, _wrap32((1 << np.maximum(right - 1, 0)) + ((y_zero - y_min) << right)), 0)
    table = np.stack([c0, _wrap32(mult), ra, s, _wrap32(c0 + bq), _wrap32(2 * mult), kt, right], axis=1)
    return table.reshape(-1)


def _smmla(a, b, ra):
    """``ra + floor(a * b / 2**32)``: SMMLA (the product's high word plus ``ra``, the 64-bit sum
    ``ra * 2**32 + a * b`` exact: ``|ra|`` below ``2**30`` keeps it in 32 bits)."""
    return T.Cast("int32", T.shift_right(T.Cast("int64", a) * T.Cast("int64", b), T.int64(32))) + ra


def _smmulr(a, b):
    """``floor((a * b + 2**31) / 2**32)``: SMMULR (the rounded high word of the product; LLVM's
    ``llvm.arm`` has no intrinsic for it, its instruction selection matches this form)."""
    return T.Cast("int32", T.shift_right(T.Cast("int64", a) * T.Cast("int64", b) + T.int64(1 << 31), T.int64(32)))


def _qadd(a, b):
    """``a + b`` saturated to int32: QADD."""
    return T.call_llvm_pure_intrin("int32", "llvm.arm.qadd", a, b)


def _usat8(x):
    """``x`` clamped at ``[0, 255]``: USAT #8."""
    return T.call_llvm_pure_intrin("int32", "llvm.arm.usat", x, T.int32(8))


@T.macro
def _i8_store_clamped(Y, at, x, full, ylo, span):
    """``Y[at] = clamp(x + y_min, y_min, y_max)`` for ``x`` the output less ``y_min``: USAT #8
    (``[0, 255]``), then, unless the range is ``full`` (the 256 values of an int8 or uint8
    output), the upper bound ``span = y_max - y_min`` (CMP and a conditional MOV); ``y_min`` added
    back."""
    if full:
        Y[at] = T.Cast("int8", _usat8(x) + ylo)
    else:
        Y[at] = T.Cast("int8", T.min(_usat8(x), span) + ylo)


def _i8_v(ACC, RS, i, n, j, zw, c, zw0: bool):
    """The output's sum with its zero-point terms in 32 bits (wrapping, as the simulator's int32
    cast): ``acc - zw * rowsum[i] + c`` (MLS and ADD), ``acc + c`` where the column's ``zw`` is 0
    (``zw0``: the row sums neither loaded nor multiplied)."""
    if zw0:
        return T.Cast("int32", T.Cast("uint32", ACC[i * n + j]) + T.Cast("uint32", c))
    return T.Cast("int32", T.Cast("uint32", ACC[i * n + j]) - T.Cast("uint32", zw) * T.Cast("uint32", RS[i])
                  + T.Cast("uint32", c))


@T.macro
def _i8_half_up_rows(ACC, RS, Y, j, m, n, zw, c, bq, m0, ra, s, ylo, span, full: bool, zw0: bool):
    """One column of the one-rounding requantization's DSP path (:func:`_i8_half_up_columns`)."""
    for i in range(m):
        u = _qadd(_i8_v(ACC, RS, i, n, j, zw, c, zw0), bq)
        _i8_store_clamped(Y, i * n + j, T.shift_right(_smmla(u, m0, ra), s), full, ylo, span)


@T.macro
def _i8_tflite_rows(ACC, RS, Y, j, m, n, zw, c, m2, k, right, ylo, span, full: bool, zw0: bool):
    """One column of TFLite's requantization's DSP path (:func:`_i8_tflite_columns`)."""
    for i in range(m):
        x = _i8_v(ACC, RS, i, n, j, zw, c, zw0)
        h = _smmulr(x, m2) + x
        _i8_store_clamped(Y, i * n + j, T.shift_right(_qadd(h + T.shift_right(h, 31), k), right), full, ylo, span)


@T.macro
def _i8_half_up_exact(ACC, RS, Q, Y, j, m, n, zw, bq, c, lo, hi):
    """One column of the one-rounding requantization's exact 64-bit path (:func:`_i8_half_up_columns`)."""
    sh = Q[5 + 4 * j + 3]
    m0 = T.Cast("int64", Q[5 + 4 * j + 2])
    b0 = T.Cast("int64", bq) * m0
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
            Y[i * n + j] = T.Cast("int8", T.Cast("int32", T.min(T.max(r, T.Cast("int64", lo)),
                                                                T.Cast("int64", hi))) + Q[2])


@T.macro
def _i8_half_up_general(ACC, RS, CS, Q, Y, zx, lo, hi, j0, w, m, n):
    """The one-rounding requantization's columns on any number of rows (:func:`_i8_half_up_columns`):
    per column its constants, then one of four row loops (the clamp's two forms, with and without
    the row sums' term) or the exact path."""
    full = Q[4] - Q[3] == 255
    for jj in range(w):
        j = j0 + jj
        zw = Q[5 + 4 * j]
        d = 10 + 4 * n + I8_DSP_WORDS * j  # the column's entry of the host's table
        s = Q[d + 3]
        bq = Q[5 + 4 * j + 1]
        c = Q[d] - zx * CS[j]
        if s != 0:
            m0 = Q[d + 1]
            ra = Q[d + 2]
            # the four row loops: the clamp's two forms, with and without the row sums' term
            if full:
                if zw == 0:
                    _i8_half_up_rows(ACC, RS, Y, j, m, n, zw, c, bq, m0, ra, s, Q[3], 255, True, True)
                else:
                    _i8_half_up_rows(ACC, RS, Y, j, m, n, zw, c, bq, m0, ra, s, Q[3], 255, True, False)
            elif zw == 0:
                _i8_half_up_rows(ACC, RS, Y, j, m, n, zw, c, bq, m0, ra, s, Q[3], Q[4] - Q[3], False, True)
            else:
                _i8_half_up_rows(ACC, RS, Y, j, m, n, zw, c, bq, m0, ra, s, Q[3], Q[4] - Q[3], False, False)
        else:
            _i8_half_up_exact(ACC, RS, Q, Y, j, m, n, zw, bq, c, lo, hi)


@T.macro
def _i8_half_up_columns(ACC, RS, CS, Q, Y, zx, lo, hi, j0, w, m, n, gemv: bool):
    """The one-rounding requantization (:func:`tvm_spinn.program.quant.requantize`) per column.

    The DSP path, for shifts of 33 to ``32 + I8_DSP_MAX_SHIFT``, multipliers ``M0 >= 2**30``
    (every multiplier :func:`~tvm_spinn.program.quant.quantize_multiplier` gives from 2**-22 to
    1/4) and biases up to ``I8_DSP_MAX_BIAS``: ``u = QADD(v, bias_q)``, one SMMLA onto ``ra =
    2**(s - 1) + (z - y_min) 2**s`` (``s = shift - 32``: the rounding term and the zero point
    ``z`` less ``y_min``, both multiples of what the high word keeps), ASR by ``s``, the clamp
    (:func:`_i8_store_clamped`). ``floor((u M0 + 2**(shift-1)) / 2**shift) = floor((floor(u M0 /
    2**32) + 2**(s - 1)) / 2**s)`` (floor divisions compose). Where ``v + bias_q`` leaves int32
    the output saturates with or without QADD's saturation: at ``u = 2**31 - 1`` the quotient is
    at least ``2**(61 - shift) - 1 >= 511`` (``M0 >= 2**30``), beyond any int8 or uint8 bound
    less a zero point, and likewise below. Other columns run the exact 64-bit path: one SMLAL
    onto the column's 64-bit bias-and-rounding term, then for shifts of 32 and more the high
    word's shift and a 32-bit clamp, below 32 a 64-bit shift and clamp. The zero-point terms that
    do not depend on the row fold into ``c`` (32-bit wrapping, as the simulator's int32 cast)."""
    if gemv:
        if m == 1:
            # a GEMV (one output a column): the column's set-up is its cost, so every DSP column
            # runs the one general form, straight-line: the MLS of the row sum's term (zero where
            # the column's ``zw`` is) and the clamp's top (USAT's own where the range is full),
            # no row loop to select, enter or leave
            for jj in range(w):
                j = j0 + jj
                zw = Q[5 + 4 * j]
                d = 10 + 4 * n + I8_DSP_WORDS * j  # the column's entry of the host's table
                s = Q[d + 3]
                bq = Q[5 + 4 * j + 1]
                c = Q[d] - zx * CS[j]
                if s != 0:
                    u = _qadd(_i8_v(ACC, RS, 0, n, j, zw, c, False), bq)
                    _i8_store_clamped(Y, j, T.shift_right(_smmla(u, Q[d + 1], Q[d + 2]), s), False, Q[3],
                                      Q[4] - Q[3])
                else:
                    _i8_half_up_exact(ACC, RS, Q, Y, j, 1, n, zw, bq, c, lo, hi)
        else:
            _i8_half_up_general(ACC, RS, CS, Q, Y, zx, lo, hi, j0, w, m, n)
    else:
        _i8_half_up_general(ACC, RS, CS, Q, Y, zx, lo, hi, j0, w, m, n)


@T.macro
def _i8_tflite_columns(ACC, RS, CS, Q, Y, zx, lo, hi, j0, w, m, n, gemv: bool = False):
    """TFLite's requantization (:func:`tvm_spinn.program.quant.requantize_tflite`) per column:
    ``x = (v + bias_q) << left`` in 32 bits (the simulator's int32 of the int64 sum shifted: the
    low 32 bits depend only on the sum's), ``SaturatingRoundingDoublingHighMul(x, M0)``, then
    ``RoundingDivideByPOT`` by ``right`` and the clamp at ``[y_min, y_max]`` after the zero point.

    The DSP path, for ``right`` of 1 to ``I8_DSP_MAX_SHIFT`` and ``M0 >= 2**30`` (every TFLite
    multiplier from 2**-21 to 1/2): ``h = SMMLAR(x, M2, x)`` with ``M2 = 2 M0 - 2**32`` (int32; written as
    SMMULR plus ``x``, which LLVM fuses), i.e. ``floor((2 x M0 + 2**31) / 2**32) = floor((x M0 +
    2**30) / 2**31)``, which is
    SaturatingRoundingDoublingHighMul for both signs (its nudge and truncating division are that
    floor; ``M0 >= 0`` never saturates); then ``h + (h >> 31)`` (one ADD with the shifted operand:
    ties of a negative ``h`` away from zero), QADD of ``K = 2**(right - 1) + z 2**right`` (the
    rounding term and the zero point ``z``), ASR by ``right`` (RoundingDivideByPOT plus the zero
    point, where the sum stays in int32; where it does not, the output saturates either way) and
    the clamp (:func:`_i8_store_clamped`). Other columns run the exact path: the 64-bit
    ``(x M0 + 2**30) >> 31`` after one SMULL, then RoundingDivideByPOT in 32 bits and the clamp
    at ``[lo, hi]`` (the bounds less the zero point) before the zero point is added."""
    full = Q[4] - Q[3] == 255
    for jj in range(w):
        j = j0 + jj
        zw = Q[5 + 4 * j]
        d = 10 + 4 * n + I8_DSP_WORDS * j  # the column's entry of the host's table
        right = Q[d + 7]
        c = T.Cast("uint32", Q[d + 4] - zx * CS[j])
        if right != 0:
            m2 = Q[d + 5]
            k = Q[d + 6]
            if gemv and m == 1:
                # one row a tile: one straight-line form (the row sum's MLS and the clamp's top
                # whatever the column's zero point and the output's range), no row loop
                x = _i8_v(ACC, RS, 0, n, j, zw, c, False)
                h = _smmulr(x, m2) + x
                _i8_store_clamped(Y, j, T.shift_right(_qadd(h + T.shift_right(h, 31), k), right), False, Q[3],
                                  Q[4] - Q[3])
            elif full:
                if zw == 0:
                    _i8_tflite_rows(ACC, RS, Y, j, m, n, zw, c, m2, k, right, Q[3], 255, True, True)
                else:
                    _i8_tflite_rows(ACC, RS, Y, j, m, n, zw, c, m2, k, right, Q[3], 255, True, False)
            elif zw == 0:
                _i8_tflite_rows(ACC, RS, Y, j, m, n, zw, c, m2, k, right, Q[3], Q[4] - Q[3], False, True)
            else:
                _i8_tflite_rows(ACC, RS, Y, j, m, n, zw, c, m2, k, right, Q[3], Q[4] - Q[3], False, False)
        else:
            e = 31 - Q[5 + 4 * j + 3]  # TFLite's shift: > 0 a left shift
            m0 = T.Cast("int64", Q[5 + 4 * j + 2])
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
