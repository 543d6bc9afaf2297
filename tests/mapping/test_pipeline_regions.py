"""Any region of a build that no board holds is mapped over pipeline stages, on the boards the
build has left, and a system with dead hardware cuts it over its whole boards.

References: each stage's program mapped alone on a healthy board (the mapping and latency it
must carry), the send priced by :func:`~tvm_spinn.timing.collectives.point_to_point` between the
stages' first chips on the system's own link graph (around dead boards), and the functional
simulator's output of the whole program (the bits the stages must give).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tvm_spinn.mapping import MappingError, map_program
from tvm_spinn.mapping.planner import plan_system
from tvm_spinn.mapping.stages import stage_programs_of
from tvm_spinn.report.report import system_summary
from tvm_spinn.runtime.simulator import run_program
from tvm_spinn.target.arch import make_system
from tvm_spinn.target.topology import topology_of
from tvm_spinn.timing.collectives import point_to_point

from _chains import build_and_run, chain

K = 1024
PER = 48  # chips a board
# boards of 48 chips, 4 PEs and 8 KiB of DRAM a chip: a board holds 2 of chain()'s four
# 1024 x 1024 float32 layers (4 MiB each), so chain() needs two boards and chain(2, 256) a part of one
SMALL = dict(pes_per_chip=4, dram_bytes=8 * 1024)


def _system(name, boards, **faults):
    arch = make_system(name, boards=boards, **SMALL)
    return arch.replace(**faults) if faults else arch


def _board(arch):
    """One healthy board of ``arch`` as a system of its own."""
    return make_system(arch.name, boards=1, **SMALL)


def _check_pipeline(program, arch, boards, handed_from=None):
    """``program`` is mapped over one stage per board of ``boards``, in order: each stage's
    mapping and latency those of its program alone on a healthy board, the sends priced
    between the stages' first chips on ``arch``'s link graph; its inputs handed over from
    board ``handed_from`` (None: none) to its first stage's."""
    pipe, t = program.mapping.pipeline, program.timing.pipeline
    assert pipe is not None and program.mapping.system is None
    assert [s.chips for s in pipe.stages] == [tuple(range(b * PER, (b + 1) * PER)) for b in boards]
    board = _board(arch)
    for stage, got in zip(stage_programs_of(program), t.stage_s):
        alone = map_program(replace(stage, mapping=None), board)
        assert alone.mapping == stage.mapping and alone.timing.latency_s == got > 0
    topo = topology_of(arch)
    ref = [point_to_point(topo, [a * PER], [b * PER], float(s.nbytes)).seconds
           for a, b, s in zip(boards, boards[1:], pipe.sends)]
    assert t.send_s == tuple(ref)
    assert t.latency_s == pytest.approx(sum(t.stage_s) + sum(t.send_s), rel=1e-15)
    inputs = sum(program.tensors[i].nbytes for i in program.inputs)
    hand = point_to_point(topo, [handed_from * PER], [boards[0] * PER], float(inputs)).seconds \
        if handed_from is not None else 0.0
    assert program.timing.latency_s == pytest.approx(t.latency_s + hand, rel=1e-15)
    assert program.timing.throughput_inf_s == pytest.approx(1 / max(t.period_s, hand), rel=1e-15)


def _same_bits(program, mapped):
    """``mapped`` (``program`` over stages) computes the unmapped ``program``'s bits."""
    x = np.random.default_rng(3).standard_normal((1, K)).astype(np.float32)
    (whole,) = run_program(program, [x])
    assert np.array_equal(run_program(mapped, [x])[0], whole)


# -- a build's later regions --------------------------------------------------------------------
def test_a_second_region_no_board_holds_is_pipelined_on_the_boards_after_the_first():
    arch = _system("pp-regions-3", 3)
    small, big = chain(2, 256, symbol="small"), chain(symbol="big")
    plan = plan_system([small, big], arch)
    assert plan.policy == "in_order"  # a region over stages moves the build's stage: in dataflow order
    first, second = plan.regions
    assert (first.stage, plan.programs[0].mapping.pipeline) == (0, None)
    assert first.chips == plan.programs[0].mapping.system.chips > 1
    _check_pipeline(plan.programs[1], arch, [1, 2], handed_from=0)
    # the region's chips: its stages' shard-plan groups (each stage's plan alone on a board)
    groups = [map_program(replace(s, mapping=None), _board(arch)).mapping.system.chips
              for s in stage_programs_of(plan.programs[1])]
    assert (second.stage, second.chips, plan.stages) == (2, sum(groups), 3)
    _same_bits(big, plan.programs[1])
    # the same region first in its build takes boards 0 and 1, with the same stages
    alone = plan_system([big], arch)
    _check_pipeline(alone.programs[0], arch, [0, 1])
    assert alone.regions[0].chips == second.chips and alone.regions[0].stage == 1
    assert [s.mapping for s in alone.programs[0].mapping.pipeline.stages] == \
        [s.mapping for s in plan.programs[1].mapping.pipeline.stages]


def test_two_regions_no_board_holds_take_two_boards_each():
    arch = _system("pp-regions-4", 4)
    plan = plan_system([chain(symbol="a"), chain(seed=8, symbol="b")], arch)
    _check_pipeline(plan.programs[0], arch, [0, 1])
    _check_pipeline(plan.programs[1], arch, [2, 3], handed_from=1)
    assert [r.stage for r in plan.regions] == [1, 3]


def test_the_next_region_goes_on_on_the_last_stages_board_after_what_it_holds():
    arch = _system("pp-regions-3a", 3)
    plan = plan_system([chain(2, 256, symbol="before"), chain(symbol="big"), chain(2, 256, seed=9, symbol="after")],
                       arch)
    _check_pipeline(plan.programs[1], arch, [1, 2], handed_from=0)
    # reference: the last stage's program alone on a board, what it holds there
    last = stage_programs_of(plan.programs[1])[-1]
    held = plan_system([replace(last, mapping=None)], _board(arch), policy="in_order").final
    after = plan.regions[2]
    assert (after.stage, after.budget.held.stage) == (2, 2)
    assert (after.budget.held.sram, after.budget.held.dram) == (held.sram, held.dram) and any(held.sram)
    assert plan.programs[2].mapping.system.stage == 2
    # its resident weights go on top of the last stage's
    assert plan.final.sram == tuple(a + b for a, b in zip(held.sram, after.sram_bytes))


def _board_bytes(arch):
    """What a board's chips hold: DRAM and every PE's SRAM."""
    return PER * (arch.dram_bytes + arch.pes_per_chip * arch.tile_sram_bytes)


def _refusal(region, weights, need, left):
    """The refusal naming ``region``, the whole boards ``left`` to it and the ``need`` it has at least."""
    return (rf"first program over: {region}\); no board holds region {region}: over pipeline stages \(a whole board "
            rf"each\) it needs at least {need} boards \(its {weights} bytes of weights, \d+ bytes a board holds; "
            rf"more than the boards it was tried on\), and {len(left)} whole board\(s\) were left to it "
            rf"\({', '.join(map(str, left)) or 'none'}\)$")


def test_a_region_no_board_left_holds_is_refused():
    # the pipelined region ends on the last board: a 12-layer region after it has no board left;
    # its 48 MiB of weights need at least 3 boards of 48 chips (4 PEs, 8 KiB of DRAM)
    arch = _system("pp-regions-3b", 3)
    big2 = chain(12, seed=9, symbol="big2")
    weights = sum(t.nbytes for t in big2.tensors if t.role == "const")
    assert weights == 12 * K * K * 4 and -(-weights // _board_bytes(arch)) == 3 > 2
    with pytest.raises(MappingError, match=_refusal("big2", weights, 3, [])):
        plan_system([chain(2, 256, symbol="before"), chain(symbol="big"), big2], arch)
    # two boards: the second region has one board left (board 1), where no stage cut fits: it
    # needs more than that one (its 16 MiB alone: one board)
    arch = _system("pp-regions-2", 2)
    assert -(-4 * K * K * 4 // _board_bytes(arch)) == 1
    with pytest.raises(MappingError, match=_refusal("big", 4 * K * K * 4, 2, [1])):
        plan_system([chain(2, 256, symbol="before"), chain(symbol="big")], arch)


# -- systems with faults ------------------------------------------------------------------------
def test_a_dead_board_is_stepped_over():
    arch = _system("pp-dead-board", 3, dead_boards=(1,))
    program = map_program(chain(), arch)
    _check_pipeline(program, arch, [0, 2])  # the send routed on the links left
    _same_bits(chain(), program)


def test_a_board_with_a_dead_chip_holds_no_stage():
    # board 0 has a dead chip: the stages take the whole boards 1 and 2
    arch = _system("pp-dead-chip", 3, dead_chips=(5,))
    program = map_program(chain(), arch)
    _check_pipeline(program, arch, [1, 2])
    _same_bits(chain(), program)
    # with one whole board left there is no pipeline of whole boards
    with pytest.raises(MappingError, match="does not fit pp-dead-chip-2 .*" + _refusal("main", 4 * K * K * 4, 2, [1])):
        map_program(chain(), _system("pp-dead-chip-2", 2, dead_chips=(5,)))


def test_a_dead_board_before_a_later_region():
    # board 1 dead: the first region on board 0, the second over boards 2 and 3
    arch = _system("pp-dead-later", 4, dead_boards=(1,))
    plan = plan_system([chain(2, 256, symbol="small"), chain(symbol="big")], arch)
    assert plan.regions[0].stage == 0
    _check_pipeline(plan.programs[1], arch, [2, 3], handed_from=0)
    assert plan.regions[1].stage == 2  # the third usable board


def test_the_summary_keys_stages_and_regions_by_board_on_a_system_with_faults():
    # board 1 dead: the chain over boards 0 and 2, the next region after it on board 2 (the
    # second usable board, its stage 1): both count on board 2
    arch = _system("pp-dead-summary", 3, dead_boards=(1,))
    plan = plan_system([chain(symbol="big"), chain(2, 256, seed=9, symbol="after")], arch)
    big, after = plan.programs
    _check_pipeline(big, arch, [0, 2])
    # the region goes on on the chain's last stage (its board: 2)
    assert [r.stage for r in plan.regions] == [1, 1] and after.mapping.system.stage == 1
    summary = system_summary(plan.programs, arch)
    first, last = big.timing.pipeline.stage_s
    # two boards in use (one replica of the 3-board system): the slower one binds
    assert (summary["stages"], summary["replicas"], summary["chips_per_replica"]) == (2, 1, 2 * PER)
    assert summary["throughput_inf_s"] == pytest.approx(1 / max(first, last + after.timing.latency_s), rel=1e-12)
    assert last + after.timing.latency_s > first


# -- a build -------------------------------------------------------------------------------------
def test_a_build_whose_second_region_no_board_holds(register_system):
    torch = pytest.importorskip("torch")

    import tvm_spinn

    class TwoRegions(torch.nn.Module):
        """A dense layer, a host op (floor), then four dense layers: two regions, the second
        no board holds."""

        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(K, K, bias=False)
            self.fc = torch.nn.ModuleList(torch.nn.Linear(K, K, bias=False) for _ in range(4))

        def forward(self, x):
            x = torch.floor(4 * torch.relu(self.head(x)))
            for i, fc in enumerate(self.fc):
                x = fc(x)
                x = torch.relu(x) if i % 2 == 0 else x
            return x

    torch.manual_seed(0)
    x = torch.randn(1, K)
    mod = tvm_spinn.frontend.from_pytorch(TwoRegions().eval(), (x,))

    def run(target):
        return build_and_run(mod, x.numpy(), target)

    arch = _system("pp-regions-build", 3)
    ex, got = run(register_system(arch))
    rep = tvm_spinn.report(ex)
    assert rep.regions == 2
    (row,) = rep.pipelines
    assert (row["stages"], row["chips"]) == (2, [PER, PER])
    piped = next(p for p in rep.programs if p.mapping.pipeline is not None)
    first = next(p for p in rep.programs if p.mapping.pipeline is None)
    assert [s.chips for s in piped.mapping.pipeline.stages] == [tuple(range(PER, 2 * PER)), tuple(range(2 * PER, 3 * PER))]
    assert first.mapping.system.stage == 0
    # a stream of inputs: each board works on its own, the slowest one binds (one replica: 3 boards)
    assert rep.throughput_inf_s == pytest.approx(1 / max(first.timing.latency_s, *piped.timing.pipeline.stage_s),
                                                 rel=1e-12)
    assert rep.latency_s == pytest.approx(first.timing.latency_s + piped.timing.latency_s, rel=1e-12)
    # the same bits as on one chip whose DRAM holds the whole model, close to llvm's
    _, one = run(register_system(make_system("pp-regions-roomy", chips=1, pes_per_chip=4)))
    assert np.array_equal(got, one)
    _, ref = run("llvm")
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_the_summary_counts_replicas_on_what_works():
    # one region on one board: a healthy 3-board system holds replicas on all its chips, the
    # same system with board 1 dead only on its two live boards' chips
    program = chain(2, 256, seed=9, symbol="small")
    for dead, boards_alive in (((), 3), ((1,), 2)):
        arch = _system(f"replicas-dead-{len(dead)}", 3, **({"dead_boards": dead} if dead else {}))
        plan = plan_system([program], arch)
        (p,) = plan.programs
        assert p.mapping.pipeline is None and p.mapping.system.stage == 0
        summary = system_summary(plan.programs, arch)
        live = boards_alive * PER
        group = p.mapping.system.chips
        assert summary["stages"] == 1 and summary["chips_per_replica"] == group
        assert summary["replicas"] == max(1, live // group)
        assert summary["throughput_inf_s"] == pytest.approx(live / (p.timing.latency_s * group), rel=1e-12)
