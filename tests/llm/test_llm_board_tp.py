"""The ``board_tp`` placement of ``tvm_spinn.llm.plan``: blocks tensor-parallel over groups of
boards, pipelined across groups (config only, no weights, no simulation)."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_spinn  # noqa: E402
from tvm_spinn.llm import board_tp  # noqa: E402
from tvm_spinn.llm.plan import plan  # noqa: E402
from tvm_spinn.llm.spec import spec_of  # noqa: E402

SMALL = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
         "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 1000, "max_position_embeddings": 512}


def test_slice_config_splits_heads_kv_heads_and_mlp_columns():
    spec = spec_of(SMALL)
    two = spec_of(board_tp.slice_config(SMALL, spec, 2))
    assert (two.heads, two.kv_heads, two.head_dim, two.intermediate, two.hidden) == (4, 1, 64, 512, 512)
    # four boards: eight query heads, two KV heads; each KV head is held by the two boards whose
    # query heads read it
    four = spec_of(board_tp.slice_config(SMALL, spec, 4))
    assert (four.heads, four.kv_heads, four.intermediate) == (2, 1, 256)
    # the slices' weights add up to the block's (the norms and, past the KV heads, K and V are
    # held on every board)
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    full = spec.hidden * (2 * q + 2 * kv) + 3 * spec.hidden * spec.intermediate
    part = two.hidden * (2 * two.heads * two.head_dim + 2 * two.kv_heads * two.head_dim) \
        + 3 * two.hidden * two.intermediate
    assert 2 * part == full
    assert board_tp.slice_config(SMALL, spec, 3) is None  # 8 heads do not split 3 ways
    assert board_tp.slice_config({**SMALL, "num_key_value_heads": 4}, spec_of({**SMALL, "num_key_value_heads": 4}),
                                 8) is not None
    gpt2 = {"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 64}
    assert board_tp.slice_config(gpt2, spec_of(gpt2), 2) is None


def test_board_groups_are_neighbouring_boards():
    from tvm_spinn.target.topology import board_grid, topology_of

    arch = tvm_spinn.make_system(boards=24)
    topo = topology_of(arch)
    for g in (2, 4, 8):
        groups = board_tp.board_groups(board_grid(24), g)
        assert len(groups) == 24 // g and sorted(b for grp in groups for b in grp) == list(range(24))
        for grp in groups:
            ring = grp + grp[:1] if g >= 4 else grp  # 2 x (g / 2) boards: a cycle
            for a, b in zip(ring, ring[1:]):  # consecutive boards share a board edge
                chips = range(48 * a, 48 * a + 48)
                assert any(int(n) // 48 == b for c in chips for n in topo.neighbors[c]), (g, a, b)


@pytest.mark.slow  # ~20-40 s: torch.export of the slices, mapping on boards
def test_plan_splits_blocks_over_boards_when_that_is_faster(monkeypatch, register_system):
    from tvm_spinn.runtime import simulator

    monkeypatch.setattr(simulator, "run_program", lambda *a, **k: (_ for _ in ()).throw(AssertionError("simulated")))
    cfg = dict(SMALL, hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=4)
    system = register_system(tvm_spinn.make_system("spinn2-six-boards", boards=6), tag="spinn/six-boards")
    result = plan(cfg, target=system, batch=1, seq=64, dtype="int8")
    alts = result.plan["alternatives"]
    tp = {k: v for k, v in alts.items() if k.startswith("board_tp")}
    assert tp, alts
    # the kept plan is the fastest of all candidates
    assert result.decode_latency_s == min(v["decode_s"] for v in alts.values())
    for name, alt in tp.items():
        assert alt["chips"] % 48 == 0 and alt["chips"] // 48 <= 6 and alt["decode_s"] > 0
        # the prompt is planned once for the system: every placement's time to first token is its plan's
        assert alt["ttft_s"] == result.ttft_s == result.plan["prefill"]["ttft_s"] > 0
    if result.plan["placement"] == "board_tp":
        p = result.plan
        assert p["boards_used"] * 48 == result.chips_used
        # the parts add up: blocks, the all-reduces, the hand-overs, the head, the token back to
        # the first group and to every chip of it, the token out to the host
        assert result.decode_latency_s == pytest.approx(p["block_decode_s"] * 4 + p["board_all_reduces_decode_s"]
                                                        + p["handoff_decode_s"] + p["head_decode_s"] + p["token_return_s"]
                                                        + p["step_sync_s"] + p["host_io_decode_s"])
        assert p["token_return_s"] > 0 and p["step_sync_s"] > 0
        assert p["board_all_reduces_decode_s"] == pytest.approx(2 * 4 * p["board_all_reduce_s"])
    assert 0 < result.efficiency <= 1
    # fp32 models keep the chain's bits: never split over boards
    fp32 = plan(cfg, target=system, batch=1, seq=64, dtype="fp32")
    assert not any(k.startswith("board_tp") for k in fp32.plan["alternatives"])


def test_group_caches_hold_every_users_cache_or_name_the_stage_and_the_largest_batch():
    """A board of a group running n blocks holds n x the slice's cache of the whole batch: in SRAM
    beside the resident weights, the rest in DRAM beside the streamed weights; a batch beyond
    that is refused naming the stage, its boards, the bytes and the largest batch that fits."""
    from tvm_spinn.llm.plan import _Stage

    board = tvm_spinn.make_system("spinn2-tp-cache", boards=1)
    zero = dict.fromkeys(("compute", "dram", "sram", "links"), 0.0)
    dram = board.chips * board.dram_bytes
    # a slice mapped for 4 users: 1 MB of weights, 0.75 MB kept in SRAM, 2 MB of KV cache (half in SRAM)
    res = _Stage(1e-3, 0.0, 2**20, 3 * 2**18 + 2**20, 0, 0, 0, zero, zero, kv_bytes=2 * 2**20, kv_sram_bytes=2**20)
    stm = _Stage(2e-3, 0.0, 2**20, 0, 0, 0, 0, zero, zero, kv_bytes=2 * 2**20, kv_sram_bytes=0)
    capacity = 10 * 2**20
    caches = board_tp.group_caches(res, stm, [5, 3], 2, 4, board, capacity)
    # group 0: 5 blocks, 2 resident (0.75 MB kept, 0.25 MB streamed each), 3 streamed (1 MB each)
    assert caches.need == (10 * 2**20, 6 * 2**20)
    assert caches.sram_room == (capacity - 2 * 3 * 2**18, capacity - 2 * 3 * 2**18)
    assert caches.dram_room == (dram - 2 * 2**18 - 3 * 2**20, dram - 2 * 2**18 - 2**20)
    per_user = [10 * 2**20 // 4, 6 * 2**20 // 4]
    assert caches.largest_batch == min((s + d) // u for s, d, u in zip(caches.sram_room, caches.dram_room, per_user))
    assert caches.fits and caches.message("x", [[0, 1], [2, 3]], 2) == ""
    # the same stages for a batch whose cache overflows the first group's boards
    big = 4 * (caches.largest_batch // 4 + 1)
    scale = big // 4
    res_b = _Stage(1e-3, 0.0, 2**20, 3 * 2**18 + 2**20 * scale, 0, 0, 0, zero, zero, kv_bytes=2 * 2**20 * scale,
                   kv_sram_bytes=2**20 * scale)
    over = board_tp.group_caches(res_b, stm, [5, 3], 2, big, board, capacity)
    assert not over.fits and over.largest_batch == caches.largest_batch
    msg = over.message("spinn/x", [[0, 1], [2, 3]], 2)
    assert f"the KV cache of {big} users does not fit stage 0 (boards [0, 1] of spinn/x" in msg
    assert f"{10 * 2**20 * scale} bytes needed per board" in msg
    assert f"the largest batch that fits every stage is {caches.largest_batch}" in msg
    # a mapping that kept no cache in SRAM leaves it all to DRAM
    assert board_tp.group_caches(stm, stm, [1], 1, 4, board, capacity).sram_room == (0,)


def test_prefetch_fetches_during_the_all_reduces_what_the_dram_channel_has_time_for():
    """During an all-reduce the chips' DRAM channels are idle: each program of a streamed block
    fetches up to (all-reduce time x DRAM bandwidth) of its streamed bytes ahead, saving their
    DRAM time, never more than streaming costs it over running with its weights resident, and
    the block's programs together never more than its two all-reduces."""
    from tvm_spinn.llm.plan import _Stage

    zero = dict.fromkeys(("compute", "dram", "sram", "links"), 0.0)
    bw = 6.4e9

    def stage(program_s, streamed=()):
        return _Stage(sum(program_s), 0.0, 0, 0, sum(streamed), 0, 0, zero, zero, program_s=tuple(program_s),
                      program_streamed=tuple(streamed))

    resident = stage([60e-6, 250e-6])
    # program 0 streams 0.2 MB a chip (31 us of DRAM) and is 10 us slower streaming: saves 10 us;
    # program 1 streams 2 MB (312 us), 100 us slower: a 50 us all-reduce fetches 320 KB ahead (50 us)
    streamed = stage([70e-6, 350e-6], [200_000, 2_000_000])
    gains, buffer = board_tp._ahead_gains(resident, streamed, 50e-6, bw)
    saved = sum(gains)
    assert saved == pytest.approx(10e-6 + 50e-6)
    assert buffer == int(round(50e-6 * bw))  # the larger of the two programs' fetches ahead
    # a long all-reduce: program 1 saves its whole excess over the resident mapping (100 us)
    gains, buffer = board_tp._ahead_gains(resident, streamed, 400e-6, bw)
    saved = sum(gains)
    assert saved == pytest.approx(10e-6 + 100e-6) and buffer == 2_000_000
    # never more than the block's two all-reduces
    fast = stage([1e-6, 1e-6])
    slow = stage([900e-6, 900e-6], [10_000_000, 10_000_000])
    assert sum(board_tp._ahead_gains(fast, slow, 100e-6, bw)[0]) == pytest.approx(200e-6)
    # no all-reduce or no per-program figures: nothing gained
    assert board_tp._ahead_gains(resident, streamed, 0.0, bw) == ((), 0)
    assert board_tp._ahead_gains(resident, stage([70e-6, 350e-6]), 50e-6, bw) == ((), 0)
    # pieces cut at the all-reduces: the DRAM channel streams on from piece to piece, every idle
    # stretch (a piece's run past its own streamed bytes, the all-reduce after it) fetching for
    # the pieces after it
    res = stage([60e-6, 40e-6, 100e-6])
    pieces = stage([70e-6, 80e-6, 300e-6], [64_000, 128_000, 1_280_000])  # 10, 20 and 200 us of DRAM
    gains, buffer = board_tp._ahead_gains(res, pieces, 50e-6, bw, 2, (False, True, True))
    saved = sum(gains)
    # a block's idle stretches: 60 + 60 + 100 us running, two 50 us all-reduces (320 us) cover
    # what the pieces lose streaming (10 + 20 + 200 us, each at most its bytes' DRAM time): all
    # saved; the buffer at its fullest holds piece 2's 200 us while it runs, the next block's
    # pieces 0 and 1 (30 us) and 100 us of its piece 2 fetched while piece 2 runs
    assert saved == pytest.approx(10e-6 + 20e-6 + 200e-6)
    assert buffer == pytest.approx(330e-6 * bw, abs=1)
    # a buffer of 150 us a chip: piece 2's bytes are all held when it starts (150 us of its 200)
    gains, buffer = board_tp._ahead_gains(res, pieces, 50e-6, bw, 2, (False, True, True), capacity=150e-6 * bw)
    saved = sum(gains)
    assert saved == pytest.approx(10e-6 + 20e-6 + 150e-6) and buffer <= 150e-6 * bw + 1
    # no all-reduce and no idle stretch: nothing fetched ahead
    busy = stage([10e-6, 20e-6, 200e-6], [64_000, 128_000, 1_280_000])
    assert board_tp._ahead_gains(stage([5e-6, 10e-6, 100e-6]), busy, 0.0, bw, 2, (False, True, True)) == ((), 0)
    assert board_tp._ahead_gains(res, pieces, 50e-6, bw, 2, (False, True)) == ((), 0)  # not these pieces
    # the run: the streamed blocks (past the resident ones) each run the saving faster
    assert board_tp._run_s(resident, streamed, 5, 2, 60e-6) == pytest.approx(
        2 * resident.latency_s + 3 * (streamed.latency_s - 60e-6))


def test_fused_gathers_take_out_the_row_gathers_the_all_reduce_delivers():
    """A piece ending where the boards all-reduce saves the gather of its row at its end (the
    all-reduce's multicast delivers the row to every chip): it ends when its last layer does.
    Pieces not ending at an all-reduce save nothing; a piece whose tail holds anything but the
    row's gather is not fused."""
    from tvm_spinn.llm.plan import _Stage
    from tvm_spinn.program.records import CollectiveSummary, SystemTimingSummary

    zero = dict.fromkeys(("compute", "dram", "sram", "links"), 0.0)
    row = 32768

    def timing(layer_s, colls, tail):
        latency = sum(layer_s) + tail
        return SystemTimingSummary(latency, 0.0, 0.0, 0.0, "compute", 48, 0, tuple(layer_s),
                                   tuple(CollectiveSummary(layer, op, "multicast", nbytes, s, 7, 0)
                                         for layer, op, nbytes, s in colls), 0.0)

    def stage(timings, streamed):
        program_s = [t.latency_s for t in timings]
        return _Stage(sum(program_s), 0.0, 0, 0, sum(streamed), 0, 0, zero, zero, program_s=tuple(program_s),
                      program_streamed=tuple(streamed), program_timings=tuple(timings))

    attention = timing([10e-6, 20e-6], [(1, "all_reduce", 16, 5e-6), (2, "all_gather", 2048, 4e-6)], 4e-6)
    projection = timing([3e-6, 2e-6], [(2, "all_gather", row, 36e-6)], 35e-6)  # its row's gather ends it
    mlp = timing([6e-6, 40e-6, 9e-6], [(1, "all_gather", 1792, 5e-6), (3, "all_gather", row, 36e-6)], 36e-6)
    ends = (False, True, True)
    sliced = stage([attention, projection, mlp], [0, 0, 0])
    saved = board_tp.fused_gathers(sliced, ends, row)
    assert saved == pytest.approx((0.0, 35e-6, 36e-6))
    less = board_tp._less(sliced, saved)
    assert less.latency_s == pytest.approx(sliced.latency_s - 71e-6)
    assert less.program_s == pytest.approx((attention.latency_s, 5e-6, 55e-6))
    # a program bound by its links: its share of the stage's bounds without the gathers
    linked = SystemTimingSummary(mlp.latency_s, 1e-6, 2e-6, 120e-6, "communication", 48, 0, mlp.layer_s,
                                 mlp.collectives, 120e-6)
    bounded = stage([linked], [5000])
    bounded = _Stage(**{**bounded.__dict__, "bounds": dict(zero, links=120e-6), "alone": dict(zero, links=125e-6)})
    cut = board_tp._less(bounded, (72e-6,))
    assert cut.bounds["links"] == pytest.approx(48e-6) and cut.alone["links"] == pytest.approx(53e-6)
    # a piece ending at an all-reduce whose tail is not (only) the row's gather: nothing saved
    assert board_tp.fused_gathers(sliced, (True, True, True), row) == pytest.approx((0.0, 35e-6, 36e-6))
    shared = timing([6e-6, 40e-6], [(2, "all_gather", row, 36e-6), (2, "all_gather", 2048, 5e-6)], 41e-6)
    assert board_tp.fused_gathers(stage([attention, shared], [0, 0]), (False, True), row) == (0.0, 0.0)
    # the projection's sums on one chip: nothing gathered, nothing saved; the all-reduce takes
    # them spread over the board's chips: spreading them costs an on-board gather's time
    one_chip = SystemTimingSummary(46e-6, 0.0, 0.0, 0.0, "compute", 1, 0, (6e-6, 40e-6), (), 0.0)
    solo = stage([attention, one_chip], [0, 0])
    assert board_tp.fused_gathers(solo, (False, True), row) == (0.0, 0.0)
    spread = board_tp._spread(solo, (False, True), 48, 9e-6)
    assert spread.program_s == pytest.approx((attention.latency_s, 55e-6))
    assert spread.latency_s == pytest.approx(solo.latency_s + 9e-6) and spread.bounds["links"] == pytest.approx(9e-6)
    assert board_tp._spread(sliced, ends, 48, 9e-6) is sliced  # spread over the board already
    # not cut into pieces, or no per-piece timings: nothing known
    assert board_tp.fused_gathers(sliced, None, row) is None
    assert board_tp.fused_gathers(stage([], []), ends, row) is None


def _streaming_boards(register_system, name):
    """A small Llama on 6 boards of chips with 4 PEs (11 MB of resident SRAM a board), so its
    slices stream most blocks' weights: ``(llm.plan module, config, target, arch, spec, seq,
    {"head": the described head})``."""
    import importlib

    from tvm_spinn.llm.describe import describe
    from tvm_spinn.target import arch_of, get_target

    P = importlib.import_module("tvm_spinn.llm.plan")
    cfg = dict(SMALL, intermediate_size=4096, num_hidden_layers=8)
    tag = register_system(tvm_spinn.make_system(f"spinn2-{name}-boards", boards=6, pes_per_chip=4),
                          tag=f"spinn/{name}-boards")
    target = get_target(tag)
    arch, spec, seq = arch_of(target), spec_of(cfg), 64
    parts = P._parts(P._meta_model(cfg, spec), spec, 1, seq)
    return P, cfg, target, arch, spec, seq, {"head": describe(parts[2][1], parts[2][2], target, "int8")}


@pytest.mark.slow  # ~20 s alone: two slices described and mapped on boards
def test_degree_floor_bounds_every_mapped_degree_and_counts_the_streamed_blocks(monkeypatch, register_system):
    """Each degree's floor (the all-reduces, hand-overs, loop, head and the blocks the SRAM
    cannot keep streaming from DRAM: no mapping) is at most the degree's mapped token, and the
    slice's weight bytes from the sizes alone are at most the described slice's constants."""
    from tqdm.auto import tqdm

    P, cfg, target, arch, spec, seq, described = _streaming_boards(register_system, "floor")
    memo: dict = {}
    streamed = 0
    for g in (2, 4):  # each degree mapped on its own: nothing cut
        monkeypatch.setattr(board_tp, "TP_BOARDS", (g,))
        floors: dict = {}
        out = board_tp.records(cfg, spec, arch, target, "int8", 1, seq, 4, described, spec.params,
                               seq * spec.kv_bytes_per_token(4), tqdm(disable=True), memo=memo, floors=floors)
        assert set(floors) == {g} and out, (g, floors, out)
        decode = min(r["decode_s"] for r in out.values())
        assert 0 < floors[g] <= decode, (g, floors[g], decode)
        dec = memo[("board_tp_slice", g, 1, seq, "int8")]
        consts = sum(t.nbytes for p in dec for t in p.tensors if t.role == "const")
        assert 0.9 * consts <= board_tp.slice_weight_bytes(spec, g) <= consts
        streamed += sum(r["dram_chip"] > 0 for r in out.values())
    assert streamed  # the case exercises the floor's streamed blocks
    # the floor's streamed part: the bytes over the board's DRAM channels, less the all-reduces
    assert board_tp.stream_floor(4_000_000, 4, 1e9, 2e-4) == pytest.approx(8e-4)
    assert board_tp.stream_floor(4_000_000, 4, 1e9, 2e-3) == 0.0


def test_a_streamed_piece_fetched_ahead_runs_as_mapped_alone():
    """Fetched ahead, a streamed block's piece runs with its weights on chip and nothing else
    resident: the piece mapped alone (less its fused gather), where the block's SRAM ledger left
    part of its weights in DRAM; a piece the ledger kept whole keeps its time."""
    from tvm_spinn.llm.plan import _Stage
    from tvm_spinn.program.records import CollectiveSummary, SystemTimingSummary

    zero = dict.fromkeys(("compute", "dram", "sram", "links"), 0.0)
    row = 32768

    def stage(program_s, streamed, timings=()):
        return _Stage(sum(program_s), 0.0, 0, 0, sum(streamed), 0, 0, zero, zero, program_s=tuple(program_s),
                      program_streamed=tuple(streamed), program_timings=tuple(timings))

    gathered = SystemTimingSummary(80e-6, 0.0, 0.0, 0.0, "compute", 48, 0, (20e-6, 30e-6),
                                   (CollectiveSummary(2, "all_gather", "multicast", row, 36e-6, 7, 0),), 0.0)
    alone = stage([80e-6], [0], [gathered])  # 50 us of layers, then its row's gather
    mapped = []

    def map_alone(piece):
        mapped.append(piece)
        return alone

    resident = stage([40e-6, 120e-6], [0, 600_000])  # piece 1: part of its weights left in DRAM
    got = board_tp._on_chip(resident, ["attention", "mlp"], (False, True), row, 48, 9e-6, map_alone)
    assert mapped == ["mlp"] and got.program_s == pytest.approx((40e-6, 50e-6))
    # alone on one chip: its sums spread over the board first; never slower than in the block
    one = stage([100e-6], [0], [SystemTimingSummary(100e-6, 0.0, 0.0, 0.0, "compute", 1, 0, (100e-6,), (), 0.0)])
    assert board_tp._on_chip(resident, ["a", "m"], (False, True), row, 48, 9e-6, lambda p: one).program_s \
        == pytest.approx((40e-6, 109e-6))
    slow = stage([200e-6], [0], [SystemTimingSummary(200e-6, 0.0, 0.0, 0.0, "compute", 48, 0, (200e-6,), (), 0.0)])
    assert board_tp._on_chip(resident, ["a", "m"], (False, True), row, 48, 9e-6, lambda p: slow).program_s \
        == pytest.approx((40e-6, 120e-6))
    # a slice not cut into pieces: as mapped
    assert board_tp._on_chip(resident, ["a", "m"], None, row, 48, 9e-6, map_alone) is resident
    # the piece's timing (its layers and collectives, what slice_collectives reports) is then
    # the alone mapping's; a piece that keeps its time in the block keeps its timing
    own = [SystemTimingSummary(t, 0.0, 0.0, 0.0, "compute", 48, 0, (t,), (), 0.0) for t in (40e-6, 120e-6)]
    timed = stage([40e-6, 120e-6], [0, 600_000], own)
    got = board_tp._on_chip(timed, ["a", "m"], (False, True), row, 48, 9e-6, map_alone)
    assert got.program_timings == (own[0], gathered)
    assert board_tp.slice_collectives(got, row) == {}  # the row's gather is the all-reduce's
    assert board_tp.slice_collectives(got) == {"all_gather multicast": pytest.approx(36e-6)}
    assert board_tp._on_chip(timed, ["a", "m"], (False, True), row, 48, 9e-6, lambda p: slow).program_timings \
        == tuple(own)


def test_a_piece_fetched_ahead_runs_with_the_plan_that_holds_its_fetched_weights():
    """The weights fetched ahead land on the chips of the piece's streaming shard plan (each its
    share): a piece whose alone mapping takes another plan (one chip holding them all, handing
    its outputs on outside its time) runs with the streaming plan, its weights on chip, at the
    time the alone mapping timed for that plan (plus its cache write); without that plan timed,
    or ending at an all-reduce where the streaming plan is not faster, as mapped alone."""
    from tvm_spinn.llm.plan import _Stage
    from tvm_spinn.program.records import SystemTimingSummary

    zero = dict.fromkeys(("compute", "dram", "sram", "links"), 0.0)

    def summary(t, chips):
        return SystemTimingSummary(t, 0.0, 0.0, 0.0, "compute", chips, 0, (t,), (), 0.0)

    def stage(program_s, streamed, chips, plans=(), candidates=()):
        return _Stage(sum(program_s), 0.0, 0, 0, sum(streamed), 0, 0, zero, zero, program_s=tuple(program_s),
                      program_streamed=tuple(streamed), program_timings=tuple(summary(t, c) for t, c in zip(program_s, chips)),
                      program_plans=tuple(plans), program_candidates=tuple(candidates))

    wide, one = (48, 1, 1), (1, 1, 1)
    resident = stage([35e-6, 70e-6], [8, 4], [1, 48], [one, wide])
    streamed = stage([47e-6, 88e-6], [160_000, 170_000], [48, 48], [wide, wide])
    # alone: one chip (35 us, 1 us of it the cache write); the 48-chip plan timed at 38 us
    alone = stage([35e-6], [0], [1], [one], [{one: 34e-6, wide: 38e-6}])
    attention = stage([35e-6], [0], [48], [wide], [{wide: 35e-6}])
    by_piece = {"qkv": alone, "attention": attention}
    got = board_tp._on_chip(resident, ["qkv", "attention"], (False, False), 2048, 48, 5e-6, by_piece.get, streamed)
    assert got.program_s[0] == pytest.approx(39e-6)  # 38 us on the 48 chips + 1 us cache write
    assert got.program_timings[0] == streamed.program_timings[0]  # that plan's layers and collectives
    # the other piece's alone mapping is the same plan as streaming: as mapped alone (35 us < 70 us)
    assert got.program_s[1] == pytest.approx(35e-6)
    # no timing of the streaming plan, or without the streaming mapping: the alone mapping's
    untimed = stage([35e-6], [0], [1], [one], [{one: 34e-6}])
    for args in ((lambda p: untimed, streamed), (lambda p: alone, None)):
        assert board_tp._on_chip(resident, ["q", "a"], (False, False), 2048, 48, 5e-6, *args).program_s \
            == pytest.approx((35e-6, 35e-6))
    # a piece ending at an all-reduce keeps the alone mapping (its gathers are the all-reduce's),
    # its sums spread over the board first (40 us), never slower than in the block (35 us)
    assert board_tp._on_chip(resident, ["q", "a"], (True, False), 2048, 48, 5e-6, lambda p: alone,
                             streamed).program_s[0] == pytest.approx(35e-6)
    fast = stage([30e-6], [0], [1], [one], [{one: 29e-6, wide: 38e-6}])
    assert board_tp._on_chip(resident, ["q", "a"], (True, False), 2048, 48, 5e-6, lambda p: fast,
                             streamed).program_s[0] == pytest.approx(35e-6)
    assert board_tp._on_chip(resident, ["q", "a"], (True, False), 2048, 48, 1e-6, lambda p: fast,
                             streamed).program_s[0] == pytest.approx(31e-6)


def test_a_piece_on_fewer_chips_than_the_next_hands_its_outputs_on():
    """A piece whose outputs sit on fewer chips than the next piece reads them on pays their
    gather on those chips (as a piece mapped on them gathers its own outputs); one ending at an
    all-reduce (which delivers the row) or on as many chips pays nothing."""
    from types import SimpleNamespace

    from tvm_spinn.llm.plan import _Stage
    from tvm_spinn.program.records import SystemTimingSummary

    zero = dict.fromkeys(("compute", "dram", "sram", "links"), 0.0)

    def stage(program_s, chips):
        return _Stage(sum(program_s), 0.0, 0, 0, 0, 0, 0, zero, zero, program_s=tuple(program_s),
                      program_streamed=(0,) * len(program_s),
                      program_timings=tuple(SystemTimingSummary(t, 0.0, 0.0, 0.0, "compute", c, 0, (t,), (), 0.0)
                                            for t, c in zip(program_s, chips)))

    pieces = [SimpleNamespace(tensors=[SimpleNamespace(nbytes=n) for n in (2048, 512, 512)], outputs=[0, 1, 2]),
              SimpleNamespace(tensors=[SimpleNamespace(nbytes=2048)], outputs=[0])]
    handoffs = board_tp.handoff_gathers(pieces, lambda n: n * 1e-9)
    assert handoffs == pytest.approx((3072e-9, 2048e-9))
    got = board_tp._handed_on(stage([35e-6, 70e-6], [1, 48]), (False, True), (5e-6, 7e-6))
    assert got.program_s == pytest.approx((40e-6, 70e-6)) and got.latency_s == pytest.approx(110e-6)
    assert got.bounds["links"] == pytest.approx(5e-6)
    # where the piece's mapping timed a plan over the next piece's chips faster than that, its time
    one, wide = (1, 1, 1), (48, 1, 1)
    timed = dataclasses.replace(stage([35e-6, 70e-6], [1, 48]), program_plans=(one, wide),
                                program_candidates=({one: 35e-6, wide: 38e-6, (24, 1, 1): 36e-6}, {wide: 70e-6}))
    assert board_tp._handed_on(timed, (False, True), (5e-6, 7e-6)).program_s == pytest.approx((38e-6, 70e-6))
    assert board_tp._handed_on(timed, (False, True), (2e-6, 7e-6)).program_s == pytest.approx((37e-6, 70e-6))
    for chips, ends in (([48, 48], (False, True)), ([1, 48], (True, True))):
        same = stage([35e-6, 70e-6], chips)
        assert board_tp._handed_on(same, ends, (5e-6, 7e-6)) is same
    # mapped alone on one chip before the attention's 48: charged before it is compared
    resident = stage([45e-6, 70e-6], [48, 48])
    alone = stage([35e-6], [1])
    resident = dataclasses.replace(resident, program_streamed=(8, 0))
    got = board_tp._on_chip(resident, ["qkv", "attention"], (False, False), 2048, 48, 5e-6, lambda p: alone,
                            None, (5e-6, 0.0))
    assert got.program_s == pytest.approx((40e-6, 70e-6))
    got = board_tp._on_chip(resident, ["qkv", "attention"], (False, False), 2048, 48, 5e-6, lambda p: alone,
                            None, (15e-6, 0.0))
    assert got.program_s == pytest.approx((45e-6, 70e-6))  # no faster than as the block maps it


def test_a_resident_program_runs_no_slower_than_streaming():
    """A resident block's program takes at most its time streaming its weights (the same shard
    plan with its loads gone), whatever plan the block's SRAM ledger led it to."""
    from tvm_spinn.llm.plan import _Stage

    zero = dict.fromkeys(("compute", "dram", "sram", "links"), 0.0)

    def stage(program_s):
        return _Stage(sum(program_s) + 3e-6, 0.0, 0, 0, 0, 0, 0, zero, zero, program_s=tuple(program_s))

    resident, streamed = stage([20e-6, 15e-6, 40e-6]), stage([30e-6, 5e-6, 50e-6])
    got = board_tp._at_most(resident, streamed)
    assert got.program_s == pytest.approx((20e-6, 5e-6, 40e-6))
    assert got.latency_s == pytest.approx(65e-6 + 3e-6)  # what is not a program's (a cache write) stays
    assert board_tp._at_most(resident, resident) is resident


@pytest.mark.slow  # ~20-40 s alone: the slices described, mapped cut and uncut on boards
def test_each_degree_keeps_the_faster_of_the_cut_and_the_uncut_slice(monkeypatch, register_system):
    """Each degree's kept candidate is as fast as the fastest of its slice cut at the all-reduces
    (with its residual adds on their delivery or not) and its slice as described, each timed on
    its own (records with only that form)."""
    from tqdm.auto import tqdm

    P, cfg, target, arch, spec, seq, described = _streaming_boards(register_system, "cut")
    memo: dict = {}
    forms = board_tp.slice_forms

    def kept(pick):
        monkeypatch.setattr(board_tp, "slice_forms", lambda dec, reduces: pick(forms(dec, reduces)))
        out = board_tp.records(cfg, spec, arch, target, "int8", 1, seq, 4, described, spec.params,
                               seq * spec.kv_bytes_per_token(4), tqdm(disable=True), memo=memo)
        assert out
        return min(r["decode_s"] for r in out.values()), min(out.values(), key=lambda r: r["decode_s"])

    for g in (2, 4):
        monkeypatch.setattr(board_tp, "TP_BOARDS", (g,))
        cut, cut_rec = kept(lambda f: f[:1])
        uncut, uncut_rec = kept(lambda f: f[-1:])
        added, _ = kept(lambda f: f[1:-1])  # cut, the adds on the all-reduces' delivery
        both, rec = kept(lambda f: f)
        assert cut_rec["meta"]["board_gather_fused"] and not uncut_rec["meta"]["board_gather_fused"]
        assert both == pytest.approx(min(cut, added, uncut), rel=1e-12), (g, cut, added, uncut, both)
        assert rec["meta"]["board_gather_fused"] == (min(cut, added) <= uncut)


def test_a_streamed_block_fetched_ahead_burns_no_static_power_over_the_seconds_saved():
    """The seconds the stream ahead takes off a streamed block are not run: the block's energy
    leaves out its programs' chips' static power over them (each program's own chips)."""
    from tvm_spinn.llm.plan import _Stage
    from tvm_spinn.program.records import SystemTimingSummary
    from tvm_spinn.target import arch_of

    board = arch_of("spinn/board")
    zero = dict.fromkeys(("compute", "dram", "sram", "links"), 0.0)

    def timing(chips):
        return SystemTimingSummary(1e-4, 0.0, 0.0, 0.0, "dram", chips, 0, (1e-4,), (), 0.0)

    stage = _Stage(3e-4, 0.02, 0, 0, 0, 0, 0, zero, zero, program_s=(1e-4, 2e-4), program_streamed=(0, 0),
                   program_timings=(timing(48), timing(12)))
    p = board.p_static_w_per_chip
    # 40 us on 48 chips, 100 us on 12
    assert board_tp._unburnt_j(stage, (40e-6, 100e-6), board) == pytest.approx(p * (40e-6 * 48 + 100e-6 * 12))
    assert board_tp._unburnt_j(stage, (0.0, 0.0), board) == 0.0
    # without per-program figures: the board's chips over the whole saving
    bare = _Stage(3e-4, 0.02, 0, 0, 0, 0, 0, zero, zero)
    assert board_tp._unburnt_j(bare, (40e-6,), board) == pytest.approx(p * board.chips * 40e-6)


def test_every_block_streams_where_a_fetched_ahead_block_beats_a_resident_one():
    """A resident block runs its pieces with the shard plans its one SRAM ledger leaves them; a
    streamed block's pieces, their weights fetched ahead, may run faster: then every block
    streamed (none resident) is a variant of its own, and a group's blocks take no longer
    with it than with any resident ones; otherwise it is not offered."""
    from tvm_spinn.llm.plan import _Stage

    zero = dict.fromkeys(("compute", "dram", "sram", "links"), 0.0)
    resident = _Stage(300e-6, 1.0, 2**20, 2**20, 0, 0, 0, zero, zero)
    streamed = _Stage(420e-6, 1.5, 2**20, 0, 2**16, 0, 0, zero, zero)
    # fetched ahead, a streamed block takes 420 - 200 = 220 us: faster than 300 us resident
    variants = board_tp._block_variants(resident, streamed, 3, 2, 200e-6, 4096, 0.25)
    assert [v[-1] for v in variants] == ["", "p", "s"]
    assert variants[-1] == (0, 200e-6, 4096, 0.25, "s")
    times = {v[-1]: board_tp._run_s(resident, streamed, 10, v[0], v[1]) for v in variants}
    assert times["s"] == pytest.approx(10 * 220e-6)
    assert times["p"] == pytest.approx(2 * 300e-6 + 8 * 220e-6) and times[""] == pytest.approx(3 * 300e-6 + 7 * 420e-6)
    assert times["s"] < min(times["p"], times[""])
    # 100 us saved: 320 us streamed, slower than resident; no time saved: no fetched-ahead variant at all
    assert [v[-1] for v in board_tp._block_variants(resident, streamed, 3, 2, 100e-6, 4096, 0.1)] == ["", "p"]
    assert [v[-1] for v in board_tp._block_variants(resident, streamed, 3, 2, 0.0, 0, 0.0)] == [""]


def test_a_degree_whose_streamed_blocks_beat_resident_ones_keeps_every_block_streamed(monkeypatch, register_system):
    """Where a block fetched ahead runs faster than a resident one (the gains fetching ahead
    makes raised to 90% of each streamed program's time), the degree's kept record is the
    every-block-streamed variant: no block's weights kept, each group's blocks' streamed bytes
    in each chip's DRAM, and the blocks' energy less the static power over the seconds saved,
    counted here from the mapped stages."""
    import math

    from tqdm.auto import tqdm

    P, cfg, target, arch, spec, seq, described = _streaming_boards(register_system, "all-streamed")
    forms, mapped, seen = board_tp.slice_forms, [], []
    map_stage = P._map_stage

    def spy_map(*a, **k):
        st = map_stage(*a, **k)
        mapped.append((k.get("keep_outputs", False), st))
        return st

    gains = board_tp._ahead_gains

    def ahead(on_chip, streamed, *a, **k):  # 90% of each program's streaming time saved
        return tuple(0.9 * s for s in streamed.program_s), gains(on_chip, streamed, *a, **k)[1]

    variants = board_tp._block_variants

    def spy_variants(resident, streamed, *a):
        seen.append((resident, streamed))
        return variants(resident, streamed, *a)

    monkeypatch.setattr(P, "_map_stage", spy_map)
    monkeypatch.setattr(board_tp, "TP_BOARDS", (2,))
    monkeypatch.setattr(board_tp, "slice_forms", lambda dec, reduces: forms(dec, reduces)[:1])  # the cut slice
    monkeypatch.setattr(board_tp, "_ahead_gains", ahead)
    monkeypatch.setattr(board_tp, "_block_variants", spy_variants)
    out = board_tp.records(cfg, spec, arch, target, "int8", 1, seq, 4, described, spec.params,
                           seq * spec.kv_bytes_per_token(4), tqdm(disable=True), memo={})
    (key,) = out
    rec, ((resident, streamed),) = out[key], seen
    saved = 0.9 * sum(streamed.program_s)
    assert streamed.latency_s - saved < resident.latency_s  # the case: a streamed block is faster
    assert key.startswith("board_tp:g2m") and key.endswith("s"), key
    L, per_group = spec.layers, rec["meta"]["blocks_per_stage"]
    (head,) = [st for keep, st in mapped if not keep]  # the head's stage: the only one not a slice's
    # no block's weights kept: only the head's
    assert rec["resident"] == min(spec.params, min(head.resident_bytes, head.weight_bytes))
    assert rec["streamed"] == spec.params - rec["resident"]
    assert rec["meta"]["block_decode_s"] == pytest.approx(streamed.latency_s - saved, rel=1e-12)
    assert rec["meta"]["prefetch_saved_decode_s"] == pytest.approx(L * saved, rel=1e-12)
    # every block of a group streams its weights through each chip's DRAM
    assert rec["dram_chip"] == math.ceil(per_group * streamed.streamed_bytes_per_chip) > 0
    # each program's chips do not burn static power over its seconds saved
    unburnt = arch.p_static_w_per_chip * sum(0.9 * s * t.chips
                                            for s, t in zip(streamed.program_s, streamed.program_timings))
    assert len(streamed.program_timings) == len(streamed.program_s) > 0
    assert rec["energy_j"] == pytest.approx(2 * L * (streamed.energy_j - unburnt) + head.energy_j, rel=1e-12)


def test_a_piece_ending_at_an_all_reduce_fetched_ahead_runs_its_streaming_plan_without_the_row_gather():
    """A projection ending where the boards all-reduce, whose block's SRAM ledger put it on one
    chip (its sums then spread over the board): fetched ahead, it runs the streaming mapping's
    48-chip plan with its weights on chip, at the time the alone mapping timed for that plan
    less the gather of its row at its end (the all-reduce delivers the row: the tail the
    streamed piece's own timing of that plan shows), where that is faster."""
    from tvm_spinn.llm.plan import _Stage
    from tvm_spinn.program.records import CollectiveSummary, SystemTimingSummary

    zero = dict.fromkeys(("compute", "dram", "sram", "links"), 0.0)
    row = 32768
    wide, one = (48, 1, 1), (1, 1, 1)

    def stage(timings, streamed, plans, candidates=()):
        program_s = [t.latency_s for t in timings]
        return _Stage(sum(program_s), 0.0, 0, 0, sum(streamed), 0, 0, zero, zero, program_s=tuple(program_s),
                      program_streamed=tuple(streamed), program_timings=tuple(timings), program_plans=tuple(plans),
                      program_candidates=tuple(candidates))

    def timing(layer_s, tail, chips, colls=()):
        return SystemTimingSummary(sum(layer_s) + tail, 0.0, 0.0, 0.0, "compute", chips, 0, tuple(layer_s),
                                   tuple(CollectiveSummary(layer, op, "multicast", nbytes, s, 7, 0)
                                         for layer, op, nbytes, s in colls), 0.0)

    # the block's ledger: the projection on one chip, 10 us, its sums spread over the board: 16 us
    resident = stage([timing([16e-6], 0.0, 1)], [8], [one])
    # streaming on 48 chips: 2 us of layers and 12 us of weights, then its row's 36 us gather
    streamed = stage([timing([14e-6], 36e-6, 48, [(1, "all_gather", row, 36e-6)])], [88_000], [wide])
    # alone: one chip at 10 us; the 48-chip plan with its weights on chip timed at 40 us (its gather in)
    alone = stage([timing([10e-6], 0.0, 1)], [0], [one], [{one: 10e-6, wide: 40e-6}])
    got = board_tp._on_chip(resident, ["proj"], (True,), row, 48, 6e-6, lambda p: alone, streamed)
    assert got.program_s[0] == pytest.approx(4e-6)  # 40 us less its row's 36 us gather
    assert got.program_timings[0] == streamed.program_timings[0]
    # a tail that is not the row's gather is not the all-reduce's: the one-chip piece, spread (16 us)
    other = stage([timing([14e-6], 36e-6, 48, [(1, "all_gather", 2048, 36e-6)])], [88_000], [wide])
    assert board_tp._on_chip(resident, ["proj"], (True,), row, 48, 6e-6, lambda p: alone,
                             other).program_s[0] == pytest.approx(16e-6)
    # the 48-chip plan not timed alone: as mapped alone, spread
    untimed = stage([timing([10e-6], 0.0, 1)], [0], [one], [{one: 10e-6}])
    assert board_tp._on_chip(resident, ["proj"], (True,), row, 48, 6e-6, lambda p: untimed,
                             streamed).program_s[0] == pytest.approx(16e-6)
