"""One tuning job per work directory: a second job is refused naming the first; logs that two
jobs wrote at once are refused by name instead of failing inside MetaSchedule."""

import json
import os
import socket
import subprocess
import sys

import pytest

import tvm_spinn
from tvm_spinn.tune import TuningLockError, TuningLogError, validate_logs
from tvm_spinn.tune.database import RECORD_FILE, WORKLOAD_FILE
from tvm_spinn.tune import lock as lock_module
from tvm_spinn.tune.lock import LOCK_FILE, WorkDirLock

LOCK_MODULE = lock_module.__file__


def _holder(work):
    """A process holding the work directory's lock until killed; returns it once it holds it."""
    # the lock module alone (standard library only): the holder starts in a moment
    code = ("import importlib.util, time\n"
            f"spec = importlib.util.spec_from_file_location('lock', {LOCK_MODULE!r})\n"
            "lock = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(lock)\n"
            f"with lock.WorkDirLock({str(work)!r}):\n"
            "    print('held', flush=True)\n"
            "    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_job_is_refused_naming_the_holder(tmp_path):
    work = tmp_path / "logs"
    proc = _holder(work)
    try:
        with pytest.raises(TuningLockError) as info:
            with WorkDirLock(str(work)):
                pass
        message = str(info.value)
        assert f"pid {proc.pid}" in message and socket.gethostname() in message and "started" in message
        assert str(work) in message
        # the job itself is refused before it measures (or writes) anything
        import torch

        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(dim=-1)).eval()
        mod = tvm_spinn.frontend.from_pytorch(model, (torch.randn(2, 4),))
        with pytest.raises(TuningLockError, match=f"pid {proc.pid}"):
            tvm_spinn.tune(mod, target="llvm", work_dir=str(work), max_trials_per_task=1)
        assert sorted(os.listdir(work)) == [LOCK_FILE]
    finally:
        proc.kill()
        proc.wait()
    with WorkDirLock(str(work)):  # the kernel dropped the killed holder's lock: no stale lock
        info = json.loads((work / LOCK_FILE).read_text())
        assert info["pid"] == os.getpid()


def test_two_jobs_in_one_process_are_refused(tmp_path):
    with WorkDirLock(str(tmp_path)):
        with pytest.raises(TuningLockError, match=f"pid {os.getpid()}"):
            with WorkDirLock(str(tmp_path)):
                pass
    with WorkDirLock(str(tmp_path)):
        pass


@pytest.mark.slow
def test_cli_tune_on_a_busy_work_dir_is_one_line(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9),
              str(tmp_path / "m.onnx"))
    work = tmp_path / "logs"
    proc = _holder(work)
    try:
        run = subprocess.run([sys.executable, "-m", "tvm_spinn.cli", "tune", str(tmp_path / "m.onnx"),
                              "--target", "llvm", "--work-dir", str(work), "--no-progress"],
                             capture_output=True, text=True, timeout=300)
    finally:
        proc.kill()
        proc.wait()
    assert run.returncode == 2 and f"pid {proc.pid}" in run.stderr, run.stderr[-2000:]
    assert run.stderr.strip().count("\n") == 0 and "Traceback" not in run.stderr


def test_logs_written_by_two_jobs_at_once_are_refused_by_name(tmp_path):
    """What two unlocked jobs leave: each workload twice, interleaved records."""
    workload = json.dumps(["0x1234", {"root": 1, "nodes": [], "b64ndarrays": []}])
    (tmp_path / WORKLOAD_FILE).write_text(workload + "\n" + workload + "\n")
    record = json.dumps([0, [[], [1.0e-6], {"kind": "llvm"}, None]])
    (tmp_path / RECORD_FILE).write_text(record + "\n" + record.replace("[0,", "[1,", 1) + "\n")
    with pytest.raises(TuningLogError, match=f"{WORKLOAD_FILE}:2: repeats the workload of line 1.*two tuning jobs"):
        validate_logs(str(tmp_path), "llvm")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_cli_jobs_on_one_work_dir_leave_loadable_logs(tmp_path):
    """Two `tvm-spinn tune` started together: one tunes, the other is refused naming it; the
    logs then load for a build (they held every workload twice before the lock)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Softmax(dim=-1)).eval()
    torch.onnx.export(model, (torch.randn(2, 8),), str(tmp_path / "m.onnx"), dynamo=False,
                      input_names=["x"], opset_version=17)
    work = tmp_path / "logs"
    cmd = [sys.executable, "-m", "tvm_spinn.cli", "tune", str(tmp_path / "m.onnx"), "--target", "llvm",
           "--work-dir", str(work), "--trials", "2", "--no-progress"]
    jobs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(job.pid, *job.communicate(timeout=800), job.returncode) for job in jobs]
    codes = sorted(rc for _, _, _, rc in results)
    assert codes == [0, 2], [(rc, err[-1500:]) for _, _, err, rc in results]
    (winner, _, _, _), = [r for r in results if r[3] == 0]
    refused = next(err for _, _, err, rc in results if rc == 2)
    assert f"pid {winner}" in refused and "in use by another tuning job" in refused
    assert validate_logs(str(work), "llvm")["records"] >= 2
    build = subprocess.run([sys.executable, "-m", "tvm_spinn.cli", "compile", str(tmp_path / "m.onnx"),
                            "--target", "llvm", "-o", str(tmp_path / "m.so"), "--tuning-logs", str(work)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
