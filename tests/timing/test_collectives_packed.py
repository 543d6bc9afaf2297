"""The board group's all-reduce over packed trees (the row split over many trees through the
group and the boards around it) and the floor it is held to."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_spinn.timing import collectives as C

from _boards import N, board_setting


def _setting(boards: int):
    return board_setting(boards, f"spinn2-packed-{boards}-boards")


def _grid(order, group):
    return [[c + b * 48 for c in order] for b in group]


def test_two_by_two_torus_matches_the_hand_computation():
    """Four boards on a 2 x 2 torus: every two boards share two edges, so the row splits over
    four stars (one rooted at each board, each on its own parallel edge): every directed edge
    carries a quarter of the row, and two members are two board hops apart along a star."""
    topo, order = _setting(4)
    graph = topo.board_graph()
    rate, hop = float(graph.link_bw[0]), float(graph.link_hop_s[0])
    assert np.all(graph.link_bw == rate) and np.all(graph.link_hop_s == hop)
    cost = C.board_group_all_reduce(topo, _grid(order, range(4)), N, board_gather=False, pipelined=True)
    assert cost.seconds == pytest.approx(N / 4 / rate + 2 * hop)
    # the floor: 2 (k - 1) copies over the 24 directed edges between four parts, one hop apart
    bandwidth, latency = C.board_group_floor(topo, range(4), N)
    assert bandwidth == pytest.approx(2 * 3 * N / (24 * rate))
    assert latency == pytest.approx(hop)
    assert cost.seconds >= bandwidth + latency
    # the packed trees alone: the four stars' quarter of the row on every directed edge (the
    # parts re-weighed to within 1%), two hops between members
    graph.memo.clear()
    options, _ = C.packing._packed_trees(graph, np.arange(4), 4)
    best = min(options, key=lambda o: graph.link_seconds(o[0] * N) + o[1])
    assert N / 4 / rate <= graph.link_seconds(best[0] * N) <= 1.01 * N / 4 / rate
    assert best[1] == pytest.approx(2 * hop) and best[2] == 2


def test_three_boards_and_a_relay_match_the_cut_by_hand():
    """Three boards of the 2 x 2 torus, the fourth relaying (and adding): parts {0, 3}, {1},
    {2} leave 10 of the 12 board-to-board pairs of edges between parts, so the parts exchange
    2 (3 - 1) rows over 20 directed edges, a fifth of the row on each at best; the packed trees
    come within 1% of it, with every two members two hops apart."""
    topo, order = _setting(4)
    graph = topo.board_graph()
    rate, hop = float(graph.link_bw[0]), float(graph.link_hop_s[0])
    bandwidth, latency = C.board_group_floor(topo, range(3), N)
    assert bandwidth == pytest.approx(N / 5 / rate) and latency == pytest.approx(hop)
    cost = C.board_group_all_reduce(topo, _grid(order, range(3)), N, board_gather=False, pipelined=True)
    assert cost.algorithm == "board-packed"
    assert N / 5 / rate + 2 * hop <= cost.seconds <= 1.01 * N / 5 / rate + 2 * hop


def test_four_by_four_torus_packs_below_the_one_tree_per_share_multicast():
    """Sixteen boards, the whole 4 x 4 torus (no relays): the floor is the members' own bound,
    2 (g - 1) / g of the row in over each board's six edges, and two board hops; the packed
    trees beat the multicast of one tree per share and stay above the floor."""
    topo, order = _setting(16)
    graph = topo.board_graph()
    rate, hop = float(graph.link_bw[0]), float(graph.link_hop_s[0])
    bandwidth, latency = C.board_group_floor(topo, range(16), N)
    assert bandwidth == pytest.approx(2 * 15 / 16 * N / (6 * rate))
    assert latency == pytest.approx(2 * hop)
    grid = _grid(order, range(16))
    cost = C.board_group_all_reduce(topo, grid, N, board_gather=False, pipelined=True)
    assert cost.algorithm == "board-packed"  # cheaper than one multicast tree per board's share
    assert bandwidth + latency <= cost.seconds
    # the trees' loads and spans add up to the figure: the busiest edge's time plus the span
    members = np.arange(16)
    options, _ = C.packing._packed_trees(graph, members, 16)
    # (the trees of every span at once, the longer trees' parts first, are never dearer than
    # the trees of any one span cap: test_collectives_priority.py checks the schedule)
    assert cost.seconds <= min(graph.link_seconds(load * N) + lat for load, lat, _ in options) + 1e-12
    for load, _, _ in options:  # every tree's part adds up to the whole row into each member
        into = np.zeros(graph.nodes)
        np.add.at(into, graph.neighbors.reshape(-1), load)
        assert np.all(into[members] >= 1.0 - 1e-9)


def test_the_group_of_sixteen_on_boards24_never_goes_below_its_floor_and_is_deterministic():
    topo, order = _setting(24)
    graph = topo.board_graph()
    group = list(range(16))  # rows 0-3 of the 4 x 6 torus: rows 4 and 5 relay
    grid = _grid(order, group)
    first = C.board_group_all_reduce(topo, grid, N, board_gather=False, pipelined=True)
    bandwidth, latency = C.board_group_floor(topo, group, N)
    assert bandwidth + latency <= first.seconds
    # the members-only bound does not hold here: the relays add partial sums too, and the
    # floor's cut with the relays joined to one member's part is the binding one
    assert bandwidth > N / (6 * float(graph.link_bw[0]))
    # fused on-board gather: never below the floor plus the board's gather hops
    fused = C.board_group_all_reduce(topo, grid, N, pipelined=True, fuse_gather=True)
    hops = C._gather_parts(topo, np.asarray(grid[0]), N)[1]
    assert bandwidth + latency + hops <= fused.seconds
    # the same figure from a fresh search (no memo): deterministic
    graph.memo.clear()
    again = C.board_group_all_reduce(topo, grid, N, board_gather=False, pipelined=True)
    assert again == first
    # not pipelined: the packed trees rooted, reduce then multicast, never below the pipelined
    plain = C.board_group_all_reduce(topo, grid, N, board_gather=False)
    assert plain.algorithm == "board-packed" and plain.seconds >= first.seconds


def test_floor_refuses_bad_groups():
    topo, _ = _setting(4)
    with pytest.raises(ValueError, match="distinct boards"):
        C.board_group_floor(topo, [0, 0], N)
    with pytest.raises(ValueError, match=r"boards must be in \[0, 4\)"):
        C.board_group_floor(topo, [0, 7], N)
    with pytest.raises(ValueError, match="nbytes"):
        C.board_group_floor(topo, [0, 1], float("nan"))
    assert C.board_group_floor(topo, [2], N) == (0.0, 0.0)
