"""Real architectures from `transformers` configs (random weights, nothing downloaded).

Same tolerance argument as test_e2e.py: only the fp32 summation order differs from PyTorch
and llvm (K <= 1152 here), so rtol=1e-4 / atol=1e-5 relative to O(1) activations. BatchNorm
folding into the convolutions (done in fp64, rounded once) adds < 1 ulp per weight.
"""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn

transformers = pytest.importorskip("transformers")


class _Pooled(torch.nn.Module):
    def __init__(self, model, field):
        super().__init__()
        self.model, self.field = model, field

    def forward(self, x):
        return getattr(self.model(x), self.field)


def _resnet():
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64],
                                    depths=[1, 1, 1], layer_type="basic")
    torch.manual_seed(0)
    model = _Pooled(transformers.ResNetModel(cfg), "pooler_output").eval()
    # Non-trivial BatchNorm statistics so that folding is actually exercised.
    gen = torch.Generator().manual_seed(1)
    for mod in model.modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.running_mean.copy_(torch.randn(mod.num_features, generator=gen) * 0.1)
            mod.running_var.copy_(torch.rand(mod.num_features, generator=gen) + 0.5)
    return model, torch.randn(1, 3, 32, 32, generator=gen)


def _bert():
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=128, max_position_embeddings=32)
    torch.manual_seed(0)
    model = _Pooled(transformers.BertModel(cfg), "last_hidden_state").eval()
    return model, torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("make,must_offload", [
    (_resnet, {"spinn.conv2d_bias_relu", "spinn.conv2d_bias", "spinn.max_pool2d", "spinn.mean"}),
    # BERT with -m slow: its numerics are test_zoo.py's bert, its offloaded set test_e2e.py's
    # transformer block, the export/reload the resnet's here
    pytest.param(_bert, {"spinn.dense_bias", "spinn.matmul", "spinn.softmax", "spinn.layer_norm", "spinn.gelu"},
                 marks=pytest.mark.slow),
], ids=["resnet", "bert"])
def test_transformers_model(make, must_offload, tmp_path):
    model, x = make()
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    summary = tvm_spinn.summarize_partition(tvm_spinn.partition_for_spinn(mod))
    assert must_offload <= set(summary.offloaded_ops), summary
    assert not {"relax.nn.conv2d", "relax.matmul", "relax.nn.batch_norm"} & set(summary.fallback_ops)
    with torch.no_grad():
        ref = model(x).numpy()
    ex = relax.build(mod, target="spinn")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy())).numpy()
    llvm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x.numpy())).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got, llvm, rtol=1e-4, atol=1e-5)
    path = tmp_path / "model.so"
    ex.export_library(str(path))
    lib = tvm_spinn.load_module(path)
    again = relax.VirtualMachine(lib, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy())).numpy()
    assert np.array_equal(again, got)
    rep = tvm_spinn.report(lib)
    assert rep.latency_s >= rep.physical_bound_s > 0 and rep.roofline_s > 0


def test_gpt2_single_token_offloads_its_split_attention():
    """GPT-2 splits its fused QKV projection: the split becomes slices whose TupleGetItems are
    canonicalized away (a one-token input once left a TupleGetItem inside a region)."""
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32)
    torch.manual_seed(0)
    # inside a wrapper, with transformers' default use_cache=True: the importer turns the cache
    # off for the export (a DynamicCache's concat with an empty past is not importable) and back on
    model = _Pooled(transformers.GPT2Model(cfg), "last_hidden_state").eval()
    for seq in (1, 5):
        x = torch.randint(0, 100, (1, seq), generator=torch.Generator().manual_seed(seq))
        mod = tvm_spinn.frontend.from_pytorch(model, (x,))
        assert model.model.config.use_cache is True
        summary = tvm_spinn.summarize_partition(tvm_spinn.partition_for_spinn(mod))
        assert "relax.split" not in summary.fallback_ops and summary.offloaded_ops.get("spinn.take") == 2, summary
        out = relax.VirtualMachine(relax.build(mod, target="spinn"), tvm.cpu())["main"](tvm.runtime.tensor(x.numpy())).numpy()
        with torch.no_grad():
            np.testing.assert_allclose(out, model(x).numpy(), rtol=1e-4, atol=1e-5)
