"""A topology's memo bounds each kind of entry on its own: many collective costs never evict the
multicast trees (which the mapper asks for again and again), a remembered value is the value a
fresh topology computes, different rank sets never share an entry, and every kind stays bounded.
"""

import numpy as np

import tvm_spinn
from tvm_spinn.target.topology import ring_order, topology_of
from tvm_spinn.timing.collectives import cost as cost_module
from tvm_spinn.timing.collectives import trees as trees_module
from tvm_spinn.timing.collectives.cost import _COUNTS, _remember
from tvm_spinn.timing.system import collective_cost


def _board():
    topo = topology_of(tvm_spinn.make_system("memo-kinds", boards=1))
    topo.memo.clear()  # the link graph is shared by the systems with its numbers
    return topo


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b))


def test_trees_survive_many_collective_costs_and_equal_fresh_ones(monkeypatch):
    topo = _board()
    ranks = np.asarray(ring_order(topo, 12), dtype=np.int64)
    first = trees_module._multicast_trees(topo, ranks)
    # far more collective costs than trees kept: other kinds of entries do not evict the trees
    for k in range(2 * cost_module._TREES_KEPT):
        collective_cost(topo, ranks, "all_gather", 4.0 * (k + 1), False)
    built = []
    real = trees_module._local_links

    def counted(*args):
        built.append(1)
        return real(*args)

    monkeypatch.setattr(trees_module, "_local_links", counted)
    again = trees_module._multicast_trees(topo, ranks)
    assert not built and again is first  # found, not built again
    # what a fresh topology computes, bit for bit
    topo.memo.clear()
    assert _same(trees_module._multicast_trees(topo, ranks), first)
    assert built
    topo.memo.clear()


def test_different_rank_sets_do_not_collide():
    topo = _board()
    a = np.asarray(ring_order(topo, 12), dtype=np.int64)
    b = a[::-1].copy()  # the same chips in another order: other trees' rank order
    c = np.asarray(ring_order(topo, 8), dtype=np.int64)
    got = [trees_module._multicast_trees(topo, r) for r in (a, b, c)]
    fresh = []
    for r in (a, b, c):
        topo.memo.clear()
        fresh.append(trees_module._multicast_trees(topo, r))
    assert all(_same(x, y) for x, y in zip(got, fresh))
    assert not _same(got[0], got[2])
    assert got[0][2] != got[2][2] or not np.array_equal(got[0][0], got[2][0])
    topo.memo.clear()


def test_each_kind_is_bounded_and_counted_alone():
    memo: dict = {}
    for k in range(10):
        _remember(memo, ("a", k), k, 4)
        _remember(memo, ("b", k), -k, 100)
    kept_a = sorted(key[1] for key in memo if key[0] == "a")
    assert len(kept_a) <= 4 and kept_a[-1] == 9  # the newest is always kept
    assert sorted(key[1] for key in memo if key[0] == "b") == list(range(10))  # a's drops leave b alone
    assert memo[_COUNTS]["a"] == len(kept_a) and memo[_COUNTS]["b"] == 10
    # storing a key again does not count it twice
    _remember(memo, ("b", 3), -3, 100)
    assert memo[_COUNTS]["b"] == 10 and memo[("b", 3)] == -3


def test_large_entries_are_bounded_by_bytes(monkeypatch):
    monkeypatch.setattr(cost_module, "_KIND_BYTES_KEPT", 1000)
    memo: dict = {}
    for k in range(20):
        _remember(memo, ("big", k), k, 256, entry_bytes=300)  # at most 3 of 300 bytes in 1000
    assert 1 <= sum(1 for key in memo if key[0] == "big") <= 3


def test_routes_are_remembered_exactly_and_per_transfer_set(monkeypatch):
    from tvm_spinn.target import topology as topology_module

    topo = _board()
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(0, topo.chips, 7), rng.integers(0, topo.chips, 7)) for _ in range(3)]
    pairs.append((pairs[0][1], pairs[0][0]))  # the same chips the other way: other routes
    sizes = (4.0, np.arange(1.0, 8.0))
    remembered = [[topo.evaluate(s, d, n) for n in sizes] for s, d in pairs]
    routed = []
    real = topology_module.Topology.route_links

    def counted(self, *args):
        routed.append(1)
        return real(self, *args)

    monkeypatch.setattr(topology_module.Topology, "route_links", counted)
    again = [[topo.evaluate(s, d, n) for n in sizes] for s, d in pairs]
    assert not routed  # every route set found
    topo.memo.clear()
    fresh = [[topo.evaluate(s, d, n) for n in sizes] for s, d in pairs]
    assert routed
    for a, b, c in zip(remembered, again, fresh):
        for (cost_a, load_a), (cost_b, load_b), (cost_c, load_c) in zip(a, b, c):
            assert cost_a == cost_b == cost_c
            assert np.array_equal(load_a, load_c) and np.array_equal(load_b, load_c)
    assert not np.array_equal(fresh[0][0][1], fresh[3][0][1])  # the reversed transfers load other links
    topo.memo.clear()


def test_routes_kept_are_bounded(monkeypatch):
    from tvm_spinn.target import topology as topology_module

    monkeypatch.setattr(topology_module, "ROUTES_KEPT", 3)
    topo = _board()
    for k in range(10):
        topo.evaluate(np.array([0]), np.array([k + 1]), 4.0)
    routes = topo.memo[("routes",)]
    assert len(routes.entries) == 3 and routes.bytes > 0
    topo.memo.clear()
