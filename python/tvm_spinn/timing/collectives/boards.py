"""Collectives between whole boards: the ring or tree of every chip's slice, multipath transfers,
the sliced hand-over and the all-to-all-v.

What the board-group all-reduce (:mod:`.group`) falls back to or builds on, kept apart from
its tree search.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from .chips import all_gather, point_to_point
from .cost import CollectiveCost, _prepare
from .steps import _ALGORITHMS, _evaluate, _steps


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


def _board_halves(topo: "Topology", a: int, b: int, nbytes: float) -> float:
    """Seconds for two boards to send each other half of ``nbytes`` over every edge-disjoint
    path between them (:func:`multipath_point_to_point`; the two directions use opposite
    directed links, so they run at once)."""
    return max(multipath_point_to_point(topo, a, b, nbytes / 2).seconds,
               multipath_point_to_point(topo, b, a, nbytes / 2).seconds)


def _hand_over_pairs(topo: "Topology", src_boards, dst_boards, nbytes: float, who: str) -> list[tuple[int, int]]:
    """The ``(sending board, receiving board)`` pairs of a sliced hand-over: each board of the
    first group, in the order given, to the receiving board fewest board edges away that is
    still free (ties to the first given); bad groups or sizes are refused naming ``who``."""
    src = [int(b) for b in src_boards]
    dst = [int(b) for b in dst_boards]
    if len(src) != len(dst) or not src or len(set(src)) != len(src) or len(set(dst)) != len(dst) or set(src) & set(dst):
        raise ValueError(f"{who}: two groups of as many distinct boards, none in both, got {src} and {dst}")
    if not np.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
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
    return pairs


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
    pairs = _hand_over_pairs(topo, src_boards, dst_boards, nbytes, "sliced_hand_over")
    cpb = int(chips_per_board)
    chips = np.arange(cpb, dtype=np.int64)
    cost = point_to_point(topo, np.concatenate([chips + a * cpb for a, _ in pairs]),
                          np.concatenate([chips + b * cpb for _, b in pairs]), float(nbytes) / len(pairs) / cpb)
    return dataclasses.replace(cost, algorithm="sliced", nbytes=float(nbytes))


def multipath_sliced_hand_over(topo: "Topology", src_boards: Sequence[int], dst_boards: Sequence[int],
                               nbytes: float) -> CollectiveCost:
    """Cost of the sliced hand-over of :func:`sliced_hand_over` with each slice sent over every
    edge-disjoint path between its two boards.

    The boards pair up as in :func:`sliced_hand_over` (each board of the first group its slice,
    ``nbytes / g``, to the nearest free board of the second). With one token in flight the
    links are otherwise idle, so a slice need not leave by the one board edge of its chips'
    routes: each pair sends over its :meth:`~tvm_spinn.target.topology.Topology.board_paths`
    (no two sharing a directed board edge), as :func:`multipath_point_to_point` does for one
    pair. The pairs' paths may share edges with one another; each directed edge group then
    gives every path crossing it an equal share of its rate (a path runs at the least of its
    edges' shares: ``rate / n`` on an edge of ``rate`` crossed by ``n`` paths in all, those
    :func:`water_fill` leaves idle included), a schedule the serial links can run, and
    each pair splits its slice over its paths at those rates so that they finish together
    (:func:`water_fill`). The hand-over takes as long as its slowest pair.

    Parameters
    ----------
    topo : Topology
        The system's link graph.
    src_boards, dst_boards : sequence of int
        The two groups' boards (the same number, no board in both).
    nbytes : float
        Bytes of the whole vector.

    Returns
    -------
    CollectiveCost
        ``op="point_to_point"``, ``algorithm="sliced-multipath"``, one step; ``bytes_per_link``
        the busiest directed edge group's bytes, ``hops`` the longest used path's board hops.
    """
    pairs = _hand_over_pairs(topo, src_boards, dst_boards, nbytes, "multipath_sliced_hand_over")
    share = float(nbytes) / len(pairs)
    paths = [topo.board_paths(a, b) for a, b in pairs]
    edges = topo.edge_rate()
    crossing: dict[int, int] = {}  # directed edge group -> paths of every pair crossing it
    for own in paths:
        for path in own:
            for e in path:
                crossing[int(e)] = crossing.get(int(e), 0) + 1
    seconds, load, longest = 0.0, dict.fromkeys(crossing, 0.0), 0
    for own in paths:
        costs = [topo.path_cost(p) for p in own]
        rates = [min(float(edges[int(e)]) / crossing[int(e)] for e in p) for p in own]
        t, sent = water_fill(rates, [lat for _, lat in costs], share)
        seconds = max(seconds, t)
        for p, b in zip(own, sent):
            if b > 0:
                longest = max(longest, len(p))
                for e in p:
                    load[int(e)] += float(b)
    return CollectiveCost("point_to_point", "sliced-multipath", seconds, max(load.values(), default=0.0), longest,
                          longest, 1, 2 * len(pairs), float(nbytes))


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
