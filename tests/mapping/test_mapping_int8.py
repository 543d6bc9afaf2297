"""The mapping compiler on int8 layers: 1-byte operands, MAC-array cycles, k-splits, energy.

Programs are built by hand (no front-end) and every expected number is computed here from the
hardware description, not taken from the mapping code: int8/uint8 operands take 1 byte per
element, GEMM accumulators 4, the MAC array does ``mac_rows x mac_cols`` (16 x 4) MACs per cycle
on blocks padded to that shape, one cycle per k, plus ``mac_readout_cycles`` per block and
k-chunk; the M4F does ``m4f_flops_per_cycle`` (16 / 42) fp32 MACs per cycle.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.mapping import MappingError, MappingOptions, choose_gemm_tile, map_program, plan_memory, tile_layer
from tvm_spinn.mapping.tiling import layer_work
from tvm_spinn.mapping.tiling import GemmShape
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.timing.bounds import physical_bound, program_workload
from tvm_spinn.program.ops.gemm import geometry as G
from tvm_spinn.program.ops.m4f import mix_cycles

ARCH = tvm_spinn.SpinnArch()
# products of -128 * -128 that fit the signed accumulator: 511 on the production chip's 24 bits
SAFE_K = (2 ** (ARCH.acc_bits - 1) - 1) // (128 * 128)
DENSE = (256, 1024, 1024)  # M, K, N
CONV = (64, 32, 32, 64, 3)  # C, H, W, OC, kernel


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _gemm_layer(tensors: list[TensorDesc], kind: str, mode: str, x: int, shapes, out_dtype: str,
                name: str = "") -> Layer:
    """Append the weight, epilogue and output tensors of a GEMM layer reading tensor ``x``."""
    if kind == "dense":
        m, k, n = shapes
        wshape, oshape, channels, attrs = [k, n], [m, n], n, {}
    else:
        c, h, w, oc, kk = shapes
        p = kk // 2
        wshape, oshape, channels = [oc, c, kk, kk], [1, oc, h, w], oc
        attrs = dict(strides=[1, 1], padding=[p, p, p, p], dilation=[1, 1], groups=1)
    consts = {"weight": len(tensors)}
    tensors.append(TensorDesc(f"w{name}", wshape, "int8" if mode == "int8" else "float32", "const"))
    if mode == "int8":
        attrs.update(x_zero=0, x_flip=False, relu=False, out=out_dtype)
        epilogue = {"scale": "float32"} if out_dtype == "float32" else {
            "bias_q": "int32", "multiplier": "int32", "shift": "int32"}
    else:
        epilogue = {"bias": "float32"}
    for role, dtype in epilogue.items():
        consts[role] = len(tensors)
        tensors.append(TensorDesc(f"{role}{name}", [channels], dtype, "const"))
    tensors.append(TensorDesc(f"y{name}", oshape, out_dtype, "temp"))
    return Layer(name=f"{kind}{name}", kind=kind, inputs=[x], output=len(tensors) - 1, consts=consts,
                 attrs=attrs, mode=mode)


def gemm_program(kind: str, mode: str, shapes, arch=ARCH, out_dtype: str | None = None,
                 act_dtype: str | None = None) -> Program:
    """One conv2d/dense layer; int8 layers read int8 activations and weights."""
    act_dtype = act_dtype or ("int8" if mode == "int8" else "float32")
    out_dtype = out_dtype or ("int8" if mode == "int8" else "float32")
    if kind == "dense":
        xshape = [shapes[0], shapes[1]]
    else:
        xshape = [1, shapes[0], shapes[1], shapes[2]]
    tensors = [TensorDesc("x", xshape, act_dtype, "input")]
    layer = _gemm_layer(tensors, kind, mode, 0, shapes, out_dtype)
    tensors[layer.output] = dataclasses.replace(tensors[layer.output], role="output")
    return Program("main", arch, tensors, [0], [layer.output], [layer])


def _vmn(tile):
    (_, _), (m0, m1), (n0, n1) = tile.region[:3]
    return m1 - m0, n1 - n0


def _mac_cycles(vm: int, vn: int, k: int, k_splits: int, arch=ARCH) -> int:
    passes = math.ceil(vm / arch.mac_rows) * math.ceil(vn / arch.mac_cols)
    return passes * (k + k_splits * arch.mac_readout_cycles)


def _fp32_cycles(vm: int, vn: int, k: int, k_splits: int = 1, arch=ARCH) -> float:
    """The fp32 GEMM kernel's loop nest walked (``tvm_spinn.pe.kernels``: 4 x 4 register blocks,
    their reduction loop unrolled by 4, 4 x 1 blocks right of them, 1 x 4 blocks below them and
    single outputs right of those), each
    loop's body, set-up and trips priced by the instructions the generated code executes there
    (the ``F32_*`` mixes): per job (reduction chunk) the job, each loop nest that runs, its rows,
    its blocks or outputs and their k steps."""
    def c(mix):
        return mix_cycles(mix, arch)

    def job(kc: int) -> float:
        cycles = c(G.F32_JOB)
        rows = range(vm // 4)
        if vm // 4 and vn // 4:
            cycles += c(G.F32_NEST)
            for _ in rows:
                cycles += c(G.F32_ROW)
                for _ in range(vn // 4):
                    cycles += c(G.F32_BLOCK) + sum(c(G.F32_TRIP) / 4 if s < kc - kc % 4 else c(G.F32_REM)
                                                   for s in range(kc))
        if vm // 4 and vn % 4:
            cycles += c(G.F32_EDGE_NEST)
            for _ in rows:
                cycles += c(G.F32_EDGE_ROW) + (vn % 4) * (c(G.F32_EDGE) + kc * c(G.F32_EDGE_STEP))
        if vm % 4 and vn:
            cycles += c(G.F32_ONE_NEST)
            for _ in range(vm % 4):
                cycles += c(G.F32_ONE_ROW)
                cycles += (vn // 4) * (c(G.F32_TAIL) + kc * c(G.F32_TAIL_STEP))
                cycles += (vn % 4) * (c(G.F32_ONE) + kc * c(G.F32_ONE_STEP))
        return cycles

    chunk = math.ceil(k / k_splits)
    return sum(job(min(chunk, k - j * chunk)) for j in range(k_splits))


#: fp32 multiply-accumulates per cycle of the kernel's 4 x 4 block (a trip of its unrolled loop:
#: 4 k steps of 16 VMUL + VADD and their 8 loads)
_FULL_BLOCK_RATE = 64 / mix_cycles(G.F32_TRIP, ARCH)
#: ... and of its 1 x 4 blocks below them (a batch-1 GEMV's: 5 loads, 4 VMUL + VADD per k)
_SINGLE_RATE = 4 / mix_cycles(G.F32_TAIL_STEP, ARCH)


def _k(kind: str, shapes) -> int:
    return shapes[1] if kind == "dense" else shapes[0] * shapes[4] ** 2


# -- compute ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,shapes", [("dense", DENSE), ("conv2d", CONV)])
def test_int8_gemm_runs_on_the_mac_array(kind, shapes):
    k = _k(kind, shapes)
    fp32 = layer_work(gemm_program(kind, "fp32", shapes), 0, ARCH)
    int8 = layer_work(gemm_program(kind, "int8", shapes), 0, ARCH)
    t32, t8 = tile_layer(fp32, 0, ARCH), tile_layer(int8, 0, ARCH)
    m, n = (shapes[0], shapes[2]) if kind == "dense" else (shapes[3], shapes[1] * shapes[2])
    # Same operation count: flops are 2 M N K in both modes.
    assert fp32.layers[0].flops == int8.layers[0].flops == 2 * m * n * k
    # fp32: the M4F kernel's register blocks. int8: 16 x 4 blocks (M, N are multiples: no padding), K cycles
    # each plus one readout per k-chunk; the requantizing epilogue is free on the array.
    assert sum(t.cycles for t in t32) == sum(math.ceil(_fp32_cycles(*_vmn(t), k, t.k_splits)) for t in t32)
    assert all(vm % 16 == 0 and vn % 4 == 0 for vm, vn in map(_vmn, t8))
    assert sum(t.cycles for t in t8) == sum(_mac_cycles(*_vmn(t), k, t.k_splits) for t in t8)
    ratio = sum(t.cycles for t in t32) / sum(t.cycles for t in t8)
    array_vs_m4f = 16 * 4 / _FULL_BLOCK_RATE
    assert 0.9 * array_vs_m4f < ratio <= 1.1 * array_vs_m4f
    # The whole layer (DMA, DRAM, barriers included) is faster too, never below its physical bound.
    fp32 = map_program(fp32, ARCH)
    int8 = map_program(int8, ARCH)
    assert int8.timing.cycles * 4 < fp32.timing.cycles
    assert int8.timing.latency_s >= physical_bound(program_workload([int8]), ARCH).total_s > 0
    assert int8.timing.roofline_s < fp32.timing.roofline_s


def test_int8_padding_to_the_array_is_paid():
    # A batch-1 dense layer: the array holds its one row on the 4-wide side (16 outputs of N per
    # pass, 1 of 4 lanes used), never on the 16-wide side (1 of 16): int8 gains at most a
    # quarter of the array over the M4F, and more than the 16-wide side's sixteenth.
    shapes = (1, 1024, 1000)
    fp32, int8 = gemm_program("dense", "fp32", shapes), gemm_program("dense", "int8", shapes)
    t32, t8 = tile_layer(fp32, 0, ARCH), tile_layer(int8, 0, ARCH)
    assert sum(t.cycles for t in t32) == sum(math.ceil(_fp32_cycles(*_vmn(t), 1024, t.k_splits)) for t in t32)
    for t in t8:
        vm, vn = _vmn(t)
        assert vm == 1 and t.cycles == math.ceil(vn / 16) * (1024 + t.k_splits * ARCH.mac_readout_cycles)
    ratio = sum(t.cycles for t in t32) / sum(t.cycles for t in t8)
    array_vs_m4f = 16 * 4 / _SINGLE_RATE  # the M4F runs a batch-1 GEMV one output at a time
    assert array_vs_m4f / 16 < ratio <= array_vs_m4f / 4 * 1.01


def test_dequantizing_epilogue_runs_on_the_m4f():
    # fp32 output: the M4F scales every accumulator (m4f_elementwise_cycles per element) while the
    # array runs; with K = 27 (a first conv layer: 3 channels, 3x3) the M4F is the bottleneck.
    shapes = (3, 32, 32, 16, 3)
    for out_dtype in ("float32", "int8"):
        tiles = tile_layer(gemm_program("conv2d", "int8", shapes, out_dtype=out_dtype), 0, ARCH)
        for t in tiles:
            vm, vn = _vmn(t)
            assert t.k_splits == 1
            array = _mac_cycles(vm, vn, 27, 1)
            expected = max(array, vm * vn * ARCH.m4f_elementwise_cycles) if out_dtype == "float32" else array
            assert t.cycles == expected and t.out_bytes == vm * vn * (4 if out_dtype == "float32" else 1)


# -- bytes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,shapes", [("dense", DENSE), ("conv2d", CONV)])
def test_int8_moves_a_quarter_of_the_bytes(kind, shapes):
    k = _k(kind, shapes)
    # naive: the same 16 x 4 tiles in both modes, so the bytes compare element for element.
    fp32 = tile_layer(gemm_program(kind, "fp32", shapes), 0, ARCH, naive=True)
    int8 = tile_layer(gemm_program(kind, "int8", shapes), 0, ARCH, naive=True)
    assert [t.region for t in fp32] == [t.region for t in int8]
    for a, b in zip(fp32, int8):
        vm, vn = _vmn(b)
        assert b.in_bytes * 4 == a.in_bytes
        assert b.out_bytes * 4 == a.out_bytes == 4 * vm * vn
        if kind == "dense":  # x rows; weight columns + 3 int32 epilogue words per column
            assert b.in_bytes == vm * k
            assert (a.w_bytes, b.w_bytes) == (4 * k * vn + 4 * vn, k * vn + 3 * 4 * vn)
        else:  # weight rows + epilogue per output channel; the input window of 4 pixels: 3 x 6
            assert (a.w_bytes, b.w_bytes) == (4 * vm * k + 4 * vm, vm * k + 3 * 4 * vm)
            if b.region[2][0] % shapes[2] + vn <= shapes[2]:  # one output row
                assert b.in_bytes == shapes[0] * 3 * min(shapes[2], (vn - 1) + 3)
    w_ratio = sum(t.w_bytes for t in fp32) / sum(t.w_bytes for t in int8)
    assert 3.9 < w_ratio < 4
    # End to end, same tiles (inputs, weights and outputs all 1 byte): ~4x fewer DRAM bytes.
    p32, p8 = gemm_program(kind, "fp32", shapes), gemm_program(kind, "int8", shapes)
    with MappingOptions(naive=True):
        p32 = map_program(p32, ARCH)
        p8 = map_program(p8, ARCH)
    assert 3.5 < p32.timing.dram_bytes / p8.timing.dram_bytes <= 4


@pytest.mark.parametrize("kind,act", [("quantize", "float32"), ("dequantize", "int8"), ("dequantize", "uint8")])
def test_quantize_dequantize_bytes(kind, act):
    from tvm_spinn.program.ops.m4f import FUSED_CYCLES, mix_cycles, pass_cycles
    from tvm_spinn.program.ops.qdq import QDQ_MIXES, QUANTIZE_RUN

    out = "int8" if kind == "quantize" else "float32"
    n = 8 * 1000
    tensors = [TensorDesc("x", [8, 1000], act, "input"), TensorDesc("scale", [1], "float32", "const"),
               TensorDesc("zero", [1], "int32", "const"), TensorDesc("y", [8, 1000], out, "output")]
    layer = Layer(name=kind, kind=kind, inputs=[0], output=3, consts={"scale": 1, "zero": 2}, attrs={"axis": 0})
    program = layer_work(Program("main", ARCH, tensors, [0], [3], [layer]), 0, ARCH)
    tiles = tile_layer(program, 0, ARCH)
    i, o = (4, 1) if kind == "quantize" else (1, 4)
    assert sum(t.region[0][1] - t.region[0][0] for t in tiles) == n
    assert sum(t.in_bytes for t in tiles) == i * n and sum(t.out_bytes for t in tiles) == o * n
    for t in tiles:
        e = t.region[0][1] - t.region[0][0]
        assert t.sram_bytes == 2 * (1 + 4) * e  # double-buffered in and out
        # one job each, the PE kernel's instruction mix per element (quantize's four fused
        # multiply-adds among them) and, quantize, one run of the scale (its VDIV) a tile
        per = pass_cycles((QDQ_MIXES[kind],), ARCH)
        assert per > (4 * FUSED_CYCLES if kind == "quantize" else 4 * ARCH.m4f_fpu_cycles)
        run = mix_cycles(QUANTIZE_RUN, ARCH) if kind == "quantize" else 0
        assert run == 0 or run > ARCH.m4f_divide_cycles
        assert t.cycles == math.ceil(e * per + ARCH.m4f_job_cycles + run)
    assert program.layers[0].flops == n


# -- SRAM ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,shapes", [("dense", DENSE), ("conv2d", CONV)])
def test_int8_tiles_fit_sram_with_one_byte_operands(kind, shapes):
    k = _k(kind, shapes)
    for naive in (False, True):
        for t in tile_layer(gemm_program(kind, "int8", shapes), 0, ARCH, naive=naive):
            vm, vn = _vmn(t)
            pm, pn = 16 * math.ceil(vm / 16), 4 * math.ceil(vn / 4)
            # Double-buffered 1-byte A (pm x tk) and B (tk x pn) chunks + 4-byte accumulators.
            assert t.sram_bytes <= ARCH.tile_sram_bytes
            tk, rest = divmod(t.sram_bytes - 4 * pm * pn, 2 * (pm + pn))
            assert rest == 0 and math.ceil(k / tk) == t.k_splits


def test_int8_fits_an_sram_too_small_for_fp32():
    # 1500 bytes: a 16 x 4 fp32 tile with 16 k needs 4 * (2 * (16*16 + 16*4) + 16*4) = 2816;
    # int8 needs 2 * (16*16 + 16*4) + 4 * 16*4 = 896, and takes k = (1500 - 256) // 40 -> 16.
    tiny = tvm_spinn.make_system("int8-tiny", sram_bytes=2524, sram_reserved_bytes=1024)
    g = GemmShape(1, 16, 16, 64)
    with pytest.raises(MappingError, match="sram_bytes >= "):
        choose_gemm_tile(g, tiny, "fp32 layer")
    tm, tn, tk = choose_gemm_tile(g, tiny, mode="int8")
    assert tk == 16 and 2 * (tm * tk + tk * tn) + 4 * tm * tn <= 1500
    program = gemm_program("dense", "int8", (16, 64, 16), arch=tiny)
    program = map_program(program, tiny)
    assert all(t.sram_bytes <= 1500 and t.k_splits == 4 for t in program.tiles)
    assert program.memory.peak_bytes_max <= 1500


@pytest.mark.parametrize("kind,shapes", [("dense", (16, 40000, 64)), ("conv2d", (2048, 4, 4, 16, 3))])
def test_int8_long_reductions_split_at_the_accumulator_limit(kind, shapes):
    k = _k(kind, shapes)
    assert k > SAFE_K
    for naive in (False, True):
        tiles = tile_layer(gemm_program(kind, "int8", shapes), 0, ARCH, naive=naive)
        for t in tiles:
            vm, vn = _vmn(t)
            assert t.k_splits >= math.ceil(k / SAFE_K) and math.ceil(k / t.k_splits) <= SAFE_K
            if len(t.region) > 3:  # one part of a reduction split over PEs (test_k_split.py)
                (k0, k1), chunk = t.region[3], math.ceil(k / t.k_splits)
                assert k0 % chunk == 0 and (k1 == k or k1 % chunk == 0)
                assert t.cycles >= _mac_cycles(vm, vn, k1 - k0, math.ceil((k1 - k0) / chunk))
                continue
            assert t.cycles == _mac_cycles(vm, vn, k, t.k_splits)  # the M4F's chunk adds hide
    # The same layer in fp32 has no accumulator limit: the M4F sums in fp32 registers.
    program = gemm_program(kind, "fp32", shapes)
    fp32 = tile_layer(program, 0, ARCH)
    assert sum(t.cycles for t in fp32) == sum(math.ceil(_fp32_cycles(*_vmn(t), k, t.k_splits)) for t in fp32)
    assert sum(math.prod(_vmn(t)) for t in fp32) == _numel(program.tensors[program.layers[0].output].shape)


def test_int8_activations_and_weights_are_planned_with_one_byte():
    # quantize -> int8 dense (requantizing) -> dequantize on 8 PEs (896 KiB of tile SRAM).
    arch = tvm_spinn.make_system("int8-8pe", pes_per_chip=8)
    tensors = [TensorDesc("x", [64, 512], "float32", "input"), TensorDesc("qs", [1], "float32", "const"),
               TensorDesc("qz", [1], "int32", "const"), TensorDesc("xq", [64, 512], "int8", "temp")]
    quant = Layer(name="q", kind="quantize", inputs=[0], output=3, consts={"scale": 1, "zero": 2}, attrs={"axis": 0})
    dense = _gemm_layer(tensors, "dense", "int8", 3, (64, 512, 512), "int8", name="d")
    tensors += [TensorDesc("y", [64, 512], "float32", "output")]
    deq = Layer(name="dq", kind="dequantize", inputs=[dense.output], output=len(tensors) - 1,
                consts={"scale": 1, "zero": 2}, attrs={"axis": 0})
    program = Program("main", arch, tensors, [0], [len(tensors) - 1], [quant, dense, deq])
    program = map_program(program, arch)
    # Weights (256 KiB int8 + 3 x 2 KiB epilogue) stay resident; in fp32 (1 MiB) they could not.
    assert 1 in program.mapping.resident_layers
    assert 512 * 512 <= program.memory.resident_bytes_total < 2 * 512 * 512
    plan = plan_memory(program, arch)
    assert 1 in plan.resident_layers and max(plan.peak_bytes.values()) <= arch.tile_sram_bytes
    # The int8 activations are on chip; their tiles account 1 byte per element.
    assert set(plan.onchip_tensors) == {3, dense.output}
    for i, tid in ((0, 3), (1, dense.output)):
        assert sum(t.out_bytes for t in program.tiles if t.layer == i) == _numel(tensors[tid].shape)
    f32 = gemm_program("dense", "fp32", (64, 512, 512), arch=arch)
    with MappingOptions(weights="resident"), pytest.raises(MappingError, match="cannot stay resident"):
        map_program(f32, arch)


# -- energy -------------------------------------------------------------------------------------
def test_int8_energy_is_per_int8_mac():
    quiet = ARCH.replace(e_sram_byte_j=0.0, e_dram_byte_j=0.0, e_noc_byte_j=0.0, e_link_byte_j=0.0,
                         p_static_w_per_chip=0.0)
    macs = 256 * 1024 * 1024
    for mode, per_mac in (("fp32", quiet.e_flop_fp32_j), ("int8", quiet.e_mac_int8_j)):
        program = map_program(gemm_program("dense", mode, DENSE, arch=quiet), quiet)
        assert program.timing.flops == 2 * macs
        assert program.timing.energy_j == pytest.approx(macs * per_mac, rel=1e-12)
