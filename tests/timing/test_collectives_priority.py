"""The packed trees of every span carrying the row at once
(:func:`tvm_spinn.timing.collectives._priority_packing`) and the event simulation that plays
their schedule out (:func:`tvm_spinn.timing.collectives._chunked_schedule`): the simulation
against a timeline worked by hand, and the figure against the closed form it is never below,
the group's floor and the trees of one span cap."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_spinn.target.topology import BoardGraph
from tvm_spinn.timing import collectives as C

from _boards import N, board_setting


def _setting(boards: int):
    return board_setting(boards, f"spinn2-priority-{boards}-boards")


def _line(rate: float, hop: float) -> BoardGraph:
    """Three boards in a line, 0 - 1 - 2 (edge 0 one way, edge 3 the other)."""
    nb = np.full((3, 6), -1, dtype=np.int64)
    nb[0, 0], nb[1, 3], nb[1, 0], nb[2, 3] = 1, 0, 2, 1
    return BoardGraph(nodes=3, neighbors=nb, link_bw=np.full(18, rate), link_hop_s=np.full(18, hop),
                      board_link=np.ones((3, 6), dtype=bool))


@pytest.mark.parametrize("chunks", [1, 4, 32])
def test_the_simulation_of_one_tree_is_the_timeline_by_hand(chunks):
    """One tree on three boards in a line, rooted at the middle one: the ends send chunk ``c``
    to the middle, where it is at ``(c + 1) t + a`` (``t`` a chunk's time on an edge, ``a`` the
    hop); the middle passes it on to each end as soon as it has it from the other, back-to-back,
    so the last chunk reaches the ends at ``(m + 1) t + 2 a``: the fluid figure (the busiest
    edge, ``n / r``, plus the span, ``2 a``) and one chunk's store-and-forward."""
    rate, hop = 1e8, 4.5e-6
    graph = _line(rate, hop)
    shapes = [(1, ((0, 1 * 6 + 3), (2, 1 * 6 + 0)))]
    seconds = C._chunked_schedule(graph, np.arange(3), shapes, np.array([1.0]), 3, N, chunks, 1e-4)
    t = N / chunks / rate
    assert seconds == pytest.approx((chunks + 1) * t + 2 * hop)
    # the middle board alone a member: done when the last chunk has reached it from both ends
    assert C._chunked_schedule(graph, np.array([1, 0, 2]), [(0, ((1, 3), (2, 0)))], np.array([1.0]), 1, N, chunks,
                               1e-4) == pytest.approx(chunks * t + hop)


def test_a_play_that_leaves_a_member_without_its_sums_is_refused():
    """Two edges between the same two boards are no tree: neither board has heard from all its
    neighbours but one, nothing is passed on, and the play names the member left without its
    sums rather than returning a figure."""
    twice = ((1, 0, 0, 1), (1, 0, 2, 3))  # (node, parent, link down, link up)
    with pytest.raises(RuntimeError, match="packed tree 0 left member 0 without its sums"):
        C._played_schedule((twice,), (1e8,) * 4, (4.5e-6,) * 4, (1.0,), 2, float(N), 4, 1e-4)
    # one of the two edges is a tree: each board's four chunks cross it back-to-back, the last
    # arriving after four chunks' time and the hop
    assert C._played_schedule((twice[:1],), (1e8,) * 4, (4.5e-6,) * 4, (1.0,), 2, float(N), 4, 1e-4) == \
        pytest.approx(N / 1e8 + 4.5e-6)


@pytest.mark.parametrize("boards, group", [(4, range(3)), (24, range(16))])
def test_the_priority_figure_is_its_schedule_played_out_and_above_the_floor(boards, group):
    topo, order = _setting(boards)
    graph = topo.board_graph()
    members = np.asarray(list(group))
    halo = np.setdiff1d(np.unique(graph.neighbors[members]), members)
    region = np.concatenate([members, halo[halo >= 0]])
    seconds, load, first, hops, weight = C._priority_packing(graph, region, members.size, N)
    full, span, span_hops, shapes = graph.memo[("packed_shapes", region.tobytes(), members.size)][:4]
    fluid = C._priority_seconds(graph, full, span, weight, N)
    # the weights of one span cap: the cheapest closed form's, or another's that plays out cheaper
    assert C._priority_fluid(graph, region, members.size, N)[0] <= fluid + 1e-12
    played = C._chunked_schedule(graph, region, shapes, weight, members.size, N, C._SCHEDULE_CHUNKS, fluid)
    assert seconds == pytest.approx(max(fluid, played))
    # finer chunks approach the closed form (within 2% at 64 chunks a part)
    finer = C._chunked_schedule(graph, region, shapes, weight, members.size, N, 64, fluid)
    assert fluid * 0.999 <= finer <= fluid * 1.02
    bandwidth, latency = C.board_group_floor(topo, members, N)
    assert bandwidth + latency <= fluid <= seconds
    # the closed form: the busiest edge with every tree's bytes plus the shortest span used,
    # at least; the weights split the whole row and the loads are theirs
    assert fluid >= graph.link_seconds(load * N) + first - 1e-12
    assert weight.sum() == pytest.approx(1.0) and np.all(weight >= 0)
    np.testing.assert_allclose(load, weight @ full)
    # board_group_all_reduce takes it where it is the cheapest, never below the floor
    cost = C.board_group_all_reduce(topo, [[c + b * 48 for c in order] for b in members], N,
                                    board_gather=False, pipelined=True)
    assert bandwidth + latency <= cost.seconds <= seconds + 1e-12


@pytest.mark.parametrize("boards, group", [(4, range(3)), (24, range(16))])
def test_a_bound_stops_the_play_only_where_the_figure_could_not_get_below_it(boards, group):
    """Given the caller's figure and the figure it already has, the weights are played out only
    while they could still win: None comes back exactly where every weight played out gives a
    figure no cheaper than the bound, and otherwise the same weights and figure."""
    topo, _ = _setting(boards)
    graph = topo.board_graph()
    members = np.asarray(list(group))
    halo = np.setdiff1d(np.unique(graph.neighbors[members]), members)
    region = np.concatenate([members, halo[halo >= 0]])
    whole = C._priority_packing(graph, region, members.size, N)
    gather = 3.5e-6  # a fixed phase after the all-reduce

    def figure(T, first):
        return T + gather

    for bound in (figure(whole[0], whole[2]) * 0.9, figure(whole[0], whole[2]),
                  np.nextafter(figure(whole[0], whole[2]), np.inf), np.inf):
        got = C._priority_packing(graph, region, members.size, N, figure, bound)
        if figure(whole[0], whole[2]) < bound:
            assert got is not None and got[0] == whole[0] and np.array_equal(got[4], whole[4])
        else:
            assert got is None or figure(got[0], got[2]) >= bound
