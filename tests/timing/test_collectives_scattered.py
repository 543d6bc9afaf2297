"""The board group's all-reduce as a reduce-scatter, exchanges of the row's statistics and an
all-gather of the row narrowed (:func:`tvm_spinn.timing.collectives.board_group_scattered_all_reduce`)."""

from __future__ import annotations

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.target.topology import ring_order, topology_of
from tvm_spinn.timing import collectives as C

N = 32768.0  # an 8,192-wide row of int32 partial sums
GROUPS = [[0, 1, 4, 5], [0, 2, 9], [0, 5, 14], [0, 1, 2, 3, 7, 6, 5, 4], [0, 1, 4, 5, 8, 9, 12, 13]]


@pytest.fixture(scope="module")
def boards24():
    arch = tvm_spinn.make_system("spinn2-24-boards-scattered", boards=24)  # a 4 x 6 torus of boards
    topo = topology_of(arch)
    order = [int(c) for c in ring_order(topology_of(arch.replace(chips=48)), 48)]
    return topo, order


def _grid(order, boards):
    return [[c + b * 48 for c in order] for b in boards]


@pytest.mark.parametrize("boards", [[0, 1]] + GROUPS)
def test_the_whole_row_without_exchanges_is_the_unpipelined_all_reduce(boards24, boards, monkeypatch):
    """Gathering the row unnarrowed with no exchange, on the tree sets the all-reduce prices, is
    the all-reduce whose multicast starts after the reduce: the same figure, bit for bit. The
    unpipelined all-reduce also takes the packed trees rooted at the boards around the group,
    so it is never dearer than that; the pipelined all-reduce, both phases on every edge at
    once, is never dearer than either."""
    topo, order = boards24
    grid = _grid(order, boards)
    want = C.board_group_all_reduce(topo, grid, N, pipelined=False, fuse_gather=True)
    assert want.algorithm in ("board-multicast", "board-multipath", "board-packed")  # not the ring fallback
    scattered = C.board_group_scattered_all_reduce(topo, grid, N, N, 0)
    assert want.seconds <= scattered.seconds
    assert C.board_group_all_reduce(topo, grid, N, pipelined=True, fuse_gather=True).seconds <= want.seconds
    monkeypatch.setattr(C.packing, "_packed_trees", lambda *args: None)
    plain = C.board_group_all_reduce(topo, grid, N, pipelined=False, fuse_gather=True)
    assert plain.algorithm in ("board-multicast", "board-multipath")
    assert C.board_group_scattered_all_reduce(topo, grid, N, N, 0).seconds == plain.seconds


def test_two_boards_send_each_phase_as_halves_over_every_path(boards24):
    """One chip a board (no on-board gather): each phase is the two boards sending each other
    half of its bytes over every edge-disjoint path, both ways at once."""
    topo, _ = boards24
    n, narrow, stats = N, N / 4, 1024.0

    def halves(nbytes):
        return max(C.multipath_point_to_point(topo, 0, 1, nbytes / 2).seconds,
                   C.multipath_point_to_point(topo, 1, 0, nbytes / 2).seconds)

    for rounds in (0, 1, 2):
        cost = C.board_group_scattered_all_reduce(topo, [[0], [48]], n, narrow, rounds, stats)
        assert cost.algorithm == "board-scattered-multipath"
        assert cost.seconds == pytest.approx(halves(n) + rounds * halves(stats) + halves(narrow), rel=1e-12)


@pytest.mark.parametrize("boards", GROUPS)
def test_each_round_costs_one_exchange_and_narrowing_never_costs_more(boards24, boards):
    topo, order = boards24
    grid = _grid(order, boards)
    costs = [C.board_group_scattered_all_reduce(topo, grid, N, N / 4, rounds, 1024.0) for rounds in (0, 1, 2, 3)]
    steps = np.diff([c.seconds for c in costs])
    assert steps[0] > 0
    assert steps == pytest.approx(np.full(3, steps[0]), rel=1e-9)
    # an exchange of no statistics is no exchange
    assert C.board_group_scattered_all_reduce(topo, grid, N, N / 4, 2, 0.0).seconds == costs[0].seconds
    assert costs[0].seconds < C.board_group_scattered_all_reduce(topo, grid, N, N, 0).seconds


@pytest.mark.parametrize("boards", GROUPS)
def test_never_below_the_cut_floor_of_its_two_phases(boards24, boards):
    """The reduce-scatter moves at least half the all-reduce's copies of the partial sums across
    every cut (:func:`~tvm_spinn.timing.collectives.board_group_floor`), the all-gather half its
    copies of the narrowed row, one after the other; each board's result depends on the farthest
    member's partial sums."""
    topo, order = boards24
    grid = _grid(order, boards)
    reduce_bw, latency = C.board_group_floor(topo, boards, N)
    gather_bw, _ = C.board_group_floor(topo, boards, N / 4)
    cost = C.board_group_scattered_all_reduce(topo, grid, N, N / 4, 0)
    assert cost.seconds >= reduce_bw / 2 + gather_bw / 2 + latency


def test_the_packed_trees_are_taken_where_cheaper_and_only_then(boards24, monkeypatch):
    topo, order = boards24
    figures = {}
    for boards in GROUPS:
        figures[tuple(boards)] = C.board_group_scattered_all_reduce(topo, _grid(order, boards), N, N / 4, 1, 1024.0)
    monkeypatch.setattr(C.packing, "_packed_trees", lambda *args: None)
    packed = 0
    for boards in GROUPS:
        without = C.board_group_scattered_all_reduce(topo, _grid(order, boards), N, N / 4, 1, 1024.0)
        with_packed = figures[tuple(boards)]
        assert with_packed.seconds <= without.seconds
        assert without.algorithm == "board-scattered"
        if with_packed.algorithm == "board-scattered-packed":
            packed += 1
            assert with_packed.seconds < without.seconds
        else:
            assert with_packed.seconds == without.seconds
    assert packed > 0


def test_phases_without_bytes_cost_nothing(boards24):
    topo, order = boards24
    grid = _grid(order, [0, 1, 4, 5])
    assert C.board_group_scattered_all_reduce(topo, grid, 0.0, 0.0, 3, 0.0).seconds == 0.0
    # the narrowed row's all-gather alone, with nothing to reduce, is still paid
    gather_only = C.board_group_scattered_all_reduce(topo, grid, 0.0, N / 4, 0)
    assert 0.0 < gather_only.seconds < C.board_group_scattered_all_reduce(topo, grid, N, N / 4, 0).seconds


def test_bad_input_is_refused_naming_it(boards24):
    topo, order = boards24
    grid = _grid(order, [0, 1, 4, 5])
    f = C.board_group_scattered_all_reduce
    with pytest.raises(ValueError, match="gather_bytes"):
        f(topo, grid, N, -1.0)
    with pytest.raises(TypeError, match="nbytes"):
        f(topo, grid, "32768", 8192.0)
    with pytest.raises(ValueError, match="stat_bytes"):
        f(topo, grid, N, 8192.0, 1, float("nan"))
    with pytest.raises(ValueError, match="rounds"):
        f(topo, grid, N, 8192.0, rounds=1.5)
    with pytest.raises(ValueError, match="one board"):
        f(topo, [grid[0], grid[0]], N, 8192.0)
    with pytest.raises(ValueError, match="boards x chips"):
        f(topo, [grid[0], grid[1][:3]], N, 8192.0)  # ragged
    assert f(topo, grid[:1], N, 8192.0).seconds == 0.0


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
