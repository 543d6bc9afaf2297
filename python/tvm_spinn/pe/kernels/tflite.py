"""TFLite's integer row kernels on int8/uint8 rows: the mean and the softmax (gemmlowp's
fixed point).

Kernels (the ``spec`` of :func:`~tvm_spinn.pe.kernels.kernel_object`):

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
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T


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
