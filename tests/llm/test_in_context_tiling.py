"""A tensor-parallel slice's tiling ranked by its streamed block's time with the weights it lets
the DRAM channels fetch ahead, not by each piece's time alone.

Llama-2-70B int8 (batch 1, 2,048 slots) on 8 boards: blocks tensor-parallel over 4 boards, most
of them streaming their weights. With register-block row tiles, the attention piece (8 query
heads a KV head: 8-row fp32 matmuls) is fastest alone on half the board's chips, each then
reading twice its share of the KV cache from its own DRAM: its channels idle for less of its
run, they fetch less of the MLP's weights ahead, and the streamed block is slower than with the
MAC-high row tiles that keep the attention on every chip.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_spinn  # noqa: E402
from tvm_spinn.llm import board_tp  # noqa: E402
from tvm_spinn.llm.plan import plan  # noqa: E402

CONFIG = os.path.join(os.path.dirname(tvm_spinn.__file__), "llm", "configs", "llama-2-70b.json")


@pytest.mark.slow  # ~60 CPU s: one Llama-2-70B plan on 8 boards
def test_the_streamed_block_takes_the_tiling_faster_in_context(register_system, monkeypatch):
    calls, inside = [], []
    variants, mac_high = board_tp._block_variants, board_tp._mac_high

    def record_variants(resident, streamed, fit, fit_ahead, saved, *rest):
        calls.append((bool(inside), streamed, saved))
        return variants(resident, streamed, fit, fit_ahead, saved, *rest)

    def record_mac_high(*args, **kwargs):
        inside.append(True)
        try:
            return mac_high(*args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(board_tp, "_block_variants", record_variants)
    monkeypatch.setattr(board_tp, "_mac_high", record_mac_high)
    records, board_records = {}, board_tp.records

    def record_records(*args, **kwargs):
        out = board_records(*args, **kwargs)
        records.update(out)
        return out

    monkeypatch.setattr(board_tp, "records", record_records)
    target = register_system(tvm_spinn.make_system("spinn2-8-boards-tiling", boards=8), tag="spinn/tiling-8")
    result = plan(CONFIG, target=target, batch=1, seq=2048, dtype="int8")
    kept = [k for k in result.plan["alternatives"] if k.startswith("board_tp")]
    assert result.plan["placement"] == "board_tp" and result.plan["tp_boards"] == 4
    # the kept candidate streams its blocks with the MAC-high row tiles
    assert kept and kept[0].endswith("r"), kept
    assert "MAC-high row tiles" in result.plan["description"]
    # the plan records the tiling its streamed blocks run with: MappingOptions(row_tiles=False)
    # for the MAC-high candidates, the mapper's default (no key) for the others
    assert result.plan["mapping_row_tiles"] is False
    tilings = {k: r["meta"].get("mapping_row_tiles", True) for k, r in records.items()}
    assert tilings == {k: not k.endswith("r") for k in records}, tilings
    assert any(k.endswith("r") for k in records)
    # each MAC-high slice right after the mapper's of the same form: alone, the mapper's pieces
    # are the faster (its tiles are the fastest for each piece), with the weights fetched ahead
    # the MAC-high block is; a slice with nothing to fetch ahead has no MAC-high candidate
    pairs = [(a, b) for a, b in zip(calls, calls[1:]) if not a[0] and b[0]]
    assert pairs
    assert any(b[1].latency_s > a[1].latency_s and b[1].latency_s - b[2] < a[1].latency_s - a[2] for a, b in pairs)
    assert any(len(a[1].program_plans) == len(b[1].program_plans) and a[1].program_plans != b[1].program_plans
               for a, b in pairs)
