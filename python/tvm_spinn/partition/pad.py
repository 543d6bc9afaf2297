"""Fold explicit zero padding into the convolution that reads it.

Models exported with TensorFlow-style "same" padding (transformers' MobileNetV2 with
``tf_padding=True``, Keras models through ONNX) pad the input with ``nn.pad`` and then run the
convolution with no padding. Left alone, every such pad falls back to the host and cuts the
offloaded graph into one region per convolution (MobileNetV2: 52 regions, 52 host calls). A
``conv2d(pad(x), w)`` whose pad adds +0.0 on the spatial axes only is ``conv2d(x, w)`` with the
widths added to its own padding: the convolution's padding reads +0.0 too (the PEs' im2col, and
TVM's conv2d), so every product, and every bit of the result, is the same.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax

__all__ = ["FoldPadIntoConv", "fold_pad_into_conv"]

_PAD = "relax.nn.pad"
_CONV = "relax.nn.conv2d"


def _spatial_widths(pad: relax.Call) -> tuple[int, int, int, int] | None:
    """(top, left, bottom, right) of an NCHW zero pad on H and W only, else None."""
    attrs = pad.attrs
    if str(attrs.pad_mode) != "constant":
        return None
    value = float(attrs.pad_value)
    if value != 0.0 or math.copysign(1.0, value) < 0:  # -0.0 would change the sign of zero sums
        return None
    widths = [int(w) for w in attrs.pad_width]
    if len(widths) != 8 or any(w < 0 for w in widths) or any(widths[:4]):
        return None
    top, bottom, left, right = widths[4:]
    return top, left, bottom, right


@relax.expr_functor.mutator
class _FoldPad(relax.PyExprMutator):
    def __init__(self, value_of: dict):
        super().__init__()
        self.value_of = value_of

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: D102
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == _CONV):
            return call
        attrs = call.attrs
        pad = self.value_of.get(call.args[0])
        if (attrs.data_layout != "NCHW" or not isinstance(pad, relax.Call)
                or not isinstance(pad.op, tvm.ir.Op) or pad.op.name != _PAD):
            return call
        widths = _spatial_widths(pad)
        if widths is None:
            return call
        padding = [int(p) + w for p, w in zip(attrs.padding, widths)]
        return relax.op.nn.conv2d(
            self.visit_expr(pad.args[0]), call.args[1], strides=attrs.strides, padding=padding,
            dilation=attrs.dilation, groups=attrs.groups, data_layout=attrs.data_layout,
            kernel_layout=attrs.kernel_layout, out_layout=attrs.out_layout,
            out_dtype=attrs.out_dtype,
        )


def fold_pad_into_conv(func: relax.Function) -> relax.Function:
    """``conv2d(pad(x), w)`` -> ``conv2d(x, w)`` with the pad's widths in its padding.

    Only constant pads of +0.0 on the spatial axes of an NCHW convolution fold; a pad that is
    still read elsewhere stays for its other users; the others are removed.

    Parameters
    ----------
    func : relax.Function
        Any Relax function.

    Returns
    -------
    relax.Function
        The function with the folded convolutions (``func`` itself if nothing folds).
    """
    value_of = relax.analysis.get_var2val(func)
    if not any(isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name == _PAD
               for v in value_of.values()):
        return func
    # the pads no convolution reads any more would still reach the partitioner (and the host)
    return relax.analysis.remove_all_unused(_FoldPad(value_of).visit_expr(func))


@relax.transform.function_pass(opt_level=0, name="SpinnFoldPadIntoConv")
def FoldPadIntoConv(func: relax.Function, _mod, _ctx) -> relax.Function:  # noqa: N802 - TVM pass naming
    """Function pass: :func:`fold_pad_into_conv`."""
    return fold_pad_into_conv(func)
