"""Physical lower bounds of one inference step that no mapping or plan can move.

Each bound is a closed formula of a plain description of the work (:class:`Workload`: MACs per
arithmetic mode, bytes the step must read at least once, the smallest activation that must
cross between two layers) and of the system's :class:`~tvm_spinn.target.arch.SpinnArch`
fields. Nothing here reads a mapping, a plan, a tile or the timing model: a worse plan of the
same work has the same bound, so ``efficiency = bound / latency`` (at most 1) ranks plans.

Only the live hardware counts (:mod:`tvm_spinn.target.faults`: a system with dead chips or boards,
or a partial allocation): its chips compute and hold bytes, on the usable boards.

Three kinds, each a lower bound on the latency of *any* placement:

* **compute**: the MACs of each mode at the peak of every application PE of the system
  (int8: :attr:`~SpinnArch.macs_per_cycle` a cycle on the MAC array; fp32:
  :attr:`~SpinnArch.m4f_flops_per_cycle` multiply-accumulates a cycle on the M4F);
* **memory**: the bytes the step must read at least once (the weights it touches, the KV
  slots it attends over, the rows a gather takes from an embedding table, never the whole
  table) from where they can live: in SRAM as far as the SRAM of the boards holding them has
  room, read at the SRAM rate, the rest from the DRAM of every chip of those boards, both at
  once (see :func:`sram_read_bytes_s` for the SRAM rate);
* **communication**: the bytes a step reads sit on ``n`` chips, at least as many as the
  fewest chips whose SRAM and DRAM hold them. The step's layers depend on each other in a
  chain (each output of a dense layer needs all of its input), so a token passes through every
  chip holding some of them, one after another: ``n`` chips on ``k`` boards cost at least
  ``k - 1`` board-to-board crossings and ``n - k`` crossings between chips of a board. A
  crossing costs at least its hop latency (:attr:`~SpinnArch.board_link_hop_s`,
  :attr:`~SpinnArch.link_hop_s`) plus one row of the hand-over (the smallest activation that
  can cross a cut between two layers, :attr:`Workload.handover_rows` rows that may stream
  through the chain one after another) over the crossing's bandwidth; the whole hand-over
  passes the path's slowest crossing once. Between boards that bandwidth is the links joining
  two boards at their payload rate (:func:`board_pair_bytes_s`); between two chips of a board it
  is every link into the receiving chip (:func:`chip_in_bytes_s`: routes through other chips
  may widen a hand-over up to that, never beyond). Hand-overs are in the dtype the program's
  tensors have at that cut (fp32 where the bits must equal the one-chip program's).

That chain argument holds for placements that keep each layer's bytes on one chip (pipelines
of layers). A placement may instead split layers over chips (tensor parallelism) and cross far
fewer times than it has chips. The step is a run of **phases** separated by
:attr:`Workload.sync_points` ``S`` points where a full row must be assembled from every part
of the phase before it (a norm, the step's output): a phase whose bytes sit on two or more
chips ends with an exchange, and a phase on one chip hands over to the next whenever that one
is elsewhere. For any placement with ``m`` phases split and the rest on ``d`` distinct chips,
a token's path crosses at least ``m + d - 2`` times (every split phase's end; every entry into
a split phase but the step's first; every move between single chips, ``d - 1`` arrivals at a
new chip of which a split phase's end gives at most one per run of split phases, each run but
the first entered by a crossing of its own), ``S`` when every phase is split, and once when
``n >= 2`` chips hold bytes. Those ``d`` chips read every byte of the unsplit phases, at least
``R - m rho`` (``R`` the bytes read, ``rho`` :attr:`Workload.largest_phase_bytes`), so when
``m + d <= R / rho`` their read takes at least as long as ``R`` spread over ``m + d`` chips.
Hence, with ``S' = min(S, floor(R / rho))`` and ``c(n) = max(min(n - 1, 1), min(n - 2, S' -
1))``, every placement takes at least ``min over n of max(memory(n), c(n) crossings)`` (``n =
m + d`` when ``m + d - 2 < S' - 1``, else the chips it uses), and when a phase fits a chip the
``n`` worth trying start at the fewest chips that hold the bytes (``m + d`` chips hold them).
The same argument over boards gives ``min over k of max(memory(k boards), c(k) board
crossings)``.

What a crossing of a split placement costs: its hop latency, and for every crossing into a
phase on two or more chips the row part a receiving chip lacks: each chip of a phase's first
weight-bearing layer takes the whole row in (its weights a slice of the output features, the
split tensor-parallel plans use), some chip of the phase made at most half of it, so it takes
at least half a row in over its links (:func:`chip_in_bytes_s`), across a board edge too. A
crossing into a phase on one chip may be a reduction into the chip that made most of the row:
its hop only. Two such crossings have a crossing into a split phase between them, so of ``c``
crossings at least ``floor(c / 2)`` carry half a row. (Splitting a layer's input features
instead takes a slice of the row in and pays an exchange of partial sums inside the phase;
that variant is not derived here.)

The physical bound is the least of the chain bound (``min over n of max(compute, memory(n),
chain communication(n))`` for ``n`` from the fewest chips whose SRAM and DRAM hold the bytes
up to every chip of the system, ``n`` chips on the fewest boards that have them, ``k =
ceil(n / chips_per_board)``) and the split bound (``max`` of compute and the chip and board
forms above); :attr:`PhysicalBound.binding` names the largest part of the lesser,
:attr:`PhysicalBound.details` ``"placement"`` which of the two it is.

What the bounds do not count (so they stay below every plan): element-wise work, writes,
per-layer fixed costs (barriers, DMA set-up) and program load. Compute is the whole system's
peak whatever ``n`` is. Bytes are read by the chips that hold them (weights shipped from
another chip's memory ahead of the token are not derived).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..program.ops import family_of
from ..target.arch import SpinnArch

__all__ = ["Workload", "PhysicalBound", "physical_bound", "program_workload", "decode_workload",
           "gathered_bytes", "sram_read_bytes_s", "board_pair_bytes_s", "chip_in_bytes_s",
           "board_capacity_bytes", "chip_capacity_bytes"]

KINDS = ("compute", "memory", "communication")


@dataclass(frozen=True)
class Workload:
    """The work of one inference step, as far as the physical bounds need it.

    Parameters
    ----------
    macs_int8 : int
        Multiply-accumulates of int8 GEMMs (MAC array).
    macs_fp32 : int
        Multiply-accumulates of fp32 GEMMs (M4F).
    read_bytes : int
        Bytes the step must read at least once (weights touched, KV slots attended over, rows
        gathered from tables, the step's inputs).
    handover_bytes : int
        The smallest activation that must cross a cut between two consecutive layers, in the
        dtype the program holds it in there (0: the step has a single layer).
    handover_rows : int
        Rows of that hand-over the chain may stream one after another (a layer can finish a row
        of its output once that row of its input is in): the users of a decode batch (each
        output of a dense layer needs all of one user's input); a program's hand-over counts
        as ``handover_bytes`` rows of a byte (its layers' rows may stream, and a bound may not
        charge more than a byte of them in series per crossing).
    sync_points : int
        Points of the step where a full row must be assembled from every part of the stretch
        before it, the step's output included: every norm of a transformer's residual stream
        (two a block), the final norm and the output; a program's output at least (1, the fewest
        any step has). A placement that splits every weight-bearing layer exchanges at each.
        Must not exceed the true count: more sync points force more crossings.
    largest_phase_bytes : int
        Bytes read by the largest stretch between two sync points, or more (0: ``read_bytes``,
        the whole step as one stretch). Must not be less than the true largest stretch.
    description : dict
        What the numbers count (shown in reports; not read by the bounds).
    """

    macs_int8: int = 0
    macs_fp32: int = 0
    read_bytes: int = 0
    handover_bytes: int = 0
    handover_rows: int = 1
    sync_points: int = 1
    largest_phase_bytes: int = 0
    description: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("macs_int8", "macs_fp32", "read_bytes", "handover_bytes", "largest_phase_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"Workload.{name} must be an integer >= 0, got {value!r}")
        rows = self.handover_rows
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1:
            raise ValueError(f"Workload.handover_rows must be an integer >= 1, got {rows!r}")
        syncs = self.sync_points
        if isinstance(syncs, bool) or not isinstance(syncs, (int, np.integer)) or syncs < 1:
            raise ValueError(f"Workload.sync_points must be an integer >= 1, got {syncs!r}")


@dataclass(frozen=True)
class PhysicalBound:
    """A plan-independent lower bound on a step's latency (see the module docstring).

    ``total_s = max(compute_s, memory_s, communication_s)``; ``binding`` names the largest;
    ``details`` holds the numbers behind them (boards on a token's path, crossings, rates).
    """

    compute_s: float
    memory_s: float
    communication_s: float
    total_s: float
    binding: str
    details: dict = field(default_factory=dict, compare=False)

    def efficiency(self, latency_s: float) -> float:
        """``total_s / latency_s``: 1 would be a plan at the physical limit."""
        return self.total_s / latency_s if latency_s > 0 else float("nan")

    def parts(self) -> dict:
        """``{kind: seconds}`` of the three parts."""
        return {"compute": self.compute_s, "memory": self.memory_s, "communication": self.communication_s}

    def to_dict(self) -> dict:
        return {"total_s": self.total_s, "binding": self.binding, "parts_s": self.parts(), "details": dict(self.details)}

    def line(self) -> str:
        """One line: total, binding kind and parts."""
        parts = ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in self.parts().items())
        n, k = self.details.get("chips_on_path", 1), self.details.get("boards_on_path", 1)
        path = f"; {n} chips on {k} board(s) on a token's path" if n > 1 else ""
        return f"{self.total_s * 1e3:.4g} ms, {self.binding} binds ({parts}{path})"


# ----------------------------------------------------------------------------- rates and sizes
def sram_read_bytes_s(arch: SpinnArch) -> float:
    """Bytes per second one PE can read out of its own SRAM: the faster of its DMA engine
    (:attr:`~SpinnArch.dma_bw_bytes_per_cycle`) and the MAC array's operand reads (one
    ``mac_rows`` and one ``mac_cols`` vector of int8 operands a cycle), at the clock."""
    return max(arch.dma_bw_bytes_per_cycle, float(arch.mac_rows + arch.mac_cols)) * arch.clock_hz


def board_pair_bytes_s(arch: SpinnArch) -> float:
    """Data bytes per second between two neighbouring boards, one direction, packet overhead
    paid: the board edge's serial links together (:meth:`SpinnArch.payload_bw` ``"board_pair"``:
    :attr:`~SpinnArch.board_serial_links` x :attr:`~SpinnArch.board_link_bw_bytes_s` x
    :attr:`~SpinnArch.link_payload_fraction`)."""
    return arch.payload_bw("board_pair")


def chip_in_bytes_s(arch: SpinnArch) -> float:
    """Data bytes per second a chip can receive from the other chips of its board, packet
    overhead paid: all its :attr:`~SpinnArch.links_per_chip` links at once
    (:meth:`SpinnArch.payload_bw` ``"chip"`` each). A hand-over from one chip to another may be
    split over routes through other chips, but every byte enters the receiver by one of them."""
    return arch.links_per_chip * arch.payload_bw("chip")


def chip_capacity_bytes(arch: SpinnArch) -> int:
    """Bytes one chip can hold: its DRAM and the SRAM its PEs leave to data."""
    return arch.dram_bytes + arch.pes_per_chip * arch.tile_sram_bytes


def board_capacity_bytes(arch: SpinnArch) -> int:
    """Bytes one board (or the whole system, when it is part of one board) can hold: every
    chip's DRAM and the SRAM its PEs leave to data."""
    chips = min(arch.chips, arch.chips_per_board)
    return chips * (arch.dram_bytes + arch.pes_per_chip * arch.tile_sram_bytes)


# ----------------------------------------------------------------------------- the bound
def _live_per_board(arch: SpinnArch) -> np.ndarray:
    """Cumulative live chips of the usable boards, the boards with the most live chips first:
    entry ``k - 1`` is the most chips ``k`` boards have (a system with faults or a partial
    allocation counts its live hardware only: :mod:`tvm_spinn.target.faults`)."""
    cpb = min(arch.chips, arch.chips_per_board)
    if not arch.has_faults:
        return cpb * np.arange(1, arch.boards + 1, dtype=np.int64)
    # the live chips of tvm_spinn.target.faults.live_chips, from the fields alone (timing does not
    # import the target package; a system whose faults cut live chips apart is refused there)
    board = np.arange(arch.chips, dtype=np.int64) // arch.chips_per_board
    live = ~np.isin(np.arange(arch.chips), list(arch.dead_chips)) & ~np.isin(board, list(arch.dead_boards))
    if arch.allocated_boards:
        live &= np.isin(board, list(arch.allocated_boards))
    counts = np.bincount(board[live])
    return np.cumsum(np.sort(counts[counts > 0])[::-1])


def _boards_holding(live: np.ndarray, chips: int) -> int:
    """The fewest boards with ``chips`` live chips (``live`` from :func:`_live_per_board`)."""
    return int(np.searchsorted(live, chips, side="left")) + 1


def _memory_s(nbytes: float, sram_bytes: float, sram_bw: float, dram_bw: float) -> float:
    """Least time to read ``nbytes`` placed in SRAM (at most ``sram_bytes``, at ``sram_bw``) and
    DRAM (at ``dram_bw``), both read at once: the best split puts ``nbytes * sram_bw / (sram_bw
    + dram_bw)`` in SRAM when that fits, else fills the SRAM."""
    if nbytes <= 0:
        return 0.0
    return max(nbytes / (sram_bw + dram_bw), (nbytes - sram_bytes) / dram_bw)


def _alternating_s(crossings: int, carrying: float, hop: float) -> float:
    """``crossings`` in series of which every other one (``floor(crossings / 2)``) carries half
    a row (``carrying`` seconds) and the rest at least their ``hop`` (module docstring)."""
    return (crossings // 2) * carrying + (crossings - crossings // 2) * hop


def _split_bound(work: Workload, arch: SpinnArch, compute: float, memory_on, least_chips: int,
                 least_boards: int, row: int) -> dict:
    """The bound of placements that split phases over chips (module docstring): ``max`` of
    compute, ``min over n of max(memory(n), crossings(c(n)))`` over chips and the same over
    boards, ``c(n) = max(min(n - 1, 1), min(n - 2, S' - 1))``, ``S' = min(S, floor(R / rho))``."""
    rho = work.largest_phase_bytes or work.read_bytes
    syncs = min(work.sync_points, work.read_bytes // rho) if rho else work.sync_points
    live = _live_per_board(arch)
    half = row / 2 / chip_in_bytes_s(arch)  # half a row into a chip: every byte enters by its links
    levels = {
        # chips: hops between chips of a board (the cheapest crossing); boards: the board edge's hop
        "chip": (int(live[-1]), lambda u: u, least_chips if rho <= chip_capacity_bytes(arch) else 1, arch.link_hop_s),
        "board": (live.size, lambda u: int(live[u - 1]),
                  least_boards if rho <= int(live[0]) * chip_capacity_bytes(arch) else 1, arch.board_link_hop_s),
    }
    out = {}
    for level, (units, chips_of, first, hop) in levels.items():
        best = None
        # past S' + 1 units the crossings stay at S' and the memory only falls: try the last too
        candidates = list(range(first, min(units, syncs + 1) + 1)) + [units]
        for u in candidates:
            if u < first:
                continue
            memory = memory_on(chips_of(u))
            c = max(min(u - 1, 1), min(u - 2, syncs - 1)) if work.handover_bytes else 0
            comm = _alternating_s(c, hop + half, hop)
            if best is None or max(memory, comm) < best[0]:
                best = (max(memory, comm), u, memory, comm, c)
        out[level] = best
    level = max(out, key=lambda key: out[key][0])
    value, u, memory, comm, c = out[level]
    chips = int(live[u - 1]) if level == "board" else u
    return {"total": max(compute, value), "binding_level": level, "chips": chips,
            "boards": _boards_holding(live, chips),
            "memory": memory, "communication": comm, "sync_points_counted": syncs,
            "chip_crossings": out["chip"][4], "board_crossings": out["board"][4],
            "chip_level_s": out["chip"][0], "board_level_s": out["board"][0]}


def physical_bound(work: Workload, arch: SpinnArch) -> PhysicalBound:
    """The physical lower bound of ``work`` on the system ``arch`` (see the module docstring).

    Parameters
    ----------
    work : Workload
        The step's MACs, bytes it must read and smallest hand-over.
    arch : SpinnArch
        The system (only its fields are read).

    Returns
    -------
    PhysicalBound
    """
    live = _live_per_board(arch)  # the live hardware only: a dead chip neither computes nor holds bytes
    chips_live = int(live[-1])
    pes = chips_live * arch.pes_per_chip
    compute = (work.macs_int8 / (pes * arch.macs_per_cycle * arch.clock_hz)
               + work.macs_fp32 / (pes * arch.m4f_flops_per_cycle * arch.clock_hz))
    sram_c = arch.pes_per_chip * arch.tile_sram_bytes
    sram_bw_c = arch.pes_per_chip * sram_read_bytes_s(arch)
    dram_bw_c = arch.dram_bw_bytes_s
    # the fewest boards whose live chips hold the bytes (the boards with the most live chips first)
    least = max(1, _boards_holding(live, math.ceil(work.read_bytes / chip_capacity_bytes(arch))))
    if least > live.size:
        raise ValueError(f"the step reads {work.read_bytes} bytes, more than the {live.size} board(s) of "
                         f"{arch.name} can hold ({chips_live * chip_capacity_bytes(arch)} bytes)")
    least_chips = max(1, math.ceil(work.read_bytes / chip_capacity_bytes(arch)))
    pair_bw, chip_bw = board_pair_bytes_s(arch), chip_in_bytes_s(arch)
    row = -(-work.handover_bytes // work.handover_rows)  # the part every crossing waits for
    board_crossing = arch.board_link_hop_s + row / pair_bw
    chip_crossing = arch.link_hop_s + row / chip_bw

    def communication(n: int, k: int) -> float:
        if n <= 1 or work.handover_bytes == 0:  # a single layer: nothing crosses in series
            return 0.0
        # the rest of the hand-over streams behind its first row through the slowest crossing
        rest = (work.handover_bytes - row) / (pair_bw if k > 1 else chip_bw)
        return (k - 1) * board_crossing + (n - k) * chip_crossing + rest

    def memory_on(n: int) -> float:
        return _memory_s(work.read_bytes, n * sram_c, n * sram_bw_c, n * dram_bw_c)

    best = None  # the chain placements
    for n in range(least_chips, chips_live + 1):
        k = _boards_holding(live, n)
        memory = memory_on(n)
        comm = communication(n, k)
        total = max(compute, memory, comm)
        if best is None or total < best[0]:
            best = (total, n, k, memory, comm)
        if comm >= memory:  # more chips only add crossings
            break
    split = _split_bound(work, arch, compute, memory_on, least_chips, least, row)
    placement = "chain" if best[0] <= split["total"] else "split"
    if placement == "chain":
        total, n, k, memory, comm = best
    else:
        total, n, k, memory, comm = (split[key] for key in ("total", "chips", "boards", "memory", "communication"))
    parts = {"compute": compute, "memory": memory, "communication": comm}
    binding = max(KINDS, key=lambda kind: parts[kind])
    details = {
        "placement": placement, "chips_on_path": n, "boards_on_path": k, "least_chips": least_chips,
        "least_boards": least,
        "board_crossings": k - 1 if placement == "chain" else split["board_crossings"],
        "chip_crossings": max(0, n - k) if placement == "chain" else split["chip_crossings"],
        "board_crossing_s": board_crossing if k > 1 else 0.0,
        "chip_crossing_s": chip_crossing if n > k else 0.0,
        "chain_bound_s": best[0], "split_bound_s": split["total"], "split": split,
        "chain": {"total_s": best[0], "chips": best[1], "boards": best[2], "memory_s": best[3],
                  "communication_s": best[4], "board_crossings": best[2] - 1, "chip_crossings": best[1] - best[2]},
        "handover_bytes": work.handover_bytes, "handover_rows": work.handover_rows,
        "sync_points": work.sync_points, "read_bytes": work.read_bytes, "sram_bytes_on_path": n * sram_c,
        "sram_read_bytes_s_per_pe": sram_read_bytes_s(arch), "dram_bytes_s_on_path": n * dram_bw_c,
        "board_pair_bytes_s": pair_bw, "chip_in_bytes_s": chip_bw,
        "macs_int8": work.macs_int8, "macs_fp32": work.macs_fp32,
        **({"workload": dict(work.description)} if work.description else {}),
        **({"live_chips": chips_live, "usable_boards": int(live.size)} if arch.has_faults else {}),
    }
    return PhysicalBound(compute, memory, comm, total, binding, details)


# ----------------------------------------------------------------------------- workloads
def gathered_bytes(program) -> dict[int, int]:
    """``{table tensor: bytes}`` a step must read of each constant table used only by gathers
    (``take``, an embedding): the rows gathered (the gathers' outputs), at most the table."""
    read: dict[int, int] = {}
    other: set[int] = set()
    for layer in program.layers:
        table = family_of(layer.kind).gathered_table(layer)
        for tid in list(layer.consts.values()) + list(layer.inputs):
            if tid != table:
                other.add(tid)
        if table is not None:
            read[table] = read.get(table, 0) + program.tensors[layer.output].nbytes
    return {tid: min(n, program.tensors[tid].nbytes) for tid, n in read.items() if tid not in other}


def _smallest_cut(program) -> int | None:
    """Bytes of the smallest set of activations live across a boundary between two layers of
    ``program`` (produced at or before it, read after it or returned), or of its outputs."""
    n = len(program.layers)
    last_use: dict[int, int] = {}
    for i, layer in enumerate(program.layers):
        for t in layer.inputs:
            last_use[t] = i
    for t in program.outputs:
        last_use[t] = n
    produced = {layer.output: i for i, layer in enumerate(program.layers)}
    best = sum(program.tensors[t].nbytes for t in program.outputs) if program.outputs else None
    live = np.zeros(n + 1, dtype=np.int64)  # live[i]: across the boundary after layer i
    for t, i in produced.items():
        end = last_use.get(t, i)
        if end > i:
            live[i:end] += program.tensors[t].nbytes
    if n > 1:
        inner = int(live[:n - 1].min())
        best = inner if best is None else min(best, inner)
    return best


def program_workload(programs) -> Workload:
    """The :class:`Workload` of the offloaded programs of a build (run one after another).

    MACs: ``flops / 2`` of the GEMM layers (those with a ``gemm`` shape), by mode. Bytes read:
    every constant a layer uses (a table only gathered from: the rows gathered,
    :func:`gathered_bytes`) and every program's inputs, once (an input of the same name, shape
    and dtype in two programs is one tensor), except those of programs that only move data
    (reshape, concat...: the KV cache copied into the returned cache, which the attention
    programs read already). Hand-over: the smallest live set of
    activations at a boundary between two layers or at a program's outputs, in rows of a byte
    (which rows of a program's layers may stream is not derived: a byte is the least). Sync
    points: 1, the output (which of a program's layers need a whole row is not derived: one is
    the fewest), the whole step one stretch."""
    macs = {"int8": 0, "fp32": 0}
    const_bytes = input_bytes = 0
    cuts = []
    seen = set()  # inputs by (name, shape, dtype): a tensor two programs read (a KV cache) counts once
    for p in programs:
        for layer in p.layers:
            if layer.gemm is not None:
                macs["int8" if layer.mode == "int8" else "fp32"] += int(layer.flops) // 2
        gathered = gathered_bytes(p)
        used = sorted({t for layer in p.layers for t in (*layer.inputs, *layer.consts.values())
                       if p.tensors[t].role == "const"})
        const_bytes += sum(gathered.get(t, p.tensors[t].nbytes) for t in used)
        if all(family_of(layer.kind).moves_data for layer in p.layers):
            continue  # a copy (a reshape or concat of a cache into the returned one): no work reads it
        for t in p.inputs:
            key = (p.tensors[t].name, tuple(p.tensors[t].shape), p.tensors[t].dtype)
            if key not in seen:
                seen.add(key)
                input_bytes += p.tensors[t].nbytes
        cut = _smallest_cut(p)
        if cut is not None:
            cuts.append(cut)
    handover = min(cuts) if cuts else 0
    return Workload(macs_int8=macs["int8"], macs_fp32=macs["fp32"], read_bytes=const_bytes + input_bytes,
                    handover_bytes=handover, handover_rows=max(1, handover), sync_points=1,
                    description={"constant_bytes": const_bytes, "input_bytes": input_bytes,
                                 "programs": len(programs)})


def decode_workload(spec, batch: int, context: int, dtype: str, handover_itemsize: int = 4) -> Workload:
    """One decode step of a decoder-only transformer: every user's token through every block
    and the LM head, attending over a ``context``-slot KV cache.

    Parameters
    ----------
    spec
        The model's sizes (attributes ``family`` (``"gpt2"`` / ``"llama"``), ``layers``,
        ``hidden``, ``heads``, ``kv_heads``, ``head_dim``, ``intermediate``, ``vocab``,
        ``max_positions``, ``tied_embeddings``, ``params``), e.g. a
        :class:`tvm_spinn.llm.ModelSpec`.
    batch : int
        Users decoding together (one token each).
    context : int
        KV-cache slots each token attends over.
    dtype : {"int8", "fp32"}
        Storage and arithmetic of the weight GEMMs; the attention and the KV cache are fp32.
    handover_itemsize : int
        Bytes per element of the residual stream handed between boards: 4 (fp32) keeps the bits
        of the one-chip program; a build that allows narrower hand-overs may pass less.

    Returns
    -------
    Workload
        MACs: the weight GEMMs (``dtype``) and the attention's two matmuls (fp32). Bytes read:
        every GEMM weight (of a mixture of experts, the experts the batch's tokens can pick:
        ``min(experts, batch x experts_per_token)`` per block), the vectors (norm scales, biases; fp32), the embedding rows the batch
        gathers (a tied table is read whole as the LM head), and the KV cache. Hand-over: the
        batch's residual stream, a row per user. Sync points: the two norms of every block
        (each needs the whole residual row) and the final norm (``2 layers + 1``; the output's
        arg-max would be one more, not counted). Largest stretch: the largest of a block's
        attention half (with its layer's KV slots), its MLP half and the LM head, plus every
        vector and gathered row.
    """
    itemsize = {"int8": 1, "fp32": 4}[dtype]
    h, i, v = spec.hidden, spec.intermediate, spec.vocab
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    mlp = 3 if spec.family == "llama" else 2
    # a mixture of experts: each token runs its router and k experts, the batch reads the
    # experts its tokens pick (at most batch x k of them)
    n_experts = getattr(spec, "experts", 0)
    experts, k = max(1, n_experts), max(1, getattr(spec, "experts_per_token", 0))
    read_experts = min(experts, batch * k)
    router = n_experts * h
    block = h * (q + 2 * kv) + q * h + mlp * h * i * k + router
    gemm = spec.layers * block + v * h  # every block and the LM head (a token's MACs)
    stored = spec.layers * (h * (q + 2 * kv) + q * h + mlp * h * i * experts + router) + v * h
    tables = (0 if spec.tied_embeddings else v * h) + (spec.max_positions * h if spec.family == "gpt2" else 0)
    vectors = spec.params - stored - tables
    read_gemm = spec.layers * (h * (q + 2 * kv) + q * h + mlp * h * i * read_experts + router) + v * h
    rows = batch * h * ((0 if spec.tied_embeddings else 1) + (1 if spec.family == "gpt2" else 0))
    kv_cache = batch * context * 2 * spec.layers * kv * 4
    attention = batch * spec.layers * 2 * spec.heads * spec.head_dim * context
    weights = read_gemm * itemsize + vectors * 4 + rows * itemsize
    # the stretches between norms: a block's attention half (its GEMMs and its layer's KV slots),
    # its MLP half, the LM head; every vector and gathered row added to the largest keeps it an
    # upper bound on what any one stretch reads
    largest = (max(h * (q + 2 * kv) + q * h, mlp * h * i * read_experts + router, v * h) * itemsize
               + (kv_cache // spec.layers if spec.layers else 0) + vectors * 4 + rows * itemsize)
    return Workload(macs_int8=batch * gemm if dtype == "int8" else 0,
                    macs_fp32=attention + (batch * gemm if dtype == "fp32" else 0),
                    read_bytes=weights + kv_cache, handover_bytes=batch * h * handover_itemsize,
                    handover_rows=batch, sync_points=2 * spec.layers + 1,
                    largest_phase_bytes=min(largest, weights + kv_cache),
                    description={"weight_bytes_read": weights, "kv_cache_bytes": kv_cache, "context": context,
                                 "batch": batch, "dtype": dtype, "embedding_rows_bytes": rows * itemsize})
