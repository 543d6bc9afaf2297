"""A region that no chip group holds is mapped over pipeline stages: each stage's program on
its own board, the program carrying the stages (layers, chips, mapping, sends) and the
pipeline's period and latency; it runs with the whole program's bits, survives save/load, and a
corrupted stage record is refused naming the field."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from tvm_spinn.mapping import derive_tables, map_program
from tvm_spinn.mapping.stages import stage_programs_of
from tvm_spinn.mapping.tiling import MappingError
from tvm_spinn.program import Program
from tvm_spinn.program.format import CHECKSUM_BYTES, mapping_from_json, program_digest, mapping_to_json, timing_from_json, timing_to_json
from tvm_spinn.program.model import ProgramError
from tvm_spinn.runtime.simulator import run_program
from tvm_spinn.target.arch import make_system
from tvm_spinn.target.topology import topology_of
from tvm_spinn.timing.collectives import point_to_point

from _chains import build_and_run, chain, chain_reference

K = 1024
# two boards of 48 chips, 4 PEs and 8 KiB of DRAM a chip: a board holds 2 of the 4 layers'
# 4 MiB of weights (tp=48: 87 KiB a chip each), not all 4
ARCH = make_system("pp-map", boards=2, pes_per_chip=4, dram_bytes=8 * 1024)


@pytest.fixture(scope="module")
def piped():
    return map_program(chain(), ARCH)


def test_a_region_no_board_holds_is_mapped_over_two_boards(piped):
    pipe = piped.mapping.pipeline
    assert pipe is not None and piped.mapping.system is None
    assert [(s.first_layer, s.layers) for s in pipe.stages] == [(0, 2), (2, 2)]
    per = ARCH.chips_per_board
    # each stage on its own board, its program's shard plan over the board's chips
    assert [s.chips for s in pipe.stages] == [tuple(range(per)), tuple(range(per, 2 * per))]
    assert [s.mapping.system.chips for s in pipe.stages] == [per, per]
    # the per-layer records are the stages' in layer order
    assert piped.mapping.layers == pipe.stages[0].mapping.layers + pipe.stages[1].mapping.layers
    # one send: y1 (one row of K floats) from board 0 to board 1
    (send,) = pipe.sends
    assert (send.op, send.layer, piped.tensors[send.tensor].name, send.nbytes) == ("send", 2, "y1", K * 4)


def test_each_stage_is_its_program_mapped_alone_on_a_board(piped):
    board = ARCH.replace(chips=ARCH.chips_per_board)
    t = piped.timing.pipeline
    for stage, got in zip(stage_programs_of(piped), t.stage_s):
        alone = map_program(replace(stage, mapping=None), board)
        assert alone.mapping == stage.mapping and alone.timing.latency_s == got > 0
    # the send priced on the links between the boards' first chips
    ref = point_to_point(topology_of(ARCH), [0], [ARCH.chips_per_board], float(K * 4))
    assert t.send_s == (ref.seconds,) and ref.board_hops >= 1
    # latency: every stage and send in turn; period: the longest of them
    assert t.latency_s == pytest.approx(sum(t.stage_s) + sum(t.send_s), rel=1e-15)
    assert t.period_s == max(t.stage_s + t.send_s) < t.latency_s
    assert piped.timing.latency_s == t.latency_s
    assert piped.timing.throughput_inf_s == pytest.approx(1 / t.period_s, rel=1e-15)
    assert t.binding in ("stage 0", "stage 1")


def test_the_pipeline_runs_with_the_whole_programs_bits(piped):
    program = chain()
    x = np.random.default_rng(3).standard_normal((1, K)).astype(np.float32)
    ref = chain_reference(program, x)
    (whole,) = run_program(program, [x])
    (got,) = run_program(piped, [x])
    assert np.array_equal(got, whole)
    assert np.array_equal(run_program(piped, [x], mode="tiles")[0], whole)  # every stage's tiles
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    # the stages run in turn, the tensor sent at the cut handed on: the same bits
    s0, s1 = stage_programs_of(piped)
    (y1,) = run_program(s0, [x])
    (out,) = run_program(s1, [y1])
    assert np.array_equal(out, whole)


def test_the_pipeline_survives_save_and_load(piped):
    data = piped.to_bytes()
    back = Program.from_bytes(data)
    assert back.mapping == piped.mapping and back.timing == piped.timing and back.memory == piped.memory
    assert back.to_bytes() == data
    # the tiles derived from the records are the compiler's
    for a, b in zip(derive_tables(back, ARCH), piped.tiles.tables):
        assert a.layer == b.layer and np.array_equal(a.lo, b.lo) and np.array_equal(a.hi, b.hi) \
            and np.array_equal(a.pe, b.pe)


def _corrupt(piped, edit):
    header = mapping_to_json(piped.mapping)
    header = json.loads(json.dumps(header))
    edit(header["pipeline"])
    return header


@pytest.mark.parametrize("edit, match", [
    (lambda p: p["stages"][1].update(first_layer=3), r"mapping\.pipeline\.stages\[1\]\.first_layer: expected 2"),
    (lambda p: p["stages"][1].update(layers=1), r"mapping\.pipeline\.stages\[1\]\.layers: 1, but its mapping has 2"),
    (lambda p: (p["stages"][1].update(layers=1), p["stages"][1]["mapping"]["layers"].pop()),
     r"mapping\.pipeline\.stages: cover layers 0\.\.2 of the program's 4"),
    (lambda p: p["stages"][1].update(chips=[0]), r"mapping\.pipeline\.stages\[1\]\.chips: expected distinct"),
    (lambda p: p["stages"][1].update(chips=[48]), r"mapping\.pipeline\.stages\[1\]\.chips: every stage has as many"),
    (lambda p: p["stages"][0].update(first_layer="0"), r"mapping\.pipeline\.stages\[0\]\.first_layer: expected an integer"),
    (lambda p: p["stages"][0].pop("mapping"), r"mapping\.pipeline\.stages\[0\]: missing key\(s\) \['mapping'\]"),
    (lambda p: p["stages"][0]["mapping"]["layers"][1].update(rotate=1),
     r"mapping\.pipeline\.stages\[0\]\.mapping\.layers: not the program's mapping of layers 0\.\.1"),
    (lambda p: p["stages"][0]["mapping"].update(bogus=1), r"mapping\.pipeline\.stages\[0\]\.mapping: .*unknown key\(s\) \['bogus'\]"),
    (lambda p: p["stages"].pop(), r"mapping\.pipeline\.stages: a pipeline has at least 2 stages"),
    (lambda p: p["sends"][0].update(layer=1), r"mapping\.pipeline\.sends\[0\]: expected a send at the first layer"),
    (lambda p: p["sends"][0].update(op="all_gather"), r"mapping\.pipeline\.sends\[0\]: expected a send"),
    (lambda p: p["sends"][0].update(layer=[2]), r"mapping\.pipeline\.sends\[0\]: expected a send at the first layer"),
    (lambda p: p["sends"][0].update(shape=[[1], 2]), r"mapping\.pipeline\.sends\[0\]\.shape: expected non-negative integers"),
    (lambda p: p.update(extra=[]), r"mapping\.pipeline: missing key\(s\) \[\], unknown key\(s\) \['extra'\]"),
])
def test_a_corrupted_stage_record_is_refused_naming_the_field(piped, edit, match):
    with pytest.raises(ProgramError, match=match):
        mapping_from_json(_corrupt(piped, edit))


@pytest.mark.parametrize("edit, match", [
    (lambda t: t["stage_s"].__setitem__(1, -1.0), r"timing\.pipeline\.stage_s\[1\]: expected a finite time"),
    (lambda t: t.pop("period_s"), r"timing\.pipeline: missing key\(s\) \['period_s'\]"),
    (lambda t: t.update(send_s="x"), r"timing\.pipeline\.send_s: expected a list"),
])
def test_a_corrupted_pipeline_timing_is_refused_naming_the_field(piped, edit, match):
    header = json.loads(json.dumps(timing_to_json(piped.timing)))
    edit(header["pipeline"])
    with pytest.raises(ProgramError, match=match):
        timing_from_json(header)


def test_a_corrupted_stage_record_in_a_saved_program_is_refused(piped):
    # the saved bytes with one field of the header changed (padded to its length, which the
    # framing records) and the checksum recomputed: refused by Program.from_bytes, naming it
    data = piped.to_bytes()
    header = piped.header(piped.blob_offsets()[0])
    good = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    header["mapping"]["pipeline"]["stages"][1]["chips"] = [0]
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    assert good in data and len(text) < len(good)
    text = text.replace(b'"chips":[0]', b'"chips":[0' + b" " * (len(good) - len(text)) + b"]", 1)
    body = data[:-CHECKSUM_BYTES].replace(good, text, 1)
    with pytest.raises(ProgramError, match=r"mapping\.pipeline\.stages\[1\]\.chips: expected distinct"):
        Program.from_bytes(body + program_digest(body))


def test_a_region_no_pipeline_holds_is_still_refused():
    # one board: no second stage to cut to, and 8 KiB of DRAM a chip holds no stage
    arch = make_system("pp-map-one", chips=48, pes_per_chip=4, dram_bytes=8 * 1024)
    with pytest.raises(MappingError, match="does not fit pp-map-one"):
        map_program(chain(), arch)


def test_programs_that_fit_carry_no_pipeline_record():
    program = map_program(chain(2, 256), ARCH)
    assert program.mapping.pipeline is None and program.timing.pipeline is None
    header = program.header()
    assert "pipeline" not in header["mapping"] and "pipeline" not in header["timing"]


def test_a_model_no_board_holds_builds_over_stages(register_system):
    torch = pytest.importorskip("torch")

    import tvm_spinn

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.ModuleList(torch.nn.Linear(K, K, bias=False) for _ in range(4))

        def forward(self, x):
            for i, fc in enumerate(self.fc):
                x = fc(x)
                x = torch.relu(x) if i % 2 == 0 else x
            return x

    torch.manual_seed(0)
    x = torch.randn(1, K)
    mod = tvm_spinn.frontend.from_pytorch(Chain().eval(), (x,))

    def run(target):
        return build_and_run(mod, x.numpy(), target)

    ex, got = run(register_system(ARCH))
    rep = tvm_spinn.report(ex)
    ((row),) = rep.pipelines
    assert (row["stages"], row["chips"]) == (2, [48, 48])
    (program,) = rep.programs
    assert row["period_s"] == program.timing.pipeline.period_s == 1 / rep.throughput_inf_s
    assert rep.latency_s == row["latency_s"] > row["period_s"]
    assert "2 pipeline stages of [48, 48] chip(s)" in str(rep)
    # the same bits as on one chip whose DRAM holds the whole model (no pipeline), close to llvm's
    roomy = register_system(make_system("pp-map-roomy", chips=1, pes_per_chip=4))
    ex1, one = run(roomy)
    assert tvm_spinn.report(ex1).pipelines == []
    assert np.array_equal(got, one)
    _, ref = run("llvm")
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_an_int8_model_no_board_holds_has_the_one_chip_bits(register_system):
    # int8 weights take a quarter of the bytes: 4 x 2048^2 no board of ARCH holds
    torch = pytest.importorskip("torch")

    import tvm_spinn

    k = 2 * K
    torch.manual_seed(1)
    net = torch.nn.Sequential(*(torch.nn.Linear(k, k, bias=False) for _ in range(4))).eval()
    x = torch.randn(1, k)
    mod = tvm_spinn.quantize(tvm_spinn.frontend.from_pytorch(net, (x,)), [x.numpy()])

    def run(target):
        return build_and_run(mod, x.numpy(), target)

    ex, got = run(register_system(ARCH))
    assert [(p["stages"], p["chips"]) for p in tvm_spinn.report(ex).pipelines] == [(2, [48, 48])]
    assert any(layer.mode == "int8" for p in tvm_spinn.report(ex).programs for layer in p.layers)
    _, one = run(register_system(make_system("pp-map-one-chip", chips=1, pes_per_chip=4)))
    assert np.array_equal(got, one)


def test_the_system_plan_counts_the_chips_of_every_stage(piped):
    from tvm_spinn.mapping.planner import plan_system

    plan = plan_system([chain()], ARCH)
    (region,) = plan.regions
    assert plan.programs[0].mapping == piped.mapping
    # each stage's shard plan over its board, mapped alone (the reference), summed
    board = ARCH.replace(chips=ARCH.chips_per_board)
    groups = [map_program(replace(s, mapping=None), board).mapping.system.chips for s in stage_programs_of(piped)]
    assert region.chips == sum(groups) == 2 * ARCH.chips_per_board
    assert (region.stage, plan.stages) == (1, 2)
