"""Tuple operands written in place, so that only tensors cross a spinn region's boundary.

``concat(t)`` where ``t = (a, b, c)`` is a binding of its own (``Gradient`` writes the gradient
of a ``split`` that way, GPT-2's fused QKV projection) matches the concat pattern through the
binding, but the composite then takes ``t`` as its operand: the region's input is a tuple, which
a spinn program (tensors in, tensors out) cannot have. With the tuple written into the call,
``concat((a, b, c))``, the composite's operands are the tensors ``a``, ``b``, ``c``; the tuple's
own binding is left to dead-code elimination when nothing else reads it. Same values: a Relax
tuple is a pure grouping of its fields.
"""

from __future__ import annotations

import tvm
from tvm import relax

__all__ = ["InlineTupleOperands"]


def _is_tuple_var(expr) -> bool:
    return isinstance(expr, relax.Var) and isinstance(expr.ty, relax.TupleType)


def _operator_call(expr) -> bool:
    # call_tir/call_dps_packed take their operands as one tuple by design: left alone
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and not expr.op.name.startswith("relax.call_")


@relax.expr_functor.mutator
class _Inliner(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: D102
        call = super().visit_call_(call)
        if not _operator_call(call):
            return call
        args = []
        for arg in call.args:
            bound = self.lookup_binding(arg) if _is_tuple_var(arg) else None
            args.append(bound if isinstance(bound, relax.Tuple) else arg)
        if all(a.same_as(b) for a, b in zip(args, call.args)):
            return call
        return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)


def _has_tuple_operand(func: relax.Function) -> bool:
    found = []

    def visit(expr) -> None:
        if _operator_call(expr) and any(_is_tuple_var(a) for a in expr.args):
            found.append(expr)

    relax.analysis.post_order_visit(func, visit)
    return bool(found)


@tvm.transform.module_pass(opt_level=0, name="SpinnInlineTupleOperands")
def InlineTupleOperands(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802
    """Module pass: an operator's operand that is a variable bound to a ``Tuple`` becomes that
    ``Tuple`` (see module docstring). A module without such operands is returned as it is."""
    changed = False
    for gvar, func in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint):
        if isinstance(func, relax.Function) and _has_tuple_operand(func):
            mod = mod.clone() if not changed else mod
            mod[gvar] = _Inliner().visit_expr(func)
            changed = True
    return mod
