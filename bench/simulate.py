"""Functional-simulator speed: runs of layers in one C++ call each ("layers", the default) and
every layer whole from Python ("python", TVM_SPINN_SIM_NATIVE=0) against the tile-by-tile
reference ("tiles"), per model, plus onnxruntime on the same model where it exports.

Times one inference through the Relax VM (the simulator is nearly all of it), median of --repeat
runs after a warm-up, with TVM_SPINN_SIM_MODE set per mode; also checks the two modes' bits agree.
Next to it: the same imported module built by TVM for llvm (what TVM itself runs it in on this
CPU) and onnxruntime on the model's ONNX export.
The simulator and onnxruntime run on the same number of threads (--threads, default
$TVM_SPINN_SIM_THREADS, else all cores).

    python bench/simulate.py                     # all models
    python bench/simulate.py --models bert-layer --repeat 1
    python bench/simulate.py --no-tiles --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
import tvm
from tvm import relax

import tvm_spinn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import models  # noqa: E402
from test_zoo import ZOO, _Field  # noqa: E402


def _bert_layer():
    import transformers as tf

    cfg = tf.BertConfig(vocab_size=100, hidden_size=768, num_hidden_layers=1, num_attention_heads=12,
                        intermediate_size=3072, max_position_embeddings=128)
    tokens = torch.randint(0, 100, (1, 128), generator=torch.Generator().manual_seed(0))
    return _Field(tf.BertModel(cfg), "last_hidden_state"), tokens


MODELS = {
    "cnn": lambda: models.make("cnn"),
    "mlp": lambda: models.make("mlp"),
    "transformer": lambda: models.make("transformer"),
    **{f"zoo-{k}": v for k, v in ZOO.items()},
    "bert-layer": _bert_layer,  # one BERT-base encoder layer, sequence 128
}


def _time(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@contextlib.contextmanager
def _quiet_fds():
    """Silence stdout and stderr at the file-descriptor level (the exporter prints from C++)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def _onnxruntime_ms(model, x, repeat, threads):
    try:
        import onnxruntime as ort

        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "m.onnx")
            # The exporter's warnings (and, for models it cannot export, a dump of the whole
            # TorchScript graph) would drown the table.
            with warnings.catch_warnings(), _quiet_fds():
                warnings.simplefilter("ignore")
                torch.onnx.export(model, (x,), path, dynamo=False, input_names=["x"], opset_version=17)
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
            sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
            feed = {sess.get_inputs()[0].name: x.numpy()}
            return _time(lambda: sess.run(None, feed), repeat)
    except Exception:  # not exportable: skip the column
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("TVM_SPINN_SIM_THREADS") or os.cpu_count() or 1),
                    help="threads of the simulator's kernels and of onnxruntime")
    ap.add_argument("--no-tiles", action="store_true", help="skip timing the tile-by-tile reference")
    args = ap.parse_args()
    os.environ["TVM_SPINN_SIM_THREADS"] = str(args.threads)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # TVM's own thread pool (the llvm build)
    print(f"threads: {args.threads}")
    print(f"{'model':<18}{'tiles ms':>11}{'python ms':>11}{'layers ms':>11}{'x python':>9}{'llvm ms':>9}"
          f"{'x llvm':>8}{'ort ms':>9}{'x ort':>8}  same bits")
    for name in args.models:
        torch.manual_seed(0)
        model, x = MODELS[name]()
        model = model.eval()
        mod = tvm_spinn.frontend.from_pytorch(model, (x,))
        ex = relax.build(mod, target="spinn")
        vm = relax.VirtualMachine(ex, tvm.cpu())
        arg = tvm.runtime.tensor(x.numpy())
        # The same module built for llvm: what TVM itself runs it in on this CPU.
        llvm_vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
        llvm_vm["main"](arg)
        llvm_ms = _time(lambda: llvm_vm["main"](arg), args.repeat)
        ms, out = {}, {}
        # "python": every layer whole, each from Python (TVM_SPINN_SIM_NATIVE=0); "layers": the
        # default, runs of layers in one C++ call each
        for mode, sim, native in (("tiles", "tiles", "0"), ("python", "layers", "0"), ("layers", "layers", "1")):
            os.environ["TVM_SPINN_SIM_MODE"] = sim
            os.environ["TVM_SPINN_SIM_NATIVE"] = native
            out[mode] = vm["main"](arg).numpy()
            timed = not (args.no_tiles and mode == "tiles")
            ms[mode] = _time(lambda: vm["main"](arg), args.repeat) if timed else float("nan")
        os.environ.pop("TVM_SPINN_SIM_MODE")
        os.environ.pop("TVM_SPINN_SIM_NATIVE")
        with torch.no_grad():
            ort_ms = _onnxruntime_ms(model, x, args.repeat, args.threads)
        same = all(np.array_equal(out["tiles"].view(np.uint8), out[m].view(np.uint8)) for m in ("python", "layers"))
        ort = f"{ort_ms:9.2f}{ms['layers'] / ort_ms:8.1f}" if ort_ms is not None else f"{'-':>9}{'-':>8}"
        print(f"{name:<18}{ms['tiles']:11.1f}{ms['python']:11.2f}{ms['layers']:11.2f}"
              f"{ms['layers'] / ms['python']:9.2f}{llvm_ms:9.2f}{ms['layers'] / llvm_ms:8.1f}{ort}  {same}", flush=True)


if __name__ == "__main__":
    main()
