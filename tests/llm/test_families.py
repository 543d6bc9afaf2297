"""tvm_spinn.llm beyond GPT-2 and Llama: Mistral (sliding-window attention), Qwen2 (biased q/k/v)
and Phi-3 (fused qkv / gate-up weights). Each family's greedy tokens are checked against
transformers' own ``generate(do_sample=False)`` on the same seeded random weights, its logits
step by step against transformers' forward within an fp32 bound, and its published full-size
config is read, counted and planned (the window-limited KV cache, the biases)."""

from __future__ import annotations

import importlib.resources
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from tvm_spinn import llm  # noqa: E402

CONFIGS = importlib.resources.files("tvm_spinn.llm") / "configs"
NEW_TOKENS = 8
#: fp32 bound on |logits - transformers' logits|, relative to the logits' scale: the same dot
#: products summed in another order (blocked GEMMs, the ring cache's slot order)
LOGIT_RTOL = 1e-5

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=256, max_position_embeddings=64)


def _model(cls_name: str, **kw):
    torch.manual_seed(0)
    config_cls = getattr(tf, cls_name.replace("ForCausalLM", "Config"))
    model = getattr(tf, cls_name)(config_cls(**{**TINY, **kw}))
    # our generate always produces max_new_tokens; transformers would stop at an EOS token
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _reference(model, ids: np.ndarray, new_tokens: int) -> np.ndarray:
    ids = torch.from_numpy(ids)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                              attention_mask=torch.ones_like(ids)).numpy()


def _check_logits(model, compiled, tokens: np.ndarray, prompt_len: int) -> float:
    """Our prefill's and every decode step's logits vs transformers' forward over the same tokens
    (no cache: its own masks, sliding window included). Returns the largest relative error."""
    import tvm

    dev = tvm.cpu()
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens)).logits.numpy()  # (b, n, vocab)
    _, prefill = compiled.prefill_executable(prompt_len)
    _, decode = compiled.decode_executable()
    out = prefill["main"](*(tvm.runtime.tensor(a, dev) for a in compiled._prefill_args(tokens[:, :prompt_len])))
    worst = 0.0
    for pos in range(prompt_len - 1, tokens.shape[1] - 1):
        logits, k_cache, v_cache = out[0].numpy(), out[1], out[2]
        expected = ref[:, pos]
        worst = max(worst, float(np.abs(logits - expected).max() / np.abs(expected).max()))
        args = compiled._decode_args(tokens[:, pos + 1:pos + 2], pos + 1)
        out = decode["main"](tvm.runtime.tensor(args[0], dev), k_cache, v_cache,
                             *(tvm.runtime.tensor(a, dev) for a in args[1:]))
    return worst


def _generate_and_compare(model, compiled, prompt_len: int, seed: int):
    ids = np.random.default_rng(seed).integers(0, 256, (compiled.batch, prompt_len))
    out = compiled.generate(ids, NEW_TOKENS)
    np.testing.assert_array_equal(out, _reference(model, ids, NEW_TOKENS))
    worst = _check_logits(model, compiled, out, prompt_len)
    print(f"largest relative logit error {worst:.2e}")
    assert worst <= LOGIT_RTOL
    return out


# ------------------------------------------------------------------------------------ Mistral
WINDOW = 4


@pytest.fixture(scope="module")
def mistral():
    model = _model("MistralForCausalLM", sliding_window=WINDOW)
    return model, llm.compile(model, target="spinn", max_seq_len=24, batch=2)


def test_mistral_spec_reads_the_window_and_the_cache_holds_it(mistral):
    _, compiled = mistral
    spec = compiled.spec
    assert (spec.family, spec.model_type, spec.sliding_window) == ("llama", "mistral", WINDOW)
    assert spec.cache_slots(24) == WINDOW and spec.cache_slots(3) == 3
    assert [s[-1] for s in compiled._cache_shapes()] == [WINDOW, 16]  # K^T (.., d, slots), V (.., slots, d)


def test_mistral_tokens_and_logits_match_transformers_past_the_window(mistral):
    # a prompt shorter than the window, then 8 tokens: the window slides over the ring cache
    model, compiled = mistral
    _generate_and_compare(model, compiled, prompt_len=3, seed=1)


def test_mistral_prompt_longer_than_the_window(mistral):
    # the prefill masks each query to its last 4 keys and leaves the prompt's last 4 in their ring slots
    model, compiled = mistral
    _generate_and_compare(model, compiled, prompt_len=7, seed=2)


def test_the_window_changes_the_tokens():
    """Not a vacuous check: the same weights without a window generate other tokens (so the
    match above depends on the window being applied)."""
    windowed = _model("MistralForCausalLM", sliding_window=4)
    full = _model("MistralForCausalLM", sliding_window=None)
    ids = np.random.default_rng(1).integers(0, 256, (1, 9))
    assert not np.array_equal(_reference(windowed, ids, 8), _reference(full, ids, 8))
    assert llm.spec_of(full).sliding_window is None


# -------------------------------------------------------------------------------------- Qwen2
@pytest.fixture(scope="module")
def qwen2():
    model = _model("Qwen2ForCausalLM")
    with torch.no_grad():  # transformers initializes biases to zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model, llm.compile(model, target="spinn", max_seq_len=24, batch=2)


def test_qwen2_tokens_and_logits_match_transformers(qwen2):
    model, compiled = qwen2
    assert compiled.spec.qkv_bias and compiled.spec.sliding_window is None
    _generate_and_compare(model, compiled, prompt_len=6, seed=3)


def test_qwen2_sliding_window_is_refused_by_name():
    cfg = json.loads((CONFIGS / "qwen2-7b.json").read_text())
    with pytest.raises(llm.LLMError, match="'use_sliding_window' is True"):
        llm.spec_of({**cfg, "use_sliding_window": True})
    # a window written but unused is the common case
    assert llm.spec_of({**cfg, "sliding_window": 4096, "use_sliding_window": False}).sliding_window is None
    with pytest.raises(llm.LLMError, match="layer_types"):
        llm.spec_of({**cfg, "layer_types": ["sliding_attention"] * 28})


# -------------------------------------------------------------------------------------- Phi-3
@pytest.fixture(scope="module")
def phi3():
    model = _model("Phi3ForCausalLM", sliding_window=WINDOW, pad_token_id=0, eos_token_id=None)
    return model, llm.compile(model, target="spinn", max_seq_len=24, batch=1)


def test_phi3_tokens_and_logits_match_transformers(phi3):
    model, compiled = phi3
    assert compiled.spec.sliding_window == WINDOW
    _generate_and_compare(model, compiled, prompt_len=6, seed=4)


def test_families_run_their_projections_and_attention_on_the_pes(mistral, qwen2, phi3):
    import tvm_spinn

    ops = {name: tvm_spinn.report(compiled.decode_executable()[0]).offloaded_ops
           for name, (_, compiled) in (("mistral", mistral), ("qwen2", qwen2), ("phi3", phi3))}
    for name, found in ops.items():  # two blocks: two softmaxes, 2 x 2 attention GEMMs, 2 x 2 + 1 RMSNorms
        assert (found.get("spinn.softmax"), found.get("spinn.matmul"), found.get("spinn.rms_norm")) == (2, 4, 5), name
    # q, k and v one GEMM (their weights concatenated), o, gate and up one GEMM, down; the LM head
    assert ops["mistral"].get("spinn.dense") == 2 * 4 + 1
    assert ops["qwen2"].get("spinn.dense_bias") == 2 * 1 and ops["qwen2"].get("spinn.dense") == 2 * 3 + 1
    assert ops["phi3"].get("spinn.dense") == 2 * 4 + 1  # fused qkv, o, fused gate_up, down; the LM head


# ------------------------------------------------------------------------ counts and configs
@pytest.mark.parametrize("cls_name, kw", [("MistralForCausalLM", {}), ("Qwen2ForCausalLM", {}),
                                          ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
                                          ("Phi3ForCausalLM", {"pad_token_id": 0})])
def test_spec_counts_the_parameters_of_the_model(cls_name, kw):
    model = _model(cls_name, **kw)
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    assert llm.spec_of(model).params == sum(unique.values())


@pytest.mark.parametrize("name, params", [("mistral-7b", 7_241_732_096), ("qwen2-7b", 7_615_616_512),
                                          ("phi-3-mini-4k", 3_821_079_552)])
def test_shipped_configs_have_the_published_sizes(name, params):
    # parameter counts as published with the checkpoints (transformers' num_parameters())
    assert llm.spec_of(str(CONFIGS / f"{name}.json")).params == params


@pytest.mark.parametrize("name, field, value, match", [
    ("mistral-7b", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "'rope_scaling' .* 'yarn' is not implemented"),
    ("phi-3-mini-4k", "rope_scaling", {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
     "'rope_scaling' .* 'longrope' is not implemented"),
    ("qwen2-7b", "rope_parameters", {"rope_type": "dynamic", "factor": 2.0}, "'rope_parameters' .* 'dynamic'"),
    ("phi-3-mini-4k", "partial_rotary_factor", 0.75, "'partial_rotary_factor' is 0.75"),
    ("mistral-7b", "sliding_window", 0, "'sliding_window' must be"),
    ("mistral-7b", "sliding_window", "4096", "'sliding_window' must be"),
    ("qwen2-7b", "use_sliding_window", "no", "'use_sliding_window' must be"),
    ("qwen2-7b", "max_window_layers", -1, "'max_window_layers' must be"),
    ("mistral-7b", "num_local_experts", 8, "num_local_experts=8"),  # Mixtral relabelled
])
def test_unsupported_fields_are_refused_by_name_and_value(name, field, value, match):
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    with pytest.raises(llm.LLMError, match=match):
        llm.spec_of({**cfg, field: value})


def test_unknown_hidden_act_is_refused_by_the_planner():
    cfg = json.loads((CONFIGS / "mistral-7b.json").read_text())
    with pytest.raises(llm.LLMError, match="'hidden_act' is 'swishy'"):
        llm.plan({**cfg, "hidden_act": "swishy", "num_hidden_layers": 1}, target="spinn/board", seq=64)


def test_mistral_window_default_follows_transformers():
    cfg = json.loads((CONFIGS / "mistral-7b.json").read_text())
    cfg.pop("sliding_window")
    assert llm.spec_of(cfg).sliding_window == tf.MistralConfig().sliding_window == 4096
    assert llm.spec_of({**cfg, "sliding_window": None}).sliding_window is None


# ---------------------------------------------------------------------------------- planning
SMALL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=1, vocab_size=256, max_position_embeddings=256)


@pytest.mark.slow  # two plans (~30-80 s on a loaded host)
def test_plan_holds_a_window_limited_kv_cache():
    windowed = llm.plan({"model_type": "mistral", **SMALL, "sliding_window": 64}, target="spinn", seq=256)
    full = llm.plan({"model_type": "mistral", **SMALL, "sliding_window": None}, target="spinn", seq=256)
    spec = llm.spec_of({"model_type": "mistral", **SMALL})
    assert windowed.kv_cache_bytes == 64 * spec.kv_bytes_per_token(4)
    assert full.kv_cache_bytes == 256 * spec.kv_bytes_per_token(4)
    assert windowed.weight_bytes == full.weight_bytes == spec.params
    # the physical bound reads the 64 slots a decode step attends over, not 256
    from tvm_spinn.target import arch_of
    from tvm_spinn.timing.bounds import decode_workload, physical_bound

    windowed_spec = llm.spec_of({"model_type": "mistral", **SMALL, "sliding_window": 64})
    arch = arch_of("spinn")
    assert windowed.physical_bound_s == physical_bound(decode_workload(windowed_spec, 1, 64, "int8"), arch).total_s
    assert full.physical_bound_s == physical_bound(decode_workload(windowed_spec, 1, 256, "int8"), arch).total_s
    # a decode step reads a quarter of the cache: it is faster
    assert windowed.decode_latency_s < full.decode_latency_s


def test_qwen2_counts_its_qkv_biases():
    qwen, llama = (llm.spec_of(str(CONFIGS / f"{n}.json")) for n in ("qwen2-7b", "llama-2-7b"))
    assert qwen.qkv_bias and not llama.qkv_bias
    as_llama = llm.spec_of({**json.loads((CONFIGS / "qwen2-7b.json").read_text()), "model_type": "llama"})
    assert qwen.params - as_llama.params == 28 * (3584 + 2 * 512)  # q, k, v biases of 28 layers
    assert qwen.kv_bytes_per_token(4) == as_llama.kv_bytes_per_token(4)


@pytest.mark.slow  # two plans (~30-50 s on a loaded host)
def test_plan_counts_qwen2_biases():
    qwen = llm.plan({"model_type": "qwen2", **SMALL}, target="spinn", seq=32)
    llama = llm.plan({"model_type": "llama", **SMALL}, target="spinn", seq=32)
    q, kv = 128, 2 * 32
    assert qwen.weight_bytes - llama.weight_bytes == 1 * (q + 2 * kv)  # one layer; int8: a byte per parameter
    assert qwen.kv_cache_bytes == llama.kv_cache_bytes


@pytest.mark.slow  # the full-size blocks described and mapped (minutes each)
@pytest.mark.parametrize("name, seq, slots", [("qwen2-7b", 512, 512), ("phi-3-mini-4k", 2560, 2047)])
def test_plan_cli_plans_the_shipped_config(name, seq, slots, capsys):
    from tvm_spinn.cli import main

    assert main(["plan", str(CONFIGS / f"{name}.json"), "--target", "spinn/board", "--seq", str(seq),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    spec = llm.spec_of(str(CONFIGS / f"{name}.json"))
    assert spec.cache_slots(seq) == slots
    weights, kv = spec.params, slots * spec.kv_bytes_per_token(4)  # int8 weights
    assert f"{weights / 1e9:.3f} GB / {kv / 1e9:.3f} GB" in out
