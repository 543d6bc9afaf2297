"""Tiles as data: a layer's tiling is a few integers; its tiles are arrays derived from them.

A program stores, per layer, only its *tile shape* (``program.mapping["layers"][i]["tile"]``)
and the contiguous PE range it runs on; every tile is a pure function of those and the layer's
output shape, so the artifact's header stays O(layers) and the tiles are expanded, vectorized,
only when something needs them (the tile-by-tile reference simulator, the mapper's cost model,
reports).

Regions by layer kind (half-open ``[start, stop)`` ranges over the layer's output), tile shape
and order:

- GEMMs (``conv2d``, ``dense``, ``matmul``; GEMM view ``C[b, m, n] = sum_k A[b, m, k] B[b, k,
  n]``, see :func:`tvm_spinn.program.gemm.gemm_shape`): tile ``[tm, tn, tk]``, regions
  ``[[b, b+1], [m0, m1], [n0, n1]]`` in ``b``, ``m0``, ``n0`` order; the reduction streams
  through the tile's PE in ``k_splits = ceil(K / tk)`` chunks of ``ceil(K / k_splits)``
  (ascending k, output stationary). Tiles of one *group* share a weight block (conv2d:
  ``b * ceil(M / tm) + m0 // tm``; dense: ``n0 // tn``; matmul: none, ``-1``).
- ``softmax``, ``layer_norm``, ``mean``: tile ``[rows]``, regions ``[[r0, r1]]`` over rows.
- pools: tile ``[planes, rows]``, regions ``[[p0, p1], [r0, r1]]`` over ``N*C`` planes and
  output rows (planes outer).
- everything else (element-wise, quantize/dequantize, data movement): tile ``[elements]``,
  regions ``[[e0, e1]]`` over the flattened output.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .gemm import gemm_shape
from .model import Tile

__all__ = [
    "GEMM_KINDS", "ROW_KINDS", "POOL_KINDS", "TileTable", "tile_arity", "region_extent",
    "expand_regions", "k_splits", "tile_count", "count_tiles", "splits_of", "chunk_length",
    "layer_tiles", "layer_tile_shape",
]

GEMM_KINDS = ("conv2d", "dense", "matmul")
ROW_KINDS = ("softmax", "layer_norm", "mean")
POOL_KINDS = ("max_pool2d", "avg_pool2d")


def tile_arity(kind: str) -> int:
    """Number of integers in a tile shape of ``kind`` (GEMM 3, pools 2, others 1)."""
    return 3 if kind in GEMM_KINDS else 2 if kind in POOL_KINDS else 1


def region_extent(program, index: int) -> tuple[int, ...]:
    """The output space the tiles of layer ``index`` partition (see the module docstring)."""
    layer = program.layers[index]
    out = program.tensors[layer.output].shape
    if layer.kind in GEMM_KINDS:
        g = gemm_shape(program, layer)
        return (g.batch, g.m, g.n)
    n_out = int(np.prod(out, dtype=np.int64))
    if layer.kind in ROW_KINDS:
        return (n_out,) if layer.kind == "mean" else (n_out // out[-1],)
    if layer.kind in POOL_KINDS:
        return (out[0] * out[1], out[2])
    return (n_out,)


def _starts(extent: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    lo = np.arange(0, extent, size, dtype=np.int64)
    return lo, np.minimum(lo + size, extent)


def count_tiles(extent: tuple[int, ...], tile) -> int:
    """How many tiles ``tile`` cuts an output space ``extent`` (:func:`region_extent`) into:
    a GEMM's (3-D) batch entries are never split, its ``tk`` does not cut outputs."""
    if len(extent) == 3:
        return extent[0] * -(-extent[1] // tile[0]) * -(-extent[2] // tile[1])
    count = 1
    for e, s in zip(extent, tile):
        count *= -(-e // s)
    return count


def tile_count(program, index: int, tile) -> int:
    """How many tiles ``tile`` cuts layer ``index`` into (without expanding them)."""
    return count_tiles(region_extent(program, index), tile)


def splits_of(k: int, tk: int) -> int:
    """Reduction chunks of a GEMM tile with reduction ``k`` and tile depth ``tk``."""
    return -(-k // min(int(tk), k)) if k else 1


def chunk_length(k: int, tk: int) -> int:
    """Products per chunk, ``ceil(k / splits)``: what one accumulator takes (same for every
    chunk but possibly the last)."""
    return -(-k // splits_of(k, tk)) if k else 1


def k_splits(program, index: int, tile) -> int:
    """Reduction chunks per GEMM tile (1 for other kinds)."""
    layer = program.layers[index]
    if layer.kind not in GEMM_KINDS:
        return 1
    return splits_of(gemm_shape(program, layer).k, tile[2])


def expand_regions(program, index: int, tile) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(lo, hi, group)`` of every tile of layer ``index`` cut by ``tile``: int64 arrays of
    shape ``[T, D]``, ``[T, D]`` and ``[T]`` in tile order (see the module docstring)."""
    layer = program.layers[index]
    ext = region_extent(program, index)
    if layer.kind in GEMM_KINDS:
        batch, m, n = ext
        tm, tn = int(tile[0]), int(tile[1])
        m0, m1 = _starts(m, tm)
        n0, n1 = _starts(n, tn)
        b = np.repeat(np.arange(batch, dtype=np.int64), len(m0) * len(n0))
        mi = np.tile(np.repeat(np.arange(len(m0)), len(n0)), batch)
        ni = np.tile(np.arange(len(n0)), batch * len(m0))
        lo = np.stack([b, m0[mi], n0[ni]], axis=1)
        hi = np.stack([b + 1, m1[mi], n1[ni]], axis=1)
        if layer.kind == "conv2d":
            group = b * len(m0) + mi
        elif layer.kind == "dense":
            group = ni.astype(np.int64)
        else:
            group = np.full(len(b), -1, dtype=np.int64)
        return lo, hi, group
    if layer.kind in POOL_KINDS:
        p0, p1 = _starts(ext[0], int(tile[0]))
        r0, r1 = _starts(ext[1], int(tile[1]))
        pi = np.repeat(np.arange(len(p0)), len(r0))
        ri = np.tile(np.arange(len(r0)), len(p0))
        lo = np.stack([p0[pi], r0[ri]], axis=1)
        hi = np.stack([p1[pi], r1[ri]], axis=1)
        return lo, hi, np.full(len(pi), -1, dtype=np.int64)
    e0, e1 = _starts(ext[0], int(tile[0]))
    return e0[:, None], e1[:, None], np.full(len(e0), -1, dtype=np.int64)


def layer_tile_shape(program, index: int) -> list[int]:
    """The tile shape the program's mapping recorded for layer ``index``."""
    return program.mapping["layers"][index]["tile"]


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
