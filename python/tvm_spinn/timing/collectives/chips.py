"""Collectives over a group of chips on the link graph: ring, tree and multicast; point-to-point,
all-to-all and the chain all-reduce.

The public chip-level collectives (:func:`all_reduce`, :func:`all_gather`,
:func:`reduce_scatter`, :func:`point_to_point`, :func:`all_to_all`, :func:`chain_all_reduce`,
:func:`chains_all_reduce`, :func:`chain_all_reduce_gathered`) and the multicast all-gather's parts (:func:`_gather_parts`)
that the board collectives add for a board's own gather.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from .cost import MULTICAST_MAX_RANKS, CollectiveCost, _prepare
from .steps import _ALGORITHMS, _evaluate, _pairwise_steps, _steps
from .trees import _multicast_trees


def _multicast(topo: "Topology", ranks: np.ndarray, nbytes: float) -> "CollectiveCost | None":
    """The multicast all-gather's cost, or None where it is not built (see :mod:`tvm_spinn.timing.collectives`)."""
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


def _segment_counts(name: str, segments) -> "tuple[int, ...]":
    """``segments`` as a tuple of positive ints; a clear error for none or a bad count (without
    one a cost would have no candidate to choose)."""
    counts = tuple(segments)
    if not counts or any(isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1 for m in counts):
        raise ValueError(f"{name}: segments must be one or more integers >= 1, got {counts!r}")
    return tuple(int(m) for m in counts)


#: Bytes a link packet carries (a 72-bit packet's 32-bit payload, ``SpinnArch.link_payload_fraction``):
#: a chain's segment is at least one packet's
PACKET_PAYLOAD_BYTES = 4


def _whole_packets(segments: "tuple[int, ...]", nbytes: float) -> "tuple[int, ...]":
    """The counts of ``segments`` that cut ``nbytes`` into segments of at least a packet's payload
    (:data:`PACKET_PAYLOAD_BYTES`; a link moves no less), one segment where none does."""
    whole = tuple(m for m in segments if m == 1 or float(nbytes) / m >= PACKET_PAYLOAD_BYTES)
    return whole or (1,)


def _relay_pes(name: str, relay_pes) -> "int | None":
    """``relay_pes`` as an int >= 1, or None; a clear error for anything else."""
    if relay_pes is None:
        return None
    if isinstance(relay_pes, bool) or not isinstance(relay_pes, (int, np.integer)) or relay_pes < 1:
        raise ValueError(f"{name}: relay_pes must be None or an integer >= 1, got {relay_pes!r}")
    return int(relay_pes)


def _relay_period(topo: "Topology", seg: float, relay_pes: "int | None") -> float:
    """Seconds a chip's PEs take to relay one segment of ``seg`` bytes, its words spread over
    ``relay_pes`` of them (:attr:`~tvm_spinn.target.topology.Topology.relay_word_s` a word, one
    word a packet's payload, :data:`PACKET_PAYLOAD_BYTES`); 0 for None (words spread over
    enough PEs that the links pace the segments)."""
    if relay_pes is None:
        return 0.0
    return float(topo.relay_word_s) * (float(seg) / PACKET_PAYLOAD_BYTES) / relay_pes


def _pipelined_s(topo: "Topology", chain: int, tree: int, m: int, step: float,
                 period: float, relay_period: float = 0.0) -> "tuple[float, float]":
    """``(seconds, first segment's chain hop)`` of a chain's ``m`` segments through its ``chain``
    hops and then its multicast tree's ``tree``.

    The first segment takes ``step`` a hop (a hop's latency and the segment's bytes on the
    slower of the chain's and the tree's links) and, at each chain hop, the rank's relay of a
    word with its term added (:attr:`~tvm_spinn.target.topology.Topology.relay_word_s`; the
    tree's hops are router copies). Each later segment leaves ``period`` after the one before
    it: the busiest link's time for the bytes a link carries a segment, the chain's hop and the
    trees' copies summed (a link on both carries a segment of each in a period), or the rank's
    PEs' time to relay a segment's words (``relay_period``, :func:`_relay_period`) where that is
    longer: a rank's words go to the PEs that hold their partial sums by their routing keys, so
    its relays keep up with the link only while a segment's words are spread over enough PEs. A
    hop's latency is the router's pipeline and the link's SERDES, which packets cross one behind
    the other, so it is paid once a hop of the path, not once a segment."""
    relay = float(topo.relay_word_s)
    return chain * (step + relay) + tree * step + (m - 1) * max(period, relay_period), step + relay


def chain_all_reduce(topo: "Topology", ranks: Sequence[int], nbytes: float,
                     segments: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128),
                     relay_pes: "int | None" = None) -> CollectiveCost:
    """Cost of an all-reduce that continues one accumulator from rank to rank (bit-exact).

    Rank ``i`` adds its partial sums into what rank ``i - 1`` sends and passes the result on, so
    the sum is the one sequential ascending reduction of the one-chip program (a row-parallel
    GEMM's ranks hold consecutive blocks of ``k``): the bits do not depend on the rank count.
    The message is cut into ``m`` segments that flow down the chain (ranks ``0 -> c-1``, one
    hop per step when consecutive ranks are neighbours); each finished segment leaves the last
    rank as a multicast (SpiNNaker's routers copy a packet onto several links) along the routes
    from it to every rank, a tree of depth ``D`` (the farthest rank's hops). The first segment
    crosses the chain's ``c - 1`` hops and the tree's ``D``, a step each (a hop's latency and
    ``nbytes / m`` on the slower of the chain's and the tree's links; at a chain hop also the
    rank's relay of a word with its term added); the other ``m - 1``
    follow it through the pipeline, each the busiest link's time for a segment after the one
    before (:func:`_pipelined_s`); ``m`` is the cheapest of ``segments``.

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
    relay_pes : int, optional
        PEs of a rank that hold a segment's partial sums (the PEs the row-parallel layer before
        the chain writes its output from): a later segment follows no faster than they relay its
        words (:func:`_relay_period`). None (default, for a caller without a mapping): spread
        over enough PEs that the links pace the segments.

    Returns
    -------
    CollectiveCost
        ``algorithm="chain"``.

    Raises
    ------
    ValueError
        For no segment count or one not an integer >= 1, or ``relay_pes`` not None or an
        integer >= 1.
    """
    segments = _whole_packets(_segment_counts("chain_all_reduce", segments), nbytes)
    relay_pes = _relay_pes("chain_all_reduce", relay_pes)
    topo, ranks = _prepare(topo, ranks, nbytes)
    c = ranks.size
    if c == 1 or nbytes == 0:
        return CollectiveCost("all_reduce", "chain", 0.0, 0.0, 0, 0, 0, c, float(nbytes))
    return _cheapest_chain(topo, ranks[:-1], ranks[1:], c, nbytes, segments,
                           _tree_choices(topo, [ranks], [ranks], ranks[:-1], ranks[1:]), relay_pes)


def chains_all_reduce(topo: "Topology", chains: Sequence[Sequence[int]], nbytes: float,
                      segments: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128),
                      relay_pes: "int | None" = None) -> CollectiveCost:
    """Several :func:`chain_all_reduce`\ s at once, each chain's result multicast back to its own
    ranks only, all of them loading the links together (a link on several chains or trees
    carries each of their segments): the contended counterpart of
    :func:`chain_all_reduce_gathered`, which multicasts every chain's result to all the chips.

    Parameters
    ----------
    topo : Topology
        The system's link graph.
    chains : sequence of sequence of int
        Distinct chip ids, one sequence per chain in chain order, all of one length.
    nbytes : float
        Bytes of each rank's partial sums (one chain's result).
    segments : sequence of int
        Segment counts to choose from.
    relay_pes : int, optional
        PEs of a rank that hold a segment's partial sums (the PEs the row-parallel layer before
        the chain writes its output from): a later segment follows no faster than they relay its
        words (:func:`_relay_period`). None (default, for a caller without a mapping): spread
        over enough PEs that the links pace the segments.

    Returns
    -------
    CollectiveCost
        ``algorithm="chain"``; ``nbytes`` is one chain's. One chain: :func:`chain_all_reduce`'s.

    Raises
    ------
    ValueError
        For no chains, chains of different lengths, a chip in two chains, no segment count or
        one not an integer >= 1, or ``relay_pes`` not None or an integer >= 1.
    """
    groups = _chain_groups("chains_all_reduce", chains)
    segments = _whole_packets(_segment_counts("chains_all_reduce", segments), nbytes)
    relay_pes = _relay_pes("chains_all_reduce", relay_pes)
    if len(groups) == 1:
        return chain_all_reduce(topo, groups[0], nbytes, segments, relay_pes)
    topo, every = _prepare(topo, np.concatenate(groups), nbytes)
    c = groups[0].size
    if c == 1 or nbytes == 0:
        return CollectiveCost("all_reduce", "chain", 0.0, 0.0, 0, 0, 0, c, float(nbytes))
    src = np.concatenate([g[:-1] for g in groups])
    dst = np.concatenate([g[1:] for g in groups])
    return _cheapest_chain(topo, src, dst, c, nbytes, segments, _tree_choices(topo, groups, groups, src, dst),
                           relay_pes)


def _chain_groups(name: str, chains) -> "list[np.ndarray]":
    """``chains`` as int64 arrays: one or more, of one length, no chip in two."""
    groups = [np.asarray(c, dtype=np.int64).reshape(-1) for c in chains]
    if not groups or len({g.size for g in groups}) != 1:
        raise ValueError(f"{name}: chains must be one or more of one length, got lengths "
                         f"{[int(g.size) for g in groups]}")
    every = np.concatenate(groups)
    if np.unique(every).size != every.size:
        raise ValueError(f"{name}: a chip is in two chains")
    return groups


def chain_all_reduce_gathered(topo: "Topology", chains: Sequence[Sequence[int]], nbytes: float,
                              segments: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128),
                              relay_pes: "int | None" = None) -> CollectiveCost:
    """Cost of concurrent chain all-reduces (:func:`chain_all_reduce`) whose results every chip
    of all the chains receives: the all-gather of the chains' results riding on their multicasts.

    Each chain reduces its own ``nbytes`` (one block of a larger tensor, e.g. the attention's
    context, one block of heads per chain) rank after rank in the one-chip program's order, as
    :func:`chain_all_reduce`; its last rank then multicasts each finished segment along the
    routes to every chip of every chain instead of its own chain's alone. An all-gather of the
    blocks over all the chips after the chains delivers exactly those bytes, so it is not run:
    its hop latencies and its separate start are saved, and the additions are the chains'
    (the same bits). All chains run at once: their chain hops and their multicast trees load
    the links together (a link on several trees carries each of their segments; the trees are
    built over the chips' own links and balanced as the multicast all-gather's are). With ``c``
    ranks a chain and trees of depth ``D`` (the farthest chip from a chain's last rank), the
    first segment crosses ``c - 1 + D`` hops, a step each (a hop's latency and ``nbytes / m``
    over the slower of the chains' and the trees' links; at a chain hop also the rank's relay
    of a word), and the other ``m - 1`` follow it at
    the busiest link's rate (:func:`_pipelined_s`).

    Parameters
    ----------
    topo : Topology
        The system's link graph.
    chains : sequence of sequence of int
        Distinct chip ids, one sequence per chain in chain order, all of one length.
    nbytes : float
        Bytes of each rank's partial sums (one chain's result).
    segments : sequence of int
        Segment counts to choose from.
    relay_pes : int, optional
        PEs of a rank that hold a segment's partial sums (the PEs the row-parallel layer before
        the chain writes its output from): a later segment follows no faster than they relay its
        words (:func:`_relay_period`). None (default, for a caller without a mapping): spread
        over enough PEs that the links pace the segments.

    Returns
    -------
    CollectiveCost
        ``algorithm="chain"``; ``nbytes`` is one chain's.

    Raises
    ------
    ValueError
        For no chains, chains of different lengths, a chip in two chains, no segment count or
        one not an integer >= 1, or ``relay_pes`` not None or an integer >= 1.
    """
    groups = _chain_groups("chain_all_reduce_gathered", chains)
    every = np.concatenate(groups)
    segments = _whole_packets(_segment_counts("chain_all_reduce_gathered", segments), nbytes)
    relay_pes = _relay_pes("chain_all_reduce_gathered", relay_pes)
    topo, every = _prepare(topo, every, nbytes)
    c = groups[0].size
    if every.size == 1 or nbytes == 0:
        return CollectiveCost("all_reduce", "chain", 0.0, 0.0, 0, 0, 0, c, float(nbytes))
    src = np.concatenate([g[:-1] for g in groups])
    dst = np.concatenate([g[1:] for g in groups])
    return _cheapest_chain(topo, src, dst, c, nbytes, segments,
                           _tree_choices(topo, groups, [every] * len(groups), src, dst), relay_pes)


def _tree_choices(topo: "Topology", groups, targets, src: np.ndarray,
                  dst: np.ndarray) -> "list[tuple[np.ndarray, int]]":
    """The multicast trees a chain all-reduce may send its result on, each as ``(trees per
    directed link, deepest tree's hops)``: from each chain's last rank (``groups[k][-1]``) to
    every chip of ``targets[k]``, along the routes; over the targets' own links balanced as
    :func:`_chain_trees` balances them, where those links connect them; and over those links
    steered off the chains' own hops (``src -> dst``), where a route of equal depth avoids
    them. A link on a chain and a tree carries a segment of each in a period, so the cheapest
    depends on the message: the caller costs every choice. Memoized on ``topo`` per chains and
    targets."""
    key = ("chain_tree_choices", tuple(tuple(int(r) for r in g) for g in groups),
           tuple(tuple(int(r) for r in t) for t in targets))
    if key not in topo.memo:
        topo.memo[key] = _build_tree_choices(topo, groups, targets, src, dst)
    return topo.memo[key]


def _build_tree_choices(topo: "Topology", groups, targets, src: np.ndarray,
                        dst: np.ndarray) -> "list[tuple[np.ndarray, int]]":
    """:func:`_tree_choices` computed."""
    share = np.zeros(topo.nodes * 6)
    depth = 0
    for g, t in zip(groups, targets):
        t = t[t != g[-1]]
        _, links = topo.route_links(np.full(t.size, g[-1]), t)
        share[np.unique(links)] += 1.0
        depth = max(depth, int(topo.hops(np.full(t.size, g[-1]), t).max()))
    choices = [(share, depth)]
    if src.size:
        _, hops = topo.route_links(src, dst)
        chain = np.bincount(hops, minlength=topo.nodes * 6).astype(np.float64)
    else:
        chain = np.zeros(topo.nodes * 6)
    for seed in (None, chain):
        total, deepest = np.zeros(topo.nodes * 6), 0
        if all(t is targets[0] for t in targets):  # one target set: the trees balanced together
            load, d = _chain_trees(topo, targets[0], [int(np.flatnonzero(targets[0] == g[-1])[0]) for g in groups],
                                   seed)
            if load is None:
                continue
            total, deepest = load, d
        else:  # each chain's tree to its own ranks, the later ones steered off the earlier ones too
            trees = []
            for g, t in zip(groups, targets):
                load, d = _chain_trees(topo, t, [t.size - 1], None if seed is None else seed + total)
                if load is None:
                    break
                trees.append(load)
                total, deepest = total + load, max(deepest, d)
            if len(trees) < len(groups):
                continue
        if not any(np.array_equal(total, other) and deepest == dd for other, dd in choices):
            choices.append((total, deepest))
    return choices


def _cheapest_chain(topo: "Topology", src: np.ndarray, dst: np.ndarray, c: int, nbytes: float, segments,
                    trees, relay_pes: "int | None" = None) -> CollectiveCost:
    """The cheapest cost of chains of ``c`` ranks (hops ``src -> dst``) at each segment count,
    their results multicast on each of ``trees`` (:func:`_tree_choices`), and the cheapest of
    those: the first segment crosses the ``c - 1`` chain hops and the tree's ``D``, a step each,
    the later ones follow a period apart (:func:`_pipelined_s`; ``relay_pes``: the PEs a rank
    relays a segment's words on, :func:`_relay_period`). ``steps`` counts those
    ``c - 1 + D`` steps and the ``m - 1`` periods; ``hops`` and ``board_hops`` are ``steps``
    times a step's longest route and its board crossings."""
    best = None
    options = []
    for m in segments:
        seg = float(nbytes) / m
        if c > 1:
            cost, chain_load = topo.evaluate(src, dst, seg)
            chain_s, max_hops, board_hops = cost.seconds, max(1, cost.max_hops), cost.board_hops
        else:
            chain_load, chain_s, max_hops, board_hops = np.zeros(topo.nodes * 6), 0.0, 1, 0
        pick = None
        for tree_share, depth in trees:
            tree = np.flatnonzero(tree_share)
            tree_s = topo.link_seconds(tree_share * seg, tree) + float(topo.link_hop_s[tree].max())
            step = max(chain_s, tree_s)
            load = chain_load + tree_share * seg
            period = topo.link_seconds(load)  # a link on the chain and a tree carries both segments
            steps = m + c + depth - 2
            seconds, hop = _pipelined_s(topo, c - 1, depth, m, step, period, _relay_period(topo, seg, relay_pes))
            candidate = CollectiveCost("all_reduce", "chain", seconds, float(load.max()) * m, steps * max_hops,
                                       steps * board_hops, steps, c, float(nbytes), segments=int(m), step_s=hop)
            if pick is None or candidate.seconds < pick.seconds:
                pick = candidate
        options.append(pick)
        if best is None or pick.seconds < best.seconds:
            best = pick
    return replace(best, by_segments=tuple(options))


def _chain_trees(topo: "Topology", ranks: np.ndarray, roots,
                 seed: "np.ndarray | None" = None) -> "tuple[np.ndarray | None, int]":
    """Multicast trees from each rank index of ``roots`` to every other rank over the ranks'
    own links, each rank hung from the neighbour one hop closer to the root whose link carries
    the fewest trees so far (re-chosen in passes, as :func:`.trees._multicast_trees` balances
    the all-gather's): ``(trees per directed link, deepest tree's hops)``, ``(None, 0)`` where
    the links do not connect the ranks. ``seed``: segments a link already carries a period (a
    chain's hops), which a tree's choice of parent weighs with its own, not counted in the
    trees returned."""
    from .trees import _MULTICAST_PASSES, _breadth_first, _local_links

    member, nb = _local_links(topo, ranks)
    roots = [int(r) for r in roots]
    dist, order = _breadth_first(nb, roots)
    if (dist < 0).any():
        return None, 0
    cand = {}
    for s in range(len(roots)):
        for v in order[s][1:]:
            cand[s, v] = [int(ranks[u]) * 6 + (d + 3) % 6 for d, u in enumerate(nb[v])
                          if u >= 0 and dist[s, u] == dist[s, v] - 1]
    load = np.zeros(topo.nodes * 6) if seed is None else np.array(seed, dtype=np.float64)
    base = load.copy()
    inv_bw = 1.0 / topo.link_bw
    choice: dict = {}
    for _ in range(_MULTICAST_PASSES):
        for key in sorted(cand):
            old = choice.get(key)
            if old is not None:
                load[old] -= 1.0
            best = min(cand[key], key=lambda link: (load[link] * inv_bw[link], link))
            choice[key] = best
            load[best] += 1.0
    return load - base, int(dist.max())
