"""The floor of a board-group all-reduce: a lower bound any schedule of trees is held to.

Kept apart from the search it bounds (:mod:`.group`), which it must not depend on.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


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
