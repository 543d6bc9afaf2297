"""The link graph (boards of 48 chips joined by their edge links) and collectives costed on it.

Routes are checked against a brute-force breadth-first search on small systems; collective costs
against values worked out by hand from the link bandwidth ``B`` and hop latency ``a``.
"""

from __future__ import annotations

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.target.arch import ArchError
from tvm_spinn.target.topology import BOARD_CHIPS, board_grid, board_layout, topology_of
from tvm_spinn.timing import collectives as C


def _bfs(topo, source: int) -> np.ndarray:
    """Hops from ``source`` to every node by breadth-first search over the neighbour table."""
    dist = np.full(topo.nodes, -1)
    dist[source] = 0
    frontier, level = np.array([source]), 0
    while frontier.size:
        level += 1
        nxt = topo.neighbors[frontier].reshape(-1)
        nxt = np.unique(nxt[nxt >= 0])
        nxt = nxt[dist[nxt] < 0]
        dist[nxt] = level
        frontier = nxt
    return dist


def _system(boards: int):
    return topology_of(tvm_spinn.make_system(f"topo-{boards}", boards=boards))


# -- the graph -------------------------------------------------------------------------------


def test_board_layout_is_the_spinn5_hexagon():
    layout = board_layout()
    assert len(layout) == len({tuple(p) for p in layout}) == BOARD_CHIPS == 48
    x, y = layout[:, 0], layout[:, 1]
    assert ((0 <= x) & (x <= 7) & (0 <= y) & (y <= 7) & (-3 <= x - y) & (x - y <= 4)).all()
    # snake order: consecutive chips of a board are one hop apart
    board = topology_of(tvm_spinn.arch_of("spinn/board"))
    assert (board.hops(np.arange(47), np.arange(1, 48)) == 1).all()


def test_standalone_board_graph():
    topo = topology_of(tvm_spinn.arch_of("spinn/board"))
    degree = topo.degree()
    assert degree.max() == 6 and degree.min() == 3  # the hexagon's corners
    assert int((6 - degree).sum()) == 48  # 8 unconnected edge links per side of the hexagon
    assert topo.board_link.sum() == 48 and not topo.wrap
    assert (topo.neighbors[topo.board_link] == -1).all()  # a lone board's edge links lead nowhere
    for source in range(48):
        dist = _bfs(topo, source)
        assert (dist >= 0).all()  # connected
        assert np.array_equal(topo.hops(np.full(48, source), np.arange(48)), dist)


@pytest.mark.parametrize("boards", [2, 3, 4, 6])
def test_board_torus_graph_matches_bfs(boards):
    topo = _system(boards)
    assert topo.grid == board_grid(boards) and topo.nodes == topo.chips == 48 * boards
    assert (topo.degree() == 6).all()
    nodes = np.arange(topo.nodes)
    for d in range(6):  # every link has its reverse
        assert np.array_equal(topo.neighbors[topo.neighbors[:, d], (d + 3) % 6], nodes)
        assert np.array_equal(topo.board_link[topo.neighbors[:, d], (d + 3) % 6], topo.board_link[:, d])
    assert (topo.board_of(topo.neighbors[~topo.board_link]) == topo.board_of(np.repeat(nodes, 6).reshape(-1, 6)[~topo.board_link])).all()
    for source in range(0, topo.nodes, 7):
        dist = _bfs(topo, source)
        assert (dist >= 0).all()
        assert np.array_equal(topo.hops(np.full(topo.nodes, source), nodes), dist)


def test_routes_are_shortest_paths_and_symmetric():
    topo = _system(4)
    rng = np.random.default_rng(0)
    src, dst = rng.integers(0, topo.chips, 300), rng.integers(0, topo.chips, 300)
    hops = topo.hops(src, dst)
    assert np.array_equal(hops, topo.hops(dst, src))
    transfer, links = topo.route_links(src, dst)
    assert np.array_equal(np.bincount(transfer, minlength=300), hops)
    one = topo.route(int(src[0]), int(dst[0]))
    assert len(one) == hops[0] and (not one or one[0][0] == src[0])


def test_part_of_a_board_routes_through_the_boards_routers():
    topo = topology_of(tvm_spinn.make_system("four", chips=4))
    assert (topo.chips, topo.nodes, topo.boards) == (4, 48, 1)
    assert list(topo.hops([0, 0, 0], [1, 2, 3])) == [1, 2, 3]
    with pytest.raises(tvm_spinn.ArchError, match="chip ids"):
        topo.hops([0], [4])


# -- costs of transfers ------------------------------------------------------------------------


def test_shared_links_cost_more_than_disjoint_ones():
    board = tvm_spinn.arch_of("spinn/board")
    topo, n = topology_of(board), 1e6
    alone = topo.transfer_cost([0], [2], n)  # (0,0) -> (2,0): two E hops
    shared = topo.transfer_cost([0, 1], [2, 3], n)  # both cross the E link of chip 1
    disjoint = topo.transfer_cost([0, 17], [2, 19], n)  # the same route two rows up
    assert shared.max_link_bytes == 2 * n and disjoint.max_link_bytes == n
    assert shared.seconds > disjoint.seconds == pytest.approx(alone.seconds)
    assert alone.seconds == pytest.approx(n / board.payload_bw("chip") + 2 * board.link_hop_s)


def test_board_to_board_links_are_slower():
    arch = tvm_spinn.make_system("two-boards", boards=2)
    topo, n = topology_of(arch), 1e6
    chip, d = map(int, np.argwhere(topo.board_link)[0])
    on_board = int(np.argwhere(~topo.board_link[chip])[0, 0])
    far, near = int(topo.neighbors[chip, d]), int(topo.neighbors[chip, on_board])
    across, within = topo.transfer_cost([chip], [far], n), topo.transfer_cost([chip], [near], n)
    assert (across.board_hops, within.board_hops) == (1, 0)
    assert across.seconds == pytest.approx(n / arch.payload_bw("board_chip") + arch.board_link_hop_s)
    assert within.seconds == pytest.approx(n / arch.payload_bw("chip") + arch.link_hop_s)
    assert across.seconds > within.seconds
    # the published figures: ~6 Gbit/s on a board, ~2 Gbit/s between boards
    assert (arch.link_bw_bytes_s, arch.board_link_bw_bytes_s) == (6e9 / 8, 2e9 / 8)


def test_links_carry_payload_at_the_packet_share_of_their_bit_rate():
    """A SpiNNaker packet carries one 32-bit payload word under an 8-bit header and a 32-bit
    routing key: data moves at 32/72 of the bit rate, on a board and between boards."""
    arch = tvm_spinn.arch_of("spinn/board")
    assert arch.link_payload_fraction == pytest.approx(32 / 72)
    assert arch.payload_bw("chip") == pytest.approx(6e9 / 8 * 32 / 72)
    assert arch.payload_bw("board_chip") == pytest.approx(2e9 / 8 * 32 / 72)
    assert arch.payload_bw("board_pair") == pytest.approx(2e9 / 8 * 32 / 72)  # one serial link
    wide = arch.replace(link_payload_fraction=1.0, board_serial_links=8)
    assert (wide.payload_bw("chip"), wide.payload_bw("board_pair")) == (6e9 / 8, 8 * 2e9 / 8)
    topo, n = topology_of(arch), 1e6
    assert topo.transfer_cost([0], [1], n).seconds == pytest.approx(n / arch.payload_bw("chip") + arch.link_hop_s)
    with pytest.raises(ArchError, match="link"):
        arch.payload_bw("cable")


def test_a_board_edge_shares_its_serial_links():
    """The eight chip links through one board edge share the edge's serial link(s): eight
    transfers over them take eight times one transfer's time; with one serial link per chip
    link they run side by side again."""
    arch = tvm_spinn.make_system("nine", boards=9)
    topo = topology_of(arch)
    groups = topo.link_group.reshape(topo.nodes, 6)
    assert (np.bincount(topo.link_group[topo.link_group >= 0]) == 8).all()  # 6 edges x 8 links a board
    assert topo.group_bw.size == 9 * 6
    for g in range(topo.group_bw.size):  # an edge group joins one board to one neighbour
        nodes, dirs = np.nonzero(groups == g)
        assert len(set((nodes // 48).tolist())) == len(set((topo.neighbors[nodes, dirs] // 48).tolist())) == 1
    nodes, dirs = np.nonzero(groups == int(topo.link_group[topo.link_group >= 0][0]))
    far = topo.neighbors[nodes, dirs]
    n, hop = 1e5, arch.board_link_hop_s
    one = topo.transfer_cost(nodes[:1], far[:1], n)
    eight = topo.transfer_cost(nodes, far, n)
    assert one.seconds == pytest.approx(n / arch.payload_bw("board_chip") + hop)
    assert eight.seconds == pytest.approx(8 * n / arch.payload_bw("board_pair") + hop)
    wide = arch.replace(board_serial_links=8)
    assert topology_of(wide).transfer_cost(nodes, far, n).seconds == pytest.approx(one.seconds)


# -- collectives -------------------------------------------------------------------------------


def test_collectives_match_hand_computed_costs():
    arch = tvm_spinn.arch_of("spinn/board")
    B, a, n = arch.payload_bw("chip"), arch.link_hop_s, 1e6
    board = topology_of(arch)
    # two neighbours: the ring sends n/2 per step (both halves on the one link) in 2 steps;
    # the tree sends n up and n down
    assert C.all_reduce(board, [0, 1], n, "ring").seconds == pytest.approx(n / B + 2 * a)
    assert C.all_reduce(board, [0, 1], n, "tree").seconds == pytest.approx(2 * n / B + 2 * a)
    assert C.all_gather(board, [0, 1], n, "ring").seconds == pytest.approx(n / 2 / B + a)
    assert C.all_gather(board, [0, 1], n, "tree").seconds == pytest.approx(1.5 * n / B + 2 * a)
    assert C.reduce_scatter(board, [0, 1], n, "tree").seconds == pytest.approx(1.5 * n / B + 2 * a)
    # four chips in a row (0,0)..(3,0): each ring step puts n/8 each way between neighbours
    # plus the 3-hop wrap-around, so every link carries n/4; 6 steps of (n/4)/B + 3a
    ring = C.all_reduce(board, [0, 1, 2, 3], n, "ring")
    assert ring.seconds == pytest.approx(6 * (n / 4 / B + 3 * a))
    assert (ring.steps, ring.hops, ring.bytes_per_link) == (6, 18, pytest.approx(1.5 * n))
    # tree: 1->0 and 3->2 (1 hop), 2->0 (2 hops), then back: 4 steps of n
    tree = C.all_reduce(board, [0, 1, 2, 3], n, "tree")
    assert tree.seconds == pytest.approx(4 * n / B + 6 * a)
    assert (tree.steps, tree.hops, tree.algorithm) == (4, 6, "tree")
    # multicast trees: an end rank takes (and sends) three shares over its one link, three hops
    # deep, in each of the two steps: the ring's bytes, a third of its hop latencies
    mc = C.all_reduce(board, [0, 1, 2, 3], n)
    assert (mc.algorithm, mc.seconds) == ("multicast", pytest.approx(2 * (3 * n / 4 / B + 3 * a)))
    assert C.all_reduce(board, [0, 1, 2, 3], n, reproducible=True).algorithm == "tree"
    assert C.all_reduce(board, [3], n).seconds == 0.0


def test_tree_for_tiny_messages_ring_for_large_ones():
    board = topology_of(tvm_spinn.arch_of("spinn/board"))
    ring_tree = ("ring", "tree")
    tiny, large = (C.all_reduce(board, range(48), n, a) for n, a in ((4, "auto"), (64e6, "auto")))
    assert (tiny.algorithm, large.algorithm) == ("multicast", "multicast")  # all 6 links, 2 board diameters
    assert min((C.all_reduce(board, range(48), 4, a) for a in ring_tree), key=lambda c: c.seconds).algorithm == "tree"
    assert min((C.all_reduce(board, range(48), 64e6, a) for a in ring_tree), key=lambda c: c.seconds).algorithm == "ring"
    assert C.reduce_scatter(board, range(48), 48 * 4, "tree").seconds < C.reduce_scatter(board, range(48), 48 * 4, "ring").seconds
    # a tiny all-gather: the multicast's one step of 7 hops beats the tree's 12 steps
    assert C.all_gather(board, range(48), 48 * 4).algorithm == "multicast"
    assert C.reduce_scatter(board, range(48), 64e6, "ring").seconds < C.reduce_scatter(board, range(48), 64e6, "tree").seconds
    assert C.all_gather(board, range(48), 64e6).algorithm == "multicast"  # all 6 links, not a ring's 2
    assert C.all_reduce(board, range(48), 64e6, reproducible=True).algorithm == "tree"


def test_multicast_all_gather_spreads_over_all_links():
    """The multicast all-gather: each rank's share streams along a shortest-path tree of the
    ranks' own links (the routers copy packets), the trees chosen to load the links evenly."""
    from tvm_spinn.target.topology import ring_order

    arch = tvm_spinn.arch_of("spinn/board")
    B, a = arch.payload_bw("chip"), arch.link_hop_s
    board = topology_of(arch)
    n = 3e5
    # chips 0, 1, 2 at (0, 0), (1, 0), (2, 0): links 1->0 and 1->2 carry two shares (1's and the
    # far end's) of n/3, two hops deep; the ring pays its 2-hop wrap-around in each of 2 steps
    assert C.all_gather(board, [0, 1, 2], n, "multicast").seconds == pytest.approx(2 * n / 3 / B + 2 * a)
    assert C.all_gather(board, [0, 1, 2], n, "ring").seconds == pytest.approx(2 * n / 3 / B + 4 * a)
    assert C.all_gather(board, [0, 1], n, "multicast").seconds == pytest.approx(n / 2 / B + a)
    # a whole board: a hexagon corner chip has 3 links, over which it must receive 47 of 48 shares
    n = 786432
    order = ring_order(board, 48)
    ring, mc = C.all_gather(board, order, n, "ring"), C.all_gather(board, order, n, "multicast")
    assert (mc.algorithm, mc.steps, mc.hops, mc.board_hops) == ("multicast", 1, 7, 0)  # the board's diameter
    corner = 47 / 3 * n / 48
    assert corner <= mc.bytes_per_link <= 1.05 * corner
    assert mc.seconds == pytest.approx(mc.bytes_per_link / B + 7 * a)
    assert mc.seconds < 0.7 * ring.seconds
    assert C.all_gather(board, order, n) == mc == C.all_gather(board, order, n, "multicast")  # auto; deterministic
    # chips 0 and 5 are not linked to each other: no multicast tree of their own links
    with pytest.raises(ValueError, match="multicast"):
        C.all_gather(board, [0, 5], n, "multicast")
    assert C.all_gather(board, [0, 5], n).algorithm == "ring"
    two = topology_of(tvm_spinn.make_system(boards=2))
    assert C.all_gather(two, range(96), n).algorithm != "multicast"  # over MULTICAST_MAX_RANKS
    with pytest.raises(ValueError, match="at most 64"):
        C.all_gather(two, range(96), n, "multicast")


def _brute_force_reduce_loads(topo, ranks):
    """Shares each directed link carries in a reduce-scatter where every rank sends shard ``s``
    to a neighbour one hop closer to rank ``s`` (independently of the library: BFS over the
    ranks' own links, lowest link id among the closer neighbours), and the deepest route."""
    import collections

    member = {int(r): i for i, r in enumerate(ranks)}
    load, deepest = collections.Counter(), 0
    for s in ranks:
        dist, queue = {int(s): 0}, [int(s)]
        for u in queue:
            for v in topo.neighbors[u]:
                if int(v) in member and int(v) not in dist:
                    dist[int(v)] = dist[u] + 1
                    queue.append(int(v))
        for v in ranks:
            hops, node = 0, int(v)
            while node != int(s):
                d = min(d for d, u in enumerate(topo.neighbors[node]) if dist.get(int(u), -1) == dist[node] - 1)
                load[node * 6 + d] += 1
                node, hops = int(topo.neighbors[node][d]), hops + 1
            deepest = max(deepest, hops)
    return load, deepest


def test_multicast_all_reduce_matches_hand_computed_and_brute_force_schedules():
    """All-reduce of integer partial sums by the multicast trees: a reduce-scatter along the
    trees run backwards, then the multicast all-gather."""
    from tvm_spinn.target.topology import ring_order

    arch = tvm_spinn.arch_of("spinn/board")
    B, a = arch.payload_bw("chip"), arch.link_hop_s
    board = topology_of(arch)
    n = 3e5
    # two neighbours: each sends the other its half (one hop), then each multicasts its reduced half
    assert C.reduce_scatter(board, [0, 1], n, "multicast").seconds == pytest.approx(n / 2 / B + a)
    assert C.all_reduce(board, [0, 1], n, "multicast").seconds == pytest.approx(n / B + 2 * a)
    # three in a row (0,0), (1,0), (2,0): the outer ranks send two shares to the middle one
    # (theirs for it and the far end's, added there), two hops deep; then the all-gather
    rs = C.reduce_scatter(board, [0, 1, 2], n, "multicast")
    assert rs.seconds == pytest.approx(2 * n / 3 / B + 2 * a)
    ar = C.all_reduce(board, [0, 1, 2], n, "multicast")
    assert ar.seconds == pytest.approx(4 * n / 3 / B + 4 * a)
    assert (ar.steps, ar.hops, ar.bytes_per_link) == (2, 4, pytest.approx(2 * n / 3 + n / 3))
    # a whole board: no link busier than the brute-force schedule's (shortest paths towards each
    # shard's owner) and the same depth; every rank sends c - 1 shares in all
    order = ring_order(board, 48)
    load, deepest = _brute_force_reduce_loads(board, order)
    rs = C.reduce_scatter(board, order, 48 * 1024, "multicast")
    assert rs.hops == deepest == 7
    assert rs.bytes_per_link <= max(load.values()) * 1024
    assert rs.seconds == pytest.approx(rs.bytes_per_link / B + 7 * a)
    # a 4 KB all-reduce on a board: about two board diameters of hops, not the ring's 94
    small = C.all_reduce(board, order, 4096)
    assert small.algorithm == "multicast"
    assert 10e-6 <= small.seconds <= 16e-6
    assert small.seconds < 0.3 * C.all_reduce(board, order, 4096, "ring").seconds
    # bit-reproducible sums never take it; groups it is not built for fall back
    assert C.all_reduce(board, order, 4096, reproducible=True).algorithm == "tree"
    with pytest.raises(ValueError, match="multicast all-reduce"):
        C.all_reduce(board, [0, 5], n, "multicast")
    assert C.all_reduce(board, [0, 5], n).algorithm in ("ring", "tree")


def test_board_all_reduce_runs_the_chip_slices_at_once_on_shared_board_edges():
    """Across boards: chip i of every board reduces slice i with its counterparts, all slices at
    once (sharing the board edges), then each board gathers its slices."""
    from tvm_spinn.target.topology import ring_order

    arch = tvm_spinn.make_system(boards=4)
    topo = topology_of(arch)
    order = ring_order(topology_of(tvm_spinn.arch_of("spinn/board")), 48)
    n = 32768
    # one chip per board: the plain all-reduce over those chips (ring or tree), no gather
    one = C.board_all_reduce(topo, [[48 * b] for b in range(4)], n)
    plain = min((C.all_reduce(topo, [48 * b for b in range(4)], n, a) for a in ("ring", "tree")), key=lambda c: c.seconds)
    assert one.seconds == pytest.approx(plain.seconds)
    assert one.algorithm == f"board-{plain.algorithm}"
    # every chip: the slices share the edges' serial links; each board must still send the
    # others at least (g - 1) / g of its buffer over its six edges
    grid = [order + 48 * b for b in range(4)]
    full = C.board_all_reduce(topo, grid, n)
    assert full.seconds >= 3 / 4 * n / (6 * arch.payload_bw("board_pair"))
    gather = C.all_gather(topo, grid[0], n)
    ring = C.board_all_reduce(topo, grid, n, "ring")
    # 2 (g - 1) ring steps of n / (2 g k) per chip link each way, plus the board's gather
    assert ring.steps == 6 + gather.steps and ring.seconds > gather.seconds
    assert full.seconds == min(ring.seconds, C.board_all_reduce(topo, grid, n, "tree").seconds)
    assert C.board_all_reduce(topo, [order], n).seconds == 0.0  # one board: nothing crosses
    with pytest.raises(ValueError, match="boards x chips"):
        C.board_all_reduce(topo, [1, 2, 3], n)
    with pytest.raises(ValueError, match="distinct"):
        C.board_all_reduce(topo, [[0, 1], [1, 2]], n)


def test_point_to_point_and_bad_calls():
    board = topology_of(tvm_spinn.arch_of("spinn/board"))
    p2p = C.point_to_point(board, [0, 1], [2, 3], 1e6)
    assert (p2p.algorithm, p2p.steps, p2p.hops, p2p.ranks) == ("direct", 1, 2, 4)
    assert p2p.seconds == pytest.approx(board.transfer_cost([0, 1], [2, 3], 1e6).seconds)
    with pytest.raises(ValueError, match="distinct"):
        C.all_reduce(board, [0, 0], 1.0)
    with pytest.raises(ValueError, match="algorithm"):
        C.all_reduce(board, [0, 1], 1.0, "butterfly")
    with pytest.raises(TypeError, match="Topology"):
        C.all_reduce(tvm_spinn.arch_of("spinn/board"), [0, 1], 1.0)


# -- the fixed reduction order -----------------------------------------------------------------


def test_reduction_order_is_a_fixed_tree_over_logical_ranks():
    assert C.reduction_order(1) == ()
    assert C.reduction_order(5) == ((0, 1), (2, 3), (0, 2), (0, 4))
    assert C.chip_blocks(8, 3) == ((0, 4), (4, 8))
    assert C.chip_blocks(6, 4) == ((0, 2), (2, 4), (4, 6))
    assert C.chip_blocks(5, 1) == ((0, 5),)
    negative_zero = C.fixed_order_sum([np.float32(-0.0)] * 3)
    assert np.signbit(negative_zero)  # absent operands are skipped, never added as +0.0


@pytest.mark.parametrize("logical", [8, 12, 13])
def test_fixed_order_sum_has_the_same_bits_on_any_chip_count(logical):
    rng = np.random.default_rng(logical)
    parts = [(rng.standard_normal(64) * 10.0 ** rng.integers(-6, 6)).astype(np.float32) for _ in range(logical)]
    reference = C.fixed_order_sum(parts)
    order = C.reduction_order(logical)
    for chips in (1, 2, 3, 4, 8, 16):
        blocks = C.chip_blocks(logical, chips)
        acc = [p.copy() for p in parts]
        # each chip adds its own block, then the chips combine: both in reduction_order's order
        inside = [s for s in order if any(lo <= s[0] and s[1] < hi for lo, hi in blocks)]
        across = [s for s in order if s not in inside]
        for left, right in inside + across:
            acc[left] = acc[left] + acc[right]
        assert acc[0].tobytes() == reference.tobytes()
    assert sum(parts).tobytes() != reference.tobytes() or logical < 3  # the order matters


# -- systems -----------------------------------------------------------------------------------


def test_make_system_boards_and_bad_numbers():
    assert tvm_spinn.make_system("b2", boards=2).chips == 96
    assert tvm_spinn.make_system("b2", boards=2, chips=96).boards == 2
    assert tvm_spinn.make_system("c4", chips=4).boards == 1
    assert board_grid(720) == (24, 30) and board_grid(7) == (1, 7)
    bad = [
        (dict(boards=0), "boards"), (dict(boards=-3), "boards"), (dict(boards=1.5), "boards"),
        (dict(boards=2, chips=100), "boards=2.*chips=100"), (dict(chips=100), "SpinnArch.chips"),
        (dict(link_bw_bytes_s=0), "link_bw_bytes_s"), (dict(board_link_bw_bytes_s=0.0), "board_link_bw_bytes_s"),
        (dict(link_hop_s=-1e-6), "link_hop_s"), (dict(board_link_hop_s=float("nan")), "board_link_hop_s"),
        (dict(chips_per_board=0), "chips_per_board"),
    ]
    for fields, message in bad:
        with pytest.raises(tvm_spinn.ArchError, match=message):
            tvm_spinn.make_system("bad", **fields)
    with pytest.raises(tvm_spinn.ArchError, match="chips_per_board"):
        topology_of(tvm_spinn.make_system("odd", chips_per_board=24, chips=48))
    with pytest.raises(tvm_spinn.ArchError, match="links_per_chip"):
        topology_of(tvm_spinn.make_system("mesh", links_per_chip=4))


def test_topology_fields_stay_out_of_programs_at_their_defaults():
    board = tvm_spinn.arch_of("spinn/board")
    assert not {"chips_per_board", "board_link_bw_bytes_s", "link_hop_s", "board_link_hop_s"} & set(board.to_dict())
    slow = board.replace(board_link_bw_bytes_s=1e8)
    assert slow.to_dict()["board_link_bw_bytes_s"] == 1e8
    assert tvm_spinn.SpinnArch.from_dict(slow.to_dict()) == slow
    assert tvm_spinn.SpinnArch.from_dict(board.to_dict()) == board


def test_spinn_cloud_builds_and_costs_a_system_wide_collective():
    cloud = tvm_spinn.arch_of("spinn/cloud")
    assert (cloud.chips, cloud.boards) == (34560, 720)
    topo = topology_of(cloud)
    assert topo.grid == (24, 30) and (topo.degree() == 6).all()
    assert topo.board_link.sum() == 48 * 720  # 48 edge links a board, all cabled
    for source in (0, 20000):  # hop counts against a search over the whole graph
        dist = _bfs(topo, source)
        assert np.array_equal(topo.hops(np.full(topo.chips, source), np.arange(topo.chips)), dist)
    ranks = np.arange(cloud.chips)
    for op in (C.all_reduce, C.all_gather, C.reduce_scatter):
        for algorithm in ("ring", "tree"):
            cost = op(topo, ranks, 1e6, algorithm)
            assert cost.ranks == 34560 and cost.seconds > 0 and cost.board_hops > 0
    tiny, large = C.all_reduce(topo, ranks, 4), C.all_reduce(topo, ranks, 1e9)
    assert tiny.algorithm == "tree" and large.algorithm == "ring"


def test_ring_order_is_a_cycle_of_one_hop_links():
    """A whole board's tensor-parallel group is ordered along a Hamiltonian cycle of its links,
    so a ring collective's every step crosses one link (the id order closes its ring over 7
    hops): the ring all-gather is several times cheaper."""
    from tvm_spinn.target.topology import ring_order

    topo = topology_of(tvm_spinn.arch_of(tvm_spinn.get_target("spinn/board")))
    for count in (16, 24, 48):
        order = ring_order(topo, count)
        assert sorted(order.tolist()) == list(range(count))
        assert (topo.hops(order, np.roll(order, -1)) == 1).all()
    n = 32768
    ring = C.all_gather(topo, ring_order(topo, 48), n, algorithm="ring")
    by_id = C.all_gather(topo, np.arange(48), n, algorithm="ring")
    assert ring.hops == 47 and ring.seconds < by_id.seconds / 3
    assert list(ring_order(topo, 3)) == [0, 1, 2]  # no 3-cycle among chips 0..2: id order
    with pytest.raises(ValueError, match="count"):
        ring_order(topo, 49)
