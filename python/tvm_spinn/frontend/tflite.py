"""TFLite / Keras front-end: load a ``.tflite`` flatbuffer and import it with ``relax.frontend.tflite``.

``from_keras`` converts a ``keras.Model`` to a TFLite flatbuffer with
``tf.lite.TFLiteConverter.from_keras_model`` -- float32, or full-integer int8 with
``quantize=representative_data`` -- and imports that.

Full-integer models (int8/uint8 activations, see :mod:`.tflite_quant`) import in the QDQ form
of the ONNX and PTQ paths; the module is marked with ``spinn_quant_rounding="tflite"`` so the
int8 convolutions requantize with TFLite's fixed-point rule (:mod:`tvm_spinn.program.quant`) and
``quantize(softmax/mean(dequantize(x)))`` become TFLite's integer ``SOFTMAX``/``MEAN`` kernels
(:mod:`tvm_spinn.program.ops.rows`), giving the TFLite interpreter's results.

TensorFlow and the ``tflite`` flatbuffer package are optional (``pip install -e ".[tf]"``) and
are imported lazily, so ``import tvm_spinn`` never pays for them.

Note on layout: TFLite graphs are NHWC (``conv2d(data_layout="NHWC", kernel_layout="HWIO")``
after import); the spinn partitioner converts them to the MAC path's NCHW with transposes only at
the graph's edges (:mod:`tvm_spinn.partition.nhwc`).
"""

from __future__ import annotations

import os

import tvm

from ..program.quant import QUANT_ROUNDING_ATTR
from .shapes import check_shape
from .tflite_quant import keras_to_int8_tflite, quant_scheme

__all__ = ["from_tflite", "from_keras", "keras_to_tflite", "TFLiteImportError"]

_INSTALL_HINT = 'pip install -e ".[tf]"'


class TFLiteImportError(ValueError):
    """A TFLite model that cannot be imported (names the file or input)."""


def _import_tflite():
    try:
        import tflite  # noqa: F401
        import tflite.Model  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"the TFLite front-end needs the 'tflite' package: {_INSTALL_HINT}"
        ) from err
    return tflite


def _read(path_or_bytes) -> tuple[bytes, str]:
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        return bytes(path_or_bytes), "<bytes>"
    if isinstance(path_or_bytes, (str, os.PathLike)):
        path = os.fspath(path_or_bytes)
        if not os.path.isfile(path):
            raise TFLiteImportError(f"TFLite file {path!r} does not exist")
        with open(path, "rb") as fh:
            return fh.read(), path
    raise TFLiteImportError(
        f"expected a path or the bytes of a .tflite flatbuffer, got {type(path_or_bytes).__name__}"
    )


def _parse(buf: bytes, where: str):
    """The parsed flatbuffer, bounds-checked first (:func:`.tflite_verify.verify`): the
    ``tflite`` package's lazy readers check nothing."""
    _import_tflite()
    from .tflite_verify import verify

    return verify(buf, where, TFLiteImportError)


def _tensor_name(subgraph, index: int) -> str:
    name = subgraph.Tensors(index).Name()
    return name.decode("utf-8") if isinstance(name, bytes) else str(name)


def _input_info(model) -> list[tuple[str, tuple, tuple | None]]:
    """(name, static shape, shape signature or None) of each input of subgraph 0."""
    subgraph = model.Subgraphs(0)
    info = []
    for k in range(subgraph.InputsLength()):
        idx = subgraph.Inputs(k)
        tensor = subgraph.Tensors(idx)
        shape = tuple(int(d) for d in tensor.ShapeAsNumpy()) if tensor.ShapeLength() else ()
        sig = None
        if tensor.ShapeSignatureLength():
            sig = tuple(int(d) for d in tensor.ShapeSignatureAsNumpy())
        info.append((_tensor_name(subgraph, idx), shape, sig))
    return info


def from_tflite(path_or_bytes, shape_dict: dict | None = None, dtype_dict: dict | None = None):
    """Import a TFLite model into Relax with its weights bound as constants.

    Parameters
    ----------
    path_or_bytes : str, os.PathLike or bytes
        A ``.tflite`` file or its contents.
    shape_dict : dict, optional
        Input tensor name -> static shape, required for inputs with dynamic dims
        (``-1`` in the tensor's ``shape_signature``).
    dtype_dict : dict, optional
        Input tensor name -> dtype (defaults to the TFLite tensor type).

    Returns
    -------
    tvm.IRModule
        ``main`` takes exactly the model inputs, named after the TFLite input tensors.

    Raises
    ------
    TFLiteImportError
        A missing, damaged (truncated, corrupt offsets: checked before anything is read) or
        unsupported model, or bad ``shape_dict`` entries: every failure of the import names the
        file and, where known, what is wrong.
    """
    buf, where = _read(path_or_bytes)
    model = _parse(buf, where)
    try:
        return _import(model, where, shape_dict, dtype_dict)
    except (TFLiteImportError, ImportError):
        raise
    except tvm.error.OpNotImplemented as err:
        raise TFLiteImportError(f"TFLite file {where!r}: {err}") from None
    except Exception as err:  # a model that passed the bounds check but not the importer's assumptions
        detail = " ".join(str(err).split())[:500]
        raise TFLiteImportError(f"TFLite file {where!r} cannot be imported: {type(err).__name__}: {detail}") from None


def _import(model, where: str, shape_dict, dtype_dict):
    from tvm.relax.frontend.tflite import from_tflite as _from_tflite

    inputs = _input_info(model)
    names = [name for name, _, _ in inputs]
    unknown = sorted(set(shape_dict or {}) - set(names))
    if unknown:
        raise TFLiteImportError(
            f"shape_dict names {unknown} are not inputs of {where!r} (inputs: {names})"
        )
    declared = {name: [d if d >= 0 else None for d in (sig if sig is not None else shape)]
                for name, shape, sig in inputs}
    shape_dict = {k: check_shape(TFLiteImportError, f"TFLite file {where!r}", k, v, declared[k])
                  for k, v in (shape_dict or {}).items()}
    for name, shape, sig in inputs:
        if name in shape_dict:
            continue
        if sig is not None and any(d < 0 for d in sig):
            raise TFLiteImportError(
                f"TFLite input '{name}' of {where!r} has dynamic dims {list(sig)}; "
                f"pass shape_dict={{'{name}': (...)}}"
            )
    scheme = quant_scheme(model, where, TFLiteImportError)
    mod = _from_tflite(model, shape_dict or None, dict(dtype_dict) if dtype_dict else None)
    main = mod["main"]
    # The converter binds weights as relax constants and additionally keeps a copy of them in
    # the "params" attribute; drop that copy (main takes only the model inputs).
    if main.attrs is not None and "params" in main.attrs:
        mod["main"] = main.without_attr("params")
    mod = mod.with_attr("spinn_source", {"framework": "tflite", "file": where, "inputs": names})
    if scheme is not None:
        mod = mod.with_attr(QUANT_ROUNDING_ATTR, scheme)
    return mod


def _keras_shapes(model, input_shapes) -> list[tuple]:
    """Static shape of each keras input (``None`` batch -> 1), in ``model.inputs`` order."""
    keras_inputs = list(model.inputs)
    if input_shapes is None:
        given = [None] * len(keras_inputs)
    elif isinstance(input_shapes, dict):
        names = [t.name.split(":")[0] for t in keras_inputs]
        unknown = sorted(set(input_shapes) - set(names))
        if unknown:
            raise TFLiteImportError(f"input_shapes names {unknown} are not inputs of {names}")
        given = [input_shapes.get(n) for n in names]
    elif input_shapes and all(isinstance(d, int) for d in input_shapes):
        given = [tuple(input_shapes)]
    else:
        given = list(input_shapes)
    if len(given) != len(keras_inputs):
        raise TFLiteImportError(
            f"got {len(given)} input shapes for a model with {len(keras_inputs)} inputs"
        )
    shapes = []
    for tensor, shape in zip(keras_inputs, given):
        if shape is None:
            dims = list(tensor.shape)
            if dims and dims[0] is None:
                dims[0] = 1
            if any(d is None for d in dims):
                raise TFLiteImportError(
                    f"keras input '{tensor.name}' has dynamic dims {list(tensor.shape)}; "
                    "pass input_shapes"
                )
            shape = dims
        shapes.append(tuple(int(d) for d in shape))
    return shapes


def _import_tf():
    try:
        import tensorflow as tf
    except ImportError as err:
        raise ImportError(f"from_keras needs TensorFlow: {_INSTALL_HINT}") from err
    return tf


def keras_to_tflite(model, input_shapes=None, quantize=None, io_dtype: str = "int8") -> bytes:
    """Convert a ``keras.Model`` to a TFLite flatbuffer: float32, or full-integer with ``quantize``.

    ``quantize`` (representative samples) and ``io_dtype`` are those of :func:`from_keras`.

    The model is first wrapped in a functional model whose inputs have the given static shapes
    (batch 1 by default): with a dynamic batch the converter emits ``Shape``/``Pack`` chains
    feeding ``Reshape`` (e.g. for ``Flatten``) that ``relax.frontend.tflite`` cannot import.
    """
    tf = _import_tf()
    import keras

    shapes = _keras_shapes(model, input_shapes)
    inputs = [
        keras.Input(batch_shape=shape, dtype=tensor.dtype)
        for tensor, shape in zip(model.inputs, shapes)
    ]
    outputs = model(inputs[0] if len(inputs) == 1 else inputs, training=False)
    static = keras.Model(inputs=inputs, outputs=outputs, name=f"{model.name}_static")
    if quantize is not None:
        return keras_to_int8_tflite(tf, static, shapes, quantize, io_dtype)
    converter = tf.lite.TFLiteConverter.from_keras_model(static)
    converter.optimizations = []  # float32, no quantization
    return converter.convert()


def from_keras(model, input_shapes=None, quantize=None, io_dtype: str = "int8") -> tvm.IRModule:
    """Import a ``keras.Model`` through TFLite, float32 or quantized by TensorFlow to int8.

    Parameters
    ----------
    model : keras.Model
        The model (Keras 3 or tf.keras).
    input_shapes : tuple, list of tuples or dict, optional
        Static shape of each model input (dict keyed by keras input name, or a list in
        ``model.inputs`` order). By default each input's keras shape with batch 1.
    quantize : array, iterable or callable, optional
        Representative data: when given, ``tf.lite.TFLiteConverter`` quantizes the model to full
        integer (``TFLITE_BUILTINS_INT8``: int8 activations, per-channel int8 weights, int32
        biases) calibrated on these samples -- an array ``(N, *input_shape[1:])``, or an iterable
        (or a function returning one) of samples, each an array or a list of arrays (one per
        input). The module computes what ``tf.lite.Interpreter`` computes on that flatbuffer
        (:func:`keras_to_tflite` returns it).
    io_dtype : {"int8", "uint8", "float32"}
        With ``quantize``: the type of the model's inputs and outputs (``float32`` keeps float
        edges, quantized and dequantized inside the model).

    Returns
    -------
    tvm.IRModule
    """
    buf = keras_to_tflite(model, input_shapes, quantize=quantize, io_dtype=io_dtype)
    mod = from_tflite(buf)
    source = dict(mod.attrs["spinn_source"])
    source.update(file="<keras>", keras_model=str(getattr(model, "name", "")))
    return mod.with_attr("spinn_source", source)
