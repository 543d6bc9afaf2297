"""fp32 GEMMs of fewer rows than the MAC array: row tiles of the M4F's register block.

A pipeline slot of a few tokens (8 rows) through a tensor-parallel shard of GPT-2 small's fused
QKV projection (768 -> 192): with MAC-high row tiles (16) the chooser can only spread the
outputs as narrow column tiles, each computed in ``4 x 1`` blocks; with register-block-high row
tiles (4) it takes ``4 x 4`` blocks, four outputs a reduction step. The compiled layer is faster
and its outputs keep their bits (every output sums its reduction on one PE, ascending k).
"""

from __future__ import annotations

import numpy as np

import tvm_spinn
from tvm_spinn.mapping import MappingOptions
from tvm_spinn.mapping.schedule import _map
from tvm_spinn.mapping.tiling import layer_work
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.program.ops.gemm import GemmShape, choose_gemm_tile, geometry
from tvm_spinn.program.ops.gemm.geometry import M4F_BLOCK, _fp32_row_tiles
from tvm_spinn.runtime.simulator import run_program


def _mapped(chip, m: int, k: int, n: int):
    tensors = [TensorDesc("x", [1, m, k], "float32", "input"), TensorDesc("w", [1, k, n], "float32", "input"),
               TensorDesc("y", [1, m, n], "float32", "output")]
    program = Program("main", chip, tensors, [0, 1], [2], [Layer(name="qkv", kind="matmul", inputs=[0, 1], output=2)])
    program = layer_work(program, 0, chip)
    return _map(program, chip, "sequential", MappingOptions(weights="auto"),
                np.zeros(chip.pes_per_chip, dtype=np.int64))[0]


def test_row_tiles_are_register_blocks_below_the_mac_rows():
    """The candidates: multiples of the register block's rows from the rows down to one block,
    only where the rows over the batch are fewer than the MAC array's and more than one block's."""
    mr = M4F_BLOCK[0]
    assert _fp32_row_tiles(GemmShape(1, 8, 192, 768), 16) == {8, 4}
    assert _fp32_row_tiles(GemmShape(1, 12, 192, 768), 16) == {12, 8, 4}
    assert _fp32_row_tiles(GemmShape(1, 5, 192, 768), 16) == {8, 4}
    assert all(t % mr == 0 for t in _fp32_row_tiles(GemmShape(1, 15, 1, 1), 16))
    assert _fp32_row_tiles(GemmShape(1, 16, 192, 768), 16) == set()
    assert _fp32_row_tiles(GemmShape(1, 4, 192, 768), 16) == set()  # one register block of rows already
    assert _fp32_row_tiles(GemmShape(8, 8, 43, 128), 16) == set()  # a batch: its own tiles to spread
    # one row: the 4-row tile computes the same single row as the 16-row one (the tie keeps 16)
    arch = tvm_spinn.SpinnArch()
    assert choose_gemm_tile(GemmShape(1, 1, 64, 1024), arch, mode="fp32")[0] == arch.mac_rows


def test_a_few_rows_take_register_block_row_tiles_faster_with_the_same_bits(monkeypatch):
    chip = tvm_spinn.make_system("one-chip-148")
    m, k, n = 8, 768, 192
    best = _mapped(chip, m, k, n)
    assert best.mapping.layers[0].tile[0] == M4F_BLOCK[0]  # register-block-high row tiles
    # the chooser with MAC-high row tiles only (it times each and keeps its best)
    monkeypatch.setattr(geometry, "_fp32_row_tiles", lambda *args: set())
    old = _mapped(chip, m, k, n)
    assert old.mapping.layers[0].tile[0] == chip.mac_rows
    assert best.timing.cycles < 0.9 * old.timing.cycles
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, m, k)).astype(np.float32)
    w = rng.standard_normal((1, k, n)).astype(np.float32)
    ref = np.zeros((1, m, n), np.float32)
    for j in range(k):  # fl(acc + fl(a * b)), k ascending: the kernels' order
        ref = ref + x[:, :, j, None] * w[:, None, j, :]
    for program in (best, old):
        (got,) = run_program(program, [x, w], mode="tiles")
        np.testing.assert_array_equal(got, ref)



def test_the_row_tiles_switch_keeps_mac_high_tiles_and_the_bits():
    """``MappingOptions(row_tiles=False)`` maps the GEMM as the chooser does without the
    register-block candidates (MAC-high row tiles); the program's options record the switch
    only where it is off, and ``has_row_tiles`` names the programs where it makes a difference."""
    from tvm_spinn.program.format import options_from_json, options_to_json
    from tvm_spinn.program.ops.gemm import has_row_tiles

    chip = tvm_spinn.make_system("one-chip-148")
    m, k, n = 8, 768, 192
    best = _mapped(chip, m, k, n)
    with MappingOptions(row_tiles=False):
        mac = _mapped(chip, m, k, n)
    assert best.mapping.layers[0].tile[0] == M4F_BLOCK[0]
    assert mac.mapping.layers[0].tile[0] == chip.mac_rows
    assert mac.timing.cycles > best.timing.cycles
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, m, k)).astype(np.float32)
    w = rng.standard_normal((1, k, n)).astype(np.float32)
    (a,), (b,) = run_program(best, [x, w], mode="tiles"), run_program(mac, [x, w], mode="tiles")
    np.testing.assert_array_equal(a, b)
    assert "row_tiles" not in options_to_json(MappingOptions())
    off = options_to_json(MappingOptions(row_tiles=False))
    assert off["row_tiles"] is False and options_from_json(off) == MappingOptions(row_tiles=False)
    # rows above one register block and below the MAC array's: only there the switch matters
    assert has_row_tiles(best, chip)
    for rows in (4, 16):
        assert not has_row_tiles(_mapped(chip, rows, k, n), chip)


def test_band_tiles_fill_about_whole_rounds_of_the_pes():
    """The band candidates: per band of one or two register blocks below the rows, column tiles of
    whole register blocks; for each round count ``j`` the one that cuts the most tiles at most
    ``j * pes`` (a brute force over every column tile of whole register blocks), within one tile
    row (``row_tiles`` tiles) below ``j * pes`` wherever some column tile is."""
    mr, nr = M4F_BLOCK
    pes = 148
    for g in (GemmShape(1, 768, 256, 8), GemmShape(1, 768, 192, 8), GemmShape(2, 64, 132, 8),
              GemmShape(1, 40, 1000, 8)):
        bands = geometry._fp32_band_tiles(g, {16, 32}, pes, 16)
        assert sorted(bands) == [t for t in (mr, 2 * mr) if t < g.m]
        for tm, cols in bands.items():
            assert all(tn % nr == 0 and 0 < tn <= -(-g.n // nr) * nr for tn in cols)
            row_tiles = g.batch * -(-g.m // tm)
            counts = {tn: row_tiles * -(-g.n // tn) for tn in range(nr, -(-g.n // nr) * nr + 1, nr)}
            got = {counts[tn] for tn in cols}
            assert len(cols) <= 8 and len(got) == len(cols)  # no two column tiles cut alike
            for j in range(1, 9):
                under = [c for c in counts.values() if c <= j * pes]
                best = max(under) if under else row_tiles  # none under: one column tile a row tile
                assert best in got, (g, tm, j)
                near = [c for c in counts.values() if j * pes - row_tiles < c <= j * pes]
                if near:  # the register block's columns allow a count within one tile row below
                    assert any(j * pes - row_tiles < c <= j * pes for c in got), (g, tm, j)
    # 768 x 256 in 4-row bands: 192 row tiles, more than one round of 148 PEs alone
    assert sorted(c / pes for c in {192 * -(-256 // tn) for tn in geometry._fp32_band_tiles(
        GemmShape(1, 768, 256, 8), set(), pes, 16)[mr]})[:2] == [192 / pes, 384 / pes]
    assert geometry._fp32_band_tiles(GemmShape(1, 4, 64, 8), {4, 16}, pes, 16) == {}  # one register block of rows
    # fewer rows than the MAC array's: only the row tiles given (the register-block ones of
    # :func:`_fp32_row_tiles`) get their column tiles
    assert sorted(geometry._fp32_band_tiles(GemmShape(1, 8, 192, 768), {16}, pes, 16)) == []
    assert sorted(geometry._fp32_band_tiles(GemmShape(1, 8, 192, 768), {4, 8, 16}, pes, 16)) == [mr]


def _executed_cycles(shapes):
    """``(m, n, k) -> cycles`` the fp32 GEMM kernel executes for one job of that tile in the ARM
    emulator (the ``iss`` mode's machine), as ``bench/iss.py`` runs it."""
    from tvm_spinn.pe.runners.gemm import gemm_f32_job_cycles

    return gemm_f32_job_cycles(shapes, tvm_spinn.SpinnArch())


def test_a_short_reduction_takes_wide_register_block_bands_faster_with_the_same_bits(monkeypatch):
    """A weight gradient over a pipeline slot's 8 tokens (GPT-2 small's MLP-up shard at TP 12,
    768 x 8 x 256) with its right operand on chip: bands of ``4 x 4`` blocks a register block or
    two high over many columns run fewer jobs, rows and blocks than MAC-high tiles; the busiest
    PE executes fewer cycles (the kernel run in the ARM emulator), and the outputs keep their
    bits. Streamed from DRAM the chooser keeps its other candidates."""
    from tvm_spinn.program.ops.gemm import choose_matmul_tile

    chip = tvm_spinn.make_system("one-chip-148")
    pes = chip.pes_per_chip
    m, k, n = 768, 8, 256
    g = GemmShape(1, m, n, k)
    band = choose_matmul_tile(g, chip, pes, resident=True)[:2]
    assert band[0] in (M4F_BLOCK[0], 2 * M4F_BLOCK[0])
    streamed = choose_matmul_tile(g, chip, pes, resident=False)[:2]
    with monkeypatch.context() as mp:
        mp.setattr(geometry, "_fp32_band_tiles", lambda *args: {})
        old = choose_matmul_tile(g, chip, pes, resident=True)[:2]
        assert choose_matmul_tile(g, chip, pes, resident=False)[:2] == streamed
    assert old[0] >= chip.mac_rows and streamed[0] >= chip.mac_rows

    def busiest(tile):  # the busiest PE's tiles one after another, each one job (k fits a chunk)
        tm, tn = tile
        tiles = -(-m // tm) * -(-n // tn)
        return -(-tiles // pes) * ran[(min(tm, m), min(tn, n), k)]

    ran = _executed_cycles({(min(t[0], m), min(t[1], n), k) for t in (band, old)})
    assert busiest(band) < 0.95 * busiest(old)
    # the compiled layer with its right operand resident takes the band and keeps the bits
    tensors = [TensorDesc("x", [1, m, k], "float32", "input"), TensorDesc("w", [1, k, n], "float32", "input"),
               TensorDesc("y", [1, m, n], "float32", "output")]
    program = Program("main", chip, tensors, [0, 1], [2], [Layer(name="wgrad", kind="matmul", inputs=[0, 1], output=2)])
    program = _map(layer_work(program, 0, chip), chip, "sequential", MappingOptions(weights="resident"),
                   np.zeros(pes, dtype=np.int64))[0]
    assert tuple(program.mapping.layers[0].tile[:2]) == tuple(band)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, m, k)).astype(np.float32)
    w = rng.standard_normal((1, k, n)).astype(np.float32)
    ref = np.zeros((1, m, n), np.float32)
    for j in range(k):  # fl(acc + fl(a * b)), k ascending: the kernels' order
        ref = ref + x[:, :, j, None] * w[:, None, j, :]
    (got,) = run_program(program, [x, w], mode="tiles")
    np.testing.assert_array_equal(got, ref)


def _program(chip, m: int, k: int, n: int, batch: int = 1):
    tensors = [TensorDesc("x", [batch, m, k], "float32", "input"), TensorDesc("w", [batch, k, n], "float32", "input"),
               TensorDesc("y", [batch, m, n], "float32", "output")]
    return Program("main", chip, tensors, [0, 1], [2], [Layer(name="mm", kind="matmul", inputs=[0, 1], output=2)])


def test_the_row_tiles_switch_covers_the_bands_of_resident_gemms():
    """``MappingOptions(row_tiles=False)`` also keeps out the bands a GEMM whose right operand is
    held in SRAM takes, rows over the batch at least the MAC array's: ``has_row_tiles`` with
    ``resident`` names them; where it does not hold, the switch changes no tile."""
    from tvm_spinn.program.ops.gemm import has_row_tiles

    chip = tvm_spinn.make_system("one-chip-148")
    arch = tvm_spinn.SpinnArch()
    g = GemmShape(1, 768, 256, 8)  # a weight gradient: 768 rows, a reduction of 8 tokens
    assert choose_gemm_tile(g, arch, kind="matmul", resident=True, pes=148) == (2 * M4F_BLOCK[0], 88, 8)
    assert choose_gemm_tile(g, arch, kind="matmul", resident=True, pes=148, row_tiles=False)[0] == arch.mac_rows
    program = _program(chip, 768, 8, 256)
    assert has_row_tiles(program, chip, resident=True) and not has_row_tiles(program, chip)
    tiles = {}
    for options in (MappingOptions(weights="resident"), MappingOptions(weights="resident", row_tiles=False)):
        with options:  # the tile chooser reads the current options
            mapped = _map(layer_work(program, 0, chip), chip, "sequential", options,
                          np.zeros(chip.pes_per_chip, dtype=np.int64))[0]
        tiles[options.row_tiles] = mapped.mapping.layers[0].tile
    assert tiles[True][0] == 2 * M4F_BLOCK[0] and tiles[False][0] == chip.mac_rows
    # where has_row_tiles does not hold, the switch moves no tile (for every PE count tried)
    for batch, m, k, n in [(1, 1, 64, 256), (1, 4, 8, 768), (8, 2, 64, 64), (1, 3, 192, 768), (4, 16, 8, 64),
                           (1, 768, 8, 256), (1, 64, 8, 132)]:
        for resident in (False, True):
            if has_row_tiles(_program(chip, m, k, n, batch), chip, resident=resident):
                continue
            for pes in (1, 37, 148, 1152):
                shape = GemmShape(batch, m, n, k)
                assert (choose_gemm_tile(shape, arch, kind="matmul", resident=resident, pes=pes)
                        == choose_gemm_tile(shape, arch, kind="matmul", resident=resident, pes=pes, row_tiles=False))


def test_band_rows_take_their_own_column_tiles_each_pair_timed_once(monkeypatch):
    """A band's row tile (one or two register blocks, below the MAC-high rows the general
    candidates start at) is timed with each of the band's column tiles (and the general ones),
    and no (rows, columns) pair is timed twice."""
    arch = tvm_spinn.SpinnArch()
    g, pes = GemmShape(1, 768, 256, 8), 148
    bands = geometry._fp32_band_tiles(g, set(), pes, arch.mac_rows)
    assert sorted(bands) == [M4F_BLOCK[0], 2 * M4F_BLOCK[0]]
    timed, cycles = [], geometry.gemm_tile_cycles

    def record(vm, vn, *args, **kwargs):
        timed.append((vm, vn))
        return cycles(vm, vn, *args, **kwargs)

    monkeypatch.setattr(geometry, "gemm_tile_cycles", record)
    choose_gemm_tile(g, arch, kind="matmul", resident=True, pes=pes)
    for tm, cols in bands.items():
        assert set(cols) <= {vn for vm, vn in timed if vm == tm}, tm
    assert len(timed) == len(set(timed))  # each pair timed once
