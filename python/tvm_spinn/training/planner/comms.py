"""Collectives of concurrent groups on the system's link graph (:class:`_Comms`)."""

from __future__ import annotations

import itertools
import math

import numpy as np


#: segment counts a pipelined chain reduction chooses from (each segment costs a DMA set-up on
#: every rank it passes, so the cheapest count stays well inside this range)
_CHAIN_SEGMENTS = tuple(2**k for k in range(13))


#: groups costed together for a lower bound of all of them at once (a subset shares fewer links)
_BOUND_GROUPS = 8


#: most ranks a direct reduce-scatter is costed for: its ``c (c - 1)`` pieces shrink with ``c``,
#: so wider groups take the chain or the ring (and costing it on the link graph grows as ``c**2``:
#: Llama-2-70B's cloud plan takes 21 s of CPU with 16, several times that with 48, same plan)
_DIRECT_RANKS = 16


#: message size at which a collective's affine cost is sampled (any size > 0 gives the same line)
_PROBE_BYTES = float(2**20)


class _Comms:
    """Collectives of concurrent groups on the system's link graph, cached by (op, groups, bytes).

    ``groups`` is a ``(g, c)`` array of chip ids: ``g`` groups of ``c`` ranks that run the same
    collective at the same time (every TP group of a stage slot, every DP group of the step),
    so their transfers share the links they meet (:meth:`Topology.evaluate` sums the bytes per
    link and per board edge). The algorithms are the step patterns of
    :mod:`tvm_spinn.timing.collectives` repeated over the groups:

    * fastest mode: the cheapest of the ring, the binomial tree and the reproducible mode's
      algorithms, and for a single group also the multicast algorithms
      (:func:`~tvm_spinn.timing.collectives.all_reduce` ``"auto"``);
    * both modes, for groups of up to :data:`_DIRECT_RANKS` ranks: the *direct* reduce-scatter
      (each rank sends every shard's owner its piece at once; the owner adds them in ascending
      rank order), and for an all-reduce the finished shards sent to every rank the same way;
    * reproducible mode: floating-point additions in one fixed order, a *pipelined chain*: the
      buffer cut into segments that flow from rank 0 to rank ``c - 1``, each rank adding its
      partial sums into the running sum (the ascending order of
      :func:`~tvm_spinn.timing.collectives.chain_all_reduce`, the order the compiled data-parallel
      step and the bit-exact tensor-parallel collectives use); an all-reduce sends each finished
      segment back down the chain on the reverse links at the same time, a reduce-scatter sends
      each finished segment on to its owner; the segments stream at the busiest link's rate
      after the first has crossed every hop (:meth:`_chain`). A single
      group may also use :func:`~tvm_spinn.timing.collectives.chain_all_reduce` (the multicast
      broadcast). All-gathers add nothing: any algorithm is exact.
    """

    def __init__(self, arch, reproducible: bool, alone: bool = False, shared: "_Comms | None" = None):
        from ...target.topology import board_grid, topology_of

        self.alone = alone  # cost each collective for its first few groups only (a lower bound)

        self.topo = topology_of(arch)
        self.per_board = arch.chips_per_board
        self.boards = max(1, -(-arch.chips // arch.chips_per_board))
        self.row = board_grid(self.boards)[0] if self.boards > 1 else 1  # boards along a torus row
        self.reproducible = reproducible
        self.dma_s = arch.dma_setup_cycles / arch.clock_hz  # one segment's DMA on a rank
        self.cache: dict = {}
        # the board paths and a pair's bytes split over them depend on the system only: a
        # ``shared`` instance's (the search's lower-bound costing beside its full one) are reused
        self.paths: dict = shared.paths if shared is not None else {}
        # so are the GEMMs' tiles and pass times (the system's chip alone prices them)
        self.gemms: dict = shared.gemms if shared is not None else {}

    def _get(self, key, make, cache: "dict | None" = None):
        cache = self.cache if cache is None else cache
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = make()
        return hit

    def collective(self, op: str, groups: np.ndarray, nbytes: float) -> float:
        """Seconds of collective ``op`` run by every group of ``groups`` at once: the cheapest
        algorithm. An algorithm is costed over all the groups only when its cost for the first
        few groups (a subset of the transfers: a lower bound of it) is below the cheapest found
        so far."""
        return self.collective_parts(op, groups, nbytes)[0]

    def collective_parts(self, op: str, groups: np.ndarray, nbytes: float, leaves: int = 1,
                         chain: bool = False) -> tuple:
        """``(seconds, busy seconds)`` of :meth:`collective`: its time, and of it the time its
        busiest link (or board edge) carries bytes. The rest (hop latencies, DMA set-ups, a
        pipelined chain's fill) delays the collective's ranks but leaves the links free for
        other transfers.

        ``leaves``: each rank's partial sum is that many leaves of the canonical order
        (:mod:`tvm_spinn.training.tp_chain`), added to the running sum one by one: the chain
        carries one buffer as before, the direct reduce-scatter one piece a leaf (a rank may
        not add its leaves first).

        ``chain``: in the reproducible mode, the chain alone (a sum whose order is one element
        after another across the ranks, as the loss' sum of exponentials in ascending class
        order: no rank's partial sum exists to send directly)."""
        return self.chosen(op, groups, nbytes, leaves, chain)[:2]

    def chosen(self, op: str, groups: np.ndarray, nbytes: float, leaves: int = 1,
               chain: bool = False) -> tuple:
        """``(seconds, busy seconds, algorithm)`` of :meth:`collective_parts`: its figures and
        the name of the algorithm they are of (``""`` where nothing is sent)."""
        groups = np.ascontiguousarray(groups, dtype=np.int64)
        if groups.ndim != 2 or groups.shape[1] < 2 or nbytes <= 0:
            return 0.0, 0.0, ""
        groups = groups[:_BOUND_GROUPS] if self.alone else self._window(groups)
        n = float(nbytes)
        names = ("chain",) if chain and self.reproducible else self._algorithms(op, groups.shape[0], groups.shape[1])
        if groups.shape[0] == 1:
            return min(self._at(op, groups, a, n, leaves) + (a,) for a in names)
        few = groups[:_BOUND_GROUPS] if groups.shape[0] > _BOUND_GROUPS else groups[:1]
        floors = {a: self._at(op, few, a, n, leaves)[0] for a in names}
        best = (math.inf, math.inf, "")
        for a in sorted(names, key=lambda a: (floors[a], a)):
            if floors[a] >= best[0]:
                break
            best = min(best, self._at(op, groups, a, n, leaves) + (a,))
        return best

    def _algorithms(self, op: str, g: int, c: int) -> tuple:
        direct = ("direct",) if c <= _DIRECT_RANKS else ()
        if self.reproducible and op != "all_gather":
            return ("chain", *direct)
        # the fixed-order algorithms are valid in the fastest mode too (it is never slower)
        exact = ("chain",) if op != "all_gather" else ()
        return ("ring", "tree", *exact, *direct, "multicast") if g == 1 else ("ring", "tree", *exact, *direct)

    def _at(self, op: str, groups: np.ndarray, algorithm: str, n: float, leaves: int = 1) -> tuple:
        """``(seconds, busy seconds)`` of one algorithm for ``n`` bytes (its affine lines cached
        per group pattern; each line ``(seconds per byte, seconds, busy seconds per byte)``).
        A direct reduction of ``leaves`` leaves a rank sends that many pieces: its reduce-scatter
        carries ``leaves`` times the bytes (an all-reduce's gather half does not)."""
        lines = self._get((op, algorithm, groups.shape, groups.tobytes()),
                          lambda: self._lines(op, groups, algorithm))
        if algorithm == "direct" and leaves > 1 and op != "all_gather":
            n = n * leaves if op == "reduce_scatter" else n * (leaves + 1) / 2
        return min(((a * n + b, busy * n) for a, b, busy in lines), default=(math.inf, math.inf))

    @staticmethod
    def _affine(cost) -> tuple:
        """``(seconds per byte, seconds)`` of a cost function of the message size: every
        candidate is a fixed set of routes whose link loads scale with the bytes, so its time is
        affine in them (:meth:`Topology.link_seconds` is a maximum of loads over rates)."""
        one, two = cost(_PROBE_BYTES), cost(2 * _PROBE_BYTES)
        return (two - one) / _PROBE_BYTES, 2 * one - two

    def _window(self, groups: np.ndarray, limit: "int | None" = None) -> np.ndarray:
        """The groups that lie on the system's first boards, when the rest repeat them.

        Chip ids number the boards one after another and a split's layout repeats along them,
        so the groups on ``4 x`` the boards one group spans (at least two periods of any
        pattern that repeats within that span), and for groups on several boards a row of the
        torus of boards more (so a stretch that wraps to the next row is among them), load
        their boards' links as every other stretch of boards is loaded: their concurrent cost
        is every group's. Where that window is the whole system, all groups are costed.
        ``limit``: the window's chips given (:meth:`window_chips`), for sets costed together."""
        top = groups.max(axis=1)
        window = self.window_chips(groups) if limit is None else limit
        inside = groups[top < window]
        return inside if inside.size else groups

    def window_chips(self, groups: np.ndarray) -> int:
        """The chips of :meth:`_window`'s window for ``groups``: the groups below that chip id
        are costed (every chip's where the window is the whole system)."""
        per_board = self.per_board
        top = groups.max(axis=1)
        span = int((top // per_board - groups.min(axis=1) // per_board).max()) + 1
        # the window also holds a row of the torus of boards and the next board: board ids run
        # along rows, so groups that straddle the end of a row (longer routes) are among it
        boards = 4 * span + (self.row + 1 if span > 1 else 0)
        return min(boards, self.boards) * per_board

    def _lines(self, op: str, groups: np.ndarray, algorithm: str) -> list:
        """One algorithm of ``op`` over ``groups`` as affine costs (class docstring); none where
        it is not built for these ranks."""
        from ...timing import collectives as co

        g, c = groups.shape
        if algorithm == "chain":
            return self._chain(op, groups)
        ranks = groups.reshape(-1)
        if algorithm == "direct":
            # every rank sends each other rank its piece (``n / c``) of that rank's shard at
            # once; the owner adds the pieces in ascending rank order (a fixed order: the
            # chain's); an all-reduce then sends each finished shard to every other rank the
            # same way; an all-gather is that second step alone
            src, dst = (x.reshape(-1) for x in np.meshgrid(np.arange(c), np.arange(c), indexing="ij"))
            keep = src != dst
            offset = (np.arange(g) * c)[:, None]
            step, _ = self.topo.evaluate(ranks[(offset + src[keep][None, :]).reshape(-1)],
                                         ranks[(offset + dst[keep][None, :]).reshape(-1)], _PROBE_BYTES / c)
            repeats = 2 if op == "all_reduce" else 1
            per_byte = repeats * step.bandwidth_s / _PROBE_BYTES
            return [(per_byte, repeats * step.latency_s, per_byte)]
        if algorithm == "multicast":  # one group: the multicast trees
            fn = {"all_reduce": co.all_reduce, "all_gather": co.all_gather, "reduce_scatter": co.reduce_scatter}[op]
            try:
                a, b = self._affine(lambda n: fn(self.topo, ranks, n, algorithm="multicast").seconds)
                return [(a, b, a)]
            except ValueError:  # no multicast trees over these ranks
                return []
        # the algorithm's steps over every group at once, each step's bandwidth term per byte and
        # its latency (collectives._evaluate sums the steps the same way)
        offset = (np.arange(g) * c)[:, None]
        per_byte, fixed = 0.0, 0.0
        for src, dst, size, repeats in co._steps(op, algorithm, c, _PROBE_BYTES):
            step, _ = self.topo.evaluate(ranks[(offset + src[None, :]).reshape(-1)],
                                         ranks[(offset + dst[None, :]).reshape(-1)], np.tile(size, g))
            per_byte += repeats * step.bandwidth_s / _PROBE_BYTES
            fixed += repeats * step.latency_s
        return [(per_byte, fixed, per_byte)]

    def _route_seconds(self, src: np.ndarray, dst: np.ndarray, nbytes) -> tuple:
        """For concurrent transfers ``src[i] -> dst[i]`` of ``nbytes``: the seconds all of them
        take together (the busiest link or board edge), and per transfer the seconds its route's
        busiest link takes to carry what all of them put on it and its summed hop latencies."""
        topo = self.topo
        nbytes = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), src.shape)
        transfer, links = topo.route_links(src, dst)
        if not links.size:
            return 0.0, np.zeros(src.size), np.zeros(src.size)
        load = np.bincount(links, weights=nbytes[transfer], minlength=topo.nodes * 6)
        seconds = load / topo.link_bw
        used = np.flatnonzero(load)
        group = topo.link_group[used]
        edge = used[group >= 0]
        if edge.size:  # a board edge's serial link(s) carry all its chip links' bytes
            per_group = np.bincount(topo.link_group[edge], weights=load[edge], minlength=topo.group_bw.size)
            seconds[edge] = np.maximum(seconds[edge], per_group[topo.link_group[edge]]
                                       / topo.group_bw[topo.link_group[edge]])
        route = np.zeros(src.size)
        np.maximum.at(route, transfer, seconds[links])
        latency = np.bincount(transfer, weights=topo.link_hop_s[links], minlength=src.size)
        return float(seconds.max()), route, latency

    def _chain(self, op: str, groups: np.ndarray) -> list:
        """The pipelined chain of every group at once, one affine cost per segment count.

        The message of ``n`` bytes flows down each chain in ``m`` segments (an all-reduce's
        finished segments flow back up at the same time; a reduce-scatter's leave the last rank
        for their owners as they finish). The links carry every segment once, so the stream
        takes the busiest link's (or board edge's) time for the whole message with all these
        transfers at once; the first segment takes every hop of its chain before the stream
        flows (the fill: each hop's busiest link's time for ``n / m`` bytes and its hop
        latencies), and every segment is one DMA (``dma_setup_cycles``) on every rank it
        passes. (Charging each of the ``m + c - 2`` steps the slowest hop's time and latency
        would make a chain that crosses a few slow board edges pay them on all its on-board
        hops.)"""
        g, c = groups.shape
        src, dst = groups[:, :-1].reshape(-1), groups[:, 1:].reshape(-1)
        sizes = np.full(src.size, _PROBE_BYTES)
        if op == "all_reduce":  # the reduce forward and the finished segments back, concurrently
            pairs, hops = (np.concatenate([src, dst]), np.concatenate([dst, src])), 2 * (c - 1)
            sizes = np.concatenate([sizes, sizes])
        else:
            pairs, hops = (src, dst), c - 1
        chain = sizes.size
        if op == "reduce_scatter":  # the last rank sends every other rank its shard
            last, owners = np.repeat(groups[:, -1], c - 1), groups[:, :-1].reshape(-1)
            pairs = (np.concatenate([pairs[0], last]), np.concatenate([pairs[1], owners]))
            sizes = np.concatenate([sizes, np.full(last.size, _PROBE_BYTES / c)])
        ways = 2 if op == "all_reduce" else 1
        lines = []
        for stream, route, latency in self._routings(pairs[0], pairs[1], sizes):
            # the fill: a segment's way along the slowest group's chain (both ways for an
            # all-reduce)
            fill = float(route[:chain].reshape(ways, g, c - 1).sum(axis=(0, 2)).max())
            lat = float(latency[:chain].reshape(ways, g, c - 1).sum(axis=(0, 2)).max())
            tail_s = tail_lat = 0.0
            if op == "reduce_scatter":
                # the last segment's way to its owner after the chain: a ``c / m`` share of its
                # shard's route (the whole shard where the segments are fewer than the owners)
                tail_s, tail_lat = float(route[chain:].max()), float(latency[chain:].max())
            lines += [((stream + fill / m + tail_s * min(1.0, c / m)) / _PROBE_BYTES,
                       lat + tail_lat + (m + hops) * self.dma_s, stream / _PROBE_BYTES) for m in _CHAIN_SEGMENTS]
        return lines

    def _routings(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> list:
        """The ways concurrent transfers may be routed, each as :meth:`_route_seconds` gives
        it: every transfer on its chip route; and where some cross between boards, those split
        over the edge-disjoint paths of boards (:meth:`_edge_seconds`; a chain hop that
        crosses a board edge need not take the one edge its chip route meets)."""
        out = [self._route_seconds(src, dst, sizes)]
        cross = src // self.per_board != dst // self.per_board
        if self.boards < 2 or not cross.any():
            return out
        edges = self._edge_seconds(src[cross] // self.per_board, dst[cross] // self.per_board, sizes[cross])
        if edges is None:
            return out
        stream, route, latency = (0.0, np.zeros(src.size), np.zeros(src.size))
        if not cross.all():
            stream, route[~cross], latency[~cross] = self._route_seconds(src[~cross], dst[~cross], sizes[~cross])
        route[cross], latency[cross] = edges[1], edges[2]
        out.append((max(stream, edges[0]), route, latency))
        return out

    def transfers(self, op: str, algorithm: str, groups: np.ndarray, nbytes: float, leaves: int = 1,
                  window: "int | None" = None) -> tuple:
        """``(src, dst, bytes)``: what collective ``op`` of every group of ``groups`` at once
        sends between each pair of chips over the whole collective, by ``algorithm``: ``"ring"``
        (:func:`~tvm_spinn.timing.collectives.steps._steps`' ring, its steps' bytes added),
        ``"chain"`` (:meth:`_chain`'s transfers: the running sums down each chain, an
        all-reduce's finished segments back up it, a reduce-scatter's shards from the last rank
        to their owners) or ``"direct"`` (:meth:`_lines`' direct: each rank's piece to every
        other rank, ``leaves`` pieces a reduction, twice for an all-reduce). The groups costed
        are :meth:`collective_parts`' (the window), or those below chip ``window``.

        Raises
        ------
        ValueError
            For another algorithm (the trees' and multicast's steps are not listed)."""
        from ...timing.collectives.steps import _steps

        groups = np.ascontiguousarray(groups, dtype=np.int64)
        groups = groups[:_BOUND_GROUPS] if self.alone else self._window(groups, window)
        g, c = groups.shape
        n = float(nbytes)
        if algorithm == "direct":
            src, dst = (x.reshape(-1) for x in np.meshgrid(np.arange(c), np.arange(c), indexing="ij"))
            keep = src != dst
            offset = (np.arange(g) * c)[:, None]
            src = groups.reshape(-1)[(offset + src[keep][None, :]).reshape(-1)]
            dst = groups.reshape(-1)[(offset + dst[keep][None, :]).reshape(-1)]
            # as :meth:`_at` prices it: a reduction's ``leaves`` pieces, an all-reduce's gather half
            piece = n / c * {"reduce_scatter": leaves, "all_reduce": leaves + 1}.get(op, 1)
            return src, dst, np.full(src.size, piece)
        if algorithm == "chain":
            src, dst = groups[:, :-1].reshape(-1), groups[:, 1:].reshape(-1)
            sizes = np.full(src.size, n)
            if op == "all_reduce":
                src, dst, sizes = np.concatenate([src, dst]), np.concatenate([dst, src]), np.concatenate([sizes, sizes])
            elif op == "reduce_scatter":
                src = np.concatenate([src, np.repeat(groups[:, -1], c - 1)])
                dst = np.concatenate([dst, groups[:, :-1].reshape(-1)])
                sizes = np.concatenate([sizes, np.full(g * (c - 1), n / c)])
            return src, dst, sizes
        if algorithm != "ring":
            raise ValueError(f"transfers: algorithm {algorithm!r} is not 'ring', 'chain' or 'direct'")
        offset = (np.arange(g) * c)[:, None]
        ranks = groups.reshape(-1)
        out = [(ranks[(offset + s[None, :]).reshape(-1)], ranks[(offset + d[None, :]).reshape(-1)],
                np.tile(size * repeats, g)) for s, d, size, repeats in _steps(op, "ring", c, n)]
        return tuple(np.concatenate(x) for x in zip(*out))

    def slot_busy(self, collectives: list, src: np.ndarray, dst: np.ndarray, sizes) -> "float | None":
        """Seconds the busiest link (or board edge) takes to carry, at once, the collectives
        ``(op, groups, bytes, leaves, chain)`` (each by the algorithm :meth:`chosen` prices it
        by) and the point-to-point transfers ``src[i] -> dst[i]`` of ``sizes``
        (:meth:`joint_busy`, every set in the widest of their windows); None where a chosen
        algorithm's transfers are not listed (:meth:`transfers`: the trees', multicast's)."""
        sets = []
        for op, groups, nbytes, leaves, chain in collectives:
            by = self.chosen(op, groups, nbytes, leaves, chain)[2]
            if by not in ("", "ring", "chain", "direct"):
                return None
            if by:
                sets.append((op, by, np.ascontiguousarray(groups, dtype=np.int64), float(nbytes), leaves))
        src, dst = np.asarray(src, np.int64).reshape(-1), np.asarray(dst, np.int64).reshape(-1)
        window = max([self.window_chips(g) for _, _, g, _, _ in sets]
                     + ([self.window_chips(np.stack([src, dst], axis=1))] if src.size else []), default=0)
        parts = [self.transfers(op, by, g, n, k, window=window) for op, by, g, n, k in sets]
        if src.size:
            parts.append(self.pair_transfers(src, dst, sizes, window))
        return self.joint_busy(parts)

    def joint_busy(self, parts: list) -> float:
        """Seconds the busiest link (or board edge) takes to carry several sets of concurrent
        transfers at once, each set ``(src, dst, bytes)`` routed one of the ways
        :meth:`_routings` offers it (every transfer on its chip route, or those that leave their
        boards split over the boards' edge-disjoint paths): the bytes of every set added per
        link and per board edge, for the combination of routings whose busiest link is least.

        Transfers that run concurrently in a steady pipeline slot (a stage's collectives of one
        slot's forward, another's backward and its hand-overs) load the links together: this is
        their busy time where they meet on few links, against the sum of each set's own busiest
        link (:meth:`collective_parts`), which counts them as if they met on one; it is never
        above that sum for the same transfers. The sets should be windowed alike
        (:meth:`transfers` and :meth:`_pairs` with one ``window``).

        The edge-disjoint option puts the bytes of transfers that leave their boards on the
        board edges alone, as :meth:`_edge_seconds` costs them: their legs on the chip links
        of the boards they leave and enter are not added (a board edge's rate is below a chip
        link's, so the edges bind where such bytes dominate)."""
        from ...target.topology import edge_rate

        topo = self.topo
        rate = edge_rate(topo)
        options = []
        for src, dst, sizes in parts:
            src, dst = np.asarray(src, np.int64).reshape(-1), np.asarray(dst, np.int64).reshape(-1)
            sizes = np.broadcast_to(np.asarray(sizes, np.float64), src.shape)
            keep = (src != dst) & (sizes > 0)
            if keep.any():
                options.append(self._loads(src[keep], dst[keep], np.ascontiguousarray(sizes[keep])))
        if not options:
            return 0.0
        best = math.inf
        for combo in itertools.product(*options):
            chip = np.sum([c for c, _ in combo], axis=0)
            edge = np.sum([e for _, e in combo], axis=0)
            edges = np.divide(edge, rate, out=np.zeros_like(edge), where=rate > 0)
            best = min(best, max(float((chip / topo.link_bw).max()), float(edges.max())))
        return best

    def _loads(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> list:
        """The ways :meth:`_routings` routes transfers, each as ``(bytes per chip link
        (nodes * 6), bytes per board edge group (boards * 6))``: on their chip routes (a board
        link's bytes count on its edge group too), and where some leave their boards, those
        over the boards' edge-disjoint paths (their bytes on the board edges alone, as
        :meth:`_edge_seconds` costs them) and the rest on their chip routes."""
        topo = self.topo

        def routed(s, d, n):
            transfer, links = topo.route_links(s, d)
            chip = np.bincount(links, weights=n[transfer], minlength=topo.nodes * 6).astype(np.float64)
            group = topo.link_group[links]
            on_edge = group >= 0
            edge = np.bincount(group[on_edge], weights=n[transfer][on_edge], minlength=self.boards * 6)
            return chip, edge.astype(np.float64)

        out = [routed(src, dst, sizes)]
        cross = src // self.per_board != dst // self.per_board
        if self.boards < 2 or not cross.any():
            return out
        found = self._edge_load(src[cross] // self.per_board, dst[cross] // self.per_board, sizes[cross])
        if found is None:
            return out
        chip, edge = routed(src[~cross], dst[~cross], sizes[~cross])
        out.append((chip, edge + found[0]))
        return out

    def handover(self, src: np.ndarray, dst: np.ndarray, nbytes: float) -> float:
        """Seconds of the concurrent point-to-point transfers ``src[i] -> dst[i]``: each on its
        chip route (:func:`~tvm_spinn.timing.collectives.point_to_point`), or, where every
        transfer leaves its board, the cheaper of that and the boards' edge-disjoint paths
        (:meth:`_board_paths`)."""
        from ...timing.collectives import point_to_point

        if nbytes <= 0 or src.size == 0:
            return 0.0
        src, dst = self._pairs(src, dst)
        return self._get(("p2p", src.tobytes(), dst.tobytes(), float(nbytes)),
                         lambda: min(point_to_point(self.topo, src, dst, nbytes).seconds,
                                     self._board_paths(src, dst, float(nbytes))))

    def _pairs(self, src: np.ndarray, dst: np.ndarray, window: "int | None" = None) -> tuple[np.ndarray, np.ndarray]:
        """The transfers ``src[i] -> dst[i]`` a costing counts: the bound's first groups
        alone, else the pipeline window's (:meth:`_window`; those below chip ``window`` where
        given), as contiguous arrays."""
        pairs = np.stack([np.ascontiguousarray(src.reshape(-1)), np.ascontiguousarray(dst.reshape(-1))], axis=1)
        pairs = pairs[:_BOUND_GROUPS] if self.alone else self._window(pairs, window)
        return np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])

    def pair_transfers(self, src: np.ndarray, dst: np.ndarray, sizes, window: int) -> tuple:
        """``(src, dst, bytes)`` of the point-to-point transfers ``src[i] -> dst[i]`` of
        ``sizes`` a joint costing (:meth:`joint_busy`) counts: the bound's first ones alone,
        else those below chip ``window`` (all where none is)."""
        src, dst = np.asarray(src, np.int64).reshape(-1), np.asarray(dst, np.int64).reshape(-1)
        sizes = np.broadcast_to(np.asarray(sizes, np.float64), src.shape)
        if self.alone:
            return src[:_BOUND_GROUPS], dst[:_BOUND_GROUPS], sizes[:_BOUND_GROUPS]
        keep = np.maximum(src, dst) < window
        keep = keep if keep.any() else np.ones_like(keep)
        return src[keep], dst[keep], np.ascontiguousarray(sizes[keep])

    def onboard(self, src: np.ndarray, dst: np.ndarray, nbytes: float) -> float:
        """Seconds the busiest *on-board* chip link takes to carry the concurrent transfers
        ``src[i] -> dst[i]`` of ``nbytes`` on their chip routes (the board-to-board links left
        out): the share of a hand-over that meets collectives confined to boards. A hand-over
        whose time is a board edge's (:meth:`_board_paths`) puts only this on the links such
        collectives use; one that stays on its board, all of it."""
        if nbytes <= 0 or src.size == 0:
            return 0.0
        src, dst = self._pairs(src, dst)

        def routed() -> np.ndarray:  # the transfers' on-board links, once per set of transfers
            _, links = self.topo.route_links(src, dst)
            return links[self.topo.link_group[links] < 0]

        def make() -> float:
            topo = self.topo
            inside = self._get(("onboard_links", key), routed)
            if not inside.size:
                return 0.0
            load = np.bincount(inside, weights=np.full(inside.size, float(nbytes)), minlength=topo.nodes * 6)
            return float((load / topo.link_bw).max())

        key = (src.tobytes(), dst.tobytes())
        return self._get(("onboard", *key, float(nbytes)), make)

    def on_boards(self, groups: np.ndarray) -> bool:
        """Whether every group's ranks lie on one board (its collectives leave the board-to-board
        links free)."""
        boards = np.asarray(groups).reshape(len(groups), -1) // self.per_board
        return bool((boards == boards[:, :1]).all())

    def _board_paths(self, src: np.ndarray, dst: np.ndarray, nbytes: float) -> float:
        """Seconds of transfers that all leave their boards, the bytes from each board to each
        other board split over the edge-disjoint paths of boards between the two
        (:meth:`~tvm_spinn.target.topology.Topology.board_paths`, shares by
        :func:`~tvm_spinn.timing.collectives.water_fill` as
        :func:`~tvm_spinn.timing.collectives.multipath_point_to_point` splits one transfer):
        the shares of all board pairs at once load the board edges, the busiest edge binds
        (the chip links on either side outrun a board edge), plus the longest used path's
        latency. ``inf`` where a transfer stays on its board."""
        a, b = src // self.per_board, dst // self.per_board
        if self.boards < 2 or (a == b).any():
            return math.inf
        found = self._edge_seconds(a, b, np.full(src.size, nbytes))
        return math.inf if found is None else found[0] + float(found[2].max())

    def _edge_seconds(self, a: np.ndarray, b: np.ndarray, sizes: np.ndarray):
        """Transfers from board ``a[i]`` to another board ``b[i]`` of ``sizes[i]`` bytes, each
        board pair's bytes split over its edge-disjoint board paths (:meth:`_board_paths`):
        ``(busiest edge's seconds, per transfer its pair's busiest used edge's seconds and its
        longest used path's latency)``, or None where two boards have no path."""
        from ...target.topology import edge_rate

        found = self._edge_load(a, b, sizes)
        if found is None:
            return None
        load, used, lats, at = found
        rate = edge_rate(self.topo)
        seconds = np.divide(load, rate, out=np.zeros_like(load), where=rate > 0)
        pair = np.array([seconds[e].max() for e in used])
        return float(seconds.max()), pair[at], lats[at]

    def _edge_load(self, a: np.ndarray, b: np.ndarray, sizes: np.ndarray):
        """The board edges' bytes of :meth:`_edge_seconds`' transfers: ``(bytes per edge group
        (boards * 6), each board pair's used edges, each pair's longest used path's latency, each
        transfer's pair)``, or None where two boards have no path."""
        keys, at = np.unique(a * self.boards + b, return_inverse=True)  # board pairs
        totals = np.bincount(at, weights=sizes)
        load = np.zeros(self.boards * 6)
        used, lats = [], np.zeros(keys.size)
        for p, (key, total) in enumerate(zip(keys.tolist(), totals.tolist())):
            split = self._get(("edge_split", key, total), lambda: self._pair_split(key, total), self.paths)
            if split is None:
                return None
            edges, parts, lats[p] = split
            # the paths are edge-disjoint (no edge twice in ``edges``): one scatter adds each
            # edge's share as the path-by-path additions would
            load[edges] += parts
            used.append(edges)
        return load, used, lats, at

    def _pair_split(self, key: int, total: float):
        """One board pair's ``total`` bytes over its board paths (:meth:`_edge_seconds`):
        ``(the used paths' edge ids, each edge's bytes, the longest used path's latency)``, or
        None where the boards have no path. The paths' edges are found once per pair and the
        bytes' shares once per displacement and bytes: the search meets the same pairs and
        bytes in split after split."""
        from ...timing.collectives import water_fill

        paths, rates, lat, edges, path_of, disjoint = self._get(
            ("pair_edges", key), lambda: self._pair_edges(*self._paths(*divmod(key, self.boards))), self.paths)
        if not paths:
            return None
        _, share = self._get(("fill", tuple(rates), tuple(lat), total), lambda: water_fill(rates, lat, total),
                             self.paths)
        used = share > 0
        latency = max(l for l, u in zip(lat, used.tolist()) if u)
        if disjoint:
            keep = used[path_of]
            return edges[keep], share[path_of][keep], latency
        load = np.zeros(self.boards * 6)  # paths that share an edge: add path by path
        for path, part in zip(paths, share):
            if part > 0:
                load[path] += part
        edges = np.flatnonzero(load)
        return edges, load[edges], latency

    @staticmethod
    def _pair_edges(paths, rates, lat) -> tuple:
        """A board pair's :meth:`_paths` and ``(every path's edge ids one after another, each
        edge's path, whether no edge is on two paths)``."""
        if not paths:
            return paths, rates, lat, None, None, False
        edges = np.concatenate(paths)
        path_of = np.repeat(np.arange(len(paths)), [len(p) for p in paths])
        return paths, rates, lat, edges, path_of, np.unique(edges).size == edges.size

    def _paths(self, x: int, y: int) -> tuple:
        """``(edge ids of each board path from board x to board y, their rates, latencies)``.
        The torus of boards looks the same from every board (unless some fault breaks it), so
        the paths and their costs are found once per displacement, from board 0, and moved."""
        topo = self.topo
        if topo.faulty:
            return self._get(("board_paths", x, y), lambda: self._costed_paths(x, y), self.paths)
        bx, by = topo.grid
        dx, dy = (y % bx - x % bx) % bx, (y // bx - x // bx) % by
        paths, rates, lats = self._get(("board_paths_by", dx, dy), lambda: self._costed_paths(0, dx + bx * dy),
                                       self.paths)
        sx, sy = x % bx, x // bx
        moved = [((path // 6 % bx + sx) % bx + bx * ((path // 6 // bx + sy) % by)) * 6 + path % 6 for path in paths]
        return moved, rates, lats

    def _costed_paths(self, x: int, y: int) -> tuple:
        paths = self.topo.board_paths(x, y)
        costs = [self.topo.path_cost(p) for p in paths]
        return [np.asarray(p, dtype=np.int64) for p in paths], [c[0] for c in costs], [c[1] for c in costs]
