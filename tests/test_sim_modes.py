"""Simulator execution modes: "layers" (default: one kernel call per GEMM layer block over all of
K; int8 in the program's accumulator-safe k-chunks) against "tiles" (the mapping executed tile by
tile, k-chunk by k-chunk; the reference). Each output reduces in ascending k on one PE whatever the
tiling, so the two must give identical bits: every model is built once and run in both modes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.mapping import MappingOptions
from tvm_spinn.runtime.simulator import sim_mode

import models


def _both_modes(monkeypatch, ex, inputs):
    """Outputs of ``ex`` on each input in "tiles" and in "layers" mode."""
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = {}
    for mode in ("tiles", "layers"):
        monkeypatch.setenv("TVM_SPINN_SIM_MODE", mode)
        out[mode] = [vm["main"](tvm.runtime.tensor(x)).numpy() for x in inputs]
    return out["tiles"], out["layers"]


def _assert_same_bits(monkeypatch, ex, inputs):
    assert any(r["kind"] in ("conv2d", "dense", "matmul") for r in tvm_spinn.report(ex).layers)
    tiles, layers = _both_modes(monkeypatch, ex, inputs)
    for t, l in zip(tiles, layers):
        assert t.dtype == l.dtype and np.array_equal(t.view(np.uint8), l.view(np.uint8))


def _build(mod, target="spinn", options=None):
    with options or MappingOptions():
        return relax.build(mod, target=target)


def test_mode_selection(monkeypatch):
    monkeypatch.delenv("TVM_SPINN_SIM_MODE", raising=False)
    assert sim_mode() == "layers"
    monkeypatch.setenv("TVM_SPINN_SIM_MODE", "tiles")
    assert sim_mode() == "tiles" and sim_mode("layers") == "layers"
    monkeypatch.setenv("TVM_SPINN_SIM_MODE", "bogus")
    with pytest.raises(ValueError, match="TVM_SPINN_SIM_MODE"):
        sim_mode()


_MAPPINGS = {
    "spinn": ("spinn", None),
    "board": ("spinn/board", None),
    "naive": ("spinn", MappingOptions(naive=True)),
    "pipelined": ("spinn", MappingOptions(mode="pipelined")),
    "stream": ("spinn", MappingOptions(weights="stream")),
    "small-sram": (dict(sram_bytes=24 * 1024, sram_reserved_bytes=4096), None),
}


def _target(spec):
    if isinstance(spec, dict):
        return tvm_spinn.register_system(tvm_spinn.make_system("simmodes-small-sram", **spec))
    return spec


@pytest.mark.parametrize("mapping", sorted(_MAPPINGS))
@pytest.mark.parametrize("name", ["cnn", "mlp", "transformer"])
def test_fp32_models_same_bits(monkeypatch, name, mapping):
    model, x = models.make(name)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    target, options = _MAPPINGS[mapping]
    ex = _build(mod, _target(target), options)
    rng = np.random.default_rng(1)
    inputs = [x.numpy(), rng.normal(size=x.shape).astype("float32") * 100]
    _assert_same_bits(monkeypatch, ex, inputs)


@pytest.mark.parametrize("system", ["spinn", "acc18"])
@pytest.mark.parametrize("name", ["cnn", "mlp", "transformer"])
def test_int8_models_same_bits(monkeypatch, name, system):
    """PTQ models on the MAC path; "acc18" has an 18-bit accumulator (safe k-chunk 7), so every
    reduction is split and the per-layer path must keep the tiles' chunk boundaries."""
    model, x = models.make(name)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    rng = np.random.default_rng(0)
    qmod = tvm_spinn.quantize(mod, [rng.normal(size=x.shape).astype("float32") for _ in range(4)])
    target = system
    if system == "acc18":
        target = tvm_spinn.register_system(tvm_spinn.make_system("simmodes-acc18", acc_bits=18))
    ex = relax.build(qmod, target=target)
    assert any(r["mode"] == "int8" for r in tvm_spinn.report(ex).layers)
    _assert_same_bits(monkeypatch, ex, [rng.normal(size=x.shape).astype("float32") for _ in range(2)])


def test_int8_wrapping_chunks_same_bits(monkeypatch):
    """Saturated operands where the chunking matters (a single accumulator over K would wrap)."""
    model, x = models.make("mlp")
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    rng = np.random.default_rng(0)
    qmod = tvm_spinn.quantize(mod, [rng.normal(size=x.shape).astype("float32") for _ in range(4)])
    target = tvm_spinn.register_system(tvm_spinn.make_system("simmodes-acc18", acc_bits=18))
    ex = relax.build(qmod, target=target)
    _assert_same_bits(monkeypatch, ex, [np.full(x.shape, 1e4, np.float32), np.full(x.shape, -1e4, np.float32)])


@pytest.mark.parametrize("name", ["resnet", "mobilenet_v2", "convnext", "vit", "bert", "gpt2", "llama"])
def test_zoo_same_bits(monkeypatch, name):
    pytest.importorskip("transformers")
    import test_zoo

    torch.manual_seed(0)
    model, x = test_zoo.ZOO[name]()
    mod = tvm_spinn.frontend.from_pytorch(model.eval(), (x,))
    _assert_same_bits(monkeypatch, _build(mod), [x.numpy()])
