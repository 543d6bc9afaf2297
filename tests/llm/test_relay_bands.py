"""Groups of boards laid out as two lines with relaying boards between them (tvm_spinn.llm.board_tp.relay_bands)."""

import pytest

from tvm_spinn.llm import board_tp

#: The lattice of boards: board (a, b) neighbours these displacements (no wrap-around here)
STEPS = ((1, 0), (-1, 0), (0, 1), (0, -1), (1, -1), (-1, 1))


def _pos(grid, group):
    return [(b % grid[0], b // grid[0]) for b in group]


def _lines(grid, group):
    """The group's boards split into the parts its own board edges join (breadth-first)."""
    at = set(_pos(grid, group))
    parts, seen = [], set()
    for p in sorted(at):
        if p in seen:
            continue
        part, front = {p}, [p]
        while front:
            a, b = front.pop()
            for da, db in STEPS:
                q = (a + da, b + db)
                if q in at and q not in part:
                    part.add(q)
                    front.append(q)
        seen |= part
        parts.append(sorted(part))
    return parts


@pytest.mark.parametrize("g", [4, 8, 16, 32])
def test_relay_bands_are_two_lines_with_the_partner_group_between(g):
    grid = (24, 30)
    layouts = board_tp.relay_bands(grid, g)
    assert len(layouts) == len(board_tp.RELAY_LINES)
    for (steps, across), groups in zip(board_tp.RELAY_LINES, layouts):
        flat = [b for grp in groups for b in grp]
        assert len(flat) == len(set(flat)) and all(0 <= b < grid[0] * grid[1] for b in flat)
        assert len(groups) % 2 == 0
        first = _pos(grid, groups[0])
        for k, grp in enumerate(groups):
            assert len(grp) == g
            pos = _pos(grid, grp)
            # every group a translate of the first
            da, db = pos[0][0] - first[0][0], pos[0][1] - first[0][1]
            assert sorted(pos) == sorted((a + da, b + db) for a, b in first)
            # two straight lines of g / 2 boards along the step, two steps across apart
            lines = _lines(grid, grp)
            assert len(lines) == 2 and all(len(line) == g // 2 for line in lines)
            (a0, b0), (a1, b1) = lines[0][0], lines[1][0]
            assert {(a1 - a0, b1 - b0), (a0 - a1, b0 - b1)} == {(2 * across[0], 2 * across[1]),
                                                                 (-2 * across[0], -2 * across[1])}
            assert all((q[0] - p[0], q[1] - p[1]) == steps[0] for line in lines for p, q in zip(line, line[1:]))
            if k % 2 == 0:
                # its partner: the line between the two and the line beside them (one step across)
                partner = set(_pos(grid, groups[k + 1]))
                assert partner == {(a + across[0], b + across[1]) for a, b in pos}


def test_relay_bands_fit_the_grid_or_are_empty():
    assert board_tp.relay_bands((24, 30), 2) == [] and board_tp.relay_bands((24, 30), 7) == []
    assert board_tp.relay_bands((3, 3), 16) == []  # no pair of two lines of 8 fits
    # a 4 x 6 torus: the pairs start one line in, so two lines of 4 along b (a pair 4 lines
    # across from a = 1) do not fit; two lines of 4 along a do, one pair from b = 1
    small = board_tp.relay_bands((4, 6), 8)
    assert small == [[[4, 5, 6, 7, 12, 13, 14, 15], [8, 9, 10, 11, 16, 17, 18, 19]]]
    # offered by group_layouts only when asked, kept to the boards given
    plain = board_tp.group_layouts((24, 30), 16, range(720), compact=True)
    offered = board_tp.group_layouts((24, 30), 16, range(720), compact=True, relays=True)
    # one way of the lines stands for the three (one shape turned): the one with the most groups
    ways = board_tp.relay_bands((24, 30), 16)
    # pairs of lines of 8 from one line in: along b 30 // 8 x (24 - 1) // 4 = 15 pairs, along a
    # 24 // 8 x (30 - 1) // 4 = 21
    assert [len(lay) for lay in ways[:2]] == [30, 42] and len(ways[2]) < 42
    assert offered[:-1] == plain and offered[-1] == ways[1]
    inside = [b for b in range(720) if b % 24 < 8 and b // 24 < 9]  # an 8 x 9 patch of the cloud
    kept = board_tp.group_layouts((24, 30), 16, inside, relays=True)
    assert all(lay and set(grp) <= set(inside) for lay in kept for grp in lay)
    # along a two pairs ((9 - 1) // 4); along b one pair and the first group of the next
    assert kept[-1] == [grp for grp in ways[1] if set(grp) <= set(inside)] and len(kept[-1]) == 4
    assert len([grp for grp in ways[0] if set(grp) <= set(inside)]) == 3


def test_relay_band_all_reduces_faster_than_the_bare_patch_and_no_faster_than_its_floor():
    """On the cloud's torus (no patch of 16 closes into a ring) two lines of 8 boards with a line
    of relaying boards between them all-reduce the int32 row faster than the 4 x 4 patch and the
    band of two rows (their shares leave every member over six board edges instead of the
    patch's border), and never below the bound any schedule of trees is held to."""
    from tvm_spinn.target import arch_of
    from tvm_spinn.timing.collectives import board_group_all_reduce, board_group_floor

    cpb, _, topo, _, order, _, torus = board_tp.board_setting(arch_of("spinn/cloud"))
    nbytes = 8192 * 4

    def cost(group):
        grid = [[int(c) + b * cpb for c in order] for b in group]
        return board_group_all_reduce(topo, grid, nbytes, board_gather=False, pipelined=True).seconds

    relay = board_tp.relay_bands(torus, 16)[0][0]
    bare = [cost(board_tp.board_patches(torus, 16)[0]), cost(board_tp.board_groups(torus, 16)[0])]
    mine = cost(relay)
    assert mine < min(bare), (mine, bare)
    bandwidth, latency = board_group_floor(topo, relay, nbytes)
    assert mine >= bandwidth + latency
    # the relays lower the floor's bandwidth part: every member's six edges lead to other boards
    assert bandwidth < board_group_floor(topo, board_tp.board_patches(torus, 16)[0], nbytes)[0]


def test_relay_bands_are_offered_only_where_the_trees_reach_the_relays():
    """Two lines of 16 boards have 56 boards next to them: with the group's 32, more than the
    multicast trees' region holds (MULTICAST_MAX_RANKS), so the all-reduce could not pass
    through them (a ring or tree across the group's boards alone): no relay layout of 32."""
    from tvm_spinn.timing.collectives import MULTICAST_MAX_RANKS

    grid = (24, 30)
    for g in (4, 8, 16, 32):
        group = board_tp.relay_bands(grid, g)[0][0]
        pos = set(_pos(grid, group))
        near = {(a + da, b + db) for a, b in pos for da, db in STEPS} - pos
        fits = g + len(near) <= MULTICAST_MAX_RANKS
        assert fits == (g < 32)
        plain = board_tp.group_layouts(grid, g, range(720), compact=True)
        assert len(board_tp.group_layouts(grid, g, range(720), compact=True, relays=True)) == len(plain) + fits


def test_a_relay_band_on_a_patch_of_the_cloud_has_relays_outside_its_first_line():
    """On an allocation (a patch of the cloud: no links beyond its edge) the pairs start one line
    in, so the first group's outer line has a line of relaying boards outside it: its all-reduce
    beats the same group moved onto the patch's edge, and the patch's own layouts."""
    from tvm_spinn.target import arch_of
    from tvm_spinn.target.allocation import allocation
    from tvm_spinn.target.faults import whole_boards
    from tvm_spinn.timing.collectives import board_group_all_reduce, board_group_floor

    arch = allocation(arch_of("spinn/cloud"), 72)  # an 8 x 9 patch
    cpb, _, topo, _, order, _, torus = board_tp.board_setting(arch)
    lays = board_tp.group_layouts(torus, 16, whole_boards(arch), compact=True, relays=True)

    def cost(group):
        return board_group_all_reduce(topo, [[int(c) + b * cpb for c in order] for b in group], 8192 * 4,
                                      board_gather=False, pipelined=True).seconds

    relay = lays[-1][0]
    at_edge = [b - torus[0] for b in relay]  # the same lines one line nearer the patch's edge
    assert min(relay) >= torus[0] and set(at_edge) <= set(whole_boards(arch))
    assert cost(relay) < cost(at_edge) and cost(relay) < min(cost(lay[0]) for lay in lays[:-1])
    assert cost(relay) >= sum(board_group_floor(topo, relay, 8192 * 4))
