"""The quantize and dequantize PE kernels (one channel's scale and zero point per element).

Kernels (the ``spec`` of :func:`~tvm_spinn.pe.kernels.kernel_object`):

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
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import _ZERO

#: 2^23: ``(v + 2^23) - 2^23`` (``(v - 2^23) + 2^23`` below 0) rounds ``|v| < 2^23`` to the nearest
#: integer, ties to even, in fp32 (FPv4 has no VRINT)
_TWO23 = T.float32(8388608.0)
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
    from ...program.quant import QUANT_RANGES
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
