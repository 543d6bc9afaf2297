"""Physical lower bounds of one inference step that no mapping or plan can move.

Each bound is a closed formula of a plain description of the work (:class:`Workload`: MACs per
arithmetic mode, bytes the step must read at least once, the smallest activation that must
cross between two layers) and of the system's :class:`~tvm_spinn.target.arch.SpinnArch`
fields. Nothing here reads a mapping, a plan, a tile or the timing model: a worse plan of the
same work has the same bound, so ``efficiency = bound / latency`` (at most 1) ranks plans.

Three kinds, each a lower bound on the latency of *any* placement:

* **compute**: the MACs of each mode at the peak of every application PE of the system
  (int8: :attr:`~SpinnArch.macs_per_cycle` a cycle on the MAC array; fp32:
  :attr:`~SpinnArch.m4f_flops_per_cycle` multiply-accumulates a cycle on the M4F);
* **memory**: the bytes the step must read at least once (the weights it touches, the KV
  slots it attends over, the rows a gather takes from an embedding table, never the whole
  table) from where they can live: in SRAM as far as the SRAM of the boards holding them has
  room, read at the SRAM rate, the rest from the DRAM of every chip of those boards, both at
  once (see :func:`sram_read_bytes_s` for the SRAM rate);
* **communication**: when the bytes do not fit one board's memories, a token must pass through
  every board that holds some of them, one after another (the step's layers depend on each
  other in a chain): ``k`` boards cost at least ``k - 1`` serial board-to-board crossings, each
  the board link's hop latency plus the smallest activation that can cross a cut between two
  layers over the links joining two boards at their payload rate (:func:`board_pair_bytes_s`).
  Hand-overs are in the dtype the program's tensors have at that cut (fp32 where the bits must
  equal the one-chip program's).

Spreading the bytes over more boards lowers the memory bound and raises the communication
bound, so the physical bound is ``min over k of max(compute, memory(k), communication(k))``
for ``k`` from the fewest boards whose SRAM and DRAM hold the bytes up to every board of the
system; :attr:`PhysicalBound.binding` names the largest part at that ``k``.

What the bounds do not count (so they stay below every plan): chip-to-chip exchanges inside a
board (the chips of a board may split the work and the bound charges no collective for it),
element-wise work, writes, per-layer fixed costs (barriers, DMA set-up) and program load.
Routes that detour through a third board to widen a hand-over are not considered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..program.ops import family_of
from ..target.arch import SpinnArch

__all__ = ["Workload", "PhysicalBound", "physical_bound", "program_workload", "decode_workload",
           "gathered_bytes", "sram_read_bytes_s", "board_pair_bytes_s", "board_capacity_bytes"]

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
    description : dict
        What the numbers count (shown in reports; not read by the bounds).
    """

    macs_int8: int = 0
    macs_fp32: int = 0
    read_bytes: int = 0
    handover_bytes: int = 0
    description: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("macs_int8", "macs_fp32", "read_bytes", "handover_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"Workload.{name} must be an integer >= 0, got {value!r}")


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
        k = self.details.get("boards_on_path", 1)
        path = f"; {k} boards on a token's path" if k > 1 else ""
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


def board_capacity_bytes(arch: SpinnArch) -> int:
    """Bytes one board (or the whole system, when it is part of one board) can hold: every
    chip's DRAM and the SRAM its PEs leave to data."""
    chips = min(arch.chips, arch.chips_per_board)
    return chips * (arch.dram_bytes + arch.pes_per_chip * arch.tile_sram_bytes)


# ----------------------------------------------------------------------------- the bound
def _memory_s(nbytes: float, sram_bytes: float, sram_bw: float, dram_bw: float) -> float:
    """Least time to read ``nbytes`` placed in SRAM (at most ``sram_bytes``, at ``sram_bw``) and
    DRAM (at ``dram_bw``), both read at once: the best split puts ``nbytes * sram_bw / (sram_bw
    + dram_bw)`` in SRAM when that fits, else fills the SRAM."""
    if nbytes <= 0:
        return 0.0
    return max(nbytes / (sram_bw + dram_bw), (nbytes - sram_bytes) / dram_bw)


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
    pes = arch.total_pes
    compute = (work.macs_int8 / (pes * arch.macs_per_cycle * arch.clock_hz)
               + work.macs_fp32 / (pes * arch.m4f_flops_per_cycle * arch.clock_hz))
    chips_b = min(arch.chips, arch.chips_per_board)
    sram_b = chips_b * arch.pes_per_chip * arch.tile_sram_bytes
    sram_bw_b = chips_b * arch.pes_per_chip * sram_read_bytes_s(arch)
    dram_bw_b = chips_b * arch.dram_bw_bytes_s
    boards = arch.boards
    least = max(1, math.ceil(work.read_bytes / board_capacity_bytes(arch)))
    if least > boards:
        raise ValueError(f"the step reads {work.read_bytes} bytes, more than the {boards} board(s) of "
                         f"{arch.name} can hold ({boards * board_capacity_bytes(arch)} bytes)")
    pair_bw = board_pair_bytes_s(arch)
    crossing = arch.board_link_hop_s + work.handover_bytes / pair_bw
    best = None
    for k in range(least, boards + 1):
        memory = _memory_s(work.read_bytes, k * sram_b, k * sram_bw_b, k * dram_bw_b)
        comm = (k - 1) * crossing
        total = max(compute, memory, comm)
        if best is None or total < best[0]:
            best = (total, k, memory, comm)
        if comm >= memory:  # more boards only add crossings
            break
    total, k, memory, comm = best
    parts = {"compute": compute, "memory": memory, "communication": comm}
    binding = max(KINDS, key=lambda kind: parts[kind])
    details = {
        "boards_on_path": k, "least_boards": least, "board_crossings": k - 1,
        "crossing_s": crossing if k > 1 else 0.0, "handover_bytes": work.handover_bytes,
        "crossing_bytes": (k - 1) * work.handover_bytes,
        "read_bytes": work.read_bytes, "sram_bytes_on_path": k * sram_b,
        "sram_read_bytes_s_per_pe": sram_read_bytes_s(arch), "dram_bytes_s_on_path": k * dram_bw_b,
        "board_pair_bytes_s": pair_bw, "macs_int8": work.macs_int8, "macs_fp32": work.macs_fp32,
        **({"workload": dict(work.description)} if work.description else {}),
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
    activations at a boundary between two layers or at a program's outputs."""
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
    return Workload(macs_int8=macs["int8"], macs_fp32=macs["fp32"], read_bytes=const_bytes + input_bytes,
                    handover_bytes=min(cuts) if cuts else 0,
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
        every GEMM weight, the vectors (norm scales, biases; fp32), the embedding rows the batch
        gathers (a tied table is read whole as the LM head), and the KV cache. Hand-over: the
        batch's residual stream.
    """
    itemsize = {"int8": 1, "fp32": 4}[dtype]
    h, i, v = spec.hidden, spec.intermediate, spec.vocab
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    mlp = 3 if spec.family == "llama" else 2
    block = h * (q + 2 * kv) + q * h + mlp * h * i
    gemm = spec.layers * block + v * h  # every block and the LM head
    tables = (0 if spec.tied_embeddings else v * h) + (spec.max_positions * h if spec.family == "gpt2" else 0)
    vectors = spec.params - gemm - tables
    rows = batch * h * ((0 if spec.tied_embeddings else 1) + (1 if spec.family == "gpt2" else 0))
    kv_cache = batch * context * 2 * spec.layers * kv * 4
    attention = batch * spec.layers * 2 * spec.heads * spec.head_dim * context
    weights = gemm * itemsize + vectors * 4 + rows * itemsize
    return Workload(macs_int8=batch * gemm if dtype == "int8" else 0,
                    macs_fp32=attention + (batch * gemm if dtype == "fp32" else 0),
                    read_bytes=weights + kv_cache, handover_bytes=batch * h * handover_itemsize,
                    description={"weight_bytes_read": weights, "kv_cache_bytes": kv_cache, "context": context,
                                 "batch": batch, "dtype": dtype, "embedding_rows_bytes": rows * itemsize})
