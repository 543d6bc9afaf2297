"""tvm_spinn.llm: greedy generation with a KV cache on the simulator, checked token by token
against transformers' own ``generate(do_sample=False)`` on the same (seeded random) weights."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import tvm_spinn  # noqa: E402
from tvm_spinn import llm  # noqa: E402

NEW_TOKENS = 32


def _gpt2(**kw):
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, **kw)
    return _no_eos(tf.GPT2LMHeadModel(cfg))


def _llama(**kw):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256, max_position_embeddings=64, **kw)
    return _no_eos(tf.LlamaForCausalLM(cfg))


def _no_eos(model):
    # our generate always produces max_new_tokens; transformers would stop at an EOS token
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _reference(model, ids, new_tokens=NEW_TOKENS):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                              attention_mask=torch.ones_like(ids)).numpy()


@pytest.fixture(scope="module")
def gpt2():
    model = _gpt2()
    return model, llm.compile(model, target="spinn", max_seq_len=48, batch=2)


@pytest.fixture(scope="module")
def llama():
    model = _llama()
    return model, llm.compile(model, target="spinn", max_seq_len=48, batch=2)


def test_gpt2_tokens_match_transformers(gpt2):
    model, compiled = gpt2
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (2, 7)))
    out = compiled.generate(ids, NEW_TOKENS)  # torch in, torch out, like transformers
    assert isinstance(out, torch.Tensor) and out.shape == (2, 7 + NEW_TOKENS)
    np.testing.assert_array_equal(out.numpy(), _reference(model, ids))


def test_llama_gqa_tokens_match_transformers(llama):
    model, compiled = llama
    assert compiled.spec.kv_heads < compiled.spec.heads  # grouped-query attention exercised
    ids = np.random.default_rng(2).integers(0, 256, (2, 5))
    out = compiled.generate(ids, NEW_TOKENS)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, _reference(model, torch.from_numpy(ids)))


def test_decode_runs_on_the_pes_and_report_is_the_timing_model(gpt2):
    _, compiled = gpt2
    compiled.generate(np.zeros((2, 7), dtype=np.int64), 2)
    rep = compiled.report()
    dec = tvm_spinn.report(compiled.decode_executable()[0])
    pre = tvm_spinn.report(compiled.prefill_executable(7)[0])
    # the attention and projections are offloaded, not left to the host
    assert dec.offloaded_ops.get("spinn.matmul", 0) >= 2 * 2 and dec.offloaded_ops.get("spinn.softmax", 0) == 2
    assert rep.ttft_s == pre.latency_s and rep.decode_latency_s == dec.latency_s
    assert rep.tokens_per_s_per_user == pytest.approx(1 / dec.latency_s)
    assert rep.tokens_per_s == pytest.approx(2 / dec.latency_s)
    assert rep.energy_per_token_j == pytest.approx(dec.energy_j / 2)
    assert "tokens/s per user" in str(rep)


def test_bad_input_names_the_field(gpt2):
    _, compiled = gpt2
    with pytest.raises(llm.LLMError, match="batch=2"):
        compiled.generate(np.zeros((3, 4), dtype=np.int64), 2)
    with pytest.raises(llm.LLMError, match="max_seq_len=48"):
        compiled.generate(np.zeros((2, 40), dtype=np.int64), 10)
    with pytest.raises(llm.LLMError, match=r"shape \(batch, n\)"):
        compiled.generate(np.zeros(4, dtype=np.int64), 2)
    with pytest.raises(llm.LLMError, match="vocab_size"):
        compiled.generate(np.full((2, 3), 256), 2)
    with pytest.raises(llm.LLMError, match="max_new_tokens"):
        compiled.generate(np.zeros((2, 3), dtype=np.int64), 0)
    with pytest.raises(llm.LLMError, match="max_seq_len=100 is longer than the model's position table"):
        llm.compile(_gpt2(), max_seq_len=100)
    with pytest.raises(llm.LLMError, match="batch must be an integer >= 1"):
        llm.compile(_gpt2(), batch=0)


def test_unknown_model_type_names_the_field():
    with pytest.raises(llm.LLMError, match="'model_type' is 'bert'"):
        llm.compile(tf.BertForMaskedLM(tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                     intermediate_size=64, vocab_size=64)))
    with pytest.raises(llm.LLMError, match="'num_key_value_heads' \\(3\\) does not divide"):
        llm.spec_of({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3,
                     "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 8, "max_position_embeddings": 8})
    with pytest.raises(llm.LLMError, match="'n_layer' is missing"):
        llm.spec_of({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "vocab_size": 8, "n_positions": 8})


def test_spec_counts_the_parameters_of_the_model():
    for model in (_gpt2(), _llama(), _llama(tie_word_embeddings=True)):
        unique = {p.data_ptr(): p.numel() for p in model.parameters()}
        assert llm.spec_of(model).params == sum(unique.values())


def _use_cache_model():
    torch.manual_seed(0)
    model = tf.GPT2Model(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16)).eval()
    assert model.config.use_cache  # the transformers default, which exported a DynamicCache
    return model, torch.randint(0, 64, (1, 4))


@pytest.mark.slow
def test_from_pytorch_use_cache_model_matches_torch():
    import tvm
    from tvm import relax

    model, x = _use_cache_model()
    vm = relax.VirtualMachine(relax.build(tvm_spinn.frontend.from_pytorch(model, (x,)), target="llvm"), tvm.cpu())
    with torch.no_grad():
        ref = model(x).last_hidden_state.numpy()
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x.numpy())).numpy(), ref, rtol=1e-5, atol=1e-5)


def test_from_pytorch_accepts_use_cache_models_and_names_unknown_outputs():
    model, x = _use_cache_model()
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    assert model.config.use_cache  # restored
    # the hidden state alone comes out (the cache is dropped, not imported)
    assert [int(d) for d in mod["main"].ret_ty.shape] == [1, 4, 32]

    from transformers.cache_utils import DynamicCache

    class CacheOut(torch.nn.Module):
        def forward(self, x):
            return x + 1, DynamicCache()

    from tvm_spinn.frontend.pytorch import PyTorchImportError

    with pytest.raises(PyTorchImportError, match="DynamicCache"):
        tvm_spinn.frontend.from_pytorch(CacheOut(), (x.float(),))


def test_llama_rmsnorms_run_fused(llama):
    # each block's two RMSNorms and the final one are one spinn.rms_norm each (blocked sum of
    # squares), not a sequential spinn.mean with point-wise layers around it
    _, compiled = llama
    ops = tvm_spinn.report(compiled.decode_executable()[0]).offloaded_ops
    assert ops.get("spinn.rms_norm", 0) == 2 * 2 + 1 and "spinn.mean" not in ops, ops
