"""The narrow wires of the all-reduces across boards: what each board sends, and its cost.

A block tensor-parallel over a group of ``g`` boards all-reduces the partial sums of the GEMMs
that end its attention and its MLP (:mod:`tvm_spinn.llm.board_tp`). By default the sums are the
int8 GEMMs' int32 accumulators (``reduce="int32"``): integers, exact in any order, so they are
added wherever they meet, in the trees of
:func:`tvm_spinn.timing.collectives.board_group_all_reduce` (every board a tree passes through,
the boards around the group included, adds what reaches it into its own partial sums and
forwards the sum). A narrow wire (``fp16``, ``bf16``, ``int8``) cannot take those trees: a
board that adds two narrow values and forwards the sum rounds it again, at every hop, and the
result then depends on the trees the planner picked. The narrow wires therefore run one fixed
schedule, whose roundings are the same whatever the topology:

1. **reduce-scatter, direct**: the row (per user, ``hidden`` elements) is cut into ``g`` equal
   shares, share ``b`` owned by the group's board ``b``. Every board dequantizes its int32
   partial sums with the GEMM's scales (fp32) and sends share ``b``, narrowed, straight to
   board ``b``: the routers on the way forward the packets and add nothing
   (:func:`tvm_spinn.timing.collectives.board_all_to_all`, one step, each chip its slice to its
   counterpart chip).
2. **sum, on the owner**: share ``b``'s owner (board ``b``, or a board of the schedule's
   choice, :func:`owner_choices`, a relay that holds no piece among them) widens the ``g``
   narrowed pieces of share ``b`` (its own included where it is a member) to fp32, adds them
   in board order (board 0 first) and narrows the total once.
3. **all-gather, multicast**: each owner multicasts its narrowed share to the group along the
   trees of :func:`tvm_spinn.timing.collectives.board_group_scattered_all_reduce` (its
   all-gather phase alone: copies, no arithmetic, so any tree gives the same bits), the
   on-board all-gather riding on the multicast: every chip receives the whole reduced row.

The schedule's roundings fix *what* is added where (the pieces on their owner, in board order)
and nothing of the routes, so :func:`narrow_all_reduce` prices two ways of running it, the
cheaper taken (the bits are the same):

* **direct**: phase 1 as a board all-to-all on the chips' own routes, then phase 3 along the
  multicast trees, one after the other (each phase's bytes, route latencies and the board's
  gather paid in full);
* **owner trees** (:mod:`tvm_spinn.timing.collectives.narrow`, groups of three boards or more
  whose trees are built): each share's pieces climb trees rooted at its owner over the graph of
  boards (the boards around the group relaying, the routers only forwarding), several trees a
  share weighed to spread the bytes over the board edges, and the reduced share comes back
  down the same trees; or each piece on routes of its own and the reduced share down trees
  weighed with them (the cheaper); pipelined chunk by chunk (an owner multicasts a chunk of its share once
  the chunk's ``g`` pieces are in and added, while the later chunks still climb), so a board
  edge carries both phases' bytes at once.

The element types (:data:`WIRES`, bytes an element in :data:`tvm_spinn.llm.plan.REDUCE_BYTES`):

* ``fp16`` / ``bf16``: round to nearest even, 2 bytes an element.
* ``int8``: the row cut into chunks of :data:`INT8_CHUNK` consecutive elements (a user's row
  of ``hidden`` elements: chunk ``c`` holds elements ``c C .. c C + C - 1``, the last chunk
  the rest), each chunk sent as ``C`` int8 values and one fp32 scale: ``s = max|x| / 127``
  over the chunk, ``q = clip(rint(x / s), -127, 127)`` (ties to even), read back as ``q s``;
  an all-zero chunk is sent with ``s = 0`` and reads back as zeros. ``1 + 4 / C`` bytes an
  element (the scales counted), the owner's sum quantized the same way once, and the reduced
  row travels on as int8 with its scales. A chunk's rounding error is at most ``s / 2`` an
  element, so the sum's error is at most ``(s_0 + .. + s_{g-1} + S) / 2`` (``S`` the total's
  scale) plus fp32's rounding of the ``g - 1`` additions.

:func:`tvm_spinn.llm.accuracy.reduce_rounding` emulates exactly these roundings on a
transformers model. The element-wise work (a chip quantizes its slice of the row, ``hidden /
chips`` elements a board's chip, and the owner's ``g`` widenings and additions of its share's
slice) is spread over the chips' processing elements and not charged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["INT8_CHUNK", "WIRES", "wire_bytes", "NarrowAllReduce", "narrow_all_reduce", "direct_schedule",
           "owner_schedule", "owner_choices"]

#: Elements of one int8 chunk of the wire, each chunk with its own fp32 scale (4 bytes): the
#: scales add ``4 / INT8_CHUNK`` bytes an element
INT8_CHUNK = 64
#: The narrow wires' element types: bytes an element on the board links, the int8 chunks'
#: scales included
WIRES = {"fp16": 2.0, "bf16": 2.0, "int8": 1.0 + 4.0 / INT8_CHUNK}


def wire_bytes(wire: str, elements: int) -> float:
    """Bytes of ``elements`` consecutive elements of a row on the ``wire`` (:data:`WIRES`; an
    int8 row of ``n`` elements carries ``ceil(n / INT8_CHUNK)`` scales, counted here as ``4 /
    INT8_CHUNK`` bytes an element: exact where the chunk divides the row)."""
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {sorted(WIRES)}, got {wire!r}")
    return float(elements) * WIRES[wire]


@dataclass(frozen=True)
class NarrowAllReduce:
    """The cost of one narrow all-reduce across a group of boards (:func:`narrow_all_reduce`):
    ``seconds``, of the cheaper ``schedule`` (``"direct"`` or ``"owner-trees"``, see the module
    docstring); ``scatter_s`` its reduce-scatter alone and ``gather_s`` its all-gather alone
    (``"direct"``: ``seconds`` is their sum; ``"owner-trees"``: at most their sum, the two
    pipelined); ``nbytes`` the row's bytes on the wire (one board's); ``owners``: the board
    that adds each share (``"direct"``: each member its own share, the group's boards in
    order; empty for one board or no bytes, where nothing is added)."""

    seconds: float
    scatter_s: float
    gather_s: float
    nbytes: float
    schedule: str = "direct"
    owners: tuple = ()


def narrow_all_reduce(topo, grid, nbytes: float) -> NarrowAllReduce:
    """Cost of an all-reduce of a row of ``nbytes`` (on the wire: :func:`wire_bytes`) across
    the boards of ``grid`` on the fixed schedule of the module docstring.

    Parameters
    ----------
    topo : tvm_spinn.target.topology.Topology
        The system's link graph.
    grid : sequence of sequence of int
        ``g`` boards by ``k`` chip ids (every chip of each board, in the board's ring order).
    nbytes : float
        Bytes of one board's narrowed row, cut into ``g`` shares of ``nbytes / g``; which shares
        a board sends and receives depends on the owners of the cheaper schedule
        (:attr:`NarrowAllReduce.owners`: a member owning one share sends ``g - 1`` and receives
        ``g - 1`` reduced shares back, a member owning none sends all ``g``).

    Returns
    -------
    NarrowAllReduce
    """
    grid = np.asarray(grid, dtype=np.int64)
    if grid.ndim != 2 or grid.size == 0:
        raise ValueError(f"grid must be boards x chips (a 2-D array of chip ids), got shape {grid.shape}")
    if not np.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
    if grid.shape[0] == 1 or nbytes == 0:
        return NarrowAllReduce(0.0, 0.0, 0.0, float(nbytes))
    best = direct_schedule(topo, grid, float(nbytes))
    trees = owner_schedule(topo, grid, float(nbytes))
    if trees is not None and trees.seconds < best.seconds:
        return trees
    return best


def direct_schedule(topo, grid, nbytes: float) -> NarrowAllReduce:
    """The direct figure of :func:`narrow_all_reduce` (see the module docstring): share ``b`` of
    every board's row straight to the group's board ``b`` (a board all-to-all on the chips' own
    routes, :func:`tvm_spinn.timing.collectives.board_all_to_all`), then the owners' reduced
    shares multicast to the group
    (:func:`tvm_spinn.timing.collectives.board_group_scattered_all_reduce`, its all-gather
    alone), one after the other. Each member owns its own share.

    Parameters
    ----------
    topo : tvm_spinn.target.topology.Topology
        The system's link graph.
    grid : sequence of sequence of int
        ``g >= 2`` boards by ``k`` chip ids (every chip of each board, in the board's ring order).
    nbytes : float
        Bytes of one board's narrowed row (every board sends ``(g - 1) / g`` of it and receives
        ``(g - 1) / g`` of it back reduced).

    Returns
    -------
    NarrowAllReduce
        ``schedule="direct"``; ``seconds`` the sum of ``scatter_s`` and ``gather_s``.
    """
    from ..timing.collectives import board_all_to_all, board_group_scattered_all_reduce
    from ..timing.collectives.boards import _board_rows

    grid, members = _board_rows(topo, grid, "direct_schedule")
    if not np.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"direct_schedule: nbytes must be a finite number >= 0, got {nbytes!r}")
    g = grid.shape[0]
    if g < 2:
        raise ValueError(f"direct_schedule: an all-reduce needs two boards or more, got {g}")
    send = np.full((g, g), float(nbytes) / g)
    np.fill_diagonal(send, 0.0)
    scatter = board_all_to_all(topo, grid, send).seconds
    # the owners' narrowed shares multicast to the group (no reduce phase: nbytes=0)
    gather = board_group_scattered_all_reduce(topo, grid, 0.0, float(nbytes), rounds=0).seconds
    return NarrowAllReduce(scatter + gather, scatter, gather, float(nbytes), "direct",
                           tuple(int(b) for b in members))


def owner_schedule(topo, grid, nbytes: float) -> "NarrowAllReduce | None":
    """The owner trees' figure of :func:`narrow_all_reduce` (see the module docstring): each
    share's pieces up and the reduced share down trees rooted at its owner
    (:func:`tvm_spinn.timing.collectives.narrow.owner_trees`, over the group's boards and the
    boards around it), pipelined, the board's gather of the narrowed row riding on the
    arrivals; the cheapest of :func:`owner_choices`. None where no choice's trees are built (two
    boards, a group and the boards around it of more than
    :data:`tvm_spinn.timing.collectives.MULTICAST_MAX_RANKS`, boards the links do not join)."""
    from ..timing.collectives import MULTICAST_MAX_RANKS, _board_tree_options, _gather_parts
    from ..timing.collectives.boards import _board_rows
    from ..timing.collectives.narrow import owner_tree_cost, owner_trees

    grid, members = _board_rows(topo, grid, "owner_schedule")
    g, k = grid.shape
    if g < 3 or nbytes == 0:
        return None
    graph = topo.board_graph()
    share = float(nbytes) / g
    region = _board_tree_options(graph, members, share)[0]
    if region.size > MULTICAST_MAX_RANKS:
        return None
    board = _gather_parts(topo, grid[0], float(nbytes)) if k > 1 else (0.0, 0.0)
    if board is None:
        return None
    best = None
    for owners in owner_choices(graph, region, g):
        trees = owner_trees(graph, region, g, share, share, board, owners)
        if trees is None:  # not built for these owners: the other choices still stand
            continue
        seconds = owner_tree_cost(graph, trees, share, share, board)
        if best is None or seconds < best.seconds:
            best = NarrowAllReduce(seconds, graph.link_seconds(trees.up * share) + trees.up_s,
                                   max(graph.link_seconds(trees.down * share), board[0]) + trees.down_s + board[1],
                                   float(nbytes), "owner-trees", tuple(int(region[o]) for o in owners))
    return best


def owner_choices(graph, region: np.ndarray, g: int) -> list[tuple[int, ...]]:
    """The owners :func:`owner_schedule` tries for the ``g`` shares of a group (the first ``g``
    boards of ``region``; local node ids of ``region``): each member its own share, and the
    shares dealt in turn, in board order, to the boards of ``region`` nearest the farthest
    member (the least eccentricity over the members, in board hops): a share's pieces then
    climb and come back down fewer hops, its owner taking more pieces; and, where there are
    more such central boards than shares, the shares spread evenly over all of them (the
    relaying boards around the group among them, their board edges otherwise only
    forwarding). The bits are the same: an owner adds the pieces in board order wherever it
    is.

    A relay owner's own movement on its board is priced as a member's: the pieces reach it at
    its edge chips and meet per element range before the add and the multicast, a gather over
    its chips that the schedule's ``board`` term (the members' chip-to-chip gather) stands for.
    The figure assumes a relay owner's chips free to add when the pieces arrive (nothing of
    their own running then, as at batch 1, one token at a time): it does not price a relay
    owner's board sharing its chips with other work."""
    from ..timing.collectives.trees import _breadth_first, _local_links

    nb = _local_links(graph, region)[1]
    dist = _breadth_first(nb, range(g))[0]  # members to every node of the region
    reach = np.where(dist < 0, region.size, dist).max(axis=0)
    central = np.flatnonzero(reach == reach.min())
    choices = [tuple(range(g))]
    dealt = tuple(int(central[s % central.size]) for s in range(g))
    if dealt != choices[0]:
        choices.append(dealt)
    if central.size > g:  # more central boards than shares: one share each, spread over all of them
        spread = tuple(int(central[(s * central.size) // g]) for s in range(g))
        if spread not in choices:
            choices.append(spread)
    return choices
