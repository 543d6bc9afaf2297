"""The timing and energy model (see :mod:`.model`); built on :mod:`tvm_spinn.program` only.

``tvm_spinn.runtime.timing`` re-exports it under its former name.
"""

from .model import LayerTiming, Timing, evaluate, roofline

__all__ = ["LayerTiming", "Timing", "evaluate", "roofline"]
