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
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from ..relax_rewrites.hidden import HiddenConstants

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


def _fix_negative_take(func: relax.Function, hidden: HiddenConstants | None = None) -> relax.Function:
    x, idx = wildcard(), (hidden.const_pattern() if hidden else is_const())
    pattern = is_op("relax.take")(x, idx)

    def rewriter(expr, matches):
        data = matches[x]
        shape = getattr(data.ty, "shape", None)
        axis = expr.attrs.axis
        if shape is None or axis is None:
            return expr
        values = hidden.value(matches, idx) if hidden else matches[idx].value.numpy()
        if values is None:  # a parameter, not a constant
            return expr
        if values.dtype.kind not in "iu" or not (values < 0).any():
            return expr
        axis = int(axis) % len(shape.values)
        dim = shape.values[axis]
        if not hasattr(dim, "value"):
            return expr
        fixed = np.where(values < 0, values + int(dim.value), values).astype(values.dtype)
        index = hidden.const(fixed, str(values.dtype)) if hidden else relax.const(fixed, str(values.dtype))
        if index is None:  # collided: the caller runs the fix-ups on the constants instead
            return expr
        return relax.op.take(data, index, axis=axis, mode=expr.attrs.mode)

    return rewrite_call(pattern, rewriter, func)


def _fixup(func: relax.Function, hidden: HiddenConstants | None) -> relax.Function:
    return _fix_negative_take(_fix_bool_arith(_fix_bool_compare(_fix_bool_cumsum(func))), hidden)


#: constants with at least this many elements stand in as parameters in the rewrites
_HIDE_MIN_ELEMENTS = 1 << 14

_BOOL_OPS = {"relax.cumsum"} | {f"relax.{name}" for name in list(_BOOL_COMPARE) + list(_BOOL_ARITH)}


def _may_fix(func: relax.Function) -> bool:
    """Whether any fix-up may apply: a bool op of the list, or a ``take`` of a constant index."""
    found = []
    value_of = relax.analysis.get_var2val(func)

    def constant_index(arg) -> bool:
        while isinstance(arg, relax.Var) and arg in value_of:
            arg = value_of[arg]
        return isinstance(arg, Constant)

    def visit(expr):
        if found or not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)):
            return
        name = expr.op.name
        if name == "relax.take" and len(expr.args) > 1 and constant_index(expr.args[1]):
            found.append(expr)
        elif name in _BOOL_OPS and any(str(getattr(arg.ty, "dtype", "")) == "bool" for arg in expr.args):
            found.append(expr)

    relax.analysis.post_order_visit(func, visit)
    return bool(found)


def fixup(func: relax.Function) -> relax.Function:
    """All the clean-ups of one function.

    They are ``rewrite_call`` rewrites, which after each change simplify the function until
    nothing changes, hashing the weights' data: they run with the large constants standing in as
    parameters (:mod:`tvm_spinn.relax_rewrites.hidden`), which gives the same function (GPT-2:
    2.5 s -> ~0.1 s)."""
    if not _may_fix(func):
        return _fixup(func, None)
    hidden = HiddenConstants(func, _HIDE_MIN_ELEMENTS)
    if not hidden.hidden:
        return _fixup(func, None)
    out = _fixup(hidden.func, hidden)
    return _fixup(func, None) if hidden.collided else hidden.restore(out)


@relax.transform.function_pass(opt_level=0, name="SpinnFixupImported")
def FixupImported(func: relax.Function, _mod, _ctx) -> relax.Function:  # noqa: N802 - TVM pass naming
    """Apply the clean-ups to every Relax function of a module."""
    return fixup(func)
