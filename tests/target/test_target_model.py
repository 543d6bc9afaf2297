"""The target model: the production SpiNNaker2 chip by default, the test chip as a variant.

Expected values are the published figures themselves (see ``tvm_spinn.target.arch`` for the
sources), written out here rather than read from the model, so a changed field fails a test.
"""

from __future__ import annotations

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.mapping import map_program
from tvm_spinn.mapping.tiling import safe_k_chunk
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.timing import roofline
from tvm_spinn.target import CHIPS

# Published figures of the production chip (arXiv 2607.24396; SpiNN2 datasheet v0.03; SpiNNMachine).
PHYSICAL_PES, APP_PES = 152, 148
MEASURED_TOPS_300MHZ = 4.563e12
TOPS_PER_W = {300e6: 2.06e12, 150e6: 2.77e12}


def test_production_chip_is_the_default():
    arch = tvm_spinn.SpinnArch()
    assert arch == CHIPS["production"] == tvm_spinn.arch_of("spinn")
    assert (arch.pes_per_chip, arch.mgmt_pes_per_chip, arch.physical_pes_per_chip) == (APP_PES, 4, PHYSICAL_PES)
    assert (arch.mac_rows, arch.mac_cols, arch.acc_bits) == (16, 4, 24)
    assert arch.clock_hz == 300e6 and CHIPS["production-150mhz"].clock_hz == 150e6
    assert (arch.dram_bytes, arch.dram_bw_bytes_s) == (2 * 1024**3, 6.4e9)
    assert safe_k_chunk(arch, 8) == 511  # 511 * 128 * 128 <= 2**23 - 1 < 512 * 128 * 128
    # the published theoretical 5.837 TOPS counts all 152 PEs; applications get 148 of them
    assert 2 * 64 * 300e6 * arch.physical_pes_per_chip == pytest.approx(5.837e12, rel=1e-3)
    assert arch.peak_int8_ops_s == 2 * 64 * 300e6 * APP_PES
    board = tvm_spinn.arch_of("spinn/board")
    assert board.chips == 48 and board.total_pes == 7104  # published: 7,104 application PEs a board
    assert board.replace(name=arch.name, chips=1) == arch


@pytest.mark.parametrize("chip", ["production", "production-150mhz"])
def test_energy_reproduces_the_published_tops_per_watt(chip):
    """A chip busy at the measured MAC rate (the measured 4.563 TOPS at 300 MHz, half of it at
    150 MHz) draws static power plus e_mac per MAC: that must give the published TOPS/W."""
    arch = CHIPS[chip]
    ops_s = MEASURED_TOPS_300MHZ * arch.clock_hz / 300e6
    watts = arch.p_static_w_per_chip + arch.e_mac_int8_j * ops_s / 2
    assert ops_s / watts == pytest.approx(TOPS_PER_W[arch.clock_hz], rel=1e-9)
    assert 0.5e-12 < arch.e_mac_int8_j < 1.0e-12  # in the ~0.7-1.0 pJ/MAC band, less static power


def test_testchip_variant_keeps_the_earlier_numbers():
    test = tvm_spinn.make_system("tc", chip="testchip")
    assert (test.pes_per_chip, test.mgmt_pes_per_chip, test.acc_bits, test.clock_hz) == (152, 0, 29, 250e6)
    assert (test.noc_bw_bytes_s, test.noc_hop_cycles) == (64e9, 4)
    assert (test.link_bw_bytes_s, test.e_mac_int8_j) == (0.5e9, 0.3e-12)
    assert safe_k_chunk(test, 8) == 16383
    assert tvm_spinn.arch_of("spinn/testchip") == CHIPS["testchip"]
    assert tvm_spinn.arch_of("spinn/testchip/board").total_pes == 48 * 152
    # fields given to make_system override the preset, the rest stay the test chip's
    four = tvm_spinn.make_system("tc4", chip="testchip", chips=4)
    assert four.chips == 4 and four.acc_bits == 29
    assert tvm_spinn.make_system("p4", chips=4).acc_bits == 24
    with pytest.raises(tvm_spinn.ArchError, match=r"unknown chip 'tesla'.*production.*testchip"):
        tvm_spinn.make_system("x", chip="tesla")
    with pytest.raises(tvm_spinn.ArchError, match="mgmt_pes_per_chip"):
        tvm_spinn.make_system("x", mgmt_pes_per_chip=-1)
    with pytest.raises(tvm_spinn.ArchError, match="acc_bits"):
        tvm_spinn.make_system("x", acc_bits=24.0)
    # the serialized form (inside every spinn program) round-trips the new field
    assert tvm_spinn.SpinnArch.from_dict(test.to_dict()) == test


def test_from_dict_refuses_the_retired_sync_packet_cycles():
    """A saved system that sets the retired ``sync_packet_cycles`` (its meaning split between a
    software scheduler's cycles per packet word and the barrier's cycles per pop) is refused
    naming both fields that replace it; the replacements keep their numbers and round-trip."""
    saved = {**tvm_spinn.SpinnArch().to_dict(), "sync_packet_cycles": 4.0}
    with pytest.raises(tvm_spinn.ArchError, match=r"'sync_packet_cycles' is retired: set task_word_cycles / "
                                                  r"barrier_pop_cycles"):
        tvm_spinn.SpinnArch.from_dict(saved)
    arch = tvm_spinn.SpinnArch()
    assert (arch.barrier_pop_cycles, arch.task_word_cycles) == (5 / 4, 4.0)
    set_both = arch.replace(barrier_pop_cycles=2.0, task_word_cycles=6.0)
    assert tvm_spinn.SpinnArch.from_dict(set_both.to_dict()) == set_both


def _int8_dense(arch: tvm_spinn.SpinnArch, m: int, k: int, n: int) -> Program:
    tensors = [
        TensorDesc("x", [m, k], "int8", "input"), TensorDesc("w", [k, n], "int8", "const"),
        TensorDesc("bq", [n], "int32", "const"), TensorDesc("m0", [n], "int32", "const"),
        TensorDesc("sh", [n], "int32", "const"), TensorDesc("y", [m, n], "int8", "output"),
    ]
    layer = Layer(name="dense", kind="dense", inputs=[0], output=5,
                  consts={"weight": 1, "bias_q": 2, "multiplier": 3, "shift": 4},
                  attrs=dict(x_zero=0, x_flip=False, relu=False, out="int8"), mode="int8")
    return Program("main", arch, tensors, [0], [5], [layer])


@pytest.mark.parametrize("chip,pes", [("production", APP_PES), ("testchip", 152)])
def test_placement_and_roofline_use_the_application_pes(chip, pes):
    arch = CHIPS[chip]
    m = k = n = 2048
    program = map_program(_int8_dense(arch, m, k, n), arch)
    used = {t.pe for t in program.tiles}
    assert len(program.tiles) > pes and used == set(range(pes))  # every application PE, no other
    assert program.mapping.layers[0].pes == (0, pes)  # the layer runs on exactly those
    flops = 2 * m * k * n
    assert program.layers[0].flops == flops
    # compute-bound even if every byte crossed DRAM (int8 x, w, y and three int32 vectors)
    compute_s = flops / (2 * 64 * arch.clock_hz * pes)
    assert (m * k + k * n + m * n + 3 * 4 * n) / arch.dram_bw_bytes_s < compute_s
    assert roofline(program, arch) == pytest.approx(compute_s, rel=1e-12)
    assert np.isclose(program.timing.roofline_s, compute_s, rtol=1e-12)
    assert program.timing.latency_s >= compute_s
