"""The whole token in an LLM plan: the sampled token's way back from the last pipeline stage to
the first, its arrival at every chip of the first stage, and the host's I/O per token."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_spinn  # noqa: E402
from tvm_spinn.llm.plan import TOKEN_BYTES, _step_io, plan  # noqa: E402
from tvm_spinn.target.topology import DIRECTION_NAMES, topology_of  # noqa: E402

SMALL_LLAMA = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
               "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 1000, "max_position_embeddings": 512}


def _route_latency(arch, src: int, dst: int) -> tuple[int, float]:
    """Hops of the route ``src -> dst`` and their latencies summed, each hop an on-board link
    (``link_hop_s``) or a board-to-board one (``board_link_hop_s``), read off the route."""
    topo = topology_of(arch)
    hops = topo.route(src, dst)
    board = [bool(topo.board_link[node, DIRECTION_NAMES.index(name)]) for node, name in hops]
    return len(hops), sum(arch.board_link_hop_s if b else arch.link_hop_s for b in board)


def _system(boards: int) -> str:
    tag = f"spinn/token-return-{boards}"
    if tag not in tvm_spinn.known_targets():
        tvm_spinn.register_system(tvm_spinn.make_system(f"spinn2-token-return-{boards}", boards=boards), tag=tag)
    return tag


@pytest.mark.parametrize("boards, last", [(3, 2 * 48 + 17), (24, 13 * 48 + 40), (1, 47)])
def test_token_return_is_the_route_hop_count_times_its_hop_latency(boards, last):
    arch = tvm_spinn.make_system(f"spinn2-return-{boards}", boards=boards)
    io = _step_io(arch, batch=1, seq=64, last_chip=last, first_chips=range(48))
    hops, expected = _route_latency(arch, last, 0)
    assert hops > 0 and io["token_return_hops"] == hops
    assert io["token_return_s"] == pytest.approx(expected, rel=1e-12)
    if boards == 1:  # on one board every hop is an on-board link
        assert io["token_return_s"] == pytest.approx(hops * arch.link_hop_s, rel=1e-12)
    # the first stage's chips all get the token: its farthest chip from the one it arrives at
    far = max(_route_latency(arch, 0, c)[1] for c in range(1, 48))
    assert io["step_sync_s"] == pytest.approx(far, rel=1e-12)
    # the host: one message per step out (a token id per user), and the prompt in
    assert io["host_io_decode_s"] == pytest.approx(arch.host_link_latency_s + TOKEN_BYTES / arch.host_link_bw_bytes_s)
    assert io["host_io_prefill_s"] == pytest.approx(2 * arch.host_link_latency_s
                                                    + 65 * TOKEN_BYTES / arch.host_link_bw_bytes_s)


def test_single_stage_plan_has_no_return_term():
    result = plan(SMALL_LLAMA, target="spinn", batch=1, seq=64, dtype="int8")
    p = result.plan
    assert p["placement"] == "shared" and set(p["alternatives"]) == {"shared"}
    assert p["token_return_s"] == 0 and p["token_return_hops"] == 0 and p["step_sync_s"] == 0
    arch = tvm_spinn.target.arch_of(tvm_spinn.get_target("spinn"))
    assert p["host_io_decode_s"] == pytest.approx(arch.host_link_latency_s + TOKEN_BYTES / arch.host_link_bw_bytes_s)
    # the step's parts add up, the host's I/O included; the table shows each
    assert result.decode_latency_s == pytest.approx(4 * p["block_decode_s"] + p["head_decode_s"] + p["handoff_decode_s"]
                                                    + p["host_io_decode_s"])
    table = result.table()
    assert "token return" in table and "host I/O" in table and "step synchronisation" in table
    data = json.loads(json.dumps(result.to_dict()))
    assert data["plan"]["host_io_decode_s"] == p["host_io_decode_s"]


@pytest.mark.slow  # ~5-9 s: torch.export of three parts and mapping on two boards
def test_pipeline_plan_returns_the_token_from_the_head_board_to_the_first():
    """A block on one board and the head on the other (the two-board pipeline of
    tests/llm/test_llm_plan.py): the token goes back from the head's board to the block's."""
    tag = _system(2)
    cfg = dict(SMALL_LLAMA, hidden_size=1024, intermediate_size=4096, num_hidden_layers=1)
    result = plan(cfg, target=tag, batch=1, seq=16, dtype="fp32")
    p = result.plan
    assert p["placement"] == "pipeline" and p["stages"] == 2
    arch = tvm_spinn.target.arch_of(tvm_spinn.get_target(tag))
    hops, expected = _route_latency(arch, 48, 0)  # the head's board's first chip to the block's
    assert p["token_return_hops"] == hops > 0
    assert p["token_return_s"] == pytest.approx(expected, rel=1e-12)
    assert p["step_sync_s"] == pytest.approx(max(_route_latency(arch, 0, c)[1] for c in range(1, 48)), rel=1e-12)
    block, head = p["stage_plan"]
    assert result.decode_latency_s == pytest.approx(block["latency_s"] + head["latency_s"] + p["handoff_decode_s"]
                                                    + p["token_return_s"] + p["step_sync_s"] + p["host_io_decode_s"])
    assert result.bounds_s["links"] >= p["handoff_decode_s"] + p["token_return_s"] + p["host_io_decode_s"]
