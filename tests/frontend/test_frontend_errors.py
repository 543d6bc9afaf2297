"""Front-end bad inputs: one clear error naming the file, the input or every unsupported op."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tvm_spinn
from tvm_spinn.frontend import OnnxImportError


def _model(nodes, inputs, outputs):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_unsupported_ops_are_all_listed():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="ok"),
        helper.make_node("FancyOp", ["a"], ["b"], name="fancy1", domain="com.example"),
        helper.make_node("OtherOp", ["b"], ["c"], name="other", domain="com.example"),
        helper.make_node("FancyOp", ["c"], ["y"], name="fancy2", domain="com.example"),
    ]
    model = _model(nodes, [x], [y])
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(OnnxImportError) as info:
        tvm_spinn.frontend.from_onnx(model, passes=False)
    msg = str(info.value)
    assert "2 unsupported op type(s)" in msg
    assert "com.example.FancyOp (nodes: fancy1, fancy2)" in msg and "com.example.OtherOp (nodes: other)" in msg


def test_dynamic_dims_need_a_shape():
    x = helper.make_tensor_value_info("tokens", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    model = _model([helper.make_node("Relu", ["tokens"], ["y"])], [x], [y])
    with pytest.raises(OnnxImportError, match=r"input 'tokens'.*shape_dict"):
        tvm_spinn.frontend.from_onnx(model)
    mod = tvm_spinn.frontend.from_onnx(model, shape_dict={"tokens": (4, 3)})
    assert [int(d) for d in mod["main"].params[0].ty.shape.values] == [4, 3]


def test_corrupt_and_missing_files_are_named(tmp_path):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"\x08\x01garbage" * 10)
    with pytest.raises(OnnxImportError, match="broken.onnx"):
        tvm_spinn.frontend.from_onnx(str(bad))
    with pytest.raises(OnnxImportError, match="nothere.onnx"):
        tvm_spinn.frontend.from_onnx(str(tmp_path / "nothere.onnx"))


def test_passes_are_recorded_and_keep_numerics(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3], rng.standard_normal(12).astype(np.float32).ravel())
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    nodes = [helper.make_node("Identity", ["x"], ["xi"]),
             helper.make_node("Gemm", ["xi", "w"], ["y"], transB=1, alpha=0.5)]
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    mod = tvm_spinn.frontend.from_onnx(model)
    assert any("Identity" in p for p in mod.attrs["spinn_source"]["passes"])
    import tvm
    from tvm import relax
    data = rng.standard_normal((2, 3)).astype(np.float32)
    ex = relax.build(mod, target="spinn")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(data)).numpy()
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": data})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
