"""The event simulation that plays a packed-tree all-reduce out chunk by chunk on the graph of boards.

Separate from the trees it plays: it needs only each tree's edges, rates and hop latencies, and
the play itself is memoized on those hashable values (:func:`_played_schedule`), so the same
patch of boards in another graph is played once.
"""

from __future__ import annotations

import functools

import numpy as np


#: Chunks each tree's part is cut into by :func:`_chunked_schedule` (a chunk crosses a board
#: edge whole before it goes on: fewer chunks, a dearer figure; the boards' 4-byte packets
#: would go on one by one)
_SCHEDULE_CHUNKS = 32


def _chunked_schedule(graph, ranks: np.ndarray, shapes, weight: np.ndarray, members: int, nbytes: float,
                      chunks: int, horizon: float) -> float:
    """Seconds of the packed trees' all-reduce played out by discrete events on the graph of
    boards: tree ``j`` (``shapes[j]``: ``(root, ((node, local link from its parent), ...))``
    over the local nodes ``ranks``, the first ``members`` the group's boards) carries
    ``weight[j]`` of the ``nbytes`` row cut into ``chunks`` chunks; a node passes chunk ``c``
    on towards a tree neighbour once the chunk has reached it from all its other tree
    neighbours (their partial sums added to its own), each directed board edge passes one
    chunk at a time at its rate, then the chunk takes the edge's hop latency; the all-reduce
    is done when every member has every chunk from all its tree neighbours. Where several
    chunks wait for an edge it passes the one due first: chunk ``c`` is due ``(c + 1) /
    chunks`` of the way through ``horizon``, less the latency from the edge to the farthest
    member beyond it (a chunk with further to go goes earlier)."""
    # the trees over local links, numbered as met: the play depends on nothing else of the
    # graph, so the same patch of boards in another graph (the planner's ladder of
    # allocations) is played once (:func:`_played_schedule`, cached)
    local: dict = {}
    rates, hops, trees = [], [], []
    for _, parent in shapes:
        edges = []
        for v, link in parent:
            u, k = link // 6, link % 6
            ends = []
            for glob in (int(ranks[u]) * 6 + k, int(ranks[v]) * 6 + (k + 3) % 6):
                if glob not in local:
                    local[glob] = len(local)
                    rates.append(float(graph.link_bw[glob]))
                    hops.append(float(graph.link_hop_s[glob]))
                ends.append(local[glob])
            edges.append((int(v), int(u), ends[0], ends[1]))
        trees.append(tuple(edges))
    return _played_schedule(tuple(trees), tuple(rates), tuple(hops), tuple(float(w) for w in weight),
                            int(members), float(nbytes), int(chunks), float(horizon))


@functools.lru_cache(maxsize=256)
def _played_schedule(trees: tuple, rates: tuple, hops: tuple, weight: tuple, members: int, nbytes: float,
                     chunks: int, horizon: float) -> float:
    """:func:`_chunked_schedule` on hashable values: ``trees[j]`` tree ``j``'s edges ``(node,
    its parent, link parent to node, link node to parent)``, the links numbered into ``rates``
    (bytes/s) and ``hops`` (seconds); ``weight[j]`` its share of the row.

    Every (tree, node) is numbered and keeps, per chunk, how many tree neighbours it has the
    chunk from (``heard``, and which: a bit per neighbour) and which it has passed it on to
    (``sent``): a node passes a chunk on only once it has heard from all its neighbours but
    one, so most arrivals end at a count, and the play runs as flat lists rather than sets."""
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
    # per link: heap of (due, tree, chunk, to's number, place); a link carries a tree's chunk once,
    # so (tree, chunk) decides every tie of ``due``
    queue: list = [[] for _ in rates]
    busy_until = [0.0] * len(rates)
    starting: list = [None] * len(rates)  # per link: the time of its start event still in ``events``
    events: list = []  # (time, order, link, None: the link may start its next chunk; else an arrival)
    # per numbered node, its neighbours as (bit, their number, link, latency beyond, place): what
    # passing a chunk on reads, looked up once
    rows = [tuple((1 << k, m, link, far, back) for k, (m, link, far, back) in enumerate(row)) for row in out]
    order = 0
    # A node passes chunk ``c`` on to each tree neighbour it has not yet passed it to once it has
    # the chunk from every other neighbour: having heard from ``count`` of its ``degree`` (at
    # least all but one), to the one it has not heard from, or, having heard from all, to every
    # neighbour. Each pass queues the chunk on the link (the one due first goes first) and, the
    # link idle and no start event of it due now, adds its start event.
    for j in used:  # the leaves start (a node with more neighbours waits to hear from them)
        leaves = [ids[j, u] for u in sorted(adj[j]) if len(adj[j][u]) == 1]
        for c in range(chunks):
            for n in leaves:
                at = n * chunks + c
                done_to = sent[at]
                for bit, m, link, far, back in rows[n]:
                    if not done_to & bit:
                        done_to |= bit
                        heappush(queue[link], (due[c] - far, j, c, m, back))
                        if busy_until[link] > 0.0 or starting[link] == 0.0:
                            continue
                        starting[link] = 0.0
                        order += 1
                        heappush(events, (0.0, order, link, None))
                sent[at] = done_to
    done = 0.0
    while events:
        t, _, link, arrival = heappop(events)
        if arrival is None:  # an edge may start its next chunk
            starting[link] = None
            waiting = queue[link]
            if busy_until[link] > t or not waiting:
                continue
            _, j, c, m, back = heappop(waiting)
            end = t + part[j] / rates[link]
            busy_until[link] = end
            starting[link] = end  # the link's next start, then the chunk's arrival past the hop
            heappush(events, (end, order + 1, link, None))
            heappush(events, (end + hops[link], order + 2, link, (m, c, back)))
            order += 2
        else:
            m, c, back = arrival
            at = m * chunks + c
            heard[at] = count = heard[at] + 1
            heard_from[at] = got = heard_from[at] | (1 << back)
            if member[m] and t > done:
                done = t
            need = degree[m] - 1
            if count < need:
                continue  # no neighbour to pass the chunk on to yet
            done_to = sent[at]
            j = owner[m][0]
            key = due[c]
            for bit, n, out_link, far, place in rows[m]:
                # m has the chunk from every tree neighbour but this one
                if (count - 1 if got & bit else count) == need and not done_to & bit:
                    done_to |= bit
                    heappush(queue[out_link], (key - far, j, c, n, place))
                    if busy_until[out_link] > t or starting[out_link] == t:
                        continue  # its start event is due no later than t: nothing more to do now
                    starting[out_link] = t
                    order += 1
                    heappush(events, (t, order, out_link, None))
            sent[at] = done_to
    for n, (j, u) in enumerate(owner):  # every member has every chunk from all its tree neighbours
        if member[n] and any(heard[n * chunks + c] != degree[n] for c in range(chunks)):
            raise RuntimeError(f"packed tree {j} left member {u} without its sums (a tree that is not one)")
    return done
