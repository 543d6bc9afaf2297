"""The ``quantize`` PE kernel's quotient without a VDIV per element, checked bit for bit.

The kernel (:func:`tvm_spinn.pe.kernels.quantize._quantize`) divides by a run's scale with one VDIV
of the reciprocal ``y = RN(1/s)`` and two corrections of ``q0 = RN(x y)`` by fused multiply-adds
(Markstein), then rounds with VCVTR and adds the zero point with QADD and SSAT/USAT; elements
whose corrected quotient is NaN and runs whose scale or zero point is outside the ranges where
that is exact take the reference's own operations. Checked here:

- the numpy emulation of the fused multiply-add (:func:`fma32`) against exact rational
  arithmetic;
- the emulated instruction sequence's quotient against numpy's correctly rounded float32
  division on every significand of ``x`` in a binade, for scales at the edges of the reciprocal's
  rounding (significands all ones, one ulp above 1, the range's ends);
- the emulated kernel (quotient, rounding, zero point, saturation, fallback) against the
  simulator's formula on random rows quantized by their absolute maximum, with values at the
  ``.5`` boundaries of ``x / s`` and their neighbours, the absmax element, signed zeros,
  subnormals, infinities and NaNs;
- the kernel itself, executed in the instruction-set simulator, against the simulator's formula
  on the same kinds of values, per tensor, per channel and with a channel per element, for int8
  and uint8, scales and zero points inside and outside the fast path's ranges;
- a quantize layer run through the default simulator (C++) and the ISS, bitwise equal.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

pytest.importorskip("unicorn")
pytest.importorskip("elftools")
pytest.importorskip("ziglang")

from tvm import relax  # noqa: E402

import tvm_spinn  # noqa: E402
from tvm_spinn.pe import run_program_iss  # noqa: E402
from tvm_spinn.pe.images import role_image  # noqa: E402
from tvm_spinn.pe.iss import PeMachine  # noqa: E402
from tvm_spinn.pe.kernels.quantize import _SCALE_EXP, _ZERO_BOUND  # noqa: E402
from tvm_spinn.program.quant import QUANT_RANGES  # noqa: E402
from tvm_spinn.runtime.simulator import run_program  # noqa: E402

F32, F64 = np.float32, np.float64


# ------------------------------------------------------------------ references and emulation
def reference(x, s, z, dtype: str) -> np.ndarray:
    """The simulator's quantize (:mod:`tvm_spinn.program.ops.qdq`): ``clamp(rint(fl(x / s)) +
    fl(z))``, NaN to 0."""
    lo, hi = QUANT_RANGES[dtype]
    with np.errstate(all="ignore"):
        q = np.clip(np.rint((np.asarray(x, F32) / np.asarray(s, F32)).astype(F32)) + np.asarray(z, np.int32).astype(F32),
                    F32(lo), F32(hi))
    q[np.isnan(q)] = 0
    return q.astype(dtype)


def fma32(a, b, c) -> np.ndarray:
    """``RN32(a * b + c)`` with one rounding, for float32 operands: the product is exact in
    float64, the sum's error exact by TwoSum, the sum rounded to odd in float64 and then to
    float32 (rounding to odd with two extra bits makes the second rounding the correct one:
    Boldo and Melquiond, "Emulation of FMA and correctly rounded sums", IEEE TC 2008)."""
    a, b, c = (np.asarray(v, F32).astype(F64) for v in np.broadcast_arrays(a, b, c))
    with np.errstate(all="ignore"):
        p = a * b
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        inexact = np.isfinite(s) & np.isfinite(err) & (err != 0)
        bits = s.view(np.int64).copy()
        # truncate toward zero (one ulp down in magnitude where the exact sum is nearer zero),
        # then set the last bit: the odd one of the two neighbours
        bits[inexact & ((err > 0) != (s > 0))] -= 1
        bits[inexact] |= 1
        return bits.view(F64).astype(F32)


def kernel_quotient(x, s) -> np.ndarray:
    """The kernel's quotient of a run: ``y = RN(1/s)``, ``q0 = RN(x y)``, then twice ``r =
    fma(-q, s, x)``, ``q = fma(r, y, q)``."""
    x, s = np.broadcast_arrays(np.asarray(x, F32), np.asarray(s, F32))
    with np.errstate(all="ignore"):
        y = (F32(1) / s).astype(F32)
        q = (x * y).astype(F32)
    for _ in range(2):
        q = fma32(fma32(-q, s, x), y, q)
    return q


def fast_run(s, z) -> np.ndarray:
    """Whether a run of scale ``s`` and zero point ``z`` takes the corrected quotient."""
    e = (np.asarray(s, F32).view(np.int32) >> 23) & 255
    z = np.asarray(z, np.int64)
    return (e >= _SCALE_EXP[0]) & (e <= _SCALE_EXP[1]) & (np.abs(z) <= _ZERO_BOUND)


def emulate_kernel(x, s, z, dtype: str) -> np.ndarray:
    """The kernel's executed operations per element, in numpy: the corrected quotient, VCVTR
    (round to nearest even, saturating to int32), QADD (saturating), SSAT/USAT; the reference's
    operations where the quotient is NaN or the run is outside the fast path's ranges."""
    x, s, z = np.broadcast_arrays(np.asarray(x, F32), np.asarray(s, F32), np.asarray(z, np.int32))
    lo, hi = QUANT_RANGES[dtype]
    with np.errstate(all="ignore"):
        q = np.where(fast_run(s, z), kernel_quotient(x, s), F32(np.nan))
        r = np.rint(q.astype(F64))
        v = np.clip(np.nan_to_num(r, nan=0.0), -2.0 ** 31, 2.0 ** 31 - 1).astype(np.int64)
    v = np.clip(np.clip(v + z, -(1 << 31), (1 << 31) - 1), lo, hi)
    slow = np.isnan(q)
    out = v.astype(dtype)
    out[slow] = reference(x[slow], s[slow], z[slow], dtype)
    return out


def _round32(v: Fraction) -> float:
    """``v`` rounded to the nearest float32 (ties to even), exactly (subnormals included)."""
    if v == 0:
        return 0.0
    sign, m = (-1 if v < 0 else 1), abs(v)
    e = m.numerator.bit_length() - m.denominator.bit_length()
    while Fraction(2) ** e > m:
        e -= 1
    while Fraction(2) ** (e + 1) <= m:
        e += 1
    ulp = Fraction(2) ** max(e - 23, -149)
    n, rem = divmod(m, ulp)
    if rem > ulp / 2 or (rem == ulp / 2 and n % 2 == 1):
        n += 1
    return sign * float(n * ulp) if n * ulp < Fraction(2) ** 128 else sign * float("inf")


# ------------------------------------------------------------------ inputs
def boundary_values(s: np.float32, rng, count: int = 64) -> np.ndarray:
    """Values of ``x`` at the rounding boundaries of ``x / s``: ``fl((k + 1/2) s)`` and its two
    float32 neighbours for ``k`` across the int8/uint8 range and beyond, the absmax element
    ``fl(127 s)``, signed zeros and subnormals."""
    k = np.concatenate([np.arange(-131, 259), rng.integers(-300, 300, size=count)]).astype(F64)
    with np.errstate(all="ignore"):
        mid = ((k + 0.5) * F64(s)).astype(F32)
        whole = (k * F64(s)).astype(F32)
    out = np.concatenate([mid, np.nextafter(mid, F32(np.inf)), np.nextafter(mid, F32(-np.inf)), whole,
                          (F64(s) * 127).astype(F32).reshape(1),
                          np.array([0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, -3e-39], F32)])
    return out[np.isfinite(out)]


SPECIALS = np.array([np.inf, -np.inf, np.nan, 3.4028235e38, -3.4028235e38, 1e30, -1e30, 1e-30, 2.0 ** 100,
                     np.float32(2.0 ** 31), -np.float32(2.0 ** 31), 2.0 ** 23, 2.0 ** 23 + 1, 2.0 ** 22 + 0.5], F32)


def adversarial_scales() -> list:
    """Scales inside the fast path (absmax-like, the exponent range's ends, significands all ones
    and one ulp above 1, negative) and outside it (beyond the ends, subnormal, zero, infinite,
    NaN)."""
    lo, hi = F32(2.0 ** -64), F32(2.0 ** 64)
    return [F32(0.0123), F32(1 / 127), F32(1.0), F32(1.9999999), F32(1.0000001), F32(3.0), F32(-0.037), lo,
            np.nextafter(hi, F32(0)), F32(1e-19), F32(1e19), np.nextafter(lo, F32(0)), hi, F32(1e-30), F32(1e30),
            F32(3e-39), F32(0.0), F32(np.inf), F32(np.nan)]


ZEROS = [0, 3, -128, 127, 255, _ZERO_BOUND, -_ZERO_BOUND, _ZERO_BOUND + 1, -_ZERO_BOUND - 1, (1 << 31) - 1, -(1 << 31)]


# ------------------------------------------------------------------ the emulation itself
def test_fma32_matches_exact_arithmetic():
    """:func:`fma32` equals the exactly rounded ``a * b + c`` (rational arithmetic), on random
    operands over the exponent range, on cancellations and on sums at float32 midpoints."""
    rng = np.random.default_rng(3)
    n = 3000
    a = (rng.normal(size=n) * np.exp2(rng.integers(-60, 60, size=n))).astype(F32)
    b = (rng.normal(size=n) * np.exp2(rng.integers(-60, 60, size=n))).astype(F32)
    c = (rng.normal(size=n) * np.exp2(rng.integers(-120, 120, size=n))).astype(F32)
    # cancellations: c = -RN(a b) (the remainder's case), and sums one bit past a midpoint
    c[: n // 3] = -(a[: n // 3] * b[: n // 3]).astype(F32)
    a[n // 3: n // 2], b[n // 3: n // 2] = F32(1 + 2.0 ** -23), F32(1 + 2.0 ** -23)
    c[n // 3: n // 2] = F32(2.0 ** -24) * rng.choice([-1, 1], size=n // 2 - n // 3).astype(F32)
    got = fma32(a, b, c)
    want = np.array([_round32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(w)))
                     for x, y, w in zip(a, b, c)], F32)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


def _significands(step: int) -> np.ndarray:
    """float32 values in ``[1, 2)``, every ``step``-th significand."""
    return ((127 << 23) | np.arange(0, 1 << 23, step, dtype=np.int64)).astype(np.int32).view(F32)


@pytest.mark.parametrize("step", [pytest.param(1, marks=pytest.mark.slow), 61])
def test_corrected_quotient_is_the_rounded_quotient(step):
    """``q2 = RN(x / s)`` bitwise for every ``step``-th significand of ``x`` over a binade,
    against numpy's float32 division, for scales at the reciprocal's rounding edges (significands
    all ones, one ulp above 1), at the fast path's exponent ends (``x / s`` between 1/4 and 1/2,
    and 2^6 and 2^7) and at random significands. (The sequence is sign-symmetric and, without
    underflow or overflow, invariant under scaling by powers of two: one binade of ``x`` per
    scale is every significand of ``x`` against that scale's.)"""
    rng = np.random.default_rng(5)
    cases = [(F32(1.9999999), 0), (F32(1.0000001), 0), (F32(1.5), 0), (F32(3.0), 0), (F32(1.3333334), 0),
             (F32(2.0 ** -64), -2), (np.nextafter(F32(2.0 ** 64), F32(0)), 7)]
    cases += [(s, 0) for s in rng.uniform(1, 2, 3 if step == 1 else 40).astype(F32)]
    base = _significands(step)
    for s, shift in cases:
        for chunk in np.array_split(base, max(1, base.size // (1 << 20))):
            x = (chunk.astype(F64) * 2.0 ** (shift + np.floor(np.log2(F64(s))))).astype(F32)  # exact
            want = (x / s).astype(F32)
            got = kernel_quotient(x, s)
            assert np.array_equal(got.view(np.int32), want.view(np.int32)), (s, shift)


@pytest.mark.parametrize("rows", [pytest.param(1_000_000, marks=pytest.mark.slow), 20_000])
@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_emulated_kernel_matches_the_reference_on_rows(rows, dtype):
    """Rows of 16 quantized by their absolute maximum (``s = fl(absmax / 127)``, as dynamic
    int8 quantization does) with random zero points, some elements set to ``.5`` boundaries of
    ``x / s`` and their neighbours, the absmax element, signed zeros, subnormals, infinities
    and NaNs: the emulated kernel equals the simulator's formula element for element."""
    rng = np.random.default_rng(11 if dtype == "int8" else 12)
    width = 16
    x = (rng.standard_normal((rows, width)) * np.exp2(rng.integers(-40, 40, size=(rows, 1)))).astype(F32)
    s = (np.abs(x).max(axis=1, keepdims=True).astype(F64) / 127).astype(F32)
    k = rng.integers(-130, 130, size=(rows, 4)).astype(F64)
    mid = ((k + 0.5) * s.astype(F64)).astype(F32)
    x[:, :4] = mid
    x[:, 4] = np.nextafter(mid[:, 0], F32(np.inf))
    x[:, 5] = np.nextafter(mid[:, 1], F32(-np.inf))
    flat = x.reshape(-1)
    special = rng.random(flat.size) < 0.01
    flat[special] = rng.choice(np.array([0.0, -0.0, 1e-45, -3e-39, np.inf, -np.inf, np.nan], F32),
                               size=int(special.sum()))
    z = rng.integers(-20, 20, size=(rows, 1)) + (128 if dtype == "uint8" else 0)
    got = emulate_kernel(x, s, z, dtype)
    want = reference(x, s, z, dtype)
    assert np.array_equal(got, want)
    # the boundary values exercise both roundings of a tie and the saturation
    with np.errstate(all="ignore"):
        q = (x / s).astype(F32)
        assert np.sum(np.abs(q - np.floor(q)) == 0.5) > rows // 10 and np.sum(np.abs(q) > 128) > 0


def test_emulated_kernel_matches_the_reference_on_adversarial_runs():
    """Every adversarial scale and zero point (inside and outside the fast path's ranges) with
    boundary values and specials: the emulated kernel equals the simulator's formula."""
    rng = np.random.default_rng(13)
    for dtype in ("int8", "uint8"):
        for s in adversarial_scales():
            x = np.concatenate([boundary_values(s, rng) if np.isfinite(s) and s != 0 else np.zeros(0, F32), SPECIALS,
                                rng.standard_normal(64).astype(F32)])
            for z in ZEROS:
                assert np.array_equal(emulate_kernel(x, s, z, dtype), reference(x, s, z, dtype)), (dtype, s, z)


# ------------------------------------------------------------------ the kernel in the ISS
def _run_kernel(machine, dtype, x, scales, zeros, inner, channels, off, c0) -> np.ndarray:
    arrays = [np.asarray(x, F32), np.asarray(scales, F32), np.asarray(zeros, np.int32), np.zeros(len(x), dtype)]
    addr, pointers = machine.arena, []
    for arr in arrays:
        pointers.append(addr)
        machine.write(addr, arr.tobytes())
        addr += -(-max(arr.nbytes, 4) // 8) * 8
    machine.run([pointers + [len(x), inner, channels, off, c0]])
    return np.frombuffer(machine.read(pointers[-1], len(x)), dtype).copy()


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_kernel_in_the_iss_matches_the_reference(dtype):
    """The generated kernel, executed: per tensor (one run) for every adversarial scale and zero
    point, per channel (runs of 3 from a tile starting mid-run and mid-row) and with a channel
    per element, against the simulator's formula."""
    from tvm_spinn.target.arch import SpinnArch

    arch = SpinnArch()
    image = role_image(("quantize", dtype))
    machine = PeMachine(image.elf, image.name, 0, arch.acc_bits, arch)
    rng = np.random.default_rng(17)
    # the corrected quotient is what runs: a run of ordinary values costs well under the
    # reference's operations (VDIV alone 14 cycles an element, ~52 in all)
    x = (rng.standard_normal(512) * 3).astype(F32)
    start = machine.now()
    assert np.array_equal(_run_kernel(machine, dtype, x, [F32(0.0123)], [3], len(x), 1, 0, 0),
                          reference(x, F32(0.0123), 3, dtype))
    assert (machine.now() - start) / len(x) < 32
    scales = adversarial_scales()
    for s in scales:
        x = np.concatenate([boundary_values(s, rng, 16) if np.isfinite(s) and s != 0 else np.zeros(0, F32), SPECIALS])
        for z in ZEROS:
            got = _run_kernel(machine, dtype, x, [s], [z], len(x), 1, 0, 0)
            assert np.array_equal(got, reference(x, s, z, dtype)), (s, z)
    # per channel: element i of the tile is flat element first + i, channel (first // inner) % C
    channels, inner, first = len(scales), 3, 7
    zeros = np.array(ZEROS * 2, np.int64)[:channels]
    for inner in (3, 1):
        n = 5 * channels * inner + 2
        x = rng.standard_normal(n).astype(F32) * 200
        x[::5] = SPECIALS[np.arange(len(x[::5])) % len(SPECIALS)]
        c = ((first + np.arange(n)) // inner) % channels
        s_el, z_el = np.array(scales, F32)[c], zeros[c]
        with np.errstate(all="ignore"):
            mid = ((rng.integers(-130, 130, size=n) + 0.5) * s_el.astype(F64)).astype(F32)
        x[1::3] = np.where(np.isfinite(mid[1::3]), mid[1::3], x[1::3])
        got = _run_kernel(machine, dtype, x, scales, zeros.astype(np.int32), inner, channels, first % inner,
                          (first // inner) % channels)
        assert np.array_equal(got, reference(x, s_el, z_el, dtype)), inner


@pytest.mark.parametrize("axis", [None, 0])
def test_quantize_layer_simulator_and_iss_bitwise_equal(axis):
    """A quantize layer (per tensor, and per row: runs of a row's elements) on boundary values,
    specials and an absmax scale: the default simulator and the ISS give the same bytes."""
    rng = np.random.default_rng(23)
    shape = (6, 40)
    s = F32(0.0173)
    x = rng.standard_normal(shape).astype(F32)
    x.reshape(-1)[: 200] = boundary_values(s, rng)[:200]
    x.reshape(-1)[-len(SPECIALS):] = SPECIALS
    scale = s if axis is None else (np.abs(x).max(axis=1).astype(F64) / 127).astype(F32)
    scale = np.where(np.isfinite(scale) & (scale > 0), scale, s).astype(F32)
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType(list(shape), "float32"))
    with bb.function("main", [xv]):
        with bb.dataflow():
            q = bb.emit(relax.op.quantize(xv, relax.const(scale), relax.const(np.asarray(3 if axis is None else
                                                                                           np.arange(6) - 2, "int8")),
                                          axis=-1 if axis is None else axis, out_dtype="int8"))
            gv = bb.emit_output(q)
        bb.emit_func_output(gv)
    programs = tvm_spinn.report(relax.build(bb.get(), target="spinn")).programs
    assert any(layer.kind == "quantize" for p in programs for layer in p.layers)
    for program in programs:
        want = run_program(program, [x])
        got = run_program_iss(program, [x])
        for w, g in zip(want, got):
            assert w.dtype == g.dtype and np.array_equal(w, g)
