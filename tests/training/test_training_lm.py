"""Small GPT-2 and Llama language models (``transformers`` configs, random weights: 2 layers,
hidden 64, vocabulary 256) trained with AdamW on the PEs, the loss included: loss curve and
parameters against ``torch.optim.AdamW``, and bitwise-identical parameters across the parallel
plans that keep the reduction order (one chip, a board, 2 and 4 data-parallel replicas at one
micro-batch count; chip vs board of the fused step).

The default run takes a few steps of a smaller GPT-2; the 50-step runs are ``slow``."""

from __future__ import annotations


import numpy as np
import pytest
import torch

import tvm_spinn
from training_models import LM, torch_adamw

transformers = pytest.importorskip("transformers")

ADAMW = ("adamw", {"lr": 1e-3, "weight_decay": 0.01})
# Tolerance vs PyTorch: float32 formulas summed in other orders (GEMMs of K <= 256, the
# vocabulary; exp/log models within 1 ulp). AdamW normalizes each update by sqrt(v): a gradient
# of relative error e moves a parameter by ~lr * e per step, so after 50 steps at lr 1e-3 the
# parameters stay within ~50 * 1e-3 * 1e-2 = 5e-4 even for e ~ 1e-2 on tiny gradients (measured far less).
RTOL, ATOL_PARAM, ATOL_LOSS = 1e-3, 5e-4, 1e-4


def gpt2(layers: int = 2, hidden: int = 64, vocab: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=hidden, n_layer=layers, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return LM(transformers.GPT2LMHeadModel(cfg))


def llama(layers: int = 2, hidden: int = 64, vocab: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                                   max_position_embeddings=16, use_cache=False, bos_token_id=0, eos_token_id=0,
                                   attn_implementation="eager")
    return LM(transformers.LlamaForCausalLM(cfg))


def tokens(vocab: int = 256, batch: int = 4, seq: int = 8):
    """One batch of token ids and its next-token labels (the sequence shifted by one)."""
    ids = np.random.default_rng(0).integers(0, vocab, (batch, seq)).astype(np.int64)
    return ids, np.roll(ids, -1, axis=1).reshape(-1)


def _run(trainer, batches):
    return [trainer.step(x, y) for x, y in batches], trainer.parameters()


def _assert_close(run, ref):
    np.testing.assert_allclose(run[0], ref[0], rtol=RTOL, atol=ATOL_LOSS)
    assert sorted(run[1]) == sorted(ref[1])
    for name, value in ref[1].items():
        np.testing.assert_allclose(run[1][name], value, rtol=RTOL, atol=ATOL_PARAM, err_msg=name)


def _assert_same_bits(run, ref, what):
    assert run[0] == ref[0], what
    for name, value in ref[1].items():
        assert run[1][name].tobytes() == value.tobytes(), (what, name)


def _plans(model, ids, steps: int, microbatches: int = 4) -> dict:
    """Parameters after ``steps`` AdamW steps under data-parallel plans of one micro-batch count:
    1 replica on a chip, 2 and 4 replicas on a board (every replica a chip of the board)."""
    batches = [tokens(int(model.lm.config.vocab_size), ids.shape[0], ids.shape[1])] * steps
    dp = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn/board",
                                    data_parallel={"replicas": 1, "microbatches": microbatches})
    runs = {}
    for replicas in (1, 2, 4):
        runs[f"board dp{replicas}"] = _run(dp.with_replicas(replicas), batches)
    return runs, batches


def test_small_gpt2_adamw_plans_bitwise_and_close_to_pytorch():
    """The fast variant: a 1-layer GPT-2 (hidden 32, vocabulary 64), 3 AdamW steps in 4
    micro-batches on 1, 2 and 4 replicas: the same bits, and PyTorch's loss and parameters."""
    model = gpt2(layers=1, hidden=32, vocab=64)
    ids, _ = tokens(64)
    runs, batches = _plans(model, ids, 3)
    ref = torch_adamw(model, batches, ADAMW[1])
    _assert_close(runs["board dp1"], ref)
    for name in ("board dp2", "board dp4"):
        _assert_same_bits(runs[name], runs["board dp1"], name)


@pytest.mark.slow
@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_lm_50_adamw_steps_match_pytorch_and_four_plans_agree_bitwise(make):
    """50 AdamW steps of a 2-layer, hidden-64, vocabulary-256 LM on the PEs (the loss included):

    - the fused step on a chip vs PyTorch (loss curve and parameters within float32 error),
      and on a board (every program mapped over 48 chips) with the chip's bits;
    - 4 micro-batches on 1, 2 and 4 replicas (a chip, then a board's chips): the same bits as
      each other, and PyTorch's values (a micro-batch count fixes the order of the batch's
      gradient sum, so these bits differ from the fused step's)."""
    model = make()
    ids, labels = tokens()
    batches = [(ids, labels)] * 50
    chip = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn")
    board = chip.build_for("spinn/board")
    ref = torch_adamw(model, batches, ADAMW[1])
    assert ref[0][-1] < 0.5 * ref[0][0]
    got = _run(chip, batches)
    _assert_close(got, ref)
    _assert_same_bits(_run(board, batches), got, "board")
    dp = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn",
                                    data_parallel={"replicas": 1, "microbatches": 4})
    chip_dp = _run(dp, batches)
    _assert_close(chip_dp, ref)
    runs, _ = _plans(model, ids, 50)
    for name, run in runs.items():
        _assert_same_bits(run, chip_dp, name)
