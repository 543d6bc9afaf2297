"""Ctrl-C and failure bookkeeping for a tuning job.

MetaSchedule runs the search in C++ and calls back into Python (builder, runner, callbacks). A
``KeyboardInterrupt`` raised inside such a callback crosses the FFI boundary as a
``RuntimeError('')``, so a job that catches per-task errors would take Ctrl-C for a failed task,
skip it and go on. :class:`InterruptGuard` remembers that SIGINT arrived, so the job can turn
whatever comes out of MetaSchedule back into a ``KeyboardInterrupt``; :class:`GuardCallback`
runs first among the measure callbacks and stops the batch in flight before MetaSchedule adds
it to the database (its candidates may have been killed by the same Ctrl-C: recording them
as failed, 1e10 s, would poison the logs).
"""

from __future__ import annotations

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

from .._interrupts import InterruptGuard

__all__ = ["InterruptGuard", "GuardCallback"]


@derived_object
class GuardCallback(PyMeasureCallback):
    """First measure callback of a job: stop on Ctrl-C, keep the first error of each batch.

    Parameters
    ----------
    guard : InterruptGuard
        The job's guard; a pending interrupt aborts the batch before it reaches the database.
    """

    def __init__(self, guard: InterruptGuard) -> None:
        super().__init__()
        self.guard = guard
        self.errors: list[str] = []

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:  # noqa: D102
        self.guard.check()
        for built, ran in zip(builder_results, runner_results):
            message = built.error_msg or ran.error_msg
            if message:
                self.errors.append(str(message))

    def first_error(self) -> str | None:
        """The first candidate error seen since the last :meth:`reset` (its last line)."""
        for message in self.errors:
            lines = [line for line in message.strip().splitlines() if line.strip()]
            if lines:
                return lines[-1].strip()
        return None

    def reset(self) -> None:
        """Forget the errors (called before each task)."""
        self.errors = []
