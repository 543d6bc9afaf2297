"""The int8 GEMM kernel's fixed costs as executed: the MAC array's block-pipeline driver
(``pe_mac_wait_next``: the next block started right after the wait, the chunk's registers kept)
and the split of a tile's executed cycles into phases
(:func:`tvm_spinn.pe.runners.gemm.int8_tile_phases`)."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_spinn.pe.cycles import executed_cycles
from tvm_spinn.pe.execute import run_int8_tile
from tvm_spinn.pe.images import role_image
from tvm_spinn.pe.iss import PeMachine
from tvm_spinn.pe.runners.gemm import INT8_PHASES, int8_tile_phases
from tvm_spinn.program.ops.gemm.geometry import I8_RESTART, mac_passes
from tvm_spinn.program.ops.m4f import mix_cycles
from tvm_spinn.target.arch import SpinnArch


def test_wait_next_starts_the_next_block_on_the_kept_registers():
    """After one block's start (every register written), ``pe_mac_wait_next`` with only B, C, N and
    LDC runs the next block on the same A, M, K and LDB: both blocks' sums exact (int64
    reference), and the array idles between them only for the driver's writes after the wait,
    the counted :data:`I8_RESTART`."""
    arch = SpinnArch()
    image = role_image(("gemm_i8",))
    machine = PeMachine(image.elf, image.name, 0, arch.acc_bits, arch)
    rng = np.random.default_rng(2)
    m, k, n, w = 16, 96, 24, 8
    a = rng.integers(-128, 128, (m, k)).astype(np.int8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    pa = machine.arena
    pb, pc = pa + a.nbytes, pa + a.nbytes + b.nbytes
    machine.write(pa, a.tobytes())
    machine.write(pb, b.tobytes())
    machine.write(pc, bytes(4 * m * n))
    machine.clear_counters()
    machine.mac.update(A=pa, B=pb, C=pc, M=m, N=w, K=k, LDB=n, LDC=n)
    machine._mac_run()
    first_end = machine.mac_pending[3]
    assert machine.call("pe_mac_wait_next", [pb + w, pc + 4 * w, w, n])
    run = int(mac_passes(m, w, arch)) * (k + arch.mac_readout_cycles)
    assert machine.mac_pending[3] - first_end - run == mix_cycles(I8_RESTART, arch)
    assert machine.call("pe_mac_wait")
    got = np.frombuffer(machine.read(pc, 4 * m * n), np.int32).reshape(m, n)
    want = a.astype(np.int64) @ b.astype(np.int64)
    np.testing.assert_array_equal(got[:, :2 * w], want[:, :2 * w])
    np.testing.assert_array_equal(got[:, 2 * w:], 0)  # the columns no run covered


@pytest.mark.parametrize("spec,shape,kw", [(("gemm_i8",), (16, 32, 256, 256), dict(requant=False)),
                                           (("gemm_i8",), (16, 8, 600, 300), {}),
                                           (("gemm_i8", "gemv"), (1, 16, 700, 350), dict(row_sums=True))])
def test_tile_phases_add_up_to_the_executed_cycles(spec, shape, kw):
    """The phases of a tile sum to the cycles the same tile executes when run as the ``iss`` mode
    runs it (:func:`~tvm_spinn.pe.execute.run_int8_tile` on the same seeded operands); a one-chunk
    tile has no chunk adds, an int32 output no epilogue, a tile without zero points no operand
    sums; the waits are the stall the run reports."""
    arch = SpinnArch()
    rows, cols, k, chunk = shape
    phases = int8_tile_phases(spec, rows, cols, k, chunk, arch, seed=4, **kw)
    assert all(phases[p] >= 0 for p in INT8_PHASES)
    image = role_image(spec)
    machine = PeMachine(image.elf, image.name, 0, arch.acc_bits, arch)
    rng = np.random.default_rng(4)
    a = rng.integers(-128, 128, (rows, k)).astype(np.int8)
    b = rng.integers(-128, 128, (k, cols)).astype(np.int8)
    q = np.concatenate([[3, k, 0, -128, 127], np.tile([1, 100, 1 << 30, 40], cols)])
    flags = (2 if kw.get("requant", True) else 0) | (4 if kw.get("row_sums") else 0)
    run_int8_tile(machine, a, b, chunk, q, flags)
    assert phases["executed"] == executed_cycles(machine)[0]
    assert phases["waits"] == int(-(-machine.stall // 1))
    assert (phases["chunk adds"] == 0) == (chunk >= k)
    assert (phases["epilogue"] == 0) == (not kw.get("requant", True))
    assert (phases["operand sums"] == 0) == (not kw.get("row_sums"))
    assert phases["mac_runs"] == machine.mac_calls
