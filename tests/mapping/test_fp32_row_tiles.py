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
