"""The all-to-all collectives (a mixture of experts' dispatch and combine) against hand-computed costs."""

from __future__ import annotations

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.target.topology import topology_of
from tvm_spinn.timing import collectives as C


def test_all_to_all_matches_hand_computed_costs():
    arch = tvm_spinn.arch_of("spinn/board")
    B, a, n = arch.payload_bw("chip"), arch.link_hop_s, 1e6
    board = topology_of(arch)
    # two neighbours: each sends the other half of its n bytes over its own direction of the link
    two = C.all_to_all(board, [0, 1], n)
    assert (two.algorithm, two.seconds, two.bytes_per_link) == ("direct", pytest.approx(n / 2 / B + a), n / 2)
    # four chips in a row (0,0)..(3,0), n / 4 to each other rank. Direct: the east link 1 -> 2
    # carries 0->2, 0->3, 1->2, 1->3 (n in all), the longest route 3 hops: n / B + 3a
    assert C.all_to_all(board, [0, 1, 2, 3], n, "direct").seconds == pytest.approx(n / B + 3 * a)
    # pairwise: step 1 (i -> i+1; 3 -> 0 three hops back) n/4 a link; step 2 (i -> i+2) n/2 on
    # the middle links, 2 hops; step 3 (i -> i+3: 0 -> 3 three hops) n/4: n / B + 8a
    pair = C.all_to_all(board, [0, 1, 2, 3], n, "pairwise")
    assert (pair.seconds, pair.steps) == (pytest.approx(n / B + 8 * a), 3)
    assert C.all_to_all(board, [0, 1, 2, 3], n).algorithm == "direct"  # the cheaper
    assert C.all_to_all(board, [5], n).seconds == 0.0


def test_board_all_to_all_sends_each_pair_chip_by_chip():
    arch = tvm_spinn.arch_of("spinn/board").replace(chips=2 * 48, name="two boards")
    topo = topology_of(arch)
    grid = [list(range(48)), list(range(48, 96))]
    n = 48 * 4096.0
    send = np.array([[0.0, n], [0.0, 0.0]])
    # board 0 to board 1, each chip its 1/48 to its counterpart: the chips' direct transfers
    direct = C.point_to_point(topo, grid[0], grid[1], n / 48)
    cost = C.board_all_to_all(topo, grid, send)
    assert cost.seconds == pytest.approx(direct.seconds) and cost.op == "all_to_all"
    # both ways at once: the two directions use different directed links, so no slower
    both = C.board_all_to_all(topo, grid, send + send.T)
    assert both.seconds == pytest.approx(direct.seconds)
    # a board's own share and empty pairs move nothing
    assert C.board_all_to_all(topo, grid, np.diag([n, n])).seconds == 0.0
    with pytest.raises(ValueError, match="send must be 2 x 2"):
        C.board_all_to_all(topo, grid, np.zeros((3, 3)))
    with pytest.raises(ValueError, match="byte counts >= 0"):
        C.board_all_to_all(topo, grid, -send)
