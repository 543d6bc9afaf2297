"""Keras models quantized by TensorFlow (full integer) and a tf.lite.Interpreter runner, shared by
tests/frontend/test_frontend_tflite_quant.py and bench/quantize.py.

    import tflite_models as tm
    buf = tm.int8_tflite(tm.cnn(), tm.calibration((16, 16, 3)))
"""

from __future__ import annotations

import numpy as np


def _keras():
    import keras

    return keras


def randomize(model, seed: int = 0):
    """Random biases and batch-norm statistics (Keras initializes them to constants, and the
    converter drops all-zero biases), so every part of the int8 epilogue is exercised."""
    layers = _keras().layers
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        weights = layer.get_weights()
        if not weights:
            continue
        new = []
        for w in weights:
            if w.ndim == 1:  # bias, gamma, beta, moving mean; variance and gamma stay positive
                bn = isinstance(layer, layers.BatchNormalization)
                w = (rng.uniform(0.5, 1.5, w.shape) if bn and len(new) in (0, 3)
                     else rng.normal(0.0, 0.2, w.shape)).astype(w.dtype)
            new.append(w)
        layer.set_weights(new)
    return model


def cnn():
    """Conv (ReLU), depthwise (ReLU6), 1x1 conv, residual add, max pool, strided conv, 2x2
    average pool (ties), concat, global average pool, dense + softmax; two outputs."""
    keras = _keras()
    L = keras.layers
    keras.utils.set_random_seed(0)
    x = keras.Input((16, 16, 3))
    a = L.Conv2D(8, 3, activation="relu")(x)
    b = L.DepthwiseConv2D(3, padding="same", activation="relu6")(a)
    b = L.Conv2D(8, 1)(b)
    c = L.MaxPooling2D()(L.Add()([a, b]))
    d = L.Conv2D(16, 3, strides=2, padding="same", activation="relu")(c)
    e = L.AveragePooling2D(2)(d)  # 4-element windows: ties, which TFLite rounds away from zero
    f = L.Concatenate()([e, L.Conv2D(4, 1)(e)])
    g = L.GlobalAveragePooling2D()(f)
    h = L.Dense(10, activation="softmax")(g)
    return randomize(keras.Model(x, [f, h], name="qcnn"))


def mlp():
    keras = _keras()
    L = keras.layers
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), L.Dense(64, activation="relu"), L.Dense(48, activation="relu"),
                              L.Dense(16)], name="mlp")
    return randomize(model)


def softmax(shape: tuple):
    """A lone softmax over the last axis (TFLite's integer SOFTMAX, output scale 1/256)."""
    keras = _keras()
    return keras.Sequential([keras.Input(shape), keras.layers.Softmax()], name="qsoftmax")


def mean(shape: tuple, keepdims: bool = False):
    """A lone global average pool over the trailing axes of a channels-first input (TFLite's
    integer MEAN over axes 2 and 3)."""
    keras = _keras()
    pool = keras.layers.GlobalAveragePooling2D(data_format="channels_first", keepdims=keepdims)
    return keras.Sequential([keras.Input(shape), pool], name="qmean")


def mobilenet_v2(include_top: bool = False):
    keras = _keras()
    keras.utils.set_random_seed(0)
    return randomize(keras.applications.MobileNetV2(weights=None, alpha=0.35, input_shape=(96, 96, 3),
                                                    include_top=include_top))


def calibration(shape: tuple, count: int = 16, seed: int = 1, normal: bool = False) -> np.ndarray:
    """Seeded representative samples ``(count, *shape)``: uniform [0, 1) (images) or normal."""
    rng = np.random.default_rng(seed)
    if normal:
        return rng.standard_normal((count, *shape), dtype=np.float32)
    return rng.random((count, *shape), dtype=np.float32)


def interpret(buf: bytes, x: np.ndarray, resolver: str = "BUILTIN_REF") -> list[np.ndarray]:
    """Outputs of ``tf.lite.Interpreter`` (kernels ``OpResolverType.<resolver>``) on one input."""
    import tensorflow as tf

    kind = getattr(tf.lite.experimental.OpResolverType, resolver)
    interp = tf.lite.Interpreter(model_content=buf, experimental_op_resolver_type=kind)
    interp.allocate_tensors()
    (inp,) = interp.get_input_details()
    interp.set_tensor(inp["index"], x)
    interp.invoke()
    return [interp.get_tensor(o["index"]) for o in interp.get_output_details()]


def integer_inputs(buf: bytes, count: int, seed: int = 0) -> list[np.ndarray]:
    """Seeded random inputs over the whole range of the model's (integer) input type."""
    import tensorflow as tf

    (inp,) = tf.lite.Interpreter(model_content=buf).get_input_details()
    rng = np.random.default_rng(seed)
    info = np.iinfo(inp["dtype"])
    return [rng.integers(info.min, info.max + 1, size=inp["shape"]).astype(inp["dtype"]) for _ in range(count)]
