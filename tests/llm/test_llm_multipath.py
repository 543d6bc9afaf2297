"""Hand-overs over every edge-disjoint path between boards and all-reduces over the graph of
boards (tvm_spinn.target.topology's board graph, tvm_spinn.timing.collectives), checked against
hand counts on a 2 x 2 torus of boards, and the planner's use of them."""

from __future__ import annotations

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.target.topology import (board_edges, board_grid, board_paths, crossing_hops, edge_rate,
                                       edge_reach_hops, path_cost, ring_order, topology_of)
from tvm_spinn.timing.collectives import (all_gather, board_all_reduce, board_group_all_reduce,
                                          multipath_point_to_point, point_to_point, water_fill)


@pytest.fixture(scope="module")
def four():
    arch = tvm_spinn.make_system("spinn2-four-boards", boards=4)
    return arch, topology_of(arch)


def test_board_graph_of_a_two_by_two_torus(four):
    arch, topo = four
    assert board_grid(4) == (2, 2)
    # board (a, b) = a + 2 b; its edges go to (a, b) + (1,0), (0,1), (-1,1), (-1,0), (0,-1), (1,-1)
    # modulo 2: two edges to each of the other three boards
    assert board_edges(topo).tolist() == [[1, 2, 3, 1, 2, 3], [0, 3, 2, 0, 3, 2], [3, 0, 1, 3, 0, 1],
                                          [2, 1, 0, 2, 1, 0]]
    # an edge's 8 chip links share its one serial link: the edge moves that link's payload rate
    serial = arch.board_link_bw_bytes_s * arch.link_payload_fraction * arch.board_serial_links
    assert np.allclose(edge_rate(topo), serial)
    # a board's hexagon: opposite edges 7 chips apart, neighbouring edges meet at a corner chip
    hops = crossing_hops()
    assert (np.diag(hops) == 0).all() and (hops == hops.T).all()
    assert all(hops[e, (e + 3) % 6] == 7 for e in range(6))
    assert all(hops[e, (e + 1) % 6] == 0 for e in range(6))
    assert edge_reach_hops().max() == 7


def test_board_paths_are_edge_disjoint_and_as_many_as_the_edges(four):
    _, topo = four
    far = board_edges(topo).reshape(-1)
    paths = board_paths(topo, 0, 1)
    # by hand: the two edges 0 -> 1 directly, then 0 -> 2 -> 1 and 0 -> 3 -> 1 twice each
    assert sorted(len(p) for p in paths) == [1, 1, 2, 2, 2, 2]
    edges = [e for p in paths for e in p]
    assert len(set(edges)) == len(edges) == 10
    for p in paths:
        board = 0
        for e in p:
            assert e // 6 == board
            board = int(far[e])
        assert board == 1
    # the same seen from another board (the torus is the same from every board)
    assert sorted(len(p) for p in board_paths(topo, 3, 2)) == [1, 1, 2, 2, 2, 2]
    with pytest.raises(tvm_spinn.target.ArchError, match="same board"):
        board_paths(topo, 2, 2)


def test_multipath_hand_over_is_the_hand_count(four):
    arch, topo = four
    paths = board_paths(topo, 0, 1)
    rate = arch.board_link_bw_bytes_s * arch.link_payload_fraction
    hop, board_hop = arch.link_hop_s, arch.board_link_hop_s
    # the direct path: from the farthest chip to the edge, one board hop, to the farthest chip
    direct = [p for p in paths if len(p) == 1][0]
    e = direct[0] % 6
    assert path_cost(topo, direct) == pytest.approx(
        (rate, board_hop + (edge_reach_hops()[e] + edge_reach_hops()[(e + 3) % 6]) * hop))
    lat = np.array([path_cost(topo, p)[1] for p in paths])
    # a large message uses all six paths, finishing together: 6 r T = n + r sum(latencies)
    n = 1e6
    cost = multipath_point_to_point(topo, 0, 1, n)
    assert cost.algorithm == "multipath"
    assert cost.seconds == pytest.approx((n + rate * lat.sum()) / (6 * rate))
    # a tiny one only the quickest paths (the two direct edges)
    t, share = water_fill([rate] * 6, lat, 8.0)
    quickest = int((lat == lat.min()).sum())
    assert quickest == 2 and t == pytest.approx(lat.min() + 8.0 / (quickest * rate)) and (share > 0).sum() == 2
    # 32 KB (an 8192-wide fp32 vector): the 48 chips' direct routes cross the two edges between
    # the boards; the six paths take ~1/3 of their time
    chips = np.arange(48)
    direct_routes = point_to_point(topo, chips, chips + 48, 32768 / 48).seconds
    assert direct_routes > 32768 / (2 * rate)
    assert multipath_point_to_point(topo, 0, 1, 32768).seconds < direct_routes / 3


def test_two_board_all_reduce_exchanges_halves_over_every_path(four):
    arch, topo = four
    order = ring_order(topology_of(arch.replace(chips=48)), 48)
    grid = [[int(c) + b * 48 for c in order] for b in (0, 1)]
    n = 32768.0
    cost = board_group_all_reduce(topo, grid, n)
    half = max(multipath_point_to_point(topo, 0, 1, n / 2).seconds, multipath_point_to_point(topo, 1, 0, n / 2).seconds)
    assert cost.algorithm == "board-multipath"
    assert cost.seconds == pytest.approx(2 * half + all_gather(topo, grid[0], n).seconds)
    assert cost.seconds < board_all_reduce(topo, grid, n).seconds / 1.5
    # more boards: the multicast over the graph of boards, never dearer than the ring or tree
    four_grid = [[int(c) + b * 48 for c in order] for b in range(4)]
    assert board_group_all_reduce(topo, four_grid, n).seconds <= board_all_reduce(topo, four_grid, n).seconds
    with pytest.raises(ValueError, match="one board"):
        board_group_all_reduce(topo, [[0, 1], [2, 3]], n)


def test_int32_partial_sums_do_not_depend_on_the_boards_or_the_order():
    """The board_tp placement's exactness argument: an int8 row-parallel GEMM's int32 partial
    sums over any number of boards, added in any order (ring, tree, multicast trees), give the
    one-board result bit for bit, so the tokens do not depend on the tensor-parallel degree."""
    rng = np.random.default_rng(0)
    x = rng.integers(-128, 128, (1, 8192), dtype=np.int8)
    w = rng.integers(-128, 128, (8192, 64), dtype=np.int8)
    full = x.astype(np.int32) @ w.astype(np.int32)
    for g in (2, 4, 8, 16):
        parts = [x[:, k::g].astype(np.int32) @ w[k::g].astype(np.int32) for k in range(g)]
        for order in (range(g), reversed(range(g)), rng.permutation(g)):
            acc = np.zeros_like(full)
            for k in order:
                acc += parts[k]
            assert np.array_equal(acc, full)


def test_group_all_reduce_relays_and_spread_trees_never_cost_more(four):
    """Groups of boards on a larger torus: the trees over the group's own edges, with the
    neighbouring boards relaying, or spread off the shortest paths, whichever is cheapest; each
    is a valid schedule, so the result is never dearer than the ring or tree over the boards,
    and a relay carries a share only on a route to a board that needs it."""
    from tvm_spinn.timing import collectives as C

    arch = tvm_spinn.make_system("spinn2-twelve-boards", boards=12)
    topo = topology_of(arch)
    order = ring_order(topology_of(arch.replace(chips=48)), 48)
    graph = topo.board_graph()
    for group in ([0, 1, 4, 5], [0, 1, 2, 5, 4, 3]):
        grid = [[int(c) + b * 48 for c in order] for b in group]
        cost = board_group_all_reduce(topo, grid, 32768.0)
        assert cost.seconds <= board_all_reduce(topo, grid, 32768.0).seconds
        members = np.array(group)
        halo = np.setdiff1d(np.unique(graph.neighbors[members]), members)
        ranks = np.concatenate([members, halo])
        shares = C._multicast_trees(graph, ranks, sources=len(group))[0]
        spread = C._spread_trees(graph, ranks, len(group), 32768.0 / len(group))[0]
        for trees in (shares, spread):
            # every member receives every other member's share: at least g - 1 shares arrive
            into = np.zeros(topo.boards)
            for link in np.flatnonzero(trees):
                into[graph.neighbors.reshape(-1)[link]] += trees[link]
            assert all(into[b] >= len(group) - 1 for b in group)
            # a share crosses a link at most once per tree: at most g shares on any link
            assert trees.max() <= len(group)


def test_board_patches_tile_the_grid_with_compact_groups():
    from tvm_spinn.llm.board_tp import board_patches

    # 24 boards (4 x 6): one 4 x 4 patch of 16; 2 x 4 patches of 8 side by side
    assert board_patches((4, 6), 16) == [list(range(16))]
    assert board_patches((4, 6), 8, (2, 4)) == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    # the cloud (24 x 30): 4 x 4 patches in a snake, consecutive patches side by side
    cloud = board_patches((24, 30), 16)
    assert len(cloud) == 6 * 7 and cloud[0][:5] == [0, 1, 2, 3, 24] and cloud[6][0] == 20 + 24 * 4
    assert all(len(set(p)) == 16 for p in cloud) and len({b for p in cloud for b in p}) == 16 * len(cloud)
    assert board_patches((2, 2), 8) == [] and board_patches((4, 6), 8, (3, 3)) == []
