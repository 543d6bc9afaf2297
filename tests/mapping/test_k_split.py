"""int8 GEMM tiles whose reduction is split over several PEs (tile ``[tm, tn, tk, p]``).

A decode step's matrix-vector GEMM has few output tiles per chip: without the split most PEs
idle while a few stream the whole reduction. Each part streams its own run of the tile's
k-chunks (every chunk within ``safe_k_chunk`` products: no 24/29-bit accumulator wraps), and the
reducing part adds the int32 partial sums, which is exact in any order. References: numpy's exact
int64 sums (the dequantized output is ``float32(sum)``, exact below 2**24), the layers mode (one
batched C++ call per layer) and the same program with the split forced off.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.mapping import MappingOptions, derive_tables, map_program
from tvm_spinn.mapping.tiling import layer_work, tile_costs
from tvm_spinn.program import Layer, Program, ProgramError, TensorDesc
from tvm_spinn.program.ops import gemm as gemm_ops
from tvm_spinn.program.ops.gemm import k_part_bounds, splits_of
from tvm_spinn.runtime.simulator import run_program
from tvm_spinn.timing import evaluate

ARCH = tvm_spinn.make_system("ksplit-1x32", chips=1, pes_per_chip=32)


def _gemv(k: int, n: int, x_zero: int = 3, rows: int = 1, seed: int = 0) -> Program:
    """``x`` (int8, ``rows`` rows) through one int8 dense ``k -> n`` with per-channel weight
    zero points and a dequantizing epilogue of scale 1 (the output is the exact int sum)."""
    tensors = [TensorDesc("x", [rows, k], "int8", "input"), TensorDesc("w", [k, n], "int8", "const"),
               TensorDesc("scale", [n], "float32", "const"), TensorDesc("w_zero", [n], "int32", "const"),
               TensorDesc("y", [rows, n], "float32", "output")]
    layer = Layer(name="proj", kind="dense", inputs=[0], output=4, consts={"weight": 1, "scale": 2, "w_zero": 3},
                  attrs=dict(x_zero=x_zero, x_flip=False, relu=False, out="float32"), mode="int8")
    rng = np.random.default_rng(seed)
    program = Program("main", ARCH, tensors, [0], [4], [layer],
                      constants={1: rng.integers(-128, 128, (k, n), dtype=np.int8), 2: np.ones(n, dtype=np.float32),
                                 3: rng.integers(-5, 6, n, dtype=np.int32)})
    return layer_work(program, 0, ARCH)


def _retiled(mapping, tile):
    """``mapping`` with its first layer cut by ``tile``."""
    return dataclasses.replace(mapping, layers=(dataclasses.replace(mapping.layers[0], tile=tuple(tile)),
                                                *mapping.layers[1:]))


def _reference(program: Program, x: np.ndarray) -> np.ndarray:
    layer = program.layers[0]
    w = program.constants[1].astype(np.int64) - program.constants[3].astype(np.int64)[None, :]
    exact = (x.astype(np.int64) - layer.attrs["x_zero"]) @ w
    assert np.abs(exact).max() < 2**24  # float32 holds it exactly
    return exact.astype(np.float32)


@pytest.mark.parametrize("k, n", [(4096, 24), (1000, 40)])
def test_split_reduction_is_chosen_and_keeps_the_bits(k, n):
    program = _gemv(k, n)
    with MappingOptions(weights="auto"):
        program = map_program(program, ARCH)
    tile = program.mapping.layers[0].tile
    assert len(tile) == 4 and tile[3] > 1  # few column tiles on 32 PEs: the reduction splits
    table = program.tiles.tables[0]
    parts = tile[3]
    assert len(table) == -(-n // tile[1]) * parts and len(set(table.pe.tolist())) == len(table)
    # the parts cover the reduction on chunk boundaries, one weight block each
    bounds = k_part_bounds(k, tile[2], parts)
    assert bounds[0] == 0 and bounds[-1] == k and (np.diff(bounds) > 0).all()
    np.testing.assert_array_equal(table.lo[:parts, 3], bounds[:-1])
    assert len(set(table.group.tolist())) == len(table)
    assert int(table.w_bytes.sum()) >= k * n  # every weight byte once (plus the epilogue's)
    # bits: tiles mode == layers mode == numpy's exact sums
    x = np.random.default_rng(1).integers(-128, 128, (1, k), dtype=np.int8)
    x[0, :300] = -128
    ref = _reference(program, x)
    for mode in ("tiles", "layers"):
        (got,) = run_program(program, [x], mode=mode)
        np.testing.assert_array_equal(got, ref)
    # the split is faster than the same tiles unsplit, as timed by the model
    whole = dataclasses.replace(program, mapping=_retiled(program.mapping, tile[:3]))
    unsplit = evaluate(whole, ARCH, derive_tables(whole, ARCH)).cycles
    assert evaluate(program, ARCH).cycles < unsplit
    (got,) = run_program(whole, [x], mode="tiles")
    np.testing.assert_array_equal(got, ref)


def test_split_costs_the_reduction_of_partials():
    program = _gemv(4096, 8)
    tk = 511
    ks = splits_of(4096, tk)
    one = tile_costs(program, 0, ARCH, [16, 4, tk])
    three = tile_costs(program, 0, ARCH, [16, 4, tk, 3])
    assert len(three) == 3 * len(one)
    reducer = three.hi[:, 3] == 4096
    # the reducer pays the other parts' partials (DMA + adds) and the epilogue after its chunks
    assert (three.cycles[reducer] > three.cycles[~reducer].max()).all()
    assert three.cycles.max() < one.cycles.max()
    # a part's result is its int32 partial sums; the weight bytes add up to the whole block's
    assert (three.out_bytes[~reducer] == 4 * 1 * 4).all()
    w = three.w_bytes.reshape(-1, 3)
    assert (w.sum(axis=1) == one.w_bytes).all() and ks == 9


def test_fp32_never_splits_and_records_are_validated():
    program = _gemv(4096, 24)
    with MappingOptions(weights="auto"):
        program = map_program(program, ARCH)
    assert len(program.mapping.layers[0].tile) == 4
    loaded = Program.from_bytes(program.to_bytes())  # the record round-trips
    assert loaded.mapping.layers[0].tile == program.mapping.layers[0].tile
    tables = derive_tables(loaded, ARCH)
    np.testing.assert_array_equal(tables[0].pe, program.tiles.tables[0].pe)
    assert evaluate(loaded, ARCH, tables).cycles == program.timing.cycles
    x = np.random.default_rng(2).integers(-128, 128, (1, 4096), dtype=np.int8)
    (got,) = run_program(loaded, [x], mode="tiles")
    np.testing.assert_array_equal(got, _reference(program, x))
    fp32 = dataclasses.replace(
        program, layers=[dataclasses.replace(program.layers[0], mode="fp32", attrs={}, consts={"weight": 1})],
        tensors=[dataclasses.replace(t, dtype="float32") if tid in (0, 1) else t for tid, t in enumerate(program.tensors)],
        constants={**program.constants, 1: program.constants[1].astype(np.float32)})
    assert len(tvm_spinn.mapping.choose_gemm_tile(tvm_spinn.mapping.gemm_shape(fp32, fp32.layers[0]), ARCH,
                                                  pes=32, mode="fp32", split_k=True)) == 3
    with pytest.raises(ProgramError, match=r"mapping\.layers\[0\]\.tile\[3\]: a reduction split .* int8"):
        Program.from_bytes(fp32.to_bytes())
    for parts, match in [(10, r"mapping\.layers\[0\]\.tile\[3\]: 10 reduction parts exceed"),
                         (0, r"mapping\.layers\[0\]\.tile\[3\]")]:
        bad = dataclasses.replace(program, mapping=_retiled(program.mapping, program.mapping.layers[0].tile[:3] + (parts,)))
        with pytest.raises(ProgramError, match=match):
            Program.from_bytes(bad.to_bytes())


def test_split_conv_and_dense_requantize_like_the_whole_layer(monkeypatch):
    """int8 conv2d (im2col operand) and dense with a requantizing epilogue: a split tiling runs
    tile by tile to the bits of the layers mode and of the unsplit tiling."""
    from test_mapping_int8 import gemm_program

    arch = tvm_spinn.make_system("ksplit-conv", chips=1)
    rng = np.random.default_rng(5)
    for kind, shapes in [("conv2d", (512, 4, 4, 8, 3)), ("dense", (2, 3000, 8))]:
        outs = []
        for split in (True, False):
            program = gemm_program(kind, "int8", shapes, arch=arch)
            layer = program.layers[0]
            program = dataclasses.replace(program, layers=[dataclasses.replace(
                layer, attrs={**layer.attrs, "y_zero": 0, "y_min": -128, "y_max": 127})])
            c = program.layers[0].consts
            shape = {role: program.tensors[tid].shape for role, tid in c.items()}
            program = dataclasses.replace(program, constants={
                c["weight"]: np.random.default_rng(1).integers(-128, 128, shape["weight"]).astype(np.int8),
                c["bias_q"]: np.arange(shape["bias_q"][0], dtype=np.int32) * 37,
                c["multiplier"]: np.full(shape["multiplier"], 1 << 30, np.int32),
                c["shift"]: np.full(shape["shift"], 40, np.int32)})
            program = map_program(program, arch, MappingOptions(split_k=split))
            assert (len(program.mapping.layers[0].tile) == 4) == split
            if not outs:
                x = rng.integers(-128, 128, program.tensors[0].shape).astype(np.int8)
                (ref,) = run_program(program, [x], mode="layers")
                assert len(np.unique(ref)) > 4  # not saturated
            (got,) = run_program(program, [x], mode="tiles")
            outs.append(got)
        np.testing.assert_array_equal(outs[0], ref)
        np.testing.assert_array_equal(outs[1], ref)


def test_tile_chooser_splits_without_zero_point_sums():
    # a symmetric int8 GEMV described without its zero-point side (int8=None) splits its
    # 4,096-long reduction like one with it: the part and tail costs default the side
    arch = tvm_spinn.arch_of(tvm_spinn.get_target("spinn"))
    g = gemm_ops.GemmShape(1, 1, 64, 4096)
    bare = gemm_ops.choose_gemm_tile(g, arch, mode="int8", split_k=True, pes=148)
    sided = gemm_ops.choose_gemm_tile(g, arch, mode="int8", split_k=True, pes=148, int8=gemm_ops.Int8Side())
    assert len(bare) == 4 and bare[3] > 1 and bare == sided
