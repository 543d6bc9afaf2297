"""Which families' blocks split over boards (``board_tp``): the llama-family variants (Mistral,
Qwen2, Phi-3, Gemma-2) slice by heads and MLP columns through their config at the model's hidden
size; GPT-2, GPT-J and Falcon derive their head size from the hidden size, so no config of theirs
describes a slice: their block's parameters are narrowed to a board's share (``slice_block``)."""

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
def test_families_whose_head_size_follows_the_hidden_size_are_not_sliced_by_config(name):
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    assert board_tp.slice_config(cfg, spec_of(cfg), 2) is None


#: small configs of the families sliced by narrowing their block's parameters
NARROWED = {
    "gpt2": {"model_type": "gpt2", "n_embd": 320, "n_head": 5, "n_layer": 2, "vocab_size": 100, "n_positions": 64},
    "gptj": {"model_type": "gptj", "n_embd": 256, "n_head": 4, "n_layer": 2, "vocab_size": 100, "n_positions": 64,
             "rotary_dim": 16},
    "falcon": {"model_type": "falcon", "hidden_size": 448, "num_attention_heads": 7, "num_hidden_layers": 2,
               "vocab_size": 100, "max_position_embeddings": 64, "multi_query": True},
    "falcon-mha": {"model_type": "falcon", "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 2,
                   "vocab_size": 100, "max_position_embeddings": 64, "multi_query": False, "bias": True},
}


def _block_matrices(model) -> int:
    block = model.transformer.h[0]
    return sum(p.numel() for p in block.parameters() if p.dim() == 2)


@pytest.mark.parametrize("name", sorted(NARROWED))
@pytest.mark.parametrize("g", [2, 4])
def test_narrowed_slice_holds_a_boards_share_of_heads_and_columns(name, g):
    P = importlib.import_module("tvm_spinn.llm.plan")
    cfg = NARROWED[name]
    spec = spec_of(cfg)
    sub, model = board_tp.slice_block(cfg, spec, g)
    heads = -(-spec.heads // g)  # the largest share: heads that g does not divide go as evenly as they can
    kv = 1 if spec.kv_heads == 1 else heads  # multi-query: the one key/value head on every board
    inter = -(-spec.intermediate // g)
    assert (sub.heads, sub.kv_heads, sub.intermediate, sub.hidden, sub.head_dim) == (
        heads, kv, inter, spec.hidden, spec.head_dim)
    h, d = spec.hidden, spec.head_dim
    # q, k, v columns and the output projection's rows of the board's heads, the MLP's columns
    assert _block_matrices(model) == h * (heads + 2 * kv) * d + heads * d * h + 2 * h * inter
    whole = _block_matrices(P._meta_model(cfg, spec))
    if spec.heads % g == 0 and spec.kv_heads == spec.heads:
        assert g * _block_matrices(model) == whole
    # biases of the split projections follow their columns
    for path, axis, what in board_tp_splits(spec):
        owner, _, leaf = path.rpartition(".")
        p = getattr(model.transformer.h[0].get_submodule(owner), leaf, None)
        if p is not None and p.dim() == 1:
            assert p.shape[0] == {"qkv": (heads + 2 * kv) * d, "mlp": inter, "q": heads * d, "kv": kv * d}[what]


def board_tp_splits(spec):
    from tvm_spinn.llm.spec import BLOCK_SPLITS

    return BLOCK_SPLITS[spec.family].parameters


def test_slice_shares_refuse_what_does_not_split():
    gqa = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 64}
    assert board_tp.slice_shares(spec_of(gqa), 2) is None  # the Llama family is sliced by its config
    assert board_tp.slice_shares(spec_of(NARROWED["gpt2"]), 8) is None  # more boards than heads
    assert board_tp.slice_shares(spec_of(NARROWED["falcon"]), 4) == (2, 1, 448)
    assert board_tp.slice_block(NARROWED["gpt2"], spec_of(NARROWED["gpt2"]), 8) is None


def test_parallel_blocks_all_reduce_once():
    assert board_tp.block_all_reduces(spec_of(NARROWED["gptj"])) == 1
    assert board_tp.block_all_reduces(spec_of(NARROWED["falcon"])) == 1
    assert board_tp.block_all_reduces(spec_of(NARROWED["gpt2"])) == 2
    llama = json.loads((CONFIGS / "mistral-7b.json").read_text())
    assert board_tp.block_all_reduces(spec_of(llama)) == 2


@pytest.mark.parametrize("name", ["falcon", "gptj"])
def test_narrowed_slice_describes_with_the_boards_weights(name):
    """The slice's decode block exports and lowers; its GEMM weights are the board's share."""
    P = importlib.import_module("tvm_spinn.llm.plan")
    from tvm_spinn.llm.describe import describe

    cfg = NARROWED[name]
    spec = spec_of(cfg)
    sub, model = board_tp.slice_block(cfg, spec, 2)
    _, module, args = P._parts(model, sub, 1, 16)[0]
    programs = describe(module, args, "spinn", "int8")
    dense = sum(t.nbytes for d in programs for t in d.program.tensors if t.role == "const" and t.dtype == "int8")
    h, d = spec.hidden, spec.head_dim
    assert dense == h * (sub.heads + 2 * sub.kv_heads) * d + sub.heads * d * h + 2 * h * sub.intermediate
    # the planner's floor counts them from the sizes alone
    assert board_tp.slice_weight_bytes(spec, 2) == dense


@pytest.mark.slow  # ~60-300 s: torch.export and mapping of the slices and the prompt's plan
def test_falcon_plans_blocks_over_boards(register_system):
    """A multi-query Falcon on five boards: its blocks split over 2 and 4 boards are candidates
    (one all-reduce a block), and the kept plan is the fastest of all."""
    import tvm_spinn
    from tvm_spinn.llm.plan import plan

    cfg = {"model_type": "falcon", "hidden_size": 1024, "num_attention_heads": 16, "num_hidden_layers": 4,
           "vocab_size": 1000, "max_position_embeddings": 256, "multi_query": True}
    system = register_system(tvm_spinn.make_system("spinn2-five-boards", boards=5), tag="spinn/five-boards")
    result = plan(cfg, target=system, seq=64)
    alts = result.plan["alternatives"]
    assert {k.split("m")[0] for k in alts if k.startswith("board_tp")} == {"board_tp:g2", "board_tp:g4"}, alts
    assert result.decode_latency_s == min(v["decode_s"] for v in alts.values())
    if result.plan["placement"] == "board_tp":
        g = result.plan["tp_boards"]
        assert result.plan["board_all_reduces_decode_s"] == pytest.approx(4 * result.plan["board_all_reduce_s"])
        assert g in (2, 4)


@pytest.mark.parametrize("name", ["gpt2", "gptj", "falcon"])
def test_slices_are_cut_where_the_boards_all_reduce(name):
    """The slice's programs are cut at its all-reduces (one a block where attention and MLP join
    the residual together): the piece after each starts with the residual add reading the
    reduced row, and the output projection after the attention over the cache starts a piece."""
    P = importlib.import_module("tvm_spinn.llm.plan")
    from tvm_spinn.llm.describe import describe
    from tvm_spinn.program.ops import family_of

    cfg = NARROWED[name]
    spec = spec_of(cfg)
    sub, model = board_tp.slice_block(cfg, spec, 2)
    _, module, args = P._parts(model, sub, 1, 16)[0]
    programs = [d.program for d in describe(module, args, "spinn", "int8")]
    pieces, ends = board_tp.slice_pieces(programs, board_tp.block_all_reduces(spec))
    assert sum(ends) == board_tp.block_all_reduces(spec) and len(pieces) == len(ends)
    assert sum(len(p.layers) for p in pieces) == sum(len(p.layers) for p in programs)
    for k, end in enumerate(ends[:-1]):
        first = pieces[k + 1].layers[0]
        if end:
            assert first.kind == "add" and len(first.inputs) == 2
        elif any(family_of(layer.kind).weight_gemm(layer) for layer in pieces[k + 1].layers[:2]):
            # the projection after the attention: its piece starts with the quantize of its input
            assert family_of(first.kind).quantizes(first)
    # a block whose programs show no all-reduce of this count is left whole
    assert board_tp.slice_pieces(programs, board_tp.block_all_reduces(spec) + 1) is None
