"""The prompt's own plan (``tvm_spinn.llm.prefill``): chunked prefill pipelined over boards."""

import importlib.resources
import json
import math

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.llm import LLMError
from tvm_spinn.llm.prefill import (chunk_sizes, flow_shop_path, flow_shop_s, plan_prefill, prefill_bound,
                                   prefill_workload, replicated_flow_shop)
from tvm_spinn.llm.spec import spec_of

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 256, "max_position_embeddings": 64}


def _no_simulation(monkeypatch):
    from tvm_spinn.runtime import simulator

    def refuse(*args, **kwargs):
        raise AssertionError("planning ran the functional simulator")

    monkeypatch.setattr(simulator, "run_program", refuse)


def test_flow_shop_equal_times_is_machines_plus_chunks_minus_one():
    t = 0.25
    for machines, chunks in ((1, 1), (1, 5), (3, 1), (4, 6), (7, 3)):
        assert flow_shop_s(np.full((machines, chunks), t)) == pytest.approx((machines + chunks - 1) * t)


def test_flow_shop_against_a_hand_count():
    # machine 0: chunks take 1, 3; machine 1: 2, 1. Chunk 0 leaves m0 at 1, m1 at 3; chunk 1
    # leaves m0 at 4, waits for nothing on m1 (free since 3): 4 + 1 = 5
    assert flow_shop_s([[1.0, 3.0], [2.0, 1.0]]) == pytest.approx(5.0)
    # a slow second machine: chunk 1 waits for it: 1 + 5 = 6, then 6 + 5 = 11
    assert flow_shop_s([[1.0, 1.0], [5.0, 5.0]]) == pytest.approx(11.0)
    with pytest.raises(ValueError, match="machines x chunks"):
        flow_shop_s([])


def test_flow_shop_path_adds_up_to_the_makespan():
    rng = np.random.default_rng(0)
    for machines, chunks in ((1, 1), (1, 4), (5, 1), (6, 9), (9, 3)):
        times = rng.uniform(0.1, 2.0, size=(machines, chunks))
        path = flow_shop_path(times)
        # a monotone staircase from the first cell to the last, one machine or one chunk a step
        assert path[0] == (0, 0) and path[-1] == (machines - 1, chunks - 1)
        assert all((m2 - m1, k2 - k1) in ((1, 0), (0, 1)) for (m1, k1), (m2, k2) in zip(path, path[1:]))
        assert sum(times[m, k] for m, k in path) == pytest.approx(flow_shop_s(times))
    # the hand count's second case: the slow second machine's two chunks are on the path
    assert flow_shop_path([[1.0, 1.0], [5.0, 5.0]]) == [(0, 0), (1, 0), (1, 1)]


def test_replicated_flow_shop_of_one_replica_is_the_flow_shop():
    rng = np.random.default_rng(1)
    for stages, chunks in ((1, 1), (1, 6), (5, 1), (4, 7), (7, 3)):
        t = rng.uniform(0.5, 2.0, size=(stages, chunks))
        h = rng.uniform(0.1, 1.0, size=(stages - 1, chunks))
        rows = [r for j in range(stages) for r in ([t[j]] + ([h[j]] if j < stages - 1 else []))]
        makespan, path = replicated_flow_shop(t, 0.3 * t, h, 1, 0.2)
        assert makespan == pytest.approx(flow_shop_s(rows))
        assert path["blocks_s"] + path["handovers_s"] == pytest.approx(makespan) and path["kv_steps"] == 0
        # more replicas: the path still adds up to the makespan, which is never longer
        for r in (2, 3):
            more, p = replicated_flow_shop(t, 0.3 * t, h, r, 0.2)
            assert p["blocks_s"] + p["handovers_s"] + p["kv_s"] == pytest.approx(more)
            assert p["steady_s"] + p["fill_drain_s"] == pytest.approx(more)
            assert more <= makespan + 1e-12


def test_replicated_flow_shop_against_a_hand_count():
    # one stage, two boards: chunk 0 on board 0 (0 -> 1); chunk 1 on board 1 writes its own keys
    # at 0.25 but waits for chunk 0's, written at 0.25 and sent in 0.1: attention at 0.35, done
    # 0.75 later
    makespan, path = replicated_flow_shop([[1.0, 1.0]], [[0.25, 0.25]], np.zeros((0, 2)), 2, 0.1)
    assert makespan == pytest.approx(1.1)
    assert (path["kv_steps"], path["kv_s"], path["blocks_s"]) == (1, pytest.approx(0.1), pytest.approx(1.0))
    # no keys to wait for: n chunks on r boards take ceil(n / r) chunk times
    for n, r in ((5, 2), (6, 3), (4, 4)):
        assert replicated_flow_shop(np.ones((1, n)), np.zeros((1, n)), np.zeros((0, n)), r, 0.0)[0] == \
            pytest.approx(math.ceil(n / r))
    # two stages of two boards, chunks of 1 s, hand-overs of 0.5 s: board 0 of stage 0 runs chunks
    # 0 and 2 (done at 1 and 2), chunk 2 crosses (2.5) and runs on board 0 of stage 1, free since
    # chunk 0 left it at 2.5: done at 3.5
    makespan, path = replicated_flow_shop(np.ones((2, 4)), np.zeros((2, 4)), np.full((1, 4), 0.5), 2, 0.0)
    assert makespan == pytest.approx(3.5)
    assert (path["stage_steps"], path["handover_steps"]) == (3, 1)
    with pytest.raises(ValueError, match="replicas"):
        replicated_flow_shop([[1.0]], [[0.0]], np.zeros((0, 1)), 0, 0.0)
    with pytest.raises(ValueError, match="hand-over row fewer"):
        replicated_flow_shop([[1.0], [1.0]], [[0.0], [0.0]], np.zeros((0, 1)), 1, 0.0)


def test_chunk_sizes_divide_the_prompt():
    assert chunk_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert chunk_sizes(48) == [1, 2, 4, 8, 16, 48]
    assert chunk_sizes(7) == [1, 7]
    assert chunk_sizes(1) == [1]
    for n in (16, 100, 2048):
        assert all(n % c == 0 for c in chunk_sizes(n))


def test_prefill_workload_counts_the_causal_attention_and_the_gemms():
    spec = spec_of(TINY)
    work = prefill_workload(spec, 32, "int8")
    h, q, kv, i = 64, 64, 32, 128
    block = h * (q + 2 * kv) + q * h + 3 * h * i
    assert work.macs_int8 == 32 * 4 * block + 256 * h  # every token's blocks, the last token's head
    assert work.macs_fp32 == 4 * 2 * 4 * 16 * (32 * 33 // 2)  # layers x (QK, PV) x heads x head_dim x keys
    assert work.handover_bytes == 32 * h * 4 and work.handover_rows == 32


def test_moe_prefill_reads_the_experts_its_tokens_pick():
    moe = dict(TINY, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)
    spec = spec_of(moe)
    h, q, kv, i, L = 64, 64, 32, 128, 4
    attn, expert, router = h * (q + 2 * kv) + q * h, 3 * h * i, 8 * h
    one, two, long = (prefill_workload(spec, n, "int8") for n in (1, 2, 64))
    # a token runs its router and 2 of the 8 experts
    assert two.macs_int8 - one.macs_int8 == L * (attn + 2 * expert + router)
    # one token reads its 2 experts a block, two tokens up to 4, a long prompt all 8 (and each
    # token its embedding row)
    read = [w.description["weight_bytes_read"] for w in (one, two, long)]
    assert read[1] - read[0] == L * 2 * expert + h and read[2] - read[1] == L * 4 * expert + 62 * h
    # every stored weight read once by the long prompt: int8 matrices, fp32 vectors
    dense = prefill_workload(spec_of(TINY), 64, "int8").description["weight_bytes_read"]
    assert read[2] - dense == L * (7 * expert + router)


@pytest.fixture(scope="module")
def four_boards():
    from tvm_spinn.target import register_system, unregister_system

    tag = register_system(tvm_spinn.make_system("prefill-four-boards", boards=4), tag="spinn/prefill-four-boards")
    yield tag
    unregister_system(tag)


@pytest.fixture(scope="module")
def two_chunks(four_boards):
    """A 32-token prompt in two chunks of 16 on four boards (one board per block stage)."""
    return plan_prefill(TINY, four_boards, prompt=32, chunk=16, tp_boards=(1,))


def test_chunked_pipeline_ttft_is_the_hand_count(two_chunks):
    p = two_chunks
    assert p.chunks == 2 and p.chunk == 16 and p.tp_boards == 1
    # 4 blocks, 4 boards of which one runs the head: 3 stage boards, so 2 blocks a stage
    assert (p.blocks_per_stage, p.stages, p.boards_used) == (2, 2, 3)
    t0, t1 = p.stage_chunk_s  # a stage's blocks on the first chunk and on the second (more keys)
    h = p.handover_chunk_s
    assert 0 < h <= t0 <= t1
    # chunk 0 through stage 0, then chunk 1 (t0 + t1); chunk 1 then crosses and runs stage 1,
    # never waiting: chunk 0 is ahead and no slower
    assert p.parts_s["pipeline_s"] == pytest.approx(t0 + t1 + (p.stages - 1) * (h + t1))
    assert p.ttft_s == pytest.approx(sum(p.parts_s.values()))
    assert p.parts_s["head_s"] > 0 and p.parts_s["host_io_s"] > 0
    # the critical path: chunk 0 on stage 0, then chunk 1 on stage 0, its hand-over and stage 1
    cp = p.breakdown["critical_path"]
    assert (cp["stage_steps"], cp["handover_steps"], cp["steady_steps"]) == (3, 1, 2)
    assert cp["blocks_s"] + cp["handovers_s"] + cp["all_reduces_s"] == pytest.approx(p.parts_s["pipeline_s"])
    assert cp["steady_s"] + cp["fill_drain_s"] == pytest.approx(p.parts_s["pipeline_s"])
    assert cp["handovers_s"] == pytest.approx(h) and cp["steady_s"] == pytest.approx(t0 + t1)


def test_relay_paths_shorten_the_hand_over(two_chunks, four_boards):
    """The hand-over between the two stages also crosses the neighbouring boards' free edges:
    faster than the chips' own routes alone, never faster than every edge of the sending board
    at once."""
    direct = plan_prefill(TINY, four_boards, prompt=32, chunk=16, tp_boards=(1,), relays=False)
    p = two_chunks
    assert (direct.stages, direct.chunk) == (p.stages, p.chunk) and direct.stage_chunk_s == p.stage_chunk_s
    assert p.handover_chunk_s < direct.handover_chunk_s and p.ttft_s < direct.ttft_s
    arch = tvm_spinn.target.arch_of(four_boards)
    assert p.handover_chunk_s > 16 * 64 * 4 / (6 * arch.payload_bw("board_pair"))


@pytest.mark.slow  # ~30 s: two plans on six boards
def test_groups_hand_over_in_slices(monkeypatch, register_system):
    """Between groups of two boards each board hands over its half of the chunk's hidden state
    (the last all-reduce's reduce-scatter on one group, its all-gather on the next) where that
    is cheaper than every board sending the whole of it: the hand-over is the cheaper of the two
    plus the receiving board's gather, the same with either."""
    from types import SimpleNamespace

    from tvm_spinn.llm.board_tp import board_groups
    from tvm_spinn.target.topology import board_grid, topology_of
    from tvm_spinn.timing import collectives
    from tvm_spinn.timing.collectives import point_to_point, sliced_hand_over

    _no_simulation(monkeypatch)
    tag = register_system(tvm_spinn.make_system("prefill-six-boards", boards=6), tag="spinn/prefill-six-boards")
    memo = {}

    def two_stages():
        p = plan_prefill(TINY, tag, prompt=32, chunk=16, tp_boards=(2,), memo=memo)
        return next(r for r in p.candidates if r["tp_boards"] == 2 and r["stages"] == 2)

    sliced = two_stages()
    monkeypatch.setattr(collectives, "sliced_hand_over", lambda *a, **k: SimpleNamespace(seconds=math.inf))
    direct = two_stages()
    monkeypatch.undo()
    assert direct["stage_chunk_s"] == sliced["stage_chunk_s"]
    topo = topology_of(tvm_spinn.target.arch_of(tag))
    groups = board_groups(board_grid(6), 2)[:2]
    assert sorted(sliced["boards"])[:4] == sorted(groups[0] + groups[1])
    nbytes = 16 * 64 * 4
    chips = [np.concatenate([np.arange(48) + b * 48 for b in grp]) for grp in groups]
    whole = point_to_point(topo, chips[0], chips[1], nbytes / 48).seconds
    halves = sliced_hand_over(topo, groups[0], groups[1], nbytes).seconds
    assert halves < whole
    assert direct["handover_chunk_s"] - sliced["handover_chunk_s"] == pytest.approx(whole - halves)


@pytest.mark.slow  # ~30-60 s: a plan on nine boards
def test_stages_on_boards_taking_turns(monkeypatch, register_system):
    """Nine boards hold four one-block stages of two boards each and the head: those layouts are
    timed (every chunk size the climb reached), never below the bound, their critical path adding
    up to the pipeline, and the plan the fastest candidate."""
    _no_simulation(monkeypatch)
    tag = register_system(tvm_spinn.make_system("prefill-nine-boards", boards=9), tag="spinn/prefill-nine-boards")
    p = plan_prefill(TINY, tag, prompt=32, tp_boards=(1,))
    turns = [r for r in p.candidates if r["replicas"] == 2]
    assert turns and all(r["replicas"] == 1 for r in p.candidates if r not in turns)
    for r in turns:
        assert (r["stages"], r["blocks_per_stage"], r["boards_used"], len(r["boards"])) == (4, 1, 9, 9)
        assert p.bound_s <= r["ttft_s"] and 0 < r["prefix_chunk_s"] <= r["stage_chunk_s"][0] and r["kv_chunk_s"] > 0
        cp = r["critical_path"]
        assert cp["blocks_s"] + cp["handovers_s"] + cp["kv_s"] == pytest.approx(r["pipeline_s"])
    assert p.ttft_s == min(r["ttft_s"] for r in p.candidates)
    assert p.replicas == next(r for r in p.candidates if r["ttft_s"] == p.ttft_s)["replicas"]
    assert ("taking turns" in p.line()) == ("taking turns" in p.breakdown_line()) == (p.replicas > 1)


def test_ttft_never_below_the_bound(two_chunks, four_boards):
    p = two_chunks
    assert 0 < p.bound_s <= p.ttft_s
    assert 0 < p.efficiency <= 1
    for record in p.candidates:
        assert record["ttft_s"] >= p.bound_s
    spec = spec_of(TINY)
    assert prefill_bound(spec, 32, "int8", tvm_spinn.target.arch_of(four_boards)).total_s == pytest.approx(p.bound_s)


def test_chunk_search_picks_the_minimum(monkeypatch):
    _no_simulation(monkeypatch)
    memo = {}
    searched = plan_prefill(TINY, "spinn/board", prompt=32, memo=memo)
    each = {c: plan_prefill(TINY, "spinn/board", prompt=32, chunk=c, memo=memo).ttft_s for c in chunk_sizes(32)}
    assert searched.ttft_s == pytest.approx(min(each.values()))
    assert searched.chunk == min(each, key=each.get)
    assert searched.ttft_s == min(r["ttft_s"] for r in searched.candidates)
    # one board: every block one stage, the chunks one after another
    assert searched.stages == 1 and searched.blocks_per_stage == 4 and searched.boards_used == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt=65), r"prompt=65 is longer than the model's position table"),
    (dict(prompt=0), r"prompt must be an integer"),
    (dict(prompt=-3), r"prompt must be an integer"),
    (dict(prompt=2.5), r"prompt must be an integer"),
    (dict(prompt=32, chunk=0), r"chunk must be"),
    (dict(prompt=32, chunk=12), r"chunk must be .* dividing the prompt"),
    (dict(prompt=32, dtype="fp16"), r"dtype must be one of"),
    (dict(prompt=32, handover="bf16"), r"handover must be one of"),
    (dict(prompt=32, search="best"), r"search must be 'climb' or 'all'"),
])
def test_bad_input_names_the_field(kwargs, match):
    with pytest.raises(LLMError, match=match):
        plan_prefill(TINY, "spinn/board", **kwargs)


def test_llama_3_1_70b_config_ships_with_its_rope_scaling():
    path = importlib.resources.files("tvm_spinn.llm") / "configs" / "llama-3.1-70b.json"
    cfg = json.loads(path.read_text())
    spec = spec_of(cfg)
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.intermediate, spec.vocab,
            spec.max_positions) == (80, 8192, 64, 8, 28672, 128256, 131072)
    assert cfg["rope_scaling"] == {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    assert cfg["rope_theta"] == 500000.0
    assert math.isclose(spec.params / 1e9, 70.55, rel_tol=1e-3)


@pytest.mark.slow
def test_plan_reports_the_prefill_plans_ttft(monkeypatch):
    from tvm_spinn.llm.plan import plan

    _no_simulation(monkeypatch)
    result = plan(TINY, target="spinn/board", seq=32)
    pre = result.plan["prefill"]
    assert result.ttft_s == pre["ttft_s"] > 0
    assert pre["prompt"] == 32 and pre["bound_s"] <= pre["ttft_s"]
    assert result.ttft_s == min(c["ttft_s"] for c in pre["candidates"])
    assert f"{pre['chunks']} chunk(s) of {pre['chunk']} tokens" in result.table()


def test_a_system_smaller_than_a_board_runs_one_stage(monkeypatch):
    _no_simulation(monkeypatch)
    p = plan_prefill({**TINY, "num_hidden_layers": 2}, "spinn", prompt=32, chunk=16, dtype="fp32")
    assert (p.stages, p.blocks_per_stage, p.tp_boards, p.chunks) == (1, 2, 1, 2)
    assert p.handover_chunk_s == 0 and p.parts_s["head_handover_s"] == 0
    t0, t1 = p.stage_chunk_s
    assert p.parts_s["pipeline_s"] == pytest.approx(t0 + t1)  # one stage: the chunks one after another
    assert p.bound_s <= p.ttft_s


@pytest.mark.parametrize("boards, faults", [(4, dict(dead_boards=(1,))), (4, dict(allocated_boards=(0, 2, 3))),
                                            (3, dict(dead_chips=(50,))), (1, dict(dead_chips=(0, 30)))])
def test_prefill_runs_on_the_live_hardware_only(monkeypatch, register_system, boards, faults):
    """The prompt's stages and head on usable boards only: never a dead board or one outside the
    allocation, a board with a dead chip mapped as it is (three boards, chip 50 dead: board 1
    runs the head on its live chips; one board with two dead chips, its 46 live ones); the time to
    first token is never below the healthy one's."""
    from tvm_spinn.target.faults import usable_boards, whole_boards

    _no_simulation(monkeypatch)
    healthy = tvm_spinn.make_system(f"prefill-{boards}-boards", boards=boards)
    arch = healthy.replace(name=f"prefill-{boards}-boards-faulty", **faults)
    tags = [register_system(a, tag=f"spinn/{a.name}") for a in (healthy, arch)]
    memo = {}
    well, faulty = (plan_prefill(TINY, tag, prompt=32, chunk=16, tp_boards=(1,), memo=memo) for tag in tags)
    dead = set(range(boards)) - set(usable_boards(arch))
    assert faulty.ttft_s >= well.ttft_s
    assert faulty.boards and not set(faulty.boards) & dead
    assert all(not set(r["boards"]) & dead for r in faulty.candidates)
    assert len(faulty.boards) == faulty.boards_used
    if boards == 3:
        # two stages on the whole boards, the head on the board with the dead chip, on its live chips
        assert set(whole_boards(arch)) == {0, 2} and faulty.boards == (0, 1, 2) and faulty.stages == 2
        assert faulty.parts_s["head_s"] >= well.parts_s["head_s"]


@pytest.mark.slow  # ~20-40 s: a plan on four boards
def test_every_alternatives_ttft_is_the_prompts_plan(monkeypatch, register_system):
    """The prompt is planned once for the system: every decode placement's time to first token is
    that plan's (no placement keeps an estimate of its own)."""
    from tvm_spinn.llm.plan import plan

    _no_simulation(monkeypatch)
    tag = register_system(tvm_spinn.make_system("prefill-alt-four", boards=4), tag="spinn/prefill-alt-four")
    result = plan(TINY, target=tag, seq=32)
    alts = result.plan["alternatives"]
    assert len(alts) >= 2 and any(k.startswith("board_tp") for k in alts)
    assert all(a["ttft_s"] == result.ttft_s == result.plan["prefill"]["ttft_s"] for a in alts.values())


def test_pruned_search_picks_the_exhaustive_plan(monkeypatch, four_boards):
    """Leaving untimed the layouts whose lower bound exceeds the best found picks the plan that
    timing every layout the search reaches picks; what it leaves out is slower than the plan."""
    _no_simulation(monkeypatch)
    memo = {}
    for search in ("climb", "all"):
        full = plan_prefill(TINY, four_boards, prompt=32, memo=memo, search=search, prune=False)
        pruned = plan_prefill(TINY, four_boards, prompt=32, memo=memo, search=search)
        assert pruned.line() == full.line() and pruned.breakdown_line() == full.breakdown_line()
        assert (pruned.chunk, pruned.tp_boards, pruned.replicas, pruned.stages, pruned.boards) == \
            (full.chunk, full.tp_boards, full.replicas, full.stages, full.boards)
        assert pruned.ttft_s == full.ttft_s
        kept = [r for r in full.candidates if r in pruned.candidates]
        assert len(kept) == len(pruned.candidates)
        assert all(r["ttft_s"] > pruned.ttft_s for r in full.candidates if r not in pruned.candidates)


def test_the_chunk_block_keeps_the_faster_of_fused_and_separate_projections(monkeypatch):
    """The prompt's block is mapped with its q/k/v and gate/up projections fused and each on its
    own, and the faster kept: the plan is never slower than either alone (a fused GEMM's output
    is split over the chips in concatenated column order, so the slices that part gate from up
    gather it over the chip links)."""
    from tvm_spinn.llm.prefill import chunk

    _no_simulation(monkeypatch)
    own = chunk.ChunkStep

    def ttft(fuse):
        with monkeypatch.context() as m:
            if fuse is not None:  # the block's describer builds its step through chunk.ChunkStep
                m.setattr(chunk, "ChunkStep", lambda model, spec, context, _=True: own(model, spec, context, fuse))
            return plan_prefill(TINY, "spinn/board", prompt=32, chunk=16).ttft_s

    fused, separate, both = ttft(True), ttft(False), ttft(None)
    assert fused != pytest.approx(separate, rel=1e-6)  # the two blocks map differently
    assert both == pytest.approx(min(fused, separate), rel=1e-9)


@pytest.mark.slow
def test_the_prompts_head_is_the_decode_plans_head_described_once(monkeypatch):
    from tvm_spinn.llm import describe as described
    from tvm_spinn.llm.graphs import Head
    from tvm_spinn.llm.plan import plan

    _no_simulation(monkeypatch)
    heads = []
    real = described.describe

    def counted(module, *args, **kwargs):
        if isinstance(module, Head):
            heads.append(module)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(described, "describe", counted)
    result = plan(TINY, target="spinn/board", seq=32)
    # one user's head: the decode plan's described part serves the prompt's plan too
    assert len(heads) == 1
    heads.clear()
    alone = plan_prefill(TINY, "spinn/board", prompt=32)
    assert len(heads) == 1  # on its own the prompt's plan describes its head itself
    assert json.dumps(result.plan["prefill"], sort_keys=True) == json.dumps(alone.to_dict(), sort_keys=True)
    heads.clear()
    plan(TINY, target="spinn/board", seq=32, batch=2)
    assert len(heads) == 2  # two users' head is not the prompt's
