"""A system of whole boards as the board-collective tests take it: its topology and the order
of a board's 48 chips around their ring (a chip's index on every board)."""

from __future__ import annotations

import tvm_spinn
from tvm_spinn.target.topology import ring_order, topology_of

N = 32768.0  # an 8,192-wide row of int32 partial sums


def board_setting(boards: int, name: str):
    """``(topology, chip order)`` of ``make_system(name, boards=boards)``."""
    arch = tvm_spinn.make_system(name, boards=boards)
    topo = topology_of(arch)
    order = [int(c) for c in ring_order(topology_of(arch.replace(chips=48)), 48)]
    return topo, order
