"""The timeline of a chunked pipeline (:mod:`tvm_spinn.training.chunk_schedule`): the order the
bits fix (forwards ascending, input gradients descending, weight gradients ascending after the
micro-batch's last input-gradient pass) against hand-made event lists; bad input named."""

from __future__ import annotations

import itertools

import pytest

from tvm_spinn.training import TrainingError
from tvm_spinn.training.chunk_schedule import chunk_ends, chunk_times


def test_two_stages_two_chunks_by_hand():
    """2 stages, 1 micro-batch of 2 chunks, every pass 1 s, no hand-over time. Stage 1's first
    B pass is the last chunk's, after both forwards; both W passes wait for chunk 0's B pass."""
    done, ends = chunk_times(1, 2, [1, 1], [1, 1], [1, 1])
    assert done == {("f", 0, 0, 0): 1.0, ("f", 0, 0, 1): 2.0, ("f", 1, 0, 0): 2.0, ("f", 1, 0, 1): 3.0,
                    ("b", 1, 0, 1): 4.0, ("b", 1, 0, 0): 5.0, ("b", 0, 0, 1): 5.0, ("b", 0, 0, 0): 6.0,
                    ("w", 1, 0, 0): 6.0, ("w", 1, 0, 1): 7.0, ("w", 0, 0, 0): 7.0, ("w", 0, 0, 1): 8.0}
    assert ends == [8.0, 7.0]


def test_independent_slots_by_hand():
    """The same passes as independent slots: stage 1 runs chunk 0's B before chunk 1's forward
    (B first on a tie), each W pass right after its own B pass where the stage is free."""
    done, ends = chunk_times(1, 2, [1, 1], [1, 1], [1, 1], chunk_order=False)
    assert done == {("f", 0, 0, 0): 1.0, ("f", 0, 0, 1): 2.0, ("f", 1, 0, 0): 2.0, ("b", 1, 0, 0): 3.0,
                    ("b", 0, 0, 0): 4.0, ("f", 1, 0, 1): 4.0, ("w", 0, 0, 0): 5.0, ("b", 1, 0, 1): 5.0,
                    ("b", 0, 0, 1): 6.0, ("w", 1, 0, 0): 6.0, ("w", 0, 0, 1): 7.0, ("w", 1, 0, 1): 7.0}
    assert ends == [7.0, 7.0]


def test_joint_weight_pass_by_hand():
    """One W pass over the micro-batch's tokens (1.5 s) after its last B pass on each stage."""
    done, ends = chunk_times(1, 2, [1, 1], [1, 1], [1, 1], joint_weight_s=[1.5, 1.5])
    assert done[("w", 1, 0, 0)] == 6.5 and done[("w", 0, 0, 0)] == 7.5
    assert sum(1 for k in done if k[0] == "w") == 2
    assert ends == [7.5, 6.5]


def test_hand_over_times_delay_the_neighbour():
    """A forward's output reaches the next stage 0.5 s after it ends, a B pass's the previous
    stage 0.25 s after."""
    done, _ = chunk_times(1, 1, [1, 1], [1, 1], [0, 0], [0.5, 0.0], [0.0, 0.25])
    assert done[("f", 1, 0, 0)] == 2.5 and done[("b", 1, 0, 0)] == 3.5 and done[("b", 0, 0, 0)] == 4.75


def test_a_tokenwise_last_stage_runs_each_chunk_back_at_once():
    """A token-wise last stage (a head) runs chunk c's B right after its forward; the block stage
    before it still starts its B passes with the last chunk's, once the head returned it."""
    done, _ = chunk_times(1, 3, [1, 1], [1, 1], [0, 0], tokenwise=1)
    assert done[("b", 1, 0, 0)] < done[("f", 1, 0, 1)]  # chunk 0 back before chunk 1 goes forward
    assert done[("b", 0, 0, 2)] < done[("b", 0, 0, 1)] < done[("b", 0, 0, 0)]
    assert done[("b", 0, 0, 2)] >= done[("b", 1, 0, 2)]


@pytest.mark.parametrize("stages, mb, chunks", [(3, 2, 4), (4, 3, 2), (2, 1, 5)])
def test_every_pass_after_what_it_reads(stages, mb, chunks):
    """Unequal stages: every pass once, no two passes of a stage at once, each after its
    operands: forwards in ascending chunk order, B passes descending, W passes ascending after
    the micro-batch's chunk-0 B pass."""
    f = [1.0 + 0.25 * s for s in range(stages)]
    b = [1.5 - 0.25 * s for s in range(stages)]
    w = [0.5 + 0.125 * s for s in range(stages)]
    done, ends = chunk_times(mb, chunks, f, b, w, [0.1] * stages, [0.2] * stages)
    assert len(done) == 3 * stages * mb * chunks
    dur = {"f": f, "b": b, "w": w}
    for s in range(stages):
        spans = sorted((done[k] - dur[k[0]][s], done[k]) for k in done if k[1] == s)
        assert all(a[1] <= b_[0] + 1e-12 for a, b_ in zip(spans, spans[1:]))
        assert ends[s] == spans[-1][1]
    for s, m, c in itertools.product(range(stages), range(mb), range(chunks)):
        start = {k: done[k] - dur[k[0]][k[1]] for k in done}
        if s:
            assert start[("f", s, m, c)] >= done[("f", s - 1, m, c)] + 0.1 - 1e-12
        if s < stages - 1:
            assert start[("b", s, m, c)] >= done[("b", s + 1, m, c)] + 0.2 - 1e-12
        else:
            assert start[("b", s, m, c)] >= done[("f", s, m, chunks - 1)] - 1e-12
        if c:
            assert done[("f", s, m, c - 1)] <= start[("f", s, m, c)] + 1e-12
            assert done[("b", s, m, c)] <= start[("b", s, m, c - 1)] + 1e-12
            assert done[("w", s, m, c - 1)] <= start[("w", s, m, c)] + 1e-12
        assert start[("w", s, m, c)] >= done[("b", s, m, 0)] - 1e-12


def test_one_chunk_is_independent_slots():
    """With one chunk a micro-batch is a slot: ``m`` micro-batches of one chunk have the
    timeline of one micro-batch of ``m`` independent slots."""
    args = ([1.0, 1.5, 1.25], [1.5, 1.0, 1.25], [0.75, 0.5, 1.0], [0.2] * 3, [0.1] * 3)
    one, one_end = chunk_times(4, 1, *args)
    free, free_end = chunk_times(1, 4, *args, chunk_order=False)
    assert one_end == free_end
    assert {(k, s, c): t for (k, s, m, c), t in free.items()} == {(k, s, m): t for (k, s, m, _), t in one.items()}


def test_the_chunk_order_costs_time_behind_a_slower_head():
    """3 block stages (F = B = W = 1 s) and a slower token-wise head (F = B = 1.5 s), 2
    micro-batches of 8 chunks: as independent slots the head paces every slot (55 s); in the
    order the bits fix, the last micro-batch's B passes start only once its last chunk left the
    head, and its W passes after its chunk-0 B pass (69 s); one W pass a micro-batch that does
    the eight passes' work in 6 s ends 2 s sooner."""
    args = (2, 8, [1.0] * 3 + [1.5], [1.0] * 3 + [1.5], [1.0] * 3 + [0.0])
    assert max(chunk_times(*args, tokenwise=1, chunk_order=False)[1]) == 55.0
    assert max(chunk_times(*args, tokenwise=1)[1]) == 69.0
    assert max(chunk_times(*args, tokenwise=1, joint_weight_s=[6.0] * 3 + [0.0])[1]) == 67.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(microbatches=0), "microbatches must be an integer >= 1"),
    (dict(chunks=True), "chunks must be an integer >= 1"),
    (dict(weight_s=[1.0]), "weight_s must be 2 non-negative seconds"),
    (dict(backward_s=[1.0, -1.0]), "backward_s must be 2 non-negative seconds"),
    (dict(forward_hand_s=[0.0]), "forward_hand_s must be 2"),
    (dict(tokenwise=2), "tokenwise must be 0 or 1"),
    (dict(joint_weight_s=[1.0, 1.0, 1.0]), "joint_weight_s must be 2"),
])
@pytest.mark.parametrize("simulate", [chunk_times, chunk_ends])
def test_bad_input_is_named(kwargs, message, simulate):
    args = dict(microbatches=1, chunks=2, forward_s=[1.0, 1.0], backward_s=[1.0, 1.0], weight_s=[1.0, 1.0])
    args.update(kwargs)
    with pytest.raises(TrainingError, match=message):
        simulate(**args)


def test_chunk_ends_is_the_event_simulation():
    """:func:`chunk_ends` (each start refreshes three stages' candidates) gives the stages' ends
    of :func:`chunk_times` (every stage scanned at every start) bit for bit, over random
    stages, micro-batches, chunks, pass times (ties included: quarter seconds), hand-overs,
    token-wise heads, joint W passes and independent slots."""
    import random

    rng = random.Random(20261129)
    for _ in range(400):
        stages, mb, chunks = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 5)
        step = rng.choice([None, 0.25])

        def times(low: float = 0.0, high: float = 2.0) -> list:
            return [round(rng.uniform(low, high) / step) * step if step else rng.uniform(low, high)
                    for _ in range(stages)]

        args = (mb, chunks, times(0.1), times(0.1), rng.choice([times(), [0.0] * stages]),
                rng.choice([None, times(0.0, 0.5)]), rng.choice([None, times(0.0, 0.5)]))
        kwargs = dict(tokenwise=rng.choice([0, 1]) if stages > 1 else 0, chunk_order=rng.random() < 0.75,
                      joint_weight_s=rng.choice([None, [rng.choice([None, t]) for t in times()]]))
        assert chunk_ends(*args, **kwargs) == chunk_times(*args, **kwargs)[1], (args, kwargs)


def _gpt2_small_24_boards():
    transformers = pytest.importorskip("transformers")
    from tvm_spinn.target.arch import make_system
    from tvm_spinn.training.planner import Split, _Comms, _spec, _step_time

    spec = _spec(transformers.GPT2Config())
    arch = make_system("gpt2-small-24-boards", boards=24)
    comms = _Comms(arch, True)
    # the 24-board plan of bench/training.py: TP 12 x PP 12 x DP 4, a head stage of 96 chips 4
    # slots behind, 2 micro-batches of one sequence in 32 chunks, ZB-H1
    split = Split(12, 12, 4, 0, 1, 2, False, True, 32, "dp,tp,pp", 96, False, 4, True)
    return spec, split, _step_time(spec, split, 256, "adamw", arch, comms), arch, comms


def test_the_planned_pipeline_as_a_timeline():
    """GPT-2 small's 24-board plan: its passes as independent slots take no longer than the
    planner's pipeline term and at least 94% of it (the term's rule on the same passes; a head
    stage lagging behind the blocks maps onto its passes less tightly); in the chunk order the
    bits fix the pipeline takes longer, and one W pass a micro-batch gives some of it back."""
    from tvm_spinn.training.planner.timeline import pipeline_timeline

    spec, split, step, arch, comms = _gpt2_small_24_boards()
    assert len(step.passes_s) == split.stages
    for f, b, w, hand_f, hand_b in step.passes_s[:split.pp]:  # a block stage's passes sum to its slot
        assert f + b + w == pytest.approx(max(s for *_, s in step.stages_s[:-1]))
    assert step.passes_s[-1][2] == 0.0  # the head's slot is its links': nothing to defer
    t = pipeline_timeline(spec, split, step, 256, arch, comms)
    assert 0.94 * step.pipeline_s <= t["slots"] <= step.pipeline_s * (1 + 1e-9)
    assert t["ordered"] > 1.1 * t["slots"]
    assert t["slots"] < t["joint"] < t["ordered"]


def test_the_search_charges_the_chunk_order():
    """A chunked split's step is charged its passes' ordered timeline where that is longer than
    the pipeline term (GPT-2 small's 24-board split: 0.093 s as slots, 0.116 s in order); the
    other parts stay, and a split without chunks is left as it is."""
    import dataclasses

    from tvm_spinn.training.planner.timeline import charge_chunk_order, pipeline_timeline

    spec, split, step, arch, comms = _gpt2_small_24_boards()
    charged = charge_chunk_order(split, step)
    ordered = pipeline_timeline(spec, split, step, 256, arch, comms)["ordered"]
    assert charged.pipeline_s == ordered > 1.1 * step.pipeline_s
    assert charged.bubble_s == pytest.approx(step.bubble_s + ordered - step.pipeline_s)
    assert charged.total_s - step.total_s == pytest.approx(ordered - step.pipeline_s)
    assert (charged.compute_s, charged.dp_comm_s, charged.passes_s) == (step.compute_s, step.dp_comm_s, step.passes_s)
    whole = dataclasses.replace(split, chunks=1)
    assert charge_chunk_order(whole, step) is step


def test_a_timeline_needs_a_pipeline():
    from tvm_spinn.training.planner import StepTime
    from tvm_spinn.training.planner.timeline import pipeline_timeline

    spec, split, _, arch, comms = _gpt2_small_24_boards()
    with pytest.raises(ValueError, match="no passes"):
        pipeline_timeline(spec, split, StepTime(1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0), 256, arch, comms)
