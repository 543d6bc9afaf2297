"""The DRAM ledger counts the state (a KV cache) a region streams: on one stage, each chip's
copy under its shard plan; with several inputs in flight, one copy per input (each stream has
its own state in every region), counted over the whole build. A chip that keeps its state in
SRAM exchanges one stream's copy for the next through its DRAM on every input; a hand-in moves
only the inputs that are not state. Checked against a count of the schedule's inputs in flight
and of each chip's bytes by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dataclasses import replace

from tvm_spinn.mapping import MappingOptions, derive_tables, map_program
from tvm_spinn.mapping.planner import plan_system
from tvm_spinn.mapping.state import build_flight
from tvm_spinn.mapping.stages import stage_programs_of
from tvm_spinn.mapping.system import recorded_plan, retime
from tvm_spinn.mapping.tiling import MappingError
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.target.arch import SpinnArch, make_system
from tvm_spinn.timing.stages import PipelineTiming, inputs_in_flight, state_exchange_s

K, M = 1024, 4


def stateful(k: int = K, m: int = M, seed: int = 7) -> Program:
    """Four dense layers of ``k x k`` float32 weights (a board of :func:`_arch` holds two) and,
    after the second and the fourth, a matmul reading a state input ``s0`` / ``s1``
    ``[k, m]`` (the right operand of a matmul: a KV cache, kept between calls)."""
    rng = np.random.default_rng(seed)
    t = [TensorDesc("x", [1, k], "float32", "input")]
    t += [TensorDesc(f"w{i}", [k, k], "float32", "const") for i in range(4)]                      # 1..4
    t += [TensorDesc("s0", [k, m], "float32", "input"), TensorDesc("s1", [k, m], "float32", "input")]  # 5, 6
    t += [TensorDesc(f"y{i}", [1, k], "float32", "temp") for i in range(4)]                        # 7..10
    t += [TensorDesc("a0", [1, m], "float32", "output"), TensorDesc("a1", [1, m], "float32", "output")]  # 11, 12
    layers = [Layer(name="fc0", kind="dense", inputs=[0], output=7, consts={"weight": 1}, attrs={"relu": True}),
              Layer(name="fc1", kind="dense", inputs=[7], output=8, consts={"weight": 2}, attrs={"relu": False}),
              Layer(name="att0", kind="matmul", inputs=[8, 5], output=11),
              Layer(name="fc2", kind="dense", inputs=[8], output=9, consts={"weight": 3}, attrs={"relu": True}),
              Layer(name="fc3", kind="dense", inputs=[9], output=10, consts={"weight": 4}, attrs={"relu": False}),
              Layer(name="att1", kind="matmul", inputs=[10, 6], output=12)]
    consts = {1 + i: (rng.standard_normal((k, k)) / np.sqrt(k)).astype(np.float32) for i in range(4)}
    return Program("main", SpinnArch(), t, [0, 5, 6], [11, 12], layers, constants=consts)


def _arch(dram_kib: int):
    return make_system(f"pp-state-{dram_kib}", boards=2, pes_per_chip=4, dram_bytes=dram_kib * 1024)


def _in_flight_by_schedule(latency_s: float, period_s: float) -> int:
    """Inputs in the pipeline at once: one enters every period and leaves ``latency_s`` later;
    counted at instants of a steady-state period."""
    return max(sum(1 for k in range(200) if k * period_s <= t < k * period_s + latency_s)
               for t in np.linspace(150 * period_s, 151 * period_s, 101))


@pytest.mark.parametrize("latency, period, n", [(7.0, 3.0, 3), (6.0, 3.0, 2), (3.0, 3.0, 1), (2.05e-3, 1e-3, 3)])
def test_inputs_in_flight_by_hand(latency, period, n):
    assert inputs_in_flight(latency, period) == n == _in_flight_by_schedule(latency, period)


@pytest.mark.parametrize("latency, period", [(1.0, 0.0), (1.0, 2.0), (math.nan, 1.0), (math.inf, 1.0)])
def test_inputs_in_flight_refuses_bad_times(latency, period):
    with pytest.raises(ValueError, match="inputs_in_flight: expected 0 < period_s <= latency_s"):
        inputs_in_flight(latency, period)


def test_an_exchange_writes_the_leaving_copy_and_reads_the_next():
    # 16 KiB out and 16 KiB in through a 6.4 GB/s port: 5.12 us
    assert state_exchange_s(16384, 6.4e9) == pytest.approx(5.12e-6, rel=1e-15)
    assert state_exchange_s(0, 6.4e9) == 0.0
    for nbytes, bw in ((-1, 6.4e9), (1, 0.0), (1, math.nan), (1, math.inf)):
        with pytest.raises(ValueError, match="state_exchange_s: expected bytes >= 0 and a finite bandwidth > 0"):
            state_exchange_s(nbytes, bw)


def test_a_pipeline_of_no_time_keeps_one_input_in_flight():
    # no period to count by: each stage holds the one input it computes
    assert PipelineTiming((0.0, 0.0), (), 0.0, "stage 0", 0.0).in_flight == 1


def test_a_hand_in_is_part_of_the_latency_and_bounds_the_period():
    stages = PipelineTiming((3.0, 3.0), (), 3.0, "stage 0", 6.0)
    assert stages.in_flight == 2 == _in_flight_by_schedule(6.0, 3.0)
    short = stages.handed_in(0.5)  # 6.5 s through, one input every 3 s
    assert (short.latency_s, short.period_s, short.binding) == (6.5, 3.0, "stage 0")
    assert short.in_flight == 3 == _in_flight_by_schedule(6.5, 3.0)
    long = stages.handed_in(4.0)  # the hand-in binds: 10 s through, one input every 4 s
    assert (long.latency_s, long.period_s, long.binding) == (10.0, 4.0, "hand-in")
    assert long.in_flight == 3 == _in_flight_by_schedule(10.0, 4.0)
    assert stages.handed_in(0.0) is stages
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="PipelineTiming.handed_in: expected a finite time >= 0"):
            stages.handed_in(bad)


def test_the_ledger_counts_a_state_copy_per_input_in_flight():
    arch = _arch(64)
    plan = plan_system([stateful()], arch)
    (piped,), (region,) = plan.programs, plan.regions
    pipe, t = piped.mapping.pipeline, piped.timing.pipeline
    assert pipe is not None and len(pipe.stages) == 2
    copies = _in_flight_by_schedule(t.latency_s, t.period_s)
    assert copies == 3  # two stages and a send: a stream is back after just over two periods
    # each stage holds its state (s0 in stage 0, s1 in stage 1) as its own shard plan places it
    per_chip, in_sram, whole = [], [], 0
    for k, stage in enumerate(stage_programs_of(piped)):
        sid = next(i for i, x in enumerate(stage.tensors) if x.name == f"s{k}")
        local = recorded_plan(stage).shapes[sid]
        chip = int(np.prod(local)) * 4
        per_chip.append(chip)
        att = next(i for i, layer in enumerate(stage.layers) if layer.kind == "matmul")
        in_sram.append(chip if att in stage.mapping.resident_layers else 0)
        whole += chip * stage.mapping.system.chips
    assert region.state_tensor_bytes == 2 * K * M * 4
    assert region.state_bytes == copies * whole
    assert region.state_sram_bytes == sum(s * st.mapping.system.chips for s, st in zip(in_sram, stage_programs_of(piped)))
    # each stage is its program alone on a board, and between two inputs its chips write the
    # leaving stream's SRAM copy to DRAM and read the next one's: 2 x its SRAM bytes at 6.4 GB/s
    board = arch.replace(chips=arch.chips_per_board)
    alone = [plan_system([replace(st, mapping=None)], board) for st in stage_programs_of(piped)]
    for stage, one, got, sram in zip(stage_programs_of(piped), alone, t.stage_s, in_sram):
        assert stage.mapping.system.streams == copies
        assert one.programs[0].mapping == replace(stage.mapping, system=replace(stage.mapping.system, streams=1))
        assert sram > 0 and got == pytest.approx(one.programs[0].timing.latency_s + 2 * sram / 6.4e9, rel=1e-12)
    assert t.latency_s == pytest.approx(sum(t.stage_s) + sum(t.send_s), rel=1e-12)
    # the build continues on the last stage's board: its DRAM holds the copies not in SRAM
    # (alone, the stage's ledger holds one copy's DRAM part: the others come on top)
    assert plan.final.dram == alone[-1].final.dram + (copies - 1) * per_chip[-1] > alone[-1].final.dram


def test_one_stream_exchanges_nothing():
    # on one board the region keeps one input in flight: its state stays in SRAM, no exchange
    plan = plan_system([stateful()], _board(1024))
    (mapped,) = plan.programs
    assert mapped.mapping.system.streams == 1 and plan.regions[0].state_sram_bytes > 0
    assert mapped.timing.latency_s == mapped.timing.system.latency_s


def test_stages_whose_chips_hold_one_copy_of_their_state_but_not_every_copy_are_refused():
    # 24 KiB of DRAM a chip: one copy of a stage's state (16 KiB a chip) fits, the three that the
    # inputs in flight keep do not (one of them in SRAM: 32 KiB in DRAM)
    arch = _arch(24)
    with pytest.raises(MappingError, match=r"stage 0 of main: 3 inputs in flight keep 3 copies of its state "
                                           r"\(16384 bytes a chip each, 16384 of them in SRAM\): 32768 bytes of "
                                           r"DRAM a chip needed, 24576 available"):
        map_program(stateful(), arch)


def _board(dram_kib: int):
    return make_system(f"state-{dram_kib}", boards=1, pes_per_chip=4, dram_bytes=dram_kib * 1024)


def _col_bytes(k: int, tp: int) -> int:
    """A chip's share of a ``k x k`` float32 weight split ``tp`` ways (the last chips may hold less)."""
    return -(-k // tp) * k * 4


def test_a_streamed_state_is_counted_in_the_dram_of_each_chip():
    # weights streamed: each chip's DRAM holds its share of the four weights and, as each chip
    # reads the whole of a state too small to split (two [k, 64] float32 tensors), both of them
    m = 64
    plan = plan_system([stateful(m=m)], _board(1024), MappingOptions(weights="stream"))
    (mapped,), (region,) = plan.programs, plan.regions
    system = mapped.mapping.system
    assert system.tp == system.chips and mapped.mapping.resident_layers == ()
    state = 2 * K * m * 4
    assert plan.final.dram == region.dram_bytes == 4 * _col_bytes(K, system.tp) + state
    assert region.state_bytes == system.chips * state and region.state_sram_bytes == 0


def test_state_kept_in_sram_neither_takes_dram_nor_frees_the_weights_dram():
    # the memory plan keeps the state's readers resident (with the first two weights): the
    # DRAM holds the other two weights' shares, and not the state
    plan = plan_system([stateful()], _board(1024))
    (mapped,), (region,) = plan.programs, plan.regions
    system, resident = mapped.mapping.system, set(mapped.mapping.resident_layers)
    attention = {i for i, layer in enumerate(mapped.layers) if layer.kind == "matmul"}
    assert attention <= resident and region.state_sram_bytes == region.state_bytes > 0
    streamed = [i for i, layer in enumerate(mapped.layers) if "weight" in layer.consts and i not in resident]
    assert streamed and plan.final.dram == len(streamed) * _col_bytes(K, system.tp)


def test_a_chip_whose_dram_does_not_hold_the_streamed_state_is_refused():
    # each chip reads both [k, 256] float32 states whole: 2 MiB, twice a chip's 1 MiB of DRAM
    # (the weights alone, 352 KiB a chip, fit; the state does not)
    m, arch = 256, _board(1024)
    assert 2 * K * m * 4 > arch.dram_bytes > 4 * _col_bytes(K, arch.chips_per_board)
    with pytest.raises(MappingError, match=rf"its weights need {4 * K * K * 4} bytes and its state \(inputs kept "
                                           rf"between calls, such as a KV cache\) {2 * K * m * 4} bytes"):
        plan_system([stateful(m=m)], arch, MappingOptions(weights="stream"))


def _state_held(piped) -> int:
    """One copy of the state ``s0`` / ``s1`` the stages of ``piped`` hold: each stage's chips'
    shares under its own shard plan (float32), summed over its chips."""
    out = 0
    for k, stage in enumerate(stage_programs_of(piped)):
        sid = next(i for i, x in enumerate(stage.tensors) if x.name == f"s{k}")
        out += int(np.prod(recorded_plan(stage).shapes[sid])) * 4 * stage.mapping.system.chips
    return out


def _hand_in_s(arch, piped, nbytes: int) -> float:
    """A hand-over of ``nbytes`` from the first chip of board 0 to ``piped``'s first stage's
    first chip, priced on its own."""
    from tvm_spinn.target.topology import topology_of
    from tvm_spinn.timing.collectives import point_to_point

    first = piped.mapping.pipeline.stages[0].chips[0]
    return point_to_point(topology_of(arch), [0], [first], float(nbytes)).seconds


def _build_in_flight(programs) -> int:
    """Inputs a build keeps in flight, by its schedule: each goes through every region in turn
    (their latencies summed), one leaves every period: the busiest board an input (each
    pipeline stage on its own board; here every other region alone on its board) or the
    longest link transfer (a send, a hand-in)."""
    latency = sum(p.timing.latency_s for p in programs)
    parts = []
    for p in programs:
        t = p.timing.pipeline
        if t is None:
            parts.append(p.timing.latency_s)
        else:
            parts += list(t.stage_s) + list(t.send_s) + [p.timing.latency_s - t.latency_s]
    return _in_flight_by_schedule(latency, max(parts))


def test_the_hand_in_moves_only_the_inputs_that_are_not_state():
    # a small region on board 0, the stateful one over boards 1 and 2: its row x (4 KiB) crosses
    # from board 0 on every call; its states s0 and s1 (32 KiB) stay on the stages' chips
    from _chains import chain

    arch = make_system("pp-state-hand-in", boards=3, pes_per_chip=4, dram_bytes=64 * 1024)
    plan = plan_system([chain(2, 256, symbol="small"), stateful()], arch)
    piped, region = plan.programs[1], plan.regions[1]
    t, hand = piped.timing.pipeline, _hand_in_s(arch, piped, K * 4)
    assert piped.timing.latency_s == pytest.approx(t.latency_s + hand, rel=1e-12)
    # the bytes on the links: the region's own (alone on two boards: no hand-in) and x's
    alone = plan_system([stateful()], _arch(64)).programs[0]
    assert alone.timing.latency_s == pytest.approx(t.latency_s, rel=1e-12)
    assert piped.timing.link_bytes == alone.timing.link_bytes + K * 4
    # an input is in flight from the hand-in on; the build's count is the same here
    copies = _in_flight_by_schedule(t.latency_s + hand, max(t.period_s, hand))
    assert copies == _build_in_flight(plan.programs) == 3
    assert region.state_bytes == copies * _state_held(piped)


def test_stages_whose_dram_holds_the_copies_of_a_hand_in_of_the_data_alone_are_taken():
    # 36 KiB of DRAM a chip, a stateful region of k = 1088 with [k, 3] states (13056 bytes a
    # chip each): after a region on board 0 it keeps 3 inputs in flight (two copies in DRAM:
    # 26112 bytes a chip). Handing its state in too (30464 bytes a call, a hand-in about as long
    # as a stage) would keep 4 in flight, three copies in DRAM (39168 bytes), which would not fit.
    from _chains import chain

    k, m = 1088, 3
    arch = make_system("pp-state-hand-in-36", boards=3, pes_per_chip=4, dram_bytes=36 * 1024)
    plan = plan_system([chain(2, 256, symbol="small"), stateful(k, m)], arch)
    piped = plan.programs[1]
    t = piped.timing.pipeline
    slow = _hand_in_s(arch, piped, k * 4 + 2 * k * m * 4)
    assert _in_flight_by_schedule(t.latency_s + slow, max(t.period_s, slow)) == 4
    assert 3 * k * m * 4 > arch.dram_bytes
    assert plan.regions[1].state_bytes == 3 * _state_held(piped)
    assert plan.final.dram == 2 * k * m * 4 <= arch.dram_bytes


def _two(k: int = K):
    return [replace(stateful(k, seed=7), symbol="a"), replace(stateful(k, seed=8), symbol="b")]


def test_the_copies_are_counted_over_the_build_s_flight():
    # two stateful regions, each over two boards of four: a stream goes through both, so the
    # build keeps latency(a) + latency(b) over one period in flight (5), not each region its own
    # (3 and 3): every stage of both holds 5 copies of its state
    arch = make_system("pp-state-two", boards=4, pes_per_chip=4, dram_bytes=64 * 1024)
    plan = plan_system(_two(), arch)
    streams = _build_in_flight(plan.programs)
    assert streams == 5
    # the planner's flight: each board holds one stage, which binds
    flight = build_flight(plan.programs, arch)
    stages = [s for p in plan.programs for s in p.timing.pipeline.stage_s]
    assert flight.stage_s == tuple(stages) and flight.period_s == max(stages) and flight.binding == "board 0"
    assert flight.latency_s == pytest.approx(sum(p.timing.latency_s for p in plan.programs), rel=1e-15)
    assert flight.in_flight == streams
    for piped, region in zip(plan.programs, plan.regions):
        t = piped.timing.pipeline
        assert len(piped.mapping.pipeline.stages) == 2
        assert _in_flight_by_schedule(piped.timing.latency_s, max(t.stage_s + t.send_s)) == 3
        assert [st.mapping.system.streams for st in piped.mapping.pipeline.stages] == [streams] * 2
        assert region.state_bytes == streams * _state_held(piped)


def test_a_build_whose_dram_holds_each_region_s_own_copies_but_not_the_build_s_is_refused():
    # 56 KiB of DRAM a chip: each region's own flight (3 inputs: two copies of 16 KiB a chip in
    # DRAM) fits, the build's five do not (64 KiB)
    arch = make_system("pp-state-two-56", boards=4, pes_per_chip=4, dram_bytes=56 * 1024)
    with pytest.raises(MappingError, match=r"5 inputs in flight keep 5 copies of its state \(16384 bytes a chip each, "
                                           r"16384 of them in SRAM\): 65536 bytes of DRAM a chip needed, 57344 "
                                           r"available"):
        plan_system(_two(), arch)


def test_regions_on_one_stage_each_keep_a_copy_per_stream_of_the_build():
    # two stateful regions, each on a board of its own (one stage each, no pipeline): the boards
    # overlap, so the build keeps two inputs in flight, and each region two copies of its state;
    # its chips exchange the SRAM copy between inputs (2 x its SRAM bytes a chip at 6.4 GB/s)
    arch = make_system("state-two-boards", boards=2, pes_per_chip=4, dram_bytes=256 * 1024)
    plan = plan_system(_two(), arch)
    assert [r.stage for r in plan.regions] == [0, 1]
    streams = _build_in_flight(plan.programs)
    assert streams == 2
    for mapped, region, program in zip(plan.programs, plan.regions, _two()):
        system = mapped.mapping.system
        assert system.streams == streams and region.state_bytes == streams * region.state_sram_bytes > 0
        # per chip: both states [K, M] float32, each as the shard plan places it, in SRAM
        shapes = recorded_plan(mapped).shapes
        sram = sum(int(np.prod(shapes[t])) * 4 for t in (5, 6))
        assert region.state_sram_bytes == sram * system.chips
        # the same region under the same budget, for one stream: the same plan, no exchange
        assert region.budget.streams == streams
        one = map_program(program, arch, budget=replace(region.budget, streams=1))
        # (the candidates' latencies include each plan's exchange)
        assert replace(one.mapping, system=None) == replace(mapped.mapping, system=None)
        assert replace(one.mapping.system, candidates=()) == replace(system, streams=1, candidates=())
        assert mapped.timing.latency_s == pytest.approx(one.timing.latency_s + 2 * sram / 6.4e9, rel=1e-12)
        # the records say it: a loaded program's timing is re-derived with the exchange
        loaded = Program.from_bytes(mapped.to_bytes())
        assert loaded.mapping.system.streams == streams
        assert retime(loaded, arch, derive_tables) == mapped.timing
