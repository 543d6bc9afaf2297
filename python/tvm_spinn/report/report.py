"""``tvm_spinn.report``: read the programs out of an executable and summarize them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


from ..codegen import MANIFEST_MAGIC, MANIFEST_SYMBOL
from ..program import Program
from ..program.format import mapping_to_json
from ..target.arch import SpinnArch
from ..target.faults import live_chips, usable_boards
from ..mapping.state import build_flight
from ..timing.bounds import PhysicalBound, physical_bound, program_workload

__all__ = ["Report", "report", "find_spinn_modules"]


@dataclass
class Report:
    """Simulated performance of a compiled model on its spinn system.

    Totals add up the offloaded regions, which run one after another. ``latency_s`` is the timing
    model's figure. ``physical`` is the plan-independent bound of the same work
    (:func:`tvm_spinn.timing.bounds.physical_bound`: the ops' MACs at the whole system's peak, the
    bytes they must read at the best bandwidth any placement gets, the board and chip
    crossings any placement that fits the memories needs); ``efficiency = physical_bound_s /
    latency_s`` is the headline (at most 1). ``roofline_s`` is the mapped programs' own compute/DRAM roofline (a
    diagnostic: it moves with the mapping, e.g. with the weights it keeps resident), and
    ``plan`` holds a multi-chip plan's own bounds (a diagnostic too).
    """

    system: str
    chips: int
    latency_s: float
    roofline_s: float
    cycles: int
    dram_bytes: int
    noc_bytes: int
    energy_j: float
    pe_utilization: float
    flops: int
    regions: int
    offloaded_ops: dict[str, int] = field(default_factory=dict)
    fallback_ops: dict[str, int] = field(default_factory=dict)
    fallback_reasons: dict[str, str] = field(default_factory=dict)
    weight_bytes: int = 0
    resident_weight_bytes: int = 0
    link_bytes: int = 0
    throughput_inf_s: float = 0.0
    mapping: list[dict] = field(default_factory=list)
    #: The multi-chip plan and bounds (see :func:`system_summary`); empty on one chip.
    plan: dict = field(default_factory=dict)
    layers: list[dict] = field(default_factory=list)
    programs: list = field(default_factory=list, repr=False)
    #: The plan-independent bound of the offloaded work (None for an empty report).
    physical: PhysicalBound | None = None
    #: Per region mapped over pipeline stages: its symbol, stages, the chips of each, the
    #: steady-state period, what binds it and the latency of one input (see
    #: :attr:`tvm_spinn.program.records.TimingSummary.pipeline`); empty when none is.
    pipelines: list[dict] = field(default_factory=list)

    @property
    def physical_bound_s(self) -> float:
        """Plan-independent lower bound on ``latency_s`` (seconds; 0.0 without programs)."""
        return self.physical.total_s if self.physical else 0.0

    @property
    def physical_binding(self) -> str:
        """Which part of the physical bound binds: ``compute``, ``memory`` or ``communication``."""
        return self.physical.binding if self.physical else ""

    @property
    def efficiency(self) -> float:
        """``physical_bound_s / latency_s`` (at most 1; nan without a latency)."""
        return self.physical.efficiency(self.latency_s) if self.physical else float("nan")

    def to_perfetto(self, path: str) -> str:
        """Write the simulated timeline as Chrome-trace JSON (opens in Perfetto); returns path."""
        from .timeline import to_perfetto

        return to_perfetto(self.programs, path)

    def plot(self, path: str) -> str:
        """Save a PE-utilization heatmap and layer timeline (matplotlib); returns path."""
        from .timeline import plot

        return plot(self.programs, path)

    def table(self) -> str:
        """Per-layer table as text."""
        head = (f"{'layer':<28}{'kind':<12}{'mode':<6}{'tile':>16}{'tiles':>7}{'PEs':>6}{'chips':>6}{'cycles':>12}{'DRAM B':>12}"
                f"{'NoC B':>12}{'SRAM peak':>11}{'MAC util':>9}")
        rows = [head, "-" * len(head)]
        for row in self.layers:
            tile = "x".join(str(v) for v in row.get("tile", []))
            rows.append(
                f"{row['region'] + '.' + row['name']:<28.28}{row['kind']:<12}{row.get('mode', 'fp32'):<6}{tile:>16.16}{row['tiles']:>7}{row['pes']:>6}"
                f"{row['chips']:>6}{row['cycles']:>12}{row['dram_bytes']:>12}{row['noc_bytes']:>12}"
                f"{row['sram_peak']:>11}{row['utilization']:>9.1%}"
            )
        return "\n".join(rows)

    def __str__(self) -> str:
        lines = [
            f"spinn report: system {self.system} ({self.chips} chip{'s' if self.chips != 1 else ''}), "
            f"{self.regions} offloaded region(s)",
            f"  latency {self.latency_s * 1e3:.3f} ms, {self.cycles} cycles; physical bound "
            + (f"{self.physical.line()}; efficiency {self.efficiency:.3f}" if self.physical else "n/a"),
            f"  the programs' own roofline (diagnostic) {self.roofline_s * 1e3:.3f} ms",
            f"  DRAM {self.dram_bytes / 1e6:.3f} MB, NoC {self.noc_bytes / 1e6:.3f} MB, "
            f"energy {self.energy_j * 1e3:.4f} mJ, PE utilization {self.pe_utilization:.2%}",
            f"  offloaded ops: {self.offloaded_ops or 'none'}",
            f"  fallback ops:  {self.fallback_ops or 'none'}",
        ]
        for op, why in self.fallback_reasons.items():
            lines.append(f"    {op}: {why}")
        if self.plan:
            lines.extend(_system_lines(self.plan))
        for p in self.pipelines:
            lines.append(f"  {p['symbol']}: {p['stages']} pipeline stages of {p['chips']} chip(s), period "
                         f"{p['period_s'] * 1e3:.3f} ms ({p['binding']} binds), latency {p['latency_s'] * 1e3:.3f} ms")
        return "\n".join(lines + [self.table()])


def system_summary(programs: list, arch: SpinnArch) -> dict:
    """The plan of a multi-chip build and its bounds, summed over its programs (which run one
    after another): per program tensor/data-parallel degrees and pipeline stage, the
    collectives, and the plan's own compute, memory (where the weights live) and communication
    bounds; ``binding`` names the largest and ``latency_over_bound`` compares the latency with it.
    These move with the plan (a diagnostic); :attr:`Report.efficiency` is the plan-independent
    headline.

    Throughput for a stream of inputs: the programs of one stage (board) run one after another
    and stages overlap (a pipeline, :func:`tvm_spinn.mapping.state.build_flight`: its period
    is the busiest board's time or the longest link transfer of an input), and the boards the
    stages leave free hold replicas. A
    program mapped over pipeline stages counts each stage's time on its own board, the others
    theirs on their stage's board (on a system with faults, the stage-th usable board), and
    ``stages`` counts the boards the build uses. On one
    stage, a replica group sized by the widest plan runs a narrower program (``tp x dp`` chips
    of the group's ``G``) for ``G / chips`` inferences at once, each chip holding that plan's
    shard (what the build's DRAM ledger counts), so the system completes
    ``chips / sum(latency x chips)`` inferences per second: the chip-seconds per inference the
    throughput objective minimizes. On a system with faults only what works holds replicas:
    its live chips for one stage, whole sets of ``stages`` usable boards for a pipeline.
    """
    rows = [p for p in programs if p.mapping.system is not None]
    if not rows:
        return {}
    keys = ("compute_bound_s", "memory_bound_s", "comm_bound_s")
    bounds = {k: sum(getattr(p.timing.system, k) for p in rows) for k in keys}
    latency = sum(p.timing.latency_s for p in programs)
    chips_per_board = arch.chips_per_board
    flight = build_flight(programs, arch)  # each board's time and the build's period
    usable = usable_boards(arch)
    stages = len(flight.stage_s)
    group = max(p.mapping.system.chips for p in rows)
    per_replica = stages * chips_per_board if stages > 1 else group
    # replicas only on what works: whole sets of usable boards for a pipeline, live chips for
    # one stage (every chip and board on a healthy system)
    live = int(live_chips(arch).size)
    replicas = max(1, len(usable) // stages if stages > 1 else live // per_replica)
    ops: dict[str, dict] = {}
    for p in rows:
        for c in p.timing.system.collectives:
            entry = ops.setdefault(f"{c.op}/{c.algorithm}", {"count": 0, "seconds": 0.0})
            entry["count"] += 1
            entry["seconds"] += c.seconds
    names = {"compute_bound_s": "compute", "memory_bound_s": "memory", "comm_bound_s": "communication"}
    binding = max(keys, key=lambda k: (bounds[k], k))
    bound = bounds[binding]
    return {
        "plans": [{"symbol": p.symbol, "tp": p.mapping.system.tp, "dp": p.mapping.system.dp,
                   "sp": p.mapping.system.sp,
                   "stage": p.mapping.system.stage, "binding": p.timing.system.binding} for p in rows],
        "tp": sorted({p.mapping.system.tp for p in rows}), "dp": sorted({p.mapping.system.dp for p in rows}),
        "sp": sorted({p.mapping.system.sp for p in rows}),
        "replicated": [{"symbol": p.symbol, "layer": name, "reason": reason}
                       for p in rows for name, reason in p.mapping.system.replicated],
        "stages": stages, "replicas": replicas, "chips_per_replica": per_replica,
        "collectives": ops, **bounds, "binding": names[binding],
        "latency_over_bound": latency / bound if bound else float("nan"),
        "streamed_bytes_per_chip": sum(p.timing.system.streamed_bytes_per_chip for p in rows),
        "throughput_inf_s": (replicas / flight.period_s if stages > 1 else
                             live / sum(p.timing.latency_s * (p.mapping.system.chips if p.mapping.system is not None
                                                               else 1) for p in programs)) if latency else 0.0,
    }


def _pipeline_row(program) -> dict:
    t, stages = program.timing.pipeline, program.mapping.pipeline.stages
    return {"symbol": program.symbol, "stages": len(stages), "chips": [len(s.chips) for s in stages],
            "period_s": t.period_s, "binding": t.binding, "latency_s": t.latency_s}


def _throughput(programs: list, arch: SpinnArch) -> float:
    if any(p.mapping.system is not None for p in programs):
        return system_summary(programs, arch)["throughput_inf_s"]
    return min((p.timing.throughput_inf_s for p in programs), default=0.0)


def _system_lines(s: dict) -> list[str]:
    coll = ", ".join(f"{v['count']} {k} ({v['seconds'] * 1e3:.3f} ms)" for k, v in sorted(s["collectives"].items()))
    return [
        f"  plan: tensor parallel {s['tp']}, data parallel {s['dp']}, sequence parallel {s.get('sp', [1])}, "
        f"{s['stages']} pipeline stage(s), "
        f"{s['replicas']} replica(s) of {s['chips_per_replica']} chips; collectives: {coll or 'none'}",
        f"  the plan's own bounds (diagnostic): compute {s['compute_bound_s'] * 1e3:.3f} ms, memory {s['memory_bound_s'] * 1e3:.3f} ms "
        f"({s['streamed_bytes_per_chip'] / 1e6:.3f} MB streamed per chip), communication "
        f"{s['comm_bound_s'] * 1e3:.3f} ms; {s['binding']} binds; latency / the plan's bound "
        f"{s['latency_over_bound']:.2f}; stream throughput {s['throughput_inf_s']:.1f} inf/s",
    ] + [f"  replicated on every chip: {r['symbol']} {r['layer']} ({r['reason']})" for r in s.get("replicated", [])]


def _walk(mod):
    yield mod
    for sub in mod.imports:
        yield from _walk(sub)


def find_spinn_modules(ex) -> list:
    """All ``spinn`` runtime modules imported by an executable or loaded library."""
    root = ex.mod if hasattr(ex, "mod") else ex  # VMExecutable, or a loaded runtime.Module
    found = [m for m in _walk(root) if m.kind == "spinn"]
    return sorted(found, key=lambda m: str(m["get_symbol"]()))


def report(ex) -> Report:
    """Summarize the simulated execution of a model compiled for a spinn target.

    Parameters
    ----------
    ex : tvm.relax.VMExecutable or tvm.runtime.Module
        What ``relax.build(mod, target="spinn")`` returned, or ``tvm.runtime.load_module`` of an
        exported library.

    Returns
    -------
    Report
        Latency, the physical bound and efficiency, the programs' own roofline, cycles, bytes moved,
        energy, utilization, op counts and per-layer rows.
    """
    manifest, programs = {}, []
    for m in find_spinn_modules(ex):
        data = bytes(m["get_program"]())
        if str(m["get_symbol"]()) == MANIFEST_SYMBOL and data.startswith(MANIFEST_MAGIC):
            manifest = json.loads(data[len(MANIFEST_MAGIC):].decode())
        else:
            programs.append(Program.from_bytes(data))
    if not programs and not manifest:
        raise ValueError("no spinn modules in this executable: was it built for a spinn target?")
    arch = programs[0].arch if programs else SpinnArch()
    chips = manifest.get("chips", arch.chips)
    system = arch if chips == arch.chips else arch.replace(chips=chips)
    keys = ("latency_s", "roofline_s", "cycles", "dram_bytes", "noc_bytes", "link_bytes", "energy_j", "flops")
    totals = {k: sum(getattr(p.timing, k) for p in programs) for k in keys}
    busy = sum(p.timing.pe_utilization * p.timing.cycles for p in programs)
    layers = []
    for i, p in enumerate(programs):
        modes = {layer.name: layer.mode for layer in p.layers}
        records = p.mapping.layers
        for j, row in enumerate(p.timing.layers):
            # the mapping's decision for the layer: its tile shape and its PE range
            tile, pes = (records[j].tile, records[j].pes) if j < len(records) else ((), (0, 0))
            layers.append(dict(vars(row), region=f"r{i}", mode=modes.get(row.name, "fp32"),
                               tile=list(tile), pe_range=list(pes)))
    return Report(
        system=manifest.get("system", arch.name), chips=manifest.get("chips", arch.chips),
        regions=len(programs), pe_utilization=busy / totals["cycles"] if totals["cycles"] else 0.0,
        offloaded_ops=manifest.get("offloaded_ops", {}), fallback_ops=manifest.get("fallback_ops", {}),
        fallback_reasons=manifest.get("fallback_reasons", {}),
        weight_bytes=sum(t.nbytes for p in programs for t in p.tensors if t.role == "const"),
        resident_weight_bytes=sum(p.memory.resident_bytes_total for p in programs),
        throughput_inf_s=_throughput(programs, system),
        mapping=[dict(mapping_to_json(p.mapping), symbol=p.symbol) for p in programs],
        plan=system_summary(programs, system),
        layers=layers, programs=programs, pipelines=[_pipeline_row(p) for p in programs if p.timing.pipeline is not None],
        physical=physical_bound(program_workload(programs), system) if programs else None, **totals,
    )
