"""The PE's address map as the generated images and the instruction-set simulator see it.

One place for every address the PE code relies on. The SRAM size is SpiNNaker2's (128 KiB per
PE, :attr:`tvm_spinn.target.arch.SpinnArch.sram_bytes`); the peripherals' register interface is
not published in a form this package could cite, so the MAC array's registers below are a named
**assumption** (a memory-mapped block with operand addresses, extents and a start/status word),
kept here so a published map replaces them in one edit.
"""

from __future__ import annotations

__all__ = [
    "SRAM_BASE", "SRAM_BYTES", "STACK_BYTES", "STACK_TOP", "JOB_ADDR", "JOB_WORDS", "ARENA_END",
    "MAC_BASE", "MAC_REGS", "MAC_BYTES", "MAC_START", "ARENA_ALIGN",
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

#: The MAC array's register block (assumption: address and layout are this package's).
MAC_BASE = 0x4000_0000
MAC_BYTES = 0x1000
#: Word offsets of the MAC array's registers (assumption): operand A (int8 ``[m, k]`` row-major),
#: operand B (int8 ``[k, n]`` row-major), result C (int32 ``[m, n]``, overwritten with the
#: sign-extended ``acc_bits``-bit sums), the extents, and CTRL (write 1: run; reads 0 when done).
MAC_REGS = {"A": 0x00, "B": 0x04, "C": 0x08, "M": 0x0C, "N": 0x10, "K": 0x14, "CTRL": 0x18}
MAC_START = 1
