"""``tvm_spinn.tune``: tune a model's fallback tasks with MetaSchedule, resumably."""

from __future__ import annotations

import os
import statistics
import warnings
from dataclasses import dataclass, field, replace

import tvm
import tvm_ffi

from .compare import (COMPARE_EVALUATOR, COMPARE_RULE, MARGIN, MODULE_MARGIN, best_tuned_record,
                      choice_key, compare_pairs, decide, fingerprint_choices, model_inputs,
                      record_fingerprint, time_modules, tuned_module)
from .database import (exhausted_tasks, mark_exhausted, open_database, record_choices, task_choices,
                       update_manifest)
from .defaults import default_latency, default_schedule, measure_defaults, open_defaults
from .intrinsics import ensure_intrinsics, tune_context
from .lock import WorkDirLock
from .logs import JobLogs
from .runner import make_runner
from .tasks import extract_fallback_tasks, model_hash, task_key

__all__ = ["tune", "TaskResult", "TuningResult", "TuningWarning"]

#: run_secs at or above this are MetaSchedule's marks of failed candidates
_FAILED_SECS = 1e9


class TuningWarning(UserWarning):
    """A task was skipped (every schedule failed, or its search could not start)."""


@dataclass(frozen=True)
class TaskResult:
    """One fallback task after tuning."""

    name: str
    flop: float
    trials: int
    new_trials: int
    best_latency_us: float | None  # the search's best candidate (not the default)
    status: str  # "tuned", "resumed" (nothing left to do), "skipped"
    reason: str | None = None  # why a task was skipped
    default_latency_us: float | None = None  # its default schedule, measured the same way
    default_rule: str | None = None  # the dlight rule of the default ("untuned": none)
    bytes: float = float("nan")  # bytes of its parameters (inputs and outputs)
    calls: int = 1  # how many times the model calls it
    choice: str | None = None  # "default" or "tuned" as recorded by the job's comparison
    choice_reason: str | None = None  # the comparison behind it (medians, or why none)
    compared_default_us: float | None = None  # median of the interleaved rounds' figures
    compared_tuned_us: float | None = None

    @property
    def chosen(self) -> str | None:
        """``"default"`` or ``"tuned"``: which candidate the build applies (None: unmeasured).

        The job's recorded choice (repeated interleaved measurement, end-to-end check); for a
        result without one, the lower of the two single measurements."""
        if self.choice is not None:
            return self.choice
        known = [v for v in (self.best_latency_us, self.default_latency_us) if v is not None]
        if not known:
            return None
        return "default" if min(known) == self.default_latency_us else "tuned"

    @property
    def latency_us(self) -> float | None:
        """Latency of the schedule a build with these logs uses (the comparison's median when
        there was one, else the single measurement)."""
        chosen = self.chosen
        if chosen is None:
            return None
        compared = self.compared_tuned_us if chosen == "tuned" else self.compared_default_us
        if compared is not None:
            return compared
        return self.best_latency_us if chosen == "tuned" else self.default_latency_us


@dataclass
class TuningResult:
    """What a tuning job did; ``table()`` renders the per-task table."""

    work_dir: str
    target: str
    model_hash: str
    tasks: list[TaskResult] = field(default_factory=list)
    #: the end-to-end check of the choices (see :mod:`tvm_spinn.tune.compare`), or None
    end_to_end: dict | None = None

    @property
    def new_trials(self) -> int:
        """Trials measured by this run (0 when everything was already in the logs)."""
        return sum(t.new_trials for t in self.tasks)

    def table(self) -> str:
        """Per-task table: FLOP, default and tuned latency, which one the build uses, trials,
        status; then why tasks were skipped, each task's comparison and the end-to-end check."""
        def us(value):
            return "-" if value is None else f"{value:.2f}" if value < 10 else f"{value:.1f}"

        rows = [("task", "FLOP", "default (us)", "tuned (us)", "latency (us)", "uses", "trials",
                 "status")]
        def pick(compared, single):  # the comparison's median where there was one
            return compared if compared is not None else single

        for t in self.tasks:
            rows.append((t.name, f"{t.flop:.3g}", us(pick(t.compared_default_us, t.default_latency_us)),
                         us(pick(t.compared_tuned_us, t.best_latency_us)),
                         us(t.latency_us), t.chosen or "-", str(t.trials), t.status))
        total = [t.latency_us for t in self.tasks]
        if self.tasks and all(v is not None for v in total):
            defaults = [pick(t.compared_default_us, t.default_latency_us) for t in self.tasks]
            rows.append(("total (each task once)", "", us(sum(defaults)) if None not in defaults else "-",
                         "", us(sum(total)), "", "", ""))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if any(t.compared_default_us is not None for t in self.tasks):
            lines.append("default/tuned: medians over the rounds of the job's interleaved comparison "
                         "(each round: the fastest of short timings; single measurements where there was none)")
        lines += [f"{t.name} skipped: {t.reason}" for t in self.tasks if t.reason]
        lines += [f"{t.name} uses {t.choice}: {t.choice_reason}" for t in self.tasks
                  if t.choice is not None and t.choice_reason]
        if self.end_to_end:
            lines.append(f"end to end: {self.end_to_end.get('reason', '')}")
        return "\n".join(lines)


def _positive(name: str, value, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _mean_secs(rec) -> float | None:
    if rec.run_secs is not None and len(rec.run_secs):
        secs = sum(float(s) for s in rec.run_secs) / len(rec.run_secs)
        if secs < _FAILED_SECS:
            return secs
    return None


def _records(db, mod):
    """(all trials, best seconds or None) of ``mod`` in ``db`` without adding it."""
    if not db.has_workload(mod):
        return 0, None
    workload = db.commit_workload(mod)
    count, best = 0, None
    for rec in db.get_all_tuning_records():
        if not rec.workload.same_as(workload) and not tvm_ffi.structural_equal(rec.workload.mod, mod):
            continue
        count += 1
        secs = _mean_secs(rec)
        if secs is not None and (best is None or secs < best):
            best = secs
    return count, best


def _with_num_cores(target: tvm.target.Target) -> tvm.target.Target:
    """MetaSchedule needs ``num-cores`` on llvm targets: default it to this host's cores."""
    if target.kind.name == "llvm" and "num-cores" not in target.attrs:
        config = dict(target.export())
        config["num-cores"] = os.cpu_count() or 1
        return tvm.target.Target(config)
    return target


def _param_bytes(mod) -> float:
    """Bytes of a PrimFunc's tensor parameters (what it must read and write at least once)."""
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    total = 0.0
    for info in ArgInfo.from_entry_func(mod, remove_preproc=True):
        shape = getattr(info, "shape", None)
        if shape is None:
            continue
        size = float(max(1, tvm.DataType(str(info.dtype)).bits // 8))
        for dim in shape:
            size *= int(dim)
        total += size
    return total


def _flop(mod) -> float:
    from tvm.s_tir.analysis import estimate_tir_flops

    try:
        return float(estimate_tir_flops(mod))
    except Exception:  # noqa: BLE001  (ops without an estimate)
        return float("nan")


def tune(mod: tvm.IRModule, target="spinn", work_dir: str = "logs", max_trials: int | None = None,
         max_trials_per_task: int = 64, runner=None, *, rpc_tracker: str | None = None,
         rpc_key: str | None = None, seed: int = 0, num_trials_per_iter: int = 16,
         progress: bool = False, builder=None, verbose: bool = False,
         compare_rounds: int = 11) -> TuningResult:
    """Tune the fallback (non-offloaded) tasks of a model with MetaSchedule.

    Tasks are tuned one after another in name order (XGBoost cost model shared between them,
    evolutionary search seeded from ``seed``). Records go to MetaSchedule's JSON database in
    ``work_dir`` as they are measured, so a killed job resumes: trials already in the logs
    count towards each task's budget and finished tasks are not tuned again (a task is finished
    when it has its budget of trials, or when its search ran out of new candidates: that is
    noted in the manifest). A task whose every candidate fails keeps its default schedule; the
    reason goes to a :class:`TuningWarning`, its log file and ``TaskResult.reason``.

    Parameters
    ----------
    mod : tvm.IRModule
        Relax model.
    target : str or tvm.target.Target
        Build target: a spinn tag (only the fallback is tuned), ``llvm`` (whole model on CPU) or
        a cuda target (needs a runner that can measure on a GPU).
    work_dir : str
        Directory for ``database_workload.json``, ``database_tuning_record.json``, ``logs/``
        and the manifest ``tvm_spinn_tuning.json``.
    max_trials : int, optional
        Global budget over all tasks (counting trials already in the logs); defaults to
        ``max_trials_per_task * number of tasks``.
    max_trials_per_task : int
        Budget per task (counting trials already in the logs).
    runner : tvm.s_tir.meta_schedule.runner.Runner, optional
        Measurement runner; default: local. See also ``rpc_tracker``/``rpc_key``.
    rpc_tracker, rpc_key : str, optional
        Measure on the servers of a TVM RPC tracker (``"host:port"``, device key).
    seed : int
        Seed of the search (same seed, same logs -> same candidates).
    num_trials_per_iter : int
        Candidates measured per batch (the granularity at which a killed job loses work).
    progress : bool
        Show a tqdm progress bar of measured trials.
    builder : tvm.s_tir.meta_schedule.builder.Builder, optional
        Default: :class:`~tvm_spinn.tune.builder.InProcessBuilder`.
    verbose : bool
        Echo MetaSchedule's log (INFO and above) to stderr; it always goes to ``work_dir/logs``
        (``task_scheduler.log``, ``task_<i>_<name>.log``). The job never touches the process's
        logging configuration.
    compare_rounds : int
        Rounds of the interleaved default-vs-tuned comparison made after the search, per task
        and end to end (see :mod:`tvm_spinn.tune.compare`; a tie is measured for as many rounds
        again); its verdicts go to the manifest and decide what a build with the logs applies.
        With 7 rounds or fewer a tuned schedule must win every round to be chosen.

    Returns
    -------
    TuningResult
        Per-task FLOP, best latency, trials and status.

    Raises
    ------
    KeyboardInterrupt
        On Ctrl-C (SIGINT), at once: the batch in flight is dropped, every batch measured
        before it stays in the logs, and the next run resumes from there.
    TuningLogError
        Existing logs in ``work_dir`` are corrupt or for another target (nothing is modified).
    TuningLockError
        Another tuning job is using ``work_dir`` (the message names its pid, host and start).
    ValueError
        Bad budgets, runner or RPC settings, or unknown target.
    """
    from tvm.s_tir import meta_schedule as ms

    from ..target.registry import get_target
    from .builder import InProcessBuilder
    from .guard import GuardCallback, InterruptGuard  # MetaSchedule classes: import lazily
    from .progress import ProgressCallback

    target = _with_num_cores(get_target(target))
    _positive("max_trials_per_task", max_trials_per_task, False)
    _positive("max_trials", max_trials, True)
    _positive("num_trials_per_iter", num_trials_per_iter, False)
    _positive("compare_rounds", compare_rounds, False)
    if not isinstance(work_dir, (str, os.PathLike)):
        raise TypeError(f"work_dir must be a path, got {work_dir!r}")
    work_dir = os.fspath(work_dir)
    # the comparisons time short repeats (see compare.py); a runner passed in is used as is
    compare_runner = runner or make_runner(None, rpc_tracker, rpc_key, evaluator=COMPARE_EVALUATOR)
    runner = make_runner(runner, rpc_tracker, rpc_key)
    if not isinstance(mod, tvm.IRModule):
        raise TypeError(f"tune expects a Relax IRModule, got {type(mod).__name__}")
    with WorkDirLock(work_dir):  # one job per work directory: logs from two are unloadable
        db = open_database(work_dir, target, require=False)
        tasks = extract_fallback_tasks(mod, target)
        mhash = model_hash(tasks)
        update_manifest(work_dir, target, mhash, [t.task_name for t in tasks])
        result = TuningResult(work_dir=work_dir, target=str(target), model_hash=mhash)
        if not tasks:
            return result
        ensure_intrinsics(target)
        budget = max_trials if max_trials is not None else max_trials_per_task * len(tasks)
        defaults = {t.task_name: default_schedule(t.dispatched[0], t.target) for t in tasks}
        defaults_db = open_defaults(work_dir, target, require=False)
        done = {t.task_name: _records(db, t.dispatched[0])[0] for t in tasks}
        budget_left = budget - sum(min(d, max_trials_per_task) for d in done.values())
        num_threads = os.cpu_count() or 1
        builder = builder or InProcessBuilder()
        cost_model = ms.CostModel.create("xgb", num_tuning_cores=num_threads)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=max(0, budget_left), unit="trial", desc="tuning")
        guard = InterruptGuard()
        first = GuardCallback(guard)  # first: an interrupted batch never reaches the database
        callbacks = [first] + ms.MeasureCallback.create("default") + ([ProgressCallback(bar)] if bar else [])
        exhausted = exhausted_tasks(work_dir)
        logs = JobLogs(work_dir, [t.task_name for t in tasks], verbose=verbose)
        try:
            with guard:
                _measure_defaults(tasks, defaults, defaults_db, logs, builder, runner, guard)
                for index, (task, logger) in enumerate(zip(tasks, logs.tasks)):
                    result.tasks.append(_tune_task(
                        ms, task, index, logger, logs.scheduler, db, done[task.task_name],
                        defaults[task.task_name], default_latency(defaults_db, task.dispatched[0]),
                        0 if task_key(task) in exhausted else min(max_trials_per_task - done[task.task_name],
                                                                budget_left),
                        work_dir=work_dir, builder=builder, runner=runner, cost_model=cost_model,
                        callbacks=callbacks, first=first, guard=guard, seed=seed,
                        num_trials_per_iter=num_trials_per_iter, max_trials_per_task=max_trials_per_task,
                        num_threads=num_threads, bar=bar,
                    ))
                    budget_left -= result.tasks[-1].new_trials
                _choose(mod, tasks, result, db, defaults, logs, builder, compare_runner, guard,
                        compare_rounds, work_dir, mhash)
        finally:
            logs.close()
            if bar is not None:
                bar.close()
        return result


def _measure_defaults(tasks, defaults, defaults_db, logs, builder, runner, guard) -> None:
    """Measure, in one batch, the default schedule of every task that has no record of it yet,
    and commit each as a record (a failed one is logged and not committed: the build still
    gives the task its default schedule, unmeasured). Ctrl-C commits nothing."""
    todo = [(i, t) for i, t in enumerate(tasks)
            if default_latency(defaults_db, t.dispatched[0]) is None]
    if not todo:
        return
    target = todo[0][1].target
    try:
        measured = measure_defaults([defaults[t.task_name] for _, t in todo], target, builder, runner)
    except KeyboardInterrupt:
        raise
    except Exception as err:  # noqa: BLE001  (the search can still go on)
        guard.check()  # Ctrl-C that crossed the FFI as a RuntimeError('')
        measured = [(None, f"measurement failed: {_last_line(err)}")] * len(todo)
    guard.check()
    for (i, task), (run_secs, error) in zip(todo, measured):
        default = defaults[task.task_name]
        if run_secs is None:
            logs.tasks[i].error("default schedule (%s) failed, not a candidate: %s", default.rule, error)
            continue
        default.commit(defaults_db, task.dispatched[0], run_secs, target)
        logs.tasks[i].info("default schedule (%s): %.1f us", default.rule,
                           1e6 * sum(run_secs) / len(run_secs))


def _choose(mod, tasks, result, db, defaults, logs, builder, runner, guard,
            rounds: int, work_dir: str, mhash: str) -> None:
    """Decide per task between its default and the search's best by repeated interleaved
    measurement, check the choices end to end, record both in the manifest and the logs, and
    put them into ``result``. A comparison already recorded for the same tuned record is reused
    (a finished job measures nothing again)."""
    recorded, recorded_e2e = task_choices(work_dir)
    entries: dict[str, dict] = {}
    todo = []
    for i, task in enumerate(tasks):
        func, name = task.dispatched[0], task.task_name
        key = choice_key(func)
        record = best_tuned_record(db, func)
        if record is None:
            entries[key] = {"task": name, "compared": "default", "use": "default", "tuned_record": None,
                            "reason": "no tuned schedule ran"}
            continue
        fingerprint = record_fingerprint(record)
        old = recorded.get(key)
        if (isinstance(old, dict) and old.get("tuned_record") == fingerprint and old.get("compared")
                and old.get("rule") == COMPARE_RULE):  # decided by an earlier rule: compared again
            entries[key] = dict(old, task=name, use=old["compared"])
            continue
        todo.append((i, key, record, fingerprint))
    if todo:
        pairs = [(defaults[tasks[i].task_name].mod, tuned_module(record, tasks[i].dispatched[0]))
                 for i, _, record, _ in todo]
        try:
            compared = compare_pairs(pairs, tasks[0].target, builder, runner, rounds, guard.check)
        except KeyboardInterrupt:
            raise
        except Exception as err:  # noqa: BLE001  (keep the defaults, say why)
            guard.check()
            compared = [None] * len(todo)
            failure = f"comparison failed: {_last_line(err)}"
        for (i, key, _, fingerprint), comparison in zip(todo, compared):
            if comparison is None:
                entry = {"compared": "default", "reason": failure}
            else:
                verdict, why = comparison.verdict(MARGIN)
                entry = {"compared": "tuned" if verdict == "tuned" else "default",
                         "default_us": [round(s * 1e6, 3) for s in comparison.default_secs],
                         "tuned_us": [round(s * 1e6, 3) for s in comparison.tuned_secs]}
                entry["reason"] = comparison.error or (
                    f"median of {len(comparison.default_secs)} interleaved rounds: default "
                    f"{comparison.default_median * 1e6:.2f} us, tuned {comparison.tuned_median * 1e6:.2f} us; "
                    f"{why}" + (" -> a tie keeps the default" if verdict == "tie" else "")
                    + f" (tuned must be {MARGIN:.0%} faster in the median ratio and win the rounds)")
            entries[key] = dict(entry, task=tasks[i].task_name, use=entry["compared"], tuned_record=fingerprint,
                                rule=COMPARE_RULE)
            logs.tasks[i].info("comparison: %s -> the build uses the %s schedule", entry["reason"],
                               entry["compared"])
    e2e = None
    if any(e["compared"] == "tuned" for e in entries.values()):
        signature = fingerprint_choices(entries)
        old = recorded_e2e.get(mhash)
        if (isinstance(old, dict) and old.get("signature") == signature and old.get("verdict")
                and old.get("rule") == COMPARE_RULE):
            e2e = old
        else:
            record_choices(work_dir, entries)  # the build with the choices reads them
            try:
                e2e = _end_to_end(mod, tasks, entries, work_dir, runner, rounds, guard)
            except BaseException:
                record_choices(work_dir, {k: dict(e, use="default") for k, e in entries.items()})
                raise
            e2e["signature"], e2e["rule"] = signature, COMPARE_RULE
            logs.scheduler.info("end-to-end check: %s", e2e["reason"])
        if e2e["verdict"] == "defaults":
            entries = {k: dict(e, use="default") for k, e in entries.items()}
    record_choices(work_dir, entries, {mhash: e2e} if e2e else None)
    result.end_to_end = e2e
    by_key = {choice_key(t.dispatched[0]): t.task_name for t in tasks}
    for n, task_result in enumerate(result.tasks):
        key = next(k for k, name in by_key.items() if name == task_result.name)
        entry = entries[key]
        default_us, tuned_us = entry.get("default_us"), entry.get("tuned_us")
        reason = entry.get("reason")
        if entry["use"] != entry["compared"]:
            reason = f"{reason}; overruled by the end-to-end check"
        result.tasks[n] = replace(
            task_result, choice=entry["use"] if task_result.chosen is not None else None,
            choice_reason=reason,
            compared_default_us=statistics.median(default_us) if default_us else None,
            compared_tuned_us=statistics.median(tuned_us) if tuned_us else None)


def _end_to_end(mod, tasks, entries, work_dir, runner, rounds, guard) -> dict:
    """The model with the recorded choices against all-defaults, in interleaved rounds.

    The Relax VM on the local device where the job measures locally and the whole model runs
    here (llvm or a present CUDA device, not a spinn target whose offloaded layers would run on
    the simulator); otherwise the fallback's kernels, summed per round with their call counts
    from the per-task comparison."""
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    from .._build_options import build_options
    from ..target.registry import is_spinn_target

    target = tasks[0].target
    device = tvm.cpu() if target.kind.name == "llvm" else tvm.cuda(0) if target.kind.name == "cuda" else None
    inputs = model_inputs(mod)
    why_not = ("the job measures on RPC servers" if isinstance(runner, ms.runner.RPCRunner)
               else "offloaded layers would run on the simulator" if is_spinn_target(target)
               else "no such device here" if device is None or not device.exist
               else "the model's inputs are not static tensors" if inputs is None else None)
    if why_not is None:
        with build_options(tuning_logs=work_dir):
            chosen = relax.build(mod, target=target)
        with build_options():
            default = relax.build(mod, target=target)
        default_s, chosen_s = time_modules(
            [default, chosen], device, inputs, rounds, guard.check,
            more=lambda times: decide(times[0], times[1], MODULE_MARGIN)[0] == "tie")
        how = "whole model"
    else:
        weights = {choice_key(t.dispatched[0]): int(t.weight) for t in tasks}
        n = min([len(e.get("default_us", [])) for e in entries.values() if e.get("default_us")] or [0])
        default_s = [sum(weights[k] * e["default_us"][r] for k, e in entries.items() if e.get("default_us")) * 1e-6
                     for r in range(n)]
        chosen_s = [sum(weights[k] * e["tuned_us" if e["compared"] == "tuned" else "default_us"][r]
                        for k, e in entries.items() if e.get("default_us")) * 1e-6 for r in range(n)]
        how = f"fallback kernels summed ({why_not})"
        if not n:
            return {"verdict": "choices", "how": how, "reason": "nothing to compare"}
    dm, cm = statistics.median(default_s), statistics.median(chosen_s)
    decided, why = decide(default_s, chosen_s, MODULE_MARGIN)
    verdict = "choices" if decided == "tuned" else "defaults"
    return {
        "verdict": verdict, "how": how,
        "default_ms": [round(s * 1e3, 5) for s in default_s], "chosen_ms": [round(s * 1e3, 5) for s in chosen_s],
        "reason": (f"{how}, median of {len(default_s)} interleaved rounds: all defaults {dm * 1e3:.4g} ms, "
                   f"with the tuned choices {cm * 1e3:.4g} ms; {why.replace('tuned/default', 'choices/defaults')}"
                   .replace("tuned faster", "the choices faster") + " -> "
                   + ("the choices are kept" if verdict == "choices" else
                      f"not clearly {MODULE_MARGIN:.0%} faster (a tie after re-measuring counts as not): "
                      "every task uses its default schedule")),
    }


def _tune_task(ms, task, index: int, logger, scheduler_logger, db, before: int, default,
               default_secs: float | None, todo: int, *,
               work_dir: str, builder, runner, cost_model, callbacks, first, guard, seed: int,
               num_trials_per_iter: int, max_trials_per_task: int, num_threads: int,
               bar) -> TaskResult:
    """Tune one task for ``todo`` more trials (none: it is finished) and report it.

    Ctrl-C (seen by ``guard``) becomes ``KeyboardInterrupt`` whatever MetaSchedule turned it
    into; any other failure of the task skips it with a :class:`TuningWarning` naming the cause.
    """
    func = task.dispatched[0]
    status = "resumed" if before else "tuned"
    reason = None
    first.reset()  # errors seen from here on are this task's
    if todo > 0:
        if bar is not None:
            bar.set_postfix_str(task.task_name)
        context = tune_context(  # ms.TuneContext without importing every backend's intrinsics
            func, target=task.target, space_generator="post-order-apply",
            search_strategy=ms.search_strategy.EvolutionarySearch(
                population_size=min(512, max(32, 8 * max_trials_per_task))),
            task_name=task.task_name, logger=logger,
            rand_state=(seed * 1_000_003 + index) % (2 ** 30) + 1, num_threads=num_threads,
        ).clone()
        try:
            ms.tune.tune_tasks(
                tasks=[context], task_weights=[1.0], work_dir=work_dir,
                max_trials_global=todo, max_trials_per_task=todo,
                num_trials_per_iter=min(num_trials_per_iter, todo), builder=builder,
                runner=runner, database=db, cost_model=cost_model,
                measure_callbacks=callbacks,
                task_scheduler=_round_robin(ms, scheduler_logger),
            )
            status = "tuned"
        except KeyboardInterrupt:
            raise
        except Exception as err:  # noqa: BLE001  (one task must not stop the job)
            if guard.interrupted:  # Ctrl-C that crossed the FFI as a RuntimeError('')
                raise KeyboardInterrupt from None
            reason = _last_line(err)
            logger.error("task failed and was skipped: %s", reason)
            warnings.warn(f"tuning task {task.task_name!r} failed and was skipped "
                          f"(it keeps its default schedule): {reason}", TuningWarning, stacklevel=3)
            status = "skipped"
        guard.check()
    trials, best = _records(db, func)
    new = max(0, trials - before)
    if status == "tuned" and todo > 0 and new < todo:
        # MetaSchedule stopped early: the search has no new candidates. Remember it, or every
        # re-run would re-measure a known schedule and add a trial.
        mark_exhausted(work_dir, task_key(task), trials)
        logger.info("search space exhausted after %d trials; the task is finished", trials)
    if best is None and status != "skipped":
        if trials:
            reason = first.first_error() or "every schedule measured so far failed"
            logger.error("all %d schedules failed; the task keeps its default schedule: %s",
                         trials, reason)
            warnings.warn(f"tuning task {task.task_name!r}: all {trials} schedules failed to build "
                          f"or run; skipped (it keeps its default schedule): {reason}",
                          TuningWarning, stacklevel=3)
        status = "skipped"
    chosen = TaskResult(
        name=task.task_name, flop=_flop(func), trials=trials, new_trials=new,
        best_latency_us=None if best is None else best * 1e6, status=status, reason=reason,
        default_latency_us=None if default_secs is None else default_secs * 1e6,
        default_rule=default.rule, bytes=_param_bytes(func), calls=int(task.weight),
    )
    if chosen.chosen is not None:
        logger.info("the build uses the %s schedule (%.1f us)", chosen.chosen, chosen.latency_us)
    return chosen


def _round_robin(ms, logger):
    """MetaSchedule's round-robin scheduler, logging to this job's logger (not to stdout)."""
    from tvm.s_tir.meta_schedule import _ffi_api
    from tvm.s_tir.meta_schedule.logging import get_logging_func

    scheduler = ms.task_scheduler.RoundRobin.__new__(ms.task_scheduler.RoundRobin)
    scheduler.__init_handle_by_constructor__(_ffi_api.TaskSchedulerRoundRobin,  # pylint: disable=no-member
                                             get_logging_func(logger))
    return scheduler


def _last_line(err: BaseException) -> str:
    """The last non-empty line of an error (TVM errors carry a traceback), or its type."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__
