"""The tvm-spinn console script: compile an ONNX file, run the library, report."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from models import make


def _cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "tvm_spinn.cli", *args], capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_compile_run_report(tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    model, x = make("mlp")
    onnx_path = tmp_path / "mlp.onnx"
    torch.onnx.export(model, (x,), str(onnx_path), dynamo=False, input_names=["x"], opset_version=17)
    lib = tmp_path / "mlp.so"
    out = _cli("compile", str(onnx_path), "--target", "spinn", "-o", str(lib), "--report")
    assert lib.exists() and "latency" in out.stdout
    np.savez(tmp_path / "in.npz", x=x.numpy())
    _cli("run", str(lib), "--inputs", str(tmp_path / "in.npz"), "-o", str(tmp_path / "out.npz"))
    got = np.load(tmp_path / "out.npz")["output0"]
    ref = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    rep = _cli("report", str(lib))
    assert "dense" in rep.stdout and "roofline" in rep.stdout


def test_bad_inputs_give_one_line_errors(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not protobuf")
    proc = _cli("compile", str(bad), "-o", str(tmp_path / "x.so"), check=False)
    assert proc.returncode != 0 and "bad.onnx" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x.so").exists()
    proc = _cli("compile", str(bad), "--target", "spinn/nope", "-o", str(tmp_path / "x.so"), check=False)
    assert proc.returncode != 0 and "spinn/board" in proc.stderr
    proc = _cli("run", str(tmp_path / "missing.so"), "--inputs", "none.npz", check=False)
    assert proc.returncode != 0 and "missing.so" in proc.stderr and "Traceback" not in proc.stderr


def test_compile_quantized(tmp_path):
    """--quantize: int8 PTQ from an .npz of calibration samples; the layers run in int8 mode and
    the result stays within the PTQ bound of the float model (3 GEMMs: 2*3/255 of the range)."""
    onnxruntime = pytest.importorskip("onnxruntime")
    model, x = make("mlp")
    onnx_path = tmp_path / "mlp.onnx"
    torch.onnx.export(model, (x,), str(onnx_path), dynamo=False, input_names=["x"], opset_version=17)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "calib.npz", x=rng.normal(size=(8,) + tuple(x.shape)).astype("float32"))
    lib = tmp_path / "mlp_int8.so"
    out = _cli("compile", str(onnx_path), "-o", str(lib), "--quantize", str(tmp_path / "calib.npz"),
               "--quant-scheme", "percentile=99.99", "--report")
    assert lib.exists() and out.stdout.count("int8") >= 3
    np.savez(tmp_path / "in.npz", x=x.numpy())
    _cli("run", str(lib), "--inputs", str(tmp_path / "in.npz"), "-o", str(tmp_path / "out.npz"))
    got = np.load(tmp_path / "out.npz")["output0"]
    ref = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    assert np.abs(got - ref).max() <= 2 * 3 * np.abs(ref).max() / 255
    # bad calibration data: wrong shape names the input; a bad scheme names the field
    np.savez(tmp_path / "bad.npz", x=rng.normal(size=(2, 3, 3)).astype("float32"))
    proc = _cli("compile", str(onnx_path), "-o", str(tmp_path / "b.so"), "--quantize", str(tmp_path / "bad.npz"),
                check=False)
    assert proc.returncode == 2 and "'x'" in proc.stderr and "shape" in proc.stderr
    proc = _cli("compile", str(onnx_path), "-o", str(tmp_path / "b.so"), "--quantize", str(tmp_path / "calib.npz"),
                "--quant-scheme", "int4", check=False)
    assert proc.returncode == 2 and "int4" in proc.stderr
    assert not (tmp_path / "b.so").exists()
