"""A chain all-reduce's later segments paced by the PEs that relay their words.

References: each chain's cost with the links alone pacing it (``relay_pes=None``), the links'
period of a segment from its busiest link's bytes, and the PEs' period computed by hand from
:attr:`~tvm_spinn.target.topology.Topology.relay_word_s` (a word a 4-byte packet payload).
"""

from types import SimpleNamespace

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.mapping.shard import Collective
from tvm_spinn.program.tiles import TileTable
from tvm_spinn.target.topology import ring_order, topology_of
from tvm_spinn.timing import collectives as C
from tvm_spinn.timing.system import collective_cost


@pytest.fixture(scope="module")
def board():
    return topology_of(tvm_spinn.make_system("chain-relay", boards=1))


def _chip_bw(board) -> float:
    bw = np.unique(board.link_bw[board.link_group < 0])
    assert bw.size == 1  # one board: every chip link alike
    return float(bw[0])


@pytest.mark.parametrize("m", [4, 8, 16])
def test_one_pe_paces_the_later_segments(board, m):
    """A chain whose words all meet on one PE of a chip: each later segment follows the one
    before at that PE's rate, about 2.5 times the links' word rate; the first segment is
    unchanged."""
    chain = ring_order(board, 48)[:12]
    nbytes = 4096
    links = C.chain_all_reduce(board, chain, nbytes, (m,))
    one = C.chain_all_reduce(board, chain, nbytes, (m,), relay_pes=1)
    words = nbytes / m / 4
    pe = board.relay_word_s * words
    link = links.bytes_per_link / m / _chip_bw(board)
    assert 2.2 < pe / (words * 4 / _chip_bw(board)) < 2.8  # 30 ns a word against about 12 ns
    assert pe > link
    assert one.seconds == pytest.approx(links.seconds + (m - 1) * (pe - link), rel=1e-12)
    assert one.seconds > links.seconds
    assert (one.step_s, one.steps, one.segments) == (links.step_s, links.steps, links.segments)


def test_fewer_pes_never_cost_less(board):
    """The chain's cost falls as its words spread over more PEs, down to the links' own."""
    chain = ring_order(board, 48)[:12]
    costs = [C.chain_all_reduce(board, chain, 65536, relay_pes=p).seconds for p in (1, 2, 3, 8)]
    assert costs == sorted(costs, reverse=True) and costs[0] > costs[-1]
    assert costs[-1] == C.chain_all_reduce(board, chain, 65536).seconds


@pytest.mark.parametrize("pes", [3, 16, 152])
def test_three_pes_keep_the_links_pace(board, pes):
    """Words spread over at least three PEs: every chain cost is the links' own, to the bit,
    at every segment count (30 ns a word over three PEs is under the link's word)."""
    order = ring_order(board, 48)
    chains = [order[j * 12:(j + 1) * 12] for j in range(4)]
    for nbytes in (4, 512, 4096, 65536):
        pairs = [(C.chain_all_reduce(board, chains[0], nbytes), C.chain_all_reduce(board, chains[0], nbytes,
                                                                                     relay_pes=pes)),
                 (C.chains_all_reduce(board, chains, nbytes), C.chains_all_reduce(board, chains, nbytes,
                                                                                   relay_pes=pes)),
                 (C.chain_all_reduce_gathered(board, chains, nbytes),
                  C.chain_all_reduce_gathered(board, chains, nbytes, relay_pes=pes))]
        for links, relayed in pairs:
            assert relayed == links


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_bad_relay_pes_is_refused(board, bad):
    for call in (lambda: C.chain_all_reduce(board, [0, 1], 64, relay_pes=bad),
                 lambda: C.chains_all_reduce(board, [[0, 1], [2, 3]], 64, relay_pes=bad),
                 lambda: C.chain_all_reduce_gathered(board, [[0, 1], [2, 3]], 64, relay_pes=bad)):
        with pytest.raises(ValueError, match="relay_pes"):
            call()


def _table(pe, lo, hi) -> TileTable:
    n = len(pe)
    z = np.zeros(n, dtype=np.int64)
    return TileTable(layer=0, k_splits=1, lo=np.asarray(lo, dtype=np.int64), hi=np.asarray(hi, dtype=np.int64),
                     group=z - 1, pe=np.asarray(pe, dtype=np.int64), chip=z, sram_bytes=z, in_bytes=z,
                     w_bytes=z, out_bytes=z, cycles=z)


def test_output_pes_counts_one_pe_a_region():
    """A region's ``k`` tiles sum on its first tile's PE: four regions, two k tiles each, on
    eight PEs are held by four."""
    lo = [[0, 64 * (i // 2)] for i in range(8)]
    hi = [[1, 64 * (i // 2 + 1)] for i in range(8)]
    from tvm_spinn.mapping.system import output_pes

    assert output_pes(_table(range(8), lo, hi)) == 4
    assert output_pes(_table([5] * 8, lo, hi)) == 1
    assert output_pes(_table([-1] * 8, lo, hi)) is None


def test_the_mapper_charges_the_chain_its_mapped_pes(board):
    """The mapper's chain after a row-parallel layer whose outputs sit on one PE of each chip is
    costed with that PE relaying (slower than the links' own), and with its outputs on 16 PEs
    at the links' rate."""
    from tvm_spinn.mapping.system import _comm, group_ranks

    program = SimpleNamespace(layers=[SimpleNamespace(kind="matmul", inputs=(0, 1), output=2)])
    plan = SimpleNamespace(tp=12, sp=1, dp=1, chips=12, collectives=[Collective(1, "all_reduce", 2, 4096, False, "tp")])
    ranks = group_ranks(board, plan)["tp"]
    lo = [[0, 16 * i] for i in range(64)]
    hi = [[1, 16 * (i + 1)] for i in range(64)]
    ((_, one, _),) = _comm(board, program, plan, [_table([7] * 64, lo, hi)])
    ((_, spread, _),) = _comm(board, program, plan, [_table([i % 16 for i in range(64)], lo, hi)])
    ((_, unmapped, _),) = _comm(board, program, plan)
    assert one == collective_cost(board, ranks, "all_reduce", 4096, False, 1)
    assert one.seconds > spread.seconds
    assert spread == unmapped == collective_cost(board, ranks, "all_reduce", 4096, False)


def test_a_short_sum_is_held_by_no_more_pes_than_its_words(board):
    """The mapper counts at most one PE a word of the chain's bytes: an 8-byte sum written from
    64 PEs is held by two."""
    from tvm_spinn.mapping.system import _comm, _relay_pes, issued

    program = SimpleNamespace(layers=[SimpleNamespace(kind="matmul", inputs=(0, 1), output=2)])
    plan = SimpleNamespace(tp=12, sp=1, dp=1, chips=12, collectives=[Collective(1, "all_reduce", 2, 8, False, "tp")])

    lo = [[0, i] for i in range(64)]
    hi = [[1, i + 1] for i in range(64)]
    rows = issued(program, plan.collectives)
    assert _relay_pes(program, plan, rows, [_table(range(64), lo, hi)]) == [2]
    assert _relay_pes(program, plan, rows, None) == [None]
    assert len(_comm(board, program, plan, [_table(range(64), lo, hi)])) == 1
