"""tvm_spinn.llm for Gemma-2 (soft-capped attention and logits, alternating local/global layers,
GeGLU, four RMSNorms of (1 + weight), scaled embeddings, query_pre_attn_scalar, a head size not
hidden / heads), GPT-J (parallel attention and MLP, a partial pair-interleaved rotary embedding,
a biased untied LM head), Falcon (multi-query attention, parallel attention and MLP, rotary) and
Mixtral (a router's top-2 of its experts per token).

Each family's greedy tokens are compared with transformers' own ``generate(do_sample=False)`` on
seeded random weights: equal wherever transformers' top-2 logit margin exceeds the fp32 logit
error bound (a step whose margin is inside the bound may pick the other token; none did here),
and every step's logits within that bound of transformers' forward. Unsupported values of each
family's switches are refused naming the field and value, and the published full-size configs
are read, counted (against transformers' own count) and planned."""

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
#: fp32 bound on |logits - transformers' logits|, relative to the logits' scale (the largest
#: |logit| of the step): the same dot products summed in another order (blocked GEMMs)
LOGIT_RTOL = 1e-5
VOCAB = 256


def _model(cls_name: str, **kw):
    torch.manual_seed(0)
    config_cls = getattr(tf, cls_name.replace("ForCausalLM", "Config"))
    model = getattr(tf, cls_name)(config_cls(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None,
                                             pad_token_id=None, **kw))
    # our generate always produces max_new_tokens; transformers would stop at an EOS token
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _randomize(model, names: tuple) -> None:
    """Parameters whose names contain one of ``names`` drawn at random (transformers initializes
    norms to 1 (Gemma-2: 0, i.e. a scale of 1 + 0) and biases to zero, which would hide them)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(n in name for n in names):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def _reference(model, ids: np.ndarray, new_tokens: int) -> np.ndarray:
    ids = torch.from_numpy(ids)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                              attention_mask=torch.ones_like(ids)).numpy()


def _step_logits(compiled, tokens: np.ndarray, prompt_len: int) -> list:
    """Our logits after the prefill of ``tokens[:, :prompt_len]`` and after each decode step fed
    the next given token: the prediction for positions ``prompt_len .. n - 1``."""
    import tvm

    dev = tvm.cpu()
    _, prefill = compiled.prefill_executable(prompt_len)
    _, decode = compiled.decode_executable()
    out = prefill["main"](*(tvm.runtime.tensor(a, dev) for a in compiled._prefill_args(tokens[:, :prompt_len])))
    steps = []
    for pos in range(prompt_len - 1, tokens.shape[1] - 1):
        steps.append(out[0].numpy())
        args = compiled._decode_args(tokens[:, pos + 1:pos + 2], pos + 1)
        out = decode["main"](tvm.runtime.tensor(args[0], dev), out[1], out[2],
                             *(tvm.runtime.tensor(a, dev) for a in args[1:]))
    return steps


def _generate_and_compare(model, compiled, prompt_len: int, seed: int) -> float:
    """Greedy tokens vs transformers' generate, logits vs transformers' forward over our tokens.
    Returns the largest relative logit error."""
    ids = np.random.default_rng(seed).integers(0, VOCAB, (compiled.batch, prompt_len))
    ours = compiled.generate(ids, NEW_TOKENS)
    theirs = _reference(model, ids, NEW_TOKENS)
    with torch.no_grad():
        ref = model(torch.from_numpy(ours)).logits.numpy()  # (b, n, vocab): transformers on our tokens
    worst = 0.0
    for t, logits in enumerate(_step_logits(compiled, ours, prompt_len)):
        expected = ref[:, prompt_len - 1 + t]
        scale = np.abs(expected).max(axis=-1)
        worst = max(worst, float((np.abs(logits - expected).max(axis=-1) / scale).max()))
        top2 = np.sort(expected, axis=-1)[:, -2:]
        for row in range(ours.shape[0]):
            if np.array_equal(ours[row, :prompt_len + t], theirs[row, :prompt_len + t]):
                # same prefix: the next tokens must agree unless the margin is inside the bound
                same = ours[row, prompt_len + t] == theirs[row, prompt_len + t]
                inside = top2[row, 1] - top2[row, 0] <= 2 * LOGIT_RTOL * scale[row]
                assert same or inside, f"row {row}, step {t}: tokens differ at a margin above the bound"
    print(f"largest relative logit error {worst:.2e}")
    assert worst <= LOGIT_RTOL
    return worst


# ------------------------------------------------------------------------------------ Gemma-2
WINDOW = 4
#: soft-capping values that the scores and logits of these random weights reach (Gemma-2-9B's 50
#: and 30 would leave tanh nearly linear here)
GEMMA2_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    intermediate_size=128, max_position_embeddings=64, sliding_window=WINDOW,
                    query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)


@pytest.fixture(scope="module")
def gemma2():
    return _gemma2_model(), None


def _gemma2_model():
    model = _model("Gemma2ForCausalLM", **GEMMA2_SMALL)
    # norms away from 1 + 0; queries, keys and embeddings large enough that both caps bite
    _randomize(model, ("norm", "q_proj", "k_proj", "embed"))
    return model


@pytest.fixture(scope="module")
def gemma2_compiled(gemma2):
    model, _ = gemma2
    return model, llm.compile(model, target="spinn", max_seq_len=24, batch=2)


def test_gemma2_tokens_and_logits_match_transformers(gemma2_compiled):
    # a prompt longer than the window, then 8 tokens: layer 0 local (window 4), layer 1 global
    model, compiled = gemma2_compiled
    spec = compiled.spec
    assert (spec.family, spec.model_type, spec.sliding_window, spec.global_layers) == ("llama", "gemma2", WINDOW, (1,))
    assert (spec.attn_softcap, spec.final_softcap, spec.head_dim) == (2.0, 3.0, 32)
    assert spec.cache_slots(24) == 24  # the global layer keeps every position
    _generate_and_compare(model, compiled, prompt_len=7, seed=2)


def test_gemma2_features_change_the_logits(gemma2):
    """Not a vacuous check: without either soft-capping, without the window or with the default
    query scale the same weights give other logits (far beyond the bound), so the match above
    depends on each."""
    import copy

    model, _ = gemma2
    ids = torch.from_numpy(np.random.default_rng(2).integers(0, VOCAB, (1, 12)))

    def logits(m):
        with torch.no_grad():
            return m(ids).logits.numpy()

    base = logits(model)

    def without_attn_cap(m):
        for layer in m.model.layers:
            layer.self_attn.attn_logit_softcapping = None

    def without_final_cap(m):
        m.config.final_logit_softcapping = None

    def without_window(m):
        m.config.layer_types = ["full_attention"] * len(m.model.layers)
        for layer in m.model.layers:
            layer.self_attn.sliding_window = None

    def default_scale(m):
        for layer in m.model.layers:
            layer.self_attn.scaling = layer.self_attn.head_dim ** -0.5

    for change in (without_attn_cap, without_final_cap, without_window, default_scale):
        other = copy.deepcopy(model)
        change(other)
        assert np.abs(logits(other) - base).max() > 1000 * LOGIT_RTOL * np.abs(base).max(), change.__name__


# -------------------------------------------------------------------------------------- GPT-J
GPTJ_SMALL = dict(n_embd=64, n_head=4, n_layer=2, rotary_dim=8, n_positions=64)


@pytest.fixture(scope="module")
def gptj():
    model = _model("GPTJForCausalLM", **GPTJ_SMALL)
    _randomize(model, ("bias", "ln_"))
    return model, llm.compile(model, target="spinn", max_seq_len=24, batch=1)


def test_gptj_tokens_and_logits_match_transformers(gptj):
    model, compiled = gptj
    spec = compiled.spec
    assert (spec.family, spec.rotary_dim, spec.head_dim, spec.tied_embeddings) == ("gptj", 8, 16, False)
    _generate_and_compare(model, compiled, prompt_len=6, seed=3)


# ------------------------------------------------------------------------------------- Falcon
FALCON_SMALL = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def falcon():
    model = _model("FalconForCausalLM", **FALCON_SMALL)
    _randomize(model, ("layernorm", "ln_f"))
    return model, llm.compile(model, target="spinn", max_seq_len=24, batch=2)


def test_falcon_multi_query_tokens_and_logits_match_transformers(falcon):
    model, compiled = falcon
    spec = compiled.spec
    assert (spec.family, spec.heads, spec.kv_heads) == ("falcon", 4, 1)  # one key/value head for all
    assert [s[1] for s in compiled._cache_shapes()] == [2 * 1] * 2  # batch x kv heads rows
    _generate_and_compare(model, compiled, prompt_len=6, seed=4)


@pytest.mark.slow  # a second compile (~30 s on a loaded host)
def test_falcon_without_multi_query_and_with_biases():
    model = _model("FalconForCausalLM", **FALCON_SMALL, multi_query=False, bias=True)
    _randomize(model, ("bias", "layernorm", "ln_f"))
    compiled = llm.compile(model, target="spinn", max_seq_len=16, batch=1)
    assert (compiled.spec.kv_heads, compiled.spec.attention_bias) == (4, True)
    _generate_and_compare(model, compiled, prompt_len=5, seed=5)


# ------------------------------------------------------------------------------------ Mixtral
MIXTRAL_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=96, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def mixtral():
    model = _model("MixtralForCausalLM", **MIXTRAL_SMALL)
    _randomize(model, ("gate.weight",))  # a router that tells the experts apart
    return model, llm.compile(model, target="spinn", max_seq_len=24, batch=2)


@pytest.mark.slow  # four experts in each of two blocks (~80 s on a loaded host)
def test_mixtral_tokens_and_logits_match_transformers(mixtral):
    import tvm_spinn

    model, compiled = mixtral
    spec = compiled.spec
    assert (spec.family, spec.experts, spec.experts_per_token) == ("llama", 4, 2)
    _generate_and_compare(model, compiled, prompt_len=6, seed=6)
    # not a vacuous check: the router picks different experts for different tokens
    ids = torch.from_numpy(np.random.default_rng(6).integers(0, VOCAB, (2, 6)))
    with torch.no_grad():
        h = model.model.layers[0].post_attention_layernorm(model.model.embed_tokens(ids))
        _, _, picked = model.model.layers[0].mlp.gate(h)
    assert len({tuple(sorted(p)) for p in picked.tolist()}) > 1
    ops = tvm_spinn.report(compiled.decode_executable()[0]).offloaded_ops
    # q, k and v one GEMM, o, the router and two GEMMs per expert in each block; the LM head
    assert ops.get("spinn.dense") == 2 * (2 + 1 + 2 * 4) + 1 and ops.get("spinn.softmax") == 2 * 2


def test_mixtral_bound_reads_the_experts_a_batch_picks():
    from tvm_spinn.timing.bounds import decode_workload

    spec = llm.spec_of(str(CONFIGS / "mixtral-8x7b.json"))
    one, four = (decode_workload(spec, b, 2048, "int8") for b in (1, 4))
    expert = 3 * spec.hidden * spec.intermediate  # int8: a byte per weight
    kv = 2048 * spec.kv_bytes_per_token(4)
    # four users pick up to all 8 experts of a block, one user 2: six more experts per block
    assert (four.read_bytes - 4 * kv) - (one.read_bytes - kv) == spec.layers * 6 * expert + 3 * spec.hidden * 1
    assert one.macs_int8 == spec.step_params(1) - spec.vocab * spec.hidden - spec.layers * 2 * spec.hidden - spec.hidden


def test_families_run_their_projections_and_attention_on_the_pes(gemma2_compiled, gptj, falcon):
    import tvm_spinn

    ops = {name: tvm_spinn.report(compiled.decode_executable()[0]).offloaded_ops
           for name, (_, compiled) in (("gemma2", gemma2_compiled), ("gptj", gptj), ("falcon", falcon))}
    layers = {"gemma2": 2, "gptj": 2, "falcon": 2}
    for name, found in ops.items():  # a softmax and two attention GEMMs per block
        assert (found.get("spinn.softmax"), found.get("spinn.matmul")) == (layers[name], 2 * layers[name]), name
    dense = {k: v for k, v in ops["gemma2"].items() if k.startswith("spinn.dense")}
    # q, k and v one GEMM (their weights concatenated), o, gate and up one GEMM, down; the LM head
    assert sum(dense.values()) == 2 * 4 + 1, dense
    gptj_dense = sum(v for k, v in ops["gptj"].items() if k.startswith("spinn.dense"))
    assert gptj_dense == 2 * 4 + 1  # q, k and v one GEMM, out, fc_in, fc_out; the (biased) LM head
    falcon_dense = sum(v for k, v in ops["falcon"].items() if k.startswith("spinn.dense"))
    assert falcon_dense == 2 * 4 + 1  # fused query_key_value, dense, h_to_4h, 4h_to_h; the LM head


# ------------------------------------------------------------------------ counts and configs
@pytest.mark.parametrize("cls_name, kw", [
    ("Gemma2ForCausalLM", GEMMA2_SMALL), ("Gemma2ForCausalLM", {**GEMMA2_SMALL, "tie_word_embeddings": False}),
    ("GPTJForCausalLM", GPTJ_SMALL), ("GPTJForCausalLM", {**GPTJ_SMALL, "tie_word_embeddings": True, "n_inner": 96}),
    ("FalconForCausalLM", FALCON_SMALL), ("FalconForCausalLM", {**FALCON_SMALL, "multi_query": False, "bias": True}),
    ("FalconForCausalLM", {**FALCON_SMALL, "tie_word_embeddings": False, "ffn_hidden_size": 96}),
    ("MixtralForCausalLM", MIXTRAL_SMALL), ("MixtralForCausalLM", {**MIXTRAL_SMALL, "num_local_experts": 3}),
])
def test_spec_counts_the_parameters_of_the_model(cls_name, kw):
    model = _model(cls_name, **kw)
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    assert llm.spec_of(model).params == sum(unique.values())


@pytest.mark.parametrize("name, cls_name", [("gemma-2-9b", "Gemma2ForCausalLM"), ("gpt-j-6b", "GPTJForCausalLM"),
                                            ("falcon-7b", "FalconForCausalLM"), ("mixtral-8x7b", "MixtralForCausalLM")])
def test_shipped_configs_count_as_transformers_does(name, cls_name):
    path = str(CONFIGS / f"{name}.json")
    config = tf.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = getattr(tf, cls_name)(config)
    assert llm.spec_of(path).params == model.num_parameters()


def test_shipped_configs_read_as_published():
    gemma = llm.spec_of(str(CONFIGS / "gemma-2-9b.json"))
    assert gemma.params == 9_241_705_984  # Gemma-2-9B's published count
    assert (gemma.head_dim, gemma.heads * gemma.head_dim, gemma.hidden) == (256, 4096, 3584)  # not hidden / heads
    assert gemma.global_layers == tuple(range(1, 42, 2)) and gemma.sliding_window == 4096
    assert (gemma.attn_softcap, gemma.final_softcap, gemma.tied_embeddings) == (50.0, 30.0, True)
    gptj = llm.spec_of(str(CONFIGS / "gpt-j-6b.json"))
    assert (gptj.rotary_dim, gptj.head_dim, gptj.intermediate, gptj.tied_embeddings) == (64, 256, 16384, False)
    falcon = llm.spec_of(str(CONFIGS / "falcon-7b.json"))
    assert falcon.params == 6_921_720_704  # Falcon-7B's published count
    assert (falcon.heads, falcon.kv_heads, falcon.head_dim) == (71, 1, 64)
    assert falcon.kv_bytes_per_token(4) == 2 * 32 * 1 * 64 * 4  # one key/value head per layer
    mixtral = llm.spec_of(str(CONFIGS / "mixtral-8x7b.json"))
    assert mixtral.params == 46_702_792_704  # Mixtral-8x7B's published count
    assert mixtral.step_params(1) == 12_879_925_248  # the ~12.9B a token uses (2 of 8 experts)
    assert mixtral.step_params(4) == mixtral.params


@pytest.mark.parametrize("name, field, value, match", [
    ("gemma-2-9b", "layer_types", ["sliding_attention", "chunked_attention"] * 21, "'layer_types' holds"),
    ("gemma-2-9b", "layer_types", ["full_attention"] * 41, "'layer_types' has 41 entries"),
    ("gemma-2-9b", "attn_logit_softcapping", 0, "'attn_logit_softcapping' must be"),
    ("gemma-2-9b", "query_pre_attn_scalar", -1, "'query_pre_attn_scalar' must be"),
    ("gemma-2-9b", "rope_scaling", {"rope_type": "linear", "factor": 2.0}, "'rope_scaling' .* 'linear' is not"),
    ("gemma-2-9b", "use_bidirectional_attention", True, "'use_bidirectional_attention' is True"),
    ("gemma-2-9b", "num_local_experts", 8, "num_local_experts=8"),
    ("gpt-j-6b", "rotary_dim", 63, "'rotary_dim' is 63"),
    ("gpt-j-6b", "rotary_dim", 512, "'rotary_dim' is 512"),
    ("gpt-j-6b", "rotary_dim", None, "'rotary_dim' is None"),
    ("gpt-j-6b", "rotary", False, "'rotary' is False"),
    ("gpt-j-6b", "parallel_attn", True, "parallel_attn=True"),
    ("gpt-j-6b", "n_head", 3, "'n_head' \\(3\\) does not divide"),
    ("falcon-7b", "alibi", True, "'alibi' is True"),
    ("falcon-7b", "new_decoder_architecture", True, "'new_decoder_architecture' is True"),
    ("falcon-7b", "parallel_attn", False, "'parallel_attn' is False"),
    ("falcon-7b", "apply_residual_connection_post_layernorm", True, "'apply_residual_connection_post_layernorm'"),
    ("falcon-7b", "num_ln_in_parallel_attn", 2, "'num_ln_in_parallel_attn' is 2"),
    ("falcon-7b", "rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "'rope_scaling' .* 'dynamic'"),
    ("falcon-7b", "multi_query", "yes", "'multi_query' must be true or false"),
    ("falcon-7b", "attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
    ("mixtral-8x7b", "num_experts_per_tok", 9, "'num_experts_per_tok' \\(9\\) exceeds"),
    ("mixtral-8x7b", "num_local_experts", 0, "'num_local_experts' must be"),
    ("mixtral-8x7b", "shared_expert_intermediate_size", 1024, "shared_expert_intermediate_size=1024"),
    ("mixtral-8x7b", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "'rope_scaling' .* 'yarn'"),
    ("llama-2-7b", "num_local_experts", 8, "num_local_experts=8"),  # experts outside mixtral
])
def test_unsupported_fields_are_refused_by_name_and_value(name, field, value, match):
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    with pytest.raises(llm.LLMError, match=match):
        llm.spec_of({**cfg, field: value})


def test_falcon_key_value_heads_without_multi_query_are_refused():
    cfg = {**json.loads((CONFIGS / "falcon-7b.json").read_text()), "multi_query": False}
    assert llm.spec_of(cfg).kv_heads == 71
    with pytest.raises(llm.LLMError, match="'num_kv_heads' is 8"):
        llm.spec_of({**cfg, "num_kv_heads": 8})


def test_soft_capping_is_accepted_for_gemma2_only():
    llama = json.loads((CONFIGS / "llama-2-7b.json").read_text())
    for key, value in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
                       ("query_pre_attn_scalar", 256)):
        with pytest.raises(llm.LLMError, match=f"{key}={value}"):
            llm.spec_of({**llama, key: value})
    # Gemma-2 without soft-capping (null) is planned without it
    gemma = json.loads((CONFIGS / "gemma-2-9b.json").read_text())
    spec = llm.spec_of({**gemma, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert spec.attn_softcap is None and spec.final_softcap is None


@pytest.mark.slow  # a whole plan (prefill included) of a small mixture of experts on four boards (~1-3 min)
def test_mixtral_is_planned_across_boards(register_system):
    """A mixture of experts on several boards has its experts placed across them (the
    ``experts`` placement, :mod:`tvm_spinn.llm.experts`); never the pipeline or ``board_tp``
    placements, whose stages would keep only the experts one step reads."""
    import tvm_spinn

    tag = register_system(tvm_spinn.make_system("spinn2-moe-four", boards=4), tag="spinn/moe-four")
    config = {"model_type": "mixtral", "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 256,
              "num_local_experts": 4, "num_experts_per_tok": 2}
    plan = llm.plan(config, target=tag, seq=64)
    names = set(plan.plan["alternatives"])
    assert any(n.startswith("experts:ep2") for n in names)
    assert not any(n.startswith(("pipeline", "board_tp")) for n in names)
    assert plan.tokens_per_s_per_user > 0 and 0 < plan.efficiency <= 1


def test_training_planner_refuses_the_families_it_does_not_count():
    from tvm_spinn.training.planner import _spec

    for name in ("gemma-2-9b", "gpt-j-6b", "falcon-7b", "mixtral-8x7b"):
        with pytest.raises(llm.LLMError, match="'model_type' is"):
            _spec(str(CONFIGS / f"{name}.json"))


# ---------------------------------------------------------------------------------- planning
@pytest.mark.slow  # one plan per family (~30-60 s each on a loaded host)
@pytest.mark.parametrize("config", [
    {"model_type": "gemma2", "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
     "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 256,
     "max_position_embeddings": 256, "sliding_window": 64},
    {"model_type": "gptj", "n_embd": 128, "n_head": 4, "n_layer": 2, "rotary_dim": 16, "vocab_size": 256,
     "n_positions": 256},
    {"model_type": "falcon", "hidden_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
     "vocab_size": 256, "max_position_embeddings": 256},
    {"model_type": "mixtral", "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
     "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 256,
     "num_local_experts": 8, "num_experts_per_tok": 2},
])
def test_plan_small_configs(config):
    plan = llm.plan(config, target="spinn", seq=128)
    spec = llm.spec_of(config)
    assert plan.weight_bytes == spec.params  # int8: a byte per parameter
    assert plan.kv_cache_bytes == 128 * spec.kv_bytes_per_token(4)
    assert plan.decode_latency_s > 0


@pytest.mark.slow  # the full-size blocks described and mapped (minutes each)
@pytest.mark.parametrize("name", ["gemma-2-9b", "gpt-j-6b", "falcon-7b", "mixtral-8x7b"])
def test_plan_cli_plans_the_shipped_config(name, capsys):
    from tvm_spinn.cli import main

    assert main(["plan", str(CONFIGS / f"{name}.json"), "--target", "spinn/board", "--seq", "1024",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    spec = llm.spec_of(str(CONFIGS / f"{name}.json"))
    weights, kv = spec.params, 1024 * spec.kv_bytes_per_token(4)  # int8 weights
    assert f"{weights / 1e9:.3f} GB / {kv / 1e9:.3f} GB" in out
