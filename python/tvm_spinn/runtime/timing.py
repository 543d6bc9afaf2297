"""Timing and energy model: walks a program's static schedule.

Per layer, each PE runs its task list with double buffering: the DMA of tile i+1 overlaps the
compute of tile i, so a PE's time is its first ``dma_in`` plus, per tile, the larger of compute
and the next transfer, plus the last ``dma_out``. All DMA traffic goes between DRAM and SRAM over
the NoC; the chip's DRAM bandwidth is shared by its PEs, so a layer takes at least its DRAM bytes
over the chip's bandwidth. A barrier closes each layer. Energy counts compute, SRAM, DRAM and NoC
bytes and static power over the latency.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..program import Program
from ..target.arch import SpinnArch

__all__ = ["LayerTiming", "Timing", "evaluate", "roofline"]


@dataclass
class LayerTiming:
    name: str
    kind: str
    tiles: int
    pes: int
    cycles: int
    compute_cycles: int
    dram_bytes: int
    noc_bytes: int
    flops: int
    sram_peak: int
    utilization: float


@dataclass
class Timing:
    cycles: int
    latency_s: float
    roofline_s: float
    dram_bytes: int
    noc_bytes: int
    energy_j: float
    pe_utilization: float
    flops: int
    layers: list[LayerTiming] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def roofline(program: Program, arch: SpinnArch) -> float:
    """Lower bound: max(compute at peak, every input/weight/output crossing DRAM once)."""
    fp32 = sum(layer.flops for layer in program.layers if layer.mode == "fp32")
    int8 = sum(layer.flops for layer in program.layers if layer.mode == "int8")
    compute_s = fp32 / arch.peak_fp32_flops_s + int8 / arch.peak_int8_ops_s
    touched = sum(t.nbytes for t in program.tensors if t.role in ("input", "output", "const"))
    return max(compute_s, touched / arch.total_dram_bw_bytes_s)


def evaluate(program: Program, arch: SpinnArch) -> Timing:
    """Cycles, bytes, energy and utilization of ``program`` on ``arch``."""
    n_layers = len(program.layers)
    dma_cycles = lambda nbytes: arch.dma_setup_cycles + nbytes / arch.dma_bw_bytes_per_cycle  # noqa: E731
    pe_time = [dict() for _ in range(n_layers)]
    compute = [0] * n_layers
    dram = [0] * n_layers
    for pe, tasks in enumerate(program.schedule):
        # Per layer: (first transfer, sum of max(compute_i, transfer_{i+1}), pending transfer).
        state: dict[int, list[float]] = {}
        for op, layer, tile, amount in tasks:
            if op == "barrier":
                continue
            s = state.setdefault(layer, [0.0, 0.0, None])
            if op == "dma_in":
                dram[layer] += amount
                cost = dma_cycles(amount)
                if s[2] is None:
                    s[0] += cost
                else:
                    s[1] += max(s[2], cost)
                s[2] = None
            elif op == "compute":
                compute[layer] += amount
                s[2] = float(amount)
            else:  # dma_out overlaps the next tile's compute; accounted as a transfer
                dram[layer] += amount
                s[1] += max(s[2] or 0.0, dma_cycles(amount))
                s[2] = None
        for layer, s in state.items():
            pe_time[layer][pe] = s[0] + s[1] + (s[2] or 0.0)
    dram_per_cycle = arch.dram_bw_bytes_s * arch.chips / arch.clock_hz
    layers, total_cycles = [], 0
    for i, layer in enumerate(program.layers):
        tiles = [t for t in program.tiles if t.layer == i]
        busiest = max(pe_time[i].values(), default=0.0)
        cycles = int(max(busiest, dram[i] / dram_per_cycle)) + arch.barrier_cycles
        total_cycles += cycles
        pes = len(pe_time[i])
        layers.append(LayerTiming(
            name=layer.name, kind=layer.kind, tiles=len(tiles), pes=pes, cycles=cycles,
            compute_cycles=compute[i], dram_bytes=dram[i], noc_bytes=dram[i], flops=layer.flops,
            sram_peak=max((t.sram_bytes for t in tiles), default=0),
            utilization=compute[i] / (cycles * arch.total_pes) if cycles else 0.0,
        ))
    latency = total_cycles / arch.clock_hz
    dram_total = sum(dram)
    flops = sum(layer.flops for layer in program.layers)
    energy = (
        flops / 2 * arch.e_flop_fp32_j
        + dram_total * (arch.e_dram_byte_j + arch.e_noc_byte_j + arch.e_sram_byte_j)
        + arch.p_static_w_per_chip * arch.chips * latency
    )
    busy = sum(compute)
    return Timing(
        cycles=total_cycles, latency_s=latency, roofline_s=roofline(program, arch),
        dram_bytes=dram_total, noc_bytes=dram_total, energy_j=energy,
        pe_utilization=busy / (total_cycles * arch.total_pes) if total_cycles else 0.0,
        flops=flops, layers=layers,
    )
