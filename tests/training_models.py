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
    opt = (torch.optim.SGD if name == "sgd" else torch.optim.Adam)(model.parameters(), **opts)
    loss_fn = torch.nn.CrossEntropyLoss() if loss == "cross_entropy" else torch.nn.MSELoss()
    losses = []
    for x, y in batches:
        opt.zero_grad()
        out = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y))
        out.backward()
        opt.step()
        losses.append(out.item())
    return losses, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


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
