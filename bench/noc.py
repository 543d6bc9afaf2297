"""The PE runtime's NoC: the barrier's cycles from its executed code against the timing model's
barrier, and a small MLP's PEs run concurrently in the instruction-set simulator, the jobs'
dependencies carried by NoC packets (its outputs checked against the sequential replay).

Run: ``python bench/noc.py`` (about a minute). Printed per barrier size (the timing model's tree:
its quad-PEs on the chip's grid, the root in the middle, :func:`tvm_spinn.pe.multi.barrier_pes`):
the root's and the slowest PE's cycles (executed instructions priced by the Cortex-M4 TRM's table,
waits for packets in flight included), ``SpinnArch.barrier_cost_cycles`` and its error against
the slowest PE, and the root's and slowest PE's cycles when every PE reports to the root; then the MLP's PEs, packets,
slowest PE's cycles and whether its outputs are the sequential replay's bits.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np


def main() -> None:
    from tvm_spinn.pe import run_barrier
    from tvm_spinn.pe.multi import barrier_pes
    from tvm_spinn.target.arch import SpinnArch
    arch = SpinnArch()
    print(f"{'PEs':>5} {'root':>8} {'slowest':>8} {'model':>8} {'error':>7} {'flat root':>10} {'flat slowest':>13}")
    for n in (2, 4, 16, 64, arch.pes_per_chip):
        pes, root = barrier_pes(n, arch)
        c = run_barrier(pes, master=root, arch=arch)
        f = run_barrier(pes, master=root, arch=arch, by_qpe=False)
        model = arch.barrier_cost_cycles(n)
        print(f"{n:>5} {c[root]:>8} {max(c.values()):>8} {model:>8.0f} {model / max(c.values()) - 1:>+7.1%} "
              f"{f[root]:>10} {max(f.values()):>13}")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "pe"))
    import torch
    import tvm_spinn
    from tvm import relax
    from tvm_spinn.pe import run_firmware, run_firmware_concurrent
    from tvm_spinn.pe.firmware import programs_of
    from test_firmware_loader import _Mlp, _inputs
    torch.manual_seed(3)
    ex = relax.build(tvm_spinn.frontend.from_pytorch(_Mlp().eval(), (torch.randn(4, 16),)), target="spinn")
    with tempfile.TemporaryDirectory() as tmp:
        tvm_spinn.export_firmware(ex, tmp, noc=True)
        x = _inputs(programs_of(ex)[0])
        run = run_firmware_concurrent(tmp, x)
        same = all(a.tobytes() == b.tobytes() for a, b in zip(run.outputs, run_firmware(tmp, x)))
    print(f"mlp: {len(run.cycles)} PEs, {run.packets} packets, slowest PE {max(run.cycles.values())} cycles, "
          f"outputs {'identical to' if same else 'DIFFERENT from'} the sequential replay")
    np.testing.assert_equal(same, True)


if __name__ == "__main__":
    main()
