"""The in-process MetaSchedule builder: CUDA candidates on a thread pool (NVRTC releases the
GIL), in candidate order, each failure that candidate's own error; llvm candidates serial."""

import pytest
import tvm
from tvm import relax, te
from tvm.s_tir import meta_schedule as ms

from tvm_spinn.tune.builder import InProcessBuilder


def _gpu_func(n: int) -> tvm.IRModule:
    """``B = A * 2`` over ``n`` elements, bound to blocks and threads (a valid CUDA kernel)."""
    from tvm.s_tir import dlight as dl

    a = te.placeholder((n,), "float32", name="A")
    b = te.compute((n,), lambda i: a[i] * 2.0, name="B")
    mod = tvm.IRModule({"main": te.create_prim_func([a, b])})
    target = _cuda()
    with target:
        return dl.ApplyDefaultSchedule(dl.gpu.Fallback())(mod)


def _cuda() -> tvm.target.Target:
    return tvm.target.Target({"kind": "cuda", "arch": "sm_80", "max_num_threads": 1024,
                              "max_threads_per_block": 1024, "thread_warp_size": 32,
                              "max_shared_memory_per_block": 49152, "registers_per_block": 65536,
                              "host": "llvm"})


def test_cuda_candidates_build_on_threads_in_order():
    target = _cuda()
    bb = relax.BlockBuilder()  # not a tensor program: this candidate's build fails
    x = relax.Var("x", relax.TensorType([2], "float32"))
    with bb.function("main", [x]):
        bb.emit_func_output(x)
    broken = bb.get()
    inputs = [ms.builder.BuilderInput(_gpu_func(n), target) for n in (64, 128, 256)]
    inputs.insert(1, ms.builder.BuilderInput(broken, target))
    serial = InProcessBuilder(max_workers=1).build(inputs)
    threaded = InProcessBuilder(max_workers=4).build(inputs)
    for one, many in zip(serial, threaded):
        assert (one.error_msg is None) == (many.error_msg is None)
    assert [r.error_msg is None for r in threaded] == [r.error_msg is None for r in serial]
    assert [r.error_msg is None for r in threaded] == [True, False, True, True]
    assert "InProcessBuilder" in threaded[1].error_msg


def test_max_workers_must_be_positive():
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        InProcessBuilder(max_workers=0)
