"""Reports: performance summary of a compiled model."""

from .report import Report, find_spinn_modules, report

__all__ = ["Report", "find_spinn_modules", "report"]
