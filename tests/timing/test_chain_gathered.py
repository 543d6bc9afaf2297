"""The chain all-reduces whose multicasts deliver every chain's result to every chip of them all."""

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.target.topology import ring_order, topology_of
from tvm_spinn.timing import collectives as C


@pytest.fixture(scope="module")
def board():
    return topology_of(tvm_spinn.make_system("chain-gathered", boards=1))


def test_one_chain_is_the_chain_all_reduce(board):
    """Delivering to the chain's own chips only is :func:`chain_all_reduce`."""
    order = ring_order(board, 12)
    for nbytes in (512, 4096):
        one, ref = C.chain_all_reduce_gathered(board, [order], nbytes), C.chain_all_reduce(board, order, nbytes)
        assert one.seconds == pytest.approx(ref.seconds) and one.steps == ref.steps and one.segments == ref.segments


def test_steps_follow_the_chain_and_the_deepest_tree(board):
    """m + c + D - 2 steps, D the farthest chip from a chain's last rank (a whole board's chips:
    their own links are all the board's, so D is the hop count of the shortest routes)."""
    order = ring_order(board, 48)
    tp = 12
    chains = [order[j * tp:(j + 1) * tp] for j in range(4)]
    depth = max(int(board.hops(np.full(47, c[-1]), order[order != c[-1]]).max()) for c in chains)
    for m in (1, 4):
        cost = C.chain_all_reduce_gathered(board, chains, 512, segments=(m,))
        assert cost.steps == m + tp + depth - 2
        assert cost.op == "all_reduce" and cost.algorithm == "chain" and cost.ranks == tp
    # each step moves a segment over a hop: more bytes never cost less, more chips to reach more steps
    small, large = (C.chain_all_reduce_gathered(board, chains, n) for n in (512, 4096))
    assert large.seconds > small.seconds
    alone = C.chain_all_reduce(board, chains[0], 512, segments=(1,))
    assert C.chain_all_reduce_gathered(board, chains, 512, segments=(1,)).steps > alone.steps


def test_bad_chains_are_refused(board):
    with pytest.raises(ValueError, match="one length"):
        C.chain_all_reduce_gathered(board, [[0, 1, 2], [3, 4]], 64)
    with pytest.raises(ValueError, match="two chains"):
        C.chain_all_reduce_gathered(board, [[0, 1], [1, 2]], 64)
    with pytest.raises(ValueError, match="one length"):
        C.chain_all_reduce_gathered(board, [], 64)


def _attention_end(sp_gather_tensor: int, sp: int = 4, nbytes: int = 512):
    """A one-layer program whose output (tensor 2, the PV product's partial sums, ``nbytes`` a
    group) is chain all-reduced in each tensor-parallel group and then all-gathered over all
    the chips."""
    from types import SimpleNamespace

    from tvm_spinn.mapping.shard import Collective

    program = SimpleNamespace(layers=[SimpleNamespace(kind="matmul", inputs=(0, 1), output=2)])
    colls = [Collective(1, "all_reduce", 2, nbytes, False, "tp"),
             Collective(1, "all_gather", sp_gather_tensor, nbytes * sp, True, "all")]
    return program, colls


@pytest.mark.parametrize("tp, sp, nbytes", [(6, 4, 512), (12, 4, 512), (12, 2, 512), (2, 12, 512), (3, 8, 512),
                                         (3, 8, 4096)])
def test_the_gather_rides_on_the_chains_where_cheaper(board, tp, sp, nbytes):
    """On one board the chains deliver a small sum to every chip sooner than the chains and the
    gather after them, whatever the groups: the trees' depth is paid once, by the first
    segment, and the later segments follow at the links' rate. A larger sum's trees to every
    chip load the chains' links too (three-chip chains, 4 KB: the gather apart is the cheaper).
    The mapper keeps the cheaper and charges what it keeps (the other way round:
    :func:`test_the_choice_costs_the_chains_apart_at_once`)."""
    from types import SimpleNamespace

    from tvm_spinn.mapping.system import _comm, group_order

    program, colls = _attention_end(2, sp, nbytes)
    plan = SimpleNamespace(tp=tp, sp=sp, dp=1, chips=tp * sp, collectives=colls)
    order = group_order(board, tp, sp)
    chains = [order[j * tp:(j + 1) * tp] for j in range(sp)]
    got = _comm(board, program, plan)
    fused = C.chain_all_reduce_gathered(board, chains, nbytes)
    apart = C.chains_all_reduce(board, chains, nbytes).seconds + C.all_gather(board, order, nbytes * sp).seconds
    assert (fused.seconds < apart) == (nbytes == 512)
    if fused.seconds < apart:
        assert [(layer, c.op, c.algorithm, ready) for layer, c, ready in got] == [(1, "all_reduce", "chain", None)]
        assert got[0][1].seconds == pytest.approx(fused.seconds)
    else:
        assert [c.op for _, c, _ in got] == ["all_reduce", "all_gather"]
    # a gather of another tensor is not what the chains deliver: both run
    other, colls = _attention_end(0, sp, nbytes)
    got = _comm(board, other, SimpleNamespace(tp=tp, sp=sp, dp=1, chips=tp * sp, collectives=colls))
    assert [c.op for _, c, _ in got] == ["all_reduce", "all_gather"]


def test_the_choice_costs_the_chains_apart_at_once(board, monkeypatch):
    """The chains without the gather are costed as the fused ones are, all ``sp`` of them on the
    links together (:func:`~tvm_spinn.timing.collectives.chains_all_reduce`): where that plus
    the gather is the cheaper, the mapper runs the chain and the gather."""
    from types import SimpleNamespace

    from tvm_spinn.mapping import system as S

    program, colls = _attention_end(2, 12)
    plan = SimpleNamespace(tp=2, sp=12, dp=1, chips=24, collectives=colls)
    assert [c.op for _, c, _ in S._comm(board, program, plan)] == ["all_reduce"]
    free = C.CollectiveCost("all_reduce", "chain", 0.0, 0.0, 0, 0, 0, 2, 512.0)
    monkeypatch.setattr(S, "chains_all_reduce", lambda topo, chains, nbytes, relay_pes=None: free)
    board.memo.clear()
    try:
        assert [c.op for _, c, _ in S._comm(board, program, plan)] == ["all_reduce", "all_gather"]
    finally:
        board.memo.clear()


def test_chains_at_once_cost_at_least_one_alone(board):
    """Several chains at once: one chain is :func:`chain_all_reduce`; more never cost less than
    one of them alone, and chains that share links (two of 12 chips on one board) cost more."""
    order = ring_order(board, 24)
    one = C.chain_all_reduce(board, order[:12], 512)
    assert C.chains_all_reduce(board, [order[:12]], 512).seconds == one.seconds
    for tp in (2, 3, 4, 6, 12):
        chains = [order[j * tp:(j + 1) * tp] for j in range(24 // tp)]
        alone = max(C.chain_all_reduce(board, ch, 512).seconds for ch in chains)
        assert C.chains_all_reduce(board, chains, 512).seconds >= alone * (1 - 1e-12)
    assert C.chains_all_reduce(board, [order[:12], order[12:]], 512).seconds > 1.2 * one.seconds
    with pytest.raises(ValueError, match="two chains"):
        C.chains_all_reduce(board, [[0, 1], [1, 2]], 64)


def test_some_board_plan_rides_the_gather(board):
    """On one board's chips a 6 x 4 attention plan's chains reach all 24 chips sooner than the
    chain and the gather after it (the choice above is not vacuous)."""
    order = ring_order(board, 24)
    fused = C.chain_all_reduce_gathered(board, [order[j * 6:(j + 1) * 6] for j in range(4)], 512)
    apart = C.chain_all_reduce(board, order[:6], 512).seconds + C.all_gather(board, order, 2048).seconds
    assert fused.seconds < apart


@pytest.mark.parametrize("bad", [(), (0,), (4, -1), (2.5,), (True,)])
def test_bad_segment_counts_are_refused(board, bad):
    chains = [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="segments"):
        C.chain_all_reduce_gathered(board, chains, 512, segments=bad)
    with pytest.raises(ValueError, match="segments"):
        C.chain_all_reduce(board, chains[0], 512, segments=bad)
