"""LLM inference on spinn systems: generated tokens on the simulator, and plans from configs.

Three parts, each printed as one table from one run:

* ``generate``: small GPT-2 and Llama configs (seeded random weights) compiled with
  ``tvm_spinn.llm.compile`` in fp32 and int8 (``tvm_spinn.quantize``, calibrated on seeded random
  prompts); greedy tokens compared with transformers' ``generate(do_sample=False)`` on the same
  weights (agreement = share of new tokens equal, and the first step that differs); the
  simulated time to first token and decode latency; and the wall time of one decode step on
  the functional simulator next to transformers' own step (eager PyTorch, same thread count)
  and next to onnxruntime running the same step (``graphs.Decode`` exported with
  ``torch.onnx.export``: fp32 weights, the KV cache as plain tensors; the issue's 3x budget),
  measured side by side (simulator and onnxruntime calls interleaved), with the largest logit
  difference between the two (int8 rows: the int8 simulator against the fp32 step).
* ``plan``: shipped configs (Llama-2-7B/13B/70B, GPT-2-XL) x systems (chip, board, 24 boards,
  720 boards) x dtype with ``tvm_spinn.llm.plan`` (no weights, timing model). A decode step is one
  token per user through every block and the LM head, attending over a KV cache of ``--seq``
  slots (2,048 by default; GPT-2-XL its 1,024 positions). Side by side: the token period, the
  physical bound (the config, context and system only: MACs at the system's peak, the bytes the
  step must read once, one embedding row per user, never the table, at the best bandwidth any
  placement gets, and the board and chip crossings any placement needs), what binds it and the
  efficiency (bound / period, at most 1); then tokens/s, TTFT, energy per token, the plan's own
  bound's ratio (a diagnostic: it moves with the plan) and the planning time; with
  ``--int8-handover`` each multi-board row planned again with int8 hand-overs, printed below it;
  each int8 row of three boards or more planned again with its all-reduces across boards
  narrowed (``--compare-reduce``, fp16 and int8 by default; ``--reduce`` sets the rows' own wire, int32 by
  default: the model's bits), printed below it, with each narrowed wire's accuracy cost against
  fp32 logits on the small random-weight Llama and GPT-2 (``tvm_spinn.llm.accuracy.reduce_rounding``);
  over several board counts, tokens/s per user with the boards each plan uses and its
  efficiency; a plot of tokens/s per user against boards, the physical bound dotted (``--plot``,
  written atomically).
* ``scaling`` (run alone): one model (Llama-2-70B by default) over allocations of 1, 2, 4, 8,
  24, 72, 240 and 720 boards of one machine, ``spinn/cloud``. The wiring model: an N-board point
  is the most nearly square N-board patch of the cloud's 24 x 30 torus of boards
  (:func:`tvm_spinn.target.allocation.allocation`, ``SpinnArch.allocated_boards``), so every
  point shares the cloud's wiring: a patch has no wrap-around links unless it spans a dimension
  of the torus (the whole cloud). The planner also plans every smaller patch of its ladder
  inside the allocation it is given and keeps the fastest (a plan may leave boards idle), so
  tokens/s per user cannot fall from one point to the next by construction of the search. One
  table: the boards allocated, their patch, the patch the kept plan runs on and the boards it
  uses, the placement, tokens/s per user, the efficiency against the physical bound, the token
  period and the time to first token; whether tokens/s per user ever falls, and the plot
  (``--plot``; by default ``bench/results/scaling.png``, a git-ignored folder). A standalone
  24-board system (``spinn/boards24``: its own 4 x 6 torus, whose wrap-around links make rings
  of four boards) is another machine: ``--part plan --systems boards24``.
* ``prefill`` (run alone): the prompt's own plan (``tvm_spinn.llm.prefill``) for 128 / 2,048 /
  4,096-token prompts on Llama-2-70B and 8,192 on Llama-3.1-70B per system: time to first token,
  its plan-independent bound and efficiency, the chunk size, stages and boards the search chose.

    python bench/llm.py                                   # both parts, the default subset
    python bench/llm.py --part plan --models llama-2-70b --systems board boards24 cloud
    python bench/llm.py --part plan --models llama-2-70b --systems scaling --plot scaling.png
    python bench/llm.py --part plan --models llama-2-70b --systems board boards24 cloud --int8-handover
    python bench/llm.py --part generate --new-tokens 32
    python bench/llm.py --part plan --models llama-2-70b --systems boards24 --dead-boards 5   # healthy and as is
    python bench/llm.py --part prefill --systems board boards24 cloud   # TTFT: 128-8192-token prompts
    python bench/llm.py --part scaling --plot scaling.png   # Llama-2-70B over 1, 2, ... 720 boards

Timings on this shared 2-core machine vary between runs (up to 2x for sub-millisecond steps).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.resources
import math
import os
import time

import numpy as np

SYSTEMS = {"chip": ("spinn", 1 / 48), "board": ("spinn/board", 1), "boards24": ("spinn/boards24", 24),
           "cloud": ("spinn/cloud", 720)}
#: Systems of whole boards registered by the bench (``boardsN``: ``make_system(boards=N)``)
BOARD_COUNTS = (2, 4, 8, 24, 72, 240)
SYSTEMS.update({f"boards{n}": (f"spinn/boards{n}", n) for n in BOARD_COUNTS})
#: ``--systems scaling``: standalone systems of these board counts (each its own torus of boards)
SCALING = ("board", "boards2", "boards4", "boards8", "boards24", "boards72", "boards240", "cloud")
#: ``--part scaling``: allocations of ``spinn/cloud`` of these many boards, whose tokens/s per
#: user must never fall (the planner's ladder of patches, and the whole cloud)
SCALING_BOARDS = (1, 2, 4, 8, 24, 72, 240, 720)


def _small(family: str):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if family == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=128, n_layer=4, n_head=4, vocab_size=512, n_positions=128))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                                   num_key_value_heads=2, intermediate_size=256, vocab_size=512,
                                                   max_position_embeddings=128))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _agreement(out: np.ndarray, ref: np.ndarray, prompt: int) -> tuple[float, int]:
    new, ref_new = out[:, prompt:], ref[:, prompt:]
    differ = np.nonzero((new != ref_new).any(axis=0))[0]
    return float((new == ref_new).mean()), int(differ[0]) if differ.size else -1


def _ort_decode(compiled, call_args: list, threads: int):
    """onnxruntime session of the same decode step (``graphs.Decode``: the model's weights in fp32,
    the KV cache as plain tensors, exported with ``torch.onnx.export``) and its feeds."""
    import io

    import onnxruntime as ort
    import torch

    from tvm_spinn.llm.graphs import Decode

    wrapper = Decode(compiled.model, compiled.spec, compiled.max_seq_len).eval()
    buf = io.BytesIO()
    torch.onnx.export(wrapper, tuple(torch.from_numpy(a) for a in call_args), buf, dynamo=False,
                      input_names=[f"in{i}" for i in range(len(call_args))])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(buf.getvalue(), so, providers=["CPUExecutionProvider"])
    return sess, {i.name: a for i, a in zip(sess.get_inputs(), call_args)}


def _step_times(compiled, model, ids: np.ndarray, repeat: int, threads: int) -> tuple[float, float, float, float]:
    """Median wall time of one decode step: the simulator's VM call, transformers' forward and
    onnxruntime on the exported step (interleaved with the simulator's calls), and the largest
    logit difference between the simulator and onnxruntime."""
    import torch
    import tvm

    b, n = ids.shape
    _, prefill = compiled.prefill_executable(n)
    _, decode = compiled.decode_executable()
    dev = tvm.cpu()
    out = prefill["main"](*(tvm.runtime.tensor(a, dev) for a in compiled._prefill_args(ids)))
    tok = np.argmax(out[0].numpy(), axis=-1).astype(np.int64)[:, None]
    args = compiled._decode_args(tok, n)
    call = [tvm.runtime.tensor(args[0], dev), out[1], out[2], *(tvm.runtime.tensor(a, dev) for a in args[1:])]
    sess, feeds = _ort_decode(compiled, [args[0], out[1].numpy(), out[2].numpy(), *args[1:]], threads)
    diff = float(np.abs(decode["main"](*call)[0].numpy() - sess.run(None, feeds)[0]).max())
    sim, onnx = [], []
    for _ in range(repeat + 1):
        t = time.perf_counter()
        decode["main"](*call)
        sim.append(time.perf_counter() - t)
        t = time.perf_counter()
        sess.run(None, feeds)
        onnx.append(time.perf_counter() - t)
    with torch.no_grad():
        pre = model(torch.from_numpy(ids), use_cache=True)
        ref = []
        for _ in range(repeat + 1):
            t = time.perf_counter()
            model(torch.from_numpy(tok), past_key_values=pre.past_key_values, use_cache=True)
            ref.append(time.perf_counter() - t)
            pre.past_key_values.crop(-1)  # back to the prompt: every step measured at the same length
    return float(np.median(sim[1:])), float(np.median(ref[1:])), float(np.median(onnx[1:])), diff


def part_generate(args) -> None:
    import torch

    from tvm_spinn import llm

    threads = int(os.environ.get("TVM_SPINN_SIM_THREADS", "2"))
    torch.set_num_threads(threads)
    print(f"\n== generate: {args.prompts} prompt(s) of {args.prompt_len} tokens, {args.new_tokens} new tokens, "
          f"target spinn (simulator; decode step wall times median of {args.repeat})")
    head = (f"{'model':<8}{'dtype':<6}{'agree':>7}{'1st diff':>9}{'TTFT sim ms':>13}{'decode sim ms':>15}"
            f"{'step wall ms':>14}{'torch ms':>10}{'ratio':>7}{'ort ms':>8}{'sim/ort':>8}{'ort diff':>10}{'build s':>9}")
    print(head + "\n" + "-" * len(head))
    rng = np.random.default_rng(0)
    for family in args.families:
        model = _small(family)
        prompts = rng.integers(0, 512, (args.prompts, args.prompt_len))
        with torch.no_grad():
            ref = model.generate(torch.from_numpy(prompts), max_new_tokens=args.new_tokens, do_sample=False,
                                 attention_mask=torch.ones(prompts.shape, dtype=torch.long)).numpy()
        for dtype in args.dtypes:
            t = time.perf_counter()
            compiled = llm.compile(model, target="spinn", max_seq_len=args.prompt_len + args.new_tokens,
                                   batch=args.prompts, quantize=True if dtype == "int8" else None)
            out = compiled.generate(prompts, args.new_tokens)
            build = time.perf_counter() - t
            agree, first = _agreement(out, ref, args.prompt_len)
            rep = compiled.report()
            sim, eager, onnx, diff = _step_times(compiled, model, prompts, args.repeat, threads)
            print(f"{family:<8}{dtype:<6}{agree:>7.1%}{first if first >= 0 else '-':>9}{rep.ttft_s * 1e3:>13.3f}"
                  f"{rep.decode_latency_s * 1e3:>15.4f}{sim * 1e3:>14.2f}{eager * 1e3:>10.2f}{sim / eager:>7.2f}"
                  f"{onnx * 1e3:>8.2f}{sim / onnx:>8.2f}{diff:>10.2g}{build:>9.1f}")


def _with_board_systems(fn):
    """``fn`` with the ``boardsN`` systems registered as targets while it runs, and only then."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        import tvm_spinn
        from tvm_spinn.target import registered_system

        with contextlib.ExitStack() as stack:
            for n in BOARD_COUNTS:
                stack.enter_context(registered_system(tvm_spinn.make_system(f"spinn2-{n}-boards", boards=n),
                                                      tag=f"spinn/boards{n}"))
            faults = _faults(args[0]) if args and hasattr(args[0], "dead_boards") else {}
            for system in (args[0].systems if faults else ()):  # each system as it is: ``_as_is``
                arch = tvm_spinn.target.arch_of(SYSTEMS[system][0])
                stack.enter_context(registered_system(arch.replace(name=f"{arch.name}-as-is", **faults),
                                                      tag=_as_is(SYSTEMS[system][0])))
            return fn(*args, **kwargs)

    return run


@_with_board_systems
def part_plan(args) -> list[dict]:
    from tvm_spinn.llm import LLMError, spec_of
    from tvm_spinn.llm.plan import plan

    configs = importlib.resources.files("tvm_spinn.llm") / "configs"
    print(f"\n== plan: batch {args.batch}, seq {args.seq}, {args.handover} hand-overs between boards "
          "(config only: no weights, timing model)")
    head = (f"{'model':<13}{'system':<10}{'dtype':<6}{'ms/token':>10}{'bound ms':>10}{'binding':>14}{'eff.':>8}"
            f"{'tok/s/user':>11}{'tok/s':>10}{'TTFT s':>9}{'J/token':>10}{'own ms':>8}{'own ratio':>10}{'chips':>7}"
            f"{'boards':>7}{'placement':>24}{'weights in':>28}{'plan s':>8}{'KV cache in':>28}")
    print(head + "\n" + "-" * len(head))
    rows = []
    for name in args.models:
        spec = spec_of(str(configs / f"{name}.json"))
        seq = min(args.seq, spec.max_positions)  # GPT-2-XL has 1024 positions
        if seq != args.seq:
            print(f"{name}: seq {seq} (its position table)")
        for system in [x for s in args.systems for x in ((s, s + "*") if _faults(args) else (s,))]:
            target, boards = SYSTEMS[system] if system in SYSTEMS else (_as_is(SYSTEMS[system[:-1]][0], args),
                                                                         SYSTEMS[system[:-1]][1])
            for dtype in args.dtypes:
                try:
                    p = plan(str(configs / f"{name}.json"), target=target, batch=args.batch, seq=seq, dtype=dtype,
                             handover=args.handover, reduce=args.reduce)
                except (LLMError, ValueError) as err:
                    print(f"{name:<13}{system:<10}{dtype:<6}  {err}")
                    continue
                row = dict(model=name, system=system, boards=boards, dtype=dtype, plan=p)
                if args.int8_handover and args.handover != "int8" and boards > 1:
                    row["int8_handover"] = plan(str(configs / f"{name}.json"), target=target, batch=args.batch,
                                                seq=seq, dtype=dtype, handover="int8")
                wires = [w for w in args.compare_reduce if w not in ("none", args.reduce)]
                if wires and boards >= 3 and dtype == "int8":
                    row["narrow_reduce"] = {w: plan(str(configs / f"{name}.json"), target=target, batch=args.batch,
                                                    seq=seq, dtype=dtype, handover=args.handover, reduce=w)
                                            for w in wires}
                rows.append(row)
                print(f"{name:<13}{system:<10}{dtype:<6}{1e3 / p.tokens_per_s_per_user:>10.3f}"
                      f"{p.physical_bound_s * 1e3:>10.4g}{p.physical_bound['binding']:>14}{p.efficiency:>8.4f}"
                      f"{p.tokens_per_s_per_user:>11.3f}{p.tokens_per_s:>10.3f}"
                      f"{p.ttft_s:>9.2f}{p.energy_per_token_j:>10.3g}"
                      f"{1e3 / p.bound_tokens_per_s:>8.1f}{p.bound_ratio:>10.2f}"
                      f"{p.chips_used:>7}{math.ceil(p.chips_used / 48):>7}{_placement(p):>24}"
                      f"{p.plan['weights_in'][:27]:>28}"
                      f"{p.plan_seconds:>8.1f}{p.plan['kv_cache_in'][:27]:>28}")
                if "int8_handover" in row:
                    q = row["int8_handover"]
                    print(f"{'':<13}{'':<10}{'':<6}{1e3 / q.tokens_per_s_per_user:>10.3f}{'':>10}{'':>14}"
                          f"{q.efficiency:>8.4f}{q.tokens_per_s_per_user:>11.3f}  (int8 hand-overs: "
                          f"{_placement(q)}, {math.ceil(q.chips_used / 48)} boards)")
                for w, q in row.get("narrow_reduce", {}).items():
                    print(f"{'':<13}{'':<10}{'':<6}{1e3 / q.tokens_per_s_per_user:>10.3f}{'':>10}{'':>14}"
                          f"{q.efficiency:>8.4f}{q.tokens_per_s_per_user:>11.3f}  ({w} all-reduces "
                          f"across boards: {_placement(q)}, {math.ceil(q.chips_used / 48)} boards, "
                          f"{q.plan.get('board_all_reduces_decode_s', 0.0) * 1e3:.3f} ms of all-reduces a token "
                          f"against {p.plan.get('board_all_reduces_decode_s', 0.0) * 1e3:.3f}; TTFT {q.ttft_s:.2f} s)")
    if _faults(args):
        print(f"*: the system as it is ({', '.join(f'{k} {v}' for k, v in _faults(args).items())}); boards used: "
              + "; ".join(f"{r['model']} {r['system']}: {r['plan'].plan.get('boards', '-')}" for r in rows
                          if r["system"].endswith("*")))
    if rows:
        print("ms/token: the per-user token period; bound ms: the physical bound (binding: its largest part);"
              " eff.: bound / period; own ms, own ratio: the plan's own bound and tokens/s over it (diagnostic)")
        for r in rows:
            b = r["plan"].physical_bound
            parts = ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in b["parts_s"].items())
            print(f"  {r['model']} {r['system']} {r['dtype']}: physical bound parts {parts}; "
                  f"{b['details']['chips_on_path']} chip(s) on {b['details']['boards_on_path']} board(s) "
                  f"on a token's path, "
                  f"{b['details']['read_bytes'] / 1e9:.2f} GB read once (KV cache at {r['plan'].seq} slots)")
    for key in sorted({(r["model"], r["dtype"]) for r in rows}):
        pts = sorted((r["boards"], r["plan"].tokens_per_s_per_user, math.ceil(r["plan"].chips_used / 48),
                      r["plan"].efficiency, r.get("int8_handover")) for r in rows if (r["model"], r["dtype"]) == key
                     and not r["system"].endswith("*"))
        if len(pts) > 1:
            falls = [(a[0], b[0]) for a, b in zip(pts, pts[1:]) if b[1] < a[1]]
            print(f"  {key[0]} {key[1]} tokens/s per user over boards (boards used, efficiency"
                  + (", int8 hand-overs" if args.int8_handover else "") + "): "
                  + ", ".join(f"{b:g}: {t:.2f} ({u}, {e:.3f}" + (f", {h.tokens_per_s_per_user:.2f}" if h else "") + ")"
                              for b, t, u, e, h in pts)
                  + ("; never falls" if not falls else f"; falls from {falls[0][0]:g} to {falls[0][1]:g} boards"))
    for w in sorted({w for r in rows for w in r.get("narrow_reduce", {})}):
        _reduce_accuracy(w)
    _anchors(rows)
    return rows


def _reduce_accuracy(wire: str, boards=(2, 4)) -> None:
    """The accuracy cost of ``wire`` all-reduces across boards, printed below the plans: logits
    of the small random-weight models (:func:`_small`) with every split GEMM's partial sums
    narrowed (:func:`tvm_spinn.llm.accuracy.reduce_rounding`) against float32 on a fixed random
    token sequence (the same tokens in every run)."""
    from tvm_spinn.llm.accuracy import compare, reduce_rounding, torch_logits

    parts = []
    for family in ("llama", "gpt2"):
        model = _small(family)
        model.config._attn_implementation = "eager"
        ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 40))
        ref = torch_logits(model, ids)
        for g in boards:
            with reduce_rounding(model, wire, g):
                a = compare(torch_logits(model, ids), ref, ids)
            parts.append(f"{family} over {g} boards: logit err max {a.max_rel_err:.2e} / mean {a.mean_rel_err:.2e}, "
                         f"top-1 {round(a.top1 * a.positions)}/{a.positions}, perplexity ratio {a.ppl_ratio:.5f}")
    print(f"  {wire} all-reduces' accuracy cost vs fp32 logits (small random-weight models, 2 x 40 fixed "
          f"random tokens; every block's two split GEMMs narrowed): " + "; ".join(parts))


def part_scaling(args) -> list[dict]:
    """One model over the allocations of :data:`SCALING_BOARDS` boards of ``spinn/cloud`` (each
    its most nearly square patch of the cloud's torus of boards,
    :func:`tvm_spinn.target.allocation.allocation`; 720: the whole cloud): one table of the
    boards allocated, the patch, the patch of it the plan runs on and the boards it uses, its
    placement, tokens/s per user, the efficiency against the physical bound and the token period;
    whether tokens/s per user ever falls; the plot (``--plot``, default
    ``bench/results/scaling.png``)."""
    from tvm_spinn.llm import LLMError
    from tvm_spinn.llm.plan import plan
    from tvm_spinn.target import arch_of, registered_system
    from tvm_spinn.target.allocation import allocation, patch_shape
    from tvm_spinn.target.topology import board_grid

    configs = importlib.resources.files("tvm_spinn.llm") / "configs"
    cloud = arch_of(SYSTEMS["cloud"][0])
    rows = []
    for name in args.models:
        for dtype in args.dtypes:
            print(f"\n== scaling: {name} {dtype} on allocations of {cloud.name}, batch {args.batch}, seq {args.seq}, "
                  f"{args.handover} hand-overs (config only: no weights, timing model)")
            head = (f"{'boards':>7}{'patch':>8}{'runs on':>9}{'used':>6}{'placement':>26}{'tok/s/user':>12}"
                    f"{'eff.':>8}{'ms/token':>10}{'bound ms':>10}{'TTFT s':>8}{'plan s':>8}")
            print(head + "\n" + "-" * len(head))
            mine, searches = [], {}  # one memo of patch searches for the sweep: each patch searched once
            for boards in SCALING_BOARDS:
                arch = allocation(cloud, boards)
                start = time.perf_counter()
                try:
                    with registered_system(arch, tag=f"spinn/cloud-{boards}"):
                        p = plan(str(configs / f"{name}.json"), target=f"spinn/cloud-{boards}", batch=args.batch,
                                 seq=args.seq, dtype=dtype, handover=args.handover, patches=True, reduce=args.reduce,
                                 searches=searches)
                except (LLMError, ValueError) as err:
                    print(f"{boards:>7}  {err}")
                    continue
                used = p.plan["boards_used"]
                mine.append(dict(model=name, system=arch.name, boards=boards, dtype=dtype, plan=p, used=used))
                patch = "x".join(map(str, patch_shape(boards, board_grid(cloud.boards))))
                print(f"{boards:>7}{patch:>8}{p.plan['patch'] or '-':>9}{used:>6}{_placement(p):>26}"
                      f"{p.tokens_per_s_per_user:>12.3f}{p.efficiency:>8.4f}{1e3 / p.tokens_per_s_per_user:>10.3f}"
                      f"{p.physical_bound_s * 1e3:>10.4g}{p.ttft_s:>8.3f}{time.perf_counter() - start:>8.1f}")
            falls = [(a["boards"], b["boards"]) for a, b in zip(mine, mine[1:])
                     if b["plan"].tokens_per_s_per_user < a["plan"].tokens_per_s_per_user]
            print("tokens/s per user " + ("never falls" if not falls else
                                          "falls " + ", ".join(f"from {a:g} to {b:g} boards" for a, b in falls))
                  + "; boards: allocated (patch: their rectangle of the cloud's torus of boards; the whole cloud "
                  "keeps its wrap-around links, a smaller patch has none); runs on: the patch whose plan is kept "
                  "(the allocation's own or a smaller one of the ladder inside it); used: the boards the plan runs "
                  "on (the rest idle); eff.: physical bound / token period")
            rows += mine
    return rows


def _faults(args) -> dict:
    """The fault fields ``--dead-*`` / ``--allocated-boards`` give (empty: healthy systems only)."""
    from tvm_spinn.target.faults import parse_ids

    given = {"dead_boards": args.dead_boards, "dead_chips": args.dead_chips, "dead_links": args.dead_links,
             "dead_board_links": args.dead_board_links, "allocated_boards": args.allocated_boards}
    return {k: parse_ids(v, "--" + k.replace("_", "-")) for k, v in given.items() if v}


def _as_is(target: str, args=None) -> str:
    """The tag of ``target`` with the faults of ``--dead-*`` / ``--allocated-boards``: a system of
    its own name, registered while a part runs (:func:`_with_board_systems`)."""
    return f"{target}*"


#: ``--part prefill``: (model, prompt tokens) planned by default
PREFILL_CASES = ("llama-2-70b:128", "llama-2-70b:2048", "llama-2-70b:4096", "llama-3.1-70b:8192")


@_with_board_systems
def part_prefill(args) -> list:
    """The prompt's own plan (``tvm_spinn.llm.prefill``): time to first token per model, prompt and
    system, next to its plan-independent bound (efficiency = bound / TTFT)."""
    from tvm_spinn.llm import LLMError
    from tvm_spinn.llm.prefill import plan_prefill

    configs = importlib.resources.files("tvm_spinn.llm") / "configs"
    print(f"\n== prefill: one prompt, {args.handover} hand-overs between boards (config only: no weights, "
          "timing model)")
    head = (f"{'model':<15}{'system':<10}{'prompt':>7}{'TTFT ms':>11}{'bound ms':>10}{'binding':>15}{'eff.':>8}"
            f"{'chunk':>7}{'chunks':>7}{'stages':>7}{'blocks':>7}{'TP':>4}{'boards':>7}{'waits on':>10}"
            f"{'plan s':>8}")
    print(head + "\n" + "-" * len(head))
    rows, memo = [], {}
    for case in args.prefill:
        name, prompt = case.split(":")
        for system in args.systems:
            target = SYSTEMS[system][0]
            for dtype in args.dtypes:
                start = time.perf_counter()
                try:
                    p = plan_prefill(str(configs / f"{name}.json"), target, prompt=int(prompt), dtype=dtype,
                                     handover=args.handover, memo=memo, reduce=args.reduce)
                except LLMError as err:
                    print(f"{name:<15}{system:<10}{prompt:>7}  {err}")
                    continue
                rows.append(p)
                print(f"{name:<15}{system:<10}{p.prompt:>7}{p.ttft_s * 1e3:>11.1f}{p.bound_s * 1e3:>10.4g}"
                      f"{p.bound['binding']:>15}{p.efficiency:>8.4f}{p.chunk:>7}{p.chunks:>7}{p.stages:>7}"
                      f"{p.blocks_per_stage:>7}{p.tp_boards:>4}{p.boards_used:>7}{p.busiest['kind']:>10}"
                      f"{time.perf_counter() - start:>8.1f}")
                print(f"    {p.breakdown_line()}")
    if rows:
        print("TTFT: the prompt in chunks through board stages (each `blocks` blocks, tensor-parallel over `TP` "
              "boards), the head's first token and the host's I/O; bound: compute at the system's peak, every "
              "weight read once, the least crossings; eff. = bound / TTFT; waits on: what the pipeline's "
              "busiest machine is (a stage's programs or a hand-over between stages)")
    return rows


def _placement(p) -> str:
    """``shared``, ``groups`` or ``pipeline: stages x boards (per block)``."""
    meta = p.plan
    if meta["placement"] == "board_tp":
        return f"tp {meta['tp_boards']} boards x {meta['groups']} grp"
    if meta["placement"] != "pipeline":
        return meta["placement"]
    per = (f"{meta['stages_per_block']}/block" if meta.get("stages_per_block")
           else f"{meta['blocks_per_stage']} blocks/st")
    return f"pipe {meta['stages']} st, {per}"


#: Published decode speeds of spatial accelerators on 70B Llama models (tokens/s per user)
ANCHORS = (("Groq LPU, 576 chips, Llama-2-70B", 300.0, "llama-2-70b"),
           ("Tenstorrent Galaxy (32 Wormhole), Llama-3.3-70B", 72.5, "llama-2-70b"),
           ("Cerebras (wafer SRAM), Llama-3.1-70B at launch", 450.0, "llama-2-70b"),
           ("SambaNova SN40L (16-bit), Llama-3.1-70B", 457.0, "llama-2-70b"))


def _anchors(rows: list[dict]) -> None:
    """Each planned 70B row's tokens/s per user against the published anchors."""
    shown = [r for r in rows if r["model"] == "llama-2-70b"]
    if not shown:
        return
    print("\nagainst published anchors (tokens/s per user; ours / theirs):")
    for name, tps, _ in ANCHORS:
        ratios = ", ".join(f"{r['system']} {r['dtype']}: {r['plan'].tokens_per_s_per_user / tps:.3f}" for r in shown)
        print(f"  {name} ~{tps:g}: {ratios}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["model"], r["dtype"]) for r in rows}):
        pts = sorted((r["boards"], r["plan"].tokens_per_s_per_user, 1 / r["plan"].physical_bound_s)
                     for r in rows if (r["model"], r["dtype"]) == key)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{key[0]} {key[1]}")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], ":", color=line.get_color())
        for r in rows:  # the boards each plan runs on, where the table has them
            if (r["model"], r["dtype"]) == key and "used" in r:
                ax.annotate(f"{r['used']}", (r["boards"], r["plan"].tokens_per_s_per_user), fontsize=6,
                            textcoords="offset points", xytext=(0, 4), ha="center", color=line.get_color())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("boards (48 chips each)")
    ax.set_ylabel("tokens/s per user (dotted: physical bound)")
    if any("used" in r for r in rows):
        ax.set_title("labels: boards the plan uses", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    from tvm_spinn._files import atomic_write

    atomic_write(path, lambda f: fig.savefig(f, format=os.path.splitext(path)[1][1:] or "png", dpi=120))
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("generate", "plan", "prefill", "scaling", "all"), default="all")
    ap.add_argument("--families", nargs="+", default=["gpt2", "llama"], choices=("gpt2", "llama"))
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "int8"], choices=("fp32", "int8"))
    ap.add_argument("--prompts", type=int, default=2, help="batch of prompts generated together")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=None, help="default: llama-2-7b and llama-2-70b "
                    "(--part scaling: llama-2-70b)",
                    choices=("llama-2-7b", "llama-2-13b", "llama-2-70b", "gpt2-xl"))
    ap.add_argument("--systems", nargs="+", default=["chip", "board", "boards24", "cloud"],
                    choices=sorted(SYSTEMS) + ["scaling"], help="'scaling': 1, 2, 4, 8, 24, 72, 240 and 720 boards")
    ap.add_argument("--handover", default="fp32", choices=("fp32", "fp16", "int8"),
                    help="activations handed over between boards (fp32 keeps the model's bits)")
    ap.add_argument("--int8-handover", action="store_true",
                    help="also plan each multi-board row with int8 hand-overs and print it below (accuracy cost: "
                         "bench/llm_accuracy.py)")
    ap.add_argument("--reduce", default="int32", choices=("int32", "fp16", "bf16", "int8"),
                    help="partial sums all-reduced across boards (int32 keeps the model's bits)")
    ap.add_argument("--compare-reduce", nargs="+", default=["fp16", "int8"], choices=("fp16", "bf16", "int8", "none"),
                    help="also plan each int8 row of 3+ boards with these all-reduce wires, each printed below it "
                         "with its accuracy cost vs fp32 (none: skip)")
    ap.add_argument("--plan-dtypes", nargs="+", default=["int8"], choices=("fp32", "int8"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--plot", help="save tokens/s per user against boards here (.png)")
    for flag, what in (("--dead-boards", "board ids, e.g. 5 or 3,7"), ("--dead-chips", "chip ids"),
                       ("--dead-links", "chip:direction pairs"), ("--dead-board-links", "board:edge pairs"),
                       ("--allocated-boards", "board ids, e.g. 0-23")):
        ap.add_argument(flag, default=None, help=f"plan each system also as it is (rows marked *): {what}")
    ap.add_argument("--prefill", nargs="+", default=list(PREFILL_CASES),
                    help="--part prefill: model:prompt-tokens cases (a shipped config's name)")
    args = ap.parse_args()
    args.models = args.models or (["llama-2-70b"] if args.part == "scaling" else ["llama-2-7b", "llama-2-70b"])
    args.systems = [x for s in args.systems for x in (SCALING if s == "scaling" else (s,))]
    if args.part in ("generate", "all"):
        part_generate(args)
    if args.part in ("plan", "all"):
        rows = part_plan(argparse.Namespace(**{**vars(args), "dtypes": args.plan_dtypes}))
        if args.plot and rows:
            plot(rows, args.plot)
    if args.part == "prefill":
        part_prefill(argparse.Namespace(**{**vars(args), "dtypes": args.plan_dtypes}))
    if args.part == "scaling":
        rows = part_scaling(argparse.Namespace(**{**vars(args), "dtypes": args.plan_dtypes}))
        if rows:
            path = args.plot
            if path is None:  # the default lies in bench/results/ (git-ignored)
                path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "scaling.png")
                os.makedirs(os.path.dirname(path), exist_ok=True)
            plot(rows, path)


if __name__ == "__main__":
    main()
