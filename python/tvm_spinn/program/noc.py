"""The NoC's time for a layer's traffic: one model shared by the timing model and the tile chooser.

A leaf of the ``program`` package (it reads :class:`~tvm_spinn.target.arch.SpinnArch` fields
and imports nothing of the package), so the operator families' tile choosers and
:mod:`tvm_spinn.timing.model` cost the NoC the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..target.arch import SpinnArch

__all__ = ["BISECTION_SHARE", "noc_port_cycles"]

#: Share of the NoC traffic that crosses the mesh's bisection when a layer's sources and
#: destinations spread evenly over the chip (a uniformly random pair lies on opposite halves
#: half the time).
BISECTION_SHARE = 0.5


def noc_port_cycles(pe: np.ndarray, chip: np.ndarray, recv, send, arch: "SpinnArch") -> float:
    """Cycles the NoC needs to carry ``recv`` bytes into and ``send`` bytes out of PEs ``pe``
    (on chips ``chip``; one entry per tile or per PE).

    Every quad-PE's router joins its PEs to the mesh through one port of
    ``noc_link_bytes_per_cycle`` each way, so the bytes a quad-PE's tiles receive (operands not
    in their own SRAM, from DRAM or from other PEs) and send (outputs not kept locally) queue
    there; traffic spread over the chip crosses the middle of the mesh with probability
    :data:`BISECTION_SHARE`, at ``noc_bw_bytes_s``. The slowest chip sets the time. The timing model
    (:func:`tvm_spinn.timing.model.noc_cycles`) and the GEMM tile chooser both cost the NoC with it.
    """
    recv = np.broadcast_to(np.asarray(recv, dtype=np.float64), pe.shape)
    send = np.broadcast_to(np.asarray(send, dtype=np.float64), pe.shape)
    qpe = pe // arch.pes_per_qpe
    qpe = qpe - int(qpe.min())
    port = max(float(np.bincount(qpe, weights=recv).max()), float(np.bincount(qpe, weights=send).max()))
    chip = chip - int(chip.min())
    bisection = float(np.bincount(chip, weights=recv + send).max()) * BISECTION_SHARE
    return max(port / arch.noc_link_bytes_per_cycle, bisection / (arch.noc_bw_bytes_s / arch.clock_hz))
