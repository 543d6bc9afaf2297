"""Offloaded operators, one module per family of layer kinds.

Each family (:class:`~tvm_spinn.program.ops.base.OpFamily`) is the one home of what the
compiler and the runtime know about its kinds: the partition pattern and its check, the
lowering to program layers, the attribute schema and operand rules the validator enforces, the
tile geometry, the work, smallest tile, tile choice and tile costs of the mapper, and the
functional kernels of the simulator (tile by tile and whole layer). Adding an operator means
adding or extending one module here; the stages look families up by layer kind
(:func:`family_of`).

Families: :mod:`.gemm` (conv2d, dense, matmul; fp32 and int8), :mod:`.qdq` (quantize,
dequantize), :mod:`.rows` (softmax, layer_norm, rms_norm, mean), :mod:`.pool` (max / average pooling, max pooling's gradient),
:mod:`.elementwise` (unary, power, clip, binary, where_less), :mod:`.rope` (rotary position embedding), :mod:`.movement` (reshape, permute_dims,
broadcast_to, strided_slice, concat, pad), :mod:`.gather` (take) and :mod:`.loss` (cross_entropy and its
gradient, training's loss).
"""

from __future__ import annotations

from .base import LoweringError, MappingError, OpFamily, families, family_of, register, unregister
from . import gemm, qdq, loss, rows, pool, elementwise, movement, gather, rope  # noqa: F401,E402  (each registers)

__all__ = ["OpFamily", "MappingError", "LoweringError", "families", "family_of", "register", "unregister", "family_for_composite", "layer_kinds"]


def layer_kinds() -> tuple[str, ...]:
    """Every layer kind a program may hold: those of the registered families."""
    return tuple(kind for family in families() for kind in family.kinds)


def family_for_composite(composite: str) -> OpFamily | None:
    """The family that lowers composite ``spinn.<composite>``, or None."""
    for family in families():
        if family.lowers(composite):
            return family
    return None
