"""An exact all-reduce the chain after it waits for: reduced to the chain's first chip.

References: the link graph's own transfer costs (every rank to the chain's first, the first to
each rank) and the chain's steps, added by hand; the exact all-reduce by itself
(:func:`tvm_spinn.timing.system.collective_cost`).
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


def test_reduced_to_the_first_rank_under_the_chain(board):
    """A split row's maximum (4 bytes) over 12 chips before its sum's chain: the values reduced to
    the chain's first chip, the result's multicast to the others no slower than the chain's first
    segment reaches them; cheaper than the all-reduce by itself, never below the reduction."""
    ranks = ring_order(board, 12)
    chain = collective_cost(board, ranks, "all_reduce", 4, False)
    whole = collective_cost(board, ranks, "all_reduce", 4, True)
    led = chain_led_all_reduce(board, ranks, 4, chain)
    up = board.transfer_cost(ranks[1:], np.full(11, ranks[0]), 4.0)
    step = chain.seconds / chain.steps
    lag = max(board.transfer_cost(ranks[:1], ranks[i:i + 1], 4.0).seconds - i * step for i in range(1, 12))
    assert led.algorithm == "reduce-first" and led.op == "all_reduce" and led.ranks == 12
    assert led.seconds == pytest.approx(up.seconds + max(0.0, lag))
    assert up.seconds <= led.seconds < whole.seconds


def test_a_chain_faster_than_the_multicast_waits_for_it(board):
    """Where the chain's steps would outrun the result's multicast, the difference is added; where
    that is no cheaper than the all-reduce by itself, the all-reduce is kept."""
    ranks = ring_order(board, 12)
    chain = collective_cost(board, ranks, "all_reduce", 4, False)
    fast = replace(chain, seconds=chain.seconds * 1e-3)  # a step far shorter than a hop
    led = chain_led_all_reduce(board, ranks, 4, fast)
    whole = collective_cost(board, ranks, "all_reduce", 4, True)
    up = board.transfer_cost(ranks[1:], np.full(11, ranks[0]), 4.0)
    step = fast.seconds / fast.steps
    lag = max(board.transfer_cost(ranks[:1], ranks[i:i + 1], 4.0).seconds - i * step for i in range(1, 12))
    assert lag > 0
    expected = up.seconds + lag
    if expected < whole.seconds:
        assert led.algorithm == "reduce-first" and led.seconds == pytest.approx(expected)
    else:
        assert led == whole
    # one rank: nothing to reduce
    assert chain_led_all_reduce(board, ranks[:1], 4, chain).seconds == 0.0


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
