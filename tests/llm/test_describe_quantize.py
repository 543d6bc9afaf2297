"""Described int8 programs quantize each activation tensor once, as post-training quantization
does (:mod:`tvm_spinn.quant.insert`): the GEMMs that read one hidden state (q, k and v; gate and
up) share its ``quantize``."""

from __future__ import annotations

import importlib

from tvm_spinn.llm.spec import spec_of

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 64}


def _described(cfg):
    P = importlib.import_module("tvm_spinn.llm.plan")
    from tvm_spinn.llm.describe import describe

    spec = spec_of(cfg)
    _, module, args = P._parts(P._meta_model(cfg, spec), spec, 1, 16)[0]
    return [d.program for d in describe(module, args, "spinn", "int8")]


def test_one_quantize_per_activation_tensor():
    from tvm_spinn.program.ops import family_of

    programs = _described(TINY_LLAMA)
    readers = {}  # (program, quantize output) -> the int8 GEMMs reading it
    for k, program in enumerate(programs):
        made = {layer.output: layer for layer in program.layers if family_of(layer.kind).quantizes(layer)}
        inputs = [layer.inputs[0] for layer in made.values()]
        assert len(inputs) == len(set(inputs)), "two quantize layers of one activation"
        for layer in program.layers:
            if layer.kind == "dense" and layer.mode == "int8":
                assert layer.inputs[0] in made, f"{layer.name} reads no quantize"
                readers.setdefault((k, layer.inputs[0]), []).append(layer)
    # q, k and v share the block's normed hidden state, gate and up the MLP's; o and down their own
    widths = sorted(sorted(int(programs[k].tensors[g.output].shape[-1]) for g in gemms)
                    for (k, _), gemms in readers.items())
    spec = spec_of(TINY_LLAMA)
    qkv = sorted([spec.heads * spec.head_dim] + 2 * [spec.kv_heads * spec.head_dim])
    assert qkv in widths and [spec.intermediate, spec.intermediate] in widths
    assert sum(len(g) for g in readers.values()) == 7 and len(readers) == 4
