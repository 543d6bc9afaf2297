"""The system planner (``mapping.planner.plan_system``): a frozen plan, explicit budgets.

A build's regions share the system's SRAM and DRAM; the planner decides each region's budget
and maps it under that budget. References: the same regions mapped one by one with the budgets
the plan names (bytes), and a second plan of the same regions (no state kept between calls).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tvm import relax

import tvm_spinn
from tvm_spinn.codegen.lower import lower_function
from tvm_spinn.mapping import MappingError
from tvm_spinn.mapping.budget import RegionBudget, SystemState
from tvm_spinn.mapping.planner import plan_system
from tvm_spinn.mapping.schedule import map_program

#: Two chips of four PEs with little SRAM: the regions' resident weights compete for it.
ARCH = tvm_spinn.make_system("plan-test", chips=2, pes_per_chip=4, pes_per_qpe=4, sram_bytes=32 * 1024)


class _Blocks(torch.nn.Module):
    """Dense blocks of different widths separated by a host op (floor): one region each."""

    def __init__(self, widths):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for layer in self.layers:
            x = torch.floor(layer(x))
        return x


def _functions(widths=(96, 128, 64, 96)):
    torch.manual_seed(0)
    model = _Blocks(widths).eval()
    mod = tvm_spinn.partition_for_spinn(tvm_spinn.frontend.from_pytorch(model, (torch.randn(1, widths[0]),)))
    return [(str(f.attrs["global_symbol"]), f) for _, f in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint)
            if isinstance(f, relax.Function) and f.attrs is not None and f.attrs.get("Codegen") == "spinn"]


def _lowered(functions, arch=ARCH):
    return [lower_function(f, name, arch.to_dict()) for name, f in functions]


@pytest.fixture(scope="module")
def functions():
    return _functions()


def test_plan_is_frozen_and_threads_the_budgets(functions):
    programs = _lowered(functions)
    assert len(programs) == 3
    plan = plan_system(programs, ARCH)
    assert [r.symbol for r in plan.regions] == [p.symbol for p in programs]
    for record in (plan, plan.regions[0], plan.regions[0].budget, plan.final):
        with pytest.raises(dataclasses.FrozenInstanceError):
            record.stage = 5
    # the first region starts on an empty system; each later one holds what the earlier left
    assert plan.regions[0].budget.held == SystemState()
    held = [0] * ARCH.pes_per_chip
    for region in plan.regions:
        assert region.stage == 0 and region.chips >= 1
        assert list(region.budget.held.sram or [0] * ARCH.pes_per_chip) == held
        held = [a + b for a, b in zip(held, region.sram_bytes)]
    assert any(held), "no region kept a resident weight: the budgets were never tested"
    assert list(plan.final.sram) == held
    assert plan.final.dram == sum(r.dram_bytes for r in plan.regions)
    assert plan.final.weights == sum(t.nbytes for p in programs for t in p.tensors if t.role == "const")


def test_region_remapped_with_its_budget_gives_the_same_bytes(functions):
    programs = _lowered(functions)
    plan = plan_system(programs, ARCH)
    again = _lowered(functions)
    for region, program, fresh in zip(plan.regions, programs, again):
        map_program(fresh, ARCH, budget=region.budget)
        assert fresh.to_bytes() == program.to_bytes(), region.symbol
    # and without its budget (alone on the system) the last region keeps more weights resident
    alone = _lowered(functions)[-1]
    map_program(alone, ARCH)
    assert alone.memory["resident_bytes_total"] >= programs[-1].memory["resident_bytes_total"]


def test_no_state_kept_between_plans(functions):
    first = plan_system(_lowered(functions), ARCH)
    second = plan_system(_lowered(functions), ARCH)
    assert first == second
    # a plan of the last region alone starts from an empty system, whatever was planned before
    alone = plan_system(_lowered(functions)[-1:], ARCH)
    assert alone.regions[0].budget.held == SystemState()


def test_one_chip_regions_share_nothing(functions):
    chip = ARCH.replace(chips=1)
    plan = plan_system(_lowered(functions, chip), chip)
    assert all(r.budget == RegionBudget() and r.sram_bytes == () and r.dram_bytes == 0 for r in plan.regions)
    assert plan.stages == 1


def test_bad_arguments_name_the_cause(functions):
    programs = _lowered(functions)
    with pytest.raises(ValueError, match="unknown policy 'greedy'"):
        plan_system(programs, ARCH, policy="greedy")
    with pytest.raises(ValueError, match="1 onchip_inputs lists for 3 programs"):
        plan_system(programs, ARCH, onchip_inputs=[[]])


def test_too_large_build_names_its_bytes(functions):
    tiny = ARCH.replace(dram_bytes=4 * 1024)
    programs = _lowered(functions, tiny)
    with pytest.raises(MappingError, match="the model does not fit"):
        plan_system(programs, tiny)
