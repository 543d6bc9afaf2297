"""Small models and data shared by the training tests (seeded: same init on every run)."""

from __future__ import annotations

import copy

import numpy as np
import torch


def mlp(seed: int = 0, d_in: int = 16, hidden: int = 32, d_out: int = 10) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, d_out))


def classification_data(seed: int = 1, batch: int = 8, d_in: int = 16, classes: int = 10):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, d_in)).astype(np.float32)
    y = rng.integers(0, classes, batch).astype(np.int64)
    return x, y


def torch_reference(model, batches, loss: str, optimizer) -> tuple[list[float], dict[str, np.ndarray]]:
    """Train a copy of ``model`` with PyTorch on ``batches`` [(x, y)]; (losses, final params)."""
    model = copy.deepcopy(model).train()
    name, opts = optimizer
    opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name](model.parameters(), **opts)
    loss_fn = torch.nn.CrossEntropyLoss() if loss == "cross_entropy" else torch.nn.MSELoss()
    losses = []
    for x, y in batches:
        opt.zero_grad()
        out = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y))
        out.backward()
        opt.step()
        losses.append(out.item())
    return losses, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def torch_adamw(model, batches, opts) -> tuple[list[float], dict[str, np.ndarray]]:
    """Train a copy of ``model`` with torch.optim.AdamW (cross entropy); (losses, final params)."""
    return torch_reference(model, batches, "cross_entropy", ("adamw", opts))


class LM(torch.nn.Module):
    """A causal LM's logits as (batch * seq, vocab), the shape cross-entropy trains."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        logits = self.lm(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        return logits.reshape(-1, logits.shape[-1])


def small_cnn(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 2 * 2, 10))


def batchnorm_cnn(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 10))


class _Block(torch.nn.Module):
    """Pre-norm transformer block: multi-head self-attention and a GELU MLP, both residual."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, dim)

    def forward(self, x):
        b, s, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.norm1(x)).reshape(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) * (d // h) ** -0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


class TinyTransformer(torch.nn.Module):
    """Two transformer blocks on a (batch, seq, features) input, mean-pooled, then a classifier
    (no embedding table: the tokens come in as vectors)."""

    def __init__(self, d_in: int = 8, dim: int = 16, heads: int = 2, hidden: int = 32, layers: int = 2,
                 classes: int = 10):
        super().__init__()
        self.embed = torch.nn.Linear(d_in, dim)
        self.blocks = torch.nn.Sequential(*[_Block(dim, heads, hidden) for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.embed(x))).mean(dim=1))


def transformer(seed: int = 0, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TinyTransformer(**kwargs)


def run_steps(trainer, batches):
    """``trainer``'s losses over ``batches`` and its parameters after them."""
    return [trainer.step(x, y) for x, y in batches], trainer.parameters()


def same_bits(run, ref) -> bool:
    """Whether two :func:`run_steps` results have the same losses and bitwise equal parameters."""
    return run[0] == ref[0] and sorted(run[1]) == sorted(ref[1]) and all(
        run[1][n].tobytes() == ref[1][n].tobytes() for n in ref[1])
