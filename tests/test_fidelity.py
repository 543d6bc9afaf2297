"""The timing model against published silicon (``bench/fidelity.py``'s cases).

Every case that meets the target (modelled within +-15% of the silicon figure, in the measured
setup) is asserted here, so a change to the model that moves it out of the band fails. The cases
still outside the band are printed by the benchmark, not asserted.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import fidelity  # noqa: E402

#: Cases the model meets within the tolerance (the rest are shown by the benchmark).
WITHIN = (
    "matmul-sram-300 2048x256x256",
    "matmul-sram-300 512x256x256",
    "matmul-sram-300 4096x128x128",
    "matmul-sram-150 2048x256x256",
    "matmul-sram-150 512x256x256",
    "matmul-sram-150 4096x128x128",
    "fc-batch1 1x1024x1024",
    "tops-w-300 2048x256x256",
    "tops-w-150 2048x256x256",
    "tops-w-300 512x256x256",
)
CASES = {case.name: case for case in fidelity.cases()}


def test_cases_are_well_formed():
    assert set(WITHIN) <= set(CASES)
    # at least a third of the cases are held out (no constant was looked at against them)
    assert 3 * sum(c.held_out for c in CASES.values()) >= len(CASES)
    for case in CASES.values():
        assert case.measured > 0 and case.source and case.setup


@pytest.mark.parametrize("name", WITHIN)
def test_case_within_tolerance(name):
    value, ratio, _ = CASES[name].run()
    assert value > 0
    assert abs(ratio - 1.0) <= fidelity.TOLERANCE, f"{name}: modelled {value:.4g} vs measured {CASES[name].measured}"


def test_barrier_is_built_from_noc_packets():
    from tvm_spinn.target.arch import ArchError, SpinnArch

    arch = SpinnArch()
    # 148 PEs = 37 quad-PEs on a 7 x 6 grid of routers: 3 + 3 hops from the middle, out and back
    # at 5 cycles; 3 packets counted in a quad-PE and 36 at the root, 4 cycles each; one wake-up
    assert arch.barrier_cost_cycles(148) == 2 * 6 * 5 + (3 + 36) * 4 + 12
    # 8 PEs = 2 quad-PEs side by side: 1 hop
    assert arch.barrier_cost_cycles(8) == 2 * 1 * 5 + (3 + 1) * 4 + 12
    # more PEs, more packets: 148 and 152 PEs do not synchronise in the same time
    assert arch.barrier_cost_cycles(152) > arch.barrier_cost_cycles(148)
    # software on top (a scheduler's) adds as it is
    assert arch.replace(barrier_cycles=1000).barrier_cost_cycles(148) == arch.barrier_cost_cycles(148) + 1000
    for name, bad in (("sync_packet_cycles", 0), ("noc_link_bytes_per_cycle", 0.0), ("irq_entry_cycles", -1)):
        with pytest.raises(ArchError, match=name):
            arch.replace(**{name: bad})
    # the new fields stay out of serialized programs at their defaults
    assert not {"sync_packet_cycles", "noc_link_bytes_per_cycle", "irq_entry_cycles"} & set(arch.to_dict())
