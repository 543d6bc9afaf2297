"""Exceptions of :mod:`tvm_spinn.training` (one class per kind of bad input)."""

from __future__ import annotations

__all__ = ["TrainingError", "CheckpointError"]


class TrainingError(ValueError):
    """Bad input to the training API: the message names the argument, loss, optimizer, layer or
    tensor and the shape/dtype expected."""


class CheckpointError(TrainingError):
    """A checkpoint that cannot be loaded into this trainer (file, field or parameter named)."""
