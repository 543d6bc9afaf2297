"""Mapping options: one struct per compilation, IREE-style, and a context to set it.

``relax.build`` has no slot for backend options, so the current :class:`MappingOptions` is read
from a context (``with tvm_spinn.MappingOptions(mode="pipelined"): relax.build(...)``) and
serialized into the program, where the report shows it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .._scoped import ScopedOptions

__all__ = ["MappingOptions", "current_options"]


@dataclass(frozen=True)
class MappingOptions(ScopedOptions):
    """How the mapping compiler maps a region onto the system.

    Parameters
    ----------
    mode : {"auto", "sequential", "pipelined"}
        ``sequential``: every layer uses all PEs of the chips chosen for it, one layer after
        another (lowest latency for one input). ``pipelined``: layers get disjoint PE groups
        sized by their work and run as a spatial pipeline (highest throughput for a stream of
        inputs). ``auto`` picks by the cost model for ``objective``.
    objective : {"latency", "throughput"}
        What ``auto`` optimizes.
    weights : {"auto", "resident", "stream"}
        Keep weights in SRAM across inferences (loaded once at program load) or stream them from
        DRAM each inference. ``auto`` keeps as many as fit next to the working buffers, most
        re-fetched first, unless the timing model finds streaming them all faster (resident
        weights take the SRAM that would keep activations on chip).
    activations : {"auto", "dram"}
        ``auto`` keeps a layer's output in SRAM for the next layer when it fits (read over the
        NoC); ``dram`` always spills.
    naive : bool
        The baseline the benchmark compares with: fixed 16x4 MAC-shaped tiles, round-robin
        placement, no double buffering, every operand from DRAM, one chip.
    double_buffer : bool
        Load a PE's next tile while it computes the current one (the default). ``False``
        serializes fetch -> compute -> write-back on every PE (the setup of a scheduler that
        stages each layer's operands before computing, e.g. OctopuScheduler on SpiNNaker2).
    scheduler : {"static", "software"}
        ``static`` (the default): the compiled schedule; PEs start each layer on a barrier built
        from NoC packets. ``software``: the setup of a runtime scheduler on one PE (e.g.
        OctopuScheduler on SpiNNaker2), which the timing model costs: per layer the scheduler PE
        sends every worker PE its task descriptor as NoC packets, one worker after another; each
        worker takes an interrupt, reads the descriptor and programs its DMAs; the workers report
        completion with one packet each, which the scheduler takes one by one before it
        dispatches the next layer. The mapping (tiles, placement) is the same; only the timing
        changes. One chip only (the scheduler's packets to other chips are not costed).
    """

    mode: str = "auto"
    objective: str = "latency"
    weights: str = "auto"
    activations: str = "auto"
    naive: bool = False
    double_buffer: bool = True
    scheduler: str = "static"

    def __post_init__(self) -> None:
        for name, allowed in (("mode", ("auto", "sequential", "pipelined")),
                              ("objective", ("latency", "throughput")),
                              ("weights", ("auto", "resident", "stream")),
                              ("activations", ("auto", "dram")),
                              ("scheduler", ("static", "software"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"MappingOptions.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def to_dict(self) -> dict:
        out = asdict(self)
        if out["double_buffer"]:  # the default: left out so earlier programs' bytes stay the same
            del out["double_buffer"]
        if out["scheduler"] == "static":  # the default, left out for the same reason
            del out["scheduler"]
        return out


def current_options() -> MappingOptions:
    """The innermost active :class:`MappingOptions` (defaults when none)."""
    return MappingOptions.current() or MappingOptions()
