"""bench/board_all_reduce.py's figures: each schedule against the others and the floor, and its
breakdown of the cheapest layout against the bound the trees' closed form is held to."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import numpy as np
import pytest

import tvm_spinn


@pytest.fixture(scope="module")
def bench():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "board_all_reduce.py")
    spec = importlib.util.spec_from_file_location("board_all_reduce_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def arch():
    return tvm_spinn.make_system("spinn2-boards24-bench", boards=24)


def test_figures_keep_their_order(bench, arch):
    """Groups of 4 boards of boards24: the packed trees never dearer than without them, the
    pipelined never dearer than the unpipelined (nor the rooted trees than the multicast), all
    at or above the floor; the members-only bound is ``2 (g - 1) / g`` of the row over six edges."""
    g, hidden = 4, 8192
    n = hidden * 4
    rows = bench._figures(arch, g, hidden)
    assert rows
    rate = 1e6 * 1000 / 9  # a board edge's payload rate: 111 MB/s (checked below against the graph)
    graph = tvm_spinn.target.topology.topology_of(arch).board_graph()
    assert float(graph.link_bw[np.isfinite(graph.link_bw)].min()) == pytest.approx(rate)
    for (_, with_packed, without, bandwidth, latency, on_board, members_only, _, scattered, unpiped,
         unpiped_without) in rows:
        assert members_only == pytest.approx(2 * (g - 1) / g * n / (6 * rate))
        floor = bandwidth + latency + on_board
        assert floor <= with_packed.seconds <= without.seconds
        assert with_packed.seconds <= unpiped.seconds <= unpiped_without.seconds
        assert with_packed.seconds <= scattered.seconds + 1e-12 or scattered.seconds >= floor


def test_breakdown_adds_up_and_its_closed_form_stays_above_the_tree_bound(bench, arch, capsys):
    """The cheapest layout of 16 boards of boards24: the closed form is the busiest edge's
    serialisation plus the span (within the longer spans' classes), the figure at least the
    played schedule plus the on-board hops, and the bound the closed form of any trees is held
    to (the floor's bandwidth, twice the group's least radius in hops, the on-board hops) between
    the floor and the closed form plus the on-board hops."""
    bench._breakdown(arch, 16, 8192)
    text = capsys.readouterr().out
    num = r"([0-9.]+)"
    figure = float(re.search(rf"\): {num} us board-", text).group(1))
    busiest, span, closed, played = (float(x) for x in re.search(
        rf"serialisation {num} us .*span of the trees used {num} us, closed form {num} us, played out {num} us",
        text).groups())
    hops = float(re.search(rf"hops {num} us\n", text).group(1))
    floor, bandwidth = (float(x) for x in re.search(rf"floor {num} us = cut bandwidth {num}", text).groups())
    span_hops, span_s, least = (float(x) for x in re.search(
        rf"span >= {num} hops \({num} us\), at least {num} us", text).groups())
    assert closed >= busiest + span - 0.1
    assert played >= closed - 0.1
    assert figure == pytest.approx(played + hops, abs=0.15)
    assert span >= span_s - 0.05 and span_s == pytest.approx(span_hops * 4.5, abs=0.05)
    assert least == pytest.approx(bandwidth + span_s + hops, abs=0.15)
    assert floor <= least <= closed + hops + 0.15 <= figure + 0.15
