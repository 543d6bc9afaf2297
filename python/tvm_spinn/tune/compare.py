"""Choosing, per task, between the default schedule and the search's best: a repeated comparison.

The search measures each candidate once (``number=3`` runs of one batch). On a shared or busy
machine one such figure moves by 2x, so picking per task the lower of two single figures
(default's, search best's) picks a slower schedule about as often as a faster one, and a
build can end up slower than the defaults (measured: transformer block, 8 trials per task,
defaults 0.570 ms, tuned 0.939 ms). So after the search:

1. **Per task**, the default and the search's best record are built once and run in
   ``rounds`` interleaved rounds with the job's own runner (A B, then B A, ...: a slow spell of
   the machine hits both), every task's pair in the same round. The tuned schedule is chosen
   only if its median is below the default's by :data:`MARGIN`; otherwise the default stays.
2. **End to end**, if any task chose its tuned schedule, the whole model is built with the
   choices and with the defaults and both are run in interleaved rounds (Relax VM on the local
   device; where the model cannot be run here, e.g. an RPC runner or a spinn target whose
   offloaded layers run on the simulator, the fallback's kernels summed per round with their
   call counts). Unless the choices are faster by :data:`MODULE_MARGIN`, every task of the model
   goes back to its default schedule.

Every comparison (the per-round figures, the verdict, which tuned record was compared, by a
fingerprint of its trace) goes to the manifest's ``choices`` and ``end_to_end`` entries and to
the task logs; a build with the logs applies exactly the recorded choice (see
:func:`tvm_spinn._tuning_db.apply_tuning_logs`), so it is deterministic given the logs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
from dataclasses import dataclass

import numpy as np
import tvm

from .._tuning_db import choice_key, record_fingerprint  # noqa: F401  (re-exported)

__all__ = ["MARGIN", "MODULE_MARGIN", "Comparison", "record_fingerprint", "choice_key",
           "best_tuned_record", "tuned_module", "compare_pairs", "choose", "model_inputs",
           "time_modules", "fingerprint_choices"]

#: the tuned schedule of a task must be this much faster (median over rounds) to be chosen
MARGIN = 0.03
#: the model built with the choices must be this much faster than all-defaults to be kept
MODULE_MARGIN = 0.01


def best_tuned_record(db, task_mod: tvm.IRModule):
    """The search's fastest valid record of ``task_mod`` in ``db`` (None: none)."""
    if not db.has_workload(task_mod):
        return None
    top = db.get_top_k(db.commit_workload(task_mod), 1)
    return top[0] if top else None


def tuned_module(record, task_mod: tvm.IRModule) -> tvm.IRModule:
    """``task_mod`` scheduled by ``record``'s trace, as MetaSchedule's apply-database does."""
    sch = tvm.s_tir.Schedule(task_mod)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    return sch.mod


@dataclass(frozen=True)
class Comparison:
    """Interleaved measurements of one task's default and tuned schedule (seconds per round)."""

    default_secs: tuple[float, ...]
    tuned_secs: tuple[float, ...]
    error: str | None = None  # why the pair could not be compared

    @property
    def default_median(self) -> float:
        return statistics.median(self.default_secs)

    @property
    def tuned_median(self) -> float:
        return statistics.median(self.tuned_secs)


def choose(comparison: Comparison, margin: float = MARGIN) -> str:
    """``"tuned"`` if its median beats the default's by ``margin``, else ``"default"``."""
    if comparison.error or not comparison.tuned_secs or not comparison.default_secs:
        return "default"
    return "tuned" if comparison.tuned_median < (1.0 - margin) * comparison.default_median else "default"


def _last_line(message: str) -> str:
    lines = [line.strip() for line in str(message).strip().splitlines() if line.strip()]
    return lines[-1] if lines else str(message)


def compare_pairs(pairs: list[tuple[tvm.IRModule, tvm.IRModule]], target: tvm.target.Target,
                  builder, runner, rounds: int, check=lambda: None) -> list[Comparison]:
    """Measure ``(default, tuned)`` scheduled modules in ``rounds`` interleaved rounds.

    Everything is built once with ``builder``; each round is one ``runner.run`` call holding every
    pair, the default first in even rounds and the tuned schedule first in odd ones. ``check``
    runs between rounds (the job's Ctrl-C check).
    """
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.builder import BuilderInput
    from tvm.s_tir.meta_schedule.runner import RunnerInput

    if not pairs:
        return []
    device = "cpu" if target.kind.name == "llvm" else target.kind.name
    flat = [m for pair in pairs for m in pair]
    built = builder.build([BuilderInput(m, target) for m in flat])
    errors: list[str | None] = [None] * len(pairs)
    for i in range(len(pairs)):
        for which, result in zip(("default", "tuned"), built[2 * i: 2 * i + 2]):
            if result.error_msg and errors[i] is None:
                errors[i] = f"{which} schedule failed to build: {_last_line(result.error_msg)}"
    secs: list[list[list[float]]] = [[[], []] for _ in pairs]
    try:
        live = [i for i in range(len(pairs)) if errors[i] is None]
        for r in range(rounds):
            check()
            order = (0, 1) if r % 2 == 0 else (1, 0)
            inputs, where = [], []
            for i in live:
                for k in order:
                    mod, result = flat[2 * i + k], built[2 * i + k]
                    inputs.append(RunnerInput(result.artifact_path, device,
                                              ArgInfo.from_entry_func(mod, remove_preproc=True)))
                    where.append((i, k))
            futures = runner.run(inputs) if inputs else []
            for (i, k), future in zip(where, futures):
                ran = future.result()
                if ran.error_msg:
                    if errors[i] is None:
                        errors[i] = (f"{'default' if k == 0 else 'tuned'} schedule failed to run: "
                                     f"{_last_line(ran.error_msg)}")
                    continue
                secs[i][k].append(sum(float(s) for s in ran.run_secs) / len(ran.run_secs))
            live = [i for i in live if errors[i] is None]
        check()
    finally:
        for result in built:
            if result.artifact_path:  # the builder's temporary directory
                shutil.rmtree(os.path.dirname(result.artifact_path), ignore_errors=True)
    return [Comparison(tuple(d), tuple(t), errors[i]) for i, (d, t) in enumerate(secs)]


def model_inputs(mod: tvm.IRModule) -> list[np.ndarray] | None:
    """Fixed inputs (seed 0) for ``mod["main"]``: floats in [-1, 1), integers 0 (valid indices
    for any gather); None when a parameter is not a static-shape tensor."""
    rng = np.random.default_rng(0)
    out = []
    for param in mod["main"].params:
        ty = param.ty
        shape = getattr(ty, "shape", None)
        dtype = str(getattr(ty, "dtype", ""))
        if shape is None or not dtype or not hasattr(shape, "values"):
            return None
        try:
            dims = [int(d) for d in shape.values]
        except (TypeError, ValueError):  # symbolic dimension
            return None
        if "float" in dtype:
            out.append(rng.uniform(-1.0, 1.0, size=dims).astype(dtype))
        else:
            out.append(np.zeros(dims, dtype=dtype))
    return out


def time_modules(executables: list, device, inputs: list[np.ndarray], rounds: int,
                 check=lambda: None) -> list[list[float]]:
    """Seconds per call of each executable's ``main``, one figure per round, interleaved.

    Each round runs every executable once (at least 20 ms of calls), in turn; the order is
    reversed every other round.
    """
    from tvm import relax

    evaluators, args = [], [tvm.runtime.tensor(x, device) for x in inputs]
    for ex in executables:
        vm = relax.VirtualMachine(ex, device)
        vm["main"](*args)  # warm up (and fail here, not inside a timer)
        evaluators.append(vm.time_evaluator("main", device, number=1, repeat=1, min_repeat_ms=20))
    times: list[list[float]] = [[] for _ in executables]
    for r in range(rounds):
        check()
        order = range(len(executables)) if r % 2 == 0 else reversed(range(len(executables)))
        for i in order:
            times[i].append(float(evaluators[i](*args).mean))
    return times


def fingerprint_choices(entries: dict) -> str:
    """A stable hash of a model's per-task choices (what the end-to-end check compared)."""
    digest = hashlib.sha256()
    for key in sorted(entries):
        e = entries[key]
        digest.update(f"{key}:{e.get('compared')}:{e.get('tuned_record')};".encode())
    return digest.hexdigest()[:16]
