"""The 2-D pooling PE kernels, forward and the max pool's backward.

Kernels (the ``spec`` of :func:`~tvm_spinn.pe.kernels.kernel_object`):

- ``("pool", op)`` (``max``/``avg``): 2-D pooling of a band of padded input rows, the window
  visited row by row: max from the lowest finite float32 by ``acc > v || acc != acc ? acc :
  v``; average as an fp32 sum from the window's first element, divided by ``div[r, c]`` (the
  window size or its count of non-padding elements); args ``src, div, dst, geom`` with
  ``geom`` ``[planes, rows, ow, band_h, wp, kh, kw, sh, sw, dh, dw]`` (int32).
- ``("pool_grad",)``: ``max_pool2d_backward`` on a band of one plane's rows: the output
  elements ``[lo, hi)`` of the band set to +0.0, then the windows that may hold a band row
  visited from the last backwards (rows, then columns), each one's argmax found as TVM's
  ``pool_grad`` finds it (from the lowest float32, a tap taken unless ``best > v || best ==
  v``, so a NaN is taken; the best kept by ``best > v ? best : v``) and its gradient added to
  the element it takes where that lies in ``[lo, hi)`` and not in the padding (the VADD takes
  the gradient as its first operand); args ``x, dy, dx, geom`` with ``x`` the padded input rows
  under the windows, ``dy`` their gradients and ``geom`` ``[windows' rows, ow, padded width, kh,
  kw, sh, sw, the band's first element row relative to the windows' first padded row, w, lo,
  hi, left padding]`` (int32).
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

#: the lowest finite float32: the max pool's start
_LOWEST = T.float32(-3.4028234663852886e38)


def _pool(op: str):
    is_max = op == "max"

    @T.prim_func
    def kernel(src: T.handle("float32"), div: T.handle("float32"), dst: T.handle("float32"), geom: T.handle("int32")):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        G = T.decl_buffer((11,), "int32", data=geom)
        planes, rows, ow, bh, wp = G[0], G[1], G[2], G[3], G[4]
        kh, kw, sh, sw, dh, dw = G[5], G[6], G[7], G[8], G[9], G[10]
        S = T.decl_buffer((planes * bh * wp,), "float32", data=src)
        DV = T.decl_buffer((rows * ow,), "float32", data=div)
        D = T.decl_buffer((planes * rows * ow,), "float32", data=dst)
        acc = T.decl_buffer((1,), "float32", scope="local")
        for p in range(planes):
            for r in range(rows):
                for c in range(ow):
                    if is_max:
                        acc[0] = _LOWEST
                    for i in range(kh):
                        for j in range(kw):
                            v = S[p * bh * wp + (r * sh + i * dh) * wp + c * sw + j * dw]
                            if is_max:
                                acc[0] = T.if_then_else(tvm.tirx.Or(acc[0] > v, T.isnan(acc[0])), acc[0], v)
                            else:
                                acc[0] = T.if_then_else(i == 0 and j == 0, v, acc[0] + v)
                    if is_max:
                        D[p * rows * ow + r * ow + c] = acc[0]
                    else:
                        D[p * rows * ow + r * ow + c] = acc[0] / DV[r * ow + c]
    return kernel


def _pool_grad():
    """``max_pool2d_backward`` on a band of one plane's input rows (see the module docstring)."""

    @T.prim_func
    def kernel(x: T.handle("float32"), dy: T.handle("float32"), dx: T.handle("float32"), geom: T.handle("int32")):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        G = T.decl_buffer((15,), "int32", data=geom)
        nwy, nwx, ow, wp, kh, kw, sh, sw = G[0], G[1], G[2], G[3], G[4], G[5], G[6], G[7]
        rbase, w, lo, hi, pl, ox0 = G[8], G[9], G[10], G[11], G[12], G[13]
        X = T.decl_buffer((((nwy - 1) * sh + kh) * wp,), "float32", data=x)
        DY = T.decl_buffer((nwy * ow,), "float32", data=dy)
        D = T.decl_buffer((hi,), "float32", data=dx)
        best = T.decl_buffer((1,), "float32", scope="local")
        tap = T.decl_buffer((2,), "int32", scope="local")
        for e in range(lo, hi):
            # +0.0 from the job's words (``G[14]``): a constant's store loop would become the
            # runtime's byte-wise memset, four stores per element
            D[e] = T.reinterpret("float32", G[14])
        # the windows from the last backwards (rows, then columns): each element's gradient
        # adds its windows' in that order (the +0.0 of a window not taking it changes no bits)
        for a in range(nwy):
            for b in range(nwx):
                best[0] = _LOWEST
                tap[0] = -1
                tap[1] = 0
                for i in range(kh):
                    for j in range(kw):
                        # TVM's argmax: the later tap unless the best is greater or equal (a NaN
                        # either side is taken); the best kept by ``best > v ? best : v``
                        if T.Not(tvm.tirx.Or(
                                best[0] > X[((nwy - 1 - a) * sh + i) * wp + (ox0 + nwx - 1 - b) * sw + j],
                                best[0] == X[((nwy - 1 - a) * sh + i) * wp + (ox0 + nwx - 1 - b) * sw + j])):
                            tap[0] = i
                            tap[1] = j
                        best[0] = T.if_then_else(
                            best[0] > X[((nwy - 1 - a) * sh + i) * wp + (ox0 + nwx - 1 - b) * sw + j], best[0],
                            X[((nwy - 1 - a) * sh + i) * wp + (ox0 + nwx - 1 - b) * sw + j])
                if tap[0] >= 0:
                    # the taken element: in the band's flat range and not in the padding columns
                    c = (ox0 + nwx - 1 - b) * sw + tap[1] - pl
                    f = ((nwy - 1 - a) * sh + tap[0] + rbase) * w + c
                    if c >= 0 and c < w and f >= lo and f < hi:
                        D[f] = D[f] + DY[(nwy - 1 - a) * ow + ox0 + nwx - 1 - b]
    return kernel
