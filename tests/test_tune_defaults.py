"""Tuning never makes a task slower: each task's default schedule is a measured candidate.

The selection is tested without timed asserts: runners that make one kind of candidate lose
deterministically (a fixed penalty on its measured time), and a real short search whose
outcome is read back from the logs (the applied schedule must be the minimum over all
candidates, the default's included).
"""

import os

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import PyBuilder
from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, PyRunner, RunnerFuture, RunnerResult
from tvm.s_tir.meta_schedule.runner.local_runner import default_alloc_argument, default_run_evaluator

import tvm_spinn
from tvm_spinn.fallback import default_schedule_pass, prepare_fallback
from tvm_spinn.tune import TuningWarning
from tvm_spinn.tune.builder import InProcessBuilder
from tvm_spinn.tune.database import DEFAULTS_DIR, apply_tuning_logs
from tvm_spinn.tune.tasks import extract_fallback_tasks

from models import make

LLVM = tvm.target.Target({"kind": "llvm", "num-cores": os.cpu_count() or 1})
PENALTY = 1e-2  # seconds: far above any of these kernels' latency (microseconds)


def _mlp():
    model, x = make("mlp")
    return tvm_spinn.frontend.from_pytorch(model, (x,)), x.numpy()


def _default_bodies(mod):
    """Task name -> body of its PrimFunc under the build's own default-schedule pass."""
    out = {}
    for task in extract_fallback_tasks(mod, LLVM):
        with LLVM:
            scheduled = default_schedule_pass(LLVM)(task.dispatched[0])
        out[task.task_name] = scheduled["main"].body
    return out


def _applied(mod, work):
    """Task name -> body of the PrimFunc a build with the logs in ``work`` uses."""
    with LLVM:
        prepared = prepare_fallback(mod)
    applied = apply_tuning_logs(prepared, work, LLVM)
    return {gv.name_hint: f.body for gv, f in applied.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


class _Measure:
    """Builder and runner pair, in process, adding PENALTY to one kind of candidate.

    ``lose="search"`` penalizes every candidate that is not a default schedule, ``"default"``
    the default schedules. Which is which is told from the module built (the default bodies
    computed above), not from how the job calls them.
    """

    def __init__(self, defaults, lose):
        self.defaults, self.lose, self.penalized = list(defaults.values()), lose, set()
        good = InProcessBuilder()
        outer = self

        @derived_object
        class Builder(PyBuilder):
            def build(self, build_inputs):
                results = good.build(build_inputs)
                for item, res in zip(build_inputs, results):
                    is_default = any(tvm_ffi.structural_equal(item.mod["main"].body, b) for b in outer.defaults)
                    if res.artifact_path and is_default == (outer.lose == "default"):
                        outer.penalized.add(res.artifact_path)
                return results

        config = EvaluatorConfig(number=1, repeat=1, min_repeat_ms=0, enable_cpu_cache_flush=False)

        @derived_object
        class Runner(PyRunner):
            def run(self, runner_inputs):
                futures = []
                for item in runner_inputs:
                    device = tvm.cpu()
                    args = default_alloc_argument(device, [a.as_json() for a in item.args_info], 1)
                    costs = default_run_evaluator(tvm.runtime.load_module(item.artifact_path), device,
                                                  config, args)
                    if item.artifact_path in outer.penalized:
                        costs = [c + PENALTY for c in costs]
                    futures.append(RunnerFuture(lambda: True, lambda r=RunnerResult(costs, None): r))
                return futures

        self.builder, self.runner = Builder(), Runner()


@pytest.fixture(scope="module")
def mlp():
    mod, x = _mlp()
    return mod, x, _default_bodies(mod)


@pytest.mark.parametrize("lose", ["search", pytest.param("default", marks=pytest.mark.slow)])
def test_build_applies_the_faster_of_default_and_search(mlp, tmp_path, lose):
    mod, x, defaults = mlp
    work = str(tmp_path / "logs")
    measure = _Measure(defaults, lose)
    result = tvm_spinn.tune(mod, target=LLVM, work_dir=work, max_trials_per_task=1,
                            num_trials_per_iter=1, builder=measure.builder, runner=measure.runner)
    assert measure.penalized  # the penalty was applied to something
    applied = _applied(mod, work)
    for task in result.tasks:
        assert task.default_latency_us is not None and task.best_latency_us is not None, task
        assert task.latency_us == min(task.default_latency_us, task.best_latency_us)
        is_default = tvm_ffi.structural_equal(applied[task.name], defaults[task.name])
        if lose == "search":  # the search's best is slower: the build keeps the default
            assert task.best_latency_us > task.default_latency_us and task.chosen == "default"
            assert is_default, task.name
        else:
            assert task.default_latency_us > task.best_latency_us and task.chosen == "tuned"
            assert not is_default, task.name
    assert ("default" if lose == "search" else "tuned") in result.table()
    if lose == "default":
        return  # the numbers of tuned schedules are checked in test_tune.py
    # same numbers as TVM's untuned build of the same module
    ref = relax.VirtualMachine(relax.build(mod, target=LLVM), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    with tvm_spinn.build_options(tuning_logs=work):
        ex = relax.build(mod, target=LLVM)
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def _mean(rec):
    return sum(float(s) for s in rec.run_secs) / len(rec.run_secs)


@pytest.mark.slow
def test_short_search_never_beats_the_measured_minimum(mlp, tmp_path):
    """One real trial per task: whatever the timings, each task's build uses the candidate with
    the lowest measured latency over the search's records and the default's record."""
    mod, _, defaults = mlp
    work = str(tmp_path / "logs")
    result = tvm_spinn.tune(mod, target=LLVM, work_dir=work, max_trials_per_task=1,
                            num_trials_per_iter=1, builder=InProcessBuilder(),
                            runner=_Measure({}, "none").runner)
    search = ms.database.JSONDatabase(work_dir=work)
    default_db = ms.database.JSONDatabase(work_dir=os.path.join(work, DEFAULTS_DIR))
    applied = _applied(mod, work)
    by_name = {t.task_name: t for t in extract_fallback_tasks(mod, LLVM)}
    for task in result.tasks:
        task_mod = by_name[task.name].dispatched[0]
        ours = [_mean(r) for r in default_db.get_all_tuning_records()
                if tvm_ffi.structural_equal(r.workload.mod, task_mod)]
        theirs = [_mean(r) for r in search.get_all_tuning_records()
                  if tvm_ffi.structural_equal(r.workload.mod, task_mod)]
        assert len(ours) == 1 and len(theirs) == task.trials >= 1
        assert task.default_latency_us == pytest.approx(ours[0] * 1e6)
        assert task.latency_us == pytest.approx(min(ours + theirs) * 1e6)
        uses_default = tvm_ffi.structural_equal(applied[task.name], defaults[task.name])
        assert uses_default == (ours[0] <= min(theirs)), task.name
    # a second run measures nothing again: the defaults are in the logs
    again = tvm_spinn.tune(mod, target=LLVM, work_dir=work, max_trials_per_task=1,
                           builder=InProcessBuilder(), runner=_Measure({}, "none").runner)
    assert again.new_trials == 0
    assert len(ms.database.JSONDatabase(work_dir=os.path.join(work, DEFAULTS_DIR)).get_all_tuning_records()) \
        == len(result.tasks)
