"""Independent GEMMs sharing a chip's PEs (timing/gemm_overlap.py): each GEMM's tiles cover it
and cost something, one chain alone is its GEMMs one after another, and shared PEs finish
independent GEMMs sooner than in series, never sooner than the work allows."""

import numpy as np
import pytest

from tvm_spinn.target.registry import arch_of
from tvm_spinn.timing.gemm_overlap import GemmTiles, gemm_tiles, shared_pes_seconds

SHAPES = [(8, 768, 192, 1), (8, 192, 768, 1), (768, 8, 192, 1), (256, 8, 768, 1), (8, 64, 132, 12),
          (256, 768, 3072, 1), (1, 4096, 4096, 1), (33, 17, 5, 3)]


@pytest.fixture(scope="module")
def board():
    return arch_of("spinn/board")


@pytest.mark.parametrize("resident", [False, True])
def test_tiles_cover_the_gemm(board, resident):
    """Every GEMM has tiles with a cost, and alone on fewer PEs it takes longer."""
    rng = np.random.default_rng(7)
    shapes = SHAPES + [tuple(int(x) for x in rng.integers(1, 900, 3)) + (int(rng.integers(1, 4)),)
                       for _ in range(12)]
    for m, k, n, b in shapes:
        tiles = gemm_tiles(board, m, k, n, b, resident)
        assert tiles.tiles >= 1 and tiles.tile_s > 0 and tiles.first_s > 0 and tiles.last_s > 0
        assert tiles.alone_s(1) >= tiles.alone_s(board.pes_per_chip), (m, k, n, b)
        assert tiles.alone_s(1) * board.clock_hz >= tiles.tiles * tiles.tile_cycles, (m, k, n, b)


def test_one_chain_alone_is_its_gemms_in_series(board):
    chain = [gemm_tiles(board, *shape) for shape in SHAPES]
    pes = board.pes_per_chip
    assert shared_pes_seconds(board, [chain]) == pytest.approx(sum(g.alone_s(pes) for g in chain), rel=1e-12)
    # a chain and nothing else: two chains of one GEMM each that fill the PEs take both in series
    full = GemmTiles(pes, 10, 0.0, 0.0, 0.0, 1e6)
    assert shared_pes_seconds(board, [[full], [full]]) == pytest.approx(2e-5, rel=1e-12)


def test_half_filled_gemms_share_the_pes(board):
    """Hand-worked schedules on the chip's P PEs (at 10 cycles a second: a tile of 10 cycles is 1 s)."""
    pes = board.pes_per_chip
    assert pes % 4 == 0

    def gemm(tiles, tile_s, first_s=0.0, last_s=0.0):
        return GemmTiles(tiles, round(10 * tile_s), 10 * first_s, 10 * last_s, 0.0, 10.0)

    half = gemm(pes // 2, 1.0, 0.1, 0.2)
    # two independent GEMMs of P/2 tiles: one round together (operands 0.1, the tiles 1.0, the end 0.2)
    assert shared_pes_seconds(board, [[half], [half]]) == pytest.approx(1.3, rel=1e-12)
    # a chain of A (P/2 tiles of 1.0) then C (P tiles of 1.0); a free GEMM of P/2 tiles of 0.5
    # fits A's idle half (two tiles a PE by 1.0): C starts at 1.0 and ends at 2.0 (in series 2.5)
    a, c = gemm(pes // 2, 1.0), gemm(pes, 1.0)
    w = gemm(pes // 2, 0.5)
    assert shared_pes_seconds(board, [[a, c]], [w]) == pytest.approx(2.0, rel=1e-12)
    # a free GEMM that does not fit before the chain ends runs on the PEs as they free up: P/2
    # idle PEs take two tiles of 0.5 by 1.0, the other P/2 tiles one round on every PE: 1.5
    w3 = gemm(3 * pes // 2, 0.5)
    assert shared_pes_seconds(board, [[a]], [w3]) == pytest.approx(1.5, rel=1e-12)


def test_shared_pes_bounds(board):
    """Two chains and free GEMMs of a GPT-2-small block at 8 rows a slot (TP 12): never longer than
    in series, never shorter than either chain alone or the tiles' work over the PEs."""
    pes = board.pes_per_chip
    fwd = [gemm_tiles(board, 8, 768, 192, 1, True), gemm_tiles(board, 8, 64, 132, 12),
           gemm_tiles(board, 8, 132, 64, 12), gemm_tiles(board, 8, 64, 768, 1, True),
           gemm_tiles(board, 8, 768, 256, 1, True), gemm_tiles(board, 8, 256, 768, 1, True)]
    bwd = [gemm_tiles(board, 8, 768, 256, 1, True), gemm_tiles(board, 8, 256, 768, 1, True),
           gemm_tiles(board, 8, 768, 64, 1, True), gemm_tiles(board, 8, 64, 132, 12),
           gemm_tiles(board, 8, 132, 64, 12), gemm_tiles(board, 8, 192, 768, 1, True)]
    wgt = [gemm_tiles(board, 256, 8, 768, 1, True), gemm_tiles(board, 768, 8, 256, 1, True),
           gemm_tiles(board, 64, 8, 768, 1, True), gemm_tiles(board, 768, 8, 192, 1, True)]
    series = sum(g.alone_s(pes) for g in fwd + bwd + wgt)
    shared = shared_pes_seconds(board, [fwd, bwd], wgt)
    work = sum(g.tiles * g.tile_s for g in fwd + bwd + wgt) / pes
    chains = max(sum(g.alone_s(pes) for g in fwd), sum(g.alone_s(pes) for g in bwd))
    assert max(work, chains) <= shared < series
    assert shared == shared_pes_seconds(board, [fwd, bwd], wgt)  # deterministic


def test_leftover_free_tiles_on_unstarted_pes_wait_for_their_operands(board):
    """A free GEMM whose tiles found no idle time before the chain (the chain's one GEMM takes
    every PE from the start) runs after it, and each PE's first tile of it waits for its
    operands: a round of the chain GEMM (operands 100 cycles, tile 1,000, write-back 10), then
    the free GEMM's operands (300), its tile (500) and write-back (20), counted here by hand."""
    pes = board.pes_per_chip
    chain = GemmTiles(pes, 1000, 100.0, 10.0, 0.0, 1.0)
    free = GemmTiles(pes, 500, 300.0, 20.0, 0.0, 1.0)
    assert shared_pes_seconds(board, [[chain]], [free]) == pytest.approx(100 + 1000 + 300 + 500 + 20)
