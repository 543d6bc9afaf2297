"""Post-training quantization of a float32 Relax module: find the GEMMs, calibrate, insert QDQ.

Result structure (the one ONNX QDQ models import as), for every quantized GEMM::

    xq = quantize(x, sx, zx, axis=1, out_dtype="int8")        # once per activation tensor
    xd = dequantize(xq, sx, zx, axis=1, out_dtype="float32")  # one per consuming GEMM
    wd = dequantize(Wq, sw, zw, axis=0, out_dtype="float32")  # conv2d OIHW (axis=1: matmul [K, N])
    y  = conv2d(xd, wd, <same attributes>)                    # or matmul(xd, wd)

``Wq`` is an int8 constant, ``sw`` a float32 constant of shape ``[O]`` (per channel) or ``[]``
(per tensor), ``zw`` int8 zeros of the same shape; ``sx`` a float32 and ``zx`` an int8 (uint8)
scalar constant. The activation axis follows ONNX's QuantizeLinear default (1, or 0 for 1-D
tensors); with scalar parameters it does not change the result. A matmul of two activations
gets a quantize/dequantize pair on both operands. Everything else (bias adds, activations,
normalizations) stays float32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

import tvm
from tvm import relax

from ..relax_rewrites.folds import FoldBatchNorm, FoldLayoutConstants
from .calibrate import activation_qparams, collect_ranges, input_specs, normalize_samples
from .scheme import QuantizationError, QuantScheme, as_scheme

__all__ = ["quantize", "quantizable_layers", "prepare", "find_layers", "quantize_weight", "Layer"]

ATTR = "spinn_quantization"
_Constant = tvm.ir.expr.Constant
_CONV, _MATMUL = "relax.nn.conv2d", "relax.matmul"
_QDQ = ("relax.quantize", "relax.dequantize")


@dataclass(frozen=True)
class Layer:
    """One quantizable GEMM of ``main``.

    ``kind`` is ``"conv2d"`` (constant OIHW weight), ``"dense"`` (matmul with a constant
    [K, N] weight) or ``"activation_matmul"``; ``inputs`` are the activation operands, ``weight``
    the float32 constant (``None`` for activation matmuls) and ``weight_axis`` its output-channel
    axis. ``block``/``index`` locate the binding in ``main``'s body.
    """

    name: str
    op: str
    kind: str
    block: int
    index: int
    var: relax.Var
    call: relax.Call
    inputs: tuple
    weight: object = None
    weight_axis: int | None = None


def _main(mod) -> relax.Function:
    if not isinstance(mod, tvm.IRModule):
        raise QuantizationError(f"expected a tvm.IRModule, got {type(mod).__name__}")
    gv = mod.get_global_var("main") if any(g.name_hint == "main" for g in mod.get_global_vars()) else None
    if gv is None or not isinstance(mod[gv], relax.Function):
        raise QuantizationError("the module has no Relax function 'main' to quantize")
    return mod[gv]


def prepare(mod: tvm.IRModule) -> tvm.IRModule:
    """Canonicalize before calibration so the quantized weights are the folded ones.

    Folds layout ops of constants (``matmul(x, permute_dims(W))`` -> ``matmul(x, W.T)``), batch
    norms into the preceding conv2d (with or without a bias add in between), and merges common
    subexpressions (so e.g. the one ``reshape`` feeding q/k/v projections is quantized once).
    """
    _main(mod)
    mod = FoldLayoutConstants(mod)
    mod = FoldBatchNorm(mod)
    return relax.transform.EliminateCommonSubexpr()(mod)


def _f32(expr) -> bool:
    ty = getattr(expr, "ty", None)
    return (isinstance(ty, relax.TensorType) and str(ty.dtype) == "float32" and ty.shape is not None
            and hasattr(ty.shape, "values"))


def _act(expr) -> bool:
    return isinstance(expr, relax.Var) and _f32(expr)


def _f32_out(call) -> bool:
    return str(call.attrs.out_dtype) in ("float32", "", "None", "void")


def _classify(call):
    """(kind, weight, weight_axis, inputs) if ``call`` is a quantizable GEMM, else None."""
    name = call.op.name
    if name == _CONV and len(call.args) == 2:
        x, w = call.args
        a = call.attrs
        if (_act(x) and isinstance(w, _Constant) and _f32(w) and len(w.ty.shape.values) == 4
                and str(a.data_layout) == "NCHW" and str(a.kernel_layout) == "OIHW"
                and str(a.out_layout) in ("NCHW", "") and _f32_out(call)):
            return "conv2d", w, 0, (x,)
    elif name == _MATMUL and len(call.args) == 2 and _f32_out(call):
        a, b = call.args
        if _act(a) and isinstance(b, _Constant) and _f32(b) and len(b.ty.shape.values) == 2:
            return "dense", b, 1, (a,)
        if _act(a) and _act(b):
            return "activation_matmul", None, None, (a, b)
    return None


def find_layers(func: relax.Function) -> list[Layer]:
    """The quantizable GEMMs of ``func`` in program order, named ``<op>_<i>`` where ``i`` counts
    the quantizable calls of that op (``conv2d_0``, ``conv2d_1``, ``matmul_0``, ...)."""
    layers, counts = [], {}
    for bi, block in enumerate(func.body.blocks):
        for ji, binding in enumerate(block.bindings):
            call = getattr(binding, "value", None)
            if not isinstance(binding, relax.VarBinding) or not isinstance(call, relax.Call):
                continue
            if not isinstance(call.op, tvm.ir.Op) or call.op.name not in (_CONV, _MATMUL):
                continue
            found = _classify(call)
            if found is None:
                continue
            op = call.op.name.split(".")[-1]
            idx = counts.get(op, 0)
            counts[op] = idx + 1
            kind, weight, axis, inputs = found
            layers.append(Layer(f"{op}_{idx}", op, kind, bi, ji, binding.var, call, inputs, weight, axis))
    return layers


def quantizable_layers(mod: tvm.IRModule) -> list[str]:
    """Names of the GEMMs :func:`quantize` can quantize, in program order.

    ``conv2d_<i>`` for the i-th conv2d with a constant NCHW/OIHW float32 weight, ``matmul_<i>``
    for the i-th matmul with a constant 2-D weight or of two activations (after the folding of
    :func:`prepare`). These are the names ``keep_fp32`` and the ``spinn_quantization`` attribute
    use. For a module :func:`quantize` returned, the names recorded in that attribute.
    """
    _main(mod)
    if mod.attrs is not None and ATTR in mod.attrs:
        return [str(k) for k in mod.attrs[ATTR].keys()]
    return [layer.name for layer in find_layers(_main(prepare(mod)))]


def quantize_weight(w: np.ndarray, axis: int, per_channel: bool):
    """Symmetric int8 weight quantization.

    Per channel (along ``axis``): ``s_c = max|w_c| / 127`` in float64, stored as float32 (a zero
    channel gets ``s_c = 1.0``, hence all-zero codes); per tensor: one ``s = max|w| / 127``.
    Codes ``Wq = clip(round_half_even(w / s), -127, 127)`` use the stored float32 scale.

    Returns
    -------
    (Wq int8 array, scale float32 array of shape [C] or [], zero point int8 zeros of that shape)
    """
    w64 = np.asarray(w, dtype=np.float64)
    if per_channel:
        other = tuple(i for i in range(w64.ndim) if i != axis)
        amax = np.abs(w64).max(axis=other)
    else:
        amax = np.asarray(np.abs(w64).max())
    scale = (amax / 127.0).astype(np.float32)
    scale = np.where((scale > 0) & np.isfinite(scale), scale, np.float32(1.0)).astype(np.float32)
    shape = [1] * w64.ndim
    if per_channel:
        shape[axis] = -1
    codes = np.clip(np.round(w64 / scale.astype(np.float64).reshape(shape)), -127, 127).astype(np.int8)
    return codes, scale, np.zeros(scale.shape, dtype=np.int8)


def _axis(var) -> int:
    return 1 if len(var.ty.shape.values) >= 2 else 0


def _rewrite(func, layers, qparams, weights, act_dtype):
    """``func`` with QDQ inserted for ``layers`` (see module docstring)."""
    bb = relax.BlockBuilder()
    by_pos = {(layer.block, layer.index): layer for layer in layers}
    blocks = []
    for bi, block in enumerate(func.body.blocks):
        dataflow = isinstance(block, relax.DataflowBlock)
        new_var = relax.DataflowVar if dataflow else relax.Var
        quantized = {}
        bindings = []

        def bind(name, value):
            value = bb.normalize(value)
            var = new_var(name, value.ty)
            bindings.append(relax.VarBinding(var, value))
            return var

        for ji, binding in enumerate(block.bindings):
            layer = by_pos.get((bi, ji))
            if layer is None:
                bindings.append(binding)
                continue
            args = []
            for x in layer.inputs:
                sx, zx = qparams[x]
                if x not in quantized:
                    quantized[x] = bind(f"{x.name}_q", relax.op.quantize(x, sx, zx, _axis(x), act_dtype))
                dq = relax.op.dequantize(quantized[x], sx, zx, _axis(x), "float32")
                args.append(bind(f"{x.name}_dq_{layer.name}", dq))
            if layer.weight is not None:
                wq, sw, zw = weights[layer.name]
                args.append(bind(f"{layer.name}_w", relax.op.dequantize(wq, sw, zw, layer.weight_axis, "float32")))
            call = layer.call
            new_call = bb.normalize(relax.Call(call.op, args, call.attrs, call.ty_args))
            bindings.append(relax.VarBinding(binding.var, new_call))
        blocks.append(relax.DataflowBlock(bindings) if dataflow else relax.BindingBlock(bindings))
    body = relax.SeqExpr(blocks, func.body.body)
    return bb.normalize(relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span))


def _as_float(x) -> float:
    return float(np.float32(x))


def quantize(mod: tvm.IRModule, calibration_data, scheme: QuantScheme | str | None = None,
             keep_fp32=()) -> tvm.IRModule:
    """Post-training static quantization of a float32 Relax module for the int8 MAC path.

    Parameters
    ----------
    mod : tvm.IRModule
        Float32 module with static shapes and weights bound as constants (as produced by
        ``tvm_spinn.frontend.from_pytorch`` / ``from_onnx``). Only ``main`` is rewritten.
    calibration_data : iterable
        Representative samples: each a dict ``{input name: array}``, a list/tuple of arrays in
        parameter order, or (one-input models) a single array. Arrays must have the inputs'
        exact shapes and dtypes.
    scheme : QuantScheme, str or None
        Options (:class:`QuantScheme`); a string is parsed by :meth:`QuantScheme.parse`
        (``"int8"``, ``"uint8,per-tensor"``, ``"int8,percentile=99.9"``); ``None`` is the default
        (int8, per-channel weights, asymmetric min/max activations).
    keep_fp32 : sequence of str
        Extra layer names (see :func:`quantizable_layers`) to leave in float32, added to
        ``scheme.keep_fp32``.

    Returns
    -------
    tvm.IRModule
        The prepared module (:func:`prepare`) with quantize/dequantize pairs around every
        quantized GEMM (structure in the module docstring) and the module attribute
        ``spinn_quantization``: ``{layer name: {...}}`` with, for a quantized layer,
        ``op``, ``kind``, ``kept_fp32=False``, ``dtype_x``, ``scale_x``, ``zero_x``, ``range_x``
        (calibrated ``[lo, hi]``), then either, for a constant weight, ``weight``
        (``"per-channel"``/``"per-tensor"``), ``weight_dtype``, ``channels`` (number of weight
        scales: output channels, or 1) and ``scale_w_range`` (``[min, max]`` of the weight scales,
        which themselves are the ``dequantize`` constants), or, for an activation matmul,
        ``weight="activation"``, ``scale_y``, ``zero_y``, ``range_y`` of the second operand.
        A float32 layer has ``op``, ``kind``, ``kept_fp32=True`` and ``reason``.

    Scales: activations ``scale = (hi - lo) / 255`` with ``zero = round(-lo / scale) - 128``
    (asymmetric int8, range widened to include 0) or ``max|x| / 127`` with zero 0 (symmetric);
    weights symmetric ``s_c = max|w_c| / 127``, ``Wq = clip(round(w / s_c), -127, 127)``.
    See :func:`~tvm_spinn.quant.calibrate.activation_qparams` and :func:`quantize_weight`.

    Raises
    ------
    QuantizationError
        Bad scheme, no samples, a sample with a wrong input name/shape/dtype, an unknown
        ``keep_fp32`` name, an already quantized module, non-finite weights or activations.
    """
    scheme = as_scheme(scheme)
    if keep_fp32:
        extra = (keep_fp32,) if isinstance(keep_fp32, str) else tuple(keep_fp32)
        scheme = dataclasses.replace(scheme, keep_fp32=scheme.keep_fp32 + extra)
    func = _main(mod)
    for block in func.body.blocks:
        for binding in block.bindings:
            value = getattr(binding, "value", None)
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in _QDQ:
                raise QuantizationError(f"the module is already quantized (it contains {value.op.name})")
    samples = normalize_samples(calibration_data, input_specs(func))

    mod = prepare(mod)
    func = mod["main"]
    layers = find_layers(func)
    names = [layer.name for layer in layers]
    unknown = [k for k in scheme.keep_fp32 if k not in names]
    if unknown:
        raise QuantizationError(f"keep_fp32: unknown layer name(s) {unknown}; the quantizable layers are {names}")

    def reason(layer):
        if layer.name in scheme.keep_fp32:
            return "keep_fp32"
        if layer.kind == "activation_matmul" and not scheme.activation_matmuls:
            return "activation_matmuls=False"
        return None

    active = [layer for layer in layers if reason(layer) is None]
    targets, labels = {}, []
    for layer in active:
        for k, x in enumerate(layer.inputs):
            if x not in targets:
                targets[x] = len(targets)
                labels.append(f"{'first' if k == 0 else 'second'} input of {layer.name} ({x.name})")
    ranges = collect_ranges(mod, list(targets), labels, samples, scheme)
    qparams = {}
    for x, i in targets.items():
        scale, zero = activation_qparams(*ranges[i], scheme.activations, scheme.symmetric_activations)
        qparams[x] = (relax.const(scale, "float32"), relax.const(zero, scheme.activations), scale, zero, ranges[i])

    weights, info = {}, {}
    for layer in layers:
        entry = {"op": layer.op, "kind": layer.kind}
        why = reason(layer)
        if why is not None:
            entry.update(kept_fp32=True, reason=why)
            info[layer.name] = entry
            continue
        entry["kept_fp32"] = False
        x = layer.inputs[0]
        entry.update(dtype_x=scheme.activations, scale_x=_as_float(qparams[x][2]), zero_x=int(qparams[x][3]),
                     range_x=[float(v) for v in qparams[x][4]])
        if layer.weight is not None:
            w = layer.weight.value.numpy()
            if not np.all(np.isfinite(w)):
                raise QuantizationError(f"layer {layer.name}: the weight has non-finite values")
            wq, sw, zw = quantize_weight(w, layer.weight_axis, scheme.per_channel)
            weights[layer.name] = (relax.const(wq, "int8"), relax.const(sw, "float32"), relax.const(zw, "int8"))
            entry.update(weight="per-channel" if scheme.per_channel else "per-tensor", weight_dtype="int8",
                         channels=int(sw.size), scale_w_range=[_as_float(sw.min()), _as_float(sw.max())])
        else:
            y = layer.inputs[1]
            entry.update(weight="activation", scale_y=_as_float(qparams[y][2]), zero_y=int(qparams[y][3]),
                         range_y=[float(v) for v in qparams[y][4]])
        info[layer.name] = entry

    new_main = _rewrite(func, active, {x: q[:2] for x, q in qparams.items()}, weights, scheme.activations)
    funcs = {gv: (new_main if gv.name_hint == "main" else f) for gv, f in mod.functions.items()}
    out = tvm.IRModule(funcs, attrs=mod.attrs, global_infos=mod.global_infos)
    return out.with_attr(ATTR, info)
