"""Typed, immutable records a program carries besides its graph: its mapping, the timing and
memory summaries.

The mapper and the timing model build these; :mod:`.format` alone turns them into the header's
JSON and back (:func:`.format.mapping_to_json`, :func:`.format.timing_to_json`,
:func:`.format.memory_to_json` and their ``*_from_json``), next to the validator. Records are frozen: a stage that changes one makes a new one
(:func:`dataclasses.replace`), so a record shared between programs (a replayed mapping) is never
edited behind another program's back.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..options import MappingOptions

__all__ = ["LayerTimingSummary", "CollectiveSummary", "SystemTimingSummary", "TimingSummary", "AddressRange",
           "MemorySummary", "LayerMapping", "PlanCandidate", "PlanCollective", "SystemMapping", "ProgramMapping",
           "PipelineTimingSummary", "PipelineStage", "PipelineMapping"]


@dataclass(frozen=True)
class LayerTimingSummary:
    """One layer's figures in a :class:`TimingSummary`, as the timing model
    (:func:`tvm_spinn.timing.evaluate`) derives them."""

    name: str
    kind: str
    tiles: int
    pes: int
    chips: int
    cycles: int
    compute_cycles: int
    dram_bytes: int
    noc_bytes: int
    link_bytes: int
    flops: int
    sram_peak: int
    utilization: float
    start_cycle: int = 0


@dataclass(frozen=True)
class CollectiveSummary:
    """One collective of a system mapping: before layer ``layer``, ``nbytes`` per rank, its
    algorithm's time and the link hops it crosses (on and between boards), as
    :func:`tvm_spinn.timing.system.compose` costs it."""

    layer: int
    op: str
    algorithm: str
    nbytes: int
    seconds: float
    hops: int
    board_hops: int


@dataclass(frozen=True)
class SystemTimingSummary:
    """A system mapping's timing on its chip group, as :func:`tvm_spinn.timing.system.compose`
    derives it: latency, the three bounds, the largest of them (``bound_s``) and the one that
    binds, per-layer seconds and the collectives."""

    latency_s: float
    compute_bound_s: float
    memory_bound_s: float
    comm_bound_s: float
    binding: str
    chips: int
    streamed_bytes_per_chip: int
    layer_s: tuple[float, ...]
    collectives: tuple[CollectiveSummary, ...]
    bound_s: float


@dataclass(frozen=True)
class TimingSummary:
    """The timing model's result (:func:`tvm_spinn.timing.evaluate`), stored with a program
    (``Program.timing``): whole-program figures, one :class:`LayerTimingSummary` per layer and,
    for a program mapped over several chips, the :class:`SystemTimingSummary` (None on one
    chip)."""

    cycles: int
    latency_s: float
    roofline_s: float
    throughput_inf_s: float
    dram_bytes: int
    noc_bytes: int
    link_bytes: int
    energy_j: float
    pe_utilization: float
    flops: int
    layers: tuple[LayerTimingSummary, ...] = ()
    system: SystemTimingSummary | None = None
    pipeline: "PipelineTimingSummary | None" = None


@dataclass(frozen=True)
class PipelineTimingSummary:
    """The timing of a program mapped over pipeline stages (``TimingSummary.pipeline``), as
    :func:`tvm_spinn.timing.stages.pipeline_timing` derives it: each stage's latency
    (``stage_s``), each cut's send time (``send_s``, in cut order), the steady-state period
    (one input leaves every ``period_s``), what binds it (``"stage <s>"`` or ``"send
    <layer>"``) and the latency of one input through every stage and cut."""

    stage_s: tuple[float, ...]
    send_s: tuple[float, ...]
    period_s: float
    binding: str
    latency_s: float


@dataclass(frozen=True)
class AddressRange:
    """Bytes ``[start, end)`` of a PE's SRAM held from layer ``first_layer`` to ``last_layer``
    (inclusive) by ``what`` (resident weights, a layer's on-chip output, its working buffers)."""

    start: int
    end: int
    first_layer: int
    last_layer: int
    what: str


@dataclass(frozen=True)
class MemorySummary:
    """The SRAM plan stored with a program (``Program.memory``): the largest per-PE peak, the
    resident weight bytes of every PE together and the checked address ranges of the busiest
    PE (``busiest_pe``; -1 when no PE holds anything)."""

    peak_bytes_max: int
    resident_bytes_total: int
    busiest_pe: int
    ranges: tuple[AddressRange, ...] = ()


@dataclass(frozen=True)
class LayerMapping:
    """One layer's mapping decision: its tile shape (the family's arity, see
    :mod:`tvm_spinn.program.tiles`), the contiguous PE range ``(first, count)`` it runs on and
    ``rotate``, the PE of the range its placement starts from
    (:func:`tvm_spinn.mapping.placement.place_tiles`; 0: the first)."""

    tile: tuple[int, ...]
    pes: tuple[int, int]
    rotate: int = 0


@dataclass(frozen=True)
class PlanCandidate:
    """One shard plan a system mapping timed: its mesh (``tp x dp x sp`` chips, ``row``: the
    row-parallel GEMM rule), its latency and whether its shard fit the chips' DRAM."""

    tp: int
    dp: int
    sp: int
    row: bool | str
    latency_s: float
    fits: bool


@dataclass(frozen=True)
class PlanCollective:
    """One collective of the chosen shard plan (see :class:`tvm_spinn.mapping.shard.Collective`):
    before layer ``layer``, on tensor ``tensor`` of ``nbytes`` (``exact``: integer partial sums),
    among the chips of ``group``; ``shape``: what one chip holds after an all-gather."""

    layer: int
    op: str
    tensor: int
    nbytes: int
    exact: bool
    group: str = "tp"
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class SystemMapping:
    """The shard plan of a program mapped over several chips (``ProgramMapping.system``): the
    mesh (``tp x dp x sp`` = ``chips``), the row-parallel rule, the layers per split kind
    (``splits``: ``(kind, count)`` in first-use order), the pipeline stage (board), the plans
    timed, the collectives, the hand-over time from the previous stage, the layers
    replicated for want of a sharding rule (``(layer name, reason)``) and the streams the
    program's state is kept for (each input in flight a stream with its own copy of the state:
    see :func:`tvm_spinn.mapping.state.build_flight`; 1 for one stream)."""

    tp: int
    dp: int
    row: bool | str
    chips: int
    splits: tuple[tuple[str, int], ...]
    stage: int
    candidates: tuple[PlanCandidate, ...]
    collectives: tuple[PlanCollective, ...]
    handoff_s: float = 0.0
    sp: int = 1
    replicated: tuple[tuple[str, str], ...] = ()
    streams: int = 1


@dataclass(frozen=True)
class ProgramMapping:
    """The mapping stored with a program (``Program.mapping``): the mode (``sequential`` or
    ``pipelined``), the :class:`~tvm_spinn.options.MappingOptions` it was made with, chips and PEs per layer, double buffering, one :class:`LayerMapping` per
    layer, the layers whose weights stay resident, the activations kept on chip, the scheduler
    and, over several chips, the :class:`SystemMapping` (None on one chip). Everything else (the
    tiles, their placement and schedule) is derived from these."""

    mode: str
    options: MappingOptions
    chips_per_layer: tuple[int, ...]
    pes_per_layer: tuple[int, ...]
    double_buffer: bool
    layers: tuple[LayerMapping, ...]
    resident_layers: tuple[int, ...] = ()
    onchip_tensors: tuple[int, ...] = ()
    scheduler: str = "static"
    system: SystemMapping | None = None
    pipeline: "PipelineMapping | None" = None


@dataclass(frozen=True)
class PipelineStage:
    """One pipeline stage of a program (:class:`PipelineMapping`): its layers
    ``[first_layer, first_layer + layers)``, the chips it runs on and the one-chip mapping of
    its stage program (:func:`tvm_spinn.mapping.shard.stage_programs`: its layer indices and
    tensor ids are the stage program's own)."""

    first_layer: int
    layers: int
    chips: tuple[int, ...]
    mapping: ProgramMapping


@dataclass(frozen=True)
class PipelineMapping:
    """A program mapped over pipeline stages (``ProgramMapping.pipeline``; None for every
    other): the stages in layer order, each on its own chips, and the tensors sent at each cut
    (``sends``: the plan's ``"send"`` records, program tensor ids, ``layer`` the first layer of
    the receiving stage)."""

    stages: tuple[PipelineStage, ...]
    sends: tuple[PlanCollective, ...] = ()
