"""The int8 GEMM kernel's pipeline cost in closed form
(:func:`tvm_spinn.program.ops.gemm.geometry.int8_pipelined_cycles`) against the pipeline walked
step by step, chunk by chunk and block by block, as the kernel runs it; and its overlap rule:
the M4F's work on a column block hides behind the MAC array's next block, the tile's last
block's work (its epilogue) follows the array."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tvm_spinn.program.ops.gemm.geometry import (I8_BLOCK, I8_JOB, I8_LEAD, I8_RESTART, I8_SUM, I8_SUM_ROW, Int8Side,
                                                 _finish_cycles, int8_acc_cycles, int8_block_columns,
                                                 int8_pipelined_cycles, mac_passes)
from tvm_spinn.program.ops.m4f import mix_cycles
from tvm_spinn.target.arch import SpinnArch

SIDES = (Int8Side(), Int8Side(int32_out=True), Int8Side(fp32_out=True, relu=True, bias=True),
         Int8Side(row_sums=True, col_sums=True, transposed=True, col_zero=True, narrow=True),
         Int8Side(tflite=True, col_zero=True), Int8Side(epilogue=False, col_sums=True, transposed=True))


def walked(vm, vn, k, tk, arch, side, starts=True) -> float:
    """The pipeline one step at a time: per chunk (job) and column block, the M4F's work on the
    block just waited for beside the array's run of the next block (the next chunk's first after
    a chunk's last block, beside the next job's entry too; the next block of a chunk started
    after the wait, the driver's writes in series); the first job's entry up to its first start;
    the tile's last block alone."""
    rows, cols = (vn, vm) if side.transposed else (vm, vn)

    def c(mix):
        return mix_cycles(mix, arch)

    cb = int8_block_columns(rows, cols, arch)
    widths = [min(cb, cols - j0) for j0 in range(0, cols, cb)]
    chunks = [min(tk, k - k0) for k0 in range(0, k, tk)]
    summed = vm * side.row_sums + vn * side.col_sums

    def add(w):  # one block's chunk add (the routine's cycles, checked on the ISS by
        return int8_acc_cycles(rows, w, arch)  # test_int8_kernel_fixed_costs.py)

    def entry(kc):
        return arch.m4f_job_cycles + c(I8_JOB) + summed * (kc * c(I8_SUM) + c(I8_SUM_ROW))

    def array(kc, w):
        return float(mac_passes(rows, w, arch)) * (kc + arch.mac_readout_cycles)

    t = entry(chunks[0]) - c(I8_LEAD) + max(c(I8_LEAD), array(chunks[0], widths[0]))
    for ci, kc in enumerate(chunks):
        adds, last = not (ci == 0 and starts), ci == len(chunks) - 1
        for j, w in enumerate(widths):
            work = c(I8_BLOCK) + adds * add(w)
            work += _finish_cycles(rows, w, 1, arch, side) if last else 0.0
            if j + 1 < len(widths):  # the next block's start after the wait: its writes in series
                t += c(I8_RESTART) + max(work, array(kc, widths[j + 1]))
            elif not last:
                t += max(work + entry(chunks[ci + 1]), array(chunks[ci + 1], widths[0]))
            else:
                t += work
    return t


def test_closed_form_is_the_walked_pipeline():
    """On random tiles (one to many blocks and chunks, a short last chunk, every side, a split
    reduction's later parts), scalar and per-tile arrays alike."""
    arch = SpinnArch()
    rnd = random.Random(3)
    cases = []
    for _ in range(400):
        k = rnd.randint(1, 2500)
        tk = rnd.randint(1, 600)
        tk = -(-k // -(-k // min(tk, k)))  # the kernel's chunk length
        cases.append((rnd.randint(1, 160), rnd.randint(1, 260), k, tk, rnd.choice(SIDES), rnd.random() < 0.6))
    for vm, vn, k, tk, side, starts in cases:
        want = walked(vm, vn, k, tk, arch, side, starts)
        assert int8_pipelined_cycles(vm, vn, k, tk, arch, side, starts) == pytest.approx(want, rel=1e-12)
    for side in SIDES:
        picked = [case for case in cases if case[4] == side and case[3] == cases[0][3]] or [cases[0]]
        tk = picked[0][3]
        vm, vn, k = (np.array([case[i] for case in picked], dtype=np.int64) for i in range(3))
        k = np.maximum(k, 1)
        starts = np.array([case[5] for case in picked])
        got = int8_pipelined_cycles(vm, vn, k, tk, arch, side, starts)
        want = [walked(int(a), int(b), int(kk), tk, arch, side, bool(s)) for a, b, kk, s in zip(vm, vn, k, starts)]
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_overlap_rule():
    """Where the array's next block outlasts the M4F's work on each block, the tile takes the
    array's runs plus the first job's entry before its first start and the last block's work,
    its epilogue, after the array; a requantizing epilogue costs a tile of one block exactly
    its counted code (nothing hides it), and on a tile of several blocks less than that sum
    (the blocks but the last hide behind the array) but at least its last block's."""
    arch = SpinnArch()

    def c(mix):
        return mix_cycles(mix, arch)

    rows, cols, k = 16, 64, 511
    bare = Int8Side(int32_out=True)
    cb = int8_block_columns(rows, cols, arch)
    blocks = -(-cols // cb)
    run = float(mac_passes(rows, cb, arch)) * (k + arch.mac_readout_cycles)
    assert run > c(I8_BLOCK) and run > c(I8_LEAD)  # the array is the longer at every step
    entry = arch.m4f_job_cycles + c(I8_JOB)
    assert int8_pipelined_cycles(rows, cols, k, k, arch, bare) == pytest.approx(
        entry - c(I8_LEAD) + blocks * run + (blocks - 1) * c(I8_RESTART) + c(I8_BLOCK))
    req = Int8Side()
    one_block = int8_pipelined_cycles(rows, 4, k, k, arch, req) - int8_pipelined_cycles(rows, 4, k, k, arch, bare)
    assert one_block == pytest.approx(_finish_cycles(rows, 4, 1, arch, req))
    several = int8_pipelined_cycles(rows, cols, k, k, arch, req) - int8_pipelined_cycles(rows, cols, k, k, arch, bare)
    last = _finish_cycles(rows, cols - (blocks - 1) * cb, 1, arch, req)
    assert last <= several < blocks * _finish_cycles(rows, cb, 1, arch, req)
