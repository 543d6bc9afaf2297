"""Default fallback schedules: CPU (dlight + parallel/vectorize) and CUDA (compile-only)."""

import os
import shutil
import threading

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.fallback import default_schedule_pass, prepare_fallback
from tvm_spinn.tune import current_build_options

from models import make

LLVM = tvm.target.Target({"kind": "llvm", "num-cores": os.cpu_count() or 1})


def _run(ex, x):
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x))
    return (out if hasattr(out, "numpy") else out[0]).numpy()


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_default_schedules_match_untuned_build(name):
    model, x = make(name)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    untuned = _run(relax.build(mod, target=LLVM), x.numpy())
    with tvm_spinn.build_options():
        scheduled = _run(relax.build(mod, target=LLVM), x.numpy())
    np.testing.assert_allclose(scheduled, untuned, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(untuned, model(x).detach().numpy(), rtol=1e-3, atol=1e-4)


def test_every_cpu_task_gets_a_parallel_or_vectorized_schedule():
    model, x = make("cnn")
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    with LLVM:
        mod = default_schedule_pass(LLVM)(prepare_fallback(mod))
    funcs = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert funcs and all(f.attrs.get("tirx.is_scheduled", False) for f in funcs.values())
    convs = [f.script() for name, f in funcs.items() if "conv2d" in name]
    assert convs and all("T.vectorized" in s for s in convs)
    assert any("T.parallel" in s for s in convs)


def test_spinn_target_fallback_is_default_scheduled_and_correct():
    model, x = make("transformer")
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    ref = _run(relax.build(mod, target=LLVM), x.numpy())
    got = _run(relax.build(mod, target="spinn"), x.numpy())
    # Measured: |spinn - llvm| <= 4.8e-7 on outputs up to 4.3 (GEMMs on the simulator sum in
    # ascending k, llvm in its own order): fp32 reordering only, so fp32-level tolerances.
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, model(x).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_build_options_is_thread_local_and_validated(tmp_path):
    seen = []
    with tvm_spinn.build_options(default_schedules=False) as opts:
        assert current_build_options() is opts
        t = threading.Thread(target=lambda: seen.append(current_build_options()))
        t.start()
        t.join()
    assert seen == [None] and current_build_options() is None
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tvm_spinn.build_options(tuning_logs=str(tmp_path / "missing"))
    with pytest.raises(TypeError, match="default_schedules"):
        tvm_spinn.build_options(default_schedules="yes")
    with pytest.raises(TypeError, match="tuning_logs"):
        tvm_spinn.build_options(tuning_logs=3)


def _cuda_sources(ex):
    out, stack = [], [ex.mod]
    while stack:
        m = stack.pop()
        if m.kind == "cuda":
            out.append(m.inspect_source())
        stack.extend(m.imports)
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the system nvcc (compile only)")
def test_spinn_cuda_fallback_compiles_with_nvcc():
    from tvm.support import nvcc

    import torch

    class NotOffloaded(torch.nn.Module):  # softmax over axis 0 and a column mean stay on the GPU
        def forward(self, x):
            return torch.softmax(x, dim=0) * 2.0 + x.mean(0, keepdim=True)

    x = torch.randn(32, 48)
    mod = tvm_spinn.frontend.from_pytorch(NotOffloaded().eval(), (x,))
    target = tvm_spinn.get_target("spinn/cuda")
    ex = relax.build(mod, target=target)
    sources = _cuda_sources(ex)
    assert sources and all("__global__" in s for s in sources)
    with target:
        for src in sources:
            ptx = nvcc.compile_cuda(src, target_format="ptx", compiler="nvcc")
            assert b".entry" in bytes(ptx)


def test_unit_reduction_with_epilogue_is_not_miscompiled():
    """A 1x1 conv of one channel has reduction extent 1; dlight's normalization would inline the
    fused epilogue into the update (exp(exp(0) + x*w)). Such kernels keep TVM's lowering."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 1, 7, 7], "float32"))
    w = relax.Var("w", relax.TensorType([1, 1, 1, 1], "float32"))  # a runtime weight: fallback
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.exp(relax.op.nn.conv2d(x, w)))
            gv = bb.emit_output(y)
        bb.emit_func_output(gv)
    mod = bb.get()
    xs = np.linspace(-1, 1, 49, dtype="float32").reshape(1, 1, 7, 7)
    ws = np.full((1, 1, 1, 1), 0.5, dtype="float32")
    for target in ("spinn", LLVM):
        ex = relax.build(mod, target=target)
        vm = relax.VirtualMachine(ex, tvm.cpu())
        got = vm["main"](tvm.runtime.tensor(xs), tvm.runtime.tensor(ws)).numpy()
        np.testing.assert_allclose(got, np.exp(xs * 0.5), rtol=1e-6)


def test_zero_size_constant_survives_export_and_reload(tmp_path):
    """A zero-size constant (an ONNX input frozen to shape (3, 0, 5)) used to be saved in the
    executable's constant pool, which TVM cannot load back; the spinn build must reload."""
    data = np.zeros((3, 0, 5), dtype="int64")
    bb = relax.BlockBuilder()
    with bb.function("main", []):
        with bb.dataflow():
            gv = bb.emit_output(relax.op.tril(relax.const(tvm.runtime.tensor(data)), 1))
        bb.emit_func_output(gv)
    path = str(tmp_path / "zero.so")
    relax.build(bb.get(), target="spinn").export_library(path)
    out = relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())["main"]()
    assert out.numpy().shape == (3, 0, 5) and out.numpy().dtype == np.int64


def test_erf_tanh_exp_are_vectorized_and_accurate():
    """float32 erf/tanh/exp become TVM's fast approximations on llvm: vectorized loops, and
    within 1e-6 (erf, tanh: absolute; exp: relative) of the exact functions over the whole
    range, clamping regions included; MetaSchedule can extract and estimate them."""
    import math

    xs = np.linspace(-12, 12, 8192, dtype=np.float32).reshape(64, 128)
    x = relax.Var("x", relax.TensorType(xs.shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.emit_output(relax.Tuple([relax.op.erf(x), relax.op.tanh(x), relax.op.exp(x * relax.const(7.0, "float32"))]))
        bb.emit_func_output(gv)
    mod = bb.get()
    with LLVM:
        scheduled = default_schedule_pass(LLVM)(prepare_fallback(mod))
    text = scheduled.script()
    assert "T.erf" not in text and "T.tanh" not in text and "T.exp" not in text and "T.vectorized" in text
    with tvm_spinn.build_options():
        out = relax.VirtualMachine(relax.build(mod, target=LLVM), tvm.cpu())["main"](tvm.runtime.tensor(xs))
    exact = [np.vectorize(math.erf)(xs.astype(np.float64)), np.tanh(xs.astype(np.float64))]
    for got, want in zip(out[:2], exact):
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(out[2].numpy(), np.exp((np.float32(7.0) * xs).astype(np.float64)), rtol=1e-6, atol=1e-37)
    from tvm.s_tir.analysis import estimate_tir_flops

    from tvm_spinn.tune.tasks import extract_fallback_tasks

    for task in extract_fallback_tasks(mod, LLVM):  # no Let: MetaSchedule handles them
        assert "T.let" not in task.dispatched[0].script() and estimate_tir_flops(task.dispatched[0]) > 0
    # other targets keep the exact intrinsics
    with tvm.target.Target("cuda"):
        assert "T.erf" in prepare_fallback(mod).script()
