"""Scale-out benchmark (issue 12): one model over chips, boards and a SpiNNcloud, side by side.

Models are `transformers` configs with random weights. Printed in one run:

1. GPT-2-medium decode step (batch 1, one token, no KV cache) on `spinn/board`, fp32 and int8
   (weight GEMMs quantized): latency against the board's DRAM-bandwidth bound for its offloaded
   weights (weight bytes / (48 x 6.4 GB/s)), weights streamed every token and weights resident
   where the aggregate SRAM holds them;
2. BERT-base s128 batch 1: one chip's latency over the board's;
3. ResNet-50 224 at batch 48 on a board: throughput over 48 x one chip's (batch 1);
4. BERT-large s128 throughput (stream of inputs) on 1, 48, 1,152 and 34,560 chips with the
   efficiency at each size (throughput / (chips x one chip's)), plotted to `--plot`.

Each row also gives the plan, the binding bound and latency / bound, and the mapping+timing
time of the build (wall clock of `relax.build`; noisy on a shared machine).

    python bench/scale.py                 # everything (several minutes)
    python bench/scale.py --quick         # smaller configs
    python bench/scale.py --only bert-large --plot scale.png
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

import torch
from tvm import relax

import tvm_spinn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_zoo import _Field  # noqa: E402


def _bert(size: str, quick: bool):
    import transformers as tf

    torch.manual_seed(0)
    if quick:
        cfg = tf.BertConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024)
    elif size == "large":
        cfg = tf.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
    else:
        cfg = tf.BertConfig()
    return _Field(tf.BertModel(cfg), "last_hidden_state").eval(), torch.randint(0, 1000, (1, 64 if quick else 128))


def _gpt2(quick: bool):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_embd=256, n_layer=2, n_head=4) if quick else tf.GPT2Config(n_embd=1024, n_layer=24, n_head=16)
    cfg._attn_implementation = "eager"
    return _Field(tf.GPT2Model(cfg), "last_hidden_state", use_cache=False).eval(), torch.randint(0, 1000, (1, 1))


def _resnet(quick: bool, batch: int):
    import transformers as tf

    torch.manual_seed(0)
    cfg = (tf.ResNetConfig(depths=[1, 1, 1, 1], hidden_sizes=[64, 128, 256, 512], layer_type="bottleneck")
           if quick else tf.ResNetConfig())
    img = 112 if quick else 224
    return _Field(tf.ResNetModel(cfg), "pooler_output").eval(), torch.randn(batch, 3, img, img)


def _build(mod, target, options=None):
    t0 = time.perf_counter()
    with (options or tvm_spinn.MappingOptions()):
        ex = relax.build(mod, target=target)
    return tvm_spinn.report(ex), time.perf_counter() - t0


def _plan(rep) -> str:
    p = rep.plan
    if not p:
        return "1 chip"
    return (f"tp{'/'.join(map(str, p['tp']))} dp{'/'.join(map(str, p['dp']))} sp{'/'.join(map(str, p.get('sp', [1])))} "
            f"st{p['stages']} x{p['replicas']}; "
            f"{p['binding']} binds, lat/bound {p['latency_over_bound']:.2f}")


def _gpt2_int8(mod, n_layer: int):
    """GPT-2 with its weight GEMMs in int8 (``tvm_spinn.quantize``, calibrated on seeded random
    tokens); the attention's two activation matmuls stay fp32 (one token attends to itself
    only: its probabilities are the constant 1, an empty calibration range)."""
    keep = [f"matmul_{6 * b + j}" for b in range(n_layer) for j in (1, 2)]
    torch.manual_seed(1)
    samples = [(torch.randint(0, 1000, (1, 1)).numpy(),) for _ in range(4)]
    return tvm_spinn.quantize(mod, samples, keep_fp32=keep)


def gpt2_rows(quick: bool) -> None:
    model, x = _gpt2(quick)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    arch = tvm_spinn.arch_of(tvm_spinn.get_target("spinn/board"))
    print("\n[1] GPT-2-medium decode step on spinn/board" + (" [quick config]" if quick else ""))
    for dtype in ("fp32", "int8"):
        m = mod if dtype == "fp32" else _gpt2_int8(mod, model.model.config.n_layer)
        for weights in ("stream", "auto"):
            rep, secs = _build(m, "spinn/board", tvm_spinn.MappingOptions(weights=weights))
            bound = rep.weight_bytes / arch.total_dram_bw_bytes_s
            print(f"  {dtype} weights={weights:<7} latency {rep.latency_s * 1e3:8.3f} ms  DRAM bound {bound * 1e3:8.3f} ms  "
                  f"bound/latency {bound / rep.latency_s:5.2f}  ({rep.weight_bytes / 1e6:.0f} MB offloaded weights, "
                  f"{rep.plan.get('streamed_bytes_per_chip', 0) / 1e6:.2f} MB streamed per chip; {_plan(rep)}; "
                  f"build {secs:.1f} s)", flush=True)


def bert_base_rows(quick: bool) -> None:
    model, x = _bert("base", quick)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    chip, c_s = _build(mod, "spinn")
    board, b_s = _build(mod, "spinn/board")
    same = sum(min(c["latency_s"] for c in m["system"]["candidates"] if c["tp"] * c["dp"] == 1)
               for m in board.mapping if "system" in m)
    print("\n[2] BERT-base s128 batch 1: one chip vs a board" + (" [quick config]" if quick else ""))
    print(f"  chip {chip.latency_s * 1e3:.3f} ms (PE-level reference), board {board.latency_s * 1e3:.3f} ms: "
          f"ratio {chip.latency_s / board.latency_s:.2f}x; vs the board model's own 1-chip plans "
          f"{same * 1e3:.3f} ms: {same / board.latency_s:.2f}x  ({_plan(board)}; builds {c_s:.1f} / {b_s:.1f} s)",
          flush=True)


def resnet_rows(quick: bool) -> None:
    model1, x1 = _resnet(quick, 1)
    chip, c_s = _build(tvm_spinn.frontend.from_pytorch(model1, (x1,)), "spinn")
    model48, x48 = _resnet(quick, 48)
    board, b_s = _build(tvm_spinn.frontend.from_pytorch(model48, (x48,)), "spinn/board")
    ratio = (48 / board.latency_s) / (48 / chip.latency_s)
    print("\n[3] ResNet-50 224: batch 48 on a board vs 48 x one chip at batch 1" + (" [quick config]" if quick else ""))
    print(f"  chip {1 / chip.latency_s:.1f} img/s, board {48 / board.latency_s:.1f} img/s: "
          f"{ratio:.2f} x (48 x chip)  ({_plan(board)}; builds {c_s:.1f} / {b_s:.1f} s)", flush=True)


def bert_large_rows(quick: bool, plot: str | None) -> None:
    model, x = _bert("large", quick)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    sizes = [("spinn", 1), (tvm_spinn.register_system(tvm_spinn.make_system("scale-24b", boards=24)), 1152),
             ("spinn/board", 48), ("spinn/cloud", 34560)]
    sizes.sort(key=lambda s: s[1])
    print("\n[4] BERT-large s128 throughput (stream of inputs)" + (" [quick config]" if quick else ""))
    print(f"  {'chips':>6} {'latency ms':>11} {'inf/s':>10} {'efficiency':>10} {'build s':>8}  plan")
    rows = []
    base = None
    for tag, chips in sizes:
        rep, secs = _build(mod, tag, tvm_spinn.MappingOptions(objective="throughput"))
        # one chip runs its regions one after another: 1 / latency (the report's one-chip figure
        # treats the regions as a pipeline of their own)
        tput = rep.throughput_inf_s if rep.plan else 1.0 / rep.latency_s
        base = base or tput
        eff = tput / (chips * base)
        rows.append((chips, tput, eff))
        print(f"  {chips:>6} {rep.latency_s * 1e3:>11.3f} {tput:>10.1f} {eff:>10.3f} {secs:>8.1f}  {_plan(rep)}",
              flush=True)
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r[0] for r in rows]
        ax.loglog(xs, [r[1] for r in rows], "o-", label="simulated")
        ax.loglog(xs, [base * c for c in xs], "--", label="linear (1 chip x chips)")
        for c, t, e in rows:
            ax.annotate(f"{e:.2f}", (c, t), textcoords="offset points", xytext=(4, -12))
        ax.set_xlabel("chips")
        ax.set_ylabel("inferences / s")
        ax.set_title("BERT-large s128 on SpiNNaker2 systems (efficiency annotated)")
        ax.legend()
        fig.tight_layout()
        fd, tmp = tempfile.mkstemp(suffix=".png", dir=os.path.dirname(os.path.abspath(plot)))
        os.close(fd)
        fig.savefig(tmp)
        os.replace(tmp, plot)  # written atomically
        print(f"  plot: {plot}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small configs")
    ap.add_argument("--only", nargs="+", choices=("gpt2", "bert-base", "resnet", "bert-large"))
    ap.add_argument("--plot", default="scale.png", help="file for the BERT-large scaling plot")
    args = ap.parse_args()
    todo = args.only or ("gpt2", "bert-base", "resnet", "bert-large")
    if "gpt2" in todo:
        gpt2_rows(args.quick)
    if "bert-base" in todo:
        bert_base_rows(args.quick)
    if "resnet" in todo:
        resnet_rows(args.quick)
    if "bert-large" in todo:
        bert_large_rows(args.quick, args.plot)
    print(f"\npeak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
