"""int8 on the MAC arrays: the simulator's integer results against an independent reference.

The reference is numpy int64 arithmetic written from the rule documented in
``tvm_spinn.program.quant`` (not by calling it): ``acc = sum (x - zx)(w - zw)`` exactly, bias
quantized with round-half-even at scale ``sx * sw``, the real multiplier ``sx * sw / sy`` as a
31-bit fixed-point ``M0 * 2**-shift``, rounding half up, saturation to the output type. Integer
outputs must be equal, not close. Element-wise quantize/dequantize are compared with the same
Relax module built for llvm (TVM's legalization is the reference), also exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn import _lib
from tvm_spinn.partition import summarize_partition

RANGES = {"int8": (-128, 127), "uint8": (0, 255)}


# -- reference ------------------------------------------------------------------------------
def ref_multiplier(m: float) -> tuple[int, int]:
    """Fixed-point M0 (31 bits) and right shift with m = M0 / 2**shift, by search over shift."""
    if m == 0:
        return 0, 1
    shift = 0
    while m * 2.0**shift < 2.0**30:  # normalize into [2**30, 2**31)
        shift += 1
    m0 = round(m * 2.0**shift)
    if m0 == 2**31:
        m0, shift = 2**30, shift - 1
    return m0, shift


def ref_requant(acc: np.ndarray, real_mult: np.ndarray, zy: int, dtype: str, relu: bool) -> np.ndarray:
    out = np.empty(acc.shape, dtype=np.int64)
    lo, hi = RANGES[dtype]
    flat_acc = acc.reshape(acc.shape[0], -1) if acc.ndim > 1 else acc[:, None]
    flat_out = out.reshape(flat_acc.shape)
    for c in range(flat_acc.shape[0]):
        m0, shift = ref_multiplier(float(real_mult[c]))
        v = [int(a) * m0 for a in flat_acc[c]]  # Python ints: no overflow anywhere
        q = [(p + (1 << (shift - 1))) >> shift for p in v]
        flat_out[c] = np.clip(np.array(q, dtype=np.int64) + zy, max(lo, zy) if relu else lo, hi)
    return out


def conv_acc(x, w, zx, zw, stride, pad, groups):
    """sum (x - zx)(w - zw) over the window, exactly (float64 sums of integers < 2**53)."""
    xs = x.astype(np.float64) - zx
    ws = w.astype(np.float64) - np.asarray(zw, dtype=np.float64).reshape(-1, 1, 1, 1)
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    xp = np.pad(xs, ((0, 0), (0, 0), (pad, pad), (pad, pad)))  # padding is real 0 = (zx - zx)
    oh, ow = (h + 2 * pad - kh) // stride + 1, (wd + 2 * pad - kw) // stride + 1
    out = np.zeros((n, o, oh, ow))
    og = o // groups
    for g in range(groups):
        for i in range(kh):
            for j in range(kw):
                patch = xp[:, g * cg:(g + 1) * cg, i:i + stride * (oh - 1) + 1:stride, j:j + stride * (ow - 1) + 1:stride]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, ws[g * og:(g + 1) * og, :, i, j])
    return out.astype(np.int64)


# -- module builders ------------------------------------------------------------------------
def _c(v, dtype):
    return relax.const(np.asarray(v).astype(dtype), dtype)


def qgemm_module(xshape, xdtype, wq, sw, zw, sx, zx, *, op="conv2d", bias=None, relu=False, out=None,
                 conv_attrs=None, w_axis=0, wdtype="int8", b_shape=None):
    """main(xq [, bq]) = [quantize](relu(gemm(dequantize(xq), dequantize(W)) + bias))."""
    bb = relax.BlockBuilder()
    xq = relax.Var("xq", relax.TensorType(list(xshape), xdtype))
    params = [xq]
    if op == "matmul":
        bq = relax.Var("bq", relax.TensorType(list(b_shape), wdtype))
        params.append(bq)
    with bb.function("main", params):
        with bb.dataflow():
            x = bb.emit(relax.op.dequantize(xq, _c(sx, "float32"), _c(zx, xdtype)))
            if op == "matmul":
                w = bb.emit(relax.op.dequantize(bq, _c(sw, "float32"), _c(zw, wdtype)))
                y = bb.emit(relax.op.matmul(x, w))
            else:
                w = bb.emit(relax.op.dequantize(_c(wq, wdtype), _c(sw, "float32"), _c(zw, wdtype), axis=w_axis))
                y = bb.emit(relax.op.nn.conv2d(x, w, **(conv_attrs or {})) if op == "conv2d" else relax.op.matmul(x, w))
            if bias is not None:
                shape = (1, -1, 1, 1) if op == "conv2d" else (-1,)
                y = bb.emit(relax.op.add(y, _c(np.asarray(bias).reshape(shape), "float32")))
            if relu:
                y = bb.emit(relax.op.nn.relu(y))
            if out is not None:
                sy, zy, ydtype = out
                y = bb.emit(relax.op.quantize(y, _c(sy, "float32"), _c(zy, ydtype), out_dtype=ydtype))
            gv = bb.emit_output(y)
        bb.emit_func_output(gv)
    return bb.get()


def run_spinn(mod, *inputs, target="spinn"):
    part = tvm_spinn.partition_for_spinn(mod, target)
    summary = summarize_partition(part)
    assert not summary.fallback_ops, summary
    ex = relax.build(mod, target=target)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy(), summary


def run_llvm(mod, *inputs):
    ex = relax.build(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy()


# -- tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("xdtype,groups,relu,per_channel", [
    ("int8", 1, True, True), ("uint8", 1, False, True), ("int8", 4, True, False), ("uint8", 8, False, True),
])
def test_qconv2d_requant_bit_exact(xdtype, groups, relu, per_channel):
    rng = np.random.default_rng(10 + groups)
    lo, hi = RANGES[xdtype]
    c, o = 8, 8 if groups == 8 else 16
    x = rng.integers(lo, hi + 1, size=(1, c, 9, 9)).astype(xdtype)
    w = rng.integers(-127, 128, size=(o, c // groups, 3, 3)).astype("int8")
    sx, zx = 0.02, (7 if xdtype == "int8" else 131)
    sw = rng.uniform(0.002, 0.01, size=o if per_channel else 1).astype("float32")
    bias = rng.normal(scale=0.5, size=o).astype("float32")
    sy, zy = (0.05 if groups == 1 else 0.01), (-5 if xdtype == "int8" else 120)
    mod = qgemm_module(x.shape, xdtype, w, sw, np.zeros_like(sw, dtype="int8"), sx, zx, bias=bias, relu=relu,
                       out=(sy, zy, xdtype), conv_attrs=dict(strides=2, padding=1, groups=groups))
    got, summary = run_spinn(mod, x)
    assert any(k.startswith("spinn.qconv2d") for k in summary.offloaded_ops)
    assert got.dtype == np.dtype(xdtype)

    acc = conv_acc(x, w, zx, 0, 2, 1, groups)
    s_acc = np.float64(np.float32(sx)) * np.broadcast_to(sw.astype(np.float64), (o,))
    bias_q = np.rint(bias.astype(np.float64) / s_acc).astype(np.int64)
    acc = acc + bias_q[None, :, None, None]
    mult = s_acc / np.float64(np.float32(sy))
    want = ref_requant(acc[0], mult, zy, xdtype, relu)[None]
    np.testing.assert_array_equal(got.astype(np.int64), want)
    # the numbers are not trivial: both rails and the interior are hit
    assert (want == hi).any() and ((want == lo).any() or (relu and (want == zy).any()))


def test_qconv2d_asymmetric_uint8_weights_fp32_out():
    """Asymmetric uint8 weights (w_zero != 0 after the 128 flip) with a float32 epilogue."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, size=(2, 6, 7, 7)).astype("uint8")
    w = rng.integers(0, 256, size=(5, 6, 3, 3)).astype("uint8")
    sx, zx, sw, zw = 0.03, 100, np.float32(0.004), 117
    bias = rng.normal(size=5).astype("float32")
    mod = qgemm_module(x.shape, "uint8", w, sw, zw, sx, zx, bias=bias, relu=True, wdtype="uint8",
                       conv_attrs=dict(padding=1))
    got, _ = run_spinn(mod, x)
    acc = conv_acc(x, w, zx, zw, 1, 1, 1)
    assert np.abs(acc).max() < 2**24  # exactly representable in fp32 on the way out
    scale = np.float32(np.float64(np.float32(sx)) * np.float64(sw))
    want = np.maximum(acc.astype(np.float32) * scale + bias[None, :, None, None], np.float32(0))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("out_dtype", ["int8", None])
def test_qdense_per_channel(out_dtype):
    rng = np.random.default_rng(4)
    m, k, n = 24, 300, 40
    x = rng.integers(-128, 128, size=(m, k)).astype("int8")
    w = rng.integers(-127, 128, size=(k, n)).astype("int8")
    sx, zx = 0.01, -3
    sw = rng.uniform(0.001, 0.005, size=n).astype("float32")
    bias = rng.normal(size=n).astype("float32")
    out = (0.2, 4, "int8") if out_dtype else None
    mod = qgemm_module(x.shape, "int8", w, sw, np.zeros(n, "int8"), sx, zx, op="dense", bias=bias,
                       out=out, w_axis=1)
    got, summary = run_spinn(mod, x)
    assert any(k.startswith("spinn.qdense") for k in summary.offloaded_ops)
    acc = (x.astype(np.int64) - zx) @ w.astype(np.int64)
    s_acc = np.float64(np.float32(sx)) * sw.astype(np.float64)
    if out_dtype:
        acc = acc + np.rint(bias.astype(np.float64) / s_acc).astype(np.int64)[None]
        want = ref_requant(acc.T.copy(), s_acc / np.float64(np.float32(0.2)), 4, "int8", False).T
        np.testing.assert_array_equal(got.astype(np.int64), want)
    else:
        want = acc.astype(np.float32) * s_acc.astype(np.float32)[None] + bias[None]
        np.testing.assert_array_equal(got, want)


def test_qmatmul_two_activations():
    rng = np.random.default_rng(5)
    a = rng.integers(0, 256, size=(2, 3, 16, 20)).astype("uint8")
    b = rng.integers(0, 256, size=(2, 3, 20, 12)).astype("uint8")
    mod = qgemm_module(a.shape, "uint8", None, 0.02, 140, 0.05, 90, op="matmul", wdtype="uint8",
                       b_shape=b.shape, out=(0.9, 128, "uint8"))
    got, summary = run_spinn(mod, a, b)
    assert any(k.startswith("spinn.qmatmul") for k in summary.offloaded_ops)
    acc = np.einsum("bhmk,bhkn->bhmn", a.astype(np.int64) - 90, b.astype(np.int64) - 140)
    mult = np.float64(np.float32(0.05)) * np.float64(np.float32(0.02)) / np.float64(np.float32(0.9))
    flat = acc.reshape(-1)[None]
    want = ref_requant(flat, [mult], 128, "uint8", False).reshape(acc.shape)
    np.testing.assert_array_equal(got.astype(np.int64), want)


@pytest.mark.parametrize("target,k", [("spinn", 2000), ("spinn/testchip", 20000)])
def test_reduction_longer_than_the_accumulator(target, k):
    """K products of 127*127: one unsplit accumulation wraps (24 bits on the production chip, 29
    on the test chip); the mapping splits it at the safe length and the result is exact."""
    arch = tvm_spinn.arch_of(target)
    limit = (2 ** (arch.acc_bits - 1) - 1) // (128 * 128)  # -128 * -128 products that fit
    assert k * 127 * 127 >= 2 ** (arch.acc_bits - 1)
    x = np.full((4, k), 127, dtype="int8")
    x[1] = -128
    x[2, ::2] = -128
    w = np.full((k, 8), 127, dtype="int8")
    w[:, 3] = -127
    # what a naive, unsplit accumulation on the array gives
    naive = np.zeros((4, 8), dtype=np.int32)
    wraps = _lib.gemm_i8(x, w, naive, arch.acc_bits)
    exact = x.astype(np.int64) @ w.astype(np.int64)
    assert wraps > 0 and not np.array_equal(naive.astype(np.int64), exact)

    sx, sw, sy = 0.01, np.float32(0.01), 2e-3 * k  # rows 0, 1 saturate, row 2 stays in range
    mod = qgemm_module(x.shape, "int8", w, sw, 0, sx, 0, op="dense", out=(sy, 0, "int8"))
    got, _ = run_spinn(mod, x, target=target)
    mult = np.float64(np.float32(sx)) * np.float64(sw) / np.float64(np.float32(sy))
    want = ref_requant(exact.T.copy(), np.full(8, mult), 0, "int8", False).T
    np.testing.assert_array_equal(got.astype(np.int64), want)
    assert (want == 127).any() and (want == -128).any()  # saturation is exercised
    # the program the simulator ran split K into chunks no longer than the safe length
    (prog,) = tvm_spinn.report(relax.build(mod, target=target)).programs
    (dense,) = [i for i, layer in enumerate(prog.layers) if layer.mode == "int8"]
    from tvm_spinn.program.tiles import layer_tiles

    splits = {t.k_splits for t in layer_tiles(prog, dense)}
    assert splits and all(-(-k // s) <= limit for s in splits)


@pytest.mark.parametrize("axis,dtype", [(None, "int8"), (1, "uint8")])
def test_quantize_dequantize_match_tvm(axis, dtype):
    rng = np.random.default_rng(6)
    x = (rng.normal(size=(2, 5, 6, 6)) * 3).astype("float32")
    x[0, 0, 0, :4] = [0.25, 0.75, -0.25, 1e6]  # ties (round half even) and saturation
    n = 5 if axis is not None else 1
    scale = rng.uniform(0.01, 0.05, size=n).astype("float32")
    scale[0] = 0.5
    zero = rng.integers(-10, 10, size=n) + (128 if dtype == "uint8" else 0)
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType(list(x.shape), "float32"))
    with bb.function("main", [xv]):
        with bb.dataflow():
            s = _c(scale if n > 1 else scale[0], "float32")
            z = _c(zero if n > 1 else zero[0], dtype)
            q = bb.emit(relax.op.quantize(xv, s, z, axis=axis if axis is not None else -1, out_dtype=dtype))
            d = bb.emit(relax.op.dequantize(q, s, z, axis=axis if axis is not None else -1))
            gv = bb.emit_output(relax.Tuple([q, d]))
        bb.emit_func_output(gv)
    mod = bb.get()
    part = summarize_partition(tvm_spinn.partition_for_spinn(mod))
    assert part.offloaded_ops == {"spinn.dequantize": 1, "spinn.quantize": 1}
    ex = relax.build(mod, target="spinn")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    ref = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x))
    np.testing.assert_array_equal(got[0].numpy(), ref[0].numpy())
    np.testing.assert_array_equal(got[1].numpy(), ref[1].numpy())


def test_int8_layers_are_mapped_as_int8(tmp_path):
    """The program records mode=int8 GEMMs with int8 weights and the same bits after export."""
    rng = np.random.default_rng(7)
    x = rng.integers(-128, 128, size=(1, 8, 8, 8)).astype("int8")
    w = rng.integers(-127, 128, size=(16, 8, 3, 3)).astype("int8")
    mod = qgemm_module(x.shape, "int8", w, np.float32(0.01), 0, 0.02, 0, out=(0.1, 0, "int8"),
                       conv_attrs=dict(padding=1))
    ex = relax.build(mod, target="spinn")
    rep = tvm_spinn.report(ex)
    assert [row["mode"] for row in rep.layers if row["kind"] == "conv2d"] == ["int8"]
    assert "int8" in rep.table()
    (prog,) = rep.programs
    (conv,) = [layer for layer in prog.layers if layer.kind == "conv2d"]
    assert prog.tensors[conv.consts["weight"]].dtype == "int8" and prog.tensors[conv.output].dtype == "int8"
    a = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    # against the integer reference: exact accumulation, fixed-point requantization
    mult = np.full(16, np.float64(np.float32(0.02)) * np.float64(np.float32(0.01)) / np.float64(np.float32(0.1)))
    want = ref_requant(conv_acc(x, w, 0, 0, 1, 1, 1)[0], mult, 0, "int8", False)[None]
    np.testing.assert_array_equal(a.astype(np.int64), want)
    assert len(np.unique(want)) > 50  # not saturated
    path = tmp_path / "qconv.so"
    ex.export_library(str(path))
    c = relax.VirtualMachine(tvm_spinn.load_module(str(path)), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_array_equal(a, c)
