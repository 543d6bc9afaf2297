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

from collections import OrderedDict
from dataclasses import replace

import numpy as np

from .._scoped import ScopedOptions

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
    "safe_k_chunk", "tile_layer", "MappingError", "ACC_BYTES", "layer_work", "program_work", "choose_tile", "tile_costs", "TileCostMemo", "smallest_tile_bytes",
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
    (vectorized; unplaced: ``pe = chip = -1``); inside ``with TileCostMemo():`` a table of the
    same layer structure and tile already costed is reused (see :class:`TileCostMemo`)."""
    memo = TileCostMemo.current()
    key = memo.key(program, index, arch, tile) if memo is not None else None
    if key is not None:
        table = memo.get(key)
        if table is not None:
            return table if table.layer == index else replace(table, layer=index)
    table = _tile_costs(program, index, arch, tile)
    if key is not None:
        memo.put(key, table)
    return table


def _tile_costs(program: Program, index: int, arch: SpinnArch, tile) -> TileTable:
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


class TileCostMemo(ScopedOptions):
    """Tile tables already costed, reused by :func:`tile_costs` while the memo is active
    (``with memo:``, innermost in this thread).

    A layer's tile table (bounds, groups, bytes, SRAM, cycles) is a function of the layer's
    record (kind, mode, attributes, work), the shape, dtype, role and offset of each tensor it
    reads or writes (in its operand order, repeated operands marked), the tile and the
    architecture: an operator family's ``tile_costs``, ``expand_regions`` and ``k_splits`` read
    nothing else of the program (not its constants' data, nor its other layers). The
    mapper costs the same layer many times over: each shard plan of a program, each budget
    of a stage, each tile a layout tries; the LLM planner maps a block at several contexts,
    projection forms and weight modes whose GEMMs are mostly the same layers. The key is
    exactly those inputs, so a reused table is the table :func:`tile_costs` would compute.
    Stored tables' arrays are made read-only (tables are shared as they are: a placed copy
    keeps its costs' arrays). At most ``limit`` tables are kept, the least recently used
    dropped first."""

    def __init__(self, limit: int = 4096):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"TileCostMemo limit must be a positive integer, got {limit!r}")
        self.limit = limit
        self.tables: OrderedDict = OrderedDict()
        self.hits = self.misses = 0

    @staticmethod
    def key(program: Program, index: int, arch: SpinnArch, tile) -> "tuple | None":
        """Everything :func:`tile_costs` reads, hashable; None where an attribute has no
        exact hashable form (that layer is costed afresh)."""
        layer = program.layers[index]
        attrs = _exact(layer.attrs)
        if attrs is _INEXACT:
            return None
        tensors = program.tensors
        roles = sorted(layer.consts.items())
        order = list(layer.inputs) + [tid for _, tid in roles] + [layer.output]
        first: dict = {}
        aliases = tuple(first.setdefault(tid, len(first)) for tid in order)

        def desc(tid: int) -> tuple:
            d = tensors[tid]
            return tuple(int(v) for v in d.shape), str(d.dtype), d.role, int(d.offset)

        return (layer.kind, layer.mode, None if layer.gemm is None else tuple(int(v) for v in layer.gemm),
                int(layer.flops), attrs, tuple(role for role, _ in roles), aliases, tuple(desc(t) for t in order),
                tuple(int(v) for v in tile), arch)

    def get(self, key: tuple) -> "TileTable | None":
        table = self.tables.get(key)
        if table is None:
            self.misses += 1
            return None
        self.hits += 1
        self.tables.move_to_end(key)
        return table

    def put(self, key: tuple, table: TileTable) -> None:
        for value in vars(table).values():
            if isinstance(value, np.ndarray):
                value.flags.writeable = False
        self.tables[key] = table
        if len(self.tables) > self.limit:
            self.tables.popitem(last=False)


#: :func:`_exact`'s mark of a value with no exact hashable form
_INEXACT = object()


def _exact(value):
    """``value`` (a layer attribute) as an exact hashable value, or :data:`_INEXACT`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    if isinstance(value, np.generic):
        return ("np", str(value.dtype), value.item())
    if isinstance(value, np.ndarray):
        return ("nd", value.shape, str(value.dtype), value.tobytes())
    if isinstance(value, dict):
        items = [(k, _exact(v)) for k, v in sorted(value.items())]
        return _INEXACT if any(v is _INEXACT for _, v in items) else ("dict", tuple(items))
    if isinstance(value, (list, tuple)):
        items = [_exact(v) for v in value]
        return _INEXACT if any(v is _INEXACT for v in items) else (type(value).__name__, tuple(items))
    return _INEXACT


def tile_layer(program: Program, index: int, arch: SpinnArch, pes: int | None = None,
               naive: bool = False) -> TileTable:
    """Tiles (without PE assignment) of ``program.layers[index]`` for ``pes`` PEs: the tile
    shape :func:`choose_tile` picks, expanded with its costs (:func:`tile_costs`). Sets the
    layer's ``gemm`` and ``flops`` first (in a copy: ``program`` is left as it is)."""
    program = layer_work(program, index, arch)
    return tile_costs(program, index, arch, choose_tile(program, index, arch, pes, naive))
