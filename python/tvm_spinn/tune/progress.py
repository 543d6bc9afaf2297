"""A MetaSchedule measure callback that advances a progress bar."""

from __future__ import annotations

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

__all__ = ["ProgressCallback"]


@derived_object
class ProgressCallback(PyMeasureCallback):
    """Advance ``bar`` (tqdm-like: ``update(n)``) by each measured batch."""

    def __init__(self, bar) -> None:
        super().__init__()
        self.bar = bar

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:  # noqa: D102
        self.bar.update(len(runner_results))
