"""Graph rewrites that run before partitioning so more of a model reaches the PEs.

- :func:`FoldLayoutConstants`: ``permute_dims`` / ``reshape`` / ``astype`` of constants folded
  with numpy. ``FoldConstant`` would compile an LLVM kernel for each (every Linear's transposed
  weight): the slowest part of partitioning a transformer.
- :func:`fold_batch_norm`: ``batch_norm(conv2d(x, W) [+ b], gamma, beta, mean, var)[0]`` with
  constant parameters becomes ``conv2d(x, W * s) + ((b - mean) * s + beta)``,
  ``s = gamma / sqrt(var + eps)`` (inference only). Other batch norms are decomposed into element-wise arithmetic by
  ``DecomposeOpsForInference``, which the element-wise patterns then offload.
"""

from __future__ import annotations

import numpy as np

import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.dpl import is_const, is_op, is_tuple_get_item, is_var, rewrite_call, wildcard

__all__ = ["fold_batch_norm", "FoldBatchNorm", "FoldLayoutConstants"]


def _pattern():
    x, w, b = wildcard(), is_const(), is_const()
    conv = is_op("relax.nn.conv2d")(x, w)
    # ``nn.Conv2d(bias=True)`` before the batch norm: an add of a constant per-channel bias
    biased = is_op("relax.add")(conv, b) | is_op("relax.add")(b, conv)
    gamma, beta, mean, var = is_const(), is_const(), is_const(), is_const()
    bn = is_op("relax.nn.batch_norm")(conv | biased, gamma, beta, mean, var)
    return is_tuple_get_item(bn, 0), dict(x=x, w=w, b=b, conv=conv, bn=bn, gamma=gamma, beta=beta, mean=mean, var=var)


def fold_batch_norm(func: relax.Function) -> relax.Function:
    """Fold inference batch norms into the preceding conv2d (optionally with a bias add) of ``func``."""
    pattern, parts = _pattern()

    def rewriter(expr, matches):
        conv, bn = matches[parts["conv"]], matches[parts["bn"]]
        attrs = conv.attrs
        if bool(bn.attrs.training):  # batch statistics: nothing to fold
            return expr
        if (attrs.kernel_layout != "OIHW" or int(bn.attrs.axis) != 1 or attrs.data_layout != "NCHW"
                or str(matches[parts["w"]].ty.dtype) != "float32"):
            return expr
        weight = matches[parts["w"]].value.numpy().astype(np.float64)
        channels = weight.shape[0]
        bias = np.zeros(channels)
        if parts["b"] in matches:
            b = matches[parts["b"]].value.numpy().astype(np.float64)
            if b.shape not in ((1, channels, 1, 1), (channels, 1, 1)):
                return expr
            bias = b.reshape(-1)
        p = {k: matches[parts[k]].value.numpy().astype(np.float64).reshape(-1) for k in ("gamma", "beta", "mean", "var")}
        gamma = p["gamma"] if bool(bn.attrs.scale) else np.ones(channels)
        beta = p["beta"] if bool(bn.attrs.center) else np.zeros(channels)
        scale = gamma / np.sqrt(p["var"] + float(bn.attrs.epsilon))
        new_w = (weight * scale[:, None, None, None]).astype(np.float32)
        new_b = ((bias - p["mean"]) * scale + beta).astype(np.float32).reshape(1, -1, 1, 1)
        new_conv = relax.op.nn.conv2d(
            matches[parts["x"]], relax.const(new_w), strides=attrs.strides, padding=attrs.padding,
            dilation=attrs.dilation, groups=attrs.groups, data_layout="NCHW", kernel_layout="OIHW",
            out_layout=attrs.out_layout, out_dtype=attrs.out_dtype,
        )
        return relax.op.add(new_conv, relax.const(new_b))

    return rewrite_call(pattern, rewriter, func)


@relax.transform.function_pass(opt_level=0, name="SpinnFoldBatchNorm")
def FoldBatchNorm(func: relax.Function, _mod, _ctx) -> relax.Function:  # noqa: N802 - TVM pass naming
    """Function pass: :func:`fold_batch_norm`; run ``DecomposeOpsForInference`` after it."""
    return fold_batch_norm(func)


def _folded(value: np.ndarray, expr: relax.Call) -> np.ndarray:
    """``expr`` (``permute_dims`` / ``reshape`` / ``astype`` of ``value``) computed with numpy."""
    name = expr.op.name
    if name == "relax.permute_dims":
        axes = expr.attrs.axes
        return np.transpose(value, [int(a) for a in axes] if axes is not None else None)
    if name == "relax.reshape":
        return value.reshape([int(d) for d in expr.ty.shape.values])
    return value.astype(str(expr.attrs.dtype))


def _layout_patterns(arg):
    return (is_op("relax.permute_dims")(arg), is_op("relax.reshape")(arg, wildcard()), is_op("relax.astype")(arg))


def _fold_layout_reference(func: relax.Function) -> relax.Function:
    """The fold as three ``rewrite_call`` passes on the constants themselves (slow on big weights:
    the rewriter's common-subexpression elimination hashes every constant's data)."""
    c = is_const()

    def rewriter(expr, matches):
        out = _folded(matches[c].value.numpy(), expr)
        return relax.const(np.ascontiguousarray(out), str(expr.ty.dtype))

    for pattern in _layout_patterns(c):
        func = rewrite_call(pattern, rewriter, func)
    return func


#: constants with at least this many elements are hidden from ``rewrite_call`` (see _fold_layout)
_HIDE_MIN_ELEMENTS = 1 << 14


def _key(arr: np.ndarray) -> tuple:
    """Equal for equal data (dtype, shape, a strided sample of the elements in C order)."""
    step = max(1, arr.size // 64)
    return str(arr.dtype), arr.shape, arr.flat[::step].tobytes(), arr.flat[arr.size - 1:].tobytes()


def _const(value: np.ndarray, dtype: str) -> Constant:
    """``relax.const(np.ascontiguousarray(value), dtype)`` with one copy instead of three."""
    try:
        if value.dtype == np.dtype(dtype):
            tensor = tvm.runtime.empty(value.shape, dtype)
            dst = np.from_dlpack(tensor)
            if value.ndim == 2 and not value.flags.c_contiguous:
                # a transposed weight: copied a band of columns at a time (cache-friendly, ~3x)
                for j in range(0, value.shape[1], 64):
                    np.copyto(dst[:, j:j + 64], value[:, j:j + 64], casting="no")
            else:
                np.copyto(dst, value, casting="no")
            return relax.const(tensor)
    except (TypeError, ValueError, BufferError, RuntimeError):
        pass
    return relax.const(np.ascontiguousarray(value), dtype)


def _array(const) -> np.ndarray:
    try:
        return np.from_dlpack(const.value)  # no copy
    except (TypeError, ValueError, BufferError, RuntimeError):
        return const.value.numpy()


@relax.expr_functor.mutator
class _Substitute(relax.PyExprMutator):
    def __init__(self, table: dict):
        super().__init__()
        self.table = table

    def visit_generic_const_(self, const):  # noqa: D102
        return self.table.get(const, const)


_LAYOUT_OPS = ("relax.permute_dims", "relax.reshape", "relax.astype")


def _may_fold(func: relax.Function) -> bool:
    """Whether a layout op may read a constant (possibly through variables) in ``func``."""
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return True
    value_of: dict = {}
    for block in body.blocks:
        for binding in block.bindings:
            value = binding.value
            value_of[binding.var] = value
            if isinstance(value, (relax.Function, relax.If, relax.SeqExpr)):
                return True
            if (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                    and value.op.name in _LAYOUT_OPS and value.args):
                arg = value.args[0]
                while isinstance(arg, relax.Var) and arg in value_of:
                    arg = value_of[arg]
                if isinstance(arg, Constant):
                    return True
    return False


def _fold_layout(func: relax.Function) -> relax.Function:
    """:func:`_fold_layout_reference`, with each large constant standing in as a parameter.

    ``rewrite_call`` follows a rewrite with common-subexpression elimination until nothing
    changes, which hashes and compares constants by their data: for BERT-base's weights that was
    most of the fold's time. Here every large constant whose data no other large constant may
    share (so that comparing by data and by identity agree) is replaced by a parameter of the
    same type for the three rewrites, new large constants too, and bound back at the end. The
    rewrites, bindings and simplifications are TVM's, so the result is the reference's; if two
    large constants may hold equal data, the reference fold runs instead.
    """
    if not _may_fold(func):
        return _fold_layout_reference(func)  # nothing matches: as cheap as a traversal
    found: dict = {}

    def collect(expr):
        if (isinstance(expr, Constant) and hasattr(expr.value, "numpy")
                and int(np.prod(expr.value.shape)) >= _HIDE_MIN_ELEMENTS):
            found[expr] = None

    relax.analysis.post_order_visit(func, collect)
    if not found:
        return _fold_layout_reference(func)
    keys: dict = {}
    for const in found:
        keys.setdefault(_key(_array(const)), []).append(const)
    hidden: dict = {}  # placeholder var -> (constant, or None until made) and array
    table: dict = {}
    for group in keys.values():
        if len(group) != 1:
            continue  # maybe equal data: left as constants, compared by data as usual
        const = group[0]
        var = relax.Var(f"spinn_layout_const_{len(hidden)}", const.ty)
        hidden[var] = (const, _array(const))
        table[const] = var
    new_func = _Substitute(table).visit_expr(func)
    new_func = relax.Function(list(new_func.params) + list(hidden), new_func.body, new_func.ret_ty,
                              new_func.is_pure, new_func.attrs)
    c, v = is_const(), is_var()
    collided = []

    def rewriter(expr, matches):
        if c in matches:
            value = matches[c].value.numpy()
        elif v in matches and matches[v] in hidden:
            value = hidden[matches[v]][1]
        else:
            return expr
        out = _folded(value, expr)
        if out.size < _HIDE_MIN_ELEMENTS:
            return relax.const(np.ascontiguousarray(out), str(expr.ty.dtype))
        key = _key(out)
        if key in keys or collided:
            collided.append(key)  # might equal another large constant: comparing by identity would differ
            return expr
        keys[key] = [None]
        var = relax.Var(f"spinn_layout_const_{len(hidden)}", expr.ty)
        hidden[var] = (None, out)
        return var

    for pattern in _layout_patterns(c | v):
        new_func = rewrite_call(pattern, rewriter, new_func)
        if collided:
            return _fold_layout_reference(func)
    used = set(relax.analysis.free_vars(new_func.body))
    params = [p for p in new_func.params if p not in hidden]
    new_func = relax.Function(params + [p for p in hidden if p in used], new_func.body, new_func.ret_ty,
                              new_func.is_pure, new_func.attrs)
    binds = {var: const if const is not None else _const(arr, str(var.ty.dtype))
             for var, (const, arr) in hidden.items() if var in used}
    return new_func.bind_params(binds) if binds else new_func


@relax.transform.function_pass(opt_level=0, name="SpinnFoldLayoutConstants")
def FoldLayoutConstants(func: relax.Function, _mod, _ctx) -> relax.Function:  # noqa: N802
    """Function pass: fold layout ops of constants with numpy (see module docstring)."""
    return _fold_layout(func)
