"""Sensitivity of the headline numbers to the assumed hardware numbers: a table and a tornado plot.

Every :class:`tvm_spinn.SpinnArch` number marked "assumption" has a cited low/high range in
:data:`tvm_spinn.target.arch.ASSUMPTION_RANGES`. For each headline this bench measures the
latency (and the efficiency: physical bound / latency, :func:`efficiency`) at the default system
and with one field at a time set to its low and to its high end, prints one table, and draws a
tornado plot (latency change from the default per field, widest first) as a PNG.

Headlines (models are transformers configs; weights random or absent):

* ``resnet50-chip``, ``bert-base-chip``: ResNet-50 224 and BERT-base s128, batch 1, fp32, one
  chip (``spinn``). Built once (``relax.build``) with the default numbers, then **re-timed**:
  each variant recomputes the tiles' costs (:func:`tvm_spinn.mapping.derive_tables`) and runs
  the timing model (:func:`tvm_spinn.timing.model.evaluate`) and the physical bound on the same
  mapped programs. Tiles and placement stay those chosen for the default system (a compiler
  that knew the variant's numbers could choose better ones).
* ``gpt2-medium-board``: GPT-2-medium greedy decode on ``spinn/board``, fp32 weights, a
  1,024-token KV cache and its LM head (:func:`tvm_spinn.llm.plan`).
* ``llama-2-70b-board``, ``llama-2-70b-boards24``, ``llama-2-70b-cloud``: Llama-2-70B int8 decode
  (batch 1, 2,048-token context) on a board, 24 boards and ``spinn/cloud``.
  The LLM headlines are **re-planned** for every variant: the variant is registered as a system
  and :func:`tvm_spinn.llm.plan` chooses its placement from scratch; the latency is the token
  period (1 / tokens/s per user). The planning time of each plan is printed (the cloud's must
  stay under 60 s).

    python bench/sensitivity.py --quick                    # a few minutes on 2 cores
    python bench/sensitivity.py                            # every headline and field (long)
    python bench/sensitivity.py --headlines llama-2-70b-cloud --fields board_serial_links
    python bench/sensitivity.py --out /tmp/tornado.png

The plot goes to ``--out`` (default: a new temporary directory); nothing is written into the
repository unless ``--out`` points there.
"""

from __future__ import annotations

import argparse
import importlib.resources
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import tvm_spinn
from tvm_spinn.target.arch import ASSUMPTION_RANGES, ArchError, SpinnArch

#: Fields studied by default: every ranged number that moves a latency (energy and the host's
#: roofline do not; its link moves the LLM plans' token), first the six that move the headlines
#: most (link payload, board links, barrier, hop latency, DRAM rate, M4F cycles: QUICK_FIELDS).
FIELDS = (
    "link_payload_fraction", "board_serial_links", "barrier_cycles", "link_hop_s", "dram_bw_bytes_s",
    "m4f_flops_per_cycle", "board_link_bw_bytes_s", "board_link_hop_s", "m4f_elementwise_cycles",
    "dma_setup_cycles", "dma_bw_bytes_per_cycle", "exp_unit_cycles", "mac_readout_cycles",
    "sram_reserved_bytes", "host_link_latency_s", "host_link_bw_bytes_s",
)
QUICK_FIELDS = FIELDS[:6]
HEADLINES = ("resnet50-chip", "bert-base-chip", "gpt2-medium-board", "llama-2-70b-board",
             "llama-2-70b-boards24", "llama-2-70b-cloud")
QUICK_HEADLINES = ("bert-base-chip", "llama-2-70b-board")


@dataclass(frozen=True)
class Measure:
    """One headline on one system: its latency, its physical bound and (LLM plans) planning time."""

    latency_s: float
    physical_bound_s: float
    plan_s: float = float("nan")


def efficiency(m: Measure) -> float:
    """Physical bound / latency (at most 1); nan where either is missing."""
    if not (m.latency_s > 0 and m.physical_bound_s > 0):
        return float("nan")
    return m.physical_bound_s / m.latency_s


# --------------------------------------------------------------------------------- headlines
def _retimed(model_fn) -> Callable[[SpinnArch], Measure]:
    """Build a one-chip model once; return a function re-timing its programs on a variant."""
    from tvm import relax

    from tvm_spinn.mapping import derive_tables
    from tvm_spinn.timing.bounds import physical_bound, program_workload
    from tvm_spinn.timing.model import evaluate

    model, x = model_fn()
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    ex = relax.build(mod, target="spinn")
    rep = tvm_spinn.report(ex)
    base = rep.programs[0].arch
    tables = [derive_tables(p, base) for p in rep.programs]
    work = program_workload(rep.programs)
    # the re-timing path reproduces the build's own numbers on the default system
    again = sum(evaluate(p, base, t).latency_s for p, t in zip(rep.programs, tables))
    if not math.isclose(again, rep.latency_s, rel_tol=1e-9):
        raise RuntimeError(f"re-timing disagrees with the build: {again} vs {rep.latency_s} s")

    def measure(arch: SpinnArch) -> Measure:
        arch = arch.replace(chips=base.chips, name=base.name)
        # the same tiles on the same PEs, their costs (cycles, bytes) recomputed on the variant
        latency = sum(evaluate(p, arch, derive_tables(p, arch)).latency_s for p in rep.programs)
        return Measure(latency, physical_bound(work, arch).total_s)

    return measure


def _resnet50():
    import torch
    import transformers as tf

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_zoo import _Field

    torch.manual_seed(0)
    return _Field(tf.ResNetModel(tf.ResNetConfig()), "pooler_output").eval(), torch.randn(1, 3, 224, 224)


def _bert_base():
    import torch
    import transformers as tf

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_zoo import _Field

    torch.manual_seed(0)
    return _Field(tf.BertModel(tf.BertConfig()), "last_hidden_state").eval(), torch.randint(0, 1000, (1, 128))


def _planned(config, seq: int, dtype: str) -> Callable[[SpinnArch], Measure]:
    from tvm_spinn.llm.plan import plan
    from tvm_spinn.target import registered_system

    def measure(arch: SpinnArch) -> Measure:
        # the variant is a target only while it is planned (one at a time, so one name serves)
        with registered_system(arch.replace(name="sensitivity-variant")) as tag:
            p = plan(config, target=tag, batch=1, seq=seq, dtype=dtype)
        return Measure(1.0 / p.tokens_per_s_per_user, p.physical_bound_s, p.plan_seconds)

    return measure


def _llama70b():
    return str(importlib.resources.files("tvm_spinn.llm") / "configs" / "llama-2-70b.json")


def _gpt2_medium() -> dict:
    import transformers as tf

    return tf.GPT2Config(n_embd=1024, n_layer=24, n_head=16).to_dict()


def _systems() -> dict[str, SpinnArch]:
    return {"chip": tvm_spinn.arch_of("spinn"), "board": tvm_spinn.arch_of("spinn/board"),
            "boards24": tvm_spinn.make_system("spinn2-24-boards", boards=24),
            "cloud": tvm_spinn.arch_of("spinn/cloud")}


def headline(name: str) -> tuple[SpinnArch, Callable[[SpinnArch], Measure]]:
    """The default system of a headline and the function measuring it on a variant of it."""
    systems = _systems()
    if name == "resnet50-chip":
        return systems["chip"], _retimed(_resnet50)
    if name == "bert-base-chip":
        return systems["chip"], _retimed(_bert_base)
    if name == "gpt2-medium-board":
        return systems["board"], _planned(_gpt2_medium(), 1024, "fp32")
    if name.startswith("llama-2-70b-"):
        return systems[name.rsplit("-", 1)[1]], _planned(_llama70b(), 2048, "int8")
    raise ValueError(f"unknown headline {name!r}; known: {', '.join(HEADLINES)}")


# ------------------------------------------------------------------------------------- study
@dataclass(frozen=True)
class Row:
    headline: str
    field: str
    low: float
    high: float
    at_low: Measure | None
    at_high: Measure | None


def study(names, field_names, log=print) -> tuple[dict[str, Measure], list[Row]]:
    """Measure each headline at its default system and at each field's two ends."""
    defaults, rows = {}, []
    for name in names:
        t0 = time.perf_counter()
        base, measure = headline(name)
        defaults[name] = measure(base)
        log(f"  {name}: default {defaults[name].latency_s * 1e3:.4g} ms, efficiency "
            f"{efficiency(defaults[name]):.3g} (plan {defaults[name].plan_s:.1f} s; setup {time.perf_counter() - t0:.1f} s)")
        for f in field_names:
            span = ASSUMPTION_RANGES[f]
            ends = []
            for value in (span.low, span.high):
                try:
                    variant = base.replace(**{f: value})
                except ArchError as err:  # an end that contradicts another default: say so
                    log(f"    {f}={value:g}: {err}")
                    ends.append(None)
                    continue
                ends.append(measure(variant))
            rows.append(Row(name, f, span.low, span.high, *ends))
            log(f"    {f}: {_fmt_ms(ends[0])} / {_fmt_ms(ends[1])} ms at {span.low:.4g} / {span.high:.4g}")
    return defaults, rows


def _fmt_ms(m: Measure | None) -> str:
    return "n/a" if m is None else f"{m.latency_s * 1e3:.4g}"


def _fmt_eff(m: Measure | None) -> str:
    return "n/a" if m is None else f"{efficiency(m):.3g}"


def table(defaults: dict[str, Measure], rows: list[Row]) -> str:
    head = (f"{'headline':<22}{'field':<24}{'low':>10}{'high':>10}{'ms @low':>11}{'ms @def':>11}{'ms @high':>11}"
            f"{'eff @low':>10}{'eff @def':>10}{'eff @high':>10}{'plan s (lo/hi)':>16}")
    lines = [head, "-" * len(head)]
    for r in rows:
        d = defaults[r.headline]
        plan_s = "/".join("-" if m is None or math.isnan(m.plan_s) else f"{m.plan_s:.0f}" for m in (r.at_low, r.at_high))
        lines.append(f"{r.headline:<22}{r.field:<24}{r.low:>10.4g}{r.high:>10.4g}{_fmt_ms(r.at_low):>11}"
                     f"{_fmt_ms(d):>11}{_fmt_ms(r.at_high):>11}{_fmt_eff(r.at_low):>10}{_fmt_eff(d):>10}"
                     f"{_fmt_eff(r.at_high):>10}{plan_s:>16}")
    return "\n".join(lines)


def tornado(defaults: dict[str, Measure], rows: list[Row], path: str) -> None:
    """One panel per headline: latency change (%) from the default at each field's two ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(defaults)
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 1.2 + 0.35 * len({r.field for r in rows}) * len(names)),
                             squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        base = defaults[name].latency_s
        mine = [r for r in rows if r.headline == name]

        def change(m):
            return 0.0 if m is None else 100.0 * (m.latency_s / base - 1.0)

        mine.sort(key=lambda r: abs(change(r.at_high) - change(r.at_low)))
        ys = range(len(mine))
        ax.barh(ys, [change(r.at_low) for r in mine], color="tab:blue", label="field at low end")
        ax.barh(ys, [change(r.at_high) for r in mine], color="tab:orange", alpha=0.8, label="field at high end")
        ax.set_yticks(list(ys), [r.field for r in mine], fontsize=7)
        ax.axvline(0.0, color="black", lw=0.8)
        ax.set_title(f"{name}: {base * 1e3:.4g} ms at the defaults, efficiency {efficiency(defaults[name]):.3g}",
                     fontsize=8)
        ax.set_xlabel("latency change from the default (%)", fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
    axes[0, 0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"headlines {', '.join(QUICK_HEADLINES)}; fields {', '.join(QUICK_FIELDS)}")
    ap.add_argument("--headlines", nargs="+", choices=HEADLINES)
    ap.add_argument("--fields", nargs="+", choices=sorted(ASSUMPTION_RANGES))
    ap.add_argument("--out", help="tornado plot (.png); default: sensitivity.png in a new temporary directory")
    args = ap.parse_args()
    names = args.headlines or (QUICK_HEADLINES if args.quick else HEADLINES)
    field_names = args.fields or (QUICK_FIELDS if args.quick else FIELDS)
    out = args.out or os.path.join(tempfile.mkdtemp(prefix="spinn-sensitivity-"), "sensitivity.png")
    print(f"sensitivity of {len(names)} headline(s) to {len(field_names)} assumed field(s), one at a time")
    t0 = time.perf_counter()
    defaults, rows = study(names, field_names)
    print()
    print(table(defaults, rows))
    print("\nranges and their sources (tvm_spinn.target.arch.ASSUMPTION_RANGES):")
    for f in field_names:
        span = ASSUMPTION_RANGES[f]
        print(f"  {f}: {span.low:.4g} .. {span.high:.4g} (default {getattr(SpinnArch(), f):.4g}): {span.source}")
    planned = [m.plan_s for name, m in defaults.items() if name == "llama-2-70b-cloud"]
    planned += [m.plan_s for r in rows if r.headline == "llama-2-70b-cloud" for m in (r.at_low, r.at_high) if m]
    if planned:
        print(f"\nLlama-2-70B on spinn/cloud: planning {planned[0]:.1f} s at the defaults, at most {max(planned):.1f} s "
              f"over the variants (budget 60 s)")
    tornado(defaults, rows, out)
    print(f"\ntornado plot: {out}  (total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
