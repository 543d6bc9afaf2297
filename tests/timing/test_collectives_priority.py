"""The packed trees of every span at once, the longer trees' parts sent first
(:func:`tvm_spinn.timing.collectives._priority_packing`), checked against an event simulation
of a schedule on the link graph: every tree's part cut into chunks, each directed board edge a
server passing the ready chunks one at a time at its rate, each chunk then a hop latency on
its way, a tree node passing a chunk on towards a neighbour once the chunk has reached it from
all its other tree neighbours (the partial sums added on the way), and a member done once
every chunk has reached it from all its tree neighbours. An edge passes first the ready chunk
due first: chunk ``c`` of ``m`` is due ``(c + 1) / m`` of the way through the figure under
test, less the latency from the edge to the farthest member beyond it (a chunk of a longer
tree has further to go, so it goes earlier)."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.target.topology import ring_order, topology_of
from tvm_spinn.timing import collectives as C

N = 32768.0  # an 8,192-wide row of int32 partial sums


def _setting(boards: int):
    arch = tvm_spinn.make_system(f"spinn2-priority-{boards}-boards", boards=boards)
    topo = topology_of(arch)
    order = [int(c) for c in ring_order(topology_of(arch.replace(chips=48)), 48)]
    return topo, order


def _simulate(graph, ranks: np.ndarray, shapes, span: np.ndarray, weight: np.ndarray, members: int,
              nbytes: float, chunks: int, horizon: float) -> float:
    """Seconds until every member holds every chunk's sum, by discrete events (see the module
    docstring); ``shapes``: each tree's ``(root, ((node, local link from its parent), ...))``
    over the local nodes ``ranks`` (the first ``members`` the group's boards); ``horizon``:
    the figure whose pace sets when each chunk is due."""
    adj = []  # per tree: node -> [(neighbour, directed global link from node to it)]
    for root, parent in shapes:
        nbrs: dict = {}
        for v, link in parent:
            u, k = link // 6, link % 6
            nbrs.setdefault(u, []).append((v, int(ranks[u]) * 6 + k))
            nbrs.setdefault(v, []).append((u, int(ranks[v]) * 6 + (k + 3) % 6))
        adj.append(nbrs)
    # per tree and directed edge (u, v): latency from v on to the farthest member beyond it
    ahead: dict = {}
    for j, nbrs in enumerate(adj):
        for u in nbrs:
            for v, link in nbrs[u]:
                far, stack = 0.0, [(v, u, 0.0)]
                while stack:
                    x, came, d = stack.pop()
                    if x < members:
                        far = max(far, d)
                    stack += [(y, x, d + float(graph.link_hop_s[l])) for y, l in nbrs[x] if y != came]
                ahead[j, u, v] = far
    got: dict = {}  # (tree, chunk, node) -> neighbours heard from
    sent: set = set()
    queue: dict = {}  # link -> heap of (priority, tree, chunk, src, dst)
    busy_until: dict = {}
    events: list = []  # (time, seq, kind, payload)
    seq = [0]

    def push(t, kind, payload):
        seq[0] += 1
        heapq.heappush(events, (t, seq[0], kind, payload))

    def ready(t, j, c, u):
        heard = got.get((j, c, u), set())
        for v, link in adj[j][u]:
            if (j, c, u, v) not in sent and all(x == v or x in heard for x, _ in adj[j][u]):
                sent.add((j, c, u, v))
                key = ((c + 1) / chunks * horizon - ahead[j, u, v], j, c)
                heapq.heappush(queue.setdefault(link, []), (key, j, c, u, v))
                push(t, "try", link)

    for j in np.flatnonzero(weight > 0):
        for c in range(chunks):
            for u in sorted(adj[j]):
                ready(0.0, int(j), c, u)
    done = 0.0
    while events:
        t, _, kind, payload = heapq.heappop(events)
        if kind == "try":
            link = payload
            if busy_until.get(link, 0.0) > t or not queue.get(link):
                continue
            _, j, c, u, v = heapq.heappop(queue[link])
            end = t + weight[j] * nbytes / chunks / float(graph.link_bw[link])
            busy_until[link] = end
            push(end, "try", link)
            push(end + float(graph.link_hop_s[link]), "arrive", (j, c, u, v))
        else:
            j, c, u, v = payload
            got.setdefault((j, c, v), set()).add(u)
            if v < members:
                done = max(done, t)
            ready(t, j, c, v)
    # every member heard every chunk from every tree neighbour
    for j in np.flatnonzero(weight > 0):
        for m in range(members):
            if m in adj[j]:
                for c in range(chunks):
                    assert got.get((j, c, m), set()) == {x for x, _ in adj[j][m]}
    return done


@pytest.mark.parametrize("boards, group, chunks", [(4, range(3), 32), (24, range(16), 32)])
def test_the_priority_schedule_is_what_an_event_simulation_of_it_takes(boards, group, chunks):
    """The figure is reached by the schedule it describes, played chunk by chunk with each
    edge passing the chunk due first (its share of the row's time less the latency still
    ahead of it), within one chunk's store-and-forward on each hop of the longest route (a
    board's packets carry 4 bytes each: the row moves as thousands of packets, so that term
    vanishes), and it is never below the group's floor, nor above the packed trees of any one
    span cap."""
    topo, order = _setting(boards)
    graph = topo.board_graph()
    members = np.asarray(list(group))
    halo = np.setdiff1d(np.unique(graph.neighbors[members]), members)
    region = np.concatenate([members, halo[halo >= 0]])
    seconds, load, first, hops, weight = C._priority_packing(graph, region, members.size, N)
    full, span, span_hops, shapes, start = graph.memo[("packed_shapes", region.tobytes(), members.size)]
    simulated = _simulate(graph, region, shapes, span, weight, members.size, N, chunks, seconds)
    step = float((weight.max() * N / chunks / graph.link_bw[np.isfinite(graph.link_bw)]).max())
    assert simulated <= seconds + (hops + 2) * step
    bandwidth, latency = C.board_group_floor(topo, members, N)
    assert bandwidth + latency <= seconds
    assert bandwidth + latency <= simulated
    options, _ = C._packed_trees(graph, region, members.size)
    assert seconds <= min(graph.link_seconds(o[0] * N) + o[1] for o in options) + 1e-12
    # the weights split the whole row; the loads are theirs
    assert weight.sum() == pytest.approx(1.0) and np.all(weight >= 0)
    np.testing.assert_allclose(load, weight @ full)
    # board_group_all_reduce takes it where it is the cheapest
    cost = C.board_group_all_reduce(topo, [[c + b * 48 for c in order] for b in members], N,
                                    board_gather=False, pipelined=True)
    assert cost.seconds <= seconds + 1e-12
