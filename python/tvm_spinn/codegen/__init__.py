"""Codegen: partitioned Relax functions -> spinn programs -> ``spinn`` runtime modules."""

from .codegen import MANIFEST_MAGIC, MANIFEST_SYMBOL, codegen_spinn, compile_function, make_manifest_module
from .lower import LoweringError, lower_function

__all__ = [
    "MANIFEST_MAGIC", "MANIFEST_SYMBOL", "codegen_spinn", "compile_function", "make_manifest_module",
    "LoweringError", "lower_function",
]
