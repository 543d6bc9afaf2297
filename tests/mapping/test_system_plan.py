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
from tvm_spinn.mapping.memory import LEDGER_RESIDENT_SHARE
from tvm_spinn.mapping.planner import _benefit_order, plan_system
from tvm_spinn.mapping.schedule import map_program

#: Two chips of four PEs with little SRAM: the regions share it for their resident weights.
ARCH = tvm_spinn.make_system("plan-test", chips=2, pes_per_chip=4, pes_per_qpe=4, sram_bytes=48 * 1024)


class _Blocks(torch.nn.Module):
    """Dense blocks of different widths separated by a host op (floor): one region each."""

    def __init__(self, widths):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for layer in self.layers:
            x = torch.floor(layer(x))
        return x


def _functions(widths=(96, 128, 64, 96), batch=1):
    torch.manual_seed(0)
    model = _Blocks(widths).eval()
    mod = tvm_spinn.partition_for_spinn(tvm_spinn.frontend.from_pytorch(model, (torch.randn(batch, widths[0]),)))
    return [(str(f.attrs["global_symbol"]), f) for _, f in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint)
            if isinstance(f, relax.Function) and f.attrs is not None and f.attrs.get("Codegen") == "spinn"]


def _lowered(functions, arch=ARCH):
    return [lower_function(f, name, arch) for name, f in functions]


@pytest.fixture(scope="module")
def functions():
    return _functions()


def test_plan_is_frozen_and_threads_the_budgets_in_order(functions):
    programs = _lowered(functions)
    assert len(programs) == 3
    given = [p.to_bytes() for p in programs]
    plan = plan_system(programs, ARCH, policy="in_order")
    assert [r.symbol for r in plan.regions] == [p.symbol for p in programs] == [p.symbol for p in plan.programs]
    # the plan holds new mapped programs; the regions given are left as they were
    assert [p.to_bytes() for p in programs] == given
    assert all(p.mapping is None and q.mapping is not None for p, q in zip(programs, plan.programs))
    assert all(p is not q for p, q in zip(programs, plan.programs))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.programs[0].layers[0].flops = 0
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


@pytest.mark.parametrize("policy", ["in_order", "benefit"])
def test_region_remapped_with_its_budget_gives_the_same_bytes(functions, policy):
    programs = _lowered(functions)
    plan = plan_system(programs, ARCH, policy=policy)
    programs = plan.programs
    again = _lowered(functions)
    for region, program, fresh in zip(plan.regions, programs, again):
        fresh = map_program(fresh, ARCH, budget=region.budget)
        assert fresh.to_bytes() == program.to_bytes(), region.symbol
    # and without its budget (alone on the system) the last region keeps more weights resident
    alone = _lowered(functions)[-1]
    alone = map_program(alone, ARCH)
    assert alone.memory.resident_bytes_total >= programs[-1].memory.resident_bytes_total


def _decisions(plan):
    """Per symbol, what the plan decided for the region and the region's bytes (not the running
    DRAM total, which only checks capacity)."""
    out = {}
    for region, program in zip(plan.regions, plan.programs):
        out[region.symbol] = (region.budget.held.sram, region.stage, region.chips, region.sram_bytes,
                              region.dram_bytes, program.to_bytes())
    return out


def test_benefit_plan_does_not_depend_on_the_order_of_the_regions(functions):
    plans = plan_system(_lowered(functions), ARCH), plan_system(_lowered(functions)[::-1], ARCH)
    assert [p.policy for p in plans] == ["benefit", "benefit"]  # no fallback to in_order
    a, b = _decisions(plans[0]), _decisions(plans[1])
    assert a == b
    # in order, the first region given takes the SRAM: the plans differ with the order
    forward, backward = _lowered(functions), _lowered(functions)[::-1]
    c = _decisions(plan_system(forward, ARCH, policy="in_order"))
    d = _decisions(plan_system(backward, ARCH, policy="in_order"))
    assert c != d
    # the regions' resident weights together stay within the memory plans' cap on every PE
    plan = plan_system(_lowered(functions), ARCH)
    cap = int(ARCH.tile_sram_bytes * LEDGER_RESIDENT_SHARE)
    used = [sum(col) for col in zip(*(r.sram_bytes for r in plan.regions))]
    assert max(used) <= cap
    for region in plan.regions:
        assert all(b <= cap - h for b, h in zip(region.sram_bytes, region.budget.held.sram))


def test_benefit_order_puts_weight_bound_regions_first(functions):
    """A batch of 8 does 8x the operations per weight byte of a batch of 1: its regions gain
    less from resident weights and come last, whatever order the regions are given in."""
    ones = _lowered(functions)
    eights = _lowered(_functions(batch=8))
    orders = []
    for given in (ones + eights, eights + ones, eights[::-1] + ones[::-1]):
        order = [given[i] for i in _benefit_order(given, ARCH)]
        assert set(map(id, order[:len(ones)])) == set(map(id, ones))
        orders.append([id(p) for p in order])
    assert orders[0] == orders[1] == orders[2]


def test_no_state_kept_between_plans(functions):
    first = plan_system(_lowered(functions), ARCH)
    second = plan_system(_lowered(functions), ARCH)
    assert first == second
    # a plan of the last region alone starts from an empty system, whatever was planned before
    alone = plan_system(_lowered(functions)[-1:], ARCH)
    held = alone.regions[0].budget.held
    assert not any(held.sram) and held.dram == 0 and held.stage == 0


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
    tiny = ARCH.replace(dram_bytes=1024, sram_bytes=32 * 1024)
    programs = _lowered(functions, tiny)
    with pytest.raises(MappingError, match="the model does not fit"):
        plan_system(programs, tiny)
