"""Linking a PE image: the runtime object and a role's kernel object into one ELF executable
for the PE's SRAM, with the ``ld.lld`` that the ``ziglang`` wheel ships.

The linker script places the vector table at address 0, then code, read-only data, data and
zero-initialised data; ``_end`` (64-byte aligned) marks where the tile data may start.
Unwind tables and unused sections are dropped; debug information is stripped and no build ID is
written, so equal inputs give equal bytes.
"""

from __future__ import annotations

import os
import tempfile

from .memory_map import ARENA_ALIGN, JOB_ADDR, SRAM_BASE
from .runtime import runtime_object, zig

__all__ = ["LINKER_SCRIPT", "link_image"]

LINKER_SCRIPT = f"""
ENTRY(_start)
MEMORY {{ SRAM (rwx) : ORIGIN = {SRAM_BASE:#x}, LENGTH = {JOB_ADDR - SRAM_BASE:#x} }}
SECTIONS {{
  .text : {{ KEEP(*(.vectors)) *(.text.start) *(.text .text.*) }} > SRAM
  .rodata : ALIGN(4) {{ *(.rodata .rodata.*) }} > SRAM
  .data : ALIGN(4) {{ *(.data .data.*) }} > SRAM
  .bss : ALIGN(4) {{ *(.bss .bss.* COMMON) }} > SRAM
  _end = ALIGN({ARENA_ALIGN});
  /DISCARD/ : {{ *(.ARM.exidx*) *(.ARM.extab*) *(.comment) *(.note*) }}
}}
"""


def link_image(kernel_object: bytes) -> bytes:
    """The ELF image of one PE role: the runtime and ``kernel_object`` (which defines
    ``pe_kernel``), linked for the PE's SRAM."""
    with tempfile.TemporaryDirectory(prefix="tvm_spinn_pe_") as tmp:
        paths = {}
        for name, data in (("pe_runtime.o", runtime_object()), ("pe_kernel.o", kernel_object),
                           ("pe.ld", LINKER_SCRIPT.encode())):
            paths[name] = os.path.join(tmp, name)
            with open(paths[name], "wb") as f:
                f.write(data)
        out = os.path.join(tmp, "pe.elf")
        zig("ld.lld", "-T", paths["pe.ld"], "--gc-sections", "--build-id=none", "--strip-debug",
            "--no-undefined", "--nmagic", "-z", "max-page-size=64", "-o", out, paths["pe_runtime.o"], paths["pe_kernel.o"])
        with open(out, "rb") as f:
            return f.read()
