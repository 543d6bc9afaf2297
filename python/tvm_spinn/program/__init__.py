"""The spinn program: data model and serialized format (see :mod:`.format`)."""

from .format import (
    LAYER_KINDS, PROGRAM_MAGIC, PROGRAM_VERSION, Layer, Program, ProgramError, TensorDesc, Tile,
)

__all__ = [
    "LAYER_KINDS", "PROGRAM_MAGIC", "PROGRAM_VERSION", "Layer", "Program", "ProgramError",
    "TensorDesc", "Tile",
]
