"""Element-wise operators: unary (``relu``, ``gelu``, ``gelu_tanh``, ``sigmoid``, ``tanh``,
``negative``, ``sqrt``, ``rsqrt``, ``power`` by a constant 2 or 3), ``clip`` and binary (``add``, ``subtract``, ``multiply``, ``divide``; ``add`` may end in a ReLU)
on float32, with numpy broadcasting.

- Arithmetic (Cortex-M4F, fp32): each is single fp32 operations in a fixed order (a binary op
  with a NaN operand gives that NaN, quieted, the first operand's if both are: the M4F's rule
  with FPSCR.DN = 0, :func:`binary`); ``relu`` is
  ``x > 0 ? x : +0`` and ``clip`` is TVM's ``max(min(x, hi), lo)`` as compare-and-select
  (``x < hi ? x : hi``, then ``y > lo ? y : lo``), a NaN operand of either giving that NaN
  (relu(NaN) and clip(NaN) are NaN, as in PyTorch and numpy; the fallback's llvm build does
  the same, :mod:`tvm_spinn.fallback`); ``exp`` comes from the exp/log unit (:func:`exp_f32`, a fixed float32 algorithm), ``erf``
  (GELU) is the M4F library's rational approximation in fp32 (Abramowitz-Stegun 7.1.26,
  |error| < 1.5e-7): GELU is ``0.5 x (1 + erf(x / sqrt 2))``, GELU-tanh ``0.5 x (1 + tanh(
  0.79788456 (x + 0.044715 x^3)))``, sigmoid ``1 / (1 + exp(-x))`` (C++ ``activation_f32``).
  ``sqrt`` is VSQRT.F32 and ``rsqrt`` is ``1 / sqrt(x)`` (VSQRT then VDIV: two correctly rounded
  operations, as TVM's llvm build); ``negative`` flips the sign bit; ``power`` by a constant 2
  or 3 is ``x * x`` or ``(x * x) * x`` (the library ``powf`` would go through exp and log; for
  the exponent 2 the product is the correctly rounded square, for 3 it may differ from a
  correctly rounded cube by an ulp).
- ``where_less`` (:class:`Select`): ``a < b ? c : d``, a compare and a select.
- Tiles: ``[elements]`` over the flattened (broadcast) output.
"""

from __future__ import annotations

import math

import numpy as np

from ... import _lib
from ..checks import RELU, check_int, check_num, fail
from ..model import Layer
from . import native
from .base import FlatFamily, register
from .m4f import Mix, pass_cycles
from .sharding import PointwiseRule

__all__ = ["Elementwise", "Select", "binary", "relu", "relu_owned", "unary", "clip_fast", "exp_f32", "log_f32", "tanh_f32", "BINARY", "UNARY", "TRANSCENDENTAL"]

_F32 = np.float32
_ZERO = _F32(0)

#: binary kinds and their fp32 operation
BINARY = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": np.divide}
UNARY = ("relu", "gelu", "gelu_tanh", "sigmoid", "tanh", "negative", "sqrt", "rsqrt")
#: unary kinds that are plain M4F instructions: their Relax operator
_PLAIN = {"negative": "relax.negative", "sqrt": "relax.sqrt", "rsqrt": "relax.rsqrt"}
#: ``power`` exponents computed by repeated multiplication
POWER_EXPONENTS = (2, 3)
#: kinds whose elements go through the exp/log unit
TRANSCENDENTAL = ("gelu", "gelu_tanh", "sigmoid", "tanh")


#: Per element, the instructions of the PE kernels (:mod:`tvm_spinn.pe.kernels`) of the
#: element-wise kinds, one :class:`~.m4f.Mix` per pass over the data: a binary operation loads
#: both operands back to back (the second pipelined), computes and stores; a ReLU is a compare
#: and a select; ``clip`` two of each; ``negative`` flips the sign bit in an integer register.
#: The kinds on the exp/log unit run two passes around one stream of exp arguments: the first
#: writes each argument, the second reloads the input and the exp and finishes (tanh: the
#: common ``|x| > 0.625`` branch, ``1 - 2 / (e + 1)`` with its sign; gelu: erf by
#: Abramowitz-Stegun 7.1.26, a divide and a degree-5 polynomial).
_UNARY_MIX = {
    "relu": (Mix(loads=2.0, compares=1.0, selects=1.0),),
    "clip": (Mix(loads=2.0, compares=2.0, selects=2.0),),
    "negative": (Mix(loads=2.0, alu=1.0),),
    "sqrt": (Mix(loads=2.0, divides=1.0),),
    "rsqrt": (Mix(loads=2.0, divides=2.0),),
    "sigmoid": (Mix(loads=2.0, alu=1.0), Mix(loads=2.0, fpu=1.0, divides=1.0, exp=1.0)),
    "tanh": (Mix(loads=2.0, fpu=2.0),
             Mix(loads=2.0, paired=1.0, fpu=4.0, compares=3.0, selects=1.0, divides=1.0, branches=2.0, exp=1.0)),
    "gelu": (Mix(loads=2.0, fpu=3.0),
             Mix(loads=2.0, paired=1.0, fpu=18.0, compares=2.0, selects=1.0, divides=1.0, branches=1.0, exp=1.0)),
    "gelu_tanh": (Mix(loads=2.0, fpu=7.0),
                  Mix(loads=2.0, paired=1.0, fpu=12.0, compares=3.0, selects=1.0, divides=1.0, branches=2.0,
                      exp=1.0)),
}


def m4f_passes(layer: Layer) -> tuple:
    """The :class:`~.m4f.Mix` of each pass over the data of ``layer``'s PE kernel."""
    kind = layer.kind
    if kind in BINARY:
        op = dict(divides=1.0) if kind == "divide" else dict(fpu=1.0)
        relu_ = dict(compares=1.0, selects=1.0) if layer.attrs.get("relu") else {}
        return (Mix(loads=2.0, paired=1.0, **op, **relu_),)
    if kind == "power":  # x * x, then times x for a cube
        return (Mix(loads=2.0, fpu=float(layer.attrs.get("exponent", 2)) - 1.0),)
    passes = _UNARY_MIX[kind]
    if layer.attrs.get("relu") and kind != "relu":
        last = passes[-1]
        passes = (*passes[:-1], Mix(**{**last.__dict__, "compares": last.compares + 1, "selects": last.selects + 1}))
    return passes


_QUIET = np.uint32(0x00400000)
#: the Arm default NaN (positive, quiet, zero payload)
_DEFAULT_NAN = np.uint32(0x7FC00000).view(np.float32)


def _signalling(x: np.ndarray) -> np.ndarray:
    """Whether each float32 of ``x`` is a signalling NaN (quiet bit clear)."""
    x = np.asarray(x, dtype=_F32)
    return np.isnan(x) & ((x.view(np.uint32) & _QUIET) == 0)


def binary(kind: str, a, b) -> np.ndarray:
    """``a <op> b`` in float32 with numpy broadcasting and the M4F's NaN rule (FPSCR.DN = 0,
    FPProcessNaNs in the v7-M ARM): a signalling NaN operand propagates first (the first
    operand's if both are), else a quiet one (the first operand's if both are), quieted; an
    invalid operation on numbers (inf - inf, 0 * inf, 0 / 0) gives the default NaN 0x7FC00000
    (x86, and so numpy, gives 0xFFC00000). numpy's
    broadcast loops may evaluate a commutative op with its operands swapped (and x86 prefers the
    first operand even over a signalling second one), so the rule is applied here."""
    res = BINARY[kind](a, b)
    nan = np.isnan(res)
    if nan.any():
        a, b = np.broadcast_to(a, res.shape)[nan], np.broadcast_to(b, res.shape)[nan]
        first = np.where(_signalling(a), a, np.where(_signalling(b), b,
                         np.where(np.isnan(a), a, np.where(np.isnan(b), b, _DEFAULT_NAN))))
        bits = first.view(np.uint32) | np.where(np.isnan(a) | np.isnan(b), _QUIET, np.uint32(0))
        if type(res) is not np.ndarray:
            res = np.array(res)
        res[nan] = bits.view(np.float32)
    return res


def _unit(name: str, x, *args) -> np.ndarray:
    """``out = kernel(x, out, *args)`` of a float32 element-wise C++ kernel, ``x``'s shape."""
    x = np.ascontiguousarray(x, dtype=_F32)
    out = np.empty(x.shape, dtype=_F32)
    _lib._func(name)(_lib._input(x), out, *args)
    return out


def exp_f32(x) -> np.ndarray:
    """The exp/log unit's ``exp`` on float32 (``tvm_spinn.sim.exp_f32``: one fixed algorithm,
    < 1 ulp, the same bits on every host; numpy's float32 ``exp`` differs between its SIMD
    levels)."""
    return _unit("tvm_spinn.sim.exp_f32", x)


def log_f32(x) -> np.ndarray:
    """The exp/log unit's natural ``log`` on float32 (``tvm_spinn.sim.log_f32``: Cephes logf as
    one fixed sequence of float32 operations, within 1 ulp, the same bits on every host; the
    cross-entropy's log and the instruction-set simulator's unit compute it)."""
    return _unit("tvm_spinn.sim.log_f32", x)


def tanh_f32(x) -> np.ndarray:
    """``tanh`` on float32 from the same exp model (``tvm_spinn.sim.tanh_f32``)."""
    return _unit("tvm_spinn.sim.tanh_f32", x)


#: activation -> its kind in the C++ kernel ``tvm_spinn.sim.activation_f32``
_ACTIVATIONS = {"gelu": 0, "gelu_tanh": 1, "sigmoid": 2}


def _activation(kind: str, x) -> np.ndarray:
    """GELU (erf), GELU (tanh) or sigmoid on the exp model: the operation sequences of the
    module docstring, one fp32 rounding each (``tvm_spinn.sim.activation_f32``)."""
    return _unit("tvm_spinn.sim.activation_f32", x, _ACTIVATIONS[kind])


def _max(a, b) -> np.ndarray:
    """``a > b ? a : b`` (the M4F's compare-and-select, no VMAXNM) with a NaN operand
    propagated: NaN ``a`` gives ``a``, NaN ``b`` gives ``b`` (PyTorch's and numpy's maximum)."""
    return np.where((a > b) | np.isnan(a), a, b)


def _min(a, b) -> np.ndarray:
    """``a < b ? a : b`` with a NaN operand propagated (see :func:`_max`)."""
    return np.where((a < b) | np.isnan(a), a, b)


def relu(x: np.ndarray) -> np.ndarray:
    """``x > 0 ? x : +0`` in ``x``'s dtype (a new array)."""
    return _max(x, _F32(0)).astype(x.dtype, copy=False)


def relu_owned(r: np.ndarray) -> np.ndarray:
    """:func:`relu` of an array the caller owns, in place where it is float32: ``maximum(r, 0)``
    is :func:`relu` except that it may keep a -0.0 (both propagate NaN), and adding +0.0 turns
    exactly -0.0 into +0.0, leaving every other value (all >= 0, or NaN) unchanged."""
    if r.dtype != _F32:
        return relu(r)
    np.maximum(r, _ZERO, out=r)
    np.add(r, _ZERO, out=r)
    return r


#: the M4F's default NaN (an invalid operation's result on numbers; x86's is 0xFFC00000)
_M4F_DEFAULT_NAN = np.array(0x7FC00000, dtype=np.uint32).view(_F32)


def _m4f_sqrt(x) -> np.ndarray:
    """VSQRT.F32: a negative number's square root is the M4F's default NaN (a NaN is quieted)."""
    x = np.asarray(x, dtype=_F32)
    with np.errstate(invalid="ignore"):
        return np.where(x < 0, _M4F_DEFAULT_NAN, np.sqrt(x, dtype=_F32)).astype(_F32, copy=False)


def unary(kind: str, x: np.ndarray, attrs: dict) -> np.ndarray:
    """The fp32 result of unary ``kind`` (or ``clip`` with ``attrs`` min/max) on ``x``."""
    if kind == "relu":
        return relu(x)
    if kind == "clip":  # TVM's order: max(min(x, hi), lo); clip(NaN) = NaN
        return _max(_min(x, _F32(attrs["max"])), _F32(attrs["min"])).astype(_F32, copy=False)
    if kind == "tanh":
        return tanh_f32(x)
    if kind == "negative":
        return np.negative(x)
    if kind == "sqrt":
        return _m4f_sqrt(x)
    if kind == "rsqrt":
        return np.divide(_F32(1), _m4f_sqrt(x), dtype=_F32)
    if kind == "power":
        square = np.multiply(x, x, dtype=_F32)
        return square if attrs["exponent"] == 2 else np.multiply(square, x, dtype=_F32)
    if kind in _ACTIVATIONS:
        return _activation(kind, x)
    raise NotImplementedError(kind)


def clip_fast(lo, hi):
    """``x -> max(min(x, hi), lo)`` (TVM's order, NaN propagated, :func:`unary`) as numpy's
    minimum/maximum, or None where they could differ. :func:`_min` ``(x, hi)`` is ``minimum(x,
    hi)`` when ``hi`` is a nonzero number (both propagate a NaN x; equal values have equal bits);
    :func:`_max` ``(y, lo)`` is ``maximum(y, lo)`` when ``lo`` is a nonzero number, or, for
    ``lo`` = +0.0, ``maximum(y, 0) + 0.0`` (see :func:`relu_owned`)."""
    lo, hi = _F32(lo), _F32(hi)
    if np.isnan(lo) or np.isnan(hi) or hi == 0 or (lo == 0 and np.signbit(lo)):
        return None
    plus_zero = lo == 0

    def clip(x, out=None):
        if x.dtype != _F32:
            return None
        y = np.minimum(x, hi, out=out)
        np.maximum(y, lo, out=y)
        if plus_zero:
            np.add(y, _ZERO, out=y)
        return y
    return clip


def _finite_num(v, field: str) -> float:
    return check_num(v, field)


class Elementwise(FlatFamily):
    """Unary, clip and binary element-wise operators on float32."""

    kinds = (*UNARY, "power", "clip", *BINARY)
    pointwise = True
    priority = 50
    composites = (*UNARY, "power", "clip", *BINARY, "add_relu")

    # -- partition and codegen ---------------------------------------------------------------
    def patterns(self, kit) -> list[tuple]:
        """Unary ops, clip, then ``add + relu`` before the plain binary ops (more specific)."""
        from tvm.relax.dpl import is_const, is_op, wildcard

        check = self._check_pattern
        entries = [kit.unary(f"spinn.{k}", f"relax.nn.{k}" if k in ("relu", "gelu", "gelu_tanh") else f"relax.{k}", check)
                   for k in UNARY]
        x = wildcard()
        power = is_op("relax.power")(x, is_const())
        entries.append(kit.entry("spinn.power", power, {"input": x, "root": power}, self._check_power))
        x = wildcard()
        clip = is_op("relax.clip")(x, wildcard(), wildcard())  # bounds are PrimValue arguments
        entries.append(kit.entry("spinn.clip", clip, {"input": x, "root": clip}, self._check_clip))
        lhs, rhs = wildcard(), wildcard()
        add_relu = is_op("relax.nn.relu")(is_op("relax.add")(lhs, rhs))  # one pass instead of two
        entries.append(kit.entry("spinn.add_relu", add_relu, {"lhs": lhs, "rhs": rhs, "root": add_relu}, check))
        entries += [kit.binary(f"spinn.{k}", f"relax.{k}", check) for k in BINARY]
        return entries

    @staticmethod
    def _check_pattern(kit, op: str, ctx) -> bool:
        return kit.check_tensors(op, ctx, ("lhs", "rhs", "input"))

    @classmethod
    def _check_clip(cls, kit, op: str, ctx) -> bool:
        # clamp_min/clamp_max/hardsigmoid import as clip(x, lo, +inf) / clip(x, -inf, hi);
        # a spinn program holds finite attributes only (its header is strict JSON).
        root = ctx.annotated_expr["root"]
        for bound in root.args[1:3]:
            inner = getattr(bound, "value", bound)
            value = float(getattr(inner, "value", inner))
            if not math.isfinite(value):
                return kit.refuse(op, root, f"clip bound {value} is not finite")
        return cls._check_pattern(kit, op, ctx)

    @classmethod
    def _check_power(cls, kit, op: str, ctx) -> bool:
        root = ctx.annotated_expr["root"]
        if _exponent(root) is None:
            return kit.refuse(op, root, f"the exponent is not a scalar constant in {POWER_EXPONENTS}")
        return cls._check_pattern(kit, op, ctx)

    def lower(self, lowerer, name: str, kind: str, calls: list, env: dict, layer: Layer) -> None:
        call = calls[0][1]
        if kind == "power":
            layer.inputs = [lowerer.operand(call.args[0], env)]
            layer.attrs["exponent"] = _exponent(call)
            return
        if kind in BINARY or kind == "add_relu":
            layer.inputs = [lowerer.operand(x, env) for x in call.args]
            if kind == "add_relu":
                layer.kind, layer.attrs["relu"] = "add", True
            return
        layer.inputs = [lowerer.operand(call.args[0], env)]
        if kind == "clip":
            layer.attrs["min"], layer.attrs["max"] = (_prim_float(a) for a in call.args[1:3])

    def sums_inputs(self, layer) -> bool:
        """A plain ``add`` (not the fused ``add + relu``)."""
        return layer.kind == "add" and not layer.attrs.get("relu", False)

    # -- validation -----------------------------------------------------------------------------
    def attr_schema(self, kind: str, mode: str):
        if kind == "clip":
            return {"min": _finite_num, "max": _finite_num}, dict(RELU)
        if kind == "power":
            return {"exponent": _power_exponent}, dict(RELU)
        return {}, dict(RELU)

    def check(self, v, f, kind, mode, ins, consts, out, attrs):
        fo = f"{f}.output"
        v.need(f"{f}.inputs", kind, ins, 2 if kind in BINARY else 1)
        ishape = v.shapes[ins[0]]
        for i, tid in enumerate(ins):
            v.dtype(f"{f}.inputs[{i}]", tid, ("float32",))
        v.dtype(fo, out, ("float32",))
        v.consts(f, consts, set())
        if kind in BINARY:
            b = v.broadcast(ishape, v.shapes[ins[1]])
            if b is None:
                fail(f"{f}.inputs", f"shapes {ishape} and {v.shapes[ins[1]]} do not broadcast")
            v.shape(fo, out, b)
        else:
            v.shape(fo, out, ishape)
        return (math.prod(v.shapes[out]),), None

    # -- mapping ------------------------------------------------------------------------------
    def work(self, program, layer, arch):
        n_out = int(np.prod(program.tensors[layer.output].shape, dtype=np.int64))
        return n_out * (8 if layer.kind in TRANSCENDENTAL else 1), None

    def cycles_per_element(self, layer, arch):
        """The PE kernel's passes over the data (:func:`m4f_passes`) priced by the TRM."""
        return pass_cycles(m4f_passes(layer), arch)

    def fixed_cycles(self, layer, arch):
        """One job, and for the kinds on the exp/log unit the unit's latency to the first
        result of the tile's one stream of arguments."""
        return arch.m4f_job_cycles + (arch.exp_unit_latency_cycles if layer.kind in TRANSCENDENTAL else 0)

    # -- functional simulator -----------------------------------------------------------------
    def prepare_tiles(self, runner) -> None:
        self.broadcast_inputs(runner)

    def run_tile(self, runner, tile) -> None:
        (e0, e1), = tile.region
        args = [a[e0:e1] for a in runner.flat_in]
        k = runner.layer.kind
        res = binary(k, args[0], args[1]) if k in BINARY else unary(k, args[0], runner.layer.attrs)
        if runner.layer.attrs.get("relu"):
            res = relu(res)
        runner.out.reshape(-1)[e0:e1] = res

    def run_whole(self, program, index, layer, env, out):
        args = [v if v.shape == out.shape else np.broadcast_to(v, out.shape) for v in (env[i] for i in layer.inputs)]
        k = layer.kind
        res = binary(k, args[0], args[1]) if k in BINARY else unary(k, args[0], layer.attrs)
        if layer.attrs.get("relu"):
            res = relu(res)
        out[...] = res
        return out

    def step(self, program, layer):
        """The whole output: operands are not broadcast to the output first (the ufunc's own
        broadcast gives the same elements); a smaller result is broadcast into the output."""
        tensors = program.tensors
        shape = tuple(tensors[layer.output].shape)
        dtype = np.dtype(tensors[layer.output].dtype)
        k = layer.kind
        attrs = layer.attrs
        do_relu = bool(attrs.get("relu"))

        def finish(res):  # res: a new array or scalar (a ufunc result)
            if type(res) is np.ndarray and res.shape == shape and res.dtype == dtype and res.flags.c_contiguous:
                return relu_owned(res) if do_relu else res  # nothing else holds it
            if do_relu:
                res = relu(res)
            out = np.empty(shape, dtype=dtype)
            out[...] = res
            return out
        if k in BINARY:
            t0, t1 = layer.inputs[0], layer.inputs[1]
            return lambda program, env: finish(binary(k, env[t0], env[t1]))
        x_tid = layer.inputs[0]
        if k == "relu":
            def relu_step(program, env):
                x = env[x_tid]
                if x.dtype != _F32:
                    return finish(unary(k, x, attrs))
                y = np.maximum(x, _ZERO)  # as relu_owned, into a new array
                np.add(y, _ZERO, out=y)
                return finish(y)
            return relu_step
        clip = clip_fast(attrs["min"], attrs["max"]) if k == "clip" else None
        if clip is not None:
            def clip_step(program, env):
                x = env[x_tid]
                y = clip(x)
                return finish(unary(k, x, attrs) if y is None else y)

            def clip_into(program, env, out):
                x = env[x_tid]
                if x.dtype != _F32 or dtype != _F32:
                    return clip_step(program, env)
                clip(x, out)  # x broadcasts to the output
                return relu_owned(out) if do_relu else out
            clip_step.into = clip_into
            return clip_step
        return lambda program, env: finish(unary(k, env[x_tid], attrs))


    def native(self, program, layer, nb, clip=None):
        """float32 layers: the unary kinds and clip as one ``unary`` instruction (the C++ loops
        perform :func:`unary`'s operations; exp-based kinds call the same kernels), binary kinds
        as one ``binary`` instruction reading both operands with broadcast strides."""
        tensors = program.tensors
        shape = tuple(tensors[layer.output].shape)
        if any(tensors[t].dtype != "float32" for t in (*layer.inputs, layer.output)) or len(shape) > 8:
            return False
        k, attrs = layer.kind, layer.attrs
        relu_flag = int(bool(attrs.get("relu")))
        if k in BINARY:
            strides = [native.broadcast_strides(tensors[t].shape, shape) for t in layer.inputs]
            if None in strides:
                return False
            a, b = (nb.read(t) for t in layer.inputs)
            nb.emit("binary", a, b, nb.write(layer.output), native.codes()[f"binary.{k}"], relu_flag,
                    len(shape), list(shape), strides[0], strides[1])
            return True
        if k == "power":
            kind = "square" if attrs["exponent"] == 2 else "cube"
        else:
            kind = k
        lo = hi = 0
        if k == "clip":
            lo, hi = native.f32_bits(attrs["min"]), native.f32_bits(attrs["max"])
        x = nb.read(layer.inputs[0])
        nb.emit("unary", x, nb.write(layer.output), native.numel(shape), native.codes()[f"unary.{kind}"],
                lo, hi, relu_flag)
        return True


class Select(FlatFamily):
    """``where_less``: ``a < b ? c : d`` on float32 with numpy broadcasting of the four operands
    (``where(less(a, b), c, d)``: a ReLU's gradient ``where(x < 0, 0, dy)``).

    One VCMP.F32 and a conditional move per element: the selected operand's bits are copied
    (NaN and -0.0 included), and a NaN ``a`` or ``b`` compares false, selecting ``d``, as the
    llvm build's ``less`` does; natively one ``where_less`` instruction (:meth:`native`)."""

    kinds = ("where_less",)
    pointwise = True
    priority = 50

    def patterns(self, kit) -> list[tuple]:
        from tvm.relax.dpl import is_op, wildcard

        a, b, c, d = (wildcard() for _ in range(4))
        root = is_op("relax.where")(is_op("relax.less")(a, b), c, d)
        return [kit.entry("spinn.where_less", root, {"a": a, "b": b, "c": c, "d": d, "root": root},
                          self._check_pattern)]

    @staticmethod
    def _check_pattern(kit, op: str, ctx) -> bool:
        return kit.check_tensors(op, ctx, ("a", "b", "c", "d"))

    def lower(self, lowerer, name, kind, calls, env, layer) -> None:
        less = next(call for _, call in calls if call.op.name == "relax.less")
        where = next(call for _, call in calls if call.op.name == "relax.where")
        layer.inputs = [lowerer.operand(x, env) for x in (*less.args, *where.args[1:])]

    def check(self, v, f, kind, mode, ins, consts, out, attrs):
        v.float32_only(f, kind, ins, out, consts, 4)
        shape = v.shapes[ins[0]]
        for tid in ins[1:]:
            b = v.broadcast(shape, v.shapes[tid])
            if b is None:
                fail(f"{f}.inputs", f"shapes {[v.shapes[t] for t in ins]} do not broadcast")
            shape = b
        v.shape(f"{f}.output", out, shape)
        return (math.prod(v.shapes[out]),), None

    def work(self, program, layer, arch):
        return int(np.prod(program.tensors[layer.output].shape, dtype=np.int64)), None

    def cycles_per_element(self, layer, arch):
        """The PE kernel's one pass as the generated code executes it (the loop unrolled by 4,
        counted in its executed block): per element ``a`` and ``b`` loaded (VLDR), the compare
        (VCMP + VMRS), the pointer select (MOV of ``d``'s base, IT, MOVMI of ``c``'s, the ADD of
        the element's offset), the load through the selected pointer (LDR: its address is the
        instruction before's result, so it does not pipeline) and the store (four loads and
        stores, 1.5 of them pipelined); per 4 elements the group's address and index
        increments and its compare (1.25 ALU operations per element, the first element's ADD
        folded into its load). The loop's branch is ``m4f_loop_cycles``."""
        return pass_cycles((Mix(loads=2.5, paired=1.5, compares=1.0, alu=5.25),), arch)

    @staticmethod
    def select(a, b, c, d) -> np.ndarray:
        """``a < b ? c : d`` (broadcast), float32."""
        return np.where(a < b, c, d).astype(_F32, copy=False)

    def prepare_tiles(self, runner) -> None:
        self.broadcast_inputs(runner)

    def run_tile(self, runner, tile) -> None:
        (e0, e1), = tile.region
        runner.out.reshape(-1)[e0:e1] = self.select(*(a[e0:e1] for a in runner.flat_in))

    def run_whole(self, program, index, layer, env, out):
        out[...] = self.select(*(env[t] for t in layer.inputs))
        return out

    def step(self, program, layer):
        shape = tuple(program.tensors[layer.output].shape)
        tids = list(layer.inputs)

        def step(program, env):
            out = np.empty(shape, dtype=_F32)
            out[...] = self.select(*(env[t] for t in tids))
            return out
        return step

    def native(self, program, layer, nb, clip=None):
        """One ``where_less`` instruction: :meth:`select` with each operand read through its
        broadcast strides (the selected operand's bits copied)."""
        tensors = program.tensors
        shape = [int(d) for d in tensors[layer.output].shape]
        if len(shape) > native.codes()["max_dims"]:
            return False
        strides = [native.broadcast_strides([int(d) for d in tensors[t].shape], shape) for t in layer.inputs]
        if len(layer.inputs) != 4 or any(s is None for s in strides):
            return False
        nb.emit("where_less", *(nb.read(t) for t in layer.inputs), nb.write(layer.output), len(shape), shape,
                *strides)
        return True


def _exponent(call) -> int | None:
    """The exponent of ``power(x, c)`` when ``c`` is a scalar float32 constant equal to one of
    :data:`POWER_EXPONENTS`, else None."""
    data = getattr(call.args[1], "value", None)  # a relax constant's tensor
    if data is None or not hasattr(data, "numpy"):
        return None
    data = data.numpy()
    if data.dtype != np.float32 or data.size != 1:
        return None
    value = float(data.reshape(-1)[0])
    return int(value) if value in POWER_EXPONENTS else None


def _power_exponent(v, field: str) -> int:
    value = check_int(v, field)
    if value not in POWER_EXPONENTS:
        fail(field, f"exponent {value} is not one of {POWER_EXPONENTS}")
    return value


def _prim_float(value) -> float:
    inner = getattr(value, "value", value)
    return float(getattr(inner, "value", inner))


Elementwise.sharding = PointwiseRule()
Select.sharding = PointwiseRule()
register(Elementwise())
register(Select())
