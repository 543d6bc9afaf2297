"""The mapping compiler: bitwise-identical results under any mapping, memory plan, timing, traces."""

import dataclasses
import json

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.mapping import MappingError, MappingOptions, choose_gemm_tile
from tvm_spinn.mapping.tiling import GemmShape
from models import make

SYSTEMS = {
    "1pe": dict(pes_per_chip=4, pes_per_qpe=4, chips=1),
    "8pe": dict(pes_per_chip=8, chips=1),
    "chip": dict(),
    "4chips": dict(chips=4),
    "board": dict(chips=48),
    "small-sram": dict(sram_bytes=24 * 1024, sram_reserved_bytes=4096),
}


def _run(mod, target, x, options=None):
    if options is None:
        options = MappingOptions()
    with options:
        ex = relax.build(mod, target=target)
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    return out.numpy(), tvm_spinn.report(ex)


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_result_bits_do_not_depend_on_the_mapping(name, register_system):
    model, x = make(name)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    results = {}
    for key, fields in SYSTEMS.items():
        if key == "1pe":
            fields = dict(pes_per_chip=4, chips=1)
        tag = register_system(tvm_spinn.make_system(f"det-{key}", **fields))
        results[key], _ = _run(mod, tag, x.numpy())
    for options in (MappingOptions(naive=True), MappingOptions(mode="pipelined"), MappingOptions(weights="stream")):
        results[str(options)], _ = _run(mod, "spinn", x.numpy(), options)
    first = next(iter(results.values()))
    for key, value in results.items():
        assert np.array_equal(value.view(np.uint32), first.view(np.uint32)), key
    with torch.no_grad():
        np.testing.assert_allclose(first, model(x).numpy(), rtol=1e-4, atol=1e-5)


def test_mapping_improves_on_naive_and_respects_roofline():
    model, x = make("cnn")
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    _, good = _run(mod, "spinn", x.numpy())
    _, naive = _run(mod, "spinn", x.numpy(), MappingOptions(naive=True))
    assert naive.latency_s > good.latency_s >= good.physical_bound_s
    assert naive.physical_bound_s == good.physical_bound_s  # the physical bound ignores the mapping


def test_memory_plan_is_checked_and_fits(register_system):
    model, x = make("transformer")
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    tag = register_system(tvm_spinn.make_system("mem-small", sram_bytes=24 * 1024, sram_reserved_bytes=4096))
    _, rep = _run(mod, tag, x.numpy())
    arch = tvm_spinn.target.SYSTEMS["mem-small"]
    for program in rep.programs:
        assert program.memory.peak_bytes_max <= arch.tile_sram_bytes
        ranges = program.memory.ranges
        for i, a in enumerate(ranges):
            assert 0 <= a.start < a.end <= arch.tile_sram_bytes
            for b in ranges[i + 1:]:
                live_together = a.first_layer <= b.last_layer and b.first_layer <= a.last_layer
                assert not (live_together and a.start < b.end and b.start < a.end), (a, b)


def test_weights_resident_vs_streamed_traffic():
    model, x = make("mlp")
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    _, resident = _run(mod, "spinn", x.numpy(), MappingOptions(weights="resident"))
    _, stream = _run(mod, "spinn", x.numpy(), MappingOptions(weights="stream"))
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert resident.resident_weight_bytes >= weight_bytes
    assert stream.dram_bytes - resident.dram_bytes >= weight_bytes
    assert stream.latency_s > resident.latency_s


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_auto_weights_never_lose_to_streaming(name):
    """Resident weights take SRAM that could keep activations on chip: weights="auto" keeps
    them only when the timing model says it pays."""
    model, x = make(name)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    _, auto = _run(mod, "spinn", x.numpy(), MappingOptions(weights="auto"))
    _, stream = _run(mod, "spinn", x.numpy(), MappingOptions(weights="stream"))
    assert auto.latency_s <= stream.latency_s


def test_board_spreads_large_layers_over_chips_with_link_traffic():
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).eval()
    x = torch.randn(64, 1024)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    with MappingOptions(weights="stream"):
        chip = tvm_spinn.report(relax.build(mod, target="spinn"))
        board = tvm_spinn.report(relax.build(mod, target="spinn/board"))
    assert max(row["chips"] for row in board.layers) > 1 and board.link_bytes > 0
    assert board.latency_s < chip.latency_s


def test_pipelined_mode_raises_throughput():
    model, x = make("cnn")
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    out_seq, seq = _run(mod, "spinn", x.numpy(), MappingOptions(mode="sequential"))
    out_pipe, pipe = _run(mod, "spinn", x.numpy(), MappingOptions(mode="pipelined"))
    out_auto, auto = _run(mod, "spinn", x.numpy(), MappingOptions(objective="throughput"))
    (ps,), (pp,), (pa,) = seq.programs, pipe.programs, auto.programs  # one region: the whole CNN
    # Sequential: one inference at a time, throughput = 1 / latency. Pipelined: a new input enters
    # when the slowest layer stage is free, throughput = clock / max stage cycles. Both say the
    # same clock, so seq_throughput * total cycles == pipe_throughput * max stage cycles.
    clock = ps.timing.throughput_inf_s * ps.timing.cycles
    assert ps.timing.throughput_inf_s == pytest.approx(1.0 / ps.timing.latency_s, rel=1e-9)
    stage_max = max(row["cycles"] for row in pipe.layers)
    assert pp.timing.throughput_inf_s == pytest.approx(clock / stage_max, rel=1e-9)
    # The CNN's layers are unbalanced but several: pipelining must raise throughput (and pay in
    # latency: each stage has fewer PEs). The gain is bounded by the slowest stage (~2.3x here):
    # stages are sized by each layer's cycles on one PE, so a pool's window loops get their share.
    assert pipe.throughput_inf_s > 1.1 * seq.throughput_inf_s and pipe.latency_s > seq.latency_s
    # auto keeps the better of the two mappings, whole: same throughput, same per-layer modes.
    best = max((seq, pipe), key=lambda r: r.throughput_inf_s)
    assert auto.throughput_inf_s == best.throughput_inf_s and pa.timing == best.programs[0].timing
    assert [m["mode"] for m in auto.mapping] == [m["mode"] for m in best.mapping] == ["pipelined"] * len(best.mapping)
    # and the mapping changes no bits
    assert np.array_equal(out_seq.view(np.uint32), out_pipe.view(np.uint32))
    assert np.array_equal(out_seq.view(np.uint32), out_auto.view(np.uint32))


def test_perfetto_and_plot(tmp_path):
    model, x = make("cnn")
    _, rep = _run(tvm_spinn.frontend.from_pytorch(model, (x,)), "spinn", x.numpy())
    trace = json.loads(open(rep.to_perfetto(str(tmp_path / "t.json"))).read())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len([e for e in slices if e["cat"] == "layer"]) == len(rep.layers)
    assert all(e["dur"] >= 0 for e in slices)
    png = rep.plot(str(tmp_path / "p.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("target,options", [("spinn", {}), ("spinn/board", {}),
                                            ("spinn", {"mode": "pipelined"}), ("spinn", {"naive": True})])
def test_loaded_program_rederives_the_compile_time_tiles_and_timing(monkeypatch, target, options):
    """Only tile shapes and PE ranges are stored: a loaded program derives the very tiles,
    placement and timing the compiler had (the schedule is a function of them)."""
    from tvm_spinn.mapping import derive_tables
    from tvm_spinn.program import Program
    from tvm_spinn.timing import evaluate

    model, x = make("transformer")
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    compiled = {}
    import tvm_spinn.codegen.codegen as codegen

    original = codegen.plan_system

    def keep(programs, arch, *args, **kwargs):  # the compiler's own Program objects
        plan = original(programs, arch, *args, **kwargs)
        for program in plan.programs:
            compiled[program.symbol] = (program, arch)
        return plan

    monkeypatch.setattr(codegen, "plan_system", keep)
    with MappingOptions(**options):
        ex = relax.build(mod, target=target)
    data = {m["get_symbol"](): bytes(m["get_program"]()) for m in tvm_spinn.report_modules(ex)}
    assert compiled
    for symbol, (program, arch) in compiled.items():
        loaded = Program.from_bytes(data[symbol])
        # the module holds exactly the serialized program, with the native section codegen adds
        assert dataclasses.replace(loaded, native_section=None).to_bytes() == program.to_bytes()
        assert loaded.tiles is None
        tables = derive_tables(loaded, arch)
        for a, b in zip(program.tiles.tables, tables):
            for field in ("lo", "hi", "group", "pe", "chip", "sram_bytes", "in_bytes", "w_bytes", "out_bytes", "cycles"):
                assert np.array_equal(getattr(a, field), getattr(b, field)), field
        if loaded.mapping.system is not None:  # several chips: one chip's shard and the collectives
            from tvm_spinn.mapping.system import retime

            assert retime(loaded, arch, derive_tables) == loaded.timing == program.timing
        else:
            assert evaluate(loaded, arch, tables) == loaded.timing == program.timing


def test_gemm_tile_choice_fits_and_is_mac_aligned():
    """int8 tiles are MAC-array shaped; fp32 tiles (the M4F) keep MAC-shaped rows but may take
    fewer columns, and a GEMM of fewer rows (over its batch) than the array may take rows of the
    M4F's register block; all fit SRAM with their buffers padded to the MAC shape."""
    arch = tvm_spinn.SpinnArch()
    r, c = arch.mac_rows, arch.mac_cols
    for g in (GemmShape(1, 64, 3136, 576), GemmShape(1, 128, 768, 3072), GemmShape(8, 7, 5, 3),
              GemmShape(1, 8, 192, 768)):
        for mode, e in (("fp32", 4), ("int8", 1)):
            tm, tn, tk = choose_gemm_tile(g, arch, mode=mode)
            few = mode == "fp32" and g.m * g.batch < r
            assert tm % (4 if few else r) == 0 and (mode == "fp32" or tn % c == 0)
            pm, pn = -(-tm // r) * r, -(-tn // c) * c
            assert 4 * pm * pn + 2 * e * (pm * tk + tk * pn) <= arch.tile_sram_bytes


def test_fp32_matvec_spreads_its_columns_over_the_pes():
    """A decode step's fp32 matrix-vector product with few output columns (a tensor-parallel
    shard: 64 columns) uses a PE per column or two, not one per MAC-array width (16 PEs)."""
    arch = tvm_spinn.SpinnArch()
    tm, tn, _ = choose_gemm_tile(GemmShape(1, 1, 64, 1024), arch, mode="fp32")
    assert tn <= 2 and -(-64 // tn) >= 32
    tm8, tn8, _ = choose_gemm_tile(GemmShape(1, 1, 64, 1024), arch, mode="int8")
    assert tn8 % arch.mac_cols == 0


def test_unmappable_layer_names_layer_size_and_smallest_system():
    arch = tvm_spinn.SpinnArch()
    with pytest.raises(MappingError, match=r"layer big.*bytes.*sram_bytes >= "):
        choose_gemm_tile(GemmShape(1, 64, 64, 64), arch.replace(sram_bytes=20 * 1024, sram_reserved_bytes=19 * 1024), "big")


def test_impossible_options_name_the_field():
    with pytest.raises(ValueError, match="MappingOptions.mode"):
        MappingOptions(mode="diagonal")


def test_large_pool_planes_are_split_into_row_bands():
    class Pools(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.max_pool2d(x, 3, 2, 1) + torch.nn.functional.avg_pool2d(x, 3, 2, 1)

    x = torch.randn(1, 4, 150, 150, generator=torch.Generator().manual_seed(3))
    out, rep = _run(tvm_spinn.frontend.from_pytorch(Pools().eval(), (x,)), "spinn", x.numpy())
    assert {r["kind"] for r in rep.layers} >= {"max_pool2d", "avg_pool2d"}
    assert all(r["tiles"] > 4 for r in rep.layers if r["kind"].endswith("pool2d"))  # > one tile per plane
    np.testing.assert_allclose(out, Pools()(x).numpy(), rtol=1e-6, atol=1e-6)  # 9-term sums only


@pytest.mark.parametrize("chip,bits,expected", [("production", 24, 511), ("testchip", 29, 16383)])
def test_int8_reductions_are_split_so_accumulators_never_wrap(chip, bits, expected):
    from tvm_spinn import _lib
    from tvm_spinn.mapping.tiling import safe_k_chunk

    arch = tvm_spinn.make_system(f"acc-{chip}", chip=chip)
    assert arch.acc_bits == bits
    limit = safe_k_chunk(arch, 8)
    assert limit == expected == (2 ** (bits - 1) - 1) // 2**14  # products of -128 * -128 that fit
    k = 40000
    tm, tn, tk = choose_gemm_tile(GemmShape(1, 16, 4, k), arch, mode="int8")
    assert tk <= limit
    # Worst case operands: every product is +16384.
    a = np.full((tm, k), -128, np.int8)
    b = np.full((k, tn), -128, np.int8)
    whole = np.zeros((tm, tn), np.int32)
    assert _lib.gemm_i8(a, b, whole, acc_bits=bits) > 0  # one accumulator over all of K wraps
    total = np.zeros((tm, tn), np.int64)
    for k0 in range(0, k, tk):  # the tiling's chunks: each fits the accumulator exactly
        part = np.zeros((tm, tn), np.int32)
        assert _lib.gemm_i8(np.ascontiguousarray(a[:, k0:k0 + tk]), np.ascontiguousarray(b[k0:k0 + tk]), part, acc_bits=bits) == 0
        total += part
    np.testing.assert_array_equal(total, a.astype(np.int64) @ b.astype(np.int64))
