"""LLM plans on machines as they are: a dead board in the middle of the pipeline, a partial
allocation, a dead chip, and a batch whose micro-batches fill the pipeline."""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_spinn  # noqa: E402
from tvm_spinn.llm.plan import plan  # noqa: E402
from tvm_spinn.target.topology import topology_of  # noqa: E402

#: two blocks of ~12.6 MB (fp32) and a head: the pipeline's three board stages beat the shared
#: placement's streamed weights (see tests/llm/test_llm_plan.py's two-board case)
CFG = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 8,
       "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512}


@pytest.mark.slow  # ~30-60 s: mapping on boards, three placements
def test_dead_board_in_the_middle_of_the_pipeline(register_system):
    """Four boards, board 1 dead: the three stages run on boards 0, 2 and 3; the hand-overs and
    the token's way back take live routes, and nothing reports the dead board."""
    healthy = register_system(tvm_spinn.make_system("spinn2-four", boards=4), tag="spinn/four")
    arch = tvm_spinn.make_system("spinn2-four-dead1", boards=4).replace(dead_boards=(1,))
    tag = register_system(arch, tag="spinn/four-dead1")
    results = {t: plan(CFG, target=t, batch=1, seq=16, dtype="fp32") for t in (healthy, tag)}
    p = results[tag].plan
    assert p["placement"] == "pipeline" and p["stages"] == 3 and p["boards"] == [0, 2, 3]
    assert "boards" not in results[healthy].plan  # a healthy plan's records are as they were
    assert results[tag].chips_used == 3 * 48 and p["health"]["usable_boards"] == 3 and p["health"]["dead_boards"] == [1]
    # the token goes back from the head's board (3) to the first stage's (0) around board 1
    topo = topology_of(arch)
    hops = topo.hops([3 * 48], [0])[0]
    assert p["token_return_hops"] == hops and not np.isin(topo.route_links([3 * 48], [0])[1] // 6,
                                                          np.arange(48, 96)).any()
    # the stages are the same programs on whole boards: only the routes between them differ
    ph = results[healthy].plan
    assert [s["latency_s"] for s in p["stage_plan"]] == [s["latency_s"] for s in ph["stage_plan"]]
    assert results[tag].tokens_per_s_per_user == pytest.approx(
        1 / (sum(s["latency_s"] for s in p["stage_plan"][:1]) * 2 + p["stage_plan"][-1]["latency_s"]
             + p["handoff_decode_s"] + p["token_return_s"] + p["step_sync_s"] + p["host_io_decode_s"]))


@pytest.mark.slow  # ~30-60 s
def test_partial_allocation_batch_and_dead_chip(register_system):
    """Boards 1-3 of a four-board machine allocated, a chip of board 2 dead: the pipeline's stages
    take the whole boards first (1 and 3), then board 2 on its 47 live chips; a batch of three
    users goes through in micro-batches whose every user's cache is placed and reported."""
    arch = tvm_spinn.make_system("spinn2-four-part", boards=4).replace(allocated_boards=(1, 2, 3), dead_chips=(100,))
    tag = register_system(arch, tag="spinn/four-part")
    result = plan(CFG, target=tag, batch=3, seq=16, dtype="fp32")
    p = result.plan
    assert p["health"]["usable_boards"] == 3 and p["health"]["whole_boards"] == 2
    if p["placement"] == "pipeline":
        assert p["boards"] == [1, 2, 3] and result.chips_used == 3 * 48 - 1
        assert p["micro_batch"] == 1 and p["micro_batches"] == 3
        users = p["kv_cache_users"]
        assert [u["users"] for u in users] == [[0, 0], [1, 1], [2, 2]]
        assert sum(u["sram_bytes"] + u["dram_bytes"] for u in users) == result.kv_cache_bytes
        assert all(set(u["boards"]) <= {1, 2, 3} for u in users) and p["largest_batch"] >= 3
    assert "pipeline:s1" in p["alternatives"] and p["alternatives"]["pipeline:s1"]["chips"] == 3 * 48 - 1
    table = result.table()
    assert "3 of 4 boards usable (2 whole), 143 live chips" in table and "dead chips [100]" in table
    if p["placement"] == "pipeline":
        assert re.search(r"boards used\s+1, 2, 3\n", table)
        assert re.search(r"KV cache per user\s+users 0-\d: [0-9.]+ GB in SRAM", table)
        assert re.search(rf"largest batch\s+{p['largest_batch']} users", table)
    # aggregate tokens/s is the batch's: three users, each at the per-user rate
    assert result.tokens_per_s == pytest.approx(3 * result.tokens_per_s_per_user)
    assert result.chips_used <= 3 * 48 - 1


@pytest.mark.slow  # ~20-40 s
def test_one_board_with_dead_chips_plans_on_its_live_chips(register_system):
    arch = tvm_spinn.make_system("spinn2-board-2dead", chips=48).replace(dead_chips=(0, 30))
    tag = register_system(arch, tag="spinn/board-2dead")
    cfg = dict(CFG, hidden_size=256, intermediate_size=512, num_hidden_layers=1)
    result = plan(cfg, target=tag, batch=1, seq=16, dtype="int8")
    assert result.chips_used <= 46 and result.plan["health"]["live_chips"] == 46


def test_plan_cli_refuses_bad_machine_descriptions(tmp_path, capsys):
    """One line and exit status 2, before any planning, naming the option or field."""
    import importlib.resources

    from tvm_spinn.cli import main

    config = str(importlib.resources.files("tvm_spinn.llm") / "configs" / "llama-2-7b.json")
    before = set(tvm_spinn.known_targets())
    for args, named in ((["--dead-boards", "99"], "dead_boards: a board id must be an integer in [0, 1), got 99"),
                        (["--dead-links", "3"], "--dead-links: expected comma-separated chip:direction"),
                        (["--dead-chips", "0-47"], "leave no chip to use"),
                        (["--target", "spinn/board", "--dead-links", "0:3"], "chip 0's link 3 (W) leads nowhere"),
                        (["--system", str(tmp_path / "none.json")], "does not exist"),
                        (["--train", "--dead-boards", "1"], "--dead-boards applies to inference plans")):
        assert main(["plan", config, "--no-progress", *args]) == 2, args
        err = capsys.readouterr().err
        assert named in err and len(err.strip().splitlines()) == 1, (args, err)
    bad = tmp_path / "m.json"
    bad.write_text('{"boards": 2, "dead_boards": [0, 1]}')
    assert main(["plan", config, "--no-progress", "--system", str(bad)]) == 2
    assert "m.json" in capsys.readouterr().err
    assert set(tvm_spinn.known_targets()) == before  # nothing left registered
