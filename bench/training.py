"""Training-step benchmark: simulated time per step on one chip and on a board, by
phase, and data-parallel scaling over the board's chips, reproducible vs ring all-reduce.

Models are `transformers` configs with random weights (no download):

- ``resnet18``: ``ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128,
  256, 512])``, ResNet-18's layers and widths, BatchNorm in training mode, on 64x64 images
  (not ImageNet's 224x224: the step's host-side conv gradients make a 224 build too slow to
  compile here), 10 classes;
- ``bert``: BERT-base (12 layers, hidden 768, 12 heads, FFN 3072) at sequence 128, a 1,000-token
  vocabulary (the 30,522 rows of the real one only add an embedding-gradient on the host),
  dropout 0, sequence classification with 2 labels.

- ``gpt2-small``: GPT-2 small (``GPT2Config()`` defaults: 124M parameters, 12 layers, hidden
  768, vocabulary 50,257) at sequence 256, 8 sequences a step, AdamW, recomputation off,
  planned by :func:`tvm_spinn.training.plan_training` (a compiled build of the full model is
  too slow here) on the smallest system that holds its step (its AdamW state alone is ~1.5 GB),
  a board and 24 boards: time per step, tokens/s, efficiency against the plan-independent
  physical bound, speed-up over the smallest system and its fraction of linear scaling (chips
  of the system over the smallest one's), and the reproducible mode's cost over the fastest
  (non-reproducible) plan; then the issue's targets, met or not. The planner's per-chip
  weights, gradients and optimizer state are checked against the buffers an actual build of a
  small GPT-2 allocates by ``tests/training/test_training_plan.py::
  test_plan_matches_the_buffers_a_build_allocates``.

``--quick`` shrinks the compiled models (ResNet-18 on 32x32, BERT with 2 layers at sequence 32). Per compiled model:

1. one training step (SGD with momentum for ResNet, Adam for BERT) compiled for ``spinn`` and
   for ``spinn/board``: simulated seconds of the step, and of its forward, backward and update
   phases on the chip (``--board-phases``: on the board too) (:func:`tvm_spinn.training.step_time`:
   the offloaded programs' simulated time, and the host ops left as a separate "host" phase
   timed by the host's roofline; the total is their sum);
2. data parallelism on the board: a batch of 8 micro-batches of 2 samples (BatchNorm needs
   more than one value per channel), R = 1, 2, 4, 8 replicas (one chip each); simulated step
   time with the reproducible reduction (a chain in micro-batch order) and with the
   non-reproducible one (per-replica sum, then the cheaper of ring and tree), their ratio (the
   issue's budget: <= 1.2x), and the speedup over R = 1.

The scaling is plotted to ``--plot`` (matplotlib; written atomically). Build times are wall
clock on this machine (noisy when shared).

    python bench/training.py                      # both models, full configs (~20 min here)
    python bench/training.py --quick --plot /tmp/training.png
    python bench/training.py --only bert --no-phases
    python bench/training.py --dp-only            # only the data-parallel scaling and its plot
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

import tvm_spinn
from tvm_spinn._files import atomic_write


class _Logits(torch.nn.Module):
    """A `transformers` classifier as a tensor -> logits module."""

    def __init__(self, model, key: str):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x):
        return self.model(**{self.key: x}).logits


def resnet18(quick: bool, batch: int):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
                          embedding_size=64, num_labels=10)
    side = 32 if quick else 64
    x = torch.randn(batch, 3, side, side)
    return (_Logits(tf.ResNetForImageClassification(cfg), "pixel_values"), x, 10,
            ("sgd", {"lr": 0.1, "momentum": 0.9}), f"ResNet-18 {side}x{side}")


def bert(quick: bool, batch: int):
    import transformers as tf

    torch.manual_seed(0)
    layers, seq = (2, 32) if quick else (12, 128)
    cfg = tf.BertConfig(vocab_size=1000, hidden_size=768, num_hidden_layers=layers, num_attention_heads=12,
                        intermediate_size=3072, max_position_embeddings=max(seq, 128), hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=2, attn_implementation="eager")
    ids = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(0))
    return (_Logits(tf.BertForSequenceClassification(cfg), "input_ids"), ids, 2, ("adam", {"lr": 1e-4}),
            f"BERT-base {layers} layers s{seq}")


MODELS = {"resnet18": resnet18, "bert": bert}
#: models planned by the training planner instead of compiled
PLANNED = ("gpt2-small",)
#: the issue's targets for GPT-2 small on 24 boards
TARGET_EFFICIENCY, TARGET_SCALING = 0.3, 0.5


def _ms(s: float) -> str:
    return f"{s * 1e3:9.3f}"


def _step_times(model, x, y, optimizer, args) -> dict:
    t0 = time.perf_counter()
    chip = tvm_spinn.training.compile(model, x, optimizer=optimizer, target="spinn")
    print(f"  build for spinn: {time.perf_counter() - t0:.1f} s wall")
    t0 = time.perf_counter()
    try:
        board = chip.build_for("spinn/board")
        print(f"  build for spinn/board: {time.perf_counter() - t0:.1f} s wall")
    except Exception as err:  # noqa: BLE001 - a mapping limit is a result to print, not a crash
        board = None
        print(f"  build for spinn/board FAILED: {type(err).__name__}: {str(err).splitlines()[-1]}")
    place = tvm_spinn.training.op_placement(chip)
    for phase, where in place.items():
        host = sum(where["host"].values())
        print(f"  {phase:<8} PE ops {sum(where['pe'].values()):4d}, host ops {host:4d}: "
              + ", ".join(f"{k.removeprefix('relax.')} {v}" for k, v in where["host"].items()))
    print(f"  {'system':<12}{'total ms':>10}{'PE ms':>10}{'host ms':>10}{'forward':>10}{'backward':>10}{'update':>10}"
          f"   host: {'forward':>8}{'backward':>10}{'update':>8}")
    rows = {}
    for system, trainer in (("spinn", chip), ("spinn/board", board)):
        if trainer is None:
            continue
        phases = not args.no_phases and (system == "spinn" or args.board_phases)
        t = tvm_spinn.training.step_time(trainer, phases=phases)
        rows[system] = t
        parts = "".join(f"{_ms(t[k]):>10}" for k in ("forward_s", "backward_s", "update_s")) if "forward_s" in t else ""
        if "forward_s" in t:
            parts += "         " + "".join(f"{_ms(t[k]):>9}" for k in ("forward_host_s", "backward_host_s", "update_host_s"))
        print(f"  {system:<12}{_ms(t['total_s']):>10}{_ms(t['step_s']):>10}{_ms(t['host_s']):>10}{parts}")
    if "spinn/board" in rows:
        print(f"  board speedup over one chip: {rows['spinn']['total_s'] / rows['spinn/board']['total_s']:.2f}x "
              f"(PE time only: {rows['spinn']['step_s'] / rows['spinn/board']['step_s']:.2f}x)")
    if args.run_step:  # one real step on the functional simulator (BERT-base: ~14 GB, minutes)
        print(f"  one simulated step on a chip: loss {chip.step(x, y):.4f}")
    return rows


def _one(name: str, args) -> dict:
    model, x, classes, optimizer, label = MODELS[name](args.quick, args.batch)
    y = np.arange(args.batch, dtype=np.int64) % classes
    print(f"\n== {label}, batch {args.batch}, optimizer {optimizer[0]}")
    if not args.dp_only:
        _step_times(model, x, y, optimizer, args)
    t0 = time.perf_counter()
    m = args.microbatches
    xs = x[:args.micro].repeat(m, *([1] * (x.dim() - 1)))  # shapes only: m micro-batches of args.micro
    dp = tvm_spinn.training.compile(model, xs, optimizer=optimizer, target="spinn/board",
                                    data_parallel={"replicas": 1, "microbatches": m})
    print(f"  data parallel, {m} micro-batches of {args.micro} samples (build {time.perf_counter() - t0:.1f} s wall)")
    print(f"  {'replicas':>8}{'repro ms':>10}{'ring ms':>10}{'ratio':>7}{'speedup':>9}  all-reduce (repro / fast)")
    scaling = []
    replicas = [r for r in (1, 2, 4, 8, 16, 32) if r <= m]
    for r in replicas:
        fixed = dp.with_replicas(r).simulated_step()
        fast = dp.with_replicas(r, reproducible=False).simulated_step()
        scaling.append((r, fixed["total_s"], fast["total_s"]))
        print(f"  {r:>8}{_ms(fixed['total_s']):>10}{_ms(fast['total_s']):>10}{fixed['total_s'] / fast['total_s']:>7.3f}"
              f"{scaling[0][1] / fixed['total_s']:>8.2f}x  {fixed['all_reduce']} {_ms(fixed['all_reduce_s']).strip()} / "
              f"{fast['all_reduce']} {_ms(fast['all_reduce_s']).strip()} ms")
    return {"label": label, "scaling": scaling}


def gpt2_small_plans(seq: int = 256, batch: int = 8) -> dict:
    """GPT-2 small's training step planned on the smallest system that holds it, a board and 24
    boards, reproducible and fastest; prints the table and the targets, returns the rows."""
    import transformers as tf

    from tvm_spinn.target.arch import make_system
    from tvm_spinn.target.registry import arch_of
    from tvm_spinn.training.planner import _spec, smallest_system

    cfg = tf.GPT2Config()
    spec = _spec(cfg)
    board = arch_of("spinn/board")
    found = smallest_system(spec, board, batch, seq, "adamw", recompute=False)
    if found is None:
        print("  GPT-2 small fits no system")
        return {}
    systems = (("smallest", make_system("gpt2-small-smallest", chips=found[0])), ("board", board),
               ("24 boards", make_system("gpt2-small-24-boards", boards=24)))
    print(f"\n== GPT-2 small ({spec.params / 1e6:.1f}M parameters, vocabulary {spec.vocab}), seq {seq}, "
          f"batch {batch}, AdamW, recomputation off (planned; priced, not built: a steady slot's passes on "
          f"shared PEs and the token chunks, while the compiled step runs its GEMMs one after another)")
    print(f"  {'system':<10}{'chips':>6}  {'split (reproducible)':<44}{'step s':>9}{'tokens/s':>10}{'bound s':>9}"
          f"{'effic.':>8}{'speedup':>9}{'of lin.':>8}{'repro/fast':>11}")
    rows = {}
    for name, arch in systems:
        t0 = time.perf_counter()
        fixed = tvm_spinn.training.plan_training(cfg, arch, seq=seq, global_batch=batch, optimizer="adamw",
                                                 recompute=False, reproducible=True)
        fast = tvm_spinn.training.plan_training(cfg, arch, seq=seq, global_batch=batch, optimizer="adamw",
                                                recompute=False, reproducible=False)
        rows[name] = (arch.chips, fixed, fast, time.perf_counter() - t0)
    base_chips, base = rows["smallest"][0], rows["smallest"][1]
    for name, (chips, fixed, fast, secs) in rows.items():
        speedup = base.time_per_step_s / fixed.time_per_step_s
        linear = chips / base_chips
        split = (f"TP{fixed.split.tp} PP{fixed.split.pp} DP{fixed.split.dp} ZeRO-{fixed.split.zero} "
                 f"mb{fixed.split.micro_batch}x{fixed.split.micro_batches}"
                 + (f" c{fixed.split.chunks}" if fixed.split.chunks > 1 else "")
                 + (f" head{fixed.split.head_tp}" if fixed.split.head_tp else "")
                 + (" head-spread" if fixed.split.spread_head else "")
                 + (f" lag{fixed.split.head_lag}" if fixed.split.head_lag else "")
                 + (" zb" if fixed.split.zero_bubble else ""))
        print(f"  {name:<10}{chips:>6}  {split:<44}{fixed.time_per_step_s:>9.3f}{fixed.tokens_per_s:>10.0f}"
              f"{fixed.bound_s:>9.4f}{fixed.efficiency:>8.3f}{speedup:>8.2f}x{speedup / linear:>8.3f}"
              f"{fixed.time_per_step_s / fast.time_per_step_s:>10.2f}x")
    print("  where each step's time goes (reproducible, seconds; pipeline = the slots at the slowest stage's "
          "pace, each stage's slot once more for the fill and drain, at least one slot's passes and collectives in "
          "series (zb: less its weight gradients, deferred into the idle time); of it compute, TP collectives and "
          "hand-overs (with several slots they overlap the other pass's compute), 'exposed' the slots' time "
          "beyond their compute, and the bubble (beyond the slots at that pace); DP sync: "
          "exposed, and hidden in the pipeline's drain):")
    print(f"  {'system':<10}{'pipeline':>9}{'compute':>9}{'TP coll.':>9}{'PP hand':>9}{'exposed':>9}{'bubble':>9}"
          f"{'DP sync':>9}{'hidden':>9}{'update':>9}{'DRAM-bound':>11}  split")
    for name, (chips, fixed, fast, secs) in rows.items():
        st = fixed.step
        print(f"  {name:<10}{st.pipeline_s:>9.4f}{st.compute_s:>9.4f}{st.tp_comm_s:>9.4f}{st.pp_comm_s:>9.4f}"
              f"{st.pipeline_s - st.compute_s:>9.4f}{st.bubble_s:>9.4f}{st.dp_comm_s:>9.4f}{st.dp_hidden_s:>9.4f}"
              f"{st.optimizer_s:>9.4f}{'yes' if st.dram_bound else 'no':>11}  {fixed.split.line()}")
    print("  one pipeline slot by stage (ms; stage = pp: the LM head's own stage; the slot: its compute, TP "
          "collectives and hand-overs as they overlap; * the stage that paces the pipeline):")
    for name, (chips, fixed, fast, secs) in rows.items():
        pace = max(slot for *_, slot in fixed.step.stages_s)
        print(f"  {name:<10}" + "; ".join(f"stage {j}{'*' if slot == pace else ''}: slot {slot * 1e3:.2f} (compute "
                                         f"{c * 1e3:.2f}, TP {t * 1e3:.2f}, hand-over {h * 1e3:.2f})"
                                         for j, c, t, h, slot in fixed.step.stages_s))
    print("  the physical bound (plan-independent, seconds): "
          + "; ".join(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in fixed.bound_parts_s)
                      for name, (chips, fixed, fast, secs) in rows.items()))
    chips24, plan24 = rows["24 boards"][0], rows["24 boards"][1]
    scaling = base.time_per_step_s / plan24.time_per_step_s / (chips24 / base_chips)
    eff_ok, scale_ok = plan24.efficiency >= TARGET_EFFICIENCY, scaling >= TARGET_SCALING
    print(f"  24 boards use {plan24.split.chips} of their {chips24} chips; bound binding: {plan24.bound_binding}")
    _limits(plan24, chips24)
    _pacing_gemms(spec, plan24, systems[-1][1], seq)
    _timeline(spec, plan24, systems[-1][1], seq)
    print(f"  target efficiency >= {TARGET_EFFICIENCY} on 24 boards (reproducible): {plan24.efficiency:.3f} "
          f"-> {'MET' if eff_ok else 'NOT MET'}")
    print(f"  target 24 boards vs smallest >= {TARGET_SCALING} of linear: {scaling:.4f} "
          f"-> {'MET' if scale_ok else 'NOT MET'}")
    return rows


def _timeline(spec, plan, arch, seq: int) -> None:
    """The planned pipeline as a timeline of its passes (:mod:`tvm_spinn.training.chunk_schedule`):
    as independent slots (the pipeline term's assumption), in the chunk order the bits fix (what
    the search charges a chunked split), and with one weight-gradient pass a micro-batch."""
    from tvm_spinn.training.planner import _Comms
    from tvm_spinn.training.planner.timeline import pipeline_timeline

    t = pipeline_timeline(spec, plan.split, plan.step, seq, arch, _Comms(arch, True))
    print(f"  the pipeline as a timeline of its passes (training.chunk_schedule; the plan's pipeline "
          f"{plan.step.pipeline_s:.4f} s, the longer of its term and the chunk order): independent slots "
          f"{t['slots']:.4f} s, in the chunk order the bits fix (B passes descending, W passes after the "
          f"micro-batch's chunk-0 B pass) {t['ordered']:.4f} s ({t['ordered'] / t['slots']:.2f}x), with one W pass "
          f"a micro-batch {t['joint']:.4f} s ({t['joint'] / t['slots']:.2f}x)")


def _limits(plan, chips: int) -> None:
    """What separates a plan's step from its bound, part by part: the bound's compute on every chip,
    on the chips the split uses, the pacing stage's slots (and of them its GEMMs, against the
    bound on the chips used), the fill and drain beyond the slots, and the exposed data-parallel
    synchronisation and update."""
    st, split = plan.step, plan.split
    compute = dict(plan.bound_parts_s)["compute"]
    used = compute * chips / split.chips
    pace = max(st.stages_s, key=lambda s: s[-1])
    slots = split.slots * pace[-1]
    gemms = split.slots * pace[1]
    print(f"  24 boards, where the step goes against the bound (s): compute bound on {chips} chips {compute:.4f}; "
          f"on the {split.chips} used {used:.4f}; the pacing stage's {split.slots} slots {slots:.4f} (its GEMMs "
          f"{gemms:.4f}, {gemms / used:.2f}x the bound on the chips used); fill and drain {st.bubble_s:.4f}; "
          f"DP sync {st.dp_comm_s:.4f}; update {st.optimizer_s:.4f}; step {st.total_s:.4f}")


def _pacing_gemms(spec, plan, arch, seq: int) -> None:
    """One layer's GEMMs of a block stage's slot on a rank, as the planner prices them
    (:func:`tvm_spinn.timing.gemm.gemm_seconds` at the mapper's tile, each right operand in SRAM
    where the planner finds it there: resident weights where the stage's fit the SRAM share, the
    output gradients, the slot's fresh keys and values): per pass and shape the tile, its rounds of tiles over the chip's
    PEs against the work (tiles over PEs), and the microseconds."""
    import math

    from tvm_spinn.program.ops.gemm import GemmShape, choose_matmul_tile
    from tvm_spinn.timing.gemm import gemm_seconds
    from tvm_spinn.training.planner import _Comms, _gathered_params, _resident_share, _stage_params
    from tvm_spinn.training.planner.model import _block_gemms
    from tvm_spinn.training.planner.slot import _fresh_attention

    split, pes = plan.split, arch.pes_per_chip
    tokens = split.micro_batch * seq // split.chunks
    stage = split.pp - 1  # a block stage (the first one also gathers the embeddings' rows)
    streamed = (_stage_params(spec, split.tp, split.pp, stage, split.head_tp, split.spread_head)
                - _gathered_params(spec, split, stage))
    resident = 2 * 4 * streamed <= _resident_share(arch)
    weights, attention = _block_gemms(spec, tokens, seq, split.tp, split.micro_batch, split.chunks)
    fresh = _fresh_attention(spec, split, tokens, arch)
    # where each pass's right operand is (:func:`tvm_spinn.training.planner.slot._pass_seconds`)
    on_chip = {False: (resident, resident, True), True: (fresh, fresh and split.recompute, True)}
    print(f"  a block stage's GEMMs of one layer and slot ({tokens} tokens, TP {split.tp}, weights "
          f"{'resident' if resident else 'streamed'}; rounds: tiles over the {pes} PEs, work: their share):")
    totals = {}
    for g, (m, k, n, b) in enumerate(weights + attention):
        passes = (("forward", (m, k, n)), ("input grad", (m, n, k)), ("weight grad", (k, m, n)))
        for (name, (mm, kk, nn)), in_sram in zip(passes, on_chip[g >= len(weights)]):
            tm, tn, tk = choose_matmul_tile(GemmShape(b, mm, nn, kk), arch, pes, in_sram)[:3]
            tiles = b * math.ceil(mm / tm) * math.ceil(nn / tn)
            secs = gemm_seconds(arch, mm, kk, nn, b, in_sram)
            totals[name] = totals.get(name, 0.0) + secs
            print(f"    {name:<12}{b:>3} x {mm}x{kk}x{nn:<6} tile {min(tm, mm)}x{min(tn, nn)}x{min(tk, kk):<5}"
                  f"{tiles:>6} tiles  rounds {math.ceil(tiles / pes):>3} (work {tiles / pes:5.2f})  {secs * 1e6:8.1f} us")
    print("    per layer (us): " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in totals.items())
          + f"; all {sum(totals.values()) * 1e6:.1f}")
    from tvm_spinn.training.planner import _shared_pes_saving
    from tvm_spinn.training.planner.model import _attention_at

    saved = _shared_pes_saving(arch, weights, _Comms(arch, plan.reproducible), resident, attention, fresh,
                               split.recompute, _attention_at(spec))
    print(f"    a steady slot's passes on shared PEs (one slot's forward, another's backward, the weight gradients; "
          f"timing.gemm_overlap; priced, not built: the compiled step runs them one after another): "
          f"{(sum(totals.values()) - saved) * 1e6:.1f} us")


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for res in results.values():
        r = [row[0] for row in res["scaling"]]
        base = res["scaling"][0][1]
        ax.plot(r, [base / row[1] for row in res["scaling"]], "o-", label=f"{res['label']} (reproducible)")
        ax.plot(r, [base / row[2] for row in res["scaling"]], "x--", label=f"{res['label']} (ring)")
    top = max(row[0] for res in results.values() for row in res["scaling"])
    ax.plot([1, top], [1, top], ":", color="gray", label="linear")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("replicas (chips of spinn/board)")
    ax.set_ylabel("speedup of a training step over 1 replica")
    ax.set_title("Data-parallel training on a board (simulated)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format=os.path.splitext(path)[1][1:] or "png", dpi=120))
    plt.close(fig)
    print(f"\nplot written to {path}")


def _plot_search(rows: dict, path: str) -> None:
    """The split search of each GPT-2 small plan: every split whose lower bound the planner took
    (chips used vs seconds a step), costed in full or pruned by its bound, and the one chosen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False)
    for ax, (name, (chips, fixed, _, _)) in zip(axes[0], rows.items()):
        costed = [(s.chips, t) for s, _, t in fixed.search if t is not None]
        pruned = [(s.chips, b) for s, b, t in fixed.search if t is None]
        if pruned:
            ax.scatter(*zip(*pruned), marker=".", s=6, color="0.7", label=f"pruned: lower bound ({len(pruned)})")
        if costed:
            ax.scatter(*zip(*costed), marker="o", s=12, color="tab:blue", label=f"costed in full ({len(costed)})")
        ax.scatter([fixed.split.chips], [fixed.time_per_step_s], marker="*", s=160, color="tab:red", zorder=3,
                   label=f"chosen: {fixed.time_per_step_s:.3g} s")
        ax.axhline(fixed.bound_s, color="k", ls=":", label=f"physical bound {fixed.bound_s:.3g} s")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("chips used by the split")
        ax.set_ylabel("seconds per step (reproducible)")
        ax.set_title(f"GPT-2 small, {name} ({chips} chips)", fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format=os.path.splitext(path)[1][1:] or "png", dpi=120))
    plt.close(fig)
    print(f"\nsplit-search plot written to {path}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(MODELS) + list(PLANNED), action="append",
                        help="models to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="smaller configs")
    parser.add_argument("--batch", type=int, default=8, help="samples per step (default 8)")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches of the data-parallel step")
    parser.add_argument("--micro", type=int, default=2,
                        help="samples per micro-batch (2: BatchNorm needs more than one value per channel)")
    parser.add_argument("--dp-only", action="store_true", help="only the data-parallel scaling")
    parser.add_argument("--run-step", action="store_true",
                        help="also run one step on the functional simulator (BERT-base needs ~14 GB)")
    parser.add_argument("--no-phases", action="store_true", help="skip the per-phase builds")
    parser.add_argument("--board-phases", action="store_true", help="time the phases on the board too (3 more builds)")
    parser.add_argument("--plot", default="training_scaling.png", help="where to write the scaling plot")
    parser.add_argument("--search-plot", default=os.path.join("results", "training_split_search.png"),
                        help="where to write the GPT-2 small split-search plot ('' for none)")
    args = parser.parse_args(argv)
    names = args.only or list(MODELS) + list(PLANNED)
    if "gpt2-small" in names:
        planned = gpt2_small_plans()
        if args.search_plot and planned:
            _plot_search(planned, args.search_plot)
    results = {name: _one(name, args) for name in names if name in MODELS}
    if args.plot and results:
        _plot(results, args.plot)


if __name__ == "__main__":
    sys.exit(main())
