"""Tokens/s per user never falls as boards are added, and the planner keeps its fastest
candidate (a small Llama config: no weights, no simulation)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_spinn  # noqa: E402
from tvm_spinn.llm.plan import plan  # noqa: E402

TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 64}


@pytest.mark.slow  # ~30-60 s: three plans, each mapping the block on its candidates
def test_tokens_per_s_never_fall_over_boards_and_the_fastest_plan_is_kept(register_system):
    rates = []
    for boards in (1, 2, 4):
        target = "spinn/board" if boards == 1 else register_system(
            tvm_spinn.make_system(f"spinn2-tiny-{boards}", boards=boards), tag=f"spinn/tiny-{boards}")
        result = plan(TINY, target=target, batch=1, seq=16, dtype="int8")
        alts = result.plan["alternatives"]
        # the kept plan is the fastest of every candidate costed
        assert 1 / result.tokens_per_s_per_user == pytest.approx(min(a["period_s"] for a in alts.values()))
        if boards > 1:
            # what one board plans is a candidate on more boards too
            assert "groups:one-board" in alts
        if boards >= 3:
            # blocks tensor-parallel over boards are costed (a failing candidate must not vanish)
            assert any(k.startswith("board_tp") for k in alts), sorted(alts)
        rates.append(result.tokens_per_s_per_user)
    assert rates == sorted(rates), rates



#: A Llama block with heads and MLP columns enough to split over 2, 4 and 8 boards
LADDER = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
          "num_key_value_heads": 8, "num_hidden_layers": 8, "vocab_size": 1024, "max_position_embeddings": 256}


@pytest.mark.slow  # minutes: four plans, the block mapped on each candidate
def test_tokens_per_s_never_fall_from_one_to_eight_boards(register_system):
    """The ladder of bench/llm.py --part scaling, cheaper: a plan may leave boards idle, so more
    boards never plan a slower token; each plan runs on no more boards than the system has,
    and the kept plan is the fastest of its candidates."""
    rates = []
    for boards in (1, 2, 4, 8):
        target = "spinn/board" if boards == 1 else register_system(
            tvm_spinn.make_system(f"spinn2-ladder-{boards}", boards=boards), tag=f"spinn/ladder-{boards}")
        result = plan(LADDER, target=target, batch=1, seq=128, dtype="int8")
        assert result.chips_used <= 48 * boards
        assert 1 / result.tokens_per_s_per_user == pytest.approx(
            min(a["period_s"] for a in result.plan["alternatives"].values()))
        rates.append(result.tokens_per_s_per_user)
    assert rates == sorted(rates), rates
