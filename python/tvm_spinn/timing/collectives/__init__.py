"""Collectives costed on the link graph: all-reduce, all-gather, reduce-scatter, all-to-all, point-to-point.

Every collective is a sequence of *steps*; a step is a set of concurrent transfers costed by
:meth:`tvm_spinn.target.topology.Topology.evaluate` (routes on the graph, bytes summed per link,
``max bytes / bandwidth + longest route's hop latencies``). A collective's time is the sum of its
steps: the model does not overlap one step with the next (each needs the data of the last).

Every function takes the system's link graph, a
:class:`tvm_spinn.target.topology.Topology` (``topology_of(arch)``).

Algorithms over ``c`` ranks (chip ids in the order given, rank ``i`` = ``ranks[i]``):

Every rate is the links' payload rate (a link's bit rate less its packets' headers and routing
keys), and the chip links through one board edge share that edge's serial links
(:meth:`~tvm_spinn.target.topology.Topology.link_seconds`).

- **ring** (bidirectional): half of the data goes around the ring one way and half the other,
  so each step sends ``n / (2c)`` bytes to each ring neighbour. All-reduce is a reduce-scatter
  and an all-gather: ``2 (c - 1)`` steps; all-gather and reduce-scatter ``c - 1`` steps.
- **tree** (binomial over rank indices): reduce to rank 0 in ``ceil(log2 c)`` steps (step ``k``:
  rank ``i + 2^k`` sends to ``i`` for ``i`` a multiple of ``2^(k+1)``), broadcast back in the
  reverse order. Gather and scatter use the same pairs with the subtree's share of the bytes.
  The reduce follows :func:`reduction_order` over the ranks, which is what makes a tree
  all-reduce bitwise reproducible (see there).
- **multicast** (all-gather only): every rank's share goes out as one packet stream that the
  routers copy onto several links (SpiNNaker's multicast routing, as in :func:`chain_all_reduce`)
  along a shortest-path tree of the ranks' own links; the ``c`` streams run at once, one step
  costing ``max link bytes / bandwidth + the deepest route's hop latencies``. The trees are
  chosen to spread the bytes over *all* the links between ranks, not the two of a ring: each
  rank takes, per source, the incoming link from a neighbour one hop closer that carries the
  fewest bytes so far (three greedy passes). A rank then receives ``n (c - 1) / c`` over up to
  6 links instead of 2: on a board ~0.65 of the ring's time, within ~3% of the bound of the
  rank with the fewest links (a hexagon corner has 3). Built for groups of at most
  :data:`MULTICAST_MAX_RANKS` ranks whose links connect them (otherwise not a candidate).

- **multicast reduce** (reduce-scatter, all-reduce of integer partial sums): the multicast
  trees run backwards. Share ``s`` is reduced towards rank ``s`` along the reverse of the tree
  that multicasts it, every rank adding its children's sums into its own before passing it up,
  all ``c`` reductions at once: one step whose link loads are the all-gather's with every link
  reversed. An all-reduce is that reduce-scatter and then the multicast all-gather: two steps
  of ``max link bytes / bandwidth + the deepest route's hop latencies``, so a small all-reduce
  on a board costs about two board diameters of hops rather than the ring's ``2 (c - 1)`` hop
  latencies or the tree's ``2 ceil(log2 c)`` full-message steps. The additions follow the
  trees, so floating-point sums do not take it (their bits must not depend on the plan:
  :func:`chain_all_reduce`).

- **packed trees** (:func:`board_group_all_reduce`, pipelined, integer sums): the row is cut
  into parts, each reduced and spread along a tree of its own that spans the group's boards
  and may pass through the boards around them. Every tree node adds what reaches it from all
  but one of its tree neighbours into its own partial sums and passes the sum to that
  neighbour, both ways along every tree edge at once, so each tree edge carries the part once
  in each direction and a member's sum is complete once the partial sums of the farthest
  member have arrived: the tree's span between members, not twice its depth from a root.
  The trees are packed by multiplicative weights (each the cheapest tree under link costs that
  grow with the parts the earlier ones put on a link) and the parts re-weighed to lighten the
  busiest edge; :func:`board_group_floor` bounds what any such schedule can reach.
  The trees of every span may also share the row at once, the longer trees' parts due first
  (:func:`_priority_packing`): the short trees fill the edges' time after the long ones have
  gone, so a few long trees spread the bytes while the last parts take the short ways; that
  schedule is costed by playing it out chunk by chunk on the graph of boards
  (:func:`_chunked_schedule`) where that is dearer than its closed form. Unpipelined, the
  same trees run rooted (:func:`_rooted_shapes`): each part reduced up to its tree's root,
  then multicast back down.

``algorithm="auto"`` costs ring, tree and multicast and returns the cheapest (ring on a tie).
On the links that matter, for ``n`` bytes, link bandwidth ``B`` and hop latency ``a``, two chips one
hop apart give ring all-reduce ``n / B + 2a`` and tree ``2n / B + 2a``: the tree pays the full
message per step, the ring ``n / c`` but ``2 (c - 1)`` latencies, so tiny messages go by tree.

The package's modules, each with one job (none imports this ``__init__``, which re-exports
the public names):

- :mod:`.cost`: :class:`CollectiveCost`, the checks every collective makes, the memo's bounds;
- :mod:`.steps`: the ring, tree and pairwise algorithms as steps, and their cost on the graph;
- :mod:`.trees`: the multicast trees (shortest-path, spread, negotiated);
- :mod:`.chips`: the collectives over a group of chips;
- :mod:`.order`: the fixed reduction order of the bit-exact all-reduce;
- :mod:`.boards`: the collectives between whole boards;
- :mod:`.packing`: the packed trees over the graph of boards and their parts of the row;
- :mod:`.schedule`: the event simulation that plays a packed-tree schedule out;
- :mod:`.priority`: the packed trees of every span sharing the row;
- :mod:`.floor`: the floor of a board-group all-reduce;
- :mod:`.group`: the board-group all-reduce's search over tree sets;
- :mod:`.overlap`: an all-reduce streamed chunk by chunk between its producer and its consumer;
- :mod:`.narrow`: the owner trees of an all-reduce whose sums are added on their owners only
  (the narrow wires of :mod:`tvm_spinn.llm.wire`), and their floor.
"""

from __future__ import annotations

# No import of tvm_spinn.target here nor in the modules: timing sits on program only
# (tests/test_layering.py), and importing the target package loads TVM. Callers pass a Topology
# built by tvm_spinn.target.topology.topology_of; only its documented methods are used.

from . import cost as _cost
from .boards import (board_all_reduce, board_all_to_all, multipath_point_to_point, multipath_sliced_hand_over,
                     sliced_hand_over, water_fill)
from .chips import (all_gather, all_reduce, all_to_all, chain_all_reduce, chain_all_reduce_gathered,
                    chains_all_reduce, point_to_point, reduce_scatter)
from .cost import CollectiveCost
from .floor import board_group_floor
from .group import board_group_all_reduce, board_group_scattered_all_reduce
from .overlap import streamed_all_reduce
from .order import chip_blocks, fixed_order_sum, reduction_order

# Internals read under these names by the training planner (``_steps``, ``_evaluate``), the tests and
# bench/board_all_reduce.py. A name replaced here reaches no module that calls it, so the packed
# trees, which the tests and the bench switch off, are left out: they are replaced (and read) in
# their own module, ``packing._packed_trees`` and ``packing._rooted_shapes``, and replacing them
# here fails as a missing name rather than doing nothing.
from .chips import _gather_parts  # noqa: F401
from .group import _SPLIT_PARTS, _SPLIT_TREES, _board_tree_options  # noqa: F401
from .priority import _priority_fluid, _priority_packing, _priority_seconds  # noqa: F401
from .schedule import _SCHEDULE_CHUNKS, _chunked_schedule, _played_schedule  # noqa: F401
from .steps import _evaluate, _steps  # noqa: F401
from .trees import _breadth_first, _local_links, _multicast_trees, _negotiated_trees, _spread_trees  # noqa: F401

#: Largest group the multicast collectives are built for; larger groups gather by ring or tree
#: (why: its definition in :mod:`.cost`). Bound here too so that the API reference lists it with
#: the other public names (it documents a module's own assignments, not its imports).
MULTICAST_MAX_RANKS = _cost.MULTICAST_MAX_RANKS

__all__ = [
    "CollectiveCost", "all_gather", "all_reduce", "chain_all_reduce", "chain_all_reduce_gathered", "chains_all_reduce",
    "fixed_order_sum",
    "point_to_point", "reduce_scatter", "reduction_order", "chip_blocks", "MULTICAST_MAX_RANKS", "board_all_reduce",
    "board_group_all_reduce", "multipath_point_to_point", "multipath_sliced_hand_over", "sliced_hand_over", "water_fill",
    "all_to_all",
    "board_all_to_all", "board_group_floor", "board_group_scattered_all_reduce", "streamed_all_reduce",
]
