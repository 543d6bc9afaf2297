"""The SpiNNaker2-class target model: one frozen dataclass, every number a named parameter.

Published figures (SpiNNaker2 papers and SpiNNcloud material) are used where they exist; the
rest are *assumptions* documented next to the field. Everything downstream (tiling, placement,
timing, energy) reads its numbers from a :class:`SpinnArch` and nothing else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

__all__ = ["SpinnArch", "ArchError", "make_system"]


class ArchError(ValueError):
    """A system description with impossible numbers (names the offending field)."""


@dataclass(frozen=True)
class SpinnArch:
    """Architecture parameters of a SpiNNaker2-class many-core system.

    Parameters
    ----------
    name : str
        System name, used as the target ``model`` attribute and in reports.
    chips : int
        Number of chips in the system (1 chip, 48 per board, ~35k for SpiNNcloud).
    pes_per_chip : int
        Processing elements (Arm Cortex-M4F) per chip; 152 = 38 quad-PEs.
    pes_per_qpe : int
        PEs per quad-PE (the NoC router endpoint).
    sram_bytes : int
        Local SRAM per PE (code, stack and data share it).
    sram_reserved_bytes : int
        Assumption: SRAM kept for code, stack and runtime state, unavailable to tiles.
    mac_rows, mac_cols : int
        Shape of the output-stationary MAC array (16 x 4 = 64 int8 MACs/cycle).
    mac16_per_cycle : int
        MACs per cycle in 16-bit mode.
    acc_bits : int
        Width of the MAC array's accumulators (29 bits on SpiNNaker2).
    mac_readout_cycles : int
        Assumption: cycles for the MAC array to write one ``mac_rows x mac_cols`` block of 32-bit
        sums to SRAM after a k-chunk (64 words = 256 B through a 128-bit SRAM port: 16). int8
        tiles pay it once per block and k-chunk (see ``tvm_spinn.mapping.tiling``).
    clock_hz : float
        PE clock. Assumption: 250 MHz (published range 200-300 MHz; 4.5 TOPS/chip implies ~230-250).
    m4f_flops_per_cycle : float
        Assumption: sustained fp32 multiply-accumulates per cycle on the M4F (VMLA.F32 issues one
        per cycle when pipelined, loads and address arithmetic cost about as much again: 0.5).
        Only ``mode="fp32"`` layers use it; ``mode="int8"`` GEMMs run on the MAC array at
        :attr:`macs_per_cycle` (128x the M4F's rate with the defaults).
    m4f_elementwise_cycles : float
        Assumption: cycles per fp32 element for simple element-wise ops on the M4F (load, op, store).
    exp_unit_cycles : float
        Assumption: cycles per element through the exp/log accelerator.
    dram_bytes : int
        LPDDR4 capacity per chip (2 GB).
    dram_bw_bytes_s : float
        LPDDR4 bandwidth per chip (6.4 GB/s).
    dma_bw_bytes_per_cycle : float
        Assumption: per-PE DMA engine bandwidth between SRAM and the NoC (8 B/cycle = 2 GB/s at
        250 MHz).
    noc_bw_bytes_s : float
        Assumption: aggregate NoC bisection bandwidth per chip (not published; 64 GB/s).
    noc_hop_cycles : int
        Assumption: per-hop router latency.
    links_per_chip : int
        Chip-to-chip links (6).
    link_bw_bytes_s : float
        Assumption: bandwidth per chip-to-chip link (not published; 0.5 GB/s, in line with
        SpiNNaker2's serial links).
    barrier_cycles : int
        Assumption: cycles for a chip-wide barrier (a NoC multicast round trip).
    dma_setup_cycles : int
        Assumption: fixed cost of issuing one DMA transfer.
    e_mac_int8_j, e_flop_fp32_j, e_sram_byte_j, e_dram_byte_j, e_noc_byte_j, e_link_byte_j : float
        Assumptions: energy per operation / byte moved (22FDX-class figures). The timing model
        charges ``e_mac_int8_j`` per MAC (``flops / 2``) of ``int8`` layers and ``e_flop_fp32_j``
        per ``flops / 2`` of ``fp32`` layers.
    p_static_w_per_chip : float
        Assumption: static power per chip.
    """

    name: str = "spinn2-chip"
    chips: int = 1
    pes_per_chip: int = 152
    pes_per_qpe: int = 4
    sram_bytes: int = 128 * 1024
    sram_reserved_bytes: int = 16 * 1024
    mac_rows: int = 16
    mac_cols: int = 4
    mac16_per_cycle: int = 16
    acc_bits: int = 29
    mac_readout_cycles: int = 16
    clock_hz: float = 250e6
    m4f_flops_per_cycle: float = 0.5
    m4f_elementwise_cycles: float = 4.0
    exp_unit_cycles: float = 2.0
    dram_bytes: int = 2 * 1024**3
    dram_bw_bytes_s: float = 6.4e9
    dma_bw_bytes_per_cycle: float = 8.0
    noc_bw_bytes_s: float = 64e9
    noc_hop_cycles: int = 4
    links_per_chip: int = 6
    link_bw_bytes_s: float = 0.5e9
    barrier_cycles: int = 200
    dma_setup_cycles: int = 50
    e_mac_int8_j: float = 0.3e-12
    e_flop_fp32_j: float = 10e-12
    e_sram_byte_j: float = 1e-12
    e_dram_byte_j: float = 40e-12
    e_noc_byte_j: float = 2e-12
    e_link_byte_j: float = 20e-12
    p_static_w_per_chip: float = 0.5
    host_fallback: str = field(default="llvm")

    def __post_init__(self) -> None:
        positive_ints = (
            "chips", "pes_per_chip", "pes_per_qpe", "sram_bytes", "mac_rows", "mac_cols",
            "mac16_per_cycle", "dram_bytes", "links_per_chip",
        )
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ArchError(f"SpinnArch.{name} must be a positive integer, got {value!r}")
        positive_floats = (
            "clock_hz", "m4f_flops_per_cycle", "m4f_elementwise_cycles", "exp_unit_cycles",
            "dram_bw_bytes_s", "dma_bw_bytes_per_cycle", "noc_bw_bytes_s", "link_bw_bytes_s",
        )
        for name in positive_floats:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ArchError(f"SpinnArch.{name} must be a positive number, got {value!r}")
        for name in ("sram_reserved_bytes", "mac_readout_cycles", "noc_hop_cycles", "barrier_cycles",
                     "dma_setup_cycles", "e_mac_int8_j", "e_flop_fp32_j", "e_sram_byte_j", "e_dram_byte_j",
                     "e_noc_byte_j", "e_link_byte_j", "p_static_w_per_chip"):
            if getattr(self, name) < 0:
                raise ArchError(f"SpinnArch.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.pes_per_chip % self.pes_per_qpe:
            raise ArchError(
                f"SpinnArch.pes_per_chip ({self.pes_per_chip}) must be a multiple of "
                f"pes_per_qpe ({self.pes_per_qpe})"
            )
        if not 2 <= self.acc_bits <= 32:
            raise ArchError(f"SpinnArch.acc_bits must be in [2, 32], got {self.acc_bits}")
        # The smallest useful fp32 tile: one MAC-array block of A, B and C, double buffered.
        min_tile = 2 * 4 * (self.mac_rows * 1 + 1 * self.mac_cols + self.mac_rows * self.mac_cols)
        if self.tile_sram_bytes < min_tile:
            raise ArchError(
                f"SpinnArch.sram_bytes ({self.sram_bytes}) minus sram_reserved_bytes "
                f"({self.sram_reserved_bytes}) leaves {self.tile_sram_bytes} bytes, smaller than one "
                f"{self.mac_rows}x{self.mac_cols} MAC tile ({min_tile} bytes)"
            )
        if self.host_fallback not in ("llvm", "cuda"):
            raise ArchError(f"SpinnArch.host_fallback must be 'llvm' or 'cuda', got {self.host_fallback!r}")

    # Derived figures -------------------------------------------------------------------------
    @property
    def total_pes(self) -> int:
        """PEs in the whole system."""
        return self.chips * self.pes_per_chip

    @property
    def tile_sram_bytes(self) -> int:
        """SRAM per PE available to tiles."""
        return self.sram_bytes - self.sram_reserved_bytes

    @property
    def macs_per_cycle(self) -> int:
        """int8 MACs per cycle per PE."""
        return self.mac_rows * self.mac_cols

    @property
    def peak_int8_ops_s(self) -> float:
        """Peak int8 operations per second of the system (1 MAC = 2 ops)."""
        return 2.0 * self.macs_per_cycle * self.clock_hz * self.total_pes

    @property
    def peak_fp32_flops_s(self) -> float:
        """Peak fp32 FLOP/s of the system on the M4F cores (1 MAC = 2 FLOPs)."""
        return 2.0 * self.m4f_flops_per_cycle * self.clock_hz * self.total_pes

    @property
    def total_dram_bw_bytes_s(self) -> float:
        """Aggregate DRAM bandwidth of the system."""
        return self.dram_bw_bytes_s * self.chips

    def replace(self, **changes) -> "SpinnArch":
        """Return a copy with some fields changed (validated)."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ArchError(f"unknown SpinnArch field(s) {unknown}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain-dict form, stable key order (serialized into every spinn program)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "SpinnArch":
        """Inverse of :meth:`to_dict`; unknown keys are an error naming them."""
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ArchError(f"unknown SpinnArch field(s) {unknown}")
        return cls(**data)


def make_system(name: str = "custom", **fields_) -> SpinnArch:
    """Build a custom system description, validating every field.

    Parameters
    ----------
    name : str
        Name of the system (becomes the target's ``model``).
    **fields_
        Any :class:`SpinnArch` field, e.g. ``chips=4, pes_per_chip=32, sram_bytes=64*1024``.

    Returns
    -------
    SpinnArch
    """
    return SpinnArch().replace(name=name, **fields_)
