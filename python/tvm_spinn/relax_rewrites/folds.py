"""Graph rewrites that run before partitioning so more of a model reaches the PEs.

- :func:`FoldLayoutConstants`: ``permute_dims`` / ``reshape`` / ``astype`` of constants folded
  with numpy. ``FoldConstant`` would compile an LLVM kernel for each (every Linear's transposed
  weight): the slowest part of partitioning a transformer.
- :func:`fold_batch_norm`: ``batch_norm(conv2d(x, W) [+ b], gamma, beta, mean, var)[0]`` with
  constant parameters becomes ``conv2d(x, W * s) + ((b - mean) * s + beta)``,
  ``s = gamma / sqrt(var + eps)`` (inference only). Other batch norms are decomposed into element-wise arithmetic by
  ``DecomposeOpsForInference``, which the element-wise patterns then offload.

Both are ``rewrite_call`` rewrites; on large models they run with the weights standing in as
parameters (:mod:`.hidden`), which gives the same module without ``rewrite_call`` hashing the
weights' data after every change (``_fold_layout_reference`` and ``_fold_batch_norm(func, None)``
are the plain versions, used when that is not possible and by the tests).
"""

from __future__ import annotations

import numpy as np

import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.dpl import is_const, is_op, is_tuple_get_item, rewrite_call, wildcard

from ..program.quant import QUANT_ROUNDING_ATTR
from .hidden import HiddenConstants

__all__ = ["fold_batch_norm", "FoldBatchNorm", "FoldLayoutConstants", "TagRequantRounding", "FoldQuantizedClip"]


def _pattern(constant=is_const):
    x, w, b = wildcard(), constant(), constant()
    conv = is_op("relax.nn.conv2d")(x, w)
    # ``nn.Conv2d(bias=True)`` before the batch norm: an add of a constant per-channel bias
    biased = is_op("relax.add")(conv, b) | is_op("relax.add")(b, conv)
    gamma, beta, mean, var = constant(), constant(), constant(), constant()
    bn = is_op("relax.nn.batch_norm")(conv | biased, gamma, beta, mean, var)
    return is_tuple_get_item(bn, 0), dict(x=x, w=w, b=b, conv=conv, bn=bn, gamma=gamma, beta=beta, mean=mean, var=var)


def _fold_batch_norm(func: relax.Function, hidden: HiddenConstants | None) -> relax.Function:
    pattern, parts = _pattern(hidden.const_pattern if hidden else is_const)
    target = hidden.func if hidden else func

    def rewriter(expr, matches):
        def value(name):
            if hidden:
                return hidden.value(matches, parts[name])
            return matches[parts[name]].value.numpy()

        conv, bn = matches[parts["conv"]], matches[parts["bn"]]
        attrs = conv.attrs
        if bool(bn.attrs.training):  # batch statistics: nothing to fold
            return expr
        if (attrs.kernel_layout != "OIHW" or int(bn.attrs.axis) != 1 or attrs.data_layout != "NCHW"
                or str(matches[parts["w"]].ty.dtype) != "float32"):
            return expr
        has_bias = hidden.matched(matches, parts["b"]) if hidden else parts["b"] in matches
        values = {k: value(k) for k in ("w", "gamma", "beta", "mean", "var") + (("b",) if has_bias else ())}
        if any(v is None for v in values.values()):
            return expr  # a parameter, not a constant: the pattern's is_const() would not match
        weight = values["w"].astype(np.float64)
        channels = weight.shape[0]
        bias = np.zeros(channels)
        if has_bias:
            b = values["b"].astype(np.float64)
            if b.shape not in ((1, channels, 1, 1), (channels, 1, 1)):
                return expr
            bias = b.reshape(-1)
        p = {k: values[k].astype(np.float64).reshape(-1) for k in ("gamma", "beta", "mean", "var")}
        gamma = p["gamma"] if bool(bn.attrs.scale) else np.ones(channels)
        beta = p["beta"] if bool(bn.attrs.center) else np.zeros(channels)
        scale = gamma / np.sqrt(p["var"] + float(bn.attrs.epsilon))
        new_w = (weight * scale[:, None, None, None]).astype(np.float32)
        new_b = ((bias - p["mean"]) * scale + beta).astype(np.float32).reshape(1, -1, 1, 1)
        new_w = hidden.const(new_w, "float32") if hidden else relax.const(new_w)
        if new_w is None:
            return expr  # collided: the caller runs the fold on the constants instead
        new_conv = relax.op.nn.conv2d(
            matches[parts["x"]], new_w, strides=attrs.strides, padding=attrs.padding,
            dilation=attrs.dilation, groups=attrs.groups, data_layout="NCHW", kernel_layout="OIHW",
            out_layout=attrs.out_layout, out_dtype=attrs.out_dtype,
        )
        return relax.op.add(new_conv, relax.const(new_b))

    return rewrite_call(pattern, rewriter, target)


def fold_batch_norm(func: relax.Function) -> relax.Function:
    """Fold inference batch norms into the preceding conv2d (optionally with a bias add) of ``func``."""
    if not _may_fold_batch_norm(func):
        return _fold_batch_norm(func, None)  # nothing matches: as cheap as a traversal
    hidden = HiddenConstants(func, _HIDE_MIN_ELEMENTS)
    if not hidden.hidden:
        return _fold_batch_norm(func, None)
    out = _fold_batch_norm(func, hidden)
    return _fold_batch_norm(func, None) if hidden.collided else hidden.restore(out)


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


#: constants with at least this many elements stand in as parameters in the rewrites (see .hidden)
_HIDE_MIN_ELEMENTS = 1 << 14

_LAYOUT_OPS = ("relax.permute_dims", "relax.reshape", "relax.astype")


def _may_fold(func: relax.Function) -> bool:
    """Whether a layout op may read a constant (directly or through variables) in ``func``."""
    value_of = relax.analysis.get_var2val(func)
    found = []

    def visit(expr):
        if found or not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)
                         and expr.op.name in _LAYOUT_OPS and expr.args):
            return
        arg = expr.args[0]
        while isinstance(arg, relax.Var) and arg in value_of:
            arg = value_of[arg]
        if isinstance(arg, Constant):
            found.append(expr)

    relax.analysis.post_order_visit(func, visit)
    return bool(found)


def _may_fold_batch_norm(func: relax.Function) -> bool:
    """Whether ``func`` may hold a batch norm (anywhere, nested functions included)."""
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.nn.batch_norm":
            found.append(expr)

    relax.analysis.post_order_visit(func, visit)
    return bool(found)


def _fold_layout(func: relax.Function) -> relax.Function:
    """:func:`_fold_layout_reference`, with the large constants standing in as parameters (see
    :mod:`.hidden`): the same rewrites and result without hashing the weights' data."""
    if not _may_fold(func):
        return _fold_layout_reference(func)  # nothing matches: as cheap as a traversal
    hidden = HiddenConstants(func, _HIDE_MIN_ELEMENTS)
    if not hidden.hidden:
        return _fold_layout_reference(func)
    const = hidden.const_pattern()

    def rewriter(expr, matches):
        value = hidden.value(matches, const)
        if value is None:
            return expr
        new = hidden.const(_folded(value, expr), str(expr.ty.dtype))
        return expr if new is None else new

    new_func = hidden.func
    for pattern in _layout_patterns(const):
        new_func = rewrite_call(pattern, rewriter, new_func)
        if hidden.collided:
            return _fold_layout_reference(func)
    return hidden.restore(new_func)


@relax.transform.function_pass(opt_level=0, name="SpinnFoldLayoutConstants")
def FoldLayoutConstants(func: relax.Function, _mod, _ctx) -> relax.Function:  # noqa: N802
    """Function pass: fold layout ops of constants with numpy (see module docstring)."""
    return _fold_layout(func)


_ROUNDING_SUFFIX = {"tflite": "_tflite"}


@tvm.transform.module_pass(opt_level=0, name="SpinnTagRequantRounding")
def TagRequantRounding(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802
    """Name the requantization rule in the int8 GEMM composites of a TFLite model.

    Runs between ``FuseOpsByPattern`` and ``MergeCompositeFunctions``: a composite
    ``spinn.qconv2d..._requant`` becomes ``..._requant_tflite`` when the module's
    :data:`QUANT_ROUNDING_ATTR` is ``"tflite"``; the GEMM family's lowering reads the suffix and
    records ``rounding="tflite"`` in the layer (the QDQ graph itself cannot carry it).

    Fully-connected layers (``spinn.qdense*``) keep the single rounding: TFLite's reference
    ``FULLY_CONNECTED`` kernel rounds ``acc * M0 / 2**shift`` once, half up (measured against
    ``tf.lite.Interpreter(..., BUILTIN_REF)`` in TF 2.21: 0 of 7,680 outputs differ with one
    rounding, 8 with the double rounding), while its convolutions round twice. (TVM's importer
    refuses quantized ``BATCH_MATMUL``, so no TFLite model reaches ``spinn.qmatmul``.)"""
    rule = mod.attrs.get(QUANT_ROUNDING_ATTR) if mod.attrs else None
    if rule is None:
        return mod
    rule = str(rule)
    if rule not in _ROUNDING_SUFFIX:
        raise ValueError(f"module attribute {QUANT_ROUNDING_ATTR}={rule!r}: expected one of "
                         f"{sorted(_ROUNDING_SUFFIX)}")
    suffix = _ROUNDING_SUFFIX[rule]
    updates = {}
    for gvar, func in mod.functions_items():
        if not (isinstance(func, relax.Function) and func.attrs and "Composite" in func.attrs):
            continue
        name = str(func.attrs["Composite"])
        if name.startswith("spinn.qconv2d") and name.endswith("_requant"):
            updates[gvar] = func.with_attr("Composite", name + suffix)
    if not updates:
        return mod
    mod = mod.clone()
    for gvar, func in updates.items():
        mod[gvar] = func
    return mod


_INT_RANGES = {"int8": (-128, 127), "uint8": (0, 255)}


def _prim_float(value) -> float | None:
    inner = getattr(value, "value", None)
    try:
        return float(getattr(inner, "value", inner))
    except (TypeError, ValueError):
        return None


@relax.transform.function_pass(opt_level=0, name="SpinnFoldQuantizedClip")
def FoldQuantizedClip(func: relax.Function, _mod, _ctx) -> relax.Function:  # noqa: N802
    """A fused activation on quantized data, ``clip(quantize(x, s, z), lo, hi)`` (TFLite's
    importer), as the QDQ form the int8 patterns fuse: ``quantize(x)`` when the clip covers the
    type's range, ``quantize(relu(x))`` when it is ``[z, max]`` (a ReLU: ``quantize`` is monotonic
    and ``quantize(0) = z``, so both give the same integers). Other clips stay."""
    x, s, z = wildcard(), is_const(), is_const()
    quant = is_op("relax.quantize")(x, s, z)
    pattern = is_op("relax.clip")(quant, wildcard(), wildcard())

    def rewriter(expr, matches):
        q = matches[quant]
        rng = _INT_RANGES.get(str(q.attrs.out_dtype))
        lo, hi = _prim_float(expr.args[1]), _prim_float(expr.args[2])
        zero = matches[z].value.numpy()
        if rng is None or lo is None or hi is None or zero.size != 1 or hi < rng[1]:
            return expr
        if lo <= rng[0]:
            return q
        if lo == float(zero.reshape(-1)[0]):
            return relax.op.quantize(relax.op.nn.relu(matches[x]), q.args[1], q.args[2],
                                     axis=int(q.attrs.axis), out_dtype=str(q.attrs.out_dtype))
        return expr

    if "relax.clip" not in _ops_in(func):
        return func
    return rewrite_call(pattern, rewriter, func)


def _ops_in(func: relax.Function) -> set[str]:
    ops: set[str] = set()

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            ops.add(str(expr.op.name))

    relax.analysis.post_order_visit(func, visit)
    return ops
