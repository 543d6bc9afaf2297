"""An all-reduce streamed between its producer and its consumer chunk by chunk
(:func:`tvm_spinn.timing.collectives.streamed_all_reduce`)."""

from __future__ import annotations

import pytest

from tvm_spinn.timing import collectives as C

from _boards import N, board_setting


def _linear(a: float, b: float):
    return lambda m: a + b * m


def test_one_chunk_is_the_three_one_after_another():
    cost = _linear(10e-6, 3e-9)
    assert C.streamed_all_reduce(cost, N, 4e-6, 2e-6, 1) == pytest.approx(4e-6 + cost(N) + 2e-6, abs=1e-15)


@pytest.mark.parametrize("chunks", [2, 4, 16])
def test_a_link_bound_all_reduce_hides_all_but_a_chunk_of_its_neighbours(chunks):
    """A latency ``a`` and ``b`` a byte (a busiest edge serialising the chunks): with the
    producer faster than the links, the row's last chunk leaves ``b N`` after the first chunk is
    made, so the whole takes the first chunk's production, the all-reduce, and the consumer's
    last chunk (a FIFO server's closed form)."""
    a, b, produce, consume = 12e-6, 3e-9, 5e-6, 3e-6
    assert produce / chunks <= b * N / chunks  # the links are the slower
    got = C.streamed_all_reduce(_linear(a, b), N, produce, consume, chunks)
    assert got == pytest.approx(produce / chunks + a + b * N + consume / chunks, rel=1e-12)


def test_a_slow_producer_binds_the_stream():
    """A producer slower than the links: the last chunk is made at ``P`` and its own
    all-reduce follows (the closed form's other branch)."""
    a, b, produce, chunks = 12e-6, 3e-9, 400e-6, 8
    got = C.streamed_all_reduce(_linear(a, b), N, produce, 0.0, chunks)
    assert got == pytest.approx(produce + a + b * N / chunks, rel=1e-12)


def test_board_group_all_reduce_streamed_stays_between_its_floor_and_unchunked():
    """With the planner's own cost function (the pipelined packed-tree all-reduce of a group of
    four boards of 24): more chunks never cost more, and every figure lies between the
    all-reduce alone (itself above the group's floor) and the three one after another."""
    topo, order = board_setting(24, "spinn2-24-boards-overlap")
    boards = [0, 1, 4, 5]
    grid = [[c + b * 48 for c in order] for b in boards]
    memo: dict = {}

    def cost(m: float) -> float:
        if m not in memo:
            memo[m] = C.board_group_all_reduce(topo, grid, m, pipelined=True, fuse_gather=True).seconds
        return memo[m]

    floor = sum(C.board_group_floor(topo, boards, N))
    whole = cost(N)
    assert whole >= floor
    produce, consume = 6e-6, 3e-6
    figures = [C.streamed_all_reduce(cost, N, produce, consume, k) for k in (1, 2, 4, 8)]
    assert figures[0] == pytest.approx(produce + whole + consume, abs=1e-15)
    assert all(later <= earlier + 1e-15 for earlier, later in zip(figures, figures[1:]))
    assert all(whole <= f <= produce + whole + consume + 1e-15 for f in figures)
    assert figures[-1] < figures[0]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_chunks_are_refused(bad):
    with pytest.raises(ValueError, match="chunks"):
        C.streamed_all_reduce(_linear(1e-6, 1e-9), N, 0.0, 0.0, bad)


def test_a_negative_time_is_refused():
    with pytest.raises(ValueError, match="produce_s"):
        C.streamed_all_reduce(_linear(1e-6, 1e-9), N, -1e-6, 0.0, 2)


def _played_out(cost_of, nbytes, produce, consume, c):
    """The schedule written out chunk by chunk in plain Python (the reference)."""
    done = 0.0
    for i in range(c):
        delivered = max(produce * (j + 1) / c + cost_of(nbytes * (i - j + 1) / c) for j in range(i + 1))
        done = max(delivered, done) + consume / c
    return min(done, produce + cost_of(nbytes) + consume)


@pytest.mark.parametrize("chunks", [3, 17, 64])
def test_matches_the_schedule_played_out_with_a_concave_cost(chunks):
    cost = lambda m: 2e-6 + 3e-9 * m ** 0.8  # noqa: E731 (latency plus a sub-linear part)
    got = C.streamed_all_reduce(cost, N, 5e-6, 3e-6, chunks)
    assert got == pytest.approx(_played_out(cost, N, 5e-6, 3e-6, chunks), rel=1e-12)


def test_too_many_chunks_are_refused():
    from tvm_spinn.timing.collectives.overlap import MAX_CHUNKS

    C.streamed_all_reduce(_linear(1e-6, 1e-9), N, 1e-6, 1e-6, MAX_CHUNKS)
    with pytest.raises(ValueError, match=f"1..{MAX_CHUNKS}"):
        C.streamed_all_reduce(_linear(1e-6, 1e-9), N, 1e-6, 1e-6, MAX_CHUNKS + 1)
    with pytest.raises(ValueError, match="chunks"):
        C.streamed_all_reduce(_linear(1e-6, 1e-9), N, 1e-6, 1e-6, 10 ** 6)


def test_the_most_chunks_take_little_cpu_time():
    import resource

    from tvm_spinn.timing.collectives.overlap import MAX_CHUNKS

    t0 = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    C.streamed_all_reduce(_linear(1e-6, 1e-9), N, 1e-6, 1e-6, MAX_CHUNKS)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_utime - t0 < 2.0
