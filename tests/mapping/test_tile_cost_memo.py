"""A layer's tile table is costed once while a :class:`TileCostMemo` is active: the stages one
plan maps (the LLM planner's stage memo holds one) get the tables a fresh costing gives, and
fewer tables are costed."""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tvm_spinn.llm.describe import describe  # noqa: E402
from tvm_spinn.llm.spec import spec_of  # noqa: E402
from tvm_spinn.mapping import tiling  # noqa: E402
from tvm_spinn.mapping.tiling import TileCostMemo, choose_tile, program_work, tile_costs  # noqa: E402
from tvm_spinn.target import arch_of  # noqa: E402

P = importlib.import_module("tvm_spinn.llm.plan")

SEQ = 256


@pytest.fixture(scope="module")
def block():
    """A small Llama block's decode step (int8) and the host's shapes."""
    cfg = dict(model_type="llama", hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
               head_dim=64, intermediate_size=256, vocab_size=256, max_position_embeddings=SEQ, rms_norm_eps=1e-5)
    spec = spec_of(cfg)
    parts = P._parts(P._meta_model(cfg, spec), spec, 1, SEQ)
    programs = [d.program for d in describe(parts[0][1], parts[0][2], "spinn/board", "int8")]
    host = {tuple(int(x) for x in a.shape) for a in parts[0][2][1:]}
    return programs, host


def _costed(monkeypatch) -> list:
    """Count the tile tables actually costed (the memo's misses and every call without it)."""
    calls = []
    original = tiling._tile_costs

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(tiling, "_tile_costs", counted)
    return calls


def _tables_equal(a, b) -> bool:
    return all(np.array_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))


def test_stages_mapped_with_the_plan_memo_equal_fresh_ones_and_cost_fewer_tables(monkeypatch, block):
    programs, host = block
    board = arch_of("spinn/board")
    calls = _costed(monkeypatch)
    # fresh: every table of every shard plan and layout is costed
    fresh = [P._map_stage(programs, board, host, SEQ, weights=w) for w in ("auto", "stream")]
    n_fresh = len(calls)
    calls.clear()
    memo: dict = {}
    shared = [P._map_stage(programs, board, host, SEQ, weights=w, memo=memo) for w in ("auto", "stream")]
    tiles = memo[P._TILES]
    assert isinstance(tiles, TileCostMemo)
    # the same stages (their latencies, bounds, plans and timings), from fewer costed tables:
    # the shard plans and layouts try the same layers and tiles over and over, and the
    # streamed stage's layers are the kept one's
    assert [repr(s) for s in shared] == [repr(s) for s in fresh]
    assert len(calls) == tiles.misses == len(tiles.tables)
    assert 0 < len(calls) < n_fresh / 2
    assert tiles.hits + tiles.misses == n_fresh


def test_a_table_is_reused_only_for_the_same_layer_structure_and_tile(monkeypatch, block):
    programs, _ = block
    board = arch_of("spinn/board")
    program = program_work(programs[0], board)
    index = next(i for i, layer in enumerate(program.layers) if layer.kind == "dense")
    tile = choose_tile(program, index, board)
    fresh = tile_costs(program, index, board, tile)
    calls = _costed(monkeypatch)
    memo = TileCostMemo()
    with memo:
        first = tile_costs(program, index, board, tile)
        again = tile_costs(program, index, board, tile)
    assert len(calls) == 1 and again is first and _tables_equal(first, fresh)
    assert not first.cycles.flags.writeable  # shared tables are never edited in place
    with pytest.raises(ValueError):
        first.cycles[0] = 0
    # the same layer at another index of another program: the table, with its own index
    layers = list(program.layers)
    moved = dataclasses.replace(program, layers=[layers[index]] + layers[:index] + layers[index + 1:])
    with memo:
        there = tile_costs(moved, 0, board, tile)
    assert len(calls) == 1 and there.layer == 0 and _tables_equal(dataclasses.replace(there, layer=index), first)
    # anything the costs read differs: costed afresh, as without the memo
    weight = layers[index].consts["weight"]
    tensors = list(program.tensors)
    k, n = tensors[weight].shape
    tensors[weight] = dataclasses.replace(tensors[weight], shape=[k, n // 2])
    out = layers[index].output
    tensors[out] = dataclasses.replace(tensors[out], shape=list(tensors[out].shape[:-1]) + [n // 2])
    narrower = dataclasses.replace(program, tensors=tensors)
    with memo:
        other = tile_costs(narrower, index, board, tile)
        other_tile = tile_costs(program, index, board, [tile[0], max(1, tile[1] // 2), *tile[2:]])
    assert len(calls) == 3
    assert _tables_equal(other, tile_costs(narrower, index, board, tile))
    assert len(other) != len(first) or not _tables_equal(other, first)
    assert _tables_equal(other_tile, tile_costs(program, index, board, [tile[0], max(1, tile[1] // 2), *tile[2:]]))


def test_the_memo_keeps_at_most_its_limit_and_refuses_a_bad_one(block):
    programs, _ = block
    board = arch_of("spinn/board")
    program = program_work(programs[0], board)
    memo = TileCostMemo(limit=2)
    with memo:
        for i in range(len(program.layers)):
            tile_costs(program, i, board, choose_tile(program, i, board))
    assert len(program.layers) > 2 and len(memo.tables) == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="limit"):
            TileCostMemo(limit=bad)
