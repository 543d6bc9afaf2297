"""tvm_spinn.llm.compile(quantize=True): int8 weight GEMMs, float32 attention against the float32
KV cache (so a decode step never quantizes the cache), logits close to transformers' float32 ones."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import tvm_spinn  # noqa: E402
from tvm_spinn import llm  # noqa: E402
from tvm_spinn.llm import accuracy as acc  # noqa: E402

SLOTS = 32


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64)
    model = tf.GPT2LMHeadModel(cfg)
    model.config._attn_implementation = "eager"
    model.eval()
    return model, llm.compile(model, target="spinn", max_seq_len=SLOTS, batch=1, quantize=True)


def test_decode_step_quantizes_the_weight_gemms_and_never_the_cache(gpt2):
    _, compiled = gpt2
    rep = tvm_spinn.report(compiled.decode_executable()[0])
    programs = rep.programs
    layers = [(p, layer) for p in programs for layer in p.layers]
    dense = [layer for _, layer in layers if layer.kind == "dense"]
    attention = [layer for _, layer in layers if layer.kind == "matmul"]
    assert dense and all(layer.mode == "int8" for layer in dense)  # projections, MLPs, LM head
    assert len(attention) == 2 * 2 and all(layer.mode == "fp32" for layer in attention)  # q K^T, p V a block
    # the cache of one layer: 4 heads x 16 x 32 slots of float32 (K^T and V alike)
    cache = 4 * 16 * SLOTS * 4
    quantized = [p.tensors[layer.inputs[0]].nbytes for p, layer in layers if layer.kind == "quantize"]
    assert quantized and max(quantized) < cache, quantized  # hidden rows and MLP rows only


def test_int8_logits_stay_close_to_float32(gpt2):
    model, compiled = gpt2
    ids = np.random.default_rng(3).integers(0, 256, (1, 12))
    got = acc.compiled_logits(compiled, ids, prefill=4)
    ref = acc.torch_logits(model, ids)[:, 3:]
    err = np.abs(got - ref)
    assert err.max() / np.abs(ref).max() < 0.1 and err.mean() / np.abs(ref).mean() < 0.05
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.75
