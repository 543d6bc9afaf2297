"""Gathers never read outside their table, whatever the index dtype and wherever they run.

An offloaded ``take`` (int32 indices, static shape) is checked by the simulator; every other
``take`` in ``fast`` mode runs on the fallback, whose indices pass a bounds check first
(:mod:`tvm_spinn.runtime.checked_take`). Each frontend keeps its own meaning of a negative index:
ONNX ``Gather`` counts ``[-n, -1]`` from the end (onnxruntime), ``torch.nn.Embedding`` refuses it.
"""

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn

VOCAB, DIM = 10, 4


def _gather_onnx(path, index_dtype="int64", dynamic=False):
    """An embedding lookup ``Gather(W, ids)``: W (10, 4) float32, ids (2, 3) of ``index_dtype``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    table = np.random.default_rng(0).standard_normal((VOCAB, DIM)).astype(np.float32)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(index_dtype))
    ids = helper.make_tensor_value_info("ids", elem, ["batch", 3] if dynamic else [2, 3])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, DIM] if dynamic else [2, 3, DIM])
    graph = helper.make_graph([helper.make_node("Gather", ["W", "ids"], ["y"], axis=0, name="embed")], "g",
                              [ids], [out], [numpy_helper.from_array(table, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


def _ort(path, ids):
    onnxruntime = pytest.importorskip("onnxruntime")
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]


def _vm_run(ex, *arrays):
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


IN_RANGE = [[0, 1, 2], [9, 3, 4]]
FROM_THE_END = [[-1, -10, 2], [9, -3, 0]]  # ONNX: [-n, -1] counts from the end
OUT_OF_RANGE = {"extent": ([[0, 1, VOCAB], [9, 3, 4]], VOCAB), "below -n": ([[0, -11, 2], [9, 3, 4]], -1),
                "far": ([[0, 1, 2], [9, 3, 10**12]], 10**12)}


@pytest.mark.parametrize("dtype", ["int64", "int32"])  # ONNX Gather's index types
def test_onnx_gather_matches_onnxruntime_and_refuses_out_of_range(tmp_path, dtype):
    path = _gather_onnx(tmp_path / "g.onnx", dtype)
    ex = relax.build(tvm_spinn.frontend.from_onnx(str(path)), target="spinn")
    cases = [IN_RANGE] + ([FROM_THE_END] if np.dtype(dtype).kind == "i" else [])
    for ids in cases:
        ids = np.array(ids, dtype)
        np.testing.assert_array_equal(_vm_run(ex, ids), _ort(path, ids))  # a gather is exact
    for tag, (ids, shown) in OUT_OF_RANGE.items():
        if not np.can_cast(np.min_scalar_type(np.array(ids)), dtype):
            continue  # not representable in this dtype
        ids = np.array(ids, dtype)
        with pytest.raises(Exception):  # onnxruntime refuses it too
            _ort(path, ids)
        with pytest.raises(IndexError, match=f"index {shown} is out of range for axis 0 of extent {VOCAB}"):
            _vm_run(ex, ids)


def _take_module(dtype, shape, axis=0):
    table = np.arange(VOCAB * DIM, dtype=np.float32).reshape(VOCAB, DIM)
    if axis == 1:
        table = np.ascontiguousarray(table.T)
    bb = relax.BlockBuilder()
    ids = relax.Var("ids", relax.TensorType(shape, dtype))
    with bb.function("main", [ids]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.take(relax.const(table), ids, axis=axis))
        bb.emit_func_output(out)
    return relax.build(bb.get(), target="spinn"), table


@pytest.mark.parametrize("dtype", ["int8", "int16", "uint8", "uint16", "int32", "uint32", "int64"])
def test_take_any_index_dtype_is_checked(dtype):
    """Static (2, 3) indices of every integer dtype; int32 is offloaded, the others run on the
    fallback: both match numpy in range and raise an IndexError outside it (axis 1 here)."""
    ex, table = _take_module(dtype, [2, 3], axis=1)
    ids = np.array([[0, 1, 9], [4, 4, 2]], dtype)
    np.testing.assert_array_equal(_vm_run(ex, ids), np.take(table, ids, axis=1))
    bad = [np.array([[0, 1, 10], [4, 4, 2]], dtype)]
    if np.dtype(dtype).kind == "i":
        bad.append(np.array([[0, 1, 2], [4, -1, 2]], dtype))
    for ids in bad:
        shown = ids[(ids < 0) | (ids >= VOCAB)][0]
        with pytest.raises(IndexError, match=f"take index {shown} is out of range for axis 1 of extent {VOCAB}"):
            _vm_run(ex, ids)


def test_dynamic_int32_take_is_checked_on_the_fallback():
    """int32 indices with a symbolic shape stay on the fallback: checked there too."""
    ex, table = _take_module("int32", [tvm.tirx.Var("n", "int64")])
    np.testing.assert_array_equal(_vm_run(ex, np.array([3, 0, 9], "int32")), table[[3, 0, 9]])
    with pytest.raises(IndexError, match="take index -1 is out of range for axis 0 of extent 10"):
        _vm_run(ex, np.array([3, -1], "int32"))


def test_torch_embedding_int64_ids_match_torch_and_refuse_negative():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Embedding(VOCAB, DIM).eval()
    example = torch.tensor(IN_RANGE, dtype=torch.int64)
    ex = relax.build(tvm_spinn.frontend.from_pytorch(model, (example,)), target="spinn")
    with torch.no_grad():
        np.testing.assert_array_equal(_vm_run(ex, example.numpy()), model(example).numpy())
    for bad in ([[0, 1, VOCAB], [9, 3, 4]], [[0, -1, 2], [9, 3, 4]]):  # torch: IndexError for both
        with pytest.raises(IndexError):
            model(torch.tensor(bad))
        with pytest.raises(IndexError, match="out of range"):
            _vm_run(ex, np.array(bad, "int64"))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tvm_spinn.cli", *args], capture_output=True, text=True,
                          timeout=600)


def _cli_run_checks(tmp_path, lib, onnx_path, good, bad):
    for ids in good:
        ids = np.array(ids, "int64")
        np.save(tmp_path / "ids.npy", ids)
        proc = _cli("run", str(lib), "--inputs", str(tmp_path / "ids.npy"), "-o", str(tmp_path / "out.npz"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        np.testing.assert_array_equal(np.load(tmp_path / "out.npz")["output0"], _ort(onnx_path, ids))
    for tag in bad:
        ids, shown = OUT_OF_RANGE[tag]
        np.save(tmp_path / "bad.npy", np.array(ids, "int64"))
        out = tmp_path / f"bad-{tag.replace(' ', '_')}.npz"
        proc = _cli("run", str(lib), "--inputs", str(tmp_path / "bad.npy"), "-o", str(out))
        assert proc.returncode > 0, (tag, proc.returncode, proc.stderr[-2000:])  # not killed by a signal
        last = proc.stderr.strip().splitlines()[-1]
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]  # one line, not a stack
        assert last.startswith("tvm-spinn: error:") and "take" in last and f"index {shown} is out of range" in last, last
        assert not out.exists()


def test_cli_run_int64_ids_past_the_table_is_an_error_not_a_crash(tmp_path):
    """``tvm-spinn run`` on an int64 embedding: ids in range (some counted from the end) match
    onnxruntime exactly; an id far past the table (a segfault of TVM's unchecked gather) ends in
    an IndexError naming the take, never a crash (rc 139) or a read past it."""
    path = _gather_onnx(tmp_path / "emb.onnx", "int64")
    lib = tmp_path / "emb.so"
    tvm_spinn.export_library(relax.build(tvm_spinn.frontend.from_onnx(str(path)), target="spinn"), lib)
    _cli_run_checks(tmp_path, lib, path, [FROM_THE_END], ["far"])


@pytest.mark.slow
def test_cli_compile_and_run_int64_ids_every_out_of_range_kind(tmp_path):
    """The same through ``tvm-spinn compile``, with every kind of out-of-range id."""
    path = _gather_onnx(tmp_path / "emb.onnx", "int64")
    lib = tmp_path / "emb.so"
    proc = _cli("compile", str(path), "-o", str(lib))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _cli_run_checks(tmp_path, lib, path, [IN_RANGE, FROM_THE_END], list(OUT_OF_RANGE))


def test_calibration_ids_past_the_table_are_an_index_error():
    """Calibration runs the model on a plain llvm build of the user's samples: its gathers are
    checked too (an id past the table is an IndexError, not a read past it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 4)).eval()
    mod = tvm_spinn.frontend.from_pytorch(model, (torch.tensor([[1, 2, 3]]),))
    tvm_spinn.quantize(mod, [[np.array([[1, 2, 3]], "int64")], [np.array([[4, 5, 9]], "int64")]])
    with pytest.raises(IndexError, match="out of range for axis 0 of extent 10"):
        tvm_spinn.quantize(mod, [[np.array([[1, 2, 10**9]], "int64")]])


def _indexing_model(path, op, data_shape, index_shape, out_shape, **attrs):
    from onnx import TensorProto, helper

    node = helper.make_node(op, ["x", "i"], ["y"], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, data_shape),
                                            helper.make_tensor_value_info("i", TensorProto.INT64, index_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)


@pytest.mark.parametrize("op, index_shape, out_shape, attrs, good, bad, shown", [
    ("GatherElements", [3, 2], [3, 2], {"axis": 1}, [[0, 3], [1, -1], [3, 0]], [[0, 4], [1, 2], [3, 0]],
     "gather_elements index 4 is out of range for axis 1 of extent 4"),
    ("GatherND", [2, 2], [2], {}, [[0, 3], [2, -4]], [[0, 3], [3, 1]],
     "gather_nd index 3 is out of range for axis 0 of extent 3"),
])
def test_gather_elements_and_gather_nd_are_checked(tmp_path, op, index_shape, out_shape, attrs, good, bad, shown):
    """The fallback's GatherElements / GatherND trust their indices in TVM: checked like take
    (in-range ids, negative ones counted from the end, equal onnxruntime's)."""
    path = str(tmp_path / "m.onnx")
    _indexing_model(path, op, [3, 4], index_shape, out_shape, **attrs)
    ex = relax.build(tvm_spinn.frontend.from_onnx(path), target="spinn")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    x = np.random.default_rng(0).standard_normal((3, 4)).astype("float32")
    want = ort.InferenceSession(path).run(None, {"x": x, "i": np.array(good, "int64")})[0]
    got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(np.array(good, "int64"))).numpy()
    np.testing.assert_array_equal(got, want)
    with pytest.raises(IndexError, match=shown):
        vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(np.array(bad, "int64")))
