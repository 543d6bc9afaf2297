"""Tiles as data: a layer's tiling is a few integers; its tiles are arrays derived from them.

A program stores, per layer, only its *tile shape* (``program.mapping.layers[i].tile``)
and the contiguous PE range it runs on; every tile is a pure function of those and the layer's
output shape, so the artifact's header stays O(layers) and the tiles are expanded, vectorized,
only when something needs them (the tile-by-tile reference simulator, the mapper's cost model,
reports).

Regions by layer kind (half-open ``[start, stop)`` ranges over the layer's output), tile shape
and order (each defined by the kind's operator family, :mod:`tvm_spinn.program.ops`):

- GEMMs (``conv2d``, ``dense``, ``matmul``; GEMM view ``C[b, m, n] = sum_k A[b, m, k] B[b, k,
  n]``, see :func:`tvm_spinn.program.ops.gemm.gemm_shape`): tile ``[tm, tn, tk]``, regions
  ``[[b, b+1], [m0, m1], [n0, n1]]`` in ``b``, ``m0``, ``n0`` order; the reduction streams
  through the tile's PE in ``k_splits = ceil(K / tk)`` chunks of ``ceil(K / k_splits)``
  (ascending k, output stationary). Tiles of one *group* share a weight block (conv2d:
  ``b * ceil(M / tm) + m0 // tm``; dense: ``n0 // tn``; matmul: none, ``-1``). int8 tile
  ``[tm, tn, tk, p]``: each region's chunks split over ``p`` tiles (PEs), regions ``[[b, b+1],
  [m0, m1], [n0, n1], [k0, k1]]`` (parts innermost), groups ``g * p + j``; the part with ``k1 =
  K`` adds the others' int32 partial sums (:func:`tvm_spinn.program.ops.gemm.k_part_bounds`).
- ``softmax``, ``layer_norm``, ``rms_norm``, ``mean``: tile ``[rows, cols]``, regions ``[[r0, r1], [c0, c1]]``
  over rows and the elements of a row (rows outer; ``cols`` below the row length: a row split
  over PEs, its sums chained, see :mod:`tvm_spinn.program.ops.rows`).
- pools: tile ``[planes, rows]``, regions ``[[p0, p1], [r0, r1]]`` over ``N*C`` planes and
  output rows (planes outer).
- everything else (element-wise, quantize/dequantize, data movement): tile ``[elements]``,
  regions ``[[e0, e1]]`` over the flattened output.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .model import Tile
from .ops import family_of
from .ops.gemm import chunk_length, splits_of

__all__ = [
    "TileTable", "tile_arity", "tile_arity_optional", "region_extent",
    "expand_regions", "k_splits", "tile_count", "count_tiles", "splits_of", "chunk_length",
    "layer_tiles", "layer_tile_shape",
]

def _family(kind: str):
    family = family_of(kind)
    if family is None:
        raise ValueError(f"layer kind {kind!r} has no operator family (tvm_spinn.program.ops)")
    return family


def tile_arity(kind: str) -> int:
    """Number of integers in a tile shape of ``kind`` (GEMM 3, pools 2, others 1)."""
    return _family(kind).tile_arity


def tile_arity_optional(kind: str) -> int:
    """Optional trailing integers a tile shape of ``kind`` may add (GEMM 1: the reduction's
    PEs ``p``; others 0)."""
    return int(getattr(_family(kind), "tile_optional", 0))


def region_extent(program, index: int) -> tuple[int, ...]:
    """The output space the tiles of layer ``index`` partition (see the module docstring)."""
    layer = program.layers[index]
    return _family(layer.kind).region_extent(program, layer)


def count_tiles(extent: tuple[int, ...], tile) -> int:
    """How many tiles ``tile`` cuts an output space ``extent`` (:func:`region_extent`) into:
    a GEMM's (3-D) batch entries are never split, its ``tk`` does not cut outputs."""
    if len(extent) == 3:  # a GEMM; ``[tm, tn, tk, p]``: each region's reduction in p parts
        parts = int(tile[3]) if len(tile) > 3 else 1
        return extent[0] * -(-extent[1] // tile[0]) * -(-extent[2] // tile[1]) * parts
    count = 1
    for e, s in zip(extent, tile):
        count *= -(-e // s)
    return count


def tile_count(program, index: int, tile) -> int:
    """How many tiles ``tile`` cuts layer ``index`` into (without expanding them)."""
    return count_tiles(region_extent(program, index), tile)


def k_splits(program, index: int, tile) -> int:
    """Reduction chunks per tile (GEMMs; 1 for other kinds)."""
    layer = program.layers[index]
    return _family(layer.kind).k_splits(program, layer, tile)


def expand_regions(program, index: int, tile) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(lo, hi, group)`` of every tile of layer ``index`` cut by ``tile``: int64 arrays of
    shape ``[T, D]``, ``[T, D]`` and ``[T]`` in tile order (see the module docstring)."""
    layer = program.layers[index]
    return _family(layer.kind).expand_regions(program, layer, tile)


def layer_tile_shape(program, index: int) -> list[int]:
    """The tile shape the program's mapping recorded for layer ``index``."""
    return list(program.mapping.layers[index].tile)


def layer_tiles(program, index: int) -> list[Tile]:
    """The tiles of layer ``index`` as :class:`Tile` records (regions, group and k_splits only;
    no placement or costs): what the tile-by-tile reference simulator executes."""
    tile = layer_tile_shape(program, index)
    lo, hi, group = expand_regions(program, index, tile)
    ks = k_splits(program, index, tile)
    pairs = np.stack([lo, hi], axis=2).tolist()
    return [Tile(layer=index, pe=-1, region=r, k_splits=ks, group=g) for r, g in zip(pairs, group.tolist())]


@dataclass(frozen=True)
class TileTable:
    """The tiles of one layer, one array element per tile (what the mapper, the memory planner
    and the timing model work on, vectorized).

    ``lo``/``hi`` are ``[T, D]`` region bounds; every other field is an int64 ``[T]`` array:
    ``group`` (shared weight block, -1 for none), ``pe`` and ``chip`` (placement), and the
    per-tile costs ``sram_bytes``, ``in_bytes``, ``w_bytes``, ``out_bytes``, ``cycles``.
    ``k_splits`` is one number for the layer.
    """

    layer: int
    k_splits: int
    lo: np.ndarray
    hi: np.ndarray
    group: np.ndarray
    pe: np.ndarray
    chip: np.ndarray
    sram_bytes: np.ndarray
    in_bytes: np.ndarray
    w_bytes: np.ndarray
    out_bytes: np.ndarray
    cycles: np.ndarray

    def __len__(self) -> int:
        return len(self.group)

    def row(self, i: int) -> Tile:
        """Tile ``i`` as a :class:`Tile` record."""
        return Tile(layer=self.layer, pe=int(self.pe[i]), chip=int(self.chip[i]),
                    region=np.stack([self.lo[i], self.hi[i]], axis=1).tolist(), k_splits=self.k_splits,
                    group=int(self.group[i]), sram_bytes=int(self.sram_bytes[i]),
                    in_bytes=int(self.in_bytes[i]), w_bytes=int(self.w_bytes[i]),
                    out_bytes=int(self.out_bytes[i]), cycles=int(self.cycles[i]))

    def __iter__(self):
        return (self.row(i) for i in range(len(self)))

    def __getitem__(self, i: int) -> Tile:
        return self.row(i)

    def placed(self, pe: np.ndarray, pes_per_chip: int) -> "TileTable":
        """A copy with tiles placed on ``pe`` (global PE indices)."""
        pe = np.asarray(pe, dtype=np.int64)
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(pe=pe, chip=pe // pes_per_chip)
        return TileTable(**values)


class ProgramTiles:
    """All tiles of a mapped program, layer after layer (a read-only sequence of :class:`Tile`
    with program-wide indices; ``tables[i]`` is layer ``i``'s :class:`TileTable`)."""

    def __init__(self, tables: list[TileTable]):
        self.tables = tables
        self.offsets = np.concatenate([[0], np.cumsum([len(t) for t in tables], dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __iter__(self):
        for table in self.tables:
            yield from table

    def __getitem__(self, i: int) -> Tile:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        layer = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.tables[layer].row(i - int(self.offsets[layer]))

    def layer_of(self, index: "int | np.ndarray"):
        """The layer of program-wide tile ``index`` (vectorized)."""
        return np.searchsorted(self.offsets, index, side="right") - 1
