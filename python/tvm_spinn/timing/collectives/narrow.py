"""Owner trees over the graph of boards for an all-reduce whose sums are added on their owners only.

A narrowed row (fp16, bf16 or int8 on the wire, :mod:`tvm_spinn.llm.wire`) cannot be added
where two partial sums meet: a sum narrowed again at every hop rounds differently on every set
of trees. Its all-reduce therefore sends every board's piece of share ``s`` to the share's
owner, which adds the ``g`` pieces in a fixed order, and multicasts the narrowed sum back. On
the graph of boards each owner's share runs along a tree of its own rooted at the owner and
spanning the group's boards (the boards around the group may relay):

- **gather to the owner** (the reduce-scatter): each member's piece climbs the tree to the
  root, the routers only forwarding it, so a tree edge carries, towards the root, one piece
  for every member below it (no addition on the way: unlike the reversed multicast of the
  integer sums, which carries one piece per edge);
- **multicast from the owner** (the all-gather): the reduced share goes down the same tree,
  one copy per tree edge, copied where the tree branches.

:func:`owner_trees` finds such trees by negotiated congestion (as :func:`._negotiated_trees`:
each round every tree is the cheapest-path tree under link costs that grow with the bytes the
other trees already put on each link, in both directions, and with a history of the busiest
links); :func:`owner_tree_cost` prices a tree set with the package's closed forms, its two
phases one after the other or pipelined (an owner multicasts each chunk of its share as soon
as the chunk's ``g`` pieces have arrived and been added, while the later chunks still climb:
every directed board edge then carries its gather and its multicast bytes at once, the
busiest edge's time with both phases' bytes plus the deepest route each way, the form of
:func:`tvm_spinn.timing.collectives.board_group_all_reduce`'s ``pipelined``).
:func:`owner_floor` bounds what any such schedule can reach.

A piece need not climb its share's multicast tree: the routers only forward it, so each
member's piece may take routes of its own to the owner, the reduced share still coming down
trees (:func:`_owner_routes`, which :func:`owner_trees` prices beside the trees' own schedule).
The loads keep the form of :class:`OwnerTrees` (pieces up and copies down on each directed
edge) and the same closed forms price them; the bits are the same on any routes.
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple

import numpy as np

from .cost import _TREES_KEPT, _forget
from .trees import _breadth_first, _local_links

#: Rounds of :func:`owner_trees` at most; it stops after :data:`_OWNER_PATIENCE` rounds without
#: a cheaper tree set (the pipelined closed form)
_OWNER_ROUNDS = 24
_OWNER_PATIENCE = 8


class OwnerTrees(NamedTuple):
    """A set of owner trees on the graph of boards, per unit of piece and share bytes.

    ``up``: each directed board edge's pieces towards the owners (one per member below the
    edge, a tree per part of each share); ``down``: its copies of the reduced shares; ``up_s``
    and ``down_s``: the deepest member's hop latencies to its tree's root and from it;
    ``hops``: the deepest member's board hops either way."""

    up: np.ndarray
    down: np.ndarray
    up_s: float
    down_s: float
    hops: int


def _walk(graph, region: np.ndarray, g: int, trees: list, roots: list) -> OwnerTrees:
    """The loads and latencies of ``trees`` (per tree: local node -> the global link into it
    from its parent; tree ``j`` rooted at local node ``roots[j]``), counted in parts."""
    member = {int(r): i for i, r in enumerate(region)}
    up = np.zeros(graph.nodes * 6)
    down = np.zeros(graph.nodes * 6)
    up_s = down_s = 0.0
    hops = 0
    for j, tree in enumerate(trees):
        root = roots[j]
        below = {}  # members in each node's subtree
        for v in tree:
            u, n = v, 0
            while u != root:  # a member's way up: every node on it has the member below
                if v < g:
                    below[u] = below.get(u, 0) + 1
                link = tree[u]
                u = member[int(link // 6)]
            if v < g:
                out = ret = 0.0
                u = v
                while u != root:
                    link = tree[u]
                    out += float(graph.link_hop_s[link])
                    ret += float(graph.link_hop_s[int(region[u]) * 6 + (int(link % 6) + 3) % 6])
                    n += 1
                    u = member[int(link // 6)]
                down_s, up_s, hops = max(down_s, out), max(up_s, ret), max(hops, n)
        for v, link in tree.items():
            down[link] += 1.0
            up[int(region[v]) * 6 + (int(link % 6) + 3) % 6] += float(below.get(v, 0))
    return OwnerTrees(up, down, float(up_s), float(down_s), int(hops))


def owner_tree_cost(graph, trees: OwnerTrees, piece: float, share: float, board: tuple = (0.0, 0.0),
                    pipelined: bool = True) -> float:
    """Seconds of the all-reduce along ``trees`` (:class:`OwnerTrees`, counted in parts) whose
    parts carry ``piece`` bytes of every member up to the owner and ``share`` bytes of the
    reduced share down; ``board``: the on-board multicast's ``(link seconds, hop latencies)``
    of the whole narrowed row, riding on the board edges' arrivals (its link time runs under
    theirs where they are the slower). Sequential: the gather phase, then the multicast;
    pipelined: the busiest directed edge with both phases' bytes, plus the deepest route each
    way (see the module docstring); never dearer than sequential."""
    up_bw = graph.link_seconds(trees.up * piece)
    down_bw = graph.link_seconds(trees.down * share)
    sequential = up_bw + trees.up_s + max(down_bw, board[0]) + trees.down_s + board[1]
    if not pipelined:
        return sequential
    both = graph.link_seconds(trees.up * piece + trees.down * share)
    return min(sequential, max(both, board[0]) + trees.up_s + trees.down_s + board[1])


#: Depth caps :func:`owner_trees` weighs trees under, the shallowest that every share reaches
#: first (a deeper cap pays a board hop's latency each way, which its spread rarely buys back;
#: planning time: each is a linear program over every tree found)
_OWNER_CAPS = 2
#: The negotiations :func:`owner_trees` runs for candidate trees: each share cut into this many
#: parts, each part on a tree of its own (more parts: an owner's share over more of its edges)
_OWNER_PARTS = (1, 2, 3, 4)
#: Trees of one negotiation at most (all the shares' parts: planning time, each round rebuilds
#: every tree); a share is always taken whole
_OWNER_TREES = 64


def _negotiate(graph, region: np.ndarray, g: int, roots: list, piece: float, share: float, parts: int,
               board: tuple, found: dict) -> bool:
    """One negotiation of owner trees by congestion (each share cut into ``parts`` parts, each
    part ``piece`` and ``share`` bytes on a tree of its own, share ``s``'s rooted at local node
    ``roots[s]``, its owner), every round's trees added to ``found`` (share -> {tree: its
    walk}). False where the region's links do not join the group's boards."""
    member, nb = _local_links(graph, region)
    dist = _breadth_first(nb, range(g))[0]
    if (dist[:, :g] < 0).any():
        return False
    up_wait = (piece / parts / graph.link_bw).tolist()  # a part's bytes on each link
    down_wait = (share / parts / graph.link_bw).tolist()
    hop = graph.link_hop_s.tolist()
    steps = [[(int(nb[u, k]), int(region[u]) * 6 + k, int(region[int(nb[u, k])]) * 6 + (k + 3) % 6)
              for k in range(6) if nb[u, k] >= 0] for u in range(len(region))]
    up_wait_all, down_wait_all = piece / parts / graph.link_bw, share / parts / graph.link_bw
    trees: list = [{} for _ in range(g * parts)]
    history = np.zeros(graph.nodes * 6)
    loads = np.zeros(graph.nodes * 6)  # seconds of both phases' bytes on each link
    best, stale = math.inf, 0
    for round_ in range(_OWNER_ROUNDS):
        present = 0.5 * 1.5 ** round_
        hist = history.tolist()
        for j in range(g * parts):
            s = roots[j // parts]
            # the tree's own loads out of the others' (its pieces counted at one a link: an
            # estimate, the walk counts them exactly)
            for v, link in trees[j].items():
                rev = int(region[v]) * 6 + (int(link % 6) + 3) % 6
                loads[link] -= down_wait[link]
                loads[rev] -= up_wait[rev]
            load = loads.tolist()
            dist_s, parent, done, heap = {s: 0.0}, {}, set(), [(0.0, s)]
            while heap:
                d, u = heapq.heappop(heap)
                if u in done:
                    continue
                done.add(u)
                for v, link, rev in steps[u]:
                    if v in done:
                        continue
                    # a hop's latency, the part's time on the link each way, and what the
                    # other trees (and the earlier rounds' busiest links) already put there
                    cost = (d + hop[link] + down_wait[link] * (1.0 + hist[link]) + present * load[link]
                            + up_wait[rev] * (1.0 + hist[rev]) + present * load[rev])
                    if cost < dist_s.get(v, math.inf):
                        dist_s[v], parent[v] = cost, link
                        heapq.heappush(heap, (cost, v))
            tree, needed = {}, set(range(g))
            for v in sorted(parent, key=lambda v: (-dist_s[v], v)):  # children before parents
                if v in needed:
                    tree[v] = parent[v]
                    needed.add(member[int(parent[v] // 6)])
            trees[j] = tree
            for v, link in tree.items():
                rev = int(region[v]) * 6 + (int(link % 6) + 3) % 6
                loads[link] += down_wait[link]
                loads[rev] += up_wait[rev]
        walks = []
        for j, tree in enumerate(trees):
            shape = tuple(sorted(tree.items()))
            if shape not in found[j // parts]:  # each distinct tree walked once, rooted at its owner
                found[j // parts][shape] = _walk(graph, region, g, [tree], [roots[j // parts]])
            walks.append(found[j // parts][shape])
        # the round's trees together (a walk adds up over trees: loads summed, latencies the deepest)
        walked = OwnerTrees(np.sum([w.up for w in walks], axis=0), np.sum([w.down for w in walks], axis=0),
                            max(w.up_s for w in walks), max(w.down_s for w in walks), max(w.hops for w in walks))
        seconds = owner_tree_cost(graph, walked, piece / parts, share / parts, board)
        if seconds < best:
            best, stale = seconds, 0
        else:
            stale += 1
            if stale >= _OWNER_PATIENCE:
                break
        both = walked.up * up_wait_all + walked.down * down_wait_all
        history += 0.5 * (both >= both.max())
    return True


def owner_trees(graph, region: np.ndarray, g: int, piece: float, share: float,
                board: tuple = (0.0, 0.0), owners: "tuple | None" = None) -> "OwnerTrees | None":
    """Owner trees over ``region`` (the group's ``g`` boards first, then the boards that may
    relay), each share split over several trees rooted at its owner, and the split.
    ``owners``: share ``s``'s owner, a local node of ``region`` (default: member ``s``; any
    board may add a share's pieces in their fixed order, a relay too).

    The candidate trees are every round's of the negotiations by congestion (:func:`_negotiate`,
    each share cut into each of :data:`_OWNER_PARTS` parts, at most :data:`_OWNER_TREES` trees);
    then, for each cap on the trees'
    depth (the deepest member's hop latencies either way), a linear program (scipy's HiGHS)
    weighs each owner's trees no deeper than the cap (weights summing to one per owner: the
    share's fraction on each) to least load the busiest directed board edge with both phases'
    bytes (``piece`` up and ``share`` down per unit of weight, over its rate); the cap whose
    :func:`owner_tree_cost` (pipelined) is the cheapest is kept (of the :data:`_OWNER_CAPS`
    shallowest caps every share reaches), each cap's trees beside the schedule of
    :func:`_owner_routes` under the same cap (each piece on routes of its own, the trees
    weighed anew: never a busier edge than the trees'). ``up`` and ``down`` of the
    result are the weighted loads (in whole shares). None where the region's links do not join
    the group's boards. Memoized on the graph per size."""
    roots = list(range(g)) if owners is None else [int(o) for o in owners]
    if len(roots) != g or min(roots) < 0 or max(roots) >= region.size:
        raise ValueError(f"owner_trees: one owner a share, local nodes of the region, got {roots}")
    key = ("owner_trees", region.tobytes(), int(g), float(piece), float(share), tuple(board), tuple(roots))
    if key in graph.memo:
        return graph.memo[key]
    from scipy.optimize import linprog

    found: dict = {s: {} for s in range(g)}
    for parts in (m for m in _OWNER_PARTS if m == 1 or g * m <= _OWNER_TREES):
        if not _negotiate(graph, region, g, roots, piece, share, parts, board, found):
            graph.memo[key] = None
            return None
    caps = np.unique([max(w.up_s, w.down_s) for s in range(g) for w in found[s].values()])
    links = np.flatnonzero(graph.neighbors.reshape(-1) >= 0)
    best, tried = None, 0
    for cap in caps:
        owner = np.array([s for s in range(g) for w in found[s].values() if max(w.up_s, w.down_s) <= cap])
        if np.unique(owner).size < g:
            continue  # some share has no tree this shallow
        if tried == _OWNER_CAPS:
            break
        tried += 1
        walks = [w for s in range(g) for _, w in sorted(found[s].items()) if max(w.up_s, w.down_s) <= cap]
        up = np.array([w.up for w in walks])
        down = np.array([w.down for w in walks])
        # microseconds: the solver's tolerances are absolute
        busy = (up[:, links] * piece + down[:, links] * share) / graph.link_bw[links] * 1e6
        n = owner.size
        eq = (owner[None, :] == np.arange(g)[:, None]).astype(np.float64)
        res = linprog(np.r_[np.zeros(n), 1.0], A_ub=np.hstack([busy.T, -np.ones((links.size, 1))]),
                      b_ub=np.zeros(links.size), A_eq=np.hstack([eq, np.zeros((g, 1))]), b_eq=np.ones(g),
                      bounds=[(0.0, None)] * (n + 1), method="highs")
        if res.status != 0:
            continue
        up_s = np.array([w.up_s for w in walks])
        down_s = np.array([w.down_s for w in walks])
        hops = np.array([w.hops for w in walks])
        weight = np.maximum(res.x[:n], 0.0)
        weight[weight < 1e-9] = 0.0
        weight /= (np.bincount(owner, weights=weight, minlength=g))[owner]  # each owner's share whole
        used = weight > 0
        trees = OwnerTrees(weight @ up, weight @ down, float(up_s[used].max()), float(down_s[used].max()),
                           int(hops[used].max()))
        for trees in (trees, _owner_routes(graph, region, g, piece, share, roots, found, float(cap))):
            if trees is None:
                continue
            seconds = owner_tree_cost(graph, trees, piece, share, board)
            if best is None or seconds < best[0]:
                best = (seconds, trees)
    if len(graph.memo) > _TREES_KEPT:
        _forget(graph.memo, "owner_trees")
    graph.memo[key] = best[1] if best is not None else None
    return graph.memo[key]


#: Rounds of :func:`_owner_routes` at most: each solves the linear program over the routes and
#: trees found so far and looks for cheaper ones under its prices (planning time)
_ROUTE_ROUNDS = 40
#: A route or tree :func:`_owner_routes` adds must lower its price below its share's by this
#: much (microseconds of the busiest edge; the tie-break of :data:`_ROUTE_TIE` a link stays under it)
_ROUTE_GAIN = 1e-9
#: Added to every link's price (microseconds) so that among equally priced routes the one of
#: fewer board edges is found
_ROUTE_TIE = 1e-12


def _tree_links(tree: dict, region: np.ndarray, member: dict, root: int, g: int) -> tuple:
    """A tree (local node -> the global link into it from its parent, rooted at local node
    ``root``) as ``(up routes, its links)``: per member but the root, the global links of its
    way up to the root; and the tree's global links, sorted."""
    routes = {}
    for m in range(g):
        if m == root:
            continue
        path, u = [], m
        while u != root:
            link = tree[u]
            path.append(int(region[u]) * 6 + (int(link % 6) + 3) % 6)
            u = member[int(link // 6)]
        routes[m] = tuple(path)
    return routes, tuple(sorted(int(link) for link in tree.values()))


def _owner_routes(graph, region: np.ndarray, g: int, piece: float, share: float, roots: list, found: dict,
                  cap: float) -> "OwnerTrees | None":
    """The owner schedule with each piece's way up free of its share's multicast tree: every
    member's piece of share ``s`` climbs to its owner ``roots[s]`` along routes of its own (the
    routers only forward a piece, so any route gives the same bits), weighed over several
    routes, and the reduced share comes down trees weighed as in :func:`owner_trees`; both
    no deeper than ``cap`` seconds of hop latency either way.

    Column generation: a linear program (scipy's HiGHS) weighs the routes and trees found so
    far (at first the ways up and the trees of ``found`` no deeper than ``cap``: the trees' own
    schedule is one of its solutions, so it is never dearer) to least load the busiest
    directed board edge with both phases' bytes; under its prices (the busy links' duals)
    each member's cheapest route to each owner within the cap (a shortest path over hop
    layers) and each owner's cheap trees (:func:`_grow_tree`, within the cap; once they find
    nothing, the cheapest, :func:`_cheapest_tree`, proven so where its solver closes within
    its node limit) join it where they lower the busiest edge, for at most
    :data:`_ROUTE_ROUNDS` rounds. The result is the least loaded schedule over the routes and
    trees found, not proven optimal over all of them.

    Assumes every board edge of the region has the same hop latency (as
    :func:`tvm_spinn.target.topology.board_graph` builds it): the searches keep, per node, the
    cheapest way of each hop count, so a cap in seconds is a cap in hops; with unequal
    latencies they still never exceed the cap (each way's latency is checked) but may miss a
    dearer way within it. Returns the weighted loads (pieces up, copies down, in whole
    shares) with the deepest route's and tree's latencies, or None where the program fails."""
    from scipy.optimize import linprog
    from scipy.sparse import csr_matrix

    member, nb = _local_links(graph, region)
    size = region.size
    hop = graph.link_hop_s
    # the region's directed board edges: per local node, (local head, global link)
    steps = [[(int(nb[u, k]), int(region[u]) * 6 + k) for k in range(6) if nb[u, k] >= 0] for u in range(size)]
    links = sorted(link for u in range(size) for _, link in steps[u])
    row = {link: i for i, link in enumerate(links)}
    tail = {link: u for u in range(size) for _, link in steps[u]}
    head = {link: v for u in range(size) for v, link in steps[u]}
    into: dict = {v: [] for v in range(size)}
    for link in links:
        into[head[link]].append(link)
    # microseconds of a piece and of a share on each link (the solver's tolerances are absolute)
    up_us = {link: piece / float(graph.link_bw[link]) * 1e6 for link in links}
    down_us = {link: share / float(graph.link_bw[link]) * 1e6 for link in links}
    pairs = [(m, s) for s in range(g) for m in range(g) if m != roots[s]]
    pair = {p: i for i, p in enumerate(pairs)}
    tol = 1e-12 + 1e-9 * cap
    routes: dict = {}  # (pair, its links up) -> None, in the order found
    trees: dict = {}  # (share, its links) -> None

    def depth(share_, tree_links):
        """The tree's deepest member's latency from the root and board hops."""
        down = {tail[link]: [] for link in tree_links}
        for link in tree_links:
            down[tail[link]].append(link)
        lat, hops, frontier = {roots[share_]: (0.0, 0)}, 0, [roots[share_]]
        while frontier:
            nxt = []
            for u in frontier:
                for link in down.get(u, ()):
                    v = head[link]
                    lat[v] = (lat[u][0] + float(hop[link]), lat[u][1] + 1)
                    nxt.append(v)
            frontier = nxt
        deep = [lat[m] for m in range(g) if m in lat]
        return max(d[0] for d in deep), max(d[1] for d in deep)

    for s in range(g):
        for shape, w in sorted(found[s].items()):
            if max(w.up_s, w.down_s) > cap + tol:
                continue
            ways, tree_links = _tree_links(dict(shape), region, member, roots[s], g)
            for m, path in ways.items():
                routes.setdefault((pair[(m, s)], path), None)
            trees.setdefault((s, tree_links), None)
    if not trees or len({s for s, _ in trees}) < g:
        return None
    layers = int(cap / float(hop[links].min()) + 1e-9)

    def solve():
        cols_r, cols_c, vals, eq_r = [], [], [], []
        for j, (i, path) in enumerate(routes):
            cols_r += [row[link] for link in path]
            cols_c += [j] * len(path)
            vals += [up_us[link] for link in path]
            eq_r.append(i)
        for j, (s, tree_links) in enumerate(trees, start=len(routes)):
            cols_r += [row[link] for link in tree_links]
            cols_c += [j] * len(tree_links)
            vals += [down_us[link] for link in tree_links]
            eq_r.append(len(pairs) + s)
        n = len(routes) + len(trees)
        busy = csr_matrix((vals + [-1.0] * len(links), (cols_r + list(range(len(links))), cols_c + [n] * len(links))),
                          shape=(len(links), n + 1))
        eq = csr_matrix((np.ones(n), (eq_r, np.arange(n))), shape=(len(pairs) + g, n + 1))
        res = linprog(np.r_[np.zeros(n), 1.0], A_ub=busy, b_ub=np.zeros(len(links)), A_eq=eq,
                      b_eq=np.ones(len(pairs) + g), bounds=[(0.0, None)] * (n + 1), method="highs")
        return res if res.status == 0 else None

    for round_ in range(_ROUTE_ROUNDS):
        res = solve()
        if res is None:
            return None
        if round_ == _ROUTE_ROUNDS - 1:
            break
        price = -np.asarray(res.ineqlin.marginals)
        dual = np.asarray(res.eqlin.marginals)
        up_price = {link: price[row[link]] * up_us[link] + _ROUTE_TIE for link in links}
        down_price = {link: price[row[link]] * down_us[link] + _ROUTE_TIE for link in links}
        added = 0
        for s in range(g):
            # every node's cheapest way to the owner in h hops, layer by layer (reversed links)
            layer = {roots[s]: (0.0, 0.0, ())}
            best: dict = {}
            for _ in range(layers):
                nxt: dict = {}
                for v, (cost, lat, path) in layer.items():
                    for link in into[v]:
                        u = tail[link]
                        c = cost + up_price[link]
                        if u not in nxt or c < nxt[u][0]:
                            nxt[u] = (c, lat + float(hop[link]), (link,) + path)
                layer = nxt
                for u, way in layer.items():
                    if u < g and u != roots[s] and way[1] <= cap + tol and (u not in best or way[0] < best[u][0]):
                        best[u] = way
            for m, (cost, _, path) in sorted(best.items()):
                key = (pair[(m, s)], path)
                if cost < dual[pair[(m, s)]] - _ROUTE_GAIN and key not in routes:
                    routes[key] = None
                    added += 1
            tree_links = _grow_tree(roots[s], g, steps, tail, head, hop, down_price, cap + tol, layers)
            if tree_links is not None and (s, tree_links) not in trees:
                if sum(down_price[link] for link in tree_links) < dual[len(pairs) + s] - _ROUTE_GAIN:
                    trees[(s, tree_links)] = None
                    added += 1
        if not added:
            # the greedy trees found nothing cheaper: the cheapest trees within the cap (proven
            # where the program closes within its node limit; otherwise its best found, so the
            # search may then stop short of the optimum)
            for s in range(g):
                tree_links = _cheapest_tree(roots[s], g, size, links, tail, head, down_price, layers)[0]
                if tree_links is None or (s, tree_links) in trees or depth(s, tree_links)[0] > cap + tol:
                    continue
                if sum(down_price[link] for link in tree_links) < dual[len(pairs) + s] - _ROUTE_GAIN:
                    trees[(s, tree_links)] = None
                    added += 1
        if not added:
            break
    weight = np.maximum(res.x[:-1], 0.0)
    weight[weight < 1e-9] = 0.0
    commodity = np.array([i for i, _ in routes] + [len(pairs) + s for s, _ in trees])
    weight /= np.bincount(commodity, weights=weight, minlength=len(pairs) + g)[commodity]
    up = np.zeros(graph.nodes * 6)
    down = np.zeros(graph.nodes * 6)
    up_s = down_s = 0.0
    hops = 0
    for w, (_, path) in zip(weight[: len(routes)], routes):
        if w > 0:
            up[list(path)] += w
            up_s, hops = max(up_s, float(hop[list(path)].sum())), max(hops, len(path))
    for w, (s, tree_links) in zip(weight[len(routes):], trees):
        if w > 0:
            down[list(tree_links)] += w
            lat, n = depth(s, tree_links)
            down_s, hops = max(down_s, lat), max(hops, n)
    return OwnerTrees(up, down, float(up_s), float(down_s), int(hops))


def _grow_tree(root: int, g: int, steps: list, tail: dict, head: dict, hop: np.ndarray, price: dict, cap: float,
               layers: int) -> "tuple | None":
    """A cheap multicast tree from local node ``root`` to the members ``0 .. g - 1`` under link
    ``price``: grown from the root by the cheapest way from the tree to a member not yet in it
    (a shortest path over hop layers, at most ``layers`` hops from the root and ``cap`` seconds
    of hop latency to every member), until every member is in. Its links, sorted; None where
    some member is beyond the cap. Like :func:`_owner_routes`, assumes one hop latency on
    every board edge (the cheapest way of each hop count is kept, the cap then a hop count)."""
    depth = {root: (0.0, 0)}  # tree node -> (latency, hops) from the root
    chosen = []
    need = set(range(g)) - {root}
    while need:
        layer = {u: (0.0, lat, h, ()) for u, (lat, h) in depth.items()}
        best = None
        for _ in range(layers):
            nxt: dict = {}
            for u, (cost, lat, h, path) in sorted(layer.items()):
                if h >= layers:
                    continue
                for v, link in steps[u]:
                    if v in depth:
                        continue
                    c = cost + price[link]
                    if v not in nxt or c < nxt[v][0]:
                        nxt[v] = (c, lat + float(hop[link]), h + 1, path + (link,))
            layer = nxt
            for v, way in sorted(layer.items()):
                if v in need and way[1] <= cap and (best is None or way[0] < best[0]):
                    best = way
        if best is None:
            return None
        lat, h = depth[tail[best[3][0]]]
        for link in best[3]:
            lat, h = lat + float(hop[link]), h + 1
            depth[head[link]] = (lat, h)
            need.discard(head[link])
            chosen.append(link)
    return tuple(sorted(chosen))


def _cheapest_tree(root: int, g: int, size: int, links: list, tail: dict, head: dict, price: dict,
                   layers: int) -> "tuple | None":
    """The cheapest multicast tree under link ``price`` from local node ``root`` to the members
    ``0 .. g - 1``, every node at most ``layers`` board hops from the root: a mixed-integer
    program (scipy's HiGHS) over the links at each depth, each node entered at most once, a
    link used at depth ``h`` only out of a node entered at depth ``h - 1`` (the root at
    depth 0), every member entered (depth in board hops: a latency cap is a hop count only
    where every board edge has the same hop latency, the caller checking the tree's latency),
    solved to a zero optimality gap within a limit of
    branch-and-bound nodes (planning time). ``(its links sorted, proven)``: ``proven`` where
    the solver proved the tree the cheapest, otherwise it is the cheapest it found within the
    limit; ``(None, False)`` where it found none."""
    from scipy.optimize import LinearConstraint, milp
    from scipy.sparse import lil_matrix

    arcs = [(link, h) for h in range(layers) for link in links if head[link] != root]
    n = len(arcs)
    into: dict = {}
    out: dict = {}
    for j, (link, h) in enumerate(arcs):
        into.setdefault((head[link], h + 1), []).append(j)
        out.setdefault((tail[link], h), []).append(j)
    a = lil_matrix((size + len(arcs), n))
    low, high = [], []
    for v in range(size):  # entered at most once; a member exactly once
        for h in range(1, layers + 1):
            for j in into.get((v, h), ()):
                a[v, j] = 1.0
        low.append(1.0 if v < g and v != root else 0.0)
        high.append(0.0 if v == root else 1.0)
    for j, (link, h) in enumerate(arcs):  # out of a node only at the depth it was entered at
        a[size + j, j] = 1.0
        if tail[link] != root or h > 0:
            for i in into.get((tail[link], h), ()):
                a[size + j, i] = -1.0
            high.append(0.0)
        else:
            high.append(1.0)
        low.append(-np.inf)
    res = milp(np.array([price[link] for link, _ in arcs]), integrality=np.ones(n),
               bounds=(np.zeros(n), np.ones(n)), constraints=LinearConstraint(a.tocsr(), low, high),
               options={"node_limit": 200, "mip_rel_gap": 0.0})
    if res.x is None:
        return None, False
    return tuple(sorted(arcs[j][0] for j in np.flatnonzero(res.x > 0.5))), res.status == 0


def owner_floor(graph, members, piece: float, share: float, owners=None) -> tuple[float, float]:
    """A lower bound on the board edges' part of an all-reduce whose ``g`` shares are each
    added on one board (its owner) from the members' pieces of ``piece`` bytes and multicast
    back (``share`` bytes), whatever the trees or routes, any board free to relay but not to add.

    ``members``: the group's boards; ``owners``: share ``s``'s owner, a board of the system
    (default: member ``s``).

    Bandwidth: every board receives, over the board edges into it, the pieces of the shares
    it owns from every member but itself and, a member, every share it does not own; and
    sends, over the edges out of it, its pieces of the shares it does not own and each share
    it owns once; and every piece crosses at least as many board edges as the board hops from
    its member to its owner, and every reduced share one edge at least for each member but its
    owner (a tree spanning them), all over the system's directed board edges.
    Latency: each member's result of a share depends on the piece of the member farthest from
    the share's owner, which climbs to the owner and comes back down: twice the largest
    distance from an owner to a member, in hops of the cheapest board hop latency.

    Returns
    -------
    tuple of float
        ``(bandwidth seconds, latency seconds)``; ``(0, 0)`` for one board.
    """
    members = np.asarray(members, dtype=np.int64).reshape(-1)
    g = members.size
    if g < 2:
        return 0.0, 0.0
    owners = members if owners is None else np.asarray(owners, dtype=np.int64).reshape(-1)
    if owners.size != g or owners.min() < 0 or owners.max() >= graph.nodes:
        raise ValueError(f"owner_floor: one owner a share, boards of the system, got {owners.tolist()}")
    far = graph.neighbors
    rate = np.where(np.isfinite(graph.link_bw), graph.link_bw, 0.0).reshape(-1, 6)
    live = far >= 0
    into = np.zeros(graph.nodes)
    np.add.at(into, far[live], rate[live])
    out = np.where(live, rate, 0.0).sum(axis=1)
    owned = np.bincount(owners, minlength=graph.nodes)
    inside = np.zeros(graph.nodes, dtype=bool)
    inside[members] = True
    # hop distances from every owner over every board
    dist = np.full((g, graph.nodes), -1, dtype=np.int64)
    for i, s in enumerate(owners):
        dist[i, s], frontier, d = 0, np.array([s]), 0
        while frontier.size:
            nxt = np.unique(far[frontier][far[frontier] >= 0])
            nxt = nxt[dist[i, nxt] < 0]
            d += 1
            dist[i, nxt] = d
            frontier = nxt
    between = dist[:, members]
    if (between < 0).any():
        raise ValueError(f"owner_floor: the boards {members.tolist()} and owners {owners.tolist()} are not "
                         "joined by board edges")
    # joined: every board below sends and receives over at least one board edge
    single = 0.0
    for b in np.flatnonzero(inside | (owned > 0)):
        got = owned[b] * (g - int(inside[b])) * piece + (g - owned[b]) * share * int(inside[b])
        sent = (g - owned[b]) * piece * int(inside[b]) + owned[b] * share
        single = max(single, got / into[b], sent / out[b])
    copies = g * g - int(inside[owners].sum())
    volume = (piece * float(between.sum()) + share * copies) / float(rate[live].sum())
    hop = float(graph.link_hop_s[np.isfinite(graph.link_hop_s)].min())
    return max(single, volume), 2 * int(between.max()) * hop
