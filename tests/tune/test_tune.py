"""Tuning the fallback: logs, resume, applying logs, robustness, RPC measurement, CLI."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.tune import TuningLogError, TuningWarning, validate_logs
from tvm_spinn.tune.database import DEFAULTS_DIR, MANIFEST_FILE, RECORD_FILE, WORKLOAD_FILE

from models import make

LLVM = tvm.target.Target({"kind": "llvm", "num-cores": os.cpu_count() or 1})
TRIALS = 2


def _mlp():
    model, x = make("mlp")
    return tvm_spinn.frontend.from_pytorch(model, (x,)), x.numpy()


def _tiny():
    """Two fallback tasks on llvm: fused_matmul_add and softmax."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Softmax(dim=-1)).eval()
    x = torch.randn(4, 16)
    return tvm_spinn.frontend.from_pytorch(model, (x,)), x.numpy()


def _run(ex, x):
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """MLP (4 fallback tasks on llvm): an 'interrupted' run of 2 tasks, then the full job."""
    mod, x = _mlp()
    work = str(tmp_path_factory.mktemp("tune") / "logs")
    first = tvm_spinn.tune(mod, target=LLVM, work_dir=work, max_trials=2 * TRIALS,
                           max_trials_per_task=TRIALS, num_trials_per_iter=TRIALS, seed=1)
    with open(os.path.join(work, RECORD_FILE), "rb") as f:
        records_after_first = f.read()
    second = tvm_spinn.tune(mod, target=LLVM, work_dir=work, max_trials_per_task=TRIALS,
                            num_trials_per_iter=TRIALS, seed=1)
    return {"mod": mod, "x": x, "work": work, "first": first, "second": second,
            "records_after_first": records_after_first}


def test_tune_writes_logs_and_manifest(tuned):
    work = tuned["work"]
    for name in (WORKLOAD_FILE, RECORD_FILE, MANIFEST_FILE, "logs"):
        assert os.path.exists(os.path.join(work, name)), name
    manifest = json.load(open(os.path.join(work, MANIFEST_FILE)))
    assert manifest["tvm_version"] == tvm.__version__ and manifest["target_kind"] == "llvm"
    assert tuned["first"].model_hash in manifest["models"]
    assert validate_logs(work, "llvm")["records"] == 4 * TRIALS
    # and each task's default schedule, measured once, in a database of its own
    assert validate_logs(os.path.join(work, DEFAULTS_DIR), "llvm")["records"] == 4
    assert all(t.default_latency_us > 0 and t.default_rule for t in tuned["second"].tasks)
    table = tuned["second"].table()
    assert "FLOP" in table and "latency" in table and "softmax" in table


def test_resume_does_not_repeat_finished_trials(tuned):
    first, second = tuned["first"], tuned["second"]
    assert first.new_trials == 2 * TRIALS
    done_first = {t.name: t.trials for t in first.tasks if t.trials}
    assert len(done_first) == 2
    by_name = {t.name: t for t in second.tasks}
    for name, trials in done_first.items():
        assert by_name[name].trials == trials and by_name[name].new_trials == 0
    assert second.new_trials == 2 * TRIALS
    assert all(t.trials == TRIALS for t in second.tasks)
    # existing records were appended to, never rewritten
    with open(os.path.join(tuned["work"], RECORD_FILE), "rb") as f:
        assert f.read().startswith(tuned["records_after_first"])
    third = tvm_spinn.tune(tuned["mod"], target=LLVM, work_dir=tuned["work"], max_trials_per_task=TRIALS)
    assert third.new_trials == 0 and all(t.status == "resumed" for t in third.tasks)


def test_build_with_tuning_logs_matches_untuned(tuned):
    mod, x = tuned["mod"], tuned["x"]
    ref = _run(relax.build(mod, target=LLVM), x)
    with tvm_spinn.build_options(tuning_logs=tuned["work"]):
        ex = relax.build(mod, target=LLVM)
    np.testing.assert_allclose(_run(ex, x), ref, rtol=1e-4, atol=1e-5)
    with tvm_spinn.build_options(tuning_logs=tuned["work"]):
        ex = relax.build(mod, target="spinn")  # spinn: the fallback (softmax) uses the logs
    np.testing.assert_allclose(_run(ex, x), ref, rtol=1e-3, atol=1e-4)


def test_logs_tuned_for_another_cpu_apply_and_another_kind_is_refused(tuned):
    """The spinn tags compile the fallback for this host's CPU (-mcpu); logs tuned for the same
    target kind on another CPU (here plain llvm: generic x86-64) are still applied, exactly as
    recorded (what the manifest chose), while another target kind stays a TuningLogError."""
    from tvm.target.codegen import llvm_get_system_cpu

    from tvm_spinn._tuning_db import task_choices

    spinn = tvm.target.Target("spinn")
    assert "mcpu" not in LLVM.attrs and tvm_spinn.host_target().attrs.get("mcpu") == spinn.attrs.get("mcpu")
    if llvm_get_system_cpu() not in ("", "generic") and not os.environ.get("TVM_SPINN_HOST_MCPU"):
        assert spinn.attrs["mcpu"] == llvm_get_system_cpu()
    mod, x = tuned["mod"], tuned["x"]
    choices, _ = task_choices(tuned["work"])
    assert choices and all(e["use"] in ("default", "tuned") for e in choices.values())
    ref = _run(relax.build(mod, target=LLVM), x)
    with tvm_spinn.build_options(tuning_logs=tuned["work"]):
        ex = relax.build(mod, target=tvm_spinn.host_target())
    np.testing.assert_allclose(_run(ex, x), ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(TuningLogError, match="logs were tuned for"):
        tvm_spinn.tune(mod, target="spinn/cuda", work_dir=tuned["work"])


def test_host_mcpu_is_overridable_and_checked(monkeypatch, register_system):
    from tvm_spinn.target.arch import CHIPS
    from tvm_spinn.target.registry import HOST_MCPU_ENV, host_mcpu

    monkeypatch.setenv(HOST_MCPU_ENV, "")
    assert host_mcpu() == "" and "mcpu" not in tvm_spinn.host_target().attrs
    monkeypatch.setenv(HOST_MCPU_ENV, "skylake")
    assert host_mcpu() == "skylake" and tvm_spinn.host_target().attrs["mcpu"] == "skylake"
    monkeypatch.setenv(HOST_MCPU_ENV, "no-such-cpu")
    with pytest.raises(ValueError, match=rf"\${HOST_MCPU_ENV} names CPU 'no-such-cpu'"):
        host_mcpu()
    monkeypatch.delenv(HOST_MCPU_ENV)
    tag = register_system(CHIPS["production"].replace(name="spinn2-generic-host"), tag="spinn/test-generic-host",
                          host_mcpu="")
    assert "mcpu" not in tvm.target.Target(tag).attrs  # portable host code, on request


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_corrupt_and_foreign_logs_name_file_and_line(tuned, tmp_path):
    mod, _ = tuned["mod"], tuned["x"]
    bad = _copy(tuned["work"], tmp_path / "corrupt")
    path = os.path.join(bad, RECORD_FILE)
    lines = open(path, "rb").read().split(b"\n")
    lines[2] = lines[2][: len(lines[2]) // 2]
    damaged = b"\n".join(lines)
    open(path, "wb").write(damaged)
    with pytest.raises(TuningLogError, match=rf"{RECORD_FILE}:3: corrupt"):
        with tvm_spinn.build_options(tuning_logs=bad):
            relax.build(mod, target=LLVM)
    with pytest.raises(TuningLogError, match=rf"{RECORD_FILE}:3"):
        tvm_spinn.tune(mod, target=LLVM, work_dir=bad, max_trials_per_task=TRIALS + 1)
    assert open(path, "rb").read() == damaged  # never rewritten

    foreign = _copy(tuned["work"], tmp_path / "foreign")
    path = os.path.join(foreign, RECORD_FILE)
    first = json.loads(open(path).readline())
    first[1][2] = {"kind": "cuda", "arch": "sm_80"}
    with open(path, "a") as f:
        f.write(json.dumps(first) + "\n")
    n = len(open(path).read().splitlines())
    with pytest.raises(TuningLogError, match=rf"{RECORD_FILE}:{n}: .*'cuda'"):
        with tvm_spinn.build_options(tuning_logs=foreign):
            relax.build(mod, target=LLVM)

    # logs of another model (none of its tasks): an error, not a silently untuned build
    tiny, _ = _tiny()
    with pytest.raises(TuningLogError, match=rf"{WORKLOAD_FILE}: .*cover none of this model's 2 fallback "
                                             r"functions .*another model"):
        with tvm_spinn.build_options(tuning_logs=tuned["work"]):
            relax.build(tiny, target=LLVM)
    # the measured default schedules are validated like the logs
    foreign = _copy(tuned["work"], tmp_path / "foreign_defaults")
    path = os.path.join(foreign, DEFAULTS_DIR, RECORD_FILE)
    first = json.loads(open(path).readline())
    first[1][2] = {"kind": "cuda", "arch": "sm_80"}
    with open(path, "a") as f:
        f.write(json.dumps(first) + "\n")
    with pytest.raises(TuningLogError, match=rf"{DEFAULTS_DIR}/{RECORD_FILE}:\d+: .*'cuda'"):
        with tvm_spinn.build_options(tuning_logs=foreign):
            relax.build(mod, target=LLVM)

    other = tmp_path / "other"
    other.mkdir()
    (other / WORKLOAD_FILE).write_text('{"not": "metaschedule"}\n')
    (other / RECORD_FILE).write_text("")
    with pytest.raises(TuningLogError, match=rf"{WORKLOAD_FILE}:1"):
        with tvm_spinn.build_options(tuning_logs=str(other)):
            relax.build(mod, target=LLVM)
    with pytest.raises(TuningLogError, match="missing"):
        with tvm_spinn.build_options(tuning_logs=str(tmp_path)):
            relax.build(mod, target=LLVM)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tvm_spinn.build_options(tuning_logs=str(tmp_path / "nope"))


# the refusal is also the last check of test_logs_tuned_for_another_cpu_apply_and_another_kind_is_refused
@pytest.mark.slow
def test_logs_for_another_target_kind_are_refused(tuned):
    with pytest.raises(TuningLogError, match=r"tvm_spinn_tuning.json:1: logs were tuned for"):
        tvm_spinn.tune(tuned["mod"], target="spinn/cuda", work_dir=tuned["work"])


def test_bad_arguments_raise_clear_errors(tmp_path):
    mod, _ = _mlp()
    with pytest.raises(ValueError, match="max_trials_per_task"):
        tvm_spinn.tune(mod, target=LLVM, work_dir=str(tmp_path), max_trials_per_task=0)
    with pytest.raises(ValueError, match="both rpc_tracker"):
        tvm_spinn.tune(mod, target=LLVM, work_dir=str(tmp_path), rpc_tracker="127.0.0.1:9190")
    with pytest.raises(ValueError, match="bad RPC tracker address"):
        tvm_spinn.tune(mod, target=LLVM, work_dir=str(tmp_path), rpc_tracker="nohost", rpc_key="k")
    with pytest.raises(ValueError, match="unknown spinn target"):
        tvm_spinn.tune(mod, target="spinn/nope", work_dir=str(tmp_path))
    with pytest.raises(TypeError, match="Relax IRModule"):
        tvm_spinn.tune("model.onnx", target=LLVM, work_dir=str(tmp_path))
    with pytest.raises(TypeError, match="runner"):
        tvm_spinn.tune(mod, target=LLVM, work_dir=str(tmp_path), runner="local")


def test_task_whose_schedules_all_fail_is_skipped(tmp_path):
    from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
    from tvm.ir.utils import derived_object

    from tvm_spinn.tune.builder import InProcessBuilder

    good = InProcessBuilder()

    @derived_object
    class FailSoftmax(PyBuilder):
        def build(self, build_inputs):
            out = []
            for item in build_inputs:
                if "T_softmax" in item.mod.script():
                    out.append(BuilderResult(None, "injected failure"))
                else:
                    out.extend(good.build([item]))
            return out

    mod, x = _tiny()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = tvm_spinn.tune(mod, target=LLVM, work_dir=str(tmp_path / "w"), max_trials_per_task=2,
                                num_trials_per_iter=2, builder=FailSoftmax(), runner=_in_process_runner())
    status = {t.name: t.status for t in result.tasks}
    assert status["softmax"] == "skipped" and list(status.values()).count("tuned") == 1
    # the reason is the candidates' own error, in the warning, the result and the task's log
    assert "injected failure" in next(t.reason for t in result.tasks if t.name == "softmax")
    assert "softmax skipped: " in result.table() and "injected failure" in result.table()
    assert any(issubclass(w.category, TuningWarning) and "softmax" in str(w.message)
               and "injected failure" in str(w.message) for w in caught)
    log = [p for p in os.listdir(tmp_path / "w" / "logs") if "softmax" in p]
    assert "injected failure" in (tmp_path / "w" / "logs" / log[0]).read_text()
    # its failed records are never applied: MetaSchedule has no valid record for it
    db = tvm.s_tir.meta_schedule.database.JSONDatabase(work_dir=str(tmp_path / "w"))
    failed = [r.workload for r in db.get_all_tuning_records() if "T_softmax" in r.workload.mod.script()]
    assert failed and not db.get_top_k(failed[0], 1)
    with tvm_spinn.build_options(tuning_logs=str(tmp_path / "w")):
        ex = relax.build(mod, target=LLVM)  # softmax keeps its default schedule
    np.testing.assert_allclose(_run(ex, x), _run(relax.build(mod, target=LLVM), x), rtol=1e-4, atol=1e-5)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args, log):
    return subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(proc):
    """Stop a process started by _start and its children (RPC servers fork popen workers)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)  # its own session: the group is exactly its processes
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=10)
            if sig == signal.SIGTERM:
                time.sleep(0.5)  # let the children see it too before the SIGKILL sweep
        except subprocess.TimeoutExpired:
            continue


@pytest.mark.slow  # ~30-45 s: a tracker and two servers, each a fresh interpreter importing TVM;
# the RPC arguments' errors are test_bad_arguments_raise_clear_errors, and the fixture's jobs
# measure with MetaSchedule's real LocalRunner
@pytest.mark.timeout(300)
def test_tuning_through_rpc_tracker_and_two_servers(tmp_path):
    from tvm_spinn.tune.runner import tracker_servers

    port = _free_port()
    tracker_addr = f"127.0.0.1:{port}"
    procs = []
    log = open(tmp_path / "rpc.log", "w")
    try:
        procs.append(_start(["tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
                             "--port-end", str(port + 1)], log))
        time.sleep(1.0)
        for _ in range(2):
            server_port = _free_port()
            procs.append(_start(["tvm.exec.rpc_server", "--host", "127.0.0.1", "--port", str(server_port),
                                 "--port-end", str(server_port + 50), "--tracker", tracker_addr,
                                 "--key", "spinn-test"], log))
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                if tracker_servers("127.0.0.1", port, "spinn-test") >= 2:
                    break
            except Exception:  # noqa: BLE001  (tracker still starting)
                pass
            assert all(p.poll() is None for p in procs), open(tmp_path / "rpc.log").read()[-2000:]
            time.sleep(0.5)
        else:
            pytest.fail("RPC servers did not register: " + open(tmp_path / "rpc.log").read()[-2000:])
        mod, x = _tiny()
        work = str(tmp_path / "rpc_logs")
        result = tvm_spinn.tune(mod, target=LLVM, work_dir=work, max_trials_per_task=2, num_trials_per_iter=2,
                                rpc_tracker=tracker_addr, rpc_key="spinn-test")
        assert all(t.status == "tuned" and t.best_latency_us is not None for t in result.tasks), result.table()
        with tvm_spinn.build_options(tuning_logs=work):
            ex = relax.build(mod, target=LLVM)
        np.testing.assert_allclose(_run(ex, x), _run(relax.build(mod, target=LLVM), x), rtol=1e-4, atol=1e-5)
    finally:
        for proc in reversed(procs):
            _stop(proc)
        log.close()
    assert all(p.poll() is not None for p in procs)


@pytest.mark.slow
def test_cli_tune_then_compile_with_logs(tmp_path):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Softmax(dim=0)).eval()
    x = torch.randn(4, 16)
    onnx_path = tmp_path / "tiny.onnx"
    torch.onnx.export(model, (x,), str(onnx_path), dynamo=False, input_names=["x"], opset_version=17)
    work = tmp_path / "logs"
    cmd = [sys.executable, "-m", "tvm_spinn.cli"]
    proc = subprocess.run(cmd + ["tune", str(onnx_path), "--target", "spinn", "--work-dir", str(work),
                                 "--trials", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FLOP" in proc.stdout and "softmax" in proc.stdout and "trial" in proc.stderr
    lib = tmp_path / "tiny.so"
    proc = subprocess.run(cmd + ["compile", str(onnx_path), "--target", "spinn", "-o", str(lib),
                                 "--tuning-logs", str(work)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and lib.exists(), proc.stderr[-3000:]
    proc = subprocess.run(cmd + ["compile", str(onnx_path), "-o", str(lib), "--tuning-logs",
                                 str(tmp_path / "none")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_job_resumes_from_its_logs(tmp_path):
    """Kill a tuning process mid-way; the next run keeps every record and only tops up."""
    work = tmp_path / "logs"
    script = tmp_path / "job.py"
    script.write_text(
        "import sys\n"
        f"sys.path[:0] = [{os.path.dirname(os.path.abspath(__file__))!r}, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r}]\n"
        "import test_tune, tvm_spinn\n"
        "mod, _ = test_tune._mlp()\n"
        f"tvm_spinn.tune(mod, target=test_tune.LLVM, work_dir={str(work)!r}, max_trials_per_task=4,"
        " num_trials_per_iter=2)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    records = work / RECORD_FILE
    try:
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None:
            if records.exists() and len(records.read_bytes().splitlines()) >= 4:
                break
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    before = records.read_bytes()
    n_before = len(before.splitlines())
    assert 4 <= n_before < 16, n_before
    mod, _ = _mlp()
    result = tvm_spinn.tune(mod, target=LLVM, work_dir=str(work), max_trials_per_task=4, num_trials_per_iter=2)
    after = records.read_bytes()
    assert after.startswith(before) and len(after.splitlines()) == 16
    assert result.new_trials == 16 - n_before


def _in_process_runner():
    """A runner that measures in this process.

    MetaSchedule's LocalRunner starts worker processes that each import TVM (seconds of CPU),
    which would dominate these small tests; their subject (logging, interrupts, bookkeeping)
    does not depend on where candidates run. The real LocalRunner is covered by the fixture and
    the slow CLI tests.
    """
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, PyRunner, RunnerFuture, RunnerResult
    from tvm.s_tir.meta_schedule.runner.local_runner import default_alloc_argument, default_run_evaluator

    config = EvaluatorConfig(number=1, repeat=1, min_repeat_ms=0, enable_cpu_cache_flush=False)

    @derived_object
    class InProcessRunner(PyRunner):
        def run(self, runner_inputs):
            futures = []
            for item in runner_inputs:
                try:
                    device = tvm.cpu()
                    args = default_alloc_argument(device, [a.as_json() for a in item.args_info], 1)
                    costs = default_run_evaluator(tvm.runtime.load_module(item.artifact_path), device,
                                                  config, args)
                    result = RunnerResult(costs, None)
                except Exception as err:  # noqa: BLE001  (a failed candidate, as LocalRunner reports it)
                    result = RunnerResult(None, f"InProcessRunner: {err}")
                futures.append(RunnerFuture(lambda: True, lambda result=result: result))
            return futures

    return InProcessRunner()


def _abs_model():
    """On spinn the Linear is offloaded; the fallback is one task, tir_abs, with one schedule."""
    import torch

    torch.manual_seed(0)

    class LinearAbs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, x):
            return torch.abs(self.linear(x))

    return tvm_spinn.frontend.from_pytorch(LinearAbs().eval(), (torch.randn(4, 16),))


@pytest.mark.timeout(300)
@pytest.mark.slow  # ~20 s: two tuning jobs in one process; a job's own logs are checked by test_tune_writes_logs_and_manifest
def test_jobs_in_one_process_do_not_share_logging_state(tmp_path):
    """Issue 10: MetaSchedule's dictConfig loggers broke every later tune() in the process.

    In a fresh interpreter: a first job, then a handler without a name on the
    ``tvm.s_tir.meta_schedule`` logger (as log-capture tools add), then more jobs. The jobs
    must neither crash on it nor touch the process's logging, nor print MetaSchedule lines;
    a finished job (its search space ran out) must do nothing, however often it is re-run.
    """
    work = tmp_path / "logs"
    script = tmp_path / "job.py"
    script.write_text(
        "import io, logging, sys\n"
        f"sys.path[:0] = [{os.path.dirname(os.path.abspath(__file__))!r}, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r}]\n"
        "import test_tune, tvm_spinn\n"
        "mod = test_tune._abs_model()\n"
        "ms_logger = logging.getLogger('tvm.s_tir.meta_schedule')\n"
        f"kw = dict(target='spinn', work_dir={str(work)!r}, max_trials_per_task=2, num_trials_per_iter=2,"
        " runner=test_tune._in_process_runner())\n"
        "first = tvm_spinn.tune(mod, **kw)\n"
        "records = open(first.work_dir + '/database_tuning_record.json', 'rb').read()\n"
        "unnamed = logging.StreamHandler(io.StringIO())\n"
        "ms_logger.addHandler(unnamed)\n"
        "again = [tvm_spinn.tune(mod, **kw) for _ in range(2)]\n"
        "assert ms_logger.handlers == [unnamed], ms_logger.handlers\n"
        "assert open(first.work_dir + '/database_tuning_record.json', 'rb').read() == records\n"
        "print('RESULT', [(t.name, t.trials, t.status) for t in first.tasks],"
        " [(r.new_trials, [t.status for t in r.tasks]) for r in again])\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT [('tir_abs', 1, 'tuned')] [(0, ['resumed']), (0, ['resumed'])]" in proc.stdout, proc.stdout
    assert "[INFO]" not in proc.stdout + proc.stderr  # MetaSchedule's lines go to work_dir/logs only
    assert "search space exhausted" in (work / "logs" / "task_0_tir_abs.log").read_text()


def test_sigint_stops_the_job_and_it_resumes(tmp_path):
    """Ctrl-C while the second task builds: KeyboardInterrupt at once, no failed record, resumable."""
    from tvm.s_tir.meta_schedule.builder import PyBuilder
    from tvm.ir.utils import derived_object

    from tvm_spinn.tune.builder import InProcessBuilder

    good = InProcessBuilder()
    calls = []

    @derived_object
    class CtrlCOnSecondBatch(PyBuilder):
        def build(self, build_inputs):
            calls.append(len(build_inputs))
            # calls: the default schedules of both tasks (one batch), then one batch per task
            if len(calls) == 3:  # as if the user pressed Ctrl-C while this batch builds
                os.kill(os.getpid(), signal.SIGINT)
            return good.build(build_inputs)

    mod, _ = _tiny()
    work = tmp_path / "w"
    runner = _in_process_runner()
    kw = dict(target=LLVM, work_dir=str(work), max_trials_per_task=1, num_trials_per_iter=1, runner=runner)
    previous = signal.getsignal(signal.SIGINT)  # SIG_IGN in a background job, else Python's
    with pytest.raises(KeyboardInterrupt):
        tvm_spinn.tune(mod, builder=CtrlCOnSecondBatch(), **kw)
    assert signal.getsignal(signal.SIGINT) is previous  # handler restored
    assert calls == [2, 1, 1]  # stopped at once: no further batch
    before = (work / RECORD_FILE).read_bytes()
    records = [json.loads(line) for line in before.splitlines()]
    assert len(records) == 1  # the first batch only; the interrupted one is dropped
    assert all(max(r[1][1]) < 1e9 for r in records)  # no 1e10 "failed" record
    assert validate_logs(str(work), "llvm") == {"workloads": 2, "records": 1}
    result = tvm_spinn.tune(mod, **kw)
    after = (work / RECORD_FILE).read_bytes()
    assert after.startswith(before) and result.new_trials == 1  # only the interrupted task
    assert [(t.trials, t.status) for t in result.tasks] == [(1, "resumed"), (1, "tuned")]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_ctrl_c_exits_nonzero_keeps_valid_logs_and_resumes(tmp_path):
    """Ctrl-C at a terminal (SIGINT to the whole process group) during ``tvm-spinn tune``."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Softmax(dim=-1)).eval()
    onnx_path = tmp_path / "tiny.onnx"
    torch.onnx.export(model, (torch.randn(4, 16),), str(onnx_path), dynamo=False, input_names=["x"],
                      opset_version=17)
    work = tmp_path / "logs"
    cmd = [sys.executable, "-m", "tvm_spinn.cli", "tune", str(onnx_path), "--target", "llvm",
           "--work-dir", str(work), "--trials", "3", "--no-progress"]
    out, err = open(tmp_path / "out.txt", "w"), open(tmp_path / "err.txt", "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
    records = work / RECORD_FILE
    try:
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None:
            if records.exists() and records.read_bytes().count(b"\n") >= 1:
                break  # the first task has measured a batch: the job is under way
            time.sleep(0.1)
        assert proc.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=60)  # "at once": no more tasks after the interrupt
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        out.close()
        err.close()
    stderr = (tmp_path / "err.txt").read_text()
    assert rc == 130 and "interrupted" in stderr, stderr[-3000:]
    assert "[INFO]" not in (tmp_path / "out.txt").read_text()
    before = records.read_bytes()
    assert all(max(json.loads(line)[1][1]) < 1e9 for line in before.splitlines())  # no 1e10 record
    assert validate_logs(str(work), "llvm")["records"] == len(before.splitlines()) < 6
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = records.read_bytes()
    assert after.startswith(before) and len(after.splitlines()) > len(before.splitlines())
    assert "resumed" in proc.stdout and "[INFO]" not in proc.stdout
