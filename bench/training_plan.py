"""Training plans from configs (``tvm_spinn.training.plan_training``): no weights, cost model.

Two tables, printed as Markdown:

* ``plans``: the shipped Llama-2-7B/13B/70B (and GPT-2-XL) configs on a board, 24 boards and
  the cloud (720 boards), fp32 AdamW, ``--seq`` tokens x ``--batch`` sequences a step: memory
  per chip by part (GiB), the split chosen, time per step, tokens/s, utilisation (model FLOPs
  over the fp32 peak of the chips used), efficiency (the plan-independent physical bound over
  the time per step) and the planning time; a model that does not fit names the smallest
  system that holds it.
* ``references``: the planner's model states, activations and FLOPs next to the papers'
  formulas re-derived for fp32 training (ZeRO / DeepSpeed's estimator, Korthikanti et al. 2022,
  Narayanan et al. 2021); ``tests/training/test_training_plan.py`` checks them.

    python bench/training_plan.py
    python bench/training_plan.py --part plans --models llama-2-70b --systems cloud
"""

from __future__ import annotations

import argparse
import importlib.resources
import time

GIB = 2**30
SYSTEMS = {"board": "spinn/board", "boards24": None, "cloud": "spinn/cloud"}


def _system(name: str):
    if name == "boards24":
        from tvm_spinn.target import make_system

        return make_system("spinn2-24boards", boards=24)
    return SYSTEMS[name]


def _config(name: str) -> str:
    return str(importlib.resources.files("tvm_spinn.llm") / "configs" / f"{name}.json")


def plans(models, systems, seq: int, batch: int) -> None:
    from tvm_spinn.training import TrainingPlanError, plan_training

    print("| model | system | weights / grads / optimizer / activations (GiB per chip) | split | "
          "time per step (s) | tokens/s | utilisation | efficiency | planned in (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for name in systems:
            start = time.perf_counter()
            try:
                p = plan_training(_config(model), _system(name), seq=seq, global_batch=batch)
            except TrainingPlanError as err:
                print(f"| {model} | {name} | does not fit: needs {err.smallest_boards} boards | | | | | | "
                      f"{time.perf_counter() - start:.1f} |")
                continue
            m, s = p.memory, p.split
            parts = " / ".join(f"{v / GIB:.3f}" for v in (m.weights, m.gradients, m.optimizer, m.activations))
            split = (f"TP {s.tp} x PP {s.pp} x DP {s.dp}, ZeRO-{s.zero}, {s.micro_batches} x {s.micro_batch}"
                     f"{', recompute' if s.recompute else ''}")
            print(f"| {model} | {name} | {parts} | {split} | {p.time_per_step_s:.4g} | {p.tokens_per_s:.4g} | "
                  f"{p.utilisation:.3f} | {p.efficiency:.3f} | {p.plan_seconds:.1f} |")


def references(models, seq: int, batch: int) -> None:
    from tvm_spinn.llm.spec import spec_of
    from tvm_spinn.training.planner import Split, memory_per_chip, model_flops

    print("| model | Ψ | ZeRO-2 states, dp 64 (GiB): planner / 4Ψ+12Ψ/N | ZeRO-1 states: planner / "
          "DeepSpeed fp32 8Ψ+8Ψ/N | step FLOPs: planner / formula | GPT layer activations (MiB, t=1): "
          "planner / Korthikanti fp32 |")
    print("|---|---|---|---|---|---|")
    for model in models:
        spec = spec_of(_config(model))
        psi, n = spec.params, 64
        states = {}
        for zero in (1, 2):
            mem = memory_per_chip(spec, Split(1, 1, n, zero, 1, 1, False), seq, "adamw", 2 * GIB)
            states[zero] = (mem.weights + mem.gradients + mem.optimizer) / GIB
        s, b, h, L, V = seq, batch, spec.hidden, spec.layers, spec.vocab
        flops = model_flops(spec, b * s, s)
        if spec.family == "gpt2":
            ref = 72 * b * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
            one = Split(1, 1, 1, 0, 1, 1, False)
            layer = (memory_per_chip(spec, one, s, "sgd", 2**60).activations_no_recompute
                     - 4 * s * (V + 2 * h)) / L / 2**20
            korth = (64 * s * h + 4 * spec.heads * s * s) / 2**20
            acts = f"{layer:.2f} / {korth:.2f}"
        else:
            q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
            gemm = L * (h * (q + 2 * kv) + q * h + 3 * h * spec.intermediate) + V * h
            ref = 6 * gemm * b * s + 12 * L * b * s * s * q
            acts = "(not a GPT layer)"
        print(f"| {model} | {psi / 1e9:.3f} B | {states[2]:.2f} / {(4 * psi + 12 * psi / n) / GIB:.2f} | "
              f"{states[1]:.2f} / {(8 * psi + 8 * psi / n) / GIB:.2f} | {flops:.4e} / {ref:.4e} | {acts} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("plans", "references", "all"), default="all")
    parser.add_argument("--models", nargs="+", default=["llama-2-7b", "llama-2-13b", "llama-2-70b"])
    parser.add_argument("--systems", nargs="+", choices=tuple(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=512, help="sequences per step")
    args = parser.parse_args()
    if args.part in ("plans", "all"):
        plans(args.models, args.systems, args.seq, args.batch)
        print()
    if args.part in ("references", "all"):
        references(["gpt2-xl", *args.models], min(args.seq, 1024), 1)


if __name__ == "__main__":
    main()
