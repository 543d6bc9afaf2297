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

from tvm import relax
from tvm.relax.dpl import is_const, is_op, is_tuple_get_item, rewrite_call, wildcard

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


def _fold_layout(func: relax.Function) -> relax.Function:
    c = is_const()
    permute = is_op("relax.permute_dims")(c)
    reshape = is_op("relax.reshape")(c, wildcard())
    astype = is_op("relax.astype")(c)

    def rewriter(expr, matches):
        value = matches[c].value.numpy()
        name = expr.op.name
        if name == "relax.permute_dims":
            axes = expr.attrs.axes
            out = np.transpose(value, [int(a) for a in axes] if axes is not None else None)
        elif name == "relax.reshape":
            out = value.reshape([int(d) for d in expr.ty.shape.values])
        else:
            out = value.astype(str(expr.attrs.dtype))
        return relax.const(np.ascontiguousarray(out), str(expr.ty.dtype))

    for pattern in (permute, reshape, astype):
        func = rewrite_call(pattern, rewriter, func)
    return func


@relax.transform.function_pass(opt_level=0, name="SpinnFoldLayoutConstants")
def FoldLayoutConstants(func: relax.Function, _mod, _ctx) -> relax.Function:  # noqa: N802
    """Function pass: fold layout ops of constants with numpy (see module docstring)."""
    return _fold_layout(func)
