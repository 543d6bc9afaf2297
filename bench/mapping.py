"""Mapping benchmark: simulated latency against the physical bound, a naive mapping, and compile times.

For ResNet-50-like, BERT-base-like and GPT-2 (decode step) models built from `transformers`
configs with random weights, on one chip (`spinn`) and on a 48-chip board (`spinn/board`), it
prints in one run: simulated latency, the physical bound (`tvm_spinn.timing.bounds`: what the
system allows for any placement) with the kind that binds, and the efficiency (bound / latency);
the same for the naive layer-by-layer mapping (MappingOptions(naive=True)) and the speed-up over
it; spinn compile time next to TVM's own `relax.build(target="llvm")` of the same model; the
exported library's size over the model's weight bytes, and what loading it costs before the
first result (`tvm_spinn.load_module` + the first call's extra time over a second call).

    python bench/mapping.py            # all models
    python bench/mapping.py --quick    # smaller configs (a couple of minutes)
    python bench/mapping.py --models gpt2-decode --skip-llvm                 # one model
    python bench/mapping.py --targets spinn/testchip spinn/testchip/board    # the test chip's model
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tvm import relax

import tvm_spinn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_zoo import _Field  # noqa: E402  (the zoo's output-selecting wrapper)


def models(quick: bool):
    import transformers as tf

    torch.manual_seed(0)
    if quick:
        resnet = tf.ResNetConfig(depths=[1, 1, 1, 1], hidden_sizes=[64, 128, 256, 512], layer_type="bottleneck")
        bert = tf.BertConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024)
        gpt2 = tf.GPT2Config(n_embd=256, n_layer=2, n_head=4)
        img, seq = 112, 64
    else:
        resnet = tf.ResNetConfig()  # ResNet-50: bottleneck, depths 3-4-6-3
        bert = tf.BertConfig()      # BERT-base: 12 x 768
        gpt2 = tf.GPT2Config()      # GPT-2 small: 12 x 768, 124M parameters
        img, seq = 224, 128
    yield "resnet50", _Field(tf.ResNetModel(resnet), "pooler_output").eval(), torch.randn(1, 3, img, img)
    yield "bert-base", _Field(tf.BertModel(bert), "last_hidden_state").eval(), torch.randint(0, 1000, (1, seq))
    gpt2._attn_implementation = "eager"  # the sdpa mask path does not export through torch.export
    yield "gpt2-decode", _Field(tf.GPT2Model(gpt2), "last_hidden_state", use_cache=False).eval(), torch.randint(0, 1000, (1, 1))


def _artifact(ex, x, weight_bytes: int) -> tuple[float, float]:
    """(library bytes / weight bytes, seconds from load to the first result beyond a warm call)."""
    import tempfile

    import tvm

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.so")
        tvm_spinn.export_library(ex, path)
        size = os.path.getsize(path)
        t0 = time.perf_counter()
        lib = tvm_spinn.load_module(path)
        load = time.perf_counter() - t0
    vm = relax.VirtualMachine(lib, tvm.cpu())
    arg = tvm.runtime.tensor(x.numpy())
    t0 = time.perf_counter()
    vm["main"](arg)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    vm["main"](arg)
    second = time.perf_counter() - t0
    return size / weight_bytes, load + max(0.0, first - second)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-llvm", action="store_true", help="do not time TVM's llvm build")
    parser.add_argument("--skip-artifact", action="store_true", help="do not export and reload the build")
    parser.add_argument("--models", nargs="+", metavar="NAME",
                        help="subset of resnet50 bert-base gpt2-decode (default: all)")
    parser.add_argument("--targets", nargs="+", default=["spinn", "spinn/board"], metavar="TAG",
                        help="spinn target tags (default: spinn spinn/board)")
    args = parser.parse_args()
    print("; ".join(f"{t}: {tvm_spinn.arch_of(t).name}" for t in args.targets))
    head = (f"{'model':<12}{'target':<12}{'latency ms':>11}{'bound ms':>10}{'binds':>14}{'eff':>7}{'naive ms':>10}"
            f"{'naive eff':>10}{'speedup':>8}{'compile s':>10}{'llvm s':>8}{'c/llvm':>7}{'lib/w':>6}{'load s':>7}")
    print(head)
    print("-" * len(head), flush=True)
    for name, model, x in models(args.quick):
        if args.models and name not in args.models:
            continue
        mod = tvm_spinn.frontend.from_pytorch(model, (x,))
        llvm_s = float("nan")
        if not args.skip_llvm:
            t0 = time.perf_counter()
            relax.build(mod, target="llvm")
            llvm_s = time.perf_counter() - t0
        weight_bytes = sum(p.numel() * 4 for p in model.parameters())
        for target in args.targets:
            t0 = time.perf_counter()
            with tvm_spinn.MappingOptions(weights="stream"):
                ex = relax.build(mod, target=target)
            compile_s = time.perf_counter() - t0
            rep = tvm_spinn.report(ex)
            size_ratio = load_s = float("nan")
            if not args.skip_artifact:
                size_ratio, load_s = _artifact(ex, x, weight_bytes)
            with tvm_spinn.MappingOptions(naive=True):
                naive = tvm_spinn.report(relax.build(mod, target=target))
            print(f"{name:<12}{target:<12}{rep.latency_s * 1e3:>11.3f}{rep.physical_bound_s * 1e3:>10.4f}"
                  f"{rep.physical_binding:>14}{rep.efficiency:>7.3f}{naive.latency_s * 1e3:>10.3f}"
                  f"{naive.efficiency:>10.4f}{naive.latency_s / rep.latency_s:>8.2f}"
                  f"{compile_s:>10.2f}{llvm_s:>8.2f}{compile_s / llvm_s:>7.2f}"
                  f"{size_ratio:>6.3f}{load_s:>7.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
