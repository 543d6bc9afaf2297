"""Timing and energy model of a mapped program, vectorized over its tiles.

The static schedule is not stored: it is a function of the tiles (:mod:`tvm_spinn.program.tiles`,
placed and costed by the mapper) and the mapping's decisions, and this model derives what it
needs from them, one layer at a time with numpy.

*Where each operand comes from* (the schedule's transfers): a tile's activation input is read
over the NoC when every activation input of the layer stays on chip, else from DRAM, once per PE
where the PE keeps the block for its later tiles of the same input rows (a GEMM's tiles along
its weight axis); its output
stays in SRAM (``local``) when the layer's output is kept on chip, else goes to DRAM. Its weight
block is ``local`` when the layer's weights are resident or an earlier tile of the same group on
the same PE held the block (it fits next to the tile's buffers); otherwise the first tile of a
group reads it from DRAM and the NoC multicasts it to later PEs of the group. Naive mappings
read every operand from DRAM.

*Resources*: per PE a DMA engine (``dma_setup_cycles`` + bytes / ``dma_bw_bytes_per_cycle`` per
non-local transfer) and the core (the tile's ``cycles``); per quad-PE the router port its four
PEs share; per chip a DRAM channel and the NoC's bisection (:func:`noc_cycles`), whose
bandwidths bound the layer's traffic; per chip its links, which all-gather a layer's input
before the layer starts when the layer spans several chips or changes chips.

*Per PE*, tiles run in order. With double buffering loads run ahead of compute (the load of tile
i+1 overlaps the compute of tile i): compute of tile i ends at
``end_i = max(end_{i-1}, start + L_1 + ... + L_i) + C_i``, and the PE is done when its last
output is written and its DMA engine has moved every byte: ``max(end_last + O_last, sum(L + O))``.
Without double buffering (naive) load, compute and write-back of each tile are serial. A layer
takes ``max(slowest PE, slowest chip's DRAM bytes / DRAM bandwidth, the NoC's busiest router
port or bisection; the last tile fed from DRAM computes after the channel's last byte)`` plus
a barrier built from NoC packets
(:meth:`~tvm_spinn.target.arch.SpinnArch.barrier_cost_cycles`; sequential mode: the PEs that ran
since the last standing barrier and those of the next layer that runs, counted on the chip with
the most of them; pipelined mode: the layer's PE group, and throughput is set by the slowest
stage). An inference starts with one multicast packet that wakes the PEs.

*Software scheduler* (``MappingOptions(scheduler="software")``, the setup of a runtime
scheduler such as OctopuScheduler; off by default): no barriers and no wake-up packet; per
layer one scheduler PE sends each worker its task descriptor (:func:`software_dispatch`), each
PE starts when its descriptor is read, and the layer ends when the scheduler has taken every
worker's completion packet (:func:`software_completion`). Without double buffering the PEs'
fetch -> compute -> write-back runs per tile against a DRAM channel they share
(:func:`shared_dram_run`), and a tile that receives a multicast copy of another tile's DRAM
read starts its loads only once that read has ended (:func:`multicast_readers`). The
scheduler software's published, measured costs (:data:`~.software.OCTOPUS_SCHEDULER`) are
charged as they are: a layer takes at least its
time per layer, the first layer starts after its set-up and the last ends with its clean-up.

*Views* (:meth:`~tvm_spinn.program.ops.base.OpFamily.is_view`: a reshape, a unit-axis permute or
broadcast, a contiguous slice) cost nothing when their input and output live in the same memory:
the consumers' DMA reads the producer's buffer in place. *Barriers* are dropped where no PE can
need another's data (:class:`_Barriers`): a point-wise layer whose inputs were written by its own
PEs with the same flat tiles, or finished behind a standing barrier (GELU's chain of seven
element-wise layers pays one barrier, not seven), and any layer whose inputs all finished behind
a standing barrier while every buffer read since it stays live (a decode step's key and value
projections after the query's, all three reading one quantized row).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..program import Program
from ..program.ops.base import family_of
from ..program.noc import noc_port_cycles
from ..program.records import LayerTimingSummary, TimingSummary
from ..program.tiles import TileTable
from ..target.arch import SpinnArch
from .bounds import gathered_bytes
from .software import OCTOPUS_SCHEDULER

__all__ = ["evaluate", "evaluate_traced", "roofline", "transfers", "noc_cycles", "noc_port_cycles", "software_dispatch",
           "software_completion", "scheduler_path_cycles", "shared_dram_run", "multicast_readers",
           "LOCAL", "NOC", "DRAM"]


def roofline(program: Program, arch: SpinnArch) -> float:
    """Lower bound: max(compute at peak, what must cross DRAM once) over the whole system.

    Weights of layers kept resident are loaded at program load, not per inference.
    """
    fp32 = sum(layer.flops for layer in program.layers if layer.mode == "fp32")
    int8 = sum(layer.flops for layer in program.layers if layer.mode == "int8")
    compute_s = fp32 / arch.peak_fp32_flops_s + int8 / arch.peak_int8_ops_s
    resident = set(program.mapping.resident_layers) if program.mapping is not None else set()
    resident_consts = {tid for i in resident for tid in list(program.layers[i].consts.values())
                       + [t for t in program.layers[i].inputs if program.tensors[t].role == "const"]}
    gathered = gathered_bytes(program)
    touched = sum(gathered.get(tid, t.nbytes) for tid, t in enumerate(program.tensors)
                  if t.role in ("input", "output") or (t.role == "const" and tid not in resident_consts))
    return max(compute_s, touched / arch.total_dram_bw_bytes_s)


#: Where a transfer goes (codes of :func:`transfers`).
LOCAL, NOC, DRAM = 0, 1, 2


def transfers(program: Program, index: int, table: TileTable, arch: SpinnArch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(input, weight, output)`` source/destination codes (:data:`LOCAL`, :data:`NOC`,
    :data:`DRAM`) of every tile of layer ``index`` (see the module docstring)."""
    mapping = program.mapping
    naive = mapping is not None and mapping.options.naive
    onchip = set(mapping.onchip_tensors) if mapping is not None else set()
    layer = program.layers[index]
    n = len(table)
    family = family_of(layer.kind)
    # the inputs a tile's ``in_bytes`` count (a matmul's right operand has its own source below)
    acts = family.streamed_inputs(program, layer)
    axis = family.weight_region_axis(layer)
    in_src = np.full(n, NOC if acts and all(tid in onchip for tid in acts) else DRAM, np.int8)
    if not naive:
        # a DRAM input block crosses DRAM once; the NoC multicasts it to the other PEs reading it
        in_src[(in_src == DRAM) & _input_shared(axis, table)] = NOC
        in_src[_input_held(axis, table, arch)] = LOCAL
    out_dst = np.full(n, LOCAL if layer.output in onchip else DRAM, np.int8)
    if mapping is not None and index in set(mapping.resident_layers):
        return in_src, np.full(n, LOCAL, np.int8), out_dst
    w_src = np.full(n, DRAM, np.int8)
    grouped = table.group >= 0
    if naive or not grouped.any() or n == 0:
        return in_src, w_src, out_dst
    order = np.arange(n, dtype=np.int64)
    _, first_of_group = np.unique(table.group, return_index=True)
    later = np.ones(n, dtype=bool)
    later[first_of_group] = False
    w_src[later & grouped] = NOC
    # A PE keeps a group's block after fetching it when it fits next to the tile's buffers.
    key = table.pe * (int(table.group.max()) + 2) + table.group
    capable = grouped & (table.w_bytes + table.sram_bytes <= arch.tile_sram_bytes)
    if capable.any():
        keys, first_held = np.unique(key[capable], return_index=True)
        first_held = order[capable][first_held]
        pos = np.minimum(np.searchsorted(keys, key), len(keys) - 1)
        held = grouped & (keys[pos] == key) & (first_held[pos] < order)
        w_src[held] = LOCAL
    return in_src, w_src, out_dst


def noc_cycles(table: TileTable, srcs, arch: SpinnArch) -> float:
    """Cycles the NoC needs for one layer's traffic: the busiest quad-PE router port or the
    bisection, whichever binds (:func:`noc_port_cycles` of the bytes each tile receives and
    sends)."""
    in_src, w_src, out_dst = srcs
    recv = table.in_bytes * (in_src != LOCAL) + table.w_bytes * (w_src != LOCAL)
    send = table.out_bytes * (out_dst != LOCAL)
    return noc_port_cycles(table.pe, table.chip, recv, send, arch)


def _input_shared(axis: int | None, table: TileTable) -> np.ndarray:
    """Tiles whose input block an earlier tile (on any PE) reads: they receive it by multicast.
    Tiles differing only along the weight axis ``axis``, the family's
    :meth:`~tvm_spinn.program.ops.base.OpFamily.weight_region_axis`, read one input block; a
    layer without that axis shares none this way."""
    n = len(table)
    if axis is None or n < 2:
        return np.zeros(n, dtype=bool)
    keep = [a for a in range(table.lo.shape[1]) if a != axis]
    first, inverse = _row_ids(np.column_stack([table.lo[:, keep], table.hi[:, keep]]))
    return first[inverse] < np.arange(n)


def _input_held(axis: int | None, table: TileTable, arch: SpinnArch) -> np.ndarray:
    """Tiles of a GEMM layer whose input block an earlier tile on the same PE already fetched
    and kept: tiles that differ only along the weight axis ``axis`` read the same
    input rows (dense, matmul) or pixels (conv2d), and a PE keeps the block when it fits next to
    the tile's buffers (as a weight block is kept, :func:`transfers`)."""
    n = len(table)
    held = np.zeros(n, dtype=bool)
    if axis is None or n < 2:
        return held
    keep = [a for a in range(table.lo.shape[1]) if a != axis]
    fits = (table.in_bytes + table.sram_bytes <= arch.tile_sram_bytes) & (table.in_bytes > 0)
    first, inverse = _row_ids(np.column_stack([table.pe, table.lo[:, keep], table.hi[:, keep]]))
    later = first[inverse] < np.arange(n)
    return later & fits & fits[first[inverse]]


def _row_ids(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(first, inverse)`` of the distinct rows of the integer matrix ``rows`` in lexicographic
    order, as ``np.unique(rows, axis=0, return_index=True, return_inverse=True)`` gives them:
    ``first[k]`` is the first row equal to distinct row ``k``, ``inverse[i]`` the distinct row of
    row ``i``.

    Tile rows are small integers, so each row packs into one int64 (mixed radix, first column
    most significant, which keeps the lexicographic order): a 1-D unique of the packed keys is
    far cheaper than the row-wise unique, which sorts a structured view."""
    spans = [int(hi) - int(lo) + 1 for lo, hi in zip(rows.min(axis=0), rows.max(axis=0))] if len(rows) else []
    if not spans or math.prod(spans) >= 2 ** 63:
        _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
        return first, inverse.reshape(-1)
    shifted = rows.astype(np.int64) - rows.min(axis=0).astype(np.int64)
    key = np.zeros(len(rows), dtype=np.int64)
    for column, span in zip(shifted.T, spans):
        key = key * span + column
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    return first, inverse.reshape(-1)


def _segments(pe: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tiles sorted by PE (stable): ``(order, segment starts, PE of each segment)``."""
    order = np.argsort(pe, kind="stable")
    sorted_pe = pe[order]
    starts = np.flatnonzero(np.r_[True, sorted_pe[1:] != sorted_pe[:-1]]) if len(pe) else np.zeros(0, np.int64)
    return order, starts, sorted_pe[starts] if len(pe) else sorted_pe


def _segment_cumsum(x: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Inclusive cumulative sum of ``x`` restarting at every segment start."""
    c = np.cumsum(x)
    if not len(x):
        return c
    before = np.r_[0.0, c][starts]  # total before each segment
    return c - before[_segment_ids(len(x), starts)]


def _segment_ids(n: int, starts: np.ndarray) -> np.ndarray:
    """Segment index of each of ``n`` positions, segments beginning at ``starts``."""
    flag = np.zeros(n, dtype=np.int64)
    flag[starts] = 1
    return np.cumsum(flag) - 1


def _free_view(program: Program, layer, onchip: set) -> bool:
    """A view layer (:meth:`OpFamily.is_view`) whose input and output live in the same memory
    (both kept on chip or both in DRAM): its consumers read the producer's buffer in place,
    so it costs nothing (no tiles run, no barrier). A view between SRAM and DRAM is a copy."""
    family = family_of(layer.kind)
    if family is None or not family.is_view(program, layer):
        return False
    return (layer.inputs[0] in onchip) == (layer.output in onchip)


class _Barriers:
    """Which layer boundaries need the chip-wide barrier.

    A layer may start without the barrier after the layer before it when it is
    :attr:`~tvm_spinn.program.ops.base.OpFamily.pointwise` and each activation input was either
    finished behind the last standing barrier, or is the output's size and was written in the
    same element order by a layer with the same flat tiles on the same PEs (each PE reads only
    what it wrote itself). A PE may then run ahead of the others, so one more condition keeps
    the address plan safe: every value read from another PE's SRAM since the last standing
    barrier must still be live (its buffer not yet reusable) at this layer. A free view's
    output is its input's bytes, relabelled (a slice: shifted): its reads are reads of that
    buffer.

    Any other layer (a GEMM, a row operator) reads elements other PEs wrote, so it may start
    without the barrier only where it reads nothing written since the last standing barrier
    (each activation input a program input or finished behind it: the key and value
    projections after the query's, which read the same quantized row) and every buffer read
    since that barrier, by any PE, even its own, is still live at this layer (the address plan
    cannot have given its space to this layer's outputs or buffers).
    """

    def __init__(self, program: Program, tables):
        self.program, self.tables = program, tables
        self.written: dict[int, tuple[int, bool]] = {}  # tensor -> (writing layer, same order)
        self.root: dict[int, int] = {}  # tensor -> the tensor whose buffer holds its bytes
        self.last_use: dict[int, int] = {}
        for i, layer in enumerate(program.layers):
            for tid in layer.inputs:
                self.last_use[tid] = i
        self.kept = -1  # the last layer whose closing barrier stands
        self.remote: set[int] = set()  # buffers read from other PEs since then
        self.read: set[int] = set()  # buffers read since then by any PE (its own too)

    def view(self, layer) -> None:
        src = layer.inputs[0]
        self.root[layer.output] = root = self.root.get(src, src)
        self.last_use[root] = max(self.last_use.get(root, -1), self.last_use.get(layer.output, -1))
        if src in self.written:
            j, ordered = self.written[src]
            self.written[layer.output] = (j, ordered and family_of(layer.kind).view_keeps_order(layer))

    def _numel(self, tid: int) -> int:
        return int(np.prod(self.program.tensors[tid].shape, dtype=np.int64))

    def starts_free(self, index: int, layer, prev: int) -> bool:
        """Whether layer ``index`` drops the barrier after layer ``prev`` (updates the state)."""
        table = self.tables[index]
        family = family_of(layer.kind)
        pointwise = family is not None and family.pointwise
        remote, read, ok = set(), set(), prev >= 0 and family is not None
        for tid in layer.inputs:
            if self.program.tensors[tid].role == "const":
                continue
            if tid not in self.written:  # a program input: in DRAM from the start, never reused
                continue
            j, ordered = self.written[tid]
            src = self.tables[j]
            read.add(self.root.get(tid, tid))
            if (pointwise and ordered and self._numel(tid) == self._numel(layer.output)
                    and src.lo.shape[1] == 1 == table.lo.shape[1]
                    and len(src) == len(table) and np.array_equal(src.pe, table.pe)
                    and np.array_equal(src.lo, table.lo) and np.array_equal(src.hi, table.hi)):
                continue
            remote.add(self.root.get(tid, tid))
            ok = ok and j <= self.kept
        live = self.remote | remote if pointwise else self.read | read
        ok = ok and all(self.last_use.get(t, -1) >= index for t in live)
        if ok:
            self.remote |= remote
            self.read |= read
        else:
            self.kept, self.remote, self.read = prev, remote, read
        self.written[layer.output] = (index, True)
        return ok


def scheduler_path_cycles(arch: SpinnArch) -> float:
    """Cycles one packet takes between a software scheduler PE in the middle of the chip's mesh
    and its farthest worker: :meth:`~tvm_spinn.target.arch.SpinnArch.noc_hops` routers of
    ``noc_hop_cycles`` each."""
    return float(arch.noc_hops(arch.pes_per_chip) * arch.noc_hop_cycles)


def software_dispatch(table: TileTable, arch: SpinnArch) -> tuple[np.ndarray, float]:
    """A software scheduler's dispatch of one layer: ``(ready, sent)``.

    One scheduler PE sends each worker PE (the layer's PEs, in PE order) its task descriptor of
    ``task_descriptor_words`` packets, one worker after another, at ``task_word_cycles`` a
    packet; the last packet travels :func:`scheduler_path_cycles`, interrupts the worker
    (``irq_entry_cycles``) and the worker reads the words (``task_word_cycles`` each) before it
    programs its first DMA (whose ``dma_setup_cycles`` the per-PE path charges). ``ready``: per
    tile, the cycle after the layer's start at which its PE has its task; ``sent``: the cycles the
    scheduler spends sending (the dispatch phase).
    """
    workers, inverse = np.unique(table.pe, return_inverse=True)
    words = arch.task_descriptor_words * arch.task_word_cycles
    sent = (np.arange(len(workers), dtype=np.float64) + 1.0) * words
    ready = sent + scheduler_path_cycles(arch) + arch.irq_entry_cycles + words
    return ready[inverse.reshape(-1)], float(sent[-1]) if len(workers) else 0.0


def software_completion(finish: np.ndarray, arch: SpinnArch) -> float:
    """The cycle a software scheduler has taken every worker's completion packet.

    Each worker sends one packet when its last tile is written back (``task_word_cycles``); it
    travels :func:`scheduler_path_cycles`; the scheduler takes the packets one at a time in
    arrival order (``task_word_cycles`` each): ``t_k = max(t_{k-1}, a_k) + c``, i.e.
    ``max_k(a_k + (n - k) c)`` over the sorted arrivals ``a``.
    """
    if not len(finish):
        return 0.0
    c = arch.task_word_cycles
    arrive = np.sort(np.asarray(finish, dtype=np.float64)) + c + scheduler_path_cycles(arch)
    return float(np.max(arrive + c * (len(arrive) - np.arange(len(arrive)))))


def multicast_readers(program: Program, index: int, table: TileTable, srcs) -> tuple[np.ndarray, np.ndarray]:
    """``(input, weight)``: for every tile of layer ``index`` that receives an operand by
    multicast (:data:`NOC` in :func:`transfers`) copied from another tile's DRAM read, that
    tile's index; ``-1`` elsewhere. An input block is read from DRAM by the first tile reading it
    (:func:`_input_shared`), a weight block by its group's first tile; the copies reach the
    other tiles only once that read has ended (:func:`shared_dram_run` waits for it)."""
    in_src, w_src, _ = srcs
    n = len(table)
    in_reader = np.full(n, -1, np.int64)
    w_reader = np.full(n, -1, np.int64)
    if n < 2:
        return in_reader, w_reader
    layer = program.layers[index]
    axis = family_of(layer.kind).weight_region_axis(layer)
    if axis is not None:
        keep = [a for a in range(table.lo.shape[1]) if a != axis]
        first, inverse = _row_ids(np.column_stack([table.lo[:, keep], table.hi[:, keep]]))
        reader = first[inverse]
        copied = (in_src == NOC) & (in_src[reader] == DRAM) & (reader != np.arange(n))
        in_reader[copied] = reader[copied]
    grouped = table.group >= 0
    if grouped.any():
        groups, first_of_group = np.unique(table.group[grouped], return_index=True)
        reader = np.flatnonzero(grouped)[first_of_group][np.searchsorted(groups, table.group[grouped])]
        rows = np.flatnonzero(grouped)
        copied = (w_src[rows] == NOC) & (w_src[reader] == DRAM) & (reader != rows)
        w_reader[rows[copied]] = reader[copied]
    return in_reader, w_reader


def shared_dram_run(table: TileTable, srcs, arch: SpinnArch, start, readers=None) -> dict:
    """Per-PE timeline of one layer whose PEs run fetch -> compute -> write-back serially per
    tile while they share their chip's DRAM channel (a fluid model of the channel).

    Each tile is phases in order: its load DMAs' set-up (``dma_setup_cycles`` each) and the
    bytes that come over the NoC (``dma_bw_bytes_per_cycle``), the input bytes read from DRAM,
    the weight bytes read from DRAM, the compute (the tile's ``cycles``), the write-back's
    set-up and its bytes (to DRAM or over the NoC). While ``n`` PEs of a chip are in a DRAM
    phase each moves ``min(dma_bw_bytes_per_cycle, dram rate / n)`` bytes a cycle (the channel
    shared evenly), so a PE computing leaves the channel to the others and the channel idles
    only when no PE of the chip is fetching.
    ``start``: the cycle each tile's PE may begin (one number or per tile). ``readers``: the
    ``(input, weight)`` arrays of :func:`multicast_readers`: a tile receiving a multicast copy of
    another tile's DRAM read starts its loads only once that tile's DRAM phase has ended (a copy
    cannot arrive before the bytes it copies have been read). Returns the same keys as the per-PE
    path (``order``, ``begin``, ``end``, ``pes``, ``finish``).
    """
    in_src, w_src, out_dst = srcs
    rate, setup = arch.dma_bw_bytes_per_cycle, arch.dma_setup_cycles
    dram_rate = arch.dram_bw_bytes_s / arch.clock_hz
    n = len(table)
    order, starts, pes = _segments(table.pe)
    begin0 = np.broadcast_to(np.asarray(start, dtype=np.float64), (n,))[order]
    moving_in = (in_src != LOCAL) & (table.in_bytes > 0)
    moving_w = (w_src != LOCAL) & (table.w_bytes > 0)
    moving_out = (out_dst != LOCAL) & (table.out_bytes > 0)
    fixed_load = setup * (moving_in.astype(np.float64) + moving_w) + (
        table.in_bytes * (in_src == NOC) + table.w_bytes * (w_src == NOC)) / rate
    dram_in = (table.in_bytes * (in_src == DRAM)).astype(np.float64)
    dram_w = (table.w_bytes * (w_src == DRAM)).astype(np.float64)
    comp = table.cycles.astype(np.float64)
    out_setup = setup * moving_out.astype(np.float64)
    out_noc = table.out_bytes * (out_dst == NOC) / rate
    out_dram = (table.out_bytes * (out_dst == DRAM)).astype(np.float64)
    # phases per tile (in PE order): amount, whether it uses the DRAM channel, whether compute:
    # loads' set-up and NoC bytes, input from DRAM, weights from DRAM (apart: a multicast copy
    # of the input waits for the input's read only), compute, write-back's set-up and NoC
    # bytes, write-back to DRAM
    amounts = np.column_stack([fixed_load, dram_in, dram_w, comp, out_setup + out_noc, out_dram])[order]
    dram_ph = np.broadcast_to(np.array([False, True, True, False, False, True]), amounts.shape)
    comp_ph = np.broadcast_to(np.array([False, False, False, True, False, False]), amounts.shape)
    tile_ph = np.broadcast_to(np.arange(n)[:, None], amounts.shape)
    keep = amounts.reshape(-1) > 0
    amount = amounts.reshape(-1)[keep]
    is_dram, is_comp, tile = dram_ph.reshape(-1)[keep], comp_ph.reshape(-1)[keep], tile_ph.reshape(-1)[keep]
    pe_of = np.repeat(_segment_ids(n, starts), amounts.shape[1])[keep] if n else np.zeros(0, np.int64)
    npe = len(starts)
    first = np.searchsorted(pe_of, np.arange(npe))
    stop = np.searchsorted(pe_of, np.arange(npe), side="right")
    # gates: the (kept) DRAM phases a tile's first phase waits for (its multicast operands' reads)
    gates = []
    if readers is not None and n:
        kept = np.full(amounts.size, -1, np.int64)
        kept[keep] = np.arange(int(keep.sum()))
        position = np.empty(n, np.int64)
        position[order] = np.arange(n)
        width = amounts.shape[1]
        for reader, phase in zip(readers, (1, 2)):  # the reader's input or weight DRAM phase
            reader = np.asarray(reader, dtype=np.int64)
            waits = np.flatnonzero(reader >= 0)
            gate = np.full(len(amount), -1, np.int64)
            src = kept[position[reader[waits]] * width + phase]
            dst = kept[position[waits] * width + np.argmax(amounts[position[waits]] > 0, axis=1)]
            ok = (src >= 0) & (dst >= 0)
            gate[dst[ok]] = src[ok]
            gates.append(gate)
    ended_phase = np.zeros(len(amount), dtype=bool)
    pe_start = begin0[starts] if n else np.zeros(0)
    chip = (table.chip[order][starts] - int(table.chip.min())) if n else np.zeros(0, np.int64)
    begin = begin0.copy()  # compute start per tile (in PE order); tiles without compute keep it
    finish = pe_start.copy()
    ptr, rem = first.copy(), amount.copy()
    t = float(pe_start.min()) if npe else 0.0
    waiting = pe_start > t  # PEs whose task has not arrived yet
    while True:
        live = ptr < stop
        if not live.any():
            break
        idx = np.flatnonzero(live)
        cur = ptr[idx]
        wait = waiting[idx]
        blocked = np.zeros(len(idx), dtype=bool)
        for gate in gates:  # a PE whose next phase waits for another tile's DRAM read
            g = gate[cur]
            blocked |= (g >= 0) & ~ended_phase[np.maximum(g, 0)]
        blocked &= ~wait
        on_dram = is_dram[cur] & ~wait & ~blocked
        share = np.bincount(chip[idx][on_dram], minlength=int(chip.max()) + 1 if npe else 1)
        r = np.where(on_dram, np.minimum(rate, dram_rate / np.maximum(share[chip[idx]], 1)),
                     np.where(blocked, 0.0, 1.0))
        need = np.where(wait, pe_start[idx] - t, np.where(blocked, np.inf, rem[cur] / np.maximum(r, 1e-300)))
        dt = float(need.min())
        if not math.isfinite(dt):  # cannot happen: a gate points at an earlier tile
            raise RuntimeError("shared_dram_run: every running PE waits for another's DRAM read")
        t += dt
        rem[cur] -= np.where(wait, 0.0, dt * r)
        done = need <= dt + 1e-9 * max(1.0, abs(t))
        arrived = idx[done & wait]
        waiting[arrived] = False
        moved = idx[done & ~wait & ~blocked]
        ended_phase[ptr[moved]] = True
        ptr[moved] += 1
        for group in (arrived, moved):  # a PE entering a compute phase starts its tile's compute
            nxt = ptr[group]
            ok = nxt < stop[group]
            entering = group[ok][is_comp[nxt[ok]]]
            begin[tile[ptr[entering]]] = t
        ended = moved[ptr[moved] >= stop[moved]]
        finish[ended] = t
    return {"order": order, "begin": begin, "end": begin + comp[order], "pes": pes, "finish": finish}


def _layer_pes(program: Program, index: int, table: TileTable, arch: SpinnArch, double_buffer: bool,
               start, srcs) -> dict:
    """Per-PE timeline of one layer (vectorized): compute start/end per tile and PE finish.

    ``start``: the cycle the PEs may begin, one for the layer or one per tile (its PE's: the
    same for every tile of a PE)."""
    in_src, w_src, out_dst = srcs
    rate, setup = arch.dma_bw_bytes_per_cycle, arch.dma_setup_cycles

    def dma(nbytes, where):
        moving = (where != LOCAL) & (nbytes > 0)
        return np.where(moving, setup + nbytes / rate, 0.0)

    load = dma(table.in_bytes, in_src) + dma(table.w_bytes, w_src)
    out = dma(table.out_bytes, out_dst)
    comp = table.cycles.astype(np.float64)
    order, starts, pes = _segments(table.pe)
    L, C, O = load[order], comp[order], out[order]
    # every tile of a PE may start at the PE's start (one number for the layer, or per tile)
    begin0 = np.broadcast_to(np.asarray(start, dtype=np.float64), (len(table),))[order]
    seg = _segment_ids(len(order), starts)
    if double_buffer:
        # end_i = max(end_{i-1}, start + cumL_i) + C_i = cumC_i + max_{j<=i}(start + cumL_j - cumC_{j-1})
        cum_l, cum_c = _segment_cumsum(L, starts), _segment_cumsum(C, starts)
        ready = begin0 + cum_l - (cum_c - C)
        big = 4.0 * (float(L.sum() + C.sum() + O.sum()) + float(np.abs(begin0).max(initial=0.0))) + 1.0
        end = cum_c + np.maximum.accumulate(ready + seg * big) - seg * big
        begin = end - C
        last = np.r_[starts[1:], len(order)] - 1
        dma_total = np.add.reduceat(L + O, starts) if len(order) else np.zeros(0)
        finish = np.maximum(end[last] + O[last], begin0[starts] + dma_total)
    else:
        end = begin0 + _segment_cumsum(L + C + O, starts) - O
        begin = end - C
        last = np.r_[starts[1:], len(order)] - 1
        finish = end[last] + O[last]
    return {"order": order, "begin": begin, "end": end, "pes": pes, "finish": finish}


def evaluate(program: Program, arch: SpinnArch, tables: "list[TileTable] | None" = None) -> TimingSummary:
    """Cycles, bytes, energy and utilization of ``program`` on ``arch``: the record a program
    stores (``Program.timing``), one :class:`~tvm_spinn.program.records.LayerTimingSummary` per
    layer.

    ``tables``: the placed tiles per layer (default ``program.tiles.tables`` of a mapped
    program; a loaded program's come from :func:`tvm_spinn.mapping.derive_tables`).
    """
    return _evaluate(program, arch, tables, False)[0]


def evaluate_traced(program: Program, arch: SpinnArch,
                    tables: "list[TileTable] | None" = None) -> tuple[TimingSummary, list[list[int]]]:
    """:func:`evaluate` and, for timelines, every tile's compute interval
    ``[pe, tile, start, end]`` (program-wide tile index, in order), which a program does not
    store (it grows with the tiles)."""
    return _evaluate(program, arch, tables, True)


def _evaluate(program: Program, arch: SpinnArch, tables, trace: bool) -> tuple[TimingSummary, list[list[int]]]:
    if tables is None:
        if getattr(program, "tiles", None) is None:
            raise ValueError(f"{program.symbol}: the program has no tiles in memory; pass "
                             "tables=tvm_spinn.mapping.derive_tables(program, arch)")
        tables = program.tiles.tables
    mapping = program.mapping
    double_buffer = mapping.double_buffer if mapping is not None else True
    pipelined = mapping is not None and mapping.mode == "pipelined"
    software = mapping is not None and mapping.scheduler == "software"
    records = mapping.layers if mapping is not None else ()
    cpc = arch.clock_hz
    dram_rate = arch.dram_bw_bytes_s / cpc
    link_rate = arch.payload_bw("chip") * arch.links_per_chip / cpc
    ppc = arch.pes_per_chip
    now = 0.0
    layers, events = [], []
    totals = {"dram": 0, "noc": 0, "link": 0, "compute": 0}
    stage_max = 0.0
    prev_chips = None
    offset = 0
    onchip = set(mapping.onchip_tensors) if mapping is not None else set()
    barriers = _Barriers(program, tables)
    prev = -1  # the last layer that ran (its barrier is charged until the next one drops it)
    charged: dict[int, int] = {}  # barrier cycles (whole) charged at the end of each layer that ran
    # Per inference: the start packet's multicast from the middle of the mesh wakes every PE
    # (charged to the first layer that runs, so the layers' cycles add up to the total).
    # A software scheduler wakes each worker with its task descriptor instead, after its
    # software's measured per-inference set-up (:data:`~.software.OCTOPUS_SCHEDULER`).
    costs = OCTOPUS_SCHEDULER
    wake = (costs.setup_s * cpc if software
            else float(arch.noc_hops(ppc) * arch.noc_hop_cycles + arch.irq_entry_cycles))
    last_run = -1
    # A barrier's participants (sequential mode): the PEs that ran since the last standing
    # barrier and the PEs of the next layer that runs (they wait for it); a PE in neither has
    # nothing to wait for, and one running a later layer waits at that layer's barrier, which
    # comes after this one.
    free = [_free_view(program, layer, onchip) for layer in program.layers]
    next_pes: list[np.ndarray] = [np.zeros(0, np.int64)] * len(program.layers)
    upcoming = np.zeros(0, np.int64)
    for j in range(len(program.layers) - 1, -1, -1):
        next_pes[j] = upcoming
        if not free[j] and len(tables[j]):
            upcoming = np.unique(tables[j].pe)
    pending = np.zeros(0, np.int64)  # PEs that ran since the last standing barrier
    for i, layer in enumerate(program.layers):
        table = tables[i]
        if free[i]:
            barriers.view(layer)
            offset += len(table)
            layers.append(LayerTimingSummary(name=layer.name, kind=layer.kind, tiles=len(table), pes=0, chips=0, cycles=0,
                                      compute_cycles=0, dram_bytes=0, noc_bytes=0, link_bytes=0, flops=0,
                                      sram_peak=0, utilization=0.0, start_cycle=int(round(now))))
            continue
        # (pipelined mode: every layer keeps its PE group's barrier)
        # (a software scheduler waits for every layer's completion packets)
        if not software and barriers.starts_free(i, layer, -1 if pipelined else prev):
            now -= charged[prev]
            layers[prev] = replace(layers[prev], cycles=layers[prev].cycles - charged[prev])
        else:
            pending = np.zeros(0, np.int64)
        prev = i
        # Link all-gather of the layer's activation input when it spans or changes chips.
        if i < len(records):
            first, count = records[i].pes
            chips = list(range(first // ppc, (first + count - 1) // ppc + 1))
        else:
            chips = sorted(set((table.pe // ppc).tolist())) or [0]
        link_bytes, start = 0, now + wake
        layer_start = start  # (after the software scheduler's set-up)
        wake = 0.0
        if len(chips) > 1 or (prev_chips is not None and chips != prev_chips):
            in_bytes = sum(program.tensors[t].nbytes for t in layer.inputs if program.tensors[t].role != "const")
            c = len(chips)
            gather = in_bytes * (c - 1) // c if c > 1 else in_bytes
            if gather:
                link_bytes = gather * c
                start += gather / link_rate
        prev_chips = chips
        srcs = transfers(program, i, table, arch)
        first_start = start
        if software and len(table):
            ready, _ = software_dispatch(table, arch)
            if double_buffer:
                run = _layer_pes(program, i, table, arch, double_buffer, start + ready, srcs)
            else:  # serial per tile: the PEs share the DRAM channel as they fetch
                readers = multicast_readers(program, i, table, srcs)
                run = shared_dram_run(table, srcs, arch, start + ready, readers)
            first_start = start + float(ready.min())
        else:
            run = _layer_pes(program, i, table, arch, double_buffer, start, srcs)
        in_src, w_src, out_dst = srcs
        dram_t = (table.in_bytes * (in_src == DRAM) + table.w_bytes * (w_src == DRAM)
                  + table.out_bytes * (out_dst == DRAM))
        noc_t = (table.in_bytes * (in_src != LOCAL) + table.w_bytes * (w_src != LOCAL)
                 + table.out_bytes * (out_dst != LOCAL))
        end = float(run["finish"].max()) if len(table) else start
        if len(table):
            chip = table.chip - int(table.chip.min())
            dram_chip = np.bincount(chip, weights=dram_t)
            # the tile whose operands arrive last computes and writes back after the DRAM
            # channel's last byte: at least the cheapest such tile's compute and write-back
            reads = table.in_bytes * (in_src == DRAM) + table.w_bytes * (w_src == DRAM) > 0
            tail = 0.0
            if reads.any():
                write = np.where((out_dst != LOCAL) & (table.out_bytes > 0),
                                 arch.dma_setup_cycles + table.out_bytes / arch.dma_bw_bytes_per_cycle, 0.0)
                tail = float((table.cycles + write)[reads].min())
            end = max(end, first_start + float(dram_chip.max()) / dram_rate + tail,
                      first_start + noc_cycles(table, srcs, arch))
        if software:
            # the scheduler takes every worker's completion packet (the last worker's, sent after
            # the layer's work ends, at least: send, path, take) before the next layer
            packet = 2 * arch.task_word_cycles + scheduler_path_cycles(arch)
            end = max(software_completion(run["finish"], arch), end + packet)
            # and a layer takes at least its software's measured time per layer
            end = max(end, layer_start + costs.per_layer_s * cpc)
            charged[i] = 0
        elif pipelined:  # the layer's PE group
            charged[i] = int(np.ceil(arch.barrier_cost_cycles(len(run["pes"]))))
        else:
            # sequential: the PEs that ran since the last standing barrier and the next layer's,
            # counted on the chip with the most of them (each chip builds its own tree)
            pending = np.union1d(pending, run["pes"])
            party = np.union1d(pending, next_pes[i])
            count = int(np.bincount(party // ppc).max()) if len(party) else 1
            charged[i] = int(np.ceil(arch.barrier_cost_cycles(max(1, count))))
        end = float(np.ceil(end)) + charged[i]  # layers end on whole cycles
        dram_b, noc_b = int(dram_t.sum()), int(noc_t.sum())
        compute = int(table.cycles.sum())
        cycles = int(round(end - now))
        pes_used = len(run["pes"])
        if trace and len(table):
            ids = offset + run["order"]
            events.extend(zip(table.pe[run["order"]].tolist(), ids.tolist(),
                              np.rint(run["begin"]).astype(np.int64).tolist(),
                              np.rint(run["end"]).astype(np.int64).tolist()))
        offset += len(table)
        layers.append(LayerTimingSummary(
            name=layer.name, kind=layer.kind, tiles=len(table), pes=pes_used,
            chips=int(np.count_nonzero(np.bincount(table.chip - int(table.chip.min())))) if len(table) else 1,
            cycles=cycles, compute_cycles=compute,
            dram_bytes=dram_b, noc_bytes=noc_b, link_bytes=link_bytes, flops=layer.flops,
            sram_peak=int(table.sram_bytes.max()) if len(table) else 0,
            utilization=compute / (cycles * max(1, pes_used)) if cycles else 0.0,
            start_cycle=int(round(now)),
        ))
        last_run = len(layers) - 1
        stage_max = max(stage_max, end - now)
        totals["dram"] += dram_b
        totals["noc"] += noc_b
        totals["link"] += link_bytes
        totals["compute"] += compute
        now = end
    if software and last_run >= 0:
        # the scheduler software's measured per-inference clean-up, after the last layer
        cleanup = int(np.ceil(costs.cleanup_s * cpc))
        layers[last_run] = replace(layers[last_run], cycles=layers[last_run].cycles + cleanup)
        now += cleanup
    total_cycles = int(round(now))
    latency = total_cycles / cpc
    flops = sum(layer.flops for layer in program.layers)
    int8_ops = sum(layer.flops for layer in program.layers if layer.mode == "int8")
    sram_bytes = totals["noc"] + totals["dram"]
    energy = (
        # int8 layers' MACs on the MAC array; everything else on the M4F.
        (flops - int8_ops) / 2 * arch.e_flop_fp32_j + int8_ops / 2 * arch.e_mac_int8_j
        + totals["dram"] * arch.e_dram_byte_j + totals["noc"] * arch.e_noc_byte_j
        + sram_bytes * arch.e_sram_byte_j + totals["link"] * arch.e_link_byte_j
        + arch.p_static_w_per_chip * arch.chips * latency
    )
    throughput = (cpc / stage_max if pipelined else 1.0 / latency) if total_cycles else 0.0
    events.sort()
    return TimingSummary(
        cycles=total_cycles, latency_s=latency, roofline_s=roofline(program, arch),
        throughput_inf_s=throughput, dram_bytes=totals["dram"], noc_bytes=totals["noc"],
        link_bytes=totals["link"], energy_j=energy,
        pe_utilization=totals["compute"] / (total_cycles * arch.total_pes) if total_cycles else 0.0,
        flops=flops, layers=tuple(layers),
    ), [list(e) for e in events]
