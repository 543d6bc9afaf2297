"""The training planner's links carrying several concurrent transfer sets together
(``_Comms.joint_busy``, ``_Comms.transfers``) and the head stage's slot priced with them."""

from __future__ import annotations

import importlib.resources
import json

import numpy as np
import pytest

from tvm_spinn.llm.spec import spec_of
from tvm_spinn.target import make_system
from tvm_spinn.target.registry import arch_of
from tvm_spinn.target.topology import edge_rate
from tvm_spinn.training.planner import Split, _Comms, _step_time


def _busiest(topo, parts) -> float:
    """The busiest chip link's or board edge's seconds of transfer sets all on their chip
    routes, from the topology's routes: each link's bytes over its rate, each board edge
    group's bytes (its chip links') over the edge's rate."""
    chip = np.zeros(topo.nodes * 6)
    edge = np.zeros(topo.boards * 6)
    for src, dst, nbytes in parts:
        for s, d, n in zip(np.asarray(src).tolist(), np.asarray(dst).tolist(), np.broadcast_to(nbytes, len(src))):
            _, links = topo.route_links(np.array([s]), np.array([d]))
            for link in links.tolist():
                chip[link] += n
                if topo.link_group[link] >= 0:
                    edge[topo.link_group[link]] += n
    rate = edge_rate(topo)
    edges = np.divide(edge, rate, out=np.zeros_like(edge), where=rate > 0)
    return max(float((chip / topo.link_bw).max()), float(edges.max()))


def test_transfer_sets_on_one_board_load_their_links_together():
    """On one board every transfer takes its chip route: two sets that cross the same links
    take the sum of their bytes there, sets on other links the busier of the two; both against
    the links' loads added here route by route."""
    comms = _Comms(arch_of("spinn/board"), True)
    a = (np.array([0, 1, 2]), np.array([40, 41, 42]), 1e5)
    b = (np.array([0, 1, 2]), np.array([40, 41, 42]), 3e5)  # the same routes
    c = (np.array([44, 45]), np.array([5, 6]), 2e5)
    for parts in ([a], [a, b], [a, c], [a, b, c]):
        assert comms.joint_busy(parts) == pytest.approx(_busiest(comms.topo, parts), rel=1e-12), parts
    assert comms.joint_busy([a, b]) == pytest.approx(4 * comms.joint_busy([a]), rel=1e-12)
    assert comms.joint_busy([a, c]) < comms.joint_busy([a]) + comms.joint_busy([c])
    assert comms.joint_busy([]) == 0.0
    assert comms.joint_busy([(np.array([3]), np.array([3]), 1e5)]) == 0.0  # a chip to itself moves nothing


def test_a_collectives_transfers_are_its_algorithms_pairs():
    """``transfers``: a ring all-gather sends each neighbour half of the ``(c - 1) / c`` of the
    message a rank receives, each way; a chain reduce-scatter the running sums down the chain
    and the last rank's shards to their owners; a chain all-reduce the sums down and back up."""
    comms = _Comms(arch_of("spinn/board"), True)
    groups = np.array([[3, 7, 11, 15], [20, 21, 22, 23]])
    n = 4096.0

    def pairs(src, dst, sizes):
        out = {}
        for s, d, b in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            out[(s, d)] = out.get((s, d), 0.0) + b
        return out

    ring = pairs(*comms.transfers("all_gather", "ring", groups, n))
    want = {}
    for g in groups.tolist():
        for i in range(4):
            for j in (i + 1, i - 1):
                want[(g[i], g[j % 4])] = want.get((g[i], g[j % 4]), 0.0) + n / 4 * 3 / 2
    assert ring == pytest.approx(want)
    chain = pairs(*comms.transfers("reduce_scatter", "chain", groups, n))
    want = {(g[i], g[i + 1]): n for g in groups.tolist() for i in range(3)}
    for g in groups.tolist():
        for i in range(3):
            want[(g[3], g[i])] = want.get((g[3], g[i]), 0.0) + n / 4
    assert chain == pytest.approx(want)
    both = pairs(*comms.transfers("all_reduce", "chain", groups, n))
    assert both == pytest.approx({**{(g[i], g[i + 1]): n for g in groups.tolist() for i in range(3)},
                                  **{(g[i + 1], g[i]): n for g in groups.tolist() for i in range(3)}})
    with pytest.raises(ValueError, match="'tree'"):
        comms.transfers("all_gather", "tree", groups, n)


def _gpt2_small():
    cfg = json.loads((importlib.resources.files("tvm_spinn.llm") / "configs" / "gpt2-xl.json").read_text())
    return spec_of({**cfg, "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024})


def test_the_head_stages_slot_is_its_links_busy_time_with_its_transfers_together():
    """GPT-2 small's 24-board split (TP 12 x PP 12 x DP 4, a head stage of 96 chips a replica 4
    slots behind, 32 chunks of 8 tokens): in a steady slot the head's forward all-gather of
    the slot's hidden states, its backward's reduce-scatter of the input gradient and its
    loss sums (chains in rank order) and its hand-overs to and from the last block stage run
    at once. Its slot is the links' busy time with all of them together (built here pair by
    pair: the ring's neighbours, the chains, the hand-overs), which is below the sum of each
    collective's own busiest link and the hand-overs' (they meet on few links), and above the
    head's compute."""
    spec = _gpt2_small()
    system = make_system("gpt2-small-24-boards", boards=24)
    comms = _Comms(system, True)
    split = Split(12, 12, 4, 0, 1, 2, False, True, 32, "dp,tp,pp", 96, head_lag=4, zero_bubble=True)
    tokens, tp, heads = 8, 12, 96
    act = 4 * tokens * 768
    head = split.head_grid()
    last = np.ascontiguousarray(split.grid()[:, split.pp - 1, :].T).reshape(-1)
    mine = head[:, np.arange(tp) * heads // tp].reshape(-1)
    ring_src, ring_dst = [], []
    for g in head.tolist():
        for i in range(heads):
            ring_src += [g[i], g[i]]
            ring_dst += [g[(i + 1) % heads], g[(i - 1) % heads]]
    ring = (np.array(ring_src), np.array(ring_dst), act * (heads - 1) / heads / 2)
    down_src = np.concatenate([head[:, :-1].reshape(-1), np.repeat(head[:, -1], heads - 1)])
    down_dst = np.concatenate([head[:, 1:].reshape(-1), head[:, :-1].reshape(-1)])
    scatter = (down_src, down_dst, np.concatenate([np.full(head[:, 1:].size, act), np.full(head[:, 1:].size,
                                                                                          act / heads)]))
    loss = (np.concatenate([head[:, :-1].reshape(-1), head[:, 1:].reshape(-1)]),
            np.concatenate([head[:, 1:].reshape(-1), head[:, :-1].reshape(-1)]), 3 * 4 * tokens)
    hand = (np.concatenate([last, mine]), np.concatenate([mine, last]), act / tp)
    # the tied table's rows of the slot's tokens to the first stage and their gradients back
    first = np.ascontiguousarray(split.grid()[:, 0, :].T).reshape(-1)
    rows = (np.concatenate([mine, first]), np.concatenate([first, mine]), 4 * tokens * 768 / tp)
    sets = [ring, scatter, loss, hand, rows]
    together = comms.joint_busy(sets)
    apart = (comms.collective_parts("all_gather", head, act)[1]
             + comms.collective_parts("reduce_scatter", head, act, 8)[1]
             + comms.collective_parts("all_reduce", head, 3 * 4 * tokens, chain=True)[1]
             + comms.handover(*hand[:2], hand[2]) + comms.handover(*rows[:2], rows[2]))
    step = _step_time(spec, split, 256, "adamw", system, comms)
    _, compute, _, _, slot = step.stages_s[-1]
    assert compute < together < apart, (compute, together, apart)
    assert together > comms.joint_busy(sets[:4])  # the rows load the head's links too
    assert together >= max(comms.joint_busy([one]) for one in sets)
    assert slot == pytest.approx(together, rel=1e-9), (slot, together)


def test_a_slots_collectives_are_costed_by_the_algorithm_they_are_priced_by():
    """One board, a group of 8 ranks, a 24 KB reduce-scatter in the reproducible mode: the
    direct algorithm is the one priced (the cheapest in seconds), its busiest link's time above
    the chain's. The slot's links carry the direct's transfers (each rank's piece to every other
    rank, built here), never the chain's lighter load; where the algorithm priced is one whose
    transfers are not listed (the multicast trees of the fastest mode) there is no joint."""
    comms = _Comms(arch_of("spinn/board"), True)
    group = np.array([[8, 9, 10, 11, 12, 13, 14, 15]])
    n = 24576.0
    seconds, busy, algorithm = comms.chosen("reduce_scatter", group, n)
    assert algorithm == "direct" and (seconds, busy) == comms.collective_parts("reduce_scatter", group, n)
    src, dst = np.array([(s, d) for s in group[0] for d in group[0] if s != d]).T
    direct = comms.joint_busy([(src, dst, n / 8)])
    chain = comms.joint_busy([comms.transfers("reduce_scatter", "chain", group, n)])
    assert chain < busy, (chain, busy)
    none = (np.array([], np.int64), np.array([], np.int64), 0.0)
    joint = comms.slot_busy([("reduce_scatter", group, n, 1, False)], *none)
    assert joint == pytest.approx(direct, rel=1e-12) and joint >= busy * (1 - 1e-9), (joint, busy)
    hand = (np.array([0, 1]), np.array([20, 30]), 1e4)
    both = comms.slot_busy([("reduce_scatter", group, n, 1, False)], *hand)
    assert max(joint, comms.joint_busy([hand])) <= both <= joint + comms.joint_busy([hand]) * (1 + 1e-12)
    fast = _Comms(arch_of("spinn/board"), False)
    assert fast.chosen("all_gather", group, n)[2] == "multicast"
    assert fast.slot_busy([("all_gather", group, n, 1, False)], *none) is None


def test_transfers_between_two_boards_split_over_the_board_edges():
    """Two boards: every transfer from one board to the other may take the four edge-disjoint
    board paths (one board edge each, equal rates and latencies), the bytes of each direction
    split evenly over its four edges, split here by hand; a set that stays on a board keeps its
    chip routes. The joint is the cheaper of that and every transfer on its chip route, at
    least each set's own busiest link and at most their sum."""
    system = make_system("two-boards", boards=2)
    comms = _Comms(system, True)
    topo = comms.topo
    rate = edge_rate(topo)
    paths = {(0, 1): topo.board_paths(0, 1), (1, 0): topo.board_paths(1, 0)}
    assert all(len(p) == 4 and all(len(e) == 1 for e in p) for p in paths.values())
    across = (np.array([0, 1, 2, 50, 51]), np.array([48, 49, 48, 3, 4]), np.array([4e5, 2e5, 2e5, 1e5, 3e5]))
    inside = (np.array([5, 6, 60]), np.array([9, 10, 70]), 1e5)
    edge = np.zeros(topo.boards * 6)
    for (a, b), total in (((0, 1), 8e5), ((1, 0), 4e5)):
        for (e,) in paths[(a, b)]:
            edge[e] += total / 4
    by_edges = max(float((edge / rate).max()), _busiest(topo, [inside]))
    want = min(_busiest(topo, [across, inside]), by_edges)
    got = comms.joint_busy([across, inside])
    assert got == pytest.approx(want, rel=1e-12), (got, want, by_edges)
    assert got == pytest.approx(by_edges, rel=1e-12)  # the chip routes meet on few board links
    own = [comms.joint_busy([one]) for one in (across, inside)]
    assert max(own) <= got <= sum(own) * (1 + 1e-12), (own, got)
