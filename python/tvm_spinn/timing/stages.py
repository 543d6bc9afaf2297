"""Timing of a pipeline of stages: the sends between them, the period and the latency.

A shard plan with a pipeline axis (``pp``, :func:`tvm_spinn.mapping.shard.plan_mesh`) cuts the
layers into contiguous stages, each on its own chips, and hands the tensors live across each
cut over point to point (:attr:`~tvm_spinn.mapping.shard.ShardPlan.handovers`): the chip at
each mesh position of the sending stage to the chip at the same position of the receiving
stage. The sends of one cut leave together when the sending stage ends, one message per chip
pair of all the cut's tensors (one hop latency per route, not one per tensor), and are priced
on the links they cross, contention included
(:func:`tvm_spinn.timing.collectives.point_to_point`).

One input goes through every stage and every cut in turn, so the pipeline's latency is the
sum of the stages' latencies and the cuts' send times. In steady state (a stream of inputs)
every stage works on its own input: a stage computes input ``k + 1`` while its links send
input ``k`` on (the links are not the PEs), so one input leaves every *period*, the longest
of the stages and the sends. Keeping that pace takes :func:`inputs_in_flight` inputs in the
pipeline at once; where they carry state (a KV cache, a recurrent state: each input a stream
of its own, whose next input enters only once its last one has left), every stage holds that
many copies of its state, and a stage that keeps its state in SRAM exchanges one stream's copy
for the next one's through its DRAM on every input (:func:`state_exchange_s`).

Like :mod:`.collectives`, this module takes the link graph as an argument (a
:class:`~tvm_spinn.target.topology.Topology`) and imports no target module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .collectives import point_to_point

__all__ = ["HandoverCost", "PipelineTiming", "handover_costs", "pipeline_timing", "inputs_in_flight",
           "state_exchange_s"]


@dataclass(frozen=True)
class HandoverCost:
    """The sends of one cut: before layer ``layer``, from stage ``stage - 1`` to stage
    ``stage``, the tensors ``tensors`` as one message of ``nbytes`` from each chip of the
    sending stage to the chip of the same position in the receiving one; ``seconds`` until
    the last byte arrives, ``hops`` and ``board_hops`` of the longest route."""

    layer: int
    stage: int
    tensors: tuple[int, ...]
    nbytes: int
    seconds: float
    hops: int
    board_hops: int


@dataclass(frozen=True)
class PipelineTiming:
    """A pipeline's timing: each stage's latency (``stage_s``), each cut's sends
    (``handovers``, in cut order), the steady-state ``period_s`` (one input leaves every
    period: the longest stage or send), what binds it (``"stage <s>"`` or ``"send <layer>"``)
    and the ``latency_s`` of one input through every stage and cut."""

    stage_s: tuple[float, ...]
    handovers: tuple[HandoverCost, ...]
    period_s: float
    binding: str
    latency_s: float

    @property
    def throughput_inf_s(self) -> float:
        """Inputs per second in steady state (``1 / period_s``)."""
        return 1.0 / self.period_s if self.period_s > 0 else 0.0

    @property
    def in_flight(self) -> int:
        """Inputs in the pipeline at once in steady state (:func:`inputs_in_flight` of its
        latency and period); 1 for a period of 0: stages and sends that take no time (layers
        of no work) keep no input waiting behind another, yet each stage holds the state of
        the one it computes."""
        return inputs_in_flight(self.latency_s, self.period_s) if self.period_s > 0 else 1

    def handed_in(self, seconds: float) -> "PipelineTiming":
        """This pipeline behind a send of ``seconds`` that hands its inputs in (from the chips
        of the region before it): one input's latency includes the send, and the period is the
        longest of the stages, the sends and it (a link transfer overlaps the stages in steady
        state, as the cuts' sends do; ``binding`` ``"hand-in"`` where it binds). The
        ``handovers`` stay the cuts' own.

        Parameters
        ----------
        seconds : float
            The hand-in's time, finite and >= 0 (0: no hand-in, the pipeline itself).

        Returns
        -------
        PipelineTiming

        Raises
        ------
        ValueError
            When ``seconds`` is negative or not finite.
        """
        seconds = float(seconds)
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"PipelineTiming.handed_in: expected a finite time >= 0, got {seconds!r}")
        if seconds == 0:
            return self
        binding = "hand-in" if seconds > self.period_s else self.binding
        return PipelineTiming(self.stage_s, self.handovers, max(self.period_s, seconds), binding,
                              self.latency_s + seconds)


def inputs_in_flight(latency_s: float, period_s: float) -> int:
    """Inputs a pipeline keeps in flight at once in steady state: one enters every ``period_s``
    and each stays ``latency_s``, so ``ceil(latency_s / period_s)`` (Little's law; at least 1).

    Where the inputs carry state between calls (a KV cache, a recurrent state), each is a stream
    of its own: a stream's next input enters only once its last one has left, so keeping the
    period takes this many streams, and every stage holds this many copies of its state. A
    stream goes through every region of a build in turn, so the count that sets the copies is
    the build's: its latency and period over all its regions, boards and links
    (:func:`tvm_spinn.mapping.state.build_flight`).

    Parameters
    ----------
    latency_s : float
        One input's time through every stage and send.
    period_s : float
        The steady-state period (the longest stage or send).

    Returns
    -------
    int

    Raises
    ------
    ValueError
        When a time is not finite and positive, or the period exceeds the latency.
    """
    if not (math.isfinite(latency_s) and math.isfinite(period_s) and 0 < period_s <= latency_s):
        raise ValueError(f"inputs_in_flight: expected 0 < period_s <= latency_s, both finite; got period "
                         f"{period_s!r} s, latency {latency_s!r} s")
    # a latency that is a whole number of periods but for the sums' rounding keeps that number
    return max(1, math.ceil(round(latency_s / period_s, 9)))


def state_exchange_s(nbytes: int, dram_bw_bytes_s: float) -> float:
    """Time a chip takes to exchange the stream whose state it keeps in SRAM for the next one's,
    where several streams are in flight: the leaving stream's copy (``nbytes``, the SRAM copy is
    its only one) written to the chip's DRAM, then the next stream's read from it, ``2 * nbytes``
    through the chip's one DRAM port at ``dram_bw_bytes_s``. It runs between two inputs: the
    SRAM holds one copy, so the next one's cannot arrive while the last one is read.

    Parameters
    ----------
    nbytes : int
        The state bytes the chip keeps in SRAM (>= 0).
    dram_bw_bytes_s : float
        The chip's DRAM bandwidth (> 0, finite).

    Returns
    -------
    float

    Raises
    ------
    ValueError
        For negative bytes or a bandwidth that is not finite and positive.
    """
    bw = float(dram_bw_bytes_s)
    if int(nbytes) < 0 or not (math.isfinite(bw) and bw > 0):
        raise ValueError(f"state_exchange_s: expected bytes >= 0 and a finite bandwidth > 0, got {nbytes!r} bytes, "
                         f"{dram_bw_bytes_s!r} B/s")
    return 2 * int(nbytes) / bw


def handover_costs(topo, handovers, stages: Sequence[int], ranks: Sequence[Sequence[int]]) -> tuple[HandoverCost, ...]:
    """The cost of each cut's sends on the link graph.

    Parameters
    ----------
    topo : Topology
        The system's link graph (:func:`tvm_spinn.target.topology.topology_of`).
    handovers : sequence of PlanCollective
        The plan's ``"send"`` records (:attr:`~tvm_spinn.mapping.shard.ShardPlan.handovers`):
        ``layer`` the first layer of the receiving stage, ``tensor`` and ``nbytes`` what one
        chip sends.
    stages : sequence of int
        Per layer, its stage (:attr:`~tvm_spinn.mapping.shard.ShardPlan.stages`).
    ranks : sequence of sequence of int
        Per stage, its chips in mesh position order (all stages as many).

    Returns
    -------
    tuple of HandoverCost
        One per cut that sends anything, in layer order.

    Raises
    ------
    ValueError
        For a record that is not a send, a send not at the first layer of a stage, stages of
        different sizes or a chip in two stages.
    """
    stages = [int(s) for s in stages]
    ranks = [np.asarray(r, dtype=np.int64).reshape(-1) for r in ranks]
    if len({r.size for r in ranks}) > 1:
        raise ValueError(f"handover_costs: every stage needs as many chips, got {[r.size for r in ranks]}")
    every = np.concatenate(ranks) if ranks else np.zeros(0, dtype=np.int64)
    if np.unique(every).size != every.size:
        raise ValueError("handover_costs: a chip is in two stages")
    cuts: dict[int, list] = {}
    for c in handovers:
        if c.op != "send":
            raise ValueError(f"handover_costs: expected send records, got {c.op!r} before layer {c.layer}")
        if not 0 < c.layer < len(stages) or stages[c.layer] == stages[c.layer - 1]:
            raise ValueError(f"handover_costs: a send before layer {c.layer}, which does not start a stage")
        if not 0 < stages[c.layer] < len(ranks):
            raise ValueError(f"handover_costs: layer {c.layer} is in stage {stages[c.layer]}, "
                             f"but ranks name {len(ranks)} stages")
        cuts.setdefault(int(c.layer), []).append(c)
    out = []
    for layer in sorted(cuts):
        sends = cuts[layer]
        stage = stages[layer]
        nbytes = int(sum(int(c.nbytes) for c in sends))
        cost = point_to_point(topo, ranks[stage - 1], ranks[stage], float(nbytes))
        out.append(HandoverCost(layer=layer, stage=stage, tensors=tuple(int(c.tensor) for c in sends), nbytes=nbytes,
                                seconds=float(cost.seconds), hops=int(cost.hops), board_hops=int(cost.board_hops)))
    return tuple(out)


def pipeline_timing(stage_s: Sequence[float], handovers: Sequence[HandoverCost] = ()) -> PipelineTiming:
    """The period and latency of a pipeline from its stages' latencies and its cuts' sends.

    ``latency_s = sum(stage_s) + sum of the sends' seconds``; ``period_s`` is the largest of
    them all (ties: the first stage, then the first cut).

    Raises
    ------
    ValueError
        For no stage, a time that is negative or not finite, or a send into a stage that is not
        one of ``stage_s`` (other than the first).
    """
    stage_s = tuple(float(s) for s in stage_s)
    if not stage_s:
        raise ValueError("pipeline_timing: a pipeline needs at least one stage")
    for what, value in [(f"stage {s}", v) for s, v in enumerate(stage_s)] + \
                       [(f"send before layer {h.layer}", h.seconds) for h in handovers]:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"pipeline_timing: {what} takes {value!r} s (must be finite and >= 0)")
    for h in handovers:
        if not 0 < h.stage < len(stage_s):
            raise ValueError(f"pipeline_timing: the send before layer {h.layer} goes to stage {h.stage} of "
                             f"{len(stage_s)}")
    parts = [(s, f"stage {k}") for k, s in enumerate(stage_s)] + [(h.seconds, f"send {h.layer}") for h in handovers]
    period, binding = parts[0]
    for seconds, what in parts[1:]:
        if seconds > period:
            period, binding = seconds, what
    latency = sum(stage_s) + sum(h.seconds for h in handovers)
    return PipelineTiming(stage_s=stage_s, handovers=tuple(handovers), period_s=period, binding=binding,
                          latency_s=latency)
