"""An exact all-reduce the chain after it waits for: reduced to the chain's first chip.

References: the link graph's own transfer cost of every rank's value to the chain's first (a
floor), the exact all-reduce by itself (:func:`tvm_spinn.timing.system.collective_cost`, a
ceiling), and the cost's behaviour as the chain's step changes.
"""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.mapping.system import _comm
from tvm_spinn.program.records import PlanCollective
from tvm_spinn.target.topology import ring_order, topology_of
from tvm_spinn.timing.system import chain_led_all_reduce, collective_cost


@pytest.fixture(scope="module")
def board():
    return topology_of(tvm_spinn.make_system("chain-led", boards=1))


def _led(board, ranks, nbytes, chain, scale=1.0):
    """The reduce-first cost with ``chain``'s step scaled by ``scale`` (its one segment count)."""
    return chain_led_all_reduce(board, ranks, nbytes, replace(chain, seconds=chain.seconds * scale, step_s=chain.step_s * scale,
                                                            by_segments=()))


def test_reduced_to_the_first_rank_under_the_chain(board):
    """A split row's maximum (4 bytes) over 12 chips before its sum's chain: never below the
    reduction of every value to the chain's first chip, never above the all-reduce by itself,
    and here cheaper than it."""
    ranks = ring_order(board, 12)
    chain = collective_cost(board, ranks, "all_reduce", 4, False)
    whole = collective_cost(board, ranks, "all_reduce", 4, True)
    led = chain_led_all_reduce(board, ranks, 4, chain)
    up = board.transfer_cost(ranks[1:], np.full(11, ranks[0]), 4.0)
    assert led.algorithm == "reduce-first" and led.op == "all_reduce" and led.ranks == 12
    assert up.seconds <= led.seconds < whole.seconds
    # one rank: nothing to reduce
    assert chain_led_all_reduce(board, ranks[:1], 4, chain).seconds == 0.0


def test_a_longer_step_never_costs_more(board):
    """The later the chain's first segment reaches each rank, the more of the result's multicast
    it hides: the cost does not grow with the step, and stays between the reduction and the
    all-reduce by itself."""
    ranks = ring_order(board, 12)
    chain = collective_cost(board, ranks, "all_reduce", 4, False)
    whole = collective_cost(board, ranks, "all_reduce", 4, True)
    up = board.transfer_cost(ranks[1:], np.full(11, ranks[0]), 4.0)
    seconds = [_led(board, ranks, 4, chain, scale).seconds for scale in (1e-6, 1e-3, 0.1, 0.3, 1.0, 3.0, 10.0)]
    assert all(a >= b for a, b in zip(seconds, seconds[1:])), seconds
    assert all(up.seconds <= s <= whole.seconds for s in seconds)
    assert seconds[0] > seconds[-1]  # the step does matter here


def test_a_multicast_slower_than_the_chain_falls_back_to_the_all_reduce(board):
    """64 bytes over 12 chips: the reduction alone is cheaper than the all-reduce, but a chain
    whose steps are far shorter than a hop needs the result at every rank before its multicast
    can deliver it, and the wait makes the all-reduce by itself the cheaper; with the chain's
    own steps the reduce-first way is kept."""
    ranks = ring_order(board, 12)
    chain = collective_cost(board, ranks, "all_reduce", 64, False)
    whole = collective_cost(board, ranks, "all_reduce", 64, True)
    up = board.transfer_cost(ranks[1:], np.full(11, ranks[0]), 64.0)
    assert up.seconds < whole.seconds
    assert _led(board, ranks, 64, chain, 1e-6) == whole
    assert _led(board, ranks, 64, chain).algorithm == "reduce-first"


def test_priced_at_the_shortest_step_compose_may_pick(board):
    """:func:`~tvm_spinn.timing.system.compose` may cut the chain into any of the segment counts it
    was costed for: the reduce-first cost is never below what it is at any of them."""
    ranks = ring_order(board, 12)
    chain = collective_cost(board, ranks, "all_reduce", 64, False)  # 16 rows' sums: 1 to 16 segments
    assert len({o.step_s for o in chain.by_segments}) > 1
    led = chain_led_all_reduce(board, ranks, 64, chain)
    for option in chain.by_segments:
        assert led.seconds >= _led(board, ranks, 64, option).seconds * (1 - 1e-12), option.segments


def test_memoized_on_the_topology(monkeypatch):
    """A second call with the same ranks, size and step routes nothing and returns the same cost
    as a fresh topology computes; another step is costed anew."""
    topo = topology_of(tvm_spinn.make_system("chain-led-memo", boards=1))
    topo.memo.clear()  # the link graph is shared by the systems with its numbers
    ranks = ring_order(topo, 12)
    chain = collective_cost(topo, ranks, "all_reduce", 4, False)
    first = chain_led_all_reduce(topo, ranks, 4, chain)
    routed = []
    real = type(topo).transfer_cost

    def counted(self, *args, **kwargs):
        routed.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(topo), "transfer_cost", counted)
    assert chain_led_all_reduce(topo, ranks, 4, chain) == first
    assert not routed
    slower = _led(topo, ranks, 4, chain, 0.5)
    assert routed and slower.seconds >= first.seconds
    topo.memo.clear()
    assert chain_led_all_reduce(topo, ranks, 4, chain) == first


def _plan(*collectives, tp=12):
    program = SimpleNamespace(layers=[SimpleNamespace(output=0, inputs=[], kind="softmax"),
                                      SimpleNamespace(output=1, inputs=[0], kind="softmax")])
    return program, SimpleNamespace(tp=tp, dp=1, sp=1, collectives=tuple(collectives))


def test_the_mapper_leads_only_an_exact_reduce_before_a_chain(board):
    """The plan's collectives as timed: an exact all-reduce followed by a chain over the same group
    before the same layer is led by the chain; alone, or before a gather, it is the all-reduce."""
    ranks = ring_order(board, 12)
    exact = PlanCollective(layer=1, op="all_reduce", tensor=0, nbytes=4, exact=True)
    chain = PlanCollective(layer=1, op="all_reduce", tensor=0, nbytes=4, exact=False)
    program, plan = _plan(exact, chain)
    (_, led, _), (_, second, _) = _comm(board, program, plan)
    assert led.algorithm == "reduce-first" and second.algorithm == "chain"
    assert led.seconds == pytest.approx(chain_led_all_reduce(board, ranks, 4, second).seconds)
    program, plan = _plan(exact)
    ((_, alone, _),) = _comm(board, program, plan)
    assert alone.algorithm != "reduce-first"
    assert alone.seconds == pytest.approx(collective_cost(board, ranks, "all_reduce", 4, True).seconds)
    later = PlanCollective(layer=1, op="all_gather", tensor=0, nbytes=64, exact=True)
    program, plan = _plan(exact, later)
    assert _comm(board, program, plan)[0][1].algorithm != "reduce-first"
