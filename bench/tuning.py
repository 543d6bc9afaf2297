"""Benchmark: fallback latency untuned TVM vs. default schedules vs. tuned vs. onnxruntime.

Each model is built all-CPU (target llvm, so the whole model is "fallback") four ways and
measured side by side in one run:

* ``untuned``   TVM's default llvm build (no schedules: serial, scalar loops)
* ``defaults``  ``with tvm_spinn.build_options():`` dlight CPU rules + ParallelVectorize
* ``tuned``     ``tvm_spinn.tune(..., max_trials_per_task=N)`` then ``build_options(tuning_logs=...)``
* ``onnxruntime`` the same model exported to ONNX, CPUExecutionProvider

Outputs of all TVM builds are compared with onnxruntime (assert_allclose). The four are timed
in interleaved rounds (``--repeat``; each round runs every side once, in rotated order) and the
medians printed: on a shared machine, timing one build after another compares the load of two
moments, not the builds. Within a round each side makes single calls for about 50 ms and its
figure is the fastest call: a single-threaded run on a loaded machine loses the CPU for whole
scheduler slices, so the mean over a block of calls measures the CPU share it got more than
the code (the block means are printed too, to show how much). ``tuned/default`` is the median
of the per-round ratios (the two ran back to back), with the rounds in which tuned was faster.

Both sides get the same threads (``--threads``, default: the CPUs this process may use; TVM's
runtime would otherwise take half the logical CPUs, assuming hyper-threading) and TVM compiles
for this host's CPU (``-mcpu``, default ``llvm_get_system_cpu()``: without it LLVM emits
baseline SSE2 code). Both are printed. Per model, a per-task table shows where the tuned
build's time goes against this CPU's measured FLOP/byte roofline. Usage::

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


def _threads_from_argv(argv) -> int:
    """``--threads`` as given (default: usable CPUs), read before numpy/torch/TVM start pools."""
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--threads=") else (
            argv[i + 1] if arg == "--threads" and i + 1 < len(argv) else None)
        if value is not None and value.isdigit() and int(value) > 0:
            return int(value)
    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    # every pool of the run gets the same threads: TVM's runtime (also in MetaSchedule's
    # measuring processes, which inherit it), BLAS (the roofline's peak), onnxruntime (below)
    for _name in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_name] = str(_threads_from_argv(sys.argv[1:]))

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


def host_target(threads: int, mcpu: str):
    """The llvm target of the run: this host's CPU and the benchmark's thread count."""
    import tvm

    config = {"kind": "llvm", "num-cores": threads}
    if mcpu:
        config["mcpu"] = mcpu
    return tvm.target.Target(config)


ROUND_S = 0.05  # each side's share of a round: single calls for about this long


def _calls(one_call_s: float) -> int:
    return min(200, max(5, int(ROUND_S / max(one_call_s, 1e-7))))


def tvm_timer(ex, x: np.ndarray):
    """(a function timing one round: seconds of each single call, the output) of a TVM build."""
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(ex, tvm.cpu())
    arg = tvm.runtime.tensor(x)
    out = vm["main"](arg)
    out = (out if hasattr(out, "numpy") else out[0]).numpy()
    start = time.perf_counter()
    vm["main"](arg)
    evaluator = vm.time_evaluator("main", tvm.cpu(), number=1, repeat=_calls(time.perf_counter() - start),
                                  min_repeat_ms=0)
    return (lambda: [float(s) for s in evaluator(arg).results]), out


def ort_timer(model, x, threads: int):
    """(a function timing one round in seconds per call, the output) of onnxruntime."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.onnx")
        torch.onnx.export(model, (x,), path, dynamo=False, input_names=["x"], opset_version=17)
        proto = onnx.load(path)
        proto.ir_version = 9  # onnxruntime rejects newer IR versions
        onnx.save(proto, path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        sess = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    feed = {"x": x.numpy()}
    out = sess.run(None, feed)[0]
    start = time.perf_counter()
    sess.run(None, feed)
    calls = _calls(time.perf_counter() - start)

    def one_round():
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            sess.run(None, feed)
            times.append(time.perf_counter() - start)
        return times

    return one_round, out


def side_by_side(timers: dict, rounds: int) -> tuple[dict, dict]:
    """Per-round figures (ms per call) of each timer over ``rounds`` interleaved rounds: every
    round runs each side once, the order rotated round to round, so a slow spell of a shared
    machine hits all sides alike instead of whichever was measured at that moment. Returns
    (fastest call of each round, mean call of each round)."""
    names = list(timers)
    fastest = {name: [] for name in names}
    mean = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            calls = timers[name]()
            fastest[name].append(min(calls) * 1e3)
            mean[name].append(sum(calls) / len(calls) * 1e3)
    return fastest, mean


def bench(name: str, trials: int, work_root: str, repeat: int, threads: int, target, peaks) -> dict:
    from tvm import relax

    import tvm_spinn
    from tvm_spinn.tune import roofline_table

    model, x = make_model(name)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    work = os.path.join(work_root, name)
    start = time.time()
    result = tvm_spinn.tune(mod, target=target, work_dir=work, max_trials_per_task=trials, progress=True)
    tune_s = time.time() - start
    print(result.table(), flush=True)
    print(f"\nwhere the time goes ({name}, tuned build, per task as measured by the tuner):")
    print(roofline_table(result, peaks), flush=True)
    timers = {}
    timers["onnxruntime"], ref = ort_timer(model, x, threads)
    timers["untuned"], out = tvm_timer(relax.build(mod, target=target), x.numpy())
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4)
    with tvm_spinn.build_options():
        timers["defaults"], out = tvm_timer(relax.build(mod, target=target), x.numpy())
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4)
    with tvm_spinn.build_options(tuning_logs=work):
        timers["tuned"], out = tvm_timer(relax.build(mod, target=target), x.numpy())
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4)
    fastest, mean = side_by_side(timers, repeat)
    row = {"model": name, "tune_s": tune_s, **{k: statistics.median(v) for k, v in fastest.items()}}
    row["means"] = {k: statistics.median(v) for k, v in mean.items()}
    ratios = [t / d for t, d in zip(fastest["tuned"], fastest["defaults"])]
    row["tuned_ratio"], row["tuned_wins"] = statistics.median(ratios), sum(r < 1 for r in ratios)
    row["trials"] = sum(t.trials for t in result.tasks)
    row["tasks"] = len(result.tasks)
    row["tuned_tasks"] = sum(t.chosen == "tuned" for t in result.tasks)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=64, help="trials per task")
    parser.add_argument("--models", default="transformer,cnn")
    parser.add_argument("--work-dir", default="bench_tuning_logs", help="tuning logs (resumed if present)")
    parser.add_argument("--repeat", type=int, default=11,
                        help="interleaved measuring rounds (every side once per round)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads of both TVM's runtime and onnxruntime (default: usable CPUs)")
    parser.add_argument("--mcpu", default=None,
                        help="LLVM CPU to compile for (default: this host's; '' for LLVM's generic)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # (main() called from elsewhere)
    torch.set_num_threads(args.threads)
    import tvm
    from tvm.target.codegen import llvm_get_system_cpu

    from tvm_spinn.tune import measure_host_peaks

    target = host_target(args.threads, llvm_get_system_cpu() if args.mcpu is None else args.mcpu)
    peaks = measure_host_peaks()
    print(f"threads: TVM runtime {tvm.runtime.num_threads()}, onnxruntime intra-op {args.threads} "
          f"(inter-op 1); target {target}; {os.cpu_count()} logical CPUs; load average "
          f"{os.getloadavg()[0]:.1f} (a shared machine makes every figure noisy)", flush=True)
    rows = [bench(m, args.trials, args.work_dir, args.repeat, args.threads, target, peaks)
            for m in args.models.split(",")]
    print(f"\nlatency in ms (fastest single call of each round, median of {args.repeat} interleaved rounds; "
          f"threads: TVM {tvm.runtime.num_threads()}, onnxruntime {args.threads}; {args.trials} trials per "
          f"task; load average now {os.getloadavg()[0]:.1f}); tuned/default: median per-round ratio "
          f"(rounds tuned was faster)")
    header = ("model", "untuned", "defaults", "tuned", "onnxruntime", "default/ort", "tuned/ort",
              "tuned/default", "tasks", "uses tuned", "trials", "tune s")
    print(" | ".join(f"{h:>11}" for h in header))
    for r in rows:
        cells = (r["model"], f"{r['untuned']:.3f}", f"{r['defaults']:.3f}", f"{r['tuned']:.3f}",
                 f"{r['onnxruntime']:.3f}", f"{r['defaults'] / r['onnxruntime']:.2f}x",
                 f"{r['tuned'] / r['onnxruntime']:.2f}x",
                 f"{r['tuned_ratio']:.2f}x ({r['tuned_wins']}/{args.repeat})",
                 str(r["tasks"]), str(r["tuned_tasks"]), str(r["trials"]), f"{r['tune_s']:.0f}")
        print(" | ".join(f"{c:>11}" for c in cells))
    print("mean call of each round (median over rounds; on a loaded machine mostly the CPU share the "
          "process got):")
    for r in rows:
        print(f"  {r['model']}: " + ", ".join(f"{k} {v:.3f}" for k, v in r["means"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
