"""The SpiNNaker2-class target model: one frozen dataclass, every number a named parameter.

The defaults describe the **production SpiNNaker2 chip** at its upper DVFS level (300 MHz).
Published figures are cited next to the field that holds them; the rest are *assumptions*,
marked as such. Sources:

- [OJCAS26] the production-chip paper, arXiv 2607.24396 (IEEE OJCAS 2026), read through a
  secondary summary: 152 PEs of which 148 run applications, a 16 x 4 int8 MAC array per PE with
  24-bit accumulators, 5.837 TOPS theoretical and 4.563 TOPS measured at 300 MHz, 2.77 TOPS/W at
  150 MHz and 2.06 TOPS/W at 300 MHz, NoC of 192-bit flits, 5 cycles per hop, 307.2 Gbit/s
  bisection; ~6 Gbit/s per on-board chip-to-chip link.
- [SpiNNMachine] SpiNNakerManchester/SpiNNMachine ``spinn_machine/version/version_spin2.py``:
  ``clock_speeds_hz`` = 150 and 300 (MHz); 16,384 router entries. 150 MHz runs at 0.5 V and
  300 MHz at 0.8 V.
- [DS003] SpiNNaker2 datasheet v0.03: 2 GB LPDDR4 per chip, up to 6.4 GB/s sustained.
- [TUD-FAQ] TU Dresden SpiNNaker2 FAQ: the *test chip*'s MAC array accumulated in 29 bits.
- [SpiNNMachine-248] SpiNNakerManchester/SpiNNMachine ``spinn_machine/version/version_248.py`` and
  ``version_48_chips.py``: the 48-chip SpiNNaker2 board is described with the SpiNN-5 chip layout
  (an 8 x 8 hexagon of 48 chips on the triangular lattice; "TODO get real values" in the source,
  so the layout is the published *model* of the board, not a published wiring diagram), and
  multi-board machines as triads of boards on a 12 x 12-chip-per-triad torus.
- [M4-TRM] Arm Cortex-M4 Processor Technical Reference Manual (r0p1), FPU chapter: 32
  single-precision registers S0-S31; VADD.F32 and VMUL.F32 take 1 cycle, VMLA.F32 and VFMA.F32
  3, VLDR.F32 2, VLDM 1 + n (read through the TRM's table as quoted in secondary sources, e.g.
  electronics.stackexchange.com/questions/544886); interrupt entry 12 cycles (Arm knowledge
  article 103489845, quoting the TRM).
- [Systems-S] secondary sources on SpiNNaker2 systems (collected in the project notes, not read
  in a primary source): ~2 Gbit/s per board-to-board link; 48 chips a board; systems of 24
  boards; SpiNNcloud ~720 boards (~34-35k chips); one 1 GbE host port per board.
- [spiNNlink] L. A. Plana et al., "spiNNlink: FPGA-Based Interconnect for the Million-Core
  SpiNNaker System", IEEE Access 8 (2020), and its HDL, SpiNNakerManchester/spio
  (``designs/spinnaker_fpgas/README.md``, ``modules/hss_multiplexer/README.md`` and
  ``spio_hss_multiplexer_common.h``): a SpiNNaker1 (SpiNN-5) board reaches each of its six
  neighbours (E, NE, N, W, SW, S) through **one** high-speed serial link (a SATA cable driven by
  one of the board's three FPGAs, 3.0 Gbit/s line rate with 8b/10b coding) that multiplexes the
  **eight** chip-to-chip links of that board edge (``NUM_CHANS`` 8). The packets it carries are
  SpiNNaker packets of 72 bits (``PKT_BITS``): an 8-bit header, a 32-bit routing key and a
  32-bit payload word (``PKT_HDR_RNG``, ``PKT_KEY_RNG``, ``PKT_PLD_RNG``), so bulk data moves
  at 32/72 of a link's packet bit rate. What SpiNNaker2 boards use between boards and whether
  SpiNNaker2 packets keep one key per payload word is not published in what we found: both are
  assumptions here (:attr:`SpinnArch.link_payload_fraction`, :attr:`SpinnArch.board_serial_links`),
  with ranges in :data:`ASSUMPTION_RANGES`.

Everything downstream (tiling, placement, timing, energy) reads its numbers from a
:class:`SpinnArch` and nothing else. :data:`CHIPS` holds the presets ``"production"`` (the
defaults), ``"production-150mhz"`` (the lower DVFS level) and ``"testchip"`` (the numbers this
model used before it followed the production chip, kept so earlier results can be reproduced);
:func:`make_system` starts from one of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
from dataclasses import dataclass, field, fields
from typing import Mapping

__all__ = ["SpinnArch", "ArchError", "make_system", "CHIPS", "AssumedRange", "ASSUMPTION_RANGES", "FAULT_FIELDS"]


#: The PE code's overheads as calibrated on the executed cycles of the generated code
#: (``bench/iss.py``, which prints the values its calibration rows imply): per element and pass
#: of a loop, and per job. Assumptions: they describe what LLVM emits for the PE kernels, not
#: the silicon.
LOOP_CYCLES, JOB_CYCLES = 0.5, 93.0


class ArchError(ValueError):
    """A system description with impossible numbers (names the offending field)."""


@dataclass(frozen=True)
class SpinnArch:
    """Architecture parameters of a SpiNNaker2-class many-core system.

    The defaults are the production SpiNNaker2 chip at 300 MHz; the bracketed tags name the
    sources listed in the module docstring.

    Parameters
    ----------
    name : str
        System name, used as the target ``model`` attribute and in reports.
    chips : int
        Number of chips in the system (1 chip, 48 per board, ~35k for SpiNNcloud).
    pes_per_chip : int
        Processing elements (Arm Cortex-M4F) per chip that run applications, the only ones the
        mapping places work on: 148 [OJCAS26]. Global PE indices run over these.
    mgmt_pes_per_chip : int
        PEs per chip kept by the chip's management software, never given work: 152 - 148 = 4
        [OJCAS26] (one quad-PE). Counted only by :attr:`physical_pes_per_chip`.
    pes_per_qpe : int
        PEs per quad-PE (the NoC router endpoint): 4 [OJCAS26].
    sram_bytes : int
        Local SRAM per PE (code, stack and data share it): 128 KiB.
    sram_reserved_bytes : int
        Assumption: SRAM kept for code, stack and runtime state, unavailable to tiles.
    mac_rows, mac_cols : int
        Shape of the output-stationary MAC array: 16 x 4 = 64 int8 MACs/cycle [OJCAS26].
    mac16_per_cycle : int
        MACs per cycle in 16-bit mode (pairs of int8 MACs fuse: 64 / 4 [OJCAS26]).
    acc_bits : int
        Width of the MAC array's signed accumulators: 24 bits on the production chip [OJCAS26]
        (29 on the test chip [TUD-FAQ]). Int8 reductions are split at
        :func:`tvm_spinn.program.ops.gemm.safe_k_chunk` (511 products for 24 bits) so it never wraps.
    mac_readout_cycles : int
        Assumption: cycles for the MAC array to write one ``mac_rows x mac_cols`` block of 32-bit
        sums to SRAM after a k-chunk (64 words = 256 B through a 128-bit SRAM port: 16). int8
        tiles pay it once per block and k-chunk (see ``tvm_spinn.mapping.tiling``).
    clock_hz : float
        PE clock: 300 MHz, the upper of the two DVFS levels (150 MHz at 0.5 V, 300 MHz at 0.8 V)
        [SpiNNMachine]; the level [OJCAS26] measured its TOPS at.
    m4f_flops_per_cycle : float
        Sustained fp32 multiply-accumulates per cycle of the M4F's GEMM inner loop, from the
        FPU's cycle counts [M4-TRM]: VMUL.F32 and VADD.F32 take 1 cycle each, VMLA.F32 3 (so the
        loop multiplies and adds with VMUL + VADD, 2 cycles, which rounds exactly as the
        unfused VMLA the bits follow), VLDM of n registers 1 + n. A 4 x 4 block of
        accumulators (16 of the 32 registers, 8 more for the operands) loads 4 values of A and
        4 of B per k (two VLDM: 2 x 5 cycles) for 16 MACs (32 cycles): 16 / 42 = 0.381.
        Only ``mode="fp32"`` layers use it; ``mode="int8"`` GEMMs run on the MAC array at
        :attr:`macs_per_cycle` (168x the M4F's rate with the defaults).
    m4f_elementwise_cycles : float
        Assumption: cycles per fp32 element for simple element-wise ops on the M4F (load, op, store).
    m4f_chain_cycles : float
        Cycles per element of a sequential fp32 sum over values already in FPU registers (one
        dependent VADD.F32 each): 1 [M4-TRM]. A split row's chain (:mod:`tvm_spinn.program.ops.rows`)
        runs at this rate where a PE's chunk fits :attr:`m4f_chain_registers`, else at two
        element-wise operations per element (a load and an add).
    m4f_chain_registers : int
        Values of a chunk a PE can hold in FPU registers while it waits for the running sum: 24
        of the 32 single-precision registers [M4-TRM] (assumption: 8 kept for the sum, the
        statistic and addresses).
    m4f_mem_cycles, m4f_mem_pipelined_cycles : int
        Cycles of a single load or store (LDR/STR, VLDR.F32/VSTR.F32): 2, and 1 for one that
        directly follows another load or store (the address and data phases pipeline)
        [M4-TRM] (table 3-1, table 7-1, section 3.3.2). The M4F costs of the element-wise, row
        and fp32 GEMM kernels (:mod:`tvm_spinn.program.ops.m4f`) price their loads and stores
        with these.
    m4f_fpu_cycles : int
        Cycles of a single-cycle FPU instruction (VADD/VSUB/VMUL/VNMUL/VABS/VNEG/VCMP/VMOV/VMRS/
        VCVT.F32): 1 [M4-TRM] (table 7-1).
    m4f_divide_cycles : int
        Cycles of VDIV.F32 and of VSQRT.F32: 14 [M4-TRM] (table 7-1).
    m4f_alu_cycles : int
        Cycles of an integer data-processing instruction (and of IT): 1 [M4-TRM] (table 3-1).
    m4f_branch_cycles : int
        Cycles of a taken branch: 1 + P with the pipeline refill P = 1 for a branch to an
        immediate: 2 [M4-TRM] (table 3-1).
    m4f_loop_cycles : float
        Assumption, calibrated on the executed cycles of the generated PE code
        (``bench/iss.py``'s calibration rows: the element-wise ``add`` at two shapes): cycles per
        element and pass over the data that a kernel's loop spends beyond its body (index and
        address increments, the loop's compare and branch, less what LLVM's unrolling saves).
        It depends on the code LLVM emits, not on the silicon.
    m4f_job_cycles : float
        Assumption, calibrated like :attr:`m4f_loop_cycles` (same rows): cycles of one job of a
        PE's job loop beyond the kernel's loops (reading the job's arguments, the call and
        return, the kernel's prologue, epilogue and per-call set-up).
    exp_unit_cycles : float
        Assumption: cycles per element through the exp/log accelerator (a pipelined unit;
        [OJCAS26] gives 7-22 cycles latency).
    exp_unit_latency_cycles : int
        Assumption: cycles from starting the exp/log unit on a stream of arguments to its first
        result, the low end of [OJCAS26]'s 7-22 cycles latency; the PE code's executed cycles
        (:mod:`tvm_spinn.pe`) pay it once per stream, the timing model not at all.
    dram_bytes : int
        LPDDR4 capacity per chip: 2 GB [DS003].
    dram_bw_bytes_s : float
        LPDDR4 bandwidth per chip: 6.4 GB/s [DS003].
    dma_bw_bytes_per_cycle : float
        Assumption: per-PE DMA engine bandwidth between SRAM and the NoC (8 B/cycle = 2.4 GB/s at
        300 MHz).
    noc_bw_bytes_s : float
        NoC bisection bandwidth per chip, both directions: 307.2 Gbit/s = 38.4 GB/s [OJCAS26]
        (what crosses the middle of the mesh, not the chip's total: see
        :attr:`noc_link_bytes_per_cycle`).
    noc_hop_cycles : int
        Router latency per hop: 5 cycles [OJCAS26].
    noc_link_bytes_per_cycle : float
        Payload one NoC router link carries per cycle and direction: 16 B. [OJCAS26] gives
        192-bit flits; assumption: 128 bits of a flit are payload (the rest routing and
        control), which makes the published bisection (307.2 Gbit/s = 1,024 bits per cycle at
        300 MHz) eight such links. Every quad-PE's router joins its four PEs to the mesh through
        one such port, so the PEs of a quad-PE share it (the timing model's per-router
        contention); :attr:`noc_bw_bytes_s` bounds the traffic across the middle of the chip.
    links_per_chip : int
        Chip-to-chip links: 6 [OJCAS26, SpiNNMachine].
    link_bw_bytes_s : float
        Bit rate per on-board chip-to-chip link, each direction: ~6 Gbit/s = 0.75 GB/s [OJCAS26].
        Data moves at :attr:`link_payload_fraction` of it (:meth:`payload_bw`).
    link_payload_fraction : float
        Share of a link's bit rate that carries data: 32 / 72 (assumption for SpiNNaker2: the
        SpiNNaker packet of an 8-bit header, a 32-bit routing key and one 32-bit payload word
        [spiNNlink]). Applies to on-board and board-to-board links alike.
    barrier_cycles : int
        Software cycles a barrier costs beyond its packets (:meth:`barrier_cost_cycles`): 0 for
        the static schedule, which runs no scheduler between layers (a runtime with a software
        scheduler, e.g. OctopuScheduler's ~13 us per layer, would add its own).
    barrier_pop_cycles : float
        Cycles a barrier's counting PE spends popping one arrival packet, from the PE runtime's
        executed barrier (:mod:`tvm_spinn.pe.noc`, ``pe_barrier``): the packets are counted
        from the receive FIFO's count and popped unread, four back to back: an STR of 2 cycles
        and three pipelined STRs of 1 [M4-TRM] = 5 cycles for four packets: 5 / 4. (The
        loops around the pops and the rest of the barrier's path are the code's too:
        :meth:`barrier_cost_cycles`.)
    task_word_cycles : float
        Assumption: cycles a software scheduler's PE spends on one 32-bit packet word
        (:attr:`task_descriptor_words`), sending or receiving it, and on taking one completion
        packet: a load and a store (to the transmit register, or from the receive register into
        the descriptor) and the loop's compare and branch: 4.
    task_descriptor_words : int
        Assumption: 32-bit payload words of the task descriptor a software scheduler sends a
        worker PE for one layer (``MappingOptions(scheduler="software")``, read only by the
        timing model in that setup): an operation code, the six operand addresses of an int8
        GEMM (input, weight, bias, multiplier, shift, output) and the lower and upper bounds of
        the worker's share on the three GEMM axes: 13. One SpiNNaker packet carries one
        payload word [spiNNlink].
    irq_entry_cycles : int
        Cycles from an interrupt (a packet that releases a waiting PE) to the first instruction
        of its handler: 12 [M4-TRM].
    dma_setup_cycles : int
        Assumption: fixed cost of issuing one DMA transfer.
    e_mac_int8_j : float
        Energy per int8 MAC on the array, *derived* from [OJCAS26]: at 300 MHz the chip runs
        4.563 TOPS at 2.06 TOPS/W, i.e. 4.563 / 2.06 = 2.215 W for 2.2815e12 MAC/s; less the
        assumed :attr:`p_static_w_per_chip` (0.5 W) that leaves (2.215 - 0.5) / 2.2815e12 =
        0.752 pJ per MAC (operand SRAM reads included). MACs alone at the measured rate
        reproduce the published 2.06 TOPS/W; the timing model also charges the bytes a program
        moves (SRAM, NoC, DRAM) at the per-byte figures below, so a modelled program reports a
        lower TOPS/W (its SRAM operand traffic is counted conservatively, partly twice).
    e_flop_fp32_j, e_sram_byte_j, e_dram_byte_j, e_noc_byte_j, e_link_byte_j : float
        Assumptions: energy per fp32 MAC on the M4F / byte moved (22FDX-class figures). The timing
        model charges ``e_mac_int8_j`` per MAC (``flops / 2``) of ``int8`` layers and
        ``e_flop_fp32_j`` per ``flops / 2`` of ``fp32`` layers.
    p_static_w_per_chip : float
        Assumption: static power per chip at 0.8 V (0.5 W).
    host_fallback : {"llvm", "cuda"}
        Where operators that are not offloaded run.
    chips_per_board : int
        Chips on one board: 48 [SpiNNMachine-248, Systems-S]. A system of more chips is made of
        whole boards (``chips`` a multiple of it); a smaller one uses part of one board.
    board_link_bw_bytes_s : float
        Bit rate of one board-to-board serial link, each direction: ~2 Gbit/s = 0.25 GB/s
        [Systems-S]. Read only through :meth:`payload_bw`.
    board_serial_links : int
        Serial links joining a board to the neighbour across one of its six edges (each
        direction), shared by all the chip-to-chip links of that edge: 1 (assumption for
        SpiNNaker2: SpiNNaker1's spiNNlink multiplexes a board edge's 8 chip links onto one
        serial link [spiNNlink]).
    link_hop_s : float
        Assumption: latency of one hop over an on-board link (router pipeline, serialisation of a
        packet and the SERDES): 0.5 us.
    board_link_hop_s : float
        Assumption: latency of one hop over a board-to-board link (cable and board-edge SERDES on
        top of :attr:`link_hop_s`): 1.0 us.
    host_mem_bw_bytes_s : float
        Assumption: memory bandwidth of the host running the fallback's operators (their
        roofline: bytes read and written over this), 10 GB/s, one core of a current x86 server
        streaming. Read only by reports that time host operators (``tvm_spinn.training.
        step_time``'s host phase); transfers between the board and the host take the host's link
        (:attr:`host_link_bw_bytes_s`, :attr:`host_link_latency_s`).
    host_op_s : float
        Assumption: fixed cost of one host operator call (VM dispatch, kernel entry), 2 us.
    host_link_bw_bytes_s : float
        Bit rate of the link between the host and a board, each direction: one 1 GbE port per
        board = 125 MB/s [Systems-S]. Read by the LLM planner (:func:`tvm_spinn.llm.plan`) for
        the host's I/O: the prompt in, each sampled token out.
    host_link_latency_s : float
        Assumption: one-way latency of a small message between the host and a board (a UDP
        datagram through the host's network stack, its NIC and the board's Ethernet
        interface): 20 us.
    dead_chips : tuple of int
        Chips (ids ``0 .. chips - 1``) that do not work: they hold no work and their routers
        forward nothing. Empty for a healthy system.
    dead_links : tuple of (int, int)
        Chip-to-chip links that do not work, each as ``(chip, direction)``: the link leaving
        ``chip`` in ``direction`` (0 E, 1 NE, 2 N, 3 W, 4 SW, 5 S, the numbering of
        :mod:`tvm_spinn.target.topology`); dead both ways.
    dead_board_links : tuple of (int, int)
        Board edges whose serial link(s) do not work, each as ``(board, edge)`` (edges 0-5 in
        the order of :mod:`tvm_spinn.target.topology`'s edge groups): every chip-to-chip link
        that crosses that edge is dead both ways.
    dead_boards : tuple of int
        Boards (ids ``0 .. boards - 1``) that do not work: all their chips are dead.
    allocated_boards : tuple of int
        The boards of this machine the system may use (a partial allocation of a larger
        machine, e.g. ``tuple(range(24))`` of ``spinn/cloud``); the others are someone else's:
        nothing is placed on them and no route crosses them. Empty: every board. The five
        fault fields are kept sorted and free of duplicates (any sequence is accepted);
        :mod:`tvm_spinn.target.faults` derives the live hardware from them, and the link graph
        (:func:`tvm_spinn.target.topology.topology_of`) routes around what they name.
    """

    name: str = "spinn2-chip"
    chips: int = 1
    pes_per_chip: int = 148  # [OJCAS26]
    mgmt_pes_per_chip: int = 4  # [OJCAS26]: 152 - 148
    pes_per_qpe: int = 4
    sram_bytes: int = 128 * 1024
    sram_reserved_bytes: int = 16 * 1024  # assumption
    mac_rows: int = 16  # [OJCAS26]
    mac_cols: int = 4  # [OJCAS26]
    mac16_per_cycle: int = 16
    acc_bits: int = 24  # [OJCAS26]
    mac_readout_cycles: int = 16  # assumption
    clock_hz: float = 300e6  # [SpiNNMachine], [OJCAS26]
    m4f_flops_per_cycle: float = 16 / (16 * (1 + 1) + 2 * (1 + 4))  # [M4-TRM], see the docstring
    m4f_elementwise_cycles: float = 4.0  # assumption
    exp_unit_cycles: float = 2.0  # assumption
    dram_bytes: int = 2 * 1024**3  # [DS003]
    dram_bw_bytes_s: float = 6.4e9  # [DS003]
    dma_bw_bytes_per_cycle: float = 8.0  # assumption
    noc_bw_bytes_s: float = 307.2e9 / 8  # [OJCAS26]
    noc_hop_cycles: int = 5  # [OJCAS26]
    noc_link_bytes_per_cycle: float = 16.0  # [OJCAS26] 192-bit flits; assumption: 128-bit payload
    links_per_chip: int = 6  # [OJCAS26]
    link_bw_bytes_s: float = 6e9 / 8  # [OJCAS26]
    barrier_cycles: int = 0  # the static schedule's: see the docstring
    barrier_pop_cycles: float = 5 / 4  # the executed barrier's pops [M4-TRM], see the docstring
    task_word_cycles: float = 4.0  # assumption
    irq_entry_cycles: int = 12  # [M4-TRM]
    task_descriptor_words: int = 1 + 6 + 2 * 3  # assumption, see the docstring
    dma_setup_cycles: int = 50  # assumption
    # [OJCAS26] derived, see the docstring: (measured W at 300 MHz - static W) / measured MAC/s
    e_mac_int8_j: float = (4.563e12 / 2.06e12 - 0.5) / (4.563e12 / 2)
    e_flop_fp32_j: float = 10e-12  # assumption
    e_sram_byte_j: float = 1e-12  # assumption
    e_dram_byte_j: float = 40e-12  # assumption
    e_noc_byte_j: float = 2e-12  # assumption
    e_link_byte_j: float = 20e-12  # assumption
    p_static_w_per_chip: float = 0.5  # assumption
    host_fallback: str = field(default="llvm")
    # Topology (read by tvm_spinn.target.topology only); see _TOPOLOGY_FIELDS for why they are
    # left out of to_dict() while at their defaults.
    chips_per_board: int = 48  # [SpiNNMachine-248], [Systems-S]
    board_link_bw_bytes_s: float = 2e9 / 8  # [Systems-S]
    link_hop_s: float = 0.5e-6  # assumption
    board_link_hop_s: float = 1.0e-6  # assumption
    # The links' packet overhead and the board edges' serial links (read through payload_bw());
    # left out of to_dict() at their defaults like the topology fields.
    link_payload_fraction: float = 32 / 72  # assumption, [spiNNlink]
    board_serial_links: int = 1  # assumption, [spiNNlink]
    # The host's roofline (read by timing reports of host operators only); like the topology
    # fields, left out of to_dict() while at their defaults.
    host_mem_bw_bytes_s: float = 10e9  # assumption
    host_op_s: float = 2e-6  # assumption
    # The host's link to the boards (read by the LLM planner's host I/O); left out of to_dict()
    # at their defaults like the host's roofline.
    host_link_bw_bytes_s: float = 1e9 / 8  # [Systems-S]
    host_link_latency_s: float = 20e-6  # assumption
    # The M4F's register-resident sums (read by the row operators' costs); left out of
    # to_dict() at their defaults like the topology fields.
    m4f_chain_cycles: float = 1.0  # [M4-TRM]
    m4f_chain_registers: int = 24  # [M4-TRM], assumption (see the docstring)
    # The exp/log unit's pipeline fill (read by the instruction-set simulator only); left out of
    # to_dict() at its default like the timing fields.
    exp_unit_latency_cycles: int = 7  # [OJCAS26], assumption (see the docstring)
    # The M4F's instruction cycles and the PE code's overheads (read by the M4F costs of
    # tvm_spinn.program.ops.m4f); left out of to_dict() at their defaults like the timing fields.
    m4f_mem_cycles: int = 2  # [M4-TRM]
    m4f_mem_pipelined_cycles: int = 1  # [M4-TRM]
    m4f_fpu_cycles: int = 1  # [M4-TRM]
    m4f_divide_cycles: int = 14  # [M4-TRM]
    m4f_alu_cycles: int = 1  # [M4-TRM]
    m4f_branch_cycles: int = 2  # [M4-TRM]
    m4f_loop_cycles: float = LOOP_CYCLES  # assumption, calibrated (see the docstring)
    m4f_job_cycles: float = JOB_CYCLES  # assumption, calibrated (see the docstring)
    # Faults and the allocation (read by tvm_spinn.target.faults and the link graph); left out
    # of to_dict() while empty, like the topology fields.
    dead_chips: tuple = ()
    dead_links: tuple = ()
    dead_board_links: tuple = ()
    dead_boards: tuple = ()
    allocated_boards: tuple = ()

    def __post_init__(self) -> None:
        positive_ints = (
            "chips", "pes_per_chip", "pes_per_qpe", "sram_bytes", "mac_rows", "mac_cols",
            "mac16_per_cycle", "dram_bytes", "links_per_chip", "chips_per_board", "m4f_chain_registers",
            "board_serial_links", "task_descriptor_words",
        )
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ArchError(f"SpinnArch.{name} must be a positive integer, got {value!r}")
        positive_floats = (
            "clock_hz", "m4f_flops_per_cycle", "m4f_elementwise_cycles", "exp_unit_cycles",
            "dram_bw_bytes_s", "dma_bw_bytes_per_cycle", "noc_bw_bytes_s", "link_bw_bytes_s",
            "board_link_bw_bytes_s", "host_mem_bw_bytes_s", "m4f_chain_cycles", "noc_link_bytes_per_cycle",
            "barrier_pop_cycles", "task_word_cycles", "host_link_bw_bytes_s",
        )
        for name in positive_floats:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ArchError(f"SpinnArch.{name} must be a positive number, got {value!r}")
        if not isinstance(self.link_payload_fraction, numbers.Real) or isinstance(self.link_payload_fraction, bool) \
                or not 0 < self.link_payload_fraction <= 1:
            raise ArchError(f"SpinnArch.link_payload_fraction must be in (0, 1], got {self.link_payload_fraction!r}")
        if not isinstance(self.mgmt_pes_per_chip, int) or isinstance(self.mgmt_pes_per_chip, bool):
            raise ArchError(f"SpinnArch.mgmt_pes_per_chip must be an integer, got {self.mgmt_pes_per_chip!r}")
        if not isinstance(self.exp_unit_latency_cycles, int) or isinstance(self.exp_unit_latency_cycles, bool) \
                or self.exp_unit_latency_cycles < 0:
            raise ArchError(f"SpinnArch.exp_unit_latency_cycles must be a non-negative integer, "
                            f"got {self.exp_unit_latency_cycles!r}")
        for name in ("m4f_mem_cycles", "m4f_mem_pipelined_cycles", "m4f_fpu_cycles", "m4f_divide_cycles",
                     "m4f_alu_cycles", "m4f_branch_cycles"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ArchError(f"SpinnArch.{name} must be a positive integer, got {value!r}")
        for name in ("m4f_loop_cycles", "m4f_job_cycles"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0 <= value < math.inf:
                raise ArchError(f"SpinnArch.{name} must be a finite non-negative number, got {value!r}")
        if self.m4f_mem_pipelined_cycles > self.m4f_mem_cycles:
            raise ArchError(f"SpinnArch.m4f_mem_pipelined_cycles ({self.m4f_mem_pipelined_cycles}) exceeds "
                            f"m4f_mem_cycles ({self.m4f_mem_cycles}): a pipelined load cannot be slower")
        if not isinstance(self.acc_bits, int) or isinstance(self.acc_bits, bool):
            raise ArchError(f"SpinnArch.acc_bits must be an integer, got {self.acc_bits!r}")
        for name in ("mgmt_pes_per_chip", "sram_reserved_bytes", "mac_readout_cycles", "noc_hop_cycles",
                     "barrier_cycles", "irq_entry_cycles", "dma_setup_cycles", "e_mac_int8_j", "e_flop_fp32_j", "e_sram_byte_j", "e_dram_byte_j",
                     "e_noc_byte_j", "e_link_byte_j", "p_static_w_per_chip", "link_hop_s",
                     "board_link_hop_s", "host_op_s", "host_link_latency_s"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not value >= 0:
                raise ArchError(f"SpinnArch.{name} must be a number >= 0, got {value!r}")
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
        self._check_consistency()
        # Boards are joined only through their edge links: a system larger than one board is whole
        # boards (a partly populated board would leave the board-level torus with holes).
        if self.chips > self.chips_per_board and self.chips % self.chips_per_board:
            raise ArchError(
                f"SpinnArch.chips ({self.chips}) must be at most chips_per_board "
                f"({self.chips_per_board}) or a whole number of boards (a multiple of it)"
            )
        self._check_faults()

    def _check_faults(self) -> None:
        """Normalize the fault fields (sorted tuples, no duplicates) and refuse ids out of range
        or a description that leaves no chip to use (the message names the field)."""

        def index(name: str, value, limit: int, what: str) -> int:
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 0 <= value < limit:
                raise ArchError(f"SpinnArch.{name}: {what} must be an integer in [0, {limit}), got {value!r}")
            return int(value)

        if not any(getattr(self, name) for name in FAULT_FIELDS):
            return  # a healthy, whole system (the default)
        boards = self.boards
        for name, limit, what in (("dead_chips", self.chips, "a chip id"), ("dead_boards", boards, "a board id"),
                                  ("allocated_boards", boards, "a board id")):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise ArchError(f"SpinnArch.{name} must be a sequence of ids, got {value!r}")
            object.__setattr__(self, name, tuple(sorted({index(name, v, limit, what) for v in value})))
        for name, limit, second, what in (("dead_links", self.chips, self.links_per_chip, "(chip, direction)"),
                                          ("dead_board_links", boards, 6, "(board, edge)")):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise ArchError(f"SpinnArch.{name} must be a sequence of {what} pairs, got {value!r}")
            pairs = set()
            for pair in value:
                if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2:
                    raise ArchError(f"SpinnArch.{name}: each entry must be a {what} pair, got {pair!r}")
                pairs.add((index(name, pair[0], limit, what.strip("()").split(", ")[0]),
                           index(name, pair[1], second, what.strip("()").split(", ")[1])))
            object.__setattr__(self, name, tuple(sorted(pairs)))
        if self.dead_board_links and boards < 2:
            raise ArchError(f"SpinnArch.dead_board_links: a system of one board has no board-to-board links, "
                            f"got {self.dead_board_links}")
        usable = set(self.allocated_boards or range(boards)) - set(self.dead_boards)
        per_board = min(self.chips, self.chips_per_board)
        live = len(usable) * per_board - sum(1 for c in self.dead_chips if c // self.chips_per_board in usable)
        if not live:
            raise ArchError(
                f"SpinnArch.dead_chips / dead_boards / allocated_boards leave no chip to use (allocated boards "
                f"{list(self.allocated_boards) or 'all'}, dead boards {list(self.dead_boards)}, "
                f"{len(self.dead_chips)} dead chip(s))")

    def _check_consistency(self) -> None:
        """Numbers that are each valid but contradict one another (the message names both)."""
        for name in ("noc_hop_cycles", "link_hop_s", "board_link_hop_s"):
            if not getattr(self, name) > 0:
                raise ArchError(f"SpinnArch.{name} must be > 0, got {getattr(self, name)!r}: every hop passes a "
                                f"router, which takes time")
        # the NoC carries everything a chip's links send and receive: slower than one link, a link
        # could never be fed
        for name in ("link_bw_bytes_s", "board_link_bw_bytes_s"):
            if self.noc_bw_bytes_s < getattr(self, name):
                raise ArchError(
                    f"SpinnArch.noc_bw_bytes_s ({self.noc_bw_bytes_s:.4g} B/s) is slower than one link, "
                    f"SpinnArch.{name} ({getattr(self, name):.4g} B/s): the NoC feeds every link"
                )
        # a board-to-board hop passes a chip's link and router too, then the board edge's SERDES
        # and cable: it cannot be quicker than an on-board hop
        if self.board_link_hop_s < self.link_hop_s:
            raise ArchError(
                f"SpinnArch.board_link_hop_s ({self.board_link_hop_s:.4g} s) is shorter than "
                f"SpinnArch.link_hop_s ({self.link_hop_s:.4g} s): a board-to-board hop includes an on-board one"
            )

    # Derived figures -------------------------------------------------------------------------
    @property
    def boards(self) -> int:
        """Boards in the system (1 for a system of one board or part of one)."""
        return max(1, self.chips // self.chips_per_board)

    @property
    def total_pes(self) -> int:
        """PEs that run applications in the whole system (management PEs excluded)."""
        return self.chips * self.pes_per_chip

    @property
    def physical_pes_per_chip(self) -> int:
        """PEs on one chip, application and management ones (152 on SpiNNaker2)."""
        return self.pes_per_chip + self.mgmt_pes_per_chip

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
        """Peak int8 operations per second of the application PEs (1 MAC = 2 ops).

        5.683 TOPS for the production chip at 300 MHz: 148 PEs. [OJCAS26]'s 5.837 TOPS counts
        all 152.
        """
        return 2.0 * self.macs_per_cycle * self.clock_hz * self.total_pes

    @property
    def peak_fp32_flops_s(self) -> float:
        """Peak fp32 FLOP/s of the system on the M4F cores (1 MAC = 2 FLOPs)."""
        return 2.0 * self.m4f_flops_per_cycle * self.clock_hz * self.total_pes

    def noc_hops(self, pes: int) -> int:
        """NoC hops from the middle of the mesh that ``pes`` PEs' quad-PEs form (a near-square
        grid of routers) to its farthest router."""
        qpes = max(1, -(-int(pes) // self.pes_per_qpe))
        side = math.isqrt(qpes - 1) + 1  # ceil(sqrt(qpes))
        rows = -(-qpes // side)
        return side // 2 + rows // 2

    def barrier_layout(self, pes: int) -> tuple[tuple[tuple[int, int, int], ...], int]:
        """The quad-PEs of a barrier over ``pes`` PEs of one chip: ``(cells, root)``.

        The PEs fill whole quad-PEs (the last takes the rest) laid row by row on a near-square
        grid of routers, ``ceil(sqrt(qpes))`` wide; ``cells[i] = (row, column, PEs)``. ``root``:
        the index of the cell nearest the grid's middle (the one whose farthest cell is fewest
        router steps away, the first such), whose first PE is the barrier's root.
        """
        return _barrier_layout(max(1, int(pes)), self.pes_per_qpe)

    def barrier_cost_cycles(self, pes: int) -> float:
        """Cycles of a barrier over ``pes`` PEs of one chip, built from NoC packets: from every PE
        entering it at once to the last PE leaving it, as the PE runtime's barrier
        (:mod:`tvm_spinn.pe.noc`, ``pe_barrier``) executes on the tree of
        :meth:`barrier_layout`.

        Each PE sends one arrival packet to the first PE of its quad-PE (one router:
        :attr:`noc_hop_cycles`), which counts them and sends one on to the root, ``1 + d``
        routers away (``d`` grid steps); the root counts its quad-PE's and the other leaders'
        packets, multicasts the release, which travels as far back, and pops what is left. A
        counting PE polls the receive count until all its children's packets are in, popping
        four whenever four are waiting. The M4F's cycles on the way are the driver's executed
        instructions priced by the Cortex-M4 TRM's table as :mod:`tvm_spinn.pe.cycles` prices
        them (a basic block's cycles counted at its end, as the instruction-set simulator's
        clock): a leaf sends 20 cycles after entry (PUSH of four registers 5, MOVW, MOVT, LDR
        of PE_ID 2, CBZ taken 2; CMP, BNE taken 2; ORR, STR 2, STR 1, STR 1) and reads the
        count 6 later; a counting PE reads it first 18 after entry; a read that finds fewer
        packets than are due reads again 11 later (CMP, BHS, ADDS, CMP, BNE taken 2, CBZ, LDR
        2, CMP, BHS), or, with four waiting, 9 + 4 :attr:`barrier_pop_cycles` later (their
        four STRs to the pop register, the rest as before); from the read that finds every
        packet in, a leader sends 11 later, the root its release 13 later; a leader reads the
        count again 17 after its send, a turn of ``4 + 4 barrier_pop_cycles`` before it per
        four packets still to pop; the root pops them the same way and leaves 17 later (16
        after a turn, 2 more for an odd one); a PE waiting for the release leaves 16 after
        it lands (LDR of the key, ORR, MOVS, CMP, STR of the pop, IT, POP of four registers and
        PC 7). Plus :attr:`barrier_cycles` of software, if any.
        """
        # a pure function of the PEs and four numbers, called for every layer the timing model
        # times: computed once per distinct value (planning time)
        return _barrier_cost_cycles(max(1, int(pes)), self.pes_per_qpe, self.noc_hop_cycles, self.barrier_pop_cycles,
                                    self.barrier_cycles)

    @property
    def total_dram_bw_bytes_s(self) -> float:
        """Aggregate DRAM bandwidth of the system."""
        return self.dram_bw_bytes_s * self.chips

    def payload_bw(self, link: str = "chip") -> float:
        """Data bytes per second one link moves in one direction, packet overhead paid.

        Parameters
        ----------
        link : {"chip", "board_chip", "board_pair"}
            ``"chip"``: one on-board chip-to-chip link (:attr:`link_bw_bytes_s` x
            :attr:`link_payload_fraction`). ``"board_pair"``: everything one board edge carries
            to the neighbouring board, the :attr:`board_serial_links` serial links of
            :attr:`board_link_bw_bytes_s` together, shared by the edge's chip links.
            ``"board_chip"``: one chip-to-chip link through a board edge on its own, the slower
            of the chip's link and one serial link.

        Returns
        -------
        float
            Bytes per second.
        """
        chip = self.link_bw_bytes_s * self.link_payload_fraction
        serial = self.board_link_bw_bytes_s * self.link_payload_fraction
        if link == "chip":
            return chip
        if link == "board_chip":
            return min(chip, serial)
        if link == "board_pair":
            return serial * self.board_serial_links
        raise ArchError(f"payload_bw: link must be 'chip', 'board_chip' or 'board_pair', got {link!r}")

    def replace(self, **changes) -> "SpinnArch":
        """Return a copy with some fields changed (validated).

        A different ``chips`` describes another system (e.g. one board of this one, or one chip
        as a template): the fault fields, whose ids are this system's, are then left empty
        unless given too (see :func:`tvm_spinn.target.faults.board_view` for one board of a
        faulty system with its own faults).
        """
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ArchError(f"unknown SpinnArch field(s) {unknown}")
        if "chips" in changes and changes["chips"] != self.chips:
            for name in FAULT_FIELDS:
                changes.setdefault(name, ())
        return dataclasses.replace(self, **changes)

    @property
    def has_faults(self) -> bool:
        """Whether any fault field is set (dead hardware, or a partial allocation)."""
        return any(getattr(self, name) for name in FAULT_FIELDS)

    def to_dict(self) -> dict:
        """Plain-dict form, stable key order (serialized into every spinn program).

        The topology and host fields (:data:`_TOPOLOGY_FIELDS`, :data:`_HOST_FIELDS`) appear only when they differ from their
        defaults, so the programs (and mapping cache keys) of systems that do not set them are
        byte-identical to those written before the fields existed; :meth:`from_dict` restores
        the defaults.
        """
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _DEFAULTED_FIELDS and value == f.default:
                continue
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "SpinnArch":
        """Inverse of :meth:`to_dict`; unknown keys are an error naming them, a retired field's
        name an error naming its replacements (its meaning was split, never reinterpreted)."""
        for old, new in sorted(_RETIRED_FIELDS.items()):
            if old in data:
                raise ArchError(f"SpinnArch field {old!r} is retired: set {' / '.join(new)} instead "
                                f"({_RETIRED_FIELDS_WHY[old]})")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ArchError(f"unknown SpinnArch field(s) {unknown}")
        return cls(**data)


#: Retired field names -> the fields that replace them (:meth:`SpinnArch.from_dict` refuses the old name, so a
#: saved system is never silently given another meaning).
_RETIRED_FIELDS: Mapping[str, tuple] = types.MappingProxyType({
    "sync_packet_cycles": ("task_word_cycles", "barrier_pop_cycles")})
_RETIRED_FIELDS_WHY: Mapping[str, str] = types.MappingProxyType({
    "sync_packet_cycles": "a software scheduler's cycles per packet word are task_word_cycles, the executed "
                          "barrier's cycles per popped arrival barrier_pop_cycles"})
#: Fields added with the link graph; omitted from :meth:`SpinnArch.to_dict` at their defaults.
_TOPOLOGY_FIELDS = frozenset({"chips_per_board", "board_link_bw_bytes_s", "link_hop_s", "board_link_hop_s",
                              "link_payload_fraction", "board_serial_links"})
#: Fields of the host (its roofline, its link to the boards); omitted from :meth:`SpinnArch.to_dict` at their
#: defaults too.
_HOST_FIELDS = frozenset({"host_mem_bw_bytes_s", "host_op_s", "host_link_bw_bytes_s", "host_link_latency_s"})
#: The M4F's register-chain fields; omitted from :meth:`SpinnArch.to_dict` at their defaults.
_CHAIN_FIELDS = frozenset({"m4f_chain_cycles", "m4f_chain_registers"})
#: The timing model's interconnect, synchronisation and set-up fields; omitted at their defaults.
_TIMING_FIELDS = frozenset({"noc_link_bytes_per_cycle", "barrier_pop_cycles", "task_word_cycles", "irq_entry_cycles",
                            "task_descriptor_words", "exp_unit_latency_cycles"})
#: The M4F's instruction cycles and the PE code's overheads; omitted at their defaults.
_M4F_FIELDS = frozenset({"m4f_mem_cycles", "m4f_mem_pipelined_cycles", "m4f_fpu_cycles", "m4f_divide_cycles",
                         "m4f_alu_cycles", "m4f_branch_cycles", "m4f_loop_cycles", "m4f_job_cycles"})
#: The faults and the allocation (:attr:`SpinnArch.dead_chips` ...); omitted while empty.
FAULT_FIELDS = ("dead_chips", "dead_links", "dead_board_links", "dead_boards", "allocated_boards")
_DEFAULTED_FIELDS = (_TOPOLOGY_FIELDS | _HOST_FIELDS | _CHAIN_FIELDS | _TIMING_FIELDS | _M4F_FIELDS
                     | frozenset(FAULT_FIELDS))


@dataclass(frozen=True)
class AssumedRange:
    """The plausible span of one assumed (or only secondarily sourced) hardware number.

    Attributes
    ----------
    low, high : float
        The bounds, in the field's unit (``low <= default <= high``; integers for integer fields).
    source : str
        Why these bounds: the document or mechanism each end comes from.
    """

    low: float
    high: float
    source: str


#: Low/high range of every :class:`SpinnArch` number marked "assumption" (and of the cited ones
#: that are upper figures or come from secondary sources only), for sensitivity studies
#: (``bench/sensitivity.py``). Each range contains the field's default and gives a valid
#: system at either end. Cycle counts are at the PE clock.
ASSUMPTION_RANGES: Mapping[str, AssumedRange] = types.MappingProxyType({
    "sram_reserved_bytes": AssumedRange(
        8 * 1024, 32 * 1024,
        "assumption: a bare-metal kernel library and stack in 8 KiB at least; 32 KiB if the runtime "
        "keeps per-layer code and descriptors resident"),
    "noc_link_bytes_per_cycle": AssumedRange(
        8.0, 24.0,
        "[OJCAS26] 192-bit flits at the PE clock: 64 payload bits a flit (a header and a routing "
        "key in the rest) up to the whole flit"),
    "barrier_pop_cycles": AssumedRange(
        1.0, 2.0,
        "the PE runtime's executed barrier (tvm_spinn.pe.noc pe_barrier, priced by [M4-TRM]): its "
        "pops are STRs to the receive FIFO's pop register, four back to back: 2 + 1 + 1 + 1 = 5 "
        "cycles, 5/4 a packet; 1 if every STR pipelined, 2 if none did (an STR alone, or wait "
        "states on the peripheral bus)"),
    "task_word_cycles": AssumedRange(
        2.0, 10.0,
        "[M4-TRM]-based assumption: a load and an add per packet word at best; a load with "
        "peripheral wait states, a store, a compare and a taken branch at worst"),
    "task_descriptor_words": AssumedRange(
        7, 32,
        "assumption: an operation code, three operand addresses (input, weight block with its "
        "quantisation parameters packed behind it, output) and three packed 16-bit bound pairs at "
        "least; every address and bound in its own word plus per-tile entries for a worker given "
        "several tiles at most"),
    "mac_readout_cycles": AssumedRange(
        8, 64,
        "assumption: 64 32-bit sums through a 256-bit (8 cycles) to a 32-bit (64 cycles) SRAM port"),
    "m4f_flops_per_cycle": AssumedRange(
        1 / 7, 0.5,
        "[M4-TRM] FPU cycles: 1/7 MAC per cycle when each MAC loads both operands (two VLDR.F32 of "
        "2 cycles and a VMLA.F32 of 3); 0.5 with operands in registers (VMUL.F32 + VADD.F32, 1 "
        "cycle each)"),
    "m4f_elementwise_cycles": AssumedRange(
        3.0, 8.0,
        "[M4-TRM]-based assumption: load (2), op (1) and store per element at best; loop and "
        "address arithmetic up to 8"),
    "exp_unit_cycles": AssumedRange(
        1.0, 22.0,
        "[OJCAS26] gives 7-22 cycles latency for the exp/log unit: 1 per element fully pipelined, "
        "22 if not pipelined at all"),
    "exp_unit_latency_cycles": AssumedRange(
        7, 22, "[OJCAS26] gives 7-22 cycles latency for the exp/log unit"),
    "dma_bw_bytes_per_cycle": AssumedRange(
        4.0, 16.0,
        "assumption: a 32-bit to a 128-bit path between a PE's DMA and its NoC port"),
    "barrier_cycles": AssumedRange(
        0, 3900,
        "none beyond its packets for a static schedule, whose PEs wait on a NoC multicast (tens "
        "of cycles: ~10 routers of 5 cycles [OJCAS26]); up to OctopuScheduler's ~13 us per layer "
        "on silicon at 300 MHz (arXiv 2507.13736, a software scheduler's cost)"),
    "dma_setup_cycles": AssumedRange(
        20, 500,
        "assumption: writing a handful of DMA registers (20) up to a software descriptor queue and "
        "a completion interrupt per transfer (500)"),
    "e_flop_fp32_j": AssumedRange(3e-12, 30e-12, "assumption: 22FDX-class fp32 MAC with operand access"),
    "e_sram_byte_j": AssumedRange(0.3e-12, 3e-12, "assumption: 22FDX-class SRAM access per byte"),
    "e_dram_byte_j": AssumedRange(20e-12, 80e-12, "assumption: LPDDR4 interface and device, 2.5-10 pJ/bit"),
    "e_noc_byte_j": AssumedRange(0.5e-12, 5e-12, "assumption: on-chip wires and routers per byte"),
    "e_link_byte_j": AssumedRange(5e-12, 80e-12, "assumption: chip-to-chip SERDES, ~1-10 pJ/bit"),
    "p_static_w_per_chip": AssumedRange(
        0.2, 0.8,
        "assumption, bounded by [OJCAS26]: the whole chip draws 0.825 W at 150 MHz / 0.5 V"),
    "link_hop_s": AssumedRange(
        0.1e-6, 1.0e-6,
        "assumption: a router pipeline and one 72-bit packet at ~6 Gbit/s (tens of ns) up to a "
        "SERDES with elastic buffers"),
    "board_link_hop_s": AssumedRange(
        0.5e-6, 3.0e-6,
        "assumption: an on-board hop plus an FPGA or SERDES bridge and a cable ([spiNNlink]'s "
        "frame transport with credits)"),
    "host_mem_bw_bytes_s": AssumedRange(5e9, 20e9, "assumption: one server core streaming"),
    "host_op_s": AssumedRange(0.5e-6, 10e-6, "assumption: VM dispatch and kernel entry"),
    "host_link_bw_bytes_s": AssumedRange(
        100e6 / 8, 10e9 / 8,
        "[Systems-S] one 1 GbE port per board from secondary sources only: from the 100 Mbit/s "
        "Ethernet of a SpiNNaker1 (SpiNN-5) board up to a 10 GbE port (assumption)"),
    "host_link_latency_s": AssumedRange(
        5e-6, 100e-6,
        "assumption: a small UDP datagram one way, a kernel-bypass host stack (5 us) up to a "
        "loaded kernel stack and an FPGA or monitor-core bridge on the board (100 us)"),
    "m4f_loop_cycles": AssumedRange(
        0.0, 4.0,
        "calibrated on the executed PE code (bench/iss.py): none when LLVM unrolls the loop fully; "
        "an index add, a compare and a taken branch (1 + 1 + 2 cycles [M4-TRM]) per element when it "
        "does not unroll at all"),
    "m4f_job_cycles": AssumedRange(
        JOB_CYCLES / 2, 2 * JOB_CYCLES,
        "calibrated on the executed PE code (bench/iss.py): a factor of two either way for another "
        "compiler or runtime"),
    "m4f_chain_registers": AssumedRange(
        16, 28, "[M4-TRM] 32 single-precision registers, 4 to 16 of them kept for sums and addresses"),
    "link_payload_fraction": AssumedRange(
        32 / 90, 128 / 160,
        "low: [spiNNlink]'s 72-bit packet under 8b/10b line coding (if the bit rate is a line "
        "rate); high: assumption, a packet carrying four payload words under one header and key"),
    "board_serial_links": AssumedRange(
        1, 8,
        "low: [spiNNlink], one serial link per board edge for its 8 chip links; high: one per chip "
        "link (the edge's links independent)"),
    "board_link_bw_bytes_s": AssumedRange(
        1e9 / 8, 6e9 / 8,
        "[Systems-S] ~2 Gbit/s from secondary sources only: from half of it up to the on-board "
        "link's 6 Gbit/s [OJCAS26]"),
    "dram_bw_bytes_s": AssumedRange(
        4.8e9, 6.4e9,
        "[DS003] 'up to 6.4 GB/s sustained' (OctopuScheduler's 1.23 MB weight fetch in 192 us, arXiv "
        "2507.13736, runs at it); low: 75% of it, the lower end of DRAM-bound matmuls on other "
        "accelerators (83-90% on Tenstorrent)"),
})


#: Chip presets :func:`make_system` starts from. Each entry overrides only the fields that differ
#: from the production defaults of :class:`SpinnArch`, with its source.
CHIPS: dict[str, SpinnArch] = {
    "production": SpinnArch(),
    # The lower DVFS level, 150 MHz at 0.5 V [SpiNNMachine]. [OJCAS26] gives 2.77 TOPS/W there but
    # no throughput; assumption: the same measured/theoretical ratio as at 300 MHz (4.563 / 5.837),
    # i.e. 4.563 / 2 TOPS = 1.14075e12 MAC/s at 2.2815 / 2.77 = 0.824 W. Assumption: static power
    # scales with V**2, 0.5 W * (0.5 / 0.8)**2 = 0.195 W; the MAC energy is the rest.
    "production-150mhz": SpinnArch(
        name="spinn2-chip-150mhz", clock_hz=150e6,
        p_static_w_per_chip=0.5 * (0.5 / 0.8) ** 2,
        e_mac_int8_j=(4.563e12 / 2 / 2.77e12 - 0.5 * (0.5 / 0.8) ** 2) / (4.563e12 / 4),
    ),
    # The numbers this model used while it followed the test chip: all 152 PEs given to
    # applications, 29-bit accumulators [TUD-FAQ], and assumptions where nothing was published
    # (250 MHz clock, 64 GB/s NoC, 4-cycle hops, 0.5 GB/s links, 0.3 pJ per int8 MAC).
    "testchip": SpinnArch(
        name="spinn2-testchip", pes_per_chip=152, mgmt_pes_per_chip=0, acc_bits=29, clock_hz=250e6,
        noc_bw_bytes_s=64e9, noc_hop_cycles=4, link_bw_bytes_s=0.5e9, e_mac_int8_j=0.3e-12,
    ),
}


def make_system(name: str = "custom", chip: str = "production", boards: int | None = None,
                **fields_) -> SpinnArch:
    """Build a custom system description, validating every field.

    Parameters
    ----------
    name : str
        Name of the system (becomes the target's ``model``).
    chip : {"production", "production-150mhz", "testchip"}
        Preset of :data:`CHIPS` the unspecified fields come from.
    boards : int, optional
        Number of whole boards; sets ``chips = boards * chips_per_board``. ``chips`` may be given
        too only if it agrees; ``chips=`` alone still describes part of a board (e.g. 4 chips).
    **fields_
        Any :class:`SpinnArch` field, e.g. ``chips=4, pes_per_chip=32, sram_bytes=64*1024``.

    Returns
    -------
    SpinnArch

    Raises
    ------
    ArchError
        For an unknown ``chip``, an unknown field or an impossible value (named in the message).
    """
    if chip not in CHIPS:
        raise ArchError(f"unknown chip {chip!r}; known chips: {', '.join(sorted(CHIPS))}")
    if boards is not None:
        if not isinstance(boards, int) or isinstance(boards, bool) or boards <= 0:
            raise ArchError(f"boards must be a positive integer, got {boards!r}")
        per_board = fields_.get("chips_per_board", CHIPS[chip].chips_per_board)
        if not isinstance(per_board, int) or isinstance(per_board, bool) or per_board <= 0:
            raise ArchError(f"SpinnArch.chips_per_board must be a positive integer, got {per_board!r}")
        chips = boards * per_board
        if fields_.get("chips", chips) != chips:
            raise ArchError(
                f"boards={boards} ({chips} chips at chips_per_board={per_board}) is inconsistent "
                f"with chips={fields_['chips']!r}"
            )
        fields_["chips"] = chips
    return CHIPS[chip].replace(name=name, **fields_)


@functools.lru_cache(maxsize=4096)
def _barrier_layout(pes: int, pes_per_qpe: int) -> tuple[tuple[tuple[int, int, int], ...], int]:
    """:meth:`SpinnArch.barrier_layout` of ``pes`` (at least 1) PEs, ``pes_per_qpe`` a quad-PE."""
    qpes = -(-pes // pes_per_qpe)
    side = math.isqrt(qpes - 1) + 1
    cells = tuple((q // side, q % side, min(pes_per_qpe, pes - q * pes_per_qpe)) for q in range(qpes))
    reach = [max(abs(r - r0) + abs(c - c0) for r, c, _ in cells) for r0, c0, _ in cells]
    return cells, reach.index(min(reach))


@functools.lru_cache(maxsize=4096)
def _barrier_cost_cycles(pes: int, pes_per_qpe: int, noc_hop_cycles, barrier_pop_cycles, barrier_cycles) -> float:
    """:meth:`SpinnArch.barrier_cost_cycles` of ``pes`` PEs from the fields it reads."""
    cells, root = _barrier_layout(pes, pes_per_qpe)
    hop, spc = float(noc_hop_cycles), float(barrier_pop_cycles)
    turn = 4 + 4 * spc  # a turn of four pops after the send

    def count(arrivals: list, children: int) -> tuple[float, int]:
        """The cycle of the read that finds every child's packet in, and those left to pop."""
        t, popped = 18.0, 0
        while True:
            if popped < len(arrivals) and arrivals[popped] > t:  # the read waits for one
                t = arrivals[popped]
            n = sum(1 for a in arrivals if a <= t) - popped
            if n >= children:
                return t, children
            if n >= 4:
                t, popped, children = t + 9 + 4 * spc, popped + 4, children - 4
            else:
                t += 11

    r0, c0, _ = cells[root]
    leaf_send = 20.0
    waits = []  # per PE waiting for the release: (its read of the count, its grid steps)
    arrivals = []
    for i, (r, c, n) in enumerate(cells):
        d = abs(r - r0) + abs(c - c0)
        arrivals += [leaf_send + hop] * (n - 1) if i == root else []
        waits += [(leaf_send + 6, d)] * (n - 1)
        if i != root:
            send, rest = leaf_send, 0
            if n > 1:
                t, rest = count([leaf_send + hop] * (n - 1), n - 1)
                send = t + 11
            arrivals.append(send + (1 + d) * hop)
            waits.append((send + 17 + turn * (rest // 4), d))
    if not arrivals:  # one PE: straight on to the release
        return 28.0 + barrier_cycles
    t, rest = count(sorted(arrivals), len(arrivals))
    release = t + 13
    last = release + turn * (rest // 4) + (17 if rest < 4 else 16) + (2 if rest % 2 else 0)
    for read, d in waits:
        last = max(last, max(read, release + (1 + d) * hop) + 16)
    return last + barrier_cycles
