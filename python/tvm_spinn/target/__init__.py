"""Target model (architecture dataclass), its link graph and target tag registration."""

from .arch import CHIPS, ArchError, SpinnArch, make_system
from .registry import (
    HOST_MCPU_ENV, SYSTEMS, arch_of, get_target, host_mcpu, host_target, is_spinn_target,
    known_targets, register_default_tags, register_system, registered_system, unregister_system,
)
from .topology import Topology, TransferCost, topology_of

__all__ = [
    "ArchError", "CHIPS", "SpinnArch", "make_system", "SYSTEMS", "arch_of", "get_target",
    "is_spinn_target", "known_targets", "register_default_tags", "register_system", "registered_system", "unregister_system",
    "Topology",
    "TransferCost", "topology_of", "HOST_MCPU_ENV", "host_mcpu", "host_target",
]
