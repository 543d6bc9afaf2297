"""The packed trees run unpipelined: each tree's part reduced up to its root, then multicast
back down, the two phases one after the other (:func:`tvm_spinn.timing.collectives.
_rooted_shapes`), against hand counts and the figures of the one-tree-per-share multicast."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_spinn.timing import collectives as C

from _boards import N, board_setting


def _grid(order, group):
    return [[c + b * 48 for c in order] for b in group]


def test_two_by_two_torus_phases_match_the_hand_count():
    """Four boards on a 2 x 2 torus (every two boards share two edges, 24 directed edges):
    a tree over four boards has three edges, so each phase moves three copies of the row
    across the edges, an eighth of the row on the busiest directed edge at best, and a
    member one hop from its tree's root: reduce and multicast cost at least ``2 (N / 8 / rate
    + hop)``. The rooted trees come within 2% of it, half of the one-tree-per-share multicast's
    bytes (each board's quarter on one of the two parallel edges)."""
    topo, order = board_setting(4, "spinn2-rooted-4-boards")
    graph = topo.board_graph()
    rate, hop = float(graph.link_bw[0]), float(graph.link_hop_s[0])
    assert np.all(graph.link_bw == rate) and np.all(graph.link_hop_s == hop)
    up, down, depth, depth_hops = C.packing._rooted_shapes(graph, np.arange(4), 4)[:4]
    # every tree: three edges, each crossed once up and once down
    assert np.all(up.sum(axis=1) == 3) and np.all(down.sum(axis=1) == 3)
    assert depth.min() == pytest.approx(hop) and depth_hops.min() == 1  # stars: members next to the root
    cost = C.board_group_all_reduce(topo, _grid(order, range(4)), N, board_gather=False)
    assert cost.algorithm == "board-packed"
    assert 2 * (N / 8 / rate + hop) <= cost.seconds + 1e-12 <= 2 * (1.02 * N / 8 / rate + hop)
    assert cost.seconds < 2 * (N / 4 / rate + hop)  # the multicast's share whole on one edge


def test_rooted_trees_never_dearer_than_the_multicast_and_never_below_the_pipelined(monkeypatch):
    """The group of 16 boards of boards24 (rows 4 and 5 relay): the unpipelined all-reduce is
    no dearer than without the rooted trees (the multicast of one tree per share), never
    below the pipelined one nor the floor; the on-board gather's figure adds as before."""
    topo, order = board_setting(24, "spinn2-rooted-24-boards")
    group = list(range(16))
    grid = _grid(order, group)
    plain = C.board_group_all_reduce(topo, grid, N, board_gather=False)
    gathered = C.board_group_all_reduce(topo, grid, N)
    piped = C.board_group_all_reduce(topo, grid, N, board_gather=False, pipelined=True)
    bandwidth, latency = C.board_group_floor(topo, group, N)
    assert plain.algorithm == "board-packed"
    assert plain.seconds >= piped.seconds >= bandwidth + latency
    gather = C.all_gather(topo, grid[0], N).seconds
    assert gathered.seconds == pytest.approx(plain.seconds + gather)
    monkeypatch.setattr(C.packing, "_rooted_shapes", lambda *args: None)
    without = C.board_group_all_reduce(topo, grid, N, board_gather=False)
    assert without.algorithm != "board-packed"
    assert plain.seconds < without.seconds
    # the pipelined figure does not move: the packed trees' span beats their rooted depth twice
    assert C.board_group_all_reduce(topo, grid, N, board_gather=False, pipelined=True) == piped


@pytest.mark.parametrize("g", [3, 4, 8, 16])
def test_more_boards_never_below_their_floor(g):
    """Groups of 3 to 16 boards of boards24 (rows of its 4 x 6 torus filled in order): every
    schedule stays at or above the floor of its own group, unpipelined at or above pipelined."""
    topo, order = board_setting(24, "spinn2-rooted-24-boards")
    group = list(range(g))
    grid = _grid(order, group)
    bandwidth, latency = C.board_group_floor(topo, group, N)
    piped = C.board_group_all_reduce(topo, grid, N, board_gather=False, pipelined=True)
    plain = C.board_group_all_reduce(topo, grid, N, board_gather=False)
    assert bandwidth + latency <= piped.seconds <= plain.seconds
