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


def _target(spec, register_system):
    if isinstance(spec, dict):
        return register_system(tvm_spinn.make_system("simmodes-small-sram", **spec))
    return spec


# Every mapping on the cnn and the mlp; on the transformer the default one and the small SRAM
# (the most tiles), its other four mappings with -m slow.
@pytest.mark.parametrize("name, mapping", [
    *((n, m) for n in ("cnn", "mlp") for m in sorted(_MAPPINGS)),
    *(("transformer", m) if m in ("spinn", "small-sram") else pytest.param("transformer", m, marks=pytest.mark.slow)
      for m in sorted(_MAPPINGS)),
])
def test_fp32_models_same_bits(monkeypatch, register_system, name, mapping):
    model, x = models.make(name)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    target, options = _MAPPINGS[mapping]
    ex = _build(mod, _target(target, register_system), options)
    rng = np.random.default_rng(1)
    inputs = [x.numpy(), rng.normal(size=x.shape).astype("float32") * 100]
    _assert_same_bits(monkeypatch, ex, inputs)


# Default: each model once and each system at least once (acc18, the split reductions, on the
# conv and the attention model); the other three pairs run with -m slow.
@pytest.mark.parametrize("name, system", [
    ("cnn", "acc18"), ("mlp", "spinn"), ("transformer", "acc18"),
    pytest.param("cnn", "spinn", marks=pytest.mark.slow), pytest.param("mlp", "acc18", marks=pytest.mark.slow),
    pytest.param("transformer", "spinn", marks=pytest.mark.slow),
])
def test_int8_models_same_bits(monkeypatch, register_system, name, system):
    """PTQ models on the MAC path; "acc18" has an 18-bit accumulator (safe k-chunk 7), so every
    reduction is split and the per-layer path must keep the tiles' chunk boundaries."""
    model, x = models.make(name)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    rng = np.random.default_rng(0)
    qmod = tvm_spinn.quantize(mod, [rng.normal(size=x.shape).astype("float32") for _ in range(4)])
    target = system
    if system == "acc18":
        target = register_system(tvm_spinn.make_system("simmodes-acc18", acc_bits=18))
    ex = relax.build(qmod, target=target)
    assert any(r["mode"] == "int8" for r in tvm_spinn.report(ex).layers)
    _assert_same_bits(monkeypatch, ex, [rng.normal(size=x.shape).astype("float32") for _ in range(2)])


def test_int8_wrapping_chunks_same_bits(monkeypatch, register_system):
    """Saturated operands where the chunking matters (a single accumulator over K would wrap)."""
    model, x = models.make("mlp")
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    rng = np.random.default_rng(0)
    qmod = tvm_spinn.quantize(mod, [rng.normal(size=x.shape).astype("float32") for _ in range(4)])
    target = register_system(tvm_spinn.make_system("simmodes-acc18", acc_bits=18))
    ex = relax.build(qmod, target=target)
    _assert_same_bits(monkeypatch, ex, [np.full(x.shape, 1e4, np.float32), np.full(x.shape, -1e4, np.float32)])


# Default: a conv net, a depthwise/LayerNorm one and a transformer encoder; the larger ones (their
# GEMM layer kinds are the ones above and test_more_kinds_same_bits') run with -m slow.
@pytest.mark.parametrize("name", ["resnet", pytest.param("mobilenet_v2", marks=pytest.mark.slow), "convnext", "vit",
                                  *(pytest.param(n, marks=pytest.mark.slow) for n in ("bert", "gpt2", "llama"))])
def test_zoo_same_bits(monkeypatch, name):
    pytest.importorskip("transformers")
    import test_zoo

    torch.manual_seed(0)
    model, x = test_zoo.ZOO[name]()
    mod = tvm_spinn.frontend.from_pytorch(model.eval(), (x,))
    _assert_same_bits(monkeypatch, _build(mod), [x.numpy()])


class _KindsNet(torch.nn.Module):
    """Layer kinds and conv geometries the models above do not reach: grouped, strided,
    dilated and asymmetric-padded convolutions, 1x1 convolutions, max/avg pools with padding,
    sigmoid, tanh, subtract, divide, batched matmul with a broadcast operand; a depthwise conv
    with two outputs per channel and a bias, its clip fused into it (and read by the host)."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.dw2 = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=8)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2)
        self.dw = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.pw = torch.nn.Conv2d(8, 6, 1)
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x):
        x = torch.relu(self.c1(x))
        side = torch.nn.functional.hardtanh(self.dw2(x), -0.5, 6.0)
        x = torch.sigmoid(self.c2(x)) - torch.tanh(self.dw(x))
        x = torch.nn.functional.max_pool2d(x, 3, stride=2, padding=1)
        x = torch.nn.functional.avg_pool2d(self.pw(x), 2, stride=1, padding=1, count_include_pad=False)
        y = x.flatten(2).transpose(1, 2)  # [1, P, 6]
        y = self.lin(y) / 3.0
        return torch.matmul(y.transpose(1, 2), y) + y.sum() + side.sum()


@pytest.mark.parametrize("quantized", [False, True])
def test_more_kinds_same_bits(monkeypatch, quantized):
    torch.manual_seed(0)
    model, x = _KindsNet().eval(), torch.randn(1, 4, 15, 13)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    rng = np.random.default_rng(0)
    if quantized:
        mod = tvm_spinn.quantize(mod, [rng.normal(size=x.shape).astype("float32") for _ in range(4)])
    ex = _build(mod)
    _assert_same_bits(monkeypatch, ex, [x.numpy(), rng.normal(size=x.shape).astype("float32") * 30])
