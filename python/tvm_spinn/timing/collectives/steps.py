"""The ring, tree and pairwise algorithms as steps of concurrent transfers, and their cost.

A step is ``(src rank indices, dst rank indices, bytes, repeats)``; :func:`_evaluate` costs a
list of them on the link graph, one step after another. The chip collectives and the
board-level ring and tree both build on these, so they live below either.
"""

from __future__ import annotations

import numpy as np

from .cost import CollectiveCost


#: The algorithms every collective costs; the multicast joins them where its trees are built
_ALGORITHMS = ("ring", "tree")


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


def _pairwise_steps(c: int, n: float) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """The pairwise exchange: step ``s`` (``1..c-1``) rank ``i`` sends its chunk for rank
    ``(i + s) mod c`` (``n / c`` bytes)."""
    i = np.arange(c)
    return [(i, (i + s) % c, np.full(c, n / c), 1) for s in range(1, c)]


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
