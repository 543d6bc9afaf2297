"""The job-table walker linked into a self-DMA image: ``pe_jobs_dma``, C compiled for the
Cortex-M4F like :mod:`.runtime`, and the link that adds it after the runtime, the kernel and the
NoC driver where there is one (so their code keeps its addresses). The commands it runs and the
tables it walks are :mod:`.selfdma`'s.
"""

from __future__ import annotations

import functools
import os
import tempfile

from .memory_map import DMA_BASE, DMA_DESC_WORDS, DMA_REGS, DMA_START, JOB_ADDR
from .runtime import CC_FLAGS, zig

__all__ = ["SELF_DMA_C", "SELF_DMA_ROUTINE", "ENTRY_WORDS", "BATCH", "OP_JOB", "OP_DMA", "OP_RUN", "OP_CHECK",
           "STATUS_WORD", "VALUE_WORD", "self_dma_object", "link_self_dma_image"]

#: Words per command (an operation word and its operands, padded).
ENTRY_WORDS = 16
#: Commands fetched per DMA transfer into the job block (after its 4 header words).
BATCH = 3
OP_JOB, OP_DMA, OP_RUN, OP_CHECK = 1, 2, 3, 4
#: The walker's entry point.
SELF_DMA_ROUTINE = "pe_jobs_dma"
_HEADER = 4
STATUS_WORD, VALUE_WORD = 2, 3
_TABLE_ALIGN = 64

SELF_DMA_C = rf"""
typedef unsigned int u32;

extern void pe_kernel(u32, u32, u32, u32, u32, u32, u32, u32, u32, u32, u32, u32);
#define DMAW(reg) (*(volatile u32 *)({DMA_BASE:#x}u + (reg)))
#define BLOCK ((volatile u32 *){JOB_ADDR:#x}u)

/* One transfer: the descriptor's words into the registers (plain loads and stores the compiler
   may pair into LDM/STM: the registers only act on CTRL), start, wait. */
__attribute__((noinline)) static void sdma_transfer(const u32 *d) {{
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

/* The job-table walker: commands [BLOCK[0], BLOCK[0] + 64 * BLOCK[1]) of DRAM, fetched
   {BATCH} at a time into the job block after its {_HEADER} header words. */
void {SELF_DMA_ROUTINE}(void) {{
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
                pe_kernel(c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11], c[12]);
            }} else if (op == {OP_JOB}u) {{
                job = c[1];
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
    with tempfile.TemporaryDirectory(prefix="tvm_spinn_pe_") as tmp:
        src, obj = os.path.join(tmp, "pe_sdma.c"), os.path.join(tmp, "pe_sdma.o")
        with open(src, "w") as f:
            f.write(SELF_DMA_C)
        zig("cc", *CC_FLAGS, "-c", src, "-o", obj)
        with open(obj, "rb") as f:
            return f.read()


def link_self_dma_image(kernel_object: bytes, noc: bool = False) -> bytes:
    """The ELF image of one role with the walker: the runtime, ``kernel_object``, the NoC
    driver (``noc``) and the walker, in that order (the earlier objects keep their addresses),
    linked by the script of :mod:`.link`."""
    from .link import LINKER_SCRIPT
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
        for name, data in objects + [("pe.ld", LINKER_SCRIPT.encode())]:
            paths.append(os.path.join(tmp, name))
            with open(paths[-1], "wb") as f:
                f.write(data)
        out = os.path.join(tmp, "pe.elf")
        zig("ld.lld", "-T", paths[-1], "--gc-sections", "--build-id=none", "--strip-debug",
            "--no-undefined", "--nmagic", "-z", "max-page-size=64", *keep, "-o", out, *paths[:-1])
        with open(out, "rb") as f:
            return f.read()
