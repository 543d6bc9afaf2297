"""int8 benchmark: accuracy of post-training quantization and simulated latency, int8 vs fp32.

For zoo CNNs and transformers built from `transformers` configs (random weights, nothing
downloaded), it quantizes with `tvm_spinn.quantize` (calibration on seeded random inputs), builds
both the fp32 and the int8 module for "spinn", runs both on the simulator for evaluation inputs
that were not used for calibration, and prints side by side:

- top-1 agreement of the int8 model with PyTorch fp32 (classifiers and the LM head), and of the
  fp32 spinn model (which should be 100%),
- max and mean absolute error of the int8 outputs relative to the fp32 output's max |value|,
  and the signal-to-quantization-noise ratio (SQNR, dB),
- simulated latency of the int8 mapping vs the fp32 mapping (one chip), their ratio, and the
  number of GEMMs on the MAC arrays.

Then an onnxruntime-quantized (`quantize_static`, QDQ) CNN: agreement of spinn's integer
execution with onnxruntime's own int8 kernels.

Then (with TensorFlow installed) Keras models quantized by TensorFlow itself
(`tf.lite.TFLiteConverter`, representative dataset, `TFLITE_BUILTINS_INT8`): agreement of
spinn's integer outputs with `tf.lite.Interpreter` -- its reference kernels (`BUILTIN_REF`,
the semantics spinn follows), its optimized kernels without delegates
(`BUILTIN_WITHOUT_DEFAULT_DELEGATES`) and its default (`AUTO`: the XNNPACK delegate) -- and the
simulated latency of the int8 TFLite model vs the float32 TFLite model of the same Keras model.

    python bench/quantize.py            # all models
    python bench/quantize.py --quick    # fewer evaluation inputs
    python bench/quantize.py --latency-only --models resnet18 vit   # latency columns only
    python bench/quantize.py --target spinn/testchip                # the test chip's model
    python bench/quantize.py --tflite-only                          # the TFLite table only

The accuracy columns do not depend on the target model (int8 results are exact integers and
fp32 results do not depend on the mapping); ``--latency-only`` skips the evaluation runs and
prints only the simulated latencies, which do.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np
import torch
import tvm
from tvm import relax

import tvm_spinn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


class _Logits(torch.nn.Module):
    def __init__(self, model, **kwargs):
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, x):
        out = self.model(x, **self.kwargs).logits
        return out[:, -1] if out.dim() == 3 else out  # LM: next-token logits


def models():
    import transformers as tf

    torch.manual_seed(0)

    def image(seed, size):
        return torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(seed))

    def tokens(seed, n=32, vocab=512):
        return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))

    eager = {"attn_implementation": "eager"}
    yield ("resnet18", _Logits(tf.ResNetForImageClassification(tf.ResNetConfig(
        depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512], layer_type="basic", num_labels=100))),
        lambda s: image(s, 64))
    yield ("mobilenet_v2", _Logits(tf.MobileNetV2ForImageClassification(tf.MobileNetV2Config(
        depth_multiplier=0.5, image_size=64, num_labels=100))), lambda s: image(s, 64))
    yield ("vit", _Logits(tf.ViTForImageClassification(tf.ViTConfig(
        hidden_size=192, num_hidden_layers=4, num_attention_heads=3, intermediate_size=768, image_size=64,
        patch_size=8, num_labels=100))), lambda s: image(s, 64))
    yield ("bert", _Logits(tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
        max_position_embeddings=64, num_labels=10))), tokens)
    yield ("gpt2", _Logits(tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=512, n_embd=256, n_layer=4, n_head=4, n_positions=64, **eager)), use_cache=False), tokens)


def _run(ex, inputs):
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return [vm["main"](tvm.runtime.tensor(x)).numpy() for x in inputs]


def _metrics(got, ref):
    got, ref = np.stack(got), np.stack(ref)
    scale = np.abs(ref).max()
    err = np.abs(got - ref)
    sqnr = 10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / max(np.sum((got - ref).astype(np.float64) ** 2), 1e-300))
    top1 = float(np.mean(got.reshape(len(got), -1, got.shape[-1]).argmax(-1) == ref.reshape(len(ref), -1, ref.shape[-1]).argmax(-1)))
    return top1, err.max() / scale, err.mean() / scale, sqnr


def bench_ptq(n_calib: int, n_eval: int, target: str = "spinn", names: list[str] | None = None,
              latency_only: bool = False) -> None:
    head = (f"{'model':<14}{'GEMMs i8':>9}{'top1 i8':>8}{'top1 f32':>9}{'max err':>9}{'mean err':>9}{'SQNR dB':>8}"
            f"{'f32 ms':>9}{'i8 ms':>8}{'f32/i8':>7}{'f32 MB':>8}{'i8 MB':>7}")
    print(f"target {target}: {tvm_spinn.arch_of(target).name}")
    print(head)
    print("-" * len(head), flush=True)
    for name, model, make_input in models():
        if names and name not in names:
            continue
        model.eval()
        calib = [make_input(100 + i) for i in range(n_calib)]
        evals = [make_input(1000 + i) for i in range(n_eval)]
        mod = tvm_spinn.frontend.from_pytorch(model, (evals[0],))
        qmod = tvm_spinn.quantize(mod, [x.numpy() for x in calib])
        ex32 = relax.build(mod, target=target)
        ex8 = relax.build(qmod, target=target)
        if latency_only:
            top1_8 = max_err = mean_err = sqnr = top1_32 = float("nan")
        else:
            with torch.no_grad():
                ref = [model(x).numpy() for x in evals]
            inputs = [x.numpy() for x in evals]
            out32, out8 = _run(ex32, inputs), _run(ex8, inputs)
            top1_8, max_err, mean_err, sqnr = _metrics(out8, ref)
            top1_32 = _metrics(out32, ref)[0]
        r32, r8 = tvm_spinn.report(ex32), tvm_spinn.report(ex8)
        n8 = sum(1 for row in r8.layers if row["mode"] == "int8")
        print(f"{name:<14}{n8:>9}{top1_8:>8.1%}{top1_32:>9.1%}{max_err:>9.2e}{mean_err:>9.2e}{sqnr:>8.1f}"
              f"{r32.latency_s * 1e3:>9.3f}{r8.latency_s * 1e3:>8.3f}{r32.latency_s / r8.latency_s:>7.2f}"
              f"{r32.weight_bytes / 1e6:>8.2f}{r8.weight_bytes / 1e6:>7.2f}", flush=True)


def bench_ort(n_eval: int, target: str = "spinn") -> None:
    import onnxruntime as ort
    import quant_models as qm

    print("\nonnxruntime quantize_static (QDQ) models: spinn int8 vs onnxruntime int8")
    head = f"{'model':<28}{'GEMMs i8':>9}{'equal':>8}{'max |diff|':>11}{'out step':>10}{'top1 agree':>11}"
    print(head)
    print("-" * len(head), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for label, kwargs in qm.BENCH_VARIANTS:
            path, inputs = qm.quantized_cnn(tmp, n_eval=n_eval, **kwargs)
            sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            name = sess.get_inputs()[0].name
            ref = [sess.run(None, {name: x})[0] for x in inputs]
            mod = tvm_spinn.frontend.from_onnx(path)
            ex = relax.build(mod, target=target)
            got = _run(ex, inputs)
            n8 = sum(1 for row in tvm_spinn.report(ex).layers if row["mode"] == "int8")
            diff = np.abs(np.stack(got) - np.stack(ref))
            step = qm.output_step(path)
            agree = float(np.mean(np.stack(got).argmax(-1) == np.stack(ref).argmax(-1)))
            print(f"{label:<28}{n8:>9}{np.mean(diff == 0):>8.1%}{diff.max():>11.4g}{step:>10.4g}{agree:>11.1%}", flush=True)


def tflite_models():
    import tflite_models as tm

    yield "keras_cnn", tm.cnn, (16, 16, 3), False
    yield "keras_mlp", tm.mlp, (32,), True
    yield "mobilenet_v2_0.35", tm.mobilenet_v2, (96, 96, 3), False


def bench_tflite(n_eval: int, target: str = "spinn", latency_only: bool = False) -> None:
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        print("\nTFLite table skipped: TensorFlow is not installed (pip install -e '.[tf]')")
        return
    import tflite_models as tm
    from tvm_spinn.frontend.tflite import from_tflite, keras_to_tflite

    print("\nKeras models quantized by TensorFlow (TFLITE_BUILTINS_INT8): spinn int8 vs tf.lite.Interpreter")
    head = (f"{'model':<20}{'GEMMs i8':>9}{'= ref':>8}{'max':>5}{'= opt':>8}{'max':>5}{'= XNNPACK':>10}{'max':>5}"
            f"{'f32 ms':>9}{'i8 ms':>8}{'f32/i8':>7}")
    print(head)
    print("-" * len(head), flush=True)
    for name, make, shape, normal in tflite_models():
        model = make()
        buf8 = keras_to_tflite(model, quantize=tm.calibration(shape, normal=normal))
        buf32 = keras_to_tflite(model)
        ex8 = relax.build(from_tflite(buf8), target=target)
        ex32 = relax.build(from_tflite(buf32), target=target)
        equal = {"BUILTIN_REF": [], "BUILTIN_WITHOUT_DEFAULT_DELEGATES": [], "AUTO": []}
        worst = dict.fromkeys(equal, 0)
        if not latency_only:
            vm = relax.VirtualMachine(ex8, tvm.cpu())
            for x in tm.integer_inputs(buf8, n_eval, seed=7):
                out = vm["main"](tvm.runtime.tensor(x))
                got = [o.numpy() for o in out] if isinstance(out, tvm.ir.Array) else [out.numpy()]
                for resolver in equal:
                    want = tm.interpret(buf8, x, resolver)
                    for g, w in zip(sorted(got, key=np.size), sorted(want, key=np.size)):
                        diff = np.abs(g.astype(np.int64) - w.astype(np.int64))
                        equal[resolver].append(diff == 0)
                        worst[resolver] = max(worst[resolver], int(diff.max()))
        rate = {k: (float(np.mean(np.concatenate([e.ravel() for e in v]))) if v else float("nan"))
                for k, v in equal.items()}
        r32, r8 = tvm_spinn.report(ex32), tvm_spinn.report(ex8)
        n8 = sum(1 for row in r8.layers if row["mode"] == "int8")
        opt = "BUILTIN_WITHOUT_DEFAULT_DELEGATES"
        print(f"{name:<20}{n8:>9}{rate['BUILTIN_REF']:>8.2%}{worst['BUILTIN_REF']:>5}{rate[opt]:>8.2%}{worst[opt]:>5}"
              f"{rate['AUTO']:>10.2%}{worst['AUTO']:>5}{r32.latency_s * 1e3:>9.3f}{r8.latency_s * 1e3:>8.3f}"
              f"{r32.latency_s / r8.latency_s:>7.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="4 calibration and 8 evaluation inputs")
    parser.add_argument("--target", default="spinn", help="spinn target tag (default: spinn)")
    parser.add_argument("--models", nargs="+", metavar="NAME",
                        help="subset of resnet18 mobilenet_v2 vit bert gpt2 (default: all)")
    parser.add_argument("--latency-only", action="store_true",
                        help="skip the evaluation runs and the onnxruntime table: latencies only")
    parser.add_argument("--tflite-only", action="store_true",
                        help="only the table of TensorFlow-quantized (TFLite) models")
    args = parser.parse_args()
    n_calib, n_eval = (4, 8) if args.quick else (16, 64)
    if not args.tflite_only:
        bench_ptq(n_calib, n_eval, args.target, args.models, args.latency_only)
        if not args.latency_only:
            bench_ort(n_eval, args.target)
    bench_tflite(n_eval, args.target, args.latency_only)


if __name__ == "__main__":
    main()
