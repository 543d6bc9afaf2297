"""The packed trees of every span sharing the row at once, the longer trees' parts first.

:func:`_priority_fluid` weighs the trees by a linear program on the closed form;
:func:`_priority_packing` checks each weighing against the schedule played out
(:mod:`.schedule`) and keeps the cheapest figure.
"""

from __future__ import annotations

import numpy as np

from . import packing as _packing
from .cost import _TREES_KEPT, _forget
from .schedule import _SCHEDULE_CHUNKS, _chunked_schedule


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
    if _packing._packed_trees(graph, ranks, members) is None:
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
