"""One import of a chunk block (``llm.describe.imported`` with ``dims``, ``bind_dims``), bound to
each chunk size and context, or one per chunk size bound to each context, is the module and the
programs that their own import gives."""

import importlib
import json

import pytest

from tvm_spinn.llm.describe import bind_dims, describe, describe_imported, imported
from tvm_spinn.llm.prefill import plan_prefill
from tvm_spinn.llm.spec import spec_of

# the chunk block of the prompt plan (its module, example arguments and symbolic axes)
prefill = importlib.import_module("tvm_spinn.llm.prefill.chunk")

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 64}
CONFIGS = {
    "llama": TINY,
    "mixtral": dict(TINY, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 256, "n_positions": 64},
    "gemma2": dict(TINY, model_type="gemma2", head_dim=16, sliding_window=8, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, query_pre_attn_scalar=16),
}


def _block(cfg):
    P = prefill._plan_module()
    cfg = P._config_dict(cfg)
    spec = spec_of(cfg)
    # a fresh meta model per import: an export may register a tied weight again on the model
    return spec, (lambda: P._meta_model(cfg, spec))


def _headers(described):
    return [json.dumps(d.program.header(), sort_keys=True, default=str) for d in described]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_bound_import_is_each_contexts_own_import(family):
    spec, model = _block(CONFIGS[family])
    chunk = 8
    dims = prefill._CONTEXT_DIMS
    mod, n = imported(prefill.ChunkStep(model(), spec, chunk), prefill._chunk_args(spec, chunk, chunk), dims=dims)
    for context in (chunk, 24, 40):
        args = prefill._chunk_args(spec, chunk, context)
        own, n_own = imported(prefill.ChunkStep(model(), spec, context), args)
        bound = bind_dims(mod, dims, {"context": context})
        assert n == n_own
        assert bound.script() == own.script()
        assert _headers(describe_imported(bound, n, "spinn/board", "int8")) == _headers(
            describe(prefill.ChunkStep(model(), spec, context), args, "spinn/board", "int8"))


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_bound_block_import_is_each_chunk_and_contexts_own_import(family):
    spec, model = _block(CONFIGS[family])
    args = prefill._chunk_args(spec, prefill._EXAMPLE_CHUNK, prefill._EXAMPLE_CONTEXT)
    dims = {i: axes for i, axes in prefill._CHUNK_DIMS.items() if i < len(args)}
    mod, n = imported(prefill.ChunkStep(model(), spec, prefill._EXAMPLE_CONTEXT), args, dims=dims, derived=True)
    # the first chunk (context = chunk), later ones, chunks larger and smaller than the example's
    for chunk, context in ((2, 2), (2, 6), (8, 8), (8, 40), (16, 48), (32, 32)):
        own, n_own = imported(prefill.ChunkStep(model(), spec, context), prefill._chunk_args(spec, chunk, context))
        bound = bind_dims(mod, dims, {"chunk": chunk, "context": context})
        assert n == n_own
        assert bound.script() == own.script(), (chunk, context)
    chunk, context = 8, 24
    args = prefill._chunk_args(spec, chunk, context)
    assert _headers(describe_imported(bind_dims(mod, dims, {"chunk": chunk, "context": context}), n, "spinn/board",
                                      "int8")) == _headers(describe(prefill.ChunkStep(model(), spec, context), args,
                                                                    "spinn/board", "int8"))


def test_bind_dims_refuses_a_missing_or_contradicting_size():
    spec, model = _block(TINY)
    dims = prefill._CONTEXT_DIMS
    mod, _ = imported(prefill.ChunkStep(model(), spec, 8), prefill._chunk_args(spec, 8, 16), dims=dims)
    with pytest.raises(ValueError, match="context"):
        bind_dims(mod, dims, {})
    fixed, _ = imported(prefill.ChunkStep(model(), spec, 8), prefill._chunk_args(spec, 8, 16))
    with pytest.raises(ValueError, match="constant 16, not 24"):
        bind_dims(fixed, dims, {"context": 24})
    assert bind_dims(fixed, dims, {"context": 16}).script() == fixed.script()


def _imports(memo, kind):
    return [memo[k] for k in memo if isinstance(k, tuple) and k[0] == kind]


def test_prefill_memo_shares_one_import(monkeypatch):
    memo = {}
    plan = plan_prefill(TINY, "spinn/board", prompt=32, memo=memo, search="all")
    chunks = [k for k in memo if isinstance(k, tuple) and k[0] == "chunk"]
    assert len({k[-3] for k in chunks}) > 2  # several chunk sizes searched
    # one import for every chunk size but one token's (torch specializes a size of 1), per
    # variant of the block (its projections fused, and each on its own)
    block_keys = [k for k in memo if isinstance(k, tuple) and k[0] == "block-imported"]
    assert sorted(k[-1] for k in block_keys) == [False, True]
    assert all(memo[k] is not None for k in block_keys)
    assert all(c == 1 for c in {k[-2] for k in memo if isinstance(k, tuple) and k[0] == "chunk-imported"})

    from tvm_spinn.llm import describe as describe_module

    concrete = describe_module.imported

    # one import per chunk size (the path taken where torch cannot keep the chunk symbolic)
    def no_chunk(module, args, dims=None, derived=False):
        if dims and any("chunk" in axes.values() for axes in dims.values()):
            raise RuntimeError("no symbolic chunk")
        return concrete(module, args, dims)

    monkeypatch.setattr(describe_module, "imported", no_chunk)
    per_chunk = {}
    assert plan_prefill(TINY, "spinn/board", prompt=32, memo=per_chunk, search="all").to_dict() == plan.to_dict()
    assert _imports(per_chunk, "block-imported") == [None, None]
    assert any(m is not None for m in _imports(per_chunk, "chunk-imported"))

    # each context exported on its own (the path taken where torch cannot keep the context symbolic)
    def refuse(module, args, dims=None, derived=False):
        if dims:
            raise RuntimeError("no symbolic context")
        return concrete(module, args)

    monkeypatch.setattr(describe_module, "imported", refuse)
    alone = {}
    assert plan_prefill(TINY, "spinn/board", prompt=32, memo=alone, search="all").to_dict() == plan.to_dict()
    assert set(map(type, _imports(alone, "block-imported") + _imports(alone, "chunk-imported"))) == {type(None)}
