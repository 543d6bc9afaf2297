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
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["quantize_multiplier", "requantize", "QUANT_RANGES", "to_signed"]

QUANT_RANGES = {"int8": (-128, 127), "uint8": (0, 255)}
_MULT_BITS = 31


def quantize_multiplier(m: float) -> tuple[int, int]:
    """``(M0, shift)`` with ``m ~= M0 * 2**-shift``, ``2**30 <= M0 < 2**31``, ``1 <= shift <= 62``.

    Raises ``ValueError`` when ``m`` is negative, not finite, or outside ``[2**-32, 2**30)``
    (no realistic scale combination gets there). ``m == 0`` gives ``(0, 1)``.
    """
    if not math.isfinite(m) or m < 0:
        raise ValueError(f"requantization multiplier {m} is not a finite non-negative number")
    if m == 0:
        return 0, 1
    mant, exp = math.frexp(m)  # m = mant * 2**exp, 0.5 <= mant < 1
    m0 = int(round(mant * (1 << _MULT_BITS)))
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


def to_signed(values: np.ndarray) -> np.ndarray:
    """int8 as is; uint8 with the top bit flipped (``u - 128``) as int8."""
    if values.dtype == np.uint8:
        return (values.astype(np.int16) - 128).astype(np.int8)
    return values.astype(np.int8, copy=False)
