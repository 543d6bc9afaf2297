"""The int8 GEMM's requantizing epilogues on the Cortex-M4's DSP instructions (QADD, SMMLA,
SMMULR, USAT: :mod:`tvm_spinn.pe.kernels.i8_epilogues`) give the exact 64-bit rules' outputs.

Two checks: the instruction sequences, written with the Arm ARM's definitions of the
instructions on Python integers, against :func:`tvm_spinn.program.quant.requantize` and
:func:`~tvm_spinn.program.quant.requantize_tflite` -- exhaustively over every accumulator whose
output is not saturated (and a margin) at the shifts where those are few enough, and around
every rounding boundary and the int32 extremes at all the others; then the generated code run in
the instruction-set simulator on the guards' edges (the shifts and multipliers on either side
of the fast path's range), both clamp forms, int8 and uint8 outputs, columns with and without a
weight zero point, against the same references."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_spinn.program.quant import requantize, requantize_tflite

I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1
#: the kernels' fast-path bounds: the bits the final division shifts out after the high word, the
#: one-rounding rule's largest bias (beyond it the simulator's int64 product wraps)
MAX_SHIFT = 20
MAX_BIAS = (1 << 31) - (1 << 21)
#: ``(y_zero, y_min, y_max)``: int8 and uint8 full ranges, ReLUs at the zero point, a narrow clip
RANGES = ((-5, -128, 127), (0, -128, 127), (127, -128, 127), (-128, -128, 127), (131, 0, 255), (0, 0, 255),
          (-5, -5, 127), (131, 131, 255), (10, -20, 40), (255, 255, 255))


# -- the instructions (Arm ARM, ARMv7-M: SMMLA, SMMULR, QADD, USAT), on int64 arrays -----------
def _qadd(a, b):
    return np.clip(a + b, I32_MIN, I32_MAX)


def _smmla(a, b, ra):
    """``(ra << 32) + a * b``, bits [63:32]."""
    return ((ra << 32) + a * b) >> 32


def _smmulr(a, b):
    """``a * b + 0x80000000``, bits [63:32]."""
    return (a * b + (1 << 31)) >> 32


def _usat8(x):
    return np.clip(x, 0, 255)


def _clamp(x, y_min, y_max):
    """The kernels' clamp of ``x`` (the output less ``y_min``): USAT #8, the upper bound where the
    range is narrower than 256 values, ``y_min`` added back."""
    return np.minimum(_usat8(x), y_max - y_min) + y_min


def half_up_dsp(v, bias, m0, shift, zero, y_min, y_max):
    """The one-rounding requantization's DSP path on the 32-bit sum ``v`` and ``bias``."""
    s = shift - 32
    assert 1 <= s <= MAX_SHIFT and m0 >= 1 << 30 and bias <= MAX_BIAS
    ra = (1 << (s - 1)) + ((zero - y_min) << s)
    return _clamp(_smmla(_qadd(v, bias), m0, ra) >> s, y_min, y_max)


def tflite_dsp(x, m0, shift, zero, y_min, y_max):
    """TFLite's requantization's DSP path on ``x`` (the 32-bit sum with the bias)."""
    right = shift - 31
    assert 1 <= right <= MAX_SHIFT and m0 >= 1 << 30
    m2 = 2 * m0 - (1 << 32)  # 2 M0 as int32
    h = _smmulr(x, m2) + x  # SMMLAR(x, M2, x)
    k = (1 << (right - 1)) + ((zero - y_min) << right)
    return _clamp(_qadd(h + (h >> 31), k) >> right, y_min, y_max)


def _boundaries(m0: int, shift: int, lo: int, hi: int) -> np.ndarray:
    """int32 values ``u`` next to every point where ``(u M0 + 2**(shift-1)) >> shift`` (or TFLite's
    double rounding) steps between ``lo`` and ``hi``, 3 either side."""
    steps = np.arange(lo, hi + 1, dtype=np.float64)
    # the product crosses (k - 1/2) 2**shift; TFLite's first rounding at 2**31 too: both within
    # a few units of u = (k -+ 1/2) 2**shift / M0
    centre = np.concatenate([(steps - 0.5), (steps + 0.5), steps]) * np.ldexp(1.0, shift) / m0
    u = np.round(centre).astype(np.int64)[:, None] + np.arange(-3, 4)
    return np.unique(np.clip(u.ravel(), I32_MIN, I32_MAX))


def _extremes() -> np.ndarray:
    e = np.array([I32_MIN, I32_MIN + 1, I32_MAX - 1, I32_MAX, -1, 0, 1], dtype=np.int64)
    return np.unique(np.concatenate([e, e // 2, e // 4096]))


@pytest.mark.parametrize("shift", list(range(33, 33 + MAX_SHIFT)))
def test_half_up_dsp_sequence_is_the_exact_rule(shift):
    """``QADD(v, bias)``, SMMLA onto the rounding and zero-point term, ASR, the clamp: the same
    outputs as the exact ``(v + bias) M0`` rounded once, for every int32 ``v`` of an unsaturated
    output (exhaustively where those are at most 2**21), around every rounding boundary, at the
    int32 extremes, with biases from 0 to the fast path's extremes (``v + bias`` leaving int32)."""
    rng = np.random.default_rng(shift)
    for m0 in (1 << 30, (1 << 31) - 1, int(rng.integers(1 << 30, 1 << 31))):
        reach = 400 * (1 << shift) // m0 + 8  # |v| beyond this saturates every range
        vs = [np.arange(-reach, reach + 1, dtype=np.int64)] if reach <= 1 << 20 else []
        vs += [_boundaries(m0, shift, -400, 400), _extremes(), rng.integers(I32_MIN, I32_MAX, 4096, dtype=np.int64)]
        v = np.concatenate(vs)
        for bias in (0, 7, -12345, MAX_BIAS, I32_MIN, int(rng.integers(I32_MIN, MAX_BIAS))):
            for zero, y_min, y_max in RANGES:
                want = requantize(v + bias, m0, shift, zero, y_min, y_max)
                got = half_up_dsp(v, bias, m0, shift, zero, y_min, y_max)
                bad = np.flatnonzero(got != want)
                assert bad.size == 0, (m0, bias, zero, y_min, y_max, v[bad[:3]], got[bad[:3]], want[bad[:3]])


@pytest.mark.parametrize("shift", list(range(32, 32 + MAX_SHIFT)))
def test_tflite_dsp_sequence_is_the_exact_rule(shift):
    """SMMLAR with ``2 M0`` as int32, the ADD of the sign (ASR #31), QADD of the rounding and
    zero-point term, ASR, the clamp: the same outputs as TFLite's
    SaturatingRoundingDoublingHighMul and RoundingDivideByPOT in 64 bits, for every int32 ``x``
    of an unsaturated output (exhaustively where those are at most 2**21), around every rounding
    boundary (negative ties included) and at the int32 extremes."""
    rng = np.random.default_rng(100 + shift)
    for m0 in (1 << 30, (1 << 31) - 1, int(rng.integers(1 << 30, 1 << 31))):
        reach = 400 * (1 << shift) // m0 + 8
        xs = [np.arange(-reach, reach + 1, dtype=np.int64)] if reach <= 1 << 20 else []
        xs += [_boundaries(m0, shift, -400, 400), _extremes(), rng.integers(I32_MIN, I32_MAX, 4096, dtype=np.int64)]
        x = np.concatenate(xs)
        for zero, y_min, y_max in RANGES:
            want = requantize_tflite(x, m0, shift, zero, y_min, y_max)
            got = tflite_dsp(x, m0, shift, zero, y_min, y_max)
            bad = np.flatnonzero(got != want)
            assert bad.size == 0, (m0, zero, y_min, y_max, x[bad[:3]], got[bad[:3]], want[bad[:3]])


def test_dsp_sequences_need_their_guards():
    """Outside the guards the DSP sequences are not the rule (so the kernels' exact paths are
    needed there): one shift too many, a multiplier below 2**30, a bias where the simulator's
    int64 product wraps."""
    v = np.array([I32_MAX], dtype=np.int64)
    # shift 32 + MAX_SHIFT + 5: the saturated sum (2**31 - 1, not 2**32 - 2) no longer saturates the output
    shift, m0, bias = 32 + MAX_SHIFT + 5, 1 << 30, I32_MAX
    assert not np.array_equal(requantize(v + bias, m0, shift, 0, -128, 127),
                              np.clip(_smmla(_qadd(v, bias), m0, (1 << (shift - 33))) >> (shift - 32), -128, 127))
    # M0 < 2**30: 2 M0 as int32 is 2 M0 itself, so SMMLAR(x, 2 M0, x) counts x twice
    x = np.array([1000], dtype=np.int64)
    m0 = (1 << 29) + 1
    assert not np.array_equal(requantize_tflite(x, m0, 35, 0, -128, 127),
                              np.clip(_qadd(_smmulr(x, 2 * m0) + x, 1 << 3) >> 4, -128, 127))
    # v + bias near 2**32 with M0 near 2**31: the rule's int64 sum passes 2**63
    v, bias, m0, shift = np.array([I32_MAX], dtype=np.int64), I32_MAX, (1 << 31) - 1, 34
    assert requantize(v + bias, m0, shift, 0, -128, 127)[0] == -128
    assert np.clip(_smmla(_qadd(v, bias), m0, 1 << 1) >> 2, -128, 127)[0] == 127


# -- the generated code in the instruction-set simulator ----------------------------------------
pytest.importorskip("unicorn")
pytest.importorskip("elftools")
pytest.importorskip("ziglang")


def _run(spec, acc, rowsum, colsum, head, columns, out_dtype):
    from test_pe_int8_epilogues import _run_last_chunk
    return _run_last_chunk(spec, acc, rowsum, colsum, head, columns, 0, out_dtype)


def _guard_columns(rng, lo_shift, m):
    """Columns at every shift of the fast path and the ones either side of it (``lo_shift``: the
    first below it), multipliers of ``2**30 - 1`` (the exact path), ``2**30`` and ``2**31 - 1``,
    biases at the int32 extremes, half the columns with weight zero points; ``m`` rows of
    accumulators at the int32 extremes, at ties and of the size each shift brings near the output
    range. Returns ``acc, rowsum, colsum, zx, kk, columns, v`` (``v``: the sums with their
    zero-point terms, as the simulator wraps them)."""
    shifts = np.arange(lo_shift, lo_shift + MAX_SHIFT + 3)
    n = 3 * len(shifts)
    shift = np.tile(shifts, 3)
    m0 = np.concatenate([np.full(len(shifts), (1 << 30) - 1), np.full(len(shifts), 1 << 30),
                         np.full(len(shifts), (1 << 31) - 1)])
    scale = np.ldexp(100.0, shift.astype(int) - 30)
    acc = np.clip(rng.normal(size=(m, n)) * scale, I32_MIN, I32_MAX).astype(np.int64)
    acc[0], acc[1] = I32_MIN, I32_MAX
    acc[2] = ((np.arange(n) % 7 - 3) * 2 + 1) << np.maximum(shift - 32, 0)  # ties of the final division
    bias = np.clip(rng.normal(size=n) * scale, I32_MIN, I32_MAX).astype(np.int64)
    bias[::5], bias[1::5] = I32_MAX, I32_MIN
    zw = rng.integers(-128, 128, size=n)
    zw[::2] = 0
    rowsum = rng.integers(-3000, 3000, size=m)
    colsum = rng.integers(-(1 << 31), 1 << 31, size=n)
    colsum[::2] = 0
    zx, kk = 9, 64
    v = (acc - zw * rowsum[:, None] - zx * colsum + kk * zx * zw).astype(np.int32).astype(np.int64)
    return acc, rowsum, colsum, zx, kk, np.stack([zw, bias, m0, shift], axis=1), v + bias


def _out_ranges():
    """The output ranges of :data:`RANGES` an int8 or uint8 output holds, with its dtype."""
    for zero, y_min, y_max in RANGES[::2] + RANGES[1::2]:
        ydt = np.dtype("uint8" if y_min >= 0 and zero >= 0 else "int8")
        if not (ydt == np.uint8 and y_max > 255 or ydt == np.int8 and y_max > 127):
            yield zero, y_min, y_max, ydt


@pytest.mark.parametrize("tflite", [False, True])
def test_dsp_epilogues_bit_identical_at_the_guards(tflite):
    """The kernels run directly on :func:`_guard_columns` (9 rows: the row loops with and
    without the row sums' term), int8 and uint8 outputs with full and narrow clamps. The
    outputs are :func:`requantize`'s / :func:`requantize_tflite`'s."""
    rng = np.random.default_rng(7 + tflite)
    acc, rowsum, colsum, zx, kk, columns, vb = _guard_columns(rng, 31 if tflite else 32, 9)
    spec = ("gemm_i8", "tflite") if tflite else ("gemm_i8",)
    rule = requantize_tflite if tflite else requantize
    for zero, y_min, y_max, ydt in _out_ranges():
        got = _run(spec, acc, rowsum, colsum, [zx, kk, zero, y_min, y_max], columns, ydt)
        want = rule(vb, columns[:, 2], columns[:, 3], zero, y_min, y_max).astype(ydt)
        bad = np.argwhere(got != want)
        assert bad.size == 0, (zero, y_min, y_max, bad[:5])


@pytest.mark.parametrize("tflite", [False, True])
def test_gemv_epilogue_bit_identical_at_the_guards(tflite):
    """The one-row kernels (``("gemm_i8", "gemv")``, ``("gemm_i8", "tflite_gemv")``: one
    straight-line form on a one-row tile) run directly on each row of :func:`_guard_columns`
    alone, and on all of them (a tile of more rows runs the row loops), over the output ranges:
    :func:`requantize`'s / :func:`requantize_tflite`'s outputs."""
    rng = np.random.default_rng(11 + tflite)
    acc, rowsum, colsum, zx, kk, columns, vb = _guard_columns(rng, 31 if tflite else 32, 4)
    spec = ("gemm_i8", "tflite_gemv") if tflite else ("gemm_i8", "gemv")
    rule = requantize_tflite if tflite else requantize
    # row sums of every size (their zero-point term wraps in 32 bits), so that it moves outputs
    rowsum = rng.integers(-(1 << 31), 1 << 31, size=len(acc))
    zw, bias = columns[:, 0], columns[:, 1]
    vb = (acc - zw * rowsum[:, None] - zx * colsum + kk * zx * zw).astype(np.int32).astype(np.int64) + bias
    for zero, y_min, y_max, ydt in _out_ranges():
        want = rule(vb, columns[:, 2], columns[:, 3], zero, y_min, y_max).astype(ydt)
        head = [zx, kk, zero, y_min, y_max]
        for i in range(len(acc)):
            got = _run(spec, acc[i:i + 1], rowsum[i:i + 1], colsum, head, columns, ydt)
            bad = np.argwhere(got != want[i:i + 1])
            assert bad.size == 0, (i, zero, y_min, y_max, bad[:5])
        got = _run(spec, acc, rowsum, colsum, head, columns, ydt)
        assert np.array_equal(got, want), (zero, y_min, y_max)
