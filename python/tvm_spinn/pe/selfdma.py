"""PEs that place their own operands: the job table walked by the PE runtime with its DMA engine.

A firmware exported with ``self_dma=True`` (:func:`~.firmware.export_firmware`) links every
role's image with a job-table walker, ``pe_jobs_dma`` (:data:`SELF_DMA_C`, compiled like the
runtime and linked after the runtime, the kernel and the NoC driver where there is one, so their
code keeps its addresses), and writes each region's job table a second time as a *command
table* (``r<i>.sdma``) that a host copies into DRAM beside the region's data
(:func:`encode_region`). A command is :data:`ENTRY_WORDS` 32-bit words, its operation first:

- :data:`OP_JOB` (word 1: the job's id): a job starts; where the image has writable segments
  the next commands restore them (a PE's boot of the image), as DMA transfers;
- :data:`OP_DMA` (words 1-11: a descriptor in the engine's register order,
  :data:`~.memory_map.DMA_REGS`): one transfer, started and waited for: a ``put`` part from
  DRAM (``dram``, ``dram8``) or from the table's literal pool (``fill``: the word read with
  stride 0; ``bytes``) into SRAM; a ``remote`` part into the window the DMA kernels read
  (:data:`~.memory_map.REMOTE_BASE`); a ``get`` part from SRAM scattered into DRAM
  (:data:`~.memory_map.DMA_SCATTER`);
- :data:`OP_RUN` (words 1-12: the kernel's arguments): one call of ``pe_kernel``; a MAC-array
  run may stay in flight into the next job (as the host-driven run's ``mac_in_flight``);
- :data:`OP_CHECK` (word 1: the status words' address): a nonzero first status word stops the
  walk, the job and the refused value left in the job block for the host.

DRAM appears to the engine at :data:`~.memory_map.DRAM_BASE` (the region's DRAM, then the
command table at the manifest's ``table`` offset). The host writes the first command's address
and the number of commands into the job block (:data:`~.memory_map.JOB_ADDR`, words 0 and 1)
and starts ``pe_jobs_dma``; the walker fetches :data:`BATCH` commands at a time by DMA into
the rest of the job block and runs them, so a PE's consecutive jobs of one image run back to
back with no host action between them. It leaves 0 in word 2 when done, or ``job + 1`` and the
refused value (word 3) after a failed check. An unknown operation is a trap (``udf``): the
instruction-set simulator raises it as an :class:`~.errors.IssFault` naming the PE, the image
and the program counter.

:func:`run_self_dma` is the reference run: the region's DRAM mapped once (shared by every
machine), each PE's jobs in its ``pe_jobs`` order, a segment of consecutive jobs of one image
whose dependencies (``after``) have run started at once; a host action is an image load, a
segment's start (two words written) and its status read.
"""

from __future__ import annotations

import ctypes
import functools
import os
import tempfile

import numpy as np

from .memory_map import (DMA_BASE, DMA_DESC_WORDS, DMA_REGS, DMA_SCATTER, DMA_START, DRAM_BASE, JOB_ADDR,
                         REMOTE_BASE)
from .runtime import CC_FLAGS, zig

__all__ = ["SELF_DMA_C", "SELF_DMA_ROUTINE", "ENTRY_WORDS", "BATCH", "OP_JOB", "OP_DMA", "OP_RUN", "OP_CHECK",
           "self_dma_object", "link_self_dma_image", "encode_region", "region_record", "check_region",
           "run_self_dma", "SelfDmaRun"]

#: Words per command (an operation word and its operands, padded).
ENTRY_WORDS = 16
#: Commands fetched per DMA transfer into the job block (after its 4 header words).
BATCH = 3
OP_JOB, OP_DMA, OP_RUN, OP_CHECK = 1, 2, 3, 4
#: The walker's entry point.
SELF_DMA_ROUTINE = "pe_jobs_dma"
_HEADER = 4
_STATUS_WORD, _VALUE_WORD = 2, 3
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
    BLOCK[{_STATUS_WORD}] = 0u;
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
                    BLOCK[{_VALUE_WORD}] = s[1];
                    BLOCK[{_STATUS_WORD}] = job + 1u;
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


# -- the command table -----------------------------------------------------------------------
def _writable_segments(elf: bytes) -> list:
    """An image's writable loadable segments ``(address, data, memory size)``: what a job's boot
    restores."""
    import io

    from elftools.elf.elffile import ELFFile
    e = ELFFile(io.BytesIO(elf))
    return [(int(s["p_paddr"]), s.data(), int(s["p_memsz"])) for s in e.iter_segments()
            if s["p_type"] == "PT_LOAD" and s["p_flags"] & 2]


class _Table:
    """Commands and the literal pool of one region, built in order."""

    def __init__(self, base: int):
        self.base = base  # the table's DRAM offset (commands first, the pool after them)
        self.entries: list = []
        self.pool = bytearray()

    def add(self, op: int, words) -> None:
        # a pool reference stays a tuple until the pool's place is known
        row = [op, *[w if isinstance(w, tuple) else int(w) & 0xFFFFFFFF for w in words]]
        self.entries.append(row + [0] * (ENTRY_WORDS - len(row)))

    def literal(self, data: bytes) -> int:
        """``data``'s place in the pool (4-byte aligned), as a pool offset."""
        self.pool += b"\0" * (-len(self.pool) % 4)
        at = len(self.pool)
        self.pool += data
        return at

    def dma(self, src, dst: int, eb: int, counts, strides) -> None:
        self.add(OP_DMA, [src, dst, eb, *counts, *strides])


def _pool_ref(at: int) -> tuple:
    return ("pool", at)


def _put_parts(table: _Table, dst: int, parts: list) -> None:
    """A ``put`` or ``remote`` step's parts as transfers to ``dst`` on, in order."""
    for part in parts:
        kind = part[0]
        if kind in ("dram", "dram8"):
            eb = 4 if kind == "dram" else 1
            table.dma(DRAM_BASE + part[1], dst, eb, part[2], part[3])
            n = int(np.prod(part[2], dtype=np.int64))
        elif kind == "fill":  # one word read with stride 0
            table.dma(_pool_ref(table.literal(int(part[1]).to_bytes(4, "little"))), dst, 4, [part[2], 1, 1, 1],
                      [0, 0, 0, 0])
            eb, n = 4, part[2]
        else:  # "bytes"
            data = bytes.fromhex(part[1])
            eb = 4 if len(data) % 4 == 0 else 1
            n = len(data) // eb
            table.dma(_pool_ref(table.literal(data)), dst, eb, [n, 1, 1, 1], [eb, 0, 0, 0])
        dst += eb * n


def _get_parts(table: _Table, src: int, parts: list) -> None:
    """A ``get`` step's parts: SRAM from ``src`` on scattered into DRAM by their descriptors."""
    for part in parts:
        eb = 4 if part[0] == "dram" else 1
        table.dma(src, DRAM_BASE + part[1], eb | DMA_SCATTER, part[2], part[3])
        src += eb * int(np.prod(part[2], dtype=np.int64))


def encode_region(jobs: list, pe_jobs: list, images: dict, dram_bytes: int) -> dict:
    """A region's command table: every PE's jobs in its ``pe_jobs`` order, each an
    :data:`OP_JOB` and its steps' commands (``images``: name -> ELF bytes, for the writable
    segments a job's boot restores). Returns ``{"data": bytes, "table": DRAM offset, "entries":
    count, "jobs": [[first command, commands] per job id], "remote_bytes": the largest remote
    window}``."""
    base = -(-dram_bytes // _TABLE_ALIGN) * _TABLE_ALIGN
    table = _Table(base)
    spans = [None] * len(jobs)
    remote = 0
    writable = {name: _writable_segments(elf) for name, elf in sorted(images.items())}
    for _, ids in pe_jobs:
        for j in ids:
            job = jobs[j]
            first = len(table.entries)
            table.add(OP_JOB, [j])
            for addr, data, memsz in writable[job["image"]]:
                _put_parts(table, addr, [["bytes", (data + b"\0" * (memsz - len(data))).hex()]])
            for step in job["steps"]:
                if step[0] == "put":
                    _put_parts(table, step[1], step[2])
                elif step[0] == "remote":
                    before = len(table.entries)
                    _put_parts(table, REMOTE_BASE, step[1])
                    end = REMOTE_BASE
                    for row in table.entries[before:]:
                        end += (row[3] & 0xFF) * int(np.prod(row[4:8], dtype=np.int64))
                    remote = max(remote, end - REMOTE_BASE)
                elif step[0] == "run":
                    for args in step[1]:
                        table.add(OP_RUN, list(args) + [0] * (12 - len(args)))
                elif step[0] == "check":
                    table.add(OP_CHECK, [step[1]])
                else:  # get
                    _get_parts(table, step[1], step[2])
            spans[j] = [first, len(table.entries) - first]
    pool_at = base + ENTRY_WORDS * 4 * len(table.entries)
    words = np.zeros((len(table.entries), ENTRY_WORDS), dtype="<u4")
    for e, row in enumerate(table.entries):
        row = [DRAM_BASE + pool_at + w[1] if isinstance(w, tuple) else w for w in row]
        words[e] = row
    return {"data": words.tobytes() + bytes(table.pool), "table": base, "entries": len(table.entries),
            "jobs": spans, "remote_bytes": remote}


def region_record(index: int, jobs: list, pe_jobs: list, images: dict, dram_bytes: int, files: dict) -> dict:
    """The manifest's ``self_dma`` field of region ``index`` (its command table written into
    ``files`` as ``r<index>.sdma``)."""
    enc = encode_region(jobs, pe_jobs, images, dram_bytes)
    name = f"r{index}.sdma"
    files[name] = enc["data"]
    return {"file": name, "dram_base": DRAM_BASE, "table": enc["table"], "entries": enc["entries"],
            "entry_words": ENTRY_WORDS, "routine": SELF_DMA_ROUTINE, "remote_bytes": enc["remote_bytes"],
            "jobs": enc["jobs"]}


def check_region(path: str, table_path: str, r: int, region: dict, jobs: list, images: dict, files: dict) -> None:
    """Region ``r``'s ``self_dma`` field and command table: the field's types, and the table
    the job file's steps give (a :class:`~.firmware.FirmwareError` names the manifest or the
    table file, and the first job whose commands differ)."""
    from .firmware import FirmwareError
    rec = region.get("self_dma")
    keys = {"file", "dram_base", "table", "entries", "entry_words", "routine", "remote_bytes", "jobs"}
    if not (isinstance(rec, dict) and set(rec) == keys and rec["file"] == f"r{r}.sdma" and rec["file"] in files
            and rec["dram_base"] == DRAM_BASE and rec["entry_words"] == ENTRY_WORDS
            and rec["routine"] == SELF_DMA_ROUTINE):
        raise FirmwareError(path, f"field regions[{r}].self_dma: malformed (needs file r{r}.sdma listed in files, "
                                  f"dram_base {DRAM_BASE:#x}, entry_words {ENTRY_WORDS}, routine "
                                  f"{SELF_DMA_ROUTINE!r}, table, entries, remote_bytes, jobs)")
    enc = encode_region(jobs, region["pe_jobs"], images, region["dram"]["bytes"])
    for field in ("table", "entries", "remote_bytes"):
        if rec[field] != enc[field]:
            raise FirmwareError(path, f"field regions[{r}].self_dma.{field}: {rec[field]!r}, the job file's steps "
                                      f"give {enc[field]!r}")
    for j, span in enumerate(enc["jobs"]):
        if j >= len(rec["jobs"]) or rec["jobs"][j] != span:
            raise FirmwareError(path, f"field regions[{r}].self_dma.jobs[{j}]: not job {j}'s commands {span}")
    data = files[rec["file"]]
    if data != enc["data"]:
        at = next((i for i in range(min(len(data), len(enc["data"]))) if data[i] != enc["data"][i]),
                  min(len(data), len(enc["data"])))
        entry = at // (4 * ENTRY_WORDS)
        job = next((j for j, (first, n) in enumerate(enc["jobs"]) if first <= entry < first + n), None)
        where = f"job {job} (command {entry})" if job is not None else f"the literal pool (byte {at})"
        raise FirmwareError(table_path, f"differs from the job file's steps at {where}")
    if len(rec["jobs"]) != len(enc["jobs"]):
        raise FirmwareError(path, f"field regions[{r}].self_dma.jobs: {len(rec['jobs'])} jobs, the region has "
                                  f"{len(enc['jobs'])}")


# -- the reference run -----------------------------------------------------------------------
class SelfDmaRun:
    """What :func:`run_self_dma` returns: ``outputs``; ``host_actions`` (image loads, starts and
    status reads); ``segments`` (each ``(pe, [job ids])``, in the order run); the executed
    cycles (TRM-priced) of the walker's loop (``walker_cycles``: fetching and dispatching
    commands, the kernel calls' argument loads) and of its transfers (``transfer_cycles``:
    ``sdma_transfer``, a descriptor's words into the registers, the start and the polls, waits
    on the engine excluded); ``transfers`` (the :data:`OP_DMA` commands run) and ``elements``
    (the elements they moved, one engine cycle each)."""

    def __init__(self, outputs, host_actions, segments, walker_cycles, transfer_cycles, transfers, elements):
        self.outputs, self.host_actions, self.segments = outputs, host_actions, segments
        self.walker_cycles, self.transfer_cycles = walker_cycles, transfer_cycles
        self.transfers, self.elements = transfers, elements


def _segments(jobs: list, pe_jobs: list):
    """Each PE's consecutive jobs of one image whose dependencies have run, the PE whose next
    job has the lowest id first (a valid order: that job's dependencies are earlier jobs, all
    run)."""
    queues = {pe: list(ids) for pe, ids in pe_jobs}
    done: set = set()
    while any(queues.values()):
        pe = min((q[0], pe) for pe, q in queues.items() if q)[1]
        q, seg = queues[pe], []
        while q:
            job = jobs[q[0]]
            if seg and job["image"] != jobs[seg[0]]["image"]:
                break
            if not all(d in done or d in seg for lo, hi in job["after"] for d in range(lo, hi + 1)):
                break
            seg.append(q.pop(0))
        done.update(seg)
        yield pe, seg


def _walker_range(machine) -> tuple:
    """The walker's code: ``[pe_jobs_dma, the next symbol)`` and ``sdma_transfer``'s likewise."""
    syms = sorted(set(machine.symbols.values()))
    out = []
    for name in (SELF_DMA_ROUTINE, "sdma_transfer"):
        if name in machine.symbols:
            lo = machine.symbols[name]
            out.append((lo, next((a for a in syms if a > lo), 1 << 32)))
    return tuple(out)


def run_self_dma(fw, region: int, inputs: list) -> SelfDmaRun:
    """Run region ``region`` of checked firmware ``fw`` (exported with ``self_dma``) with each
    PE walking its own command table (see the module's docstring)."""
    from ..target.arch import SpinnArch
    from .errors import IssFault
    from .iss import PeMachine
    from .loader import _outputs, _region_dram
    from unicorn import UC_PROT_ALL
    from unicorn.arm_const import UC_ARM_REG_PC

    reg, tensors, mem = _region_dram(fw, region, inputs)
    rec = reg["self_dma"]
    jobs = fw.jobs[region]
    table = fw.files[rec["file"]]
    size = -(-(rec["table"] + len(table)) // 4096) * 4096
    dram = np.zeros(size, dtype=np.uint8)  # DRAM as the engines see it, shared by every machine
    dram[:mem.nbytes] = mem.view(np.uint8)
    dram[rec["table"]:rec["table"] + len(table)] = np.frombuffer(table, dtype=np.uint8)
    arch = SpinnArch.from_dict(reg["arch"])
    machines: dict = {}
    host_actions = 0
    segments, walker, transfer_cycles, transfers, elements = [], 0, 0, 0, 0
    for pe, seg in _segments(jobs, reg["pe_jobs"]):
        name = jobs[seg[0]]["image"]
        if name not in machines:
            elf = fw.files[fw.manifest["images"][name]["file"]]
            m = machines[name] = PeMachine(elf, name, pe, arch.acc_bits, arch)
            m.uc.mem_map_ptr(DRAM_BASE, size, UC_PROT_ALL, dram.ctypes.data_as(ctypes.c_void_p).value)
            if rec["remote_bytes"]:
                m.place_remote(bytes(rec["remote_bytes"]))
        m = machines[name]
        m.load(pe)  # the image's boot
        m.clear_counters()
        first, _ = rec["jobs"][seg[0]]
        last_first, last_n = rec["jobs"][seg[-1]]
        m.write(JOB_ADDR, np.array([DRAM_BASE + rec["table"] + 4 * ENTRY_WORDS * first,
                                    last_first + last_n - first], dtype="<u4").tobytes())
        m.call(SELF_DMA_ROUTINE)
        host_actions += 3  # the image's load, the start (two words), the status read
        status, value = np.frombuffer(m.read(JOB_ADDR + 4 * _STATUS_WORD, 8), dtype="<u4")
        pc = m.uc.reg_read(UC_ARM_REG_PC)
        if m.mac_pending is not None or m.dma_pending is not None:
            what = "a MAC array run" if m.mac_pending is not None else "a DMA transfer"
            raise IssFault(m.pe, m.name, pc, f"jobs {seg} ended with {what} never waited for")
        if status:
            layer = reg["layers"][jobs[int(status) - 1]["layer"]]
            raise IndexError(f"layer {layer['name']!r} ({layer['kind']}): input value {int(np.int32(value))} is "
                             f"out of range (job {int(status) - 1}'s status words)")
        loop, transfer = _walker_range(m)
        walker += _block_cycles(m, [loop])
        transfer_cycles += _block_cycles(m, [transfer])
        rows = np.frombuffer(table, dtype="<u4", count=ENTRY_WORDS * (last_first + last_n)).reshape(-1, ENTRY_WORDS)
        rows = rows[first:][rows[first:, 0] == OP_DMA]
        transfers += len(rows)
        elements += int(np.prod(rows[:, 4:8].astype(np.int64), axis=1).sum())
        segments.append((pe, seg))
    out = _outputs(reg, tensors, dram[:mem.nbytes].view("<u4"))
    return SelfDmaRun(out, host_actions, segments, walker, transfer_cycles, transfers, elements)


def _block_cycles(machine, ranges) -> int:
    """Executed cycles of the blocks that start in ``ranges`` (TRM-priced, as :mod:`.cycles`)."""
    from .cycles import _decode
    total = 0
    for key, count in machine.blocks.items():
        if not any(lo <= key[0] < hi for lo, hi in ranges):
            continue
        prices = _decode(machine, *key)
        taken = machine.taken.get(key, 0)
        for n, (_, c_not, c_taken) in enumerate(prices):
            if n == len(prices) - 1 and taken:
                total += c_taken * taken + c_not * (count - taken)
            else:
                total += c_not * count
    return total
