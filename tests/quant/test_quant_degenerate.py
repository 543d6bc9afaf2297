"""Degenerate calibration data (all zeros, constant inputs) is refused, naming tensor and inputs.

With all-zero samples every calibrated range is ``[0, 0]``; quantizing anyway gives an int8
model whose error is of the order of the whole output range.
"""

import numpy as np
import pytest
import torch
from torch import nn

import tvm_spinn
from tvm_spinn.quant import QuantizationError


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fa, self.fb = nn.Linear(8, 6), nn.Linear(8, 6)

    def forward(self, a, b):
        return torch.relu(self.fa(a)) + self.fb(b)


def _module():
    torch.manual_seed(0)
    a, b = torch.randn(2, 8), torch.randn(2, 8)
    return tvm_spinn.frontend.from_pytorch(_TwoInputs(), (a, b))


def test_all_zero_calibration_is_refused():
    mod = _module()
    zeros = [{"a": np.zeros((2, 8), "float32"), "b": np.zeros((2, 8), "float32")}] * 3
    with pytest.raises(QuantizationError) as err:
        tvm_spinn.quantize(mod, zeros)
    msg = str(err.value)
    assert "is constant (0) over all 3 sample(s)" in msg and "['a', 'b']" in msg, msg


def test_one_constant_input_is_named():
    mod = _module()
    rng = np.random.default_rng(0)
    data = [{"a": np.full((2, 8), 0.5, "float32"), "b": rng.normal(size=(2, 8)).astype("float32")}
            for _ in range(3)]
    with pytest.raises(QuantizationError, match=r"input\(s\) \['a'\] hold one constant value"):
        tvm_spinn.quantize(mod, data)


def test_varied_calibration_quantizes():
    mod = _module()
    rng = np.random.default_rng(0)
    data = [{"a": rng.normal(size=(2, 8)).astype("float32"),
             "b": rng.normal(size=(2, 8)).astype("float32")} for _ in range(3)]
    qmod = tvm_spinn.quantize(mod, data)
    assert len(qmod.attrs["spinn_quantization"]) == 2


class _DeadBranch(nn.Module):
    """``relu(-|x|)`` is 0 for every input: a constant tensor feeding a GEMM, inputs varied."""

    def __init__(self):
        super().__init__()
        self.fa, self.fb = nn.Linear(8, 6), nn.Linear(8, 6)

    def forward(self, x):
        return self.fa(x) + self.fb(torch.relu(-torch.abs(x)))


def test_constant_tensor_with_varied_inputs_warns_and_quantizes(caplog):
    torch.manual_seed(0)
    model = _DeadBranch()
    x = torch.randn(2, 8)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    rng = np.random.default_rng(0)
    data = [rng.normal(size=(2, 8)).astype("float32") for _ in range(3)]
    with caplog.at_level("WARNING", logger="tvm_spinn.quant.calibrate"):
        qmod = tvm_spinn.quantize(mod, data)
    assert "although the inputs vary" in caplog.text
    assert len(qmod.attrs["spinn_quantization"]) == 2
