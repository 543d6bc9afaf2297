"""Runtime: the program executor behind the C++ ``spinn`` module, simulator and timing model."""

from . import checked_take, executor  # noqa: F401  (register the runtime callbacks)
from .simulator import run_program
from .timing import TimingSummary, evaluate, roofline

__all__ = ["executor", "run_program", "TimingSummary", "evaluate", "roofline"]
