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
  (:func:`~tvm_spinn.timing.collectives._rooted_shapes`: each tree's part reduced up to its root
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
        packed, C._packed_trees = C._packed_trees, lambda *args: None
        try:
            without = C.board_group_all_reduce(topo, grid, n, board_gather=True, pipelined=True, fuse_gather=True)
            unpiped_without = C.board_group_all_reduce(topo, grid, n, board_gather=True, fuse_gather=True)
        finally:
            C._packed_trees = packed
        bandwidth, latency = C.board_group_floor(topo, lay[0], n)
        on_board = C._gather_parts(topo, np.asarray(grid[0]), n)[1]
        members_only = 2 * (g - 1) / g * n / (6 * rate)
        scattered = C.board_group_scattered_all_reduce(topo, grid, n, hidden, 1, hidden // LAYER_NORM_BLOCK * 4)
        out.append((len(out), with_packed, without, bandwidth, latency, on_board, members_only, seconds, scattered,
                    unpiped, unpiped_without))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=8192, help="the row's width (int32 sums: 4 bytes each)")
    parser.add_argument("--group", type=int, default=None,
                        help="boards in a group on every system (default: 16 on boards24, 32 on the cloud)")
    args = parser.parse_args()
    if args.group is not None and args.group < 2:
        parser.error(f"--group must be at least 2, got {args.group}")
    systems = (("boards24", tvm_spinn.make_system("spinn2-boards24", boards=24), args.group or 16),
               ("cloud", arch_of("spinn/cloud"), args.group or 32))
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
