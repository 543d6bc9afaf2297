"""Independent fp32 GEMMs sharing one chip's PEs: each GEMM's tiles as the closed-form GEMM
time runs them (:func:`gemm_tiles`), and a list schedule of chains of dependent GEMMs and of free
GEMMs over the PEs (:func:`shared_pes_seconds`).

A GEMM whose tiles do not fill its last round of the PEs leaves the other PEs idle for that
round (a forward over 8 rows: 96 tiles of ``4 x 4`` outputs on 148 PEs). Two GEMMs that do not
depend on each other (the forward of one pipeline slot and the backward of another, or a weight
gradient no later GEMM reads) can run their tiles on those PEs: every PE is a core of its own
that runs one tile job after another. Each tile keeps its arithmetic (the same tile, its
reduction on one PE in ascending k), so sharing the PEs moves no bit; it shortens the time the
GEMMs take together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..program.ops.gemm import GemmShape, choose_matmul_tile, gemm_tile_cycles
from ..program.ops.gemm.geometry import splits_of

__all__ = ["GemmTiles", "gemm_tiles", "shared_pes_seconds"]

#: bytes of an fp32 element (operands and result)
_F32 = 4


@dataclass(frozen=True)
class GemmTiles:
    """One GEMM's tiles on a chip: ``tiles`` tile jobs of ``tile_cycles`` each; a PE's first
    tile of the GEMM waits ``first_cycles`` after the GEMM starts (its two operands' DMA, the
    later tiles' double-buffered behind the compute) and the GEMM ends ``last_cycles`` (the last
    tile's write-back) and ``barrier_cycles`` (the chip's barrier) after its last tile. Alone on
    the chip it takes :meth:`alone_s`, :func:`~tvm_spinn.timing.gemm.gemm_seconds`."""

    tiles: int
    tile_cycles: int
    first_cycles: float
    last_cycles: float
    barrier_cycles: float
    clock_hz: float

    @property
    def tile_s(self) -> float:
        return self.tile_cycles / self.clock_hz

    @property
    def first_s(self) -> float:
        return self.first_cycles / self.clock_hz

    @property
    def last_s(self) -> float:
        """Seconds from the last tile's end to the GEMM's: its write-back and the barrier."""
        return (self.last_cycles + self.barrier_cycles) / self.clock_hz

    def alone_s(self, pes: int) -> float:
        """Seconds of the GEMM alone on the chip's ``pes`` PEs: ``ceil(tiles / pes)`` rounds of
        tiles between the first tile's operands and the last one's write-back and barrier (what
        :func:`~tvm_spinn.timing.gemm.gemm_seconds` charges)."""
        return (-(-self.tiles // pes) * self.tile_cycles + self.first_cycles + self.last_cycles
                + self.barrier_cycles) / self.clock_hz

    def with_tiles(self, tiles: int) -> "GemmTiles":
        """The same GEMM's jobs, ``tiles`` of them (what is left of it)."""
        return GemmTiles(tiles, self.tile_cycles, self.first_cycles, self.last_cycles, self.barrier_cycles,
                         self.clock_hz)


def gemm_tiles(arch, m: int, k: int, n: int, batch: int = 1, resident: bool = False) -> GemmTiles:
    """The tiles of ``batch`` fp32 GEMMs ``(m x k) @ (k x n)`` on one chip's PEs, as
    :func:`~tvm_spinn.timing.gemm.gemm_seconds` charges them (the mapper's tile, the PE kernel's
    cycles a tile, the first tile's operand DMAs, the last tile's write-back and the barrier).

    Parameters
    ----------
    arch : SpinnArch
        The system (one of its chips runs the GEMM).
    m, k, n : int
        The GEMM's rows, reduction and columns (each >= 1).
    batch : int
        Independent GEMMs of that shape in the layer.
    resident : bool
        The right operand is in SRAM when the GEMM runs (as for ``gemm_seconds``).

    Returns
    -------
    GemmTiles
    """
    if min(m, k, n, batch) < 1:
        raise ValueError(f"gemm_tiles: a GEMM of {batch} x ({m} x {k}) @ ({k} x {n}) has an empty axis")
    pes = arch.pes_per_chip
    tm, tn, tk = choose_matmul_tile(GemmShape(batch, m, n, k), arch, pes, resident)[:3]
    tiles = batch * -(-m // tm) * -(-n // tn)
    vm, vn = min(tm, m), min(tn, n)
    cycles = math.ceil(gemm_tile_cycles(vm, vn, k, splits_of(k, tk), arch))
    rate, setup = arch.dma_bw_bytes_per_cycle, arch.dma_setup_cycles
    first = 2 * setup + _F32 * (vm * k + k * vn) / rate
    last = setup + _F32 * vm * vn / rate
    return GemmTiles(tiles, cycles, first, last, arch.barrier_cost_cycles(pes), arch.clock_hz)


def _place(pe: np.ndarray, gemm: GemmTiles, start: float, lead: "np.ndarray | None" = None) -> float:
    """Run ``gemm``'s tiles from ``start`` on the PEs that free up first (``pe``: each PE's free
    time, updated in place): every PE takes ``tiles // pes`` tiles and the earliest free ones one
    more; a PE's first tile waits for its operands (``first_s`` after ``start``; with ``lead``,
    each PE's own wait after it frees up: ``first_s`` for a PE that has not run a tile of the
    GEMM yet, none for one whose next operands are already double-buffered). Returns when the
    GEMM ends (its last tile, then ``last_s``)."""
    pes = pe.size
    at = np.maximum(pe, start + gemm.first_s) if lead is None else np.maximum(pe + lead, start)
    order = np.argsort(at, kind="stable")
    full, extra = divmod(gemm.tiles, pes)
    count = np.full(pes, full, dtype=np.int64)
    count[order[:extra]] += 1
    used = count > 0
    pe[used] = at[used] + count[used] * gemm.tile_s
    return float(pe[used].max()) + gemm.last_s


def _fill(pe: np.ndarray, job: list, until: float) -> float:
    """Put tiles of the free GEMM ``job`` (``[GemmTiles, tiles left, PEs started]``) on the PEs
    idle before ``until``, as many as end by then (a PE's first tile of the job after its
    operands' DMA), earliest-free PEs first; returns the end of the last tile placed (0: none)."""
    gemm, left, started = job
    lead = np.where(started, 0.0, gemm.first_s)
    fits = np.floor((until - pe - lead) / gemm.tile_s + 1e-9).astype(np.int64)
    fits = np.maximum(fits, 0)
    if not fits.any() or left == 0:
        return 0.0
    order = np.argsort(pe, kind="stable")
    take = np.zeros(pe.size, dtype=np.int64)
    cum = np.cumsum(fits[order])
    take[order] = np.minimum(fits[order], np.maximum(0, left - (cum - fits[order])))
    used = take > 0
    pe[used] = pe[used] + lead[used] + take[used] * gemm.tile_s
    started |= used
    job[1] = left - int(take.sum())
    return float(pe[used].max()) if used.any() else 0.0


def shared_pes_seconds(arch, chains: "list[list[GemmTiles]]", free: "list[GemmTiles]" = ()) -> float:
    """Seconds one chip's PEs take to run independent chains of GEMMs and free GEMMs together.

    Each chain runs its GEMMs one after another (a GEMM starts when the one before it has ended);
    the chains and the free GEMMs do not depend on each other. The schedule: the chain whose
    next GEMM is ready first runs it on the PEs that free up first (:func:`_place`); before it
    starts, the PEs idle until then take tiles of the free GEMMs, in their order, as many as end
    by then (so no chain GEMM waits for a free tile); the free GEMMs' tiles left run on the
    earliest free PEs after the chains. A schedule the PEs can run, so its time is achievable;
    one chain alone takes the sum of its GEMMs' times on an idle chip, as run one after another.

    Parameters
    ----------
    arch : SpinnArch
        The system (its chip's ``pes_per_chip`` PEs).
    chains : list of list of GemmTiles
        Dependent GEMMs, in order, of each chain (:func:`gemm_tiles`).
    free : list of GemmTiles
        GEMMs no other waits for and that wait for none.

    Returns
    -------
    float
        Seconds from the first GEMM's start to the last one's end.
    """
    pe = np.zeros(arch.pes_per_chip)
    ready = [0.0] * len(chains)
    at = [0] * len(chains)
    jobs = [[g, g.tiles, np.zeros(pe.size, dtype=bool)] for g in free if g.tiles > 0]
    end = 0.0
    job_end = [0.0] * len(jobs)
    while any(at[c] < len(chain) for c, chain in enumerate(chains)):
        c = min((ready[c], c) for c, chain in enumerate(chains) if at[c] < len(chain))[1]
        for j, job in enumerate(jobs):  # the free GEMMs' tiles in the PEs' idle time until then
            if job[1]:
                job_end[j] = max(job_end[j], _fill(pe, job, ready[c]))
        ready[c] = _place(pe, chains[c][at[c]], ready[c])
        at[c] += 1
        end = max(end, ready[c])
    for j, (gemm, left, started) in enumerate(jobs):
        if left:  # what did not fit the idle time: on the PEs as they free up
            # a PE that has not run a tile of it yet first fetches its operands, as in _fill
            job_end[j] = _place(pe, gemm.with_tiles(left), 0.0, np.where(started, 0.0, gemm.first_s)) - gemm.last_s
        end = max(end, job_end[j] + gemm.last_s)
    return max(end, float(pe.max()))
