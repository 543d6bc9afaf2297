"""A program larger than the system is refused before it is tiled, in bounded memory.

:func:`tvm_spinn.mapping.memory.check_capacity` compares the bytes a program needs at once (its
constants and the largest layer's operands) with every chip's DRAM and SRAM, before the tiler
builds arrays that grow with the tensors' sizes.
"""

import resource
import subprocess
import sys

import numpy as np
import pytest
from tvm import relax

import tvm_spinn
from tvm_spinn.mapping import MappingError
from tvm_spinn.mapping.memory import capacity_bytes
from tvm_spinn.target import arch_of, get_target

K, N = 16, 8


def _dynamic_matmul(path):
    """``y = x @ W``: x (batch, 16) with a symbolic batch, W (16, 8) float32."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="fc")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", N])], [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


def _need(rows: int) -> int:
    return rows * K * 4 + rows * N * 4 + K * N * 4  # x, y and W (float32)


@pytest.mark.parametrize("rows", [10**9, 10**11])
def test_too_large_for_one_chip_is_a_mapping_error(tmp_path, rows):
    path = _dynamic_matmul(tmp_path / "dyn.onnx")
    mod = tvm_spinn.frontend.from_onnx(str(path), {"x": (rows, K)})
    held = capacity_bytes(arch_of(get_target("spinn")))
    with pytest.raises(MappingError) as info:
        relax.build(mod, target="spinn")
    msg = str(info.value)
    assert f"{_need(rows)} bytes needed" in msg and f"holds {held}" in msg, msg
    assert f"'x' ({rows}, {K}) float32: {rows * K * 4} bytes" in msg and "dense" in msg, msg


def test_what_fits_still_compiles_and_matches_numpy(tmp_path):
    path = _dynamic_matmul(tmp_path / "dyn.onnx")
    rows = 1000
    ex = relax.build(tvm_spinn.frontend.from_onnx(str(path), {"x": (rows, K)}), target="spinn")
    import onnx.numpy_helper
    import tvm

    w = onnx.numpy_helper.to_array(onnx.load(str(path)).graph.initializer[0])
    x = np.random.default_rng(1).standard_normal((rows, K)).astype(np.float32)
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)


def test_capacity_grows_with_the_system():
    one, board = arch_of(get_target("spinn")), arch_of(get_target("spinn/board"))
    assert capacity_bytes(board) == board.chips * capacity_bytes(one) > capacity_bytes(one)


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))


@pytest.mark.parametrize("rows", [10**11])
def test_cli_compile_refuses_in_bounded_memory(tmp_path, rows):
    """Under a 4 GiB address-space limit (the tiles of 10**11 rows once took 8.7 GB and rising),
    ``tvm-spinn compile`` ends with the capacity error, not a MemoryError, and writes nothing."""
    path = _dynamic_matmul(tmp_path / "dyn.onnx")
    out = tmp_path / "dyn.so"
    proc = subprocess.run([sys.executable, "-m", "tvm_spinn.cli", "compile", str(path), "--shape", f"x={rows},{K}",
                           "-o", str(out)], capture_output=True, text=True, timeout=600, preexec_fn=_limit_memory)
    assert proc.returncode not in (0, 1) and proc.returncode > 0, (proc.returncode, proc.stderr[-2000:])
    assert f"{_need(rows)} bytes needed" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "MemoryError" not in proc.stderr and not out.exists()
