"""Accuracy cost of int8 weights, of fp16 / int8 hand-overs and of fp16 / bf16 / int8 all-reduces on small GPT-2 and Llama models.

Each row is measured against the same model in float32 (transformers, PyTorch) on the same
tokens (:mod:`tvm_spinn.llm.accuracy`):

* ``int8 weights``: ``tvm_spinn.llm.compile(quantize=True)`` (int8 weight GEMMs: int8 weights
  and int8 activation operands, calibrated on seeded random prompts; attention in float32, as the
  KV cache) run on the simulator, every
  scored position scored by the compiled prefill / decode steps (teacher forcing); ``fp32
  compiled`` is the same path in float32, the measurement's floor.
* ``hand-over fp16`` / ``hand-over int8``: the float32 model with the hidden state rounded at
  every block boundary (forward hooks), as a pipeline with one stage per block hands it over:
  fp16 round to nearest; int8 per-tensor symmetric, ``scale = max|x| / 127`` of the handed-over
  tensor. That is the most hand-overs any split makes; fewer stages round less often.
* ``all-reduce fp16`` / ``bf16`` / ``int8``, over ``T`` boards: the float32 model with every
  block's attention output projection and MLP down projection summed over ``T`` boards' shares
  of their K dimension as ``plan(..., reduce=...)`` times it: each board's partial sum narrowed
  to the wire type (int8: per chunk of 64 elements with an fp32 scale), added in fp32 in board
  order, the total narrowed again (:func:`tvm_spinn.llm.accuracy.reduce_rounding`,
  :mod:`tvm_spinn.llm.wire`). ``int32`` (the default) is exact.

Columns: logit error ``max|d| / max|ref|`` and ``mean|d| / mean|ref|`` on a fixed random token
sequence; top-1 agreement at the positions that predict float32's greedy continuation of a random
prompt (teacher forcing: each position sees float32's tokens, so one miss does not carry over;
random weights' greedy continuations repeat a few tokens) and at the scored positions of the
random sequence;
perplexity ratio (variant / float32) on the random sequence. The weights are seeded random (no
downloads), so absolute perplexity means nothing (about the vocabulary size); the logit error and
top-1 agreement are the headline, the ratio only a check that the likelihoods barely move.

    python bench/llm_accuracy.py
    python bench/llm_accuracy.py --families llama --new-tokens 32
"""

from __future__ import annotations

import argparse

import numpy as np


def small_model(family: str):
    """The small seeded random-weight models of ``bench/llm.py`` (4 blocks, 128 wide, vocab 512),
    with the attention the compiled steps spell out."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("bench_llm", os.path.join(os.path.dirname(__file__), "llm.py"))
    bench_llm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_llm)
    model = bench_llm._small(family)
    model.config._attn_implementation = "eager"
    return model


def greedy(model, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    """Float32 greedy continuation (full forward each step: no cache, so hooks see every position)."""
    from tvm_spinn.llm.accuracy import torch_logits

    ids = prompt
    for _ in range(new_tokens):
        ids = np.concatenate([ids, torch_logits(model, ids)[:, -1].argmax(-1)[:, None]], axis=1)
    return ids


def margin(logits: np.ndarray) -> float:
    """Median gap between the top two logits, in units of the logits' standard deviation."""
    top2 = np.sort(logits, axis=-1)[..., -2:]
    return float(np.median(top2[..., 1] - top2[..., 0]) / logits.std())


def measure(family: str, batch: int, seq_len: int, prompt_len: int, new_tokens: int, seed: int,
            reduce_boards=(2, 4)) -> tuple:
    """``(rows, margin)`` for one family: a row per configuration (name, logit errors, top-1
    agreements, perplexity ratio), and float32's top-1 margin on the scored positions."""
    from tvm_spinn import llm
    from tvm_spinn.llm.accuracy import compare, compiled_logits, handover_rounding, reduce_rounding, torch_logits

    model = small_model(family)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)
    text = rng.integers(0, vocab, (batch, seq_len))
    greedy_ids = greedy(model, rng.integers(0, vocab, (batch, prompt_len)), new_tokens)
    # the positions scored: from the last prompt token on (the compiled steps' prefill covers the rest)
    lo = prompt_len - 1
    ref_text, ref_greedy = torch_logits(model, text), torch_logits(model, greedy_ids)

    def row(name, text_logits, greedy_logits):
        acc = compare(text_logits, ref_text[:, lo:], text[:, lo:])
        top = compare(greedy_logits[:, :new_tokens], ref_greedy[:, lo:lo + new_tokens],
                      greedy_ids[:, lo:lo + new_tokens])
        return name, acc.max_rel_err, acc.mean_rel_err, top.top1, top.positions, acc.top1, acc.positions, acc.ppl_ratio

    rows = []
    for name, quantize in (("fp32 compiled (simulator)", None), ("int8 weights (simulator)", True)):
        compiled = llm.compile(model, target="spinn", max_seq_len=max(seq_len, prompt_len + new_tokens),
                               batch=batch, quantize=quantize)
        rows.append(row(name, compiled_logits(compiled, text, prompt_len),
                        compiled_logits(compiled, greedy_ids, prompt_len)))
    for handover in ("fp16", "int8"):
        with handover_rounding(model, handover):
            rows.append(row(f"hand-over {handover}, every block", torch_logits(model, text)[:, lo:],
                            torch_logits(model, greedy_ids)[:, lo:]))
    for reduce in ("fp16", "bf16", "int8"):
        for boards in reduce_boards:
            with reduce_rounding(model, reduce, boards):
                rows.append(row(f"all-reduce {reduce}, {boards} boards", torch_logits(model, text)[:, lo:],
                                torch_logits(model, greedy_ids)[:, lo:]))
    return rows, margin(ref_text[:, lo:])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=40, help="tokens of the random sequence scored")
    ap.add_argument("--prompt-len", type=int, default=8, help="random prompt before the greedy tokens")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy steps whose top-1 is compared")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reduce-boards", type=int, nargs="+", default=[2, 4],
                    help="boards a block's all-reduce spans (each must divide the 4 heads)")
    a = ap.parse_args(argv)
    print(f"vs float32 logits; batch {a.batch}, random sequence of {a.seq_len} tokens (positions "
          f"{a.prompt_len - 1}..{a.seq_len - 1} scored), top-1 over {a.new_tokens} greedy steps after a "
          f"{a.prompt_len}-token prompt; random weights: perplexity ratio only, not absolute")
    print("| model | configuration | logit err max / mean (rel.) | top-1, greedy steps | top-1, random text "
          "| perplexity ratio |")
    print("|---|---|---|---|---|---|")
    margins = {}
    for family in a.families:
        rows, margins[family] = measure(family, a.batch, a.seq_len, a.prompt_len, a.new_tokens, a.seed,
                                             a.reduce_boards)
        for name, mx, mean, top1, n, top1_text, n_text, ppl in rows:
            print(f"| {family} | {name} | {mx:.2e} / {mean:.2e} | {round(top1 * n)}/{n} | "
                  f"{round(top1_text * n_text)}/{n_text} | {ppl:.5f} |", flush=True)
    # how far apart float32's two best tokens are: a small margin lets a small error flip the top-1
    print("float32's median top-1 margin (best - second logit, in logit standard deviations): "
          + ", ".join(f"{f} {m:.2f}" for f, m in margins.items()))


if __name__ == "__main__":
    main()
