"""Transformer language models from ``transformers`` configs (random weights) trained by
tvm_spinn.training against PyTorch: GPT-2 with tied embeddings and a Llama (RMSNorm's rsqrt,
rotary embedding, SiLU, a causal mask built from arange and bitwise ops), plus the small models
that isolate each piece (a tied weight, a split's gradient on the PEs, rsqrt and the mask ops)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tvm_spinn
from training_models import LM, torch_reference

SGD = ("sgd", {"lr": 0.1, "momentum": 0.9})
ADAM = ("adam", {"lr": 0.01})

# Tolerance vs PyTorch: the same float32 formulas summed in other orders. The deepest reduction is
# a GEMM of K = 100 (the vocabulary, in the embedding's and the LM head's gradients) or 16 tokens:
# ~K * u = 100 * 6e-8 = 6e-6 relative per step; momentum's gain (10) and 50 steps bound it by
# ~3e-3 in the worst case, typically far less (errors are random; measured ~1e-7 after 5 steps).
RTOL, ATOL_PARAM, ATOL_LOSS = 1e-3, 1e-4, 1e-5


def _compare(trainer, model, batches, optimizer):
    """Loss curve and parameters of ``trainer`` after ``batches`` vs PyTorch's."""
    losses = [trainer.step(x, y) for x, y in batches]
    ref_losses, ref_params = torch_reference(model, batches, "cross_entropy", optimizer)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL_LOSS)
    got = trainer.parameters()
    assert sorted(got) == sorted(ref_params)
    for name, value in ref_params.items():
        np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=ATOL_PARAM, err_msg=name)
    return losses, ref_losses


# -- small models, one piece each ------------------------------------------------------------------

class _MaskedRMSNet(torch.nn.Module):
    """Causal self-attention scores masked by ``arange`` comparisons joined with ``&``
    (bitwise_and of booleans, as transformers builds its mask) and an RMSNorm (``rsqrt``)."""

    def __init__(self, dim: int = 8, classes: int = 10):
        super().__init__()
        torch.manual_seed(5)
        self.proj = torch.nn.Linear(dim, dim)
        self.scale = torch.nn.Parameter(1.0 + 0.1 * torch.randn(dim))
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x):
        h = self.proj(x)
        pos = torch.arange(x.shape[1])
        mask = (pos[:, None] >= pos[None, :]) & (pos[None, :] >= 0)
        att = torch.softmax(torch.where(mask, h @ h.transpose(-1, -2), torch.finfo(h.dtype).min), dim=-1)
        h = att @ h
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale
        return self.head(h.mean(dim=1))


def test_rsqrt_and_mask_ops_gradients_match_pytorch():
    """rsqrt's gradient (-0.5 dy y^3) and the mask's integer/boolean ops (arange, bitwise_and:
    no gradient flows through them) on llvm: 5 steps vs PyTorch."""
    model = _MaskedRMSNet()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 6, 8)).astype(np.float32)
    y = rng.integers(0, 10, 2).astype(np.int64)
    batches = [(x, y)] * 5
    trainer = tvm_spinn.training.compile(model, torch.from_numpy(x), optimizer=SGD, target="llvm")
    losses, _ = _compare(trainer, model, batches, SGD)
    assert losses[-1] < 0.9 * losses[0]



class _SplitNet(torch.nn.Module):
    """A fused projection split in three (GPT-2's QKV): the split's gradient is a concat of a
    tuple bound on its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x):
        q, k, v = self.qkv(x).split(16, dim=-1)
        return self.head(q * k + v)


def test_split_gradient_concat_runs_on_the_pes():
    """The split's gradient, concat((dq, dk, dv)), offloads with the tensors as its operands
    (no tuple crosses a region), and 5 steps on spinn match PyTorch."""
    from training_models import classification_data

    model = _SplitNet()
    x, y = classification_data(seed=4)
    trainer = tvm_spinn.training.compile(model, torch.from_numpy(x), optimizer=SGD, target="spinn")
    summary = tvm_spinn.summarize_partition(tvm_spinn.partition_for_spinn(trainer.module))
    assert summary.offloaded_ops["spinn.concat"] == 1 and "relax.concat" not in summary.fallback_ops
    _compare(trainer, model, [(x, y)] * 5, SGD)



class _TiedNet(torch.nn.Module):
    """An embedding and an output layer sharing one weight (a tied LM head)."""

    def __init__(self, vocab: int = 20, dim: int = 8):
        super().__init__()
        torch.manual_seed(7)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.out = torch.nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.embed(ids).mean(dim=1))))


def test_tied_weight_is_one_parameter_with_both_gradients():
    """One tensor under two module paths: one trainable parameter (PyTorch's first name), its
    gradient the sum of both uses; 5 steps match PyTorch."""
    model = _TiedNet()
    rng = np.random.default_rng(8)
    ids = rng.integers(0, 20, (4, 5)).astype(np.int64)
    y = rng.integers(0, 20, 4).astype(np.int64)
    trainer = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=SGD, target="llvm")
    assert trainer._graph.param_names == ("embed.weight", "mix.weight", "mix.bias")
    _compare(trainer, model, [(ids, y)] * 5, SGD)


# -- transformers language models -------------------------------------------------------------------

def _tokens(vocab: int = 100, batch: int = 2, seq: int = 8):
    """One batch of token ids and its next-token labels (the sequence shifted by one)."""
    ids = np.random.default_rng(0).integers(0, vocab, (batch, seq)).astype(np.int64)
    return ids, np.roll(ids, -1, axis=1).reshape(-1)


def tiny_llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                   use_cache=False, attn_implementation="eager")
    return LM(transformers.LlamaForCausalLM(cfg))


def tiny_gpt2(tied: bool = True) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                  tie_word_embeddings=tied, attn_implementation="eager")
    return LM(transformers.GPT2LMHeadModel(cfg))


@pytest.mark.slow
def test_gpt2_untied_few_steps_match_pytorch():
    """GPT-2 (fused QKV split, GELU-tanh, LayerNorm), separate LM head, 5 SGD steps on the PEs."""
    model = tiny_gpt2(tied=False)
    ids, labels = _tokens()
    trainer = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=SGD, target="spinn")
    losses, _ = _compare(trainer, model, [(ids, labels)] * 5, SGD)
    assert losses[-1] < 0.9 * losses[0]


@pytest.mark.slow
def test_gpt2_tied_few_steps_match_pytorch():
    """GPT-2 with its LM head tied to the token embedding (transformers' default), 5 Adam steps
    on the PEs."""
    model = tiny_gpt2(tied=True)
    ids, labels = _tokens()
    trainer = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAM, target="spinn")
    assert "lm.lm_head.weight" not in trainer.parameters()
    losses, _ = _compare(trainer, model, [(ids, labels)] * 5, ADAM)
    assert losses[-1] < 0.9 * losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_lm_50_steps_match_pytorch_llvm_and_board_bitwise(make):
    """50 SGD-momentum steps: spinn and llvm builds of the same step vs PyTorch (loss curve and
    parameters), and spinn/board gives the chip's bits."""
    model = make()
    ids, labels = _tokens()
    batches = [(ids, labels)] * 50
    chip = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=SGD, target="spinn")
    others = {t: chip.build_for(t) for t in ("llvm", "spinn/board")}  # before any step: same start
    losses, ref_losses = _compare(chip, model, batches, SGD)
    assert ref_losses[-1] < 0.1 * ref_losses[0]
    _compare(others["llvm"], model, batches, SGD)
    board = others["spinn/board"]
    assert [board.step(x, y) for x, y in batches] == losses
    for name, value in chip.parameters().items():
        np.testing.assert_array_equal(board.parameters()[name].view(np.uint32), value.view(np.uint32), err_msg=name)


@pytest.mark.slow
def test_llama_few_steps_match_pytorch():
    """A 2-layer Llama (RMSNorm, rotary embedding, SiLU MLP, causal mask), 5 Adam steps on the PEs."""
    model = tiny_llama()
    ids, labels = _tokens()
    trainer = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAM, target="spinn")
    losses, _ = _compare(trainer, model, [(ids, labels)] * 5, ADAM)
    assert losses[-1] < 0.9 * losses[0]
