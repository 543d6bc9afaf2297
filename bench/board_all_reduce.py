"""The board group's int32 all-reduce of a tensor-parallel LLM block, side by side with its floor.

Costs :func:`tvm_spinn.timing.collectives.board_group_all_reduce` exactly as the ``board_tp``
placement does (:func:`tvm_spinn.llm.board_tp.records`: every layout of ``g`` boards on the
torus of boards, the first group of each, its chips in ring order, ``hidden * 4`` bytes,
pipelined, the on-board gather fused into the multicast) and prints, per layout:

- the figure with every schedule the model offers (packed trees included);
- the figure without the packed trees (one multicast tree per board's share, the ring);
- the floor: :func:`~tvm_spinn.timing.collectives.board_group_floor` (cuts of the boards into
  parts each holding a board of the group, plus the board hops between the farthest boards of
  the group) plus the on-board gather's hop latencies; and the members-only bandwidth bound
  ``2 (g - 1) / g`` of the row into each board over its six edges, which holds only where the
  group's own boards do every addition (the packed trees let the boards around them add too);
- the ratios: without / with, and with / floor;
- unpipelined (the reduce, then the multicast): with the packed trees each rooted
  (:func:`~tvm_spinn.timing.collectives.packing._rooted_shapes`: each tree's part reduced up to its root
  and multicast back down) and without them (one multicast tree per board's share);
- the same exact sums as a reduce-scatter, one exchange of a norm's block sums (4 bytes every
  :data:`~tvm_spinn.program.ops.rows.LAYER_NORM_BLOCK` elements) and an all-gather of the row
  quantized to int8 (:func:`~tvm_spinn.timing.collectives.board_group_scattered_all_reduce`, the
  same tree candidates as the all-reduce): the form whose all-gather carries a quarter of the
  bytes, its phases one after another; and the pipelined figure over it (above 1: the
  scattered form is the faster).

    python bench/board_all_reduce.py              # Llama-2-70B's 8,192-wide row: 16 of boards24, 32 of the cloud
    python bench/board_all_reduce.py --hidden 5120
    python bench/board_all_reduce.py --group 8    # groups of 8 boards on both systems
    python bench/board_all_reduce.py --breakdown  # where the cheapest layout's figure goes

``--breakdown`` splits the cheapest layout's figure (where its trees of every span carry the
row together, :func:`~tvm_spinn.timing.collectives._priority_packing`) into the busiest board
edge's serialisation, the shortest span between members along the trees used (the last parts'
hop latencies), what playing the schedule out adds to that closed form, and the on-board
multicast's hop latencies (its link time runs under the board edges'); and prints the bound
the closed form of every set of trees is held to: no tree joins the group's boards with a
shorter span than twice the least radius of the group over the graph of boards (a board, or
an edge, within ``r`` hops of every member), and the closed form is at least the busiest
edge's time with all the bytes plus the shortest span used, so at least the floor's bandwidth
plus that span plus the on-board hops (a bound on the closed form: a schedule played out is
held to the floor).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tvm_spinn
from tvm_spinn.llm import board_tp
from tvm_spinn.program.ops.rows import LAYER_NORM_BLOCK
from tvm_spinn.target import arch_of
from tvm_spinn.timing import collectives as C


def _figures(arch, g: int, hidden: int) -> list[tuple]:
    cpb, _, topo, _, order, _, torus = board_tp.board_setting(arch)
    graph = topo.board_graph()
    rate = float(graph.link_bw[np.isfinite(graph.link_bw)].min())
    n = hidden * 4
    out = []
    for lay in board_tp.group_layouts(torus, g, range(topo.boards), compact=True):
        grid = [[int(c) + b * cpb for c in order] for b in lay[0]]
        start = time.perf_counter()
        with_packed = C.board_group_all_reduce(topo, grid, n, board_gather=True, pipelined=True, fuse_gather=True)
        seconds = time.perf_counter() - start
        unpiped = C.board_group_all_reduce(topo, grid, n, board_gather=True, fuse_gather=True)
        # the packed trees off where every caller looks them up (their module)
        packed, C.packing._packed_trees = C.packing._packed_trees, lambda *args: None
        try:
            without = C.board_group_all_reduce(topo, grid, n, board_gather=True, pipelined=True, fuse_gather=True)
            unpiped_without = C.board_group_all_reduce(topo, grid, n, board_gather=True, fuse_gather=True)
        finally:
            C.packing._packed_trees = packed
        bandwidth, latency = C.board_group_floor(topo, lay[0], n)
        on_board = C._gather_parts(topo, np.asarray(grid[0]), n)[1]
        members_only = 2 * (g - 1) / g * n / (6 * rate)
        scattered = C.board_group_scattered_all_reduce(topo, grid, n, hidden, 1, hidden // LAYER_NORM_BLOCK * 4)
        out.append((len(out), with_packed, without, bandwidth, latency, on_board, members_only, seconds, scattered,
                    unpiped, unpiped_without))
    return out


def _breakdown(arch, g: int, hidden: int) -> None:
    cpb, _, topo, _, order, _, torus = board_tp.board_setting(arch)
    graph = topo.board_graph()
    n = float(hidden * 4)
    lays = board_tp.group_layouts(torus, g, range(topo.boards), compact=True)
    grids = [[[int(c) + b * cpb for c in order] for b in lay[0]] for lay in lays]
    costs = [C.board_group_all_reduce(topo, grid, n, board_gather=True, pipelined=True, fuse_gather=True)
             for grid in grids]
    k = int(np.argmin([c.seconds for c in costs]))
    members = np.asarray(lays[k][0])
    region, _ = C._board_tree_options(graph, members, n / g)
    on_board = C._gather_parts(topo, np.asarray(grids[k][0]), n)
    bandwidth, latency = C.board_group_floor(topo, members, n)
    # the least radius of the group: a root board, or a root edge, within r hops of every member
    nb = C._local_links(graph, region)[1]
    dist = C._breadth_first(nb, range(region.size))[0]
    dist[dist < 0] = region.size
    u, d = np.nonzero(nb >= 0)
    node_r = int(dist[:, :g].max(axis=1).min())
    edge_r = int(np.minimum(dist[u, :g], dist[nb[u, d], :g]).max(axis=1).min())
    span_hops = min(2 * node_r, 2 * edge_r + 1)
    hop = float(graph.link_hop_s[np.isfinite(graph.link_hop_s)].min())
    print(f"  layout {k} ({g} boards, {region.size - g} around them relaying): {costs[k].seconds * 1e6:.1f} us "
          f"{costs[k].algorithm}")
    packing = C._priority_packing(graph, region, g, n)
    if packing is not None:
        played, load, first, hops, weight = packing
        full, span = graph.memo[("packed_shapes", region.tobytes(), g)][:2]
        closed = C._priority_seconds(graph, full, span, weight, n)  # these weights' closed form
        busiest = graph.link_seconds(load * n)
        print(f"    busiest board edge's serialisation {busiest * 1e6:.1f} us ({float(load.max()) * n / 1e3:.1f} KB at "
              f"{float(graph.link_bw[np.isfinite(graph.link_bw)].min()) / 1e6:.0f} MB/s), shortest span of the trees "
              f"used {first * 1e6:.1f} us, closed form {closed * 1e6:.1f} us, played out {played * 1e6:.1f} us")
    print(f"    on-board multicast: link time {on_board[0] * 1e6:.1f} us (under the board edges'), hops "
          f"{on_board[1] * 1e6:.1f} us")
    print(f"    floor {(bandwidth + latency + on_board[1]) * 1e6:.1f} us = cut bandwidth {bandwidth * 1e6:.1f} + "
          f"{latency / hop:.0f} board hops {latency * 1e6:.1f} + on-board hops {on_board[1] * 1e6:.1f}; "
          f"the closed form of any trees: span >= {span_hops} hops ({span_hops * hop * 1e6:.1f} us), at least "
          f"{(bandwidth + span_hops * hop + on_board[1]) * 1e6:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=8192, help="the row's width (int32 sums: 4 bytes each)")
    parser.add_argument("--group", type=int, default=None,
                        help="boards in a group on every system (default: 16 on boards24, 32 on the cloud)")
    parser.add_argument("--breakdown", action="store_true",
                        help="split the cheapest layout's figure into serialisation, spans and hops")
    args = parser.parse_args()
    if args.group is not None and args.group < 2:
        parser.error(f"--group must be at least 2, got {args.group}")
    systems = (("boards24", tvm_spinn.make_system("spinn2-boards24", boards=24), args.group or 16),
               ("cloud", arch_of("spinn/cloud"), args.group or 32))
    if args.breakdown:
        for name, arch, g in systems:
            print(name)
            _breakdown(arch, g, args.hidden)
        return
    print(f"{'system':9} {'g':>3} {'layout':>6} {'with us':>8} {'algorithm':>16} {'without us':>10} {'floor us':>9} "
          f"{'(cut bw + hops + board)':>24} {'members-only bw':>15} {'without/with':>12} {'with/floor':>10} {'s':>5}"
          f" {'int8-gather us':>14} {'with/int8':>9} {'unpiped us':>10} {'unpiped w/o':>11}")
    for name, arch, g in systems:
        for (lay, with_packed, without, bandwidth, latency, on_board, members_only, seconds, scattered, unpiped,
             unpiped_without) in _figures(arch, g, args.hidden):
            floor = bandwidth + latency + on_board
            parts = f"{bandwidth * 1e6:.1f} + {latency * 1e6:.1f} + {on_board * 1e6:.1f}"
            print(f"{name:9} {g:>3} {lay:>6} {with_packed.seconds * 1e6:8.1f} {with_packed.algorithm:>16} "
                  f"{without.seconds * 1e6:10.1f} {floor * 1e6:9.1f} {parts:>24} {members_only * 1e6:15.1f} "
                  f"{without.seconds / with_packed.seconds:12.2f} {with_packed.seconds / floor:10.2f} {seconds:5.1f} "
                  f"{scattered.seconds * 1e6:14.1f} {with_packed.seconds / scattered.seconds:9.2f} "
                  f"{unpiped.seconds * 1e6:10.1f} {unpiped_without.seconds * 1e6:11.1f}")


if __name__ == "__main__":
    main()
