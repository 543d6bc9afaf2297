"""Mapping options: the ``mapping`` part of :class:`tvm_spinn.SpinnOptions`.

``relax.build`` has no slot for backend options, so the current :class:`MappingOptions` is read
from the active options (``with tvm_spinn.MappingOptions(mode="pipelined"): relax.build(...)``)
and serialized into the program, where the report shows it.
"""

from __future__ import annotations

from ..options import MappingOptions, current

__all__ = ["MappingOptions", "current_options"]


def current_options() -> MappingOptions:
    """The mapping part of the innermost active options (defaults when none)."""
    return current().mapping
