"""LLM configs as hostile input: every field type-checked, other architectures refused by name,
planning memory bounded up front, the caller's objects left unchanged."""

from __future__ import annotations

import copy
import importlib.resources
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tvm_spinn import llm
from tvm_spinn.llm.spec import FOREIGN_KEYS, MAX_DIM

CONFIGS = importlib.resources.files("tvm_spinn.llm") / "configs"
LLAMA = json.loads((CONFIGS / "llama-2-7b.json").read_text())
GPT2 = json.loads((CONFIGS / "gpt2-xl.json").read_text())
SMALL_LLAMA = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
               "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 1000, "max_position_embeddings": 512}

BAD_VALUES = ["4096", 4096.0, True, [4096], {"n": 4096}, -1, 0, float("nan"), float("inf"), 2**31, 10**400, None]


def _with(base: dict, **changes) -> dict:
    cfg = dict(base)
    for key, value in changes.items():
        if value is _with:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                                   "vocab_size", "max_position_embeddings", "num_key_value_heads", "head_dim"])
@pytest.mark.parametrize("value", BAD_VALUES, ids=repr)
def test_llama_size_fields_of_the_wrong_type_name_field_and_value(field, value):
    if value is None and field in ("num_key_value_heads", "head_dim"):
        return  # null means "the default" for these two (transformers' own rule)
    with pytest.raises(llm.LLMError, match=f"'{field}'") as err:
        llm.spec_of(_with(LLAMA, **{field: value}))
    if value is not None:
        assert repr(value)[:20] in str(err.value)


@pytest.mark.parametrize("field", ["n_embd", "n_head", "n_layer", "n_positions", "vocab_size", "n_inner"])
@pytest.mark.parametrize("value", ["1", 1.5, False, [1], {}, -5, 0, 2**40])
def test_gpt2_size_fields_of_the_wrong_type_name_field_and_value(field, value):
    with pytest.raises(llm.LLMError, match=f"config field '{field}' must be .*, got {__import__('re').escape(repr(value))}"):
        llm.spec_of(_with(GPT2, **{field: value}))


@pytest.mark.parametrize("field, value", [
    ("tie_word_embeddings", "no"), ("tie_word_embeddings", 1), ("attention_bias", "yes"), ("mlp_bias", "false"),
    ("rms_norm_eps", float("nan")), ("rms_norm_eps", -1e-5), ("rms_norm_eps", 0), ("rms_norm_eps", "1e-5"),
    ("rope_theta", "x"), ("rope_theta", float("inf")), ("rope_scaling", 5), ("rope_scaling", [1, 2]),
    ("hidden_act", 3), ("hidden_act", ["silu"]), ("attention_dropout", 2.0), ("pretraining_tp", 0),
    ("architectures", "LlamaForCausalLM"), ("eos_token_id", "2"), ("use_cache", "true"),
    ("model_type", ["llama"]), ("model_type", {"a": 1}), ("model_type", None), ("model_type", 7),
])
def test_other_fields_of_the_wrong_type_name_field_and_value(field, value):
    with pytest.raises(llm.LLMError, match=f"'{field}'"):
        llm.spec_of(_with(LLAMA, **{field: value}))


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size",
                                   "max_position_embeddings"])
def test_a_missing_size_field_is_named(field):
    with pytest.raises(llm.LLMError, match=f"'{field}' is missing"):
        llm.spec_of(_with(LLAMA, **{field: _with}))


def test_valid_optional_fields_are_accepted():
    spec = llm.spec_of(_with(LLAMA, num_key_value_heads=None, head_dim=None, rope_scaling={"type": "linear", "factor": 2.0},
                             eos_token_id=[1, 2], sliding_window=None, use_sliding_window=False,
                             layer_types=["full_attention"] * 32, custom_field={"anything": [1, 2]}))
    assert spec.kv_heads == spec.heads == 32 and spec.head_dim == 128
    # a window size written but not used (Qwen2 writes one with use_sliding_window false)
    assert llm.spec_of(_with(LLAMA, sliding_window=4096, use_sliding_window=False)).layers == 32


def test_odd_rotary_head_dim_is_refused():
    with pytest.raises(llm.LLMError, match="'head_dim' .* must be even"):
        llm.spec_of(_with(LLAMA, head_dim=127))


MIXTRAL = _with(LLAMA, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02, output_router_logits=False,
                sliding_window=None)
GEMMA2 = _with(LLAMA, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
               sliding_window=4096)


@pytest.mark.parametrize("cfg, keys", [
    (MIXTRAL, ["num_experts_per_tok", "num_local_experts", "router_aux_loss_coef"]),
    (GEMMA2, ["attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "sliding_window"]),
    (_with(LLAMA, sliding_window=4096), ["sliding_window"]),
    (_with(LLAMA, layer_types=["sliding_attention", "full_attention"]), ["layer_types"]),
    (_with(LLAMA, alibi=True), ["alibi"]),
    (_with(LLAMA, parallel_attn=True, new_decoder_architecture=True), ["new_decoder_architecture", "parallel_attn"]),
    (_with(LLAMA, partial_rotary_factor=0.5), ["partial_rotary_factor"]),
    (_with(LLAMA, num_experts=64, moe_intermediate_size=1408), ["moe_intermediate_size", "num_experts"]),
    (_with(GPT2, add_cross_attention=True), ["add_cross_attention"]),
    (_with(GPT2, scale_attn_by_inverse_layer_idx=True), ["scale_attn_by_inverse_layer_idx"]),
])
def test_keys_of_another_architecture_are_refused_by_name(cfg, keys):
    with pytest.raises(llm.LLMError, match="keys of another architecture") as err:
        llm.spec_of(cfg)
    message = str(err.value)
    for key in keys:
        assert f"{key}=" in message
    assert sorted(k for k in FOREIGN_KEYS if f"{k}=" in message) == keys  # exactly the set ones


def test_plan_refuses_a_relabelled_mixtral_before_any_work():
    with pytest.raises(llm.LLMError, match="num_local_experts=8"):
        llm.plan(MIXTRAL, target="spinn/board", seq=64)


def test_damaged_config_files_are_llm_errors(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(llm.LLMError, match="nests too deeply"):
        llm.spec_of(str(deep))
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(llm.LLMError, match="not valid JSON"):
        llm.spec_of(str(binary))
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(64 * 2**20)  # sparse: no disk used
    with pytest.raises(llm.LLMError, match="67108864 bytes"):
        llm.spec_of(str(big))
    array = tmp_path / "array.json"
    array.write_text("[1, 2]")
    with pytest.raises(llm.LLMError, match="expected a JSON object"):
        llm.spec_of(str(array))


def test_a_foreign_config_object_is_an_llm_error():
    class Weird:
        def to_dict(self):
            raise RuntimeError("boom")

    with pytest.raises(llm.LLMError, match="cannot read the config of Weird: RuntimeError: boom"):
        llm.spec_of(Weird())
    with pytest.raises(llm.LLMError, match="expected a transformers config"):
        llm.spec_of(42)


def test_llama_biases_are_counted_like_the_model():
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256, max_position_embeddings=64, attention_bias=True,
                         mlp_bias=True)
    model = tf.LlamaForCausalLM(cfg)
    assert llm.spec_of(model).params == sum(p.numel() for p in model.parameters())


def test_plan_batch_and_seq_are_bounded():
    for name, value in (("batch", 2**31), ("seq", 10**400), ("batch", 0), ("seq", -3), ("batch", 1.0)):
        with pytest.raises(llm.LLMError, match=f"{name} must be an integer in"):
            llm.plan(SMALL_LLAMA, **{name: value})


def test_plan_default_seq_is_the_models_position_limit_where_shorter(monkeypatch):
    small_gpt2 = {"model_type": "gpt2", "n_embd": 128, "n_head": 4, "n_layer": 2, "vocab_size": 500,
                  "n_positions": 96}
    result = llm.plan(small_gpt2, target="spinn/board")
    assert result.seq == 96
    assert "96 (the model's 96 positions)" in result.table()
    with pytest.raises(llm.LLMError, match="seq=97 is longer"):  # an explicit one is still checked
        llm.plan(small_gpt2, target="spinn/board", seq=97)


# ------------------------------------------------------------------ bounded planning memory
_PLAN_DRIVER = textwrap.dedent("""
    import json, resource, sys
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from tvm_spinn import llm
    for cfg, kwargs in json.loads(sys.argv[2]):
        try:
            llm.plan(cfg, **kwargs)
            print("planned")
        except llm.LLMError as err:
            print("LLMError:", str(err).replace(chr(10), " "))
""")
#: address space of the planning subprocess: a plan that needs more than this fails the test
#: (torch, TVM and transformers mapped, plus the 2 GB the plans may use)
_PLAN_AS_LIMIT = 6 * 2**30
_PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(llm.__file__))))
_HUGE = [  # (config changes, plan arguments, the field or argument the error names)
    ({"vocab_size": 2**31 - 1}, {"target": "spinn/cloud", "seq": 128}, "'vocab_size'=2147483647"),
    ({"max_position_embeddings": 10**8}, {"target": "spinn/cloud", "seq": 10**7}, "seq=10000000"),
    ({}, {"target": "spinn/cloud", "seq": 128, "batch": 100_000}, "batch=100000"),
    ({"intermediate_size": 2**31 - 1}, {"target": "spinn/cloud", "seq": 128}, "'intermediate_size'=2147483647"),
    ({"hidden_size": 2**20, "num_attention_heads": 2**13}, {"target": "spinn/cloud", "seq": 128},
     "'hidden_size'=1048576"),
]


def test_plan_of_huge_values_stops_with_an_error_in_bounded_memory():
    """Each case in one subprocess with its address space limited: an error naming the field
    and the bytes, before the mapping spends the host's memory."""
    cases = [(_with(LLAMA, num_hidden_layers=2, **changes), kwargs) for changes, kwargs, _ in _HUGE]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PYTHON_DIR, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _PLAN_DRIVER, str(_PLAN_AS_LIMIT), json.dumps(cases)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stdout.splitlines()
    assert len(lines) == len(_HUGE), proc.stdout
    for line, (_, _, named) in zip(lines, _HUGE):
        assert line.startswith("LLMError: ") and named in line.split(": ")[1] and str(2**34) in line, line


# ------------------------------------------------------------------ the caller's objects
def test_compile_leaves_the_callers_model_and_config_unchanged():
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16)
    cfg._attn_implementation = "sdpa"
    model = tf.GPT2LMHeadModel(cfg).train()
    before = (copy.deepcopy(model.config.to_dict()), model.config._attn_implementation,
              [m.training for m in model.modules()], {k: v.clone() for k, v in model.state_dict().items()})
    compiled = llm.compile(model, target="spinn", max_seq_len=8)
    after = (model.config.to_dict(), model.config._attn_implementation, [m.training for m in model.modules()],
             model.state_dict())
    assert after[:3] == before[:3]
    assert all(torch.equal(before[3][k], after[3][k]) for k in before[3])
    # the weights are shared, not copied
    assert compiled.model.transformer.wte.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert not compiled.model.training and compiled.model.config._attn_implementation == "eager"


@pytest.mark.slow  # ~30-60 s: GPT-2-XL's block described and mapped at 1,024 positions
def test_plan_cli_default_seq_of_the_shipped_gpt2_xl(capsys):
    from tvm_spinn.cli import main

    assert main(["plan", str(CONFIGS / "gpt2-xl.json"), "--no-progress"]) == 0
    assert "1 / 1024 (the model's 1024 positions) / int8" in capsys.readouterr().out
    with pytest.raises(llm.LLMError, match="seq=2048 is longer"):  # an explicit --seq is still checked
        llm.plan(str(CONFIGS / "gpt2-xl.json"), seq=2048)
