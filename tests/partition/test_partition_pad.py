"""Explicit zero padding folds into the convolution that reads it (``partition/pad.py``).

TF-style "same" padding (``F.pad`` then an unpadded conv) must reach the PEs as one region, give
the bits of the same convolution written with its own padding, and match PyTorch; pads that are
not +0.0 on the spatial axes are not folded (a constant pad runs as its own PE layer, a reflect
pad stays on the host) and stay correct.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from tvm import relax

import tvm_spinn


class _PadConv(torch.nn.Module):
    """``pad`` -> conv (no padding) -> ReLU, twice (the second a depthwise conv)."""

    def __init__(self, pads, stride, mode="constant", value=0.0):
        super().__init__()
        self.pads, self.mode, self.value = pads, mode, value
        self.conv = torch.nn.Conv2d(4, 8, 3, stride=stride)
        self.dw = torch.nn.Conv2d(8, 8, 3, groups=8)

    def _pad(self, x):
        if self.mode == "constant":
            return F.pad(x, self.pads, mode="constant", value=self.value)
        return F.pad(x, self.pads, mode=self.mode)

    def forward(self, x):
        y = torch.relu(self.conv(self._pad(x)))
        return torch.relu(self.dw(self._pad(y)))


def _run(model, x, target="spinn"):
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    ex = relax.build(mod, target=target)
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    return out.numpy(), mod


def _summary(mod):
    return tvm_spinn.partition.summarize_partition(tvm_spinn.partition.partition_for_spinn(mod))


# F.pad order: (left, right, top, bottom)
@pytest.mark.parametrize("pads", [(0, 1, 0, 1), (1, 1, 1, 1), (2, 0, 1, 3), (0, 0, 0, 0)])
@pytest.mark.parametrize("stride", [1, 2])
def test_zero_pad_folds_and_matches_torch(pads, stride):
    torch.manual_seed(0)
    model = _PadConv(pads, stride).eval()
    x = torch.randn(1, 4, 11, 12)
    got, mod = _run(model, x)
    summary = _summary(mod)
    assert summary.regions == 1 and "relax.nn.pad" not in summary.fallback_ops, summary
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_folded_pad_has_the_bits_of_the_padded_conv():
    """pad(1) + conv(padding 0) and conv(padding 1) with the same weights: identical bits."""
    torch.manual_seed(1)
    padded = torch.nn.Conv2d(3, 6, 3)
    same = torch.nn.Conv2d(3, 6, 3, padding=1)
    same.load_state_dict(padded.state_dict())
    x = torch.randn(1, 3, 9, 9)

    class Explicit(torch.nn.Module):
        def forward(self, x):
            return padded(F.pad(x, (1, 1, 1, 1)))

    a, _ = _run(Explicit().eval(), x)
    b, _ = _run(same.eval(), x)
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("mode,value", [("constant", 1.5), ("reflect", None), ("constant", -0.0)])
def test_other_pads_are_not_folded_and_stay_correct(mode, value):
    torch.manual_seed(2)
    model = _PadConv((1, 1, 1, 1), 1, mode=mode, value=value if value is not None else 0.0).eval()
    x = torch.randn(1, 4, 10, 10)
    got, mod = _run(model, x)
    summary = _summary(mod)
    assert "spinn.conv2d_bias_relu" in summary.offloaded_ops, summary
    if mode == "constant":  # not folded: the pads are PE layers of the one region
        assert summary.regions == 1 and summary.offloaded_ops.get("spinn.pad") == 2, summary
    else:  # the gathers torch exports for reflect stay on the host and cut the graph in two
        assert summary.regions == 2, summary
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_channel_pad_is_not_folded():
    """A pad on the channel axis changes the conv's input channels: it must not fold."""
    torch.manual_seed(3)
    conv = torch.nn.Conv2d(6, 5, 3, padding=1)

    class ChannelPad(torch.nn.Module):
        def forward(self, x):
            return conv(F.pad(x, (0, 0, 0, 0, 1, 1)))

    x = torch.randn(1, 4, 8, 8)
    got, mod = _run(ChannelPad().eval(), x)
    assert _summary(mod).offloaded_ops.get("spinn.pad", 0) == 1  # its own layer, not the conv's padding
    with torch.no_grad():
        want = ChannelPad()(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
