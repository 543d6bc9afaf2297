"""PEs that place their own operands: the command tables the PEs' job-table walker runs.

A firmware exported with ``self_dma=True`` (:func:`~.firmware.export_firmware`) links every
role's image with the walker, ``pe_jobs_dma`` (:mod:`.walker`: the same code at the same address
in every image, the image's routines called through slots), and writes each region's job table a
second time as a *command table* (``r<i>.sdma``, :func:`encode_region`) that a host copies into
DRAM after the region's data. A command is :data:`~.walker.ENTRY_WORDS` 32-bit words, its
operation first:

- :data:`~.walker.OP_JOB` (the job's id): a job starts; where the image has writable segments
  the next commands restore them;
- :data:`~.walker.OP_BOOT` (the image's index): where the PE's previous job ran another image,
  the transfers that follow load this one under the running walker;
- :data:`~.walker.OP_WAIT` (NoC images): ``pe_noc_wait_ready`` on the job's ``(slot, count)``
  pairs, copied from the table's pool into the job's data area;
- :data:`~.walker.OP_DMA` (a descriptor in the engine's register order,
  :data:`~.memory_map.DMA_REGS`): one transfer, started and waited for: a ``put`` part from
  DRAM (``dram``, ``dram8``) or from the table's literal pool (``fill``: the word read with
  stride 0; ``bytes``) into SRAM; a ``remote`` part into the window the DMA kernels read
  (:data:`~.memory_map.REMOTE_BASE`); a ``get`` part from SRAM scattered into DRAM
  (:data:`~.memory_map.DMA_SCATTER`);
- :data:`~.walker.OP_RUN` (the kernel's arguments): one call of the kernel; a MAC-array run may
  stay in flight into the next job (as the host-driven run's ``mac_in_flight``);
- :data:`~.walker.OP_CHECK` (the status words' address): a nonzero first status word stops the
  walk, the job and the refused value left in the job block for the host;
- :data:`~.walker.OP_NOTIFY` (NoC images): ``pe_noc_notify`` to the PEs with jobs that name
  this one.

DRAM appears to the engine at :data:`~.memory_map.DRAM_BASE` (the region's DRAM, then the
command table at the manifest's ``table`` offset). The host writes the first command's address
and the number of commands into the job block (:data:`~.memory_map.JOB_ADDR`, words 0 and 1)
and starts ``pe_jobs_dma``; the walker fetches :data:`~.walker.BATCH` commands at a time by
DMA into the rest of the job block and runs them, with no host action between jobs. It leaves
0 in word 2 when done, or ``job + 1`` and the refused value (word 3) after a failed check. An
unknown operation is a trap (``udf``): the instruction-set simulator raises it as an
:class:`~.errors.IssFault` naming the PE, the image and the program counter.
:func:`.loader.run_self_dma` is the reference run.
"""

from __future__ import annotations

import numpy as np

from .memory_map import DMA_SCATTER, DRAM_BASE, REMOTE_BASE
from .walker import (ENTRY_WORDS, OP_BOOT, OP_CHECK, OP_DMA, OP_JOB, OP_NOTIFY, OP_RUN, OP_WAIT, SELF_DMA_ROUTINE,
                     SLOT_WORDS, SLOTS_ADDR, walker_span)

__all__ = ["encode_region", "region_record", "check_region"]

_TABLE_ALIGN = 64


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
        self._placed: dict = {}  # bytes -> their pool offset (an image loaded by many jobs is stored once)

    def add(self, op: int, words) -> None:
        # a pool reference stays a tuple until the pool's place is known
        row = [op, *[w if isinstance(w, tuple) else int(w) & 0xFFFFFFFF for w in words]]
        self.entries.append(row + [0] * (ENTRY_WORDS - len(row)))

    def literal(self, data: bytes) -> int:
        """``data``'s place in the pool (4-byte aligned), as a pool offset."""
        data = bytes(data)
        if data not in self._placed:
            self.pool += b"\0" * (-len(self.pool) % 4)
            self._placed[data] = len(self.pool)
            self.pool += data
        return self._placed[data]

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


def _image_facts(images: dict, names: list) -> dict:
    """Per image name in ``names``: its loadable segments, its data area's start, whether it has
    the NoC driver, and its walker's code (the bytes every self-DMA image shares). Raises
    ValueError naming the first image without the walker."""
    import io

    from elftools.elf.elffile import ELFFile

    from .iss import image_symbols
    from .memory_map import arena_start
    facts = {}
    for name in sorted(names):
        elf = images[name]
        e = ELFFile(io.BytesIO(elf))
        segs = [(int(x["p_paddr"]), x.data(), int(x["p_memsz"])) for x in e.iter_segments() if x["p_type"] == "PT_LOAD"]
        symbols = image_symbols(elf)
        lo, hi = walker_span(elf, name)
        start = lo + 4 * SLOT_WORDS  # the slots differ per image, the code after them does not
        code = b"".join(d[max(0, start - a):max(0, hi - a)] for a, d, _ in segs)
        facts[name] = {"segments": segs, "arena": arena_start(symbols["_end"]), "walker": (lo, hi, code),
                       "noc": bool(symbols.get("pe_noc_wait_ready")), "writable": _writable_segments(elf)}
    return facts


def _boot(table: _Table, facts: dict) -> None:
    """Transfers that load an image over the one the PE runs, the walker's code (the same bytes
    in both) left as it is: the vector table and the slots, the code after the walker, and
    ``.bss`` zeroed."""
    lo, hi, _ = facts["walker"]
    for addr, data, memsz in facts["segments"]:
        end = addr + len(data)
        for a, b in ((addr, min(end, lo + 4 * SLOT_WORDS)), (max(addr, hi), end)):
            if a < b:
                _put_parts(table, a, [["bytes", data[a - addr:b - addr].hex()]])
        if memsz > len(data):
            _put_parts(table, end, [["fill", 0, -(-(memsz - len(data)) // 4)]])


def encode_region(jobs: list, pe_jobs: list, images: dict, dram_bytes: int) -> dict:
    """A region's command table: every PE's jobs in its ``pe_jobs`` order, each an
    :data:`~.walker.OP_JOB` and its commands: where the PE's previous job ran another image, an
    :data:`~.walker.OP_BOOT` and the transfers that load this one; with the NoC driver, an
    :data:`~.walker.OP_WAIT` on the ready packets of the jobs it names in ``after`` on other
    PEs; its steps' commands; with the NoC driver, an :data:`~.walker.OP_NOTIFY` to the PEs
    with jobs that name it. ``images``: name -> ELF bytes. Returns ``{"data": bytes, "table":
    DRAM offset, "entries": count, "jobs": [[first command, commands] per job id],
    "remote_bytes": the largest remote window, "noc": bool}``.

    Raises
    ------
    ValueError
        For a job's image that is not in ``images`` or lacks the walker, images whose walker
        code or slots differ (not linked by :func:`~.walker.link_self_dma_image`), or a region
        that mixes images with and without the NoC driver.
    """
    from .jobs import ready_signals
    base = -(-dram_bytes // _TABLE_ALIGN) * _TABLE_ALIGN
    table = _Table(base)
    spans = [None] * len(jobs)
    remote = 0
    used = sorted({job["image"] for job in jobs})
    missing = [n for n in used if n not in images]
    if missing:
        raise ValueError(f"jobs run images {missing} that the firmware does not have")
    facts = _image_facts(images, used)  # images no job runs are never loaded: their walker does not matter
    if len({facts[n]["walker"] for n in used}) > 1 or any(facts[n]["walker"][0] != SLOTS_ADDR for n in used):
        raise ValueError(f"images {used}: their walker code differs (each must be linked by link_self_dma_image)")
    nocs = {facts[n]["noc"] for n in used}
    if len(nocs) > 1:
        raise ValueError(f"images {used}: some have the NoC driver, some not")
    noc = bool(nocs and nocs.pop())
    notify, need = {}, {}
    if noc:
        on_pe = {j: pe for pe, ids in pe_jobs for j in ids}
        notify, need = ready_signals(jobs, on_pe, {})
    slot = {pe: s for s, (pe, _) in enumerate(pe_jobs)}
    names = sorted(images)
    for pe, ids in pe_jobs:
        held = None
        for j in ids:
            job = jobs[j]
            first = len(table.entries)
            f = facts[job["image"]]
            table.add(OP_JOB, [j])
            if held is not None and held != job["image"]:
                table.add(OP_BOOT, [names.index(job["image"])])
                _boot(table, f)
            held = job["image"]
            for addr, data, memsz in f["writable"]:
                _put_parts(table, addr, [["bytes", (data + b"\0" * (memsz - len(data))).hex()]])
            if need.get(j):
                words = [w for p, c in need[j] for w in (slot[p], c)]
                table.add(OP_WAIT, [_pool_ref(table.literal(np.array(words, "<u4").tobytes())), len(need[j]),
                                    f["arena"]])
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
            if notify.get(j):
                table.add(OP_NOTIFY, [_pool_ref(table.literal(np.array(notify[j], "<u4").tobytes())), len(notify[j]),
                                      f["arena"], j, slot[pe]])
            spans[j] = [first, len(table.entries) - first]
    pool_at = base + ENTRY_WORDS * 4 * len(table.entries)
    words = np.zeros((len(table.entries), ENTRY_WORDS), dtype="<u4")
    for e, row in enumerate(table.entries):
        row = [DRAM_BASE + pool_at + w[1] if isinstance(w, tuple) else w for w in row]
        words[e] = row
    return {"data": words.tobytes() + bytes(table.pool), "table": base, "entries": len(table.entries),
            "jobs": spans, "remote_bytes": remote, "noc": noc}


def region_record(index: int, jobs: list, pe_jobs: list, images: dict, dram_bytes: int, files: dict) -> dict:
    """The manifest's ``self_dma`` field of region ``index`` (its command table written into
    ``files`` as ``r<index>.sdma``)."""
    enc = encode_region(jobs, pe_jobs, images, dram_bytes)
    name = f"r{index}.sdma"
    files[name] = enc["data"]
    return {"file": name, "dram_base": DRAM_BASE, "table": enc["table"], "entries": enc["entries"],
            "entry_words": ENTRY_WORDS, "routine": SELF_DMA_ROUTINE, "remote_bytes": enc["remote_bytes"],
            "noc": enc["noc"], "jobs": enc["jobs"]}


def check_region(path: str, table_path: str, r: int, region: dict, jobs: list, images: dict,
                 files: dict) -> "tuple | None":
    """Region ``r``'s ``self_dma`` field and command table against the table the job file's
    steps give: None, or ``(file, reason)`` naming the manifest (``path``) or the table file
    (``table_path``) and the first job whose commands differ (what
    :func:`~.firmware.load_firmware` raises as a :class:`~.firmware.FirmwareError`)."""
    rec = region.get("self_dma")
    keys = {"file", "dram_base", "table", "entries", "entry_words", "routine", "remote_bytes", "noc", "jobs"}
    if not (isinstance(rec, dict) and set(rec) == keys and rec["file"] == f"r{r}.sdma" and rec["file"] in files
            and rec["dram_base"] == DRAM_BASE and rec["entry_words"] == ENTRY_WORDS
            and rec["routine"] == SELF_DMA_ROUTINE and isinstance(rec["jobs"], list)):
        return path, (f"field regions[{r}].self_dma: malformed (needs file r{r}.sdma listed in files, dram_base "
                      f"{DRAM_BASE:#x}, entry_words {ENTRY_WORDS}, routine {SELF_DMA_ROUTINE!r}, table, entries, "
                      "remote_bytes, jobs)")
    try:
        enc = encode_region(jobs, region["pe_jobs"], images, region["dram"]["bytes"])
    except ValueError as err:
        return path, f"field regions[{r}].self_dma: {err}"
    for field in ("table", "entries", "remote_bytes", "noc"):
        if rec[field] != enc[field]:
            return path, f"field regions[{r}].self_dma.{field}: {rec[field]!r}, the job file's steps give {enc[field]!r}"
    for j, span in enumerate(enc["jobs"]):
        if j >= len(rec["jobs"]) or rec["jobs"][j] != span:
            return path, f"field regions[{r}].self_dma.jobs[{j}]: not job {j}'s commands {span}"
    if len(rec["jobs"]) != len(enc["jobs"]):
        return path, f"field regions[{r}].self_dma.jobs: {len(rec['jobs'])} jobs, the region has {len(enc['jobs'])}"
    data = files[rec["file"]]
    if data != enc["data"]:
        n = min(len(data), len(enc["data"]))
        at = next((i for i in range(n) if data[i] != enc["data"][i]), n)
        entry = at // (4 * ENTRY_WORDS)
        job = next((j for j, (first, k) in enumerate(enc["jobs"]) if first <= entry < first + k), None)
        where = f"job {job} (command {entry})" if job is not None else f"the literal pool (byte {at})"
        return table_path, f"differs from the job file's steps at {where}"
    return None