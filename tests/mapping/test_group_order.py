"""The tensor-parallel groups' layout on a board (:func:`~tvm_spinn.mapping.system.group_order`).

References: the chips' one-hop links (each group's path), a hand count of the hops on the
board's lattice (``board_layout``: links E, N, NE), and every group's chains costed one by one.
"""

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.mapping.system import group_order, group_ranks
from tvm_spinn.target.topology import board_layout, ring_order, topology_of
from tvm_spinn.timing.system import chain_fed_chain, chain_led_all_reduce, collective_cost
from tvm_spinn.timing import collectives as C


@pytest.fixture(scope="module")
def board():
    return topology_of(tvm_spinn.make_system("group-order", boards=1))


@pytest.mark.parametrize("tp,sp", [(12, 4), (8, 6), (16, 3), (6, 2)])
def test_groups_are_disjoint_paths_covering_the_chips(board, tp, sp):
    order = group_order(board, tp, sp)
    assert sorted(order.tolist()) == sorted(ring_order(board, tp * sp).tolist())
    for j in range(sp):
        path = order[j * tp:(j + 1) * tp]
        for a, b in zip(path[:-1], path[1:]):
            assert b in board.neighbors[a], (j, a, b)  # one hop a step of the chain


def _lattice_hops(a, b):
    """Hops between two chips of a board counted on its lattice (links E, N, NE and their
    opposites): ``max(|dx|, |dy|)`` when the steps share a sign (NE steps), else ``|dx| + |dy|``."""
    (xa, ya), (xb, yb) = board_layout()[a], board_layout()[b]
    dx, dy = int(xb - xa), int(yb - ya)
    return max(abs(dx), abs(dy)) if dx * dy >= 0 else abs(dx) + abs(dy)


def test_compact_patches_on_a_board(board):
    """Twelve chips a group: every group's last rank is within three hops of all its ranks (its
    first within five), where the cycle's last strip reaches seven (its last chip 10 at (0, 1)
    to 44 at (7, 7): six NE steps and one E)."""
    ring = ring_order(board, 48)
    strip = ring[36:]
    assert max(_lattice_hops(strip[-1], c) for c in strip) == 7 == _lattice_hops(10, 44)
    order = group_order(board, 12, 4)
    for j in range(4):
        g = order[j * 12:(j + 1) * 12]
        assert max(_lattice_hops(g[-1], c) for c in g) <= 3
        assert max(_lattice_hops(g[0], c) for c in g) <= 5
        assert board.hops(np.full(12, g[-1]), g).tolist() == [_lattice_hops(g[-1], c) for c in g]


def _charge(board, g):
    """A split row's maximum (led into the sum's chain) and sum (fed into the context's)."""
    own = collective_cost(board, g, "all_reduce", 4, False)
    return (chain_led_all_reduce(board, g, 4, own).seconds
            + chain_fed_chain(board, g, own, C.chain_all_reduce(board, g, 512)).seconds)


def test_slowest_group_no_slower_than_the_cycles_first(board):
    """The patches' slowest group costs no more than the cycle's first strip (its best group),
    and less than the cycle's slowest."""
    ring = ring_order(board, 48)
    order = group_ranks(board, type("P", (), {"tp": 12, "sp": 4, "dp": 1})())["all"]
    strips = [_charge(board, ring[j * 12:(j + 1) * 12]) for j in range(4)]
    patches = [_charge(board, order[j * 12:(j + 1) * 12]) for j in range(4)]
    assert max(patches) <= strips[0] + 1e-12
    assert max(patches) < max(strips)
