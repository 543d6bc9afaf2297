"""Timing of the pipeline axis: each cut's sends on the link graph, each stage's latency, the
steady-state period and the latency of one input, checked against hand computations on small
meshes (a send of ``n`` bytes over one chip link: ``n / payload rate + one hop latency``) and,
for a region the system mapper cuts over three boards, against each stage mapped alone."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tvm_spinn.mapping import shard as S
from tvm_spinn.mapping.stages import stage_programs_of
from tvm_spinn.mapping import map_program
from tvm_spinn.program.ops.sharding import Mesh
from tvm_spinn.program.records import PlanCollective
from tvm_spinn.target.arch import make_system
from tvm_spinn.target.topology import topology_of
from tvm_spinn.timing.collectives import point_to_point
from tvm_spinn.timing.stages import HandoverCost, handover_costs, pipeline_timing

from _chains import F32, chain, residual
from _stages import stage_plans, stage_ranks

ARCH = make_system("pp-timing", chips=4, pes_per_chip=32)


def _send(layer, stage, seconds):
    return HandoverCost(layer=layer, stage=stage, tensors=(0,), nbytes=1, seconds=seconds, hops=1, board_hops=0)


# -- composition -------------------------------------------------------------------------------
def test_period_and_latency_by_hand():
    # stages of 3, 5 and 2 us; sends of 1 us (into stage 1) and 7 us (into stage 2)
    t = pipeline_timing((3e-6, 5e-6, 2e-6), (_send(2, 1, 1e-6), _send(4, 2, 7e-6)))
    assert t.latency_s == pytest.approx(3e-6 + 1e-6 + 5e-6 + 7e-6 + 2e-6, rel=1e-15)
    assert (t.period_s, t.binding) == (7e-6, "send 4")
    assert t.throughput_inf_s == pytest.approx(1 / 7e-6)
    # a short send: the slowest stage binds; ties go to the first stage
    assert (pipeline_timing((3e-6, 5e-6), (_send(2, 1, 1e-6),)).binding) == "stage 1"
    assert pipeline_timing((4e-6, 4e-6), (_send(1, 1, 4e-6),)).binding == "stage 0"
    one = pipeline_timing((2.5e-6,))
    assert (one.period_s, one.latency_s, one.handovers) == (2.5e-6, 2.5e-6, ())


@pytest.mark.parametrize("stage_s, sends, match", [
    ((), (), "at least one stage"),
    ((1e-6, -1e-9), (), r"stage 1 takes -1e-09 s"),
    ((1e-6, math.nan), (), r"stage 1 takes nan s"),
    ((1e-6, 1e-6), (_send(1, 1, math.inf),), r"send before layer 1 takes inf s"),
    ((1e-6, 1e-6), (_send(1, 2, 1e-6),), r"send before layer 1 goes to stage 2 of 2"),
])
def test_bad_pipeline_inputs_are_named(stage_s, sends, match):
    with pytest.raises(ValueError, match=match):
        pipeline_timing(stage_s, sends)


def test_bad_hand_overs_are_named():
    topo = topology_of(ARCH)
    send = PlanCollective(2, "send", 4, 128, True, "pp", (4, 8))
    with pytest.raises(ValueError, match="expected send records, got 'all_gather' before layer 2"):
        handover_costs(topo, [PlanCollective(2, "all_gather", 4, 128, True)], (0, 0, 1), [[0], [1]])
    with pytest.raises(ValueError, match="before layer 1, which does not start a stage"):
        handover_costs(topo, [PlanCollective(1, "send", 4, 128, True, "pp")], (0, 0, 1), [[0], [1]])
    with pytest.raises(ValueError, match="every stage needs as many chips"):
        handover_costs(topo, [send], (0, 0, 1), [[0], [1, 2]])
    with pytest.raises(ValueError, match="a chip is in two stages"):
        handover_costs(topo, [send], (0, 0, 1), [[0], [0]])
    with pytest.raises(ValueError, match="layer 2 is in stage 1, but ranks name 1 stages"):
        handover_costs(topo, [send], (0, 0, 1), [[0]])


# -- the sends ---------------------------------------------------------------------------------
# (mesh, per cut: (layer, stage, tensor names, bytes one chip sends)) of residual on ARCH
SENDS = [
    (Mesh.of(pp=2), [(2, 1, ("z", "h"), (32 + 64) * F32)]),
    (Mesh.of(pp=3), [(1, 1, ("z",), 32 * F32), (3, 2, ("z", "a"), (32 + 64) * F32)]),
]


@pytest.mark.parametrize("mesh, cuts", SENDS, ids=["pp2", "pp3"])
def test_sends_priced_by_hand_on_one_chip_link(mesh, cuts):
    program = residual()
    plan = S.plan_mesh(program, mesh)
    ranks = stage_ranks(ARCH, plan)
    assert [r.tolist() for r in ranks] == [[s] for s in range(mesh.chips)]  # a chip per stage
    topo = topology_of(ARCH)
    got = handover_costs(topo, plan.handovers, plan.stages, ranks)
    names = [t.name for t in program.tensors]
    assert [(h.layer, h.stage, tuple(names[t] for t in h.tensors), h.nbytes) for h in got] == cuts
    for h in got:
        # chip s - 1 and chip s are neighbours on the board: one link, one hop
        assert len(topo.route(h.stage - 1, h.stage)) == 1 and (h.hops, h.board_hops) == (1, 0)
        assert h.seconds == pytest.approx(h.nbytes / ARCH.payload_bw("chip") + ARCH.link_hop_s, rel=1e-12)


def test_sends_of_a_tensor_parallel_stage_go_position_to_position():
    program = residual()
    plan = S.plan_mesh(program, Mesh.of(tp=2, pp=2))
    ranks = stage_ranks(ARCH, plan)
    assert [r.tolist() for r in ranks] == [[0, 1], [2, 3]]
    (h,) = handover_costs(topology_of(ARCH), plan.handovers, plan.stages, ranks)
    assert h.nbytes == 2 * 32 * F32  # z whole (gathered before fc1), h's 8 columns (see test_pipeline_axis)
    ref = point_to_point(topology_of(ARCH), [0, 1], [2, 3], float(h.nbytes))
    assert (h.seconds, h.hops) == (ref.seconds, ref.hops)
    # two boards, a stage each: the same chips of each board, the send crosses a board edge
    boards = make_system("pp-timing-boards", boards=2, pes_per_chip=32)
    ranks = stage_ranks(boards, plan)
    per_board = boards.chips_per_board
    assert [r.tolist() for r in ranks] == [[0, 1], [per_board, per_board + 1]]
    (h,) = handover_costs(topology_of(boards), plan.handovers, plan.stages, ranks)
    assert h.board_hops >= 1


def test_stages_that_do_not_fit_the_system_are_refused():
    plan = S.plan_mesh(residual(), Mesh.of(tp=2, pp=3))
    with pytest.raises(ValueError, match=r"3 stages of 2 chips need 6 chips; pp-timing has 4"):
        stage_ranks(ARCH, plan)


# -- the stages --------------------------------------------------------------------------------
@pytest.mark.parametrize("mesh", [Mesh.of(tp=2, pp=3), Mesh.of(tp=2, sp=2, pp=2), Mesh.of(dp=2, pp=2)],
                         ids=["tp2pp3", "tp2sp2pp2", "dp2pp2"])
def test_stage_plans_are_the_plan_cut_at_the_stages(mesh):
    program = residual()
    plan = S.plan_mesh(program, mesh)
    progs, plans = S.stage_programs(program, plan), stage_plans(program, plan)
    assert len(progs) == len(plans) == mesh.size("pp")
    by_name = {t.name: tid for tid, t in enumerate(program.tensors)}
    count = 0
    for s, (prog, sub) in enumerate(zip(progs, plans)):
        lo = plan.stages.index(s)
        assert sub.pp == 1 and sub.chips == plan.chips // plan.pp and sub.handovers == ()
        assert sub.splits == plan.splits[lo:lo + len(prog.layers)]
        # every tensor of the stage's shard has the shape one chip holds of it in the whole plan
        shard = S.shard_program(prog, sub)
        for k, t in enumerate(prog.tensors):
            assert tuple(shard.tensors[k].shape) == plan.shapes[by_name[t.name]]
        count += len(sub.collectives)
        for c in sub.collectives:
            whole = [x for x in plan.collectives if x.op == c.op and program.tensors[x.tensor].name == prog.tensors[c.tensor].name]
            assert whole and any(x.layer - lo == c.layer or x.layer >= len(program.layers) for x in whole)
    assert count == len(plan.collectives)


def test_stage_latencies_compose_into_the_pipeline():
    # six layers of 4 MiB of weights on boards whose chips hold 8 KiB of DRAM: a board holds 2
    # of them, so the system mapper cuts the region into three stages, a board each
    arch = make_system("pp-timing-3", boards=3, pes_per_chip=4, dram_bytes=8 * 1024)
    board, per = arch.replace(chips=arch.chips_per_board), arch.chips_per_board
    piped = map_program(chain(6), arch)
    pipe, t = piped.mapping.pipeline, piped.timing.pipeline
    assert [(s.first_layer, s.layers) for s in pipe.stages] == [(0, 2), (2, 2), (4, 2)]
    assert [s.chips for s in pipe.stages] == [tuple(range(k * per, (k + 1) * per)) for k in range(3)]
    # each stage: its program mapped alone on a board of its own, as any region is
    for prog, got in zip(stage_programs_of(piped), t.stage_s):
        alone = map_program(replace(prog, mapping=None), board)
        assert alone.mapping == prog.mapping and alone.timing.latency_s == got > 0
    # each send: one row of 1024 floats from a stage's first chip to the next's, by hand
    topo = topology_of(arch)
    for k, (send, seconds) in enumerate(zip(pipe.sends, t.send_s)):
        assert (send.layer, send.nbytes) == (2 * (k + 1), 1024 * F32)
        assert seconds == point_to_point(topo, [k * per], [(k + 1) * per], float(1024 * F32)).seconds > 0
    assert t.latency_s == pytest.approx(sum(t.stage_s) + sum(t.send_s), rel=1e-15)
    assert t.period_s == max(t.stage_s + t.send_s) < t.latency_s
    assert piped.timing.latency_s == t.latency_s
