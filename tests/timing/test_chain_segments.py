"""A chain all-reduce's segment count chosen with the fill of the row-parallel layer before it.

References: each chain cost at one segment count alone (``segments=(m,)``), and the fill
``(c - 1) / m`` of the layer's seconds that :func:`tvm_spinn.timing.system.compose` charges,
summed by hand over every count.
"""

from types import SimpleNamespace

import pytest

import tvm_spinn
from tvm_spinn.target.topology import ring_order, topology_of
from tvm_spinn.timing import collectives as C
from tvm_spinn.timing.system import compose

SEGMENTS = (1, 2, 4, 8, 16, 32, 64, 128)


@pytest.fixture(scope="module")
def board():
    return topology_of(tvm_spinn.make_system("chain-segments", boards=1))


def _chains(board):
    order = ring_order(board, 48)
    return order, [order[j * 12:(j + 1) * 12] for j in range(4)]


@pytest.mark.parametrize("kind", ["one", "apart", "gathered"])
def test_every_count_is_kept_and_the_cheapest_returned(board, kind):
    """``by_segments`` holds the cost at every count, each what that count alone costs; the
    collective itself is the cheapest of them."""
    order, chains = _chains(board)
    fn = {"one": lambda nb, seg: C.chain_all_reduce(board, order[:12], nb, seg),
          "apart": lambda nb, seg: C.chains_all_reduce(board, chains, nb, seg),
          "gathered": lambda nb, seg: C.chain_all_reduce_gathered(board, chains, nb, seg)}[kind]
    cost = fn(512, SEGMENTS)
    assert [c.segments for c in cost.by_segments] == list(SEGMENTS)
    for c in cost.by_segments:
        alone = fn(512, (c.segments,))
        assert c.seconds == pytest.approx(alone.seconds) and c.steps == alone.steps
    assert cost.seconds == pytest.approx(min(c.seconds for c in cost.by_segments))
    assert all(not c.by_segments for c in cost.by_segments)


def test_compose_takes_the_count_cheapest_with_the_fill(board):
    """A row-parallel fp32 layer before the chain: the latency is the layer plus its fill plus
    the chain at the count that makes their sum least (by hand over every count), never more
    than at the chain's own cheapest count, never less than the layer and the cheapest chain."""
    _, chains = _chains(board)
    arch = tvm_spinn.arch_of(tvm_spinn.get_target("spinn"))
    chain = C.chain_all_reduce_gathered(board, chains, 512)
    program = SimpleNamespace(layers=[SimpleNamespace(flops=0, mode="fp32") for _ in range(2)])
    for us in (1.0, 5.4, 40.0):
        x = us * 1e-6
        cycles = [round(x * arch.clock_hz), 0]
        x = cycles[0] / arch.clock_hz
        st = compose(program, arch, cycles, [0, 0], [(1, chain)], 12, row_fp32={0})
        by_hand = min(x * (1 + 11 / c.segments) + c.seconds for c in chain.by_segments)
        own = x * (1 + 11 / chain.segments) + chain.seconds
        assert st.latency_s == pytest.approx(by_hand, rel=1e-9)
        assert st.latency_s <= own + 1e-15
        assert st.latency_s >= x + chain.seconds - 1e-15
        (summary,) = st.collectives
        picked = min(chain.by_segments, key=lambda c: x * 11 / c.segments + c.seconds)
        assert summary.seconds == pytest.approx(picked.seconds) and summary.hops == picked.hops
    # the hop latency is paid once a hop, not once a segment: the chain alone is cheapest at its
    # most segments, which also cut the fill most, so a long layer keeps the chain's own count
    assert chain.segments == max(SEGMENTS)
    st = compose(program, arch, [round(40e-6 * arch.clock_hz), 0], [0, 0], [(1, chain)], 12, row_fp32={0})
    assert st.collectives[0].seconds == pytest.approx(chain.seconds)
    # a chain cheapest alone at one segment and 1% dearer at two: a 40 us layer's fill (11 / m of
    # it) takes the two
    from dataclasses import replace
    few = C.chain_all_reduce_gathered(board, chains, 512, segments=(1, 2))
    one, two = few.by_segments
    two = replace(two, seconds=one.seconds * 1.01)
    st = compose(program, arch, [round(40e-6 * arch.clock_hz), 0], [0, 0],
                 [(1, replace(one, by_segments=(one, two)))], 12, row_fp32={0})
    assert st.collectives[0].seconds == pytest.approx(two.seconds)
    # without a row-parallel layer before it the chain keeps its own count
    st = compose(program, arch, [round(40e-6 * arch.clock_hz), 0], [0, 0], [(1, chain)], 12)
    assert st.collectives[0].seconds == pytest.approx(chain.seconds)


def test_a_segment_is_at_least_a_packet(board):
    """A link moves a packet's 4-byte payload at least: a 4-byte sum is one segment, 64 bytes are
    at most 16, and a count the message cannot fill whole packets of is not offered."""
    order, _ = _chains(board)
    for nbytes, counts in ((4, [1]), (64, [1, 2, 4, 8, 16]), (512, list(SEGMENTS))):
        cost = C.chain_all_reduce(board, order[:12], nbytes, SEGMENTS)
        assert [c.segments for c in cost.by_segments] == counts
    # asked only for counts finer than a packet: one segment, the whole 4-byte packet
    cost = C.chain_all_reduce(board, order[:12], 4, (8, 2))
    assert cost.segments == 1
    assert [c.segments for c in cost.by_segments] == [1]


def test_later_segments_pay_the_links_not_the_hops(board):
    """Each segment after the first costs the busiest link's time for its bytes (by hand: two
    neighbours, one link each way), not another hop's latency; the first pays every hop."""
    arch = tvm_spinn.arch_of(tvm_spinn.get_target("spinn/board"))
    bw, hop = arch.payload_bw("chip"), arch.link_hop_s
    relay = (2 * arch.task_word_cycles + arch.m4f_fpu_cycles) / arch.clock_hz
    for m in (1, 4, 16):
        cost = C.chain_all_reduce(board, [0, 1], 4096, (m,))
        seg = 4096 / m
        assert cost.seconds == pytest.approx(2 * (seg / bw + hop) + relay + (m - 1) * seg / bw)
        assert cost.step_s == pytest.approx(seg / bw + hop + relay)


def test_a_link_on_the_chain_and_its_tree_carries_both(board):
    """By hand on the board's chips 1 -> 0 -> 9 -> 8 -> 2 (neighbours in turn): the multicast
    from 2 reaches 1 and 8 in one hop, 9 over 8 (8 -> 9, against the chain) and 0 only over 1
    (0 and 2 share no other neighbour), so the link 1 -> 0 carries a chain segment and a tree
    copy each period: later segments leave two segments' link time apart, not one."""
    arch = tvm_spinn.arch_of(tvm_spinn.get_target("spinn/board"))
    bw, hop = arch.payload_bw("chip"), arch.link_hop_s
    relay = (2 * arch.task_word_cycles + arch.m4f_fpu_cycles) / arch.clock_hz
    chain = [1, 0, 9, 8, 2]
    assert [int(h) for h in board.hops([2] * 4, chain[:-1])] == [1, 2, 2, 1]
    for m in (1, 4, 16):
        cost = C.chain_all_reduce(board, chain, 4096, (m,))
        seg = 4096 / m
        # four chain hops (each with a relay), two tree hops, then m - 1 periods of two segments
        expect = 4 * (seg / bw + hop + relay) + 2 * (seg / bw + hop) + (m - 1) * 2 * seg / bw
        assert cost.seconds == pytest.approx(expect)


def test_the_tree_leaves_the_chain_links_where_it_can(board):
    """By hand on 3 -> 2 -> 7 -> 6: the multicast from 6 may reach 2 over 3 (3 -> 2, a chain
    link) or over 7 (7 -> 2, against the chain's 2 -> 7), both two hops: over 7 no link carries
    two segments, so later segments leave one segment's link time apart."""
    arch = tvm_spinn.arch_of(tvm_spinn.get_target("spinn/board"))
    bw, hop = arch.payload_bw("chip"), arch.link_hop_s
    relay = (2 * arch.task_word_cycles + arch.m4f_fpu_cycles) / arch.clock_hz
    assert [int(h) for h in board.hops([6, 6, 6], [3, 2, 7])] == [1, 2, 1]
    for m in (1, 4, 16):
        cost = C.chain_all_reduce(board, [3, 2, 7, 6], 4096, (m,))
        seg = 4096 / m
        expect = 3 * (seg / bw + hop + relay) + 2 * (seg / bw + hop) + (m - 1) * seg / bw
        assert cost.seconds == pytest.approx(expect)
