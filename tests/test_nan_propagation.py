"""Optimizer settings are checked by name, as ``torch.optim`` checks them.

A negative, NaN or infinite learning rate (or momentum, weight decay, eps, betas outside
``[0, 1)``), a value of the wrong type, or an unknown key is one :class:`TrainingError` naming
the optimizer and the setting, before anything is built.
"""

import numpy as np
import pytest
import torch

import tvm_spinn
from tvm_spinn.training import TrainingError
from tvm_spinn.training.graph import make_optimizer

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("name, options, message", [
    ("sgd", {"lr": -1.0}, r"option 'lr' must be >= 0 and finite, got -1.0"),
    ("sgd", {"lr": NAN}, r"option 'lr' must be >= 0 and finite, got nan"),
    ("sgd", {"lr": INF}, r"option 'lr' must be >= 0 and finite, got inf"),
    ("sgd", {"lr": "0.1"}, r"option 'lr' must be a real number, got str '0.1'"),
    ("sgd", {"lr": True}, r"option 'lr' must be a real number, got bool True"),
    ("sgd", {"lr": None}, r"option 'lr' must be a real number, got NoneType None"),
    ("sgd", {"lr": 0.1, "momentum": -0.5}, r"option 'momentum' must be >= 0"),
    ("sgd", {"lr": 0.1, "weight_decay": NAN}, r"option 'weight_decay' must be >= 0"),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": "yes"}, r"option 'nesterov' must be a bool, got str"),
    ("sgd", {"lr": 0.1, "lr_decay": 0.1}, r"unsupported option 'lr_decay' of optimizer 'sgd'"),
    ("sgd", {"lr": 0.1, 3: 0.1}, r"unsupported option 3 of optimizer 'sgd'"),
    ("adam", {"lr": 1e-3, "betas": (0.9, 1.0)}, r"option 'betas\[1\]' must be \[0, 1\), got 1.0"),
    ("adam", {"lr": 1e-3, "betas": (-0.1, 0.999)}, r"option 'betas\[0\]' must be \[0, 1\)"),
    ("adam", {"lr": 1e-3, "betas": 0.9}, r"option 'betas' must be a pair"),
    ("adam", {"lr": 1e-3, "eps": -1e-8}, r"option 'eps' must be >= 0"),
    ("adam", {"lr": 1e-3, "eps": NAN}, r"option 'eps' must be >= 0"),
    ("adam", {"lr": -1e-3}, r"optimizer 'adam': option 'lr' must be >= 0"),
])
def test_bad_optimizer_settings_are_refused_by_name(name, options, message):
    with pytest.raises(TrainingError, match=message):
        make_optimizer((name, options))
    # the negative and out-of-range values are PyTorch's own refusals (it lets NaN, inf and
    # bools through its `value < 0` checks: a NaN step there gives NaN parameters)
    known = {k: v for k, v in options.items() if isinstance(k, str) and k in ("lr", "momentum", "weight_decay",
                                                                              "betas", "eps")}
    betas = known.get("betas") if isinstance(known.get("betas"), tuple) else ()
    out_of_range = [v for v in known.values() if isinstance(v, float) and v < 0] + [b for b in betas if not 0 <= b < 1]
    if out_of_range:
        cls = torch.optim.SGD if name == "sgd" else torch.optim.Adam
        with pytest.raises(ValueError):
            cls([torch.nn.Parameter(torch.zeros(1))], **known)


@pytest.mark.parametrize("optimizer", [("rmsprop", {"lr": 0.1}), (["sgd"], {"lr": 0.1})])
def test_unknown_optimizer_name(optimizer):
    with pytest.raises(TrainingError, match="unsupported optimizer"):
        make_optimizer(optimizer)


def test_valid_settings_build_and_numpy_scalars_are_numbers():
    assert make_optimizer(("sgd", {"lr": np.float32(0.5), "momentum": np.float64(0.9), "nesterov": np.bool_(True)}))
    assert make_optimizer(("adam", {"lr": 0, "betas": [0.0, 0.5], "eps": 0.0, "weight_decay": 1}))


def test_compile_refuses_a_negative_learning_rate_before_building():
    model = torch.nn.Linear(4, 2)
    with pytest.raises(TrainingError, match="optimizer 'sgd': option 'lr' must be >= 0 and finite, got -1.0"):
        tvm_spinn.training.compile(model, torch.zeros(2, 4), optimizer=("sgd", {"lr": -1.0}))
