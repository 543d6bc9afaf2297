"""Element-wise fp32 PE kernels: one IEEE fp32 operation (or compare and select) per TIR
operation, per element.

Kernels (the ``spec`` of :func:`~tvm_spinn.pe.kernels.kernel_object`):

- ``("binary", op, relu)``: ``c[i] = a[i] <op> b[i]`` (op ``add``/``subtract``/``multiply``/
  ``divide``), then ``x > 0 || x != x ? x : +0`` when ``relu``; args ``a, b, c, n``.
- ``("relu",)``: args ``x, y, n``.
- ``("clip",)``: ``y = x < hi || x != x ? x : hi``, then ``y > lo || y != y ? y : lo`` (TVM's
  ``max(min(x, hi), lo)`` as compare-and-select, a NaN kept); args ``x, y, n, lo, hi`` (the
  bounds as float32 bits).
- ``("where_less",)``: ``y[i] = a[i] < b[i] ? c[i] : d[i]`` (a compare and a select: the
  chosen operand's bits, a NaN compare false); args ``a, b, c, d, y, n``.
- ``("rope",)``: ``y[i] = x[i] * c[i] + (j < h ? -p[i] : p[i]) * s[i]`` with ``j`` the element's
  position in its row of ``2 h`` (``j0`` for the first, wrapping to 0 at the row's end) and
  ``p`` the DMA's run of partners (``x`` at ``e + h`` in a row's first half, ``e - h`` in its
  second; the sign bit flipped as ``negative`` does); args ``x, p, c, s, y, n, j0, h``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import _ZERO

BINARY_OPS = {
    "add": lambda x, y: x + y,
    "subtract": lambda x, y: x - y,
    "multiply": lambda x, y: x * y,
    "divide": lambda x, y: x / y,
}


def _relu(v):
    """``v > 0 ? v : +0`` with a NaN kept (the simulator's :func:`~tvm_spinn.program.ops.elementwise.relu`)."""
    # !(v <= 0) is v > 0 or unordered: one compare keeps a NaN (not ``v != v``, which TVM's
    # arithmetic simplifier folds to false, assuming no NaN).
    return T.if_then_else(T.Not(v <= _ZERO), v, _ZERO)


def _binary(op: str, relu: bool):
    fn = BINARY_OPS[op]

    @T.prim_func
    def kernel(a: T.handle("float32"), b: T.handle("float32"), c: T.handle("float32"), n: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        A = T.decl_buffer((n,), "float32", data=a)
        B = T.decl_buffer((n,), "float32", data=b)
        C = T.decl_buffer((n,), "float32", data=c)
        for i in range(n):
            if relu:
                C[i] = _relu(fn(A[i], B[i]))
            else:
                C[i] = fn(A[i], B[i])
    return kernel


def _relu_kernel():
    @T.prim_func
    def kernel(x: T.handle("float32"), y: T.handle("float32"), n: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((n,), "float32", data=x)
        Y = T.decl_buffer((n,), "float32", data=y)
        for i in range(n):
            Y[i] = _relu(X[i])
    return kernel


def _where_less():
    @T.prim_func
    def kernel(a: T.handle("float32"), b: T.handle("float32"), c: T.handle("float32"), d: T.handle("float32"),
               y: T.handle("float32"), n: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        A = T.decl_buffer((n,), "float32", data=a)
        B = T.decl_buffer((n,), "float32", data=b)
        C = T.decl_buffer((n,), "float32", data=c)
        D = T.decl_buffer((n,), "float32", data=d)
        Y = T.decl_buffer((n,), "float32", data=y)
        for i in range(n):
            Y[i] = T.if_then_else(A[i] < B[i], C[i], D[i])
    return kernel


def _rope():
    @T.prim_func
    def kernel(x: T.handle("float32"), p: T.handle("float32"), c: T.handle("float32"), s: T.handle("float32"),
               y: T.handle("float32"), n: T.int32, j0: T.int32, h: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((n,), "float32", data=x)
        P = T.decl_buffer((n,), "float32", data=p)
        C = T.decl_buffer((n,), "float32", data=c)
        S = T.decl_buffer((n,), "float32", data=s)
        Y = T.decl_buffer((n,), "float32", data=y)
        j = T.decl_buffer((1,), "int32", scope="local")
        j[0] = j0
        for i in range(n):
            # the first half's partner with its sign bit flipped: an integer select of the
            # mask and an EOR, no branch; then the imported graph's order: x * cos,
            # rotate_half(x) * sin, their sum
            sign = T.if_then_else(j[0] < h, T.int32(-2147483648), T.int32(0))
            r = T.reinterpret("float32", T.bitwise_xor(T.reinterpret("int32", P[i]), sign))
            Y[i] = X[i] * C[i] + r * S[i]
            j[0] = T.if_then_else(j[0] + 1 == h + h, 0, j[0] + 1)
    return kernel


def _clip_kernel():
    @T.prim_func
    def kernel(x: T.handle("float32"), y: T.handle("float32"), n: T.int32, lo: T.int32, hi: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((n,), "float32", data=x)
        Y = T.decl_buffer((n,), "float32", data=y)
        v = T.decl_buffer((1,), "float32", scope="local")
        flo = T.reinterpret("float32", lo)
        fhi = T.reinterpret("float32", hi)
        for i in range(n):
            # !(x >= hi) is x < hi or unordered: one compare keeps a NaN
            v[0] = T.if_then_else(T.Not(X[i] >= fhi), X[i], fhi)
            Y[i] = T.if_then_else(T.Not(v[0] <= flo), v[0], flo)
    return kernel
