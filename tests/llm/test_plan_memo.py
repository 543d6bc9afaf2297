"""One plan's stages share their programs' mappings (the stage memo's MappingMemo): a program
mapped under a budget it was already mapped under is not mapped again, and every stage is the
one a fresh mapping gives."""

from __future__ import annotations

import importlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tvm_spinn.llm import board_tp  # noqa: E402
from tvm_spinn.llm.describe import describe  # noqa: E402
from tvm_spinn.llm.spec import spec_of  # noqa: E402
from tvm_spinn.mapping import system as mapping_system  # noqa: E402
from tvm_spinn.mapping.schedule import MappingMemo  # noqa: E402
from tvm_spinn.target import arch_of  # noqa: E402

P = importlib.import_module("tvm_spinn.llm.plan")

SEQ = 256


@pytest.fixture(scope="module")
def pieces():
    """A small Llama block's decode step cut into pieces where the boards all-reduce (as
    ``board_tp`` maps a slice), and the host's shapes."""
    cfg = dict(model_type="llama", hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
               head_dim=64, intermediate_size=256, vocab_size=256, max_position_embeddings=SEQ, rms_norm_eps=1e-5)
    spec = spec_of(cfg)
    parts = P._parts(P._meta_model(cfg, spec), spec, 1, SEQ)
    dec = [d.program for d in describe(parts[0][1], parts[0][2], "spinn/board", "int8")]
    host = {tuple(int(x) for x in a.shape) for a in parts[0][2][1:]}
    got, ends = board_tp.slice_forms(dec, board_tp.block_all_reduces(spec))[0]
    assert ends is not None and len(got) >= 3
    return list(got), host


def _counting(monkeypatch) -> list:
    """Count the shard plans the mapper times (each a mapping of the program on the chips)."""
    calls = []
    original = mapping_system._time_plan

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(mapping_system, "_time_plan", counted)
    return calls


def test_a_stage_reuses_the_mappings_of_the_programs_it_shares_with_an_earlier_one(monkeypatch, pieces):
    programs, host = pieces
    board = arch_of("spinn/board")
    calls = _counting(monkeypatch)
    # fresh: every stage maps all its programs
    alone_first = P._map_stage(programs[:2], board, host, SEQ)
    n_first = len(calls)
    alone_second = P._map_stage(programs[:3], board, host, SEQ)
    n_second = len(calls) - n_first
    # one memo: the longer stage's first two programs are mapped under the budgets the shorter
    # stage mapped them under (the same ledger before each), so only its third is mapped
    memo: dict = {}
    calls.clear()
    first = P._map_stage(programs[:2], board, host, SEQ, memo=memo)
    assert len(calls) == n_first
    assert isinstance(memo[P._MAPPINGS], MappingMemo)
    calls.clear()
    second = P._map_stage(programs[:3], board, host, SEQ, memo=memo)
    third_alone = n_second - n_first
    assert 0 < len(calls) == third_alone < n_second
    # and the stages are the ones mapped without the memo
    assert repr(first) == repr(alone_first)
    assert repr(second) == repr(alone_second)
