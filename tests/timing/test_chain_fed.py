"""A chain whose result the ranks use only in their own work before the next chain over them.

References: an event-by-event walk of the second chain's first segment down the ranks (each
rank ready once the first chain's multicast has reached it and its own work is done), the
first chain's own cost, and the mapper's collectives for a program with and without a
collective between the two chains.
"""

from types import SimpleNamespace

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.mapping.shard import Collective
from tvm_spinn.mapping.system import _comm, group_order
from tvm_spinn.target.topology import ring_order, topology_of
from tvm_spinn.timing import collectives as C
from tvm_spinn.timing.system import chain_fed_chain, collective_cost


@pytest.fixture(scope="module")
def board():
    return topology_of(tvm_spinn.make_system("chain-fed", boards=1))


def _walk(board, ranks, first, step2, work=3e-6):
    """When the second chain's first segment leaves its last rank, from the first chain's end
    of its chain hops (``first``'s seconds less its tree), walking the ranks one by one: rank
    ``i`` holds the result ``h_i`` tree hops after that, does ``work``, and forwards the
    segment one ``step2`` after it arrived or once ready, whichever is later."""
    hops = board.hops(np.full(len(ranks), ranks[-1]), ranks)
    tree = first.step_s - board.relay_word_s
    at = None
    for i, h in enumerate(hops):
        ready = h * tree + work
        at = ready if at is None else max(at + step2, ready)
    return at - work - (len(ranks) - 1) * step2  # the first chain's tree as the second sees it


@pytest.mark.parametrize("c", [12, 48])
def test_the_tree_is_charged_as_the_next_chain_needs_it(board, c):
    """A split row's sum (4 B) before its context's chain (512 B): the first chain's tree costs
    what the walk finds, never more than its own deepest route, and here less (the chain's
    last rank is nearer its first than its farthest rank: the first twelve chips of a one-hop
    cycle of the board, and the whole cycle)."""
    ranks = ring_order(board, c)
    first = collective_cost(board, ranks, "all_reduce", 4, False)
    second = C.chain_all_reduce(board, ranks, 512)
    fed = chain_fed_chain(board, ranks, first, second)
    depth = int(board.hops(np.full(c - 1, ranks[-1]), ranks[:-1]).max())
    tree = first.step_s - board.relay_word_s
    step2 = min(k.step_s for k in second.by_segments)
    assert fed.seconds == pytest.approx(first.seconds - depth * tree + _walk(board, ranks, first, step2))
    assert fed.seconds < first.seconds
    assert fed.algorithm == "chain" and fed.segments == first.segments and fed.step_s == first.step_s


def test_a_long_tail_keeps_the_first_chains_cost(board):
    """A 64 KB first chain's later segments cross its tree for longer than the second chain's
    first step (by hand: ``m - 1`` segments over one chip link each): they would share links
    with the second chain's segments, so nothing is saved; a 4-byte sum (one segment, no tail)
    is still fed."""
    arch = tvm_spinn.arch_of(tvm_spinn.get_target("spinn/board"))
    ranks = ring_order(board, 12)
    second = C.chain_all_reduce(board, ranks, 512)
    step2 = min(k.step_s for k in second.by_segments)
    first = C.chain_all_reduce(board, ranks, 65536)
    assert first.segments > 1
    assert (first.segments - 1) * 65536 / first.segments / arch.payload_bw("chip") > step2
    assert chain_fed_chain(board, ranks, first, second).seconds == first.seconds
    small = collective_cost(board, ranks, "all_reduce", 4, False)
    assert small.segments == 1 and chain_fed_chain(board, ranks, small, second).seconds < small.seconds


def test_a_chain_ending_far_from_its_start_saves_nothing(board):
    """Ranks along a line: the last rank's farthest is the first, which the next chain needs
    first: the first chain's cost is unchanged."""
    ranks = [0, 1, 2, 3]  # one row of the board, one hop apart
    assert board.hops(np.full(3, 3), np.array(ranks[:3])).tolist() == [3, 2, 1]
    first = collective_cost(board, np.array(ranks), "all_reduce", 4, False)
    second = C.chain_all_reduce(board, ranks, 512)
    assert chain_fed_chain(board, ranks, first, second) is first


def _program(between: bool):
    """Two layers: a 4 B chain before the first (a split row's sum) and a 512 B chain at the
    end, whose blocks are then gathered over all the chips (the context); ``between``: an
    all-gather over the tp group before the second layer too."""
    program = SimpleNamespace(layers=[SimpleNamespace(kind="softmax", inputs=(0,), output=1),
                                      SimpleNamespace(kind="matmul", inputs=(1, 3), output=2)])
    colls = [Collective(0, "all_reduce", 0, 4, False, "tp")]
    if between:
        colls.append(Collective(1, "all_gather", 3, 64, True, "tp"))
    colls += [Collective(2, "all_reduce", 2, 512, False, "tp"), Collective(2, "all_gather", 2, 512 * 4, True, "all")]
    return program, colls


def test_the_mapper_feeds_the_sum_to_the_context_chain(board):
    """The mapper charges the sum's chain as fed to the context's (the fused chains over all the
    chips, their first group the tp group); a collective between them syncs the ranks: then the
    chain's own cost."""
    program, colls = _program(False)
    plan = SimpleNamespace(tp=12, sp=4, dp=1, chips=48, collectives=colls)
    order = group_order(board, 12, 4)
    got = _comm(board, program, plan)
    assert [(layer, c.op, c.algorithm) for layer, c, _ in got] == [(0, "all_reduce", "chain"),
                                                                   (2, "all_reduce", "chain")]
    groups = [order[j * 12:(j + 1) * 12] for j in range(4)]
    own = [collective_cost(board, g, "all_reduce", 4, False) for g in groups]
    fed = [chain_fed_chain(board, g, o, got[1][1]).seconds for g, o in zip(groups, own)]
    # every group's sum is costed, the slowest charged (the second chain is the same fused one)
    assert got[0][1].seconds == pytest.approx(max(fed))
    assert got[0][1].seconds < max(o.seconds for o in own)
    program, colls = _program(True)
    got = _comm(board, program, SimpleNamespace(tp=12, sp=4, dp=1, chips=48, collectives=colls))
    assert [c.op for _, c, _ in got] == ["all_reduce", "all_gather", "all_reduce"]
    # with nothing to overlap: the slowest group's own two collectives, then the fused chains
    slowest = max(sum(collective_cost(board, g, op, n, ex).seconds
                      for op, n, ex in (("all_reduce", 4, False), ("all_gather", 64, True))) for g in groups)
    assert sum(c.seconds for _, c, _ in got[:2]) == pytest.approx(slowest)
    assert slowest > sum(collective_cost(board, groups[0], op, n, ex).seconds
                         for op, n, ex in (("all_reduce", 4, False), ("all_gather", 64, True)))
    assert got[0][1].seconds == pytest.approx(max(o.seconds for o in own))
