"""spinn/cuda: the VM hands the spinn module tensors in GPU memory; the executor stages them
through host copies. No GPU here, so a stand-in tensor reports an accelerator device and records
the copies; on a GPU machine ``bench/tuning_gpu.py`` runs the same path for real."""

import numpy as np
import torch
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.program.manifest import MANIFEST_SYMBOL
from tvm_spinn.runtime import executor

from models import make


class _Device:
    def dlpack_device_type(self):
        return 2  # kDLCUDA


class FakeGpuTensor:
    """What the executor may use of a tvm Tensor on a GPU: shape, dtype, numpy(), copyfrom()."""

    device = _Device()

    def __init__(self, array):
        self._array = np.array(array)
        self.shape, self.dtype = self._array.shape, self._array.dtype
        self.copies_in = 0

    def numpy(self):
        return self._array.copy()

    def copyfrom(self, source):
        self.copies_in += 1
        self._array[...] = source


def test_gpu_tensors_are_staged_through_host_memory():
    model, x = make("mlp")
    ex = relax.build(tvm_spinn.frontend.from_pytorch(model, (x,)), target="spinn")
    modules = [m for m in tvm_spinn.report_modules(ex) if m["get_symbol"]() != MANIFEST_SYMBOL]
    assert len(modules) == 1
    module = modules[0]
    symbol, data = module["get_symbol"](), bytes(module["get_program"]())
    program = tvm_spinn.program.Program.from_bytes(data)
    assert len(program.inputs) == 1 and len(program.outputs) == 1
    out_desc = program.tensors[program.outputs[0]]
    inp, out = FakeGpuTensor(x.numpy()), FakeGpuTensor(np.full(out_desc.shape, np.nan, out_desc.dtype))
    executor.execute("test_device_staging", lambda: data, symbol, inp, out)
    assert out.copies_in == 1
    host = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy())).numpy()
    np.testing.assert_array_equal(out.numpy(), host)  # same bits as the host path
    with torch.no_grad():
        np.testing.assert_allclose(out.numpy(), model(x).numpy(), rtol=1e-4, atol=1e-5)
