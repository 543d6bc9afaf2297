"""Keep quantized weights quantized through constant folding.

``FoldConstant`` evaluates every call whose arguments are all constants, so the weight side of a
QDQ GEMM, ``dequantize(W_int8 const, scale, zero_point)``, would become a float32 constant and
the int8 weights (and their scales) would be lost before the int8 patterns can see them.
:func:`hide_quantized_weights` turns each int8/uint8 constant under a ``dequantize`` into a
temporary function parameter, so folding leaves it alone; :func:`restore_quantized_weights`
binds the constants back right before pattern matching. Int32 biases are not hidden: folding
them to float32 is what the int8 lowering expects.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from ..relax_rewrites.hidden import HiddenConstants
from ..relax_rewrites.folds import _fold_layout

__all__ = ["hide_quantized_weights", "restore_quantized_weights", "UniqueDequantize", "QUANTIZED_DTYPES"]

QUANTIZED_DTYPES = ("int8", "uint8")
_HIDDEN_PREFIX = "spinn_qweight_"


def _is_plain(func) -> bool:
    """A user-level Relax function (not an offloaded, composite or primitive one)."""
    return isinstance(func, relax.Function) and not (
        func.attrs and any(k in func.attrs for k in ("Codegen", "Composite", "Primitive")))


def _plain_functions(mod: tvm.IRModule):
    for gvar, func in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint):
        if _is_plain(func):
            yield gvar, func


#: constants with at least this many elements stand in as parameters in the rewrite (see .hidden)
_HIDE_MIN_ELEMENTS = 1 << 14


def _hide_in_function(func: relax.Function, large: HiddenConstants | None):
    """``func`` with its quantized weights as parameters, and ``{parameter: constant}``.

    With ``large``, the rewrite runs on ``large.func`` (the large constants standing in as
    parameters, see :mod:`.hidden`) and the result is bound back; without, on ``func`` itself."""
    data = large.const_pattern() if large else is_const()
    pattern = is_op("relax.dequantize")(data, wildcard(), wildcard())
    params: dict[str, relax.Var] = {}
    consts: dict[relax.Var, Constant] = {}
    seen: dict[Constant, relax.Var] = {}

    def rewriter(expr, matches):
        const = large.constant(matches, data) if large else matches[data]
        if const is None:
            return expr  # a parameter, not a constant
        if str(const.ty.dtype) not in QUANTIZED_DTYPES:
            return expr
        var = seen.get(const)
        if var is None:
            name = f"{_HIDDEN_PREFIX}{len(params)}"
            var = relax.Var(name, const.ty)
            seen[const], params[name], consts[var] = var, var, const
        return relax.op.dequantize(var, expr.args[1], expr.args[2], axis=int(expr.attrs.axis),
                                   out_dtype=str(expr.attrs.out_dtype))

    new_func = rewrite_call(pattern, rewriter, large.func if large else func)
    if large:
        new_func = large.restore(new_func)
    return new_func, params, consts


def _has_quantized_dequantize(func: relax.Function) -> bool:
    found = []

    def visit(expr):
        if (not found and isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)
                and expr.op.name == "relax.dequantize" and expr.args
                and str(getattr(expr.args[0].ty, "dtype", "")) in QUANTIZED_DTYPES):
            found.append(expr)

    relax.analysis.post_order_visit(func, visit)
    return bool(found)


def hide_quantized_weights(mod: tvm.IRModule) -> tuple[tvm.IRModule, dict[str, dict[relax.Var, Constant]]]:
    """Replace int8/uint8 constants read by ``dequantize`` with extra parameters.

    Returns
    -------
    (tvm.IRModule, dict)
        The module and, per function name, ``{parameter: constant}`` (bound by variable, so
        a user parameter of the same name is never confused with it) for
        :func:`restore_quantized_weights`.
    """
    hidden: dict[str, dict[relax.Var, Constant]] = {}
    mod = mod.clone()  # the caller's module stays as it was
    for gvar, func in list(_plain_functions(mod)):
        if not _has_quantized_dequantize(func):
            continue  # nothing to hide (the rewrite would only drop unused bindings)
        # A weight transposed or reshaped before its dequantize (TFLite's fully-connected
        # weights) is folded first, so the dequantize reads the int8 constant itself.
        func = _fold_layout(func)
        large = HiddenConstants(func, _HIDE_MIN_ELEMENTS)
        new_func, params, consts = _hide_in_function(func, large if large.hidden else None)
        if large.hidden and large.collided:
            new_func, params, consts = _hide_in_function(func, None)
        if not params:
            continue
        new_func = relax.Function(list(new_func.params) + list(params.values()), new_func.body,
                                  new_func.ret_ty, new_func.is_pure, new_func.attrs)
        mod[gvar] = new_func
        hidden[gvar.name_hint] = consts
    return mod, hidden


def restore_quantized_weights(mod: tvm.IRModule, hidden: dict[str, dict[relax.Var, Constant]]) -> tvm.IRModule:
    """Bind the parameters made by :func:`hide_quantized_weights` back to their constants."""
    for name, consts in sorted(hidden.items()):
        mod = relax.transform.BindParams(name, dict(consts))(mod)
        # Layout changes made to the hidden weights while they were parameters (NHWC -> NCHW,
        # see .nhwc) fold into the int8 constants the patterns need.
        gvar = mod.get_global_var(name)
        mod[gvar] = _fold_layout(mod[gvar])
    return mod


_GEMM_OPS = ("relax.nn.conv2d", "relax.matmul")


@relax.expr_functor.mutator
class _UniqueDequantize(relax.PyExprMutator):
    """Give every GEMM its own copy of a ``dequantize`` it shares with other readers."""

    def __init__(self, mod: tvm.IRModule, shared: set):
        super().__init__(mod)
        self.shared = shared

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: D102
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name in _GEMM_OPS):
            return call
        args = list(call.args)
        changed = False
        for i, arg in enumerate(args):
            if isinstance(arg, relax.Var) and arg in self.shared:
                dq = self.lookup_binding(arg)
                args[i] = self.builder_.emit(relax.Call(dq.op, dq.args, dq.attrs))
                changed = True
        return relax.Call(call.op, args, call.attrs, call.ty_args) if changed else call


@relax.transform.function_pass(opt_level=0, name="SpinnUniqueDequantize")
def UniqueDequantize(func: relax.Function, mod, _ctx) -> relax.Function:  # noqa: N802
    """One ``dequantize`` per GEMM (ONNX Runtime's "unique DQ per node unit").

    A quantized activation read by several GEMMs (q/k/v projections) may reach us through one
    shared ``dequantize`` (ONNX QDQ models, or common-subexpression elimination); the int8
    patterns need each GEMM to own its operand's ``dequantize``.
    """
    if not _is_plain(func):
        return func
    shared = set()
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return func
    for block in body.blocks:
        if not isinstance(block, relax.DataflowBlock):
            continue
        uses = relax.analysis.udchain(block)
        for binding in block.bindings:
            value = binding.value
            if (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                    and value.op.name == "relax.dequantize" and len(uses.get(binding.var, [])) > 1):
                shared.add(binding.var)
    if not shared:
        return func
    return _UniqueDequantize(mod, shared).visit_expr(func)
