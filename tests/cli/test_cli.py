"""The tvm-spinn console script: compile an ONNX file, run the library, report."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from models import make, save_sub_onnx


def _cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "tvm_spinn.cli", *args], capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_compile_run_report(tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    model, x = make("mlp")
    onnx_path = tmp_path / "mlp.onnx"
    torch.onnx.export(model, (x,), str(onnx_path), dynamo=False, input_names=["x"], output_names=["y"],
                      opset_version=17)
    lib = tmp_path / "mlp.so"
    out = _cli("compile", str(onnx_path), "--target", "spinn", "-o", str(lib), "--report")
    assert lib.exists() and "latency" in out.stdout
    np.savez(tmp_path / "in.npz", x=x.numpy())
    _cli("run", str(lib), "--inputs", str(tmp_path / "in.npz"), "-o", str(tmp_path / "out.npz"))
    got = np.load(tmp_path / "out.npz")["y"]  # named as in the model
    ref = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    rep = _cli("report", str(lib))
    assert "dense" in rep.stdout and "roofline" in rep.stdout and "physical bound" in rep.stdout


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


# ~30 s of subprocesses; --quantize through the command keeps a default test in-process
# (test_npy_calibration below: the same option parsing and PTQ call, in this process)
@pytest.mark.slow
def test_compile_quantized(tmp_path):
    """--quantize: int8 PTQ from an .npz of calibration samples; the layers run in int8 mode and
    the result stays within the PTQ bound of the float model (3 GEMMs: 2*3/255 of the range)."""
    onnxruntime = pytest.importorskip("onnxruntime")
    model, x = make("mlp")
    onnx_path = tmp_path / "mlp.onnx"
    torch.onnx.export(model, (x,), str(onnx_path), dynamo=False, input_names=["x"], output_names=["y"],
                      opset_version=17)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "calib.npz", x=rng.normal(size=(8,) + tuple(x.shape)).astype("float32"))
    lib = tmp_path / "mlp_int8.so"
    out = _cli("compile", str(onnx_path), "-o", str(lib), "--quantize", str(tmp_path / "calib.npz"),
               "--quant-scheme", "percentile=99.99", "--report")
    assert lib.exists() and out.stdout.count("int8") >= 3
    np.savez(tmp_path / "in.npz", x=x.numpy())
    _cli("run", str(lib), "--inputs", str(tmp_path / "in.npz"), "-o", str(tmp_path / "out.npz"))
    got = np.load(tmp_path / "out.npz")["y"]  # named as in the model
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


# -- inputs by name, output files, errors (in-process `main` where a subprocess is not needed) ----

@pytest.fixture(scope="module")
def sub_lib(tmp_path_factory):
    from tvm_spinn import cli

    directory = tmp_path_factory.mktemp("sub")
    save_sub_onnx(directory / "sub.onnx")
    assert cli.main(["compile", str(directory / "sub.onnx"), "-o", str(directory / "sub.so")]) == 0
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 3)).astype("float32"), rng.normal(size=(2, 3)).astype("float32")
    return directory / "sub.so", a, b


def _main_error(capsys, argv):
    """Run ``cli.main`` expecting a failure; returns the one-line message (stderr or SystemExit)."""
    from tvm_spinn import cli

    capsys.readouterr()
    try:
        rc = cli.main(argv)
        message = capsys.readouterr().err
    except SystemExit as exit_:
        rc, message = 1, str(exit_.code)
    assert rc != 0 and message.strip() and "Traceback" not in message, message
    return message


def test_run_matches_inputs_by_name(sub_lib, tmp_path, capsys):
    from tvm_spinn import cli

    lib, a, b = sub_lib
    for i, arrays in enumerate(({"b": b, "a": a}, {"a": a, "b": b}, {"arr_0": a, "arr_1": b})):
        np.savez(tmp_path / f"in{i}.npz", **arrays)
        assert cli.main(["run", str(lib), "--inputs", str(tmp_path / f"in{i}.npz"),
                         "-o", str(tmp_path / f"out{i}.npz")]) == 0
        np.testing.assert_array_equal(np.load(tmp_path / f"out{i}.npz")["out"], a - b)
    for arrays, expect in (({"foo": a, "bar": b}, "unknown ['foo', 'bar']"), ({"a": a}, "missing ['b']"),
                           ({"a": a, "b": b, "c": b}, "unknown ['c']"), ({"arr_0": a}, "missing")):
        np.savez(tmp_path / "bad.npz", **arrays)
        message = _main_error(capsys, ["run", str(lib), "--inputs", str(tmp_path / "bad.npz")])
        assert "['a', 'b']" in message and expect in message, message
    np.save(tmp_path / "one.npy", a)
    assert "several inputs" in _main_error(capsys, ["run", str(lib), "--inputs", str(tmp_path / "one.npy")])
    np.savez(tmp_path / "shape.npz", a=a[:1], b=b)
    message = _main_error(capsys, ["run", str(lib), "--inputs", str(tmp_path / "shape.npz")])
    assert "'a'" in message and "(2, 3)" in message and "\n" not in message.strip(), message
    np.savez(tmp_path / "dtype.npz", a=a.astype("float64"), b=b)
    assert "float32" in _main_error(capsys, ["run", str(lib), "--inputs", str(tmp_path / "dtype.npz")])


def test_run_a_library_exported_by_tvm(sub_lib, tmp_path):
    """``ex.export_library`` (TVM's own, no seal and so no output names) runs too: the result is
    the same array, named ``output0``."""
    import tvm
    from tvm import relax

    import tvm_spinn
    from tvm_spinn import cli

    lib, a, b = sub_lib
    ex = relax.build(tvm_spinn.frontend.from_onnx(str(lib.parent / "sub.onnx")), target="spinn")
    ex.export_library(str(tmp_path / "plain.so"))
    np.savez(tmp_path / "in.npz", a=a, b=b)
    assert cli.main(["run", str(tmp_path / "plain.so"), "--inputs", str(tmp_path / "in.npz"),
                     "-o", str(tmp_path / "out.npz")]) == 0
    out = np.load(tmp_path / "out.npz")
    assert list(out) == ["output0"]
    want = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    np.testing.assert_array_equal(out["output0"], want)
    np.testing.assert_array_equal(out["output0"], a - b)


def test_output_paths_modes_and_library_errors(sub_lib, tmp_path, capsys):
    lib, a, b = sub_lib
    np.savez(tmp_path / "in.npz", a=a, b=b)
    # -o into a missing directory or onto a directory: refused before any work, naming the path
    message = _main_error(capsys, ["compile", str(lib.parent / "sub.onnx"), "-o", str(tmp_path / "nodir" / "x.so")])
    assert "nodir" in message and "does not exist" in message and ".tmp" not in message
    (tmp_path / "outdir").mkdir()
    message = _main_error(capsys, ["run", str(lib), "--inputs", str(tmp_path / "in.npz"), "-o", str(tmp_path / "outdir")])
    assert "is a directory" in message
    assert sorted(os.listdir(tmp_path)) == ["in.npz", "outdir"] and not os.listdir(tmp_path / "outdir")
    # not a tvm-spinn library: one LibraryError line
    (tmp_path / "fake.so").write_bytes(b"\x7fELF" + bytes(100))
    message = _main_error(capsys, ["run", str(tmp_path / "fake.so"), "--inputs", str(tmp_path / "in.npz")])
    assert "fake.so" in message and "not a library exported by tvm-spinn" in message
    # files get the umask's modes, no temporaries are left behind
    from tvm_spinn import cli

    work = tmp_path / "modes"
    work.mkdir()
    previous = os.umask(0o027)
    try:
        assert cli.main(["compile", str(lib.parent / "sub.onnx"), "-o", str(work / "m.so")]) == 0
        assert cli.main(["run", str(work / "m.so"), "--inputs", str(tmp_path / "in.npz"), "-o", str(work / "o.npz")]) == 0
    finally:
        os.umask(previous)
    assert sorted(os.listdir(work)) == ["m.so", "o.npz"]
    assert os.stat(work / "m.so").st_mode & 0o777 == 0o750 and os.stat(work / "o.npz").st_mode & 0o777 == 0o640
    np.testing.assert_array_equal(np.load(work / "o.npz")["out"], a - b)


def test_npy_calibration(sub_lib, tmp_path, capsys):
    """--quantize takes an .npy for a single-input model; for two inputs it names the problem."""
    onnxruntime = pytest.importorskip("onnxruntime")
    from tvm_spinn import cli

    model, x = make("mlp")
    onnx_path = tmp_path / "mlp.onnx"
    torch.onnx.export(model, (x,), str(onnx_path), dynamo=False, input_names=["x"], output_names=["y"],
                      opset_version=17)
    rng = np.random.default_rng(0)
    np.save(tmp_path / "calib.npy", rng.normal(size=(8,) + tuple(x.shape)).astype("float32"))
    assert cli.main(["compile", str(onnx_path), "-o", str(tmp_path / "q.so"), "--quantize", str(tmp_path / "calib.npy")]) == 0
    np.save(tmp_path / "x.npy", x.numpy())
    assert cli.main(["run", str(tmp_path / "q.so"), "--inputs", str(tmp_path / "x.npy"), "-o", str(tmp_path / "o.npz")]) == 0
    ref = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    assert np.abs(np.load(tmp_path / "o.npz")["y"] - ref).max() <= 2 * 3 * np.abs(ref).max() / 255
    two_inputs = sub_lib[0].parent / "sub.onnx"
    message = _main_error(capsys, ["compile", str(two_inputs), "-o", str(tmp_path / "s.so"),
                                   "--quantize", str(tmp_path / "calib.npy")])
    assert "several inputs" in message and "calib.npy" in message and not (tmp_path / "s.so").exists()
