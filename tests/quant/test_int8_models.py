"""Quantized models end to end on the MAC path: onnxruntime-quantized ONNX models and
``tvm_spinn.quantize`` results, built for "spinn" and run on the simulator.

References and tolerances:

- onnxruntime-quantized models (QDQ and QOperator) are compared with onnxruntime running the
  graph as written (the ONNX semantics: DequantizeLinear -> fp32 op -> QuantizeLinear); QOperator
  models with onnx's ReferenceEvaluator (numpy; com.microsoft ops from their specs in
  quant_models.py), since their integer ops run on MLAS even with optimizations off. The
  integer accumulators are exact on both sides; the requantization differs (fp32 there, a 31-bit
  fixed-point multiplier here), which can move a value on a rounding boundary by one step. So: at
  most 1 output step, and at least 95% of the outputs identical (measured: 100%).
- They are also compared with onnxruntime's fused int8 kernels (MLAS), with the same bound, on
  CPUs where those kernels are exact. On x86 without VNNI, MLAS's u8s8 kernels multiply with
  `vpmaddubsw`, which saturates pairs of products to int16 (onnxruntime documents this and
  recommends `reduce_range` there): measured 3 steps off on an AVX2-only EPYC for
  `cnn-qdq_channel_s8_asym`, where the as-written graph and spinn agree exactly. There the fused
  comparison is left out; the as-written comparison always runs.
- PTQ results are compared with the same quantized Relax module built for llvm (fp32
  dequantize -> GEMM -> quantize), and with PyTorch fp32. Per requantized layer the two integer
  paths differ by at most one step of that layer's output; over a chain of D GEMMs that is
  bounded by D steps of the output's quantization, i.e. a few 1/255 of the output range; the
  fp32 comparison uses the PTQ error bound 2*D/255 of the output range (see test_quant_ptq.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_spinn

import models
import quant_models as qm


def _run(ex, inputs):
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return np.stack([vm["main"](tvm.runtime.tensor(x)).numpy() for x in inputs])


def _int8_layers(ex) -> int:
    return sum(row["mode"] == "int8" for row in tvm_spinn.report(ex).layers)


@pytest.mark.parametrize("variant", sorted(qm.VARIANTS))
@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_onnxruntime_quantized_model(tmp_path, model, variant):
    build = qm.quantized_cnn if model == "cnn" else qm.quantized_mlp
    path, evals = build(tmp_path, n_eval=4, **qm.VARIANTS[variant])
    mod = tvm_spinn.frontend.from_onnx(path)
    summary = tvm_spinn.summarize_partition(tvm_spinn.partition_for_spinn(mod))
    assert summary.fallback_ops == {}, summary.fallback_reasons
    ex = relax.build(mod, target="spinn")
    # every conv / matmul of the model (5 in each) runs on the MAC arrays
    assert _int8_layers(ex) == 5
    got = _run(ex, evals)
    if qm.VARIANTS[variant]["fmt"] == "QOperator":
        # its integer ops (QLinearConv, ...) run on MLAS even with optimizations off
        as_written = np.stack([qm.onnx_reference_run(path, {"x": x})[0] for x in evals])
    else:
        as_written = np.stack([qm.ort_run(path, {"x": x}, disable_optimizations=True)[0]
                               for x in evals])
    _assert_within_one_step(got, as_written, qm.output_step(path))
    if not qm.ort_int8_kernels_exact():
        return  # MLAS's u8s8 kernels saturate int16 pairs on x86 without VNNI (module docstring)
    fused = np.stack([qm.ort_run(path, {"x": x})[0] for x in evals])
    _assert_within_one_step(got, fused, qm.output_step(path))


def _assert_within_one_step(got: np.ndarray, ref: np.ndarray, step: float) -> None:
    # Outputs are dequantized fp32 values: their own rounding is <= |v| * 2**-24, far below
    # 1e-4 of a step for the few hundred steps these outputs span.
    steps = np.abs(got.astype(np.float64) - ref) / step
    assert steps.max() <= 1 + 1e-4
    assert np.mean(steps < 1e-4) >= 0.95


@pytest.mark.parametrize("name,depth", [("cnn", 5), ("mlp", 3), ("transformer", 6)])
def test_ptq_model_on_the_mac_path(name, depth):
    model, x = models.make(name)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    rng = np.random.default_rng(0)
    calib = [rng.normal(size=x.shape).astype("float32") for _ in range(8)]
    qmod = tvm_spinn.quantize(mod, calib)
    n_gemms = sum(1 for v in qmod.attrs["spinn_quantization"].values() if not v["kept_fp32"])
    ex = relax.build(qmod, target="spinn")
    assert _int8_layers(ex) == n_gemms > 0
    evals = [rng.normal(size=x.shape).astype("float32") for _ in range(4)]
    got = _run(ex, evals)
    same_module_llvm = _run(relax.build(qmod, target="llvm"), evals)
    import torch

    with torch.no_grad():
        fp32 = np.stack([model(torch.from_numpy(e)).numpy() for e in evals])
    span = np.abs(fp32).max()
    assert np.abs(got - same_module_llvm).max() <= depth * span / 255
    assert np.abs(got - fp32).max() <= 2 * depth * span / 255


def test_keep_fp32_layer_runs_on_the_m4f():
    model, x = models.make("cnn")
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    calib = [np.random.default_rng(1).normal(size=x.shape).astype("float32") for _ in range(4)]
    names = tvm_spinn.quantizable_layers(mod)
    full = relax.build(tvm_spinn.quantize(mod, calib), target="spinn")
    partial = relax.build(tvm_spinn.quantize(mod, calib, keep_fp32=[names[0]]), target="spinn")
    assert _int8_layers(partial) == _int8_layers(full) - 1
    modes = [row["mode"] for row in tvm_spinn.report(partial).layers if row["kind"] == "conv2d"]
    assert modes[0] == "fp32" and set(modes[1:]) == {"int8"}


def test_int8_build_is_deterministic():
    model, x = models.make("mlp")
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    calib = [np.random.default_rng(2).normal(size=x.shape).astype("float32") for _ in range(4)]
    blobs = []
    for _ in range(2):
        ex = relax.build(tvm_spinn.quantize(mod, calib), target="spinn")
        blobs.append([p.to_bytes() for p in tvm_spinn.report(ex).programs])
    assert blobs[0] == blobs[1]
