"""The system planner: which part of the system each region of a build gets.

A build's regions share the system: the resident weights of one take SRAM the next cannot
use, the streamed weight shards of all of them fill the chips' DRAM, and a region whose shard
no longer fits opens the next pipeline stage (board). :func:`plan_system` decides that for the
whole list of regions and returns it as a :class:`SystemPlan`, a frozen record: per region its
:class:`~.budget.RegionBudget` (what the others hold when it is placed, which inputs are already
on chip), the stage it runs in, its chip group and the SRAM and DRAM bytes it takes, and the
mapped programs (new ones: the regions given are left as they were). Each region is mapped with
its budget passed explicitly (:func:`~.schedule.map_program`), so remapping one region with its
budget reproduces its mapping.

Policies: ``"benefit"`` (the default) places the regions in the order of what keeping their
weights in SRAM saves, decided from the whole set before any is mapped: the regions with the
fewest operations per weight byte (the ones whose time the weight stream bounds) first, then by
symbol. Each one's resident weights get the SRAM the ones before it left, so the plan does not
depend on the order the regions come in. It holds for a build on one stage (board): a build
whose weight shards need more than one stage's DRAM, or a region that does not fit where this
order puts it, is planned ``"in_order"`` instead, the stages following the dataflow order (the
returned plan names the policy used). ``"in_order"`` places the regions one after another
in the order given, on the same chips: each one's resident weights get the SRAM the earlier
ones left. ``"alone"`` gives every region the whole system (e.g. replicas, or a planner
comparing placements region by region); a region that does not fit by itself is an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..program import Program
from ..target.arch import SpinnArch
from .budget import RegionBudget, SystemState
from .memory import LEDGER_RESIDENT_SHARE
from .options import MappingOptions, current_options
from .schedule import MappingMemo, _graph_copy, map_region
from .shard import recorded_plan
from .state import build_flight, chip_bytes, region_streams, resident_state
from .stages import stage_programs_of
from .system import overflow_message
from .tiling import MappingError, program_work

__all__ = ["RegionPlan", "SystemPlan", "plan_system", "resident_capacity", "held_bytes", "POLICIES"]

#: The placement policies :func:`plan_system` knows.
POLICIES = ("benefit", "in_order", "alone")


def resident_capacity(arch: SpinnArch) -> float:
    """SRAM bytes the chips of ``arch`` keep for resident weights (and state) at most: the
    share of every PE's SRAM that the memory plans leave to residents."""
    return LEDGER_RESIDENT_SHARE * arch.chips * arch.pes_per_chip * arch.tile_sram_bytes


@dataclass(frozen=True)
class RegionPlan:
    """One region's part of the system.

    Parameters
    ----------
    symbol : str
        The region's global symbol.
    budget : RegionBudget
        What it was mapped under (pass it to :func:`~.schedule.map_program` to remap it).
    stage : int
        The pipeline stage (board) it runs in (0 off the multi-chip path; the last of its
        stages for a region mapped over pipeline stages).
    chips : int
        The chips of its group (``tp x dp x sp`` of its shard plan; 1 off the multi-chip path;
        the sum of its stages' groups for a region mapped over pipeline stages).
    sram_bytes : tuple of int
        Resident weight bytes per PE of each chip of its group that it adds (over pipeline
        stages: its last stage's, on the board the build continues on).
    dram_bytes : int
        Bytes per chip it keeps in the stage's DRAM: its streamed weight shards and the state
        its memory plan does not keep in SRAM, with the copies of the state its other streams
        keep (over pipeline stages: its last stage's).
    state_bytes : int
        Bytes of the state inputs it reads (held on the chips between calls, such as a KV
        cache: inputs read only as the right operand of ``matmul`` layers), as its shard plan
        holds them: each chip's share summed over the chips of its group, so a state tensor
        the plan keeps on several chips (each slot's keys and values read by several groups
        of chips) counts once per copy; over pipeline stages, each stage's share under its own
        plan. Times the streams it is kept for (:func:`~.state.region_streams`: the inputs the
        build keeps in flight, each a stream with its own state, :func:`~.state.build_flight`).
        This is what the chips reserve for it.
    state_sram_bytes : int
        Of ``state_bytes``, what its memory plan keeps in SRAM (one copy, the running stream's;
        the other streams' copies are in DRAM).
    state_tensor_bytes : int
        The state inputs' own bytes (one copy of each): what a call writes into it is written
        to every copy at once, each by the chip holding it.
    gathered_inputs : tuple of int
        Of the budget's ``onchip_inputs``, those its shard plan reads whole (the others each
        chip reads split, its own share): what arrives split must be all-gathered first.
    """

    symbol: str
    budget: RegionBudget
    stage: int = 0
    chips: int = 1
    sram_bytes: tuple[int, ...] = ()
    dram_bytes: int = 0
    state_bytes: int = 0
    state_sram_bytes: int = 0
    gathered_inputs: tuple[int, ...] = ()
    state_tensor_bytes: int = 0


@dataclass(frozen=True)
class SystemPlan:
    """Every region's part of the system, and what the build holds at its end.

    Parameters
    ----------
    arch : SpinnArch
        The system planned for.
    policy : str
        The placement policy (see :data:`POLICIES`).
    regions : tuple of RegionPlan
        One per region, in the order given.
    final : SystemState
        What the regions hold after the last one (its ``overflow`` names the first region that
        did not fit; ``weights`` the model's weight bytes).
    programs : tuple of Program
        The mapped regions, one per region in the order given (new programs).
    """

    arch: SpinnArch
    policy: str
    regions: tuple[RegionPlan, ...]
    final: SystemState
    programs: tuple[Program, ...] = field(default=(), compare=False, repr=False)

    @property
    def stages(self) -> int:
        """The pipeline stages (boards) the regions use."""
        return 1 + max((r.stage for r in self.regions), default=0)


def _delta(before: SystemState, after: SystemState) -> tuple[tuple[int, ...], int]:
    """``(SRAM per PE, DRAM)`` a region added to the system's state."""
    if after.stage != before.stage or not before.sram:
        return after.sram, after.dram
    return tuple(a - b for a, b in zip(after.sram, before.sram)), after.dram - before.dram


def _region(program: Program, budget: RegionBudget, onchip: tuple, stage: int = 0, sram=(), dram: int = 0) -> RegionPlan:
    """The :class:`RegionPlan` of a mapped ``program``."""
    every = resident_state(program, range(len(program.layers)))
    kept = resident_state(program, program.mapping.resident_layers)
    gathered = tuple(t for t in onchip if t in program.inputs)  # (not the outputs it leaves on chip)
    system = program.mapping.system
    if onchip and system is not None:
        local = recorded_plan(program).shapes
        gathered = tuple(t for t in gathered if tuple(local[t]) == tuple(program.tensors[t].shape))
    # each input in flight is a stream with a copy of the state: one copy where the memory plans
    # keep it in SRAM, the others in DRAM
    copies = region_streams(program)
    return RegionPlan(program.symbol, budget, stage, _chips(program), tuple(sram), int(dram),
                      copies * held_bytes(program, every), held_bytes(program, kept), gathered,
                      sum(program.tensors[t].nbytes for t in every))


def held_bytes(program: Program, tensors) -> int:
    """Bytes of ``tensors`` (ids of ``program``) the chips of a mapped ``program`` hold, summed
    over them.

    Under a shard plan each chip holds its share of a tensor (the plan's local shape): a tensor
    split over some of the group's chips and repeated over the others is held once per copy, a
    tensor kept whole on every chip once per chip. On one chip, the tensors' own bytes. Over
    pipeline stages, what each stage reading a tensor holds of it under its own shard plan
    (one input's: the copies of the inputs in flight are the caller's to count).

    Parameters
    ----------
    program : Program
        A mapped program.
    tensors : iterable of int
        Tensor ids of ``program``.

    Returns
    -------
    int
    """
    tensors = sorted(int(t) for t in tensors)
    if program.mapping.pipeline is not None:
        names = {program.tensors[t].name for t in tensors}
        return sum(held_bytes(st, [i for i, x in enumerate(st.tensors) if x.name in names])
                   for st in stage_programs_of(program))
    system = program.mapping.system
    return chip_bytes(program, tensors) * (int(system.chips) if system is not None else 1)


def _chips(program: Program) -> int:
    """The chips a mapped ``program`` computes on: its shard plan's group, the sum of its
    stages' groups over pipeline stages, 1 on one chip."""
    pipe = program.mapping.pipeline
    if pipe is not None:
        return sum(int(st.mapping.system.chips) if st.mapping.system is not None else 1 for st in pipe.stages)
    system = program.mapping.system
    return int(system.chips) if system is not None else 1


def _benefit_order(programs: Sequence[Program], arch: SpinnArch) -> list[int]:
    """The regions' indices, those that gain most from resident weights first: ascending
    operations per weight byte (a region with few is bound by its weight stream), then symbol."""
    keys = []
    for index, program in enumerate(programs):
        program = program_work(program, arch)
        weights = sum(t.nbytes for t in program.tensors if t.role == "const")
        flops = sum(int(layer.flops) for layer in program.layers)
        keys.append((flops / weights if weights else math.inf, program.symbol, index))
    return [k[-1] for k in sorted(keys)]


def plan_system(programs: Sequence[Program], arch: SpinnArch, options: MappingOptions | None = None, *,
                onchip_inputs: Sequence[Sequence[int]] | None = None, policy: str = "benefit",
                on_mapped: Callable[[int, Program], None] | None = None,
                memo: MappingMemo | None = None) -> SystemPlan:
    """Plan the system for the regions of one build, and map each region under its budget.

    A stream of inputs goes through every region in turn while the boards overlap: where the
    build keeps several inputs in flight (:func:`~.state.build_flight`) and a region has
    state, the region holds a copy of it per stream and exchanges its SRAM copy on every input.
    The regions are mapped for their own count first; when a region with state holds copies
    for another count than the build's, every region is mapped again with the build's
    (``RegionBudget.streams``), until every one holds enough (the count only grows). Under
    ``"alone"`` the regions are no build: each keeps its own count.

    Parameters
    ----------
    programs : sequence of Program
        The build's lowered regions; they are left as they were (the plan holds the mapped
        ones).
    arch : SpinnArch
        The system.
    options : MappingOptions, optional
        Mapping options (default: the current ones).
    onchip_inputs : sequence of sequences of int, optional
        Per region, the tensor ids of its inputs already in the chips' SRAM when it starts, and
        of its outputs it leaves there (:attr:`~.budget.RegionBudget.onchip_inputs`).
    policy : str
        How the regions share the system (see :data:`POLICIES`).
    on_mapped : callable, optional
        Called with ``(index, mapped program)`` once each region is mapped (e.g. to serialize it while
        the next one is mapped); called again for a region mapped again (when ``"benefit"``
        falls back to ``"in_order"``, or when the mapped build keeps more streams in flight
        than a region holds copies of its state for and every region is mapped again for the
        build's stream count, :func:`~.state.build_flight`): the last call holds. Under
        ``"benefit"`` the calls come in the planner's order, not the index order.
    memo : MappingMemo, optional
        The mappings to reuse and add to (default: a fresh one for this call). A mapping is
        keyed by everything it reads (the program's structure with the system and the options,
        and the budget it is mapped under), so a caller planning many builds of the same
        programs (the LLM planner's stages) shares one across them. Not used under ``"alone"``.

    Returns
    -------
    SystemPlan
        The plan and the mapped programs (``programs``); programs of the same structure under
        the same budget share one mapping.

    Raises
    ------
    MappingError
        When the regions together do not fit the system: the message names the model's weight
        bytes and the smallest system that holds it.
    """
    if policy not in POLICIES:
        raise ValueError(f"plan_system: unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    if onchip_inputs is not None and len(onchip_inputs) != len(programs):
        raise ValueError(f"plan_system: {len(onchip_inputs)} onchip_inputs lists for {len(programs)} programs")
    programs = [_graph_copy(p) for p in programs]
    plan = _plan_system(programs, arch, options, onchip_inputs, policy, on_mapped, memo=memo)
    streams = 0
    while policy != "alone":
        need = _build_streams(plan)
        if need is None or need <= streams:
            return plan
        # the build keeps more streams in flight than a region holds copies of its state for:
        # map every region again, its state kept for the build's streams (the exchange of the
        # SRAM copies then lengthens the stream: the count only grows, up to the build's parts)
        streams = need
        plan = _plan_system(programs, arch, options, onchip_inputs, policy, on_mapped, streams, memo)
    return plan


def _build_streams(plan: SystemPlan) -> int | None:
    """The streams a mapped build keeps in flight (:func:`~.state.build_flight`) when a region
    with state holds copies for another count; None when every region with state holds them
    for the build's count, or none has state."""
    stateful = [p for p, r in zip(plan.programs, plan.regions) if r.state_tensor_bytes]
    if not stateful or plan.arch.chips <= 1:
        return None
    need = build_flight(plan.programs, plan.arch).in_flight
    return None if all(region_streams(p) == need for p in stateful) else need


def _plan_system(programs: list[Program], arch: SpinnArch, options: MappingOptions | None,
                 onchip_inputs: Sequence[Sequence[int]] | None, policy: str,
                 on_mapped: Callable[[int, Program], None] | None, streams: int = 0,
                 memo: MappingMemo | None = None) -> SystemPlan:
    """:func:`plan_system` over ``programs`` (unmapped), the regions' state kept for
    ``streams`` streams (0: each region's own count); ``memo``: the caller's mappings (see
    :func:`plan_system`)."""
    options = options or current_options()
    memo = None if policy == "alone" else MappingMemo() if memo is None else memo
    # the regions share the chips only on the multi-chip path (see .schedule.map_region)
    shared = arch.chips > 1 and not options.naive and options.mode in ("auto", "sequential")
    by_benefit = policy == "benefit" and shared
    if by_benefit:  # the mapper keys structures by the layers with their work (see _benefit_order)
        programs = [program_work(p, arch) for p in programs]
    order = _benefit_order(programs, arch) if by_benefit else range(len(programs))
    state = SystemState()
    regions = {}
    mapped = list(programs)
    for index in order:
        program = programs[index]
        onchip = tuple(int(t) for t in onchip_inputs[index]) if onchip_inputs is not None else ()
        held = state if policy != "alone" else None
        if by_benefit:
            try:
                program, after = map_region(program, arch, options, held, memo, onchip, streams)
            except MappingError:
                after = None
            if after is None or after.stage != state.stage or after.overflow is not None:
                return _plan_system(programs, arch, options, onchip_inputs, "in_order", on_mapped, streams, memo)
        else:
            program, after = map_region(program, arch, options, held, memo, onchip, streams)
        if after is None:  # off the multi-chip path: the region shares nothing
            regions[index] = _region(program, RegionBudget(onchip_inputs=onchip, streams=streams), onchip)
        else:
            before = held or SystemState()
            sram, dram = _delta(before, after)
            regions[index] = _region(program, RegionBudget(held=before, onchip_inputs=onchip, streams=streams), onchip,
                                     max(after.stage, 0), sram, dram)
            if held is not None:
                state = after
        mapped[index] = program
        if on_mapped is not None:
            on_mapped(index, program)
    if state.overflow is not None:
        raise MappingError(overflow_message(state, arch))
    return SystemPlan(arch, policy, tuple(regions[i] for i in range(len(programs))), state, tuple(mapped))
