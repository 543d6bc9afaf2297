"""``partition_for_spinn``: split a Relax module into spinn regions and fallback code."""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax
from tvm.relax import transform
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from ..program.quant import QUANT_ROUNDING_ATTR
from ..target.registry import arch_of, get_target
from .patterns import FallbackReason, patterns_for, spinn_patterns
from .fold import FoldConstant
from .pad import FoldPadIntoConv
from .split import SplitToSlices
from .tuples import InlineTupleOperands
from .qweights import UniqueDequantize, hide_quantized_weights, restore_quantized_weights
from .nhwc import has_nhwc_qconv, nhwc_to_nchw
from ..relax_rewrites.folds import FoldBatchNorm, FoldLayoutConstants, FoldQuantizedClip, TagRequantRounding

__all__ = ["partition_for_spinn", "PartitionSummary", "summarize_partition"]


def partition_for_spinn(
    mod: tvm.IRModule, target: "str | tvm.target.Target" = "spinn"
) -> tvm.IRModule:
    """Partition ``mod`` into functions offloaded to spinn (``Codegen="spinn"``) and the rest.

    Constants are folded first so that weights appear as constants the patterns can bind, and
    inference batch norms are folded into their convolutions (see :mod:`.rewrites`). Quantized
    (QDQ) convolutions and matmuls, ``gemm(dequantize(xq), dequantize(Wq))`` with optional bias,
    ReLU and output ``quantize``, become int8 composites (``spinn.qconv2d*``, ``spinn.qdense*``,
    ``spinn.qmatmul*``) for the MAC arrays; their int8 weights are kept out of constant folding.
    Adjacent offloaded ops are merged into one region: one spinn program per region.

    Parameters
    ----------
    mod : tvm.IRModule
        A Relax module with static shapes (e.g. from :mod:`tvm_spinn.frontend`).
    target : str or tvm.target.Target
        A spinn target; its architecture decides what fits on a PE.

    Returns
    -------
    tvm.IRModule
        The partitioned module, with ``spinn_fallback_reasons`` in its attributes (op and shape
        to reason, for every matched op the hardware cannot hold).
    """
    arch = arch_of(get_target(target))
    loops = recursive_functions(mod)
    if loops:
        # Loops imported as recursive functions (TFLite/Keras WHILE, e.g. LSTM) make
        # MergeCompositeFunctions fail and TVM's call-graph walks (RunCodegen) overflow the
        # stack: the module is left whole to the fallback target.
        return mod.with_attr("spinn_fallback_reasons", {
            "<module>": f"recursive Relax functions (loops) {loops}: nothing is offloaded"})
    reasons = FallbackReason()
    fold = tvm.transform.Sequential(
        [
            _DecomposeTrainingBatchNorm,  # before anything that assumes running statistics
            FoldQuantizedClip,  # fused activations of quantized (TFLite) graphs as QDQ ReLUs
            _ConvertConvLayout,
            FoldPadIntoConv,  # TF-style "same" padding: one region instead of one per conv
            SplitToSlices,  # a split's tuple cannot be a layer; its parts as slices can
            InlineTupleOperands,  # concat(t) with t bound apart: the region's operands, tensors
            FoldLayoutConstants,
            FoldConstant,  # TVM's FoldConstant, legalizing only what can fold (see .fold)
            FoldBatchNorm,
            transform.DecomposeOpsForInference(),  # batch norms that did not fold into a conv
            FoldConstant,
        ]
    )
    offload = tvm.transform.Sequential(
        [
            UniqueDequantize,
            _fuse_spinn_patterns(spinn_patterns(arch, reasons)),
            TagRequantRounding,
            transform.MergeCompositeFunctions(),
            transform.DeadCodeElimination(),
        ]
    )
    # Quantized (QDQ) weights must reach the int8 patterns as int8 constants: hide them from
    # constant folding (see .qweights).
    mod, hidden = hide_quantized_weights(mod)
    mod = fold(mod)
    mod = restore_quantized_weights(mod, hidden)
    mod = offload(mod)
    return mod.with_attr("spinn_fallback_reasons", dict(sorted(reasons.reasons.items())))


def _called_ops(mod: tvm.IRModule) -> set[str]:
    """Names of the operators called anywhere in the Relax functions of ``mod``."""
    ops: set[str] = set()

    def visit(expr) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            ops.add(str(expr.op.name))

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return ops


def _fuse_spinn_patterns(patterns: list[tuple]) -> tvm.transform.Pass:
    """``FuseOpsByPattern`` with only the patterns whose operators the module calls.

    Same result as with the whole table (see :func:`.patterns.patterns_for`), without trying
    ~50 patterns on every binding (a transformer calls the operators of a fifth of them)."""

    @tvm.transform.module_pass(opt_level=0, name="SpinnFuseOpsByPattern")
    def fuse(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        used = patterns_for(patterns, _called_ops(mod))
        # Patterns named ``*_tflite`` (TFLite's integer softmax/mean) implement TFLite's
        # arithmetic: only a TFLite model's QDQ ops mean that; ONNX/PTQ graphs keep the float op.
        if not (mod.attrs and str(mod.attrs.get(QUANT_ROUNDING_ATTR, "")) == "tflite"):
            used = [entry for entry in used if not entry[0].endswith("_tflite")]
        return transform.FuseOpsByPattern(used, bind_constants=True, annotate_codegen=False)(mod)

    return fuse


def recursive_functions(mod: tvm.IRModule) -> list[str]:
    """Names of the Relax functions of ``mod`` that can call themselves (directly or not).

    Parameters
    ----------
    mod : tvm.IRModule
        Any Relax module.

    Returns
    -------
    list of str
        Sorted names of the functions on a cycle of references (empty for most models).
    """
    return sorted({g.name_hint for group in relax.analysis.detect_recursion(mod) for g in group})


def _training_batch_norm(call: relax.Call) -> relax.Expr:
    """``batch_norm(..., training=True)`` as plain ops, with the arithmetic of TVM's legalization.

    Normalizes with the batch's statistics (biased variance) and returns the updated running
    statistics ``(1 - momentum) * running + momentum * batch`` as outputs 1 and 2."""
    x, gamma, beta, moving_mean, moving_var = call.args
    attrs = call.attrs
    rank = int(x.ty.ndim)
    axis = int(attrs.axis) % rank
    dtype = str(x.ty.dtype)
    reduce_axes = [i for i in range(rank) if i != axis]
    channel_shape = [1] * rank
    channel_shape[axis] = -1

    def const(value: float) -> relax.Constant:
        return relax.const(value, dtype)

    # Each statistic is reduced once, per channel; normalizing broadcasts it back over the
    # reduced axes (expand_dims needs no type, which the rewriter's new expressions lack).
    batch_mean = relax.op.mean(x, axis=reduce_axes)
    centered = relax.op.subtract(x, relax.op.expand_dims(batch_mean, reduce_axes))
    batch_var = relax.op.mean(relax.op.multiply(centered, centered), axis=reduce_axes)
    var = relax.op.expand_dims(batch_var, reduce_axes)
    out = relax.op.divide(centered, relax.op.sqrt(relax.op.add(var, const(float(attrs.epsilon)))))
    if bool(attrs.scale):
        out = relax.op.multiply(out, relax.op.reshape(gamma, channel_shape))
    if bool(attrs.center):
        out = relax.op.add(out, relax.op.reshape(beta, channel_shape))
    momentum = float(attrs.momentum)

    def update(running: relax.Expr, batch: relax.Expr) -> relax.Expr:
        return relax.op.add(relax.op.multiply(const(1.0 - momentum), running),
                            relax.op.multiply(const(momentum), batch))

    return relax.Tuple([out, update(moving_mean, batch_mean), update(moving_var, batch_var)])


@relax.transform.function_pass(opt_level=0, name="SpinnDecomposeTrainingBatchNorm")
def _DecomposeTrainingBatchNorm(func: relax.Function, _mod, _ctx) -> relax.Function:  # noqa: N802
    """Spell out training-mode batch norms (``model.train()``) as batch-statistics arithmetic.

    ``DecomposeOpsForInference`` and the conv fold use the running statistics whatever the
    op's ``training`` attribute says; decomposed first, training batch norms reach neither."""
    pattern = is_op("relax.nn.batch_norm")(wildcard(), wildcard(), wildcard(), wildcard(), wildcard())

    def rewriter(expr: relax.Call, _matches) -> relax.Expr:
        data = expr.args[0].ty
        if not bool(expr.attrs.training) or not isinstance(data, relax.TensorType) or data.ndim < 0:
            return expr  # inference, or unknown rank (no reduction axes to name)
        return _training_batch_norm(expr)

    return rewrite_call(pattern, rewriter, func)


@tvm.transform.module_pass(opt_level=0, name="SpinnConvertConvLayout")
def _ConvertConvLayout(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802
    """The MAC path is NCHW/OIHW: convert NHWC convs (TFLite, Keras) so they can be offloaded.

    Only when the module has such a conv: ConvertLayout rejects some unrelated graphs. Functions
    made of one dataflow block are converted by :func:`.nhwc.nhwc_to_nchw` first (transposes at
    the graph's edges only, int8 weights transposed before their ``dequantize``); ConvertLayout
    handles what is left."""
    qdq = [(gvar, func) for gvar, func in mod.functions_items()
           if isinstance(func, relax.Function) and not (func.attrs and "Codegen" in func.attrs)
           and has_nhwc_qconv(func, float_too=True)]
    if qdq:
        mod = mod.clone()
        for gvar, func in qdq:
            mod[gvar] = nhwc_to_nchw(func)
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.nn.conv2d":
            if expr.attrs.data_layout != "NCHW" or expr.attrs.kernel_layout != "OIHW":
                found.append(expr)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    if not found:
        return mod
    return transform.ConvertLayout({"relax.nn.conv2d": ["NCHW", "OIHW"]})(mod)


@dataclass
class PartitionSummary:
    """Which ops were offloaded and which stay on the fallback target."""

    offloaded_ops: dict[str, int] = field(default_factory=dict)
    fallback_ops: dict[str, int] = field(default_factory=dict)
    regions: int = 0
    fallback_reasons: dict[str, str] = field(default_factory=dict)


def summarize_partition(mod: tvm.IRModule) -> PartitionSummary:
    """Count composite (offloaded) and plain (fallback) op calls of a partitioned module."""
    summary = PartitionSummary()
    reasons = mod.attrs.get("spinn_fallback_reasons") if mod.attrs else None
    summary.fallback_reasons = {str(k): str(v) for k, v in (reasons or {}).items()}

    def visit_codegen(func: relax.Function) -> None:
        # Count call sites: identical composites may be one shared function object.
        composites: dict = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                value = binding.value
                if isinstance(value, relax.Function) and value.attrs and "Composite" in value.attrs:
                    composites[binding.var] = str(value.attrs["Composite"])
                elif isinstance(value, relax.Call) and value.op in composites:
                    name = composites[value.op]
                    summary.offloaded_ops[name] = summary.offloaded_ops.get(name, 0) + 1

    for gvar, func in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint):
        if not isinstance(func, relax.Function):
            continue
        if func.attrs and "Codegen" in func.attrs:
            summary.regions += 1
            visit_codegen(func)
            continue
        if func.attrs and ("Composite" in func.attrs or "Primitive" in func.attrs):
            continue

        def fvisit_main(expr):
            if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
                name = expr.op.name
                if name.startswith("relax.") and not name.startswith(("relax.call_", "relax.builtin")):
                    summary.fallback_ops[name] = summary.fallback_ops.get(name, 0) + 1
        relax.analysis.post_order_visit(func.body, fvisit_main)
    summary.offloaded_ops = dict(sorted(summary.offloaded_ops.items()))
    summary.fallback_ops = dict(sorted(summary.fallback_ops.items()))
    return summary
