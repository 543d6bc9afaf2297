"""TFLite / Keras front-end: Keras -> TFLite -> Relax, built for llvm and spinn, vs Keras and TFLite."""

import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("tflite")
import keras  # noqa: E402

import tvm  # noqa: E402
import tvm_spinn  # noqa: E402,F401  (registers the spinn target)
from tvm import relax  # noqa: E402
from tvm_spinn.frontend.tflite import (  # noqa: E402
    TFLiteImportError, from_keras, from_tflite, keras_to_tflite,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*tf.lite.Interpreter is deprecated:UserWarning")

# Keras, the TFLite interpreter and TVM are all fp32 but sum convolutions/matmuls in a
# different order (and use different exp/tanh approximations); the only differences are
# fp32 rounding, well inside these tolerances.
RTOL, ATOL = 1e-4, 1e-5


def _run_tvm(mod, target, x):
    ex = relax.build(mod, target=target)
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    return out.numpy()


def _run_tflite(buf, x):
    interp = tf.lite.Interpreter(model_content=buf)
    interp.allocate_tensors()
    (inp,) = interp.get_input_details()
    (out,) = interp.get_output_details()
    interp.set_tensor(inp["index"], x)
    interp.invoke()
    return interp.get_tensor(out["index"])


def _check_model(model, x):
    mod = from_keras(model)
    main = mod["main"]
    assert len(main.params) == 1, "weights must be bound as constants"
    assert [int(d) for d in main.params[0].ty.shape] == list(x.shape)
    source = mod.attrs["spinn_source"]
    assert source["framework"] == "tflite"

    summary = tvm_spinn.summarize_partition(tvm_spinn.partition_for_spinn(mod))
    print(f"\n{model.name}: offloaded={summary.offloaded_ops} fallback={summary.fallback_ops} "
          f"regions={summary.regions}")

    expected = np.asarray(model(x, training=False))
    interp = _run_tflite(keras_to_tflite(model), x)
    np.testing.assert_allclose(interp, expected, rtol=RTOL, atol=ATOL)
    for target in ("llvm", "spinn"):
        got = _run_tvm(mod, target, x)
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL, err_msg=target)
        np.testing.assert_allclose(got, interp, rtol=RTOL, atol=ATOL, err_msg=target)
    return summary


def test_keras_small_cnn():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="small_cnn",
    )
    x = np.random.RandomState(0).rand(1, 16, 16, 3).astype("float32")
    summary = _check_model(model, x)
    # All of it in one region: NHWC -> NCHW once at the input, back once before the flatten
    # (partition/nhwc.py), the conv with its bias and ReLU, the pool and the dense head.
    assert summary.fallback_ops == {} and summary.regions == 1
    assert summary.offloaded_ops["spinn.permute_dims"] == 2
    assert summary.offloaded_ops["spinn.conv2d_bias_relu"] == 1
    assert summary.offloaded_ops.get("spinn.dense", 0) >= 1


@pytest.mark.slow  # ~55 s on 2 cores (two builds of 52 NHWC convs + TF conversion)
def test_keras_mobilenet_v2():
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(weights=None, input_shape=(96, 96, 3), alpha=0.35)
    x = np.random.RandomState(0).rand(1, 96, 96, 3).astype("float32")
    summary = _check_model(model, x)
    # one transpose at the input, none per conv (ConvertLayout put 104 around the 52 convs)
    assert summary.offloaded_ops["spinn.permute_dims"] <= 2


def test_from_tflite_file_and_bytes(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)], name="tiny")
    buf = keras_to_tflite(model)
    path = tmp_path / "tiny.tflite"
    path.write_bytes(buf)
    mod = from_tflite(str(path))
    assert mod.attrs["spinn_source"]["file"] == str(path)
    assert from_tflite(buf).attrs["spinn_source"]["file"] == "<bytes>"
    x = np.arange(4, dtype="float32").reshape(1, 4)
    np.testing.assert_allclose(_run_tvm(mod, "llvm", x), _run_tflite(buf, x), rtol=RTOL, atol=ATOL)


def test_dynamic_input_needs_shape_dict():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)], name="dyn")
    # from_keras_model on the original model keeps the batch dim dynamic (-1 in shape_signature).
    buf = tf.lite.TFLiteConverter.from_keras_model(model).convert()
    with pytest.raises(ValueError, match="dynamic dims") as err:
        from_tflite(buf)
    name = str(err.value).split("'")[1]
    mod = from_tflite(buf, shape_dict={name: (2, 4)})
    assert [int(d) for d in mod["main"].params[0].ty.shape] == [2, 4]


def test_corrupt_file(tmp_path):
    path = tmp_path / "corrupt.tflite"
    path.write_bytes(os.urandom(256))
    with pytest.raises(ValueError, match="corrupt.tflite"):
        from_tflite(path)
    # Right identifier, garbage body.
    path.write_bytes(b"\x10\x00\x00\x00TFL3" + b"\xff" * 8)
    with pytest.raises(ValueError, match="corrupt.tflite"):
        from_tflite(path)


def test_missing_file(tmp_path):
    path = tmp_path / "missing.tflite"
    with pytest.raises(ValueError, match="missing.tflite"):
        from_tflite(path)
