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

Before any of this, :func:`check_capacity` compares the bytes a program needs at once (its
constants, plus the largest operand set of any one layer) with what the system holds (every
chip's DRAM and PE SRAM): a program that cannot fit is refused before its tiles (arrays that
grow with the tensors' sizes) are built.

All sizes are the tiles' (``w_bytes``, ``out_bytes``, ``sram_bytes``), which the tiling takes
from the tensors' dtypes: int8/uint8 weights and activations count 1 byte per element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..program import Program
from ..program.tiles import TileTable
from ..target.arch import SpinnArch
from .tiling import MappingError

__all__ = ["MemoryPlan", "plan_memory", "check_plan", "check_capacity", "capacity_bytes", "LEDGER_RESIDENT_SHARE", "weight_bytes_per_pe",
           "held_between_calls"]

#: Share of a PE's tile SRAM the resident weights of a whole build may take (see plan_memory):
#: the tile chooser keeps working buffers within half of it when it can (WORKING_SHARE).
LEDGER_RESIDENT_SHARE = 0.5


def _nbytes(program: Program, tid: int) -> int:
    """Bytes of tensor ``tid`` (Python integers: no overflow however large the shape)."""
    t = program.tensors[tid]
    return math.prod(int(d) for d in t.shape) * int(np.dtype(t.dtype).itemsize)


def _describe(program: Program, tid: int) -> str:
    t = program.tensors[tid]
    return f"{t.role} {t.name!r} {tuple(int(d) for d in t.shape)} {t.dtype}: {_nbytes(program, tid)} bytes"


def capacity_bytes(arch: SpinnArch) -> int:
    """Bytes the whole system holds: every chip's DRAM and its PEs' tile SRAM."""
    return arch.chips * (arch.dram_bytes + arch.pes_per_chip * arch.tile_sram_bytes)


def check_capacity(program: Program, arch: SpinnArch) -> None:
    """Refuse a program that cannot fit ``arch`` whatever its tiling, before it is tiled.

    A lower bound on what must be stored at once: every constant (weights live for the life
    of the program) plus, for the layer with the largest operands, its inputs and output (a
    layer reads and writes them during one step). Only the shapes are read: the cost is
    linear in the number of layers and tensors, not in the tensors' sizes.

    Raises
    ------
    MappingError
        Naming the bytes needed, the bytes available, the layer and its largest tensor.
    """
    capacity = capacity_bytes(arch)
    consts = sorted({tid for layer in program.layers for tid in layer.consts.values()}
                    | {tid for tid, t in enumerate(program.tensors) if t.role == "const"})
    const_bytes = sum(_nbytes(program, tid) for tid in consts)
    const_set = set(consts)
    worst = None
    for layer in program.layers:
        operands = sorted({*layer.inputs, layer.output} - const_set)
        need = sum(_nbytes(program, tid) for tid in operands)
        if worst is None or need > worst[0]:
            worst = (need, layer, operands)
    need, layer, operands = worst if worst is not None else (0, None, [])
    if const_bytes + need <= capacity:
        return
    where = (f"{arch.chips} chip{'s' if arch.chips != 1 else ''}, each {arch.dram_bytes} bytes of DRAM and "
             f"{arch.pes_per_chip} PEs x {arch.tile_sram_bytes} bytes of SRAM")
    if layer is not None and need:
        big = max(operands, key=lambda tid: (_nbytes(program, tid), -tid))
        what = (f"layer {layer.name} ({layer.kind}) needs {need} bytes for its inputs and output at once "
                f"(largest: {_describe(program, big)})" + (f" beside {const_bytes} bytes of constants" if const_bytes else ""))
    else:
        big = max(consts, key=lambda tid: (_nbytes(program, tid), -tid))
        what = f"its constants need {const_bytes} bytes (largest: {_describe(program, big)})"
    raise MappingError(f"{what}: {const_bytes + need} bytes needed, the target {arch.name} holds {capacity} "
                       f"({where})")


@dataclass
class MemoryPlan:
    resident_layers: list[int] = field(default_factory=list)
    onchip_tensors: list[int] = field(default_factory=list)
    peak_bytes: dict[int, int] = field(default_factory=dict)       # pe -> peak SRAM bytes
    resident_bytes: dict[int, int] = field(default_factory=dict)   # pe -> resident weight bytes
    reserved_bytes: dict[int, int] = field(default_factory=dict)   # pe -> earlier programs' residents
    # Address ranges of the busiest PE: [start, end, first_layer, last_layer, what]
    busiest_pe: int = -1
    ranges: list[list] = field(default_factory=list)


class _PerPe:
    """Per-PE totals of one layer, dense over the layer's PE span (a layer runs on a contiguous
    PE range, so this is O(PEs of the layer) whatever the system size). PEs with a zero total
    hold nothing."""

    __slots__ = ("lo", "v")

    def __init__(self, pe: np.ndarray, values: np.ndarray, reduce: str = "sum"):
        if not len(pe):
            self.lo, self.v = 0, np.zeros(0, dtype=np.int64)
            return
        self.lo = int(pe.min())
        idx = pe - self.lo
        n = int(idx.max()) + 1
        if reduce == "sum":
            self.v = np.bincount(idx, weights=values, minlength=n).astype(np.int64)
        else:
            self.v = np.zeros(n, dtype=np.int64)
            np.maximum.at(self.v, idx, values)

    def pes(self) -> np.ndarray:
        return np.flatnonzero(self.v) + self.lo

    def values(self) -> np.ndarray:
        return self.v[self.v != 0]

    def at(self, pes: np.ndarray) -> np.ndarray:
        """Totals at PEs ``pes`` (0 outside the span)."""
        idx = pes - self.lo
        inside = (idx >= 0) & (idx < len(self.v))
        out = np.zeros(len(pes), dtype=np.int64)
        out[inside] = self.v[idx[inside]]
        return out


def weight_bytes_per_pe(table: TileTable) -> _PerPe:
    """Weight bytes each PE holds for a layer: one copy per (PE, group) of grouped tiles."""
    if not len(table):
        return _PerPe(table.pe, table.w_bytes)
    grouped = table.group >= 0
    key = table.pe * (int(table.group.max()) + 2) + table.group
    _, first = np.unique(key, return_index=True)
    keep = np.zeros(len(table), dtype=bool)
    keep[first] = True
    keep |= ~grouped
    return _PerPe(table.pe[keep], table.w_bytes[keep])


def held_between_calls(program: Program, index: int) -> bool:
    """Whether layer ``index``'s weight operand (its tiles' ``w_bytes``) may stay in SRAM from
    one call to the next: a constant weight, or any input of the program (the caller's to keep
    in place between calls, as a KV cache read as an attention matmul's right operand,
    :func:`.state.resident_state`; this rule does not tell state from an input handed over anew
    each call). Not an operand the program computes on each call (an activation: written anew
    every call, so nothing loaded at program load holds it; it moves as its tiles' bytes say)."""
    from .shard import rule_of

    layer = program.layers[index]
    rule = rule_of(layer)
    return all(tid in program.inputs or program.tensors[tid].role == "const"
               for pos, tid in enumerate(layer.inputs) if rule.cache_operand(layer, pos))


def plan_memory(program: Program, arch: SpinnArch, weights: str = "auto", activations: str = "auto",
                tables: list[TileTable] | None = None, reserved: np.ndarray | None = None) -> MemoryPlan:
    """Decide residency and on-chip activations for a placed program.

    ``tables`` are the placed tiles per layer (default: ``program.tiles`` of a mapped program).
    ``reserved``: SRAM bytes per PE already held by the resident weights of the programs mapped
    before this one on the same chips (they stay for the life of the model, so this program's
    residents and buffers fit beside them); ``resident_bytes`` counts this program's own only.
    With ``reserved`` (a build's ledger), residents never take more than
    :data:`LEDGER_RESIDENT_SHARE` of a PE's SRAM, so the programs mapped later keep room for
    their working buffers.
    """
    tables = tables if tables is not None else program.tiles.tables
    budget = arch.tile_sram_bytes
    n = len(program.layers)
    # Arrays over the PEs the program uses (not the whole system: a model on a few chips of a
    # SpiNNcloud costs what it costs on those chips).
    total = max((int(t.pe.max()) + 1 for t in tables if len(t)), default=0)
    working = [_PerPe(t.pe, t.sram_bytes, "max") for t in tables]  # layer -> max working set per PE
    max_working = np.zeros(total, dtype=np.int64)
    for w in working:
        span = slice(w.lo, w.lo + len(w.v))
        max_working[span] = np.maximum(max_working[span], w.v)

    plan = MemoryPlan()
    resident = np.zeros(total, dtype=np.int64)
    if reserved is not None and len(reserved):
        k = min(total, len(reserved))
        resident[:k] = reserved[:k]
    base = resident.copy()
    cap = int(budget * LEDGER_RESIDENT_SHARE) if reserved is not None else budget
    if weights != "stream":
        w_per_layer = [weight_bytes_per_pe(t) for t in tables]
        # DRAM bytes saved per resident byte: how often the block would be re-fetched.
        def benefit(i):
            held = int(w_per_layer[i].v.sum())
            return (int(tables[i].w_bytes.sum()) / held) if held else 0.0
        order = sorted((i for i in range(n) if w_per_layer[i].v.sum() and held_between_calls(program, i)),
                       key=lambda i: (-benefit(i), i))
        for i in order:
            pes, b = w_per_layer[i].pes(), w_per_layer[i].values()
            if (resident[pes] + b + max_working[pes] <= budget).all() and (resident[pes] + b <= cap).all():
                resident[pes] += b
                plan.resident_layers.append(i)
            elif weights == "resident":
                layer = program.layers[i]
                raise MappingError(
                    f"layer {layer.name}: its weights ({int(b.sum())} bytes) cannot stay "
                    f"resident next to the other layers' on {arch.total_pes} PEs of {budget} bytes; "
                    "use weights='auto' or 'stream', or a larger system"
                )
        plan.resident_layers.sort()
    own = resident - base
    kept = np.flatnonzero(base)
    plan.reserved_bytes = dict(zip(kept.tolist(), base[kept].tolist()))
    held = np.flatnonzero(own)
    plan.resident_bytes = dict(zip(held.tolist(), own[held].tolist()))
    held = np.flatnonzero(resident)

    # Live ranges of temporaries: producer layer -> last consumer layer.
    producer = {layer.output: i for i, layer in enumerate(program.layers)}
    last_use: dict[int, int] = {}
    for i, layer in enumerate(program.layers):
        for tid in layer.inputs:
            if tid in producer:
                last_use[tid] = i
    live: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # tensor -> (pes, bytes)
    live_bytes = np.zeros(total, dtype=np.int64)
    peak = resident.copy()
    touched = np.zeros(total, dtype=bool)
    touched[held] = True
    outs = []
    for i in range(n):
        # Free what died before this layer.
        for tid in [tid for tid in live if last_use.get(tid, -1) < i]:
            pes, b = live.pop(tid)
            live_bytes[pes] -= b
        out = program.layers[i].output
        keep = activations != "dram" and program.tensors[out].role == "temp" and out in last_use
        per_out = _PerPe(tables[i].pe, tables[i].out_bytes)
        out_pes, out_b = per_out.pes(), per_out.values()
        outs.append(per_out)
        if keep:
            horizon = np.zeros(len(out_pes), dtype=np.int64)
            for j in range(i, last_use[out] + 1):
                horizon = np.maximum(horizon, working[j].at(out_pes))
            need = resident[out_pes] + live_bytes[out_pes] + out_b + horizon
            keep = bool((need <= budget).all())
        if keep:
            live[out] = (out_pes, out_b)
            live_bytes[out_pes] += out_b
            plan.onchip_tensors.append(out)
        w = working[i]
        mask = w.v != 0
        if keep and len(per_out.v):  # same tiles, same PE span as the working sets
            mask = mask | (per_out.v != 0)
        pes = np.flatnonzero(mask) + w.lo
        used = resident[pes] + live_bytes[pes] + working[i].at(pes)
        peak[pes] = np.maximum(peak[pes], used)
        touched[pes] = True
    idx = np.flatnonzero(touched)
    plan.peak_bytes = dict(zip(idx.tolist(), peak[idx].tolist()))
    _address_plan(program, plan, outs, working, last_use)
    check_plan(plan, arch)
    return plan


def activation_label(program: Program, layer: int) -> str:
    """The label of the address range of layer ``layer``'s on-chip output (``MemoryPlan.ranges``)."""
    return f"activation {program.tensors[program.layers[layer].output].name}"


def _address_plan(program, plan, outs, working, last_use) -> None:
    if not plan.peak_bytes:
        return
    pe = max(plan.peak_bytes, key=lambda p: (plan.peak_bytes[p], -p))
    plan.busiest_pe = pe
    n = len(program.layers)
    ranges = []
    below = plan.reserved_bytes.get(pe, 0)
    top = below + plan.resident_bytes.get(pe, 0)
    if below:
        ranges.append([0, below, 0, n - 1, "resident weights of earlier programs"])
    if top > below:
        ranges.append([below, top, 0, n - 1, "resident weights"])
    # First-fit activation slices above the residents; working buffers at the end of the arena.
    onchip = set(plan.onchip_tensors)
    allocated: list[list] = []
    for i in range(n):
        out = program.layers[i].output
        if out in onchip:
            size = int(outs[i].at(np.array([pe]))[0])
            if size:
                start, end = top, top + size
                for a in sorted(allocated, key=lambda r: r[0]):
                    if a[3] >= i and a[2] <= last_use[out] and start < a[1] and a[0] < end:
                        start, end = a[1], a[1] + size
                rng = [start, end, i, last_use[out], activation_label(program, i)]
                allocated.append(rng)
    ranges.extend(allocated)
    for i in range(n):
        w = int(working[i].at(np.array([pe]))[0])
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
    if not rs:
        return
    r = np.array([a[:4] for a in rs], dtype=np.int64)
    past = np.flatnonzero(r[:, 1] > budget)
    if len(past):
        raise MappingError(f"SRAM range {rs[past[0]]} of PE {plan.busiest_pe} ends past {budget} bytes")
    # All pairs at once: overlapping addresses while live at the same time.
    clash = ((r[:, None, 0] < r[None, :, 1]) & (r[None, :, 0] < r[:, None, 1])
             & (r[:, None, 2] <= r[None, :, 3]) & (r[None, :, 2] <= r[:, None, 3]))
    clash = np.triu(clash, k=1)
    if clash.any():
        i, j = np.unravel_index(int(np.argmax(clash)), clash.shape)
        raise MappingError(f"SRAM ranges {rs[i]} and {rs[j]} of PE {plan.busiest_pe} overlap")
