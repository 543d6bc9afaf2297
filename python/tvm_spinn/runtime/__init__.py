"""Runtime: the program executor behind the C++ ``spinn`` module, simulator and timing model."""

from . import executor
from .simulator import run_program
from .timing import Timing, evaluate, roofline

__all__ = ["executor", "run_program", "Timing", "evaluate", "roofline"]
