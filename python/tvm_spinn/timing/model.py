"""Event-driven timing and energy model: walks a program's static schedule.

Resources: per PE a DMA engine and the core (M4F or MAC array); per chip one DRAM channel
(``dram_bw_bytes_s``) and the NoC (``noc_bw_bytes_s``), each a FIFO bandwidth server shared by
all PEs of the chip; per chip its links (``links_per_chip * link_bw_bytes_s``).

Per layer, every PE runs its tasks in order. With double buffering (two operand buffers) the
DMA of tile i+1 starts as soon as tile i's DMA is done and tile i-1's compute has freed its
buffer; compute of tile i starts when its operands are in and the core is free; its output DMA
follows. A transfer from DRAM occupies the chip's DRAM channel and NoC for bytes/bandwidth in
request order (contention) and the PE's DMA engine for setup + bytes/DMA bandwidth; ``noc``
transfers use only the NoC; ``local`` ones are free. Link all-gathers run before the layer
starts on their chip. A barrier ends each layer (sequential mode: all PEs; pipelined mode: the
layer's PE group, and throughput is set by the slowest stage).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from ..program import Program
from ..target.arch import SpinnArch

__all__ = ["LayerTiming", "Timing", "evaluate", "roofline"]


@dataclass
class LayerTiming:
    name: str
    kind: str
    tiles: int
    pes: int
    chips: int
    cycles: int
    compute_cycles: int
    dram_bytes: int
    noc_bytes: int
    link_bytes: int
    flops: int
    sram_peak: int
    utilization: float
    start_cycle: int = 0


@dataclass
class Timing:
    cycles: int
    latency_s: float
    roofline_s: float
    throughput_inf_s: float
    dram_bytes: int
    noc_bytes: int
    link_bytes: int
    energy_j: float
    pe_utilization: float
    flops: int
    layers: list[LayerTiming] = field(default_factory=list)
    # (pe, layer, tile, start_cycle, end_cycle) of compute tasks, for timelines.
    trace: list[list[int]] = field(default_factory=list)

    def to_dict(self, trace: bool = False) -> dict:
        """Plain dict (JSON-ready); the per-tile ``trace`` only when asked (it is large)."""
        out = {k: v for k, v in vars(self).items() if k not in ("layers", "trace")}
        out["layers"] = [dict(vars(row)) for row in self.layers]
        if trace:
            out["trace"] = self.trace
        return out


def roofline(program: Program, arch: SpinnArch) -> float:
    """Lower bound: max(compute at peak, what must cross DRAM once) over the whole system.

    Weights of layers kept resident are loaded at program load, not per inference.
    """
    fp32 = sum(layer.flops for layer in program.layers if layer.mode == "fp32")
    int8 = sum(layer.flops for layer in program.layers if layer.mode == "int8")
    compute_s = fp32 / arch.peak_fp32_flops_s + int8 / arch.peak_int8_ops_s
    resident = set(program.mapping.get("resident_layers", []))
    resident_consts = {tid for i in resident for tid in list(program.layers[i].consts.values())
                       + [t for t in program.layers[i].inputs if program.tensors[t].role == "const"]}
    touched = sum(t.nbytes for tid, t in enumerate(program.tensors)
                  if t.role in ("input", "output") or (t.role == "const" and tid not in resident_consts))
    return max(compute_s, touched / arch.total_dram_bw_bytes_s)


class _Server:
    """A FIFO bandwidth server: each request holds it for bytes / bandwidth cycles."""

    __slots__ = ("rate", "free")

    def __init__(self, bytes_per_cycle: float):
        self.rate = bytes_per_cycle
        self.free = 0.0

    def serve(self, t: float, nbytes: int) -> float:
        start = max(t, self.free)
        self.free = start + nbytes / self.rate
        return self.free


def _simulate_layer(tasks_by_pe: dict[int, list], start: float, arch: SpinnArch, double_buffer: bool,
                    dram: dict, noc: dict, trace: list) -> float:
    """Event-driven run of one layer; returns its end cycle."""
    dma_rate = arch.dma_bw_bytes_per_cycle
    setup = arch.dma_setup_cycles
    # Per PE: list of tiles, each (tile id, [(op, bytes, where)...] before compute, cycles, out).
    state = {}
    for pe, tasks in tasks_by_pe.items():
        tiles = []
        cur = None
        for op, layer, tile, amount, where in tasks:
            if op in ("dma_in", "dma_w"):
                if cur is None or cur["tile"] != tile:
                    cur = {"tile": tile, "loads": [], "cycles": 0, "out": (0, "local")}
                    tiles.append(cur)
                cur["loads"].append((amount, where))
            elif op == "compute":
                cur["cycles"] = amount
            elif op == "dma_out":
                cur["out"] = (amount, where)
        state[pe] = tiles
    finish = {}
    # Event heap: (time, seq, pe, kind, index). kind 0 = request loads of tile index.
    heap, seq = [], 0
    dma_free = {pe: start for pe in state}
    core_free = {pe: start for pe in state}
    computed = {pe: [] for pe in state}      # compute-complete time per tile
    for pe in sorted(state):
        if state[pe]:
            heapq.heappush(heap, (start, seq, pe, 0, 0))
            seq += 1
        else:
            finish[pe] = start

    def transfer(pe: int, t: float, nbytes: int, where: str) -> float:
        if where == "local" or nbytes == 0:
            return t
        chip = pe // arch.pes_per_chip
        begin = max(t, dma_free[pe])
        done = begin + setup + nbytes / dma_rate
        done = max(done, noc[chip].serve(begin, nbytes))
        if where == "dram":
            done = max(done, dram[chip].serve(begin, nbytes))
        dma_free[pe] = done
        return done

    while heap:
        t, _, pe, kind, i = heapq.heappop(heap)
        tiles = state[pe]
        tile = tiles[i]
        if kind == 0:  # load operands of tile i
            done = t
            for nbytes, where in tile["loads"]:
                done = transfer(pe, done, nbytes, where)
            begin = max(done, core_free[pe])
            end = begin + tile["cycles"]
            core_free[pe] = end
            computed[pe].append(end)
            trace.append([pe, tile["tile"], int(begin), int(end)])
            heapq.heappush(heap, (end, seq, pe, 1, i))
            seq += 1
            if i + 1 < len(tiles):
                # Next load may start once this load is done and its buffer is free.
                if double_buffer:
                    buffer_free = computed[pe][i - 1] if i >= 1 else start
                    nxt = max(done, buffer_free)
                else:
                    nxt = end
                heapq.heappush(heap, (nxt, seq, pe, 0, i + 1))
                seq += 1
        else:  # write back the output of tile i
            nbytes, where = tile["out"]
            done = transfer(pe, t, nbytes, where)
            finish[pe] = max(finish.get(pe, start), done)
    return max(finish.values(), default=start)


def evaluate(program: Program, arch: SpinnArch) -> Timing:
    """Cycles, bytes, energy and utilization of ``program`` on ``arch``."""
    n = len(program.layers)
    mapping = program.mapping or {}
    double_buffer = mapping.get("double_buffer", True)
    pipelined = mapping.get("mode") == "pipelined"
    per_layer: list[dict[int, list]] = [dict() for _ in range(n)]
    links: list[dict[int, int]] = [dict() for _ in range(n)]
    for pe, tasks in enumerate(program.schedule):
        for task in tasks:
            op, layer = task[0], task[1]
            if op == "link":
                links[layer][pe // arch.pes_per_chip] = links[layer].get(pe // arch.pes_per_chip, 0) + task[3]
            elif op != "barrier":
                per_layer[layer].setdefault(pe, []).append(task)
    cpc = arch.clock_hz
    dram = {c: _Server(arch.dram_bw_bytes_s / cpc) for c in range(arch.chips)}
    noc = {c: _Server(arch.noc_bw_bytes_s / cpc) for c in range(arch.chips)}
    link_rate = arch.link_bw_bytes_s * arch.links_per_chip / cpc
    tiles_of = [[] for _ in range(n)]
    for t in program.tiles:
        tiles_of[t.layer].append(t)
    now = 0.0
    layers, trace = [], []
    totals = {"dram": 0, "noc": 0, "link": 0, "compute": 0}
    stage_max = 0.0
    for i, layer in enumerate(program.layers):
        start = now
        link_bytes = sum(links[i].values())
        if link_bytes:
            start += max(b / link_rate for b in links[i].values())
        for server in list(dram.values()) + list(noc.values()):
            server.free = max(server.free, start)
        end = _simulate_layer(per_layer[i], start, arch, double_buffer, dram, noc, trace)
        end += arch.barrier_cycles
        dram_b = sum(task[3] for tasks in per_layer[i].values() for task in tasks
                     if task[0] != "compute" and task[4] == "dram")
        noc_b = sum(task[3] for tasks in per_layer[i].values() for task in tasks
                    if task[0] != "compute" and task[4] in ("dram", "noc"))
        compute = sum(task[3] for tasks in per_layer[i].values() for task in tasks if task[0] == "compute")
        cycles = int(round(end - now))
        chips_used = len({pe // arch.pes_per_chip for pe in per_layer[i]}) or 1
        layers.append(LayerTiming(
            name=layer.name, kind=layer.kind, tiles=len(tiles_of[i]), pes=len(per_layer[i]), chips=chips_used,
            cycles=cycles, compute_cycles=compute, dram_bytes=dram_b, noc_bytes=noc_b, link_bytes=link_bytes,
            flops=layer.flops, sram_peak=max((t.sram_bytes for t in tiles_of[i]), default=0),
            utilization=compute / (cycles * max(1, len(per_layer[i]))) if cycles else 0.0,
            start_cycle=int(round(now)),
        ))
        stage_max = max(stage_max, end - now)
        totals["dram"] += dram_b
        totals["noc"] += noc_b
        totals["link"] += link_bytes
        totals["compute"] += compute
        now = end
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
    trace.sort()
    return Timing(
        cycles=total_cycles, latency_s=latency, roofline_s=roofline(program, arch),
        throughput_inf_s=throughput, dram_bytes=totals["dram"], noc_bytes=totals["noc"],
        link_bytes=totals["link"], energy_j=energy,
        pe_utilization=totals["compute"] / (total_cycles * arch.total_pes) if total_cycles else 0.0,
        flops=flops, layers=layers, trace=trace,
    )
