"""tvm_spinn.llm.accuracy: the hand-over roundings against numpy, the hooks against the model's own
hidden states, the metrics against torch's cross entropy, and the compiled logits against transformers."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from tvm_spinn import llm  # noqa: E402
from tvm_spinn.llm import LLMError  # noqa: E402
from tvm_spinn.llm import accuracy as acc  # noqa: E402


def _gpt2():
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=256, n_positions=64)
    model = tf.GPT2LMHeadModel(cfg)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(scope="module")
def gpt2():
    return _gpt2()


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(3).integers(0, 256, (2, 12))


def test_fp16_rounding_is_numpys_float16_round_trip():
    x = np.random.default_rng(0).standard_normal((3, 5, 7)).astype(np.float32) * 40
    got = acc.round_fp16(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float32))
    assert np.abs(got - x).max() > 0


def test_int8_rounding_is_per_tensor_symmetric_within_half_a_step():
    x = np.random.default_rng(1).standard_normal((4, 9)).astype(np.float32) * 3
    x[1, 2] = -15.0  # the extreme sets the scale
    got = acc.round_int8(torch.from_numpy(x)).numpy()
    scale = np.float32(15.0) / np.float32(127)
    q = np.clip(np.round(x / scale), -127, 127)
    np.testing.assert_allclose(got, q * scale, rtol=0, atol=1e-6)
    assert np.abs(got - x).max() <= scale / 2 * (1 + 1e-5)
    assert len(np.unique(np.round(got / scale))) <= 255 and got[1, 2] == pytest.approx(-15.0)
    zeros = torch.zeros(3)
    assert torch.equal(acc.round_int8(zeros), zeros)


def _block_inputs(model, ids, handover, boundaries=None):
    """The hidden state each block receives, seen by pre-hooks of our own (not transformers' records)."""
    seen = {}

    def observe(i):
        def pre(_module, args, kwargs):
            seen[i] = (args[0] if args else kwargs["hidden_states"]).clone()
        return pre

    blocks = acc.blocks_of(model)
    with acc.handover_rounding(model, handover, boundaries):
        handles = [b.register_forward_pre_hook(observe(i), with_kwargs=True) for i, b in enumerate(blocks)]
        try:
            acc.torch_logits(model, ids)
        finally:
            for h in handles:
                h.remove()
    return [seen[i] for i in range(len(blocks))]


def test_hooks_round_every_handed_over_hidden_state(gpt2, ids):
    plain = _block_inputs(gpt2, ids, "fp32")
    assert not torch.equal(plain[1], plain[1].half().float())
    # every block after the first receives a handed-over state: float16-exact
    for x in _block_inputs(gpt2, ids, "fp16")[1:]:
        assert torch.equal(x, x.half().float())
    assert all(torch.equal(x, y) for x, y in zip(_block_inputs(gpt2, ids, "fp32"), plain))  # hooks removed
    got = _block_inputs(gpt2, ids, "int8", boundaries=[1])
    assert torch.equal(got[1], plain[1])  # block 0's output not handed over
    # block 1 received the same input, so it handed over its fp32 output plain[2], rounded (numpy)
    x = plain[2].numpy()
    step = np.abs(x).max() / np.float32(127)
    np.testing.assert_allclose(got[2].numpy(), np.clip(np.round(x / step), -127, 127) * step, rtol=0, atol=1e-5)


def test_int8_handover_costs_more_than_fp16_which_costs_something(gpt2, ids):
    ref = acc.torch_logits(gpt2, ids)
    errs = {}
    for h in acc.HANDOVERS:
        with acc.handover_rounding(gpt2, h):
            errs[h] = acc.compare(acc.torch_logits(gpt2, ids), ref, ids)
    assert errs["fp32"].max_rel_err == 0 and errs["fp32"].top1 == 1 and errs["fp32"].ppl_ratio == 1
    assert errs["int8"].max_rel_err > errs["fp16"].max_rel_err > 0
    assert errs["int8"].mean_rel_err > errs["fp16"].mean_rel_err > 0


def test_metrics_match_an_independent_computation():
    rng = np.random.default_rng(4)
    ref = rng.standard_normal((2, 6, 10)).astype(np.float32)
    other = ref + rng.standard_normal(ref.shape).astype(np.float32) * 0.5
    ids = rng.integers(0, 10, (2, 6))
    got = acc.compare(other, ref, ids, top1_from=2)

    def ppl(z):
        return torch.exp(torch.nn.functional.cross_entropy(torch.from_numpy(z[:, :-1]).double().reshape(-1, 10),
                                                           torch.from_numpy(ids[:, 1:]).reshape(-1))).item()

    assert got.ppl_ratio == pytest.approx(ppl(other) / ppl(ref), rel=1e-9)
    d = np.abs(other.astype(np.float64) - ref)
    assert got.max_rel_err == pytest.approx(d.max() / np.abs(ref).max())
    assert got.mean_rel_err == pytest.approx(d.mean() / np.abs(ref).mean())
    assert got.top1 == pytest.approx(np.mean(other[:, 2:].argmax(-1) == ref[:, 2:].argmax(-1)))
    assert got.positions == 8


def test_compiled_logits_are_transformers_logits_at_every_position(gpt2, ids):
    short = ids[:1, :5]
    compiled = llm.compile(gpt2, target="spinn", max_seq_len=5, batch=1)
    got = acc.compiled_logits(compiled, short, prefill=3)
    assert got.shape == (1, 3, 256)
    np.testing.assert_allclose(got, acc.torch_logits(gpt2, short)[:, 2:], rtol=0, atol=1e-4)
    with pytest.raises(LLMError, match="prefill"):
        acc.compiled_logits(compiled, ids, prefill=1)


def test_bad_input_is_refused(gpt2):
    with pytest.raises(LLMError, match="handover"):
        with acc.handover_rounding(gpt2, "bf16"):
            pass
    with pytest.raises(LLMError, match="boundaries"):
        with acc.handover_rounding(gpt2, "fp16", boundaries=[3]):
            pass
    with pytest.raises(LLMError, match="do not agree"):
        acc.compare(np.zeros((1, 3, 4)), np.zeros((1, 3, 5)), np.zeros((1, 3), dtype=np.int64))
    with pytest.raises(LLMError, match="decoder blocks"):
        acc.blocks_of(torch.nn.Linear(2, 2))
