"""Scale-out benchmark: one model over chips, boards and a SpiNNcloud, side by side.

Models are `transformers` configs with random weights. Printed in one run:

1. GPT-2-medium decode step on `spinn/board`, batch 1, fp32 and int8: one token through every
   block and the LM head, attending over a full 1,024-token KV cache;
2. BERT-base s128 batch 1: one chip's latency over the board's;
3. ResNet-50 224 at batch 48 on a board: throughput over 48 x one chip's (batch 1);
4. BERT-large s128 throughput (stream of inputs) on 1, 48, 1,152 and 34,560 chips with the
   scaling at each size (throughput / (chips x one chip's)), plotted to `--plot`.

Each headline prints its latency, the physical bound (``tvm_spinn.report(ex).physical_bound_s``:
the work's MACs at the system's peak, the bytes it must read once at the best bandwidth any
placement gets, the board and chip crossings any placement needs; no plan moves it), what binds it and
the efficiency (bound / latency, at most 1) side by side; then the plan, with its own bound's
ratio as a labelled diagnostic, and the mapping+timing time of the build (wall clock of
`relax.build`; noisy on a shared machine).

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
    """GPT-2-medium (or a small GPT-2 for ``--quick``) as a causal LM: its decode step has the LM head."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_embd=256, n_layer=2, n_head=4) if quick else tf.GPT2Config(n_embd=1024, n_layer=24, n_head=16)
    cfg._attn_implementation = "eager"
    return tf.GPT2LMHeadModel(cfg).eval()


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


def _bound(rep) -> str:
    """Latency, the physical bound, what binds it and the efficiency, side by side."""
    return (f"latency {rep.latency_s * 1e3:.3f} ms, physical bound {rep.physical_bound_s * 1e3:.4g} ms "
            f"({rep.physical_binding}), efficiency {rep.efficiency:.3g}")


def _plan(rep) -> str:
    """The multi-chip plan, with its own bound's ratio labelled as the diagnostic it is."""
    p = rep.plan
    if not p:
        return "1 chip"
    return (f"tp{'/'.join(map(str, p['tp']))} dp{'/'.join(map(str, p['dp']))} sp{'/'.join(map(str, p.get('sp', [1])))} "
            f"st{p['stages']} x{p['replicas']}; the plan's own bound (diagnostic): {p['binding']}, "
            f"latency / it {p['latency_over_bound']:.2f}")


#: KV-cache slots of the GPT-2-medium decode step (its whole position table)
GPT2_CONTEXT = 1024


def gpt2_rows(quick: bool) -> None:
    """GPT-2-medium decode on a board: one token attending over a full ``GPT2_CONTEXT``-slot KV
    cache, through every block and the LM head (``tvm_spinn.llm.compile``'s decode step; int8:
    calibrated on seeded random prompts), in fp32 and int8."""
    from tvm_spinn import llm

    model = _gpt2(quick)
    context = 64 if quick else GPT2_CONTEXT
    print(f"\n[1] GPT-2-medium decode step on spinn/board: a {context}-token KV cache and the LM head, batch 1"
          + (" [quick config]" if quick else ""))
    for dtype in ("fp32", "int8"):
        compiled = llm.compile(model, target="spinn/board", max_seq_len=context, quantize=True if dtype == "int8" else None)
        t0 = time.perf_counter()
        with tvm_spinn.MappingOptions(weights="auto"):
            ex, _ = compiled.decode_executable()
        rep, secs = tvm_spinn.report(ex), time.perf_counter() - t0
        work = rep.physical.details["workload"]
        print(f"  {dtype}: {_bound(rep)}; {rep.physical.details['read_bytes'] / 1e6:.0f} MB read once "
              f"({work['constant_bytes'] / 1e6:.0f} MB of weights and embedding rows, {work['input_bytes'] / 1e6:.0f} MB "
              f"of inputs: the KV cache), {1 / rep.latency_s:.0f} tokens/s; {_plan(rep)}; build {secs:.1f} s", flush=True)


def bert_base_rows(quick: bool) -> None:
    model, x = _bert("base", quick)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    chip, c_s = _build(mod, "spinn")
    board, b_s = _build(mod, "spinn/board")
    same = sum(min(c["latency_s"] for c in m["system"]["candidates"] if c["tp"] * c["dp"] == 1)
               for m in board.mapping if "system" in m)
    print("\n[2] BERT-base s128 batch 1: one chip vs a board" + (" [quick config]" if quick else ""))
    print(f"  chip: {_bound(chip)}; board: {_bound(board)}")
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
    print(f"  chip: {_bound(chip)}; board (batch 48): {_bound(board)}")
    print(f"  chip {1 / chip.latency_s:.1f} img/s, board {48 / board.latency_s:.1f} img/s: "
          f"{ratio:.2f} x (48 x chip)  ({_plan(board)}; builds {c_s:.1f} / {b_s:.1f} s)", flush=True)


def bert_large_rows(quick: bool, plot: str | None) -> None:
    from tvm_spinn.target import registered_system

    model, x = _bert("large", quick)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    print("\n[4] BERT-large s128 throughput (stream of inputs)" + (" [quick config]" if quick else ""))
    print(f"  {'chips':>6} {'latency ms':>11} {'bound ms':>9} {'binding':>13} {'bound/lat':>9} {'inf/s':>10} "
          f"{'scaling':>8} {'build s':>8}  plan")
    rows = []
    base = None
    sizes = [("spinn", 1), (None, 1152), ("spinn/board", 48), ("spinn/cloud", 34560)]  # None: 24 boards
    sizes.sort(key=lambda s: s[1])
    for tag, chips in sizes:
        if tag is None:  # the 24-board system is a target only while it is built
            with registered_system(tvm_spinn.make_system("scale-24b", boards=24)) as tag:
                rep, secs = _build(mod, tag, tvm_spinn.MappingOptions(objective="throughput"))
        else:
            rep, secs = _build(mod, tag, tvm_spinn.MappingOptions(objective="throughput"))
        # one chip runs its regions one after another: 1 / latency (the report's one-chip figure
        # treats the regions as a pipeline of their own)
        tput = rep.throughput_inf_s if rep.plan else 1.0 / rep.latency_s
        base = base or tput
        eff = tput / (chips * base)
        rows.append((chips, tput, eff))
        print(f"  {chips:>6} {rep.latency_s * 1e3:>11.3f} {rep.physical_bound_s * 1e3:>9.4g} {rep.physical_binding:>13} "
              f"{rep.efficiency:>9.3g} {tput:>10.1f} {eff:>8.3f} {secs:>8.1f}  {_plan(rep)}", flush=True)
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
