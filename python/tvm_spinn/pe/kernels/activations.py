"""The activation PE kernels ``("unary", act)``: the activations on exp in two passes around
one stream through the exp/log unit, the others one element at a time.

Kernels (the ``spec`` of :func:`~tvm_spinn.pe.kernels.kernel_object`):

- ``("unary", act)``: ``gelu`` (erf by Abramowitz-Stegun 7.1.26), ``gelu_tanh``, ``sigmoid``,
  ``tanh``, in the simulator's operation order, in two passes around one stream of exp
  arguments through the exp/log unit (``y`` holds the arguments, then their exps); ``negative`` (the sign
  bit flipped), ``sqrt`` (VSQRT), ``rsqrt`` (VSQRT, VDIV), ``square`` and ``cube`` (``power``
  by 2 or 3: ``x * x``, ``(x * x) * x``); args ``x, y, n``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import _exp_unit, _f, _vsqrt, _ZERO


def _fabs(v):
    """``|v|`` (VABS: clears the sign bit)."""
    return T.call_llvm_pure_intrin("float32", "llvm.fabs.f32", v)


def _neg(v):
    """``-v`` as C++'s unary minus (the sign bit flipped; TIR's ``-v`` is ``v * -1.0``, which
    keeps a NaN's sign)."""
    return T.reinterpret("float32", T.bitwise_xor(T.reinterpret("int32", v), T.int32(-2147483648)))


# The activations on exp run in two passes around one stream through the exp/log unit: the
# first (``*_arg``) writes each element's exp argument to ``t[8]``, the second (``*_finish``)
# recomputes what it needs from ``x`` (the same operations, so the same bits) and finishes
# from ``e``, the argument's exp, into ``t[8]``. Elements whose result does not use the exp
# (tanh's small or huge arguments) still stream an argument through the unit.


@T.macro
def _tanh_arg(t, x):
    """``2 |x|``, the exp argument of tanh's large branch (the C++ ``TanhModel``)."""
    t[6] = _fabs(x)
    t[8] = t[6] + t[6]


@T.macro
def _tanh_finish(t, x, e):
    """``t[8] = tanh(x)`` from ``e = exp(2 |x|)`` (the C++ ``TanhModel``); uses ``t[6..9]``."""
    t[9] = x
    t[6] = _fabs(t[9])
    if t[6] > _f(0.625):
        if t[6] > _f(44.0):
            t[8] = T.if_then_else(t[9] > _ZERO, _f(1.0), _f(-1.0))
        else:
            t[7] = _f(1.0) - _f(2.0) / (e + _f(1.0))
            t[8] = T.if_then_else(t[9] < _ZERO, _neg(t[7]), t[7])
    elif t[9] == _ZERO:
        t[8] = t[9]  # keeps the sign of zero
    else:
        t[6] = t[9] * t[9]
        t[7] = _f("-5.70498872745e-3")
        t[7] = t[7] * t[6] + _f("2.06390887954e-2")
        t[7] = t[7] * t[6] - _f("5.37397155531e-2")
        t[7] = t[7] * t[6] + _f("1.33314422036e-1")
        t[7] = t[7] * t[6] - _f("3.33332819422e-1")
        t[7] = t[7] * t[6]
        t[7] = t[7] * t[9]
        t[8] = t[7] + t[9]


@T.macro
def _gelu_arg(t, x):
    """``-a * a`` with ``a = |x / sqrt 2|``: the exp argument of erf (the C++ ``GeluModel``)."""
    t[10] = x * _f("0.70710678118654752")
    t[12] = _fabs(t[10])
    t[8] = _neg(t[12]) * t[12]


@T.macro
def _gelu_finish(t, x, e):
    """``t[8] = gelu(x)`` with erf by Abramowitz-Stegun 7.1.26 (the C++ ``GeluModel``), from
    ``e = exp(-a * a)``."""
    t[9] = x
    t[10] = t[9] * _f("0.70710678118654752")
    if t[10] > _ZERO:
        t[11] = _f(1.0)
    elif t[10] < _ZERO:
        t[11] = _f(-1.0)
    elif T.isnan(t[10]):
        t[11] = t[10]
    else:
        t[11] = _ZERO
    t[12] = _fabs(t[10])
    t[13] = _f("0.3275911") * t[12]
    t[13] = _f(1.0) / (_f(1.0) + t[13])
    t[14] = t[13] * _f("1.061405429")
    t[14] = _f("-1.453152027") + t[14]
    t[14] = t[13] * t[14]
    t[14] = _f("1.421413741") + t[14]
    t[14] = t[13] * t[14]
    t[14] = _f("-0.284496736") + t[14]
    t[14] = t[13] * t[14]
    t[14] = _f("0.254829592") + t[14]
    t[14] = t[13] * t[14]
    t[14] = t[14] * e
    t[14] = t[11] * (_f(1.0) - t[14])
    t[15] = _f(0.5) * t[9]
    t[8] = t[15] * (_f(1.0) + t[14])


@T.macro
def _gelu_tanh_inner(t, x):
    """``t[11] = 0.7978845608028654 (x + 0.044715 x^3)`` (the C++ ``GeluTanhModel``)."""
    t[10] = x
    t[11] = _f("0.044715") * t[10]
    t[11] = t[11] * t[10]
    t[11] = t[11] * t[10]
    t[11] = _f("0.7978845608028654") * (t[10] + t[11])


@T.macro
def _gelu_tanh_arg(t, x):
    _gelu_tanh_inner(t, x)
    _tanh_arg(t, t[11])


@T.macro
def _gelu_tanh_finish(t, x, e):
    """``t[8] = 0.5 x (1 + tanh(inner))`` from ``e = exp(2 |inner|)``."""
    _gelu_tanh_inner(t, x)
    t[12] = _f(0.5) * t[10]
    _tanh_finish(t, t[11], e)
    t[8] = t[12] * (_f(1.0) + t[8])


@T.macro
def _sigmoid_arg(t, x):
    t[8] = _neg(x)


@T.macro
def _sigmoid_finish(t, x, e):
    """``t[8] = 1 / (1 + exp(-x))`` (the C++ ``SigmoidModel``)."""
    t[8] = _f(1.0) / (_f(1.0) + e)


@T.macro
def _negative_into(t, x):
    t[8] = _neg(x)


@T.macro
def _sqrt_into(t, x):
    t[8] = _vsqrt(x)


@T.macro
def _rsqrt_into(t, x):
    """``1 / sqrt(x)``: VSQRT then VDIV (two roundings, the simulator's and TVM's llvm build's)."""
    t[9] = _vsqrt(x)
    t[8] = _f(1.0) / t[9]


@T.macro
def _square_into(t, x):
    t[8] = x * x


@T.macro
def _cube_into(t, x):
    t[9] = x
    t[10] = t[9] * t[9]
    t[8] = t[10] * t[9]


#: the functions of kernel ``("unary", act)`` that need no exp: act -> macro writing ``t[8]``
_PLAIN_ACTIVATIONS = {"negative": _negative_into, "sqrt": _sqrt_into, "rsqrt": _rsqrt_into, "square": _square_into,
                      "cube": _cube_into}
#: those on the exp/log unit: act -> (argument macro, finishing macro)
_EXP_ACTIVATIONS = {"gelu": (_gelu_arg, _gelu_finish), "gelu_tanh": (_gelu_tanh_arg, _gelu_tanh_finish),
                    "sigmoid": (_sigmoid_arg, _sigmoid_finish), "tanh": (_tanh_arg, _tanh_finish)}
#: every activation of kernel ``("unary", act)``
ACTIVATIONS = (*sorted(_EXP_ACTIVATIONS), *sorted(_PLAIN_ACTIVATIONS))


def _unary(act: str):
    if act in _PLAIN_ACTIVATIONS:
        into = _PLAIN_ACTIVATIONS[act]

        @T.prim_func
        def kernel(x: T.handle("float32"), y: T.handle("float32"), n: T.int32):
            T.func_attr({"tir.noalias": True, "calling_conv": 0})
            X = T.decl_buffer((n,), "float32", data=x)
            Y = T.decl_buffer((n,), "float32", data=y)
            t = T.decl_buffer((16,), "float32", scope="local")
            for i in range(n):
                into(t, X[i])
                Y[i] = t[8]
        return kernel
    arg, finish = _EXP_ACTIVATIONS[act]

    @T.prim_func
    def kernel_exp(x: T.handle("float32"), y: T.handle("float32"), n: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        X = T.decl_buffer((n,), "float32", data=x)
        Y = T.decl_buffer((n,), "float32", data=y)
        t = T.decl_buffer((16,), "float32", scope="local")
        for i in range(n):  # the exp arguments, into y
            arg(t, X[i])
            Y[i] = t[8]
        _exp_unit(T.address_of(Y[0]), T.address_of(Y[0]), n)
        for i in range(n):
            finish(t, X[i], Y[i])
            Y[i] = t[8]
    return kernel_exp
