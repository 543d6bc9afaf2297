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
