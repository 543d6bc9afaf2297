"""Collectives costed on the link graph: all-reduce, all-gather, reduce-scatter, all-to-all, point-to-point.

Every collective is a sequence of *steps*; a step is a set of concurrent transfers costed by
:meth:`tvm_spinn.target.topology.Topology.evaluate` (routes on the graph, bytes summed per link,
``max bytes / bandwidth + longest route's hop latencies``). A collective's time is the sum of its
steps: the model does not overlap one step with the next (each needs the data of the last).

Every function takes the system's link graph, a
:class:`tvm_spinn.target.topology.Topology` (``topology_of(arch)``).

Algorithms over ``c`` ranks (chip ids in the order given, rank ``i`` = ``ranks[i]``):

Every rate is the links' payload rate (a link's bit rate less its packets' headers and routing
keys), and the chip links through one board edge share that edge's serial links
(:meth:`~tvm_spinn.target.topology.Topology.link_seconds`).

- **ring** (bidirectional): half of the data goes around the ring one way and half the other,
  so each step sends ``n / (2c)`` bytes to each ring neighbour. All-reduce is a reduce-scatter
  and an all-gather: ``2 (c - 1)`` steps; all-gather and reduce-scatter ``c - 1`` steps.
- **tree** (binomial over rank indices): reduce to rank 0 in ``ceil(log2 c)`` steps (step ``k``:
  rank ``i + 2^k`` sends to ``i`` for ``i`` a multiple of ``2^(k+1)``), broadcast back in the
  reverse order. Gather and scatter use the same pairs with the subtree's share of the bytes.
  The reduce follows :func:`reduction_order` over the ranks, which is what makes a tree
  all-reduce bitwise reproducible (see there).
- **multicast** (all-gather only): every rank's share goes out as one packet stream that the
  routers copy onto several links (SpiNNaker's multicast routing, as in :func:`chain_all_reduce`)
  along a shortest-path tree of the ranks' own links; the ``c`` streams run at once, one step
  costing ``max link bytes / bandwidth + the deepest route's hop latencies``. The trees are
  chosen to spread the bytes over *all* the links between ranks, not the two of a ring: each
  rank takes, per source, the incoming link from a neighbour one hop closer that carries the
  fewest bytes so far (three greedy passes). A rank then receives ``n (c - 1) / c`` over up to
  6 links instead of 2: on a board ~0.65 of the ring's time, within ~3% of the bound of the
  rank with the fewest links (a hexagon corner has 3). Built for groups of at most
  :data:`MULTICAST_MAX_RANKS` ranks whose links connect them (otherwise not a candidate).

- **multicast reduce** (reduce-scatter, all-reduce of integer partial sums): the multicast
  trees run backwards. Share ``s`` is reduced towards rank ``s`` along the reverse of the tree
  that multicasts it, every rank adding its children's sums into its own before passing it up,
  all ``c`` reductions at once: one step whose link loads are the all-gather's with every link
  reversed. An all-reduce is that reduce-scatter and then the multicast all-gather: two steps
  of ``max link bytes / bandwidth + the deepest route's hop latencies``, so a small all-reduce
  on a board costs about two board diameters of hops rather than the ring's ``2 (c - 1)`` hop
  latencies or the tree's ``2 ceil(log2 c)`` full-message steps. The additions follow the
  trees, so floating-point sums do not take it (their bits must not depend on the plan:
  :func:`chain_all_reduce`).

- **packed trees** (:func:`board_group_all_reduce`, pipelined, integer sums): the row is cut
  into parts, each reduced and spread along a tree of its own that spans the group's boards
  and may pass through the boards around them. Every tree node adds what reaches it from all
  but one of its tree neighbours into its own partial sums and passes the sum to that
  neighbour, both ways along every tree edge at once, so each tree edge carries the part once
  in each direction and a member's sum is complete once the partial sums of the farthest
  member have arrived: the tree's span between members, not twice its depth from a root.
  The trees are packed by multiplicative weights (each the cheapest tree under link costs that
  grow with the parts the earlier ones put on a link) and the parts re-weighed to lighten the
  busiest edge; :func:`board_group_floor` bounds what any such schedule can reach.
  The trees of every span may also share the row at once, the longer trees' parts due first
  (:func:`_priority_packing`): the short trees fill the edges' time after the long ones have
  gone, so a few long trees spread the bytes while the last parts take the short ways; that
  schedule is costed by playing it out chunk by chunk on the graph of boards
  (:func:`_chunked_schedule`) where that is dearer than its closed form. Unpipelined, the
  same trees run rooted (:func:`_rooted_shapes`): each part reduced up to its tree's root,
  then multicast back down.

``algorithm="auto"`` costs ring, tree and multicast and returns the cheapest (ring on a tie).
On the links that matter, for ``n`` bytes, link bandwidth ``B`` and hop latency ``a``, two chips one
hop apart give ring all-reduce ``n / B + 2a`` and tree ``2n / B + 2a``: the tree pays the full
message per step, the ring ``n / c`` but ``2 (c - 1)`` latencies, so tiny messages go by tree.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

# No import of tvm_spinn.target here: timing sits on program only (tests/test_layering.py), and
# importing the target package loads TVM. Callers pass a Topology built by
# tvm_spinn.target.topology.topology_of; only its documented methods are used.

__all__ = [
    "CollectiveCost", "all_gather", "all_reduce", "chain_all_reduce", "fixed_order_sum", "point_to_point",
    "reduce_scatter", "reduction_order", "chip_blocks", "MULTICAST_MAX_RANKS", "board_all_reduce",
    "board_group_all_reduce", "multipath_point_to_point", "sliced_hand_over", "water_fill", "all_to_all",
    "board_all_to_all", "board_group_floor", "board_group_scattered_all_reduce",
]

_ALGORITHMS = ("ring", "tree")
#: Largest group the multicast all-gather is built for: its trees are chosen per (source, rank)
#: pair in Python (about 0.07 s for a board's 48 ranks, growing as ranks squared); larger
#: groups gather by ring or tree.
MULTICAST_MAX_RANKS = 64
_MULTICAST_PASSES = 3
#: Multicast tree sets kept per topology (:attr:`Topology.memo`), at most this many
_TREES_KEPT = 256


@dataclass(frozen=True)
class CollectiveCost:
    """Cost of one collective on the link graph.

    Attributes
    ----------
    op : str
        ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``, ``"point_to_point"`` or ``"all_to_all"``.
    algorithm : str
        ``"ring"``, ``"tree"``, ``"multicast"``, ``"chain"`` or ``"direct"``.
    seconds : float
        Sum over the steps of each step's time.
    bytes_per_link : float
        Bytes the busiest directed link carries over the whole collective.
    hops : int
        Hops on the critical path: the sum over steps of the step's longest route.
    board_hops : int
        Board-to-board hops on the critical path (same sum, board links only).
    steps : int
        Number of steps.
    ranks : int
        Chips taking part.
    nbytes : float
        The message size the collective was asked for (see each function).
    """

    op: str
    algorithm: str
    seconds: float
    bytes_per_link: float
    hops: int
    board_hops: int
    steps: int
    ranks: int
    nbytes: float
    segments: int = 0  # chain: the segments the message is cut into (0: not a chain)


# ----------------------------------------------------------------------------------------------
# Steps of each algorithm as (src rank index, dst rank index, bytes) arrays


def _ring_step(c: int, chunk: float) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """One ring step (repeated), as ``[(src, dst, bytes, repeats)]`` over rank indices."""
    i = np.arange(c)
    nxt, prv = (i + 1) % c, (i - 1) % c
    src, dst = np.concatenate([i, i]), np.concatenate([nxt, prv])
    return [(src, dst, np.full(2 * c, chunk / 2), 1)]


def _tree_pairs(c: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Binomial step ``k``: parents ``i`` (multiples of ``2^(k+1)``), children ``i + 2^k``, and
    the ranks in each child's subtree."""
    width = 1 << k
    parent = np.arange(0, c, 2 * width)
    parent = parent[parent + width < c]
    child = parent + width
    return parent, child, np.minimum(width, c - child)


def _levels(c: int) -> int:
    return int(c - 1).bit_length()  # ceil(log2 c) for c >= 1


def _tree_steps(op: str, c: int, n: float) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    up, down = [], []
    for k in range(_levels(c)):
        parent, child, subtree = _tree_pairs(c, k)
        if op in ("all_reduce", "reduce_scatter"):  # partial sums of the whole message go up
            up.append((child, parent, np.full(len(child), n), 1))
        else:  # all_gather: each subtree's own shares go up
            up.append((child, parent, subtree * (n / c), 1))
        if op in ("all_reduce", "all_gather"):  # the whole result comes down
            down.append((parent, child, np.full(len(child), n), 1))
        else:  # reduce_scatter: each subtree gets its shares
            down.append((parent, child, subtree * (n / c), 1))
    return up + down[::-1]


def _steps(op: str, algorithm: str, c: int, n: float):
    if algorithm == "tree":
        return _tree_steps(op, c, n)
    repeats = 2 * (c - 1) if op == "all_reduce" else c - 1
    (src, dst, size, _), = _ring_step(c, n / c)
    return [(src, dst, size, repeats)]


def _evaluate(topo: "Topology", ranks: np.ndarray, op: str, algorithm: str, steps, nbytes: float) -> CollectiveCost:
    seconds, hops, board_hops, count = 0.0, 0, 0, 0
    total = None  # bytes per link over the steps (one step: its own load, no copy of the system's links)
    for src, dst, size, repeats in steps:
        cost, load = topo.evaluate(ranks[src], ranks[dst], size)
        seconds += repeats * cost.seconds
        hops += repeats * cost.max_hops
        board_hops += repeats * cost.board_hops
        total = repeats * load if total is None else total + repeats * load
        count += repeats
    busiest = 0.0 if total is None else float(total.max(initial=0.0))
    return CollectiveCost(
        op=op, algorithm=algorithm, seconds=seconds, bytes_per_link=busiest,
        hops=hops, board_hops=board_hops, steps=count, ranks=len(ranks), nbytes=float(nbytes),
    )


def _prepare(topo: "Topology", ranks: Sequence[int], nbytes: float) -> tuple["Topology", np.ndarray]:
    if not hasattr(topo, "evaluate"):
        raise TypeError(f"expected a Topology (tvm_spinn.target.topology_of(arch)), got {type(topo).__name__}")
    ranks = np.asarray(ranks, dtype=np.int64).reshape(-1)
    if ranks.size == 0:
        raise ValueError("a collective needs at least one rank")
    if np.unique(ranks).size != ranks.size:
        raise ValueError("ranks must be distinct chips")
    if not np.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
    return topo, ranks


def _forget(memo: dict, kind: str) -> None:
    """Drop the entries of one kind from a topology's memo (bounds its size)."""
    for key in [k for k in memo if k[0] == kind]:
        del memo[key]


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
    all-gather's trees over ``ranks`` (see the module docstring), or None when the ranks'
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
    if len(memo) > _TREES_KEPT:
        _forget(memo, "multicast_trees")
    memo[key] = result
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
#: Parts a board's share of :func:`board_group_all_reduce` is cut into at most (each part its own
#: tree: a board's share then leaves over several of its six board edges), and the trees of
#: all the boards' parts together at most (planning time: each round rebuilds every tree)
_SPLIT_PARTS = 4
_SPLIT_TREES = 32


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


def _priority_packing(graph, ranks: np.ndarray, members: int, nbytes: float, figure=None, bound: float = np.inf):
    """:func:`_priority_fluid`'s trees and weights with the figure the schedule reaches: the
    dearer of the closed form and the schedule played out by :func:`_chunked_schedule` (each
    part in :data:`_SCHEDULE_CHUNKS` chunks), the cheapest of the weights found for each span
    cap (played out in the order of their closed forms, until the next closed form is no
    cheaper than the best figure). Same tuple; None where there are no trees.

    ``figure(T, first)``, non-decreasing in ``T`` and never below ``figure(T, -inf)``, is the
    caller's all-reduce figure and ``bound`` the figure it already has: where neither the best
    weights played so far nor any later ones (whose played figure is at least their closed
    form, no cheaper than the current one) can give a figure below ``bound``, the play stops
    and None comes back, the caller's choice the same as with every weight played. Each
    weights' played figure is memoized on the graph per size, so a later call with another
    bound plays out only what it still needs."""
    fluids = _priority_fluid(graph, ranks, members, nbytes) is not None and \
        graph.memo[("priority_fluid", ranks.tobytes(), int(members), float(nbytes))]
    if not fluids:
        return None
    shapes = graph.memo[("packed_shapes", ranks.tobytes(), int(members))][3]
    key = ("priority_played", ranks.tobytes(), int(members), float(nbytes))
    if key not in graph.memo:
        if len(graph.memo) > _TREES_KEPT:
            _forget(graph.memo, "priority_played")
        graph.memo[key] = {}
    played = graph.memo[key]  # index of the weights in ``fluids`` -> their figure played out
    best = None
    # each span cap's weights, the cheapest closed form first, while it could still win
    for i, fluid in enumerate(fluids):
        if best is not None and fluid[0] >= best[0]:
            break
        if figure is not None and figure(fluid[0], -np.inf) >= bound and \
                (best is None or figure(best[0], best[2]) >= bound):
            return None  # neither these weights nor any later ones, nor the best, gets below bound
        if i not in played:
            played[i] = _chunked_schedule(graph, ranks, shapes, fluid[4], int(members), float(nbytes),
                                          _SCHEDULE_CHUNKS, fluid[0])
        if best is None or max(fluid[0], played[i]) < best[0]:
            best = (max(fluid[0], played[i]),) + fluid[1:]
    return best


def _priority_fluid(graph, ranks: np.ndarray, members: int, nbytes: float):
    """The row split over :func:`_packed_trees`' trees of *every* span at once, the parts on
    the trees of longer span sent first.

    Every board edge passes first the part whose bytes are due first, a part of a longer tree
    earlier (it has further to go after the edge), so the parts of the trees whose span is at
    least ``s`` have crossed every edge once the edges have carried their bytes alone: a part
    on a tree of span ``s`` is in every member once its trees' and the longer trees' bytes
    have crossed the busiest edge and ``s`` more (the packed trees' own figure, busiest edge
    plus span, class by class). The all-reduce ends with the latest class::

        T(w) = max over the spans s used of  max over edges of (sum of w_j load_j over the
               trees j of span >= s) / rate  +  s

    With one span this is :func:`_packed_trees`' figure; with several, the short trees fill
    the edges' time after the long ones have gone, so a few long trees spread the bytes while
    the short ones keep the last parts' latency low. The weights ``w`` (the row's share on
    each tree) minimise ``T``: for each longest span ``c`` allowed, a linear program (scipy's
    HiGHS) over the trees no longer than ``c``, ``min T`` subject to the bound of every class
    ``s <= c`` on every edge, the cheapest over ``c``; ``T`` is then recomputed from the
    weights as above. Never below :func:`board_group_floor` (the busiest edge of all the
    bytes plus the shortest span, at least the floor's two parts).

    That closed form is what the schedule tends to as the parts flow as ever finer chunks, but
    with several spans the edges cannot always keep to it (a long tree's bytes reach an edge
    far from its members only after their fill): :func:`_priority_packing` gives the figure
    the schedule reaches played out (32 KB over the group of 16 boards of a 24-board torus:
    the weights of span cap 31.5 us 111.7 us against their closed form's 107.8 us, those of
    cap 27 us 108.6 us against 108.0; over a band of 16 boards of the cloud 142.4 us against
    131.6 us, where the trees of one span cap, 141.7 us, stay the cheaper).

    Returns ``(closed form's seconds, load, shortest span used, its longest span's hops,
    weights)`` of the cheapest closed form (the memo keeps every span cap's, cheapest
    first): ``load`` each directed board edge's share of the row; None where
    :func:`_packed_trees` finds no trees. Memoized on the graph per size."""
    key = ("priority_fluid", ranks.tobytes(), int(members), float(nbytes))
    if key in graph.memo:
        return graph.memo[key][0] if graph.memo[key] else None
    if len(graph.memo) > _TREES_KEPT:
        _forget(graph.memo, "priority_fluid")
    if _packed_trees(graph, ranks, members) is None:
        graph.memo[key] = []
        return None
    from scipy.optimize import linprog

    full, span, span_hops = graph.memo[("packed_shapes", ranks.tobytes(), int(members))][:3]
    links = np.flatnonzero(full.any(axis=0))
    # microseconds: the solver's tolerances are absolute
    busy = full[:, links] * (float(nbytes) / graph.link_bw[links]) * 1e6
    spans = np.unique(span)
    found = []
    for cap in spans:  # the trees no longer than each span
        allowed = np.flatnonzero(span <= cap)
        n = allowed.size
        blocks, bounds_ub = [], []
        for s in spans[spans <= cap]:  # each class's bound on every edge
            on = (span[allowed] >= s).astype(np.float64)
            blocks.append(np.hstack([(busy[allowed] * on[:, None]).T, -np.ones((links.size, 1))]))
            bounds_ub.append(np.full(links.size, -float(s) * 1e6))
        res = linprog(np.r_[np.zeros(n), 1.0], A_ub=np.vstack(blocks), b_ub=np.concatenate(bounds_ub),
                      A_eq=np.r_[np.ones(n), 0.0][None, :], b_eq=[1.0],
                      bounds=[(0.0, None)] * (n + 1), method="highs")
        if res.status != 0:
            continue
        weight = np.zeros(span.size)
        weight[allowed] = np.maximum(res.x[:n], 0.0)
        weight[weight < 1e-9 * weight.max()] = 0.0
        weight /= weight.sum()
        seconds = _priority_seconds(graph, full, span, weight, float(nbytes))
        used = weight > 0
        found.append((seconds, float(cap), weight @ full, float(span[used].min()), int(span_hops[used].max()),
                      weight))
    found.sort(key=lambda f: f[:2])
    graph.memo[key] = [f[:1] + f[2:] for f in found]  # every span cap's, the cheapest first
    return graph.memo[key][0] if found else None


def _priority_seconds(graph, full: np.ndarray, span: np.ndarray, weight: np.ndarray, nbytes: float) -> float:
    """:func:`_priority_packing`'s ``T(w)``: per span used, the busiest edge's time with the
    bytes of the trees of that span or longer, plus the span; the latest."""
    out = 0.0
    for s in np.unique(span[weight > 0]):
        on = np.where(span >= s, weight, 0.0)
        out = max(out, graph.link_seconds((on @ full) * nbytes) + float(s))
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


def _multicast(topo: "Topology", ranks: np.ndarray, nbytes: float) -> "CollectiveCost | None":
    """The multicast all-gather's cost, or None where it is not built (see the module docstring)."""
    c = ranks.size
    if c == 1 or nbytes == 0:
        return CollectiveCost("all_gather", "multicast", 0.0, 0.0, 0, 0, int(c > 1), c, float(nbytes))
    if c > MULTICAST_MAX_RANKS:
        return None
    trees = _multicast_trees(topo, ranks)
    if trees is None:
        return None
    shares, latency, hops, board_hops = trees[:4]
    load = shares * (float(nbytes) / c)
    seconds = topo.link_seconds(load) + latency
    return CollectiveCost("all_gather", "multicast", seconds, float(load.max()), hops, board_hops, 1, c,
                          float(nbytes))


def _multicast_reduce(op: str, topo: "Topology", ranks: np.ndarray, nbytes: float,
                      sources: "int | None" = None) -> "CollectiveCost | None":
    """Reduce-scatter over the multicast trees run backwards (and, for ``op="all_reduce"``, the
    multicast all-gather after it), or None where the trees are not built.

    Shard ``s`` of the ``c`` shares is reduced towards rank ``s`` along the reverse of the tree
    that multicasts it: every rank adds what its children send into its own share and passes
    the sum to its parent, so each tree link carries the shard once, the other way. The link
    loads are the all-gather's with every link reversed, and all ``c`` reductions run at once:
    one step of ``max link bytes / bandwidth + the deepest reversed route's hop latencies``
    (the additions ride on the words as they arrive, like the routers' copies of a multicast;
    they are not charged). The order of the additions follows the trees, so this is for
    integer partial sums (any order) only: floating-point sums use :func:`chain_all_reduce`.
    ``sources``: the first ``sources`` ranks take part, the others relay (see
    :func:`_multicast_trees`)."""
    c = ranks.size
    if c == 1 or nbytes == 0:
        return CollectiveCost(op, "multicast", 0.0, 0.0, 0, 0, int(c > 1), c, float(nbytes))
    if c > MULTICAST_MAX_RANKS:
        return None
    trees = _multicast_trees(topo, ranks, sources)
    if trees is None:
        return None
    shares, latency, hops, board_hops, rev_shares, back = trees
    share = float(nbytes) / (c if sources is None else sources)
    rev = rev_shares * share
    seconds = topo.link_seconds(rev) + back
    if op == "reduce_scatter":
        return CollectiveCost(op, "multicast", seconds, float(rev.max()), hops, board_hops, 1, c, float(nbytes))
    load = shares * share
    seconds += topo.link_seconds(load) + latency
    return CollectiveCost(op, "multicast", seconds, float((rev + load).max()), 2 * hops, 2 * board_hops, 2, c,
                          float(nbytes))


def _collective(op: str, topo: "Topology", ranks, nbytes: float, algorithm: str, allowed=_ALGORITHMS) -> CollectiveCost:
    topo, ranks = _prepare(topo, ranks, nbytes)
    if algorithm != "auto" and algorithm not in allowed:
        raise ValueError(f"algorithm must be 'auto' or one of {allowed}, got {algorithm!r}")
    candidates = allowed if algorithm == "auto" else (algorithm,)
    costs = [(_multicast(topo, ranks, nbytes) if op == "all_gather" else _multicast_reduce(op, topo, ranks, nbytes))
             if a == "multicast"
             else _evaluate(topo, ranks, op, a, _steps(op, a, ranks.size, float(nbytes)), nbytes) for a in candidates]
    if algorithm == "multicast" and costs[0] is None:
        raise ValueError(f"no multicast {op.replace('_', '-')} over these {ranks.size} ranks: it needs at most "
                         f"{MULTICAST_MAX_RANKS} ranks that the links between them connect")
    return min((cost for cost in costs if cost is not None), key=lambda cost: cost.seconds)  # ring on a tie


def all_reduce(topo: "Topology", ranks: Sequence[int], nbytes: float,
               algorithm: str = "auto", reproducible: bool = False) -> CollectiveCost:
    """Cost of an all-reduce of ``nbytes`` bytes held by every rank.

    Parameters
    ----------
    topo : Topology
        The system's link graph (:func:`tvm_spinn.target.topology.topology_of`).
    ranks : sequence of int
        Distinct chip ids; their order is the ring order and the tree's rank order.
    nbytes : float
        Bytes of the buffer each rank contributes and receives back reduced.
    algorithm : {"auto", "ring", "tree", "multicast"}
        ``"auto"`` returns the cheapest (multicast: a reduce-scatter over the multicast trees
        run backwards, then the multicast all-gather; where it is built, see :func:`all_gather`).
    reproducible : bool
        Only algorithms whose additions follow :func:`reduction_order` (the tree); the ring's
        chunk order depends on the rank count.

    Returns
    -------
    CollectiveCost
    """
    allowed = ("tree",) if reproducible else _ALGORITHMS + ("multicast",)
    return _collective("all_reduce", topo, ranks, nbytes, algorithm, allowed)


def all_gather(topo: "Topology", ranks: Sequence[int], nbytes: float,
               algorithm: str = "auto") -> CollectiveCost:
    """Cost of an all-gather whose result on every rank is ``nbytes`` bytes.

    Parameters
    ----------
    topo : Topology
        The system's link graph.
    ranks : sequence of int
        Distinct chip ids; each contributes ``nbytes / len(ranks)`` bytes.
    nbytes : float
        Bytes of the gathered result.
    algorithm : {"auto", "ring", "tree", "multicast"}
        ``"auto"`` returns the cheapest (multicast where it is built: at most
        :data:`MULTICAST_MAX_RANKS` ranks connected by their own links).

    Returns
    -------
    CollectiveCost

    Raises
    ------
    ValueError
        For ``algorithm="multicast"`` over ranks it is not built for (naming why).
    """
    return _collective("all_gather", topo, ranks, nbytes, algorithm, _ALGORITHMS + ("multicast",))


def reduce_scatter(topo: "Topology", ranks: Sequence[int], nbytes: float,
                   algorithm: str = "auto") -> CollectiveCost:
    """Cost of a reduce-scatter of ``nbytes`` bytes held by every rank.

    Parameters
    ----------
    topo : Topology
        The system's link graph.
    ranks : sequence of int
        Distinct chip ids; each ends with ``nbytes / len(ranks)`` reduced bytes.
    nbytes : float
        Bytes of each rank's input buffer.
    algorithm : {"auto", "ring", "tree", "multicast"}
        ``"auto"`` returns the cheapest (multicast: the multicast all-gather's trees run
        backwards, adding on the way; where it is built, see :func:`all_gather`).

    Returns
    -------
    CollectiveCost
    """
    return _collective("reduce_scatter", topo, ranks, nbytes, algorithm, _ALGORITHMS + ("multicast",))


def board_all_reduce(topo: "Topology", grid: Sequence[Sequence[int]], nbytes: float,
                     algorithm: str = "auto", board_gather: bool = True) -> CollectiveCost:
    """Cost of an all-reduce of integer partial sums across boards, every chip of each board taking part.

    ``grid[b][i]`` is chip ``i`` of board ``b``; every chip holds the board's ``nbytes`` of
    partial sums. Chip ``i`` of every board reduces the ``i``-th of ``k`` slices of the buffer
    (``nbytes / k`` bytes) with its counterparts on the other boards, the ``k`` slices' ring or
    tree collectives (as :func:`all_reduce` over the boards) all at once, so they share the board
    edges' serial links on the link graph; then each board all-gathers its ``k`` reduced slices
    (:func:`all_gather`, the cheapest algorithm over the board's own links).

    Parameters
    ----------
    topo : Topology
        The system's link graph.
    grid : sequence of sequence of int
        ``g`` boards by ``k`` distinct chip ids (the same ``k`` on every board).
    nbytes : float
        Bytes of the buffer each board contributes and every chip receives back reduced.
    algorithm : {"auto", "ring", "tree"}
        The collective across the boards; ``"auto"`` returns the cheaper.
    board_gather : bool
        Whether the on-board all-gather is part of it. Without it, chip ``i`` of every board
        ends with the ``i``-th reduced slice: the layout in which the layer that produced the
        partial sums left them, for a caller whose consumer gathers what it needs itself.

    Returns
    -------
    CollectiveCost
        ``algorithm`` ``"board-ring"`` or ``"board-tree"``; ``ranks`` counts every chip; ``steps``
        and ``hops`` include the on-board all-gather's.
    """
    grid = np.asarray(grid, dtype=np.int64)
    if grid.ndim != 2 or grid.size == 0:
        raise ValueError(f"grid must be boards x chips (a 2-D array of chip ids), got shape {grid.shape}")
    topo, ranks = _prepare(topo, grid.reshape(-1), nbytes)
    if algorithm != "auto" and algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm must be 'auto' or one of {_ALGORITHMS}, got {algorithm!r}")
    g, k = grid.shape
    if g == 1 or nbytes == 0:
        return CollectiveCost("all_reduce", "board-ring", 0.0, 0.0, 0, 0, 0, int(ranks.size), float(nbytes))
    column = np.arange(k)
    best = None
    for name in (_ALGORITHMS if algorithm == "auto" else (algorithm,)):
        steps = []
        for src, dst, size, repeats in _steps("all_reduce", name, g, float(nbytes) / k):
            # board index b, chip index i -> rank index b * k + i, for all k slices at once
            steps.append(((src[:, None] * k + column).reshape(-1), (dst[:, None] * k + column).reshape(-1),
                          np.repeat(size, k), repeats))
        cost = _evaluate(topo, ranks, "all_reduce", f"board-{name}", steps, nbytes)
        if best is None or cost.seconds < best.seconds:
            best = cost
    gather = all_gather(topo, grid[0], nbytes) if k > 1 and board_gather else None
    if gather is None:
        return best
    return dataclasses.replace(best, seconds=best.seconds + gather.seconds, hops=best.hops + gather.hops,
                               steps=best.steps + gather.steps,
                               bytes_per_link=max(best.bytes_per_link, gather.bytes_per_link))


def water_fill(rates: Sequence[float], latencies: Sequence[float], nbytes: float) -> tuple[float, np.ndarray]:
    """Split ``nbytes`` over paths of the given rates and latencies so that all finish together.

    Path ``p`` carries ``rates[p] (T - latencies[p])`` bytes where that is positive; ``T`` is the
    smallest time at which the paths together carry ``nbytes`` (a path slower to start than
    ``T`` carries nothing).

    Returns
    -------
    tuple
        ``(T, bytes per path)``.
    """
    r = np.asarray(rates, dtype=np.float64)
    lat = np.asarray(latencies, dtype=np.float64)
    if r.shape != lat.shape or r.size == 0 or (r <= 0).any():
        raise ValueError("water_fill needs one positive rate per path and at least one path")
    if nbytes <= 0:
        return 0.0, np.zeros(r.size)
    order = np.argsort(lat, kind="stable")
    best = np.inf
    for m in range(1, r.size + 1):
        use = order[:m]
        t = (nbytes + float((r[use] * lat[use]).sum())) / float(r[use].sum())
        if t >= lat[use].max() and (m == r.size or t <= lat[order[m]]):
            best = t
            break
        best = min(best, t) if t >= lat[use].max() else best
    share = np.maximum(0.0, r * (best - lat))
    return float(best), share


def multipath_point_to_point(topo: "Topology", src_board: int, dst_board: int, nbytes: float) -> CollectiveCost:
    """Cost of one board's ``nbytes`` sent to another board over every edge-disjoint path at once.

    When one transfer is alone on the links (a batch-1 token crossing from one pipeline stage
    to the next), it need not take the one board edge between the two boards: the paths of
    :meth:`~tvm_spinn.target.topology.Topology.board_paths` share no board edge, so their serial
    links run in parallel. Each path's rate and hop latency come from the link graph
    (:meth:`~tvm_spinn.target.topology.Topology.path_cost`), and the bytes are split so that
    the paths finish together (:func:`water_fill`). The chips at either end move the shares
    between the board's chips and its edges on on-board links, each several times an edge's
    rate, so the edges bind (their hops are in the paths' latencies).

    Parameters
    ----------
    topo : Topology
        The system's link graph.
    src_board, dst_board : int
        Distinct boards.
    nbytes : float
        Bytes to move.

    Returns
    -------
    CollectiveCost
        ``algorithm="multipath"``, one step; ``bytes_per_link`` the busiest path's bytes,
        ``hops`` the longest used path's board hops.
    """
    if not np.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
    paths = topo.board_paths(int(src_board), int(dst_board))
    if not paths:
        raise ValueError(f"no path of board edges from board {src_board} to board {dst_board}")
    costs = [topo.path_cost(p) for p in paths]
    seconds, share = water_fill([c[0] for c in costs], [c[1] for c in costs], float(nbytes))
    used = [len(p) for p, b in zip(paths, share) if b > 0] or [len(paths[0])]
    return CollectiveCost("point_to_point", "multipath", seconds, float(share.max(initial=0.0)), max(used),
                          max(used), 1, 2, float(nbytes))


def _gather_parts(topo: "Topology", ranks: np.ndarray, nbytes: float) -> "tuple[float, float] | None":
    """``(bandwidth seconds, latency seconds)`` of the multicast all-gather of ``nbytes`` over
    ``ranks`` (its busiest link's bytes and its deepest route), or None where its trees are not
    built."""
    c = ranks.size
    if c == 1 or nbytes == 0:
        return 0.0, 0.0
    if c > MULTICAST_MAX_RANKS:
        return None
    trees = _multicast_trees(topo, ranks)
    if trees is None:
        return None
    return topo.link_seconds(trees[0] * (float(nbytes) / c)), float(trees[1])


def board_group_floor(topo: "Topology", boards: Sequence[int], nbytes: float) -> tuple[float, float]:
    """A lower bound on the board edges' part of an all-reduce of ``nbytes`` over a group of
    boards (:func:`board_group_all_reduce` with ``pipelined=True`` and ``board_gather=False``,
    whatever its trees), any board of the system free to relay and to add partial sums.

    Bandwidth: cut the boards into ``k`` parts, each holding at least one of the group's boards;
    an all-reduce among ``k`` parties moves at least ``2 (k - 1)`` copies of every element from
    one part to another (each party's data must leave it and the sum reach it), so the links
    between the parts carry ``2 (k - 1) nbytes`` at least. Two cuts are taken: one board of the
    group against all the others (``2 nbytes`` over its twelve directed edges: every board must
    receive ``nbytes`` and send ``nbytes``), and every board of the group a part of its own with
    the boards outside the group joined to the part of one of them (the ``2 (g - 1)`` copies over
    the edges that leave a part), the larger over the choice of that board. Latency: the result
    on each board depends on every other board's partial sums, so the two boards of the group
    the most board hops apart are that many of the cheapest hop latencies apart.

    Parameters
    ----------
    topo : Topology
        The system's link graph.
    boards : sequence of int
        The group's distinct boards.
    nbytes : float
        Bytes of the row each board contributes and receives back reduced.

    Returns
    -------
    tuple of float
        ``(bandwidth seconds, latency seconds)``; ``(0, 0)`` for one board.
    """
    members = np.asarray(boards, dtype=np.int64).reshape(-1)
    if members.size == 0 or np.unique(members).size != members.size:
        raise ValueError(f"board_group_floor: a group of distinct boards, got {members.tolist()}")
    if not np.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
    graph = topo.board_graph()
    if members.min() < 0 or members.max() >= graph.nodes:
        raise ValueError(f"board_group_floor: boards must be in [0, {graph.nodes}), got {members.tolist()}")
    g = members.size
    if g == 1 or nbytes == 0:
        return 0.0, 0.0
    far = graph.neighbors  # (boards, 6): the board across each edge, -1 where none
    rate = np.where(np.isfinite(graph.link_bw), graph.link_bw, 0.0).reshape(-1, 6)
    live = far >= 0
    # directed edges leaving (and, by symmetry of the torus, entering) each board
    out_rate = np.where(live, rate, 0.0)
    into = np.zeros(graph.nodes)
    np.add.at(into, far[live], rate[live])
    single = float(max(2.0 * nbytes / (out_rate[b].sum() + into[b]) for b in members))
    inside = np.zeros(graph.nodes, dtype=bool)
    inside[members] = True
    best = 0.0
    for keep in members:  # the part that also holds every board outside the group
        part = np.where(inside, np.arange(graph.nodes), keep)
        cross = live & (part[:, None] != np.where(live, part[np.where(live, far, 0)], -1))
        capacity = float(rate[cross].sum())
        best = max(best, 2.0 * (g - 1) * nbytes / capacity)
    # hop distances between the group's boards over every board
    hops = 0
    for s in members:
        dist = np.full(graph.nodes, -1, dtype=np.int64)
        dist[s], frontier = 0, np.array([s])
        while frontier.size:
            nxt = np.unique(far[frontier][far[frontier] >= 0])
            nxt = nxt[dist[nxt] < 0]
            dist[nxt] = dist[frontier[0]] + 1
            frontier = nxt
        hops = max(hops, int(dist[members].max()))
    return max(single, best), hops * float(graph.link_hop_s.min())


def _board_rows(topo: "Topology", grid, who: str) -> tuple[np.ndarray, np.ndarray]:
    """``grid`` as a ``(g, k)`` array of chip ids, each row the chips of one board, and the
    rows' boards; a ragged or non-integer grid, or rows that are not one distinct board each, are
    refused naming ``who``."""
    try:
        grid = np.asarray(grid, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as err:
        raise ValueError(f"{who}: grid must be boards x chips, rows of equal length of integer chip ids ({err})") \
            from None
    if grid.ndim != 2 or grid.size == 0:
        raise ValueError(f"{who}: grid must be boards x chips (a 2-D array of chip ids), got shape {grid.shape}")
    board = topo.board_of(grid)
    if (board != board[:, :1]).any() or np.unique(board[:, 0]).size != grid.shape[0]:
        raise ValueError(f"{who}: each row of grid must be the chips of one board, boards distinct")
    return grid, board[:, 0]


def _byte_count(name: str, value) -> float:
    """``value`` as a float of bytes, refused naming ``name`` unless a finite number >= 0."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number of bytes, got {type(value).__name__} {value!r}")
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _board_halves(topo: "Topology", a: int, b: int, nbytes: float) -> float:
    """Seconds for two boards to send each other half of ``nbytes`` over every edge-disjoint
    path between them (:func:`multipath_point_to_point`; the two directions use opposite
    directed links, so they run at once)."""
    return max(multipath_point_to_point(topo, a, b, nbytes / 2).seconds,
               multipath_point_to_point(topo, b, a, nbytes / 2).seconds)


def _board_tree_options(graph, members: np.ndarray, part: float) -> tuple[np.ndarray, list]:
    """The multicast tree sets a group of more than two boards may reduce and multicast its
    shares along, and the boards the packed trees may span.

    The members' own multicast trees; then, where the group and the boards next to it are at
    most :data:`MULTICAST_MAX_RANKS`, trees through those boards too (at batch 1 their edges are
    free, and a board on the group's border then reduces and receives over all six of its
    edges): the multicast trees over them, each board's share whole along one tree
    (:func:`_spread_trees`), or cut into ``m`` parts along trees of their own
    (:func:`_negotiated_trees`, ``g m`` trees at most :data:`_SPLIT_TREES`: planning time).
    ``part``: the bytes of a board's share the trees are built for.

    Returns
    -------
    tuple
        ``(region, options)``: the group's boards followed by the boards next to it where they
        fit (else the group's alone), and ``(trees, m)`` per candidate, ``trees`` as
        :func:`_multicast_trees` returns them (None where not built) for a share cut into ``m``
        parts (each part ``part / m`` bytes).
    """
    g = members.size
    options = [(_multicast_trees(graph, members) if g <= MULTICAST_MAX_RANKS else None, 1)]
    halo = np.setdiff1d(np.unique(graph.neighbors[members]), members)
    halo = halo[halo >= 0]
    if not (halo.size and g + halo.size <= MULTICAST_MAX_RANKS):
        return members, options
    region = np.concatenate([members, halo])
    options.append((_multicast_trees(graph, region, g), 1))
    options.append((_spread_trees(graph, region, g, part), 1))
    options += [(_negotiated_trees(graph, region, g, part / m, m), m)
                for m in range(1, _SPLIT_PARTS + 1) if m == 1 or g * m <= _SPLIT_TREES]
    return region, options


def board_group_all_reduce(topo: "Topology", grid: Sequence[Sequence[int]], nbytes: float,
                           board_gather: bool = True, pipelined: bool = False,
                           fuse_gather: bool = False) -> CollectiveCost:
    """Cost of an all-reduce of integer partial sums across boards, each board one rank of the
    multicast reduce on the graph of boards.

    ``grid[b]``: the chips of the ``b``-th board of the group (every chip holds the board's
    ``nbytes`` of partial sums, as in :func:`board_all_reduce`). The boards are the ranks of the
    multicast reduce-scatter and all-gather (see the module docstring) on
    :meth:`~tvm_spinn.target.topology.Topology.board_graph`: one link per board edge at its
    serial links' rate, so each board's share is reduced and multicast along trees that use
    every edge between the group's boards, not the one or two edges of a ring; the boards next
    to the group may relay (their edges are free while one token is in flight), and the trees
    may leave the shortest paths to spread the shares over more edges (:func:`_spread_trees`,
    :func:`_negotiated_trees`), the cheapest trees taken. Then every chip
    of a board receives the result from the board's edges (the board's all-gather, as in
    :func:`board_all_reduce`). Integer sums only (any order). Falls back to
    :func:`board_all_reduce` where the trees are not built (more than
    :data:`MULTICAST_MAX_RANKS` boards) or where that is cheaper.

    Two boards exchange halves over every edge-disjoint path between them
    (:func:`multipath_point_to_point`, both directions at once) instead.

    ``board_gather=False`` leaves out the on-board all-gather (as in :func:`board_all_reduce`):
    each chip then receives only its own slice of the reduced sums from the board's edges, the
    layout the producing layer left, where the program that consumes them gathers the whole
    vector itself (a board's program whose norm needs the whole row all-gathers it anyway).

    ``pipelined=True``: the shares are cut into segments, and a share's root multicasts each
    segment as soon as it is reduced, while the later segments still flow up the reversed
    trees: a directed board edge then carries its reduce and its multicast bytes at once (the
    two phases use each edge's two directions differently), so the all-reduce costs the
    busiest edge's bytes of both phases together plus the deepest route each way, instead of
    the busiest edge of each phase one after the other. Never dearer.

    With ``pipelined`` the row may also be cut into parts that each take a tree of their own
    (:func:`_packed_trees`, the module docstring's packed trees): every tree edge carries its
    part both ways at once, the busiest edge's bytes over its rate plus the longest way between
    two members along a tree (the members' sums complete as the farthest partial sums arrive);
    the trees pass through the boards around the group (free at batch 1), which add partial
    sums too, so the group's own edges no longer carry all of ``2 (g - 1) / g`` of the row.
    The trees of every span may carry the row together, the longer trees' parts sent first
    (:func:`_priority_packing`), where that is cheaper. Never below :func:`board_group_floor`.

    Without ``pipelined`` the packed trees run rooted (:func:`_rooted_shapes`): each tree's part
    reduced up to its root, then multicast back down, the two phases one after the other and
    costed as the multicast trees' are, so the unpipelined all-reduce, too, spreads the row over
    many trees through the group and the boards around it rather than one tree per board's
    share (:func:`_rooted_weights`: the parts per cap on the trees' span or depth).

    ``fuse_gather=True`` (with ``board_gather``): the on-board all-gather rides on the
    multicast: the reduced shares entering a board (and its own) are copied by the board's
    routers to every chip as they arrive (SpiNNaker's multicast routing), so the board's
    all-gather streams behind the board edges instead of starting after the last share: it
    adds its deepest route's hop latencies and the part of its link time the board edges do
    not already take (the edges are the slower: :attr:`~tvm_spinn.target.arch.SpinnArch.
    board_link_bw_bytes_s` against the on-board links' :attr:`~tvm_spinn.target.arch.
    SpinnArch.link_bw_bytes_s`).

    Returns
    -------
    CollectiveCost
        ``algorithm="board-multicast"``, ``"board-packed"`` (the packed trees; ``hops`` and
        ``board_hops`` their longest way between two members, or twice the deepest member's
        way to its root where they run rooted) or ``"board-multipath"`` (two boards) when that
        is the cheaper.
    """
    grid = np.asarray(grid, dtype=np.int64)
    ring = board_all_reduce(topo, grid, nbytes, board_gather=board_gather)
    g, k = grid.shape
    if g == 1 or nbytes == 0:
        return ring
    grid, members = _board_rows(topo, grid, "board_group_all_reduce")
    gather = all_gather(topo, grid[0], nbytes) if k > 1 and board_gather else None
    parts = _gather_parts(topo, grid[0], nbytes) if gather is not None and fuse_gather else None

    def total(reduce_bw: float, reduce_lat: float, gather_bw: float, gather_lat: float, both_bw: float) -> float:
        """The all-reduce's seconds from its two phases' link times and latencies (and, for
        ``pipelined``, the busiest edge's time with both phases' bytes on it), the on-board
        all-gather after it or fused into its multicast."""
        phases = reduce_bw + reduce_lat + gather_bw + gather_lat
        if parts is not None:  # the board's gather streams behind the multicast's arrivals
            phases = reduce_bw + reduce_lat + max(gather_bw, parts[0]) + gather_lat + parts[1]
        if pipelined:
            across = both_bw if parts is None else max(both_bw, parts[0])
            phases = min(phases, across + reduce_lat + gather_lat + (parts[1] if parts is not None else 0.0))
        if parts is None and gather is not None:
            phases += gather.seconds
        return phases

    if g == 2:
        # two boards: each sends the other the half it does not reduce, over every edge-disjoint
        # path (the two directions use opposite directed links), then the reduced halves back
        half = _board_halves(topo, int(members[0]), int(members[1]), nbytes)
        seconds = total(half, 0.0, half, 0.0, 2 * half)
        cost = CollectiveCost("all_reduce", "board-multipath", seconds, nbytes / 2, 0, 0, 2, 2, float(nbytes))
    else:
        graph = topo.board_graph()
        part = float(nbytes) / g
        region, options = _board_tree_options(graph, members, part)
        cost = None
        for trees, m in options:
            if trees is None:
                continue
            share = part / m
            shares, latency, hops, _, rev_shares, back = trees
            seconds = total(graph.link_seconds(rev_shares * share), back, graph.link_seconds(shares * share), latency,
                            graph.link_seconds((shares + rev_shares) * share))
            if cost is None or seconds < cost.seconds:
                cost = CollectiveCost("all_reduce", "board-multicast", seconds,
                                      float(((shares + rev_shares) * share).max()), 2 * hops, 2 * hops, 2, g,
                                      float(nbytes))
        if not pipelined and g <= MULTICAST_MAX_RANKS:
            # the packed trees each rooted: the part reduced up to the root, then multicast back
            # down (pipelined, the packed trees' span beats twice a rooted tree's depth)
            rooted = _rooted_shapes(graph, region, g)
            for member_roots in ((False, True) if rooted is not None else ()):
                up, down, depth, depth_hops = rooted[:4]
                for weight, keep in _rooted_weights(graph, region, g, float(nbytes), float(nbytes), member_roots,
                                                    depth_caps=True):
                    lat = float(depth[keep].max())
                    rise, fall = weight @ up[keep] * float(nbytes), weight @ down[keep] * float(nbytes)
                    seconds = total(graph.link_seconds(rise), lat, graph.link_seconds(fall), lat,
                                    graph.link_seconds(rise + fall))
                    if cost is None or seconds < cost.seconds:
                        deep = 2 * int(depth_hops[keep].max())
                        cost = CollectiveCost("all_reduce", "board-packed", seconds, float((rise + fall).max()),
                                              deep, deep, 2, g, float(nbytes))
        if pipelined and g <= MULTICAST_MAX_RANKS:
            # trees packed over the group and the boards around it, the row split over them
            packed = _packed_trees(graph, region, g)
            if packed is not None:
                for load, latency, hops in packed[0]:
                    across = graph.link_seconds(load * float(nbytes))
                    if parts is not None:  # the board's gather streams behind the arrivals
                        seconds = max(across, parts[0]) + latency + parts[1]
                    else:
                        seconds = across + latency + (gather.seconds if gather is not None else 0.0)
                    if cost is None or seconds < cost.seconds:
                        cost = CollectiveCost("all_reduce", "board-packed", seconds,
                                              float(load.max()) * float(nbytes), hops, hops, 1, g, float(nbytes))
                # every span's trees at once, the longer trees' parts sent first
                def figure(T: float, first: float) -> float:
                    if parts is not None:  # the board's gather streams behind the arrivals
                        return max(T, parts[0] + first) + parts[1]
                    return T + (gather.seconds if gather is not None else 0.0)

                # (played out only where its closed form, never dearer, would be the cheapest)
                fluid = _priority_fluid(graph, region, g, float(nbytes))
                if fluid is not None and (cost is None or figure(fluid[0], fluid[2]) < cost.seconds):
                    packing = _priority_packing(graph, region, g, float(nbytes), figure,
                                                np.inf if cost is None else cost.seconds)
                    T, load, first, hops, _ = packing if packing is not None else (np.inf,) * 5
                    seconds = figure(T, first)
                    if packing is not None and (cost is None or seconds < cost.seconds):
                        cost = CollectiveCost("all_reduce", "board-packed", seconds,
                                              float(load.max()) * float(nbytes), hops, hops, 1, g, float(nbytes))
    if cost is None or cost.seconds >= ring.seconds:
        return ring
    return CollectiveCost("all_reduce", cost.algorithm, cost.seconds, cost.bytes_per_link,
                          cost.hops + (gather.hops if gather else 0), cost.board_hops,
                          cost.steps + (gather.steps if gather else 0), int(grid.size), float(nbytes))


def sliced_hand_over(topo: "Topology", src_boards: Sequence[int], dst_boards: Sequence[int], nbytes: float,
                     chips_per_board: int = 48) -> CollectiveCost:
    """Cost of handing a vector over from one group of ``g`` boards to another in slices.

    The vector is the result of an all-reduce over the first group. Stopping that all-reduce
    after its reduce-scatter leaves board ``k`` of the group with slice ``k`` (``nbytes / g``);
    each board sends its slice to one board of the other group, and the other group's
    all-gather (the all-reduce's second half, as it would have run on the first group) gives
    each of its boards the whole vector. The hand-over itself is then the ``g`` slices at
    once, each split over its board's chips, chip ``i`` to chip ``i`` of the receiving board,
    on the link graph (routes, bytes per link and board edge): ``nbytes / g`` a board instead
    of every board sending the whole vector to its counterpart. A board of the first group
    sends to the receiving board fewest board edges away that is still free (in the order
    given, ties to the first given), so the slices take short, mostly disjoint routes.

    Parameters
    ----------
    topo : Topology
        The system's link graph.
    src_boards, dst_boards : sequence of int
        The two groups' boards (the same number, no board in both).
    nbytes : float
        Bytes of the whole vector.
    chips_per_board : int
        Chips of a board (board ``b`` holds chips ``b * chips_per_board ..``).

    Returns
    -------
    CollectiveCost
        ``op="point_to_point"``, ``algorithm="sliced"``, one step.
    """
    src = [int(b) for b in src_boards]
    dst = [int(b) for b in dst_boards]
    if len(src) != len(dst) or not src or len(set(src)) != len(src) or len(set(dst)) != len(dst) or set(src) & set(dst):
        raise ValueError(f"sliced_hand_over: two groups of as many distinct boards, none in both, got {src} and {dst}")
    if not np.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
    cpb = int(chips_per_board)
    far = topo.board_graph().neighbors
    free, pairs = list(dst), []
    for a in src:
        # board edges from board a (breadth-first on the graph of boards) to the free boards
        seen, frontier = {a}, [a]
        while frontier and not seen & set(free):
            frontier = sorted({int(v) for u in frontier for v in far[u] if v >= 0} - seen)
            seen |= set(frontier)
        pick = next(b for b in free if b in seen)  # the nearest; ties: the first given
        free.remove(pick)
        pairs.append((a, pick))
    chips = np.arange(cpb, dtype=np.int64)
    cost = point_to_point(topo, np.concatenate([chips + a * cpb for a, _ in pairs]),
                          np.concatenate([chips + b * cpb for _, b in pairs]), float(nbytes) / len(src) / cpb)
    return dataclasses.replace(cost, algorithm="sliced", nbytes=float(nbytes))


def point_to_point(topo: "Topology", src: Sequence[int], dst: Sequence[int],
                   nbytes: float) -> CollectiveCost:
    """Cost of concurrent point-to-point transfers (e.g. a pipeline stage handing over).

    Parameters
    ----------
    topo : Topology
        The system's link graph.
    src, dst : sequence of int
        Sender and receiver of each transfer (same length).
    nbytes : float
        Bytes of each transfer.

    Returns
    -------
    CollectiveCost
        ``algorithm="direct"``, one step; ``ranks`` counts the distinct chips involved.
    """
    src = np.asarray(src, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst, dtype=np.int64).reshape(-1)
    if src.shape != dst.shape:
        raise ValueError(f"src and dst differ in length: {src.size} vs {dst.size}")
    chips = np.unique(np.concatenate([src, dst]))
    topo, chips = _prepare(topo, chips, nbytes)
    index = np.searchsorted(chips, np.concatenate([src, dst]))
    step = (index[: src.size], index[src.size:], np.full(src.size, float(nbytes)), 1)
    return _evaluate(topo, chips, "point_to_point", "direct", [step], nbytes)


def _pairwise_steps(c: int, n: float) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """The pairwise exchange: step ``s`` (``1..c-1``) rank ``i`` sends its chunk for rank
    ``(i + s) mod c`` (``n / c`` bytes)."""
    i = np.arange(c)
    return [(i, (i + s) % c, np.full(c, n / c), 1) for s in range(1, c)]


def all_to_all(topo: "Topology", ranks: Sequence[int], nbytes: float, algorithm: str = "auto") -> CollectiveCost:
    """Cost of an all-to-all: every rank holds ``nbytes`` cut into ``c`` equal chunks and sends
    chunk ``j`` to rank ``j`` (a mixture of experts' token dispatch and combine).

    Algorithms over ``c`` ranks:

    - **direct**: one step, all ``c (c - 1)`` chunks at once on the link graph: ``max link bytes /
      bandwidth + the longest route's hop latencies``;
    - **pairwise**: ``c - 1`` steps, step ``s`` every rank sends to the rank ``s`` places on: each
      step's links carry less, but the hop latencies are paid ``c - 1`` times.

    Parameters
    ----------
    topo : Topology
        The system's link graph.
    ranks : sequence of int
        Distinct chip ids.
    nbytes : float
        Bytes each rank holds (its ``c`` chunks together, its own included).
    algorithm : {"auto", "direct", "pairwise"}
        ``"auto"`` returns the cheaper (direct on a tie).

    Returns
    -------
    CollectiveCost
        ``op="all_to_all"``.
    """
    topo, ranks = _prepare(topo, ranks, nbytes)
    choices = ("direct", "pairwise")
    if algorithm != "auto" and algorithm not in choices:
        raise ValueError(f"algorithm must be 'auto' or one of {choices}, got {algorithm!r}")
    c = ranks.size
    if c == 1 or nbytes == 0:
        return CollectiveCost("all_to_all", "direct", 0.0, 0.0, 0, 0, 0, int(c), float(nbytes))
    best = None
    for name in (choices if algorithm == "auto" else (algorithm,)):
        if name == "direct":
            src, dst = (x.reshape(-1) for x in np.meshgrid(np.arange(c), np.arange(c), indexing="ij"))
            keep = src != dst
            steps = [(src[keep], dst[keep], np.full(int(keep.sum()), float(nbytes) / c), 1)]
        else:
            steps = _pairwise_steps(c, float(nbytes))
        cost = _evaluate(topo, ranks, "all_to_all", name, steps, nbytes)
        if best is None or cost.seconds < best.seconds:
            best = cost
    return best


def board_all_to_all(topo: "Topology", grid: Sequence[Sequence[int]], send: "np.ndarray") -> CollectiveCost:
    """Cost of an all-to-all between boards with per-pair sizes (an all-to-all-v): board ``a``
    sends ``send[a, b]`` bytes to board ``b``, each of its ``k`` chips its ``1 / k`` share to
    its counterpart chip on board ``b``, every pair at once on the link graph (one step).

    A mixture of experts' dispatch (the tokens' hidden states from the boards that ran the
    router to the boards holding the experts they picked) and combine (the experts' outputs
    back) are such exchanges: the pairs that carry nothing (``send[a, b] == 0``, and ``a ==
    b``: the board's own experts) move nothing.

    Parameters
    ----------
    topo : Topology
        The system's link graph.
    grid : sequence of sequence of int
        ``g`` boards by ``k`` distinct chip ids (the same ``k`` on every board).
    send : array_like
        ``(g, g)`` bytes, sender by receiver.

    Returns
    -------
    CollectiveCost
        ``op="all_to_all"``, ``algorithm="board-direct"``; ``nbytes`` the bytes sent in all.
    """
    grid = np.asarray(grid, dtype=np.int64)
    send = np.asarray(send, dtype=np.float64)
    if grid.ndim != 2 or grid.size == 0:
        raise ValueError(f"grid must be boards x chips (a 2-D array of chip ids), got shape {grid.shape}")
    g, k = grid.shape
    if send.shape != (g, g):
        raise ValueError(f"send must be {g} x {g} bytes (sender by receiver), got shape {send.shape}")
    if not np.isfinite(send).all() or (send < 0).any():
        raise ValueError("send must hold finite byte counts >= 0")
    topo, ranks = _prepare(topo, grid.reshape(-1), float(send.sum()))
    a, b = np.nonzero((send > 0) & ~np.eye(g, dtype=bool))
    if not a.size:
        return CollectiveCost("all_to_all", "board-direct", 0.0, 0.0, 0, 0, 0, int(ranks.size), float(send.sum()))
    column = np.arange(k)
    src = (a[:, None] * k + column).reshape(-1)
    dst = (b[:, None] * k + column).reshape(-1)
    size = np.repeat(send[a, b] / k, k)
    return _evaluate(topo, ranks, "all_to_all", "board-direct", [(src, dst, size, 1)], float(send.sum()))


# ----------------------------------------------------------------------------------------------
# The fixed reduction order


def reduction_order(logical: int) -> tuple[tuple[int, int], ...]:
    """The fixed order in which ``logical`` partial sums are added, independent of chip count.

    A balanced pairwise tree over *logical* ranks (shards of the reduced dimension, fixed by the
    model, not by the plan): level ``w = 1, 2, 4, ...`` adds partial ``left + w`` into ``left``
    for every ``left`` a multiple of ``2w``; the result ends in partial 0. A missing right
    operand (``left + w >= logical``) is skipped, never replaced by zero: ``-0.0 + 0.0`` is
    ``+0.0``, so padding would change bits.

    A plan on any number of chips reproduces these bits when each chip owns an aligned block of
    logical ranks (:func:`chip_blocks`): the chip adds its block in this order (the steps inside
    the block), and the binomial tree all-reduce over the chips (:func:`all_reduce`,
    ``reproducible=True``) performs exactly the remaining steps, in this order.

    Parameters
    ----------
    logical : int
        Number of logical partial sums (>= 1).

    Returns
    -------
    tuple of (int, int)
        ``(left, right)`` pairs, in execution order: ``partial[left] += partial[right]``.
    """
    if not isinstance(logical, (int, np.integer)) or logical < 1:
        raise ValueError(f"logical must be a positive integer, got {logical!r}")
    steps, width = [], 1
    while width < logical:
        steps += [(left, left + width) for left in range(0, logical - width, 2 * width)]
        width *= 2
    return tuple(steps)


def chip_blocks(logical: int, chips: int) -> tuple[tuple[int, int], ...]:
    """Blocks of logical ranks each chip owns so that :func:`reduction_order` is kept.

    Blocks are aligned subtrees: the smallest power of two ``b`` with ``ceil(logical / b) <=
    chips``; chip ``r`` owns ``[r b, min((r + 1) b, logical))``. Chips past the last block
    hold no partial sum of this reduction.

    Parameters
    ----------
    logical : int
        Number of logical partial sums.
    chips : int
        Chips available for the reduction.

    Returns
    -------
    tuple of (int, int)
        ``(start, stop)`` per chip that holds partial sums, in rank order.
    """
    if not isinstance(chips, (int, np.integer)) or chips < 1:
        raise ValueError(f"chips must be a positive integer, got {chips!r}")
    reduction_order(logical)  # validates logical
    block = 1
    while -(-logical // block) > chips:
        block *= 2
    return tuple((start, min(start + block, logical)) for start in range(0, logical, block))


def fixed_order_sum(partials: Sequence[np.ndarray]) -> np.ndarray:
    """Reference sum of logical partials in :func:`reduction_order` (a new array).

    Parameters
    ----------
    partials : sequence of numpy.ndarray
        One array per logical rank, all of one shape and dtype.

    Returns
    -------
    numpy.ndarray
    """
    acc = [np.array(p, copy=True) for p in partials]
    for left, right in reduction_order(len(acc)):
        acc[left] = acc[left] + acc[right]
    return acc[0]


def chain_all_reduce(topo: "Topology", ranks: Sequence[int], nbytes: float,
                     segments: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128)) -> CollectiveCost:
    """Cost of an all-reduce that continues one accumulator from rank to rank (bit-exact).

    Rank ``i`` adds its partial sums into what rank ``i - 1`` sends and passes the result on, so
    the sum is the one sequential ascending reduction of the one-chip program (a row-parallel
    GEMM's ranks hold consecutive blocks of ``k``): the bits do not depend on the rank count.
    The message is cut into ``m`` segments that flow down the chain (ranks ``0 -> c-1``, one
    hop per step when consecutive ranks are neighbours); each finished segment leaves the last
    rank as a multicast (SpiNNaker's routers copy a packet onto several links) along the routes
    from it to every rank, a tree of depth ``D`` (the farthest rank's hops). The reduce takes
    ``m + c - 2`` steps and the broadcast, pipelined behind it, ``D`` more: ``m + c + D - 2``
    steps, each moving ``nbytes / m`` over one hop (the slower of the chain's and the tree's
    links); ``m`` is the cheapest of ``segments``.

    Parameters
    ----------
    topo : Topology
        The system's link graph.
    ranks : sequence of int
        Distinct chip ids in chain order.
    nbytes : float
        Bytes of each rank's partial sums (and of the result).
    segments : sequence of int
        Segment counts to choose from.

    Returns
    -------
    CollectiveCost
        ``algorithm="chain"``.
    """
    topo, ranks = _prepare(topo, ranks, nbytes)
    c = ranks.size
    if c == 1 or nbytes == 0:
        return CollectiveCost("all_reduce", "chain", 0.0, 0.0, 0, 0, 0, c, float(nbytes))
    i = np.arange(c - 1)
    root = np.full(c - 1, ranks[-1])
    depth = int(topo.hops(root, ranks[:-1]).max())
    # the multicast tree: every link on a route from the last rank carries each segment once
    _, tree = topo.route_links(root, ranks[:-1])
    tree = np.unique(tree)
    best = None
    tree_share = np.zeros(topo.nodes * 6)
    tree_share[tree] = 1.0  # one copy of each segment on every link of the tree
    for m in segments:
        cost, load = topo.evaluate(ranks[i], ranks[i + 1], float(nbytes) / m)
        tree_s = topo.link_seconds(tree_share * (float(nbytes) / m)) + float(topo.link_hop_s[tree].max())
        step = max(cost.seconds, tree_s)
        load = load + tree_share * (float(nbytes) / m)
        steps = m + c + depth - 2
        candidate = CollectiveCost("all_reduce", "chain", steps * step, float(load.max()) * m,
                                   steps * max(1, cost.max_hops), steps * cost.board_hops, steps, c, float(nbytes),
                                   segments=int(m))
        if best is None or candidate.seconds < best.seconds:
            best = candidate
    return best



def board_group_scattered_all_reduce(topo: "Topology", grid: Sequence[Sequence[int]], nbytes: float,
                                     gather_bytes: float, rounds: int = 1, stat_bytes: float = 0.0) -> CollectiveCost:
    """Cost of an all-reduce of integer partial sums across boards whose reduced row is narrowed
    before it is multicast: a reduce-scatter, ``rounds`` exchanges of the row's statistics, an
    all-gather of the narrowed row, one after another.

    ``grid[b]``: the chips of the ``b``-th board of the group, each board ``nbytes`` of partial
    sums (as in :func:`board_group_all_reduce`). Each share of the row is reduced up a tree to
    one board of the group, its root (a member: the root keeps its share of the state the row
    updates, such as the residual stream); the roots then gather ``stat_bytes`` of statistics
    from one another ``rounds`` times (what the narrowing needs from the whole row: a norm's
    block sums, added in their fixed order on every root; one round per statistic that depends
    on the one before), each an all-gather along the group's trees plus the board's deepest
    on-board route; then each root multicasts its share narrowed (``gather_bytes`` the
    whole row) down its tree, the on-board all-gather of the narrowed row riding on the
    multicast (as :func:`board_group_all_reduce`'s ``fuse_gather``). The phases cannot overlap:
    the narrowed row exists only once the whole row is reduced and its statistics known. The
    element-wise work on the roots between the phases is the caller's.

    A directed board edge carries each tree's share one way in the reduce-scatter and the other
    way narrowed in the all-gather, where the pipelined all-reduce carries partial sums both
    ways at once on every tree edge (:func:`board_group_all_reduce`: no phase of its own for the
    reduced row to narrow); this form pays for its narrower bytes with two more tree latencies
    and the exchanges.

    The trees: every tree set :func:`board_group_all_reduce` prices (:func:`_board_tree_options`:
    the members' multicast trees, and those through the boards next to the group, spread or
    negotiated; each board's share reduced up its reversed trees and multicast down them, each
    phase priced at its own bytes), and its packed trees over the group and the boards around it
    rooted at a member (their parts reweighed for the two phases' bytes, :func:`_reweigh`); two
    boards exchange halves over every edge-disjoint path (:func:`multipath_point_to_point`). The
    cheapest is taken; each exchange takes the cheapest tree set for the statistics' bytes. With
    ``rounds=0`` and ``gather_bytes=nbytes``, on those tree sets it is
    :func:`board_group_all_reduce` with ``pipelined=False, fuse_gather=True`` bit for bit (where
    that does not fall back to the ring); the packed trees, which that does not take, may only
    lower it. A phase without bytes (``stat_bytes=0``, ``nbytes=0``, ``gather_bytes=0``) costs
    nothing.

    Only ``bench/board_all_reduce.py`` uses it (the planner prices the pipelined
    :func:`board_group_all_reduce`), to weigh the exact int32 sums with an int8 all-gather of the
    normed row against the pipelined int32 all-reduce. For Llama-2-70B's 8,192-wide row (one
    exchange of the norm's block sums) the pipelined all-reduce is the cheaper on every layout
    of 16 boards of 24 (112 against 118 us), of 8 and 32 boards of the cloud, and on the best
    layout of 8 boards of 24 (101.5 against 110.5 us); the scattered form is ahead only on one
    layout of 8 boards of 24 (110.5 against 112.1 us), not the cheapest one.

    Parameters
    ----------
    topo : Topology
        The system's link graph.
    grid : sequence of sequence of int
        ``g`` boards by ``k`` chip ids (every chip of each board).
    nbytes : float
        Bytes of the partial sums each board contributes.
    gather_bytes : float
        Bytes of the narrowed row every chip receives.
    rounds : int
        Exchanges of the row's statistics between the reduce-scatter and the all-gather.
    stat_bytes : float
        Bytes of statistics every root gathers in one exchange (all roots' together).

    Returns
    -------
    CollectiveCost
        ``op="all_reduce"``, ``algorithm`` ``"board-scattered"``, ``"board-scattered-packed"`` or
        ``"board-scattered-multipath"``; ``nbytes`` the partial sums' bytes.

    Raises
    ------
    TypeError
        A byte count that is not a number.
    ValueError
        A grid that is not boards by chips (ragged, not integers, a row not the chips of one
        board, boards or chips repeated), more than :data:`MULTICAST_MAX_RANKS` boards, a byte
        count negative or not finite, ``rounds`` not an integer >= 0, or a group no trees join.
    """
    who = "board_group_scattered_all_reduce"
    grid, members = _board_rows(topo, grid, who)
    if np.unique(grid).size != grid.size:
        raise ValueError(f"{who}: the chips of grid must be distinct")
    nbytes, gather_bytes, stat_bytes = (_byte_count(name, v) for name, v in (
        ("nbytes", nbytes), ("gather_bytes", gather_bytes), ("stat_bytes", stat_bytes)))
    if isinstance(rounds, (bool, np.bool_)) or not isinstance(rounds, (int, np.integer)) or rounds < 0:
        raise ValueError(f"rounds must be an integer >= 0, got {rounds!r}")
    g, k = grid.shape
    if g > MULTICAST_MAX_RANKS:
        raise ValueError(f"{who}: at most {MULTICAST_MAX_RANKS} boards, got {g}")
    exchanges = int(rounds) if stat_bytes > 0 else 0  # an exchange of no statistics is none
    if g == 1 or (nbytes == 0 and gather_bytes == 0 and exchanges == 0):
        return CollectiveCost("all_reduce", "board-scattered", 0.0, 0.0, 0, 0, 0, int(grid.size), nbytes)
    # a phase that moves no bytes costs nothing, its latency included
    parts = (0.0, 0.0)  # the board's gather of the narrowed row behind the multicast's arrivals
    if k > 1 and gather_bytes > 0:
        parts = _gather_parts(topo, grid[0], gather_bytes)
        if parts is None:  # no multicast trees on the board: its all-gather after the arrivals
            parts = (0.0, all_gather(topo, grid[0], gather_bytes).seconds)
    on_board = 0.0  # an exchange's way from the board's edges to its chips holding the share
    if k > 1 and exchanges:
        tiny = _gather_parts(topo, grid[0], 1.0)
        on_board = tiny[1] if tiny is not None else all_gather(topo, grid[0], 1.0).seconds

    def total(reduce_bw: float, reduce_lat: float, exchange: float, gather_bw: float, gather_lat: float) -> float:
        """The phases one after another, those without bytes left out; the board's gather
        streams behind the multicast's arrivals (summed in :func:`board_group_all_reduce`'s
        order, so the same phases give the same bits)."""
        if nbytes == 0:
            reduce_bw = reduce_lat = 0.0
        if gather_bytes == 0:
            gather_bw = gather_lat = 0.0
        return (reduce_bw + reduce_lat + (exchanges * (exchange + on_board) if exchanges else 0.0)
                + max(gather_bw, parts[0]) + gather_lat + parts[1])

    if g == 2:
        a, b = (int(x) for x in members)
        return CollectiveCost("all_reduce", "board-scattered-multipath",
                              total(_board_halves(topo, a, b, nbytes), 0.0,
                                    _board_halves(topo, a, b, stat_bytes) if exchanges else 0.0,
                                    _board_halves(topo, a, b, gather_bytes), 0.0),
                              nbytes / 2, 0, 0, 2 + exchanges, int(grid.size), nbytes)
    graph = topo.board_graph()
    part = nbytes / g
    # the trees as board_group_all_reduce builds them for the row's shares (for the bytes that
    # move where no partial sums do)
    region, options = _board_tree_options(graph, members, part if nbytes > 0 else max(gather_bytes, stat_bytes) / g)
    built = [(trees, m) for trees, m in options if trees is not None]
    # each exchange: an all-gather of the statistics along the cheapest of the tree sets
    exchange = min((graph.link_seconds(trees[0] * (stat_bytes / g / m)) + trees[1] for trees, m in built),
                   default=0.0)
    best = None
    for (shares, latency, hops, _, rev_shares, back), m in built:
        up, down = rev_shares * (part / m), shares * (gather_bytes / g / m)
        seconds = total(graph.link_seconds(up), back, exchange, graph.link_seconds(down), latency)
        if best is None or seconds < best.seconds:
            best = CollectiveCost("all_reduce", "board-scattered", seconds, float(max(up.max(), down.max())),
                                  2 * hops, 2 * hops, 2 + exchanges, int(grid.size), nbytes)
    found = graph.memo.get(("packed_shapes", region.tobytes(), int(g))) if _packed_trees(graph, region, g) else None
    if found is None:
        if best is None:
            raise ValueError(f"{who}: no trees join the group's boards {members.tolist()} (neither over their "
                             "own links nor through the boards next to them)")
        return best
    up, down, depth, depth_hops = _rooted_shapes(graph, region, g)[:4]
    for weight, keep in _rooted_weights(graph, region, g, nbytes, gather_bytes, True):
        lat = float(depth[keep].max())
        seconds = total(graph.link_seconds(weight @ up[keep] * float(nbytes)), lat, exchange,
                        graph.link_seconds(weight @ down[keep] * float(gather_bytes)), lat)
        if best is None or seconds < best.seconds:
            deep = 2 * int(depth_hops[keep].max())
            best = CollectiveCost("all_reduce", "board-scattered-packed", seconds,
                                  float((weight @ up[keep]).max()) * nbytes, deep, deep, 2 + exchanges,
                                  int(grid.size), nbytes)
    if best is None:
        raise ValueError(f"{who}: no trees join the group's boards {members.tolist()} rooted at them")
    return best
