"""The PE's address map as the generated images and the instruction-set simulator see it.

One place for every address the PE code relies on. The SRAM size is SpiNNaker2's (128 KiB per
PE, :attr:`tvm_spinn.target.arch.SpinnArch.sram_bytes`); the peripherals' register interface is
not published in a form this package could cite, so the MAC array's, the exp/log unit's, the
DMA engine's and the NoC interface's registers below are named **assumptions** (memory-mapped blocks with operand addresses, extents
and a start/status word), kept here so a published map replaces them in one edit.
"""

from __future__ import annotations

__all__ = [
    "SRAM_BASE", "SRAM_BYTES", "STACK_BYTES", "STACK_TOP", "JOB_ADDR", "JOB_WORDS", "ARENA_END",
    "MAC_BASE", "MAC_REGS", "MAC_BYTES", "MAC_START", "ARENA_ALIGN", "arena_start",
    "EXP_BASE", "EXP_REGS", "EXP_BYTES", "EXP_START", "EXP_FUNC_EXP", "EXP_FUNC_LOG",
    "DMA_BASE", "DMA_REGS", "DMA_BYTES", "DMA_START", "DMA_DESC_WORDS", "DMA_EB_MASK", "DMA_SCATTER", "REMOTE_BASE",
    "NOC_BASE", "NOC_BYTES", "NOC_REGS", "NOC_MULTICAST", "NOC_KEY_KIND_SHIFT", "NOC_KEY_READY", "NOC_KEY_ARRIVE",
    "NOC_KEY_RELEASE", "NOC_WAIT_POLLS", "NOC_FAULT_CODES", "NOC_FAULT_TIMEOUT", "NOC_FAULT_UNEXPECTED",
    "NOC_FAULT_SLOT", "NOC_FAULT_MAILBOX", "NOC_STATE_ADDR", "NOC_STATE_WORDS", "NOC_KEY_DATA", "NOC_MAILBOX_ADDR", "NOC_MAILBOX_WORDS",
    "DRAM_BASE",
]

#: The PE's local SRAM: code, data and stack (SpiNNaker2: 128 KiB per PE at address 0).
SRAM_BASE = 0x0000_0000
SRAM_BYTES = 128 * 1024
#: Stack at the top of SRAM (full descending, AAPCS 8-byte aligned).
STACK_BYTES = 4096
STACK_TOP = SRAM_BASE + SRAM_BYTES
#: The job block the start-up code reads: ``u32 count``, then ``count`` jobs of
#: :data:`JOB_WORDS` 32-bit arguments each (the kernel's arguments, in AAPCS order).
JOB_WORDS = 12
JOB_ADDR = STACK_TOP - STACK_BYTES - 256
#: Tile data lives between the image's end (``_end``, aligned) and the job block.
ARENA_END = JOB_ADDR
ARENA_ALIGN = 64


def arena_start(end: int) -> int:
    """Where an image's data area starts: its end ``end`` (the ``_end`` symbol) rounded up to
    :data:`ARENA_ALIGN` bytes."""
    return -(-end // ARENA_ALIGN) * ARENA_ALIGN

#: The MAC array's register block (assumption: address and layout are this package's).
MAC_BASE = 0x4000_0000
MAC_BYTES = 0x1000
#: Word offsets of the MAC array's registers (assumption): operand A (int8 ``[m, k]`` row-major),
#: operand B (int8 ``[k, n]``, rows ``LDB`` bytes apart), result C (int32 ``[m, n]``, rows ``LDC``
#: words apart, overwritten with the sign-extended ``acc_bits``-bit sums), the extents, and CTRL
#: (write 1: start; the array then runs concurrently with the M4F, and CTRL reads 1 while it
#: runs and 0 once C holds the sums). The row strides let one run cover a block of columns of
#: a wider B and C, so the M4F can work on one block while the array computes the next. The
#: registers hold what was last written to them across runs (assumption: a start writes only
#: the registers that change; the runtime's ``pe_mac_wait_next`` starts a block pipeline's next
#: run by writing B, C, N, LDC and CTRL after the wait, A, M, K and LDB kept); a PE's boot
#: (its image loaded) resets every register to 0, so a start that relies on kept registers
#: with none written since the boot is a fault (LDB 0 below N). Only one run is in flight: a
#: start while one runs is a fault.
MAC_REGS = {"A": 0x00, "B": 0x04, "C": 0x08, "M": 0x0C, "N": 0x10, "K": 0x14, "CTRL": 0x18,
            "LDB": 0x1C, "LDC": 0x20}
MAC_START = 1

#: The exp/log unit's register block (assumption: address and layout are this package's). Every
#: SpiNNaker2 PE has the unit, attached to the M4F as a memory-mapped processor extension
#: (Partzsch et al., ISCAS 2017; Mikaitis et al., ARITH 2018), whose published use is one
#: argument written and its result read back per element; the streaming interface assumed here
#: (as the MAC array's: the unit reads ``N`` float32 arguments from SRAM at SRC and writes their
#: results to DST, which may equal SRC) keeps its pipeline full, the rate the timing model
#: charges (``SpinnArch.exp_unit_cycles`` an element after ``exp_unit_latency_cycles``).
EXP_BASE = 0x4000_1000
EXP_BYTES = 0x1000
#: Word offsets (assumption): SRC, DST, N, FUNC (:data:`EXP_FUNC_EXP` or :data:`EXP_FUNC_LOG`),
#: CTRL (write 1: run; reads 0 when done).
EXP_REGS = {"SRC": 0x00, "DST": 0x04, "N": 0x08, "FUNC": 0x0C, "CTRL": 0x10}
EXP_START = 1
EXP_FUNC_EXP = 0
#: The unit's natural log (the published unit computes exp and log: Mikaitis et al., ARITH 2018;
#: the FUNC code and the log's pipeline timing, the same latency and rate as exp's, are
#: assumptions). Its results are the simulator's log model
#: (:func:`tvm_spinn.program.ops.elementwise.log_f32`).
EXP_FUNC_LOG = 1

#: The DMA engine's register block (assumption: address and layout are this package's). One
#: transfer is a strided descriptor: ``EB``-byte elements read at ``SRC + i3*S3 + i2*S2 + i1*S1
#: + i0*S0`` (byte strides, signed; ``i0`` innermost, ``Cn`` the extents) and written one after
#: another from ``DST``; a stride of 0 repeats an element (a broadcast). Word offsets: SRC, DST,
#: EB, C0-C3, S0-S3 (in that order: a descriptor in SRAM is these :data:`DMA_DESC_WORDS` words,
#: which the driver copies in), then CTRL (write 1: start; the engine then runs concurrently
#: with the M4F, CTRL reads 1 while it runs and 0 once DST holds the elements). The engine
#: moves one element a cycle (:data:`tvm_spinn.program.ops.movement.DMA_ELEMENT_CYCLES`, the
#: timing model's rate).
DMA_BASE = 0x4000_2000
DMA_BYTES = 0x1000
DMA_REGS = {"SRC": 0x00, "DST": 0x04, "EB": 0x08, "C0": 0x0C, "C1": 0x10, "C2": 0x14, "C3": 0x18,
            "S0": 0x1C, "S1": 0x20, "S2": 0x24, "S3": 0x28, "CTRL": 0x2C}
DMA_DESC_WORDS = 11
DMA_START = 1
#: The ``EB`` word's fields (assumption): bits 0-7 the element's bytes; bit 8 (:data:`DMA_SCATTER`)
#: puts the strides on the destination: the elements are read one after another from ``SRC``
#: and written at ``DST + i3*S3 + i2*S2 + i1*S1 + i0*S0`` in that order (an input written into
#: a strided view of an output: ``concat``, ``pad``). Engines with a stride or an increment on
#: each side have this mode: TI's EDMA3 (a PaRAM set's ``SRCBIDX``/``SRCCIDX`` and
#: ``DSTBIDX``/``DSTCIDX``, SPRUGS5), Arm's PL080 (a channel's control word: source and
#: destination increment bits ``SI``/``DI`` beside the transfer widths, DDI 0196). Other bits
#: are refused.
DMA_EB_MASK = 0xFF
DMA_SCATTER = 0x100
#: Where memory outside the PE (DRAM, another PE's SRAM: a layer's input as the DMA reads it)
#: appears to the DMA engine (assumption). The M4F's code never addresses it.
REMOTE_BASE = 0x8000_0000

#: The NoC interface's register block (assumption: address and layout are this package's). What
#: is published: SpiNNaker's packets carry a 32-bit routing key and an optional 32-bit payload,
#: and multicast packets are routed by their key through the router's associative table of
#: (key, mask) -> destinations (Furber et al., "The SpiNNaker Project", Proc. IEEE 102(5), 2014);
#: SpiNNaker2 keeps a multicast router with 16,384 associative entries (SpiNNaker2 datasheet
#: v0.03, 2021) and its NoC moves a packet 5 cycles a router hop (``SpinnArch.noc_hop_cycles``).
#: Assumed here: a packet is ``(key, payload)`` and the receiver also sees the sending PE;
#: TX_DEST names one PE (a packet to that PE) or, with :data:`NOC_MULTICAST` set, asks the router
#: to route the packet by its key (the table the host loads); a write of TX_SEND (the payload)
#: sends ``(TX_KEY, payload)`` to TX_DEST. The receive side is a FIFO: RX_COUNT the packets
#: waiting, RX_KEY, RX_PAYLOAD and RX_SOURCE the oldest one's fields, a write of RX_POP drops it.
#: PE_ID reads the PE's own id. A write of FAULT (a :data:`NOC_FAULT_CODES` code, its detail
#: word in FAULT_DETAIL first) is the driver's report of an error it cannot recover from; the
#: instruction-set simulator raises it as a fault naming the PE, image and program counter.
NOC_BASE = 0x4000_3000
NOC_BYTES = 0x1000
NOC_REGS = {"TX_DEST": 0x00, "TX_KEY": 0x04, "TX_SEND": 0x08, "RX_COUNT": 0x0C, "RX_KEY": 0x10,
            "RX_PAYLOAD": 0x14, "RX_SOURCE": 0x18, "RX_POP": 0x1C, "PE_ID": 0x20, "FAULT_DETAIL": 0x24,
            "FAULT": 0x28}
NOC_MULTICAST = 0x8000_0000
#: Packet kinds in a key's top byte (the rest is the kind's field): a job's results are ready
#: (field: the job's id), a PE arrives at a barrier, a barrier's release (field: the barrier's
#: group key).
NOC_KEY_KIND_SHIFT = 24
NOC_KEY_READY = 0x01 << NOC_KEY_KIND_SHIFT
NOC_KEY_ARRIVE = 0x02 << NOC_KEY_KIND_SHIFT
NOC_KEY_RELEASE = 0x03 << NOC_KEY_KIND_SHIFT
#: A data word handed from PE to PE (a split row's statistics): the key's bits 16-23 the sending
#: PE's slot, bits 0-15 the receiver's mailbox word it fills; the payload is the word.
NOC_KEY_DATA = 0x04 << NOC_KEY_KIND_SHIFT
#: The driver's bounded wait: polls of an empty RX FIFO before it reports a timeout.
NOC_WAIT_POLLS = 1 << 16
#: The driver's fault codes (FAULT register).
NOC_FAULT_CODES = {1: "receive timed out: no packet after NOC_WAIT_POLLS polls of an empty RX FIFO",
                   2: "unexpected packet (its key in the detail word)",
                   3: "ready packet from a PE slot outside the NoC state (its slot in the detail word)",
                   4: "data packet for a word outside the mailbox (its key in the detail word)"}
NOC_FAULT_TIMEOUT, NOC_FAULT_UNEXPECTED, NOC_FAULT_SLOT, NOC_FAULT_MAILBOX = 1, 2, 3, 4
#: The NoC state the driver keeps across jobs and image loads: per source PE slot, the ready
#: packets that arrived from it (u32 each), in the stack region's lowest bytes (assumption: the
#: images' stack stays above it; the job block below it holds at most
#: ``(NOC_STATE_ADDR - JOB_ADDR - 4) // (4 * JOB_WORDS)`` jobs while it is in use). The PE's boot
#: zeroes it.
NOC_STATE_ADDR = STACK_TOP - STACK_BYTES
NOC_STATE_WORDS = 128
#: The mailbox the driver writes data packets' words into (after the NoC state, in the stack
#: region too: the images' stack stays above it), read by the PE's DMA where a job places them.
NOC_MAILBOX_ADDR = NOC_STATE_ADDR + 4 * NOC_STATE_WORDS
NOC_MAILBOX_WORDS = 256

#: Where the chip's DRAM appears to a PE's DMA engine when the PE places its own operands
#: (firmware exported with ``self_dma``, :mod:`.selfdma`; assumption): a region's DRAM from
#: offset 0, its command table after it. The M4F's code never addresses it either.
DRAM_BASE = 0xA000_0000
