"""Gradients TVM 0.27's ``relax.training`` lacks, registered as ``FPrimalGradient`` of the op.

``Gradient`` fails on an op without one ("FPrimalGradient has not been registered"); the ones
a transformer needs are added here, each written as PyTorch's backward formula so that rounding
stays close to PyTorch's (``aten/src/ATen/native/cpu/Activation.cpp``). Registration happens
once, on import of :mod:`tvm_spinn.training`, and never replaces a gradient TVM itself has
(a later TVM that registers its own keeps it).
"""

from __future__ import annotations

import math

import tvm
from tvm import relax

__all__ = ["register"]


def _const(value: float, like) -> relax.Expr:
    return relax.const(value, like.ty.dtype)


def _gelu_grad(orig_var, orig_call, output_grad, ctx):
    """``y = x * Phi(x)``: ``dx = dy * (Phi(x) + x * phi(x))``, ``Phi(x) = (1 + erf(x / sqrt 2)) / 2``,
    ``phi(x) = exp(-x^2 / 2) / sqrt(2 pi)``."""
    x = orig_call.args[0]
    cdf = _const(0.5, x) * (_const(1.0, x) + relax.op.erf(x * _const(math.sqrt(0.5), x)))
    pdf = relax.op.exp(_const(-0.5, x) * x * x) * _const(1.0 / math.sqrt(2.0 * math.pi), x)
    return [output_grad * (cdf + x * pdf)]


def _gelu_tanh_grad(orig_var, orig_call, output_grad, ctx):
    """``y = x (1 + tanh(u)) / 2``, ``u = sqrt(2/pi) (x + 0.044715 x^3)``:
    ``dx = dy * ((1 + t) / 2 + x (1 - t^2) u' / 2)``, ``u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2)``."""
    x = orig_call.args[0]
    beta, kappa = math.sqrt(2.0 / math.pi), 0.044715
    x2 = x * x
    t = relax.op.tanh(_const(beta, x) * (x + _const(kappa, x) * x2 * x))
    one, half = _const(1.0, x), _const(0.5, x)
    du = _const(beta, x) * (one + _const(3.0 * kappa, x) * x2)
    return [output_grad * (half * (one + t) + half * x * (one - t * t) * du)]


def _rsqrt_grad(orig_var, orig_call, output_grad, ctx):
    """``y = x^(-1/2)`` (RMSNorm's ``1 / sqrt(mean(x^2) + eps)``): ``dx = -0.5 * dy * y^3``, the
    product in PyTorch's order (``tools/autograd/derivatives.yaml``: ``-0.5 * grad *
    result.pow(3)``; ``pow(y, 3)`` is ``y * y * y``)."""
    y = orig_var
    return [_const(-0.5, y) * output_grad * (y * y * y)]


def _not_differentiable_grad(orig_var, orig_call, output_grad, ctx):
    """Ops whose result is an integer or boolean tensor (``arange``, bitwise and logical ops:
    a causal mask, position ids): no partial for any argument, as TVM's own comparison ops
    (``relax.less`` etc. return ``no_grad`` for both operands). ``Gradient`` asks every op on
    the way to the loss for one, the mask's ops included, although nothing flows through them."""
    return [relax.op.grad.no_grad(a) for a in orig_call.args]


def _index_tensor_grad(orig_var, orig_call, output_grad, ctx):
    """``index_tensor`` of an integer or boolean tensor (a mask's rows, picked by position
    ids): not differentiable. Of a float tensor it would need a scatter-add: refused by name."""
    data = orig_call.args[0]
    if str(data.ty.dtype).startswith(("float", "bfloat")):
        raise ValueError("tvm_spinn.training: no gradient for index_tensor of a float tensor "
                         f"{data.ty} (advanced indexing of an activation or weight)")
    return _not_differentiable_grad(orig_var, orig_call, output_grad, ctx)


def _reshape_back_grad(orig_var, orig_call, output_grad, ctx):
    """Ops that only change the shape (``squeeze``): the gradient is ``dy`` in the input's shape."""
    return [relax.op.reshape(output_grad, orig_call.args[0].ty.shape)] + [
        relax.op.grad.no_grad(a) for a in orig_call.args[1:]]


def _ints(t) -> list[int]:
    return [int(getattr(f, "value", f)) for f in t.fields]


def _strided_slice_grad(orig_var, orig_call, output_grad, ctx):
    """A unit-stride slice (``x[..., a:b]``, ``unbind``): ``dy`` zero-padded back to the input's
    shape (``pad`` writes exact zeros: the gradient of the elements not read)."""
    x, axes, begin, end = orig_call.args[:4]
    shape = [int(d) for d in x.ty.shape]
    pads = [[0, 0] for _ in shape]
    steps = _ints(orig_call.args[4]) if len(orig_call.args) > 4 else [1] * len(axes.fields)
    for axis, b, e, s in zip(_ints(axes), _ints(begin), _ints(end), steps):
        axis %= len(shape)
        if s != 1:
            raise ValueError(f"tvm_spinn.training: no gradient for a strided_slice of stride {s} (only 1)")
        n = shape[axis]
        b = min(max(b + n if b < 0 else b, 0), n)
        e = min(max(e + n if e < 0 else e, b), n)
        pads[axis] = [b, n - e]
    # one partial per argument: the slice bounds (tuples of ints) get none
    no = relax.op.grad.no_grad
    return [relax.op.nn.pad(output_grad, [v for p in pads for v in p])] + [no(a) for a in orig_call.args[1:]]


def _pad_grad(orig_var, orig_call, output_grad, ctx):
    """A constant pad: the gradient of the input is ``dy`` without the padding (a unit-stride
    slice); the padded elements are constants."""
    x = orig_call.args[0]
    if str(orig_call.attrs.pad_mode) != "constant":
        raise ValueError(f"tvm_spinn.training: no gradient for a pad of mode {orig_call.attrs.pad_mode}")
    shape = [int(d) for d in x.ty.shape]
    width = [int(v) for v in orig_call.attrs.pad_width]
    axes = list(range(len(shape)))
    begin = [width[2 * k] for k in axes]
    return [relax.op.strided_slice(output_grad, axes, begin, [b + d for b, d in zip(begin, shape)])]


_GRADIENTS = {"relax.nn.pad": _pad_grad, "relax.rsqrt": _rsqrt_grad, "relax.index_tensor": _index_tensor_grad, "relax.squeeze": _reshape_back_grad, "relax.strided_slice": _strided_slice_grad, "relax.nn.gelu": _gelu_grad, "relax.nn.gelu_tanh": _gelu_tanh_grad}

_GRADIENTS.update({name: _not_differentiable_grad for name in (
    "relax.arange", "relax.bitwise_and", "relax.bitwise_or", "relax.bitwise_xor", "relax.bitwise_not",
    "relax.logical_and", "relax.logical_or", "relax.logical_xor", "relax.logical_not")})


def register() -> None:
    """Register the gradients above for ops that have none (idempotent)."""
    for name, fn in _GRADIENTS.items():
        if tvm.ir.Op.get(name).get_attr("FPrimalGradient") is None:
            tvm.ir.register_op_attr(name, "FPrimalGradient", fn)
