"""The training planner's data-parallel synchronisation schedule (``training.planner.sync``):
transfers streamed in the links' free share, ZeRO-2's reduce-scatters during the pipeline, and
the bucketed schedule never slower than the synchronisation at once."""

from __future__ import annotations

import importlib.resources
import json

import pytest

from tvm_spinn.llm.spec import spec_of
from tvm_spinn.target import make_system
from tvm_spinn.training.planner import Split, _Comms, _stage_params, _step_time, _untouched_rows
from tvm_spinn.training.planner.sync import _stream_end, _update_seconds


@pytest.mark.parametrize("start, seconds, free, end", [
    (2.0, 3.0, 0.5, 5.0),      # after the pipeline: the links' full rate
    (-10.0, 3.0, 0.5, -4.0),   # inside it at half the rate: 6 s, ends before the pipeline does
    (-10.0, 8.0, 0.5, 3.0),    # 5 s of it inside (10 s at half), the other 3 s after
    (-10.0, 8.0, 0.0, 8.0),    # no free share: all of it after the pipeline
    (-10.0, 0.0, 0.5, -10.0),  # nothing to send
])
def test_a_transfer_streams_in_the_links_free_share_until_the_pipeline_ends(start, seconds, free, end):
    assert _stream_end(start, seconds, free) == pytest.approx(end)


def _gpt2_small_24_boards():
    """GPT-2 small with an untied LM head (no tied table's synchronisation beside the blocks')."""
    cfg = json.loads((importlib.resources.files("tvm_spinn.llm") / "configs" / "gpt2-xl.json").read_text())
    spec = spec_of({**cfg, "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024,
                    "tie_word_embeddings": False})
    assert not spec.tied_embeddings
    system = make_system("gpt2-small-24-boards", boards=24)
    return spec, system, _Comms(system, True)


def test_zero2_reduce_scatters_the_earlier_micro_batches_during_the_pipeline():
    """ZeRO-2 reduce-scatters every micro-batch's gradients: with each data-parallel group on
    one board (``dp,tp,pp``) the links carry the earlier micro-batches' reduce-scatters during
    the pipeline, so at most one micro-batch's reduce-scatter, the all-gather and the shard's
    update are exposed after it, not the ``m`` reduce-scatters of the synchronisation at once
    (both computed here from the collectives' costs of the step's groups)."""
    spec, system, comms = _gpt2_small_24_boards()
    split = Split(12, 12, 4, 2, 1, 8, False, True, 1, "dp,tp,pp")
    groups = split.grid().reshape(-1, split.dp)
    touched = max(_stage_params(spec, 12, 12, j) - _untouched_rows(spec, 256, j) for j in (0, 11))
    rs = comms.collective("reduce_scatter", groups, 4 * touched)
    ag = comms.collective("all_gather", groups, 4 * touched)
    update = _update_seconds(system, "adamw", -(-_stage_params(spec, 12, 12, 0) // split.dp))
    step = _step_time(spec, split, 256, "adamw", system, comms)
    exposed = step.dp_comm_s + step.optimizer_s
    at_once = split.micro_batches * rs + ag + update
    assert exposed <= rs + ag + update < at_once, (exposed, rs + ag + update, at_once)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_the_bucketed_schedule_is_never_slower_than_the_synchronisation_at_once(zero):
    """Whatever the ZeRO stage, the exposed synchronisation and update are at most the block
    stages' synchronisation at once after the pipeline (ZeRO-0 an all-reduce, ZeRO-1 a
    reduce-scatter, ZeRO-2 one a micro-batch, and the all-gather; with the update), each
    computed here from the collectives' costs over every block stage's groups."""
    spec, system, comms = _gpt2_small_24_boards()
    split = Split(12, 12, 4, zero, 1, 8, False, True, 1, "tp,pp,dp")
    groups = split.grid().reshape(-1, split.dp)
    touched = max(_stage_params(spec, 12, 12, j) - _untouched_rows(spec, 256, j) for j in (0, 11))
    nbytes = 4 * touched
    if zero == 0:
        sync = comms.collective("all_reduce", groups, nbytes)
    else:
        scatters = split.micro_batches if zero == 2 else 1
        sync = scatters * comms.collective("reduce_scatter", groups, nbytes) + comms.collective(
            "all_gather", groups, nbytes)
    params = max(_stage_params(spec, 12, 12, j) for j in (0, 11))
    update = _update_seconds(system, "adamw", -(-params // split.dp) if zero else params)
    step = _step_time(spec, split, 256, "adamw", system, comms)
    assert 0.0 < step.dp_comm_s + step.optimizer_s <= (sync + update) * (1 + 1e-9)


@pytest.mark.parametrize("optimizer, state", [("adamw", 2), ("momentum", 1), ("sgd", 0)])
def test_an_update_of_resident_weights_moves_only_the_optimizer_state(optimizer, state):
    """A parameter whose weight and gradient are in the tile SRAM (a stage whose weights fit its
    resident share) is updated there: DRAM carries its optimizer state only, read and written
    (AdamW two fp32 vectors, momentum one, SGD none), where a streamed parameter's update also
    reads the weight and gradient and writes the weight; the M4F cores' element-wise work is the
    same (the compiled update's operations: AdamW 14, momentum 4, SGD 2, each
    ``m4f_elementwise_cycles`` on one of the chip's PEs)."""
    system = make_system("gpt2-small-24-boards", boards=24)
    ops = {"adamw": 14, "momentum": 4, "sgd": 2}[optimizer]
    n, resident = 600_000, 450_000
    cores = ops * n * system.m4f_elementwise_cycles / (system.pes_per_chip * system.clock_hz)
    streamed = 4 * (3 + 2 * state) * (n - resident)
    assert _update_seconds(system, optimizer, n) == pytest.approx(
        max(4 * (3 + 2 * state) * n / system.dram_bw_bytes_s, cores), rel=1e-12)
    assert _update_seconds(system, optimizer, n, resident) == pytest.approx(
        max((streamed + 4 * 2 * state * resident) / system.dram_bw_bytes_s, cores), rel=1e-12)
    assert _update_seconds(system, optimizer, n, n) <= _update_seconds(system, optimizer, n, resident)

