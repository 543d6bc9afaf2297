"""Tensor parallelism of a training step: the simulated step of a small GPT-2 on a board for
tp = 1, 2, 4 (Megatron's split, the sums over a split axis in the canonical leaf order), side by
side with the usual all-reduced split, and the bits of every plan against tp = 1.

Columns: the step, its speed-up over tp = 1, the busiest replica's granules (one rank's share),
the one-chip granule, the fixed-order reduction over the ranks a rank is charged per granule,
the update (a rank's share of the parameters), the step with Megatron's all-reduce instead
(bits depend on tp), the reproducible mode's cost over it, and whether the parameters after one
step are the tp = 1 bits.

    python bench/training_tp.py [--hidden 64] [--layers 2] [--heads 4] [--seq 8] [--batch 4]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import transformers

import tvm_spinn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from training_models import LM  # noqa: E402  (the causal LM's logits as cross-entropy trains them)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden,
                                  n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, use_cache=False, attn_implementation="eager")
    model = LM(transformers.GPT2LMHeadModel(cfg))
    ids = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq)).astype(np.int64)
    labels = np.roll(ids, -1, axis=1).reshape(-1)
    print(f"GPT-2 {args.layers} layers, hidden {args.hidden}, {args.heads} heads, batch {args.batch} x {args.seq} "
          "tokens, AdamW, spinn/board, one micro-batch (granule: one sample)")
    print(f"{'tp':>3} {'step ms':>9} {'speed-up':>9} {'granule ms':>11} {'one-chip':>9} {'reduce ms':>10} "
          f"{'update ms':>10} {'all-reduced tp ms':>18} {'repro cost':>11} {'bits = tp1':>11}")
    ref, base = None, None
    for tp in args.tp:
        trainer = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=("adamw", {"lr": 1e-3}),
                                             target="spinn/board", parallel={"tp": tp, "microbatches": 1})
        t = trainer.simulated_step()
        loss = trainer.step(ids, labels)
        params = trainer.parameters()
        same = "ref" if ref is None else str(loss == ref[0] and all(
            params[n].tobytes() == ref[1][n].tobytes() for n in ref[1]))
        ref = ref or (loss, params)
        base = base or t["total_s"]
        c = t.get("tp", {})
        # the step with Megatron's all-reduce: the granules at the all-reduced rank's time
        mega = t["total_s"] - t["compute_s"] * (1 - c["megatron_rank_s"] / c["rank_s"]) if c else t["total_s"]
        print(f"{tp:>3} {t['total_s'] * 1e3:>9.3f} {base / t['total_s']:>8.2f}x {t['compute_s'] * 1e3:>11.3f} "
              f"{c.get('one_chip_s', t['compute_s'] / args.batch) * 1e3:>9.3f} {c.get('reduce_s', 0) * 1e3:>10.3f} "
              f"{t['update_s'] * 1e3:>10.3f} {mega * 1e3:>18.3f} {t['total_s'] / mega:>10.2f}x {same:>11}")


if __name__ == "__main__":
    main()
