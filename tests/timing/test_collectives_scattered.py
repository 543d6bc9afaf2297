"""The board group's all-reduce as a reduce-scatter, exchanges of the row's statistics and an
all-gather of the row narrowed (:func:`tvm_spinn.timing.collectives.board_group_scattered_all_reduce`)."""

from __future__ import annotations

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.target.topology import ring_order, topology_of
from tvm_spinn.timing import collectives as C


@pytest.fixture(scope="module")
def boards24():
    arch = tvm_spinn.make_system("spinn2-24-boards-scattered", boards=24)  # a 4 x 6 torus of boards
    topo = topology_of(arch)
    order = [int(c) for c in ring_order(topology_of(arch.replace(chips=48)), 48)]
    return topo, order


def _grid(order, boards):
    return [[c + b * 48 for c in order] for b in boards]


def test_two_boards_compose_their_halves_over_every_path(boards24):
    topo, order = boards24
    grid = _grid(order, [0, 1])
    n, narrow, stats = 32768.0, 8192.0, 1024.0

    def halves(nbytes):  # each board sends the other half of it, both directions at once
        return max(C.multipath_point_to_point(topo, 0, 1, nbytes / 2).seconds,
                   C.multipath_point_to_point(topo, 1, 0, nbytes / 2).seconds)

    bw, deep = C._gather_parts(topo, np.asarray(grid[0]), narrow)
    on_board = C._gather_parts(topo, np.asarray(grid[0]), 1.0)[1]
    for rounds in (0, 1, 2):
        cost = C.board_group_scattered_all_reduce(topo, grid, n, narrow, rounds, stats)
        want = halves(n) + rounds * (halves(stats) + on_board) + max(halves(narrow), bw) + deep
        assert cost.algorithm == "board-scattered-multipath"
        assert cost.seconds == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("boards", [[0, 1, 4, 5], [0, 1, 2, 3, 7, 6, 5, 4], [0, 1, 4, 5, 8, 9, 12, 13]])
def test_group_figures_stay_above_the_members_bytes_and_grow_by_an_exchange_a_round(boards24, boards):
    topo, order = boards24
    grid = _grid(order, boards)
    g, n, narrow, stats = len(boards), 32768.0, 8192.0, 1024.0
    graph = topo.board_graph()
    edge = float(graph.link_bw[np.isfinite(graph.link_bw)].max())
    # every member sends its partial sums of the g - 1 shares rooted elsewhere (no board can
    # add them for it) and takes in the g - 1 narrowed shares, over its six edges, in phases
    floor = (g - 1) / g * (n + narrow) / (6 * edge)
    costs = [C.board_group_scattered_all_reduce(topo, grid, n, narrow, rounds, stats) for rounds in (0, 1, 2)]
    assert floor < costs[0].seconds
    # each round: the statistics' all-gather on the members' multicast trees, then the board's
    # deepest on-board route (the same whichever trees carry the row)
    shares, latency = C._multicast_trees(graph, np.asarray(boards, dtype=np.int64))[:2]
    exchange = graph.link_seconds(shares * stats / g) + latency + C._gather_parts(topo, np.asarray(grid[0]), 1.0)[1]
    assert costs[1].seconds - costs[0].seconds == pytest.approx(exchange, rel=1e-9)
    assert costs[2].seconds - costs[1].seconds == pytest.approx(exchange, rel=1e-9)
    # a narrower all-gather is never dearer
    wider = C.board_group_scattered_all_reduce(topo, grid, n, n, 0, stats)
    assert costs[0].seconds <= wider.seconds


def test_bad_input_is_refused_naming_it(boards24):
    topo, order = boards24
    grid = _grid(order, [0, 1, 4, 5])
    with pytest.raises(ValueError, match="gather_bytes"):
        C.board_group_scattered_all_reduce(topo, grid, 32768.0, -1.0)
    with pytest.raises(ValueError, match="rounds"):
        C.board_group_scattered_all_reduce(topo, grid, 32768.0, 8192.0, rounds=1.5)
    with pytest.raises(ValueError, match="one board"):
        C.board_group_scattered_all_reduce(topo, [grid[0], grid[0]], 32768.0, 8192.0)
    assert C.board_group_scattered_all_reduce(topo, grid[:1], 32768.0, 8192.0).seconds == 0.0


def test_a_norm_from_exchanged_block_sums_keeps_the_kernels_bits():
    """What one exchange carries for an RMS norm: each root's block sums (4 bytes every
    :data:`~tvm_spinn.program.ops.rows.LAYER_NORM_BLOCK` elements of its share), added on every
    root in the row's fixed order, give the norm the C++ kernel computes on the whole row bit for
    bit; the shares' own totals, added across the roots, do not."""
    from tvm_spinn.program.ops.rows import LAYER_NORM_BLOCK, _rms_norm

    rng = np.random.default_rng(7)
    d, eps, boards = 8192, np.float32(1e-5), 8
    differ = 0
    for _ in range(8):
        x = (rng.standard_normal(d) * np.exp(rng.uniform(-4, 4, d))).astype(np.float32)
        w = rng.standard_normal(d).astype(np.float32)
        want = _rms_norm(x[None], eps, w)[0]
        shares = np.split(x, boards)  # each root's share: whole blocks
        blocks = np.concatenate([np.add.accumulate((s * s).reshape(-1, LAYER_NORM_BLOCK), axis=1,
                                                   dtype=np.float32)[:, -1] for s in shares])
        q = np.add.accumulate(blocks, dtype=np.float32)[-1]  # every root: the block sums left to right
        r = np.float32(1) / np.sqrt(np.float32(np.float32(q / np.float32(d)) + eps))
        got = np.concatenate([w[i * (d // boards):(i + 1) * (d // boards)] * (s * r) for i, s in enumerate(shares)])
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        totals = np.add.accumulate(blocks.reshape(boards, -1), axis=1, dtype=np.float32)[:, -1]
        differ += np.add.accumulate(totals, dtype=np.float32)[-1] != q
    assert differ > 0
