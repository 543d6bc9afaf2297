"""Measured costs of a runtime scheduler's software (``MappingOptions(scheduler="software")``).

A software scheduler (one PE of the chip that dispatches every layer to the worker PEs, e.g.
OctopuScheduler) spends time that is its software's, not the silicon's: the timing model
charges its packets (:func:`~tvm_spinn.timing.model.software_dispatch`,
:func:`~tvm_spinn.timing.model.software_completion`) and, for what its software does beyond
them, the costs measured on silicon and published for that scheduler. They are properties of
that software (a static schedule has none of them), not hardware numbers of
:class:`~tvm_spinn.target.arch.SpinnArch`, and nothing here is fitted.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SchedulerSoftwareCosts", "OCTOPUS_SCHEDULER"]


@dataclass(frozen=True)
class SchedulerSoftwareCosts:
    """A software scheduler's measured fixed costs, in seconds.

    Attributes
    ----------
    per_layer_s : float
        The scheduler's time per layer (reading the layer's description, issuing its tasks,
        collecting the workers' completion): a layer takes at least this long, however little
        work it has; the packets the model charges run within it.
    setup_s : float
        Per inference, before the first layer (charged to the first layer that runs).
    cleanup_s : float
        Per inference, after the last layer (charged to the last layer that runs).
    source : str
        Where the figures were measured and published.
    """

    per_layer_s: float
    setup_s: float
    cleanup_s: float
    source: str

    def __post_init__(self) -> None:
        for name in ("per_layer_s", "setup_s", "cleanup_s"):
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"SchedulerSoftwareCosts.{name} must be >= 0 seconds, got {value!r}")


#: OctopuScheduler's multi-layer extension on one production SpiNNaker2 chip, measured on
#: silicon (Jobst et al., "An End-to-End DNN Inference Framework for the SpiNNaker2
#: Neuromorphic MPSoC", arXiv 2507.13736, 2025, extending OctopuScheduler, IEEE NICE 2025):
#: ~13 us of scheduling per layer, 39 us of set-up and 93 us of clean-up per inference.
OCTOPUS_SCHEDULER = SchedulerSoftwareCosts(
    per_layer_s=13e-6, setup_s=39e-6, cleanup_s=93e-6,
    source="arXiv 2507.13736 (OctopuScheduler multi-layer extension, one SpiNNaker2 chip)")
