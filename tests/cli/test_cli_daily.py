"""The command line in daily use: output paths, lazy imports, model formats, output names,
targets, refusals; and the API not mutating what the caller passes."""

import os
import socket
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from models import save_sub_onnx
from tvm_spinn import _files, cli

PYTHON_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python")


@pytest.fixture(scope="module")
def sub(tmp_path_factory):
    directory = tmp_path_factory.mktemp("daily")
    save_sub_onnx(directory / "sub.onnx", output="diff")
    assert cli.main(["compile", str(directory / "sub.onnx"), "-o", str(directory / "sub.so")]) == 0
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 3)).astype("float32"), rng.normal(size=(2, 3)).astype("float32")
    np.savez(directory / "in.npz", a=a, b=b)
    return directory, a, b


def _refused(capsys, argv):
    capsys.readouterr()
    try:
        rc = cli.main(argv)
        message = capsys.readouterr().err
    except SystemExit as exit_:
        rc, message = exit_.code if isinstance(exit_.code, int) else 1, str(exit_.code)
    assert rc != 0 and "Traceback" not in message and message.strip().count("\n") == 0, message
    return message


# ----------------------------------------------------------------------------------- output paths
def test_output_may_not_be_an_input(sub, tmp_path, capsys):
    directory, a, b = sub
    model, lib = directory / "sub.onnx", directory / "sub.so"
    model_bytes, lib_bytes = model.read_bytes(), lib.read_bytes()
    message = _refused(capsys, ["compile", str(model), "-o", str(model)])
    assert "sub.onnx" in message and "input" in message
    message = _refused(capsys, ["run", str(lib), "--inputs", str(directory / "in.npz"), "-o", str(lib)])
    assert "sub.so" in message and "input" in message
    os.link(lib, tmp_path / "hard.so")  # another name of the same file
    message = _refused(capsys, ["run", str(lib), "--inputs", str(directory / "in.npz"), "-o", str(tmp_path / "hard.so")])
    assert "hard.so" in message and "sub.so" in message
    os.symlink(model, tmp_path / "link.so")
    message = _refused(capsys, ["compile", str(model), "-o", str(tmp_path / "link.so")])
    assert "link.so" in message and "a link to" in message
    assert model.read_bytes() == model_bytes and lib.read_bytes() == lib_bytes


def test_devices_fifos_and_sockets_are_refused(sub, tmp_path, capsys):
    directory, _, _ = sub
    model = str(directory / "sub.onnx")
    message = _refused(capsys, ["compile", model, "-o", os.devnull])
    assert "/dev/null" in message and "character device" in message and "tvm-spinn report" in message
    message = _refused(capsys, ["run", str(directory / "sub.so"), "--inputs", str(directory / "in.npz"), "-o", os.devnull])
    assert "/dev/null" in message and "leave out -o" in message
    os.mkfifo(tmp_path / "pipe")
    message = _refused(capsys, ["compile", model, "-o", str(tmp_path / "pipe")])
    assert "pipe" in message and "FIFO" in message
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    try:
        with pytest.raises(_files.OutputPathError, match="socket"):
            _files.atomic_write(tmp_path / "sock", lambda f: f.write(b"x"))
    finally:
        sock.close()
    assert stat.S_ISFIFO(os.lstat(tmp_path / "pipe").st_mode) and stat.S_ISSOCK(os.lstat(tmp_path / "sock").st_mode)
    assert sorted(os.listdir(tmp_path)) == ["pipe", "sock"]  # no temporary left behind


def test_symlink_target_is_replaced_not_the_link(sub, tmp_path):
    directory, a, b = sub
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "out.npz"
    target.write_bytes(b"old")
    os.symlink(target, tmp_path / "out.npz")
    assert cli.main(["run", str(directory / "sub.so"), "--inputs", str(directory / "in.npz"),
                     "-o", str(tmp_path / "out.npz")]) == 0
    assert os.path.islink(tmp_path / "out.npz")
    np.testing.assert_array_equal(np.load(target)["diff"], a - b)  # named after the model's output
    # a dangling link: its target is created
    os.symlink(tmp_path / "real" / "lib.so", tmp_path / "lib.so")
    assert cli.main(["compile", str(directory / "sub.onnx"), "-o", str(tmp_path / "lib.so")]) == 0
    assert os.path.islink(tmp_path / "lib.so") and (tmp_path / "real" / "lib.so").stat().st_size > 0
    assert sorted(os.listdir(tmp_path / "real")) == ["lib.so", "out.npz"]


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")

    def fail(f):
        f.write(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _files.atomic_write(path, fail)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]
    _files.atomic_write(path, lambda f: f.write("ü".encode()))
    assert path.read_text(encoding="utf-8") == "ü"


# ---------------------------------------------------------------------------------- lazy imports
def _command(tmp_path, *args):
    """Run the console script (a file named tvm-spinn, as pip writes it); report which heavy
    modules the process imported."""
    script = tmp_path / "tvm-spinn"
    script.write_text(textwrap.dedent("""\
        import atexit, sys
        atexit.register(lambda: sys.stderr.write(
            "\\nIMPORTED " + ",".join(m for m in ("torch", "tvm", "onnx") if m in sys.modules) + "\\n"))
        from tvm_spinn.cli import main
        sys.exit(main())
    """))
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120, env=env)
    imported = proc.stderr.rsplit("IMPORTED ", 1)[1].strip()
    return proc, imported.split(",") if imported else []


GPT2_XL = os.path.join(PYTHON_DIR, "tvm_spinn", "llm", "configs", "gpt2-xl.json")


def test_help_and_argument_errors_import_neither_torch_nor_tvm(tmp_path):
    save_sub_onnx(tmp_path / "m.onnx", output="diff")
    cases = [
        (["--help"], 0, "compile"),
        (["compile", "--help"], 0, "spinn/cloud"),
        (["compile", str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "x.so")], 2, "does not exist"),
        (["compile", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "x.so"), "--bogus"], 2, "unrecognized"),
        (["compile", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "x.so"), "--target", "spinn/nope"], 2,
         "spinn/board"),
        (["compile", str(tmp_path / "m.onnx"), "-o", os.devnull], 2, "/dev/null"),
        (["compile", str(tmp_path / "m.onnx"), "--shape", "x=1,a", "-o", str(tmp_path / "x.so")], 2, "--shape"),
        (["compile", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "x.so"), "--tuning-logs",
          str(tmp_path / "nologs")], 2, "nologs"),
        (["run", str(tmp_path / "none.so"), "--inputs", "in.npz"], 2, "none.so"),
        (["plan", str(tmp_path / "bad.json")], 2, "model_type"),
        (["plan", "--train", str(tmp_path / "bad.json")], 2, "model_type"),
        (["plan", GPT2_XL, "--zero", "1"], 2, "--zero applies to training plans"),
        (["plan", "--train", GPT2_XL, "--tp", "0"], 2, "--tp must be a positive integer"),
    ]
    (tmp_path / "bad.json").write_text('{"model_type": "mamba"}')
    for argv, rc, expect in cases:
        proc, imported = _command(tmp_path, *argv)
        assert proc.returncode == rc, (argv, proc.stderr[-2000:])
        assert expect in proc.stdout + proc.stderr, (argv, proc.stdout, proc.stderr)
        assert "torch" not in imported and "tvm" not in imported, (argv, imported)
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "x.so").exists()


def test_module_form_defers_imports_too(tmp_path):
    """``python [options] -m tvm_spinn.cli``: -X importtime lists every module imported."""
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for argv in (["--help"], ["compile", str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "x.so")]):
        proc = subprocess.run([sys.executable, "-u", "-X", "importtime", "-m", "tvm_spinn.cli", *argv],
                              capture_output=True, text=True, timeout=120, env=env)
        modules = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
        assert "tvm_spinn" in modules and not modules & {"torch", "tvm", "onnx"}, argv


@pytest.mark.parametrize("argv, orig, deferred", [
    (["/venv/bin/tvm-spinn", "--help"], ["python", "/venv/bin/tvm-spinn", "--help"], True),
    (["/x/cli.py", "--help"], ["python", "-X", "importtime", "-u", "-m", "tvm_spinn.cli", "--help"], True),
    (["-c", "-m", "tvm_spinn.cli"], ["python", "-c", "import tvm_spinn", "-m", "tvm_spinn.cli"], False),
    (["job.py", "-m", "tvm_spinn.cli"], ["python", "job.py", "-m", "tvm_spinn.cli"], False),
    (["/x/pytest"], ["python", "-m", "pytest"], False),
])
def test_only_the_command_defers_the_package_import(monkeypatch, argv, orig, deferred):
    import tvm_spinn

    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig)
    assert tvm_spinn._deferred() is deferred


def test_help_lists_every_registered_target():
    import tvm_spinn

    assert sorted(cli.TARGETS) == tvm_spinn.known_targets()
    text = cli.build_parser()._subparsers._group_actions[0].choices["compile"].format_help()
    assert all(t in " ".join(text.split()) for t in cli.TARGETS)


# ------------------------------------------------------------------------- formats, names, refusals
def test_torch_export_program_compiles_and_runs_with_output_names(tmp_path):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    x = torch.randn(2, 4)
    torch.export.save(torch.export.export(model, (x,)), str(tmp_path / "m.pt2"))
    assert cli.main(["compile", str(tmp_path / "m.pt2"), "-o", str(tmp_path / "m.so")]) == 0
    np.save(tmp_path / "x.npy", x.numpy())
    assert cli.main(["run", str(tmp_path / "m.so"), "--inputs", str(tmp_path / "x.npy"), "-o", str(tmp_path / "o.npz")]) == 0
    out = np.load(tmp_path / "o.npz")
    assert list(out) == ["relu"]
    np.testing.assert_allclose(out["relu"], model(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    (tmp_path / "bad.pt2").write_bytes(b"not a zip")
    assert cli.main(["compile", str(tmp_path / "bad.pt2"), "-o", str(tmp_path / "b.so")]) == 2
    assert not (tmp_path / "b.so").exists()


def test_tflite_model_compiles_with_shape_and_dtype_options(tmp_path, capsys):
    pytest.importorskip("tflite")
    tf = pytest.importorskip("tensorflow")
    inp = tf.keras.Input((5,), batch_size=1, name="x")
    model = tf.keras.Model(inp, tf.keras.layers.Dense(3, activation="relu", name="dense")(inp))
    buf = tf.lite.TFLiteConverter.from_keras_model(model).convert()
    (tmp_path / "m.tflite").write_bytes(buf)
    assert cli.main(["compile", str(tmp_path / "m.tflite"), "-o", str(tmp_path / "m.so")]) == 0
    x = np.random.default_rng(0).normal(size=(1, 5)).astype("float32")
    np.save(tmp_path / "x.npy", x)
    assert cli.main(["run", str(tmp_path / "m.so"), "--inputs", str(tmp_path / "x.npy"), "-o", str(tmp_path / "o.npz")]) == 0
    out = np.load(tmp_path / "o.npz")
    np.testing.assert_allclose(out[list(out)[0]], model(x).numpy(), rtol=1e-5, atol=1e-5)
    assert list(out)[0] != "output0"
    message = _refused(capsys, ["compile", str(tmp_path / "m.tflite"), "--dtype", "x=float32x",
                                "-o", str(tmp_path / "n.so")])
    assert "--dtype" in message


def test_report_target_is_honoured_or_refused(sub, capsys):
    directory, _, _ = sub
    message = _refused(capsys, ["report", str(directory / "sub.so"), "--target", "spinn/board"])
    assert "--target" in message and "compiled library" in message
    capsys.readouterr()
    assert cli.main(["report", str(directory / "sub.onnx"), "--target", "spinn/testchip"]) == 0
    testchip = capsys.readouterr().out
    assert cli.main(["report", str(directory / "sub.onnx"), "--target", "spinn"]) == 0
    production = capsys.readouterr().out
    assert "testchip" in testchip and "testchip" not in production


def test_nonexistent_onnx_opset_is_refused(tmp_path, capsys):
    import onnx

    import tvm_spinn

    save_sub_onnx(tmp_path / "m99.onnx", output="diff", opset=99)
    with pytest.raises(tvm_spinn.frontend.OnnxImportError, match=f"opset 99.*1 to {onnx.defs.onnx_opset_version()}"):
        tvm_spinn.frontend.from_onnx(str(tmp_path / "m99.onnx"))
    assert "opset 99" in _refused(capsys, ["compile", str(tmp_path / "m99.onnx"), "-o", str(tmp_path / "x.so")])
    assert not (tmp_path / "x.so").exists()


def test_compile_is_quiet_unless_verbose(tmp_path):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)).eval()
    torch.onnx.export(model, (torch.randn(1, 8),), str(tmp_path / "m.onnx"), dynamo=False,
                      input_names=["x"], opset_version=17)
    proc = subprocess.run([sys.executable, "-m", "tvm_spinn.cli", "compile", str(tmp_path / "m.onnx"),
                           "-o", str(tmp_path / "m.so")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]


def test_torch_onnx_export_default_exporter_works(tmp_path):
    """The extras install onnxscript: torch.onnx.export's default (dynamo) path, then the CLI."""
    pytest.importorskip("onnxscript")
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    torch.onnx.export(model, (torch.randn(2, 4),), str(tmp_path / "m.onnx"), input_names=["x"],
                      output_names=["y"])
    assert cli.main(["compile", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.so")]) == 0


def test_from_pytorch_keeps_the_callers_training_mode():
    import torch

    import tvm_spinn

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 2))
    model.train()
    model[2].eval()  # a mixed state is restored module by module
    before = [m.training for m in model.modules()]
    tvm_spinn.frontend.from_pytorch(model, (torch.randn(1, 4),))
    assert [m.training for m in model.modules()] == before == [True, True, True, False]


def test_quiet_hides_library_chatter_unless_verbose():
    import logging
    import warnings

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    logger = logging.getLogger("tvm_spinn.partition")
    logger.addHandler(handler)
    try:
        for verbose in (False, True):
            seen.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with cli._quiet(verbose):
                    logger.warning("spinn: op stays on the fallback target")
                    warnings.warn("per-export chatter", FutureWarning)
                    warnings.warn("a tuning task was skipped", UserWarning)  # tvm-spinn's own: kept
            kinds = sorted(w.category.__name__ for w in caught)
            if verbose:
                assert seen and kinds == ["FutureWarning", "UserWarning"]
            else:
                assert not seen and kinds == ["UserWarning"]
    finally:
        logger.removeHandler(handler)
    assert logger.level == logging.NOTSET  # restored


def test_outputs_to_unicode_paths_and_concurrent_writers(tmp_path):
    import threading

    path = tmp_path / "ausgabe-é中.bin"
    payloads = [bytes([i]) * 200_000 for i in range(8)]
    threads = [threading.Thread(target=_files.atomic_write, args=(path, lambda f, p=p: f.write(p)))
               for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.read_bytes() in payloads  # one writer's complete file, never a mix
    assert os.listdir(tmp_path) == [path.name]
