"""Model zoo: real architectures from `transformers` configs (small sizes, random weights, nothing
downloaded), compiled for "spinn" and compared with PyTorch.

Tolerance: rtol=1e-4, atol=1e-4 on O(1) outputs. Only the fp32 summation order differs (the M4F
sums sequentially; MKL in blocks), plus BatchNorm folded into conv weights in fp64 and rounded
once. For the K <= ~1500 reductions and up to 4 stacked layers here that is < 1e-5 typical,
a few 1e-5 worst case after LayerNorm rescaling. Keras models are covered in
test_frontend_tflite.py.
"""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn

tf = pytest.importorskip("transformers")


class _Field(torch.nn.Module):
    def __init__(self, model, field, **kwargs):
        super().__init__()
        self.model, self.field, self.kwargs = model, field, kwargs

    def forward(self, x):
        return getattr(self.model(x, **self.kwargs), self.field)


def _image(seed=0, size=32):
    return torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _tokens(seed=0, n=16, vocab=100):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _causal(cfg):
    cfg._attn_implementation = "eager"  # the sdpa mask path does not go through torch.export
    return cfg


ZOO = {
    "resnet": lambda: (_Field(tf.ResNetModel(tf.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck")), "pooler_output"), _image()),
    "mobilenet_v2": lambda: (_Field(tf.MobileNetV2Model(tf.MobileNetV2Config(
        depth_multiplier=0.35, image_size=64)), "pooler_output"), _image(size=64)),
    "convnext": lambda: (_Field(tf.ConvNextModel(tf.ConvNextConfig(
        hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)), "pooler_output"), _image()),
    "vit": lambda: (_Field(tf.ViTModel(tf.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32,
        patch_size=8), add_pooling_layer=False), "last_hidden_state"), _image()),
    "bert": lambda: (_Field(tf.BertModel(tf.BertConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=32)), "last_hidden_state"), _tokens()),
    "gpt2": lambda: (_Field(tf.GPT2Model(_causal(tf.GPT2Config(
        vocab_size=100, n_embd=64, n_layer=2, n_head=2, n_positions=32))), "last_hidden_state", use_cache=False), _tokens()),
    "llama": lambda: (_Field(tf.LlamaModel(_causal(tf.LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))), "last_hidden_state", use_cache=False), _tokens()),
}


# MobileNetV2 (~10 s: 17 blocks) runs with -m slow: its depthwise convolutions with fused ReLU6,
# folded BatchNorm and residual adds are each covered by default (test_ops.py, test_e2e.py's cnn,
# test_zoo_transformers.py's resnet), and its partition by test_partition_speed.py.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "mobilenet_v2" else n
                                  for n in sorted(ZOO)])
def test_zoo_model(name):
    torch.manual_seed(0)
    model, x = ZOO[name]()
    model = model.eval()
    with torch.no_grad():
        ref = model(x).numpy()
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    summary = tvm_spinn.summarize_partition(tvm_spinn.partition_for_spinn(mod))
    print(f"{name}: offloaded {sum(summary.offloaded_ops.values())} {summary.offloaded_ops}; "
          f"fallback {sum(summary.fallback_ops.values())} {summary.fallback_ops}")
    compute_ops = {"relax.nn.conv2d", "relax.matmul"}
    assert not compute_ops & set(summary.fallback_ops), summary.fallback_ops
    ex = relax.build(mod, target="spinn")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy())).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
