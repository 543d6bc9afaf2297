"""What every tile runner shares: the record of a tile as executed (:class:`TileRun`), a PE's
free SRAM handed out in aligned blocks (``_Arena``) and the state of one ``iss`` run (``_Run``:
the program, its images, the record and a machine per PE)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import view
from ..cycles import executed_cycles
from ..errors import PeCodegenError
from ..iss import PeMachine
from ..memory_map import ARENA_END


_F32 = np.float32


@dataclass
class TileRun:
    """One tile as executed: layer, tile index, PE, executed instructions per class and their
    cycles (:mod:`.cycles`, the waits on peripherals included), the timing model's cycles for
    the tile, and the cycles of ``cycles`` the M4F waited on the MAC array or the exp/log unit
    (recorded for tiles run in one piece; 0 where not)."""

    layer: int
    tile: int
    pe: int
    modelled: float
    cycles: int = 0
    classes: dict = field(default_factory=dict)
    waited: float = 0.0


def _align(n: int, a: int = 64) -> int:
    return -(-n // a) * a


class _Arena:
    """Bump allocation of tile buffers in a PE's SRAM between the image and the job block."""

    def __init__(self, machine: PeMachine, program, index: int):
        self.m, self.base, self.p, self.i = machine, machine.arena, program, index

    def take(self, *sizes: int) -> list[int]:
        out, pos = [], self.base
        for size in sizes:
            out.append(pos)
            pos += _align(max(int(size), 4))
        if pos > ARENA_END:
            need = f"a tile needs {pos - self.base} bytes of SRAM, the PE has {ARENA_END - self.base} after its image"
            if self.p is None:
                raise ValueError(need)
            raise PeCodegenError(view.layer_name(self.p, self.i), view.layer_kind(self.p, self.i), need)
        return out


class _Run:
    def __init__(self, program, images, record):
        self.p, self.images, self.record = program, images, record
        self.machines: dict = {}
        self.acc_bits = view.arch_of(program).acc_bits

    def machine(self, index: int, pe: int) -> PeMachine:
        """The machine of layer ``index``'s role, booted as PE ``pe`` (one emulator per role,
        reloaded for each tile: the PEs of a role run the same image on their own data)."""
        name = self.images.layers[index]
        if name not in self.machines:
            self.machines[name] = PeMachine(self.images.images[name].elf, name, pe, self.acc_bits,
                                            view.arch_of(self.p))
        m = self.machines[name]
        m.load(pe)
        m.clear_counters()
        return m

    def done(self, index: int, t: int, table, m: PeMachine) -> None:
        if self.record is not None:
            cycles, classes = executed_cycles(m)
            self.record.append(TileRun(index, t, int(table.pe[t]), float(table.cycles[t]), cycles, classes, m.stall))


def _tally(entry: list, m) -> None:
    """Add the machine's executed cycles and instruction classes to a tile's ``[cycles, classes]``."""
    cycles, classes = executed_cycles(m)
    entry[0] += cycles
    for key, v in classes.items():
        entry[1][key] = entry[1].get(key, 0) + v


def _record_runs(run, index: int, table, runs: list) -> None:
    """One :class:`TileRun` per tile of layer ``index`` where the run records them."""
    if run.record is not None:
        for t in range(len(table)):
            run.record.append(TileRun(index, t, int(table.pe[t]), float(table.cycles[t]), runs[t][0],
                                      dict(sorted(runs[t][1].items()))))
