"""The play of packed trees chunk by chunk (:func:`tvm_spinn.timing.collectives._played_schedule`)
against a reference play that keeps every rule in its plainest form (a function per pass, every
queued entry naming its tree, chunk, ends and place): the same seconds, to the last bit, on the
packed trees a 24-board group and the cloud's planner play (every span cap's weights, three sizes),
and on random trees with ties of every kind (equal rates and hops, equal weights)."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_spinn.timing import collectives as C

from _boards import N, board_setting


def _reference_play(trees, rates, hops, weight, members, nbytes, chunks, horizon):
    """The play as the docstring of :func:`~tvm_spinn.timing.collectives._played_schedule` states
    it: per (tree, node) and chunk the neighbours heard from and passed to; a node passes a chunk
    to a neighbour once it has it from every other one; each directed link passes its queued
    chunks one at a time, the one due first (less the latency beyond the link) first; events in
    time order, ties in the order they were made."""
    import heapq

    heappush, heappop = heapq.heappush, heapq.heappop
    adj = []  # per tree: node -> [(neighbour, directed link from node to it)]
    for edges in trees:
        nbrs: dict = {}
        for v, u, down, up in edges:
            nbrs.setdefault(u, []).append((v, down))
            nbrs.setdefault(v, []).append((u, up))
        adj.append(nbrs)
    used = [j for j, w in enumerate(weight) if w > 0]
    ids: dict = {}  # (tree, node) -> its number
    for j in used:
        for u in sorted(adj[j]):
            ids[j, u] = len(ids)
    # per numbered node: its tree, its node, its neighbours in order as (their number, the link to
    # them, the latency from them to the farthest member beyond, this node's place in their list)
    owner = [key for key in ids]
    out: list = [None] * len(ids)
    for (j, u), n in ids.items():
        nbrs = adj[j]
        row = []
        for v, link in nbrs[u]:
            far, stack = 0.0, [(v, u, 0.0)]
            while stack:
                x, came, d = stack.pop()
                if x < members:
                    far = max(far, d)
                stack += [(y, x, d + hops[l]) for y, l in nbrs[x] if y != came]
            back = next(k for k, (y, _) in enumerate(nbrs[v]) if y == u)
            row.append((ids[j, v], link, far, back))
        out[n] = row
    degree = [len(row) for row in out]
    member = [u < members for _, u in owner]
    due = [(c + 1) / chunks * horizon for c in range(chunks)]
    part = [w * nbytes / chunks for w in weight]  # a chunk's bytes on each tree
    heard = [0] * (len(ids) * chunks)  # per (node, chunk): how many neighbours it has the chunk from
    heard_from = [0] * (len(ids) * chunks)  # and which (a bit per place in its list)
    sent = [0] * (len(ids) * chunks)  # the neighbours it has passed the chunk on to
    queue: list = [[] for _ in rates]  # per link: heap of (due, tree, chunk, from, to, to's number, place)
    busy_until = [0.0] * len(rates)
    starting: list = [None] * len(rates)  # per link: the time of its start event still in ``events``
    events: list = []  # (time, order, link, None: the link may start its next chunk; else an arrival)
    order = 0

    def offer(t, n, c, at, count, need):
        """Node ``n`` (``at``: its entry for chunk ``c``) has heard from ``count`` of its neighbours,
        at least ``need`` (all but one): it passes the chunk on to each it may and has not yet."""
        nonlocal order
        got, done_to = heard_from[at], sent[at]
        j, u = owner[n]
        for k, (m, link, far, back) in enumerate(out[n]):
            bit = 1 << k
            # n has the chunk from every tree neighbour but this one
            if count - (1 if got & bit else 0) == need and not done_to & bit:
                done_to |= bit
                heappush(queue[link], (due[c] - far, j, c, u, owner[m][1], m, back))
                if busy_until[link] > t or starting[link] == t:
                    continue  # its start event is due no later than t: nothing more to do now
                starting[link] = t
                order += 1
                heappush(events, (t, order, link, None))
        sent[at] = done_to

    for j in used:  # the leaves start (a node with more neighbours waits to hear from them)
        leaves = [ids[j, u] for u in sorted(adj[j]) if len(adj[j][u]) == 1]
        for c in range(chunks):
            for n in leaves:
                offer(0.0, n, c, n * chunks + c, 0, 0)
    done = 0.0
    while events:
        t, _, link, arrival = heappop(events)
        if arrival is None:  # an edge may start its next chunk
            starting[link] = None
            if busy_until[link] > t or not queue[link]:
                continue
            _, j, c, _, _, m, back = heappop(queue[link])
            end = t + part[j] / rates[link]
            busy_until[link] = end
            starting[link] = end  # the link's next start, then the chunk's arrival past the hop
            order += 1
            heappush(events, (end, order, link, None))
            order += 1
            heappush(events, (end + hops[link], order, link, (m, c, back)))
        else:
            m, c, back = arrival
            at = m * chunks + c
            heard[at] = count = heard[at] + 1
            heard_from[at] |= 1 << back
            if member[m]:
                done = max(done, t)
            if count >= degree[m] - 1:  # else it has no neighbour to pass the chunk on to yet
                offer(t, m, c, at, count, degree[m] - 1)
    for n, (j, u) in enumerate(owner):  # every member has every chunk from all its tree neighbours
        if member[n] and any(heard[n * chunks + c] != degree[n] for c in range(chunks)):
            raise RuntimeError(f"packed tree {j} left member {u} without its sums (a tree that is not one)")
    return done


def _plays_of(boards: int, group, name: str):
    """Every play the packed trees of ``group`` on ``boards`` boards ask for: each span cap's
    weights at three sizes of the row (the all-reduce's and two of its streamed runs)."""
    topo, _ = board_setting(boards, name)
    graph = topo.board_graph()
    members = np.asarray(list(group))
    halo = np.setdiff1d(np.unique(graph.neighbors[members]), members)
    region = np.concatenate([members, halo[halo >= 0]])
    out = []
    for nbytes in (N, N / 4, 3 * N / 4):
        if C._priority_fluid(graph, region, members.size, nbytes) is None:
            continue
        fluids = graph.memo[("priority_fluid", region.tobytes(), int(members.size), float(nbytes))]
        shapes = graph.memo[("packed_shapes", region.tobytes(), int(members.size))][3]
        for fluid in fluids:
            out.append((graph, region, shapes, fluid[4], members.size, nbytes, fluid[0]))
    return out


def _hashable(graph, ranks, shapes, weight, members, nbytes, chunks, horizon):
    """The arguments :func:`~tvm_spinn.timing.collectives._chunked_schedule` passes on: spy on them."""
    seen = []
    real = C.schedule._played_schedule
    try:
        C.schedule._played_schedule = lambda *a: seen.append(a) or 0.0
        C._chunked_schedule(graph, ranks, shapes, weight, members, nbytes, chunks, horizon)
    finally:
        C.schedule._played_schedule = real
    return seen[0]


@pytest.mark.parametrize("boards, group", [(4, range(3)), (24, range(16)), (24, [0, 1, 6, 7])])
def test_the_play_is_the_reference_play_to_the_bit_on_packed_trees(boards, group):
    plays = _plays_of(boards, group, f"spinn2-play-{boards}-boards")
    assert plays
    for graph, region, shapes, weight, members, nbytes, horizon in plays:
        for chunks in (1, 4, C._SCHEDULE_CHUNKS):
            args = _hashable(graph, region, shapes, weight, members, nbytes, chunks, horizon)
            got = C.schedule._played_schedule.__wrapped__(*args)
            want = _reference_play(*args)
            assert got == want, (chunks, got, want)
            assert got > 0


def _random_tree(rng, nodes: int, links: int) -> tuple:
    """A random tree over ``nodes`` nodes, its edges on distinct directed links of ``links``."""
    free = list(rng.permutation(links))
    edges = []
    for v in range(1, nodes):
        u = int(rng.integers(0, v))
        edges.append((v, u, int(free.pop()), int(free.pop())))
    return tuple(edges)


@pytest.mark.parametrize("seed", range(6))
def test_the_play_is_the_reference_play_to_the_bit_on_random_trees_with_ties(seed):
    rng = np.random.default_rng(seed)
    links = 40
    nodes = int(rng.integers(3, 9))
    trees = tuple(_random_tree(rng, nodes, links) for _ in range(int(rng.integers(1, 5))))
    # equal rates and hops (every chunk ties with another) or a few distinct ones
    rates = tuple(float(x) for x in (np.full(links, 1e8) if seed % 2 else rng.choice([1e8, 2e8, 4e8], links)))
    hops = tuple(float(x) for x in (np.full(links, 4.5e-6) if seed % 3 else rng.choice([2e-6, 4.5e-6], links)))
    weight = tuple(float(x) for x in ([1.0 / len(trees)] * len(trees) if seed % 2 else rng.dirichlet(np.ones(len(trees)))))
    members = int(rng.integers(2, nodes + 1))
    for chunks in (1, 3, 8):
        args = (trees, rates, hops, weight, members, float(N), chunks, 1e-4)
        got = C.schedule._played_schedule.__wrapped__(*args)
        assert got == _reference_play(*args)
        assert got > 0
