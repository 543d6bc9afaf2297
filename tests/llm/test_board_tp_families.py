"""Which families' blocks split over boards (``board_tp``): the llama-family variants (Mistral,
Qwen2, Phi-3, Gemma-2) slice by heads and MLP columns at the model's hidden size; GPT-2, GPT-J
and Falcon derive their head size from the hidden size, so no config of theirs describes a
slice, and they are left out (never planned as something else)."""

from __future__ import annotations

import importlib
import json
import pathlib

import pytest

from tvm_spinn.llm import board_tp
from tvm_spinn.llm.spec import spec_of

CONFIGS = pathlib.Path(board_tp.__file__).parent / "configs"


@pytest.mark.parametrize("name", ["mistral-7b", "qwen2-7b", "phi-3-mini-4k", "gemma-2-9b"])
def test_llama_variants_slice_by_heads_and_columns(name):
    P = importlib.import_module("tvm_spinn.llm.plan")
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    spec = spec_of(cfg)
    g = 4
    sliced = board_tp.slice_config(cfg, spec, g)
    sub = spec_of(sliced)
    assert (sub.model_type, sub.hidden, sub.head_dim) == (spec.model_type, spec.hidden, spec.head_dim)
    assert (sub.heads, sub.intermediate) == (spec.heads // g, spec.intermediate // g)
    assert sub.kv_heads == max(1, spec.kv_heads // g)
    assert (sub.sliding_window, sub.attn_softcap, sub.attention_bias) == (spec.sliding_window, spec.attn_softcap,
                                                                         spec.attention_bias)
    # the slice's block: a board's heads (and their KV heads) and MLP columns, every weight 1/g
    # of the model's where the KV heads split
    block = sum(p.numel() for p in P._meta_model(sliced, sub).model.layers[0].parameters() if p.dim() == 2)
    whole = sum(p.numel() for p in P._meta_model(cfg, spec).model.layers[0].parameters() if p.dim() == 2)
    if spec.kv_heads % g == 0:
        assert block * g == whole


@pytest.mark.parametrize("name", ["gpt2-xl", "gpt-j-6b", "falcon-7b"])
def test_families_whose_head_size_follows_the_hidden_size_are_not_sliced(name):
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    assert board_tp.slice_config(cfg, spec_of(cfg), 2) is None
