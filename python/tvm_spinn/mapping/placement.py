"""Placement: how many chips each layer spans, and which PE runs each tile.

- :func:`choose_chips` (sequential mode): per layer, the number of chips (tensor parallelism)
  that minimizes ``max(compute / PEs, DRAM bytes / DRAM bandwidth) + link all-gather`` — large
  layers spread over the board, small ones stay on one chip and avoid link traffic.
- :func:`pipeline_groups` (pipelined mode): disjoint PE ranges per layer, sized by work.
- :func:`place_tiles`: longest-processing-time-first assignment of tile groups (tiles sharing a
  weight block) to the least loaded PE, a round of PEs at a time (vectorized), so each weight
  block is fetched once per PE; groups are split when there are fewer groups than PEs, and cut
  into contiguous runs of nearly equal cycles when whole groups cannot be balanced (150 groups
  on 148 PEs). Deterministic (ties by index).
"""

from __future__ import annotations

import numpy as np

from ..program import Layer, Program
from ..program.tiles import TileTable
from ..target.arch import SpinnArch

__all__ = ["choose_chips", "pipeline_groups", "place_tiles", "layer_estimate"]


def _layer_bytes(program: Program, layer: Layer) -> tuple[int, int]:
    """(activation bytes in+out, weight bytes) of a layer."""
    t = program.tensors
    acts = sum(t[i].nbytes for i in layer.inputs if t[i].role != "const") + t[layer.output].nbytes
    weights = sum(t[i].nbytes for i in layer.inputs if t[i].role == "const")
    weights += sum(t[i].nbytes for i in layer.consts.values())
    return acts, weights


def _work_cycles(layer: Layer, arch: SpinnArch) -> float:
    """Single-PE compute cycles: int8 GEMMs on the MAC array, the rest on the M4F."""
    rate = arch.macs_per_cycle if layer.mode == "int8" else arch.m4f_flops_per_cycle
    return max(layer.flops, 1) / (2 * rate)


def layer_estimate(program: Program, layer: Layer, arch: SpinnArch, chips: int, pes: int | None = None) -> float:
    """Cycles estimate of a layer on ``chips`` chips (or ``pes`` PEs), for mapping decisions."""
    pes = pes or chips * arch.pes_per_chip
    acts, weights = _layer_bytes(program, layer)
    compute = _work_cycles(layer, arch) / pes
    dram = (acts + weights) / (arch.dram_bw_bytes_s * chips / arch.clock_hz)
    link = 0.0
    if chips > 1:
        in_bytes = sum(program.tensors[i].nbytes for i in layer.inputs if program.tensors[i].role != "const")
        link_bw = arch.payload_bw("chip") * arch.links_per_chip / arch.clock_hz  # payload, not the line rate
        link = in_bytes * (chips - 1) / chips / link_bw
    return max(compute, dram) + link + arch.barrier_cost_cycles(pes)


def choose_chips(program: Program, arch: SpinnArch) -> list[int]:
    """Chips per layer (powers of two up to the system's chip count, and the count itself)."""
    options = sorted({min(2**i, arch.chips) for i in range(arch.chips.bit_length() + 1)})
    result = []
    for layer in program.layers:
        best = min(options, key=lambda c: (layer_estimate(program, layer, arch, c), c))
        result.append(best)
    return result


def _pe_cycles(program: Program, index: int, arch: SpinnArch) -> float:
    """Cycles of layer ``index`` on one PE: its family's own tile costs (the tile it would choose
    for one PE, every tile summed), so a layer whose M4F work is dear for its flops (a pool's
    window loops, a quantize's rounding) gets its share of PEs."""
    from .tiling import choose_tile, tile_costs  # tiling builds on this module's estimates

    return float(tile_costs(program, index, arch, choose_tile(program, index, arch, pes=1)).cycles.sum())


def pipeline_groups(program: Program, arch: SpinnArch) -> list[list[int]] | None:
    """Disjoint PE lists per layer sized by each layer's cycles on one PE (:func:`_pe_cycles`);
    None if there are too few PEs."""
    n = len(program.layers)
    total = arch.total_pes
    if n > total:
        return None
    work = [_pe_cycles(program, index, arch) for index in range(n)]
    share = [max(1, int(total * w / max(sum(work), 1.0))) for w in work]
    while sum(share) > total:  # trim the largest shares first (deterministic)
        i = max(range(n), key=lambda j: (share[j], -j))
        share[i] -= 1
    groups, start = [], 0
    for s in share:
        groups.append(list(range(start, start + s)))
        start += s
    return groups


def place_tiles(table: TileTable, first: int, count: int, arch: SpinnArch, naive: bool = False,
                rotate: int = 0) -> TileTable:
    """Place ``table``'s tiles on PEs ``first .. first + count - 1``; returns the placed table.

    Units are the tile groups (tiles sharing a weight block), or single tiles when there are
    fewer groups than PEs. Units are taken longest first (ties by position) in rounds of
    ``count``; each round gives its i-th longest unit to the i-th least loaded PE (ties by PE
    order): longest-processing-time-first, a round at a time, vectorized. Where whole groups
    leave the busiest PE slower than cutting the tiles, group by group, into one contiguous run
    of nearly equal cycles per PE (:func:`_contiguous_runs`; each PE's weight-block fetches
    counted, :func:`_busiest_pe`), the runs are taken: the chooser's tiles assume an even
    spread, and 150 equal groups on 148 PEs would put two on two PEs, twice the layer's time.
    ``naive`` deals tiles round-robin. Deterministic.

    ``rotate``: equally loaded PEs are taken from PE ``first + rotate`` on (wrapping around the
    range) instead of from ``first``, so a layer with fewer units than PEs can start where an
    earlier layer's resident weights end (see ``schedule._resident_layout``).
    """
    n = len(table)
    if naive or n == 0:
        return table.placed(first + np.arange(n, dtype=np.int64) % count, arch.pes_per_chip)
    # A layer's tiles are either all grouped (conv2d, dense: groups numbered 0, 1, ...) or none.
    grouped = int(table.group.min()) >= 0 and int(table.group.max()) + 1 >= count
    if grouped:
        whole = _lpt(table.group, table.cycles, count, rotate)
        split = _contiguous_runs(table, count, rotate)
        if _busiest_pe(table, split, count, arch) < _busiest_pe(table, whole, count, arch):
            return table.placed(first + split, arch.pes_per_chip)
        return table.placed(first + whole, arch.pes_per_chip)
    return table.placed(first + _lpt(np.arange(n, dtype=np.int64), table.cycles, count, rotate), arch.pes_per_chip)


def _lpt(unit: np.ndarray, cycles: np.ndarray, count: int, rotate: int) -> np.ndarray:
    """PE offset (``0 .. count - 1``) of every tile when the ``unit`` s (tiles with one unit id
    go together) are dealt longest first, a round of ``count`` at a time, each round's i-th
    longest unit to the i-th least loaded PE (ties by PE order from ``rotate``)."""
    n = len(unit)
    n_units = int(unit.max()) + 1
    cost = np.bincount(unit, weights=cycles, minlength=n_units)
    first_tile = np.full(n_units, n, dtype=np.int64)
    np.minimum.at(first_tile, unit, np.arange(n, dtype=np.int64))
    order = np.lexsort((first_tile, -cost))  # longest first, ties by first tile position
    load = np.zeros(count, dtype=np.float64)
    order_pe = (np.arange(count, dtype=np.int64) - int(rotate)) % count  # tie order of the PEs
    unit_pe = np.empty(n_units, dtype=np.int64)
    for r in range(0, n_units, count):
        batch = order[r:r + count]
        free = np.lexsort((order_pe, load))[:len(batch)]  # least loaded first
        unit_pe[batch] = free
        load[free] += cost[batch]
    return unit_pe[unit]


def _contiguous_runs(table: TileTable, count: int, rotate: int) -> np.ndarray:
    """PE offset of every tile when the tiles, taken group by group (in table order within a
    group), are cut into ``count`` contiguous runs of nearly equal cycles: a tile goes to the run
    its cycles' midpoint falls in. A group is split over neighbouring PEs only where whole groups
    cannot be balanced (150 equal groups on 148 PEs put two on two PEs: twice the layer's time);
    each PE fetches the weight blocks of the (at most a few) groups its run touches."""
    order = np.lexsort((np.arange(len(table), dtype=np.int64), table.group))
    c = table.cycles[order].astype(np.float64)
    total = float(c.sum())
    mid = np.cumsum(c) - c / 2.0
    run = np.minimum((mid * count / total).astype(np.int64), count - 1) if total > 0 else (
        np.arange(len(c), dtype=np.int64) * count // max(1, len(c)))
    pe = np.empty(len(table), dtype=np.int64)
    pe[order] = (run + int(rotate)) % count
    return pe


def _busiest_pe(table: TileTable, pe: np.ndarray, count: int, arch: SpinnArch) -> float:
    """The busiest PE's cycles under placement ``pe`` (offsets): its tiles' compute plus one
    weight-block DMA (``dma_setup_cycles`` + bytes / ``dma_bw_bytes_per_cycle``) per group it
    holds, as the timing model charges a PE that fetches a block and keeps it."""
    key = pe * (int(table.group.max()) + 2) + table.group
    _, first = np.unique(key, return_index=True)
    fetch = arch.dma_setup_cycles + table.w_bytes[first] / arch.dma_bw_bytes_per_cycle
    load = np.bincount(pe, weights=table.cycles, minlength=count) + np.bincount(pe[first], weights=fetch,
                                                                                 minlength=count)
    return float(load.max())
