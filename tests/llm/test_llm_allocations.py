"""Allocations of one machine: a larger patch contains every plan of the ladder's smaller patches
inside it, so it never plans a slower token, and a plan says the boards it has and uses (a small
Llama config: no weights, no simulation)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_spinn  # noqa: E402
from tvm_spinn.llm.plan import plan  # noqa: E402
from tvm_spinn.target.allocation import allocation  # noqa: E402

TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 64}


@pytest.mark.slow  # ~30-60 s: two plans, each mapping the block on its candidates and its patches'
def test_a_larger_allocation_contains_the_smaller_patches_plans(register_system):
    machine = tvm_spinn.make_system("spinn2-five-by-five", boards=25)  # a 5 x 5 torus of boards
    results = {}
    # a 2 x 2 and a 4 x 4 patch at the torus' origin: neither spans it (no wrap-around links)
    for boards in (4, 16):
        tag = register_system(allocation(machine, boards), tag=f"spinn/five-by-five-{boards}")
        searches: dict = {}  # the 4 x 4's search of its 2 x 2 patch runs afresh
        results[boards] = plan(TINY, target=tag, batch=1, seq=16, dtype="int8", patches=True, searches=searches)
        # without patches=True the plan searches the allocation alone (its search remembered)
        alone = plan(TINY, target=tag, batch=1, seq=16, dtype="int8", searches=searches)
        assert not [k for k in alone.plan["alternatives"] if "@" in k]
        assert alone.plan["patch"] == {4: "2x2", 16: "4x4"}[boards]
        assert alone.tokens_per_s_per_user <= results[boards].tokens_per_s_per_user
    small, large = results[4], results[16]
    for boards, result in results.items():
        meta = result.plan
        assert meta["allocated_boards"] == boards
        assert 1 <= meta["boards_used"] <= boards and result.chips_used <= 48 * boards
        # the kept plan is the fastest of every candidate costed, its patch's included
        assert 1 / result.tokens_per_s_per_user == pytest.approx(min(a["period_s"] for a in meta["alternatives"].values()))
    assert large.plan["patch"] in ("1x1", "1x2", "2x2", "2x4", "4x4")
    # the 2 x 2 patch inside the 4 x 4 one is the 2 x 2 allocation: each of its own candidates
    # again, at the same period
    own = {k: a["period_s"] for k, a in small.plan["alternatives"].items() if "@" not in k}
    inner = {k[:-2]: a["period_s"] for k, a in large.plan["alternatives"].items() if k.endswith("@4")}
    assert own and inner.keys() == own.keys()
    for k, period in own.items():
        assert inner[k] == pytest.approx(period, rel=1e-12), k
    assert large.tokens_per_s_per_user >= small.tokens_per_s_per_user
