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
