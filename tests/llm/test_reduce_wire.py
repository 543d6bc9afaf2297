"""The all-reduce wire type across boards (``tvm_spinn.llm.plan(..., reduce=...)``): the
narrowed sums' roundings against a numpy hand computation, the hooks on the split GEMMs of
small Llama and GPT-2 models, bad values refused, and (slow) the plan's all-reduces timed
at the wire's bytes against the cost functions called directly (int32 along the trees, the
narrow wires on their fixed schedule), int8 between a free all-reduce and fp16."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import tvm_spinn  # noqa: E402
from tvm_spinn.llm import LLMError  # noqa: E402
from tvm_spinn.llm import accuracy as acc  # noqa: E402
from tvm_spinn.llm.plan import REDUCE_BYTES, plan  # noqa: E402


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even) -> float32, on the bits (finite values)."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def _int8_chunks(x: np.ndarray, chunk: int = 64) -> np.ndarray:
    """numpy: each run of ``chunk`` elements of the last axis (the last run the rest) as int8
    with an fp32 scale ``max|x| / 127``, read back; a chunk of zeros stays zeros."""
    x = np.asarray(x, dtype=np.float32)
    out = np.empty_like(x)
    for lo in range(0, x.shape[-1], chunk):
        part = x[..., lo:lo + chunk]
        s = (np.abs(part).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
        with np.errstate(invalid="ignore", divide="ignore"):
            q = np.clip(np.rint(part / s), -127, 127).astype(np.float32)
        out[..., lo:lo + chunk] = np.where(s > 0, q * s, np.float32(0))
    return out


def _narrow(x: np.ndarray, wire: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if wire == "int8":
        return _int8_chunks(x)
    return x.astype(np.float16).astype(np.float32) if wire == "fp16" else _bf16(x)


def _hand_split_sum(x, w_k_out, bias, boards, wire):
    """numpy: each board's partial sum (exact in float64, then float32), narrowed, added in
    float32 in board order, the total narrowed, the bias added."""
    k = x.shape[-1]
    step = k // boards
    total = None
    for j in range(boards):
        part = (x[..., j * step:(j + 1) * step].astype(np.float64) @ w_k_out[j * step:(j + 1) * step]).astype(np.float32)
        part = _narrow(part, wire)
        total = part if total is None else (total + part).astype(np.float32)
    total = _narrow(total, wire)
    return total if bias is None else total + bias


def test_bf16_rounding_is_round_to_nearest_even():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 50
    # ties: a float32 exactly half-way between two bfloat16 values goes to the even one
    x[:4] = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80C000], dtype=np.uint32).view(np.float32)
    got = acc.round_bf16(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, _bf16(x))
    np.testing.assert_array_equal(got[:4].view(np.uint32),
                                  np.array([0x3F800000, 0x3F820000, 0xBF800000, 0x3F810000], dtype=np.uint32))
    assert np.abs(got - x).max() > 0


@pytest.mark.parametrize("wire", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("k_major", [False, True])
def test_split_sum_is_the_hand_computation(wire, k_major):
    rng = np.random.default_rng(1)
    # dyadic operands: every partial sum is exact in float32, so only the wire's roundings differ;
    # 150 outputs: two whole int8 chunks of 64 and a last one of 22
    x = (rng.integers(-240, 240, (2, 3, 32)) / 8).astype(np.float32)
    w = (rng.integers(-240, 240, (32, 150)) / 8).astype(np.float32)  # (K, out)
    bias = (rng.integers(-100, 100, 150) / 4).astype(np.float32)
    weight = torch.from_numpy(w if k_major else np.ascontiguousarray(w.T))
    for boards in (1, 2, 4):
        got = acc.split_sum(torch.from_numpy(x), weight, torch.from_numpy(bias), boards, wire, k_major).numpy()
        np.testing.assert_array_equal(got, _hand_split_sum(x, w, bias, boards, wire))
    exact = (x.astype(np.float64) @ w + bias).astype(np.float32)
    assert not np.array_equal(got, exact)  # the wire rounds
    np.testing.assert_array_equal(acc.split_sum(torch.from_numpy(x), weight, None, 4, "int32", k_major).numpy(),
                                  (x.astype(np.float64) @ w).astype(np.float32))


def _llama():
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                               max_position_embeddings=64))
    model.config._attn_implementation = "eager"
    return model.eval()


def _gpt2():
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64))
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.mark.parametrize("make, names", [(_llama, ("self_attn.o_proj", "mlp.down_proj")),
                                         (_gpt2, ("attn.c_proj", "mlp.c_proj"))])
def test_hooks_narrow_every_split_gemms_partial_sums(make, names):
    model = make()
    blocks = acc.blocks_of(model)
    gemms = acc.split_gemms(model)
    assert gemms == [b.get_submodule(n) for b in blocks for n in names]
    ids = np.random.default_rng(3).integers(0, 256, (2, 10))
    ref = acc.torch_logits(model, ids)
    seen = []

    def spy(module, args, out):
        seen.append((args[0].detach().numpy().copy(), out.detach().numpy().copy()))

    with acc.reduce_rounding(model, "fp16", 2):
        handle = gemms[-1].register_forward_hook(spy)  # after the rounding hook: sees its output
        try:
            narrowed = acc.torch_logits(model, ids)
        finally:
            handle.remove()
    with acc.reduce_rounding(model, "int32", 2):
        np.testing.assert_array_equal(acc.torch_logits(model, ids), ref)  # exact sums: no rounding
    x, out = seen[0]
    m = gemms[-1]
    w = m.weight.detach().numpy()
    w = w.T if hasattr(m, "in_features") else w  # (K, out)
    bias = None if m.bias is None else m.bias.detach().numpy()
    # float32 GEMMs sum in their own order, so a partial sum may round to the neighbouring
    # float16: within one float16 step of the largest partial sum per rounding (three of them)
    step = float(np.spacing(np.float16(np.abs(x @ w).max())))
    hand = _hand_split_sum(x, w, bias, 2, "fp16")
    np.testing.assert_allclose(out, hand, rtol=0, atol=3 * step)
    assert (out == hand).mean() > 0.95  # almost all bit-identical (unrounded sums would not be)
    if bias is None:  # the reduced row travels as float16: every element is one
        np.testing.assert_array_equal(out, out.astype(np.float16).astype(np.float32))
    assert not np.array_equal(narrowed, ref)
    a = acc.compare(narrowed, ref, ids)
    assert 0 < a.max_rel_err < 1e-2 and a.top1 >= 0.9
    # the hooks are gone after the block
    np.testing.assert_array_equal(acc.torch_logits(model, ids), ref)


def test_bad_values_are_refused_naming_the_field():
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 64}
    for bad in ("int4", "fp32", None, 2):
        with pytest.raises(LLMError, match="reduce must be one of"):
            plan(cfg, target="spinn/board", seq=16, reduce=bad)
    from tvm_spinn.llm.prefill import plan_prefill

    with pytest.raises(LLMError, match="reduce must be one of"):
        plan_prefill(cfg, "spinn/board", prompt=16, reduce="int16")
    model = _llama()
    with pytest.raises(LLMError, match="reduce must be one of"):
        with acc.reduce_rounding(model, "fp8", 2):
            pass
    with pytest.raises(LLMError, match="boards must be"):
        with acc.reduce_rounding(model, "fp16", 3):  # 4 heads do not split 3 ways
            pass
    model.config.intermediate_size = 130  # 4 heads split 2 ways, 130 columns do not split 4 ways
    with pytest.raises(LLMError, match="boards must divide the intermediate size 130"):
        with acc.reduce_rounding(model, "fp16", 4):
            pass
    model.config.intermediate_size = 128
    with pytest.raises(LLMError, match="K=32"):
        acc.split_sum(torch.zeros(2, 32), torch.zeros(4, 32), None, 5, "fp16")
    from tvm_spinn.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "cfg.json", "--reduce", "int4"])
    # int8: a byte an element and a 4-byte scale a chunk of 64
    assert REDUCE_BYTES == {"int32": 4, "fp16": 2, "bf16": 2, "int8": 1 + 4 / 64}


@pytest.mark.slow  # four plans of a small Llama on three boards (~3 min of CPU; more on a loaded host)
def test_narrow_wires_time_their_fixed_schedule_and_default_keeps_todays_plan(monkeypatch, register_system):
    from tvm_spinn.llm import board_tp, wire as wire_module
    from tvm_spinn.target.topology import topology_of
    from tvm_spinn.timing import collectives

    cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 64}
    system = register_system(tvm_spinn.make_system("spinn2-three-boards-wire", boards=3), tag="spinn/three-boards-wire")
    calls, kept = [], {}
    real_tree, real_narrow, real_records = (collectives.board_group_all_reduce, wire_module.narrow_all_reduce,
                                            board_tp.records)
    zero = {"on": False}

    def spy_tree(topo, grid, nbytes, **kw):
        out = real_tree(topo, grid, nbytes, **kw)
        calls.append(("tree", np.asarray(grid).copy(), nbytes, kw))
        return out

    def spy_narrow(topo, grid, nbytes):
        out = real_narrow(topo, grid, nbytes)
        calls.append(("narrow", np.asarray(grid).copy(), nbytes, {}))
        # the zero-cost reduce: the same plan with the all-reduces free
        return wire_module.NarrowAllReduce(0.0, 0.0, 0.0, nbytes) if zero["on"] else out

    def spy_records(*args, **kw):
        out = real_records(*args, **kw)
        kept["zero" if zero["on"] else kw.get("reduce", "int32")] = out
        return out

    monkeypatch.setattr(collectives, "board_group_all_reduce", spy_tree)
    monkeypatch.setattr(wire_module, "narrow_all_reduce", spy_narrow)
    monkeypatch.setattr(board_tp, "records", spy_records)
    seen = {}
    for wire in ("int32", "fp16", "int8", "zero"):
        calls.clear()
        zero["on"] = wire == "zero"
        kw = {} if wire == "int32" else {"reduce": "int8" if wire == "zero" else wire}
        p = plan(cfg, target=system, seq=32, searches={}, **kw)
        seen[wire] = (p, list(calls))
    hidden = 256
    for wire in ("int32", "fp16", "int8"):
        wire_calls = [c for c in seen[wire][1] if c[0] == ("tree" if wire == "int32" else "narrow")]
        # int32 along the trees, the narrow wires on their fixed schedule only, at the wire's bytes
        # (a token's row; the prompt's plan all-reduces whole chunks of rows)
        sizes = {n / (hidden * REDUCE_BYTES[wire]) for _, _, n, _ in wire_calls}
        assert 1.0 in sizes and all(x == int(x) for x in sizes)
        if wire != "int32":
            assert not any(c[0] == "tree" and c[2] == hidden * REDUCE_BYTES[wire] for c in seen[wire][1])
    topo = topology_of(tvm_spinn.target.arch_of(system))
    names = sorted(kept["int32"])
    assert names and all(sorted(kept[w]) == names for w in ("fp16", "int8", "zero"))
    for name in names:
        m32, m16, m8, m0 = (kept[w][name]["meta"] for w in ("int32", "fp16", "int8", "zero"))
        # each record's all-reduce is the cost function's at the wire's bytes, called directly
        fused = m32["board_gather_fused"]
        grids = [g for kind, g, _, kw in seen["int32"][1] if kind == "tree" and kw.get("fuse_gather") == fused]
        assert m32["board_all_reduce_s"] in {real_tree(topo, g, hidden * 4, board_gather=fused, pipelined=True,
                                                       fuse_gather=fused).seconds for g in grids}
        for m, wire in ((m16, "fp16"), (m8, "int8")):
            grids = [g for kind, g, _, _ in seen[wire][1] if kind == "narrow"]
            direct = {real_narrow(topo, g, hidden * REDUCE_BYTES[wire]).seconds for g in grids}
            assert m["board_all_reduce_s"] in direct
            assert m["board_all_reduces_decode_s"] == pytest.approx(2 * cfg["num_hidden_layers"]
                                                                    * m["board_all_reduce_s"])
            assert m["board_all_reduce_wire"] == wire
        assert m0["board_all_reduce_s"] == 0.0
        # int8 strictly between a free all-reduce and fp16's: fewer bytes on the same schedule
        assert 0.0 < m8["board_all_reduce_s"] < m16["board_all_reduce_s"]
        assert kept["zero"][name]["decode_s"] < kept["int8"][name]["decode_s"] < kept["fp16"][name]["decode_s"]
        assert "board_all_reduce_wire" not in m32
        assert "fp16 partial sums" in kept["fp16"][name]["description"]
        assert "int8 partial sums" in kept["int8"][name]["description"]
        assert "int32 partial sums" in kept["int32"][name]["description"]
    # the default states nothing new: today's plan (no wire keys), its sums int32; int8 says so
    p32, p8 = seen["int32"][0], seen["int8"][0]
    assert "reduce" not in p32.plan and p8.plan["reduce"] == "int8"
    for k, alt in p32.plan["alternatives"].items():
        if not k.startswith("board_tp"):  # the other placements have no all-reduce across boards
            assert p8.plan["alternatives"][k]["decode_s"] == alt["decode_s"]


def test_cli_passes_the_wire_type_to_the_planner(monkeypatch, tmp_path):
    import json

    from tvm_spinn import cli
    import importlib

    plan_module = importlib.import_module("tvm_spinn.llm.plan")  # the module (the package exports the function)

    seen = {}

    class Stop(Exception):
        pass

    def fake(config, **kw):
        seen.update(kw)
        raise Stop

    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                                "vocab_size": 256, "max_position_embeddings": 64}))
    monkeypatch.setattr(plan_module, "plan", fake)
    for argv, wire in ((["--reduce", "bf16"], "bf16"), (["--reduce", "int8"], "int8"), ([], "int32")):
        seen.clear()
        try:
            cli.main(["plan", str(path), "--no-progress", *argv])  # the command reports Stop as its error
        except Stop:
            pass
        assert seen["reduce"] == wire
