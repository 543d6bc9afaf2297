"""GEMMs: ``conv2d`` (NCHW / OIHW, grouped and depthwise), ``dense`` (``x @ W``) and batched
``matmul``, in fp32 on the Cortex-M4F or int8 on the MAC array.

GEMM view ``C[b, m, n] = sum_k A[b, m, k] B[b, k, n]`` (:func:`gemm_shape`): conv2d uses ``A = weight[oc, ic*kh*kw]`` (m = output channel), ``B = im2col
(input)`` (n = output pixel), b = batch x group; dense and matmul use ``A = input`` and ``B =
weight``/rhs (matmul's batches broadcast).

- fp32 arithmetic: ``acc = fl(acc + fl(a * b))`` with k strictly ascending from 0 (VMLA.F32 is
  not fused); each output reduces on one PE whatever the tiling, so the result does not depend
  on it. Bias is added to the finished accumulator, then ReLU (``x > 0 ? x : +0``).
- int8 arithmetic (``mode="int8"``): raw int8 products into ``acc_bits``-bit wrapping
  accumulators, one k-chunk at a time (chunks of :func:`chunk_length`, at most
  :func:`safe_k_chunk` long); the M4F adds chunk sums in 32-bit,
  applies the zero-point terms and the epilogue (dequantize, or requantize with a fixed-point
  multiplier: :mod:`tvm_spinn.program.quant`), or with ``attrs.out = "int32"`` (no zero points)
  outputs the int32 sums. ``uint8`` operands have their top bit flipped.
- Tiles: ``[tm, tn, tk]``, regions ``[[b, b+1], [m0, m1], [n0, n1]]`` in ``b``, ``m0``, ``n0``
  order; the reduction streams through the tile's PE in ``k_splits = ceil(K / tk)`` chunks
  (output stationary). Tiles of one group share a weight block (conv2d: ``b * ceil(M / tm) +
  m0 // tm``; dense: ``n0 // tn``; matmul: none). Tile shapes are chosen by a cost model among
  candidates padded to the MAC array (:func:`choose_gemm_tile`).
- Reduction split over PEs (int8 only): tile ``[tm, tn, tk, p]`` cuts each output region's
  ``k_splits`` chunks into ``p`` contiguous parts (:func:`k_part_bounds`, on chunk boundaries),
  each a tile of its own with a fourth region axis ``[k0, k1]`` (parts innermost) and its own
  weight block (group ``g * p + j``). Every chunk stays within :func:`safe_k_chunk` products, so
  no accumulator wraps and the int32 sum of the parts' partial sums is the whole reduction's
  (integer adds are exact in any order): the bits do not depend on ``p``. The last part
  (``k1 = K``) reduces: it DMAs the other parts' ``vm*vn`` int32 partials over the NoC, adds them
  and runs the epilogue, after its own chunks (:func:`k_part_tail_cycles`; the partials' few
  bytes are costed there, in its DMA time, not in the chip's NoC traffic), with one more
  accumulator block of SRAM to receive them. fp32 tiles never split (their k order is the
  result).
- Compute cycles of a tile (:func:`gemm_tile_cycles`): fp32 the PE kernel's register blocks
  (:func:`~.geometry.fp32_tile_cycles`: ``4 x 4`` blocks, ``4 x 1`` right edges, single outputs
  below, priced by the instructions the generated code executes); int8: the tile padded to ``mac_rows x mac_cols`` blocks in the orientation
  that pads least (:func:`mac_passes`), each streaming
  its reduction one k-chunk at a time (1 cycle per k) then reading out its sums, overlapped
  with the M4F's adds of later chunks' sums and of the activation operands' zero-point sums
  (the longer of the two). The generated PE kernel's own cost, its requantization included,
  is :func:`~.geometry.int8_pipelined_cycles` (the M4F's share alone:
  :func:`~.geometry.int8_m4f_cycles`, :class:`Int8Side`), checked against executed code by
  ``bench/iss.py``.
  ``layer.flops`` is ``2 * M * N * K`` in both modes.

The package by concern: :mod:`.geometry` (the GEMM view, reduction chunks, tile cycles and the
tile chooser), :mod:`.reference` (the simulator's arithmetic and the native plan's
instructions), :mod:`.family` (the operator family), :mod:`.patterns` (partition patterns and
checks, lowering, int8 epilogue validation), :mod:`.shard_rule` (how GEMMs shard) and
:mod:`.descriptor` (GEMMs of descriptor programs).
"""

from __future__ import annotations

from .geometry import (GEMM_KINDS, GemmShape, Int8Side, choose_gemm_tile, choose_matmul_tile, chunk_length, gemm_shape,
                       gemm_tile_cycles, has_row_tiles, int8_side, k_part_bounds, k_part_tail_cycles, mac_passes,
                       safe_k_chunk, smallest_gemm_tile_bytes, splits_of)
from .family import Gemm
from .shard_rule import GemmSharding
from .descriptor import fuse_bias, share_quantizes, weight_matmuls_to_dense
from ..base import register

__all__ = ["Gemm", "weight_matmuls_to_dense", "fuse_bias", "share_quantizes", "GemmShape", "gemm_shape", "safe_k_chunk", "Int8Side", "int8_side", "gemm_tile_cycles", "mac_passes", "choose_gemm_tile", "choose_matmul_tile", "has_row_tiles",
           "smallest_gemm_tile_bytes", "splits_of", "chunk_length", "k_part_bounds", "k_part_tail_cycles", "GEMM_KINDS"]

Gemm.sharding = GemmSharding()
register(Gemm())
