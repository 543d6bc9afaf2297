"""A region over pipeline stages: its layers cut into contiguous stages, each mapped alone on a
whole board of its own.

When no shard plan of one stage holds a region (:func:`.system.map_on_system` finds none that
fits), it is cut into the fewest contiguous stages whose programs, each mapped alone on its own
whole board, fit (:func:`map_pipeline`); the stages take the boards from the build's current
stage (when it holds nothing yet) or the next one, skipping boards with dead chips or links on a
system with faults (:func:`pipeline_boards`). Each stage is mapped as any region is on a whole
board (:func:`map_stages`, through the ``map_region`` callable :func:`.system.map_on_system`
passes in), the sends between stages priced on the link graph
(:func:`tvm_spinn.timing.stages.handover_costs`), and the program carries a
:class:`~tvm_spinn.program.records.PipelineMapping` with its period and latency
(:func:`install_pipeline`). When it opens a board after the build's earlier regions, its inputs
are handed over from their board to its first stage's (:func:`hand_in_cost`,
:func:`handed_in`). When no number of stages holds it, :func:`shortfall` says how many boards it
needs at least.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
import numpy as np

from ..program import Program
from ..program.ops.sharding import Mesh
from ..program.records import PipelineMapping, PipelineStage, PipelineTimingSummary, ProgramMapping, TimingSummary
from ..program.tiles import ProgramTiles
from ..target.arch import FAULT_FIELDS, SpinnArch
from ..target.faults import live_chips, usable_boards, whole_boards
from ..target.topology import topology_of
from ..timing.collectives import point_to_point
from .budget import Shortfall, SystemState
from .memory import activation_label, check_capacity
from .shard import ShardPlan, plan_mesh, stage_programs
from .state import data_bytes, state_copies, state_per_chip, with_streams
from .tiling import MappingError

from ..timing.stages import PipelineTiming, handover_costs, pipeline_timing

__all__ = ["stages_of", "stage_ranks", "pipeline_boards", "shortfall", "map_pipeline", "map_stages", "hand_in_cost",
           "handed_in", "install_pipeline", "pipeline_tables", "stage_programs_of"]


def stages_of(arch: SpinnArch) -> int:
    """Pipeline stages a system offers: its boards (one stage on part of a board); with faults,
    the boards it may use (:func:`tvm_spinn.target.faults.usable_boards`)."""
    if arch.has_faults:
        return len(usable_boards(arch))
    return arch.chips // arch.chips_per_board if arch.chips >= arch.chips_per_board else 1


def stage_ranks(arch: SpinnArch, stage: int, count: int) -> np.ndarray:
    """The first ``count`` chips of pipeline stage ``stage`` (its board's live chips)."""
    if not arch.has_faults:
        return np.arange(count) % arch.chips + (stage * arch.chips_per_board) % arch.chips
    boards = usable_boards(arch)
    return live_chips(arch, boards[stage % len(boards)])[:count]


def pipeline_boards(arch: SpinnArch, start: int) -> list[tuple[int, np.ndarray]]:
    """The boards a region over pipeline stages may take from stage ``start`` on, in stage
    order: ``(stage, chips)`` per board, ``chips`` its chips in mesh position order. Every
    stage is a whole board (all its chips and on-board links working, so every stage has the
    same chips and its mapping is a healthy board's): on a system with faults the usable
    boards with dead hardware are left out. On a system smaller than a board there are none:
    within a board the shard plans already spread a region over every chip, stages there would
    add no memory."""
    per = arch.chips_per_board
    if arch.chips < per:
        return []
    if not arch.has_faults:
        return [(s, stage_ranks(arch, s, per)) for s in range(start, stages_of(arch))]
    whole = set(whole_boards(arch))
    return [(s, live_chips(arch, b)) for s, b in enumerate(usable_boards(arch)) if s >= start and b in whole]


def shortfall(program: Program, arch: SpinnArch, boards: list[tuple[int, np.ndarray]]) -> Shortfall | None:
    """Why ``program`` (a region no board holds) found no pipeline on ``boards``
    (:func:`pipeline_boards`) when more boards would help: the board ids, the boards needed
    at least and its weight bytes (a :class:`~.budget.Shortfall`); None when no number of boards holds it (a layer's weights exceed what a board
    holds, or every cut up to a layer a stage was tried) or the system is smaller than a board.

    The bound is cheap, no imaginary board mapped: the region needs at least 2 stages (no board
    holds it), more than the boards it was tried on, and its weights over what a board's DRAM
    and SRAM hold."""
    per = arch.chips_per_board
    if arch.chips < per or len(program.layers) <= len(boards):
        return None
    board_bytes = per * (arch.dram_bytes + arch.pes_per_chip * arch.tile_sram_bytes)
    layer_bytes = [sum(program.tensors[t].nbytes for t in set(layer.consts.values())) for layer in program.layers]
    if max(layer_bytes) > board_bytes:
        return None
    weights = sum(t.nbytes for t in program.tensors if t.role == "const")
    need = max(2, len(boards) + 1, -(-weights // board_bytes))
    return Shortfall(tuple(int(chips[0]) // per for _, chips in boards), int(need), int(weights))


def map_pipeline(program: Program, arch: SpinnArch, map_region, boards: list[tuple[int, np.ndarray]],
                 hand_in_s: float = 0.0, streams: int = 0) -> tuple[tuple[Program, int, SystemState] | None, str | None]:
    """``program`` over the fewest pipeline stages that hold it, on the first of ``boards``
    (:func:`pipeline_boards`), the stage of its last board and what its last stage holds
    there (a :class:`~.budget.SystemState` of one board); None when no number does, with why
    the most stages tried failed where their stages fitted but not their state's copies (else
    None). ``hand_in_s``: the send handing its inputs in from the region before it (0: none),
    part of the time each input is in flight; ``streams``: the streams its state is kept for
    (0: its own count); ``map_region`` maps one stage's program alone on a board (both as
    :func:`map_stages` takes them).

    The layers are cut into ``pp`` contiguous stages (:func:`.shard.plan_mesh` with a ``pp``
    axis) and mapped by :func:`map_stages`; ``pp`` goes up from 2 until every stage fits (at
    most one stage a board)."""
    why = None
    for pp in range(2, min(len(program.layers), len(boards)) + 1):
        plan = plan_mesh(program, Mesh.of(pp=pp))
        if plan is None:
            continue
        ranks = [r for _, r in boards[:pp]]
        try:
            mapped, timing, held = map_stages(program, plan, arch, map_region, ranks, hand_in_s, streams)
        except _StateCopiesError as err:
            why = str(err)
            continue
        except MappingError:
            why = None
            continue
        return (install_pipeline(program, plan, mapped, ranks, timing, arch), boards[pp - 1][0], held), None
    return None, why


class _StateCopiesError(MappingError):
    """Pipeline stages that fit one input's state but not the copies of the inputs in flight."""


def map_stages(program: Program, plan: ShardPlan, arch: SpinnArch, map_region, ranks, hand_in_s: float = 0.0,
               streams: int = 0) -> tuple[tuple[Program, ...], PipelineTiming, SystemState]:
    """Each stage of ``plan`` (a plan of :func:`.shard.plan_mesh` whose mesh has only a ``pp``
    axis) mapped alone on its own board, and the pipeline's timing.

    Each stage's program (:func:`.shard.stage_programs`: the tensors live across a cut are sent
    whole) is mapped as any region is on a whole board of ``arch`` (its chips ``ranks[s]``, the
    same count for every stage), its shard plan chosen among the board's chips; the sends are
    priced from each stage's first chip to the next's
    (:func:`tvm_spinn.timing.stages.handover_costs`) and the stages and sends composed
    (:func:`tvm_spinn.timing.stages.pipeline_timing`).

    Parameters
    ----------
    program : Program
        The region.
    plan : ShardPlan
        Its cut into stages.
    arch : SpinnArch
        The system.
    map_region : callable
        ``map_region(stage, board)``: a stage's program mapped alone on ``board`` (a whole board
        of ``arch`` as a system of its own), and what it holds there (a
        :class:`~.budget.SystemState`); :func:`.system.map_on_system` with the build's options.
    ranks : sequence of numpy.ndarray
        Per stage, the chips of its board in mesh position order.
    hand_in_s : float
        The send that hands the region's inputs in from the region before it (0: none). An
        input is in flight from that send on, so the region's own count of streams is taken
        over its whole latency, the hand-in included
        (:meth:`~tvm_spinn.timing.stages.PipelineTiming.handed_in`).
    streams : int
        The streams the state is kept for (the build's inputs in flight, :func:`.state.build_flight`);
        0: the region's own count, the inputs its stages, sends and hand-in keep in flight.
        With more than one, each stage's chips hold a copy per stream and exchange the copy
        their memory plan keeps in SRAM on every input (:func:`.state.state_copies`): the stages'
        times include it, and so does the count.

    Returns
    -------
    tuple
        The stages' mapped programs in stage order (each with its streams and their exchange,
        ``mapping.system.streams``), the :class:`~tvm_spinn.timing.stages.PipelineTiming` of
        the stages and cuts (without the hand-in) and what the last stage holds on its board (a
        :class:`~.budget.SystemState`).

    Raises
    ------
    MappingError
        When a stage does not fit its board, or its chips' DRAM does not hold the copies of its
        state that the inputs in flight keep (:attr:`~tvm_spinn.timing.stages.PipelineTiming.in_flight`).
    """
    # a whole board of the system as a system of its own (the same for every stage)
    sub = arch.replace(chips=int(ranks[0].size), **(dict.fromkeys(FAULT_FIELDS, ()) if arch.has_faults else {}))
    mapped, held = [], []
    for stage in stage_programs(program, plan):
        check_capacity(stage, sub)
        shard, after = map_region(stage, sub)
        mapped.append(shard)
        held.append(after)
    sends = handover_costs(topology_of(arch), plan.handovers, plan.stages, [r[:1] for r in ranks])

    def timed(stages):
        return pipeline_timing([p.timing.latency_s for p in stages], sends)

    # Each input in flight is a stream with its own state at every stage: a stage's chips hold
    # that many copies of its state, the one its memory plan keeps in SRAM and the others in DRAM.
    # The stage's own ledger (``after``) already holds one copy's DRAM part (:func:`dram_per_chip`).
    copies = streams or timed(mapped).handed_in(hand_in_s).in_flight
    if not streams and copies > 1:
        # several streams: the stages exchange their SRAM copies (the same time for any count
        # over one), which lengthens the latency the count is taken over
        copies = timed([with_streams(p, 2, sub) for p in mapped]).handed_in(hand_in_s).in_flight
    mapped = [with_streams(p, copies, sub) for p in mapped]
    timing = timed(mapped)
    for k, (shard, after) in enumerate(zip(mapped, held)):
        whole, in_sram = state_per_chip(shard)
        extra, _ = state_copies(shard, copies, sub)
        if extra and after.dram + extra > sub.dram_bytes:
            raise _StateCopiesError(f"stage {k} of {program.symbol}: {copies} inputs in flight keep {copies} copies of its "
                               f"state ({whole} bytes a chip each, {in_sram} of them in SRAM): {after.dram + extra} "
                               f"bytes of DRAM a chip needed, {sub.dram_bytes} available")
        held[k] = replace(after, dram=after.dram + extra)
    return tuple(mapped), timing, held[-1]


def hand_in_cost(program: Program, topo, src: np.ndarray, first: np.ndarray):
    """The hand-over of ``program``'s inputs that a call moves (:func:`.state.data_inputs`: its state
    stays on its stages' chips), whole, from chip ``src[0]`` (the previous region's board) to
    chip ``first[0]`` (its first stage's first chip), as the pipeline's own sends go
    (:func:`tvm_spinn.timing.collectives.point_to_point`)."""
    nbytes = data_bytes(program)
    return point_to_point(topo, np.asarray(src[:1], dtype=np.int64), np.asarray(first[:1], dtype=np.int64),
                          float(nbytes))


def handed_in(program: Program, cost, arch: SpinnArch) -> Program:
    """``program`` (mapped over pipeline stages) with the hand-over of its inputs ``cost``
    (:func:`hand_in_cost`): its latency and energy include it, and the period is the longest
    of the stages, the sends and this hand-over (a link transfer overlaps the stages in steady
    state). The ``timing.pipeline`` record stays the stages' own."""
    nbytes = data_bytes(program)
    t = program.timing
    latency = t.latency_s + cost.seconds
    period = max(t.pipeline.period_s, cost.seconds)
    return replace(program, timing=replace(t, latency_s=latency, cycles=int(round(latency * arch.clock_hz)),
                                           throughput_inf_s=1.0 / period if period > 0 else 0.0,
                                           link_bytes=int(t.link_bytes + nbytes),
                                           energy_j=t.energy_j + nbytes * arch.e_link_byte_j))


def install_pipeline(program: Program, plan: ShardPlan, mapped, ranks, timing, arch: SpinnArch) -> Program:
    """``program`` mapped over the pipeline stages of ``plan``: ``mapped`` each stage's program
    mapped on its chips ``ranks``, ``timing`` the pipeline's
    (:class:`~tvm_spinn.timing.stages.PipelineTiming`). The program carries a
    :class:`~tvm_spinn.program.records.PipelineMapping` (each stage's layers, chips and
    mapping; the sends), its per-layer records are its stages' in layer order, its timing the
    latency of one input and the period (``1 / throughput_inf_s``, ``timing.pipeline``), its
    memory summary that of the stage whose PE peaks highest."""
    starts = [i for i in range(len(plan.stages)) if i == 0 or plan.stages[i] != plan.stages[i - 1]]
    stages, layers, pes, chips, resident, rows, tables = [], [], [], [], [], [], []
    for lo, stage, group in zip(starts, mapped, ranks):
        m = stage.mapping
        group = tuple(int(c) for c in group)
        stages.append(PipelineStage(first_layer=lo, layers=len(stage.layers), chips=group, mapping=m))
        layers += m.layers
        pes += m.pes_per_layer
        chips += m.chips_per_layer
        resident += [lo + i for i in m.resident_layers]
        rows += stage.timing.layers
        tables += [replace(t, layer=lo + i) for i, t in enumerate(stage.tiles.tables)]
    first = mapped[0].mapping
    mapping = ProgramMapping(mode=first.mode, options=first.options, chips_per_layer=tuple(chips),
                             pes_per_layer=tuple(pes), double_buffer=first.double_buffer, layers=tuple(layers),
                             resident_layers=tuple(resident), scheduler=first.scheduler,
                             pipeline=PipelineMapping(stages=tuple(stages), sends=tuple(plan.handovers)))
    sent = sum(h.nbytes for h in timing.handovers)
    parts = [p.timing for p in mapped]
    summary = PipelineTimingSummary(stage_s=timing.stage_s, send_s=tuple(h.seconds for h in timing.handovers),
                                    period_s=timing.period_s, binding=timing.binding, latency_s=timing.latency_s)
    flops = sum(t.flops for t in parts)
    total = TimingSummary(
        cycles=int(round(timing.latency_s * arch.clock_hz)), latency_s=timing.latency_s,
        roofline_s=sum(t.roofline_s for t in parts), throughput_inf_s=timing.throughput_inf_s,
        dram_bytes=sum(t.dram_bytes for t in parts), noc_bytes=sum(t.noc_bytes for t in parts),
        link_bytes=int(sent + sum(t.link_bytes for t in parts)),
        energy_j=sum(t.energy_j for t in parts) + sent * arch.e_link_byte_j,
        pe_utilization=sum(t.pe_utilization * t.flops for t in parts) / flops if flops else 0.0,
        flops=flops, layers=tuple(rows), pipeline=summary)
    # the memory plan of the stage whose PE peaks highest (ranges in the program's layers)
    s = max(range(len(stages)), key=lambda k: (mapped[k].memory.peak_bytes_max, -k))
    mem, lo = mapped[s].memory, stages[s].first_layer
    ranges = tuple(replace(r, first_layer=r.first_layer + lo, last_layer=r.last_layer + lo) for r in mem.ranges)
    ranges = tuple(replace(r, what=activation_label(program, r.first_layer)) if str(r.what).startswith("activation ")
                   else r for r in ranges)
    memory = replace(mem, ranges=ranges, resident_bytes_total=sum(int(p.memory.resident_bytes_total) for p in mapped))
    return replace(program, tiles=ProgramTiles(tables), mapping=mapping, timing=total, memory=memory)


def pipeline_tables(program: Program, arch: SpinnArch, derive):
    """The tiles of a program mapped over pipeline stages: each stage's, on one chip, in layer
    order (``derive`` is :func:`tvm_spinn.mapping.derive_tables`)."""
    pipe = program.mapping.pipeline
    stages = stage_programs_of(program)
    out = []
    for st, prog in zip(pipe.stages, stages):
        tables = derive(prog, arch.replace(chips=1))
        out += [replace(t, layer=st.first_layer + i) for i, t in enumerate(tables)]
    return out


def stage_programs_of(program: Program) -> tuple[Program, ...]:
    """The stage programs of a program mapped over pipeline stages, cut where its
    ``mapping.pipeline`` says (:func:`.shard.stage_programs`), each with its stage's mapping."""
    pipe = program.mapping.pipeline
    stages = tuple(k for k, st in enumerate(pipe.stages) for _ in range(st.layers))
    plan = _StageCut(pp=len(pipe.stages), stages=stages, handovers=pipe.sends)
    return tuple(replace(p, mapping=st.mapping) for p, st in zip(stage_programs(program, plan), pipe.stages))


@dataclass(frozen=True)
class _StageCut:
    """What :func:`.shard.stage_programs` reads of a shard plan: the stages and their sends."""

    pp: int
    stages: tuple[int, ...]
    handovers: tuple
