"""The narrow wires' all-reduce on owner trees (:mod:`tvm_spinn.timing.collectives.narrow`,
:func:`tvm_spinn.llm.wire.narrow_all_reduce`): the trees' loads obey the schedule's flow of
pieces and copies, the figure is never below the schedule's floor nor above the direct
schedule, and bad owners are refused."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

from tvm_spinn.llm.wire import direct_schedule, narrow_all_reduce, owner_choices, owner_schedule, wire_bytes
from tvm_spinn.timing import collectives as C
from tvm_spinn.timing.collectives import narrow as N

from _boards import board_setting

GROUPS = [[0, 1, 4], [0, 1, 4, 5], [0, 1, 2, 3, 7, 6, 5, 4], list(range(16))]


@pytest.fixture(scope="module")
def boards24():
    return board_setting(24, "spinn2-24-boards-narrow")  # a 4 x 6 torus of boards


def _grid(order, boards):
    return np.array([[c + b * 48 for c in order] for b in boards], dtype=np.int64)


def _flows(graph, load):
    """Per board: bytes (units) out of it and into it over its board edges."""
    out = load.reshape(-1, 6).sum(axis=1)
    into = np.zeros(graph.nodes)
    live = graph.neighbors >= 0
    np.add.at(into, graph.neighbors[live], load.reshape(-1, 6)[live])
    return out, into


@pytest.mark.parametrize("boards", GROUPS)
def test_owner_trees_carry_each_piece_to_its_owner_and_each_share_to_every_member(boards24, boards):
    """Flow conservation, board by board, re-derived from the schedule alone: a member sends
    one piece of every share it does not own and a relay forwards what it receives, so a
    board's pieces out less its pieces in are the member's pieces less, on an owner, the pieces
    of its shares from every other member; every member receives each share it does not own
    exactly once (a copy a tree edge into it)."""
    topo, order = boards24
    graph = topo.board_graph()
    g = len(boards)
    members = np.asarray(boards)
    region = C._board_tree_options(graph, members, 1.0)[0]
    for owners in owner_choices(graph, region, g):
        trees = N.owner_trees(graph, region, g, 544.0, 544.0, (0.0, 0.0), owners)
        owned = np.bincount(region[list(owners)], minlength=graph.nodes)
        inside = np.isin(np.arange(graph.nodes), members).astype(float)
        out, into = _flows(graph, trees.up)
        np.testing.assert_allclose(out - into, inside * (g - owned) - owned * (g - inside), atol=1e-9)
        down_out, down_in = _flows(graph, trees.down)
        np.testing.assert_allclose(down_in[members], g - owned[members], atol=1e-9)
        # the pieces cross at least the board hops from their member to the owner
        dist = C._breadth_first(C._local_links(graph, region)[1], list(owners))[0][:, :g]
        assert trees.up.sum() >= dist.sum() - 1e-9
        assert trees.up_s >= dist.max() * graph.link_hop_s.min() - 1e-15


@pytest.mark.parametrize("wire", ["int8", "fp16"])
@pytest.mark.parametrize("boards", GROUPS)
def test_figure_between_the_floor_and_the_direct_schedule(boards24, boards, wire):
    topo, order = boards24
    graph = topo.board_graph()
    grid = _grid(order, boards)
    g = len(boards)
    n = wire_bytes(wire, 8192)
    cost = narrow_all_reduce(topo, grid, n)
    trees = owner_schedule(topo, grid, n)
    assert trees is not None and trees.schedule == "owner-trees"
    direct = direct_schedule(topo, grid, n)
    assert cost.seconds == pytest.approx(min(direct.seconds, trees.seconds), rel=1e-12)
    # pipelined: never dearer than its phases one after the other
    assert trees.seconds <= trees.scatter_s + trees.gather_s + 1e-15
    bw, lat = N.owner_floor(graph, boards, n / g, n / g, trees.owners)
    on_board = C._gather_parts(topo, grid[0], n)[1]
    assert trees.seconds >= bw + lat + on_board - 1e-12
    # the members' own shares: the floor of every owner choice is that of its owners
    assert N.owner_floor(graph, boards, n / g, n / g) == N.owner_floor(graph, boards, n / g, n / g, boards)


@pytest.mark.parametrize("boards", [[0, 1]] + GROUPS)
def test_direct_schedule_above_its_phases_floors(boards24, boards):
    """The direct schedule's phases one after the other, each no cheaper than the bytes its
    boards must move over their board edges (:func:`owner_floor` with the members owning their
    own shares: the pieces alone for the reduce-scatter, the reduced shares alone for the
    all-gather); on two boards, by hand: board 0 sends half the row out over its edges."""
    topo, order = boards24
    graph = topo.board_graph()
    grid = _grid(order, boards)
    g = len(boards)
    n = wire_bytes("int8", 8192)
    direct = direct_schedule(topo, grid, n)
    assert direct.schedule == "direct" and direct.owners == tuple(boards) and direct.nbytes == n
    assert direct.seconds == direct.scatter_s + direct.gather_s
    assert direct.scatter_s >= N.owner_floor(graph, boards, n / g, 0.0)[0] - 1e-15
    assert direct.gather_s >= N.owner_floor(graph, boards, 0.0, n / g)[0] - 1e-15
    if g == 2:
        edges = graph.neighbors[boards[0]] >= 0
        assert direct.scatter_s >= (n / 2) / graph.link_bw.reshape(-1, 6)[boards[0]][edges].sum()
    assert narrow_all_reduce(topo, grid, n).seconds <= direct.seconds


def test_direct_schedule_refuses_bad_input(boards24):
    topo, order = boards24
    with pytest.raises(ValueError, match="two boards or more"):
        direct_schedule(topo, _grid(order, [0]), 100.0)
    with pytest.raises(ValueError, match="nbytes"):
        direct_schedule(topo, _grid(order, [0, 1]), float("nan"))
    with pytest.raises(ValueError, match="one board"):
        direct_schedule(topo, [[0, 48]], 100.0)


def test_sixteen_boards_beat_the_direct_schedule(boards24):
    """The Llama-2-70B row over 16 boards of 24: the owner trees are the cheaper, within 1.5x
    of their floor, and an fp16 row (twice the bytes a row, less its scales) costs more than an
    int8 row on either schedule."""
    topo, order = boards24
    graph = topo.board_graph()
    grid = _grid(order, range(16))
    n = wire_bytes("int8", 8192)
    direct = direct_schedule(topo, grid, n).seconds
    cost = narrow_all_reduce(topo, grid, n)
    assert cost.schedule == "owner-trees" and cost.seconds < 0.85 * direct
    bw, lat = N.owner_floor(graph, range(16), n / 16, n / 16, cost.owners)
    assert cost.seconds < 1.5 * (bw + lat + C._gather_parts(topo, grid[0], n)[1])
    fp16 = narrow_all_reduce(topo, grid, wire_bytes("fp16", 8192))
    assert fp16.seconds > cost.seconds
    assert direct_schedule(topo, grid, wire_bytes("fp16", 8192)).seconds > direct


def test_two_boards_and_bad_owners(boards24):
    topo, order = boards24
    graph = topo.board_graph()
    assert owner_schedule(topo, _grid(order, [0, 1]), 8704.0) is None  # two boards: halves both ways
    assert narrow_all_reduce(topo, _grid(order, [0, 1]), 8704.0).schedule == "direct"
    region = C._board_tree_options(graph, np.array([0, 1, 4]), 1.0)[0]
    with pytest.raises(ValueError, match="one owner a share"):
        N.owner_trees(graph, region, 3, 1.0, 1.0, (0.0, 0.0), (0, 1))
    with pytest.raises(ValueError, match="one owner a share"):
        N.owner_floor(graph, [0, 1, 4], 1.0, 1.0, [0, 1, 999])
    assert N.owner_floor(graph, [3], 1.0, 1.0) == (0.0, 0.0)


def test_owner_schedule_keeps_the_choices_whose_trees_are_built(boards24, monkeypatch):
    """A choice of owners whose trees are not built is skipped, not the whole schedule: on four
    boards (two choices: each member its own share, and the shares dealt to the central boards)
    with the dealt choice's trees refused, the figure is the members' own choice's."""
    topo, order = boards24
    graph = topo.board_graph()
    boards = [0, 1, 4, 5]
    grid = _grid(order, boards)
    n = wire_bytes("int8", 8192)
    share = n / 4
    region = C._board_tree_options(graph, np.asarray(boards), share)[0]
    own = tuple(range(4))
    assert len(owner_choices(graph, region, 4)) == 2 and owner_choices(graph, region, 4)[0] == own
    board = C._gather_parts(topo, grid[0], n)
    expected = N.owner_tree_cost(graph, N.owner_trees(graph, region, 4, share, share, board, own), share, share, board)
    real = N.owner_trees

    def members_only(graph_, region_, g, piece, share_, board_, owners=None):
        return real(graph_, region_, g, piece, share_, board_, owners) if tuple(owners) == own else None

    monkeypatch.setattr(N, "owner_trees", members_only)
    trees = owner_schedule(topo, grid, n)
    assert trees is not None and trees.owners == tuple(boards)
    assert trees.seconds == pytest.approx(expected, rel=1e-12)
    monkeypatch.setattr(N, "owner_trees", lambda *args, **kwargs: None)
    assert owner_schedule(topo, grid, n) is None


def test_owner_floor_refuses_a_board_without_edges_before_dividing(boards24):
    """A member with no board edges: one named ValueError, and no division by its zero rate on
    the way (warnings are errors here)."""
    topo, order = boards24
    graph = topo.board_graph()
    cut = graph.neighbors.copy()
    cut[23] = -1
    cut[cut == 23] = -1
    island = dataclasses.replace(graph, neighbors=cut, memo={})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="not joined by board edges"):
            N.owner_floor(island, [0, 1, 23], 1.0, 1.0)
        with pytest.raises(ValueError, match="not joined by board edges"):
            N.owner_floor(island, [0, 1, 4], 1.0, 1.0, [0, 1, 23])


def test_routes_free_of_the_trees_lighten_the_sixteen_boards(boards24, monkeypatch):
    """The Llama-2-70B int8 row over 16 boards of 24: each piece's own routes up (the
    schedule's routes and trees of :func:`N._owner_routes`) carry the all-reduce at least 2 us
    below the trees' own schedule (each piece up its share's multicast tree), the routes'
    loads still conserving the flow of pieces and copies and the figure above its floor."""
    topo, order = boards24
    graph = topo.board_graph()
    grid = _grid(order, [0, 1, 2, 3, 7, 6, 5, 4, 8, 9, 10, 11, 15, 14, 13, 12])
    n = wire_bytes("int8", 8192)
    routed = owner_schedule(topo, grid, n)
    # the chosen schedule's loads (memoized by the call above): a board's pieces out less its
    # pieces in are its own pieces less, on an owner, those of its shares, relays forwarding
    # all they receive; every member receives each share it does not own once
    members = grid[:, 0] // 48
    region = C._board_tree_options(graph, members, n / 16)[0]
    owners = [int(np.flatnonzero(region == o)[0]) for o in routed.owners]
    sched = N.owner_trees(graph, region, 16, n / 16, n / 16, C._gather_parts(topo, grid[0], float(n)), owners)
    owned = np.bincount(list(routed.owners), minlength=graph.nodes)
    inside = np.isin(np.arange(graph.nodes), members).astype(float)
    out, into = _flows(graph, sched.up)
    np.testing.assert_allclose(out - into, inside * (16 - owned) - owned * (16 - inside), atol=1e-12)
    relay = (inside == 0) & (owned == 0)
    assert relay.any()
    np.testing.assert_allclose(out[relay], into[relay], atol=1e-12)
    down_out, down_in = _flows(graph, sched.down)
    np.testing.assert_allclose(down_in[members], 16 - owned[members], atol=1e-12)
    # a relay forwards each copy it receives (a multicast tree may fan it out further)
    assert (down_out[relay] >= down_in[relay] - 1e-12).all() and (down_in <= 16 + 1e-12).all()
    monkeypatch.setattr(N, "_owner_routes", lambda *args, **kwargs: None)
    graph.memo.clear()
    trees = owner_schedule(topo, grid, n)
    graph.memo.clear()
    assert routed.seconds < trees.seconds - 2e-6
    bw, lat = N.owner_floor(graph, grid[:, 0] // 48, n / 16, n / 16, routed.owners)
    assert routed.seconds >= bw + lat + C._gather_parts(topo, grid[0], n)[1] - 1e-12


def _brute_cheapest(nb, root, g, price, layers):
    """The cheapest tree by enumeration (an independent reference): a tree of depth at most
    ``layers`` is the union of its members' simple ways down from the root, so the cheapest
    such union whose nodes each have one parent is the cheapest tree."""
    import itertools

    def ways(target):
        out, stack = [], [(root, (), {root})]
        while stack:
            u, path, seen = stack.pop()
            if u == target:
                out.append(path)
                continue
            if len(path) == layers:
                continue
            for k in range(6):
                v = int(nb[u, k])
                if v >= 0 and v not in seen:
                    stack.append((v, path + ((u, k),), seen | {v}))
        return out

    best = None
    for choice in itertools.product(*[ways(m) for m in range(g) if m != root]):
        links = set().union(*map(set, choice))
        heads = [int(nb[u, k]) for u, k in links]
        if len(heads) != len(set(heads)):
            continue  # a node with two parents: not a tree
        cost = sum(price[(u, k)] for u, k in links)
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cheapest_tree_matches_enumeration_and_beats_the_greedy(boards24, seed):
    """:func:`N._cheapest_tree` under random link prices on a group of three boards and the
    boards around it, two hops deep: a tree (each node one parent, every member reached from
    the root within the hops), proven by the solver and exactly as cheap as the enumeration of
    every tree, and never
    dearer than the greedy tree :func:`N._grow_tree` grows."""
    topo, _ = boards24
    graph = topo.board_graph()
    members = np.array([0, 5, 10])
    region = C._board_tree_options(graph, members, 1.0)[0]
    nb = C._local_links(graph, region)[1]
    rng = np.random.default_rng(seed)
    steps = [[(int(nb[u, k]), int(region[u]) * 6 + k) for k in range(6) if nb[u, k] >= 0] for u in range(region.size)]
    links = sorted(link for u in range(region.size) for _, link in steps[u])
    tail = {link: u for u in range(region.size) for _, link in steps[u]}
    head = {link: v for u in range(region.size) for v, link in steps[u]}
    price = {link: float(p) for link, p in zip(links, rng.uniform(0.1, 1.0, len(links)))}
    tree, proven = N._cheapest_tree(0, 3, region.size, links, tail, head, price, 2)
    assert proven
    parents = {head[link]: tail[link] for link in tree}
    assert len(parents) == len(tree) and 0 not in parents
    for m in (1, 2):
        u, hops = m, 0
        while u != 0:
            u, hops = parents[u], hops + 1
        assert hops <= 2
    cost = sum(price[link] for link in tree)
    local = {(u, k): price[int(region[u]) * 6 + k] for u in range(region.size) for k in range(6) if nb[u, k] >= 0}
    assert cost == pytest.approx(_brute_cheapest(nb, 0, 3, local, 2), rel=1e-9)
    greedy = N._grow_tree(0, 3, steps, tail, head, graph.link_hop_s, price, 2 * float(graph.link_hop_s.max()), 2)
    assert cost <= sum(price[link] for link in greedy) + 1e-12


def test_sixteen_boards_spread_their_shares_over_the_relaying_boards(boards24):
    """On 16 boards of 24 every board is as central as the members (three board hops from the
    farthest), so the owners' choices include the shares spread evenly over all 24, relays
    among them; that choice is the cheapest here (their otherwise forwarding edges add and
    multicast), and its figure stays above its own floor."""
    topo, order = boards24
    graph = topo.board_graph()
    boards = list(range(16))
    region = C._board_tree_options(graph, np.asarray(boards), 1.0)[0]
    choices = owner_choices(graph, region, 16)
    assert choices[-1] == tuple((s * 24) // 16 for s in range(16))
    n = wire_bytes("int8", 8192)
    grid = _grid(order, boards)
    cost = narrow_all_reduce(topo, grid, n)
    assert cost.schedule == "owner-trees" and set(cost.owners) - set(boards)
    bw, lat = N.owner_floor(graph, boards, n / 16, n / 16, cost.owners)
    assert cost.seconds >= bw + lat + C._gather_parts(topo, grid[0], n)[1] - 1e-12
