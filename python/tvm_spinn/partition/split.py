"""``split`` as strided slices, so the movement family offloads it.

A ``relax.split`` returns a tuple, which a spinn layer (one output tensor) cannot be; GPT-2's
attention splits its fused QKV projection this way, and the split cut the block into several
regions. With a static shape, each part is one contiguous ``strided_slice`` along the axis and
the tuple is rebuilt from them: the same values (both copy), and every part offloads.
"""

from __future__ import annotations

import tvm
from tvm import relax

__all__ = ["SplitToSlices"]


def _static_dims(ty) -> list[int] | None:
    shape = getattr(ty, "shape", None)
    values = getattr(shape, "values", None)
    if values is None:
        return None
    dims = []
    for v in values:
        value = getattr(v, "value", None)  # an IntImm; a symbolic extent has none
        if not isinstance(value, int):
            return None
        dims.append(value)
    return dims


def _bounds(attrs, extent: int) -> list[tuple[int, int]] | None:
    """``[begin, end)`` of each part, or None (a split the rewrite leaves alone)."""
    spec = attrs.indices_or_sections
    if hasattr(spec, "value"):  # a number of equal sections
        sections = int(spec.value)
        if sections <= 0 or extent % sections:
            return None
        size = extent // sections
        return [(i * size, (i + 1) * size) for i in range(sections)]
    cuts = [min(max(int(i.value if hasattr(i, "value") else i), 0), extent) for i in spec]
    edges = [0, *cuts, extent]
    return [(begin, max(begin, end)) for begin, end in zip(edges[:-1], edges[1:])]


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: D102
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.split"):
            return call
        x = call.args[0]
        dims = _static_dims(x.ty)
        if dims is None:
            return call
        axis = int(call.attrs.axis)
        axis = axis + len(dims) if axis < 0 else axis
        bounds = _bounds(call.attrs, dims[axis]) if 0 <= axis < len(dims) else None
        if bounds is None or any(end <= begin for begin, end in bounds):
            return call  # empty parts: a slice has no zero-size form on the PEs
        parts = [self.builder_.emit(relax.op.strided_slice(x, [axis], [begin], [end], [1]))
                 for begin, end in bounds]
        return relax.Tuple(parts)


def _has_split(func: relax.Function) -> bool:
    found = []

    def visit(expr) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.split":
            found.append(expr)

    relax.analysis.post_order_visit(func, visit)
    return bool(found)


@tvm.transform.module_pass(opt_level=0, name="SpinnSplitToSlices")
def SplitToSlices(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802
    """Module pass: static ``split`` -> a tuple of ``strided_slice`` (see module docstring),
    then the ``TupleGetItem`` of those tuples canonicalized to the slices themselves (a
    ``TupleGetItem`` cannot sit inside an offloaded region). A module without splits is
    returned as it is."""
    changed = False
    for gvar, func in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint):
        if isinstance(func, relax.Function) and _has_split(func):
            mod[gvar] = _Rewriter().visit_expr(func)
            changed = True
    return relax.transform.CanonicalizeBindings()(mod) if changed else mod
