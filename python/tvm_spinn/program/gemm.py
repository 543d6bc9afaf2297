"""GEMM view of a layer and the MAC-array accumulator limit, shared by validation, the simulator
and the mapper (:mod:`tvm_spinn.mapping.tiling` re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .model import Layer

__all__ = ["GemmShape", "gemm_shape", "safe_k_chunk"]


@dataclass(frozen=True)
class GemmShape:
    batch: int
    m: int
    n: int
    k: int


def gemm_shape(program, layer: Layer) -> GemmShape:
    """GEMM view of a conv2d / dense / matmul layer of ``program`` (a :class:`~.format.Program`)."""
    t = program.tensors
    out = t[layer.output].shape
    if layer.kind == "conv2d":
        w = t[layer.consts["weight"]].shape
        groups = layer.attrs["groups"]
        return GemmShape(batch=out[0] * groups, m=w[0] // groups, n=out[2] * out[3], k=w[1] * w[2] * w[3])
    if layer.kind == "dense":
        w = t[layer.consts["weight"]].shape
        return GemmShape(batch=1, m=int(np.prod(out[:-1], dtype=np.int64)), n=w[1], k=w[0])
    a, b = t[layer.inputs[0]].shape, t[layer.inputs[1]].shape
    batch = int(np.prod(out[:-2], dtype=np.int64)) if len(out) > 2 else 1
    return GemmShape(batch=batch, m=a[-2], n=b[-1], k=a[-1])


def safe_k_chunk(arch, operand_bits: int = 8) -> int:
    """Longest reduction a MAC-array accumulator can take without overflowing.

    Each product of two signed ``operand_bits`` values is at most ``2**(2*(bits-1))`` in
    magnitude (-128 * -128 for int8), so ``k`` products fit a signed ``acc_bits`` accumulator when
    ``k * 2**(2*(bits-1)) <= 2**(acc_bits-1) - 1``: 511 for int8 into the production chip's 24
    bits, 16383 into the test chip's 29. Longer reductions are split into chunks whose partial
    sums the M4F adds in 32-bit.

    ``arch`` is a :class:`tvm_spinn.target.arch.SpinnArch` (only ``acc_bits`` is read).
    """
    return max(1, (2 ** (arch.acc_bits - 1) - 1) // 2 ** (2 * (operand_bits - 1)))
