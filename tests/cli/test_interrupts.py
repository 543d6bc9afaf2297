"""Ctrl-C in the command line: one line on stderr, exit status 130, no output file."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tvm_spinn import cli

from models import make

CONFIG = os.path.join(os.path.dirname(cli.__file__), "llm", "configs", "llama-2-70b.json")


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ctrlc")
    model, x = make("mlp")
    torch.onnx.export(model, (x,), str(directory / "mlp.onnx"), dynamo=False, input_names=["x"], opset_version=17)
    rng = np.random.default_rng(0)
    np.save(directory / "calib.npy", rng.normal(size=(4,) + tuple(x.shape)).astype("float32"))
    return directory


def _interrupt(argv, cwd, delay):
    """Start the command, press Ctrl-C (SIGINT to its process group, as a terminal does) after
    ``delay`` seconds; ``(returncode, stderr)``, or None when it ended before the signal."""
    proc = subprocess.Popen([sys.executable, "-m", "tvm_spinn.cli", *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(delay)
    if proc.poll() is not None:
        proc.communicate()
        return None
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, err


@pytest.mark.parametrize("command", ["compile", pytest.param("quantize", marks=pytest.mark.slow),
                                     pytest.param("plan", marks=pytest.mark.slow),
                                     pytest.param("tune", marks=pytest.mark.slow)])
def test_ctrl_c_is_one_line_exit_130_and_no_output(mlp, tmp_path, tmp_path_factory, command):
    out = tmp_path / "out.bin"
    work = tmp_path_factory.mktemp("tune") / "logs"  # a tuning job keeps its logs: elsewhere
    argv = {"compile": ["compile", str(mlp / "mlp.onnx"), "-o", str(out)],
            "quantize": ["compile", str(mlp / "mlp.onnx"), "-o", str(out), "--quantize", str(mlp / "calib.npy")],
            "plan": ["plan", CONFIG, "--no-progress", "--json", str(out)],
            "tune": ["tune", str(mlp / "mlp.onnx"), "--target", "llvm", "--work-dir", str(work),
                     "--trials", "4", "--no-progress"]}[command]
    interrupted = 0
    delays = (1.0, 5.0, 20.0) if command == "tune" else (1.0, 5.0)  # tune: also while measuring
    for delay in delays:  # importing, then importing/compiling the model
        result = _interrupt(argv, tmp_path, delay)
        if result is None:
            out.unlink(missing_ok=True)  # it finished first: no interrupt to check at this point
            continue
        rc, err = result
        if rc == 0:  # it finished as the signal came: a complete output, the Ctrl-C ignored
            assert out.exists() or command == "tune", (delay, err[-3000:])
            out.unlink(missing_ok=True)
            continue
        interrupted += 1
        assert rc == 130, (delay, err[-3000:])
        assert err.strip().count("\n") == 0 and err.startswith("tvm-spinn: ") and "interrupted" in err, err[-3000:]
        assert os.listdir(tmp_path) == [], (delay, os.listdir(tmp_path))  # nor a temporary file
    assert interrupted >= 1


def test_swallowed_interrupt_still_exits_130_without_writing(mlp, tmp_path, monkeypatch, capsys):
    """TVM turns a KeyboardInterrupt raised in a Python callback into an error its C++ code may
    handle: a Ctrl-C that never surfaces must still stop the command before it writes."""
    from tvm import relax

    real_build = relax.build

    def build_swallowing_ctrl_c(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt:
            pass  # swallowed, as inside TVM
        return real_build(*args, **kwargs)

    monkeypatch.setattr(relax, "build", build_swallowing_ctrl_c)
    previous = signal.getsignal(signal.SIGINT)
    assert cli.main(["compile", str(mlp / "mlp.onnx"), "-o", str(tmp_path / "m.so")]) == 130
    assert signal.getsignal(signal.SIGINT) is previous
    err = capsys.readouterr().err
    assert err.strip() == "tvm-spinn: interrupted; no library written"
    assert os.listdir(tmp_path) == []


#: a command whose Ctrl-C lands inside ``exec`` of a string, as it does when it interrupts an
#: import that builds a dataclass; run with ``python -m``, as the test above runs the command
#: (a script or ``-c`` exits through another path that the mark does not reach)
_CTRL_C_IN_EXEC = """
import os, signal, sys
from tvm_spinn import cli

def ctrl_c_inside_exec(args):
    exec("import os, signal, time\\nos.kill(os.getpid(), signal.SIGINT)\\ntime.sleep(5)")

cli._check_args = ctrl_c_inside_exec
sys.exit(cli.main(["plan", "no-such-config.json"]))
"""


def test_ctrl_c_inside_exec_of_a_string_still_exits_130(tmp_path):
    (tmp_path / "ctrl_c_in_exec.py").write_text(_CTRL_C_IN_EXEC)
    proc = subprocess.run([sys.executable, "-m", "ctrl_c_in_exec"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr == "tvm-spinn: interrupted; nothing written\n"
