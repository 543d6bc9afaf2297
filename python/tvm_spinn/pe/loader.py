"""A reference host loader: runs a firmware directory's region on input tensors in the
instruction-set simulator, from the directory's files alone.

What it reads: ``manifest.json`` (checked by :func:`~.firmware.load_firmware`), the images, and
the region's initial DRAM (``r<i>.dram``). It does not read the spinn program nor use the
package's ``iss`` execution: it keeps the region's DRAM as one byte array laid out as the
manifest's ``dram.tensors`` say, writes the inputs at their offsets, and replays each job of
``jobs`` in order on its PE (one :class:`~.iss.PeMachine` per image, the image reloaded at each
job as the PE's boot would): a ``put`` assembles its words from DRAM by the job's strided
descriptors (what the PE's DMA engine does: the panels, im2col and padded bands are descriptor
lists) and literal words, writes them at its SRAM address; a ``remote`` places them where the
PE's DMA engine reads memory outside it; a ``run`` runs the kernel on its argument words; a
``check`` reads the kernel's status words and raises for an input it refused; a ``get`` reads
words (``dram``) or bytes (``dram8``: 1-byte elements) from SRAM and scatters them into DRAM by
its descriptors. The outputs are read from their offsets. A region exported with ``self_dma``
runs with each PE walking its own command table instead (:func:`run_self_dma`).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from .hostdma import _check_status, _gather, _outputs, _region_dram, _scatter
from .memory_map import DRAM_BASE, JOB_ADDR
from .walker import ENTRY_WORDS, OP_DMA, SELF_DMA_ROUTINE, STATUS_WORD

__all__ = ["run_firmware", "run_self_dma", "SelfDmaRun"]


def run_firmware(directory: "str | os.PathLike", inputs: list, region: int = 0,
                 self_dma: "bool | None" = None) -> list[np.ndarray]:
    """Run region ``region`` of the firmware in ``directory`` on ``inputs``; its outputs.

    Parameters
    ----------
    directory : str or os.PathLike
        A firmware directory (:func:`tvm_spinn.export_firmware`).
    inputs : list of numpy.ndarray
        One array per region input (``dram.inputs`` order), of the manifest's shape and dtype.
    region : int
        The region's index in the manifest.
    self_dma : bool or None
        Each PE walks its own command table with its DMA engine (:func:`.selfdma.run_self_dma`;
        the region needs a ``self_dma`` field) rather than the host performing every job's
        steps. None: the walker where the region has the field.

    Returns
    -------
    list of numpy.ndarray
        The region's outputs (``dram.outputs`` order).

    Raises
    ------
    FirmwareError
        For a directory :func:`~.firmware.load_firmware` refuses.
    ValueError
        For a region the directory cannot run alone (a layer left to the host, named with its
        reason), or inputs of the wrong number, shape or dtype.
    IndexError
        For an input a kernel refuses (a ``check`` step: an embedding index out of range).
    IssFault
        For an image that faults (PE, image and program counter in the message).
    """
    from ..target.arch import SpinnArch
    from .firmware import load_firmware
    from .iss import PeMachine

    fw = load_firmware(directory)
    if self_dma is not False and 0 <= region < len(fw.manifest["regions"]):
        if "self_dma" in fw.manifest["regions"][region]:
            return run_self_dma(fw, region, inputs).outputs
        if self_dma:
            raise ValueError(f"region {region} has no command table: export the firmware with self_dma=True")
    reg, tensors, mem = _region_dram(fw, region, inputs)
    arch = SpinnArch.from_dict(reg["arch"])
    machines: dict = {}
    for job in fw.jobs[region]:
        name = job["image"]
        if name not in machines:
            elf = fw.files[fw.manifest["images"][name]["file"]]
            machines[name] = PeMachine(elf, name, job["pe"], arch.acc_bits, arch)
        m = machines[name]
        m.load(job["pe"])
        m.clear_counters()
        for step in job["steps"]:
            if step[0] == "put":
                m.write(step[1], _gather(mem, step[2]))
            elif step[0] == "remote":
                m.place_remote(_gather(mem, step[1]))
            elif step[0] == "run":
                m.run(step[1], mac_in_flight=step[2])
            elif step[0] == "check":
                _check_status(m, step[1], reg["layers"][job["layer"]])
            else:  # get: words from SRAM scattered into DRAM
                _scatter(mem, m, step[1], step[2])
    return _outputs(reg, tensors, mem)


class SelfDmaRun:
    """What :func:`run_self_dma` returns: ``outputs``; ``host_actions`` (image loads, starts and
    status reads); ``segments`` (each ``(pe, [job ids])``, in the order started); the executed
    cycles (TRM-priced) of the walker's loop (``walker_cycles``: fetching and dispatching
    commands, the kernel calls' argument loads) and of its transfers (``transfer_cycles``:
    ``sdma_transfer``, a descriptor's words into the registers, the start and the polls, waits
    on the engine excluded); ``transfers`` (the :data:`~.walker.OP_DMA` commands run),
    ``elements`` (the elements they moved, one engine cycle each) and ``boots`` (images a PE
    loaded itself); with the NoC, each PE's ``cycles`` (its clock at its walk's end) and the
    ``packets`` delivered."""

    def __init__(self, outputs, host_actions, segments, walker_cycles, transfer_cycles, transfers, elements,
                 boots=0, cycles=None, packets=0):
        self.outputs, self.host_actions, self.segments = outputs, host_actions, segments
        self.walker_cycles, self.transfer_cycles = walker_cycles, transfer_cycles
        self.transfers, self.elements, self.boots = transfers, elements, boots
        self.cycles, self.packets = cycles or {}, packets


def _segments(jobs: list, pe_jobs: list):
    """Each PE's consecutive jobs whose dependencies have run (its walker loads a job's image
    itself), the PE whose next job has the lowest id first (a valid order: that job's
    dependencies are earlier jobs, all run)."""
    queues = {pe: list(ids) for pe, ids in pe_jobs}
    done: set = set()
    while any(queues.values()):
        pe = min((q[0], pe) for pe, q in queues.items() if q)[1]
        q, seg = queues[pe], []
        while q:
            job = jobs[q[0]]
            if not all(d in done or d in seg for lo, hi in job["after"] for d in range(lo, hi + 1)):
                break
            seg.append(q.pop(0))
        done.update(seg)
        yield pe, seg


def _walker_range(machine) -> tuple:
    """The walker's loop and its transfer routine: ``[pe_jobs_dma, the next symbol)`` and
    ``sdma_transfer``'s likewise."""
    syms = sorted(set(machine.symbols.values()))
    out = []
    for name in (SELF_DMA_ROUTINE, "sdma_transfer"):
        lo = machine.symbols[name]
        out.append((lo, next((a for a in syms if a > lo), 1 << 32)))
    return tuple(out)


def _walker_machine_class():
    """:class:`~.iss.PeMachine` for images with the walker: it returns to ``pe_sdma_halt`` (the
    same address in every such image), and a transfer of an image's bytes by the walker
    (:data:`~.walker.OP_BOOT`) makes the PE that image's: its name (fault messages), symbols,
    data area and block prices, the emulator's translations of the old code dropped."""
    import hashlib

    from .iss import PeMachine, _parsed
    from .memory_map import ARENA_END, arena_start
    from .walker import SELF_DMA_HALT

    class WalkerMachine(PeMachine):
        def __init__(self, image, name, pe, acc_bits, arch, images: dict, boots: dict):
            super().__init__(image, name, pe, acc_bits, arch)
            self.images, self.boots = images, boots
            self.symbols["pe_halt"] = self.symbols[SELF_DMA_HALT]

        def boot(self, image, name):
            super().boot(image, name)
            self.symbols["pe_halt"] = self.symbols[SELF_DMA_HALT]

        def _dma_run(self):
            src, dst = self.dma["SRC"], self.dma["DST"]
            super()._dma_run()
            name = self.boots.get(src)
            if name is None:
                return
            elf = self.images[name]
            segments, symbols = _parsed(elf)
            self.name, self.segments, self.symbols = name, list(segments), dict(symbols)
            self.symbols["pe_halt"] = self.symbols[SELF_DMA_HALT]
            self.arena = arena_start(self.symbols["_end"])
            old, new = self._prices, self._image_prices.setdefault(hashlib.sha256(elf).digest(), {})
            if self._prev is not None and self._prev not in new:  # a walker block: the same in both
                new[self._prev] = old[self._prev]
            self._prices = new
            self.uc.ctl_remove_cache(dst, ARENA_END)

    return WalkerMachine


def _boot_sources(fw, rec: dict, table: bytes) -> dict:
    """DRAM address of each booted image's code transfer (the second after an
    :data:`~.walker.OP_BOOT`: the vector table and slots first, then the code after the
    walker) -> the image's name."""
    from .walker import OP_BOOT
    names = sorted(fw.manifest["images"])
    rows = np.frombuffer(table, dtype="<u4", count=ENTRY_WORDS * rec["entries"]).reshape(-1, ENTRY_WORDS)
    out = {}
    for e in np.flatnonzero(rows[:, 0] == OP_BOOT).tolist():
        out[int(rows[e + 2, 1])] = names[int(rows[e, 1])]
    return out


def _shared_dram(rec: dict, mem: np.ndarray, table: bytes) -> np.ndarray:
    """The DRAM the engines see (the region's, then its command table), whole pages."""
    size = -(-(rec["table"] + len(table)) // 4096) * 4096
    dram = np.zeros(size, dtype=np.uint8)
    dram[:mem.nbytes] = mem.view(np.uint8)
    dram[rec["table"]:rec["table"] + len(table)] = np.frombuffer(table, dtype=np.uint8)
    return dram


def _walk_stats(m, table: bytes, first: int, count: int) -> tuple:
    """The walker's loop and transfer cycles of machine ``m``'s last walk and its commands
    ``[first, first + count)``'s transfers and elements."""
    loop, transfer = _walker_range(m)
    rows = np.frombuffer(table, dtype="<u4", count=ENTRY_WORDS * (first + count)).reshape(-1, ENTRY_WORDS)[first:]
    rows = rows[rows[:, 0] == OP_DMA]
    return (_block_cycles(m, [loop]), _block_cycles(m, [transfer]), len(rows),
            int(np.prod(rows[:, 4:8].astype(np.int64), axis=1).sum()))


def run_self_dma(fw, region: int, inputs: list) -> SelfDmaRun:
    """Run region ``region`` of checked firmware ``fw`` (:func:`~.firmware.load_firmware` of a
    directory exported with ``self_dma``) with each PE walking its own command table
    (:mod:`.selfdma`): the region's DRAM and its table mapped once at
    :data:`~.memory_map.DRAM_BASE`, shared by every PE's machine. Without the NoC each PE is
    started on a segment of its consecutive jobs whose dependencies have run (its walker loads
    each job's image itself); with the NoC (images linked with its driver) every PE is started
    once on all its jobs, concurrently, its walker waiting for the ready packets of the jobs
    each job names in ``after`` and sending its own (:class:`~.multi.NocFabric`).

    Raises
    ------
    ValueError
        For a region the directory cannot run alone, or wrong inputs.
    IndexError
        For an input a kernel refuses (a check command stops the walk).
    IssFault
        For an image that faults, on the walker's path too (PE, image and program counter).
    NocDeadlock
        With the NoC, for PEs that all wait for packets none of them sends.
    """
    from unicorn import UC_PROT_ALL

    from ..target.arch import SpinnArch
    from .errors import IssFault

    reg, tensors, mem = _region_dram(fw, region, inputs)
    rec = reg["self_dma"]
    jobs = fw.jobs[region]
    table = fw.files[rec["file"]]
    dram = _shared_dram(rec, mem, table)  # shared by every machine: keep it alive over the run
    arch = SpinnArch.from_dict(reg["arch"])
    images = {name: fw.files[r["file"]] for name, r in fw.manifest["images"].items()}
    boots = _boot_sources(fw, rec, table)
    machine_class = _walker_machine_class()
    stats = [0, 0, 0, 0]
    segments, machines = [], {}

    def machine(key, name, pe):
        if key not in machines:
            m = machines[key] = machine_class(images[name], name, pe, arch.acc_bits, arch, images, boots)
            m.uc.mem_map_ptr(DRAM_BASE, dram.nbytes, UC_PROT_ALL, dram.ctypes.data_as(ctypes.c_void_p).value)
            if rec["remote_bytes"]:
                m.place_remote(bytes(rec["remote_bytes"]))
        m = machines[key]
        if m.name != name:
            m.boot(images[name], name)  # the image the PE starts with
        m.load(pe)
        return m

    def start(m, seg):
        first = rec["jobs"][seg[0]][0]
        last = rec["jobs"][seg[-1]]
        count = last[0] + last[1] - first
        m.write(JOB_ADDR, np.array([DRAM_BASE + rec["table"] + 4 * ENTRY_WORDS * first, count], "<u4").tobytes())
        return first, count

    def finish(m, seg, first, count):
        from unicorn.arm_const import UC_ARM_REG_PC
        status, value = np.frombuffer(m.read(JOB_ADDR + 4 * STATUS_WORD, 8), dtype="<u4")
        if m.mac_pending is not None or m.dma_pending is not None:
            what = "a MAC array run" if m.mac_pending is not None else "a DMA transfer"
            raise IssFault(m.pe, m.name, m.uc.reg_read(UC_ARM_REG_PC), f"jobs {seg} ended with {what} never waited for")
        if status:
            layer = reg["layers"][jobs[int(status) - 1]["layer"]]
            raise IndexError(f"layer {layer['name']!r} ({layer['kind']}): input value {int(np.int32(value))} is "
                             f"out of range (job {int(status) - 1}'s status words)")
        for i, v in enumerate(_walk_stats(m, table, first, count)):
            stats[i] += v
        segments.append((m.pe, seg))

    cycles, packets = {}, 0
    if not rec["noc"]:
        for pe, seg in _segments(jobs, reg["pe_jobs"]):
            m = machine(jobs[seg[0]]["image"], jobs[seg[0]]["image"], pe)
            m.clear_counters()
            first, count = start(m, seg)
            m.call(SELF_DMA_ROUTINE)
            finish(m, seg, first, count)
    else:
        from .memory_map import NOC_STATE_WORDS
        from .multi import NocFabric
        if len(reg["pe_jobs"]) > NOC_STATE_WORDS:
            raise ValueError(f"region {region} runs on {len(reg['pe_jobs'])} PEs; the NoC state counts packets "
                             f"from at most {NOC_STATE_WORDS}")
        fabric = NocFabric(arch)
        for pe, ids in reg["pe_jobs"]:
            fabric.attach(machine(pe, jobs[ids[0]]["image"], pe))

        def proc(pe, ids):
            m = machines[pe]
            m.clear_counters()
            first, count = start(m, ids)
            done = m.call(SELF_DMA_ROUTINE)
            while not done:
                yield False
                done = m.resume()
            finish(m, ids, first, count)
            yield True

        fabric.run({pe: proc(pe, ids) for pe, ids in reg["pe_jobs"]},
                   lambda pe: f"PE {pe}'s walker waits for ready packets ({machines[pe].name})")
        cycles = {pe: machines[pe].noc_time() for pe in sorted(machines)}
        packets = fabric.packets
    out = _outputs(reg, tensors, dram[:mem.nbytes].view("<u4"))
    # per segment: the image's load (or the PE's first), the start (two words) and the status read
    return SelfDmaRun(out, 3 * len(segments), segments, *stats, boots=_boots_run(rec, table, segments),
                      cycles=cycles, packets=packets)


def _boots_run(rec: dict, table: bytes, segments: list) -> int:
    from .walker import OP_BOOT
    rows = np.frombuffer(table, dtype="<u4", count=ENTRY_WORDS * rec["entries"]).reshape(-1, ENTRY_WORDS)
    n = 0
    for _, seg in segments:
        for j in seg[1:] if seg else ():
            first, count = rec["jobs"][j]
            n += int((rows[first:first + count, 0] == OP_BOOT).sum())
    return n


def _block_cycles(machine, ranges) -> int:
    """Executed cycles of the blocks that start in ``ranges`` (TRM-priced, as :mod:`.cycles`)."""
    from .cycles import block_cycles
    return block_cycles(machine, ranges)[0]
