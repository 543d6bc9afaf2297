"""Which kernel each layer runs: a layer's *role* (the kernel spec of :mod:`.kernels`, shared by
every PE of the layer and by every layer with the same spec), or a :class:`~.errors.PeCodegenError`
naming the layer and the reason it cannot be lowered."""

from __future__ import annotations

from . import view
from .errors import PeCodegenError
from ..program.ops.gemm.geometry import int8_gemv
from ..program.ops.movement import SCATTER_KINDS, STRIDED_KINDS
from .kernels import ACTIVATIONS, BINARY_OPS

__all__ = ["MOVE_KINDS", "ROW_KINDS", "GEMM_F32_KINDS", "layer_role", "role_name"]

#: data-movement kinds (any dtype), all run by the DMA engine (kernel ``dma``): strided descriptors
#: for a strided view of the input (``STRIDED_KINDS``), scatter descriptors of each input into a
#: strided view of the output (``SCATTER_KINDS``: ``concat``, ``pad`` after a fill)
MOVE_KINDS = STRIDED_KINDS + SCATTER_KINDS
#: fp32 row kinds with generated code (rows whole on a PE, or chunks chained over PEs)
ROW_KINDS = ("softmax", "layer_norm", "rms_norm")
#: fp32 GEMM kinds with generated code (the M4F's multiply-accumulate loop)
GEMM_F32_KINDS = ("dense", "matmul", "conv2d")


def _fail(program, index: int, reason: str):
    raise PeCodegenError(view.layer_name(program, index), view.layer_kind(program, index), reason)


def _float_operands(program, index: int) -> bool:
    tids = [*view.layer_inputs(program, index), view.layer_output(program, index)]
    return all(view.tensor_dtype(program, t) == "float32" for t in tids)


def layer_role(program, index: int) -> tuple:
    """The kernel spec layer ``index`` runs (see :mod:`.kernels`).

    Raises
    ------
    PeCodegenError
        For a kind, mode, dtype or attribute the generator does not lower.
    """
    kind, mode, attrs = view.layer_kind(program, index), view.layer_mode(program, index), view.layer_attrs(program, index)
    relu = bool(attrs.get("relu"))
    if kind in MOVE_KINDS:
        return ("dma",)
    if kind == "take":
        if view.tensor_dtype(program, view.layer_inputs(program, index)[-1]) != "int32":
            _fail(program, index, "take with indices that are not int32")
        return ("take",)
    if kind in ("max_pool2d", "avg_pool2d") and mode == "fp32" and _float_operands(program, index):
        return ("pool", kind[:3])
    if kind == "max_pool2d_backward" and mode == "fp32" and _float_operands(program, index):
        return ("pool_grad",)
    if kind == "cross_entropy_backward" and mode == "fp32":
        if view.tensor_dtype(program, view.layer_inputs(program, index)[1]) != "int32":
            _fail(program, index, "cross_entropy_backward with labels that are not int32")
        return ("xent_grad",)
    if kind == "mean" and attrs.get("rounding") == "tflite":
        dtype = view.tensor_dtype(program, view.layer_inputs(program, index)[0])
        if dtype not in ("int8", "uint8") or view.tensor_dtype(program, view.layer_output(program, index)) != dtype:
            _fail(program, index, f"TFLite integer mean of {dtype} (generated: int8 and uint8 in and out)")
        return ("mean_tflite", dtype)
    if kind == "softmax" and attrs.get("rounding") == "tflite":
        dtype = view.tensor_dtype(program, view.layer_inputs(program, index)[0])
        if dtype not in ("int8", "uint8") or view.tensor_dtype(program, view.layer_output(program, index)) != dtype:
            _fail(program, index, f"TFLite integer softmax of {dtype} (generated: int8 and uint8 in and out)")
        return ("softmax_tflite", dtype)
    if kind == "mean" and mode == "fp32" and _float_operands(program, index):
        return ("mean",)
    if kind in ROW_KINDS and mode == "fp32" and _float_operands(program, index):
        return (kind,)
    if kind == "quantize":
        return ("quantize", view.tensor_dtype(program, view.layer_output(program, index)))
    if kind == "dequantize":
        return ("dequantize", view.tensor_dtype(program, view.layer_inputs(program, index)[0]))
    if kind == "cross_entropy" and mode == "fp32":
        z, t = view.layer_inputs(program, index)
        if (view.tensor_dtype(program, z), view.tensor_dtype(program, t),
                view.tensor_dtype(program, view.layer_output(program, index))) != ("float32", "int32", "float32"):
            _fail(program, index, "cross_entropy with logits and loss that are not float32 or labels not int32")
        return ("cross_entropy",)
    if mode == "fp32":
        if not _float_operands(program, index):
            _fail(program, index, "fp32 layer with operands that are not float32")
        if kind in BINARY_OPS:
            return ("binary", kind, relu)
        if kind == "relu":
            return ("relu",)
        if kind == "clip":
            return ("clip",)
        if kind == "where_less":
            return ("where_less",)
        if kind == "rope":
            return ("rope",)
        if kind == "power" and attrs.get("exponent") in (2, 3):
            return ("unary", "square" if attrs["exponent"] == 2 else "cube")
        if kind in ACTIVATIONS:
            return ("unary", kind)
        if kind in GEMM_F32_KINDS:
            return ("gemm_f32", relu)
        _fail(program, index, "no PE kernel for this fp32 kind yet (generated: add, subtract, multiply, "
                              "divide, relu, clip, where_less, rope, gelu, gelu_tanh, sigmoid, tanh, negative, sqrt, "
                              "rsqrt, power 2 and 3, dense, matmul, conv2d, softmax, layer_norm, "
                              "rms_norm, cross_entropy, max_pool2d_backward, cross_entropy_backward, data movement)")
    if mode == "int8":
        if kind not in GEMM_F32_KINDS:
            _fail(program, index, "no PE kernel for this int8 kind yet (generated: dense, matmul, conv2d, "
                                  "data movement)")
        out, rounding = attrs.get("out"), attrs.get("rounding", "half_up")
        if out == "float32":  # the dequantizing epilogue
            return ("gemm_i8", "f32", relu)
        if out not in ("int8", "uint8", "int32"):
            _fail(program, index, f"int8 {kind} with a {out} output (generated: dequantized float32, "
                                  f"requantized int8/uint8, raw int32 sums)")
        if out != "int32" and rounding == "tflite":
            return ("gemm_i8", "tflite_gemv") if int8_gemv(program, program.layers[index]) else ("gemm_i8", "tflite")
        if rounding != "half_up":
            _fail(program, index, f"requantization rounding {rounding!r} (generated: half_up, tflite)")
        if out != "int32" and int8_gemv(program, program.layers[index]):  # one row a tile
            return ("gemm_i8", "gemv")
        return ("gemm_i8",)
    _fail(program, index, f"mode {mode!r}")


def role_name(spec: tuple) -> str:
    """A file-name-safe name of a role: ``gemm_f32_relu``, ``binary_add``..."""
    kind, *params = spec
    parts = [kind]
    for p in params:
        if p is True:
            parts.append("relu")
        elif isinstance(p, str):
            parts.append(p)
    return "_".join(parts)
