"""The int8 GEMM kernel's fixed costs as executed: the MAC array's block-pipeline driver
(``pe_mac_wait_next``: the next block started right after the wait, the chunk's registers kept)
and the split of a tile's executed cycles into phases
(:func:`tvm_spinn.pe.runners.gemm.int8_tile_phases`)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from unicorn.arm_const import UC_ARM_REG_R0

from tvm_spinn.pe.cycles import block_price, executed_cycles
from tvm_spinn.pe.errors import IssFault
from tvm_spinn.pe.execute import run_int8_tile
from tvm_spinn.pe.images import role_image
from tvm_spinn.pe.iss import PeMachine, image_symbols
from tvm_spinn.pe.memory_map import MAC_START
from tvm_spinn.pe.runners.gemm import INT8_PHASES, int8_dsp_consts, int8_seeded_operands, int8_tile_phases
from tvm_spinn.program.ops.gemm.geometry import (I8_ACC_SITE, I8_ENTRY_CYCLES, I8_JOB, I8_RESTART, Int8Side,
                                                 _finish_cycles, int8_acc_cycles, int8_block_columns, mac_passes)
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


def _priced_by_routine(machine, elf) -> dict:
    """The machine's executed blocks priced (TRM table), summed by the image's routine."""
    starts = sorted((addr & ~1, name) for name, addr in image_symbols(elf).items())
    out: dict = {}
    for key, count in machine.blocks.items():
        name = [sym for start, sym in starts if start <= key[0]][-1]
        cycles, extra = block_price(machine, *key)
        out[name] = out.get(name, 0) + cycles * count + extra * machine.taken.get(key, 0)
    return out


def test_hand_written_mac_drivers_write_every_register_and_cost_their_listing():
    """The runtime's hand-written ``pe_mac_start`` (its four stacked arguments taken by one LDM)
    and ``pe_mac_wait``: a one-block, one-chunk tile (one start, one wait) leaves M, N, K, LDB and
    LDC as the kernel passed them (the stacked ones included), its int32 sums exact (int64
    reference), and the two routines execute their listings' cycles (TRM table 3-1): 24 and 9."""
    arch = SpinnArch()
    image = role_image(("gemm_i8",))
    machine = PeMachine(image.elf, image.name, 0, arch.acc_bits, arch)
    rows, cols, k = 16, 4, 64
    a, b = int8_seeded_operands(rows, cols, k, np.random.default_rng(3))
    acc = run_int8_tile(machine, a, b, k, int8_dsp_consts(k, cols), 0)
    np.testing.assert_array_equal(acc, a.astype(np.int64) @ b.astype(np.int64))
    assert {r: machine.mac[r] for r in ("M", "N", "K", "LDB", "LDC")} == dict(M=rows, N=cols, K=k, LDB=cols, LDC=cols)
    assert machine.mac_calls == 1
    routine = _priced_by_routine(machine, image.elf)
    assert (routine["pe_mac_start"], routine["pe_mac_wait"]) == (24, 9)


def test_mac_start_called_directly_writes_each_argument_to_its_register():
    """``pe_mac_start`` called from its symbol on eight distinct arguments (r0-r3: A, B, C, M;
    the four words below a lowered SP: N, K, LDB, LDC, as the caller stacks them): each of the
    nine MAC registers holds its own argument (CTRL the start), the array ran once, and after
    ``pe_mac_wait`` C holds the sums of that geometry (int64 reference), the words beside its
    rows untouched. A swap of any two arguments' stores moves a distinct value."""
    arch = SpinnArch()
    image = role_image(("gemm_i8",))
    machine = PeMachine(image.elf, image.name, 0, arch.acc_bits, arch)
    m, n, k, ldb, ldc = 3, 5, 7, 9, 11
    rng = np.random.default_rng(5)
    a = rng.integers(-128, 128, (m, k)).astype(np.int8)
    b = rng.integers(-128, 128, (k, ldb)).astype(np.int8)
    pa = machine.arena
    pb = pa + 64
    pc = pb + 128
    machine.write(pa, a.tobytes())
    machine.write(pb, b.tobytes())
    machine.write(pc, b"\x5a" * (4 * m * ldc))
    machine.sp0 -= 16
    machine.write(machine.sp0, struct.pack("<4I", n, k, ldb, ldc))
    machine.clear_counters()
    assert machine.call("pe_mac_start", [pa, pb, pc, m])
    assert machine.mac == {"A": pa, "B": pb, "C": pc, "M": m, "N": n, "K": k, "LDB": ldb, "LDC": ldc,
                           "CTRL": MAC_START}
    assert machine.mac_calls == 1
    assert machine.call("pe_mac_wait")
    got = np.frombuffer(machine.read(pc, 4 * m * ldc), np.int32).reshape(m, ldc)
    np.testing.assert_array_equal(got[:, :n], a.astype(np.int64) @ b[:, :n].astype(np.int64))
    assert got[:, n:].tobytes() == b"\x5a" * (4 * m * (ldc - n))


@pytest.mark.parametrize("spec,shape,side", [(("gemm_i8",), (16, 32, 256, 256), Int8Side(int32_out=True)),
                                             (("gemm_i8",), (16, 8, 600, 300), Int8Side()),
                                             (("gemm_i8",), (16, 8, 600, 300), Int8Side(row_sums=True, col_zero=True)),
                                             (("gemm_i8", "gemv"), (1, 16, 700, 350),
                                              Int8Side(row_sums=True, gemv=True))])
def test_tile_phases_against_independent_measures(spec, shape, side):
    """The phases of a tile against what the same tile executes when run as the ``iss`` mode
    runs it (:func:`~tvm_spinn.pe.execute.run_int8_tile` on the same seeded operands and
    constants): the executed cycles and the waits equal; the MAC driver phase equals the
    cycles of the driver routines' executed blocks; the chunk adds at least those of
    ``pe_i32_add_rows``' blocks (the kernel's own blocks of the next chunk's start come on top),
    none in a one-chunk tile; the epilogue within 2% of its cost model (``_finish_cycles`` per
    column block), none for an int32 output; operand sums only where the side forms them."""
    arch = SpinnArch()
    rows, cols, k, chunk = shape
    phases = int8_tile_phases(spec, rows, cols, k, chunk, arch, side, seed=4)
    assert all(phases[p] >= 0 for p in INT8_PHASES)
    image = role_image(spec)
    machine = PeMachine(image.elf, image.name, 0, arch.acc_bits, arch)
    a, b = int8_seeded_operands(rows, cols, k, np.random.default_rng(4))
    flags = (0 if side.int32_out else 2) | (4 if side.row_sums else 0) | (8 if side.col_sums else 0)
    run_int8_tile(machine, a, b, chunk, int8_dsp_consts(k, cols, side.col_zero), flags)
    assert phases["executed"] == executed_cycles(machine)[0]
    assert phases["waits"] == int(-(-machine.stall // 1))
    assert phases["mac_runs"] == machine.mac_calls
    routine = _priced_by_routine(machine, image.elf)
    assert phases["MAC driver"] == sum(routine.get(n, 0) for n in ("pe_mac_start", "pe_mac_wait", "pe_mac_wait_next"))
    assert phases["job loop"] == routine["_start"] + routine.get("pe_halt", 0)
    assert phases["chunk adds"] >= routine.get("pe_i32_add_rows", 0)
    assert (phases["chunk adds"] == 0) == (chunk >= k) == ("pe_i32_add_rows" not in routine)
    cb = int(int8_block_columns(rows, cols, arch))
    epilogue = sum(_finish_cycles(rows, min(cb, cols - j), 1, arch, side) for j in range(0, cols, cb))
    assert (phases["epilogue"] == 0) == side.int32_out
    assert phases["epilogue"] == pytest.approx(epilogue, rel=0.02)
    assert (phases["operand sums"] == 0) == (not side.row_sums)


def test_tile_phases_raise_on_a_routine_no_phase_owns(monkeypatch):
    """A block executed in a routine :data:`INT8_PHASE_OWNERS` does not name raises, naming it
    (nothing lands silently in a phase)."""
    import tvm_spinn.pe.runners.gemm as runners
    owners = {n: p for n, p in runners.INT8_PHASE_OWNERS.items() if n != "pe_mac_wait_next"}
    monkeypatch.setattr(runners, "INT8_PHASE_OWNERS", owners)
    with pytest.raises(ValueError, match="'pe_mac_wait_next', a routine no phase owns"):
        int8_tile_phases(("gemm_i8",), 16, 8, 64, 64, SpinnArch())


def test_job_entry_calibration_ties_to_the_arch_field():
    """:data:`I8_JOB` is the calibrated entry less the arch's job loop: the two sum to the measured
    :data:`I8_ENTRY_CYCLES` at the default arch (the share hard-coded beside ``I8_JOB``)."""
    arch = SpinnArch()
    assert arch.m4f_job_cycles + mix_cycles(I8_JOB, arch) == pytest.approx(I8_ENTRY_CYCLES, abs=1e-9)


def test_wait_next_on_a_freshly_loaded_machine_faults():
    """A boot resets the MAC array's registers: after a tile has run (every register written),
    ``load`` and then ``pe_mac_wait_next`` (which keeps A, M, K and LDB) finds LDB 0 and faults
    with the ISS's error naming the PE, the image and the pc, instead of running on the last
    PE's registers."""
    arch = SpinnArch()
    image = role_image(("gemm_i8",))
    machine = PeMachine(image.elf, image.name, 5, arch.acc_bits, arch)
    a, b = int8_seeded_operands(16, 8, 64, np.random.default_rng(1))
    run_int8_tile(machine, a, b, 64, int8_dsp_consts(64, 8), 2)
    assert machine.mac["LDB"] == 8  # the tile's run left its registers written
    machine.load(5)
    pc = machine.arena + 4096
    with pytest.raises(IssFault, match=r"PE 5, image gemm_i8: MAC array row strides LDB=0, LDC=8 below N=4 at pc=0x[0-9a-f]{8}"):
        machine.call("pe_mac_wait_next", [machine.arena, pc, 4, 8])


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_add_rows_routine_exact_and_priced(rows):
    """The runtime's ``pe_i32_add_rows`` called directly on ``rows x w`` blocks of w = 1..9
    columns in an accumulator ``ldacc`` > w words wide: the block's columns hold the 32-bit
    wrapping sums (numpy), the columns beside it and the words after it untouched, and the
    routine's executed cycles are :func:`int8_acc_cycles` less the kernel's call site
    (:data:`I8_ACC_SITE`); the result register is 0."""
    arch = SpinnArch()
    image = role_image(("gemm_i8",))
    machine = PeMachine(image.elf, image.name, 0, arch.acc_bits, arch)
    rng = np.random.default_rng(rows)
    machine.sp0 -= 16  # room for the fifth argument, on the stack as the caller passes it
    for w in range(1, 10):
        ldacc = w + 1 + w % 3
        acc = rng.integers(-2 ** 31, 2 ** 31, (rows, ldacc), dtype=np.int64).astype(np.int32)
        part = rng.integers(-2 ** 31, 2 ** 31, (rows, w), dtype=np.int64).astype(np.int32)
        pa = machine.arena
        pp = pa + acc.nbytes + 64
        machine.write(pa, acc.tobytes() + b"\x5a" * 64)
        machine.write(pp, part.tobytes())
        machine.write(machine.sp0, struct.pack("<i", ldacc))
        machine.clear_counters()
        assert machine.call("pe_i32_add_rows", [pa, pp, rows, w])
        want = acc.copy()
        want[:, :w] = (acc[:, :w].astype(np.int64) + part).astype(np.int32)
        got = np.frombuffer(machine.read(pa, acc.nbytes), np.int32).reshape(rows, ldacc)
        np.testing.assert_array_equal(got, want)
        assert machine.read(pa + acc.nbytes, 64) == b"\x5a" * 64
        assert machine.uc.reg_read(UC_ARM_REG_R0) == 0
        cycles = executed_cycles(machine)[0]
        assert cycles == int8_acc_cycles(rows, w, arch) - mix_cycles(I8_ACC_SITE, arch), (rows, w)


@pytest.mark.parametrize("rows,cols", [(0, 4), (4, 0)])
def test_tile_without_rows_or_columns_is_refused(rows, cols):
    """``pe_i32_add_rows`` counts its loops down before testing them (m = 0 or w = 0 would run
    about 2**32 times): the host refuses a tile without rows or columns, naming it."""
    from tvm_spinn.pe.runners.base import _Arena
    from tvm_spinn.pe.runners.gemm import gemm_i8_tile
    arch = SpinnArch()
    image = role_image(("gemm_i8",))
    machine = PeMachine(image.elf, image.name, 0, arch.acc_bits, arch)
    with pytest.raises(ValueError, match=f"int8 GEMM tile {rows}x{cols}: the kernel needs at least one row"):
        gemm_i8_tile(machine, _Arena(machine, None, None), np.zeros((rows, 64), np.int8),
                     np.zeros((64, cols), np.int8), 64, 0, 64, int8_dsp_consts(64, cols), 2)
