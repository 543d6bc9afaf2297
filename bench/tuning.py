"""Benchmark: fallback latency untuned TVM vs. default schedules vs. tuned vs. onnxruntime.

Each model is built all-CPU (target llvm, so the whole model is "fallback") four ways and
measured side by side in one run:

* ``untuned``   TVM's default llvm build (no schedules: serial, scalar loops)
* ``defaults``  ``with tvm_spinn.build_options():`` dlight CPU rules + ParallelVectorize
* ``tuned``     ``tvm_spinn.tune(..., max_trials_per_task=N)`` then ``build_options(tuning_logs=...)``
* ``onnxruntime`` the same model exported to ONNX, CPUExecutionProvider

Outputs of all TVM builds are compared with onnxruntime (assert_allclose). Usage::

    python bench/tuning.py                       # 64 trials per task (slow: tens of minutes)
    python bench/tuning.py --trials 8 --models cnn
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from torch import nn


class BenchCNN(nn.Module):
    """ResNet-like: conv-BN-ReLU stem, max pool, two residual blocks, global pool, FC, softmax."""

    def __init__(self, width: int = 32, classes: int = 100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.b1 = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                                nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width))
        self.down = nn.Conv2d(width, 2 * width, 1, stride=2)
        self.b2 = nn.Sequential(nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width),
                                nn.ReLU())
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = nn.functional.max_pool2d(self.stem(x), 2)
        x = torch.relu(x + self.b1(x))
        x = self.down(x)
        x = torch.relu(x + self.b2(x))
        x = nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)
        return torch.softmax(self.fc(x), dim=-1)


def make_model(name: str):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from models import TransformerBlock

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if name == "cnn":
        model, x = BenchCNN(), torch.randn(1, 3, 64, 64, generator=gen)
    elif name == "transformer":
        model, x = TransformerBlock(dim=128, heads=4, hidden=512), torch.randn(1, 64, 128, generator=gen)
    else:
        raise SystemExit(f"unknown model {name!r} (cnn, transformer)")
    return model.eval(), x


def tvm_latency(ex, x: np.ndarray, repeat: int):
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(ex, tvm.cpu())
    arg = tvm.runtime.tensor(x)
    out = vm["main"](arg)
    out = (out if hasattr(out, "numpy") else out[0]).numpy()
    res = vm.time_evaluator("main", tvm.cpu(), number=10, repeat=repeat, min_repeat_ms=50)(arg)
    return statistics.median(res.results) * 1e3, out


def ort_latency(model, x, repeat: int):
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.onnx")
        torch.onnx.export(model, (x,), path, dynamo=False, input_names=["x"], opset_version=17)
        proto = onnx.load(path)
        proto.ir_version = 9  # onnxruntime rejects newer IR versions
        onnx.save(proto, path)
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feed = {"x": x.numpy()}
    out = sess.run(None, feed)[0]
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(10):
            sess.run(None, feed)
        times.append((time.perf_counter() - start) / 10)
    return statistics.median(times) * 1e3, out


def bench(name: str, trials: int, work_root: str, repeat: int) -> dict:
    import tvm
    from tvm import relax

    import tvm_spinn

    target = tvm.target.Target({"kind": "llvm", "num-cores": os.cpu_count() or 1})
    model, x = make_model(name)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    row = {"model": name}
    row["onnxruntime"], ref = ort_latency(model, x, repeat)
    row["untuned"], out = tvm_latency(relax.build(mod, target=target), x.numpy(), repeat)
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4)
    with tvm_spinn.build_options():
        row["defaults"], out = tvm_latency(relax.build(mod, target=target), x.numpy(), repeat)
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4)
    work = os.path.join(work_root, name)
    start = time.time()
    result = tvm_spinn.tune(mod, target=target, work_dir=work, max_trials_per_task=trials, progress=True)
    row["tune_s"] = time.time() - start
    print(result.table(), flush=True)
    with tvm_spinn.build_options(tuning_logs=work):
        row["tuned"], out = tvm_latency(relax.build(mod, target=target), x.numpy(), repeat)
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4)
    row["trials"] = sum(t.trials for t in result.tasks)
    row["tasks"] = len(result.tasks)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=64, help="trials per task")
    parser.add_argument("--models", default="transformer,cnn")
    parser.add_argument("--work-dir", default="bench_tuning_logs", help="tuning logs (resumed if present)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    rows = [bench(m, args.trials, args.work_dir, args.repeat) for m in args.models.split(",")]
    print(f"\nlatency in ms (median of {args.repeat}; {os.cpu_count()} cores; "
          f"{args.trials} trials per task)")
    header = ("model", "untuned", "defaults", "tuned", "onnxruntime", "tuned/ort", "tasks", "trials", "tune s")
    print(" | ".join(f"{h:>11}" for h in header))
    for r in rows:
        cells = (r["model"], f"{r['untuned']:.3f}", f"{r['defaults']:.3f}", f"{r['tuned']:.3f}",
                 f"{r['onnxruntime']:.3f}", f"{r['tuned'] / r['onnxruntime']:.2f}x", str(r["tasks"]),
                 str(r["trials"]), f"{r['tune_s']:.0f}")
        print(" | ".join(f"{c:>11}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
