"""Crash-safe subprocess pool, result classification, summary and JSON report.

Every (case, pipeline) pair is one task run in a long-lived worker process (``spawn`` start
method, stdout/stderr redirected to a per-worker log file). A worker that dies (segfault,
``abort``), or exceeds the per-task timeout (it is killed), fails only the task it was running;
the pool starts a replacement and carries on. Workers are also recycled after
``max_tasks_per_child`` tasks to bound memory growth.

Each result gets a ``status``:

``matched``       outputs match the expected ones;
``mismatch``      ran, but outputs differ;
``run_error``     built, but running raised;
``build_error``   imported, but ``relax.build`` raised;
``import_error``  the importer raised;
``crash``         the worker process died (signal or exit) while running the task;
``timeout``       the task exceeded the timeout and its worker was killed.

For crashes and timeouts, ``stage`` is the last stage the worker reported before dying.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from .worker import PIPELINES, STAGES, run_pipeline

STARTUP_GRACE = 180.0
"""Seconds a new worker may take to import TVM before its first task's clock starts."""

STATUSES = ("matched", "mismatch", "run_error", "build_error", "import_error", "crash", "timeout")


@dataclass
class CaseResult:
    """Outcome of one case in one pipeline.

    Attributes
    ----------
    case, pipeline : str
    stage : str
        Last stage reached (:data:`tvm_spinn.conformance.worker.STAGES`).
    status : str
        One of :data:`STATUSES`.
    error : str or None
        First line of the error that stopped the pipeline.
    seconds : float
    detail : str or None
        Traceback tail or worker log tail (for crashes/timeouts).
    """

    case: str
    pipeline: str
    stage: str = "none"
    status: str = "import_error"
    error: Optional[str] = None
    seconds: float = 0.0
    detail: Optional[str] = None

    @property
    def matched(self) -> bool:
        """Whether the outputs matched."""
        return self.status == "matched"


@dataclass
class Report:
    """All results of a run plus its summary.

    Attributes
    ----------
    results : dict
        ``case -> pipeline -> CaseResult``, cases sorted by name.
    counts : dict
        ``pipeline -> {cases, imported, built, ran, matched, <status>...}``.
    regressions : list of str
        Cases plain TVM matches but spinn does not.
    improvements : list of str
        Cases spinn matches but plain TVM does not.
    meta : dict
        Versions, options and tolerances.
    """

    results: Dict[str, Dict[str, CaseResult]]
    counts: Dict[str, Dict[str, int]]
    regressions: List[str]
    improvements: List[str]
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """JSON-able form of the report.

        Returns
        -------
        dict
        """
        return {
            "meta": self.meta,
            "counts": self.counts,
            "regressions": [
                {"case": c, "tvm": self.results[c]["tvm"].status,
                 "spinn": self.results[c]["spinn"].status,
                 "spinn_stage": self.results[c]["spinn"].stage,
                 "error": self.results[c]["spinn"].error}
                for c in self.regressions],
            "regression_causes": group_causes(
                [self.results[c]["spinn"] for c in self.regressions]),
            "improvements": self.improvements,
            "cases": {c: {p: {k: v for k, v in asdict(r).items() if k not in ("case", "pipeline")}
                          for p, r in per.items()}
                      for c, per in self.results.items()},
        }

    def write_json(self, path: str) -> None:
        """Write :meth:`to_json` checked and atomically (:func:`tvm_spinn._files.atomic_write`).

        Parameters
        ----------
        path : str

        Raises
        ------
        tvm_spinn._files.OutputPathError
            ``path`` is a device (``/dev/null`` included), FIFO, socket or directory.
        """
        from .._files import atomic_write

        text = json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"
        atomic_write(path, lambda f: f.write(text.encode()), what="conformance report")


def classify(raw: dict) -> CaseResult:
    """Turn a worker's result dict into a :class:`CaseResult`.

    Parameters
    ----------
    raw : dict
        As returned by :func:`tvm_spinn.conformance.worker.run_pipeline` (or a crash/timeout
        record with ``status`` set by the pool).

    Returns
    -------
    CaseResult
    """
    stage = raw.get("stage", "none")
    status = raw.get("status")
    if status is None:
        status = {"matched": "matched", "ran": "mismatch", "built": "run_error",
                  "imported": "build_error", "none": "import_error"}[stage]
    return CaseResult(case=raw["case"], pipeline=raw["pipeline"], stage=stage, status=status,
                      error=raw.get("error"), seconds=float(raw.get("seconds") or 0.0),
                      detail=raw.get("traceback") or raw.get("detail"))


def _cause_key(error: Optional[str]) -> str:
    """Normalize an error line for grouping: numbers and shapes blanked, names kept."""
    if not error:
        return "(no error)"
    s = re.sub(r"\b\d+(\.\d+)?(e[-+]?\d+)?\b", "N", error)
    s = re.sub(r"\([N, ]*\)|\[[N, ]*\]", "(…)", s)
    return s[:160]


def group_causes(results: Iterable[CaseResult]) -> Dict[str, List[str]]:
    """Group failed results by normalized first error line.

    Parameters
    ----------
    results : iterable of CaseResult

    Returns
    -------
    dict
        ``"<status>: <normalized error>" -> [case, ...]``, largest group first.
    """
    groups: Dict[str, List[str]] = defaultdict(list)
    for r in results:
        groups[f"{r.status}: {_cause_key(r.error)}"].append(r.case)
    return dict(sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])))


def summarize(results: Dict[str, Dict[str, CaseResult]], meta: Optional[dict] = None) -> Report:
    """Count stages and statuses per pipeline and find regressions.

    Parameters
    ----------
    results : dict
        ``case -> pipeline -> CaseResult``.
    meta : dict, optional

    Returns
    -------
    Report
    """
    results = {c: dict(sorted(results[c].items())) for c in sorted(results)}
    seen = {p for per in results.values() for p in per}
    pipelines = [p for p in PIPELINES if p in seen] + sorted(seen - set(PIPELINES))
    counts: Dict[str, Dict[str, int]] = {}
    for p in pipelines:
        rs = [per[p] for per in results.values() if p in per]
        c = {"cases": len(rs)}
        for i, st in enumerate(STAGES[1:], start=1):
            c[st] = sum(STAGES.index(r.stage) >= i for r in rs)
        st_counts = Counter(r.status for r in rs)
        for st in STATUSES:
            c[st] = st_counts.get(st, 0)
        counts[p] = c
    regressions, improvements = [], []
    for case, per in results.items():
        if "tvm" in per and "spinn" in per:
            if per["tvm"].matched and not per["spinn"].matched:
                regressions.append(case)
            elif per["spinn"].matched and not per["tvm"].matched:
                improvements.append(case)
    return Report(results=results, counts=counts, regressions=regressions,
                  improvements=improvements, meta=dict(meta or {}))


# --------------------------------------------------------------------------
# Worker process pool
# --------------------------------------------------------------------------

def _worker_main(conn, log_path: str, worker_fn: Callable) -> None:
    """Worker loop: receive ``(name, path, pipeline, options)`` tasks, send results back."""
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    except OSError:
        pass
    import warnings

    warnings.simplefilter("ignore")
    try:  # pay the import before the first task's clock starts
        import tvm  # noqa: F401
        import tvm_spinn  # noqa: F401
    except Exception:  # noqa: BLE001  (the task will report the import error)
        pass
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        name, path, pipeline, options = task
        conn.send(("start", None))
        print(f"=== {name} [{pipeline}]", flush=True)

        def progress(stage, _conn=conn):
            _conn.send(("stage", stage))

        try:
            res = worker_fn(name, path, pipeline, options, progress=progress)
        except Exception as err:  # noqa: BLE001  (worker_fn should not raise; be safe)
            res = {"case": name, "pipeline": pipeline, "stage": "none",
                   "error": f"{type(err).__name__}: {err}".splitlines()[0]}
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(("done", res))


def default_worker_fn(name: str, path: str, pipeline: str, options: dict,
                      progress: Optional[Callable[[str], None]] = None) -> dict:
    """The worker function used by :func:`run_cases` (see :func:`.worker.run_pipeline`)."""
    return run_pipeline(name, path, pipeline, options, progress=progress)


def _signal_name(exitcode: Optional[int]) -> str:
    if exitcode is None:
        return "unknown exit"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def _log_tail(path: str, offset: int, lines: int = 8) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    kept = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(kept[-lines:])[-2000:]


class _Slot:
    """One worker process and the task it is running."""

    def __init__(self, ctx, index: int, log_dir: str, worker_fn: Callable):
        self.log_path = os.path.join(log_dir, f"worker-{index}.log")
        parent, child = ctx.Pipe()
        self.conn = parent
        self.proc = ctx.Process(target=_worker_main, args=(child, self.log_path, worker_fn),
                                daemon=True, name=f"conformance-worker-{index}")
        self.proc.start()
        child.close()
        self.task = None
        self.stage = "none"
        self.started = 0.0
        self.running = False  # the worker has picked the task up (its clock is running)
        self.done = 0
        self.log_offset = 0

    def assign(self, task) -> None:
        self.task = task
        self.stage = "none"
        self.running = False
        self.started = time.monotonic()
        try:
            self.log_offset = os.path.getsize(self.log_path)
        except OSError:
            self.log_offset = 0
        self.conn.send(task)

    def deadline(self, timeout: float) -> float:
        """Monotonic time at which the current task times out (startup gets a grace period)."""
        return self.started + timeout + (0.0 if self.running else STARTUP_GRACE)

    def stop(self, kill: bool = False) -> None:
        if kill:
            if self.proc.is_alive():
                self.proc.kill()
        else:
            try:
                self.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self.conn.close()


def run_tasks(tasks: Sequence[tuple], workers: int = 2, timeout: float = 60.0,
              worker_fn: Callable = default_worker_fn, max_tasks_per_child: int = 50,
              log_dir: Optional[str] = None,
              on_result: Optional[Callable[[CaseResult], None]] = None) -> List[CaseResult]:
    """Run ``(name, path, pipeline, options)`` tasks in a crash-safe process pool.

    Parameters
    ----------
    tasks : sequence of tuple
        ``(case name, case folder, pipeline, options)``.
    workers : int
        Number of worker processes.
    timeout : float
        Seconds per task before its worker is killed and the task reported as ``timeout``.
        The clock starts when the worker picks the task up, so a fresh worker's TVM import
        (a few seconds) does not count; startup itself may take :data:`STARTUP_GRACE` more.
    worker_fn : callable
        ``worker_fn(name, path, pipeline, options, progress=...) -> dict``; must be picklable
        (a module-level function). Tests replace it to simulate crashes.
    max_tasks_per_child : int
        Tasks a worker runs before it is replaced.
    log_dir : str, optional
        Folder for the worker logs (worker stdout/stderr); a temporary folder if omitted.
    on_result : callable, optional
        Called with each :class:`CaseResult` as it completes (progress display).

    Returns
    -------
    list of CaseResult
        One per task, in completion order.
    """
    ctx = mp.get_context("spawn")
    log_dir = log_dir or tempfile.mkdtemp(prefix="tvm_spinn_conformance_logs-")
    os.makedirs(log_dir, exist_ok=True)
    pending = list(tasks)[::-1]
    results: List[CaseResult] = []
    slots: List[Optional[_Slot]] = [None] * max(1, min(workers, len(pending)))
    counter = 0

    def finish(slot: _Slot, raw: dict) -> None:
        res = classify(raw)
        results.append(res)
        slot.task = None
        slot.done += 1
        if on_result is not None:
            on_result(res)

    def fail(slot: _Slot, status: str, msg: str) -> None:
        name, _, pipeline, _ = slot.task
        finish(slot, {"case": name, "pipeline": pipeline, "stage": slot.stage, "status": status,
                      "error": msg, "seconds": round(time.monotonic() - slot.started, 3),
                      "detail": _log_tail(slot.log_path, slot.log_offset)})

    try:
        while pending or any(s is not None and s.task is not None for s in slots):
            for i, slot in enumerate(slots):
                if slot is not None and slot.task is None and (
                        slot.done >= max_tasks_per_child or not pending):
                    slot.stop()
                    slots[i] = slot = None
                if slot is None and pending:
                    counter += 1
                    slots[i] = slot = _Slot(ctx, counter, log_dir, worker_fn)
                if slot is not None and slot.task is None and pending:
                    try:
                        slot.assign(pending.pop())
                    except (OSError, BrokenPipeError):
                        fail(slot, "crash", "worker died before receiving the task")
                        slot.stop(kill=True)
                        slots[i] = None
            busy = [s for s in slots if s is not None and s.task is not None]
            if not busy:
                continue
            now = time.monotonic()
            wait_for = max(0.05, min(s.deadline(timeout) - now for s in busy))
            ready = wait([s.conn for s in busy] + [s.proc.sentinel for s in busy],
                         timeout=wait_for)
            for i, slot in enumerate(slots):
                if slot is None or slot.task is None:
                    continue
                dead = False
                try:
                    while slot.task is not None and slot.conn.poll():
                        kind, payload = slot.conn.recv()
                        if kind == "start":
                            slot.running = True
                            slot.started = time.monotonic()
                        elif kind == "stage":
                            slot.stage = payload
                        else:
                            finish(slot, payload)
                except (EOFError, OSError):
                    dead = True
                if slot.task is None:
                    continue
                if dead or slot.proc.sentinel in ready or not slot.proc.is_alive():
                    slot.proc.join(timeout=5)
                    fail(slot, "crash", f"worker died with {_signal_name(slot.proc.exitcode)}")
                    slot.stop(kill=True)
                    slots[i] = None
                elif time.monotonic() > slot.deadline(timeout):
                    fail(slot, "timeout", f"timed out after {timeout:g} s" if slot.running
                         else f"worker did not start within {timeout + STARTUP_GRACE:g} s")
                    slot.stop(kill=True)
                    slots[i] = None
    finally:
        for slot in slots:
            if slot is not None:
                slot.stop(kill=slot.task is not None)
    return results


def _meta(options: dict, timeout: float) -> dict:
    import onnx

    from .cases import DEFAULT_ATOL, DEFAULT_RTOL

    meta = {"onnx": onnx.__version__, "options": options, "timeout": timeout,
            "rtol": DEFAULT_RTOL, "atol": DEFAULT_ATOL,
            "python": sys.version.split()[0], "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        from importlib.metadata import version

        meta["tvm"] = version("apache-tvm")
    except Exception:  # noqa: BLE001
        pass
    return meta


def run_cases(names: Optional[Sequence[str]] = None, *, patterns: Optional[Sequence[str]] = None,
              limit: Optional[int] = None, workers: int = 2, timeout: float = 60.0,
              passes: bool = True, pipelines: Sequence[str] = PIPELINES,
              worker_fn: Callable = default_worker_fn, max_tasks_per_child: int = 50,
              cache_dir: Optional[str] = None, log_dir: Optional[str] = None,
              progress: bool = False) -> Report:
    """Run ONNX node test cases through the pipelines and summarize.

    Parameters
    ----------
    names : sequence of str, optional
        Exact case names (e.g. ``["test_relu", "test_add"]``); unknown names raise.
    patterns : sequence of str, optional
        Name patterns (see :func:`tvm_spinn.conformance.cases.list_cases`); all cases if both
        ``names`` and ``patterns`` are omitted.
    limit : int, optional
        Run only the first ``limit`` selected cases (sorted by name).
    workers : int
        Worker processes.
    timeout : float
        Seconds per case and pipeline.
    passes : bool
        Run the ONNX-level passes in the spinn pipeline.
    pipelines : sequence of str
        Subset of ``("tvm", "spinn")``.
    worker_fn : callable
        Per-task function (test hook), see :func:`run_tasks`.
    max_tasks_per_child : int
        Tasks per worker process before it is replaced.
    cache_dir : str, optional
        Case cache folder (see :func:`tvm_spinn.conformance.cases.default_cache_dir`).
    log_dir : str, optional
        Worker log folder.
    progress : bool
        Show a progress bar (tqdm) on stderr.

    Returns
    -------
    Report

    Raises
    ------
    ValueError
        If a name in ``names`` is not a known case, or a pipeline is unknown.
    """
    from .cases import list_cases

    bad = [p for p in pipelines if p not in PIPELINES]
    if bad:
        raise ValueError(f"unknown pipeline(s) {bad}; known: {list(PIPELINES)}")
    cache = Path(cache_dir) if cache_dir else None
    if names is not None:
        wanted = set(names)
        found = {c.name: c for c in list_cases(cache_dir=cache) if c.name in wanted}
        missing = sorted(set(names) - set(found))
        if missing:
            raise ValueError(f"unknown ONNX node test case(s): {missing}")
        cases = [found[n] for n in sorted(set(names))]
        if patterns:
            cases = [c for c in cases if c.name in {x.name for x in list_cases(patterns, cache)}]
        if limit is not None:
            cases = cases[:limit]
    else:
        cases = list_cases(patterns, cache_dir=cache, limit=limit)
    options = {"passes": bool(passes)}
    tasks = [(c.name, c.path, p, options) for c in cases for p in pipelines]
    bar = None
    if progress and tasks:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(tasks), unit="task", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            bar = None

    def on_result(res: CaseResult) -> None:
        if bar is not None:
            bar.set_postfix_str(f"{res.case[:40]} [{res.pipeline}] {res.status}", refresh=False)
            bar.update(1)

    try:
        flat = run_tasks(tasks, workers=workers, timeout=timeout, worker_fn=worker_fn,
                         max_tasks_per_child=max_tasks_per_child, log_dir=log_dir,
                         on_result=on_result)
    finally:
        if bar is not None:
            bar.close()
    results: Dict[str, Dict[str, CaseResult]] = defaultdict(dict)
    for r in flat:
        results[r.case][r.pipeline] = r
    meta = _meta(options, timeout)
    meta["pipelines"] = list(pipelines)
    return summarize(results, meta)


def format_summary(report: Report, max_cases: int = 200) -> str:
    """Human-readable summary: count table, regressions grouped by cause, improvements.

    Parameters
    ----------
    report : Report
    max_cases : int
        Longest list of case names printed per group.

    Returns
    -------
    str
    """
    cols = ["cases", "imported", "built", "ran", "matched", "mismatch", "run_error",
            "build_error", "import_error", "crash", "timeout"]
    width = {c: max(len(c), 5) for c in cols}
    lines = ["pipeline " + " ".join(c.rjust(width[c]) for c in cols)]
    for p, cnt in report.counts.items():
        lines.append(p.ljust(8) + " " + " ".join(str(cnt.get(c, 0)).rjust(width[c])
                                                 for c in cols))
    lines.append("")
    lines.append(f"regressions (plain TVM matches, spinn does not): {len(report.regressions)}")
    if report.regressions:
        causes = group_causes([report.results[c]["spinn"] for c in report.regressions])
        for cause, cases in causes.items():
            lines.append(f"  [{len(cases)}] {cause}")
            shown = cases[:max_cases]
            for c in shown:
                lines.append(f"      {c}: {report.results[c]['spinn'].error}")
            if len(cases) > len(shown):
                lines.append(f"      ... and {len(cases) - len(shown)} more")
    lines.append(f"improvements (spinn matches, plain TVM does not): {len(report.improvements)}")
    return "\n".join(lines)
