"""Quantized TFLite models: which quantization scheme a flatbuffer uses, and Keras -> int8 TFLite.

* :func:`quant_scheme` reads the flatbuffer (``tflite`` package) before the Relax import and
  tells a float model (``None``) from a full-integer one (``"tflite"``: int8/uint8 activations,
  int8 per-channel or uint8 per-tensor weights, int32 biases), which TVM's importer turns into the
  QDQ form the ONNX and PTQ paths produce. The requantization of such a model follows TFLite's
  fixed-point rule (:func:`tvm_spinn.program.quant.requantize_tflite`). Schemes the int8 path
  cannot serve raise one :class:`TFLiteImportError` naming the tensor and its type:

  - 16-bit activations (``int16x8``), and weights of other integer widths (``INT4``, ``INT16``
    weights, ...);
  - dynamic-range ("hybrid") models: int8 weights read by an op whose activations are float.

  Float16-quantized models (``float16`` weights behind a ``DEQUANTIZE``) are not an error: the
  importer widens the weights to float32 and the model runs as a float32 model (documented
  fallback, exact with respect to the stored weights).
* :func:`keras_to_int8_tflite` runs ``tf.lite.TFLiteConverter`` with a representative dataset and
  ``TFLITE_BUILTINS_INT8`` (the full-integer recipe that Arm's Vela also consumes).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

__all__ = ["quant_scheme", "keras_to_int8_tflite", "QUANT_IO_TYPES"]

#: model input/output types :func:`keras_to_int8_tflite` accepts
QUANT_IO_TYPES = ("int8", "uint8", "float32")


def _type_names() -> dict[int, str]:
    from tflite.TensorType import TensorType

    return {v: k for k, v in vars(TensorType).items() if not k.startswith("_") and isinstance(v, int)}


def _op_name(model, op) -> str:
    from tflite.BuiltinOperator import BuiltinOperator

    names = {v: k for k, v in vars(BuiltinOperator).items() if not k.startswith("_")}
    code = model.OperatorCodes(op.OpcodeIndex())
    builtin = max(code.BuiltinCode(), code.DeprecatedBuiltinCode())
    return names.get(builtin, f"op{builtin}")


def _is_quantized(tensor) -> bool:
    q = tensor.Quantization()
    return q is not None and q.ScaleLength() > 0


def _name(tensor) -> str:
    name = tensor.Name()
    return name.decode("utf-8") if isinstance(name, bytes) else str(name)


def quant_scheme(model, where: str, error: type) -> str | None:
    """``"tflite"`` for a full-integer model, ``None`` for a float one; raises ``error``
    (:class:`TFLiteImportError`) for the schemes listed in the module docstring.

    Parameters
    ----------
    model : tflite.Model.Model
        The parsed flatbuffer.
    where : str
        The file name, for messages.
    error : type
        The exception class to raise.
    """
    types = _type_names()
    sub = model.Subgraphs(0)

    def is_const(idx: int) -> bool:
        buf = model.Buffers(sub.Tensors(idx).Buffer())
        return buf is not None and buf.DataLength() > 0

    def describe(idx: int) -> tuple[str, str]:
        t = sub.Tensors(idx)
        return _name(t), types.get(t.Type(), str(t.Type()))

    integer = False
    for idx in range(sub.TensorsLength()):
        tensor = sub.Tensors(idx)
        tname, ttype = describe(idx)
        if not _is_quantized(tensor):
            continue
        if ttype in ("INT8", "UINT8"):
            integer = integer or not is_const(idx)
        elif ttype == "INT32" and is_const(idx):
            continue  # a quantized bias
        elif ttype in ("INT16", "UINT16") and not is_const(idx):
            raise error(f"TFLite tensor '{tname}' of {where!r} has type {ttype} (16-bit activations, "
                        "the int16x8 scheme): only int8/uint8 activations reach the MAC arrays; "
                        "quantize with TFLITE_BUILTINS_INT8")
        elif ttype not in ("INT32", "FLOAT32", "FLOAT16"):
            raise error(f"TFLite tensor '{tname}' of {where!r} is quantized with type {ttype}: "
                        "only int8/uint8 tensors (and int32 biases) are supported")
    for k in range(sub.OperatorsLength()):
        op = sub.Operators(k)
        opname = _op_name(model, op)
        if opname == "DEQUANTIZE":
            continue  # float16 / int8 weights widened explicitly
        ins = [int(i) for i in op.InputsAsNumpy()] if op.InputsLength() else []
        outs = [int(i) for i in op.OutputsAsNumpy()] if op.OutputsLength() else []
        float_out = any(describe(o)[1] == "FLOAT32" for o in outs if o >= 0)
        for i in ins:
            if i >= 0 and is_const(i) and describe(i)[1] in ("INT8", "UINT8") and float_out:
                tname, ttype = describe(i)
                raise error(
                    f"TFLite tensor '{tname}' of {where!r} is a {ttype} weight of {opname} whose "
                    "output is FLOAT32: a dynamic-range (hybrid) quantized model, which the int8 "
                    "path does not run; convert with a representative dataset and "
                    "TFLITE_BUILTINS_INT8 (full integer), or without quantization")
    return "tflite" if integer else None


def _samples(data, shapes: list[tuple]) -> list[list[np.ndarray]]:
    """The representative samples, each a list of one float32 array per input (batch 1)."""
    if callable(data):
        data = data()
    if isinstance(data, np.ndarray):
        data = [data[k:k + 1] for k in range(data.shape[0])] if data.ndim == len(shapes[0]) else [data]
    out = []
    for sample in data:
        arrays = list(sample) if isinstance(sample, (list, tuple)) else [sample]
        if len(arrays) != len(shapes):
            raise ValueError(f"a representative sample has {len(arrays)} arrays, the model has "
                             f"{len(shapes)} inputs")
        fixed = []
        for a, shape in zip(arrays, shapes):
            a = np.asarray(a, dtype=np.float32)
            if a.shape != tuple(shape):
                if a.shape == tuple(shape[1:]):
                    a = a[None]
                else:
                    raise ValueError(f"representative sample shape {a.shape} does not match the "
                                     f"input shape {tuple(shape)}")
            fixed.append(a)
        out.append(fixed)
    if not out:
        raise ValueError("the representative dataset is empty")
    return out


def keras_to_int8_tflite(tf, static_model, shapes: list[tuple], representative: Iterable,
                         io_dtype: str = "int8") -> bytes:
    """Full-integer TFLite flatbuffer of a (static-shaped) Keras model.

    Parameters
    ----------
    tf : module
        ``tensorflow``.
    static_model : keras.Model
        The model with static input shapes (see :func:`.tflite.keras_to_tflite`).
    shapes : list of tuple
        Its input shapes.
    representative : array, iterable or callable
        Calibration samples: an array ``(N, *input_shape[1:])`` (one sample per row), or an
        iterable (or a function returning one) of samples, each an array or a list of arrays
        (one per input).
    io_dtype : {"int8", "uint8", "float32"}
        Type of the model's inputs and outputs (``float32``: the converter adds ``QUANTIZE`` /
        ``DEQUANTIZE`` at the edges).
    """
    if io_dtype not in QUANT_IO_TYPES:
        raise ValueError(f"io_dtype {io_dtype!r}: expected one of {QUANT_IO_TYPES}")
    samples = _samples(representative, shapes)
    converter = tf.lite.TFLiteConverter.from_keras_model(static_model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = lambda: iter(samples)
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    io = {"int8": tf.int8, "uint8": tf.uint8, "float32": tf.float32}[io_dtype]
    converter.inference_input_type = io
    converter.inference_output_type = io
    return converter.convert()
