"""Described int8 programs quantize each activation tensor once, as post-training quantization
does (:mod:`tvm_spinn.quant.insert`): the GEMMs that read one hidden state (q, k and v; gate and
up) share its ``quantize``."""

from __future__ import annotations

import importlib

import pytest

from tvm_spinn.llm.spec import spec_of

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 64}


def _described(cfg, fuse: bool = True):
    P = importlib.import_module("tvm_spinn.llm.plan")
    from tvm_spinn.llm.describe import describe
    from tvm_spinn.llm.graphs import LayerStep

    spec = spec_of(cfg)
    model = P._meta_model(cfg, spec)
    _, module, args = P._parts(model, spec, 1, 16)[0]
    if not fuse:  # the q, k, v and gate, up projections as the model's separate GEMMs
        module = LayerStep(model, spec, 16, fuse=False).eval()
    return [d.program for d in describe(module, args, "spinn", "int8")]


@pytest.mark.parametrize("fuse", [False, True])
def test_one_quantize_per_activation_tensor(fuse):
    from tvm_spinn.program.ops import family_of

    programs = _described(TINY_LLAMA, fuse)
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
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    if fuse:  # one GEMM each of the concatenated columns
        assert [q + 2 * kv] in widths and [2 * spec.intermediate] in widths
        assert sum(len(g) for g in readers.values()) == 4 and len(readers) == 4
    else:
        assert sorted([q, kv, kv]) in widths and [spec.intermediate, spec.intermediate] in widths
        assert sum(len(g) for g in readers.values()) == 7 and len(readers) == 4


def _two_quantizes(scales, zeros):
    """A program whose input is quantized twice (scales ``scales``, zero points ``zeros``), each
    quantize read by its own dense layer."""
    import numpy as np

    from tvm_spinn.program import Layer, Program, TensorDesc
    from tvm_spinn.target.arch import SpinnArch

    tensors = [TensorDesc("x", [2, 8], "float32", "input")]
    constants, layers = {}, []

    def add(name, shape, dtype, role, value=None):
        tensors.append(TensorDesc(name, list(shape), dtype, role))
        if value is not None:
            constants[len(tensors) - 1] = np.asarray(value, dtype=dtype).reshape(shape)
        return len(tensors) - 1

    for i, (s, z) in enumerate(zip(scales, zeros)):
        xq = add(f"xq{i}", (2, 8), "int8", "temp")
        layers.append(Layer(name=f"q{i}", kind="quantize", inputs=[0], output=xq,
                            consts={"scale": add(f"xs{i}", (1,), "float32", "const", s),
                                    "zero": add(f"xz{i}", (1,), "int32", "const", z)}, attrs={"axis": 1}))
        layers.append(Layer(name=f"d{i}", kind="dense", inputs=[xq], output=add(f"y{i}", (2, 4), "float32", "output"),
                            consts={"weight": add(f"w{i}", (8, 4), "int8", "const", np.zeros((8, 4))),
                                    "scale": add(f"ws{i}", (4,), "float32", "const", np.ones(4))},
                            attrs={"x_zero": 0, "x_flip": False, "relu": False, "out": "float32"}, mode="int8"))
    outputs = [layer.output for layer in layers if layer.kind == "dense"]
    return Program("main", SpinnArch(), tensors, [0], outputs, layers, constants=constants)


def _quantizes_left(scales, zeros) -> list:
    from tvm_spinn.program.ops.gemm import share_quantizes

    program = _two_quantizes(scales, zeros)
    layers = share_quantizes(program, list(program.layers))
    dense = [layer for layer in layers if layer.kind == "dense"]
    assert len(dense) == 2
    kept = [layer for layer in layers if layer.kind == "quantize"]
    assert {d.inputs[0] for d in dense} == {q.output for q in kept}  # every dense reads a kept quantize
    return kept


def test_share_quantizes_keys_on_the_constants_values():
    """One input quantized with equal scale and zero point values (distinct tensors): one
    quantize; with a different scale or a different zero point: both kept."""
    assert len(_quantizes_left([0.5, 0.5], [3, 3])) == 1
    assert len(_quantizes_left([0.5, 0.25], [3, 3])) == 2
    assert len(_quantizes_left([0.5, 0.5], [3, 4])) == 2
