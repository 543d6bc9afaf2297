"""A batch in a pipeline of board stages: every user's KV cache on every stage, checked by hand.

The stages below carry the figures of Llama-2-70B int8 on 24 boards at batch 16 (a stage of four
blocks mapped for a micro-batch of one user, 2,048 slots): the hand computation follows the
rules of :mod:`tvm_spinn.llm.batching`'s docstring with the board's own numbers.
"""

from __future__ import annotations

import pytest

from tvm_spinn.llm.batching import stage_caches
from tvm_spinn.llm.plan import _Stage
from tvm_spinn.target import make_system

#: one block's K and V for one user: 8 KV heads x 128 x 2,048 slots x fp32, twice
KV_BLOCK_USER = 2 * 8 * 128 * 2048 * 4


def _stage(latency_s=0.0112, weight_bytes=3_424_157_936, resident_bytes=343_819_008, kv_bytes=4 * KV_BLOCK_USER,
           kv_sram_bytes=2 * KV_BLOCK_USER) -> _Stage:
    return _Stage(latency_s, 0.0, weight_bytes, resident_bytes, 0, 0, 32768, {}, {}, 32768, kv_bytes, kv_sram_bytes)


def test_batch_16_on_a_stage_of_four_llama_2_70b_blocks_by_hand():
    board = make_system("b", chips=48)
    st = _stage()
    caches = stage_caches([st, st], [0.0, 1e-4], 16, 1, [board, board], [0, 1], board)
    s = caches.stages[0]
    # every user's cache of the four blocks: 16 x 67,108,864 bytes
    assert 4 * KV_BLOCK_USER == 67_108_864 and s.bytes == 16 * 67_108_864 == 1_073_741_824
    # the board's resident share: half of 48 chips x 148 PEs x (128 - 16) KiB of SRAM
    budget = 0.5 * 48 * 148 * (128 - 16) * 1024
    assert budget == 407_371_776  # the 407 MB ledger of the attention boards
    sram_used = 343_819_008 - 2 * KV_BLOCK_USER  # the mapping's resident weights
    assert s.sram_room == int(budget) - sram_used == 97_107_200
    # one micro-batch's cache (67 MB) fits the room once: user 0's cache stays where the mapping
    # put it (half in SRAM), users 1-15 keep theirs in DRAM
    assert s.sram_micro_batches == 97_107_200 // 67_108_864 == 1
    assert s.sram_bytes == 2 * KV_BLOCK_USER and s.dram_bytes == s.bytes - 2 * KV_BLOCK_USER
    # DRAM: 48 chips x 2 GiB less the weights streamed (those not resident)
    assert s.dram_room == 48 * 2 * 2**30 - (3_424_157_936 - sram_used) and s.fits
    # a spilled micro-batch reads the SRAM half of its cache from the board's DRAM each token
    spill = 2 * KV_BLOCK_USER / (48 * 6.4e9)
    assert s.spill_s == pytest.approx(spill, rel=1e-12)
    assert caches.spill_decode_s == pytest.approx(2 * spill, rel=1e-12)
    # the busiest stage serves 16 micro-batches, 15 of them spilled
    assert caches.round_s == pytest.approx(16 * (0.0112 + 1e-4) + 15 * spill, rel=1e-12)
    # the largest batch: (SRAM room + DRAM room) / one user's cache of the stage
    assert caches.largest_batch == (97_107_200 + s.dram_room) // 67_108_864
    users = caches.users()
    assert len(users) == 16 and users[0]["users"] == [0, 0] and users[15]["users"] == [15, 15]
    assert users[0]["sram_bytes"] == 2 * 2 * KV_BLOCK_USER and users[0]["dram_bytes"] == 2 * 2 * KV_BLOCK_USER
    assert users[1]["sram_bytes"] == 0 and users[1]["dram_bytes"] == 2 * 4 * KV_BLOCK_USER
    assert users[3]["boards"] == [0, 1]
    assert caches.sram_bytes == 2 * 2 * KV_BLOCK_USER and caches.bytes == 2 * s.bytes


def test_one_micro_batch_keeps_what_the_mapping_held():
    """Micro-batches of the whole batch (as many users as stages or fewer): the mapping's ledger
    held every user's cache, so nothing moves and nothing is added."""
    board = make_system("b", chips=48)
    st = _stage(kv_bytes=4 * 4 * KV_BLOCK_USER, kv_sram_bytes=4 * 4 * KV_BLOCK_USER, resident_bytes=400_000_000)
    caches = stage_caches([st], [0.0], 4, 4, [board], [0], board)
    (s,) = caches.stages
    assert caches.micro_batches == 1 and s.sram_micro_batches == 1 and s.sram_bytes == s.bytes == st.kv_bytes
    assert caches.spill_decode_s == 0 and caches.round_s == st.latency_s


def test_a_batch_beyond_a_stage_is_refused_naming_it():
    """DRAM of 64 MiB a chip: 3 GiB a board, of it 2.93 GiB streamed weights; 16 users' caches
    (1 GiB) do not fit stage 1 (on board 5), whose room holds (SRAM room + DRAM room) / 67 MB users."""
    board = make_system("small", chips=48, dram_bytes=64 * 2**20)
    st = _stage(weight_bytes=3_000_000_000)
    caches = stage_caches([_stage(kv_bytes=0, kv_sram_bytes=0, weight_bytes=0, resident_bytes=0), st], [0.0, 0.0],
                          16, 1, [board, board], [4, 5], board)
    head, s = caches.stages
    assert head.fits and not s.fits and not caches.fits
    room = 48 * 64 * 2**20 - (3_000_000_000 - (343_819_008 - 2 * KV_BLOCK_USER))
    assert s.dram_room == room
    largest = (s.sram_room + room) // (4 * KV_BLOCK_USER)
    assert caches.largest_batch == largest < 16
    msg = caches.message("small")
    assert "stage 1 (board 5 of small)" in msg and f"{16 * 4 * KV_BLOCK_USER} bytes needed" in msg
    assert f"{s.sram_room + room} available" in msg and f"largest batch that fits every stage is {largest}" in msg


def test_a_board_with_dead_chips_has_their_share_less():
    """A stage on a board with two dead chips: its SRAM room and DRAM are its 46 live chips'."""
    board = make_system("b", chips=48)
    view = board.replace(dead_chips=(3, 9))
    st = _stage()
    whole, less = (stage_caches([st], [0.0], 16, 1, [v], [0], board).stages[0] for v in (board, view))
    assert less.dram_room == whole.dram_room - 2 * 2 * 2**30
    assert less.sram_room == int(0.5 * 46 * 148 * 112 * 1024) - (343_819_008 - 2 * KV_BLOCK_USER)
    assert less.spill_s == pytest.approx(whole.spill_s * 48 / 46, rel=1e-12)
