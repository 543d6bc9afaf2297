"""Memory planning: weight residency, on-chip activations, per-PE SRAM address plan.

Decisions, in this order, each checked against every PE's SRAM (``arch.tile_sram_bytes``):

1. *Weight residency* (across inferences): a layer's weight blocks stay in the SRAM of the PEs
   that use them, loaded once at program load, when every such PE still fits its resident blocks
   plus its largest working set. ``auto`` admits layers by the DRAM traffic they save per byte.
2. *On-chip activations*: a layer's output stays in the producing PEs' SRAM (read over the NoC
   by its consumers) while it is live, when every producer PE fits it next to its residents,
   other live activations and working buffers; otherwise it round-trips through DRAM.
3. *Address plan*: residents from address 0, live activations first-fit above them, working
   buffers (double-buffered tile operands) at the top; :func:`check_plan` proves no two live
   ranges overlap in time and address and everything is below the SRAM size.

All sizes are the tiles' (``w_bytes``, ``out_bytes``, ``sram_bytes``), which the tiling takes
from the tensors' dtypes: int8/uint8 weights and activations count 1 byte per element.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..program import Program, Tile
from ..target.arch import SpinnArch
from .tiling import MappingError

__all__ = ["MemoryPlan", "plan_memory", "check_plan"]


@dataclass
class MemoryPlan:
    resident_layers: list[int] = field(default_factory=list)
    onchip_tensors: list[int] = field(default_factory=list)
    peak_bytes: dict[int, int] = field(default_factory=dict)       # pe -> peak SRAM bytes
    resident_bytes: dict[int, int] = field(default_factory=dict)   # pe -> resident weight bytes
    # Address ranges of the busiest PE: [start, end, first_layer, last_layer, what]
    busiest_pe: int = -1
    ranges: list[list] = field(default_factory=list)


def _per_pe(tiles: list[Tile], attr: str, unique_groups: bool = False) -> dict[int, int]:
    out: dict[int, int] = {}
    seen = set()
    for t in tiles:
        if unique_groups and t.group >= 0:
            key = (t.pe, t.layer, t.group)
            if key in seen:
                continue
            seen.add(key)
        out[t.pe] = out.get(t.pe, 0) + getattr(t, attr)
    return out


def plan_memory(program: Program, arch: SpinnArch, weights: str = "auto", activations: str = "auto") -> MemoryPlan:
    """Decide residency and on-chip activations for a placed program (tiles have PEs)."""
    budget = arch.tile_sram_bytes
    n = len(program.layers)
    by_layer: list[list[Tile]] = [[] for _ in range(n)]
    for t in program.tiles:
        by_layer[t.layer].append(t)
    working = [dict() for _ in range(n)]  # layer -> pe -> working set
    for i, tiles in enumerate(by_layer):
        for t in tiles:
            working[i][t.pe] = max(working[i].get(t.pe, 0), t.sram_bytes)
    max_working: dict[int, int] = {}
    for w in working:
        for pe, b in w.items():
            max_working[pe] = max(max_working.get(pe, 0), b)

    plan = MemoryPlan()
    resident: dict[int, int] = {}
    if weights != "stream":
        w_per_layer = [_per_pe(tiles, "w_bytes", unique_groups=True) for tiles in by_layer]
        # DRAM bytes saved per resident byte: how often the block would be re-fetched.
        def benefit(i):
            total = sum(w_per_layer[i].values())
            return (sum(t.w_bytes for t in by_layer[i]) / total) if total else 0.0
        order = sorted((i for i in range(n) if w_per_layer[i]), key=lambda i: (-benefit(i), i))
        for i in order:
            trial = dict(resident)
            for pe, b in w_per_layer[i].items():
                trial[pe] = trial.get(pe, 0) + b
            if all(trial[pe] + max_working.get(pe, 0) <= budget for pe in trial):
                resident = trial
                plan.resident_layers.append(i)
            elif weights == "resident":
                layer = program.layers[i]
                raise MappingError(
                    f"layer {layer.name}: its weights ({sum(w_per_layer[i].values())} bytes) cannot stay "
                    f"resident next to the other layers' on {arch.total_pes} PEs of {budget} bytes; "
                    "use weights='auto' or 'stream', or a larger system"
                )
        plan.resident_layers.sort()
    plan.resident_bytes = dict(sorted(resident.items()))

    # Live ranges of temporaries: producer layer -> last consumer layer.
    producer = {layer.output: i for i, layer in enumerate(program.layers)}
    last_use: dict[int, int] = {}
    for i, layer in enumerate(program.layers):
        for tid in layer.inputs:
            if tid in producer:
                last_use[tid] = i
    live: dict[int, dict[int, int]] = {}  # tensor -> pe -> bytes
    peak: dict[int, int] = dict(resident)
    for i in range(n):
        # Free what died before this layer.
        for tid in [tid for tid in live if last_use.get(tid, -1) < i]:
            del live[tid]
        out = program.layers[i].output
        keep = activations != "dram" and program.tensors[out].role == "temp" and out in last_use
        out_per_pe = _per_pe(by_layer[i], "out_bytes")
        if keep:
            horizon = range(i, last_use[out] + 1)
            for pe, b in out_per_pe.items():
                used = resident.get(pe, 0) + sum(v.get(pe, 0) for v in live.values())
                need = used + b + max(working[j].get(pe, 0) for j in horizon)
                if need > budget:
                    keep = False
                    break
        if keep:
            live[out] = out_per_pe
            plan.onchip_tensors.append(out)
        for pe in set(working[i]) | set(out_per_pe if keep else {}):
            used = resident.get(pe, 0) + sum(v.get(pe, 0) for v in live.values()) + working[i].get(pe, 0)
            peak[pe] = max(peak.get(pe, 0), used)
    plan.peak_bytes = dict(sorted(peak.items()))
    _address_plan(program, plan, by_layer, working, last_use, producer)
    check_plan(plan, arch)
    return plan


def _address_plan(program, plan, by_layer, working, last_use, producer) -> None:
    if not plan.peak_bytes:
        return
    pe = max(plan.peak_bytes, key=lambda p: (plan.peak_bytes[p], -p))
    plan.busiest_pe = pe
    n = len(program.layers)
    ranges = []
    top = plan.resident_bytes.get(pe, 0)
    if top:
        ranges.append([0, top, 0, n - 1, "resident weights"])
    # First-fit activation slices above the residents; working buffers at the end of the arena.
    onchip = set(plan.onchip_tensors)
    allocated: list[list] = []
    for i in range(n):
        out = program.layers[i].output
        if out in onchip:
            size = sum(t.out_bytes for t in by_layer[i] if t.pe == pe)
            if size:
                start, end = top, top + size
                for a in sorted(allocated, key=lambda r: r[0]):
                    if a[3] >= i and a[2] <= last_use[out] and start < a[1] and a[0] < end:
                        start, end = a[1], a[1] + size
                rng = [start, end, i, last_use[out], f"activation {program.tensors[out].name}"]
                allocated.append(rng)
    ranges.extend(allocated)
    for i in range(n):
        w = working[i].get(pe, 0)
        if w:
            base = max([r[1] for r in ranges if r[2] <= i <= r[3]] or [0])
            ranges.append([base, base + w, i, i, f"working buffers {program.layers[i].name}"])
    plan.ranges = ranges


def check_plan(plan: MemoryPlan, arch: SpinnArch) -> None:
    """Raise :class:`MappingError` if an address range exceeds SRAM or two live ranges overlap."""
    budget = arch.tile_sram_bytes
    for pe, b in plan.peak_bytes.items():
        if b > budget:
            raise MappingError(f"SRAM plan of PE {pe} needs {b} bytes, it has {budget}")
    rs = plan.ranges
    for i, a in enumerate(rs):
        if a[1] > budget:
            raise MappingError(f"SRAM range {a} of PE {plan.busiest_pe} ends past {budget} bytes")
        for b in rs[i + 1:]:
            if a[0] < b[1] and b[0] < a[1] and a[2] <= b[3] and b[2] <= a[3]:
                raise MappingError(f"SRAM ranges {a} and {b} of PE {plan.busiest_pe} overlap")
