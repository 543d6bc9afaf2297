"""The fp32 row PE kernels: a row split over PEs chains its statistics (max, sums) in the row's
order from one job to the next, in phases.

Kernels (the ``spec`` of :func:`~tvm_spinn.pe.kernels.kernel_object`):

- ``("mean",)``: one chunk of each row's sequential fp32 sum, from +0.0 (``flags`` bit 0) or
  from the partial ``part[r]`` the previous chunk's PE passed on; the row's last chunk (bit 1)
  writes ``sum / fl(d)``, the others the partial; args ``x, part, y, rows, cols, flags, d``.
- ``("softmax",)``: the row kernel ``e / sum(e)``, ``e = exp(x - max)`` in three phases
  (argument ``phase``), so that a row split over PEs chains its statistics in the row's order:
  0, the max (from -inf, or the chain's ``st[2r]`` when ``flags`` bit 0 is clear; the row's
  first NaN wins); 1, ``y = x - max``, the chunk's ``y = exp(y)`` in one stream through the
  exp/log unit (the runtime's ``pe_exp``, a modelled peripheral), then the sequential sum of
  ``y`` into ``st[2r + 1]`` (from +0.0 on the first chunk); 2, ``y = y / sum``; args ``x, y,
  st, rows, cols, phase, flags``.
- ``("xent_grad",)``: ``cross_entropy_backward``, the softmax kernel's phases plus one: 0, the
  max (as softmax's); 1, ``y = exp(x - max)`` in one stream through the exp/log unit, and the
  sequential sum into ``st[2r + 1]``; 3, phase 1 without the sum (a streamed row's exps again for
  its output: the same bits); 2, ``y = (y / sum - (c0 + j == label[r] ? 1 : 0)) / n``; args ``x,
  y, st, labels, rows, cols, phase, flags, c0, n`` (``n``: float32 bits).
- ``("layer_norm",)``: the row's blocked sums (:data:`~tvm_spinn.program.ops.rows.LAYER_NORM_BLOCK`
  elements per block, blocks aligned at the row's start, the chunk's first column ``c0``)
  carried as ``(sum, block partial)`` in ``st[4r], st[4r + 1]``: phase 0 sums ``x``, the
  last chunk (bit 1) writes ``mean = sum / fl(d)`` to ``st[4r + 2]``; phase 1 writes ``y = x -
  mean`` and sums ``y * y``, the last chunk writes ``den = sqrt(sum / fl(d) + eps)`` (VSQRT) to
  ``st[4r + 3]``; phase 2 writes ``y / den``, times ``gamma`` (bit 2), plus ``beta`` (bit 3);
  args ``x, y, st, gamma, beta, rows, cols, phase, flags, c0, d, eps`` (``eps``: float32 bits).
- ``("rms_norm",)``: phase 0 the blocked sum of ``x * x``, the last chunk writing ``1 / sqrt(q
  / fl(d) + eps)`` to ``st[4r + 2]``; phase 1 ``h = x * r``, times the weight (bit 2, as
  ``w * h``); args ``x, y, st, w, rows, cols, phase, flags, c0, d, eps``.
- ``("cross_entropy",)``: the per-row loss ``log(s) - (z[t] - m)`` of logits ``x`` with int32
  labels ``lab`` (:func:`tvm_spinn.program.ops.loss.cross_entropy_rows`) in three phases over a
  row's chunks, the statistics chained in ``st`` (4 per row): 0 and 1 as ``softmax``'s (the
  max into ``st[4r]``; ``x - max`` and its exps in ``y``, their sequential sum into ``st[4r +
  1]``); 2, where the chunk (first column ``c0``) holds the row's label, ``z[t] - max`` into
  ``st[4r + 2]``, and on the row's last chunk (``flags`` bit 1) the sums' logs in one stream
  through the exp/log unit (the runtime's ``pe_log``) and ``out[r] = log(s) - st[4r + 2]``
  (+0.0 where the label is ``ignore``); args ``x, y, st, lab, out, rows, cols, phase, flags,
  c0, ignore``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ...program.ops.rows import LAYER_NORM_BLOCK
from .common import _exp_unit, _f, _vsqrt, _ZERO

_BLOCK = LAYER_NORM_BLOCK


def _mean():
    @T.prim_func
    def kernel(x: T.handle("float32"), part: T.handle("float32"), y: T.handle("float32"),
               rows: T.int32, cols: T.int32, flags: T.int32, d: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((rows * cols,), "float32", data=x)
        P = T.decl_buffer((rows,), "float32", data=part)
        Y = T.decl_buffer((rows,), "float32", data=y)
        acc = T.decl_buffer((1,), "float32", scope="local")
        for r in range(rows):
            acc[0] = T.if_then_else(flags & 1 != 0, _ZERO, P[r])
            for j in range(cols):
                acc[0] = acc[0] + X[r * cols + j]
            if flags & 2 != 0:
                Y[r] = acc[0] / T.Cast("float32", d)
            else:
                P[r] = acc[0]
    return kernel


_INF = T.float32(float("inf"))


@T.macro
def _row_max(X, S, acc, r, cols, flags, k):
    """``S[k]`` = the max of row ``r`` of ``X`` (``cols`` wide) carried on from ``S[k]`` (from
    -inf where ``flags`` bit 0 starts the row): the row's first NaN is its max, as the
    simulator's softmax statistics take it."""
    acc[0] = T.if_then_else(flags & 1 != 0, -_INF, S[k])
    for j in range(cols):
        if T.Not(T.isnan(acc[0])):
            if T.isnan(X[r * cols + j]) or X[r * cols + j] > acc[0]:
                acc[0] = X[r * cols + j]
    S[k] = acc[0]


@T.macro
def _row_sum(Y, S, acc, r, cols, flags, k):
    """``S[k]`` += the sum of row ``r`` of ``Y`` (``cols`` wide) in ascending order, from +0.0
    where ``flags`` bit 0 starts the row (the simulator's fixed reduction order)."""
    acc[0] = T.if_then_else(flags & 1 != 0, _ZERO, S[k])
    for j in range(cols):
        acc[0] = acc[0] + Y[r * cols + j]
    S[k] = acc[0]


def _softmax():
    @T.prim_func
    def kernel(x: T.handle("float32"), y: T.handle("float32"), st: T.handle("float32"),
               rows: T.int32, cols: T.int32, phase: T.int32, flags: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((rows * cols,), "float32", data=x)
        Y = T.decl_buffer((rows * cols,), "float32", data=y)
        S = T.decl_buffer((2 * rows,), "float32", data=st)
        acc = T.decl_buffer((1,), "float32", scope="local")
        for r in range(rows):
            if phase == 0:
                _row_max(X, S, acc, r, cols, flags, 2 * r)
            elif phase == 1:
                for j in range(cols):
                    Y[r * cols + j] = X[r * cols + j] - S[2 * r]
            else:
                for j in range(cols):
                    Y[r * cols + j] = Y[r * cols + j] / S[2 * r + 1]
        if phase == 1:  # the exps of the whole chunk in one stream, then each row's sum
            _exp_unit(T.address_of(Y[0]), T.address_of(Y[0]), rows * cols)
            for r in range(rows):
                _row_sum(Y, S, acc, r, cols, flags, 2 * r + 1)
    return kernel


def _xent_grad():
    """``cross_entropy_backward``: the softmax kernel's phases plus one (see the module docstring)."""

    @T.prim_func
    def kernel(x: T.handle("float32"), y: T.handle("float32"), st: T.handle("float32"), lab: T.handle("int32"),
               rows: T.int32, cols: T.int32, phase: T.int32, flags: T.int32, c0: T.int32, div: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((rows * cols,), "float32", data=x)
        Y = T.decl_buffer((rows * cols,), "float32", data=y)
        S = T.decl_buffer((2 * rows,), "float32", data=st)
        L = T.decl_buffer((rows,), "int32", data=lab)
        acc = T.decl_buffer((1,), "float32", scope="local")
        for r in range(rows):
            if phase == 0:
                _row_max(X, S, acc, r, cols, flags, 2 * r)
            elif phase == 2:
                # (p - onehot) / n with p = e / sum: the label's column subtracts 1.0, the others +0.0
                for j in range(cols):
                    Y[r * cols + j] = (Y[r * cols + j] / S[2 * r + 1]
                                       - T.if_then_else(c0 + j == L[r], _f(1.0), _ZERO)) / T.reinterpret("float32", div)
            else:
                for j in range(cols):
                    Y[r * cols + j] = X[r * cols + j] - S[2 * r]
        if phase == 1 or phase == 3:  # the chunk's exps in one stream; phase 1 also sums them
            _exp_unit(T.address_of(Y[0]), T.address_of(Y[0]), rows * cols)
            if phase == 1:
                for r in range(rows):
                    _row_sum(Y, S, acc, r, cols, flags, 2 * r + 1)
    return kernel


@T.macro
def _block_end(acc, end, d):
    """A blocked row sum carried as ``(sum, block partial)`` in ``acc`` after the term at column
    ``end - 1``: where a block ends there (every LAYER_NORM_BLOCK columns of the row and at its
    end ``d``) the partial joins the sum (selected, not branched: every block pays the same)."""
    done = T.truncmod(end, _BLOCK) == 0 or end == d
    acc[0] = T.if_then_else(done, acc[0] + acc[1], acc[0])
    acc[1] = T.if_then_else(done, _ZERO, acc[1])


def _layer_norm():
    @T.prim_func
    def kernel(x: T.handle("float32"), y: T.handle("float32"), st: T.handle("float32"),
               gamma: T.handle("float32"), beta: T.handle("float32"), rows: T.int32, cols: T.int32,
               phase: T.int32, flags: T.int32, c0: T.int32, d: T.int32, eps: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((rows * cols,), "float32", data=x)
        Y = T.decl_buffer((rows * cols,), "float32", data=y)
        S = T.decl_buffer((4 * rows,), "float32", data=st)
        G = T.decl_buffer((cols,), "float32", data=gamma)
        B = T.decl_buffer((cols,), "float32", data=beta)
        acc = T.decl_buffer((2,), "float32", scope="local")
        v = T.decl_buffer((1,), "float32", scope="local")
        for r in range(rows):
            if phase < 2:
                acc[0] = T.if_then_else(flags & 1 != 0, _ZERO, S[4 * r])
                acc[1] = T.if_then_else(flags & 1 != 0, _ZERO, S[4 * r + 1])
                # the chunk's columns a block at a time (its first block from ``c0`` to the next
                # block start): a block's sum needs no block-end test per term. The bounds are a
                # min and max of the step, not a select on the first step, which LLVM peels and
                # unrolls into copies of differing cost; this way every block runs one loop body
                head = T.min(cols, _BLOCK - T.truncmod(c0, _BLOCK))
                for s in range(1 + T.truncdiv(cols - head + _BLOCK - 1, _BLOCK)):
                    lo = T.max(0, head + (s - 1) * _BLOCK)
                    n = T.min(head + s * _BLOCK, cols) - lo
                    if phase == 0:
                        for j in range(n):
                            acc[1] = acc[1] + X[r * cols + lo + j]
                    else:
                        for j in range(n):
                            Y[r * cols + lo + j] = X[r * cols + lo + j] - S[4 * r + 2]
                            v[0] = Y[r * cols + lo + j] * Y[r * cols + lo + j]
                            acc[1] = acc[1] + v[0]
                    _block_end(acc, c0 + lo + n, d)
                S[4 * r] = acc[0]
                S[4 * r + 1] = acc[1]
                if flags & 2 != 0:
                    if phase == 0:
                        S[4 * r + 2] = acc[0] / T.Cast("float32", d)
                    else:
                        v[0] = acc[0] / T.Cast("float32", d) + T.reinterpret("float32", eps)
                        S[4 * r + 3] = _vsqrt(v[0])
            else:
                for j in range(cols):
                    v[0] = Y[r * cols + j] / S[4 * r + 3]
                    if flags & 4 != 0:
                        v[0] = v[0] * G[j]
                    if flags & 8 != 0:
                        v[0] = v[0] + B[j]
                    Y[r * cols + j] = v[0]
    return kernel


def _rms_norm():
    @T.prim_func
    def kernel(x: T.handle("float32"), y: T.handle("float32"), st: T.handle("float32"),
               w: T.handle("float32"), rows: T.int32, cols: T.int32, phase: T.int32, flags: T.int32,
               c0: T.int32, d: T.int32, eps: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((rows * cols,), "float32", data=x)
        Y = T.decl_buffer((rows * cols,), "float32", data=y)
        S = T.decl_buffer((4 * rows,), "float32", data=st)
        W = T.decl_buffer((cols,), "float32", data=w)
        acc = T.decl_buffer((2,), "float32", scope="local")
        v = T.decl_buffer((1,), "float32", scope="local")
        for r in range(rows):
            if phase == 0:
                acc[0] = T.if_then_else(flags & 1 != 0, _ZERO, S[4 * r])
                acc[1] = T.if_then_else(flags & 1 != 0, _ZERO, S[4 * r + 1])
                # the chunk's columns a block at a time (its first block from ``c0`` to the next
                # block start): the squares' sum of a block needs no block-end test per term
                head = T.min(cols, _BLOCK - T.truncmod(c0, _BLOCK))
                for s in range(1 + T.truncdiv(cols - head + _BLOCK - 1, _BLOCK)):
                    lo = T.if_then_else(s == 0, 0, head + (s - 1) * _BLOCK)
                    n = T.if_then_else(s == 0, head, T.min(_BLOCK, cols - lo))
                    for j in range(n):
                        v[0] = X[r * cols + lo + j] * X[r * cols + lo + j]
                        acc[1] = acc[1] + v[0]
                    _block_end(acc, c0 + lo + n, d)
                S[4 * r] = acc[0]
                S[4 * r + 1] = acc[1]
                if flags & 2 != 0:
                    v[0] = acc[0] / T.Cast("float32", d) + T.reinterpret("float32", eps)
                    v[0] = _vsqrt(v[0])
                    S[4 * r + 2] = _f(1.0) / v[0]
            else:
                for j in range(cols):
                    v[0] = X[r * cols + j] * S[4 * r + 2]
                    if flags & 4 != 0:
                        v[0] = W[j] * v[0]
                    Y[r * cols + j] = v[0]
    return kernel


@T.macro
def _log_unit(src, dst, n):
    """``dst[0:n] = log(src[0:n])`` on the exp/log unit (the runtime's driver ``pe_log``; the
    unit computes the simulator's log model, see :mod:`.iss`). ``src`` may equal ``dst``."""
    T.evaluate(T.call_extern("int32", "pe_log", src, dst, n))


def _cross_entropy():
    """The per-row cross-entropy (see the module docstring): phases 0 and 1 are the softmax
    kernel's (the same TIR, so the same max and sum of exps), phase 2 picks the label's
    ``z[t] - max`` and, on the row's last chunk, finishes ``log(sum) - (z[t] - max)``."""
    @T.prim_func
    def kernel(x: T.handle("float32"), y: T.handle("float32"), st: T.handle("float32"), lab: T.handle("int32"),
               out: T.handle("float32"), rows: T.int32, cols: T.int32, phase: T.int32, flags: T.int32,
               c0: T.int32, ignore: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((rows * cols,), "float32", data=x)
        Y = T.decl_buffer((rows * cols,), "float32", data=y)
        S = T.decl_buffer((4 * rows,), "float32", data=st)
        L = T.decl_buffer((rows,), "int32", data=lab)
        O = T.decl_buffer((rows,), "float32", data=out)
        acc = T.decl_buffer((1,), "float32", scope="local")
        for r in range(rows):
            if phase == 0:
                _row_max(X, S, acc, r, cols, flags, 4 * r)
            elif phase == 1:
                for j in range(cols):
                    Y[r * cols + j] = X[r * cols + j] - S[4 * r]
            elif L[r] != ignore and L[r] >= c0 and L[r] < c0 + cols:  # the label's logit in this chunk
                S[4 * r + 2] = X[r * cols + L[r] - c0] - S[4 * r]
        if phase == 1:  # the exps of the whole chunk in one stream, then each row's sum
            _exp_unit(T.address_of(Y[0]), T.address_of(Y[0]), rows * cols)
            for r in range(rows):
                _row_sum(Y, S, acc, r, cols, flags, 4 * r + 1)
        if phase == 2 and flags & 2 != 0:  # the rows' sums in one stream through the log
            for r in range(rows):
                Y[r] = S[4 * r + 1]
            _log_unit(T.address_of(Y[0]), T.address_of(Y[0]), rows)
            for r in range(rows):
                O[r] = T.if_then_else(L[r] == ignore, _ZERO, Y[r] - S[4 * r + 2])
    return kernel
