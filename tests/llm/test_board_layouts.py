"""Layouts of groups of boards on the torus of boards (tvm_spinn.llm.board_tp): the roundest groups."""

import numpy as np
import pytest

from tvm_spinn.llm import board_tp


def _hops(grid, group):
    """Board hops between every pair of the group's boards inside the group (breadth-first over
    the lattice of boards: (+-1, 0), (0, +-1), (1, -1), (-1, 1), no wrap-around)."""
    bx, _ = grid
    pos = {b: (b % bx, b // bx) for b in group}
    steps = ((1, 0), (-1, 0), (0, 1), (0, -1), (1, -1), (-1, 1))
    at = {p: b for b, p in pos.items()}
    out = {}
    for b in group:
        seen, front, d = {b: 0}, [b], 0
        while front:
            d += 1
            nxt = []
            for x in front:
                a0, b0 = pos[x]
                for da, db in steps:
                    y = at.get((a0 + da, b0 + db))
                    if y is not None and y not in seen:
                        seen[y] = d
                        nxt.append(y)
            front = nxt
        out[b] = seen
    return out


@pytest.mark.parametrize("g", [2, 4, 7, 8, 16, 32])
def test_compact_groups_are_disjoint_connected_translates(g):
    grid = (24, 30)
    groups = board_tp.board_compact(grid, g)
    assert groups
    flat = [b for grp in groups for b in grp]
    assert len(flat) == len(set(flat)) and all(0 <= b < grid[0] * grid[1] for b in flat)
    bx = grid[0]
    shape = sorted((b % bx - groups[0][0] % bx, b // bx - groups[0][0] // bx) for b in groups[0])
    for grp in groups:
        assert len(grp) == g
        assert sorted((b % bx - grp[0] % bx, b // bx - grp[0] // bx) for b in grp) == shape
        hops = _hops(grid, grp)
        assert all(len(seen) == g for seen in hops.values())  # connected by board edges inside it


def test_compact_groups_are_rounder_than_patches():
    grid = (24, 30)
    for g, radius in ((7, 1), (19, 2), (37, 3)):  # full hexagons: every board within radius of the first
        grp = board_tp.board_compact(grid, g)[0]
        assert max(_hops(grid, grp)[grp[0]].values()) == radius
    for g in (8, 16, 32):
        compact = board_tp.board_compact(grid, g)[0]
        patch = board_tp.board_patches(grid, g)[0]
        across = lambda grp: max(max(d.values()) for d in _hops(grid, grp).values())  # noqa: E731
        assert across(compact) < across(patch), g


def test_compact_layout_is_offered_only_when_asked_and_only_where_it_fits():
    grid = (4, 6)
    assert board_tp.board_compact(grid, 16) == []  # a 16-board hexagon needs 5 boards across
    assert len(board_tp.group_layouts(grid, 8, range(24))) == 2
    layouts = board_tp.group_layouts(grid, 8, range(24), compact=True)
    assert len(layouts) == 3 and layouts[2] == board_tp.board_compact(grid, 8)
    # kept to the boards given: a group with a board outside them is dropped
    inside = [b for b in range(24) if b not in board_tp.board_compact(grid, 8)[0]]
    kept = board_tp.group_layouts(grid, 8, inside, compact=True)
    assert board_tp.board_compact(grid, 8)[1:] in kept
    assert all(set(grp) <= set(inside) for lay in kept for grp in lay)
    assert board_tp.board_compact(grid, 0) == []


def test_compact_group_all_reduces_no_slower_than_the_patch_on_a_large_torus(monkeypatch):
    """On the cloud's 24 x 30 torus (no patch of 16 closes into a ring) the roundest group's
    int32 all-reduce over one multicast tree per board's share is cheaper than the most nearly
    square patch's (fewer board hops across); the packed trees through the boards around each
    (rooted, unpipelined) lower both."""
    from tvm_spinn.target import arch_of
    from tvm_spinn.timing import collectives as C
    from tvm_spinn.timing.collectives import board_group_all_reduce

    cpb, _, topo, _, order, _, torus = board_tp.board_setting(arch_of("spinn/cloud"))
    lays = (("patch", board_tp.board_patches(torus, 16)), ("compact", board_tp.board_compact(torus, 16)))
    grids = {name: [[int(c) + b * cpb for c in order] for b in lay[0]] for name, lay in lays}
    packed = {name: board_group_all_reduce(topo, grid, 8192 * 4, board_gather=False).seconds
              for name, grid in grids.items()}
    monkeypatch.setattr(C.packing, "_packed_trees", lambda *args: None)
    cost = {name: board_group_all_reduce(topo, grid, 8192 * 4, board_gather=False).seconds
            for name, grid in grids.items()}
    assert all(packed[name] <= cost[name] for name in cost), (packed, cost)
    assert np.isfinite(cost["compact"]) and cost["compact"] < cost["patch"], cost
