"""A sequential layer's barrier is built over the PEs that take part in it (``tvm_spinn.timing.model``).

The packets a program's barriers count are measured from the outside: the mapped program is
timed at two ``sync_packet_cycles`` (the tables fixed), and the difference per cycle of a packet
is the number of packets counted. The reference counts them from the placed tiles: per barrier,
over the PEs of the layer before it and of the layer after it, the quad-PE leaders' packets
``min(n, 4) - 1`` and the root's ``ceil(n / 4) - 1``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from tvm_spinn.mapping import MappingOptions, map_program
from tvm_spinn.target.arch import CHIPS
from tvm_spinn.timing import evaluate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import fidelity  # noqa: E402

ARCH = CHIPS["production"]


def _packets(n: int) -> int:
    return (min(n, ARCH.pes_per_qpe) - 1) + (-(-n // ARCH.pes_per_qpe) - 1)


def _counted(program) -> float:
    base = evaluate(program, ARCH, program.tiles.tables).cycles
    more = evaluate(program, ARCH.replace(sync_packet_cycles=ARCH.sync_packet_cycles + 10), program.tiles.tables).cycles
    return (more - base) / 10


def _expected(program) -> int:
    pes = [np.unique(t.pe) for t in program.tiles.tables]
    total = 0
    for i, own in enumerate(pes):
        party = np.union1d(own, pes[i + 1]) if i + 1 < len(pes) else own
        total += _packets(int(np.bincount(party // ARCH.pes_per_chip).max()))
    return total


def test_narrow_layers_count_only_their_pes():
    # three batch-1 dense layers of 512 outputs, each on 32 PEs (one 1 x 16 block per PE)
    p = map_program(fidelity.dense_chain(1, 512, 512, 3, ARCH), ARCH,
                    MappingOptions(weights="resident", split_k=False))
    used = [len(np.unique(t.pe)) for t in p.tiles.tables]
    assert max(used) < ARCH.pes_per_chip
    assert _counted(p) == _expected(p)
    # fewer packets than three barriers over the whole chip
    assert _counted(p) < 3 * _packets(ARCH.pes_per_chip)


def test_wide_layers_count_the_whole_chip():
    # layers spread over every PE of the chip: each barrier counts all of them
    p = map_program(fidelity.dense_chain(2048, 256, 256, 2, ARCH), ARCH, MappingOptions(weights="resident"))
    assert all(len(np.unique(t.pe)) == ARCH.pes_per_chip for t in p.tiles.tables)
    assert _counted(p) == 2 * _packets(ARCH.pes_per_chip) == _expected(p)
