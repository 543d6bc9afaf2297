"""The PE runtime linked into every image: start-up, the job loop, the MAC array's (start, wait,
and wait-then-start of a block pipeline's next run), the int8 GEMM's chunk add,
the exp/log unit's (exp and log) and the DMA engine's drivers and the
C library routines LLVM's code may call (``memset``, ``memcpy``).

Written in C and compiled for the Cortex-M4F by the clang that the ``ziglang`` wheel ships
(:func:`runtime_object`); the kernels themselves come from TVM's LLVM (:mod:`.kernels`).

Start-up (``_start``, the reset vector): clears FPSCR (round to nearest even, no flush-to-zero,
no default NaN: the IEEE 754 behaviour the simulator models), runs every job of the job block
(:data:`~.memory_map.JOB_ADDR`) through the role's kernel ``pe_kernel`` and parks in
``pe_halt``, where the simulator stops the PE.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile

from .memory_map import (DMA_BASE, DMA_DESC_WORDS, DMA_REGS, DMA_START, EXP_BASE, EXP_FUNC_EXP, EXP_FUNC_LOG, EXP_REGS,
                         EXP_START, JOB_ADDR, JOB_WORDS, MAC_BASE, MAC_REGS, MAC_START, STACK_TOP)

__all__ = ["RUNTIME_C", "CC_FLAGS", "compile_c", "runtime_object", "zig"]

#: clang flags of the runtime (Cortex-M4F, hard-float ABI, freestanding, reproducible).
CC_FLAGS = ("-target", "thumb-freestanding-eabihf", "-mcpu=cortex_m4+vfp4d16sp", "-mfloat-abi=hard",
            "-mfpu=fpv4-sp-d16", "-O2", "-ffreestanding", "-fno-builtin", "-nostdlib", "-g0",
            "-ffunction-sections", "-fno-ident")

RUNTIME_C = rf"""
typedef unsigned int u32;
typedef int i32;
typedef signed char i8;

extern void pe_kernel(u32, u32, u32, u32, u32, u32, u32, u32, u32, u32, u32, u32);
void pe_halt(void) __attribute__((noreturn, naked));
void pe_halt(void) {{ __asm__ volatile("1: b 1b"); }}

void *memset(void *dst, int value, u32 n) {{
    unsigned char *d = dst;
    while (n--) *d++ = (unsigned char)value;
    return dst;
}}

void *memcpy(void *dst, const void *src, u32 n) {{
    unsigned char *d = dst;
    const unsigned char *s = src;
    while (n--) *d++ = *s++;
    return dst;
}}

/* MAC array driver, split as firmware overlaps the array with the M4F: pe_mac_start starts
   C[m, n] = A[m, k] . B[k, n] (int8 operands, acc_bits-bit sums; B's rows ldb bytes apart, C's
   ldc words apart) and returns at once; pe_mac_wait blocks until C holds the sums. pe_mac_start
   is written out by hand (naked: no frame, no saved registers): the four register arguments
   stored, the four on the stack loaded by one LDM into the argument registers and stored, then
   CTRL (TRM table 3-1: 24 cycles with the return). */
#define MAC(reg) (*(volatile u32 *)({MAC_BASE:#x}u + (reg)))
i32 pe_mac_start(const i8 *a, const i8 *b, i32 *c, i32 m, i32 n, i32 k, i32 ldb, i32 ldc) __attribute__((naked));
i32 pe_mac_start(const i8 *a, const i8 *b, i32 *c, i32 m, i32 n, i32 k, i32 ldb, i32 ldc) {{
    __asm__ volatile(
        "movw r12, #{MAC_BASE & 0xFFFF:#x}\n\t"
        "movt r12, #{MAC_BASE >> 16:#x}\n\t"
        "str r0, [r12, #{MAC_REGS["A"]:#x}]\n\t"
        "str r1, [r12, #{MAC_REGS["B"]:#x}]\n\t"
        "str r2, [r12, #{MAC_REGS["C"]:#x}]\n\t"
        "str r3, [r12, #{MAC_REGS["M"]:#x}]\n\t"
        "ldm sp, {{r0-r3}}\n\t"            /* n, k, ldb, ldc: the arguments on the stack */
        "str r0, [r12, #{MAC_REGS["N"]:#x}]\n\t"
        "str r1, [r12, #{MAC_REGS["K"]:#x}]\n\t"
        "str r2, [r12, #{MAC_REGS["LDB"]:#x}]\n\t"
        "str r3, [r12, #{MAC_REGS["LDC"]:#x}]\n\t"
        "movs r0, #{MAC_START}\n\t"
        "str r0, [r12, #{MAC_REGS["CTRL"]:#x}]\n\t"
        "movs r0, #0\n\t"
        "bx lr");
}}

/* pe_mac_wait by hand too (naked): the poll of CTRL in the caller-saved registers, its zero
   the return value (9 cycles with the return). */
i32 pe_mac_wait(void) __attribute__((naked));
i32 pe_mac_wait(void) {{
    __asm__ volatile(
        "movw r1, #{MAC_BASE & 0xFFFF:#x}\n\t"
        "movt r1, #{MAC_BASE >> 16:#x}\n"
        "1:\n\t"
        "ldr r0, [r1, #{MAC_REGS["CTRL"]:#x}]\n\t"
        "cmp r0, #0\n\t"
        "bne 1b\n\t"
        "bx lr");
}}

/* The next run of a block pipeline: waits for the run in flight, then starts the array on
   another block of the same operand A (B's columns from b, n of them, into C at c, rows ldc
   words apart); A, M, K and LDB keep the values the last start wrote (the registers hold them),
   so the array is idle only for the four writes after the wait. */
i32 pe_mac_wait_next(const i8 *b, i32 *c, i32 n, i32 ldc) {{
    while (MAC({MAC_REGS["CTRL"]:#x}) != 0u) {{ }}
    MAC({MAC_REGS["B"]:#x}) = (u32)b;
    MAC({MAC_REGS["C"]:#x}) = (u32)c;
    MAC({MAC_REGS["N"]:#x}) = (u32)n;
    MAC({MAC_REGS["LDC"]:#x}) = (u32)ldc;
    MAC({MAC_REGS["CTRL"]:#x}) = {MAC_START}u;
    return 0;
}}

/* The int8 GEMM's chunk add: acc[i * ldacc + j] += p[i * w + j] for m rows of w columns (the
   MAC array's sums of a later chunk, written w words a row into a scratch block, into the int32
   accumulator's columns, 32-bit wrapping). Four outputs a step as LDM/STM of four registers
   (TRM table 3-1: 1 + N cycles each) and four ADDs, every pointer advanced by the write-back:
   5.5 cycles an output with the loop's branch; a row of a multiple of 4 columns costs the step
   loop's set-up and the next row's pointer, any other width runs the same steps then one word
   at a time. Preconditions (the kernel's, which calls it only for a block of its tile: m >= 1
   rows, 1 <= w <= ldacc columns): the loops count down to 0 before they test, so m = 0 or
   w = 0 would run about 2^32 times; acc and p 4-byte aligned (LDM/STM of words fault on an
   unaligned address). Returns 0, as the other drivers. */
i32 pe_i32_add_rows(i32 *acc, const i32 *p, i32 m, i32 w, i32 ldacc) __attribute__((naked));
i32 pe_i32_add_rows(i32 *acc, const i32 *p, i32 m, i32 w, i32 ldacc) {{
    __asm__ volatile(
        "ldr r12, [sp]\n\t"
        "push {{r4-r11, lr}}\n\t"
        "sub r12, r12, r3\n\t"
        "lsl r12, r12, #2\n\t"          /* bytes from a row's last word to the next row's first */
        "ands lr, r3, #3\n\t"
        "bne 5f\n\t"
        "lsr r3, r3, #2\n"              /* a multiple of 4 columns: steps only */
        "1:\n\t"
        "mov lr, r3\n"
        "2:\n\t"
        "ldmia r1!, {{r4-r7}}\n\t"
        "ldm r0, {{r8-r11}}\n\t"
        "add r8, r8, r4\n\t"
        "add r9, r9, r5\n\t"
        "add r10, r10, r6\n\t"
        "add r11, r11, r7\n\t"
        "stmia r0!, {{r8-r11}}\n\t"
        "subs lr, lr, #1\n\t"
        "bne 2b\n\t"
        "add r0, r0, r12\n\t"
        "subs r2, r2, #1\n\t"
        "bne 1b\n\t"
        "movs r0, #0\n\t"
        "pop {{r4-r11, pc}}\n"
        "5:\n\t"                        /* any width: the steps, then one word at a time */
        "lsrs lr, r3, #2\n\t"
        "beq 7f\n"
        "6:\n\t"
        "ldmia r1!, {{r4-r7}}\n\t"
        "ldm r0, {{r8-r11}}\n\t"
        "add r8, r8, r4\n\t"
        "add r9, r9, r5\n\t"
        "add r10, r10, r6\n\t"
        "add r11, r11, r7\n\t"
        "stmia r0!, {{r8-r11}}\n\t"
        "subs lr, lr, #1\n\t"
        "bne 6b\n"
        "7:\n\t"
        "and lr, r3, #3\n"
        "8:\n\t"
        "ldr r4, [r1], #4\n\t"
        "ldr r5, [r0]\n\t"
        "add r5, r5, r4\n\t"
        "str r5, [r0], #4\n\t"
        "subs lr, lr, #1\n\t"
        "bne 8b\n\t"
        "add r0, r0, r12\n\t"
        "subs r2, r2, #1\n\t"
        "bne 5b\n\t"
        "movs r0, #0\n\t"
        "pop {{r4-r11, pc}}\n\t");
}}

/* exp/log unit driver: y[i] = exp(x[i]) for n float32 (y may be x). */
#define EXPU(reg) (*(volatile u32 *)({EXP_BASE:#x}u + (reg)))
i32 pe_exp(const float *x, float *y, i32 n) {{
    EXPU({EXP_REGS["SRC"]:#x}) = (u32)x;
    EXPU({EXP_REGS["DST"]:#x}) = (u32)y;
    EXPU({EXP_REGS["N"]:#x}) = (u32)n;
    EXPU({EXP_REGS["FUNC"]:#x}) = {EXP_FUNC_EXP}u;
    EXPU({EXP_REGS["CTRL"]:#x}) = {EXP_START}u;
    while (EXPU({EXP_REGS["CTRL"]:#x}) != 0u) {{ }}
    return 0;
}}

/* exp/log unit driver: y[i] = log(x[i]) for n float32 (y may be x). */
i32 pe_log(const float *x, float *y, i32 n) {{
    EXPU({EXP_REGS["SRC"]:#x}) = (u32)x;
    EXPU({EXP_REGS["DST"]:#x}) = (u32)y;
    EXPU({EXP_REGS["N"]:#x}) = (u32)n;
    EXPU({EXP_REGS["FUNC"]:#x}) = {EXP_FUNC_LOG}u;
    EXPU({EXP_REGS["CTRL"]:#x}) = {EXP_START}u;
    while (EXPU({EXP_REGS["CTRL"]:#x}) != 0u) {{ }}
    return 0;
}}

/* DMA engine driver: one strided descriptor (DMA_DESC_WORDS words in the register block's
   order: SRC, DST, EB, C0-C3, S0-S3) copied into the registers, started, and waited for. */
#define DMAE(reg) (*(volatile u32 *)({DMA_BASE:#x}u + (reg)))
i32 pe_dma(const u32 *d) {{
    for (u32 i = 0; i < {DMA_DESC_WORDS}u; i++) DMAE(4u * i) = d[i];
    DMAE({DMA_REGS["CTRL"]:#x}) = {DMA_START}u;
    while (DMAE({DMA_REGS["CTRL"]:#x}) != 0u) {{ }}
    return 0;
}}

void _start(void) __attribute__((noreturn, section(".text.start")));
void _start(void) {{
    __asm__ volatile("vmsr fpscr, %0" :: "r"(0u));
    const volatile u32 *jobs = (const volatile u32 *){JOB_ADDR:#x}u;
    u32 count = jobs[0];
    for (u32 i = 0; i < count; i++) {{
        const volatile u32 *a = jobs + 1 + i * {JOB_WORDS}u;
        pe_kernel(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11]);
    }}
    pe_halt();
}}

/* The vector table: initial stack pointer and reset vector. */
__attribute__((section(".vectors"), used))
const void *const pe_vectors[2] = {{ (void *){STACK_TOP:#x}u, (void *)_start }};
"""


def zig(*args: str) -> subprocess.CompletedProcess:
    """Run the ``ziglang`` wheel's tool ``args`` (``cc ...``, ``ld.lld ...``); a failure raises
    ``RuntimeError`` with its output."""
    env = dict(os.environ)
    # zig caches compilations; a private cache per process keeps concurrent builds apart
    env.setdefault("ZIG_GLOBAL_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"tvm_spinn_zig_{os.getuid()}"))
    proc = subprocess.run([sys.executable, "-m", "ziglang", *args], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"ziglang {args[0]} failed ({proc.returncode}): {proc.stderr.strip()[:2000]}")
    return proc


def compile_c(source: str, name: str) -> bytes:
    """C ``source`` compiled with :data:`CC_FLAGS` to a Cortex-M4F object (ELF relocatable);
    ``name`` names its files in the temporary directory (and in the compiler's messages)."""
    with tempfile.TemporaryDirectory(prefix="tvm_spinn_pe_") as tmp:
        src, obj = os.path.join(tmp, f"{name}.c"), os.path.join(tmp, f"{name}.o")
        with open(src, "w") as f:
            f.write(source)
        zig("cc", *CC_FLAGS, "-c", src, "-o", obj)
        with open(obj, "rb") as f:
            return f.read()


@functools.lru_cache(maxsize=1)
def runtime_object() -> bytes:
    """The runtime compiled to a Cortex-M4F object (ELF relocatable), built once per process."""
    return compile_c(RUNTIME_C, "pe_runtime")
