"""Choosing, per task, between the default schedule and the search's best: a repeated comparison.

The search measures each candidate once (``number=3`` runs of one batch). On a shared or busy
machine one such figure moves by 2x, so picking per task the lower of two single figures
(default's, search best's) picks a slower schedule about as often as a faster one, and a
build can end up slower than the defaults (measured: transformer block, 8 trials per task,
defaults 0.570 ms, tuned 0.939 ms). So after the search:

1. **Per task**, the default and the search's best record are built once and run in
   ``rounds`` interleaved rounds with the job's own runner (A B, then B A, ...: a slow spell of
   the machine hits both), every task's pair in the same round.
2. **End to end**, if any task chose its tuned schedule, the whole model is built with the
   choices and with the defaults and both are run in interleaved rounds (Relax VM on the local
   device; where the model cannot be run here, e.g. an RPC runner or a spinn target whose
   offloaded layers run on the simulator, the fallback's kernels summed per round with their
   call counts). Unless the choices win (below, by :data:`MODULE_MARGIN`), every task of the
   model goes back to its default schedule.

**What a round measures.** Each side's figure in a round is the *fastest of several short
timings* (single calls of the model; repeats of about a millisecond for a kernel), not the
mean over a long block. A single-threaded run on a loaded machine loses the CPU for whole
scheduler slices: the mean over a 20-50 ms block then measures the share of the CPU the
process got in that block more than the code (measured on this project's 2-core machine at
load 4: such means were 3x the per-call times, and their tuned/default ratio ranged 0.98-1.30
between rounds for two builds 3-7% apart). A short timing that was not interrupted is the
code's own time; the fastest of a round's is one.

**When the tuned side wins** (:func:`decide`). The two sides of a round ran back to back, so
their ratio (tuned / default) cancels most of what the load does to both. The tuned side wins
when the median of the per-round ratios is below ``1 - margin`` *and* it is faster in enough
rounds that chance is unlikely (one-sided sign test at :data:`SIGN_LEVEL`; with too few rounds
for that, in every round). A median that says "faster" without that majority is a tie: the
pair is measured for as many rounds again and decided on all of them, a tie then keeping the
default. Losing a few percent that a tuned schedule might have won is the price of never
applying one that is slower.

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

__all__ = ["MARGIN", "MODULE_MARGIN", "SIGN_LEVEL", "COMPARE_EVALUATOR", "COMPARE_RULE", "Comparison",
           "record_fingerprint", "choice_key", "best_tuned_record", "tuned_module", "compare_pairs",
           "choose", "decide", "wins_needed", "model_inputs", "time_modules", "fingerprint_choices"]

#: the tuned schedule of a task must be this much faster (median per-round ratio) to be chosen
MARGIN = 0.03
#: the model built with the choices must be this much faster than all-defaults to be kept
MODULE_MARGIN = 0.01
#: one-sided sign test: the tuned side must win so many rounds that a coin would do it this rarely
SIGN_LEVEL = 0.05
#: the comparison runner's timing of one candidate in one round: 10 repeats of >= 1 ms (the
#: fastest is the round's figure); shorter than a scheduler slice, so most are uninterrupted
COMPARE_EVALUATOR = dict(number=1, repeat=10, min_repeat_ms=1, enable_cpu_cache_flush=False)
#: version of the rule above, recorded with each verdict: a verdict of another rule (1: medians
#: of 20 ms block means) is measured again, not reused
COMPARE_RULE = 2


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


def wins_needed(rounds: int, level: float = SIGN_LEVEL) -> int:
    """Rounds out of ``rounds`` the tuned side must win: the fewest that a fair coin reaches
    with probability <= ``level`` (one-sided sign test), or all of them when even that is
    likelier (fewer than 5 rounds at 5%)."""
    from math import comb

    for wins in range(rounds + 1):
        if sum(comb(rounds, k) for k in range(wins, rounds + 1)) / 2 ** rounds <= level:
            return wins
    return rounds


def decide(default_secs, tuned_secs, margin: float) -> tuple[str, str]:
    """``("tuned" | "default" | "tie", why)`` for paired per-round figures (see the module doc).

    ``"tie"``: the median ratio is below ``1 - margin`` but the tuned side did not win enough
    rounds (measure again, then a tie keeps the default)."""
    n = min(len(default_secs), len(tuned_secs))
    if n == 0:
        return "default", "nothing measured"
    ratios = [t / d if d > 0 else float("inf") for d, t in zip(default_secs[:n], tuned_secs[:n])]
    ratio = statistics.median(ratios)
    wins, needed = sum(r < 1.0 for r in ratios), wins_needed(n)
    why = f"tuned/default median ratio {ratio:.3f}, tuned faster in {wins} of {n} rounds (needs {needed})"
    if ratio >= 1.0 - margin:
        return "default", why
    return ("tuned" if wins >= needed else "tie"), why


@dataclass(frozen=True)
class Comparison:
    """Interleaved measurements of one task's default and tuned schedule (seconds, one figure
    per round: the fastest of the round's repeats)."""

    default_secs: tuple[float, ...]
    tuned_secs: tuple[float, ...]
    error: str | None = None  # why the pair could not be compared

    @property
    def default_median(self) -> float:
        return statistics.median(self.default_secs)

    @property
    def tuned_median(self) -> float:
        return statistics.median(self.tuned_secs)

    def verdict(self, margin: float = MARGIN) -> tuple[str, str]:
        """:func:`decide` on the rounds (``"default"`` when the pair could not be compared)."""
        if self.error or not self.tuned_secs or not self.default_secs:
            return "default", self.error or "nothing measured"
        return decide(self.default_secs, self.tuned_secs, margin)


def choose(comparison: Comparison, margin: float = MARGIN) -> str:
    """``"tuned"`` if it wins the comparison (:func:`decide`), else ``"default"`` (a tie too)."""
    return "tuned" if comparison.verdict(margin)[0] == "tuned" else "default"


def _last_line(message: str) -> str:
    lines = [line.strip() for line in str(message).strip().splitlines() if line.strip()]
    return lines[-1] if lines else str(message)


def compare_pairs(pairs: list[tuple[tvm.IRModule, tvm.IRModule]], target: tvm.target.Target,
                  builder, runner, rounds: int, check=lambda: None,
                  margin: float = MARGIN) -> list[Comparison]:
    """Measure ``(default, tuned)`` scheduled modules in ``rounds`` interleaved rounds.

    Everything is built once with ``builder``; each round is one ``runner.run`` call holding every
    pair, the default first in even rounds and the tuned schedule first in odd ones; a
    candidate's figure in a round is the fastest of the runner's repeats. Pairs that
    :func:`decide` calls a tie after ``rounds`` rounds are measured for ``rounds`` more. ``check``
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

    def measure(live: list[int], first_round: int, count: int) -> None:
        for r in range(first_round, first_round + count):
            live = [i for i in live if errors[i] is None]
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
                secs[i][k].append(min(float(s) for s in ran.run_secs))

    try:
        measure([i for i in range(len(pairs)) if errors[i] is None], 0, rounds)
        ties = [i for i in range(len(pairs)) if errors[i] is None
                and decide(secs[i][0], secs[i][1], margin)[0] == "tie"]
        if ties:  # measured again, decided on all rounds
            measure(ties, rounds, rounds)
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
                 check=lambda: None, more=lambda times: False) -> list[list[float]]:
    """Seconds per call of each executable's ``main``, one figure per round, interleaved.

    Each round runs every executable in turn (the order reversed every other round) for at
    least 5 single calls and about 20 ms; its figure is the fastest call. If ``more(times)``
    is true after ``rounds`` rounds, ``rounds`` more are run (once).
    """
    import math
    import time

    from tvm import relax

    evaluators, args = [], [tvm.runtime.tensor(x, device) for x in inputs]
    for ex in executables:
        vm = relax.VirtualMachine(ex, device)
        vm["main"](*args)  # warm up (and fail here, not inside a timer)
        start = time.perf_counter()
        vm["main"](*args)
        one = max(time.perf_counter() - start, 1e-6)
        calls = min(50, max(5, math.ceil(0.02 / one)))
        evaluators.append(vm.time_evaluator("main", device, number=1, repeat=calls, min_repeat_ms=0))
    times: list[list[float]] = [[] for _ in executables]

    def measure(first_round: int, count: int) -> None:
        for r in range(first_round, first_round + count):
            check()
            order = range(len(executables)) if r % 2 == 0 else reversed(range(len(executables)))
            for i in order:
                times[i].append(min(float(s) for s in evaluators[i](*args).results))

    measure(0, rounds)
    if more(times):
        measure(rounds, rounds)
    return times


def fingerprint_choices(entries: dict) -> str:
    """A stable hash of a model's per-task choices (what the end-to-end check compared)."""
    digest = hashlib.sha256()
    for key in sorted(entries):
        e = entries[key]
        digest.update(f"{key}:{e.get('compared')}:{e.get('tuned_record')};".encode())
    return digest.hexdigest()[:16]
