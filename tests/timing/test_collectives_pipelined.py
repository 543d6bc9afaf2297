"""The board group's all-reduce pipelined (reduce and multicast overlap) and with the on-board
all-gather riding on its multicast."""

from __future__ import annotations

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.target.topology import ring_order, topology_of
from tvm_spinn.timing import collectives as C


@pytest.fixture(scope="module")
def boards24():
    arch = tvm_spinn.make_system("spinn2-24-boards-pipelined", boards=24)  # a 4 x 6 torus of boards
    return arch, topology_of(arch)


def test_board_group_all_reduce_overlaps_its_phases_and_fuses_the_board_gather(boards24):
    arch, topo = boards24
    order = [int(c) for c in ring_order(topology_of(arch.replace(chips=48)), 48)]
    group = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    grid = [[c + b * 48 for c in order] for b in group]
    n = 32768.0
    plain = C.board_group_all_reduce(topo, grid, n, board_gather=False)
    piped = C.board_group_all_reduce(topo, grid, n, board_gather=False, pipelined=True)
    # the reduce and the multicast share the edges' two directions: never dearer (here the
    # trees load the same edges both ways: no cheaper), and never below the floor of every
    # board taking in (g - 1) / g of the vector each phase over its six edges
    g = len(group)
    graph = topo.board_graph()
    edge = float(graph.link_bw[np.isfinite(graph.link_bw)].max())
    floor = 2 * (g - 1) / g * n / (6 * edge)
    assert floor < piped.seconds <= plain.seconds
    # the on-board all-gather after it, or riding on its multicast
    gather = C.all_gather(topo, grid[0], n)
    after = C.board_group_all_reduce(topo, grid, n, pipelined=True)
    fused = C.board_group_all_reduce(topo, grid, n, pipelined=True, fuse_gather=True)
    assert after.seconds == pytest.approx(piped.seconds + gather.seconds)
    bw, lat = C._gather_parts(topo, np.asarray(grid[0]), n)
    assert bw + lat == pytest.approx(gather.seconds)
    # the board's gather streams behind the board edges (its links are the faster): only its
    # hop latencies are added
    assert bw < piped.seconds
    assert fused.seconds == pytest.approx(piped.seconds + lat)
    # without board_gather, fuse_gather changes nothing; the default is unchanged
    assert C.board_group_all_reduce(topo, grid, n, board_gather=False, fuse_gather=True) == plain
    assert C.board_group_all_reduce(topo, grid, n) == C.board_group_all_reduce(topo, grid, n, pipelined=False)
