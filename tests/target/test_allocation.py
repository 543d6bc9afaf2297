"""Allocations of one machine: patches of its torus of boards (shape, ids, the sub-patches a
planner also tries), checked against hand counts and the link graph."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_spinn.target import ArchError, arch_of, make_system
from tvm_spinn.target.allocation import (ALLOCATION_LADDER, allocation, allocation_shape, board_name, patch_boards,
                                         patch_shape, sub_allocations)
from tvm_spinn.target.faults import usable_boards
from tvm_spinn.target.topology import topology_of


@pytest.mark.parametrize("boards, shape", [(1, (1, 1)), (2, (1, 2)), (4, (2, 2)), (8, (2, 4)), (24, (4, 6)),
                                           (72, (8, 9)), (240, (15, 16)), (720, (24, 30)), (29, (1, 29))])
def test_patch_shape_is_the_most_nearly_square_that_fits_the_cloud(boards, shape):
    assert patch_shape(boards, (24, 30)) == shape


def test_patch_shape_refuses_what_no_rectangle_holds():
    with pytest.raises(ArchError, match=r"31 boards.*24 x 30"):
        patch_shape(31, (24, 30))  # prime, longer than either side
    with pytest.raises(ArchError, match="positive"):
        patch_shape(0, (4, 4))


def test_patch_boards_are_a_rectangle_of_ids():
    # board (a, b) has id a + bx b
    assert patch_boards((4, 4), (2, 2)) == (0, 1, 4, 5)
    assert patch_boards((4, 4), (2, 2), origin=(3, 3)) == (0, 3, 12, 15)  # across the torus' seam
    with pytest.raises(ArchError, match="5 x 1"):
        patch_boards((4, 4), (5, 1))


def test_allocation_is_a_patch_of_the_machine_and_the_whole_machine_is_itself():
    machine = make_system("m16", boards=16)
    a = allocation(machine, 8)
    assert a.allocated_boards == (0, 1, 4, 5, 8, 9, 12, 13) and allocation_shape(a) == (2, 4)
    assert usable_boards(a) == a.allocated_boards
    assert allocation(machine, 16) is machine and allocation_shape(machine) == (4, 4)
    # the link graph keeps only the patch's chips: no route leaves it
    live = topology_of(a).live_chips()
    assert np.array_equal(np.unique(live // 48), np.array(a.allocated_boards))
    with pytest.raises(ArchError, match="already an allocation"):
        allocation(a, 2)
    # scattered boards are no patch
    assert allocation_shape(machine.replace(allocated_boards=(0, 2))) is None
    assert allocation_shape(machine.replace(allocated_boards=(0, 1), dead_chips=(3,))) is None


def test_sub_allocations_are_the_ladders_smaller_patches_inside_the_allocation():
    cloud = arch_of("spinn/cloud")
    subs = sub_allocations(cloud)
    assert [n for n, _ in subs] == list(ALLOCATION_LADDER)
    assert [allocation_shape(s) for _, s in subs] == [(1, 1), (1, 2), (2, 2), (2, 4), (4, 6), (8, 9), (15, 16)]
    # every sweep point's own shape is among a larger one's sub-patches
    for n in ALLOCATION_LADDER[1:]:
        inner = sub_allocations(allocation(cloud, n))
        assert [allocation_shape(s) for _, s in inner] == [allocation_shape(allocation(cloud, m))
                                                            for m in ALLOCATION_LADDER if m < n]
        for m, s in inner:  # inside the allocation, named as the allocation of its size
            assert set(s.allocated_boards) <= set(allocation(cloud, n).allocated_boards)
            assert s.name == allocation(cloud, m).name and board_name(s) == "spinn2-cloud[board]"
    # a patch away from the corner: its sub-patches at its own corner
    machine = make_system("m16", boards=16)
    moved = machine.replace(allocated_boards=patch_boards((4, 4), (2, 2), origin=(2, 1)))
    assert [(n, s.allocated_boards) for n, s in sub_allocations(moved)] == [(1, (6,)), (2, (6, 10))]
    assert sub_allocations(allocation(machine, 1)) == []
