"""The record every collective returns, and the checks and memo housekeeping they share.

Kept apart from the algorithms so that every module of the package can build a
:class:`CollectiveCost` without importing any other (no import cycles between them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


#: Largest group the multicast all-gather is built for: its trees are chosen per (source, rank)
#: pair in Python (about 0.07 s for a board's 48 ranks, growing as ranks squared); larger
#: groups gather by ring or tree.
MULTICAST_MAX_RANKS = 64
#: Multicast tree sets kept per topology (:attr:`Topology.memo`), at most this many
_TREES_KEPT = 256
#: Bytes of per-link arrays one kind of a topology's memo keeps at most (:func:`_remember`): a
#: tree set holds two arrays over every directed link, 3.3 MB on ``spinn/cloud``'s 207,360
#: links, 4.6 KB on a board's 288
_KIND_BYTES_KEPT = 2**28


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
    segments : int
        A chain's segment count (0: not a chain).
    by_segments : tuple of CollectiveCost
        A chain's cost at every segment count it was costed for (empty: not a chain), so that a
        layer whose compute runs segment by segment with the chain
        (:func:`tvm_spinn.timing.system.compose`) can take the count cheapest for both.
    step_s : float
        A chain's time for its first segment to cross one hop (a hop's latency and the
        segment's bytes on the busiest link); the later segments follow at the links' rate
        (0: not a chain).
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
    by_segments: tuple = ()  # chain: the cost at each segment count costed
    step_s: float = 0.0  # chain: one hop of its first segment


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
    memo.get(_COUNTS, {}).pop(kind, None)


#: The key of a memo's entry counts per kind (:func:`_remember`)
_COUNTS = ("kept",)


def _remember(memo: dict, key: tuple, value, limit: int, entry_bytes: int = 0) -> None:
    """``value`` kept in a topology's memo under ``key`` (whose first item is its kind); the
    entries of that kind are dropped first when they number more than ``limit``, or more than
    :data:`_KIND_BYTES_KEPT` of ``entry_bytes`` each. Each kind is counted on its own: the
    entries of other kinds (a board's thousands of collective costs) never evict it, so a
    value asked for again is found while its kind is within its bound. The values are
    functions of their keys: what is dropped is computed again, to the same value."""
    counts = memo.setdefault(_COUNTS, {})
    kind = key[0]
    if key not in memo:
        cap = min(limit, max(1, _KIND_BYTES_KEPT // entry_bytes)) if entry_bytes > 0 else limit
        if counts.get(kind, 0) >= cap:
            _forget(memo, kind)
            counts = memo.setdefault(_COUNTS, {})
        counts[kind] = counts.get(kind, 0) + 1
    memo[key] = value
