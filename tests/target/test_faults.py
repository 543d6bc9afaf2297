"""Machines as they are: dead chips, links and boards, and a partial allocation, as SpinnArch fields.

The link graph routes around what is dead (hop counts checked against hand counts and against
an independent breadth-first search), the planners' views (usable and whole boards, a board on
its own) leave it out, and bad descriptions are refused naming the field.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import shortest_path

import tvm_spinn
from tvm_spinn.target import ArchError, arch_of, make_system
from tvm_spinn.target import faults
from tvm_spinn.target.topology import ring_order, topology_of


def _bfs_hops(topo, src: int, dst: int) -> int:
    """Hops of a shortest live path, by scipy's Dijkstra on the graph of live links (independent
    of the topology's own routing)."""
    flat = topo.neighbors.reshape(-1)
    ok = flat >= 0
    rows = np.repeat(np.arange(topo.nodes), 6)[ok]
    graph = csr_matrix((np.ones(rows.size), (rows, flat[ok])), shape=(topo.nodes, topo.nodes))
    return int(shortest_path(graph, indices=[src], unweighted=True)[0, dst])


def test_healthy_system_is_unchanged():
    """Empty fault fields: nothing in to_dict (programs keep their bytes), no live mask, the same
    routes as the closed form."""
    board = make_system("b", chips=48)
    assert not board.has_faults and set(faults.FAULT_FIELDS).isdisjoint(board.to_dict())
    topo = topology_of(board)
    assert not topo.faulty and topo.live is None
    assert faults.usable_boards(board) == (0,) and faults.whole_boards(board) == (0,)
    assert faults.board_view(make_system("f", boards=4), 2) == make_system("f", boards=4).replace(
        chips=48, name="f[board]")
    assert faults.chain_boards(make_system("f", boards=4)) == (0, 1, 2, 3)


def test_fields_are_normalized_and_round_trip():
    arch = make_system("x", boards=4).replace(dead_boards=[3, 1, 1], dead_links=[[5, 0]], allocated_boards=range(4),
                                              dead_board_links=[(2, 1)])
    assert arch.dead_boards == (1, 3) and arch.dead_links == ((5, 0),) and arch.allocated_boards == (0, 1, 2, 3)
    assert arch.has_faults and tvm_spinn.target.SpinnArch.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch
    # another chip count is another system: the faults (ids of this one) are not carried over
    assert not arch.replace(chips=48).has_faults and arch.replace(name="y").dead_boards == (1, 3)


@pytest.mark.parametrize("changes, named", [
    (dict(dead_boards=(4,)), r"dead_boards.*\[0, 4\).*4"),
    (dict(dead_chips=(-1,)), r"dead_chips.*-1"),
    (dict(dead_chips=(192,)), r"dead_chips.*192"),
    (dict(dead_links=((1, 6),)), r"dead_links.*direction.*6"),
    (dict(dead_links=(1,)), r"dead_links.*pair"),
    (dict(dead_board_links=((0, 7),)), r"dead_board_links.*edge.*7"),
    (dict(allocated_boards=(9,)), r"allocated_boards.*9"),
    (dict(dead_chips="ab"), r"dead_chips must be a sequence"),
    (dict(dead_boards=(True,)), r"dead_boards"),
    (dict(dead_boards=range(4)), r"leave no chip"),
    (dict(allocated_boards=(2,), dead_boards=(2,)), r"leave no chip"),
])
def test_bad_descriptions_are_refused_naming_the_field(changes, named):
    with pytest.raises(ArchError, match=named):
        make_system("x", boards=4).replace(**changes)


def test_nothing_usable_on_one_board_and_board_links_of_one_board():
    with pytest.raises(ArchError, match="leave no chip"):
        make_system("b", chips=4).replace(dead_chips=range(4))
    with pytest.raises(ArchError, match="one board has no board-to-board links"):
        make_system("b", chips=48).replace(dead_board_links=((0, 0),))


def test_dead_link_leading_nowhere_and_cut_apart_are_refused(register_system):
    # chip 0 of a standalone board sits on its west edge: its W link is unconnected
    with pytest.raises(ArchError, match=r"dead_links: chip 0's link 3 \(W\) leads nowhere"):
        topology_of(make_system("b", chips=48).replace(dead_links=((0, 3),)))
    # chip 0's connected links on a standalone board: E, NE, N; all dead cuts it off
    cut = make_system("cut", chips=48).replace(dead_links=((0, 0), (0, 1), (0, 2)))
    with pytest.raises(ArchError, match="cut the live chips into 2 parts"):
        topology_of(cut)
    with pytest.raises(ArchError, match="cut the live chips"):
        register_system(cut, tag="spinn/cut")
    assert "spinn/cut" not in tvm_spinn.known_targets()


def test_dead_link_on_a_board_detours_by_hand_count():
    """Chips 0 (0, 0) and 1 (1, 0) are east neighbours; with that link dead the route goes NE to
    (1, 1) and S to (1, 0): two hops, both ways."""
    board = make_system("b", chips=48)
    healthy, topo = topology_of(board), topology_of(board.replace(dead_links=((0, 0),)))
    assert healthy.hops([0], [1]).tolist() == [1]
    assert topo.hops([0, 1], [1, 0]).tolist() == [2, 2]
    assert [d for _, d in topo.route(0, 1)] == ["NE", "S"]
    assert topo.degree()[0] == healthy.degree()[0] - 1 and topo.degree()[1] == healthy.degree()[1] - 1
    # routes that never used the link are the healthy ones
    assert topo.route(5, 30) == healthy.route(5, 30)


def test_dead_chip_detours_by_hand_count():
    """Row 0 of a board holds chips 0-4 at x = 0..4. With chip 2 (2, 0) dead, chip 1 (1, 0) reaches
    chip 3 (3, 0) in three hops: no chip is a neighbour of both (their common neighbour (2, 0) is
    dead, (2, 1) is not next to (3, 0)), and (1, 0) NE (2, 1) E (3, 1) S (3, 0) is a path."""
    board = make_system("b", chips=48)
    topo = topology_of(board.replace(dead_chips=(2,)))
    assert topology_of(board).hops([1], [3]).tolist() == [2]
    assert topo.hops([1], [3]).tolist() == [3] == [_bfs_hops(topo, 1, 3)]
    assert all(link // 6 != 2 for _, link in [tuple(x) for x in np.stack(topo.route_links([1], [3]), 1)])
    with pytest.raises(ArchError, match=r"chip\(s\) \[2\] are dead"):
        topo.hops([0], [2])
    assert 2 not in ring_order(topo, 20).tolist() and 2 not in topo.live_chips()


def test_dead_board_routes_around_it():
    """Four boards (a 2 x 2 torus), board 1 dead: every route between live chips avoids its
    chips and is as short as a breadth-first search on the live links finds."""
    arch = make_system("four", boards=4).replace(dead_boards=(1,))
    topo = topology_of(arch)
    rng = np.random.default_rng(0)
    live = topo.live_chips()
    assert live.size == 144 and not np.isin(np.arange(48, 96), live).any()
    src, dst = rng.choice(live, 40), rng.choice(live, 40)
    transfer, links = topo.route_links(src, dst)
    assert not np.isin(links // 6, np.arange(48, 96)).any()  # no hop leaves a dead chip
    hops = np.bincount(transfer, minlength=src.size)
    assert hops.tolist() == [_bfs_hops(topo, int(s), int(d)) for s, d in zip(src, dst)]
    cost = topo.transfer_cost(src[:4], dst[:4], 1024.0)
    assert cost.max_hops == hops[:4].max() and cost.seconds > 0
    assert faults.usable_boards(arch) == (0, 2, 3) == faults.chain_boards(arch)


def test_dead_board_links_cut_a_board_edge():
    """A dead board edge takes out all the chip links across it, both ways; routes that crossed it
    go around (never shorter than before)."""
    arch = make_system("two", boards=2)
    topo0 = topology_of(arch)
    edge_links = np.flatnonzero(topo0.link_group == 0 * 6 + 0)
    assert edge_links.size == 8  # one board edge: eight chip links [spiNNlink]
    topo = topology_of(arch.replace(dead_board_links=((0, 0),)))
    assert (topo.neighbors.reshape(-1)[edge_links] == -1).all()
    far = topo0.neighbors.reshape(-1)[edge_links]
    back = far * 6 + (edge_links % 6 + 3) % 6
    assert (topo.neighbors.reshape(-1)[back] == -1).all()  # the links arriving over it too
    src, dst = edge_links // 6, far
    assert (topo.hops(src, dst) > 1).all() and (topo.hops(src, dst) >= topo0.hops(src, dst)).all()


def test_partial_allocation_of_the_cloud():
    """Boards 0-23 of spinn/cloud (one row of its 24 x 30 torus of boards): only they are usable,
    and a route between two of them stays on them."""
    cloud = arch_of("spinn/cloud")
    part = cloud.replace(name="cloud-part", allocated_boards=range(24))
    assert faults.usable_boards(part) == tuple(range(24)) and faults.live_chips(part).size == 24 * 48
    topo = topology_of(part)
    transfer, links = topo.route_links([0, 5], [12 * 48, 23 * 48 + 7])
    assert (links // 6 < 24 * 48).all()  # no hop on another job's board
    hops = np.bincount(transfer)
    assert (hops >= topology_of(cloud).hops([0, 5], [12 * 48, 23 * 48 + 7])).all()
    assert hops.tolist() == [_bfs_hops(topo, 0, 12 * 48), _bfs_hops(topo, 5, 23 * 48 + 7)]
    with pytest.raises(ArchError, match="outside the allocation"):
        topo.hops([0], [24 * 48])


def test_board_view_and_whole_boards():
    arch = make_system("four", boards=4).replace(dead_chips=(50, 97), dead_links=((98, 0), (100, 0)), dead_boards=(3,))
    assert faults.usable_boards(arch) == (0, 1, 2) and faults.whole_boards(arch) == (0,)
    assert faults.chain_boards(arch) == (0, 1, 2)  # whole boards first
    view = faults.board_view(arch, 1)
    assert view.chips == 48 and view.dead_chips == (2,) and not view.dead_links
    view2 = faults.board_view(arch, 2)
    assert view2.dead_chips == (1,) and view2.dead_links == ((2, 0),)  # (100, E) crosses the board edge
    assert faults.live_chips(arch, 1).tolist() == [c for c in range(48, 96) if c != 50]
    with pytest.raises(ArchError, match="board 3 .* dead"):
        faults.board_view(arch, 3)
    h = faults.health(arch)
    assert h["usable_boards"] == 3 and h["whole_boards"] == 1 and h["live_chips"] == 3 * 48 - 2
    json.dumps(h)


def test_mapper_places_on_live_chips():
    """The mapper's tensor-parallel groups on a board with dead chips take live chips only."""
    from tvm_spinn.mapping.stages import stages_of
    from tvm_spinn.mapping.system import stage_chips

    board = make_system("b", chips=48).replace(dead_chips=(0, 7))
    assert stage_chips(board) == 46 and stages_of(board) == 1
    four = make_system("four", boards=4).replace(dead_boards=(2,))
    assert stages_of(four) == 3
    assert not np.isin([0, 7], ring_order(topology_of(board), 46)).any()


def test_system_file_and_id_lists(tmp_path):
    path = tmp_path / "machine.json"
    path.write_text(json.dumps({"base": "spinn/cloud", "allocated_boards": [[0, 23]], "dead_boards": [3],
                                "dead_chips": [1200], "dead_links": [[52, 0]], "dead_board_links": [[7, 1]]}))
    arch, name = faults.load_system(path)
    assert name == "machine" and arch.name == "machine" and arch.chips == 720 * 48
    assert arch.allocated_boards == tuple(range(24)) and arch.dead_boards == (3,) and arch.dead_links == ((52, 0),)
    assert faults.parse_ids("3,7,10-12", "--dead-boards") == [3, 7, 10, 11, 12]
    assert faults.parse_ids("52:0,7:1", "--dead-links") == [(52, 0), (7, 1)]
    for text, named in (('{"base": "spinn/nope"}', "'base' must be a registered target"),
                        ('{"boards": 4, "dead_boards": [9]}', "dead_boards"),
                        ('{"boards": 4, "colour": 1}', r"unknown key\(s\) \['colour'\]"),
                        ('{"boards": 4, "base": "spinn"}', "exactly one of"),
                        ("[1]", "expected a JSON object"), ("{", "machine.json")):
        path.write_text(text)
        with pytest.raises(ArchError, match=named):
            faults.load_system(path)
    with pytest.raises(ArchError, match="--dead-links: expected"):
        faults.parse_ids("52", "--dead-links")
