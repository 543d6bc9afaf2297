"""``FoldConstant`` without legalizing the calls it cannot fold.

TVM's ``FoldConstant`` legalizes *every* operator call of a dataflow block (a TE compute and a
PrimFunc per call, about a millisecond each in Python) and only then finds out that most of them
read a run-time tensor and cannot be folded: for BERT-base that is ~750 legalizations per run,
most of the time partitioning took. :func:`FoldConstant` is the same pass with the legalization
of such calls skipped: for the operators in :data:`_READS_EVERY_TENSOR_ARG`, whose legalization
passes every tensor argument to the PrimFunc, a call with a run-time tensor argument (a
variable, after ``FoldConstant`` inlined the variables bound to constants) legalizes to a
``call_tir`` that reads that variable, which ``FoldConstant`` leaves unfolded; the skipped
legalization returns the call unchanged, which ``FoldConstant`` leaves unfolded too. Every other
call (constant arguments, creation ops such as ``full_like`` that read only a shape, unlisted
ops) is legalized as before, so the folded module is the same.

Structurally equal PrimFuncs (one per legalization) are also built once instead of once each.
Both are installed (on the operators' ``FLegalize`` attributes and on ``tirx.build``) for the
duration of the pass and only apply on the thread running it.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax import transform

__all__ = ["FoldConstant", "FoldSmallConstants"]

# Operators whose TVM legalization is a ``call_tir`` that takes every tensor argument of the call
# (elementwise math, layout, reductions, GEMMs, normalizations): a run-time tensor argument is
# always an argument of the legalized call, so such a call never folds.
_READS_EVERY_TENSOR_ARG = frozenset(
    "relax." + name
    for name in (
        # unary
        "abs acos acosh asin asinh atan atanh ceil cos cosh erf exp floor log negative round rsqrt "
        "sigmoid sign sin sinh sqrt square tan tanh trunc bitwise_not logical_not clip isfinite "
        "isinf isnan "
        # binary / ternary
        "add atan2 bitwise_and bitwise_or bitwise_xor divide equal floor_divide floor_mod greater "
        "greater_equal left_shift less less_equal log_add_exp logical_and logical_or logical_xor "
        "maximum minimum mod multiply not_equal power right_shift subtract where "
        # layout and data movement
        "astype broadcast_to concat expand_dims flatten flip permute_dims reshape squeeze "
        "strided_slice take tile repeat split stack tril triu "
        # reductions, GEMMs, nn
        "max mean min sum prod variance std argmax argmin matmul dequantize quantize "
        "nn.relu nn.gelu nn.gelu_tanh nn.silu nn.softmax nn.log_softmax nn.layer_norm "
        "nn.rms_norm nn.group_norm nn.batch_norm nn.conv1d nn.conv2d nn.max_pool2d nn.avg_pool2d "
        "nn.adaptive_avg_pool2d nn.leakyrelu nn.softplus nn.prelu nn.pad nn.batch_flatten"
    ).split()
)

_install_lock = threading.RLock()  # re-entrant: a nested run installs on top and restores in order
_active = threading.local()


def _runtime_tensor(arg: relax.Expr) -> bool:
    """``arg`` is (or, for a tuple, holds) a tensor variable: data known only at run time."""
    if isinstance(arg, relax.Var):
        return isinstance(arg.ty, relax.TensorType)
    if isinstance(arg, relax.Tuple):
        return any(_runtime_tensor(field) for field in arg.fields)
    return False


def _skipping(legalize):
    def legalize_foldable(bb, call):
        if getattr(_active, "on", False) and any(_runtime_tensor(arg) for arg in call.args):
            return call  # not a call_tir: FoldConstant keeps the call, as it would have anyway
        return legalize(bb, call)

    return legalize_foldable


def _memoized(build):
    """``tirx.build`` that builds structurally equal PrimFuncs once (per pass run).

    ``FoldConstant`` caches builds by PrimFunc object, and every legalization makes a new one:
    BERT's 12 ``full_like`` (one per layer, same shape) were 12 LLVM builds of the same kernel."""
    cache: dict = {}

    def build_once(func, *args):
        if not (getattr(_active, "on", False) and isinstance(func, tvm.tirx.PrimFunc)
                and all(arg is None or isinstance(arg, (str, tvm.target.Target)) for arg in args)):
            return build(func, *args)
        key = (tvm_ffi.structural_hash(func), tuple(str(arg) for arg in args))
        for known, module in cache.get(key, ()):
            if tvm_ffi.structural_equal(known, func):
                return module
        module = build(func, *args)
        cache.setdefault(key, []).append((func, module))
        return module

    return build_once


@contextlib.contextmanager
def _legalize_only_foldable():
    with _install_lock:
        saved = []
        was_on = getattr(_active, "on", False)
        build = tvm_ffi.get_global_func("tirx.build", allow_missing=True)
        try:
            if build is not None:
                tvm.register_global_func("tirx.build", _memoized(build), override=True)
            for name in sorted(_READS_EVERY_TENSOR_ARG):
                try:
                    op = tvm.ir.Op.get(name)
                except Exception:  # noqa: BLE001 - operator absent from this TVM build
                    continue
                legalize = op.get_attr("FLegalize")
                if legalize is None:
                    continue
                op.reset_attr("FLegalize")
                saved.append((op, legalize))
                op.set_attr("FLegalize", _skipping(legalize))
            _active.on = True
            yield
        finally:
            _active.on = was_on
            if build is not None:
                tvm.register_global_func("tirx.build", build, override=True)
            for op, legalize in saved:
                op.reset_attr("FLegalize")
                op.set_attr("FLegalize", legalize)


# Operators evaluated exactly with numpy on constant operands before ``FoldConstant`` (which would
# build each, e.g. an attention mask's arange/compare/broadcast/where chain, with LLVM: ~20 ms a
# kernel): integer arithmetic, comparisons, selection and data movement only, whose results do
# not depend on how they are computed.
_INT_KINDS = "iu"
_NUMPY_FOLD = {
    "relax.add": lambda a, b, attrs: np.add(a, b) if a.dtype.kind in _INT_KINDS else None,
    "relax.subtract": lambda a, b, attrs: np.subtract(a, b) if a.dtype.kind in _INT_KINDS else None,
    "relax.multiply": lambda a, b, attrs: np.multiply(a, b) if a.dtype.kind in _INT_KINDS else None,
    "relax.greater_equal": lambda a, b, attrs: np.greater_equal(a, b),
    "relax.greater": lambda a, b, attrs: np.greater(a, b),
    "relax.less_equal": lambda a, b, attrs: np.less_equal(a, b),
    "relax.less": lambda a, b, attrs: np.less(a, b),
    "relax.equal": lambda a, b, attrs: np.equal(a, b),
    "relax.not_equal": lambda a, b, attrs: np.not_equal(a, b),
    "relax.where": lambda c, a, b, attrs: np.where(c, a, b) if c.dtype == np.bool_ and a.dtype == b.dtype else None,
    "relax.expand_dims": lambda a, attrs: np.expand_dims(a, tuple(int(x) for x in attrs.axis)),
    "relax.broadcast_to": lambda a, shape, attrs: np.broadcast_to(a, shape),
    "relax.reshape": lambda a, shape, attrs: np.reshape(a, shape),
    "relax.astype": lambda a, attrs: _astype(a, str(attrs.dtype)),
    "relax.take": lambda a, i, attrs: _take(a, i, attrs),
    "relax.strided_slice": lambda a, axes, begin, end, strides, attrs: _slice(a, axes, begin, end, strides),
    "relax.gather_elements": lambda a, i, attrs: _gather(a, i, int(attrs.axis)),
}
#: Calls that start a foldable chain (operands constant before any folding).
_STARTS = frozenset(("relax.arange", "relax.take", "relax.strided_slice"))


def _astype(a: np.ndarray, dtype: str):
    target = np.dtype(dtype)
    if a.dtype == target or (a.dtype.kind in _INT_KINDS and target.kind in _INT_KINDS):
        return a.astype(target)  # integers wrap like a C cast
    return None


def _take(a: np.ndarray, indices: np.ndarray, attrs):
    if indices.dtype.kind not in _INT_KINDS or indices.size == 0:
        return None
    axis = int(attrs.axis)
    if not -a.ndim <= axis < a.ndim or indices.min() < 0 or indices.max() >= a.shape[axis]:
        return None
    return np.take(a, indices, axis=axis)


def _gather(a: np.ndarray, indices: np.ndarray, axis: int):
    if (indices.dtype.kind not in _INT_KINDS or indices.size == 0 or indices.ndim != a.ndim
            or indices.min() < 0 or indices.max() >= a.shape[axis]):
        return None
    return np.take_along_axis(a, indices, axis=axis)


def _slice(a: np.ndarray, axes, begin, end, strides):
    if not (len(axes) == len(begin) == len(end) == len(strides)):
        return None
    index = [slice(None)] * a.ndim
    for axis, b, e, s in zip(axes, begin, end, strides):
        if not (0 <= axis < a.ndim and s >= 1 and 0 <= b <= e <= a.shape[axis]):
            return None
        index[axis] = slice(b, e, s)
    return a[tuple(index)]


def _fold_small(func: relax.Function, arange: bool) -> relax.Function:
    """Replace the calls of :data:`_NUMPY_FOLD` (and integer ``arange``) whose operands are all
    known constants by their values, in host functions (the same constants ``FoldConstant``
    computes, without building a kernel for each)."""
    if func.attrs is not None and "Codegen" in func.attrs:
        return func
    value_of = relax.analysis.get_var2val(func)
    if not any(isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name in _STARTS
               and (arange or v.op.name != "relax.arange") for v in value_of.values()):
        return func  # no chain of constants this folding starts
    folder = _NumpyFold(value_of, arange)
    new = folder.visit_expr(func)
    return new if folder.folded else func


@relax.expr_functor.mutator
class _NumpyFold(relax.PyExprMutator):
    def __init__(self, value_of: dict, arange: bool):
        super().__init__()
        self.value_of = value_of
        self.arange = arange
        self.memo: dict = {}
        self.folded = 0

    def _value(self, expr, depth: int = 0):
        """The numpy value of ``expr`` when it is a known constant (else None)."""
        if isinstance(expr, Constant):
            try:
                return np.from_dlpack(expr.value)  # no copy (weights)
            except (TypeError, ValueError, BufferError, RuntimeError):
                return expr.value.numpy()
        if isinstance(expr, relax.Tuple):
            if all(isinstance(v, tvm.tirx.IntImm) for v in expr.fields):
                return tuple(int(v.value) for v in expr.fields)
            return None
        if isinstance(expr, relax.ShapeExpr):
            if all(isinstance(v, tvm.tirx.IntImm) for v in expr.values):
                return tuple(int(v) for v in expr.values)
            return None
        if isinstance(expr, relax.Var):
            if expr in self.memo:
                return self.memo[expr]
            value = self.value_of.get(expr)
            result = None
            if isinstance(value, (relax.Call, Constant)) and depth < 64:
                result = self._value(value, depth + 1)
            self.memo[expr] = result
            return result
        if isinstance(expr, relax.Call):
            return self._evaluate(expr, depth)
        return None

    def _evaluate(self, call, depth: int = 0):
        if not isinstance(call.op, tvm.ir.Op):
            return None
        name = call.op.name
        ty = call.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None or not isinstance(ty.shape, relax.ShapeExpr):
            return None
        if not all(isinstance(v, tvm.tirx.IntImm) for v in ty.shape.values):
            return None
        shape, dtype = tuple(int(v) for v in ty.shape.values), str(ty.dtype)
        if name == "relax.arange":
            if not self.arange or np.dtype(dtype).kind not in _INT_KINDS:
                return None
            bounds = []
            for arg in call.args:
                if not isinstance(arg, tvm.tirx.IntImm):
                    return None
                bounds.append(int(arg.value))
            result = np.arange(*bounds, dtype=dtype)
        else:
            fn = _NUMPY_FOLD.get(name)
            if fn is None:
                return None
            args = [self._value(arg, depth + 1) for arg in call.args]
            if any(a is None for a in args):
                return None
            try:
                result = fn(*args, call.attrs)
            except Exception:  # noqa: BLE001 - anything unexpected: FoldConstant folds it
                return None
            if result is None:
                return None
        result = np.ascontiguousarray(result)
        if result.shape != shape or str(result.dtype) != dtype:
            return None
        return result

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: D102
        value = self._evaluate(call)
        if value is None:
            return super().visit_call_(call)
        self.folded += 1
        return relax.const(value, str(value.dtype))


@relax.transform.function_pass(opt_level=0, name="SpinnFoldSmallConstants")
def FoldSmallConstants(func: relax.Function, _mod, _ctx) -> relax.Function:  # noqa: N802
    """The host's folding (fallback): integer ``arange`` chains included."""
    return _fold_small(func, arange=True)


@relax.transform.function_pass(opt_level=0, name="SpinnFoldSmallConstantsNoArange")
def _FoldSmallConstantsPartition(func: relax.Function, _mod, _ctx) -> relax.Function:  # noqa: N802
    # ``arange`` (PrimValue operands) is not folded by TVM's FoldConstant before partitioning:
    # folding it here would change what is offloaded.
    return _fold_small(func, arange=False)


@tvm.transform.module_pass(opt_level=0, name="SpinnFoldConstant")
def FoldConstant(mod: tvm.IRModule, ctx) -> tvm.IRModule:  # noqa: N802 - TVM pass naming
    """``relax.transform.FoldConstant`` that legalizes only the calls it could fold."""
    mod = _FoldSmallConstantsPartition(mod)
    with _legalize_only_foldable():
        return transform.FoldConstant()(mod)
