"""Multicast trees over a group of ranks: the shortest-path trees, spread trees and negotiated trees.

A tree set is the per-link share counts and route latencies of one multicast (or, run
backwards, one reduce) per source; the chip collectives use them on a board and the board-group
all-reduce on the graph of boards. Each set depends only on the ranks (and, for the spread and
negotiated trees, the share's bytes), so it is memoized on the topology's ``memo``.
"""

from __future__ import annotations

import math

import numpy as np

from .cost import _TREES_KEPT, _remember


#: Greedy passes over the multicast trees, each re-choosing every rank's incoming link with the
#: others fixed (a later tree sees the loads of all the others, not only of those before it)
_MULTICAST_PASSES = 3


def _local_links(graph, ranks: np.ndarray) -> tuple[dict, np.ndarray]:
    """The group's own links: ``(member, nb)``, each rank's index in ``ranks`` and, per rank
    index and direction, the neighbour's rank index (-1 where the neighbour is not a rank)."""
    member = {int(r): i for i, r in enumerate(ranks)}
    nb = np.array([[member.get(int(v), -1) for v in graph.neighbors[r]] for r in ranks], dtype=np.int64)
    return member, nb


def _breadth_first(nb: np.ndarray, sources) -> tuple[np.ndarray, list]:
    """Breadth-first search over the group's own links (``nb``: :func:`_local_links`) from each
    rank index of ``sources``: ``dist[i, v]``, rank ``v``'s hops from ``sources[i]`` (-1 where
    the links do not reach it), and ``orders[i]``, the ranks in the order reached (the source,
    then each frontier's neighbours in direction order: a parent before its children), which
    the multicast trees take their ranks in."""
    dist = np.full((len(sources), nb.shape[0]), -1, dtype=np.int64)
    orders = []
    for i, s in enumerate(sources):
        dist[i, s], frontier, seen = 0, [s], [s]
        while frontier:
            nxt = []
            for u in frontier:
                for v in nb[u]:
                    if v >= 0 and dist[i, v] < 0:
                        dist[i, v] = dist[i, u] + 1
                        nxt.append(int(v))
            seen += nxt
            frontier = nxt
        orders.append(seen)
    return dist, orders


def _tree_walk(topo, ranks, member, choice, orders, c: int, step) -> tuple:
    """Walk the multicast trees ``choice[s, v]`` (the link into rank ``v`` of source ``s``'s
    tree) in each source's ``orders[s]`` (parents first): per (source, rank) the latency from the
    root, the latency back to it over the reversed links (the reduce's way), the sum of
    ``step[link]`` along the route (board crossings, or hops), and the reversed links' loads."""
    latency, back, count = np.zeros((c, c)), np.zeros((c, c)), np.zeros((c, c), dtype=np.int64)
    rev_load = np.zeros(topo.nodes * 6)
    for s, order in enumerate(orders):
        for v in order:
            link = choice[s, v]
            u = member[int(link // 6)]
            # the same link run the other way: from v back to its parent u
            rev = int(ranks[v]) * 6 + (int(link % 6) + 3) % 6
            rev_load[rev] += 1.0
            latency[s, v] = latency[s, u] + topo.link_hop_s[link]
            back[s, v] = back[s, u] + topo.link_hop_s[rev]
            count[s, v] = count[s, u] + int(step[link])
    return latency, back, count, rev_load


def _multicast_trees(topo: "Topology", ranks: np.ndarray, sources: "int | None" = None):
    """Per-link share counts, deepest route latency, hops and board hops of the multicast
    all-gather's trees over ``ranks`` (see :mod:`tvm_spinn.timing.collectives`), or None when the ranks'
    links do not connect them. Independent of the message size, so cached per rank set.

    ``sources``: only the first ``sources`` ranks hold shares (default all); the others are
    relays, which forward along the trees but neither send nor need the shares: a relay is
    kept in a tree only where a route to a rank that needs it passes through it."""
    c = ranks.size
    sources = c if sources is None else int(sources)
    key = ("multicast_trees", ranks.tobytes(), sources)
    memo = topo.memo
    if key in memo:
        return memo[key]
    member, nb = _local_links(topo, ranks)
    dist, order = _breadth_first(nb, range(sources))  # per source: ranks in BFS order (parents first)
    order = [seen[1:] for seen in order]
    if (dist < 0).any():
        result = None
    else:
        # candidate incoming links of rank v for source s: from each neighbour one hop closer
        cand = {}
        for s in range(sources):
            for v in order[s]:
                cand[s, v] = [int(ranks[u]) * 6 + (d + 3) % 6 for d, u in enumerate(nb[v])
                              if u >= 0 and dist[s, u] == dist[s, v] - 1]
        load = np.zeros(topo.nodes * 6)
        inv_bw = 1.0 / topo.link_bw
        choice: dict = {}
        for _ in range(_MULTICAST_PASSES):  # re-choose each with the others fixed
            for s in range(sources):
                for v in order[s]:
                    old = choice.get((s, v))
                    if old is not None:
                        load[old] -= 1.0
                    best = min(cand[s, v], key=lambda link: (load[link] * inv_bw[link], link))
                    choice[s, v] = best
                    load[best] += 1.0
        if sources < c:  # relays on no route to a rank that needs the share carry nothing
            load[:] = 0.0
            for s in range(sources):
                needed = set(range(sources))
                for v in reversed(order[s]):
                    if v in needed:
                        needed.add(member[int(choice[s, v] // 6)])
                order[s] = [v for v in order[s] if v in needed]
                for v in order[s]:
                    load[choice[s, v]] += 1.0
        latency, back, board, rev_load = _tree_walk(topo, ranks, member, choice, order, c,
                                                    topo.board_link.reshape(-1))
        result = (load, float(latency.max()), int(dist[:sources].max()), int(board.max()), rev_load,
                  float(back.max()))
    _remember(memo, key, result, _TREES_KEPT, 2 * 8 * topo.nodes * 6)
    return result


def _spread_trees(graph, ranks: np.ndarray, sources: int, share_bytes: float):
    """Multicast trees like :func:`_multicast_trees`' but not only along shortest paths: a rank
    may hang from any neighbour the source's breadth-first order reaches before it (so the
    trees stay trees), chosen to least delay the share's arrival, ``share_bytes`` queued behind
    the shares the link already carries plus the parent's depth and the hop. Around a group of
    boards whose shortest paths crowd onto a few edges, the trees then take the relays' and the
    border's edges too. Same result tuple as :func:`_multicast_trees` (None where the ranks'
    links do not connect them); for the graph of boards only (memoized on it per size)."""
    key = ("spread_trees", ranks.tobytes(), int(sources), float(share_bytes))
    if key in graph.memo:
        return graph.memo[key]
    base = _multicast_trees(graph, ranks, sources)  # connectivity, the BFS orders' distances
    if base is None:
        graph.memo[key] = None
        return None
    c = ranks.size
    member, nb = _local_links(graph, ranks)
    order = _breadth_first(nb, range(sources))[1]
    load = np.zeros(graph.nodes * 6)
    wait = share_bytes / graph.link_bw
    choice: dict = {}
    for _ in range(_MULTICAST_PASSES):
        for s in range(sources):
            rank_of = {v: k for k, v in enumerate(order[s])}
            depth = {s: 0.0}
            for v in order[s][1:]:
                old = choice.get((s, v))
                if old is not None:
                    load[old] -= 1.0
                cands = [int(ranks[u]) * 6 + (d + 3) % 6 for d, u in enumerate(nb[v])
                         if u >= 0 and rank_of[int(u)] < rank_of[v]]
                best = min(cands, key=lambda link: ((load[link] + 1.0) * wait[link] + depth[member[link // 6]]
                                                    + graph.link_hop_s[link], link))
                choice[s, v] = best
                load[best] += 1.0
                depth[v] = depth[member[best // 6]] + float(graph.link_hop_s[best])
    # relays on no route to a rank that needs the share carry nothing
    load[:] = 0.0
    kept = []
    for s in range(sources):
        needed = set(range(sources))
        for v in reversed(order[s][1:]):
            if v in needed:
                needed.add(member[int(choice[s, v] // 6)])
        kept.append([v for v in order[s][1:] if v in needed])
        for v in kept[-1]:
            load[choice[s, v]] += 1.0
    latency, back, hops, rev_load = _tree_walk(graph, ranks, member, choice, kept, c,
                                               np.ones(graph.nodes * 6, dtype=np.int64))
    result = (load, float(latency.max()), int(hops.max()), int(hops.max()), rev_load, float(back.max()))
    graph.memo[key] = result
    return result


#: Rounds of :func:`_negotiated_trees` at most; it stops earlier after
#: :data:`_NEGOTIATE_PATIENCE` rounds without a cheaper set of trees
_NEGOTIATE_ROUNDS = 32
_NEGOTIATE_PATIENCE = 10


def _negotiated_trees(graph, ranks: np.ndarray, sources: int, share_bytes: float, parts: int = 1):
    """Multicast trees for the graph of boards found by negotiated congestion: every round,
    each source's tree is rebuilt as the cheapest-path tree (Dijkstra, ties to the lower rank)
    under link costs of a hop's latency plus a share's time on the link, that time scaled up
    by the shares the other trees already put on it (a factor growing each round) and by a
    history charge on the links that were the busiest in earlier rounds; the relays a tree
    reaches no member through are pruned. The rounds' cheapest result (the all-reduce's two
    steps: busiest link and deepest route, each way) is kept. Unlike :func:`_spread_trees`,
    whose trees follow one breadth-first order per source, a tree here may take any route, so
    on a group whose own edges do not close into rings (a patch of a larger torus) the shares
    go round the group's border and through the relays around it rather than queueing on the
    few edges of the shortest paths. Same result tuple as :func:`_multicast_trees` (None where
    the ranks' links do not connect them); memoized on the graph per size.

    ``parts``: each source's share is cut into this many parts of ``share_bytes``, each part
    reduced and multicast along a tree of its own (tree ``j`` rooted at source ``j // parts``):
    one tree sends a rank's whole share out over one of its links, ``parts`` trees over up to
    ``parts`` of them, so a group of few boards, each with six board edges, keeps more of its
    edges busy. The counts in the result are of parts."""
    import heapq

    key = ("negotiated_trees", ranks.tobytes(), int(sources), float(share_bytes), int(parts))
    if key in graph.memo:
        return graph.memo[key]
    if _multicast_trees(graph, ranks, sources) is None:  # the ranks' links do not connect them
        graph.memo[key] = None
        return None
    member, nb = _local_links(graph, ranks)
    # the search runs on Python lists (the same doubles as the arrays, read far faster one by one)
    wait = (share_bytes / graph.link_bw).tolist()
    hop = graph.link_hop_s
    hop_list = hop.tolist()
    # per local node: its (neighbour, link) pairs in link order
    steps = [[(int(nb[u, k]), int(ranks[u]) * 6 + k) for k in range(6) if nb[u, k] >= 0] for u in range(len(ranks))]
    load, history = np.zeros(graph.nodes * 6), np.zeros(graph.nodes * 6)
    trees: list = [{} for _ in range(sources * parts)]
    best, stale = None, 0
    for round_ in range(_NEGOTIATE_ROUNDS):
        present = 0.5 * 1.5 ** round_
        hist, loads = history.tolist(), load.tolist()
        for j in range(sources * parts):
            s = j // parts  # the tree's root
            for link in trees[j].values():
                loads[link] -= 1.0
            dist, parent, done, heap = {s: 0.0}, {}, set(), [(0.0, s)]
            while heap:
                d, u = heapq.heappop(heap)
                if u in done:
                    continue
                done.add(u)
                for v, link in steps[u]:
                    if v in done:
                        continue
                    cost = d + hop_list[link] + wait[link] * (1.0 + hist[link] + present * loads[link])
                    if cost < dist.get(v, math.inf):
                        dist[v], parent[v] = cost, link
                        heapq.heappush(heap, (cost, v))
            tree, needed = {}, set(range(sources))
            for v in sorted(parent, key=lambda v: (-dist[v], v)):  # children before parents
                if v in needed:
                    tree[v] = parent[v]
                    needed.add(member[int(parent[v] // 6)])
            trees[j] = tree
            for link in tree.values():
                loads[link] += 1.0
        load = np.asarray(loads)
        rev_load = np.zeros_like(load)
        latency = back = 0.0
        hops = 0
        for j in range(sources * parts):
            s = j // parts
            for v, link in trees[j].items():
                rev_load[int(ranks[v]) * 6 + (int(link % 6) + 3) % 6] += 1.0
                out, ret, n, u = 0.0, 0.0, 0, v
                while u != s:  # up to the source: the route's latency each way
                    up = trees[j][u]
                    out += hop[up]
                    ret += hop[int(ranks[u]) * 6 + (int(up % 6) + 3) % 6]
                    n += 1
                    u = member[int(up // 6)]
                latency, back, hops = max(latency, out), max(back, ret), max(hops, n)
        seconds = (graph.link_seconds(rev_load * share_bytes) + back + graph.link_seconds(load * share_bytes)
                   + latency)
        if best is None or seconds < best[0]:
            best, stale = (seconds, (load.copy(), float(latency), hops, hops, rev_load, float(back))), 0
        else:
            stale += 1
            if stale >= _NEGOTIATE_PATIENCE:
                break
        history += 0.5 * (load >= load.max())
    graph.memo[key] = best[1]
    return best[1]
