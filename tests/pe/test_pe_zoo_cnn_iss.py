"""The zoo's CNNs (ResNet, MobileNetV2, ConvNeXt from transformers configs, random weights) in
``iss`` mode: every region's layers run as Cortex-M4F code in the emulator and give the default
simulator's bits (convolutions, depthwise convolutions, pooling, folded BatchNorm, layer norm,
GELU, residual adds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tvm import relax

pytest.importorskip("unicorn")
pytest.importorskip("elftools")
pytest.importorskip("ziglang")
pytest.importorskip("transformers")

import tvm_spinn  # noqa: E402
import tvm_spinn.pe as pe  # noqa: E402
from tvm_spinn.pe.firmware import programs_of  # noqa: E402


def _assert_bits(want: np.ndarray, got: np.ndarray) -> None:
    """Bitwise equality, NaN signs and payloads included."""
    assert want.shape == got.shape and want.dtype == got.dtype == np.float32
    wb, gb = want.view(np.uint32).reshape(-1), got.view(np.uint32).reshape(-1)
    diff = np.flatnonzero(wb != gb)
    assert diff.size == 0, (f"{diff.size} of {wb.size} differ, first at {diff[:5]}: simulator "
                            f"{[hex(v) for v in wb[diff[:5]]]} iss {[hex(v) for v in gb[diff[:5]]]}")


@pytest.mark.slow  # ~6-18 s each on 2 workers: the build and every tile of the model in the ISS
@pytest.mark.parametrize("name", ["convnext", "mobilenet_v2", "resnet"])
def test_zoo_cnn_under_iss_option_equals_simulator(name, monkeypatch):
    """Called inside ``with SpinnOptions(iss=True)``, every spinn region of the model runs in
    the ISS (each region once) and the output has the default simulator's bits."""
    import tvm
    from test_zoo import ZOO

    monkeypatch.delenv("TVM_SPINN_SIM_MODE", raising=False)
    torch.manual_seed(0)
    model, x = ZOO[name]()
    ex = relax.build(tvm_spinn.frontend.from_pytorch(model.eval(), (x,)), target="spinn")
    programs = programs_of(ex)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    want = vm["main"](tvm.runtime.tensor(x.numpy())).numpy()
    calls = []
    real = pe.run_program_iss
    monkeypatch.setattr(pe, "run_program_iss", lambda p, i: calls.append(p.symbol) or real(p, i))
    with tvm_spinn.SpinnOptions(iss=True):
        got = vm["main"](tvm.runtime.tensor(x.numpy())).numpy()
    assert sorted(calls) == sorted(p.symbol for p in programs)
    _assert_bits(want, got)
    with torch.no_grad():
        ref = model(x).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)  # test_zoo.py's tolerance
