"""The board-group all-reduce: the search over tree sets for a group of boards' integer sums.

:func:`board_group_all_reduce` prices the multicast, spread and negotiated trees
(:mod:`.trees`), the packed trees pipelined or rooted (:mod:`.packing`) and the priority
packing (:mod:`.priority`), and keeps the cheapest, never dearer than the ring of
:func:`~tvm_spinn.timing.collectives.board_all_reduce`; :func:`board_group_scattered_all_reduce`
prices the same trees as a reduce-scatter, exchanges of the row's statistics and a narrowed
all-gather.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from . import packing as _packing
from .boards import _board_halves, _board_rows, board_all_reduce
from .chips import _gather_parts, all_gather
from .cost import MULTICAST_MAX_RANKS, CollectiveCost
from .priority import _priority_fluid, _priority_packing
from .trees import _multicast_trees, _negotiated_trees, _spread_trees


#: Parts a board's share of :func:`board_group_all_reduce` is cut into at most (each part its own
#: tree: a board's share then leaves over several of its six board edges), and the trees of
#: all the boards' parts together at most (planning time: each round rebuilds every tree)
_SPLIT_PARTS = 4
_SPLIT_TREES = 32


def _byte_count(name: str, value) -> float:
    """``value`` as a float of bytes, refused naming ``name`` unless a finite number >= 0."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number of bytes, got {type(value).__name__} {value!r}")
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


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
    multicast reduce-scatter and all-gather (see :mod:`tvm_spinn.timing.collectives`) on
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
    (:func:`_packed_trees`, the packed trees of :mod:`tvm_spinn.timing.collectives`): every tree edge carries its
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
            rooted = _packing._rooted_shapes(graph, region, g)
            for member_roots in ((False, True) if rooted is not None else ()):
                up, down, depth, depth_hops = rooted[:4]
                for weight, keep in _packing._rooted_weights(graph, region, g, float(nbytes), float(nbytes),
                                                             member_roots, depth_caps=True):
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
            packed = _packing._packed_trees(graph, region, g)
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
    found = graph.memo.get(("packed_shapes", region.tobytes(), int(g))) \
        if _packing._packed_trees(graph, region, g) else None
    if found is None:
        if best is None:
            raise ValueError(f"{who}: no trees join the group's boards {members.tolist()} (neither over their "
                             "own links nor through the boards next to them)")
        return best
    up, down, depth, depth_hops = _packing._rooted_shapes(graph, region, g)[:4]
    for weight, keep in _packing._rooted_weights(graph, region, g, nbytes, gather_bytes, True):
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
