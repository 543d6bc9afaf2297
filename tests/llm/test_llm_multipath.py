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


def test_board_paths_around_a_dead_board(four):
    """Board 1 dead: the torus is no longer the same from every board, so 2 -> 3 is searched from
    board 2 itself: its two direct edges, then through board 0 twice (by hand; board 1 relays
    nothing)."""
    arch, _ = four
    topo = topology_of(arch.replace(dead_boards=(1,)))
    far = board_edges(topo).reshape(-1)
    for src, dst in ((2, 3), (3, 0), (0, 2)):
        paths = board_paths(topo, src, dst)
        assert sorted(len(p) for p in paths) == [1, 1, 2, 2]
        for p in paths:
            board = src
            for e in p:
                assert e // 6 == board and board != 1
                board = int(far[e])
            assert board == dst
    assert multipath_point_to_point(topo, 2, 3, 32768).seconds > 0


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
    # without the on-board all-gather (the consumer gathers the row itself): the exchange alone
    assert board_group_all_reduce(topo, grid, n, board_gather=False).seconds == pytest.approx(2 * half)
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


@pytest.fixture(scope="module")
def sixty_four():
    arch = tvm_spinn.make_system("spinn2-64-boards", boards=64)  # an 8 x 8 torus: a 2 x 4 patch does not close
    return arch, topology_of(arch)


def test_negotiated_trees_are_multicast_trees_and_beat_the_breadth_first_ones_on_an_open_patch(sixty_four,
                                                                                               monkeypatch):
    """On a patch of a larger torus the shortest paths crowd onto a few edges; the negotiated
    trees route round them. Each is still a multicast tree per share: every member receives
    every other member's share exactly once, no link carries a share twice."""
    from tvm_spinn.timing import collectives as C

    arch, topo = sixty_four
    graph = topo.board_graph()
    members = np.array([0, 1, 2, 3, 8, 9, 10, 11])
    halo = np.setdiff1d(np.unique(graph.neighbors[members]), members)
    ranks = np.concatenate([members, halo[halo >= 0]])
    g, n = members.size, 32768.0

    def seconds(trees):  # the all-reduce's two steps over the graph of boards: busiest link, deepest route
        shares, latency, _, _, rev_shares, back = trees
        return graph.link_seconds(rev_shares * n / g) + back + graph.link_seconds(shares * n / g) + latency

    spread = C._spread_trees(graph, ranks, g, n / g)
    negotiated = C._negotiated_trees(graph, ranks, g, n / g)
    for trees in (spread, negotiated):
        shares, rev_shares = trees[0], trees[4]
        used, back = np.flatnonzero(shares), np.flatnonzero(rev_shares)
        # the multicast: every member receives each other share once; the reduce (the same
        # links reversed): every member sends each other share's sum on once
        into = np.bincount(graph.neighbors.reshape(-1)[used], weights=shares[used], minlength=topo.boards)
        out = np.bincount(back // 6, weights=rev_shares[back], minlength=topo.boards)
        assert (into[members] == g - 1).all() and (out[members] == g - 1).all()
        assert shares.max() <= g and shares.sum() == rev_shares.sum()
    # a share on each of a board's six edges at the least: (g - 1) shares over 6 edges each way
    assert seconds(negotiated) >= 2 * np.ceil((g - 1) / 6) * (n / g) / graph.link_bw.min()
    assert seconds(negotiated) < 0.8 * seconds(spread)
    order = ring_order(topology_of(arch.replace(chips=48)), 48)
    grid = [[int(c) + b * 48 for c in order] for b in members]
    # each share cut into m parts, each part its own tree: still a multicast tree per part
    # (every member receives and sends on each other member's m parts exactly once)
    options = [seconds(spread), seconds(negotiated)]
    for m in range(2, C._SPLIT_PARTS + 1):
        if g * m > C._SPLIT_TREES:
            continue
        split = C._negotiated_trees(graph, ranks, g, n / (g * m), m)
        shares, rev_shares = split[0], split[4]
        used, back = np.flatnonzero(shares), np.flatnonzero(rev_shares)
        into = np.bincount(graph.neighbors.reshape(-1)[used], weights=shares[used], minlength=topo.boards)
        out = np.bincount(back // 6, weights=rev_shares[back], minlength=topo.boards)
        assert (into[members] == m * (g - 1)).all() and (out[members] == m * (g - 1)).all()
        assert shares.max() <= g * m
        part = n / (g * m)
        options.append(graph.link_seconds(rev_shares * part) + split[5] + graph.link_seconds(shares * part) + split[1])
    gather = all_gather(topo, grid[0], n).seconds
    # the packed trees rooted (the reduce up to each tree's root, then the multicast) only lower it
    assert board_group_all_reduce(topo, grid, n).seconds <= min(options) + gather + 1e-12
    assert board_group_all_reduce(topo, grid, n, board_gather=False).seconds <= min(options) + 1e-12
    monkeypatch.setattr(C.packing, "_packed_trees", lambda *args: None)
    assert board_group_all_reduce(topo, grid, n).seconds == pytest.approx(min(options) + gather)
    assert board_group_all_reduce(topo, grid, n, board_gather=False).seconds == pytest.approx(min(options))


def test_a_few_boards_cut_their_shares_into_parts_to_use_more_of_their_edges(sixty_four):
    """Four boards: one tree per share sends a board's three other shares over three of its six
    edges; cut into two parts each, the six parts leave over up to six edges, and the
    all-reduce is cheaper by far (each way the busiest link carries one part, not one share)."""
    from tvm_spinn.timing import collectives as C

    arch, topo = sixty_four
    graph = topo.board_graph()
    members = np.array([0, 1, 8, 9])
    halo = np.setdiff1d(np.unique(graph.neighbors[members]), members)
    ranks = np.concatenate([members, halo[halo >= 0]])
    g, n = members.size, 32768.0

    def seconds(m):
        shares, latency, _, _, rev_shares, back = C._negotiated_trees(graph, ranks, g, n / (g * m), m)
        return graph.link_seconds(rev_shares * n / (g * m)) + back + graph.link_seconds(shares * n / (g * m)) + latency

    one, two = seconds(1), seconds(2)
    assert two < 0.8 * one
    order = ring_order(topology_of(arch.replace(chips=48)), 48)
    grid = [[int(c) + b * 48 for c in order] for b in members]
    assert board_group_all_reduce(topo, grid, n, board_gather=False).seconds <= two


def test_sliced_hand_over_sends_a_slice_a_board(sixty_four):
    from tvm_spinn.timing.collectives import sliced_hand_over

    arch, topo = sixty_four
    src, dst, n = [0, 1, 8, 9], [2, 3, 10, 11], 32768.0
    chips = np.arange(48)
    whole = point_to_point(topo, np.concatenate([chips + b * 48 for b in src]),
                           np.concatenate([chips + b * 48 for b in dst]), n / 48)
    cost = sliced_hand_over(topo, src, dst, n)
    assert cost.algorithm == "sliced" and cost.nbytes == n
    # a quarter of the bytes a board: at least a slice over one board edge, well under the whole
    rate = edge_rate(topo).max()
    assert n / 4 / rate <= cost.seconds < whole.seconds / 2
    # each board sends to the nearest free board on the graph of boards: board (a, b) to
    # (a + 2, b), two board edges (board 1 is as near to 3 as to 10, and 3 comes first)
    assert cost.seconds == pytest.approx(point_to_point(
        topo, np.concatenate([chips + b * 48 for b in src]), np.concatenate([chips + b * 48 for b in dst]),
        n / 4 / 48).seconds)
    for bad in (([0, 1], [1, 2]), ([0, 1], [2]), ([0, 0], [2, 3])):
        with pytest.raises(ValueError, match="sliced_hand_over"):
            sliced_hand_over(topo, *bad, n)
