"""Small real architectures with deterministic random weights, shared by the tests."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Conv/BN-free CNN: conv-relu-pool x2, residual add, global pool, classifier."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = nn.functional.max_pool2d(x, 2)
        x = torch.relu(self.conv2(x))
        x = x + torch.relu(self.conv3(x))
        x = torch.relu(self.dw(x))
        x = nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


class MLP(nn.Module):
    def __init__(self, dims=(64, 128, 128, 10)):
        super().__init__()
        layers = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(dims) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return torch.softmax(self.net(x), dim=-1)


class TransformerBlock(nn.Module):
    """Pre-LN transformer encoder block (BERT-style separate q/k/v): attention + GELU MLP."""

    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 128):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        b, s, d = x.shape
        h = self.heads
        y = self.ln1(x)
        q, k, v = self.q(y), self.k(y), self.v(y)
        q, k, v = (t.reshape(b, s, h, d // h).permute(0, 2, 1, 3) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) * (d // h) ** -0.5, dim=-1)
        y = (att @ v).permute(0, 2, 1, 3).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


def make(name: str, seed: int = 0):
    """Model and example input, deterministic for a seed."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "cnn":
        model, x = SmallCNN(), torch.randn(1, 3, 16, 16, generator=gen)
    elif name == "mlp":
        model, x = MLP(), torch.randn(4, 64, generator=gen)
    elif name == "transformer":
        model, x = TransformerBlock(), torch.randn(1, 16, 64, generator=gen)
    else:
        raise KeyError(name)
    return model.eval(), x


def tiny_gpt2_lm(n_layer: int, seed: int = 0):
    """A tiny GPT-2 language model from a transformers config (random weights, untied head, no
    dropout): ``(config dict, module mapping ids to logits rows, example ids (2, 8))``."""
    import transformers

    cfg = dict(model_type="gpt2", n_embd=16, n_head=2, n_layer=n_layer, n_positions=8, vocab_size=24,
               tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config = transformers.GPT2Config(**{k: v for k, v in cfg.items() if k != "model_type"}, use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()

    class LM(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.reshape(-1, 24)

    return cfg, LM(model), torch.randint(0, 24, (2, 8))


def save_sub_onnx(path, output: str = "out", opset: int = 17) -> None:
    """ONNX ``output = a - b`` with two (2, 3) float32 inputs (the order of the inputs matters
    for the result), saved at ``path`` with IR version 9 (onnxruntime's)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Sub", ["a", "b"], [output])], "sub",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("a", "b")],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, [2, 3])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9), str(path))
