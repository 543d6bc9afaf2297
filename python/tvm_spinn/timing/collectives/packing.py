"""Trees packed over the graph of boards for the board-group all-reduce, and their parts of the row.

:func:`_packed_trees` finds trees that span the group's boards (and may pass through the boards
around it) by multiplicative weights; :func:`_reweigh` splits the row over them to lighten the
busiest edge; :func:`_rooted_shapes` and :func:`_rooted_weights` run the same trees rooted
(reduce up, multicast down). The event simulation that plays them out is in
:mod:`.schedule`, the priority packing that mixes their spans in :mod:`.priority`.

The other modules call :func:`_packed_trees`, :func:`_rooted_shapes` and :func:`_rooted_weights`
as attributes of this module, not names imported from it, so that replacing one of them here (the
figures without the packed trees in ``bench/board_all_reduce.py`` and the tests) reaches every
caller, as it did when the package was one module.
"""

from __future__ import annotations

import math

import numpy as np

from .cost import _TREES_KEPT, _forget
from .trees import _breadth_first, _local_links


#: Trees :func:`_packed_trees` packs (each carries ``1 / _PACK_TREES`` of the row), the roots it
#: tries for each (taken in turn from the boards nearest every member), and how steeply a link's
#: cost grows with the share of the row already on it (the multiplicative weights' rate)
_PACK_TREES = 48
_PACK_ROOTS = 4
_PACK_ETA = 8.0
#: Depths the packed trees may go beyond the fewest hops that reach every member
_PACK_SLACK = (0, 1, 2)


def _steiner_tree(nbr: np.ndarray, cin: np.ndarray, members: int, root: tuple, depth_limit: int,
                  hops: np.ndarray):
    """A cheap tree from ``root`` (one node, or two neighbours and the edge between them)
    reaching local nodes ``0 .. members - 1`` within ``depth_limit`` hops of it, by the
    shortest-path heuristic: the tree grows by the member
    cheapest to reach from it (a path of at most ``depth_limit - depth`` hops from a tree node
    at ``depth``, through nodes not yet in the tree), members reached in one search added
    together while their paths stay apart. ``nbr[v, k]``: node ``v``'s neighbour in direction
    ``k`` (``len(nbr)`` where none), ``cin[v, k]``: the cost of the link from it into ``v``.
    ``hops``: each node's hop distance from the root (``len(nbr)`` entries).
    Returns ``(cost, {node: the local link into it from its parent})`` (link ``u * 6 + k``:
    from ``u`` in direction ``k``, so two boards joined by two edges keep them apart) or None
    where some member is out of reach."""
    n = nbr.shape[0]
    rows = np.arange(n)
    depth = np.full(n + 1, -1, dtype=np.int64)
    depth[list(root)] = 0
    parent: dict = {}
    total = 0.0
    if len(root) == 2:  # the root edge (the cheapest, where the two share several)
        ways = np.flatnonzero(nbr[root[1]] == root[0])
        k = int(ways[np.argmin(cin[root[1], ways])])
        parent[int(root[1])] = int(root[0]) * 6 + (k + 3) % 6
        total += float(cin[root[1], k])
    todo = [m for m in range(members) if m not in root]
    while todo:
        cost = np.full((depth_limit + 1, n + 1), np.inf)
        prev = np.full((depth_limit + 1, n), -1, dtype=np.int64)  # the direction it came in by
        tree = np.flatnonzero(depth[:n] >= 0)
        cost[depth[tree], tree] = 0.0
        free = depth[:n] < 0
        for h in range(depth_limit):  # cheapest way into each free node at depth h + 1
            via = cost[h][nbr] + cin
            k = via.argmin(axis=1)
            best = via[rows, k]
            better = free & (best < cost[h + 1, :n])
            cost[h + 1, :n][better] = best[better]
            prev[h + 1][better] = k[better]
        reach = cost[:, todo]
        layer = reach.argmin(axis=0)
        price = reach[layer, np.arange(len(todo))]
        if not np.isfinite(price.min()):
            return None
        taken = set()
        for i in np.lexsort((price, -hops[todo])):  # the farthest first: their ways are the fewest
            if not np.isfinite(price[i]):
                break  # out of reach from this search (the tree's nodes block its ways)
            path, v, h = [], todo[i], int(layer[i])
            while depth[v] != h:  # back to the tree node the path leaves from
                path.append((v, h))
                v, h = int(nbr[v, prev[h, v]]), h - 1
            if any(u in taken for u, _ in path):
                break  # shares a node with a path just added: search again
            for u, h in path:
                depth[u] = h
                k = int(prev[h, u])
                parent[u] = int(nbr[u, k]) * 6 + (k + 3) % 6
                taken.add(u)
            total += float(price[i])
        todo = [m for m in todo if depth[m] < 0]
    return total, parent


def _tree_span(parent: dict, root: int, members: int, hop: np.ndarray) -> float:
    """The largest latency between two members along a tree (``hop`` per local link): every
    member's sum is complete once the farthest member's partial sums have reached it.
    ``parent``: each node's link from its parent."""
    children: dict = {}
    for v, link in parent.items():
        children.setdefault(link // 6, []).append(v)
    order, stack = [], [root]
    while stack:  # parents before children
        u = stack.pop()
        order.append(u)
        stack += sorted(children.get(u, ()), reverse=True)
    deepest, span = {}, 0.0
    for u in reversed(order):  # the farthest member below each node, and the longest path through it
        reach = [0.0] if u < members else []
        for v in children.get(u, ()):
            if v in deepest:
                reach.append(deepest[v] + float(hop[parent[v]]))
        reach.sort(reverse=True)
        if reach:
            deepest[u] = reach[0]
            if u < members:
                span = max(span, reach[0])
            if len(reach) > 1:
                span = max(span, reach[0] + reach[1])
    return span


def _packed_trees(graph, ranks: np.ndarray, members: int):
    """Trees packed over the graph of boards for a pipelined all-reduce (see
    :func:`board_group_all_reduce`): ``_PACK_TREES`` trees, each spanning the first ``members``
    of ``ranks`` (the others relay) with every member within ``d`` board hops of the tree's
    root (a board, or two neighbouring boards), so that no two members are more than ``2 d``
    (``2 d + 1``) hops apart along a tree: the fewest such hops the roots allow plus each of
    :data:`_PACK_SLACK` in turn (longer trees can spread wider; shorter ones wait less). Each tree carries an equal part of
    the row. They are found one after another by multiplicative weights: each is the cheapest tree (:func:`_steiner_tree`) under link
    costs that grow exponentially with the share of the row the trees before it put on the
    link, so the parts spread over every edge of the group and of the boards around it.

    The parts are then re-weighed (:func:`_reweigh`) over all the trees found no longer than
    each span found, so that a caller can trade latency for bandwidth.

    Returns ``(options, trees)``: per span cap ``(load, latency, hops)``, each directed board
    edge's share of the row (both directions of every tree edge carry the tree's part), the
    largest latency between two members along a tree used and its board hops; and the number
    of distinct trees. None where no root reaches every member. Memoized on the graph."""
    key = ("packed_trees", ranks.tobytes(), int(members))
    if key in graph.memo:
        return graph.memo[key]
    c = ranks.size
    nb = _local_links(graph, ranks)[1]
    has = nb >= 0
    nbr = np.where(has, nb, c)
    back = (np.arange(6) + 3) % 6
    # local link u*6+k (u to its neighbour in direction k); the link into v from direction k
    into = np.where(has, nb * 6 + back, 0)
    out = np.arange(c * 6).reshape(c, 6)
    glob = (ranks[:, None] * 6 + np.arange(6)).reshape(-1)
    rate = graph.link_bw[glob]
    hop = graph.link_hop_s[glob]
    # hop distances from every node; a root (a node, or an edge) reaching every member in d
    # hops gives trees whose members are at most 2 d (2 d + 1) hops apart
    dist = _breadth_first(nb, range(c))[0]
    dist[dist < 0] = c  # out of reach: farther than any path
    far = dist[:, :members].max(axis=1)
    u, k = np.nonzero(nb >= 0)
    keep = u < nb[u, k]
    edges = np.stack([u[keep], nb[u, k][keep]], axis=1)
    far_edge = np.minimum(dist[edges[:, 0], :members], dist[edges[:, 1], :members]).max(axis=1)
    if far.min() >= c:
        graph.memo[key] = None
        return None
    scale = float(rate[np.isfinite(rate)].min())
    found: dict = {}
    for slack in _PACK_SLACK:
        _pack(found, nb, nbr, has, into, out, rate, scale, members, dist, far, far_edge, edges,
              min(2 * int(far.min()), 2 * int(far_edge.min()) + 1) + int(slack))
    if not found:
        graph.memo[key] = None
        return None


    # each distinct tree: the directed links it loads, its span between members (latency, hops)
    shapes = sorted(found)
    use = np.zeros((len(shapes), c * 6))
    span = np.zeros(len(shapes))
    span_hops = np.zeros(len(shapes), dtype=np.int64)
    ones = np.ones(c * 6)
    for j, (root, parent) in enumerate(shapes):
        parent = dict(parent)
        for v, link in parent.items():
            use[j, link] = use[j, v * 6 + (link % 6 + 3) % 6] = 1.0
        span[j] = _tree_span(parent, root, members, hop)
        span_hops[j] = int(round(_tree_span(parent, root, members, ones)))
    busy = use * (scale / np.where(np.isfinite(rate), rate, np.inf))  # a link's time per unit of row
    start = np.array([found[sh] for sh in shapes], dtype=np.float64)
    options = []
    for cap in np.unique(span):  # the trees no longer than each span between members
        keep = np.flatnonzero(span <= cap)
        weight = _reweigh(busy[keep], start[keep] / start[keep].sum())
        load = np.zeros(graph.nodes * 6)
        load[glob] = weight @ use[keep]
        options.append((load, float(cap), int(span_hops[keep].max())))
    result = (options, len(shapes))
    if len(graph.memo) > _TREES_KEPT:
        _forget(graph.memo, "packed_trees")
        _forget(graph.memo, "packed_shapes")
    graph.memo[key] = result
    # every distinct tree as found, for :func:`_priority_packing`: the directed links it loads
    # (the system's board links), its span between members (latency, hops) and its shape
    # (root, each node's link from its parent, local to ``ranks``)
    full = np.zeros((len(shapes), graph.nodes * 6))
    full[:, glob] = use
    graph.memo[("packed_shapes", ranks.tobytes(), int(members))] = (full, span, span_hops, tuple(shapes), start)
    return result


def _pack(found: dict, nb, nbr, has, into, out, rate, scale: float, members: int, dist, far, far_edge,
          edges, span: int) -> None:
    """One round of :func:`_packed_trees`' multiplicative weights: ``_PACK_TREES`` trees whose
    members are at most ``span`` hops apart along them, counted into ``found`` (``(root,
    ((node, link from its parent), ...))`` to the times it was chosen); nothing where no root
    allows it."""
    depth_limit = span // 2
    if span % 2 == 0:
        roots = [(int(r),) for r in np.argsort(far, kind="stable") if far[r] <= depth_limit]
    else:
        roots = [tuple(int(x) for x in edges[e]) for e in np.argsort(far_edge, kind="stable")
                 if far_edge[e] <= depth_limit]
    back = (np.arange(6) + 3) % 6
    load = np.zeros(nb.size)
    tries = min(_PACK_ROOTS, len(roots))
    for t in range(_PACK_TREES if roots else 0):
        weight = np.exp(_PACK_ETA * load * scale / rate) / rate * scale
        cin = np.where(has, weight[into] + weight[out], np.inf)  # the edge carries the part both ways
        best = None
        for j in range(tries):
            root = roots[(t * tries + j) % len(roots)]
            tree = _steiner_tree(nbr, cin, members, root, depth_limit, dist[list(root)].min(axis=0))
            if tree is not None and (best is None or tree[0] < best[0]):
                best = (tree[0], root, tree[1])
        if best is None:
            return
        _, root, parent = best
        root = int(root[0])
        while root >= members and sum(link // 6 == root for link in parent.values()) == 1:
            # a relay at the root with one branch adds an edge and reaches no member
            child = next(v for v, link in parent.items() if link // 6 == root)
            del parent[child]
            root = child
        shape = (root, tuple(sorted(parent.items())))
        found[shape] = found.get(shape, 0) + 1
        for v, link in parent.items():
            load[link] += 1.0 / _PACK_TREES
            load[v * 6 + back[link % 6]] += 1.0 / _PACK_TREES


def _rooted_shapes(graph, region: np.ndarray, g: int):
    """:func:`_packed_trees`' trees over ``region`` (its first ``g`` boards the group's) each run
    rooted: a reduce of its part up to the tree's root (child to parent, the children's partial
    sums added on the way), then a multicast back down (parent to child).

    Returns
    -------
    tuple or None
        ``(up, down, depth, depth_hops, member_root, span, start)``: per tree, the directed board
        edges (the system's) its reduce and its multicast use, the deepest member's hop
        latencies to the root and its board hops, whether the root is one of the group's boards,
        and :func:`_packed_trees`' span and count of each tree; None where it finds no trees.
        Memoized on the graph.
    """
    if not _packed_trees(graph, region, g):
        return None
    key = ("rooted_shapes", region.tobytes(), int(g))
    if key in graph.memo:
        return graph.memo[key]
    full, span, _, shapes, start = graph.memo[("packed_shapes", region.tobytes(), int(g))]
    glob = (region[:, None] * 6 + np.arange(6)).reshape(-1)
    hop = graph.link_hop_s[glob]
    up, down = np.zeros_like(full), np.zeros_like(full)
    depth = np.zeros(len(shapes))
    depth_hops = np.zeros(len(shapes), dtype=np.int64)
    member_root = np.zeros(len(shapes), dtype=bool)
    for j, (root, parent) in enumerate(shapes):
        parent = dict(parent)
        member_root[j] = root < g
        children: dict = {}
        for v, link in parent.items():
            down[j, glob[link]] = 1.0  # the multicast: parent to child
            up[j, glob[v * 6 + (link % 6 + 3) % 6]] = 1.0  # the reduce: child to parent
            children.setdefault(link // 6, []).append(v)
        reach, stack = {root: (0.0, 0)}, [root]
        while stack:
            u = stack.pop()
            for v in children.get(u, ()):
                reach[v] = (reach[u][0] + float(hop[parent[v]]), reach[u][1] + 1)
                stack.append(v)
        depth[j] = max(reach[m][0] for m in range(g))
        depth_hops[j] = max(reach[m][1] for m in range(g))
    if len(graph.memo) > _TREES_KEPT:
        _forget(graph.memo, "rooted_shapes")
    graph.memo[key] = result = (up, down, depth, depth_hops, member_root, span, start)
    return result


def _rooted_weights(graph, region: np.ndarray, g: int, nbytes: float, gather_bytes: float, member_roots: bool,
                    depth_caps: bool = False):
    """The rooted trees' parts of the row (:func:`_rooted_shapes` of ``region`` and ``g``), per
    span cap (and, with ``depth_caps``, per cap on the deepest member's way to its root as well):
    over the trees within the cap (rooted at one of the group's boards only, with
    ``member_roots``), weights re-weighed (:func:`_reweigh`) for the reduce's bytes alone and
    for both phases' bytes (``nbytes`` up, ``gather_bytes`` down, the busiest edge of each).

    Returns
    -------
    list
        ``(weight, keep)`` per cap and weighing: the parts over the trees ``keep`` (indices).
        Memoized on the graph per ratio of the two phases' bytes (the weights depend on no more).
    """
    ratio = float(gather_bytes) / float(nbytes) if nbytes > 0 else math.inf
    key = ("rooted_weights", region.tobytes(), int(g), ratio, bool(member_roots), bool(depth_caps))
    if key in graph.memo:
        return graph.memo[key]
    up, down, depth, _, member_root, span, start = _rooted_shapes(graph, region, g)
    rate = np.where(np.isfinite(graph.link_bw), graph.link_bw, np.inf)
    allowed = member_root if member_roots else np.ones(span.size, dtype=bool)
    out = []
    for within in (span, depth) if depth_caps else (span,):
        for cap in np.unique(within[allowed]):
            keep = np.flatnonzero(allowed & (within <= cap))
            both = (up[keep] * float(nbytes) + down[keep] * float(gather_bytes)) / rate[None, :]
            for busy in (up[keep] / rate[None, :], both):
                out.append((_reweigh(busy / max(float(busy.max()), 1e-300), start[keep] / start[keep].sum()), keep))
    if len(graph.memo) > _TREES_KEPT:
        _forget(graph.memo, "rooted_weights")
    graph.memo[key] = out
    return out


#: Steps of :func:`_reweigh` and the sharpness of its smooth maximum
_REWEIGH_STEPS = 400
_REWEIGH_SHARPNESS = 64.0


def _reweigh(busy: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Parts of the row for given trees (``busy[j]``: each link's time per unit of the row on
    tree ``j``) that make the busiest link's time small: Frank-Wolfe steps on a smooth maximum
    of the links' times from ``start``; the weights with the least busiest link seen."""
    weight = start.copy()
    best, best_t = weight.copy(), float((weight @ busy).max())
    sharp = _REWEIGH_SHARPNESS / max(best_t, 1e-300)
    for step in range(_REWEIGH_STEPS):
        time = weight @ busy
        peak = float(time.max())
        if peak < best_t:
            best, best_t = weight.copy(), peak
        grad = busy @ np.exp(sharp * (time - peak))
        j = int(np.argmin(grad))
        gamma = 2.0 / (step + 3.0)
        weight *= 1.0 - gamma
        weight[j] += gamma
    if float((weight @ busy).max()) < best_t:
        best = weight
    return best
