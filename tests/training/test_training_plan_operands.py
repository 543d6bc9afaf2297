"""Where a training stage's GEMMs find their right operands: each GEMM is priced with the tiles
for an operand in SRAM exactly where the operand is in SRAM when the GEMM runs."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from tvm_spinn.llm.spec import spec_of
from tvm_spinn.target import make_system
from tvm_spinn.timing.gemm import gemm_seconds
from tvm_spinn.timing.gemm_overlap import gemm_tiles
from tvm_spinn.training.planner import Split, _Comms, _pass_seconds, _step_time
from tvm_spinn.training.planner.model import _block_gemms, _gathered_params, _stage_params
from tvm_spinn.training.planner.slot import _fresh_attention, _resident_share

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "python" / "tvm_spinn" / "llm" / "configs"
# GPT-2 small's blocks and vocabulary
_GPT2_SMALL = {**json.loads((CONFIGS / "gpt2-xl.json").read_text()), "n_layer": 12, "n_embd": 768, "n_head": 12,
               "n_inner": None, "vocab_size": 50257, "n_positions": 1024}


@pytest.fixture(scope="module")
def board():
    return make_system("one-board", boards=1)


def _shapes(spec, tokens):
    weights, attention = _block_gemms(spec, tokens, 256, 12, 1)
    return weights, attention


def test_weight_gradients_read_the_output_gradient_on_chip(board):
    """``dB = A^T dY`` reads ``dY``, which the backward has just produced on chip: a stage whose
    weights stream from DRAM still prices its weight gradients with that operand in SRAM, and
    its forward and input gradients (which read the weights) streamed."""
    comms = _Comms(board, True)
    # a one-token slot's 132 x 132 projection: dB = A^T dY is 132 x 1 by 1 x 132, whose tile
    # depends on where dY is
    weights = [(1, 132, 132, 1)]
    fwd, dgrad, wgrad = _pass_seconds(board, weights, comms, False)
    on_chip = sum(gemm_seconds(board, k, m, n, b, True) for m, k, n, b in weights)
    from_dram = sum(gemm_seconds(board, k, m, n, b, False) for m, k, n, b in weights)
    assert on_chip != pytest.approx(from_dram, rel=1e-6)  # the two tile choices differ here
    assert wgrad == pytest.approx(on_chip, rel=1e-12)
    assert fwd == pytest.approx(sum(gemm_seconds(board, m, k, n, b, False) for m, k, n, b in weights), rel=1e-12)
    assert dgrad == pytest.approx(sum(gemm_seconds(board, m, n, k, b, False) for m, k, n, b in weights), rel=1e-12)


@pytest.mark.parametrize("recomputed", [False, True])
def test_attention_reads_stashed_keys_from_dram_in_the_backward(board, recomputed):
    """Attention's right operands are the slot's keys and values: in SRAM in the forward (its
    projections have just produced them), stashed in DRAM for the backward's input gradients
    unless the backward recomputes them; whatever the stage's weights do."""
    spec, comms = spec_of(_GPT2_SMALL), _Comms(board, True)
    _, attention = _shapes(spec, 256)
    for resident in (False, True):
        fwd, dgrad, wgrad = _pass_seconds(board, [], comms, resident, attention, True, recomputed)
        assert fwd == pytest.approx(sum(gemm_seconds(board, m, k, n, b, True) for m, k, n, b in attention),
                                    rel=1e-12)
        assert dgrad == pytest.approx(sum(gemm_seconds(board, m, n, k, b, recomputed) for m, k, n, b in attention),
                                      rel=1e-12)
        assert wgrad == pytest.approx(sum(gemm_seconds(board, k, m, n, b, True) for m, k, n, b in attention),
                                      rel=1e-12)
    # a chunked slot reads the earlier chunks' keys from the stash in the forward too
    fwd = _pass_seconds(board, [], comms, True, attention, False, recomputed)[0]
    assert fwd == pytest.approx(sum(gemm_seconds(board, m, k, n, b, False) for m, k, n, b in attention), rel=1e-12)


def test_fresh_attention_needs_the_whole_context_in_sram(board):
    """The keys and values are in SRAM only for a whole sequence a slot (no earlier chunks in
    the stash) whose keys and values fit the SRAM the resident weights leave."""
    spec = spec_of(_GPT2_SMALL)
    split = Split(12, 4, 1, 0, 1, 8, False, True, 1)
    spare = board.pes_per_chip * board.tile_sram_bytes - _resident_share(board)
    kv = spec.hidden // 12  # GPT-2's keys (and values) on one of 12 ranks
    fits = spare // (2 * 4 * kv)  # tokens whose keys and values fit
    assert _fresh_attention(spec, split, fits, board)
    assert not _fresh_attention(spec, split, fits + 1, board)
    assert not _fresh_attention(spec, dataclasses.replace(split, chunks=2), 64, board)


def test_a_spread_head_in_sram_is_not_streamed(monkeypatch):
    """GPT-2 small spread over a 24-board pipeline whose every stage holds its weights (the
    head's rows among them) in SRAM: no GEMM of the step reads its weights from DRAM, so
    pricing a streamed LM-head GEMM a thousand times dearer leaves the step's time as it is,
    while the head's GEMMs are priced through the patched tiles (in SRAM)."""
    import tvm_spinn.training.planner.slot as slot
    from tvm_spinn.training.planner import _vocab_rows

    system = make_system("g24", boards=24)
    spec = spec_of(_GPT2_SMALL)
    split = Split(12, 12, 4, 0, 1, 2, False, True, 32, "dp,tp,pp", 0, True, 4, True)
    for j in range(split.pp):
        assert 8 * (_stage_params(spec, 12, 12, j, 0, True) - _gathered_params(spec, split, j)) <= \
            _resident_share(system)
    rows = _vocab_rows(spec, split.tp * split.pp)
    step = _step_time(spec, split, 256, "adamw", system, _Comms(system, True))
    priced = []

    def dear(arch, m, k, n, batch=1, resident=False):
        tiles = gemm_tiles(arch, m, k, n, batch, resident)
        head = rows in (m, k, n) and spec.hidden in (m, k, n)
        priced.append((head, resident))
        return dataclasses.replace(tiles, tile_cycles=1000 * tiles.tile_cycles) if head and not resident else tiles

    monkeypatch.setattr(slot, "gemm_tiles", dear)
    assert _step_time(spec, split, 256, "adamw", system, _Comms(system, True)).total_s == \
        pytest.approx(step.total_s, rel=1e-12)
    assert (True, True) in priced and (True, False) not in priced  # the head's GEMMs went through it, in SRAM
