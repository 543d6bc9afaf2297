"""Where a narrow wire's all-reduce across a group of boards goes, next to its floor.

Costs :func:`tvm_spinn.llm.wire.narrow_all_reduce` as the ``board_tp`` placement does
(:func:`tvm_spinn.llm.board_tp.records`: every layout of ``g`` boards on the torus of boards,
the first group of each, its chips in ring order, ``hidden * bytes an element`` of the wire)
and prints, per layout, both ways the planner prices the schedule of :mod:`tvm_spinn.llm.wire`
(the same roundings):

- **direct**: the reduce-scatter as an all-to-all on the chips' routes (bytes through the
  busiest board edge, its serialisation, the longest route's board hops and latency), then
  the multicast all-gather (its figure), one after the other;
- **owner trees** (:mod:`tvm_spinn.timing.collectives.narrow`: the pieces up their shares'
  trees or up routes of their own, whichever is cheaper): the busiest directed board edge
  with the pieces climbing to the owners, with the reduced shares coming down, and with both
  (pipelined), the deepest member's hops each way, the board's gather riding on the arrivals
  (link time, hops), the pipelined figure and each phase alone;
- the floor of the schedule with the owners the cheaper form used
  (:func:`~tvm_spinn.timing.collectives.narrow.owner_floor`: bytes through the busiest board
  edge any routes allow over the edge rate, plus twice the farthest owner-to-member board hops
  at the cheapest hop latency), plus the board's gather hops and the owners' fp32 work (one
  cycle an addition, the share's elements spread over the owner's processing elements: a
  bound, the widening and loads come on top); and the figure over the floor.

    python bench/narrow_all_reduce.py                 # int8, Llama-2-70B's 8,192-wide row
    python bench/narrow_all_reduce.py --wire fp16
    python bench/narrow_all_reduce.py --group 8 --hidden 5120
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tvm_spinn
from tvm_spinn.llm import board_tp
from tvm_spinn.llm.wire import WIRES, direct_schedule, narrow_all_reduce, owner_schedule, wire_bytes
from tvm_spinn.target import arch_of
from tvm_spinn.timing import collectives as C
from tvm_spinn.timing.collectives import narrow as N


def _direct(topo, grid: np.ndarray, n: float) -> dict:
    """The direct schedule's figure (:func:`~tvm_spinn.llm.wire.direct_schedule`) and, of its
    reduce-scatter on the chips' routes, the busiest board edge's bytes and time and the longest
    route's latency and board hops."""
    g, k = grid.shape
    a, b = np.nonzero(~np.eye(g, dtype=bool))
    src, dst = grid[a].reshape(-1), grid[b].reshape(-1)
    cost, load = topo.evaluate(src, dst, n / g / k)
    board = topo.link_group >= 0
    edge = np.bincount(topo.link_group[board], weights=load[board], minlength=topo.group_bw.size)
    return {"cost": direct_schedule(topo, grid, n), "edge_bytes": float(edge.max()), "bw_s": cost.bandwidth_s,
            "lat_s": cost.latency_s, "board_hops": cost.board_hops}


def rows(arch, g: int, hidden: int, wire: str) -> list[dict]:
    """Per layout of ``g`` boards of ``arch``: the figures printed (see the module docstring)."""
    cpb, _, topo, _, order, _, torus = board_tp.board_setting(arch)
    graph = topo.board_graph()
    n = wire_bytes(wire, hidden)
    share = n / g
    hop = float(graph.link_hop_s[np.isfinite(graph.link_hop_s)].min())
    out = []
    for i, lay in enumerate(board_tp.group_layouts(torus, g, range(topo.boards), compact=True)):
        grid = np.array([[int(c) + b * cpb for c in order] for b in lay[0]], dtype=np.int64)
        start = time.process_time()
        cost = narrow_all_reduce(topo, grid, n)
        cpu = time.process_time() - start
        row = {"layout": i, "boards": list(lay[0]), "cost": cost, "cpu_s": cpu, "direct": _direct(topo, grid, n)}
        trees = owner_schedule(topo, grid, n)
        members = np.asarray(lay[0])
        owners = members
        if trees is not None:
            region = C._board_tree_options(graph, members, share)[0]
            board = C._gather_parts(topo, grid[0], n)
            local = [int(np.flatnonzero(region == o)[0]) for o in trees.owners]
            t = N.owner_trees(graph, region, g, share, share, board, tuple(local))
            row["trees"] = {"cost": trees, "up_s": graph.link_seconds(t.up * share),
                            "down_s": graph.link_seconds(t.down * share),
                            "both_s": graph.link_seconds((t.up + t.down) * share),
                            "up_bytes": float((t.up * share).max()), "both_bytes": float(((t.up + t.down) * share).max()),
                            "up_lat": t.up_s, "down_lat": t.down_s, "hops": t.hops, "board": board}
            if cost.schedule == "owner-trees":
                owners = np.asarray(trees.owners)
        bw, lat = N.owner_floor(graph, members, share, share, owners)
        on_board = C._gather_parts(topo, grid[0], n)[1]
        owned = int(np.bincount(owners).max())
        work = np.ceil(owned * hidden / g / (cpb * arch.pes_per_chip)) * (g - 1) / arch.clock_hz
        row["floor"] = {"bw_s": bw, "lat_s": lat, "hops": int(round(lat / hop)), "board_s": on_board, "work_s": work,
                        "total_s": bw + lat + on_board + work}
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wire", default="int8", choices=sorted(WIRES), help="the narrow wire")
    parser.add_argument("--hidden", type=int, default=8192, help="the row's width in elements")
    parser.add_argument("--group", type=int, default=None,
                        help="boards in a group on every system (default: 16 on boards24, 8 on the cloud)")
    args = parser.parse_args()
    if args.group is not None and args.group < 2:
        parser.error(f"--group must be at least 2, got {args.group}")
    if args.hidden < 1:
        parser.error(f"--hidden must be at least 1, got {args.hidden}")
    systems = (("boards24", tvm_spinn.make_system("spinn2-boards24", boards=24), args.group or 16),
               ("cloud", arch_of("spinn/cloud"), args.group or 8))
    us = 1e6
    for name, arch, g in systems:
        n = wire_bytes(args.wire, args.hidden)
        print(f"{name}: {args.wire} row of {args.hidden} elements ({n:.0f} bytes a board, share {n / g:.0f}) over {g} "
              f"boards")
        for r in rows(arch, g, args.hidden, args.wire):
            d, f, c = r["direct"], r["floor"], r["cost"]
            print(f"  layout {r['layout']} boards {r['boards']}: {c.seconds * us:.1f} us {c.schedule} "
                  f"(cpu {r['cpu_s']:.1f} s)")
            print(f"    direct       {d['cost'].seconds * us:6.1f} us = reduce-scatter {d['cost'].scatter_s * us:.1f} "
                  f"(busiest board edge {d['edge_bytes']:.0f} B {d['bw_s'] * us:.1f} + {d['board_hops']} board hops "
                  f"{d['lat_s'] * us:.1f}); then all-gather {d['cost'].gather_s * us:.1f}")
            if "trees" in r:
                t = r["trees"]
                print(f"    owner trees  {t['cost'].seconds * us:6.1f} us = busiest edge with both phases "
                      f"{t['both_bytes']:.0f} B {max(t['both_s'], t['board'][0]) * us:.1f} (pieces up alone "
                      f"{t['up_s'] * us:.1f}, shares down alone {t['down_s'] * us:.1f}) + up {t['up_lat'] * us:.1f} "
                      f"+ down {t['down_lat'] * us:.1f} ({t['hops']} board hops each way) + board gather hops "
                      f"{t['board'][1] * us:.1f}; phases alone {t['cost'].scatter_s * us:.1f} + "
                      f"{t['cost'].gather_s * us:.1f}; owners {list(t['cost'].owners)}")
            print(f"    floor        {f['total_s'] * us:6.1f} us = busiest edge {f['bw_s'] * us:.1f} + {f['hops']} board "
                  f"hops {f['lat_s'] * us:.1f} + board gather hops {f['board_s'] * us:.1f} + owners' fp32 work "
                  f"{f['work_s'] * us:.2f}; figure / floor {c.seconds / f['total_s']:.2f}")


if __name__ == "__main__":
    main()
