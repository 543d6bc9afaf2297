"""The job-table walker linked into a self-DMA image: ``pe_jobs_dma``, C compiled for the
Cortex-M4F like :mod:`.runtime`, and the link that places it at the same address with the same
bytes in every image. The commands it runs and the tables it walks are :mod:`.selfdma`'s.

Layout of a self-DMA image: the vector table (8 bytes), the walker's slots at
:data:`SLOTS_ADDR` (the addresses of the image's ``pe_kernel``, ``pe_noc_wait_ready`` and
``pe_noc_notify``, 0 for an image without the NoC driver), the walker's code (``.sdma.text``,
up to ``pe_sdma_end``), then the runtime, the kernel and the NoC driver as in the plain image.
The walker calls the image's routines through the slots, so its code does not depend on the
image: a PE boots its next image by DMA transfers of the image's bytes outside the walker
(:data:`OP_BOOT`) while the walker runs.
"""

from __future__ import annotations

import functools
import os
import tempfile

from .memory_map import DMA_BASE, DMA_DESC_WORDS, DMA_REGS, DMA_START, JOB_ADDR
from .runtime import compile_c, zig

__all__ = ["SELF_DMA_C", "SELF_DMA_ROUTINE", "SELF_DMA_HALT", "ENTRY_WORDS", "BATCH", "OP_JOB", "OP_DMA", "OP_RUN",
           "OP_CHECK", "OP_BOOT", "OP_WAIT", "OP_NOTIFY", "SLOTS_ADDR", "SLOT_WORDS", "STATUS_WORD", "VALUE_WORD",
           "self_dma_object", "link_self_dma_image", "walker_span"]

#: Words per command (an operation word and its operands, padded).
ENTRY_WORDS = 16
#: Commands fetched per DMA transfer into the job block (after its 4 header words).
BATCH = 3
OP_JOB, OP_DMA, OP_RUN, OP_CHECK = 1, 2, 3, 4
#: The image boot that follows (word 1: the image's index in the manifest's sorted images): the
#: next commands are DMA transfers of its bytes; the walker itself does nothing for it.
OP_BOOT = 5
#: A job's dependencies (words 1-3: the ``(slot, count)`` pairs' DRAM address, their number,
#: the SRAM address they are copied to): ``pe_noc_wait_ready`` on them.
OP_WAIT = 6
#: The job's ready packets (words 1-5: the destination PEs' DRAM address, their number, the
#: SRAM address they are copied to, the job's id, the PE's slot): ``pe_noc_notify``.
OP_NOTIFY = 7
#: Where the walker's slots lie in every self-DMA image (after the 8-byte vector table).
SLOTS_ADDR = 8
SLOT_WORDS = 3
#: The loop the walker returns to when its commands are done (in ``.sdma.text``: the same
#: address in every image).
SELF_DMA_HALT = "pe_sdma_halt"
#: The walker's entry point.
SELF_DMA_ROUTINE = "pe_jobs_dma"
_HEADER = 4
STATUS_WORD, VALUE_WORD = 2, 3

SELF_DMA_C = rf"""
typedef unsigned int u32;

typedef void (*kernel_fn)(u32, u32, u32, u32, u32, u32, u32, u32, u32, u32, u32, u32);
typedef void (*wait_fn)(const u32 *, u32);
typedef void (*notify_fn)(const u32 *, u32, u32, u32);
extern void pe_kernel(u32, u32, u32, u32, u32, u32, u32, u32, u32, u32, u32, u32);
extern void pe_noc_wait_ready(const u32 *, u32) __attribute__((weak));
extern void pe_noc_notify(const u32 *, u32, u32, u32) __attribute__((weak));

/* The image's routines, read by the walker at a fixed address (0 where the image lacks one). */
__attribute__((section(".sdma.slots"), used))
void *const pe_sdma_slots[{SLOT_WORDS}] = {{ (void *)pe_kernel, (void *)pe_noc_wait_ready, (void *)pe_noc_notify }};
#define SLOT(i) (((void *const volatile *){SLOTS_ADDR:#x}u)[i])
#define WALKER __attribute__((section(".sdma.text")))
#define DMAW(reg) (*(volatile u32 *)({DMA_BASE:#x}u + (reg)))
#define BLOCK ((volatile u32 *){JOB_ADDR:#x}u)

/* One transfer: the descriptor's words into the registers (plain loads and stores the compiler
   may pair into LDM/STM: the registers only act on CTRL), start, wait. */
WALKER __attribute__((noinline)) static void sdma_transfer(const u32 *d) {{
    u32 *r = (u32 *){DMA_BASE:#x}u;
    r[0] = d[0];
    r[1] = d[1];
    r[2] = d[2];
    r[3] = d[3];
    r[4] = d[4];
    r[5] = d[5];
    r[6] = d[6];
    r[7] = d[7];
    r[8] = d[8];
    r[9] = d[9];
    r[10] = d[10];
    __asm__ volatile("" ::: "memory");
    DMAW({DMA_REGS["CTRL"]:#x}) = {DMA_START}u;
    while (DMAW({DMA_REGS["CTRL"]:#x}) != 0u) {{ }}
}}

/* Copy n words from DRAM to SRAM (a wait's pairs, a notify's destinations). */
WALKER __attribute__((noinline)) static void sdma_words(u32 src, u32 dst, u32 n) {{
    const u32 d[{DMA_DESC_WORDS}] = {{ src, dst, 4u, n, 1u, 1u, 1u, 4u, 0u, 0u, 0u }};
    sdma_transfer(d);
}}

WALKER void {SELF_DMA_HALT}(void) __attribute__((noreturn, naked));
WALKER void {SELF_DMA_HALT}(void) {{ __asm__ volatile("1: b 1b"); }}

/* The job-table walker: commands [BLOCK[0], BLOCK[0] + 64 * BLOCK[1]) of DRAM, fetched
   {BATCH} at a time into the job block after its {_HEADER} header words. */
WALKER void {SELF_DMA_ROUTINE}(void) {{
    __asm__ volatile("vmsr fpscr, %0" :: "r"(0u));
    const u32 table = BLOCK[0], n = BLOCK[1];
    volatile u32 *buf = BLOCK + {_HEADER}u;
    u32 job = 0;
    BLOCK[{STATUS_WORD}] = 0u;
    for (u32 e = 0; e < n; e += {BATCH}u) {{
        const u32 k = n - e < {BATCH}u ? n - e : {BATCH}u;
        DMAW({DMA_REGS["SRC"]:#x}) = table + {4 * ENTRY_WORDS}u * e;
        DMAW({DMA_REGS["DST"]:#x}) = (u32)buf;
        DMAW({DMA_REGS["EB"]:#x}) = 4u;
        DMAW({DMA_REGS["C0"]:#x}) = {ENTRY_WORDS}u * k;
        DMAW({DMA_REGS["C1"]:#x}) = 1u;
        DMAW({DMA_REGS["C2"]:#x}) = 1u;
        DMAW({DMA_REGS["C3"]:#x}) = 1u;
        DMAW({DMA_REGS["S0"]:#x}) = 4u;
        DMAW({DMA_REGS["CTRL"]:#x}) = {DMA_START}u;
        while (DMAW({DMA_REGS["CTRL"]:#x}) != 0u) {{ }}
        __asm__ volatile("" ::: "memory");  /* the buffer holds the fetched commands now */
        for (u32 i = 0; i < k; i++) {{
            const u32 *c = (const u32 *)buf + {ENTRY_WORDS}u * i;
            const u32 op = c[0];
            if (op == {OP_DMA}u) {{
                sdma_transfer(c + 1);
            }} else if (op == {OP_RUN}u) {{
                ((kernel_fn)SLOT(0))(c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11], c[12]);
            }} else if (op == {OP_JOB}u) {{
                job = c[1];
            }} else if (op == {OP_BOOT}u) {{
                /* the image's bytes follow as transfers */
            }} else if (op == {OP_WAIT}u && SLOT(1)) {{
                sdma_words(c[1], c[3], 2u * c[2]);
                ((wait_fn)SLOT(1))((const u32 *)c[3], c[2]);
            }} else if (op == {OP_NOTIFY}u && SLOT(2)) {{
                sdma_words(c[1], c[3], c[2]);
                ((notify_fn)SLOT(2))((const u32 *)c[3], c[2], c[4], c[5]);
            }} else if (op == {OP_CHECK}u) {{
                const volatile u32 *s = (const volatile u32 *)c[1];
                if (s[0] != 0u) {{
                    BLOCK[{VALUE_WORD}] = s[1];
                    BLOCK[{STATUS_WORD}] = job + 1u;
                    return;
                }}
            }} else {{
                __builtin_trap();
            }}
        }}
    }}
}}
"""


@functools.lru_cache(maxsize=1)
def self_dma_object() -> bytes:
    """The walker compiled to a Cortex-M4F object (ELF relocatable), built once per process."""
    return compile_c(SELF_DMA_C, "pe_sdma")


def _walker_script() -> str:
    from .link import LINKER_SCRIPT
    old = "KEEP(*(.vectors))"
    assert old in LINKER_SCRIPT
    return LINKER_SCRIPT.replace(old, old + " KEEP(*(.sdma.slots)) KEEP(*(.sdma.text)) pe_sdma_end = .;")


def link_self_dma_image(kernel_object: bytes, noc: bool = False) -> bytes:
    """The ELF image of one role with the walker: the vector table, the walker's slots and
    code, then the runtime, ``kernel_object`` and the NoC driver (``noc``)."""
    from .runtime import runtime_object
    objects = [("pe_runtime.o", runtime_object()), ("pe_kernel.o", kernel_object)]
    keep = ["-u", SELF_DMA_ROUTINE]
    if noc:
        from .noc import NOC_ROUTINES, noc_object
        objects.append(("pe_noc.o", noc_object()))
        keep += [arg for r in NOC_ROUTINES for arg in ("-u", r)]
    objects.append(("pe_sdma.o", self_dma_object()))
    with tempfile.TemporaryDirectory(prefix="tvm_spinn_pe_") as tmp:
        paths = []
        for name, data in objects + [("pe.ld", _walker_script().encode())]:
            paths.append(os.path.join(tmp, name))
            with open(paths[-1], "wb") as f:
                f.write(data)
        out = os.path.join(tmp, "pe.elf")
        zig("ld.lld", "-T", paths[-1], "--gc-sections", "--build-id=none", "--strip-debug",
            "--no-undefined", "--nmagic", "-z", "max-page-size=64", *keep, "-o", out, *paths[:-1])
        with open(out, "rb") as f:
            elf = f.read()
    lo, hi = walker_span(elf)
    if lo != SLOTS_ADDR or hi <= lo:
        raise RuntimeError(f"the walker's slots at {lo:#x}, not {SLOTS_ADDR:#x}: the linker script placed them wrong")
    return elf


def walker_span(elf: bytes, name: str = "") -> tuple:
    """``(slots, end)``: where an image's walker slots start and its walker code ends (the bytes
    between ``slots + 4 * SLOT_WORDS`` and ``end`` are the same in every self-DMA image).

    Parameters
    ----------
    elf : bytes
        A linked PE image.
    name : str
        The image's name (in the error message).

    Raises
    ------
    ValueError
        For an image without the walker's symbols (not linked by :func:`link_self_dma_image`).
    """
    from .iss import image_symbols
    symbols = image_symbols(elf)
    if "pe_sdma_slots" not in symbols or "pe_sdma_end" not in symbols:
        who = f"image {name!r}" if name else "image"
        raise ValueError(f"{who}: no job-table walker: not linked by link_self_dma_image")
    return symbols["pe_sdma_slots"], symbols["pe_sdma_end"]
