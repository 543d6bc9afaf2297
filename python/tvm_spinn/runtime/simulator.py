"""Bit-exact functional simulator: executes a spinn program tile by tile.

Numerics are those of the hardware path each layer runs on:

- fp32 GEMMs (conv2d, dense, matmul) on the Cortex-M4F: ``acc = fl(acc + fl(a * b))`` with k
  strictly ascending (VMLA.F32 is not fused), in the C++ kernel ``tvm_spinn.sim.gemm_f32``; a
  tile's k-chunks run in order on one PE, so results do not depend on the tiling. Bias is added
  to the finished accumulator, then ReLU.
- reductions (softmax sum, layer_norm mean/variance, mean) are sequential fp32 sums per row
  (``tvm_spinn.sim.row_sum_f32``); element-wise ops are single fp32 operations (numpy float32).
- int8 GEMMs (``mode="int8"``) on the MAC array: raw int8 products into ``acc_bits``-bit
  wrapping accumulators (C++ kernel ``tvm_spinn.sim.gemm_i8``), one k-chunk at a time; the M4F
  adds chunk sums in 32-bit, applies the zero-point terms and the epilogue
  (:mod:`tvm_spinn.program.quant`). ``quantize`` is ``clamp(rint(x / s) + z)`` in fp32 (round
  half to even, VCVTR); ``dequantize`` is ``fl(q - z) * s``.
- Execution modes (``TVM_SPINN_SIM_MODE`` or ``run_program(..., mode=...)``): ``"layers"``
  (default) runs every layer whole: a GEMM layer is one call of a batched, multi-threaded C++
  kernel (``gemm_f32_batched`` / ``gemm_i8_batched`` with the program's k-chunk length, conv
  operands gathered by the C++ ``im2col``; ``TVM_SPINN_SIM_THREADS`` threads, default all cores,
  never changing the bits), every other layer one region covering its whole output. ``"tiles"``
  executes the mapping tile by tile and k-chunk by k-chunk (the reference). Each output element's
  arithmetic is independent of the tiling (a GEMM output reduces in ascending k from 0 on one PE),
  so both give the same bits (tests/test_sim_modes.py).
- ``exp`` comes from the exp/log unit, modelled as numpy's float32 ``exp``; ``erf`` (GELU) is the
  M4F library's rational approximation in fp32 (Abramowitz-Stegun 7.1.26, |error| < 1.5e-7).
"""

from __future__ import annotations

import os
import weakref

import numpy as np

from .. import _lib
from ..program import Layer, Program, Tile
from ..program.quant import QUANT_RANGES, requantize, to_signed
from ..program.gemm import gemm_shape
from ..program.tiles import chunk_length, layer_tile_shape, layer_tiles

__all__ = ["MODES", "run_program", "sim_mode"]

#: Simulator execution modes; ``TVM_SPINN_SIM_MODE`` picks one (default ``"layers"``).
MODES = ("layers", "tiles")


def sim_mode(mode: str | None = None) -> str:
    """The execution mode: ``mode`` if given, else ``$TVM_SPINN_SIM_MODE``, else ``"layers"``."""
    mode = mode or os.environ.get("TVM_SPINN_SIM_MODE") or "layers"
    if mode not in MODES:
        raise ValueError(f"simulator mode {mode!r}: expected one of {MODES} (TVM_SPINN_SIM_MODE)")
    return mode

_F32 = np.float32
_F32_LOWEST = np.finfo(np.float32).min


def _erf_f32(x: np.ndarray) -> np.ndarray:
    x = x.astype(_F32, copy=False)
    sign = np.sign(x).astype(_F32, copy=False)
    a = np.abs(x)
    t = _F32(1) / (_F32(1) + _F32(0.3275911) * a)
    poly = t * (_F32(0.254829592) + t * (_F32(-0.284496736) + t * (_F32(1.421413741)
           + t * (_F32(-1.453152027) + t * _F32(1.061405429)))))
    return (sign * (_F32(1) - poly * np.exp(-a * a))).astype(_F32, copy=False)


def _max(a, b) -> np.ndarray:
    """``a > b ? a : b``: the M4F's compare-and-select (no VMAXNM), and TVM's ``max``: NaN ``a``
    gives ``b`` (relu(NaN) = 0, as the llvm build), NaN ``b`` gives NaN."""
    return np.where(a > b, a, b)


def _min(a, b) -> np.ndarray:
    """``a < b ? a : b`` (see :func:`_max`)."""
    return np.where(a < b, a, b)


def _relu(x: np.ndarray) -> np.ndarray:
    return _max(x, _F32(0)).astype(x.dtype, copy=False)


def _unary(kind: str, x: np.ndarray, attrs: dict) -> np.ndarray:
    if kind == "relu":
        return _relu(x)
    if kind == "clip":  # TVM's order: max(min(x, hi), lo), so clip(NaN) = hi
        return _max(_min(x, _F32(attrs["max"])), _F32(attrs["min"])).astype(_F32, copy=False)
    if kind == "sigmoid":
        return (_F32(1) / (_F32(1) + np.exp(-x))).astype(_F32, copy=False)
    if kind == "tanh":
        return np.tanh(x).astype(_F32, copy=False)
    if kind == "gelu":
        return (_F32(0.5) * x * (_F32(1) + _erf_f32(x * _F32(0.70710678118654752)))).astype(_F32, copy=False)
    if kind == "gelu_tanh":
        inner = _F32(0.7978845608028654) * (x + _F32(0.044715) * x * x * x)
        return (_F32(0.5) * x * (_F32(1) + np.tanh(inner))).astype(_F32, copy=False)
    raise NotImplementedError(kind)


_BINARY = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": np.divide}


class _LayerRunner:
    """Per-layer operand preparation (DRAM-side layout) and per-tile execution."""

    def __init__(self, program: Program, layer: Layer, env: dict[int, np.ndarray]):
        self.p, self.layer, self.env = program, layer, env
        self.out = np.zeros(program.tensors[layer.output].shape, dtype=program.tensors[layer.output].dtype)
        k = layer.kind
        if k in ("conv2d", "dense", "matmul") and layer.mode == "int8":
            self._prepare_qgemm()
        elif k in ("conv2d", "dense", "matmul"):
            self._prepare_gemm()
        elif k in ("quantize", "dequantize"):
            self._prepare_qdq()
        elif k in ("reshape", "permute_dims", "broadcast_to"):
            x = env[layer.inputs[0]]
            if k == "permute_dims":
                moved = np.transpose(x, layer.attrs["axes"])
            elif k == "broadcast_to":
                moved = np.broadcast_to(x, self.out.shape)
            else:
                moved = x
            self.flat_in = [np.ascontiguousarray(moved).reshape(-1)]
        elif k in _BINARY or k in ("relu", "gelu", "gelu_tanh", "sigmoid", "tanh", "clip"):
            shape = self.out.shape
            self.flat_in = [np.ascontiguousarray(np.broadcast_to(env[i], shape)).reshape(-1) for i in layer.inputs]
        elif k in ("softmax", "layer_norm", "mean"):
            x = env[layer.inputs[0]]
            row = layer.attrs["row"] if k == "mean" else x.shape[-1]
            self.rows_in = np.ascontiguousarray(x).reshape(-1, row)
        elif k in ("max_pool2d", "avg_pool2d"):
            self._prepare_pool()

    # -- GEMM ------------------------------------------------------------------------------
    def _arrange(self, x: np.ndarray, rhs: np.ndarray, pad_fill) -> None:
        """GEMM operands as the DMA lays them out: ``a`` [batch-or-group, m, k], ``b`` [batch, k, n].

        conv2d: ``a`` = weight per group, ``b`` = im2col(x) (padding reads ``pad_fill``); dense:
        ``a`` = x, ``b`` = weight; matmul: both broadcast over the batch dims."""
        layer = self.layer
        g = self.g = gemm_shape(self.p, layer)
        if layer.kind == "conv2d":
            groups = layer.attrs["groups"]
            self.a = np.ascontiguousarray(rhs.reshape(groups, rhs.shape[0] // groups, -1))
            self.b = self._im2col(x, rhs.shape, pad_fill)
            self.a_index = lambda b: b % groups
        elif layer.kind == "dense":
            self.a = np.ascontiguousarray(x).reshape(1, g.m, g.k)
            self.b = np.ascontiguousarray(rhs).reshape(1, g.k, g.n)
            self.a_index = lambda b: b
        else:
            batch_shape = tuple(self.out.shape[:-2])
            self.a = np.ascontiguousarray(np.broadcast_to(x, batch_shape + x.shape[-2:])).reshape(g.batch, g.m, g.k)
            self.b = np.ascontiguousarray(np.broadcast_to(rhs, batch_shape + rhs.shape[-2:])).reshape(g.batch, g.k, g.n)
            self.a_index = lambda b: b
        self.c = self.out.reshape(g.batch, g.m, g.n)

    def _rhs(self) -> np.ndarray:
        layer = self.layer
        return self.env[layer.consts["weight"]] if "weight" in layer.consts else self.env[layer.inputs[1]]

    def _prepare_gemm(self) -> None:
        self._arrange(self.env[self.layer.inputs[0]], self._rhs(), 0)
        bias = self.layer.consts.get("bias")
        self.bias = self.env[bias] if bias is not None else None

    def _im2col(self, x: np.ndarray, wshape, fill) -> np.ndarray:
        """im2col is pure data movement (what the DMA gathers): rows ordered (c, kh, kw) like the
        OIHW weight, columns are output pixels; padding reads ``fill``."""
        n = x.shape[0]
        groups = self.layer.attrs["groups"]
        sh, sw = self.layer.attrs["strides"]
        dh, dw = self.layer.attrs["dilation"]
        pt, pl, pb, pr = self.layer.attrs["padding"]
        _, cg, kh, kw = wshape
        oh, ow = self.out.shape[2], self.out.shape[3]
        xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=fill)
        cols = np.empty((n, groups, cg * kh * kw, oh * ow), dtype=x.dtype)
        for i in range(kh):
            for j in range(kw):
                patch = xp[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]
                cols[:, :, (np.arange(cg) * kh * kw) + i * kw + j, :] = patch.reshape(n, groups, cg, oh * ow)
        return cols.reshape(n * groups, cg * kh * kw, oh * ow)

    def _run_gemm(self, tile: Tile) -> None:
        (b0, _), (m0, m1), (n0, n1) = tile.region
        self._gemm_block(b0, m0, m1, n0, n1, -(-self.g.k // tile.k_splits))

    def _gemm_block(self, b0: int, m0: int, m1: int, n0: int, n1: int, step: int) -> None:
        """Outputs ``[b0, m0:m1, n0:n1]``: k-chunks of ``step`` in ascending order into one fp32
        accumulator (the same bits for any ``step``), then bias and ReLU."""
        g = self.g
        a = self.a[self.a_index(b0), m0:m1]
        bm = self.b[b0, :, n0:n1]
        acc = np.zeros((m1 - m0, n1 - n0), dtype=_F32)
        for k0 in range(0, g.k, step):
            _lib.gemm_f32(np.ascontiguousarray(a[:, k0:k0 + step]), np.ascontiguousarray(bm[k0:k0 + step]), acc)
        if self.bias is not None:
            if self.layer.kind == "conv2d":
                groups = self.layer.attrs["groups"]
                oc0 = (b0 % groups) * g.m
                acc = acc + self.bias[oc0 + m0: oc0 + m1, None]
            else:
                acc = acc + self.bias[None, n0:n1]
        if self.layer.attrs.get("relu"):
            acc = _relu(acc)
        self.c[b0, m0:m1, n0:n1] = acc

    # -- int8 GEMM -------------------------------------------------------------------------
    def _prepare_qgemm(self) -> None:
        layer, env, attrs = self.layer, self.env, self.layer.attrs
        x = env[layer.inputs[0]]
        x = to_signed(x) if attrs["x_flip"] else x
        zx = np.int64(attrs["x_zero"])
        rhs = self._rhs()
        if layer.kind == "matmul" and attrs["b_flip"]:
            rhs = to_signed(rhs)
        # padding holds the zero point (real 0.0)
        self._arrange(x, rhs, attrs["x_zero"])
        wz = env[layer.consts["w_zero"]].astype(np.int64) if "w_zero" in layer.consts else None
        # zero points of the A rows / B columns: conv rows are output channels, dense columns are
        # output features, matmul's are per tensor
        self.za, self.zb = {"conv2d": (wz, zx), "dense": (zx, wz)}.get(
            layer.kind, (zx, np.int64(attrs.get("b_zero", 0))))
        self.epi = {k: env[layer.consts[k]] for k in ("scale", "bias", "bias_q", "multiplier", "shift") if k in layer.consts}
        self.acc_bits = int(self.p.arch.get("acc_bits", 29))

    def _run_qgemm(self, tile: Tile) -> None:
        (b0, _), (m0, m1), (n0, n1) = tile.region
        self._qgemm_block(b0, m0, m1, n0, n1, -(-self.g.k // tile.k_splits))

    def _qgemm_block(self, b0: int, m0: int, m1: int, n0: int, n1: int, step: int) -> None:
        """Outputs ``[b0, m0:m1, n0:n1]``: one ``acc_bits`` accumulation per k-chunk of ``step``
        (the wrap points depend on ``step``: callers pass the program's chunk length)."""
        g, attrs = self.g, self.layer.attrs
        a = np.ascontiguousarray(self.a[self.a_index(b0), m0:m1])
        bm = np.ascontiguousarray(self.b[b0, :, n0:n1])
        acc = np.zeros((m1 - m0, n1 - n0), dtype=np.int32)
        part = np.empty_like(acc)
        for k0 in range(0, g.k, step):  # chunks fit the accumulator (tiling.safe_k_chunk)
            part.fill(0)
            _lib.gemm_i8(np.ascontiguousarray(a[:, k0:k0 + step]), np.ascontiguousarray(bm[k0:k0 + step]), part, self.acc_bits)
            acc += part  # M4F 32-bit adds (wrap like the hardware; never reached for int8 data)
        acc = acc.astype(np.int64)
        if self.layer.kind == "conv2d":
            oc0 = (b0 % attrs["groups"]) * g.m
            ch = np.arange(oc0 + m0, oc0 + m1)[:, None]
            za = self.za[ch] if self.za is not None else np.int64(0)
            zb = self.zb
        else:
            ch = np.arange(n0, n1)[None, :]
            za = self.za
            zb = self.zb[ch] if isinstance(self.zb, np.ndarray) and self.zb.ndim else self.zb
        self.c[b0, m0:m1, n0:n1] = _int8_finish(
            acc, za, zb, lambda: a.sum(axis=1, dtype=np.int64)[:, None],
            lambda: bm.sum(axis=0, dtype=np.int64)[None, :], g.k, self.epi, attrs, ch)

    # -- quantize / dequantize ---------------------------------------------------------------
    def _prepare_qdq(self) -> None:
        layer = self.layer
        x = self.env[layer.inputs[0]]
        scale, zero = self.env[layer.consts["scale"]], self.env[layer.consts["zero"]]
        if scale.size > 1:
            shape = [1] * x.ndim
            shape[layer.attrs["axis"]] = -1
            scale, zero = scale.reshape(shape), zero.reshape(shape)
        else:
            scale, zero = scale.reshape(()), zero.reshape(())
        shape = self.out.shape
        self.flat_in = [np.ascontiguousarray(x).reshape(-1),
                        np.ascontiguousarray(np.broadcast_to(scale, shape)).reshape(-1),
                        np.ascontiguousarray(np.broadcast_to(zero, shape)).reshape(-1)]

    def _run_qdq(self, tile: Tile) -> None:
        (e0, e1), = tile.region
        x, scale, zero = (f[e0:e1] for f in self.flat_in)
        out = self.out.reshape(-1)
        if self.layer.kind == "quantize":
            lo, hi = QUANT_RANGES[str(self.out.dtype)]
            q = np.rint((x / scale).astype(_F32)) + zero.astype(_F32)
            out[e0:e1] = np.clip(q, _F32(lo), _F32(hi)).astype(self.out.dtype)
        else:
            out[e0:e1] = (x.astype(np.int32) - zero).astype(_F32) * scale

    # -- pools -----------------------------------------------------------------------------
    def _prepare_pool(self) -> None:
        x = self.env[self.layer.inputs[0]]
        n, c, h, w = x.shape
        pt, pl, pb, pr = self.layer.attrs["padding"]
        # Max pooling pads with the lowest finite float32, as TVM's topi and onnxruntime do: a
        # window lying entirely in the padding gives -3.4028235e38, not -inf.
        fill = _F32_LOWEST if self.layer.kind == "max_pool2d" else 0.0
        self.planes = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=fill).reshape(n * c, h + pt + pb, w + pl + pr)
        ones = np.pad(np.ones((h, w), _F32), ((pt, pb), (pl, pr)))
        self.valid = ones
        self.out_planes = self.out.reshape(n * c, self.out.shape[2], self.out.shape[3])

    def _run_pool(self, tile: Tile) -> None:
        (p0, p1), (r0, r1) = tile.region
        attrs = self.layer.attrs
        kh, kw = attrs["pool_size"]
        sh, sw = attrs["strides"]
        dh, dw = attrs["dilation"]
        ow = self.out_planes.shape[2]
        oh = r1 - r0
        # The band of (padded) input rows under output rows [r0, r1).
        src = self.planes[p0:p1, r0 * sh: (r1 - 1) * sh + (kh - 1) * dh + 1]
        valid = self.valid[r0 * sh: (r1 - 1) * sh + (kh - 1) * dh + 1]
        acc = None
        count = np.zeros((oh, ow), _F32)
        for i in range(kh):  # sequential window order, vectorized over planes and pixels
            for j in range(kw):
                sl = (slice(i * dh, i * dh + sh * (oh - 1) + 1, sh), slice(j * dw, j * dw + sw * (ow - 1) + 1, sw))
                v = src[:, sl[0], sl[1]]
                if self.layer.kind == "max_pool2d":
                    # The M4F's compare-and-select from the lowest float, as TVM's max reducer
                    # (``acc > v ? acc : v``): a NaN element is taken, a later number replaces it.
                    acc = np.full(v.shape, _F32_LOWEST) if acc is None else acc
                    acc = np.where(acc > v, acc, v)
                else:
                    acc = v.astype(_F32) if acc is None else (acc + v).astype(_F32)
                    count += valid[sl]
        if self.layer.kind == "avg_pool2d":
            div = _F32(kh * kw) if attrs.get("count_include_pad") else count
            acc = (acc / div).astype(_F32)
        self.out_planes[p0:p1, r0:r1] = acc

    # -- rows ------------------------------------------------------------------------------
    def _row_sum(self, x: np.ndarray) -> np.ndarray:
        out = np.empty(x.shape[0], dtype=_F32)
        _lib.row_sum_f32(np.ascontiguousarray(x, dtype=_F32), out)
        return out

    def _run_rows(self, tile: Tile) -> None:
        (r0, r1), = tile.region
        x = self.rows_in[r0:r1]
        d = _F32(x.shape[-1])
        if self.layer.kind == "mean":
            self.out.reshape(-1)[r0:r1] = self._row_sum(x) / d
            return
        out_rows = self.out.reshape(-1, self.out.shape[-1])
        if self.layer.kind == "softmax":
            e = np.exp(x - x.max(axis=-1, keepdims=True)).astype(_F32)
            out_rows[r0:r1] = e / self._row_sum(e)[:, None]
            return
        mean = self._row_sum(x) / d
        centered = (x - mean[:, None]).astype(_F32)
        var = self._row_sum(centered * centered) / d
        y = centered / np.sqrt(var + _F32(self.layer.attrs["epsilon"]))[:, None]
        if self.layer.attrs.get("scale", True):
            y = y * self.env[self.layer.consts["gamma"]]
        if self.layer.attrs.get("center", True):
            y = y + self.env[self.layer.consts["beta"]]
        out_rows[r0:r1] = y

    # -- element-wise ----------------------------------------------------------------------
    def _run_elementwise(self, tile: Tile) -> None:
        (e0, e1), = tile.region
        args = [f[e0:e1] for f in self.flat_in]
        k = self.layer.kind
        if k in ("reshape", "permute_dims", "broadcast_to"):
            res = args[0]
        else:
            res = _BINARY[k](args[0], args[1]) if k in _BINARY else _unary(k, args[0], self.layer.attrs)
            if self.layer.attrs.get("relu"):
                res = _relu(res)
        self.out.reshape(-1)[e0:e1] = res

    def run(self, tile: Tile) -> None:
        k = self.layer.kind
        if k in ("conv2d", "dense", "matmul") and self.layer.mode == "int8":
            self._run_qgemm(tile)
        elif k in ("conv2d", "dense", "matmul"):
            self._run_gemm(tile)
        elif k in ("quantize", "dequantize"):
            self._run_qdq(tile)
        elif k in ("softmax", "layer_norm", "mean"):
            self._run_rows(tile)
        elif k in ("max_pool2d", "avg_pool2d"):
            self._run_pool(tile)
        else:
            self._run_elementwise(tile)




# -- tiles: the only access to the program's tiling -------------------------------------------
def _layer_tiles(program: Program, index: int):
    """The tiles of layer ``index``: objects with ``.region`` and ``.k_splits``."""
    return layer_tiles(program, index)


def _int8_step(program: Program, index: int) -> int | None:
    """k-chunk length of int8 GEMM layer ``index``: ``ceil(K / k_splits)`` of its tiles (one tile
    shape per layer, so they never disagree)."""
    return chunk_length(gemm_shape(program, program.layers[index]).k, layer_tile_shape(program, index)[2])


# -- "layers" mode: every layer whole --------------------------------------------------------
class _Whole:
    """A pseudo-tile covering a layer's whole output (its region only)."""

    __slots__ = ("region",)

    def __init__(self, region):
        self.region = region


def _whole_region(layer: Layer, out: np.ndarray):
    k = layer.kind
    if k in ("softmax", "layer_norm", "mean"):
        rows = out.size if k == "mean" else out.size // max(out.shape[-1], 1)
        return ((0, rows),)
    if k in ("max_pool2d", "avg_pool2d"):
        return ((0, out.shape[0] * out.shape[1]), (0, out.shape[2]))
    return ((0, out.size),)


def _gemm_operands(program: Program, layer: Layer, out: np.ndarray, x: np.ndarray, rhs: np.ndarray, fill):
    """Batched GEMM operands without copies where the layout allows: ``a`` [a_count, m, k],
    ``b`` [b_count, k, n] and the int64 index vectors picking each output batch's operands (the
    same operands as ``_LayerRunner._arrange``; conv2d ``b`` is the C++ im2col)."""
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


def _rhs(layer: Layer, env) -> np.ndarray:
    return env[layer.consts["weight"]] if "weight" in layer.consts else env[layer.inputs[1]]


def _gemm_whole(program: Program, layer: Layer, env, out: np.ndarray) -> None:
    x = env[layer.inputs[0]]
    g, a, b, a_index, b_index = _gemm_operands(program, layer, out, x, _rhs(layer, env), 0)
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
        c[~(c > 0)] = _F32(0)  # _relu: a > 0 ? a : 0 (NaN and -0.0 give +0)


def _qgemm_whole(program: Program, layer: Layer, index: int, env, out: np.ndarray) -> bool:
    step = _int8_step(program, index)
    if step is None:
        return False
    attrs = layer.attrs
    x = env[layer.inputs[0]]
    x = to_signed(x) if attrs["x_flip"] else x
    zx = np.int64(attrs["x_zero"])
    rhs = _rhs(layer, env)
    if layer.kind == "matmul" and attrs["b_flip"]:
        rhs = to_signed(rhs)
    fill = np.asarray(attrs["x_zero"]).astype(x.dtype)  # padding holds the zero point
    g, a, b, a_index, b_index = _gemm_operands(program, layer, out, x, rhs, fill)
    acc32 = np.zeros((g.batch, g.m, g.n), dtype=np.int32)
    _lib.gemm_i8_batched(a, b, acc32, step, int(program.arch.get("acc_bits", 29)), a_index, b_index)
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
    out.reshape(acc.shape)[...] = _int8_finish(acc, za, zb, a_sum, b_sum, g.k, epi, attrs, ch)
    return True


def _int8_finish(acc: np.ndarray, za, zb, a_sum, b_sum, k: int, epi: dict, attrs: dict, ch) -> np.ndarray:
    """The M4F's share of an int8 GEMM on the array's int32 sums ``acc`` (int64 array, updated
    in place): the zero-point terms ``sum (a - za)(b - zb) = sum ab - zb sum_k a - za sum_k b +
    K za zb`` in 32-bit registers, then the epilogue: dequantize (``fl(acc) * scale [+ bias]``,
    ReLU) or requantize (:func:`~tvm_spinn.program.quant.requantize`). ``a_sum``/``b_sum``
    return the operands' sums over k (called only when the other zero point is nonzero); ``ch``
    indexes the per-channel constants."""
    zb = np.int64(0) if zb is None else zb
    if np.any(zb != 0):
        acc -= zb * a_sum()
    if np.any(za != 0):
        acc -= za * b_sum()
    acc += np.int64(k) * za * zb
    acc = acc.astype(np.int32).astype(np.int64)  # 32-bit registers
    if attrs["out"] == "float32":
        y = acc.astype(_F32) * epi["scale"][ch]
        if "bias" in epi:
            y = y + epi["bias"][ch]
        if attrs["relu"]:
            y = np.maximum(y, _F32(0))
        return y
    v = acc + epi["bias_q"][ch].astype(np.int64)
    return requantize(v, epi["multiplier"][ch], epi["shift"][ch], attrs["y_zero"], attrs["y_min"], attrs["y_max"])


def _elementwise_whole(layer: Layer, env, out: np.ndarray) -> None:
    k = layer.kind
    x = env[layer.inputs[0]]
    if k == "permute_dims":
        out[...] = np.transpose(x, layer.attrs["axes"])
    elif k == "broadcast_to":
        out[...] = np.broadcast_to(x, out.shape)
    elif k == "reshape":
        out[...] = np.reshape(x, out.shape)
    else:
        args = [v if v.shape == out.shape else np.broadcast_to(v, out.shape) for v in (env[i] for i in layer.inputs)]
        res = _BINARY[k](args[0], args[1]) if k in _BINARY else _unary(k, args[0], layer.attrs)
        if layer.attrs.get("relu"):
            res = _relu(res)
        out[...] = res


_ELEMENTWISE = ("reshape", "permute_dims", "broadcast_to", "relu", "gelu", "gelu_tanh", "sigmoid", "tanh", "clip",
                *_BINARY)


def _run_whole(program: Program, index: int, layer: Layer, env) -> np.ndarray | None:
    """Layer ``index`` over its whole output, or None where it must run tile by tile."""
    spec = program.tensors[layer.output]
    out = np.empty(spec.shape, dtype=spec.dtype)
    k = layer.kind
    if k in ("conv2d", "dense", "matmul"):
        if layer.mode == "int8":
            return out if _qgemm_whole(program, layer, index, env, out) else None
        _gemm_whole(program, layer, env, out)
        return out
    if k == "reshape":  # pure relabelling: a view (values are never written after they are made)
        x = env[layer.inputs[0]]
        if x.dtype == out.dtype and x.flags.c_contiguous and x.flags.writeable:
            return x.reshape(out.shape)
    if k in _ELEMENTWISE:
        _elementwise_whole(layer, env, out)
        return out
    runner = _LayerRunner(program, layer, env)
    runner.run(_Whole(_whole_region(layer, runner.out)))
    return runner.out


# -- execution plans: what "layers" mode prepares once per program ---------------------------
# A call of a small model's region costs mostly Python per layer (GEMM shapes, operand views,
# read-only constant views for the FFI, index vectors, dictionary look-ups). A plan does that work
# once per Program: per layer one prepared step ``step(program, env) -> output array`` over a list
# ``env`` indexed by tensor id. Steps hold only read-only prepared constants: every call allocates
# its own outputs and intermediates (nothing a caller holds is written later, and concurrent calls
# share no scratch). The arithmetic is that of _run_whole, operation for operation (same bits).


def _writable(x: np.ndarray) -> np.ndarray:
    """``x`` as the FFI takes it: DLPack cannot export read-only arrays (``_lib._input``)."""
    return x if x.flags.writeable else _lib._input(x)


_ZERO = _F32(0)


def _relu_owned(r: np.ndarray) -> np.ndarray:
    """:func:`_relu` of an array the caller owns, in place where it is float32: ``fmax(r, 0)``
    is ``r > 0 ? r : 0`` except that it may keep a -0.0 (fmax returns the number for NaN), and
    adding +0.0 turns exactly -0.0 into +0.0, leaving every other value (all >= 0) unchanged."""
    if r.dtype != _F32:
        return _relu(r)
    np.fmax(r, _ZERO, out=r)
    np.add(r, _ZERO, out=r)
    return r


def _clip_fast(lo, hi):
    """``x -> max(min(x, hi), lo)`` (TVM's order and NaN rules, :func:`_unary`) as fmin/fmax, or
    None where they could differ. ``x < hi ? x : hi`` is ``fmin(x, hi)`` when ``hi`` is a nonzero
    number (NaN x gives hi; equal values have equal bits); ``y > lo ? y : lo`` is ``fmax(y, lo)``
    when ``lo`` is a nonzero number (y is never NaN), or, for ``lo`` = +0.0, ``fmax(y, 0) + 0.0``
    (see :func:`_relu_owned`)."""
    lo, hi = _F32(lo), _F32(hi)
    if np.isnan(lo) or np.isnan(hi) or hi == 0 or (lo == 0 and np.signbit(lo)):
        return None
    plus_zero = lo == 0

    def clip(x, out=None):
        if x.dtype != _F32:
            return None
        y = np.fmin(x, hi, out=out)
        np.fmax(y, lo, out=y)
        if plus_zero:
            np.add(y, _ZERO, out=y)
        return y
    return clip


class _Plan:
    __slots__ = ("owner", "template", "steps", "args", "outputs", "__weakref__")

    def __init__(self, program: Program):
        self.owner = id(program)
        tensors = program.tensors
        template: list = [None] * len(tensors)
        for tid, value in program.constants.items():
            template[tid] = value
        self.template = template
        #: (tid, shape, dtype) of the DPS arguments: inputs then outputs (see executor.execute)
        self.args = tuple((tid, tuple(tensors[tid].shape), np.dtype(tensors[tid].dtype))
                          for tid in (*program.inputs, *program.outputs))
        self.outputs = frozenset(program.outputs)
        fused = _fusable_clips(program)  # GEMM layer index -> its clip layer's index
        clip_of = {index: program.layers[j] for index, j in fused.items()}
        absorbed = {j: program.layers[index].output for index, j in fused.items()}
        steps = []
        for index, layer in enumerate(program.layers):
            if index in absorbed:  # its GEMM applied the clip: the value is the GEMM's result
                source = absorbed[index]
                steps.append((layer.output, lambda program, env, source=source: env[source], None))
                continue
            step = _build_step(program, index, layer, clip_of.get(index))
            # step.into(program, env, out): the same values written into ``out`` (None: a new
            # array), for layers that produce a program output
            into = getattr(step, "into", None) if layer.output in self.outputs else None
            steps.append((layer.output, step, into))
        self.steps = tuple(steps)

    def run(self, program: Program, inputs, outs=None) -> list[np.ndarray]:
        """Outputs of ``program`` on ``inputs``. ``outs``: the caller's output arrays (DPS), which
        layers producing an output may fill directly (the result is then that array); an output
        array sharing memory with an input or another output is not written here."""
        env = self.template.copy()
        for tid, value in zip(program.inputs, inputs):
            env[tid] = value
        into = None
        if outs is not None:
            into = {}
            taken = list(inputs)
            for tid, dst in zip(program.outputs, outs):
                if (type(dst) is np.ndarray and dst.flags.c_contiguous and dst.flags.writeable
                        and tid not in into and not any(np.may_share_memory(dst, v) for v in taken)):
                    into[tid] = dst
                taken.append(dst)
        with np.errstate(all="ignore"):
            if into:
                for tid, step, fill in self.steps:
                    dst = into.get(tid) if fill is not None else None
                    env[tid] = step(program, env) if dst is None else fill(program, env, dst)
            else:
                for tid, step, _ in self.steps:
                    env[tid] = step(program, env)
        return [env[tid] for tid in program.outputs]


_PLANS: dict[int, tuple] = {}


def _forget(ref, key: int) -> None:
    entry = _PLANS.get(key)
    if entry is not None and entry[0] is ref:
        _PLANS.pop(key, None)


def program_plan(program: Program) -> _Plan:
    """The execution plan of ``program`` (built on first use; one per live Program object, dropped
    with it). A Program must not be edited after it has run (a copy gets its own plan)."""
    key = id(program)
    entry = _PLANS.get(key)
    if entry is not None and entry[0]() is program:
        return entry[1]
    plan = _Plan(program)  # concurrent first calls may both build: equal plans, one is kept
    _PLANS[key] = (weakref.ref(program, lambda ref, key=key: _forget(ref, key)), plan)
    return plan


def _generic_step(index: int, layer: Layer):
    """The unprepared path (_run_whole, else tile by tile): kinds and cases without a plan."""
    def step(program, env):
        out = _run_whole(program, index, layer, env)
        if out is None:
            runner = _LayerRunner(program, layer, env)
            for tile in _layer_tiles(program, index):
                runner.run(tile)
            out = runner.out
        return out
    return step


def _fusable_clips(program: Program) -> dict[int, int]:
    """{GEMM layer index: clip layer index} for fp32 GEMMs whose result only a clip (no ReLU of
    its own, same shape) reads and that is not a program output: the GEMM's epilogue applies
    the clip (``x < hi ? x : hi``, then ``> lo``: the clip's own operations, in place)."""
    readers: dict[int, list[int]] = {}
    for index, layer in enumerate(program.layers):
        for tid in set(layer.inputs):
            readers.setdefault(tid, []).append(index)
    outputs = set(program.outputs)
    tensors = program.tensors
    fused = {}
    for index, layer in enumerate(program.layers):
        users = readers.get(layer.output, ())
        if (layer.kind not in ("conv2d", "dense", "matmul") or layer.mode != "fp32"
                or layer.output in outputs or len(users) != 1):
            continue
        clip = program.layers[users[0]]
        if (clip.kind == "clip" and clip.mode == "fp32" and list(clip.inputs) == [layer.output]
                and not clip.attrs.get("relu")
                and tensors[clip.output].shape == tensors[layer.output].shape
                and tensors[clip.output].dtype == tensors[layer.output].dtype == "float32"):
            fused[index] = users[0]
    return fused


def _build_step(program: Program, index: int, layer: Layer, clip: Layer | None = None):
    """The layer's step; ``clip``: a clip layer whose operations this (GEMM) step applies."""
    if layer.mode not in ("fp32", "int8"):
        def unsupported(program, env, name=layer.name, mode=layer.mode):
            raise NotImplementedError(f"layer {name}: mode {mode} is not simulated")
        return unsupported
    try:
        tensors = program.tensors
        spec = tensors[layer.output]
        if all(int(d) > 0 for d in spec.shape) and all(tid in program.constants for tid in layer.consts.values()):
            k = layer.kind
            step = None
            if k in ("conv2d", "dense", "matmul") and layer.mode == "fp32":
                step = _gemm_step(program, layer, clip)
            elif k in _ELEMENTWISE:
                step = _elementwise_step(program, layer)
            elif k in ("softmax", "layer_norm", "mean"):
                step = _rows_step(program, layer)
            elif k in ("max_pool2d", "avg_pool2d"):
                step = _pool_step(program, layer)
            if step is not None:
                return step
    except Exception:  # a malformed layer fails when it runs, where _run_whole fails
        pass
    step = _generic_step(index, layer)
    if clip is None:
        return step
    attrs = clip.attrs  # the clip layer's own operations (its step is then a pass-through)
    return lambda program, env: _unary("clip", step(program, env), attrs)


def _operand(program: Program, tid: int, prepare):
    """A getter ``env -> prepare(env[tid])``, evaluated once here for a constant."""
    if tid in program.constants:
        value = prepare(program.constants[tid])
        return lambda env: value
    return lambda env: prepare(env[tid])


def _gemm_step(program: Program, layer: Layer, clip: Layer | None = None):
    """_gemm_whole with its operand layout, index vectors and bias prepared; the bias, ReLU and
    ``clip`` (a fused clip layer, see :func:`_fusable_clips`) run in the C++ epilogue."""
    g = gemm_shape(program, layer)
    tensors = program.tensors
    shape = tuple(tensors[layer.output].shape)
    dtype = np.dtype(tensors[layer.output].dtype)
    rhs_tid = layer.consts["weight"] if "weight" in layer.consts else layer.inputs[1]
    x_tid = layer.inputs[0]
    cshape = (g.batch, g.m, g.n)
    relu = bool(layer.attrs.get("relu"))
    bias_tid = layer.consts.get("bias")
    bias = _NO_BIAS
    if bias_tid is not None:
        bias = _writable(np.ascontiguousarray(program.constants[bias_tid], dtype=_F32).reshape(-1))
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
            return _depthwise_step(program, layer, shape, dtype, bias, relu, clip is not None, lo, hi)
        get_a = _operand(program, rhs_tid, lambda w: _writable(np.ascontiguousarray(w).reshape(groups, wshape[0] // groups, -1)))
        if (kh, kw) == (1, 1) and tuple(attrs["strides"]) == (1, 1) and not any(attrs["padding"]) and (oh, ow) == (h, w):
            bshape = (n * groups, cg, h * w)
            get_b = _operand(program, x_tid, lambda x: _writable(np.ascontiguousarray(x).reshape(bshape)))
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
                im2col(_writable(x), out, np.zeros(1, dtype=x.dtype), params, 0)
                return out
            get_b = _operand(program, x_tid, cols)
        a_index = np.arange(g.batch, dtype=np.int64) % groups
        b_index = np.arange(g.batch, dtype=np.int64)
    else:
        if bias.size not in (0, g.n):
            return None
        ep_shape, on_rows = cshape, False  # the bias is per column
        if layer.kind == "dense":
            get_a = _operand(program, x_tid, lambda x: _writable(np.ascontiguousarray(x).reshape(1, g.m, g.k)))
            get_b = _operand(program, rhs_tid, lambda r: _writable(np.ascontiguousarray(r).reshape(1, g.k, g.n)))
            a_index = b_index = np.zeros(1, dtype=np.int64)
        else:
            batch_shape = shape[:-2]

            def operand(tid):
                tshape = tuple(tensors[tid].shape)
                lead = tshape[:-2]
                index = np.arange(int(np.prod(lead, dtype=np.int64)), dtype=np.int64).reshape(lead)
                index = np.array(np.broadcast_to(index, batch_shape).reshape(-1), dtype=np.int64)  # writable
                three = (-1, tshape[-2], tshape[-1])
                return _operand(program, tid, lambda t: _writable(np.ascontiguousarray(t).reshape(three))), index
            get_a, a_index = operand(x_tid)
            get_b, b_index = operand(rhs_tid)
    if dtype != _F32:
        return None
    finish = bias.size or relu or clip is not None

    def into(program, env, out):
        if out is None:
            out = np.zeros(shape, dtype=dtype)
        else:  # the caller's output buffer (_Plan.run checked it)
            out.fill(0)
        gemm(get_a(env), get_b(env), out.reshape(cshape), a_index, b_index, 0)
        if finish:  # fl(acc + bias), then ReLU (x > 0 ? x : +0), then the fused clip
            epilogue(out.reshape(ep_shape), bias, on_rows, relu, clip is not None, lo, hi, 0)
        return out

    gemm = _lib._func("tvm_spinn.sim.gemm_f32_batched")

    def step(program, env):
        return into(program, env, None)
    step.into = into
    return step


#: "no bias" for the C++ epilogue (a bias with no elements)
_NO_BIAS = np.zeros(0, dtype=_F32)


def _depthwise_step(program, layer, shape, dtype, bias, relu, clip, lo, hi):
    """A conv with one input channel per group, on the direct C++ kernel (no im2col): each
    output's taps in im2col order from +0.0, then the epilogue; the bits of the GEMM path."""
    attrs = layer.attrs
    tensors = program.tensors
    weight = program.constants[layer.consts["weight"]]
    cout, _, kh, kw = weight.shape
    weight = _writable(np.ascontiguousarray(weight, dtype=_F32).reshape(cout, kh, kw))
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
        conv(_writable(np.ascontiguousarray(env[x_tid])), weight, out, bias, geometry, relu, clip, lo, hi, 0)
        return out

    def step(program, env):
        return into(program, env, None)
    step.into = into
    return step


def _elementwise_step(program: Program, layer: Layer):
    """_elementwise_whole (and _run_whole's reshape view) with shapes prepared."""
    tensors = program.tensors
    shape = tuple(tensors[layer.output].shape)
    dtype = np.dtype(tensors[layer.output].dtype)
    k = layer.kind
    x_tid = layer.inputs[0]
    if k == "reshape":
        def step(program, env):
            x = env[x_tid]
            if x.dtype == dtype and x.flags.c_contiguous and x.flags.writeable:
                return x.reshape(shape)
            out = np.empty(shape, dtype=dtype)
            out[...] = np.reshape(x, shape)
            return out
        return step
    if k in ("permute_dims", "broadcast_to"):
        axes = layer.attrs["axes"] if k == "permute_dims" else None

        def step(program, env):
            out = np.empty(shape, dtype=dtype)
            x = env[x_tid]
            out[...] = np.transpose(x, axes) if axes is not None else x  # (assignment broadcasts)
            return out
        return step
    # Operands are not broadcast to the output first: element-wise results are the same on the
    # ufunc's own broadcast, and finish() broadcasts a smaller result into the output.
    getters = [lambda env, tid=tid: env[tid] for tid in layer.inputs]
    relu = bool(layer.attrs.get("relu"))
    attrs = layer.attrs

    def finish(res):  # res: a new array or scalar (a ufunc result)
        if type(res) is np.ndarray and res.shape == shape and res.dtype == dtype and res.flags.c_contiguous:
            return _relu_owned(res) if relu else res  # nothing else holds it
        if relu:
            res = _relu(res)
        out = np.empty(shape, dtype=dtype)
        out[...] = res
        return out
    if k in _BINARY:
        op = _BINARY[k]
        t0, t1 = layer.inputs[0], layer.inputs[1]
        return lambda program, env: finish(op(env[t0], env[t1]))
    get0 = getters[0]
    if k == "relu":
        def relu_step(program, env):
            x = get0(env)
            if x.dtype != _F32:
                return finish(_unary(k, x, attrs))
            y = np.fmax(x, _ZERO)  # as _relu_owned, into a new array
            np.add(y, _ZERO, out=y)
            return finish(y)
        return relu_step
    clip = _clip_fast(attrs["min"], attrs["max"]) if k == "clip" else None
    if clip is not None:
        def clip_step(program, env):
            x = get0(env)
            y = clip(x)
            return finish(_unary(k, x, attrs) if y is None else y)

        def clip_into(program, env, out):
            x = get0(env)
            if x.dtype != _F32 or dtype != _F32:
                return clip_step(program, env)
            clip(x, out)  # x broadcasts to the output
            return _relu_owned(out) if relu else out
        clip_step.into = clip_into
        return clip_step
    return lambda program, env: finish(_unary(k, get0(env), attrs))


def _rows_step(program: Program, layer: Layer):
    """_LayerRunner._run_rows over the whole output, with the row layout and constants prepared."""
    tensors = program.tensors
    shape = tuple(tensors[layer.output].shape)
    if np.dtype(tensors[layer.output].dtype) != _F32:
        return None
    k = layer.kind
    x_tid = layer.inputs[0]
    row = int(layer.attrs["row"]) if k == "mean" else int(tensors[x_tid].shape[-1])
    rows_shape = (-1, row)
    d = _F32(row)
    row_sum_f32 = _lib._func("tvm_spinn.sim.row_sum_f32")

    def row_sum(x):
        out = np.empty(x.shape[0], dtype=_F32)
        row_sum_f32(_writable(np.ascontiguousarray(x, dtype=_F32)), out)
        return out
    if k == "mean":
        def step(program, env):
            x = np.ascontiguousarray(env[x_tid]).reshape(rows_shape)
            return (row_sum(x) / d).reshape(shape)
        return step
    if k == "softmax":
        def step(program, env):
            x = np.ascontiguousarray(env[x_tid]).reshape(rows_shape)
            e = np.exp(x - x.max(axis=-1, keepdims=True)).astype(_F32)
            res = e / row_sum(e)[:, None]
            if res.dtype != _F32:
                res = res.astype(_F32)
            return np.ascontiguousarray(res).reshape(shape)
        return step
    eps = _F32(layer.attrs["epsilon"])
    gamma = program.constants[layer.consts["gamma"]] if layer.attrs.get("scale", True) else None
    beta = program.constants[layer.consts["beta"]] if layer.attrs.get("center", True) else None

    def step(program, env):
        x = np.ascontiguousarray(env[x_tid]).reshape(rows_shape)
        mean = row_sum(x) / d
        centered = (x - mean[:, None]).astype(_F32)
        var = row_sum(centered * centered) / d
        y = centered / np.sqrt(var + eps)[:, None]
        if gamma is not None:
            y = y * gamma
        if beta is not None:
            y = y + beta
        out = np.empty((x.shape[0], row), dtype=_F32)
        out[...] = y
        return out.reshape(shape)
    return step


def _pool_step(program: Program, layer: Layer):
    """_LayerRunner._prepare_pool / _run_pool over the whole output (float32), with the window
    slices and the avg-pool counts prepared; the same window order and operations."""
    tensors = program.tensors
    x_tid = layer.inputs[0]
    if np.dtype(tensors[x_tid].dtype) != _F32 or np.dtype(tensors[layer.output].dtype) != _F32:
        return None
    shape = tuple(tensors[layer.output].shape)
    n, c, h, w = tensors[x_tid].shape
    attrs = layer.attrs
    pt, pl, pb, pr = attrs["padding"]
    kh, kw = attrs["pool_size"]
    sh, sw = attrs["strides"]
    dh, dw = attrs["dilation"]
    oh, ow = shape[2], shape[3]
    is_max = layer.kind == "max_pool2d"
    fill = _F32_LOWEST if is_max else _F32(0.0)
    padded = (n * c, h + pt + pb, w + pl + pr)
    band = (oh - 1) * sh + (kh - 1) * dh + 1
    windows = [(slice(i * dh, i * dh + sh * (oh - 1) + 1, sh), slice(j * dw, j * dw + sw * (ow - 1) + 1, sw))
               for i in range(kh) for j in range(kw)]
    div = None
    if not is_max:
        valid = np.pad(np.ones((h, w), _F32), ((pt, pb), (pl, pr)))[:band]
        count = np.zeros((oh, ow), _F32)
        for sl in windows:
            count += valid[sl]
        div = _F32(kh * kw) if attrs.get("count_include_pad") else count

    def step(program, env):
        x = env[x_tid]
        planes = np.full(padded, fill, dtype=_F32)
        planes.reshape(n, c, padded[1], padded[2])[:, :, pt:pt + h, pl:pl + w] = x
        src = planes[:, :band]
        acc = None
        for s0, s1 in windows:  # sequential window order, vectorized over planes and pixels
            v = src[:, s0, s1]
            if is_max:
                acc = np.full(v.shape, _F32_LOWEST) if acc is None else acc
                acc = np.where(acc > v, acc, v)
            else:
                acc = v.astype(_F32) if acc is None else (acc + v).astype(_F32)
        if not is_max:
            acc = (acc / div).astype(_F32)
        if acc.dtype != _F32 or not acc.flags.c_contiguous:
            acc = np.ascontiguousarray(acc, dtype=_F32)
        return acc.reshape(shape)
    return step


def run_program(program: Program, inputs: list[np.ndarray], mode: str | None = None) -> list[np.ndarray]:
    """Execute ``program`` on ``inputs`` (in ``program.inputs`` order); returns its outputs.

    ``mode`` (default ``$TVM_SPINN_SIM_MODE``, else ``"layers"``): ``"layers"`` runs every layer
    whole (from the program's prepared plan, :func:`program_plan`), ``"tiles"`` executes every
    tile of the mapping (reference); the bits are the same."""
    if sim_mode(mode) == "layers":
        return program_plan(program).run(program, inputs)
    env: dict[int, np.ndarray] = dict(program.constants)
    for tid, value in zip(program.inputs, inputs):
        env[tid] = value
    # IEEE hardware does not trap: overflow to inf, 0/0 = NaN and NaN comparisons are results,
    # not errors, so numpy must not warn about them (nor raise under -W error).
    with np.errstate(all="ignore"):
        for index, layer in enumerate(program.layers):
            if layer.mode not in ("fp32", "int8"):
                raise NotImplementedError(f"layer {layer.name}: mode {layer.mode} is not simulated")
            runner = _LayerRunner(program, layer, env)
            for tile in _layer_tiles(program, index):
                runner.run(tile)
            env[layer.output] = runner.out
    return [env[tid] for tid in program.outputs]
