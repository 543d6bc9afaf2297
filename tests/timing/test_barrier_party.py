"""A sequential layer's barrier is built over the PEs that take part in it (``tvm_spinn.timing.model``).

The parties a program's barriers are built over are recorded from the outside: the mapped program
is timed (the tables fixed) with ``SpinnArch.barrier_cost_cycles`` watched, and each barrier's
PE count is compared with the reference's, counted from the placed tiles: per barrier, the PEs of
the layer before it and of the layer after it on the chip with the most of them; the program's
cycles grow by the barriers' cost over those parties.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from tvm_spinn.mapping import MappingOptions, map_program
from tvm_spinn.target.arch import CHIPS, SpinnArch
from tvm_spinn.timing import evaluate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import fidelity  # noqa: E402

ARCH = CHIPS["production"]


def _parties(program, monkeypatch) -> list:
    """The PE counts the timing model builds the program's barriers over, in order."""
    seen = []
    cost = SpinnArch.barrier_cost_cycles

    def watched(arch, pes):
        seen.append(int(pes))
        return cost(arch, pes)

    with monkeypatch.context() as m:
        m.setattr(SpinnArch, "barrier_cost_cycles", watched)
        evaluate(program, ARCH, program.tiles.tables)
    return seen


def _expected(program) -> list:
    pes = [np.unique(t.pe) for t in program.tiles.tables]
    out = []
    for i, own in enumerate(pes):
        party = np.union1d(own, pes[i + 1]) if i + 1 < len(pes) else own
        out.append(int(np.bincount(party // ARCH.pes_per_chip).max()))
    return out


def test_narrow_layers_count_only_their_pes(monkeypatch):
    # three batch-1 dense layers of 512 outputs, each on 32 PEs (one 1 x 16 block per PE)
    p = map_program(fidelity.dense_chain(1, 512, 512, 3, ARCH), ARCH,
                    MappingOptions(weights="resident", split_k=False))
    used = [len(np.unique(t.pe)) for t in p.tiles.tables]
    assert max(used) < ARCH.pes_per_chip
    parties = _parties(p, monkeypatch)
    assert parties == _expected(p)
    # cheaper than three barriers over the whole chip
    assert sum(ARCH.barrier_cost_cycles(n) for n in parties) < 3 * ARCH.barrier_cost_cycles(ARCH.pes_per_chip)


def test_wide_layers_count_the_whole_chip(monkeypatch):
    # layers spread over every PE of the chip: each barrier counts all of them
    p = map_program(fidelity.dense_chain(2048, 256, 256, 2, ARCH), ARCH, MappingOptions(weights="resident"))
    assert all(len(np.unique(t.pe)) == ARCH.pes_per_chip for t in p.tiles.tables)
    assert _parties(p, monkeypatch) == [ARCH.pes_per_chip] * 2 == _expected(p)
