"""End-to-end numerics: PyTorch / ONNX -> relax.build(target="spinn") vs framework and llvm.

Tolerances: the spinn simulator accumulates each fp32 dot product sequentially (the M4F's
order), PyTorch/MKL and TVM's llvm code use blocked/vectorized orders; the difference is
reordering error, bounded by ~K * eps32 * sum|a*b|. For these models (K <= 288, activations
O(1)) that is < 1e-5 relative; we assert rtol=1e-4, atol=1e-5.
"""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn
from models import make

RTOL, ATOL = 1e-4, 1e-5


def _run(ex, x):
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x))
    return out.numpy() if hasattr(out, "numpy") else out[0].numpy()


@pytest.mark.parametrize("name", ["cnn", "mlp", "transformer"])
def test_pytorch_matches_torch_and_llvm(name):
    model, x = make(name)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    with torch.no_grad():
        ref = model(x).numpy()
    got = _run(relax.build(mod, target="spinn"), x.numpy())
    llvm = _run(relax.build(mod, target="llvm"), x.numpy())
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got, llvm, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["cnn", "mlp", "transformer"])
def test_onnx_matches_onnxruntime_and_llvm(name, tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    model, x = make(name, seed=1)
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=False, input_names=["x"], opset_version=17)
    sess = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ref = sess.run(None, {"x": x.numpy()})[0]
    mod = tvm_spinn.frontend.from_onnx(str(path))
    got = _run(relax.build(mod, target="spinn"), x.numpy())
    llvm = _run(relax.build(mod, target="llvm"), x.numpy())
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got, llvm, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name,expected", [
    ("cnn", {"spinn.conv2d_bias_relu", "spinn.max_pool2d", "spinn.add", "spinn.mean"}),
    ("mlp", {"spinn.dense_bias_relu", "spinn.dense_bias", "spinn.softmax"}),
    ("transformer", {"spinn.layer_norm", "spinn.dense_bias", "spinn.matmul", "spinn.softmax", "spinn.gelu", "spinn.add"}),
])
def test_partition_offloads_compute_ops(name, expected):
    model, x = make(name)
    part = tvm_spinn.partition_for_spinn(tvm_spinn.frontend.from_pytorch(model, (x,)))
    summary = tvm_spinn.summarize_partition(part)
    assert expected <= set(summary.offloaded_ops), summary
    # No conv / matmul / softmax / layer_norm left on the fallback target.
    assert not {"relax.nn.conv2d", "relax.matmul", "relax.nn.softmax", "relax.nn.layer_norm"} & set(summary.fallback_ops)
    assert summary.regions >= 1


def test_prepartitioned_module_builds_the_same(tmp_path):
    model, x = make("mlp")
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    direct = _run(relax.build(mod, target="spinn"), x.numpy())
    part = tvm_spinn.partition_for_spinn(mod, target="spinn")
    again = _run(relax.build(part, target="spinn"), x.numpy())
    assert np.array_equal(direct, again)


def test_report_is_consistent():
    model, x = make("cnn")
    ex = relax.build(tvm_spinn.frontend.from_pytorch(model, (x,)), target="spinn")
    rep = tvm_spinn.report(ex)
    assert rep.latency_s >= rep.physical_bound_s > 0 and rep.roofline_s > 0
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert rep.weight_bytes == weight_bytes
    # Weights either stay resident (loaded at program load) or cross DRAM every inference.
    assert rep.dram_bytes + rep.resident_weight_bytes >= weight_bytes
    with tvm_spinn.MappingOptions(weights="stream"):
        streamed = tvm_spinn.report(relax.build(tvm_spinn.frontend.from_pytorch(model, (x,)), target="spinn"))
    assert streamed.resident_weight_bytes == 0 and streamed.dram_bytes >= weight_bytes
    assert streamed.latency_s >= streamed.physical_bound_s == rep.physical_bound_s  # no mapping moves it
    assert rep.energy_j > 0 and 0 < rep.pe_utilization <= 1
    assert rep.cycles == sum(row["cycles"] for row in rep.layers)
    # each row names the mapping's decision for its layer: tile shape and PE range
    for row, record in zip(rep.layers, rep.programs[0].mapping.layers):
        assert row["tile"] == list(record.tile) and row["pe_range"] == list(record.pes)
    assert "tile" in rep.table().splitlines()[0]
    assert "conv2d" in str(rep)


def test_negative_index_select_is_normalized():
    """``x[:, -1]`` (LM heads take the last position) imports as ``take(x, -1, mode="fast")``,
    which TVM evaluates out of bounds; the front-end fixup makes it ``take(x, n - 1)``."""

    class LastPosition(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x)[:, -1] * 2.0

    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    mod = tvm_spinn.frontend.from_pytorch(LastPosition(), (x,))
    want = LastPosition()(x).numpy()
    for target in ("llvm", "spinn"):
        np.testing.assert_allclose(_run(relax.build(mod, target=target), x.numpy()), want, rtol=0, atol=0)
