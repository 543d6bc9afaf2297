"""Tiling: split every layer into units of work that fit one PE's SRAM.

What a tile of each layer kind is, what it costs and how big it may be is defined by the kind's
operator family (:mod:`tvm_spinn.program.ops`: the regions, tile shapes, smallest tile, work and
per-tile bytes and cycles); this module is the mapper's driver over them. Regions and tile
shapes are listed in :mod:`tvm_spinn.program.tiles`.

Bytes come from the tensors' dtypes (1 for int8/uint8, 4 for float32): a tile's ``in_bytes``,
``w_bytes``, ``out_bytes`` and the operand buffers in ``sram_bytes``. GEMM accumulators are
32-bit words in SRAM whatever the operands (:data:`ACC_BYTES`); compute cycles follow the
layer's ``mode`` (fp32 on the Cortex-M4F, int8 on the MAC array: see
:mod:`tvm_spinn.program.ops.gemm`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..program import Layer, Program
from ..program.ops import MappingError, family_of
from ..program.ops.base import ACC_BYTES
from ..program.ops.gemm import (Gemm, GemmShape, Int8Side, choose_gemm_tile, gemm_shape, gemm_tile_cycles, int8_side,
                                safe_k_chunk, smallest_gemm_tile_bytes)
from ..program.ops.pool import smallest_pool_tile_bytes
from ..program.ops.rows import smallest_row_tile_bytes
from ..program.tiles import TileTable, expand_regions, k_splits
from ..target.arch import SpinnArch

__all__ = [
    "GemmShape", "gemm_shape", "choose_gemm_tile", "gemm_tile_cycles", "Int8Side", "int8_side",
    "safe_k_chunk", "tile_layer", "MappingError", "ACC_BYTES", "layer_work", "program_work", "choose_tile", "tile_costs", "smallest_tile_bytes",
    "smallest_gemm_tile_bytes", "smallest_row_tile_bytes", "smallest_pool_tile_bytes",
]


def _family(program: Program, index: int):
    layer = program.layers[index]
    family = family_of(layer.kind)
    if family is None:
        raise MappingError(f"layer {layer.name}: kind {layer.kind!r} has no operator family")
    return layer, family


def smallest_tile_bytes(program: Program, index: int, arch: SpinnArch) -> int:
    """SRAM of the smallest tile layer ``index`` can be cut into (the tiler raises
    :class:`MappingError` when it exceeds ``arch.tile_sram_bytes``; the partition's checks use
    the same rule, so a layer the partition accepts always tiles)."""
    layer, family = _family(program, index)
    return family.smallest_tile_bytes(program, layer, arch)


def _check_fits(program: Program, index: int, arch: SpinnArch) -> None:
    need = smallest_tile_bytes(program, index, arch)
    if need > arch.tile_sram_bytes:
        layer = program.layers[index]
        raise MappingError(
            f"layer {layer.name}: its smallest tile needs {need} bytes of SRAM, a PE has "
            f"{arch.tile_sram_bytes}; the smallest system that fits has sram_bytes >= "
            f"{need + arch.sram_reserved_bytes}"
        )


def _check_nonempty(program: Program, index: int) -> None:
    # The partitioner keeps zero-size ops on the host; a program built by hand may not.
    layer = program.layers[index]
    t = program.tensors
    for tid in (*layer.inputs, layer.output):
        if 0 in tuple(t[tid].shape):
            raise MappingError(f"layer {layer.name}: tensor {tid} has a zero-size shape "
                               f"{tuple(t[tid].shape)} (dim {tuple(t[tid].shape).index(0)}); "
                               "zero-size ops run on the host")


def _worked(program: Program, index: int, arch: SpinnArch) -> Layer:
    layer, family = _family(program, index)
    flops, gemm = family.work(program, layer, arch)
    return replace(layer, flops=int(flops), gemm=layer.gemm if gemm is None else list(gemm))


def layer_work(program: Program, index: int, arch: SpinnArch) -> Program:
    """``program`` with layer ``index`` replaced by a new record with its ``gemm`` and ``flops``
    (operations of the layer, the cost model's work) set."""
    layers = list(program.layers)
    layers[index] = _worked(program, index, arch)
    return replace(program, layers=layers)


def program_work(program: Program, arch: SpinnArch) -> Program:
    """``program`` with every layer's work set (:func:`layer_work`; a layer's work depends on
    the layer and the tensors, never on the other layers)."""
    return replace(program, layers=[_worked(program, index, arch) for index in range(len(program.layers))])


def choose_tile(program: Program, index: int, arch: SpinnArch, pes: int | None = None,
                naive: bool = False, resident: bool = False) -> list[int]:
    """The tile shape of layer ``index`` for ``pes`` PEs (see :mod:`tvm_spinn.program.tiles`);
    ``resident``: a GEMM's weights will be held in SRAM (``MappingOptions(weights="resident")``),
    so its tiles are costed without weight transfers."""
    layer, family = _family(program, index)
    _check_nonempty(program, index)
    _check_fits(program, index, arch)
    if resident and isinstance(family, Gemm):
        return family.choose_tile(program, layer, arch, pes or arch.total_pes, naive, resident=True)
    return family.choose_tile(program, layer, arch, pes or arch.total_pes, naive)


def tile_costs(program: Program, index: int, arch: SpinnArch, tile) -> TileTable:
    """The tiles of layer ``index`` cut by ``tile``, with their bytes, SRAM and cycles
    (vectorized; unplaced: ``pe = chip = -1``)."""
    layer, family = _family(program, index)
    lo, hi, group = expand_regions(program, index, tile)
    count = len(group)
    sram, in_b, w_b, out_b, cycles = family.tile_costs(program, layer, arch, tile, lo, hi)

    def full(v) -> np.ndarray:
        # a scalar (one figure for every tile) filled directly: the broadcast's view costs more
        v = np.asarray(v, dtype=np.int64)
        return np.full(count, v, dtype=np.int64) if v.ndim == 0 else np.broadcast_to(v, (count,)).copy()

    return TileTable(layer=index, k_splits=k_splits(program, index, tile), lo=lo, hi=hi, group=group,
                     pe=np.full(count, -1, np.int64), chip=np.full(count, -1, np.int64),
                     sram_bytes=full(sram), in_bytes=full(in_b), w_bytes=full(w_b),
                     out_bytes=full(out_b), cycles=full(cycles))


def tile_layer(program: Program, index: int, arch: SpinnArch, pes: int | None = None,
               naive: bool = False) -> TileTable:
    """Tiles (without PE assignment) of ``program.layers[index]`` for ``pes`` PEs: the tile
    shape :func:`choose_tile` picks, expanded with its costs (:func:`tile_costs`). Sets the
    layer's ``gemm`` and ``flops`` first (in a copy: ``program`` is left as it is)."""
    program = layer_work(program, index, arch)
    return tile_costs(program, index, arch, choose_tile(program, index, arch, pes, naive))
