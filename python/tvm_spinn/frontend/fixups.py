"""Relax-level clean-ups applied by the front-ends to what the importers emit.

- ``cumsum`` of a ``bool`` tensor (causal-mask construction in `transformers` decoders) fails
  in TVM's llvm codegen; compute it in int32 and compare with zero, which is what the mask means.
- comparisons of two ``bool`` tensors are emitted as float compares and fail LLVM verification;
  compare them as int8.
- ``multiply``/``add`` of two ``bool`` tensors (``torch.isfinite``, ``torch.logaddexp``
  decompose to them) fail in TVM's llvm codegen (a float multiply check); they are
  ``logical_and``/``logical_or``, which is what bool arithmetic means in PyTorch.
- ``x[:, -1]`` is imported as ``take(x, -1, mode="fast")``, which reads out of bounds (garbage
  or NaN); constant negative indices are normalized to ``index + dim``.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

__all__ = ["FixupImported"]


def _fix_bool_cumsum(func: relax.Function) -> relax.Function:
    x = wildcard()
    pattern = is_op("relax.cumsum")(x)

    def rewriter(expr, matches):
        arg = matches[x]
        if str(arg.ty.dtype) != "bool" or str(expr.ty.dtype) != "bool":
            return expr
        attrs = expr.attrs
        summed = relax.op.cumsum(relax.op.astype(arg, "int32"), axis=attrs.axis, dtype="int32",
                                 exclusive=attrs.exclusive)
        return relax.op.not_equal(summed, relax.const(0, "int32"))

    return rewrite_call(pattern, rewriter, func)


def _rewrite_bool_binary(func: relax.Function, ops: dict) -> relax.Function:
    """Replace ``relax.<name>(a, b)`` on two bool operands by ``ops[name](a, b)``."""
    for name, replace in ops.items():
        lhs, rhs = wildcard(), wildcard()
        pattern = is_op(f"relax.{name}")(lhs, rhs)

        def rewriter(expr, matches, replace=replace, lhs=lhs, rhs=rhs):
            a, b = matches[lhs], matches[rhs]
            if str(a.ty.dtype) != "bool" or str(b.ty.dtype) != "bool":
                return expr
            return replace(a, b)

        func = rewrite_call(pattern, rewriter, func)
    return func


def _compare_as_int8(name: str):
    op = getattr(relax.op, name)
    return lambda a, b: op(relax.op.astype(a, "int8"), relax.op.astype(b, "int8"))


# LLVM's codegen rejects comparisons of bool vectors: compare them as int8.
_BOOL_COMPARE = {name: _compare_as_int8(name) for name in
                 ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")}
# bool multiply/add (torch's isfinite, logaddexp) are logical and/or.
_BOOL_ARITH = {"multiply": relax.op.logical_and, "add": relax.op.logical_or}


def _fix_bool_compare(func: relax.Function) -> relax.Function:
    return _rewrite_bool_binary(func, _BOOL_COMPARE)


def _fix_bool_arith(func: relax.Function) -> relax.Function:
    return _rewrite_bool_binary(func, _BOOL_ARITH)


def _fix_negative_take(func: relax.Function) -> relax.Function:
    x, idx = wildcard(), is_const()
    pattern = is_op("relax.take")(x, idx)

    def rewriter(expr, matches):
        data, index = matches[x], matches[idx]
        shape = getattr(data.ty, "shape", None)
        axis = expr.attrs.axis
        if shape is None or axis is None:
            return expr
        values = index.value.numpy()
        if values.dtype.kind not in "iu" or not (values < 0).any():
            return expr
        axis = int(axis) % len(shape.values)
        dim = shape.values[axis]
        if not hasattr(dim, "value"):
            return expr
        fixed = np.where(values < 0, values + int(dim.value), values).astype(values.dtype)
        return relax.op.take(data, relax.const(fixed, str(values.dtype)), axis=axis, mode=expr.attrs.mode)

    return rewrite_call(pattern, rewriter, func)


@relax.transform.function_pass(opt_level=0, name="SpinnFixupImported")
def FixupImported(func: relax.Function, _mod, _ctx) -> relax.Function:  # noqa: N802 - TVM pass naming
    """Apply the clean-ups to every Relax function of a module."""
    return _fix_negative_take(_fix_bool_arith(_fix_bool_compare(_fix_bool_cumsum(func))))
