"""``shape_dict`` entries are checked against the inputs they name: one error per mistake."""

import numpy as np
import pytest
from onnx import TensorProto, helper

import tvm_spinn
from tvm_spinn.frontend import OnnxImportError, TFLiteImportError


def _relu_model(dims):
    x = helper.make_tensor_value_info("tokens", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
    graph = helper.make_graph([helper.make_node("Relu", ["tokens"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("dims, given, match", [
    (["batch", 3], (2, 3, 4), r"shape_dict\['tokens'\].*rank 3 \(\[2, 3, 4\]\).*input has rank 2 \(\['\?', 3\]\)"),
    ([2, 3], (6,), r"shape_dict\['tokens'\].*rank 1.*rank 2 \(\[2, 3\]\)"),
    (["batch", 3], (2, 4), r"shape_dict\['tokens'\].*dim 1 = 4.*fixed to 3"),
    (["batch", 3], (2, -3), r"shape_dict\['tokens'\].*negative dim"),
    (["batch", 3], "2x3", r"shape_dict\['tokens'\].*sequence of ints"),
])
def test_onnx_shape_dict_mismatch_names_the_input(dims, given, match):
    with pytest.raises(OnnxImportError, match=match):
        tvm_spinn.frontend.from_onnx(_relu_model(dims), shape_dict={"tokens": given})


def test_onnx_shape_dict_unknown_input():
    with pytest.raises(OnnxImportError, match=r"\['tokenz'\] are not inputs.*\['tokens'\]"):
        tvm_spinn.frontend.from_onnx(_relu_model(["batch", 3]), shape_dict={"tokenz": (2, 3)})


def test_onnx_shape_dict_right_rank_imports():
    mod = tvm_spinn.frontend.from_onnx(_relu_model(["batch", 3]), shape_dict={"tokens": (5, 3)})
    assert [int(d) for d in mod["main"].params[0].ty.shape] == [5, 3]


def test_tflite_shape_dict_wrong_rank_names_the_input():
    tf = pytest.importorskip("tensorflow")
    pytest.importorskip("tflite")
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)], name="dyn")
    buf = tf.lite.TFLiteConverter.from_keras_model(model).convert()  # batch dim dynamic
    name = tvm_spinn.frontend.tflite._input_info(
        tvm_spinn.frontend.tflite._parse(buf, "<bytes>"))[0][0]
    with pytest.raises(TFLiteImportError, match=rf"shape_dict\['{name}'\].*rank 3.*rank 2 \(\['\?', 4\]\)"):
        tvm_spinn.frontend.from_tflite(buf, shape_dict={name: (1, 2, 4)})
    with pytest.raises(TFLiteImportError, match=r"dim 1 = 5.*fixed to 4"):
        tvm_spinn.frontend.from_tflite(buf, shape_dict={name: (2, 5)})
    mod = tvm_spinn.frontend.from_tflite(buf, shape_dict={name: (2, 4)})
    assert [int(d) for d in mod["main"].params[0].ty.shape] == [2, 4]
