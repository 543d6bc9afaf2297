"""Walking-skeleton benchmark: compile time, simulation time and accuracy, side by side.

For each model (transformers ResNet and BERT from small configs, random weights) it measures in
one run: spinn compile time vs TVM's own llvm build, the simulator's wall time vs onnxruntime and
vs the llvm build on the same input, the max error against PyTorch, and the simulated latency
and roofline from the timing model. Not a test: prints a table.

    python bench/quickstart.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np
import torch
import tvm
from tvm import relax

import tvm_spinn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_zoo_transformers import _bert, _resnet  # noqa: E402  (the zoo's model builders)


def _best(fn, repeat=5):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    import onnxruntime

    rows = []
    for name, make in (("resnet", _resnet), ("bert", _bert)):
        model, x = make()
        with torch.no_grad():
            ref = model(x).numpy()
        mod = tvm_spinn.frontend.from_pytorch(model, (x,))
        t0 = time.perf_counter()
        ex = relax.build(mod, target="spinn")
        compile_spinn = time.perf_counter() - t0
        t0 = time.perf_counter()
        ex_llvm = relax.build(mod, target="llvm")
        compile_llvm = time.perf_counter() - t0
        vm = relax.VirtualMachine(ex, tvm.cpu())
        vm_llvm = relax.VirtualMachine(ex_llvm, tvm.cpu())
        xt = tvm.runtime.tensor(x.numpy())
        out = vm["main"](xt).numpy()
        sim_s = _best(lambda: vm["main"](xt))
        llvm_s = _best(lambda: vm_llvm["main"](xt))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "m.onnx")
            torch.onnx.export(model, (x,), path, dynamo=False, input_names=["x"], opset_version=17)
            sess = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
            feed = {"x": x.numpy()}
            ort_s = _best(lambda: sess.run(None, feed))
        rep = tvm_spinn.report(ex)
        rows.append((name, np.abs(out - ref).max(), compile_spinn, compile_llvm, sim_s, llvm_s, ort_s,
                     rep.latency_s, rep.roofline_s, sum(rep.offloaded_ops.values()), sum(rep.fallback_ops.values())))
    head = (f"{'model':<8}{'max err':>10}{'compile s':>10}{'llvm s':>8}{'ratio':>7}{'sim ms':>9}{'llvm ms':>9}"
            f"{'ort ms':>8}{'sim/ort':>9}{'spinn us':>10}{'roof us':>9}{'lat/roof':>9}{'off/fb':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r[0]:<8}{r[1]:>10.2e}{r[2]:>10.2f}{r[3]:>8.2f}{r[2] / r[3]:>7.2f}{r[4] * 1e3:>9.2f}{r[5] * 1e3:>9.2f}"
              f"{r[6] * 1e3:>8.2f}{r[4] / r[6]:>9.1f}{r[7] * 1e6:>10.1f}{r[8] * 1e6:>9.1f}{r[7] / r[8]:>9.2f}"
              f"{f'{r[9]}/{r[10]}':>8}")


if __name__ == "__main__":
    main()
