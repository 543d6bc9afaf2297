"""bench/sensitivity.py's table, tornado plot and efficiency on hand-made measurements."""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest

from tvm_spinn.target.arch import ASSUMPTION_RANGES


@pytest.fixture(scope="module")
def bench():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "sensitivity.py")
    spec = importlib.util.spec_from_file_location("sensitivity_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_fields_studied_have_ranges(bench):
    assert set(bench.FIELDS) <= set(ASSUMPTION_RANGES)
    assert set(bench.QUICK_FIELDS) >= {"link_payload_fraction", "board_serial_links", "barrier_cycles",
                                      "link_hop_s", "dram_bw_bytes_s", "m4f_flops_per_cycle"}


def test_table_and_tornado(bench, tmp_path):
    M = bench.Measure
    assert bench.efficiency(M(2e-3, 1e-3)) == 0.5
    assert math.isnan(bench.efficiency(M(2e-3, 0.0))) and math.isnan(bench.efficiency(M(0.0, 1e-3)))
    defaults = {"h": M(2e-3, 1e-3, 3.0)}
    span = ASSUMPTION_RANGES["barrier_cycles"]
    rows = [bench.Row("h", "barrier_cycles", span.low, span.high, M(1.5e-3, 1e-3, 2.0), None),
            bench.Row("h", "link_hop_s", 1e-7, 1e-6, M(2e-3, 1e-3), M(4e-3, 1e-3))]
    text = bench.table(defaults, rows)
    lines = text.splitlines()
    assert len(lines) == 4 and "barrier_cycles" in lines[2] and "link_hop_s" in lines[3]
    assert "1.5" in lines[2] and "n/a" in lines[2] and "0.667" in lines[2]  # 1 / 1.5 ms
    assert lines[3].split()[6] == "4"  # ms at the high end
    out = tmp_path / "t.png"
    bench.tornado(defaults, rows, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="unknown headline"):
        bench.headline("nope")
