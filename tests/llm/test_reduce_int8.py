"""The int8 wire of the all-reduces across boards (:mod:`tvm_spinn.llm.wire`): its chunked
quantization against a numpy re-derivation, its error within the bound the wire implies at every
split GEMM of a tiny random Llama, and its fixed schedule's cost against the point-to-point
transfers it is made of."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import tvm_spinn  # noqa: E402
from tvm_spinn.llm import LLMError  # noqa: E402
from tvm_spinn.llm import accuracy as acc  # noqa: E402
from tvm_spinn.llm.wire import INT8_CHUNK, WIRES, narrow_all_reduce, wire_bytes  # noqa: E402


def _int8_chunks(x: np.ndarray, chunk: int) -> np.ndarray:
    """numpy: each run of ``chunk`` elements of the last axis (the last run the rest) as int8
    with the fp32 scale ``max|x| / 127``, ties to even, read back; zeros stay zeros."""
    x = np.asarray(x, dtype=np.float32)
    out = np.zeros_like(x)
    for lo in range(0, x.shape[-1], chunk):
        part = x[..., lo:lo + chunk]
        s = np.abs(part).max(axis=-1, keepdims=True) / np.float32(127)
        nz = np.broadcast_to(s > 0, part.shape)
        q = np.clip(np.rint(np.divide(part, s, where=nz, out=np.zeros_like(part))), -127, 127)
        out[..., lo:lo + chunk] = np.where(nz, q * s, np.float32(0))
    return out


def test_the_wire_is_stated_once():
    assert INT8_CHUNK == 64 and WIRES["int8"] == 1 + 4 / 64  # a byte an element and an fp32 scale a chunk
    assert wire_bytes("int8", 8192) == 8192 + 4 * 128  # Llama-2-70B's row: 128 chunks
    assert wire_bytes("fp16", 8192) == 2 * 8192
    with pytest.raises(ValueError, match="wire must be one of"):
        wire_bytes("int4", 8)


@pytest.mark.parametrize("chunk", [64, 5])
def test_chunks_are_the_numpy_rederivation(chunk):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 150)) * np.exp(rng.standard_normal((3, 1)) * 3)).astype(np.float32)
    x[1, :chunk] = 0.0  # a chunk of zeros: scale 0, zeros back
    # ties: with max 127 the scale is 1 and x / s lands half-way: rint goes to the even integer
    x[2, :5] = np.array([127.0, 0.5, 1.5, 2.5, -2.5], dtype=np.float32)
    got = acc.round_int8_chunks(torch.from_numpy(x), chunk).numpy()
    np.testing.assert_array_equal(got, _int8_chunks(x, chunk))
    np.testing.assert_array_equal(got[2, :5], [127.0, 0.0, 2.0, 2.0, -2.0])
    assert not got[1, :chunk].any()
    # at most half a step (the chunk's scale) from x, and never beyond the chunk's largest value
    for lo in range(0, x.shape[1], chunk):
        part, back = x[:, lo:lo + chunk], got[:, lo:lo + chunk]
        amax = np.abs(part).max(axis=1, keepdims=True)
        assert (np.abs(back - part) <= amax / 254 * (1 + 1e-6)).all()
        assert (np.abs(back) <= amax * (1 + 1e-6)).all()
    assert np.abs(got - x).max() > 0
    with pytest.raises(LLMError, match="chunk must be"):
        acc.round_int8_chunks(torch.from_numpy(x), 0)


def _llama():
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, intermediate_size=256, vocab_size=256,
                                               max_position_embeddings=64))
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.mark.parametrize("boards", [2, 4])
def test_each_split_gemm_within_the_wires_bound_on_a_tiny_llama(boards):
    """The derived bound, per element of chunk ``c`` of a split GEMM's output row: board ``j``'s
    fp32 partial sum ``p_j`` is read back within ``s_j / 2`` (``s_j = max_c |p_j| / 127``); the
    owner's fp32 sum of the ``T`` read-back values (each at most ``max_c |p_j|``) is within
    ``(T - 1) u sum_j max_c |p_j|`` of their exact sum (``u = 2^-24``); the total ``t`` (at most
    ``sum_j max_c |p_j|``, to first order) is requantized within ``S / 2 = max_c |t| / 254``. So
    ``|out - sum_j p_j| <= sum_j max_c |p_j| / 127`` to first order in ``u``; and the fp32 GEMMs'
    partial sums are within ``K u (|x| |W|)`` of exact. The test allows ``1e-5`` relative for
    the second-order terms."""
    model = _llama()
    gemms = acc.split_gemms(model)
    ids = np.random.default_rng(3).integers(0, 256, (2, 24))
    ref = acc.torch_logits(model, ids)
    seen = []

    def spy(module, args, out):
        seen.append((module, args[0].detach().numpy().astype(np.float64), out.detach().numpy().astype(np.float64)))

    with acc.reduce_rounding(model, "int8", boards):
        handles = [m.register_forward_hook(spy) for m in gemms]  # after the wire's hooks: their outputs
        try:
            narrowed = acc.torch_logits(model, ids)
        finally:
            for h in handles:
                h.remove()
    assert len(seen) == len(gemms)
    u = 2.0 ** -24
    worst = 0.0
    for module, x, out in seen:
        w = module.weight.detach().numpy().astype(np.float64).T  # (K, out)
        k = w.shape[0]
        step = k // boards
        parts = [x[..., j * step:(j + 1) * step] @ w[j * step:(j + 1) * step] for j in range(boards)]
        exact = sum(parts)
        n = exact.shape[-1]
        bound = np.empty_like(exact)
        for lo in range(0, n, INT8_CHUNK):
            sl = slice(lo, lo + INT8_CHUNK)
            amax = sum(np.abs(p[..., sl]).max(axis=-1, keepdims=True) for p in parts)
            bound[..., sl] = amax / 127 * (1 + 1e-5)  # each p_j's half step and the total's half step
        bound += (boards + k) * u * (np.abs(x) @ np.abs(w)) + 1e-30
        err = np.abs(out - exact)
        assert (err <= bound).all(), float((err / bound).max())
        worst = max(worst, float((err / bound).max()))
        # the wire rounds: not the exact sums
        assert err.max() > 0
    assert worst > 0.05  # the bound is not vacuous: some element comes within 20x of it
    a = acc.compare(narrowed, ref, ids)
    assert 0 < a.max_rel_err < 0.05 and a.top1 >= 0.9 and abs(a.ppl_ratio - 1) < 0.01


def test_fixed_schedule_costs_its_direct_transfers_and_gather(register_system):
    from tvm_spinn.target import arch_of
    from tvm_spinn.target.topology import ring_order, topology_of
    from tvm_spinn.timing.collectives import board_group_scattered_all_reduce, point_to_point

    system = register_system(tvm_spinn.make_system("spinn2-three-boards-int8", boards=3), tag="spinn/three-boards-int8")
    arch = arch_of(system)
    cpb = arch.chips_per_board
    topo = topology_of(arch)
    board = topology_of(arch.replace(chips=cpb, name="one board"))
    order = ring_order(board, cpb)
    grid = [[int(c) + b * cpb for c in order] for b in (0, 1)]
    n = wire_bytes("int8", 8192)
    cost = narrow_all_reduce(topo, grid, n)
    # two boards: each sends the other the half it owns, every chip its slice to its counterpart
    src = np.concatenate([np.asarray(grid[0]), np.asarray(grid[1])])
    dst = np.concatenate([np.asarray(grid[1]), np.asarray(grid[0])])
    assert cost.scatter_s == pytest.approx(point_to_point(topo, src, dst, n / 2 / cpb).seconds, rel=1e-12)
    # then the owners' halves back, multicast and copied to every chip (no reduce phase)
    assert cost.gather_s == board_group_scattered_all_reduce(topo, grid, 0.0, n, rounds=0).seconds
    assert cost.seconds == cost.scatter_s + cost.gather_s and cost.nbytes == n
    # fewer bytes cost less on the same schedule; one board or no bytes cost nothing
    assert narrow_all_reduce(topo, grid, wire_bytes("fp16", 8192)).seconds > cost.seconds > 0
    assert narrow_all_reduce(topo, grid[:1], n).seconds == 0.0
    assert narrow_all_reduce(topo, grid, 0.0).seconds == 0.0
    three = [[int(c) + b * cpb for c in order] for b in (0, 1, 2)]
    assert narrow_all_reduce(topo, three, n).scatter_s > 0
    with pytest.raises(ValueError, match="nbytes"):
        narrow_all_reduce(topo, grid, -1.0)
    with pytest.raises(ValueError, match="grid"):
        narrow_all_reduce(topo, [], n)
