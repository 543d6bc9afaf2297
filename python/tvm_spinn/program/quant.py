"""Integer rules of the int8 MAC path, shared by the lowering (compile time) and the simulator.

An int8 GEMM layer computes, per output element and channel ``c``::

    acc  = sum_k (x[k] - zx) * (w[c, k] - zw[c])            exact integer
    fp32 epilogue:  y = fl(fl(acc) * scale[c]) [+ bias[c]] [ReLU]        (M4F, fp32)
    int8 epilogue:  y = clamp(zy + rshift_round(acc + bias_q[c]) * M0[c], shift[c]), lo, hi)

- The MAC array multiplies raw int8 operands into signed ``SpinnArch.acc_bits``-bit accumulators
  (24 bits on the production chip, 29 on the test chip); ``uint8`` tensors enter it with their
  top bit flipped (``u - 128``, zero point shifted by the same 128), so both activation types use
  the same signed array. The zero-point terms (``- zw * sum x - zx * sum w + K zx zw``) are added
  by the M4F after the array; reductions longer than
  :func:`tvm_spinn.program.ops.gemm.safe_k_chunk` (511 products for 24 bits, 16383 for 29) are
  split so the accumulator never wraps, and the M4F adds the chunk sums in 32-bit.
- Requantization (assumption: a 32-bit fixed-point multiplier, as in TFLite/CMSIS-NN, done by
  the array's output stage): the real multiplier ``M = sx * sw[c] / sy`` is written as
  ``M0 * 2**-shift`` with ``2**30 <= M0 < 2**31``; ``rshift_round(v, s) = (v + 2**(s-1)) >> s``
  (arithmetic shift: rounds half up). ReLU clamps at ``zy`` (``y >= 0 <=> q >= zy``).
- The bias of an int8 epilogue is quantized at compile time: ``bias_q = round_half_even(bias /
  (sx * sw[c]))`` (float64).

Two requantization rules (:data:`ROUNDINGS`), recorded per layer (``attrs["rounding"]``, absent =
``"half_up"``) and checked when a program is loaded:

- ``"half_up"`` (ONNX / PTQ models): one rounding of the exact product, ``(acc * M0 +
  2**(shift-1)) >> shift`` -- the closest fixed-point reading of ONNX's float ``QuantizeLinear``.
- ``"tflite"`` (TFLite models, :func:`tvm_spinn.frontend.from_tflite`): TFLite's
  ``MultiplyByQuantizedMultiplier`` (``tensorflow/lite/kernels/internal/common.h``, without
  ``TFLITE_SINGLE_ROUNDING``): ``RoundingDivideByPOT(SaturatingRoundingDoublingHighMul(acc *
  2**left, M0), right)``, i.e. a rounding of ``acc * M0 / 2**31`` to an integer (ties away from
  zero) and then a second rounding division by ``2**right`` (ties away from zero); ``M0`` comes
  from :func:`quantize_multiplier_tflite` (``TfLiteRound``: ties away from zero). The two rules
  differ by one step on some inputs (double rounding, negative ties).

TFLite's integer softmax and mean (``rounding="tflite"`` on ``softmax``/``mean`` layers of
:mod:`tvm_spinn.program.ops.rows`) are built from gemmlowp's fixed-point primitives, spelled out
here on int64 numpy arrays holding int32 values (``third_party/gemmlowp/fixedpoint/fixedpoint.h``
as TFLite vendors it): :func:`srdhm` (``SaturatingRoundingDoublingHighMul``),
:func:`rounding_divide_by_pot`, :func:`saturating_multiply_by_pot`, :func:`exp_on_negative_values`
and :func:`one_over_one_plus_x`; additions wrap to 32 bits (:func:`wrap32`) as the C code's do.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["quantize_multiplier", "requantize", "quantize_multiplier_tflite", "requantize_tflite",
           "ROUNDINGS", "QUANT_ROUNDING_ATTR", "QUANT_RANGES", "to_signed", "tflite_quantize_multiplier",
           "wrap32", "srdhm", "rounding_divide_by_pot", "saturating_multiply_by_pot",
           "exp_on_negative_values", "one_over_one_plus_x", "count_leading_zeros32"]

#: IRModule attribute naming the requantization rule of a quantized model (``"tflite"``; absent:
#: ``"half_up"``), set by :func:`tvm_spinn.frontend.from_tflite` and read by the partitioner
QUANT_ROUNDING_ATTR = "spinn_quant_rounding"

#: requantization rules a program may name (``attrs["rounding"]`` of an int8 layer)
ROUNDINGS = ("half_up", "tflite")

QUANT_RANGES = {"int8": (-128, 127), "uint8": (0, 255)}
_MULT_BITS = 31


def quantize_multiplier(m: float) -> tuple[int, int]:
    """``(M0, shift)`` with ``m ~= M0 * 2**-shift``, ``2**30 <= M0 < 2**31``, ``1 <= shift <= 62``.

    Raises ``ValueError`` when ``m`` is negative, not finite, or outside ``[2**-32, 2**30)``
    (no realistic scale combination gets there). ``m == 0`` gives ``(0, 1)``.
    """
    return _split_multiplier(m, lambda x: int(round(x)))  # ties to even


def _split_multiplier(m: float, round_mantissa) -> tuple[int, int]:
    """``(M0, shift)`` of ``m`` with its 31-bit mantissa rounded by ``round_mantissa``."""
    if not math.isfinite(m) or m < 0:
        raise ValueError(f"requantization multiplier {m} is not a finite non-negative number")
    if m == 0:
        return 0, 1
    mant, exp = math.frexp(m)  # m = mant * 2**exp, 0.5 <= mant < 1
    m0 = round_mantissa(mant * (1 << _MULT_BITS))  # exact product: mant * 2**31 has ulp 2**-22
    if m0 == 1 << _MULT_BITS:
        m0, exp = m0 // 2, exp + 1
    shift = _MULT_BITS - exp
    if not 1 <= shift <= 62:
        raise ValueError(f"requantization multiplier {m} is out of the supported range [2**-31, 2**30)")
    return m0, shift


def requantize(acc: np.ndarray, m0: np.ndarray, shift: np.ndarray, zero: int, lo: int, hi: int) -> np.ndarray:
    """``clamp(zero + rshift_round(acc * m0, shift), lo, hi)`` in int64 (broadcasting)."""
    acc = np.asarray(acc, dtype=np.int64)
    m0 = np.asarray(m0, dtype=np.int64)
    shift = np.asarray(shift, dtype=np.int64)
    prod = acc * m0  # |acc| < 2**32, m0 < 2**31: fits int64
    rounded = (prod + (np.int64(1) << (shift - 1))) >> shift
    return np.clip(rounded + zero, lo, hi)


def quantize_multiplier_tflite(m: float) -> tuple[int, int]:
    """TFLite's ``QuantizeMultiplier`` in this module's ``(M0, shift)`` convention.

    Same as :func:`quantize_multiplier` except that the mantissa is rounded with ties away from
    zero (``TfLiteRound``), as TFLite does; the shift range is the same.
    """
    return _split_multiplier(m, lambda x: math.floor(x + 0.5))  # ties away from zero (x > 0)


def _trunc_div_pow2(v: np.ndarray, bits: int) -> np.ndarray:
    """``v / 2**bits`` rounded toward zero (C integer division), int64."""
    return np.where(v >= 0, v >> bits, -((-v) >> bits))


def requantize_tflite(acc: np.ndarray, m0: np.ndarray, shift: np.ndarray, zero: int, lo: int,
                      hi: int) -> np.ndarray:
    """TFLite's requantization: ``clamp(zero + MultiplyByQuantizedMultiplier(acc, M0, 31 - shift),
    lo, hi)`` in int64 (broadcasting); see the module docstring."""
    acc = np.asarray(acc, dtype=np.int64)
    m0 = np.asarray(m0, dtype=np.int64)
    exp = _MULT_BITS - np.asarray(shift, dtype=np.int64)  # TFLite's shift: > 0 is a left shift
    left = np.maximum(exp, 0)
    right = np.maximum(-exp, 0)
    # acc * 2**left stays in int32 in TFLite for every multiplier below 1 (left == 0); the
    # 32-bit register is kept for the others.
    x = (acc << left).astype(np.int32).astype(np.int64)
    ab = x * m0  # |x| < 2**31, m0 < 2**31: fits int64
    nudge = np.where(ab >= 0, np.int64(1 << 30), np.int64(1 - (1 << 30)))
    high = _trunc_div_pow2(ab + nudge, _MULT_BITS)  # SaturatingRoundingDoublingHighMul
    mask = (np.int64(1) << right) - 1
    remainder = high & mask
    threshold = (mask >> 1) + (high < 0)
    rounded = (high >> right) + (remainder > threshold)  # RoundingDivideByPOT
    return np.clip(rounded + zero, lo, hi)


def to_signed(values: np.ndarray) -> np.ndarray:
    """int8 as is; uint8 with the top bit flipped (``u - 128``) as int8."""
    if values.dtype == np.uint8:
        return (values.astype(np.int16) - 128).astype(np.int8)
    return values.astype(np.int8, copy=False)


# -- gemmlowp fixed point (TFLite's integer softmax and mean) ----------------------------------
_I64 = np.int64
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


def tflite_quantize_multiplier(m: float) -> tuple[int, int]:
    """TFLite's ``QuantizeMultiplier`` exactly: ``(M0, exponent)`` with ``m ~= M0 * 2**(exponent
    - 31)``, the mantissa rounded half away from zero; ``m == 0`` and ``exponent < -31`` give
    ``(0, 0)`` (TFLite flushes such multipliers to zero)."""
    if not math.isfinite(m) or m < 0:
        raise ValueError(f"multiplier {m} is not a finite non-negative number")
    if m == 0:
        return 0, 0
    mant, exp = math.frexp(m)
    m0 = math.floor(mant * (1 << _MULT_BITS) + 0.5)
    if m0 == 1 << _MULT_BITS:
        m0, exp = m0 // 2, exp + 1
    if exp < -31:
        return 0, 0
    return m0, exp


def wrap32(x) -> np.ndarray:
    """``x`` reduced to int32 (two's complement wrap-around), as int64."""
    return ((np.asarray(x, dtype=_I64) - _INT32_MIN) & 0xFFFFFFFF) + _INT32_MIN


def srdhm(a, b) -> np.ndarray:
    """``SaturatingRoundingDoublingHighMul(a, b)``: ``a * b / 2**31`` rounded to nearest (ties away
    from zero), ``INT32_MIN * INT32_MIN`` saturated to ``INT32_MAX``."""
    a, b = np.asarray(a, dtype=_I64), np.asarray(b, dtype=_I64)
    ab = a * b
    total = ab + np.where(ab >= 0, _I64(1 << 30), _I64(1 - (1 << 30)))
    high = _trunc_div_pow2(total, _MULT_BITS)  # C division: toward zero
    return np.where((a == b) & (a == _INT32_MIN), _I64(_INT32_MAX), high)


def rounding_divide_by_pot(x, exponent) -> np.ndarray:
    """``RoundingDivideByPOT(x, exponent)``: ``x / 2**exponent`` rounded to nearest, ties away
    from zero (``exponent`` in [0, 31], broadcasting)."""
    x = np.asarray(x, dtype=_I64)
    mask = (_I64(1) << np.asarray(exponent, dtype=_I64)) - 1
    threshold = (mask >> 1) + (x < 0)
    return (x >> np.asarray(exponent, dtype=_I64)) + ((x & mask) > threshold)


def saturating_multiply_by_pot(x, exponent: int) -> np.ndarray:
    """``SaturatingRoundingMultiplyByPOT<exponent>(x)``: a saturating left shift for ``exponent >
    0``, :func:`rounding_divide_by_pot` for ``exponent < 0``."""
    x = np.asarray(x, dtype=_I64)
    if exponent <= 0:
        return rounding_divide_by_pot(x, -exponent) if exponent else x
    threshold = (1 << (31 - exponent)) - 1
    out = np.where(x > threshold, _I64(_INT32_MAX), wrap32(x << exponent))
    return np.where(x < -threshold, _I64(_INT32_MIN), out)


def _exp_on_interval_between_negative_one_quarter_and_0_excl(a: np.ndarray) -> np.ndarray:
    """exp(a) for ``a`` in [-1/4, 0), Q0.31 in and out: the Taylor expansion around -1/8."""
    x = wrap32(a + (1 << 28))  # a + 1/8
    x2 = srdhm(x, x)
    x3 = srdhm(x2, x)
    x4 = srdhm(x2, x2)
    x4_over_4 = saturating_multiply_by_pot(x4, -2)
    poly = saturating_multiply_by_pot(wrap32(srdhm(wrap32(x4_over_4 + x3), 715827883) + x2), -1)
    exp_minus_one_eighth = 1895147668
    return wrap32(exp_minus_one_eighth + srdhm(exp_minus_one_eighth, wrap32(x + poly)))


#: exp(-2**k) in Q0.31 for k = -2 .. 4: gemmlowp's barrel shifter of exp_on_negative_values
_EXP_BARREL = ((-2, 1672461947), (-1, 1302514674), (0, 790015084), (1, 290630308), (2, 39332535),
               (3, 720401), (4, 242))


def exp_on_negative_values(a, integer_bits: int) -> np.ndarray:
    """``exp_on_negative_values(FixedPoint<int32, integer_bits>(a))``: exp of the non-positive
    fixed-point values ``a`` (raw, ``31 - integer_bits`` fractional bits), in Q0.31."""
    a = np.asarray(a, dtype=_I64)
    frac = 31 - integer_bits
    quarter = 1 << (frac - 2)
    a_mod_quarter_minus_one_quarter = wrap32((a & (quarter - 1)) - quarter)
    result = _exp_on_interval_between_negative_one_quarter_and_0_excl(
        saturating_multiply_by_pot(a_mod_quarter_minus_one_quarter, integer_bits))  # Rescale<0>
    remainder = wrap32(a_mod_quarter_minus_one_quarter - a)
    for exponent, multiplier in _EXP_BARREL:
        if integer_bits > exponent:
            bit = _I64(1) << (frac + exponent)
            result = np.where((remainder & bit) != 0, srdhm(result, multiplier), result)
    if integer_bits > 5:
        result = np.where(a < -(1 << (36 - integer_bits)), _I64(0), result)  # exp(< -32) = 0
    return np.where(a == 0, _I64(_INT32_MAX), result)


def one_over_one_plus_x(a) -> np.ndarray:
    """``one_over_one_plus_x_for_x_in_0_1``: 1 / (1 + a) for ``a`` in [0, 1) (Q0.31 in and out),
    three Newton-Raphson steps in Q2.29 from 48/17 - 32/17 * d."""
    a = np.asarray(a, dtype=_I64)
    total = a + _INT32_MAX  # RoundingHalfSum(a, One): (sum + sign(sum)) / 2, C division
    half_denominator = np.where(total >= 0, (total + 1) >> 1, -((1 - total) >> 1))
    x = wrap32(1515870810 + srdhm(half_denominator, -1010580540))
    for _ in range(3):
        one_minus = wrap32((1 << 29) - srdhm(half_denominator, x))
        x = wrap32(x + saturating_multiply_by_pot(srdhm(x, one_minus), 2))  # Rescale<2> of a Q4.27
    return saturating_multiply_by_pot(x, 1)  # Rescale<0>(ExactMulByPot<-1>(x))


def count_leading_zeros32(x) -> np.ndarray:
    """Leading zero bits of ``x`` read as uint32 (32 for 0)."""
    x = np.asarray(x, dtype=_I64) & 0xFFFFFFFF
    return 32 - np.frexp(x.astype(np.float64))[1].astype(_I64)  # exact: x < 2**53
