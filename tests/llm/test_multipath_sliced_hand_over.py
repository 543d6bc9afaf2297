"""The sliced hand-over between groups of boards over every edge-disjoint path of each pair
(tvm_spinn.timing.collectives.multipath_sliced_hand_over), checked against the one-pair
multipath transfer, the board edges' rates and the sliced hand-over over the chips' routes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.target.topology import board_paths, edge_rate, path_cost, topology_of
from tvm_spinn.timing.collectives import (multipath_point_to_point, multipath_sliced_hand_over, sliced_hand_over,
                                          water_fill)


@pytest.fixture(scope="module")
def sixty_four():
    arch = tvm_spinn.make_system("spinn2-64-boards", boards=64)  # an 8 x 8 torus of boards
    return arch, topology_of(arch)


def test_one_pair_is_the_multipath_transfer(sixty_four):
    _, topo = sixty_four
    for src, dst in ((0, 1), (0, 9), (5, 42)):
        one = multipath_sliced_hand_over(topo, [src], [dst], 32768.0)
        assert one.seconds == pytest.approx(multipath_point_to_point(topo, src, dst, 32768.0).seconds, rel=1e-12)


def test_pairs_sharing_edges_split_their_rates(sixty_four, monkeypatch):
    """Two pairs whose paths cross the same directed edges: every edge carries the bytes of the
    paths crossing it within the hand-over's time at its rate (each path's share as each pair
    splits its slice), and no board sends its slice faster than over all six of its edges."""
    from tvm_spinn.timing.collectives import boards

    _, topo = sixty_four
    src, dst, n = [0, 1], [2, 3], 32768.0
    # board 0 -> 2 and 1 -> 3 (the nearest free boards, in order)
    paths = [board_paths(topo, 0, 2), board_paths(topo, 1, 3)]
    count: dict = {}
    for own in paths:
        for p in own:
            for e in p:
                count[e] = count.get(e, 0) + 1
    assert max(count.values()) > 1  # the two pairs' paths do share edges
    sent = []
    real = boards.water_fill

    def spy(rates, latencies, nbytes):
        out = real(rates, latencies, nbytes)
        sent.append(out[1])
        return out

    monkeypatch.setattr(boards, "water_fill", spy)
    cost = multipath_sliced_hand_over(topo, src, dst, n)
    assert len(sent) == 2 and all(float(np.sum(b)) == pytest.approx(n / 2) for b in sent)
    load: dict = {}
    for own, shares in zip(paths, sent):
        for p, b in zip(own, shares):
            for e in p:
                load[e] = load.get(e, 0.0) + float(b)
    rate = edge_rate(topo)
    for e, nbytes in load.items():
        assert nbytes <= float(rate[e]) * cost.seconds * (1 + 1e-12), e
    assert cost.bytes_per_link == pytest.approx(max(load.values()))
    assert cost.seconds >= n / 2 / (6 * float(rate.max()))


def test_a_path_runs_at_its_scarcest_edge_share(sixty_four, monkeypatch):
    """A path's rate is the least of its edges' shares: an edge only that path crosses, slowed
    to the share the path gets on an edge it shares with the other pair, does not slow the
    hand-over; slowed further, it does."""
    _, topo = sixty_four
    src, dst, n = [0, 1], [2, 3], 32768.0
    count: dict = {}
    for own in (board_paths(topo, 0, 2), board_paths(topo, 1, 3)):
        for p in own:
            for e in p:
                count[e] = count.get(e, 0) + 1
    # a path of the first pair with an edge of its own and one the two pairs share
    path = next(p for p in board_paths(topo, 0, 2) if len(p) == 2 and sorted(count[e] for e in p) == [1, 2])
    alone = next(e for e in path if count[e] == 1)
    shared = next(e for e in path if count[e] == 2)
    rate = edge_rate(topo)
    assert rate[alone] == rate[shared]
    base = multipath_sliced_hand_over(topo, src, dst, n).seconds

    def slowed(factor):
        slow = rate.copy()
        slow[alone] = rate[alone] / factor
        slow.flags.writeable = False
        monkeypatch.setitem(topo.memo, ("edge_rate",), slow)
        return multipath_sliced_hand_over(topo, src, dst, n).seconds

    assert slowed(2.0) == pytest.approx(base, rel=1e-12)
    assert slowed(4.0) > base * (1 + 1e-6)


def test_faster_than_over_the_chips_routes_where_edges_are_free(sixty_four):
    _, topo = sixty_four
    src, dst, n = [0, 1, 8, 9], [2, 3, 10, 11], 32768.0
    multi = multipath_sliced_hand_over(topo, src, dst, n)
    assert multi.algorithm == "sliced-multipath" and multi.nbytes == n
    assert multi.seconds < sliced_hand_over(topo, src, dst, n).seconds
    assert multi.seconds >= n / 4 / (6 * float(edge_rate(topo).max()))


def test_bad_groups_are_refused(sixty_four):
    _, topo = sixty_four
    for bad in (([0, 1], [1, 2]), ([0, 1], [2]), ([0, 0], [2, 3]), ([], [])):
        with pytest.raises(ValueError, match="multipath_sliced_hand_over"):
            multipath_sliced_hand_over(topo, *bad, 32768.0)
    with pytest.raises(ValueError, match="nbytes"):
        multipath_sliced_hand_over(topo, [0], [1], np.inf)


@pytest.mark.slow  # ~20-40 s: a small Llama's slices described and mapped on boards
def test_board_tp_hands_over_between_groups_over_the_multipath_slices(monkeypatch, register_system):
    """At batch 1 the ``board_tp`` placement's hand-over between two groups is the cheapest of
    every board sending the whole row, the slices over the chips' routes and the slices over
    every edge-disjoint path: its candidates with several groups hand over exactly those
    seconds the multipath slices save less than without them, and never more."""
    import importlib

    from tqdm.auto import tqdm

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tvm_spinn.llm import board_tp
    from tvm_spinn.llm.describe import describe
    from tvm_spinn.llm.spec import spec_of
    from tvm_spinn.target import arch_of, get_target
    from tvm_spinn.timing import collectives

    P = importlib.import_module("tvm_spinn.llm.plan")
    cfg = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 4096, "num_attention_heads": 8,
           "num_key_value_heads": 2, "num_hidden_layers": 8, "vocab_size": 1000, "max_position_embeddings": 512}
    # board edges a tenth of their rate: the small row's hand-over is bound by the edges' bandwidth
    board = tvm_spinn.make_system("spinn2-handover-boards", boards=6, pes_per_chip=4)
    tag = register_system(board.replace(board_link_bw_bytes_s=board.board_link_bw_bytes_s / 10),
                          tag="spinn/handover-boards")
    target = get_target(tag)
    arch, spec, seq = arch_of(target), spec_of(cfg), 64
    parts = P._parts(P._meta_model(cfg, spec), spec, 1, seq)
    described = {"head": describe(parts[2][1], parts[2][2], target, "int8")}
    monkeypatch.setattr(board_tp, "TP_BOARDS", (2,))
    # a streamed block charged a second more, so that the kept candidate keeps its blocks resident
    # over several groups (each degree keeps one candidate): the hand-overs are what is tested
    run_s = board_tp._run_s
    monkeypatch.setattr(board_tp, "_run_s", lambda resident, streamed, blocks, fit, saved_s=0.0:
                        run_s(resident, streamed, blocks, fit, saved_s) + max(0, blocks - fit))
    memo: dict = {}
    calls = []
    real = collectives.multipath_sliced_hand_over

    def spy(topo, src, dst, nbytes):
        cost = real(topo, src, dst, nbytes)
        calls.append((tuple(src), tuple(dst), cost.seconds))
        return cost

    def run():
        return board_tp.records(cfg, spec, arch, target, "int8", 1, seq, 4, described, spec.params,
                                seq * spec.kv_bytes_per_token(4), tqdm(disable=True), memo=memo)

    monkeypatch.setattr(collectives, "multipath_sliced_hand_over", spy)
    with_multi = run()
    monkeypatch.setattr(collectives, "multipath_sliced_hand_over",
                        lambda *a: dataclasses.replace(real(*a), seconds=np.inf))
    without = run()
    assert calls and all(len(s) == len(d) == 2 for s, d, _ in calls)
    assert with_multi.keys() == without.keys()
    several = [k for k, r in with_multi.items() if r["meta"]["groups"] >= 2]
    assert several, with_multi.keys()
    # the multipath slices are cheaper between these groups: the hand-overs took them
    assert all(with_multi[k]["meta"]["handoff_decode_s"] < without[k]["meta"]["handoff_decode_s"] for k in several)
    for k in with_multi:
        a, b = with_multi[k]["meta"]["handoff_decode_s"], without[k]["meta"]["handoff_decode_s"]
        assert a <= b
        assert with_multi[k]["decode_s"] - without[k]["decode_s"] == pytest.approx(a - b, abs=1e-12)
