"""What a region may use of the system: the explicit inputs the system planner hands the mapper.

A region's mapping on a multi-chip system depends on what the build's other regions hold on the
chips: resident weights in the PEs' SRAM, weight shards in the chips' DRAM, the pipeline stage
(board) the build has reached. :func:`.planner.plan_system` decides those for every region of a
build and passes them to the mapper as a :class:`RegionBudget`; the mapper returns the system's
:class:`SystemState` after the region. Both are frozen records: nothing is kept between calls.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SystemState", "RegionBudget", "Shortfall"]


@dataclass(frozen=True)
class Shortfall:
    """Why a region that no board holds found no pipeline stages on the boards left to it.

    Parameters
    ----------
    boards : tuple of int
        The ids of the whole boards that were left to it.
    need : int
        The boards it needs at least (a bound: two, more than the boards it was tried on, and
        its weights over what a board holds); 0 when unknown (its stages fitted the boards but
        not the copies of their state, see ``why``).
    weights : int
        Its weight bytes.
    why : str or None
        Why the most stages tried failed where their stages fitted but not the copies of their
        state (:func:`~.stages.map_stages`); None otherwise.
    """

    boards: tuple[int, ...]
    need: int
    weights: int
    why: str | None = None


@dataclass(frozen=True)
class SystemState:
    """What the regions placed so far hold on the chips of the current pipeline stage.

    Parameters
    ----------
    stage : int
        The pipeline stage (board) the next region starts in; -1 once one region's smallest
        shard does not fit a chip at all.
    sram : tuple of int
        Resident weight bytes per PE of a chip of the stage (the shards are symmetric, so one
        chip stands for all); empty: nothing held.
    dram : int
        Bytes per chip in the stage's DRAM: the streamed weight shards and the state (a KV
        cache) the memory plans do not keep in SRAM, each chip's share under its shard plan.
    weights : int
        Full weight bytes of every region so far (names the smallest system that holds them).
    min_chip_bytes : int
        The largest of the regions' smallest per-chip shards (weights and state).
    overflow : str or None
        The symbol of the first region that did not fit the system.
    shortfall : Shortfall or None
        When that region fitted no board and found no pipeline stages on the whole boards left
        to it: the boards, how many it needs at least and why its stages failed.
    state : int
        Full bytes of the state inputs of every region so far (one copy of each; see
        :func:`~.state.resident_state`).
    """

    stage: int = 0
    sram: tuple[int, ...] = ()
    dram: int = 0
    weights: int = 0
    min_chip_bytes: int = 0
    overflow: str | None = None
    shortfall: Shortfall | None = None
    state: int = 0


@dataclass(frozen=True)
class RegionBudget:
    """The part of the system one region is mapped into, decided by the system planner.

    Parameters
    ----------
    held : SystemState
        What the build's other regions hold on the chips when this region is placed: its
        resident weights get the SRAM they leave, its streamed weight shards and state the DRAM.
    onchip_inputs : tuple of int
        Tensor ids of the region's inputs already in the chips' SRAM when it starts (handed over
        from the previous stage, or produced by an earlier region on the same chips): read over
        the NoC, never from DRAM; and of its outputs it leaves in the chips' SRAM (for a later
        region on the same chips, or the links to send): never written to DRAM.
    streams : int
        The streams the region keeps its state for: the inputs the build keeps in flight, each a
        stream with its own copy of the state (:func:`~.state.build_flight`); 0: the region's
        own count (one on one stage, the inputs its stages keep in flight over pipeline stages).
    """

    held: SystemState = SystemState()
    onchip_inputs: tuple[int, ...] = ()
    streams: int = 0
