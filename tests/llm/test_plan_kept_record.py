"""The plan's kept record completes itself: a pipeline candidate's prompt block is mapped only
where that candidate is kept, and reports what mapping it with every candidate reported."""

import json

import pytest

import tvm_spinn

CFG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
       "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 512, "max_position_embeddings": 256}


@pytest.mark.slow  # ~30 s alone: the plan of a small model (and its prompt plan) on two boards
def test_kept_pipeline_reports_its_prompt_block_mapped_on_one_board(register_system):
    import importlib

    P = importlib.import_module("tvm_spinn.llm.plan")
    from tvm_spinn.llm.describe import describe
    from tvm_spinn.llm.spec import spec_of
    from tvm_spinn.target import arch_of
    from tvm_spinn.target.allocation import board_name

    tag = register_system(tvm_spinn.make_system("spinn2-two-boards-kept", boards=2), tag="spinn/two-boards-kept")
    result = P.plan(CFG, target=tag, seq=64, dtype="int8")
    assert result.plan["placement"] == "pipeline"
    # the reference: the prompt's block described and mapped on one board of the system, alone
    spec = spec_of(CFG)
    arch = arch_of(tag)
    _, module, args = P._parts(P._meta_model(CFG, spec), spec, 1, 64)[1]
    board = arch.replace(chips=arch.chips_per_board, name=board_name(arch))
    pre = P._map(describe(module, args, tag, "int8"), board, "auto")
    assert result.plan["block_prefill_s"] == pre.latency_s > 0
    assert result.sram_bytes_per_chip >= int(pre.peak_pe_bytes * arch.pes_per_chip)
    # nothing of the search's machinery is left in what the plan reports
    json.dumps(result.to_dict())
    assert all(set(v) == {"decode_s", "period_s", "chips", "weights_resident", "ttft_s"}
               for v in result.plan["alternatives"].values())


def test_finish_completes_only_records_that_ask():
    P = __import__("importlib").import_module("tvm_spinn.llm.plan")
    plain = {"sram_pe": 3, "meta": {}}
    assert P._finish(plain) is plain and plain == {"sram_pe": 3, "meta": {}}
    calls = []
    asked = {"sram_pe": 3, "meta": {}, "finish": lambda r: calls.append(1) or dict(r, sram_pe=5)}
    done = P._finish(asked)
    assert calls == [1] and done["sram_pe"] == 5 and "finish" not in done and "finish" not in asked
