"""bench/block_path.py's capture of the planner's stages: each stage filed under its slice form and
tiling (the mapper's tiles, or the MAC-high row tiles' candidate timed after the same form's), and
a candidate's key read back to the stage it was timed with."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from tvm_spinn.llm import board_tp


@pytest.fixture(scope="module")
def bench():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "block_path.py")
    spec = importlib.util.spec_from_file_location("block_path_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_each_stage_is_filed_under_its_form_and_tiling(bench, monkeypatch):
    """A fake planner run in the planner's order (no model planned): per degree, per form, the
    mapper's stage, then, for the forms with one, the MAC-high stage."""
    forms = [("cut", [True]), ("cut, adds fused", [True], "taken"), ("uncut", None)]
    with_mac_high = {4: (0, 1), 8: (2,)}

    def fake_records(*args, **kwargs):
        for g in (4, 8):
            board_tp.slice_block(None, None, g)
            for i, _ in enumerate(board_tp.slice_forms(None, 2)):
                board_tp._ahead_gains(f"g{g} form{i}", None, 0.0)
                if i in with_mac_high[g]:
                    board_tp._mac_high(g, i)
        return {"board_tp:g4m10": {}}

    def fake_mac_high(g, i):
        board_tp._ahead_gains(f"g{g} form{i} mac-high", None, 0.0)
        return []

    monkeypatch.setattr(board_tp, "records", fake_records)
    monkeypatch.setattr(board_tp, "slice_block", lambda cfg, spec, g: None)
    monkeypatch.setattr(board_tp, "slice_forms", lambda programs, reduces: list(forms))
    monkeypatch.setattr(board_tp, "_ahead_gains", lambda on_chip, streamed, reduce_s, *a, **k: ([0.0], 0))
    monkeypatch.setattr(board_tp, "_mac_high", fake_mac_high)
    with bench._captured() as seen:
        board_tp.records()
    assert board_tp._mac_high is fake_mac_high and board_tp.records is fake_records  # put back
    expect = {4: {(0, ""): "g4 form0", (0, "r"): "g4 form0 mac-high", (1, ""): "g4 form1",
                  (1, "r"): "g4 form1 mac-high", (2, ""): "g4 form2"},
              8: {(0, ""): "g8 form0", (1, ""): "g8 form1", (2, ""): "g8 form2", (2, "r"): "g8 form2 mac-high"}}
    assert {g: {k: v[0] for k, v in st.items()} for g, st in seen["stages"].items()} == expect
    # keys as board_tp writes them: board_tp:g<g>m<blocks a group><variant><form><tiling>
    reads = {"board_tp:g4m10": (0, ""), "board_tp:g4m10r": (0, "r"), "board_tp:g4m10pf": (1, ""),
             "board_tp:g4m10pfr": (1, "r"), "board_tp:g4m10sur": (2, "r"), "board_tp:g4m10u": (2, ""),
             "board_tp:g4m10sr": (0, "r"), "board_tp:g4m10p": (0, "")}
    for key, want in reads.items():
        assert bench._form_of(key, len(forms)) == want, key
    # every key names a captured stage of its degree and the form's pieces
    for key in ("board_tp:g4m10pfr", "board_tp:g8m5sur"):
        g = int(key.split(":g")[1].split("m")[0])
        form, tiling = bench._form_of(key, len(forms))
        assert seen["stages"][g][(form, tiling)][0] == f"g{g} form{form}" + (" mac-high" if tiling else "")
