"""The cheapest layout of groups of boards found without costing every layout
(tvm_spinn.llm.board_tp.cheapest_layout) and the bound it prunes with
(tvm_spinn.timing.collectives.board_group_all_reduce_bound)."""

import numpy as np
import pytest

from tvm_spinn.llm import board_tp
from tvm_spinn.timing.collectives import board_group_all_reduce, board_group_all_reduce_bound

N = 32768.0  # an 8,192-wide row of int32 partial sums


def test_cheapest_layout_is_min_over_every_layout():
    rng = np.random.default_rng(7)
    for trial in range(300):
        n = int(rng.integers(1, 9))
        # layouts of 1-3 groups; costs from a few values so that ties (and the -len tie-break) occur
        layouts = [[[i, j] for j in range(int(rng.integers(1, 4)))] for i in range(n)]
        cost = {i: float(rng.choice([1.0, 2.0, 3.0, 5.0])) for i in range(n)}
        slack = {i: float(rng.choice([0.0, 0.5, 1.0, 3.0])) for i in range(n)}
        costed = []

        def cost_of(lay):
            costed.append(lay[0][0])
            return cost[lay[0][0]]

        expected = min(layouts, key=lambda lay: (cost[lay[0][0]], -len(lay)))
        got = board_tp.cheapest_layout(layouts, cost_of, lambda lay: cost[lay[0][0]] - slack[lay[0][0]])
        assert got is expected, trial
        # a layout left uncosted has a bound above the chosen one's cost
        for i in set(range(n)) - set(costed):
            assert cost[i] - slack[i] > cost[expected[0][0]]


def test_cheapest_layout_costs_fewer_with_tight_bounds():
    layouts = [[[i]] for i in range(6)]
    costed = []
    got = board_tp.cheapest_layout(layouts, lambda lay: costed.append(lay) or float(lay[0][0]),
                                   lambda lay: float(lay[0][0]))
    assert got == [[0]] and costed == [[[0]]]


@pytest.mark.slow
@pytest.mark.parametrize("g", [2, 4, 8])
def test_bound_never_above_the_all_reduce(g):
    """On 24 boards every layout's group: the bound is at most every form of the all-reduce."""
    import tvm_spinn

    cpb, _, topo, _, order, _, torus = board_tp.board_setting(tvm_spinn.make_system("spinn2-24-boards", boards=24))
    for lay in board_tp.group_layouts(torus, g, list(range(24)), compact=True):
        grid = [[int(c) + b * cpb for c in order] for b in lay[0]]
        bound = board_group_all_reduce_bound(topo, grid, N, board_gather=False)
        assert bound > 0
        for kw in ({"pipelined": True, "board_gather": False}, {"pipelined": False, "board_gather": False},
                   {"pipelined": True, "board_gather": True, "fuse_gather": True},
                   {"pipelined": False, "board_gather": True}):
            assert bound <= board_group_all_reduce(topo, grid, N, **kw).seconds * (1 + 1e-12), (lay[0], kw)
