"""``FoldConstant`` without legalizing the calls it cannot fold.

TVM's ``FoldConstant`` legalizes *every* operator call of a dataflow block (a TE compute and a
PrimFunc per call, about a millisecond each in Python) and only then finds out that most of them
read a run-time tensor and cannot be folded: for BERT-base that is ~750 legalizations per run,
most of the time partitioning took. :func:`FoldConstant` is the same pass with the legalization
of such calls skipped: for the operators in :data:`_READS_EVERY_TENSOR_ARG`, whose legalization
passes every tensor argument to the PrimFunc, a call with a run-time argument (a parameter of
the function or the result of another such call) legalizes to a ``call_tir`` that reads that
value, which ``FoldConstant`` leaves unfolded; a skipped call is left unfolded too. Every other
call (constant arguments, creation ops such as ``full_like`` that read only a shape, unlisted
ops) is legalized as before, so the folded module is the same.

The calls ``FoldConstant`` would fold by building a kernel are folded first by
:class:`_FoldKernels`, the same way (same legalization, same build, same bits), building each
structurally distinct kernel once per pass run instead of once per call (BERT-base: 84 LLVM
builds of 4 kernels).

Neither step changes global state: the calls that cannot fold are held out of TVM's pass
(replaced by opaque stand-ins, which it does not legalize) and put back after it, so operator
attributes and global functions are the ones TVM registered (``tirx.build`` is called, never
replaced), the kernel memo belongs to one run, and no lock is needed.
"""

from __future__ import annotations

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

#: Name prefix of the packed functions that stand in for held calls (never called: restored)
_HOLD = "__tvm_spinn_fold_hold_"


def _runtime(expr: relax.Expr, runtime_vars: set) -> bool:
    """``expr`` is (or, for a tuple, holds) a value known only at run time: a variable of
    :data:`runtime_vars`."""
    if isinstance(expr, relax.Var):
        return expr in runtime_vars
    if isinstance(expr, relax.Tuple):
        return any(_runtime(field, runtime_vars) for field in expr.fields)
    return False


@relax.expr_functor.mutator
class _Hold(relax.PyExprMutator):
    """Replaces the calls of :data:`_READS_EVERY_TENSOR_ARG` that read a run-time value by
    ``call_pure_packed`` calls of a named stand-in (an opaque call ``FoldConstant`` leaves as it
    is, without legalizing it), remembering each original call by the stand-in's name.

    A value is run-time when it is a parameter of the function, the result of a held call, an
    element of such a tuple or another name for one of those: whatever ``FoldConstant`` does to
    the rest of the function, such a value never becomes a constant."""

    def __init__(self, mod: tvm.IRModule, held: dict):
        super().__init__(mod)
        self.held = held
        self.runtime_vars: set = set()

    def visit_function_(self, func: relax.Function) -> relax.Expr:  # noqa: D102
        self.runtime_vars.update(func.params)
        return super().visit_function_(func)

    def visit_var_binding_(self, binding) -> None:  # noqa: D102
        value = binding.value
        runtime = False
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
            runtime = (value.op.name in _READS_EVERY_TENSOR_ARG
                       and any(_runtime(arg, self.runtime_vars) for arg in value.args))
        elif isinstance(value, relax.TupleGetItem):
            runtime = _runtime(value.tuple_value, self.runtime_vars)
        elif isinstance(value, relax.Var):
            runtime = value in self.runtime_vars
        if not runtime:
            super().visit_var_binding_(binding)
            return
        self.runtime_vars.add(binding.var)
        if not isinstance(value, relax.Call):
            super().visit_var_binding_(binding)
            return
        name = f"{_HOLD}{len(self.held)}"
        self.held[name] = value
        args = [self.visit_expr(arg) for arg in value.args]
        stand_in = relax.call_pure_packed(name, *args, ty_args=value.ty)
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(stand_in)))


@relax.expr_functor.mutator
class _Restore(relax.PyExprMutator):
    """Puts the held calls back, on the arguments ``FoldConstant`` left them."""

    def __init__(self, mod: tvm.IRModule, held: dict):
        super().__init__(mod)
        self.held = held

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: D102
        call = super().visit_call_(call)
        if (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_pure_packed"
                and isinstance(call.args[0], relax.ExternFunc)
                and str(call.args[0].global_symbol) in self.held):
            original = self.held[str(call.args[0].global_symbol)]
            return relax.Call(original.op, list(call.args[1:]), original.attrs, original.ty_args)
        return call


@relax.expr_functor.mutator
class _FoldKernels(relax.PyExprMutator):
    """Folds, in dataflow blocks, the operator calls whose legalization reads only constants (a
    ``call_tir`` of a static-shape tensor on :class:`~tvm.relax.Constant` arguments: calls
    ``FoldConstant`` folds), building each structurally distinct kernel once.

    ``FoldConstant`` legalizes each call and builds the PrimFunc it gets, one LLVM build per
    call: BERT-base's 72 weight transposes and 12 ``full`` masks are 84 builds of 4 distinct
    kernels. This pass evaluates each such call as ``FoldConstant`` does (the same legalization,
    the PrimFunc built by ``tirx.build`` for ``llvm`` as ``tir_function``, run on the constants'
    data into a new tensor), with the builds memoized by the kernel's structure in
    :attr:`kernels`, which belongs to this pass run. Calls whose legalization reads anything
    else are left to ``FoldConstant``."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        #: structural hash -> [(PrimFunc, its built function)] of the kernels built so far
        self.kernels: dict = {}
        self.builds = 0

    def _constant(self, arg):
        if isinstance(arg, relax.Var):
            bound = self.lookup_binding(arg)
            if isinstance(bound, Constant):
                return bound
        return arg

    def visit_var_binding_(self, binding) -> None:  # noqa: D102
        value = self._fold(binding.value) if self.builder_.current_block_is_dataflow() else None
        if value is None:
            super().visit_var_binding_(binding)
            return
        self.builder_.emit_normalized(relax.VarBinding(binding.var, value))

    def _fold(self, value) -> "Constant | None":
        """The folded value of a binding's ``value``, or None when this pass leaves it."""
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                and value.op.name not in _NOT_LEGALIZED):
            return None
        legalize = value.op.get_attr("FLegalize")
        ty = value.ty
        if (legalize is None or not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr)
                or not all(isinstance(v, tvm.tirx.IntImm) for v in ty.shape.values)
                or not any(isinstance(self._constant(a), Constant) for a in value.args)
                and value.op.name not in _CREATION):
            return None
        call = relax.Call(value.op, [self._constant(self.visit_expr(a)) for a in value.args], value.attrs,
                          value.ty_args)
        # The legalization's PrimFunc goes to a scratch builder, not into the module. No function
        # scope is entered (BlockBuilder's scope stack is shared by all threads): a legalization
        # that emits bindings fails here and is left to FoldConstant.
        scratch = relax.BlockBuilder()
        try:
            lowered = scratch.normalize(legalize(scratch, scratch.normalize(call)))
        except Exception:  # noqa: BLE001 - left to FoldConstant, which then handles it
            lowered = None
        if not (isinstance(lowered, relax.Call) and isinstance(lowered.op, tvm.ir.Op)
                and lowered.op.name == "relax.call_tir" and len(lowered.args) == 2
                and isinstance(lowered.args[1], relax.Tuple)
                and all(isinstance(a, Constant) for a in lowered.args[1].fields)):
            return None
        kernel = scratch.get()[lowered.args[0]]
        if not isinstance(kernel, tvm.tirx.PrimFunc):
            return None
        out = tvm.runtime.empty(tuple(int(v) for v in ty.shape.values), str(ty.dtype), tvm.cpu())
        self._built(kernel)(*[a.value for a in lowered.args[1].fields], out)
        return relax.const(out)

    def _built(self, kernel):
        """``kernel`` built as ``FoldConstant`` builds it, once per structurally equal kernel."""
        same = self.kernels.setdefault(tvm_ffi.structural_hash(kernel), [])
        for known, function in same:
            if tvm_ffi.structural_equal(known, kernel):
                return function
        module = tvm_ffi.get_global_func("tirx.build")(kernel.with_attr("global_symbol", "tir_function"),
                                                      tvm.target.Target("llvm"))
        self.builds += 1
        function = module["tir_function"]
        same.append((kernel, function))
        return function


#: Operators left to ``FoldConstant`` as they are (no legalization of their own)
_NOT_LEGALIZED = frozenset(("relax.call_tir", "relax.call_pure_packed", "relax.call_packed",
                            "relax.call_dps_packed", "relax.call_tir_with_grad", "relax.call_tir_inplace"))
#: Creation operators: their legalization may read no tensor (``full_like`` reads a shape)
_CREATION = frozenset(("relax.full", "relax.full_like", "relax.zeros", "relax.zeros_like", "relax.ones",
                       "relax.ones_like", "relax.eye", "relax.eye_like"))


def _map_functions(mod: tvm.IRModule, mutator) -> tvm.IRModule:
    """``mod`` with every Relax function rewritten by ``mutator`` (the unchanged ones kept)."""
    changed = False
    for gvar, func in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint):
        if isinstance(func, relax.Function):
            new = mutator.visit_expr(func)
            if not new.same_as(func):
                mutator.builder_.update_func(gvar, new)
                changed = True
    return mutator.builder_.finalize() if changed else mod


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
    """``relax.transform.FoldConstant`` that legalizes only the calls it could fold.

    The calls that read a run-time value are held out of TVM's pass (:class:`_Hold`) and put
    back after it (:class:`_Restore`); the calls that fold by a kernel are folded with each
    distinct kernel built once (:class:`_FoldKernels`); the rest is TVM's ``FoldConstant`` as
    it is."""
    mod = _FoldSmallConstantsPartition(mod)
    held: dict = {}
    mod = _map_functions(mod, _Hold(mod, held))
    mod = _map_functions(mod, _FoldKernels(mod))
    mod = transform.FoldConstant()(mod)
    return _map_functions(mod, _Restore(mod, held)) if held else mod
