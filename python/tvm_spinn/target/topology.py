"""The chip-to-chip link graph of a SpiNNaker2 system and deterministic routing on it.

Wiring (see the sources in :mod:`tvm_spinn.target.arch`)
--------------------------------------------------------
- **Board** [SpiNNMachine-248]: the 48 chips sit on the triangular lattice in the SpiNN-5 hexagon
  ``0 <= x, y <= 7, -3 <= x - y <= 4``. Each chip has 6 links, numbered as on SpiNNaker:
  0 E ``(+1, 0)``, 1 NE ``(+1, +1)``, 2 N ``(0, +1)``, 3 W ``(-1, 0)``, 4 SW ``(-1, -1)``,
  5 S ``(0, -1)``. A standalone board has no wrap-around: its edge links are unconnected.
- **Boards** (assumption for SpiNNaker2; the SpiNNaker1 arrangement that [SpiNNMachine-248]
  reuses): the hexagon tiles the lattice with translations ``U = (8, 4)`` and ``V = (4, 8)`` (three
  boards per 12 x 12 chips, SpiNNaker's "triads"). A system of ``boards >= 2`` puts board
  ``(a, b)`` at ``a U + b V`` on a ``bx x by`` torus of boards (:func:`board_grid`, the most
  nearly square factorisation), wrapping by ``bx U`` and ``by V``: every chip keeps exactly 6
  links, and a link whose far end lies outside the chip's own hexagon is a board-to-board link
  (longer hop :attr:`~SpinnArch.board_link_hop_s`). A dimension of one board wraps onto the
  board itself.
- **Board edges** (assumption for SpiNNaker2, SpiNNaker1's spiNNlink in [spiNNlink]): the eight
  chip-to-chip links that cross one of a board's six hexagon edges do not run as eight cables:
  they share the edge's :attr:`~SpinnArch.board_serial_links` serial links (an *edge group*, one
  per board, edge and direction) of ``SpinnArch.payload_bw("board_pair")`` together, and each
  alone runs at most at ``payload_bw("board_chip")``. On-board links run at
  ``payload_bw("chip")``. Every rate is a payload rate: a link's bit rate less its packets'
  headers and routing keys (:attr:`~SpinnArch.link_payload_fraction`).
- **Part of a board** (``chips < 48``): chips ``0 .. chips-1`` of one board; the routers of the
  board's other chips still forward packets.

Chip ids: board ``a + bx * b`` holds chips ``48 * board ...``; inside a board, chips are numbered
along a snake over the rows (row ``y`` left to right when even, right to left when odd), so
consecutive ids are one hop apart on a board.

Routing: the shortest displacement on the torus (the smallest of the 9 images ``d + i bx U +
j by V``, ``i, j in {-1, 0, 1}``, ties to the first in a fixed order), then dimension order:
diagonal (NE/SW) hops first when both components share a sign, then E/W, then N/S. On the
triangular lattice that path is a shortest one, and inside a convex hexagon it never leaves it.

Faults (:attr:`~SpinnArch.dead_chips`, ``dead_links``, ``dead_board_links``, ``dead_boards`` and
``allocated_boards``): a dead link, every link of a dead board edge, and every link of a dead chip
or of a board outside the allocation are taken out of the graph (``neighbors`` -1 both ways). A
route that the rule above sends over one of them takes instead a shortest path on the live links
(breadth-first, the first shortest path in link-id order, so routes stay deterministic); every
other route is the healthy one. Live chips that the faults cut apart are refused
(:class:`~tvm_spinn.target.arch.ArchError` naming the fields); so is a transfer from or to a dead chip.

Costs: a *set of concurrent transfers* loads each directed link with the bytes of the routes
through it (links are full duplex: each direction is its own link); its time is
``max over links and edge groups (bytes / bandwidth) + max over transfers (sum of the hop
latencies)`` (:meth:`Topology.link_seconds`). Nothing
here is all-pairs: positions, a neighbour table (``chips x 6``) and per-transfer walks, so a
720-board system is described in milliseconds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from .arch import FAULT_FIELDS, ArchError, SpinnArch

__all__ = [
    "BOARD_CHIPS", "DIRECTIONS", "DIRECTION_NAMES", "Topology", "TransferCost", "board_grid",
    "board_layout", "ring_order", "topology_of", "BoardGraph", "board_edges", "board_graph", "board_paths",
    "crossing_hops", "edge_rate", "edge_reach_hops", "path_cost",
]

#: Link directions in SpiNNaker's numbering: E, NE, N, W, SW, S.
DIRECTIONS = np.array([(1, 0), (1, 1), (0, 1), (-1, 0), (-1, -1), (0, -1)], dtype=np.int64)
DIRECTION_NAMES = ("E", "NE", "N", "W", "SW", "S")
#: Chips on a board in the SpiNN-5 layout [SpiNNMachine-248].
BOARD_CHIPS = 48
#: Breadth-first trees (one per source of a detoured route) a faulty graph keeps at most
DETOUR_TREES = 512
#: Route sets :meth:`Topology.evaluate` keeps per graph (:meth:`Topology._routed`), at most this
#: many and this many bytes of their arrays
ROUTES_KEPT = 4096
ROUTE_BYTES_KEPT = 2**26
_U = np.array([8, 4], dtype=np.int64)
_V = np.array([4, 8], dtype=np.int64)
_E, _NE, _N, _W, _SW, _S = range(6)


def board_layout() -> np.ndarray:
    """Lattice coordinates of a board's 48 chips, indexed by the chip's number on its board.

    Returns
    -------
    numpy.ndarray
        ``(48, 2)`` int64 ``(x, y)``, in snake order over the rows of the hexagon.
    """
    rows = []
    for y in range(8):
        xs = list(range(max(0, y - 3), min(7, y + 4) + 1))
        rows += [(x, y) for x in (xs if y % 2 == 0 else reversed(xs))]
    return np.array(rows, dtype=np.int64)


_LAYOUT = board_layout()


def _tile_table() -> np.ndarray:
    """``table[x % 12, y % 12]`` = the board-local number of the chip at ``(x, y)``.

    ``(12, 0) = 2U - V`` and ``(0, 12) = 2V - U`` are board translations, so a point's place on its
    board depends on its coordinates modulo 12 only. Built by translating the hexagon; a cell
    covered twice or never would mean the hexagon does not tile (checked here once).
    """
    table = np.full((12, 12), -1, dtype=np.int64)
    for a in range(-2, 4):
        for b in range(-2, 4):
            for local, (x, y) in enumerate(_LAYOUT + a * _U + b * _V):
                if 0 <= x < 12 and 0 <= y < 12:
                    if table[x, y] != -1:
                        raise AssertionError("board hexagon overlaps itself: layout is wrong")
                    table[x, y] = local
    if (table < 0).any():
        raise AssertionError("board hexagon leaves holes: layout is wrong")
    return table


_TILE = _tile_table()
_IN_HEXAGON = np.zeros((8, 8), dtype=bool)
_IN_HEXAGON[_LAYOUT[:, 0], _LAYOUT[:, 1]] = True


def board_grid(boards: int) -> tuple[int, int]:
    """Shape ``(bx, by)`` of the torus of boards: the most nearly square factorisation.

    Parameters
    ----------
    boards : int
        Number of boards (>= 1).

    Returns
    -------
    tuple of int
        ``bx <= by`` with ``bx * by == boards`` and ``bx`` the largest divisor <= sqrt(boards)
        (720 boards: 24 x 30; a prime count is a ring of boards, 1 x boards).
    """
    if not isinstance(boards, int) or boards <= 0:
        raise ArchError(f"boards must be a positive integer, got {boards!r}")
    bx = max(d for d in range(1, math.isqrt(boards) + 1) if boards % d == 0)
    return bx, boards // bx


def _hex_norm(vx: np.ndarray, vy: np.ndarray) -> np.ndarray:
    """Hops of a displacement on the triangular lattice (links E, NE, N and their opposites)."""
    ax, ay = np.abs(vx), np.abs(vy)
    return np.where(vx * vy >= 0, np.maximum(ax, ay), ax + ay)


@dataclass(frozen=True)
class TransferCost:
    """Cost of a set of concurrent transfers on the link graph.

    Attributes
    ----------
    seconds : float
        ``bandwidth_s + latency_s``.
    bandwidth_s : float
        Max over links of the bytes routed through the link / its bandwidth.
    latency_s : float
        Max over transfers of the summed hop latencies of its route.
    max_link_bytes : float
        Bytes on the busiest link.
    max_hops : int
        Hops of the longest route.
    board_hops : int
        Board-to-board hops of the route with the most of them.
    """

    seconds: float
    bandwidth_s: float
    latency_s: float
    max_link_bytes: float
    max_hops: int
    board_hops: int



class _Routes:
    """The least recently used route sets of one graph (:meth:`Topology._routed`), bounded in
    count and in their arrays' bytes."""

    def __init__(self):
        from collections import OrderedDict

        self.entries: OrderedDict = OrderedDict()
        self.bytes = 0

    def get(self, key):
        found = self.entries.get(key)
        if found is not None:
            self.entries.move_to_end(key)
        return found

    def put(self, key, found) -> None:
        self.entries[key] = found
        self.bytes += sum(a.nbytes for a in found[:3]) + len(key[0]) + len(key[1])
        while len(self.entries) > 1 and (len(self.entries) > ROUTES_KEPT or self.bytes > ROUTE_BYTES_KEPT):
            (src, dst), old = self.entries.popitem(last=False)
            self.bytes -= sum(a.nbytes for a in old[:3]) + len(src) + len(dst)

@dataclass(frozen=True, eq=False)
class Topology:
    """The link graph of one system; build it with :func:`topology_of`.

    Attributes
    ----------
    chips : int
        Chips of the system (ranks ``0 .. chips - 1``).
    nodes : int
        Routers in the graph: ``chips``, or 48 for part of a board (all the board's routers).
    boards : int
        Boards; ``grid`` is their ``(bx, by)`` torus and ``wrap`` whether it wraps (>= 2 boards).
    pos : numpy.ndarray
        ``(nodes, 2)`` lattice coordinates (unwrapped: board origin + place on the board).
    neighbors : numpy.ndarray
        ``(nodes, 6)`` node at the far end of each link direction, -1 where unconnected.
    board_link : numpy.ndarray
        ``(nodes, 6)`` bool: the link leaves its board.
    link_bw : numpy.ndarray
        ``(nodes * 6,)`` bytes/s of each directed link (id ``node * 6 + direction``).
    link_hop_s : numpy.ndarray
        ``(nodes * 6,)`` hop latency of each directed link.
    link_group : numpy.ndarray
        ``(nodes * 6,)`` edge group of each directed board-to-board link (``board * 6 + edge``:
        the serial links its board edge shares), -1 for an on-board link.
    group_bw : numpy.ndarray
        ``(boards * 6,)`` bytes/s of each edge group's serial links together.
    live : numpy.ndarray or None
        ``(nodes,)`` bool: the routers that work and may be used (None: all of them, a healthy
        system). Dead links are -1 in ``neighbors``.
    relay_word_s : float
        Seconds a chip's PE spends on one 32-bit word it relays with its own term added (a chain
        all-reduce's rank: the word read from the receive register, its partial sum loaded and
        added, the result written to the transmit register): ``(2 task_word_cycles +
        m4f_fpu_cycles) / clock_hz`` of the system (:func:`topology_of`); 0 for a graph built
        without a system.
    """

    chips: int
    nodes: int
    boards: int
    grid: tuple[int, int]
    wrap: bool
    pos: np.ndarray
    neighbors: np.ndarray
    board_link: np.ndarray
    link_bw: np.ndarray
    link_hop_s: np.ndarray
    link_group: np.ndarray
    group_bw: np.ndarray
    #: Costs computed on this graph (:mod:`tvm_spinn.timing`: collectives, multicast trees),
    #: keyed by the values they depend on; they live and die with the graph.
    memo: dict = field(default_factory=dict, repr=False, compare=False)
    live: "np.ndarray | None" = field(default=None, repr=False, compare=False)
    relay_word_s: float = 0.0

    @property
    def faulty(self) -> bool:
        """Whether some chip or link of the graph is out (see the module docstring)."""
        return self.live is not None

    def live_chips(self) -> np.ndarray:
        """Ids of the chips that work (all ``0 .. chips - 1`` on a healthy system)."""
        ids = np.arange(self.chips, dtype=np.int64)
        return ids if self.live is None else ids[self.live[:self.chips]]

    # Lookups --------------------------------------------------------------------------------
    def node_at(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Node ids at lattice points.

        Parameters
        ----------
        x, y : array_like of int
            Lattice coordinates (any integers: wrapped on a torus of boards).

        Returns
        -------
        numpy.ndarray
            Node id per point; -1 where a standalone board has no chip.
        """
        x, y = np.asarray(x, dtype=np.int64), np.asarray(y, dtype=np.int64)
        local = _TILE[x % 12, y % 12]
        ox, oy = x - _LAYOUT[local, 0], y - _LAYOUT[local, 1]
        a, b = (2 * ox - oy) // 12, (2 * oy - ox) // 12  # ox = 8a + 4b, oy = 4a + 8b
        if self.wrap:
            bx, by = self.grid
            return (a % bx + bx * (b % by)) * BOARD_CHIPS + local
        return np.where((a == 0) & (b == 0), local, -1)

    def board_of(self, chips: np.ndarray) -> np.ndarray:
        """Board index of each chip.

        Parameters
        ----------
        chips : array_like of int
            Chip (node) ids.

        Returns
        -------
        numpy.ndarray
            ``chips // 48``.
        """
        return np.asarray(chips, dtype=np.int64) // BOARD_CHIPS

    def degree(self) -> np.ndarray:
        """Connected links per node (6 on a torus of boards; fewer on a standalone board's edge)."""
        return (self.neighbors >= 0).sum(axis=1)

    def _check(self, chips: np.ndarray, what: str) -> np.ndarray:
        chips = np.asarray(chips, dtype=np.int64).reshape(-1)
        if chips.size and (chips.min() < 0 or chips.max() >= self.chips):
            raise ArchError(f"{what}: chip ids must be in [0, {self.chips}), got {chips.min()}..{chips.max()}")
        if self.live is not None and chips.size and not self.live[chips].all():
            dead = sorted(set(chips[~self.live[chips]].tolist()))
            raise ArchError(f"{what}: chip(s) {dead[:8]} are dead or outside the allocation")
        return chips

    def link_seconds(self, load: np.ndarray, links: "np.ndarray | None" = None) -> float:
        """Time for the links to carry a load: the busiest directed link or edge group.

        Parameters
        ----------
        load : numpy.ndarray
            ``(nodes * 6,)`` bytes on each directed link.
        links : numpy.ndarray, optional
            Ids of the links that carry bytes (all others carry none), when the caller knows
            them: the cost then grows with the links used, not with the system.

        Returns
        -------
        float
            ``max(max(load / link_bw), max over edge groups of their links' bytes / group_bw)``.
        """
        load = np.asarray(load, dtype=np.float64)
        links = np.flatnonzero(load) if links is None else np.asarray(links, dtype=np.int64)
        if not links.size:
            return 0.0
        used = load[links]
        seconds = float((used / self.link_bw[links]).max())
        groups = self.link_group[links]
        board = groups >= 0
        if board.any():
            grouped = np.bincount(groups[board], weights=used[board], minlength=self.group_bw.size)
            seconds = max(seconds, float((grouped / self.group_bw).max()))
        return seconds

    # The boards' graph (see :func:`board_paths`, :func:`board_graph`) ---------------------
    def board_paths(self, src: int, dst: int) -> tuple[tuple[int, ...], ...]:
        """Edge-disjoint paths of boards from board ``src`` to ``dst`` (:func:`board_paths`)."""
        return board_paths(self, src, dst)

    def path_cost(self, path) -> tuple[float, float]:
        """``(bytes/s, hop latency in seconds)`` of a path of edge groups (:func:`path_cost`)."""
        return path_cost(self, path)

    def edge_rate(self) -> np.ndarray:
        """Bytes/s of each edge group in one direction (:func:`edge_rate`)."""
        return edge_rate(self)

    def board_graph(self) -> "BoardGraph":
        """The graph of boards (:func:`board_graph`)."""
        return board_graph(self)

    # Routing --------------------------------------------------------------------------------
    def displacement(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shortest lattice displacement from each ``src`` to its ``dst``.

        Parameters
        ----------
        src, dst : array_like of int
            Chip ids, one transfer per pair.

        Returns
        -------
        vx, vy : numpy.ndarray
            The displacement the route follows (the smallest torus image; ties to the first
            image in a fixed order, so routes are deterministic).
        """
        src, dst = self._check(src, "src"), self._check(dst, "dst")
        d = self.pos[dst] - self.pos[src]
        if not self.wrap:
            return d[:, 0], d[:, 1]
        bx, by = self.grid
        shifts = np.array(
            [(0, 0), (1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (-1, -1), (1, -1), (-1, 1)], dtype=np.int64
        )
        images = d[:, None, :] + (shifts[:, :1] * bx * _U + shifts[:, 1:] * by * _V)[None, :, :]
        k = np.argmin(_hex_norm(images[..., 0], images[..., 1]), axis=1)  # first minimum: fixed tie-break
        v = images[np.arange(len(d)), k]
        return v[:, 0], v[:, 1]

    def hops(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Hops of the route from each ``src`` to its ``dst`` (a shortest path).

        Parameters
        ----------
        src, dst : array_like of int
            Chip ids, one transfer per pair.

        Returns
        -------
        numpy.ndarray
            Hops per transfer, from the closed form on the triangular lattice (no search).
        """
        if self.live is not None:  # routes around dead links may be longer than the closed form
            transfer, _ = self.route_links(src, dst)
            return np.bincount(transfer, minlength=np.asarray(src).size).astype(np.int64)
        vx, vy = self.displacement(src, dst)
        return _hex_norm(vx, vy)

    def route_links(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Directed links of each route, flattened.

        Parameters
        ----------
        src, dst : array_like of int
            Chip ids, one transfer per pair.

        Returns
        -------
        transfer, link : numpy.ndarray
            For every hop of every route, the transfer's index and the link id
            (``node * 6 + direction``), in hop order per transfer.
        """
        src, dst = self._check(src, "src"), self._check(dst, "dst")
        vx, vy = self.displacement(src, dst)
        ax, ay = np.abs(vx), np.abs(vy)
        # three segments: diagonal (only when the signs agree), then E/W, then N/S
        diag = np.where(vx * vy > 0, np.minimum(ax, ay), 0)
        ends1, ends2 = diag, diag + (ax - diag)
        hops = ends2 + (ay - diag)
        d1 = np.where(vx > 0, _NE, _SW)
        d2 = np.where(vx > 0, _E, _W)
        d3 = np.where(vy > 0, _N, _S)
        cur = src.copy()
        out_t, out_l = [], []
        index = np.arange(len(src))
        blocked = np.zeros(len(src), dtype=bool)
        for step in range(int(hops.max()) if len(hops) else 0):
            act = index[(step < hops) & ~blocked]
            direction = np.where(step < ends1[act], d1[act], np.where(step < ends2[act], d2[act], d3[act]))
            out_t.append(act)
            out_l.append(cur[act] * 6 + direction)
            nxt = self.neighbors[cur[act], direction]
            if self.live is not None:  # a dead link on the way: that transfer takes a detour
                cut = nxt < 0
                blocked[act[cut]] = True
                nxt = np.where(cut, cur[act], nxt)
            cur[act] = nxt
        if blocked.any():
            keep = [~blocked[t] for t in out_t]
            out_t = [t[k] for t, k in zip(out_t, keep)]
            out_l = [link[k] for link, k in zip(out_l, keep)]
            for t in np.flatnonzero(blocked):
                links = self._detour(int(src[t]), int(dst[t]))
                out_t.append(np.full(links.size, t, dtype=np.int64))
                out_l.append(links)
                cur[t] = dst[t]
        if not np.array_equal(cur, dst):  # an invariant of the wiring, not an input error
            raise AssertionError("a route left the link graph")
        if not out_t:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(out_t), np.concatenate(out_l)

    def _detour(self, src: int, dst: int) -> np.ndarray:
        """Link ids of a shortest path from ``src`` to ``dst`` on the live links (a breadth-first
        tree from ``src`` over the live graph in link order), the trees memoized per source."""
        from scipy.sparse import csr_matrix
        from scipy.sparse.csgraph import breadth_first_order

        if ("live_graph",) not in self.memo:
            flat = self.neighbors.reshape(-1)
            ok = flat >= 0
            rows = np.repeat(np.arange(self.nodes), 6)[ok]
            self.memo[("live_graph",)] = csr_matrix((np.ones(rows.size), (rows, flat[ok])),
                                                    shape=(self.nodes, self.nodes))
        key = ("detour_tree", src)
        if key not in self.memo:
            trees = [k for k in self.memo if k[0] == "detour_tree"]
            for old in trees[:max(0, len(trees) - DETOUR_TREES + 1)]:  # bounded: oldest go first
                del self.memo[old]
            _, pred = breadth_first_order(self.memo[("live_graph",)], src, directed=True, return_predecessors=True)
            self.memo[key] = pred
        pred = self.memo[key]
        path = []
        node = dst
        while node != src:
            p = int(pred[node])
            if p < 0:
                raise ArchError(f"no live route from chip {src} to chip {dst}: the faults cut them apart")
            path.append(p * 6 + int(np.flatnonzero(self.neighbors[p] == node)[0]))
            node = p
        return np.array(path[::-1], dtype=np.int64)

    def route(self, src: int, dst: int) -> list[tuple[int, str]]:
        """The route of one transfer as ``(node, direction name)`` hops (for reports and tests)."""
        _, links = self.route_links([src], [dst])
        return [(int(link // 6), DIRECTION_NAMES[int(link % 6)]) for link in links]

    def evaluate(self, src: np.ndarray, dst: np.ndarray,
                 nbytes: "float | np.ndarray") -> tuple[TransferCost, np.ndarray]:
        """Cost of a set of concurrent transfers and the bytes it puts on every link.

        Parameters
        ----------
        src, dst : array_like of int
            Chip ids, one transfer per pair (``src == dst`` moves nothing over links).
        nbytes : float or array_like of float
            Bytes of each transfer (one value for all).

        Returns
        -------
        cost : TransferCost
        load : numpy.ndarray
            ``(nodes * 6,)`` bytes routed through each directed link.
        """
        src, dst = self._check(src, "src"), self._check(dst, "dst")
        if src.shape != dst.shape:
            raise ArchError(f"src and dst differ in length: {src.size} vs {dst.size}")
        nbytes = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), src.shape)
        transfer, links, used, latency_s, max_hops, board_hops = self._routed(src, dst)
        load = np.bincount(links, weights=nbytes[transfer], minlength=self.nodes * 6)
        if not links.size:
            return TransferCost(0.0, 0.0, 0.0, 0.0, 0, 0), load
        bandwidth_s = self.link_seconds(load, used)
        cost = TransferCost(
            seconds=bandwidth_s + latency_s, bandwidth_s=bandwidth_s, latency_s=latency_s,
            max_link_bytes=float(load.max()), max_hops=max_hops, board_hops=board_hops,
        )
        return cost, load

    def _routed(self, src: np.ndarray, dst: np.ndarray) -> tuple:
        """What :meth:`evaluate` takes from the transfers' routes alone, whatever their bytes:
        ``(transfer, link, used links, deepest route's latency, most hops, most board hops)``.
        Memoized on the graph per ``(src, dst)`` (the collectives of a plan route the same rank
        sets at many sizes), at most :data:`ROUTES_KEPT` entries and :data:`ROUTE_BYTES_KEPT`
        bytes of arrays, the least recently used dropped first."""
        key = (src.tobytes(), dst.tobytes())
        routes = self.memo.get(("routes",))
        if routes is None:
            routes = self.memo[("routes",)] = _Routes()
        hit = routes.get(key)
        if hit is not None:
            return hit
        transfer, links = self.route_links(src, dst)
        if links.size:
            latency = np.bincount(transfer, weights=self.link_hop_s[links], minlength=src.size)
            board_hops = np.bincount(transfer, weights=self.board_link.reshape(-1)[links], minlength=src.size)
            found = (transfer, links, np.unique(links), float(latency.max()), int(np.bincount(transfer).max()),
                     int(board_hops.max()))
        else:
            found = (transfer, links, links, 0.0, 0, 0)
        for array in found[:3]:
            array.flags.writeable = False  # shared by every later call with these routes
        routes.put(key, found)
        return found

    def transfer_cost(self, src: np.ndarray, dst: np.ndarray, nbytes: "float | np.ndarray") -> TransferCost:
        """Time of a set of concurrent transfers, contention on shared links included.

        Parameters
        ----------
        src, dst : array_like of int
            Chip ids, one transfer per pair.
        nbytes : float or array_like of float
            Bytes of each transfer (one value for all).

        Returns
        -------
        TransferCost
            See :meth:`evaluate`, which also returns the per-link bytes.
        """
        return self.evaluate(src, dst, nbytes)[0]


#: Board translations across the six edges of a board's hexagon (the edge groups' order).
_EDGES = ((1, 0), (0, 1), (-1, 1), (-1, 0), (0, -1), (1, -1))


def _build(chips: int, link_bw: float, board_bw: float, group_bw: float, hop_s: float,
           board_hop_s: float, faults: tuple = ((), (), (), (), ()), relay_word_s: float = 0.0) -> Topology:
    boards = max(1, chips // BOARD_CHIPS)
    grid = board_grid(boards)
    wrap = boards > 1
    nodes = max(chips, BOARD_CHIPS)
    ids = np.arange(nodes, dtype=np.int64)
    board, local = ids // BOARD_CHIPS, ids % BOARD_CHIPS
    a, b = board % grid[0], board // grid[0]
    pos = _LAYOUT[local] + a[:, None] * _U + b[:, None] * _V
    topo = Topology(
        chips=chips, nodes=nodes, boards=boards, grid=grid, wrap=wrap, pos=pos,
        neighbors=np.empty((nodes, 6), np.int64), board_link=np.empty((nodes, 6), bool),
        link_bw=np.empty(nodes * 6), link_hop_s=np.empty(nodes * 6),
        link_group=np.full(nodes * 6, -1, np.int64), group_bw=np.full(boards * 6, float(group_bw)),
        relay_word_s=float(relay_word_s),
    )
    far = pos[:, None, :] + DIRECTIONS[None, :, :]
    topo.neighbors[:] = topo.node_at(far[..., 0], far[..., 1])
    # a link leaves the board when its far end is outside this chip's own hexagon (so a board
    # wrapped onto itself still uses its board-to-board links)
    lx, ly = _LAYOUT[local][:, None, 0] + DIRECTIONS[None, :, 0], _LAYOUT[local][:, None, 1] + DIRECTIONS[None, :, 1]
    inside = (lx >= 0) & (lx < 8) & (ly >= 0) & (ly < 8)
    inside[inside] = _IN_HEXAGON[lx[inside], ly[inside]]
    topo.board_link[:] = ~inside
    topo.link_bw[:] = np.where(topo.board_link, board_bw, link_bw).reshape(-1)
    topo.link_hop_s[:] = np.where(topo.board_link, board_hop_s, hop_s).reshape(-1)
    # the edge a board link crosses: the board translation a U + b V of the hexagon its far end
    # lies in (the tile table gives the far point's place on its board, hence that board's origin)
    fx, fy = lx[topo.board_link], ly[topo.board_link]
    there = _TILE[fx % 12, fy % 12]
    ox, oy = fx - _LAYOUT[there, 0], fy - _LAYOUT[there, 1]
    edge_of = {t: e for e, t in enumerate(_EDGES)}
    edge = np.array([edge_of[(int(a), int(b))] for a, b in zip((2 * ox - oy) // 12, (2 * oy - ox) // 12)],
                    dtype=np.int64)
    node_of_link = np.nonzero(topo.board_link)[0]
    topo.link_group.reshape(nodes, 6)[topo.board_link] = board[node_of_link] * 6 + edge
    if any(faults):
        object.__setattr__(topo, "live", _take_out(topo, *faults))
    for array in (topo.pos, topo.neighbors, topo.board_link, topo.link_bw, topo.link_hop_s, topo.link_group,
                  topo.group_bw) + ((topo.live,) if topo.live is not None else ()):
        array.flags.writeable = False  # shared through the cache
    return topo


def _take_out(topo: Topology, dead_chips, dead_links, dead_board_links, dead_boards, allocated) -> np.ndarray:
    """Take the faults out of ``topo``'s links (``neighbors`` -1 both ways) and return its live
    routers; refuses a dead link that leads nowhere and live chips cut apart."""
    nodes, nb = topo.nodes, topo.neighbors
    board = np.arange(nodes) // BOARD_CHIPS
    live = np.ones(nodes, dtype=bool)
    live[list(dead_chips)] = False
    live[np.isin(board, list(dead_boards))] = False
    if allocated:
        live[~np.isin(board, list(allocated))] = False
    dead = np.zeros((nodes, 6), dtype=bool)
    for chip, direction in dead_links:
        if nb[chip, direction] < 0:
            raise ArchError(f"SpinnArch.dead_links: chip {chip}'s link {direction} ({DIRECTION_NAMES[direction]}) "
                            f"leads nowhere on this system")
        dead[chip, direction] = True
    for b, e in dead_board_links:
        dead.reshape(-1)[topo.link_group == b * 6 + e] = True
    # both ways: the link arriving over a dead one's wire
    src, d = np.nonzero(dead)
    dead[nb[src, d], (d + 3) % 6] = True
    connected = nb >= 0
    dead |= connected & (~live[:, None] | ~live[np.where(connected, nb, 0)])
    nb[dead] = -1
    # every live chip must reach every other one over live links
    chips = np.flatnonzero(live[:topo.chips])
    rows = np.repeat(np.arange(nodes), 6)[nb.reshape(-1) >= 0]
    cols = nb.reshape(-1)[nb.reshape(-1) >= 0]
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    _, label = connected_components(coo_matrix((np.ones(rows.size), (rows, cols)), shape=(nodes, nodes)),
                                    directed=False)
    parts = np.unique(label[chips])
    if parts.size > 1:
        cut = chips[label[chips] != label[chips[0]]]
        raise ArchError(
            f"SpinnArch.dead_links / dead_board_links / dead_chips / dead_boards / allocated_boards cut the live "
            f"chips into {parts.size} parts: chip {int(cut[0])} cannot reach chip {int(chips[0])}")
    return live


# A pure memo (the graph is a function of these numbers; its own memo holds only values derived
# from it): state-free in effect.
@functools.lru_cache(maxsize=8)
def _cached(chips: int, link_bw: float, board_bw: float, group_bw: float, hop_s: float,
            board_hop_s: float, faults: tuple = ((), (), (), (), ()), relay_word_s: float = 0.0) -> Topology:
    return _build(chips, link_bw, board_bw, group_bw, hop_s, board_hop_s, faults, relay_word_s)


def topology_of(arch: SpinnArch) -> Topology:
    """The link graph of a system (cached per distinct set of topology numbers).

    Parameters
    ----------
    arch : SpinnArch
        The system; reads ``chips``, ``chips_per_board``, ``links_per_chip``, the links'
        payload rates (:meth:`~SpinnArch.payload_bw`), ``link_hop_s`` and ``board_link_hop_s``,
        and for :attr:`Topology.relay_word_s` ``task_word_cycles``, ``m4f_fpu_cycles`` and
        ``clock_hz``.

    Returns
    -------
    Topology

    Raises
    ------
    ArchError
        If the board is not the 48-chip, 6-link layout this wiring describes, a dead link leads
        nowhere, or the faults cut the live chips apart (naming the field).
    """
    if arch.chips_per_board != BOARD_CHIPS:
        raise ArchError(
            f"SpinnArch.chips_per_board must be {BOARD_CHIPS} for the link graph (the SpiNN-5 "
            f"board layout), got {arch.chips_per_board}"
        )
    if arch.links_per_chip != 6:
        raise ArchError(f"SpinnArch.links_per_chip must be 6 for the link graph, got {arch.links_per_chip}")
    numbers = (arch.chips, float(arch.payload_bw("chip")), float(arch.payload_bw("board_chip")),
               float(arch.payload_bw("board_pair")), float(arch.link_hop_s), float(arch.board_link_hop_s))
    relay = (2 * float(arch.task_word_cycles) + float(arch.m4f_fpu_cycles)) / float(arch.clock_hz)
    if arch.has_faults:
        return _cached(*numbers, tuple(getattr(arch, name) for name in FAULT_FIELDS), relay)
    return _cached(*numbers, relay_word_s=relay)


def _adjacent(topo: Topology, a: int, b: int) -> bool:
    return bool((topo.neighbors[a] == b).any())


def _is_cycle(topo: Topology, order: list) -> bool:
    return len(order) > 2 and all(_adjacent(topo, order[i], order[(i + 1) % len(order)]) for i in range(len(order)))


def _comb(topo: Topology, chips: np.ndarray) -> list:
    """A cycle through ``chips`` on the lattice rows: the first chip of every row above the
    first is kept for the way back; the rest is walked row by row, left to right and back
    (a boustrophedon), and the walk returns down the kept chips. Valid when every step is a
    link, which :func:`ring_order` checks (it holds for a whole board)."""
    pos = topo.pos[chips]
    rows = {}
    for c, (x, y) in zip(chips.tolist(), pos.tolist()):
        rows.setdefault(y, []).append((x, c))
    ys = sorted(rows)
    line = [[c for _, c in sorted(rows[y])] for y in ys]
    back = [row[0] for row in line[1:]]
    walk = list(line[0])
    for k, row in enumerate(line[1:]):
        rest = row[1:]
        walk += rest[::-1] if k % 2 == 0 else rest
    return walk + back[::-1]


def _search(topo: Topology, chips: np.ndarray, budget: int = 50000) -> list | None:
    """A cycle through ``chips`` by depth-first search (fewest onward links first), or None."""
    members = set(chips.tolist())
    adj = {c: sorted(int(v) for v in topo.neighbors[c] if v in members and v != c) for c in members}
    start = int(chips[0])
    path, seen, steps = [start], {start}, [0]

    def extend() -> bool:
        steps[0] += 1
        if steps[0] > budget:
            return False
        u = path[-1]
        if len(path) == len(members):
            return start in adj[u]
        for v in sorted((w for w in adj[u] if w not in seen), key=lambda w: (sum(x not in seen for x in adj[w]), w)):
            seen.add(v)
            path.append(v)
            if extend():
                return True
            seen.discard(v)
            path.pop()
        return False

    import sys
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * len(members) + 100))
    try:
        return list(path) if extend() else None
    finally:
        sys.setrecursionlimit(limit)


def _ring(topo: Topology, count: int) -> tuple:
    """A cycle through chips ``0 .. count - 1`` (memoized on ``topo``)."""
    key = ("ring", count)
    if key not in topo.memo:
        topo.memo[key] = _find_ring(topo, count)
    return topo.memo[key]


def _find_ring(topo: Topology, count: int) -> tuple:
    chips = np.arange(count, dtype=np.int64) if topo.live is None else topo.live_chips()[:count]
    if count <= 2:
        return tuple(chips.tolist())
    for order in (_comb(topo, chips), _search(topo, chips)):
        if order is not None and sorted(order) == chips.tolist() and _is_cycle(topo, order):
            return tuple(int(c) for c in order)
    return tuple(chips.tolist())


def ring_order(topo: Topology, count: int) -> np.ndarray:
    """Chips ``0 .. count - 1`` (a tensor-parallel group on one board) in the order of a cycle
    of one-hop links when one exists (a whole board has one), else in id order (which is a
    path of one-hop links on a board: the layout numbers its chips row by row, alternating
    direction). On a system with faults: the first ``count`` live chips instead.

    A ring collective over the group sends each step to the neighbours in this order, so each
    step crosses one link; the chain all-reduce follows the same order (a path). The ranks'
    logical order (which chip holds which block) is a mapping choice, free for the compiler.

    Parameters
    ----------
    topo : Topology
    count : int
        Chips in the group (at most ``topo.chips``).

    Returns
    -------
    numpy.ndarray
        ``count`` distinct chip ids.
    """
    count = int(count)
    usable = topo.chips if topo.live is None else int(topo.live[:topo.chips].sum())
    if count < 1 or count > usable:
        raise ValueError(f"count must be in [1, {usable}] (the live chips), got {count}")
    return np.asarray(_ring(topo, count), dtype=np.int64)


# ---------------------------------------------------------------------------------- the boards' graph
def board_edges(topo: Topology) -> np.ndarray:
    """The board across each edge of every board (the graph of boards).

    Parameters
    ----------
    topo : Topology

    Returns
    -------
    numpy.ndarray
        ``(boards, 6)`` int64: the board at the far end of edge group ``board * 6 + edge`` (its
        chip links all end on one board), -1 where the edge has no links (a standalone board).
    """
    key = ("board_edges",)
    if key not in topo.memo:
        out = np.full(topo.boards * 6, -1, dtype=np.int64)
        links = np.flatnonzero(topo.link_group >= 0)
        far = topo.neighbors.reshape(-1)[links] // BOARD_CHIPS
        out[topo.link_group[links]] = far
        out.flags.writeable = False
        topo.memo[key] = out.reshape(topo.boards, 6)
    return topo.memo[key]


def edge_rate(topo: Topology) -> np.ndarray:
    """Payload bytes/s each edge group carries in one direction: its serial links together, or
    its chip links' own rates summed where those are slower (``(boards * 6,)``, 0 without links)."""
    key = ("edge_rate",)
    if key not in topo.memo:
        links = np.flatnonzero(topo.link_group >= 0)
        lanes = np.bincount(topo.link_group[links], weights=topo.link_bw[links], minlength=topo.boards * 6)
        rate = np.minimum(topo.group_bw, lanes)
        rate.flags.writeable = False
        topo.memo[key] = rate
    return topo.memo[key]


@functools.lru_cache(maxsize=1)
def crossing_hops() -> np.ndarray:
    """On-board hops from the chips of one board edge to those of another (``(6, 6)`` int64):
    the fewest over the pairs of the two edges' chips, 0 on the diagonal. A packet crossing a
    board from the edge it came in by to the edge it leaves by takes at least these hops (the
    same on every board: boards are translations of one hexagon)."""
    topo = _build(BOARD_CHIPS * 4, 1.0, 1.0, 1.0, 1.0, 1.0)  # a 2 x 2 torus: every edge of board 0 has links
    chips = []
    for edge in range(6):
        links = np.flatnonzero(topo.link_group == edge)
        chips.append(np.unique(links // 6))
    out = np.zeros((6, 6), dtype=np.int64)
    for a in range(6):
        for b in range(6):
            if a != b:
                d = topo.pos[chips[b]][None, :, :] - topo.pos[chips[a]][:, None, :]
                out[a, b] = int(_hex_norm(d[..., 0], d[..., 1]).min())
    out.flags.writeable = False
    return out


def board_paths(topo: Topology, src: int, dst: int) -> tuple[tuple[int, ...], ...]:
    """Edge-disjoint paths of boards from board ``src`` to board ``dst``, as many as exist.

    A maximum flow of one unit per directed board edge (Edmonds-Karp: shortest augmenting paths
    on the residual graph, ties to the lower edge id), decomposed into paths. No two paths use
    the same directed edge group, so transfers along them do not share a serial link.

    Parameters
    ----------
    topo : Topology
    src, dst : int
        Distinct boards.

    Returns
    -------
    tuple of tuple of int
        Each path's edge groups (``board * 6 + edge``) in order, shortest first.
    """
    boards = topo.boards
    for name, b in (("src", src), ("dst", dst)):
        if not 0 <= int(b) < boards:
            raise ArchError(f"board_paths: {name} must be a board in [0, {boards}), got {b!r}")
    if src == dst:
        raise ArchError(f"board_paths: src and dst are the same board ({src})")
    if topo.faulty:  # faults break the symmetry below: search from src itself
        key = ("board_paths_faulty", int(src), int(dst))
        if key not in topo.memo:
            topo.memo[key] = _board_paths_from_origin(topo, int(dst), int(src))
        return topo.memo[key]
    # the torus of boards is the same seen from every board: paths are found from board 0 to
    # the displacement and moved back (one search per displacement, not per pair)
    bx, by = topo.grid
    dx, dy = (int(dst) % bx - int(src) % bx) % bx, (int(dst) // bx - int(src) // bx) % by
    key = ("board_paths", dx, dy)
    if key not in topo.memo:
        topo.memo[key] = _board_paths_from_origin(topo, dx + bx * dy)
    sx, sy = int(src) % bx, int(src) // bx

    def moved(e: int) -> int:
        b, k = divmod(e, 6)
        return (((b % bx) + sx) % bx + bx * (((b // bx) + sy) % by)) * 6 + k

    return tuple(tuple(moved(e) for e in path) for path in topo.memo[key])


def _board_paths_from_origin(topo: Topology, dst: int, src: int = 0) -> tuple[tuple[int, ...], ...]:
    """:func:`board_paths` from board ``src`` (0 unless the graph has faults) to ``dst``."""
    boards = topo.boards
    far = board_edges(topo).reshape(-1)
    usable = (far >= 0) & (edge_rate(topo) > 0)
    flow = np.zeros(boards * 6, dtype=np.int64)  # 1 where a unit goes along the edge group
    into: dict = {}
    for e in np.flatnonzero(usable):
        into.setdefault(int(far[e]), []).append(int(e))
    while True:
        # BFS on the residual graph: forward along a free edge, backward against a used one
        prev = {int(src): None}
        frontier = [int(src)]
        while frontier and dst not in prev:
            nxt = []
            for u in frontier:
                steps = [(int(far[u * 6 + k]), u * 6 + k, 1) for k in range(6)
                         if usable[u * 6 + k] and not flow[u * 6 + k]]
                steps += [(e // 6, e, -1) for e in into.get(u, ()) if flow[e]]
                for v, e, sign in steps:
                    if v not in prev:
                        prev[v] = (u, e, sign)
                        nxt.append(v)
            frontier = nxt
        if dst not in prev:
            break
        v = int(dst)
        while prev[v] is not None:
            u, e, sign = prev[v]
            flow[e] += sign
            v = u
    paths = []
    used = flow.copy()
    for e0 in range(int(src) * 6, int(src) * 6 + 6):
        if not used[e0]:
            continue
        path, e = [e0], e0
        used[e0] = 0
        while far[e] != dst:
            here = int(far[e])
            e = next(x for x in range(here * 6, here * 6 + 6) if used[x])
            used[e] = 0
            path.append(e)
        paths.append(tuple(path))
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


@dataclass(frozen=True, eq=False)
class BoardGraph:
    """The graph of boards as a link graph of its own: one node per board, one directed link
    per board edge (its edge group), for the collectives that treat a board as one rank
    (:func:`tvm_spinn.timing.collectives.board_group_all_reduce`). Only what those read:
    ``neighbors``, ``link_bw``, ``link_hop_s``, ``board_link``, ``nodes``, ``memo`` and
    :meth:`link_seconds`; build it with :func:`board_graph`.

    A link's rate is its edge group's (:func:`edge_rate`); its hop latency is a board-to-board
    hop plus the most on-board hops any crossing of a board between two of its edges takes
    (:func:`crossing_hops`): a route through a board enters by one edge and leaves by another,
    and which two the per-link latency cannot know, so it charges the longest crossing."""

    nodes: int
    neighbors: np.ndarray
    link_bw: np.ndarray
    link_hop_s: np.ndarray
    board_link: np.ndarray
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def link_seconds(self, load: np.ndarray, links: "np.ndarray | None" = None) -> float:
        """The busiest board edge's time: ``max(load / link_bw)``."""
        load = np.asarray(load, dtype=np.float64)
        used = np.flatnonzero(load) if links is None else np.asarray(links, dtype=np.int64)
        return float((load[used] / self.link_bw[used]).max()) if used.size else 0.0


def board_graph(topo: Topology) -> BoardGraph:
    """The :class:`BoardGraph` of a system's link graph (memoized on it)."""
    key = ("board_graph",)
    if key not in topo.memo:
        far = board_edges(topo)
        rate = edge_rate(topo)
        board_hop = float(topo.link_hop_s[topo.link_group >= 0].max()) if (topo.link_group >= 0).any() else 0.0
        chip_hop = float(topo.link_hop_s[topo.link_group < 0].max())
        hop = np.full(topo.boards * 6, board_hop + int(crossing_hops().max()) * chip_hop)
        topo.memo[key] = BoardGraph(nodes=topo.boards, neighbors=far, link_bw=np.where(rate > 0, rate, np.inf),
                                    link_hop_s=hop, board_link=np.ones((topo.boards, 6), dtype=bool))
    return topo.memo[key]


@functools.lru_cache(maxsize=1)
def edge_reach_hops() -> np.ndarray:
    """On-board hops from the farthest chip of a board to the nearest chip of each of its edges
    (``(6,)`` int64): what a share held anywhere on the board travels to leave by that edge."""
    topo = _build(BOARD_CHIPS * 4, 1.0, 1.0, 1.0, 1.0, 1.0)
    out = np.zeros(6, dtype=np.int64)
    everyone = topo.pos[:BOARD_CHIPS]
    for edge in range(6):
        chips = np.unique(np.flatnonzero(topo.link_group == edge) // 6)
        d = topo.pos[chips][None, :, :] - everyone[:, None, :]
        out[edge] = int(_hex_norm(d[..., 0], d[..., 1]).min(axis=1).max())
    out.flags.writeable = False
    return out


def path_cost(topo: Topology, path) -> tuple[float, float]:
    """Rate and latency of one path of boards (edge groups in order, :func:`board_paths`).

    The rate is the slowest of its edges' (:func:`edge_rate`: a board edge's serial links,
    which the chip links on either side outrun). The latency is the share's way from the chips
    of the first board to its first edge (:func:`edge_reach_hops`), each board-to-board hop,
    each board crossed from the edge it came in by to the edge it leaves by
    (:func:`crossing_hops`), and from the last edge to the farthest chip of the last board, at
    the links' hop latencies.

    Returns
    -------
    tuple of float
        ``(bytes per second, seconds)``.
    """
    path = [int(e) for e in path]
    if not path:
        raise ArchError("path_cost: a path needs at least one board edge")
    key = ("edge_hops",)
    if key not in topo.memo:  # each edge group's slowest hop, and an on-board hop (once per graph)
        groups = topo.link_group
        edge_hop = np.zeros(topo.boards * 6)
        np.maximum.at(edge_hop, groups[groups >= 0], topo.link_hop_s[groups >= 0])
        topo.memo[key] = (edge_hop, float(topo.link_hop_s[groups < 0].max()))
    edge_hop, chip_hop = topo.memo[key]
    rate = float(min(edge_rate(topo)[e] for e in path))
    hops = int(edge_reach_hops()[path[0] % 6])
    latency = 0.0
    for k, e in enumerate(path):
        latency += float(edge_hop[e])
        if k:
            hops += int(crossing_hops()[(path[k - 1] % 6 + 3) % 6, e % 6])
    hops += int(edge_reach_hops()[(path[-1] % 6 + 3) % 6])  # from the edge it arrives by to every chip
    return rate, latency + hops * chip_hop
