"""Each task's default schedule as a measured candidate, so tuning never loses to the defaults.

A build without tuning logs gives every fallback PrimFunc its default schedule (the dlight rules
of :func:`tvm_spinn.fallback.default_rules`, or TVM's untuned lowering where the build leaves a
function alone). A short search often finds nothing as fast. So before a task is searched, its
default schedule is built and measured with the job's own builder and runner, and committed as a
tuning record (its trace is the default schedule's trace) to a second JSON database,
``work_dir/defaults/``. At build time both databases are queried as one
(``UnionDatabase``: the record with the lowest mean latency of either), hence per task the
faster of default and tuned, as measured.

Why a database of its own: the search's evolutionary population is seeded from its database's
best records, and a dlight trace has no sampling decisions to mutate, so the search would
only measure the default again and spend a trial on it. Kept apart, trial counts and the search
are exactly MetaSchedule's, and each default is measured once per work directory.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import tvm

__all__ = ["DefaultSchedule", "default_schedule", "measure_defaults", "open_defaults",
           "default_latency"]


@dataclass(frozen=True)
class DefaultSchedule:
    """The schedule a build without tuning logs gives one task.

    Attributes
    ----------
    rule : str
        Name of the dlight rule that scheduled it, or ``"untuned"`` (no rule applies, or the
        build deliberately leaves the function to TVM's lowering).
    trace : tvm.s_tir.schedule.Trace
        Its schedule trace (empty for ``"untuned"``).
    mod : tvm.IRModule
        The scheduled module (what is built and measured).
    """

    rule: str
    trace: object
    mod: tvm.IRModule

    def commit(self, db, task_mod: tvm.IRModule, run_secs: list[float], target) -> None:
        """Add this schedule with its measured ``run_secs`` to ``db`` as a record of ``task_mod``."""
        from tvm.s_tir import meta_schedule as ms
        from tvm.s_tir.meta_schedule.arg_info import ArgInfo

        workload = db.commit_workload(task_mod)
        db.commit_tuning_record(ms.database.TuningRecord(
            self.trace, workload, run_secs, target,
            ArgInfo.from_entry_func(task_mod, remove_preproc=True)))


def open_defaults(work_dir: str, target: tvm.target.Target, require: bool):
    """The database of default-schedule records in ``work_dir`` (validated like the logs)."""
    from .._tuning_db import DEFAULTS_DIR, open_database

    return open_database(os.path.join(work_dir, DEFAULTS_DIR), target, require=require)


def default_latency(db, task_mod: tvm.IRModule) -> float | None:
    """Mean seconds of ``task_mod``'s default record in ``db`` (None: not measured)."""
    if not db.has_workload(task_mod):
        return None
    top = db.get_top_k(db.commit_workload(task_mod), 1)
    if not top or top[0].run_secs is None or not len(top[0].run_secs):
        return None
    return sum(float(s) for s in top[0].run_secs) / len(top[0].run_secs)


def default_schedule(mod: tvm.IRModule, target: tvm.target.Target) -> DefaultSchedule:
    """The default schedule of a task module (one PrimFunc, ``main``) for ``target``.

    Parameters
    ----------
    mod : tvm.IRModule
        A task's module (``ExtractedTask.dispatched[0]``).
    target : tvm.target.Target
        The task's target.

    Returns
    -------
    DefaultSchedule
    """
    from tvm.s_tir.dlight.base.transform import _apply_rules

    from ..fallback import default_rules, has_unit_reduction

    func = mod["main"]
    schedule = None
    rule_name = "untuned"
    if not (target.kind.name == "llvm" and has_unit_reduction(func)):
        with target:
            for rule in default_rules(target):
                found = _apply_rules(func, target, [rule], tunable=False)
                if found is not None:
                    schedule, rule_name = found[0], type(rule).__name__
                    break
    if schedule is None:
        schedule = tvm.s_tir.Schedule(mod)
    return DefaultSchedule(rule=rule_name, trace=schedule.trace, mod=schedule.mod)


def measure_defaults(defaults: list[DefaultSchedule], target: tvm.target.Target, builder,
                     runner) -> list[tuple[list[float] | None, str | None]]:
    """Build and run default schedules in one batch: ``(run_secs or None, error or None)`` each.

    The job's own builder and runner measure them, so default and tuned latencies are measured
    the same way.
    """
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.builder import BuilderInput
    from tvm.s_tir.meta_schedule.runner import RunnerInput

    if not defaults:
        return []
    device = "cpu" if target.kind.name == "llvm" else target.kind.name  # tvm.device() names
    built = builder.build([BuilderInput(d.mod, target) for d in defaults])
    results: list[tuple[list[float] | None, str | None]] = [(None, None)] * len(defaults)
    inputs, where = [], []
    for i, (default, result) in enumerate(zip(defaults, built)):
        if result.error_msg:
            results[i] = (None, f"build failed: {_last_line(str(result.error_msg))}")
            continue
        inputs.append(RunnerInput(result.artifact_path, device,
                                  ArgInfo.from_entry_func(default.mod, remove_preproc=True)))
        where.append(i)
    try:
        futures = runner.run(inputs) if inputs else []
        for i, future in zip(where, futures):
            ran = future.result()
            if ran.error_msg:
                results[i] = (None, f"run failed: {_last_line(str(ran.error_msg))}")
            else:
                results[i] = ([float(s) for s in ran.run_secs], None)
    finally:
        for result in built:
            if result.artifact_path:  # the builder's temporary directory
                shutil.rmtree(os.path.dirname(result.artifact_path), ignore_errors=True)
    return results


def _last_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[-1] if lines else message
