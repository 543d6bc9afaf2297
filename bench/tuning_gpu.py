"""Benchmark: the CUDA fallback on a real GPU, MetaSchedule-tuned, against PyTorch on the same GPU.

Each model is built all-fallback for the GPU (a plain ``cuda`` target: what ``spinn/cuda``
compiles for the part it does not offload) three ways and measured side by side in one run,
next to PyTorch on the same device:

* ``defaults``  ``with tvm_spinn.build_options():`` TVM's CUDA pipeline with dlight GPU rules
* ``tuned``     ``tvm_spinn.tune(..., max_trials_per_task=N)`` then ``build_options(tuning_logs=...)``
* ``eager``     PyTorch eager, fp32 (TF32 off, so both sides do fp32 arithmetic)
* ``compiled``  ``torch.compile`` (inductor) of the same module, fp32, TF32 off

All outputs are compared with PyTorch (assert_allclose). A last check runs a model built for
``spinn/cuda`` end to end on the GPU: the offloaded layers on the simulator (host memory), the
rest as CUDA kernels, the whole compared with PyTorch.

Needs a CUDA GPU and a TVM build with CUDA (the PyPI wheel has it). Usage::

    python bench/tuning_gpu.py --trials 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

# MetaSchedule's CUDA tensor intrinsics are TVMScript functions whose parser calls
# inspect.stack() for each: with torch and transformers in sys.modules that import took 50 s on
# the H100 machine. Importing them first, while few modules are loaded, makes it a few seconds.
try:
    import tvm.s_tir.tensor_intrin.cuda  # noqa: F401
except Exception:  # noqa: BLE001  (no CUDA support in this TVM: main() says so later)
    pass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tuning import make_model  # noqa: E402  (the CPU benchmark's models, same seeds)


def _models(names):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from models import TransformerBlock

    for name in names:
        if name == "bert-layer":  # BERT-base sized block, batch 8 x 128 tokens: GEMM-bound
            torch.manual_seed(0)
            gen = torch.Generator().manual_seed(0)
            yield name, TransformerBlock(dim=768, heads=12, hidden=3072).eval(), torch.randn(8, 128, 768, generator=gen)
        else:
            model, x = make_model(name)
            yield name, model, x


def cuda_target():
    import tvm

    major, minor = torch.cuda.get_device_capability()
    props = torch.cuda.get_device_properties(0)
    # MetaSchedule's GPU rules need the limits spelled out in the target (no auto-detection).
    return tvm.target.Target({"kind": "cuda", "arch": f"sm_{major}{minor}", "max_num_threads": 1024,
                              "max_threads_per_block": 1024, "thread_warp_size": 32,
                              "max_shared_memory_per_block": 49152,
                              "registers_per_block": props.regs_per_multiprocessor,
                              "host": {"kind": "llvm", "num-cores": os.cpu_count() or 1}})


def tvm_latency(ex, x: np.ndarray, repeat: int):
    import tvm
    from tvm import relax

    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(ex, dev)
    arg = tvm.runtime.tensor(x, device=dev)
    out = vm["main"](arg)
    out = (out if hasattr(out, "numpy") else out[0]).numpy()
    res = vm.time_evaluator("main", dev, number=50, repeat=repeat, min_repeat_ms=100)(arg)
    return statistics.median(res.results) * 1e3, out


def torch_latency(fn, x: torch.Tensor, repeat: int):
    with torch.no_grad():
        out = fn(x)
        for _ in range(5):
            fn(x)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeat):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                fn(x)
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / 50)
    return statistics.median(times), out.float().cpu().numpy()


def bench(name, model, x, trials: int, work_root: str, repeat: int, compare_rounds: int = 11,
          progress: bool = False, compile_torch: bool = True) -> dict:
    from tvm import relax

    import tvm_spinn

    target = cuda_target()
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    row = {"model": name, "input": list(x.shape), "target": str(target.kind.name) + " " + target.attrs["arch"]}
    gpu_model, gx = model.to("cuda"), x.to("cuda")
    row["eager"], ref = torch_latency(gpu_model, gx, repeat)
    try:
        if not compile_torch:
            raise RuntimeError("torch.compile skipped (--no-torch-compile)")
        compiled = torch.compile(gpu_model)
        row["compiled"], out = torch_latency(compiled, gx, repeat)
        np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4)
    except Exception as err:  # noqa: BLE001  (inductor missing or failing: the row says so)
        row["compiled_error"] = f"{type(err).__name__}: {err}"[:300]
    with tvm_spinn.build_options():
        start = time.time()
        ex = relax.build(mod, target=target)
        row["build_s"] = time.time() - start
        row["defaults"], out = tvm_latency(ex, x.numpy(), repeat)
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4)
    if trials > 0:
        work = os.path.join(work_root, name)
        start = time.time()
        print(f"{name}: tuning ({trials} trials per task) from {time.strftime('%H:%M:%S')}", flush=True)
        result = tvm_spinn.tune(mod, target=target, work_dir=work, max_trials_per_task=trials,
                                compare_rounds=compare_rounds, progress=progress, verbose=progress)
        row["tune_s"] = time.time() - start
        print(result.table(), flush=True)
        row["tasks"], row["trials"] = len(result.tasks), sum(t.trials for t in result.tasks)
        with tvm_spinn.build_options(tuning_logs=work):
            row["tuned"], out = tvm_latency(relax.build(mod, target=target), x.numpy(), repeat)
        np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4)
    return row


def spinn_cuda_end_to_end() -> dict:
    """A ``spinn/cuda`` build run on the GPU: offloaded GEMMs simulated, the rest CUDA kernels."""
    import tvm
    from tvm import relax

    import tvm_spinn

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from models import make

    model, x = make("transformer")
    major, minor = torch.cuda.get_device_capability()
    target = tvm_spinn.get_target("spinn/cuda")
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    ex = relax.build(mod, target=target)
    rep = tvm_spinn.report(ex)
    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(ex, [dev, tvm.cpu()])
    out = vm["main"](tvm.runtime.tensor(x.numpy(), device=dev))
    out = (out if hasattr(out, "numpy") else out[0]).numpy()
    with torch.no_grad():
        ref = model(x).numpy()
    err = float(np.max(np.abs(out - ref)))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    return {"model": "transformer (tests)", "device": f"sm_{major}{minor}", "max_abs_err": err,
            "offloaded": sum(rep.offloaded_ops.values()), "fallback": sum(rep.fallback_ops.values())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=64, help="trials per task (0: defaults only)")
    parser.add_argument("--models", default="transformer,cnn,bert-layer")
    parser.add_argument("--work-dir", default=None, help="tuning logs (default: a temporary directory)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the rows to this file")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--compare-rounds", type=int, default=11, help="default-vs-tuned comparison rounds per task")
    parser.add_argument("--no-torch-compile", action="store_true", help="leave out the torch.compile column")
    parser.add_argument("--progress", action="store_true", help="show the tuning job's progress and logs")
    parser.add_argument("--stacks-after", type=float, default=0,
                        help="print every thread's stack after this many seconds (finding where a run spends its time)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tuning_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    if args.stacks_after > 0:
        import faulthandler

        faulthandler.dump_traceback_later(args.stacks_after, exit=False)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    work_root = args.work_dir or tempfile.mkdtemp(prefix="tvm_spinn_gpu_")
    rows = []
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}

    def save():
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(results, f, indent=1)
            os.replace(tmp, args.json)

    if not args.skip_e2e:
        try:
            results["spinn_cuda_e2e"] = spinn_cuda_end_to_end()
        except Exception:  # noqa: BLE001  (recorded; the benchmark rows still run)
            results["spinn_cuda_e2e"] = {"error": traceback.format_exc()[-2000:]}
        print(results["spinn_cuda_e2e"], flush=True)
        save()
    for name, model, x in _models(args.models.split(",")):
        try:
            rows.append(bench(name, model, x, args.trials, work_root, args.repeat, args.compare_rounds, args.progress,
                              not args.no_torch_compile))
        except Exception:  # noqa: BLE001
            rows.append({"model": name, "error": traceback.format_exc()[-2000:]})
        print(rows[-1], flush=True)
        save()
    print(f"\n{results['device']}; latency in ms (median of {args.repeat} x 50 calls); "
          f"torch {torch.__version__}; {args.trials} trials per task")
    header = ("model", "defaults", "tuned", "eager", "compiled", "tuned/eager", "tuned/compiled")
    print(" | ".join(f"{h:>14}" for h in header))
    for r in rows:
        if "error" in r:
            print(f"{r['model']:>14} | error: {r['error'].splitlines()[-1]}")
            continue

        def fmt(key):
            return f"{r[key]:.4f}" if key in r else "-"

        ratio = (lambda a, b: f"{r[a] / r[b]:.2f}x" if a in r and b in r else "-")
        cells = (r["model"], fmt("defaults"), fmt("tuned"), fmt("eager"), fmt("compiled"),
                 ratio("tuned", "eager"), ratio("tuned", "compiled"))
        print(" | ".join(f"{c:>14}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
