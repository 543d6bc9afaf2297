"""The projections that read one input run as one GEMM each (q, k and v; gate and up:
:meth:`tvm_spinn.llm.graphs._Step._fuse`): the compiled steps' outputs keep the bits of the separate
GEMMs, in float32 and with per-channel int8 weights (the same per-column sums and scales), and
the planned block runs fewer GEMMs in less time."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from tvm_spinn import llm  # noqa: E402
from tvm_spinn.llm import graphs  # noqa: E402
from tvm_spinn.llm.session import CompiledLLM  # noqa: E402
from tvm_spinn.llm.spec import spec_of  # noqa: E402

SLOTS = 16


def _model(kind: str):
    torch.manual_seed(0)
    sizes = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    if kind == "qwen2":  # biased q/k/v projections
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**sizes))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**sizes))
    return model.eval()


def _run(model, quantize, fuse: bool, monkeypatch):
    """Tokens, teacher-forced logits and the decode step's latency of ``model`` compiled with
    the projections fused or apart."""
    with monkeypatch.context() as m:
        m.setattr(CompiledLLM, "_fuses", lambda self: fuse)
        compiled = llm.compile(model, target="spinn", max_seq_len=SLOTS, quantize=quantize)
        ids = np.random.default_rng(3).integers(0, 256, (1, 6))
        tokens = compiled.generate(ids, 4)
        logits = compiled.score(tokens, prefill=4)
        return tokens, logits, compiled.report().decode_latency_s


def _check(kind, quantize, monkeypatch):
    model = _model(kind)
    apart = _run(model, quantize, False, monkeypatch)
    fused = _run(model, quantize, True, monkeypatch)
    np.testing.assert_array_equal(fused[0], apart[0])
    assert np.array_equal(fused[1], apart[1]), np.abs(fused[1] - apart[1]).max()  # every bit
    # two weight GEMMs a block fewer (their barriers, tiles and hand-offs)
    assert fused[2] < apart[2], (fused[2], apart[2])


def test_fused_llama_keeps_every_bit_fp32(monkeypatch):
    _check("llama", None, monkeypatch)


@pytest.mark.slow  # four int8 builds with calibration (~40 s)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_keeps_every_bit_int8(kind, monkeypatch):
    _check(kind, True, monkeypatch)


def test_compile_fuses_unless_weights_share_one_scale():
    model = _model("llama")
    assert llm.compile(model, max_seq_len=SLOTS, quantize=None)._fuses()
    assert llm.compile(model, max_seq_len=SLOTS, quantize=True)._fuses()  # per-channel weights: a scale a column
    # one scale over the concatenated weights would not be the separate GEMMs' scales
    assert not llm.compile(model, max_seq_len=SLOTS, quantize="per-tensor")._fuses()


def test_fused_weights_are_the_projections_concatenated():
    model = _model("qwen2")
    spec = spec_of(model)
    step = graphs.Decode(model, spec, SLOTS)
    for i, block in enumerate(model.model.layers):
        attn, mlp = block.self_attn, block.mlp
        ref = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        assert torch.equal(step.fused[f"qkv{i}"], ref)
        assert torch.equal(step.fused[f"qkv{i}bias"], torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
        assert torch.equal(step.fused[f"gate_up{i}"], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        assert f"gate_up{i}bias" not in step.fused
    # the torch step's outputs: the separate projections' within float32 rounding
    apart = graphs.Decode(model, spec, SLOTS, fuse=False)
    ks = torch.zeros(spec.layers, spec.kv_heads, spec.head_dim, SLOTS)
    vs = torch.zeros(spec.layers, spec.kv_heads, SLOTS, spec.head_dim)
    write = torch.arange(SLOTS) == 0
    mask = torch.where(write, 0.0, torch.finfo(torch.float32).min)
    cos, sin = graphs.rotary_tables(model, torch.zeros(1, 1, dtype=torch.int64))
    args = (torch.tensor([[5]]), ks, vs, write, mask, cos, sin)
    with torch.no_grad():
        a, b = step(*args), apart(*args)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_steps_share_one_copy_of_the_concatenated_weights():
    """Every step given one cache (each prompt length's prefill, the decode step) holds
    the same concatenated q/k/v and gate/up tensors, equal to the projections' weights stacked
    by hand; a weight changed in place is concatenated afresh for the steps built after."""
    model = _model("qwen2")
    spec = spec_of(model)
    cache = {}
    steps = [graphs.Prefill(model, spec, SLOTS, 4, fused_cache=cache),
             graphs.Prefill(model, spec, SLOTS, 6, fused_cache=cache), graphs.Decode(model, spec, SLOTS, fused_cache=cache)]
    for i, block in enumerate(model.model.layers):
        attn, mlp = block.self_attn, block.mlp
        for name, parts in ((f"qkv{i}", [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                            (f"qkv{i}bias", [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]),
                            (f"gate_up{i}", [mlp.gate_proj.weight, mlp.up_proj.weight])):
            assert all(step.fused[name] is steps[0].fused[name] for step in steps), name
            rows = np.concatenate([p.detach().numpy() for p in parts])
            np.testing.assert_array_equal(steps[0].fused[name].detach().numpy(), rows)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.add_(1.0)
    later = graphs.Decode(model, spec, SLOTS, fused_cache=cache)
    assert not hasattr(model, "_tvm_spinn_fused")  # the model itself is left as it was
    assert later.fused["qkv0"] is not steps[0].fused["qkv0"] and later.fused["gate_up0"] is steps[0].fused["gate_up0"]
    k = model.model.layers[0].self_attn.k_proj.weight
    rows = later.fused["qkv0"].detach().numpy()[model.model.layers[0].self_attn.q_proj.weight.shape[0]:][:k.shape[0]]
    np.testing.assert_array_equal(rows, k.detach().numpy())
