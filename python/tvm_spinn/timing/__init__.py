"""The timing and energy model (see :mod:`.model`); built on :mod:`tvm_spinn.program` only.

``tvm_spinn.runtime.timing`` re-exports it under its former name.
"""

from ..program.records import LayerTimingSummary, TimingSummary
from .model import evaluate, evaluate_traced, roofline

__all__ = ["LayerTimingSummary", "TimingSummary", "evaluate", "evaluate_traced", "roofline"]
