"""The KV cache a region reserves is what its shard plan holds: every copy on every chip."""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tvm_spinn.llm import board_tp  # noqa: E402
from tvm_spinn.llm.describe import describe  # noqa: E402
from tvm_spinn.llm.spec import spec_of  # noqa: E402
from tvm_spinn.mapping import MappingOptions  # noqa: E402
from tvm_spinn.mapping.planner import plan_system  # noqa: E402
from tvm_spinn.mapping.system import recorded_plan  # noqa: E402
from tvm_spinn.target import arch_of  # noqa: E402

P = importlib.import_module("tvm_spinn.llm.plan")

SEQ = 2048


def _pieces():
    """A small Llama block's slice cut into pieces where the boards all-reduce (one key/value
    head of 128, four query heads, as one board's slice of Llama-2-70B over 16 boards): its
    attention piece runs fastest on a board with its query heads split over groups of chips and
    the cache's slots over the chips of a group, every group holding every slot."""
    cfg = dict(model_type="llama", hidden_size=512, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
               head_dim=128, intermediate_size=256, vocab_size=512, max_position_embeddings=SEQ, rms_norm_eps=1e-5)
    spec = spec_of(cfg)
    parts = P._parts(P._meta_model(cfg, spec), spec, 1, SEQ)
    dec = [d.program for d in describe(parts[0][1], parts[0][2], "spinn/board", "int8")]
    host = {tuple(int(x) for x in a.shape) for a in parts[0][2][1:]}
    pieces, ends = board_tp.slice_forms(dec, board_tp.block_all_reduces(spec))[0]
    assert ends is not None
    return list(pieces), host


@pytest.fixture(scope="module")
def mapped():
    pieces, host = _pieces()
    board = arch_of("spinn/board")
    programs = [dataclasses.replace(P._clone(p), arch=board) for p in pieces]
    onchip = [[t for t in p.inputs if tuple(p.tensors[t].shape) not in host] for p in programs]
    # the stage as plan.py maps it (in order, the pieces' hand-ins on chip)
    plan = plan_system(programs, board, MappingOptions(), onchip_inputs=onchip, policy="in_order")
    stage = P._map_stage(pieces, board, host, SEQ)
    return board, plan, stage


def test_state_bytes_count_every_copy_the_shard_plan_holds(mapped):
    board, plan, stage = mapped
    held = [(m, r) for m, r in zip(plan.programs, plan.regions) if r.state_bytes]
    assert len(held) == 1
    program, region = held[0]
    shard = recorded_plan(program)
    t = program.tensors
    caches = [i for i in program.inputs if len(t[i].shape) == 3 and SEQ in t[i].shape]
    assert len(caches) == 2
    # every chip holds its share (the local shape, fp32): summed over the plan's chips
    per_chip = sum(int(np.prod(shard.shapes[i])) * 4 for i in caches)
    whole = sum(int(np.prod(t[i].shape)) * 4 for i in caches)
    assert region.state_tensor_bytes == whole == 2 * 128 * SEQ * 4
    assert region.state_bytes == per_chip * shard.chips
    # the plan keeps copies: each slot on more than one chip
    assert shard.sp > 1 and region.state_bytes >= 2 * whole
    # the stage's ledger holds what the region reserves
    assert stage.kv_bytes == region.state_bytes
    assert stage.kv_sram_bytes == region.state_sram_bytes <= stage.resident_bytes


def test_a_batch_whose_copies_do_not_fit_is_refused(mapped):
    """A board with room for one copy of the cache but not for the copies the plan holds is not
    planned as fitting; with room for every copy it is."""
    board, plan, stage = mapped
    one = next(r.state_tensor_bytes for r in plan.regions if r.state_bytes)
    assert stage.kv_bytes >= 2 * one
    kept = stage.resident_bytes - stage.kv_sram_bytes
    rest = max(0, stage.weight_bytes - min(kept, stage.weight_bytes))

    def caches(room):  # the SRAM beside the resident weights full: ``room`` bytes of DRAM at most
        small = board.replace(dram_bytes=(rest + room) // board.chips)
        return board_tp.group_caches(stage, stage, [1], 1, 1, small, kept)

    tight = caches(one + one // 2)  # one copy and a half
    assert tight.need == (stage.kv_bytes,)
    assert tight.sram_room[0] + tight.dram_room[0] >= one  # one copy would fit
    assert not tight.fits and tight.largest_batch == 0
    assert "does not fit stage 0" in tight.message("test", [[0]], 16)
    roomy = caches(stage.kv_bytes + board.chips)
    assert roomy.fits and roomy.largest_batch >= 1
