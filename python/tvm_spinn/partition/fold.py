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

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax import transform

__all__ = ["FoldConstant"]

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


@tvm.transform.module_pass(opt_level=0, name="SpinnFoldConstant")
def FoldConstant(mod: tvm.IRModule, ctx) -> tvm.IRModule:  # noqa: N802 - TVM pass naming
    """``relax.transform.FoldConstant`` that legalizes only the calls it could fold."""
    with _legalize_only_foldable():
        return transform.FoldConstant()(mod)
