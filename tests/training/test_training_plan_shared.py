"""The training planner's steady slots on shared PEs and its sequence-parallel position rows:
a steady slot's passes take the PEs' list schedule of their GEMMs' tiles, the fill and drain's
slot its passes in series, and a rank synchronises only the position rows' elements its own
tokens take."""

from __future__ import annotations

import dataclasses

import pytest

from tvm_spinn.target import make_system
from tvm_spinn.timing.gemm import gemm_seconds
from tvm_spinn.timing.gemm_overlap import gemm_tiles, shared_pes_seconds
from tvm_spinn.training.planner import Split, _Comms, _shared_pes_saving, _spec, _step_time, _untouched_rows
from tvm_spinn.training.planner.model import _block_gemms, _position_rows

GPT2_SMALL = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024,
              "vocab_size": 50257, "n_inner": None, "tie_word_embeddings": True}
SPLIT = Split(12, 12, 4, 0, 1, 2, False, True, 32, "dp,tp,pp", 96, False, 4, True)


@pytest.fixture(scope="module")
def setup():
    system = make_system("gpt2-small-24-boards", boards=24)
    return _spec(GPT2_SMALL), system, _Comms(system, True)


def test_a_layers_passes_on_shared_pes_against_a_schedule_built_here(setup):
    """GPT-2 small's layer at 8 rows a slot (TP 12, weights resident, the chunk's keys from the
    stash): the saving is the passes' GEMMs in series less the PEs' schedule of the forward's
    chain (Q/K/V, the attention's two matmuls, the output projection, the MLP), the input
    gradients' chain in reverse and the projections' weight gradients free, each GEMM as gemm_seconds prices
    it; between nothing and what the tiles' work over the PEs leaves. The attention's key and
    value gradients are on the backward's chain (the Q/K/V projection's gradients read them),
    not free."""
    spec, system, comms = setup
    weights, attention = _block_gemms(spec, 8, 256, 12, 1, 32)
    qkv, proj, up, down = weights
    scores, context = attention
    order = [(qkv, True), (scores, False), (context, False), (proj, True), (up, True), (down, True)]
    fwd = [gemm_tiles(system, m, k, n, b, on) for (m, k, n, b), on in order]

    def d_a(g, on):  # dA = dY B^T
        m, k, n, b = g
        return gemm_tiles(system, m, n, k, b, on)

    def d_b(g):  # dB = A^T dY, dY just produced on chip
        m, k, n, b = g
        return gemm_tiles(system, k, m, n, b, True)

    # the backward's chain: each GEMM's input gradient in reverse order; the values' gradient dV
    # feeds the fused Q/K/V projection's gradients, as does the keys' dK, so each runs on the
    # chain right after its matmul's input gradient; only the projections' weight gradients
    # are read by no later GEMM of the pass
    bwd = [d_a(down, True), d_a(up, True), d_a(proj, True), d_a(context, False), d_b(context),
           d_a(scores, False), d_b(scores), d_a(qkv, True)]
    wgt = [d_b(down), d_b(up), d_b(proj), d_b(qkv)]
    series = (sum(gemm_seconds(system, m, k, n, b, on) for (m, k, n, b), on in order)
              + sum(gemm_seconds(system, m, n, k, b, on) for (m, k, n, b), on in order)
              + sum(gemm_seconds(system, k, m, n, b, True) for (m, k, n, b), _ in order))
    saving = _shared_pes_saving(system, weights, comms, True, attention, False, False, 1)
    assert saving == pytest.approx(series - shared_pes_seconds(system, [fwd, bwd], wgt), rel=1e-12)
    pes = system.pes_per_chip
    work = sum(g.tiles * g.tile_s for g in fwd + bwd + wgt) / pes
    assert 0.05 * series < saving <= series - work


def test_the_steady_slots_share_the_pes_and_the_fill_does_not(setup, monkeypatch):
    """The 24-board split's block stages: a steady slot's compute is its passes in series less the
    layer's saving (against the same step priced with no saving), and the fill and drain (each
    stage's first and last slot alone: nothing to pair a pass with) are priced the same."""
    from tvm_spinn.training.planner import step as step_module

    spec, system, comms = setup
    weights, attention = _block_gemms(spec, 8, 256, 12, 1, 32)
    saving = _shared_pes_saving(system, weights, comms, True, attention, False, False, 1)
    shared = _step_time(spec, SPLIT, 256, "adamw", system, comms)
    monkeypatch.setattr(step_module, "_shared_pes_saving", lambda *args: 0.0)
    series = _step_time(spec, SPLIT, 256, "adamw", system, _Comms(system, True))
    layers = spec.layers // SPLIT.pp
    for (j, c, *_), (k, d, *_) in zip(shared.stages_s, series.stages_s):
        assert j == k
        assert c == pytest.approx(d if j == SPLIT.pp else d - layers * saving, rel=1e-12), j

    def fill(step):  # the pipeline beyond its steady slots at the pacing stage's slot
        return step.pipeline_s - (SPLIT.slots - 1) * max(s for *_, s in step.stages_s)

    assert fill(shared) == pytest.approx(fill(series), rel=1e-12)
    assert shared.pipeline_s < series.pipeline_s


def _positions_of_each_rank(seq: int, chunks: int, micro_batch: int, tp: int) -> list:
    """Which positions each rank's tokens take over a step, enumerated: every slot (one chunk of
    each of the micro-batch's sequences, its rows sequence after sequence) split into contiguous
    row blocks over the ranks as the sequence-parallel split cuts them."""
    length = seq // chunks
    taken = [set() for _ in range(tp)]
    for c in range(chunks):
        rows = [c * length + p for _ in range(micro_batch) for p in range(length)]
        base, extra = divmod(len(rows), tp)
        start = 0
        for r in range(tp):
            size = base + (r < extra)
            taken[r].update(rows[start:start + size])
            start += size
    return taken


@pytest.mark.parametrize("chunks, micro_batch, tp", [(32, 1, 12), (1, 1, 12), (4, 2, 12), (8, 4, 6), (1, 1, 1)])
def test_the_busiest_ranks_position_rows_from_each_ranks_tokens(setup, chunks, micro_batch, tp):
    """The rows a rank synchronises are the positions its own tokens take in some slot: the
    busiest rank's count, from an enumeration of every slot's rows. The 24-board split (32 chunks
    of 8 tokens, one sequence a slot, over TP 12) gives ranks 0-7 one row of each chunk (32
    positions) and ranks 8-11 none: more than a twelfth of the 256 rows."""
    spec, _, _ = setup
    split = dataclasses.replace(SPLIT, tp=tp, chunks=chunks, micro_batch=micro_batch, sequence_parallel=tp > 1)
    taken = _positions_of_each_rank(256, chunks, micro_batch, tp)
    busiest = max(len(t) for t in taken)
    assert _position_rows(split, 256) == busiest
    assert _untouched_rows(spec, 256, 0, _position_rows(split, 256)) == (1024 - busiest) * 768
    if (chunks, micro_batch, tp) == (32, 1, 12):
        assert [len(t) for t in taken] == [32] * 8 + [0] * 4


def test_a_rank_synchronises_the_position_rows_its_tokens_take(setup):
    """With sequence parallelism over TP 12 a rank synchronises only the position rows its own
    tokens take (the busiest rank's, enumerated here), without it all 256 rows below the
    sequence length; so the first stage's exposed synchronisation is at most the all-reduce of
    its layer and those rows, below the one with all 256 rows and at least that of its layer's
    weights."""
    spec, system, comms = setup
    h = 768
    assert _untouched_rows(spec, 256, 0) == (1024 - 256) * h
    assert _untouched_rows(spec, 256, 3, 32) == 0
    busiest = max(len(t) for t in _positions_of_each_rank(256, SPLIT.chunks, SPLIT.micro_batch, SPLIT.tp))
    step = _step_time(spec, SPLIT, 256, "adamw", system, comms)
    groups = SPLIT.grid()[:, 0, :]
    layer = 3 * h * h // 12 + 3 * h // 12 + h * h // 12 + 2 * 4 * h * h // 12 + 4 * h // 12 + 6 * h
    rows_all = comms.collective("all_reduce", groups, 4 * (layer + 256 * h))
    rows_own = comms.collective("all_reduce", groups, 4 * (layer + busiest * h))
    weights_only = comms.collective("all_reduce", groups, 4 * (layer - 6 * h))
    assert weights_only <= step.dp_comm_s <= rows_own * (1 + 1e-9) < rows_all


def test_one_stage_pairs_each_later_slot_with_the_one_before(setup, monkeypatch):
    """One stage of two micro-batches (GPT-2 small on 2 chips, TP 2): the second forward shares
    the PEs with the first backward, and nothing else pairs (the first forward and the last
    backward run alone): the step is one layer-saving per block layer below the passes in series."""
    from tvm_spinn.training.planner import step as step_module

    spec, _, _ = setup
    system = make_system("gpt2-small-2-chips", chips=2)
    split = Split(2, 1, 1, 0, 4, 2, False, True)
    comms = _Comms(system, True)
    weights, attention = _block_gemms(spec, 4 * 256, 256, 2, 4, 1)
    fresh = step_module._fresh_attention(spec, split, 4 * 256, system)
    saving = _shared_pes_saving(system, weights, comms, False, attention, fresh, False, 1)
    shared = _step_time(spec, split, 256, "adamw", system, comms)
    monkeypatch.setattr(step_module, "_shared_pes_saving", lambda *args: 0.0)
    series = _step_time(spec, split, 256, "adamw", system, _Comms(system, True))
    assert saving > 0
    assert series.pipeline_s - shared.pipeline_s == pytest.approx((split.slots - 1) * spec.layers * saving, rel=1e-9)


def test_sharing_the_pes_never_takes_a_slot_below_its_dram_traffic(setup, monkeypatch):
    """However much the PEs' schedule gave back, both passes' DRAM traffic (the activations
    stashed by the forward and read back by the backward, on one DRAM port) still takes its
    time: with an absurd saving every block stage's steady compute stays positive, at least the
    stashed activations' bytes (one slot's layer inputs of 8 rows x 768, written once and read
    once) over the DRAM bandwidth."""
    from tvm_spinn.training.planner import step as step_module

    spec, system, _ = setup
    monkeypatch.setattr(step_module, "_shared_pes_saving", lambda *args: 1e3)
    step = _step_time(spec, SPLIT, 256, "adamw", system, _Comms(system, True))
    floor = 2 * 4 * 8 * 768 // 12 / system.dram_bw_bytes_s
    for j, c, *_ in step.stages_s:
        if j < SPLIT.pp:
            assert c >= floor, j


def test_each_gemm_shapes_tile_search_runs_once_a_plan(monkeypatch):
    """A plan prices each GEMM (its pass times) and schedules it on shared PEs from one tile
    search per shape and operand placement, shared by the search's full and lower-bound
    costings: the mapper's tile choice runs once per GEMM shape for the whole plan."""
    import tvm_spinn.timing.gemm_overlap as overlap_module
    import tvm_spinn.training.planner.search as search_module
    import tvm_spinn.training.planner.step as step_module
    from tvm_spinn.training import plan_training

    searched, shared = {}, []

    def counted(choose):
        def choose_counted(g, arch, pes, resident=False):
            searched[(g, pes, resident)] = searched.get((g, pes, resident), 0) + 1
            return choose(g, arch, pes, resident)
        return choose_counted

    def saving(module):
        original = module._shared_pes_saving

        def counted_saving(*args):
            shared.append(args[1:])
            return original(*args)
        return counted_saving

    monkeypatch.setattr(overlap_module, "choose_matmul_tile", counted(overlap_module.choose_matmul_tile))
    for module in (search_module, step_module):
        monkeypatch.setattr(module, "_shared_pes_saving", saving(module))
    config = {**GPT2_SMALL, "n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 1000}
    plan = plan_training(config, make_system("four-chips", chips=4), seq=64, global_batch=8, pp=2)
    assert plan.split.pp > 1 and shared  # steady slots were scheduled on shared PEs
    assert searched and max(searched.values()) == 1, sorted(n for n in searched.values() if n > 1)
