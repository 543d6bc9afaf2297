"""GEMM reference arithmetic: the functional simulator's tile and whole-layer steps (fp32 in
ascending k, int8 on wrapping accumulators) and the native plan's instructions."""

from __future__ import annotations

import numpy as np

from .... import _lib
from ...model import Layer
from ...quant import requantize, requantize_tflite, to_signed
from .. import native
from ..elementwise import binary, relu
from .geometry import GemmShape, _F32, chunk_length, gemm_shape


# -- the functional simulator ------------------------------------------------------------------
def _rhs(layer: Layer, env) -> np.ndarray:
    return env[layer.consts["weight"]] if "weight" in layer.consts else env[layer.inputs[1]]


def _im2col_reference(runner, x: np.ndarray, wshape, fill) -> np.ndarray:
    """im2col is pure data movement (what the DMA gathers): rows ordered (c, kh, kw) like the
    OIHW weight, columns are output pixels; padding reads ``fill``."""
    n = x.shape[0]
    attrs = runner.layer.attrs
    groups = attrs["groups"]
    sh, sw = attrs["strides"]
    dh, dw = attrs["dilation"]
    pt, pl, pb, pr = attrs["padding"]
    _, cg, kh, kw = wshape
    oh, ow = runner.out.shape[2], runner.out.shape[3]
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=fill)
    cols = np.empty((n, groups, cg * kh * kw, oh * ow), dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]
            cols[:, :, (np.arange(cg) * kh * kw) + i * kw + j, :] = patch.reshape(n, groups, cg, oh * ow)
    return cols.reshape(n * groups, cg * kh * kw, oh * ow)


def _arrange(runner, x: np.ndarray, rhs: np.ndarray, pad_fill) -> None:
    """GEMM operands as the DMA lays them out: ``a`` [batch-or-group, m, k], ``b`` [batch, k, n].

    conv2d: ``a`` = weight per group, ``b`` = im2col(x) (padding reads ``pad_fill``); dense:
    ``a`` = x, ``b`` = weight; matmul: both broadcast over the batch dims."""
    layer = runner.layer
    g = runner.g = gemm_shape(runner.p, layer)
    if layer.kind == "conv2d":
        groups = layer.attrs["groups"]
        runner.a = np.ascontiguousarray(rhs.reshape(groups, rhs.shape[0] // groups, -1))
        runner.b = _im2col_reference(runner, x, rhs.shape, pad_fill)
        runner.a_index = lambda b: b % groups
    elif layer.kind == "dense":
        runner.a = np.ascontiguousarray(x).reshape(1, g.m, g.k)
        runner.b = np.ascontiguousarray(rhs).reshape(1, g.k, g.n)
        runner.a_index = lambda b: b
    else:
        batch_shape = tuple(runner.out.shape[:-2])
        runner.a = np.ascontiguousarray(np.broadcast_to(x, batch_shape + x.shape[-2:])).reshape(g.batch, g.m, g.k)
        runner.b = np.ascontiguousarray(np.broadcast_to(rhs, batch_shape + rhs.shape[-2:])).reshape(g.batch, g.k, g.n)
        runner.a_index = lambda b: b
    runner.c = runner.out.reshape(g.batch, g.m, g.n)


def _gemm_block(runner, b0: int, m0: int, m1: int, n0: int, n1: int, step: int) -> None:
    """Outputs ``[b0, m0:m1, n0:n1]``: k-chunks of ``step`` in ascending order into one fp32
    accumulator (the same bits for any ``step``), then bias and ReLU."""
    g, layer = runner.g, runner.layer
    a = runner.a[runner.a_index(b0), m0:m1]
    bm = runner.b[b0, :, n0:n1]
    acc = np.zeros((m1 - m0, n1 - n0), dtype=_F32)
    for k0 in range(0, g.k, step):
        _lib.gemm_f32(np.ascontiguousarray(a[:, k0:k0 + step]), np.ascontiguousarray(bm[k0:k0 + step]), acc)
    if runner.bias is not None:
        if layer.kind == "conv2d":
            oc0 = (b0 % layer.attrs["groups"]) * g.m
            acc = acc + runner.bias[oc0 + m0: oc0 + m1, None]
        else:
            acc = acc + runner.bias[None, n0:n1]
    if layer.attrs.get("relu"):
        acc = relu(acc)
    runner.c[b0, m0:m1, n0:n1] = acc


def _qgemm_sums(runner, a: np.ndarray, bm: np.ndarray, k0: int, k1: int, step: int) -> np.ndarray:
    """int32 sums of ``a[:, k0:k1] @ bm[k0:k1]``: one ``acc_bits`` accumulation per k-chunk of
    ``step`` from ``k0`` (a chunk boundary), the chunks' sums added in 32-bit."""
    acc = np.zeros((a.shape[0], bm.shape[1]), dtype=np.int32)
    part = np.empty_like(acc)
    for c0 in range(k0, k1, step):  # chunks fit the accumulator (safe_k_chunk)
        c1 = min(c0 + step, k1)
        part.fill(0)
        _lib.gemm_i8(np.ascontiguousarray(a[:, c0:c1]), np.ascontiguousarray(bm[c0:c1]), part, runner.acc_bits)
        acc += part  # M4F 32-bit adds (wrap like the hardware; never reached for int8 data)
    return acc


def _qgemm_part(runner, b0: int, m0: int, m1: int, n0: int, n1: int, k0: int, k1: int, step: int) -> None:
    """One part (reduction ``[k0, k1)``) of a tile split over PEs: its int32 partial sums wait
    in ``runner.partials`` until the parts cover the whole reduction; then the reducing part
    adds them (32-bit, any order: the same bits) and finishes like :func:`_qgemm_block`."""
    key = (b0, m0, m1, n0, n1)
    a = np.ascontiguousarray(runner.a[runner.a_index(b0), m0:m1])
    bm = np.ascontiguousarray(runner.b[b0, :, n0:n1])
    done, acc = runner.partials.pop(key, (0, None))
    part = _qgemm_sums(runner, a, bm, k0, k1, step)
    acc = part if acc is None else acc + part
    done += k1 - k0
    if done < runner.g.k:
        runner.partials[key] = (done, acc)
        return
    _qgemm_finish(runner, b0, m0, m1, n0, n1, a, bm, acc)


def _qgemm_block(runner, b0: int, m0: int, m1: int, n0: int, n1: int, step: int) -> None:
    """Outputs ``[b0, m0:m1, n0:n1]``: one ``acc_bits`` accumulation per k-chunk of ``step``
    (the wrap points depend on ``step``: callers pass the program's chunk length)."""
    a = np.ascontiguousarray(runner.a[runner.a_index(b0), m0:m1])
    bm = np.ascontiguousarray(runner.b[b0, :, n0:n1])
    _qgemm_finish(runner, b0, m0, m1, n0, n1, a, bm, _qgemm_sums(runner, a, bm, 0, runner.g.k, step))


def _qgemm_finish(runner, b0: int, m0: int, m1: int, n0: int, n1: int, a, bm, acc) -> None:
    """Zero-point terms and epilogue of outputs ``[b0, m0:m1, n0:n1]`` from their int32 sums."""
    g, attrs = runner.g, runner.layer.attrs
    acc = acc.astype(np.int64)
    if runner.layer.kind == "conv2d":
        oc0 = (b0 % attrs["groups"]) * g.m
        ch = np.arange(oc0 + m0, oc0 + m1)[:, None]
        za = runner.za[ch] if runner.za is not None else np.int64(0)
        zb = runner.zb
    else:
        ch = np.arange(n0, n1)[None, :]
        za = runner.za
        zb = runner.zb[ch] if isinstance(runner.zb, np.ndarray) and runner.zb.ndim else runner.zb
    runner.c[b0, m0:m1, n0:n1] = int8_finish(
        acc, za, zb, lambda: a.sum(axis=1, dtype=np.int64)[:, None],
        lambda: bm.sum(axis=0, dtype=np.int64)[None, :], g.k, runner.epi, attrs, ch)


def int8_finish(acc: np.ndarray, za, zb, a_sum, b_sum, k: int, epi: dict, attrs: dict, ch) -> np.ndarray:
    """The M4F's share of an int8 GEMM on the array's int32 sums ``acc`` (int64 array, updated
    in place): the zero-point terms ``sum (a - za)(b - zb) = sum ab - zb sum_k a - za sum_k b +
    K za zb`` in 32-bit registers, then the epilogue: none (an ``int32`` output is the sums),
    dequantize (``fl(acc) * scale [+ bias]`` with the M4F's NaN rule,
    :func:`~tvm_spinn.program.ops.elementwise.binary`; ReLU) or requantize (:func:`~tvm_spinn.program.quant.requantize`). ``a_sum``/``b_sum``
    return the operands' sums over k (called only when the other zero point is nonzero); ``ch``
    indexes the per-channel constants."""
    zb = np.int64(0) if zb is None else zb
    if np.any(zb != 0):
        acc -= zb * a_sum()
    if np.any(za != 0):
        acc -= za * b_sum()
    acc += np.int64(k) * za * zb
    acc = acc.astype(np.int32).astype(np.int64)  # 32-bit registers
    if attrs["out"] == "int32":
        return acc.astype(np.int32)
    if attrs["out"] == "float32":
        # the PE code's VCVT, VMUL and VADD with the M4F's NaNs (0 * inf, inf - inf, NaN
        # constants): the VADD takes the bias as its first operand (two quiet NaNs: the bias's)
        with np.errstate(over="ignore", invalid="ignore"):
            y = binary("multiply", acc.astype(_F32), epi["scale"][ch])
            if "bias" in epi:
                y = binary("add", np.broadcast_to(epi["bias"][ch], y.shape), y)
        if attrs["relu"]:
            y = np.maximum(y, _F32(0))
        return y
    v = acc + epi["bias_q"][ch].astype(np.int64)
    if attrs.get("rounding") == "tflite":
        return requantize_tflite(v, epi["multiplier"][ch], epi["shift"][ch], attrs["y_zero"], attrs["y_min"],
                                 attrs["y_max"])
    return requantize(v, epi["multiplier"][ch], epi["shift"][ch], attrs["y_zero"], attrs["y_min"], attrs["y_max"])


def _batched_operands(program, layer: Layer, out: np.ndarray, x: np.ndarray, rhs: np.ndarray, fill):
    """Batched GEMM operands without copies where the layout allows: ``a`` [a_count, m, k],
    ``b`` [b_count, k, n] and the int64 index vectors picking each output batch's operands (the
    same operands as :func:`_arrange`; conv2d ``b`` is the C++ im2col)."""
    g = gemm_shape(program, layer)
    if layer.kind == "conv2d":
        attrs = layer.attrs
        groups = attrs["groups"]
        a = np.ascontiguousarray(rhs).reshape(groups, rhs.shape[0] // groups, -1)
        _, cg, kh, kw = rhs.shape
        n, c, h, w = x.shape
        oh, ow = out.shape[2], out.shape[3]
        x = np.ascontiguousarray(x)
        if (kh, kw) == (1, 1) and tuple(attrs["strides"]) == (1, 1) and not any(attrs["padding"]) \
                and (oh, ow) == (h, w):
            b = x.reshape(n * groups, cg, h * w)  # 1x1 convolution: im2col is the input itself
        else:
            b = _lib.im2col(x, (kh, kw), attrs["strides"], attrs["dilation"], attrs["padding"],
                            groups, fill=fill, out_hw=(oh, ow))
        a_index = np.arange(g.batch, dtype=np.int64) % groups
        b_index = np.arange(g.batch, dtype=np.int64)
    elif layer.kind == "dense":
        a = np.ascontiguousarray(x).reshape(1, g.m, g.k)
        b = np.ascontiguousarray(rhs).reshape(1, g.k, g.n)
        a_index = b_index = np.zeros(1, dtype=np.int64)
    else:  # matmul: broadcast batches index their operand instead of copying it
        batch_shape = tuple(out.shape[:-2])

        def operand(t):
            lead = t.shape[:-2]
            index = np.arange(int(np.prod(lead, dtype=np.int64)), dtype=np.int64).reshape(lead)
            index = np.broadcast_to(index, batch_shape).reshape(-1)
            return np.ascontiguousarray(t).reshape(-1, t.shape[-2], t.shape[-1]), np.ascontiguousarray(index)

        a, a_index = operand(x)
        b, b_index = operand(rhs)
    return g, a, b, a_index, b_index


def _gemm_whole(program, layer: Layer, env, out: np.ndarray) -> None:
    x = env[layer.inputs[0]]
    g, a, b, a_index, b_index = _batched_operands(program, layer, out, x, _rhs(layer, env), 0)
    c = out.reshape(g.batch, g.m, g.n)
    c.fill(0)
    _lib.gemm_f32_batched(a, b, c, a_index, b_index)
    bias = layer.consts.get("bias")
    if bias is not None:
        bias = env[bias]
        if layer.kind == "conv2d":
            groups = layer.attrs["groups"]
            c4 = out.reshape(-1, groups, g.m, g.n)
            np.add(c4, bias.reshape(groups, g.m, 1), out=c4)
        else:
            np.add(c, bias.reshape(1, 1, -1), out=c)
    if layer.attrs.get("relu"):
        c[c <= 0] = _F32(0)  # relu: a > 0 ? a : +0, NaN kept (-0.0 gives +0)


def int8_chunk(program, index: int) -> int:
    """k-chunk length of int8 GEMM layer ``index``: ``ceil(K / k_splits)`` of its tiles (one
    tile shape per layer, so they never disagree)."""
    tile = program.mapping.layers[index].tile
    return chunk_length(gemm_shape(program, program.layers[index]).k, tile[2])


def _int8_operands(layer: Layer, env):
    """``(x, rhs, x_zero)`` of an int8 GEMM as the MAC array reads them (uint8 operands with
    their top bit flipped)."""
    attrs = layer.attrs
    x = env[layer.inputs[0]]
    x = to_signed(x) if attrs["x_flip"] else x
    rhs = _rhs(layer, env)
    if layer.kind == "matmul" and attrs["b_flip"]:
        rhs = to_signed(rhs)
    return x, rhs, np.int64(attrs["x_zero"])


def _qgemm_whole(program, layer: Layer, index: int, env, out: np.ndarray) -> None:
    step = int8_chunk(program, index)
    attrs = layer.attrs
    x, rhs, zx = _int8_operands(layer, env)
    fill = np.asarray(attrs["x_zero"]).astype(x.dtype)  # padding holds the zero point
    g, a, b, a_index, b_index = _batched_operands(program, layer, out, x, rhs, fill)
    acc32 = np.zeros((g.batch, g.m, g.n), dtype=np.int32)
    _lib.gemm_i8_batched(a, b, acc32, step, int(program.arch.acc_bits), a_index, b_index)
    acc = acc32.astype(np.int64)
    wz = env[layer.consts["w_zero"]].astype(np.int64) if "w_zero" in layer.consts else None
    if layer.kind == "conv2d":
        groups = attrs["groups"]
        acc = acc.reshape(-1, groups, g.m, g.n)
        ch = np.arange(groups * g.m).reshape(groups, g.m, 1)
        za = wz[ch] if wz is not None else np.int64(0)
        zb = zx
        a_sum = lambda: a.sum(axis=2, dtype=np.int64).reshape(groups, g.m, 1)  # noqa: E731
        b_sum = lambda: b.sum(axis=1, dtype=np.int64).reshape(-1, groups, 1, g.n)  # noqa: E731
    else:
        ch = np.arange(g.n)[None, :]
        if layer.kind == "dense":
            za, zb = zx, wz
        else:
            za, zb = zx, np.int64(attrs.get("b_zero", 0))
        zb = zb[ch] if isinstance(zb, np.ndarray) and zb.ndim else zb
        a_sum = lambda: a.sum(axis=2, dtype=np.int64)[a_index][:, :, None]  # noqa: E731
        b_sum = lambda: b.sum(axis=1, dtype=np.int64)[b_index][:, None, :]  # noqa: E731
    epi = {k: env[layer.consts[k]] for k in ("scale", "bias", "bias_q", "multiplier", "shift") if k in layer.consts}
    out.reshape(acc.shape)[...] = int8_finish(acc, za, zb, a_sum, b_sum, g.k, epi, attrs, ch)


#: "no bias" for the C++ epilogue (a bias with no elements)
_NO_BIAS = np.zeros(0, dtype=_F32)


def _operand(program, tid: int, prepare):
    """A getter ``env -> prepare(env[tid])``, evaluated once here for a constant."""
    if tid in program.constants:
        value = prepare(program.constants[tid])
        return lambda env: value
    return lambda env: prepare(env[tid])


def _fp32_step(program, layer: Layer, clip: Layer | None):
    """:func:`_gemm_whole` with its operand layout, index vectors and bias prepared; the bias,
    ReLU and ``clip`` (a clip layer fused by the simulator's plan) run in the C++ epilogue."""
    g = gemm_shape(program, layer)
    tensors = program.tensors
    shape = tuple(tensors[layer.output].shape)
    dtype = np.dtype(tensors[layer.output].dtype)
    rhs_tid = layer.consts["weight"] if "weight" in layer.consts else layer.inputs[1]
    x_tid = layer.inputs[0]
    cshape = (g.batch, g.m, g.n)
    do_relu = bool(layer.attrs.get("relu"))
    bias_tid = layer.consts.get("bias")
    bias = _NO_BIAS
    if bias_tid is not None:
        bias = _lib._input(np.ascontiguousarray(program.constants[bias_tid], dtype=_F32).reshape(-1))
    lo = hi = 0.0
    if clip is not None:
        lo, hi = float(_F32(clip.attrs["min"])), float(_F32(clip.attrs["max"]))
    epilogue = _lib._func("tvm_spinn.sim.epilogue_f32")
    if layer.kind == "conv2d":
        attrs = layer.attrs
        groups = int(attrs["groups"])
        wshape = tuple(tensors[rhs_tid].shape)
        _, cg, kh, kw = wshape
        n, c, h, w = tensors[x_tid].shape
        oh, ow = shape[2], shape[3]
        if bias.size not in (0, wshape[0]):
            return None
        # C viewed as [n, output channels, pixels]: the bias is per row
        ep_shape, on_rows = (n, wshape[0], oh * ow), True
        if cg == 1 and groups > 1 and rhs_tid in program.constants:
            return _depthwise_step(program, layer, shape, dtype, bias, do_relu, clip is not None, lo, hi)
        if _transposed_conv(g, groups) and rhs_tid in program.constants and dtype == _F32:
            return _transposed_step(program, layer, g, shape, bias, do_relu, clip is not None, lo, hi)
        get_a = _operand(program, rhs_tid, lambda w: _lib._input(np.ascontiguousarray(w).reshape(groups, wshape[0] // groups, -1)))
        if (kh, kw) == (1, 1) and tuple(attrs["strides"]) == (1, 1) and not any(attrs["padding"]) and (oh, ow) == (h, w):
            bshape = (n * groups, cg, h * w)
            get_b = _operand(program, x_tid, lambda x: _lib._input(np.ascontiguousarray(x).reshape(bshape)))
        else:
            im2col = _lib._func("tvm_spinn.sim.im2col")
            sh, sw = attrs["strides"]
            dh, dw = attrs["dilation"]
            pt, pl, _, _ = attrs["padding"]
            params = [int(v) for v in (max(groups, 1), kh, kw, sh, sw, dh, dw, pt, pl, max(int(oh), 0), max(int(ow), 0))]
            cols_shape = (n * max(groups, 1), (c // max(groups, 1)) * kh * kw, max(int(oh), 0) * max(int(ow), 0))

            def cols(x):
                x = np.ascontiguousarray(x)
                out = np.empty(cols_shape, dtype=x.dtype)
                im2col(_lib._input(x), out, np.zeros(1, dtype=x.dtype), params, 0)
                return out
            get_b = _operand(program, x_tid, cols)
        a_index = np.arange(g.batch, dtype=np.int64) % groups
        b_index = np.arange(g.batch, dtype=np.int64)
    else:
        if bias.size not in (0, g.n):
            return None
        ep_shape, on_rows = cshape, False  # the bias is per column
        if layer.kind == "dense":
            get_a = _operand(program, x_tid, lambda x: _lib._input(np.ascontiguousarray(x).reshape(1, g.m, g.k)))
            get_b = _operand(program, rhs_tid, lambda r: _lib._input(np.ascontiguousarray(r).reshape(1, g.k, g.n)))
            a_index = b_index = np.zeros(1, dtype=np.int64)
        else:
            batch_shape = shape[:-2]

            def operand(tid):
                tshape = tuple(tensors[tid].shape)
                lead = tshape[:-2]
                index = np.arange(int(np.prod(lead, dtype=np.int64)), dtype=np.int64).reshape(lead)
                index = np.array(np.broadcast_to(index, batch_shape).reshape(-1), dtype=np.int64)  # writable
                three = (-1, tshape[-2], tshape[-1])
                return _operand(program, tid, lambda t: _lib._input(np.ascontiguousarray(t).reshape(three))), index
            get_a, a_index = operand(x_tid)
            get_b, b_index = operand(rhs_tid)
    if dtype != _F32:
        return None
    finish = bias.size or do_relu or clip is not None
    gemm = _lib._func("tvm_spinn.sim.gemm_f32_batched")

    def into(program, env, out):
        if out is None:
            out = np.zeros(shape, dtype=dtype)
        else:  # the caller's output buffer (the plan checked it)
            out.fill(0)
        gemm(get_a(env), get_b(env), out.reshape(cshape), a_index, b_index, 0)
        if finish:  # fl(acc + bias), then ReLU (x > 0 ? x : +0), then the fused clip
            epilogue(out.reshape(ep_shape), bias, on_rows, do_relu, clip is not None, lo, hi, 0)
        return out

    def step(program, env):
        return into(program, env, None)
    step.into = into
    return step


def _transposed_step(program, layer: Layer, g: GemmShape, shape, bias, do_relu, clip, lo, hi):
    """A conv computed as C^T = X^T W^T (:func:`_transposed_conv`): the operations of the
    native run's copy, GEMM (bias per column) and copy."""
    attrs = layer.attrs
    x_tid = layer.inputs[0]
    n, c, h, w = program.tensors[x_tid].shape
    kh, kw = program.tensors[layer.consts["weight"]].shape[2:]
    p, k, m = g.n, g.k, g.m
    wt = _lib._input(np.ascontiguousarray(
        np.asarray(program.constants[layer.consts["weight"]], dtype=_F32).reshape(m, k).T).reshape(1, k, m))
    direct = (kh, kw) == (1, 1) and tuple(attrs["strides"]) == (1, 1) and not any(attrs["padding"]) and p == h * w
    params = None
    if not direct:
        sh, sw = attrs["strides"]
        dh, dw = attrs["dilation"]
        pt, pl, _, _ = attrs["padding"]
        params = [int(v) for v in (1, kh, kw, sh, sw, dh, dw, pt, pl, shape[2], shape[3])]
    a_index, b_index = np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    gemm = _lib._func("tvm_spinn.sim.gemm_f32_batched")
    epilogue = _lib._func("tvm_spinn.sim.epilogue_f32")
    im2col = _lib._func("tvm_spinn.sim.im2col")
    finish = bias.size or do_relu or clip

    def step(program, env):
        x = np.ascontiguousarray(env[x_tid])
        if direct:
            cols = x.reshape(n, k, p)
        else:
            cols = np.empty((n, k, p), dtype=_F32)
            im2col(_lib._input(x), cols, np.zeros(1, dtype=_F32), params, 0)
        xt = np.ascontiguousarray(cols.transpose(0, 2, 1))
        ct = np.zeros((n, p, m), dtype=_F32)
        gemm(xt, wt, ct, a_index, b_index, 0)
        if finish:  # the bias is per output channel: a column of C^T
            epilogue(ct, bias, False, do_relu, clip, lo, hi, 0)
        return np.ascontiguousarray(ct.transpose(0, 2, 1)).reshape(shape)
    return step


def _depthwise_step(program, layer: Layer, shape, dtype, bias, do_relu, clip, lo, hi):
    """A conv with one input channel per group, on the direct C++ kernel (no im2col): each
    output's taps in im2col order from +0.0, then the epilogue; the bits of the GEMM path."""
    attrs = layer.attrs
    tensors = program.tensors
    weight = program.constants[layer.consts["weight"]]
    cout, _, kh, kw = weight.shape
    weight = _lib._input(np.ascontiguousarray(weight, dtype=_F32).reshape(cout, kh, kw))
    x_tid = layer.inputs[0]
    if dtype != _F32 or np.dtype(tensors[x_tid].dtype) != _F32:
        return None
    sh, sw = attrs["strides"]
    dh, dw = attrs["dilation"]
    pt, pl, _, _ = attrs["padding"]
    geometry = [int(v) for v in (sh, sw, dh, dw, pt, pl)]
    conv = _lib._func("tvm_spinn.sim.depthwise_conv2d_f32")

    def into(program, env, out):
        if out is None:
            out = np.zeros(shape, dtype=dtype)
        else:
            out.fill(0)
        conv(_lib._input(np.ascontiguousarray(env[x_tid])), weight, out, bias, geometry, do_relu, clip, lo, hi, 0)
        return out

    def step(program, env):
        return into(program, env, None)
    step.into = into
    return step


#: Convolutions with at most this many output pixels per image are computed transposed.
NARROW_PIXELS = 4


def _transposed_conv(g: GemmShape, groups: int) -> bool:
    """Whether a conv (one group, weights [m, k], pixels [k, n]) is computed as C^T = X^T W^T:
    with at most :data:`NARROW_PIXELS` pixels (a late stage of a CNN on a small image) the
    kernel's register block would hold a few pixels by many output channels and pack the whole
    weight matrix every call; transposed, the weights are the operand it reads in place. Each
    output is the same sum in the same k order; the products are w * x instead of x * w (equal
    for all but two NaN operands, whose payload the product may then take from the other)."""
    return groups == 1 and g.n <= NARROW_PIXELS and g.m >= 16


def _batch_index(tensors, tid: int, batch_shape) -> np.ndarray:
    """Per batch of a batched matmul's output, the batch of operand ``tid`` it reads (its
    leading axes broadcast to ``batch_shape``), flattened: the native GEMM's operand index."""
    lead = tuple(tensors[tid].shape)[:-2]
    idx = np.arange(int(np.prod(lead, dtype=np.int64)), dtype=np.int64).reshape(lead)
    return np.array(np.broadcast_to(idx, batch_shape).reshape(-1), dtype=np.int64)


def _fp32_native(program, layer: Layer, nb, clip: Layer | None) -> bool:
    """:func:`_fp32_step` as instructions: the same operand layouts, index vectors, kernels
    (im2col, the batched GEMM, the epilogue; the direct depthwise kernel) and epilogue."""
    tensors = program.tensors
    if tensors[layer.output].dtype != "float32" or any(tensors[t].dtype != "float32" for t in layer.inputs):
        return False
    g = gemm_shape(program, layer)
    if min(g.batch, g.m, g.n, g.k) < 1:
        return False
    shape = tuple(int(d) for d in tensors[layer.output].shape)
    rhs_tid = layer.consts["weight"] if "weight" in layer.consts else layer.inputs[1]
    x_tid = layer.inputs[0]
    attrs = layer.attrs
    none = native.codes()["none"]
    bias_tid = layer.consts.get("bias")
    bias = none
    bias_len = 0
    if bias_tid is not None:
        bias_array = np.ascontiguousarray(program.constants[bias_tid], dtype=_F32).reshape(-1)
        bias_len = bias_array.size
    relu_flag = int(bool(attrs.get("relu")))
    lo = hi = 0
    if clip is not None:
        lo, hi = native.f32_bits(clip.attrs["min"]), native.f32_bits(clip.attrs["max"])
    clip_flag = int(clip is not None)
    if layer.kind == "conv2d":
        groups = int(attrs["groups"])
        wshape = tuple(int(d) for d in tensors[rhs_tid].shape)
        cout, cg, kh, kw = wshape
        n, c, h, w = (int(d) for d in tensors[x_tid].shape)
        oh, ow = shape[2], shape[3]
        if bias_len not in (0, cout) or rhs_tid not in program.constants:
            return False
        if bias_len:
            bias = nb.const(bias_array)
        sh, sw = (int(v) for v in attrs["strides"])
        dh, dw = (int(v) for v in attrs["dilation"])
        pt, pl = int(attrs["padding"][0]), int(attrs["padding"][1])
        x = nb.read(x_tid)
        if cg == 1 and groups > 1:  # the direct depthwise kernel (_depthwise_step)
            nb.emit("depthwise", x, nb.read(rhs_tid), nb.write(layer.output), n, groups, cout // groups,
                    h, w, kh, kw, oh, ow, sh, sw, dh, dw, pt, pl, bias, relu_flag, clip_flag, lo, hi)
            return True
        if (kh, kw) == (1, 1) and (sh, sw) == (1, 1) and not any(attrs["padding"]) and (oh, ow) == (h, w):
            b = x  # [n * groups, cg, h * w]: the input itself
        else:
            b = nb.temp(4 * n * groups * cg * kh * kw * oh * ow)
            nb.emit("im2col", x, b, n, groups, c // groups, h, w, kh, kw, oh, ow, sh, sw, dh, dw, pt, pl)
        if _transposed_conv(g, groups):
            # C^T = X^T W^T: the weights (pre-transposed once) are the kernel's wide operand,
            # read in place, and only the few pixels are packed (see _transposed_conv)
            p, k, m = g.n, g.k, g.m
            xt, ct = nb.temp(4 * n * p * k), nb.temp(4 * n * p * m)
            nb.emit("copy", b, xt, 4, 3, 0, 0, [n, p, k], [k * p, 1, p], [p * k, k, 1])
            wt = np.ascontiguousarray(program.constants[rhs_tid], dtype=_F32).reshape(m, k).T
            nb.emit("gemm", xt, nb.const(wt), ct, n, p, k, m, nb.const(np.arange(n, dtype=np.int64)),
                    nb.const(np.zeros(n, dtype=np.int64)), bias, 0, relu_flag, clip_flag, lo, hi, n, p, m)
            nb.emit("copy", ct, nb.write(layer.output), 4, 3, 0, 0, [n, m, p], [p * m, 1, m], [m * p, p, 1])
            return True
        a_index = np.arange(g.batch, dtype=np.int64) % groups
        b_index = np.arange(g.batch, dtype=np.int64)
        a = nb.read(rhs_tid)
        ep = (n, cout, oh * ow, 1)  # outer, rows, cols, bias on rows
    else:
        if bias_len not in (0, g.n):
            return False
        if bias_len:
            bias = nb.const(bias_array)
        if layer.kind == "dense":
            a, b = nb.read(x_tid), nb.read(rhs_tid)
            a_index = b_index = np.zeros(1, dtype=np.int64)
        else:
            a, b = nb.read(x_tid), nb.read(rhs_tid)
            a_index, b_index = (_batch_index(tensors, tid, shape[:-2]) for tid in (x_tid, rhs_tid))
        ep = (g.batch, g.m, g.n, 0)
    nb.emit("gemm", a, b, nb.write(layer.output), g.batch, g.m, g.k, g.n, nb.const(a_index), nb.const(b_index),
            bias, ep[3], relu_flag, clip_flag, lo, hi, ep[0], ep[1], ep[2])
    return True


def _int8_native(program, layer: Layer, nb) -> bool:
    """:func:`_qgemm_whole` as instructions: uint8 operands flipped (``flip8``), conv2d operands
    gathered by the 1-byte im2col (padding holds the zero point), the chunked MAC-array GEMM
    and :func:`int8_finish`'s zero-point terms and epilogue (``qgemm``), with the sums over k
    of a constant operand prepared once."""
    tensors = program.tensors
    attrs = layer.attrs
    g = gemm_shape(program, layer)
    if min(g.batch, g.m, g.n, g.k) < 1:
        return False
    index = next(i for i, other in enumerate(program.layers) if other is layer)
    step = int8_chunk(program, index)
    acc_bits = int(program.arch.acc_bits)
    none = native.codes()["none"]
    consts = program.constants
    shape = tuple(int(d) for d in tensors[layer.output].shape)

    def signed(tid, flip):  # to_signed: a uint8 operand with its top bit flipped
        ref = nb.read(tid)
        if not flip:
            return ref
        count = native.numel(tensors[tid].shape)
        out = nb.temp(count)
        nb.emit("flip8", ref, out, count)
        return out

    x = signed(layer.inputs[0], attrs["x_flip"])
    wz = consts[layer.consts["w_zero"]].astype(np.int64).reshape(-1) if "w_zero" in layer.consts else None
    za, za_vec, zb, zb_vec = int(attrs["x_zero"]), none, 0, none
    a_sum = b_sum = none
    groups = 1
    if layer.kind == "conv2d":
        groups = int(attrs["groups"])
        weight = consts[layer.consts["weight"]]
        cout, cg, kh, kw = (int(d) for d in weight.shape)
        n, c, h, w = (int(d) for d in tensors[layer.inputs[0]].shape)
        oh, ow = shape[2], shape[3]
        sh, sw = (int(v) for v in attrs["strides"])
        dh, dw = (int(v) for v in attrs["dilation"])
        pt, pl = int(attrs["padding"][0]), int(attrs["padding"][1])
        if (kh, kw) == (1, 1) and (sh, sw) == (1, 1) and not any(attrs["padding"]) and (oh, ow) == (h, w):
            b = x  # [n * groups, cg, h * w]: the input itself
        else:
            b = nb.temp(n * groups * cg * kh * kw * oh * ow)
            fill = int(np.asarray(attrs["x_zero"]).astype(np.int8).view(np.uint8))
            nb.emit("im2col8", x, b, n, groups, cg, h, w, kh, kw, oh, ow, sh, sw, dh, dw, pt, pl, fill)
        a = nb.read(layer.consts["weight"])
        a_index = np.arange(g.batch, dtype=np.int64) % groups
        b_index = np.arange(g.batch, dtype=np.int64)
        # conv: the weight is A (rows = output channels, their zero points per row), x is B
        za, zb = 0, int(attrs["x_zero"])
        if wz is not None:
            za_vec = nb.const(wz.astype(np.int32))
        if zb != 0 or wz is not None:
            a_sum = nb.const(weight.reshape(cout, -1).sum(axis=1, dtype=np.int64))
        on_rows = 1
    else:
        if layer.kind == "dense":
            weight = consts[layer.consts["weight"]]
            b = nb.read(layer.consts["weight"])
            a_index = b_index = np.zeros(1, dtype=np.int64)
            if wz is not None:
                zb_vec = nb.const(wz.astype(np.int32))
            if za != 0:
                b_sum = nb.const(weight.reshape(g.k, g.n).sum(axis=0, dtype=np.int64))
        else:
            b = signed(layer.inputs[1], attrs["b_flip"])
            a_index, b_index = (_batch_index(tensors, tid, shape[:-2]) for tid in layer.inputs[:2])
            zb = int(attrs.get("b_zero", 0))
        a = x
        on_rows = 0
    out_kind = {"float32": 0, "int8": 1, "uint8": 2, "int32": 3}[attrs["out"]]

    def opt(role):
        return nb.read(layer.consts[role]) if role in layer.consts else none

    nb.emit("qgemm", a, b, nb.write(layer.output), nb.temp(4 * g.batch * g.m * g.n), g.batch, g.m, g.k, g.n,
            nb.const(a_index), nb.const(b_index), step, acc_bits, za, za_vec, zb, zb_vec, a_sum, b_sum, groups,
            on_rows, out_kind, opt("scale"), opt("bias"), opt("bias_q"), opt("multiplier"), opt("shift"),
            int(bool(attrs["relu"])), int(attrs.get("rounding") == "tflite"), int(attrs.get("y_zero", 0)),
            int(attrs.get("y_min", 0)), int(attrs.get("y_max", 0)))
    return True
