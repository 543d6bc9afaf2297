"""Whole-layer simulator kernels (tvm_spinn.sim.*_batched, im2col) against straightforward numpy
references, bit for bit: fp32 GEMM = per output, k ascending from C, fl(c + fl(a * b)); int8 GEMM =
per k-chunk a fresh wrapping acc_bits accumulator, chunk sums added in int32. Also: any thread
count gives the same bits, and bad arguments raise Python exceptions."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tvm_spinn import _lib


def _ref_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    acc = c.astype(np.float32).copy()
    with np.errstate(all="ignore"):
        for k in range(a.shape[1]):
            prod = (a[:, k:k + 1] * b[k:k + 1, :]).astype(np.float32)
            acc = (acc + prod).astype(np.float32)
    return acc


def _wrap(v: np.ndarray, bits: int) -> np.ndarray:
    v = v.astype(np.int64)
    return ((v + (1 << (bits - 1))) % (1 << bits)) - (1 << (bits - 1))


def _ref_int(a: np.ndarray, b: np.ndarray, c: np.ndarray, chunk: int, acc_bits: int) -> tuple[np.ndarray, int]:
    total = c.astype(np.int64)
    wraps = 0
    for k0 in range(0, a.shape[1], chunk):
        part = np.zeros(c.shape, np.int64)
        for k in range(k0, min(a.shape[1], k0 + chunk)):
            exact = part + a[:, k:k + 1].astype(np.int64) * b[k:k + 1, :].astype(np.int64)
            part = _wrap(exact, acc_bits)
            wraps += int(np.count_nonzero(part != exact))
        total = _wrap(total + part, 32)
    return total.astype(np.int32), wraps


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32)


# (batch, a_count, b_count, M, K, N): remainders of the 5 x 16 register block and of the
# 256-long k blocks, K = 1, large K, conv-like groups and broadcast batches.
SHAPES = [
    (1, 1, 1, 1, 1, 1),
    (1, 1, 1, 5, 16, 16),
    (1, 1, 1, 7, 3, 17),
    (2, 2, 2, 13, 1, 33),
    (3, 2, 3, 11, 300, 47),
    (1, 1, 1, 64, 257, 130),
    (1, 1, 1, 9, 1100, 20),
    (6, 3, 6, 1, 9, 50),  # depthwise-like: one row per group
    (4, 1, 4, 16, 8, 16),  # broadcast A
    (4, 4, 1, 16, 8, 16),  # broadcast B
    (2, 2, 2, 130, 40, 1030),  # several output blocks: multi-threaded
    (1, 1, 1, 1280, 112, 4),  # narrow outputs (N <= 8): lanes over rows of A
    (3, 2, 3, 37, 300, 3),
    (2, 1, 2, 8, 5, 8),
    (1, 1, 1, 21, 600, 1),
]


def _indexes(batch, a_count, b_count):
    return np.arange(batch) % a_count, (np.arange(batch) * 7 + 1) % b_count


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_f32_batched_bits(shape):
    batch, ac, bc, m, k, n = shape
    rng = np.random.default_rng(sum(shape))
    a = (rng.normal(size=(ac, m, k)) * rng.choice([1e-3, 1, 1e3], size=(ac, m, k))).astype(np.float32)
    b = rng.normal(size=(bc, k, n)).astype(np.float32)
    c0 = rng.normal(size=(batch, m, n)).astype(np.float32)
    ai, bi = _indexes(batch, ac, bc)
    ref = np.stack([_ref_f32(a[ai[i]], b[bi[i]], c0[i]) for i in range(batch)])
    for threads in (1, 2, 3):
        c = c0.copy()
        _lib.gemm_f32_batched(a, b, c, ai, bi, threads=threads)
        assert np.array_equal(_bits(c), _bits(ref)), threads
    # and the single-GEMM kernel agrees
    c = c0.copy()
    for i in range(batch):
        _lib.gemm_f32(a[ai[i]], b[bi[i]], c[i])
    assert np.array_equal(_bits(c), _bits(ref))


def test_gemm_f32_special_values():
    a = np.array([[np.inf, 1.0, np.nan, -0.0, 3e38, 3e38]], np.float32)
    b = np.array([[0.0], [1.0], [2.0], [5.0], [10.0], [-10.0]], np.float32).repeat(20, axis=1)
    c0 = np.array([[-0.0] * 20], np.float32)
    c = c0.copy()[None]
    _lib.gemm_f32_batched(a[None], b[None], c)
    ref = _ref_f32(a, b, c0)
    assert np.array_equal(np.isnan(c[0]), np.isnan(ref))
    assert np.array_equal(_bits(c[0])[~np.isnan(ref)], _bits(ref)[~np.isnan(ref)])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("acc_bits,chunk", [(29, 10 ** 6), (18, 7), (16, 3), (32, 100), (12, 1)])
def test_gemm_i8_batched_bits(shape, acc_bits, chunk):
    batch, ac, bc, m, k, n = shape
    rng = np.random.default_rng(sum(shape) + acc_bits)
    a = rng.integers(-128, 128, size=(ac, m, k), dtype=np.int8)
    b = rng.integers(-128, 128, size=(bc, k, n), dtype=np.int8)
    c0 = rng.integers(-2**31, 2**31, size=(batch, m, n), dtype=np.int64).astype(np.int32)
    ai, bi = _indexes(batch, ac, bc)
    refs = [_ref_int(a[ai[i]], b[bi[i]], c0[i], chunk, acc_bits) for i in range(batch)]
    ref = np.stack([r[0] for r in refs])
    for threads in (1, 2):
        c = c0.copy()
        wraps = _lib.gemm_i8_batched(a, b, c, chunk, acc_bits, ai, bi, threads=threads)
        assert np.array_equal(c, ref)
        assert wraps == sum(r[1] for r in refs)


def test_gemm_i16_batched_bits():
    rng = np.random.default_rng(3)
    a = rng.integers(-2**15, 2**15, size=(2, 9, 40), dtype=np.int16)
    b = rng.integers(-2**15, 2**15, size=(2, 40, 19), dtype=np.int16)
    c = np.zeros((2, 9, 19), np.int32)
    wraps = _lib.gemm_i16_batched(a, b, c, 6, 32)
    refs = [_ref_int(a[i], b[i], np.zeros((9, 19), np.int32), 6, 32) for i in range(2)]
    assert np.array_equal(c, np.stack([r[0] for r in refs])) and wraps == sum(r[1] for r in refs)


def _im2col_ref(x, kh, kw, strides, dilation, padding, groups, fill, oh, ow):
    n, c, h, w = x.shape
    pt, pl, pb, pr = padding
    xp = np.full((n, c, h + pt + pb + kh * dilation[0], w + pl + pr + kw * dilation[1]), fill, x.dtype)
    xp[:, :, pt:pt + h, pl:pl + w] = x
    cg = c // groups
    out = np.empty((n, groups, cg, kh, kw, oh, ow), x.dtype)
    for i in range(kh):
        for j in range(kw):
            for oy in range(oh):
                for ox in range(ow):
                    out[:, :, :, i, j, oy, ox] = xp[:, :, oy * strides[0] + i * dilation[0],
                                                     ox * strides[1] + j * dilation[1]].reshape(n, groups, cg)
    return out.reshape(n * groups, cg * kh * kw, oh * ow)


@pytest.mark.parametrize("dtype", ["float32", "int8", "uint8", "int16"])
@pytest.mark.parametrize("geom", [
    # (C, H, W, kh, kw, strides, dilation, padding, groups)
    (3, 8, 9, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1), 1),
    (4, 7, 7, 3, 3, (2, 2), (1, 1), (0, 1, 1, 0), 4),
    (6, 10, 6, 2, 3, (1, 2), (2, 1), (2, 0, 1, 3), 2),
    (2, 5, 5, 1, 1, (1, 1), (1, 1), (0, 0, 0, 0), 1),
    (2, 4, 4, 5, 5, (1, 1), (1, 1), (3, 3, 3, 3), 1),
])
def test_im2col(dtype, geom):
    c, h, w, kh, kw, strides, dilation, padding, groups = geom
    rng = np.random.default_rng(0)
    x = rng.integers(-100, 100, size=(2, c, h, w)).astype(dtype)
    fill = 7
    oh = (h + padding[0] + padding[2] - dilation[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (w + padding[1] + padding[3] - dilation[1] * (kw - 1) - 1) // strides[1] + 1
    got = _lib.im2col(x, (kh, kw), strides, dilation, padding, groups, fill=fill, threads=2)
    ref = _im2col_ref(x, kh, kw, strides, dilation, padding, groups, fill, oh, ow)
    assert got.dtype == x.dtype and np.array_equal(got, ref)


def test_thread_env_same_bits(tmp_path):
    """TVM_SPINN_SIM_THREADS=1 and =2 (threads=0: from the environment) give the same bits."""
    script = (
        "import numpy as np, sys\n"
        "from tvm_spinn import _lib\n"
        "rng = np.random.default_rng(5)\n"
        "a = rng.normal(size=(3, 70, 300)).astype(np.float32)\n"
        "b = rng.normal(size=(3, 300, 500)).astype(np.float32)\n"
        "c = np.zeros((3, 70, 500), np.float32)\n"
        "_lib.gemm_f32_batched(a, b, c)\n"
        "q = np.zeros((3, 70, 500), np.int32)\n"
        "_lib.gemm_i8_batched((a * 40).astype(np.int8), (b * 40).astype(np.int8), q, 37, 20)\n"
        "np.save(sys.argv[1], np.concatenate([c.view(np.int32).ravel(), q.ravel()]))\n"
    )
    results = []
    for threads in ("1", "2"):
        path = tmp_path / f"t{threads}.npy"
        env = dict(__import__("os").environ, TVM_SPINN_SIM_THREADS=threads)
        subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True)
        results.append(np.load(path))
    assert np.array_equal(results[0], results[1])


def test_bad_arguments_raise():
    f = np.zeros((1, 2, 3), np.float32)
    b = np.zeros((1, 3, 4), np.float32)
    c = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(ValueError, match="shape mismatch"):
        _lib.gemm_f32_batched(f, np.zeros((1, 4, 4), np.float32), c)
    with pytest.raises(TypeError, match="dtype"):
        _lib.gemm_f32_batched(f.astype(np.float64), b, c)
    with pytest.raises(ValueError, match="3-D"):
        _lib.gemm_f32_batched(f[0], b, c)
    with pytest.raises(IndexError, match="a_index"):
        _lib.gemm_f32_batched(f, b, c, a_index=np.array([1]))
    with pytest.raises(IndexError, match="b_index"):
        _lib.gemm_f32_batched(f, b, c, b_index=np.array([-1]))
    with pytest.raises(ValueError, match="shape mismatch"):
        _lib.gemm_f32_batched(f, b, c, a_index=np.array([0, 0]))
    with pytest.raises(ValueError, match="C-contiguous"):
        _lib.gemm_f32_batched(f, b, np.zeros((1, 4, 2), np.float32).transpose(0, 2, 1))
    with pytest.raises(ValueError, match="overlaps"):
        buf = np.zeros(64, np.float32)
        _lib.gemm_f32_batched(buf[:6].reshape(1, 2, 3), b, buf[:8].reshape(1, 2, 4))
    with pytest.raises(ValueError, match="threads"):
        _lib.gemm_f32_batched(f, b, c, threads=-1)
    qa, qb, qc = np.zeros((1, 2, 3), np.int8), np.zeros((1, 3, 4), np.int8), np.zeros((1, 2, 4), np.int32)
    with pytest.raises(ValueError, match="acc_bits"):
        _lib.gemm_i8_batched(qa, qb, qc, 4, 40)
    with pytest.raises(ValueError, match="chunk"):
        _lib.gemm_i8_batched(qa, qb, qc, 0, 24)
    with pytest.raises(TypeError, match="dtype"):
        _lib.gemm_i8_batched(qa, qb, qc.astype(np.int64), 4, 24)
    x = np.zeros((1, 4, 5, 5), np.float32)
    with pytest.raises(ValueError, match="divisible"):
        _lib.im2col(x, (3, 3), groups=3)
    with pytest.raises(TypeError, match="dtype"):
        _lib.im2col(x.astype(np.float64), (3, 3))
    with pytest.raises(ValueError, match="geometry"):
        _lib.im2col(x, (3, 3), strides=(0, 1))


def test_read_only_inputs_not_copied():
    """Read-only operands (a program's constants) are read in place."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(1, 3, 4)).astype(np.float32)
    b = rng.normal(size=(1, 4, 5)).astype(np.float32)
    a.flags.writeable = False
    b.flags.writeable = False
    c = np.zeros((1, 3, 5), np.float32)
    _lib.gemm_f32_batched(a, b, c)
    assert np.array_equal(_bits(c[0]), _bits(_ref_f32(a[0], b[0], np.zeros((3, 5), np.float32))))


def _epilogue_ref(c, bias, on_rows, relu, clip, lo, hi):
    """fl(c + bias), then x > 0 ? x : +0, then (x < hi ? x : hi) > lo ? . : lo, in float32, a NaN
    kept through relu and clip (PyTorch's relu and clamp)."""
    out = c.copy()
    with np.errstate(all="ignore"):
        if bias.size:
            out = (out + (bias[None, :, None] if on_rows else bias[None, None, :])).astype(np.float32)
        if relu:
            out = np.where((out > 0) | np.isnan(out), out, np.float32(0)).astype(np.float32)
        if clip:
            y = np.where((out < np.float32(hi)) | np.isnan(out), out, np.float32(hi)).astype(np.float32)
            out = np.where((y > np.float32(lo)) | np.isnan(y), y, np.float32(lo)).astype(np.float32)
    return out


def _specials(x, rng):
    flat = x.reshape(-1)
    flat[rng.integers(0, flat.size, 3)] = np.nan
    flat[rng.integers(0, flat.size, 3)] = np.inf
    flat[rng.integers(0, flat.size, 3)] = -np.inf
    flat[rng.integers(0, flat.size, 5)] = -0.0
    return x


@pytest.mark.parametrize("on_rows", [True, False])
@pytest.mark.parametrize("relu,clip,lo,hi", [(False, False, 0, 0), (True, False, 0, 0), (False, True, 0.0, 6.0),
                                             (True, True, -0.0, 0.5), (False, True, -1.5, np.nan)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_epilogue_f32_bits(on_rows, relu, clip, lo, hi, with_bias):
    rng = np.random.default_rng(0)
    c = _specials((rng.normal(size=(3, 5, 37)) * 4).astype(np.float32), rng)
    bias = rng.normal(size=5 if on_rows else 37).astype(np.float32) if with_bias else np.zeros(0, np.float32)
    want = _epilogue_ref(c, bias, on_rows, relu, clip, lo, hi)
    _lib._func("tvm_spinn.sim.epilogue_f32")(c, bias, on_rows, relu, clip, lo, hi, 2)
    assert np.array_equal(_bits(c), _bits(want))  # NaN + number: the NaN, whatever the order


@pytest.mark.parametrize("geom", [
    # (groups, mult, H, W, kh, kw, strides, dilation, (pad_top, pad_left, pad_bottom, pad_right))
    (4, 1, 9, 11, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)),
    (3, 2, 8, 8, 3, 3, (2, 2), (1, 1), (0, 1, 1, 0)),
    (2, 3, 10, 7, 2, 3, (1, 2), (2, 1), (2, 0, 1, 3)),
    (5, 1, 4, 4, 5, 5, (1, 1), (1, 1), (3, 3, 3, 3)),
    (1, 2, 6, 40, 1, 1, (1, 1), (1, 1), (0, 0, 0, 0)),
    (2, 1, 12, 12, 3, 3, (3, 1), (1, 2), (0, 0, 2, 2)),
    # rows of one or two vectors, computed four vectors at a time across rows; stride 2's
    # column phases split with vector shuffles (odd and even widths)
    (3, 1, 17, 16, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)),
    (6, 1, 33, 32, 3, 3, (2, 2), (1, 1), (0, 0, 1, 1)),
    (2, 2, 21, 37, 3, 3, (2, 2), (1, 1), (1, 1, 1, 1)),
    # small maps (ow <= 8) with >= 8 channels: 8 channels in the lanes (a partial last block)
    (16, 1, 4, 4, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)),
    (12, 1, 5, 6, 3, 3, (2, 2), (1, 1), (1, 1, 1, 1)),
    (9, 1, 3, 2, 3, 3, (1, 1), (2, 1), (2, 1, 2, 1)),
    (8, 1, 8, 8, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)),
])
@pytest.mark.parametrize("epilogue", [(False, False, False), (True, True, False), (True, False, True)])
def test_depthwise_conv2d_f32_bits(geom, epilogue):
    """The direct depthwise kernel has the bits of im2col (+0.0 padding) + the batched GEMM +
    the epilogue, NaN, infinities and signed zeros included."""
    groups, mult, h, w, kh, kw, strides, dilation, padding = geom
    with_bias, relu, clip = epilogue
    rng = np.random.default_rng(1)
    n = 2
    x = _specials(rng.normal(size=(n, groups, h, w)).astype(np.float32), rng)
    wt = _specials(rng.normal(size=(groups * mult, kh, kw)).astype(np.float32), rng)
    bias = rng.normal(size=groups * mult).astype(np.float32) if with_bias else np.zeros(0, np.float32)
    pt, pl, pb, pr = padding
    oh = (h + pt + pb - dilation[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (w + pl + pr - dilation[1] * (kw - 1) - 1) // strides[1] + 1
    cols = _im2col_ref(x, kh, kw, strides, dilation, padding, groups, np.float32(0), oh, ow)  # [n*g, kh*kw, P]
    want = np.empty((n, groups * mult, oh * ow), np.float32)
    for img in range(n):
        for g in range(groups):
            acc = _ref_f32(wt[g * mult:(g + 1) * mult].reshape(mult, kh * kw), cols[img * groups + g],
                           np.zeros((mult, oh * ow), np.float32))
            want[img, g * mult:(g + 1) * mult] = acc
    want = _epilogue_ref(want, bias, True, relu, clip, -0.25, 1.5).reshape(n, groups * mult, oh, ow)
    # what the simulator's GEMM path computes: im2col + the batched GEMM + the epilogue kernel
    gemm = np.zeros((n * groups, mult, oh * ow), np.float32)
    index = np.arange(n * groups, dtype=np.int64)
    _lib.gemm_f32_batched(wt.reshape(groups, mult, kh * kw), cols, gemm, index % groups, index)
    gemm = gemm.reshape(n, groups * mult, oh * ow)
    _lib._func("tvm_spinn.sim.epilogue_f32")(gemm, bias, True, relu, clip, -0.25, 1.5, 1)
    for threads in (1, 2):
        out = np.zeros((n, groups * mult, oh, ow), np.float32)
        _lib._func("tvm_spinn.sim.depthwise_conv2d_f32")(
            x, wt, out, bias, [strides[0], strides[1], dilation[0], dilation[1], pt, pl], relu, clip, -0.25, 1.5, threads)
        # numbers bit for bit against the sequential reference (a NaN's payload depends on which
        # operand numpy's loops return: NaN-ness only), and every bit against the GEMM path
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(out), nan) and np.array_equal(_bits(out)[~nan], _bits(want)[~nan]), threads
        assert np.array_equal(_bits(out), _bits(gemm.reshape(out.shape))), threads


def test_depthwise_and_epilogue_bad_arguments():
    conv = _lib._func("tvm_spinn.sim.depthwise_conv2d_f32")
    epilogue = _lib._func("tvm_spinn.sim.epilogue_f32")
    x = np.zeros((1, 4, 5, 5), np.float32)
    wt = np.zeros((8, 3, 3), np.float32)
    out = np.zeros((1, 8, 3, 3), np.float32)
    none = np.zeros(0, np.float32)
    with pytest.raises(ValueError, match="geometry"):
        conv(x, wt, out, none, [1, 1, 1], False, False, 0.0, 0.0, 0)
    with pytest.raises(ValueError, match="bad geometry"):
        conv(x, np.zeros((6, 3, 3), np.float32), out, none, [1, 1, 1, 1, 0, 0], False, False, 0.0, 0.0, 0)
    with pytest.raises(ValueError, match="out.shape"):
        conv(x, wt, np.zeros((1, 4, 3, 3), np.float32), none, [1, 1, 1, 1, 0, 0], False, False, 0.0, 0.0, 0)
    with pytest.raises(ValueError, match="bias.shape"):
        conv(x, wt, out, np.zeros(3, np.float32), [1, 1, 1, 1, 0, 0], False, False, 0.0, 0.0, 0)
    with pytest.raises(TypeError, match="dtype"):
        epilogue(np.zeros((1, 2, 2), np.float64), none, True, False, False, 0.0, 0.0, 0)
    with pytest.raises(ValueError, match="bias.shape"):
        epilogue(np.zeros((1, 2, 3), np.float32), np.zeros(2, np.float32), False, True, False, 0.0, 0.0, 0)


# -- the exp/log unit's models -------------------------------------------------------------------
def _exp_reference(x: np.ndarray) -> np.ndarray:
    """The exp model's algorithm, operation by operation in numpy float32 (each op one IEEE
    rounding; ``np.ldexp`` scales exactly): what the C++ kernel must equal bit for bit."""
    f = np.float32
    x = x.astype(f)
    out = np.empty_like(x)
    with np.errstate(all="ignore"):
        fn = np.rint((x * f(1.44269504088896341)).astype(f))
        r = (x - (fn * f(0.693359375)).astype(f)).astype(f)
        r = (r - (fn * f(-2.12194440e-4)).astype(f)).astype(f)
        r2 = (r * r).astype(f)
        p = np.full_like(x, f(1.9875691500e-4))
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = ((p * r).astype(f) + f(c)).astype(f)
        p = (((p * r2).astype(f) + r).astype(f) + f(1)).astype(f)
        scaled = np.ldexp(p, np.nan_to_num(fn, nan=0, posinf=0, neginf=0).astype(np.int32)).astype(f)
    out[...] = scaled
    out[x > f(88.72283905206835)] = np.inf
    out[x < f(-103.97208)] = 0
    out[np.isnan(x)] = x[np.isnan(x)]
    return out


def test_exp_model_is_its_algorithm_and_accurate():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-110, 95, 200_000), rng.normal(size=100_000),
                        [0.0, -0.0, 1.0, -1.0, 88.72, 88.73, -103.9, -104.0, np.inf, -np.inf, np.nan, 1e-30]]).astype(np.float32)
    out = np.empty_like(x)
    _lib._func("tvm_spinn.sim.exp_f32")(x, out)
    want = _exp_reference(x)
    assert np.array_equal(_bits(out), _bits(want))
    exact = np.exp(x.astype(np.float64))
    normal = (exact > 1.2e-38) & np.isfinite(exact) & (exact < 3.4e38)
    ulp = np.spacing(exact[normal].astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(out[normal] - exact[normal]) / ulp) < 1.0  # faithfully rounded
    assert out[-4] == np.inf and out[-3] == 0 and np.isnan(out[-2]) and out[-1] == 1


def test_tanh_model():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(size=200_000) * 3, [0.0, -0.0, 0.625, -0.625, 44.5, -50, np.inf, -np.inf, np.nan]]).astype(np.float32)
    out = np.empty_like(x)
    _lib._func("tvm_spinn.sim.tanh_f32")(x, out)
    exact = np.tanh(x.astype(np.float64))
    finite = np.isfinite(x)
    ulp = np.spacing(np.abs(exact[finite]).astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(out[finite] - exact[finite]) / ulp) < 2.0
    assert np.signbit(out[np.where(x == 0)[0][1]]) and out[-3] == 1 and out[-2] == -1 and np.isnan(out[-1])
    assert np.all(np.abs(out[finite]) <= 1)


def test_transcendental_models_do_not_depend_on_numpy_simd(tmp_path):
    """The simulator's exp is the same with numpy's SIMD paths disabled (numpy's own float32
    exp is not: it gives other bits on its baseline path)."""
    code = ("import numpy as np, hashlib; from tvm_spinn.program.ops.elementwise import exp_f32, tanh_f32;"
            "x = (np.random.default_rng(0).normal(size=1 << 16) * 10).astype(np.float32);"
            "print(hashlib.sha256(exp_f32(x).tobytes() + tanh_f32(x).tobytes()).hexdigest())")
    import os
    runs = []
    for disable in ("", "X86_V3 AVX512F AVX2 FMA3"):
        env = dict(os.environ, NPY_DISABLE_CPU_FEATURES=disable)
        runs.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)
    assert runs[0] == runs[1] and len(runs[0].strip()) == 64


def _softmax_reference(x):
    """numpy float32, row by row: e = exp_model(x - max), sequential sum, divide."""
    e = np.empty_like(x)
    _lib._func("tvm_spinn.sim.exp_f32")(np.ascontiguousarray(x - x.max(axis=1, keepdims=True)), e)
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        s = np.float32(0)
        for v in e[r]:
            s = np.float32(s + v)
        out[r] = e[r] / s
    return out


def _blocked_sum(v, block):
    """numpy float32: blocks of ``block`` elements summed left to right from 0, the block sums
    added left to right from 0."""
    total = np.float32(0)
    for b in range(0, len(v), block):
        s = np.float32(0)
        for e in v[b:b + block]:
            s = np.float32(s + e)
        total = np.float32(total + s)
    return total


def _layer_norm_reference(x, gamma, beta, eps):
    """numpy float32, row by row, both sums blocked (rows.LAYER_NORM_BLOCK)."""
    from tvm_spinn.program.ops.rows import LAYER_NORM_BLOCK

    d = np.float32(x.shape[1])
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        s = _blocked_sum(x[r], LAYER_NORM_BLOCK)
        c = (x[r] - s / d).astype(np.float32)
        q = _blocked_sum((c * c).astype(np.float32), LAYER_NORM_BLOCK)
        y = (c / np.sqrt(np.float32(q / d) + np.float32(eps))).astype(np.float32)
        if gamma is not None:
            y = (y * gamma).astype(np.float32)
        if beta is not None:
            y = (y + beta).astype(np.float32)
        out[r] = y
    return out


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 64), (2, 300), (2, 1024)])
@pytest.mark.parametrize("threads", [1, 2])
def test_softmax_and_layer_norm_rows_bits(shape, threads):
    rng = np.random.default_rng(sum(shape))
    x = (rng.normal(size=shape) * 5).astype(np.float32)
    x[0, 0] = -0.0
    out = np.empty_like(x)
    _lib._func("tvm_spinn.sim.softmax_f32")(x, out, threads)
    assert np.array_equal(_bits(out), _bits(_softmax_reference(x)))
    gamma = rng.normal(size=shape[1]).astype(np.float32)
    beta = rng.normal(size=shape[1]).astype(np.float32)
    for g, b in ((gamma, beta), (None, beta), (gamma, None), (None, None)):
        none = np.zeros(0, np.float32)
        _lib._func("tvm_spinn.sim.layer_norm_f32")(x, none if g is None else g, none if b is None else b, 1e-5, out, threads)
        assert np.array_equal(_bits(out), _bits(_layer_norm_reference(x, g, b, np.float32(1e-5))))


def test_layer_norm_sums_are_blocked_not_sequential():
    # 1e8 has an fp32 ulp of 8: a sequential sum of 1e8 and 33 ones never moves, while the
    # blocked order adds the second block's 32 ones as one 32.0 (and the first block's, after
    # 1e8, are lost): the mean differs, and so does every output
    x = np.ones((1, 64), np.float32)
    x[0, 0] = 1e8
    out, none = np.empty_like(x), np.zeros(0, np.float32)
    _lib._func("tvm_spinn.sim.layer_norm_f32")(x, none, none, 0.0, out, 1)
    sequential = np.float32(0)
    for v in x[0]:
        sequential = np.float32(sequential + v)
    assert sequential == np.float32(1e8) and _blocked_sum(x[0], 32) == np.float32(1e8 + 32)
    assert np.array_equal(_bits(out), _bits(_layer_norm_reference(x, None, None, np.float32(0.0))))


def test_softmax_rows_special_values():
    x = np.array([[1.0, np.nan, 2.0], [-np.inf, -np.inf, -np.inf], [np.inf, 1.0, 0.0], [-0.0, 0.0, -0.0]], np.float32)
    out = np.empty_like(x)
    _lib._func("tvm_spinn.sim.softmax_f32")(x, out, 1)
    # a NaN max; -inf - -inf; inf - inf: one NaN makes the row's sum, and so every output, NaN
    assert np.isnan(out[:3]).all()
    assert np.allclose(out[3], 1 / 3) and out[3, 0] == out[3, 1]


def _activation_reference(kind, x):
    """The activations as numpy float32 expressions (each operation one rounding), with the
    exp model for exp and tanh."""
    f = np.float32
    exp = lambda v: _unit("tvm_spinn.sim.exp_f32", v)  # noqa: E731
    tanh = lambda v: _unit("tvm_spinn.sim.tanh_f32", v)  # noqa: E731
    with np.errstate(all="ignore"):
        if kind == "sigmoid":
            return (f(1) / (f(1) + exp(-x))).astype(f)
        if kind == "gelu_tanh":
            inner = f(0.7978845608028654) * (x + f(0.044715) * x * x * x)
            return (f(0.5) * x * (f(1) + tanh(inner))).astype(f)
        u = x * f(0.70710678118654752)
        sign = np.sign(u).astype(f)
        a = np.abs(u)
        t = f(1) / (f(1) + f(0.3275911) * a)
        poly = t * (f(0.254829592) + t * (f(-0.284496736) + t * (f(1.421413741) + t * (f(-1.453152027) + t * f(1.061405429)))))
        erf = (sign * (f(1) - poly * exp(-a * a))).astype(f)
        return (f(0.5) * x * (f(1) + erf)).astype(f)


def _unit(name, x):
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    _lib._func(name)(x, out)
    return out


@pytest.mark.parametrize("kind,code", [("gelu", 0), ("gelu_tanh", 1), ("sigmoid", 2)])
def test_activation_bits(kind, code):
    rng = np.random.default_rng(code)
    x = np.concatenate([rng.normal(size=50_000) * 4, [0.0, -0.0, 1e-30, -1e-30, 30, -30, 100, -100]]).astype(np.float32)
    out = np.empty_like(x)
    _lib._func("tvm_spinn.sim.activation_f32")(x, out, code)
    assert np.array_equal(_bits(out), _bits(_activation_reference(kind, x)))
    with pytest.raises(ValueError, match="kind"):
        _lib._func("tvm_spinn.sim.activation_f32")(x, out, 7)


@pytest.mark.parametrize("dtype", ["int8", "int16", "float32", "float64"])
@pytest.mark.parametrize("shape", [(1, 1), (37, 129), (64, 64), (3072, 770)])
@pytest.mark.parametrize("threads", [1, 2])
def test_transpose2d_matches_numpy(dtype, shape, threads):
    """The compiler's weight transpose (constant folding of permute_dims on weights)."""
    src = np.random.default_rng(0).integers(-100, 100, shape).astype(dtype)
    dst = np.empty(shape[::-1], dtype)
    _lib.transpose2d(src, dst, threads)
    assert np.array_equal(dst, src.T)


def test_transpose2d_names_bad_arguments():
    with pytest.raises(ValueError, match="dst.shape\\[0\\] is 3 but must be 4"):
        _lib.transpose2d(np.zeros((3, 4), "f4"), np.zeros((3, 4), "f4"))
    with pytest.raises(TypeError, match="`dst` must have dtype float32"):
        _lib.transpose2d(np.zeros((3, 4), "f4"), np.zeros((4, 3), "i4"))
    with pytest.raises(ValueError, match="must be 2-D"):
        _lib.transpose2d(np.zeros((3, 4, 1), "f4"), np.zeros((4, 3), "f4"))
    with pytest.raises(ValueError, match="C-contiguous"):
        _lib.transpose2d(np.zeros((4, 3), "f4").T, np.zeros((4, 3), "f4"))
