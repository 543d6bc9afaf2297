"""The PEs of a region run concurrently in the instruction-set simulator, the jobs' order kept by
NoC packets between them.

:class:`NocFabric` carries packets between the NoC interfaces (:data:`~.memory_map.NOC_REGS`) of
the PEs' :class:`~.iss.PeMachine` s (one ``unicorn`` per PE) and steps the PE that can run
earliest: a PE whose code reads an empty RX FIFO's count (or reads it while another PE could
still send it a packet by then) stops there and yields, and is resumed once a packet is in its
FIFO (or the other has run that far); when every PE still running waits on an empty FIFO,
:class:`~.errors.NocDeadlock` names each PE and what it waits for.

:func:`run_firmware_concurrent` runs a region of a firmware directory exported with the NoC
driver (:func:`~.firmware.export_firmware` ``noc=True``) that way: each PE runs its jobs in its
``pe_jobs`` order; before a job, its PE runs the driver's ``pe_noc_wait_ready`` until a ready
packet has come from the PE of every job the job names in ``after`` (jobs of the same PE are
before it in its order); after a job, its PE runs ``pe_noc_notify``: one ready packet to each
other PE with a job that names it. The packets count per sending PE in the NoC state
(:data:`~.memory_map.NOC_STATE_ADDR`), so a job waits for the ``n``-th packet from a PE, ``n``
counted over that PE's packets to it in its order. A scratch word that a job on another PE reads
(a split row's statistics, a reduction's partial sums) travels as a data packet
(``pe_noc_send_words``) from the writer's SRAM into the reader's mailbox
(:data:`~.memory_map.NOC_MAILBOX_ADDR`), not through DRAM; the rest of the data moves as the job
tables say (the loader plays the DMA transfers, as :func:`~.loader.run_firmware` does).

Timing: each PE keeps its own clock (its executed instructions priced by :mod:`.cycles`,
peripheral waits included); a packet arrives at its sender's clock plus
``SpinnArch.noc_hop_cycles`` per router hop (:meth:`NocFabric.hops`), and a PE that reads it
earlier waits until then. The host's DRAM transfers take no PE time here.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass

import numpy as np

from .errors import IssFault, NocDeadlock
from .jobs import expand
from .jobs import ready_signals as _signals
from .memory_map import (JOB_ADDR, JOB_WORDS, NOC_KEY_DATA, NOC_MAILBOX_ADDR, NOC_MAILBOX_WORDS, NOC_MULTICAST,
                         NOC_STATE_ADDR, NOC_STATE_WORDS)

__all__ = ["NocFabric", "ConcurrentRun", "run_firmware_concurrent", "run_barrier", "barrier_tree", "barrier_pes",
           "MAX_JOBS_PER_RUN"]

#: Jobs one run's job block may hold without reaching the NoC state above it.
MAX_JOBS_PER_RUN = (NOC_STATE_ADDR - JOB_ADDR - 4) // (4 * JOB_WORDS)


class NocFabric:
    """The NoC between the PEs of one run: delivers packets to the receivers' RX FIFOs (oldest
    arrival first) and schedules the PEs.

    Parameters
    ----------
    arch : SpinnArch
        The chip's geometry and router latency (``pes_per_chip``, ``pes_per_qpe``,
        ``noc_hop_cycles``; ``link_hop_s`` and ``clock_hz`` between chips).
    """

    def __init__(self, arch):
        self.arch = arch
        self.machines: dict = {}
        #: per PE of the processes :meth:`run` steps, whether it waits on an empty RX FIFO
        self._blocked: dict = {}
        #: the router's multicast table: ``(key, mask, destination PEs)``
        self.routes: list = []
        #: packets delivered (a multicast counts once per destination)
        self.packets = 0

    def attach(self, machine) -> None:
        """Connect ``machine`` (its ``pe``) to the fabric."""
        self.machines[machine.pe] = machine
        machine.noc_fabric = self

    def route(self, key: int, mask: int, pes) -> None:
        """Add a multicast entry: a packet sent with :data:`~.memory_map.NOC_MULTICAST` whose
        ``key & mask == key`` goes to ``pes``."""
        self.routes.append((int(key) & 0xFFFFFFFF, int(mask) & 0xFFFFFFFF, tuple(sorted(int(p) for p in pes))))

    def hops(self, src: int, dst: int) -> int:
        """Router hops from PE ``src`` to PE ``dst`` (assumption: the quad-PEs of a chip form a
        near-square grid of routers, ``ceil(sqrt(qpes))`` wide, numbered row by row; a packet
        passes its own quad-PE's router, then one per grid step, X then Y)."""
        a = self.arch
        qpes = -(-a.pes_per_chip // a.pes_per_qpe)
        side = math.isqrt(qpes - 1) + 1
        qa, qb = (src % a.pes_per_chip) // a.pes_per_qpe, (dst % a.pes_per_chip) // a.pes_per_qpe
        return 1 + abs(qa % side - qb % side) + abs(qa // side - qb // side)

    def latency(self, src: int, dst: int) -> int:
        """Cycles from a send on PE ``src`` to the packet's arrival at PE ``dst``: the router
        hops, plus one chip-to-chip link hop (``link_hop_s``) when the PEs are on different chips."""
        a = self.arch
        cycles = self.hops(src, dst) * int(a.noc_hop_cycles)
        if src // a.pes_per_chip != dst // a.pes_per_chip:
            cycles += int(math.ceil(a.link_hop_s * a.clock_hz))
        return cycles

    def send(self, machine, dest: int, key: int, payload: int) -> None:
        """A packet sent by ``machine``'s NoC interface (called by the interface)."""
        from unicorn.arm_const import UC_ARM_REG_PC
        if dest & NOC_MULTICAST:
            targets = sorted({p for k, m, pes in self.routes if key & m == k for p in pes})
            if not targets:
                raise IssFault(machine.pe, machine.name, machine.uc.reg_read(UC_ARM_REG_PC),
                               f"multicast packet key {key:#x} matches no route of the router's table")
        else:
            targets = [dest]
        t = machine.noc_time()
        for d in targets:
            if d not in self.machines:
                raise IssFault(machine.pe, machine.name, machine.uc.reg_read(UC_ARM_REG_PC),
                               f"packet to PE {d}, which is not running (PEs {sorted(self.machines)})")
            rx = self.machines[d].noc_rx
            arrival = t + self.latency(machine.pe, d)
            pos = len(rx)  # after every packet arriving no later (most arrive in order: a short scan)
            while pos and rx[pos - 1][3] > arrival:
                pos -= 1
            rx.insert(pos, (key, payload, machine.pe, arrival))
            self.packets += 1

    def run(self, procs: dict, waiting) -> None:
        """Step the processes ``procs`` (PE -> generator) until all end, the earliest first.

        A process yields ``True`` after a step that made progress and ``False`` when its PE
        stopped on an empty RX FIFO; such a PE is stepped again only once a packet is in its FIFO.
        Each step goes to the PE that can run at the earliest cycle (its clock; for a waiting
        PE, the arrival of its oldest packet; ties by PE), so a PE reads its RX FIFO's count
        after the PEs that could have sent it a packet by then have run that far (a PE runs
        until it waits; one that runs on past another's clock may still miss that one's later
        packets, a pessimistic error of a poll). ``waiting(pe)``: what a waiting PE waits for,
        in words (for the deadlock's message).

        Raises
        ------
        NocDeadlock
            When every process still running waits on an empty RX FIFO.
        """
        active = set(procs)
        blocked = self._blocked = dict.fromkeys(active, False)
        while active:
            ready = [(t, pe) for pe in active for t in (self._ready_at(pe),) if t is not None]
            if not ready:
                raise NocDeadlock({pe: waiting(pe) for pe in sorted(active)})
            pe = min(ready)[1]
            try:
                blocked[pe] = not next(procs[pe])
            except StopIteration:
                active.remove(pe)
                del blocked[pe]

    def _ready_at(self, pe: int):
        """The cycle at which PE ``pe`` of the running processes can run: its clock, or for one
        that waits, its oldest packet's arrival (None: none in its FIFO)."""
        m = self.machines[pe]
        if not self._blocked[pe]:
            return m.noc_time()
        return max(m.noc_time(), m.noc_rx[0][3]) if m.noc_rx else None

    def earlier(self, pe: int, when: float) -> bool:
        """Whether a PE of the running processes other than ``pe`` can run before cycle
        ``when`` (and so could still send ``pe`` a packet that lands by then)."""
        for other in self._blocked:
            if other != pe:
                t = self._ready_at(other)
                if t is not None and t < when:
                    return True
        return False


@dataclass(frozen=True)
class ConcurrentRun:
    """A region run concurrently: its ``outputs`` (``dram.outputs`` order), each PE's ``cycles``
    (its clock at its last job's end), the NoC ``packets`` delivered, and the words ``handed``
    from PE to PE as data packets instead of through DRAM scratch."""

    outputs: list
    cycles: dict
    packets: int
    handed: int


def _words_only(parts: list) -> bool:
    """Whether a get's parts are all 32-bit word descriptors (the only ones a NoC hand-off carries)."""
    return all(part[0] == "dram" for part in parts)


def _handoffs(jobs: list, on_pe: dict, scratch: list) -> tuple[dict, dict, set]:
    """The scratch words handed from a job on one PE to a job on another (a split row's
    statistics, a reduction's partial sums), to travel as data packets into the receiver's
    mailbox instead of through DRAM.

    Returns ``(sends, takes, kept)``: per producing job, its ``(PE, mailbox word, SRAM address)``
    sends in order; per ``(job, put step)``, the ``(word position in the put, mailbox word)``
    pairs its PE takes from its mailbox; the scratch addresses still written to DRAM (read on
    the writer's own PE, or past a receiver's mailbox).
    """
    lo, hi = scratch[0], scratch[0] + scratch[1]
    writer: dict = {}  # scratch address -> (job, SRAM address that held it)
    for job in jobs:
        for step in job["steps"]:
            if step[0] == "get" and _words_only(step[2]):
                addr = np.concatenate([expand(part[1:]) for part in step[2]])
                for k in np.flatnonzero((addr >= lo) & (addr < hi)):
                    writer[int(addr[k])] = (job["id"], step[1] + 4 * int(k))
    sends: dict = {}
    takes: dict = {}
    kept: set = set()
    free: dict = {}  # PE -> its next free mailbox word
    for job in jobs:
        q = job["pe"]
        for s, step in enumerate(job["steps"]):
            if step[0] != "put":
                continue
            if any(part[0] == "dram8" for part in step[2]):
                # byte placements read DRAM as it is: any scratch word they read stays there (a
                # dram8 part's bytes by the words that hold them)
                for part in step[2]:
                    if part[0] in ("dram", "dram8"):
                        addr = expand(part[1:])
                        if part[0] == "dram8":
                            addr = addr & ~3
                        kept.update(int(a) for a in addr[(addr >= lo) & (addr < hi)])
                continue
            pos = 0
            for part in step[2]:
                if part[0] != "dram":
                    pos += part[2] if part[0] == "fill" else len(part[1]) // 8
                    continue
                addr = expand(part[1:])
                for k in np.flatnonzero((addr >= lo) & (addr < hi)):
                    a = int(addr[k])
                    if a not in writer:
                        continue
                    producer, sram = writer[a]
                    if on_pe[producer] == q or free.get(q, 0) >= NOC_MAILBOX_WORDS:
                        kept.add(a)
                        continue
                    idx = free[q] = free.get(q, 0) + 1
                    sends.setdefault(producer, []).append((q, idx - 1, sram))
                    takes.setdefault((job["id"], s), []).append((pos + int(k), idx - 1))
                pos += addr.size
    return sends, takes, kept


def _runs(sends: list) -> list:
    """``(PE, first mailbox word, first SRAM address, words)`` runs of consecutive sends."""
    out = []
    for q, idx, sram in sends:
        if out and out[-1][0] == q and out[-1][1] + out[-1][3] == idx and out[-1][2] + 4 * out[-1][3] == sram:
            out[-1][3] += 1
        else:
            out.append([q, idx, sram, 1])
    return out


def _words(values) -> bytes:
    return struct.pack(f"<{len(values)}I", *[int(v) & 0xFFFFFFFF for v in values])


def run_firmware_concurrent(directory: "str | os.PathLike", inputs: list, region: int = 0) -> ConcurrentRun:
    """Run region ``region`` of the firmware in ``directory`` on ``inputs`` with its PEs
    concurrent, the jobs' dependencies honoured by NoC packets (see the module's docstring).

    Parameters
    ----------
    directory : str or os.PathLike
        A firmware directory exported with the NoC driver (``export_firmware(..., noc=True)``).
    inputs : list of numpy.ndarray
        One array per region input (``dram.inputs`` order).
    region : int
        The region's index in the manifest.

    Returns
    -------
    ConcurrentRun
        The outputs (the bits of :func:`~.loader.run_firmware`'s sequential replay), each PE's
        cycles and the packets sent.

    Raises
    ------
    FirmwareError
        For a directory :func:`~.firmware.load_firmware` refuses.
    ValueError
        For a region the directory cannot run alone, wrong inputs, images without the NoC
        driver, more PEs than the NoC state counts, or a run of more jobs than the job block
        holds below the NoC state.
    IssFault
        For an image that faults (PE, image and program counter in the message).
    NocDeadlock
        For PEs that all wait for packets none of them sends.
    """
    from ..target.arch import SpinnArch
    from .firmware import load_firmware
    from .iss import PeMachine
    from .hostdma import _check_status, _gather, _outputs, _region_dram, _scatter
    from .noc import NOC_ROUTINES
    from .iss import image_symbols

    fw = load_firmware(directory)
    reg, tensors, mem = _region_dram(fw, region, inputs)
    jobs = fw.jobs[region]
    for name, rec in sorted(fw.manifest["images"].items()):
        missing = [r for r in NOC_ROUTINES if r not in image_symbols(fw.files[rec["file"]])]
        if missing:
            raise ValueError(f"image {name!r} has no NoC driver ({', '.join(missing)} missing): export the "
                             "firmware with noc=True to run its PEs concurrently")
    pes = [pe for pe, _ in reg["pe_jobs"]]
    if len(pes) > NOC_STATE_WORDS:
        raise ValueError(f"region {region} runs on {len(pes)} PEs; the NoC state counts packets from at most "
                         f"{NOC_STATE_WORDS}")
    for job in jobs:
        for step in job["steps"]:
            if step[0] == "run" and len(step[1]) > MAX_JOBS_PER_RUN:
                raise ValueError(f"job {job['id']}: a run of {len(step[1])} kernel jobs; the job block holds "
                                 f"{MAX_JOBS_PER_RUN} below the NoC state")
    slot = {pe: s for s, pe in enumerate(pes)}
    on_pe = {j: pe for pe, ids in reg["pe_jobs"] for j in ids}
    sends, takes, kept = _handoffs(jobs, on_pe, reg["dram"]["scratch"])
    notify, need = _signals(jobs, on_pe, sends)
    arch = SpinnArch.from_dict(reg["arch"])
    fabric = NocFabric(arch)
    machines: dict = {}
    current: dict = {}  # PE -> the job it runs or waits for

    def elf(name):
        return fw.files[fw.manifest["images"][name]["file"]]

    for pe, ids in reg["pe_jobs"]:
        first = jobs[ids[0]]
        machines[pe] = PeMachine(elf(first["image"]), first["image"], pe, arch.acc_bits, arch)
        fabric.attach(machines[pe])

    # the scratch addresses whose words travel by NoC (each job's gets skip them)
    handed_addr = set()
    for job in jobs:
        for step in job["steps"]:
            if step[0] == "get" and sends.get(job["id"]) and _words_only(step[2]):
                srams = {sram for _, _, sram in sends[job["id"]]}
                addr = np.concatenate([expand(part[1:]) for part in step[2]])
                for k, a in enumerate(addr):
                    if step[1] + 4 * k in srams and int(a) not in kept:
                        handed_addr.add(int(a))
    handed = sum(len(v) for v in sends.values())

    def proc(pe: int, ids: list):
        m = machines[pe]
        for j in ids:
            job = jobs[j]
            current[pe] = j
            if job["image"] != m.name:
                m.boot(elf(job["image"]), job["image"])
            else:
                m.load(pe)
            m.noc_clock0 += m.now()
            m.clear_counters()
            pairs = need[j]
            if pairs:
                m.write(m.arena, _words([w for p, c in pairs for w in (slot[p], c)]))
                done = m.call("pe_noc_wait_ready", [m.arena, len(pairs)])
                while not done:
                    yield False
                    done = m.resume()
            for s, step in enumerate(job["steps"]):
                if step[0] == "put":
                    data = _gather(mem, step[2])
                    taken = takes.get((j, s))
                    if taken:  # the handed words from the PE's mailbox (its DMA reads its own SRAM)
                        words = np.frombuffer(data, dtype="<u4").copy()
                        box = np.frombuffer(m.read(NOC_MAILBOX_ADDR, 4 * NOC_MAILBOX_WORDS), dtype="<u4")
                        pos, idx = np.array(taken, dtype=np.int64).T
                        words[pos] = box[idx]
                        data = words.tobytes()
                    m.write(step[1], data)
                elif step[0] == "remote":
                    m.place_remote(_gather(mem, step[1]))
                elif step[0] == "run":
                    m.run(step[1], mac_in_flight=step[2])
                elif step[0] == "check":
                    _check_status(m, step[1], reg["layers"][job["layer"]])
                elif not _words_only(step[2]):  # a get with byte parts: nothing of it travels by NoC
                    _scatter(mem, m, step[1], step[2])
                else:  # get: words from SRAM scattered into DRAM (scratch words handed by NoC skipped)
                    addr = np.concatenate([expand(part[1:]) for part in step[2]])
                    got = np.frombuffer(m.read(step[1], 4 * addr.size), dtype="<u4")
                    if sends.get(j):
                        keep = np.array([int(a) not in handed_addr for a in addr], dtype=bool)
                        addr, got = addr[keep], got[keep]
                    mem[addr // 4] = got
            for q, idx0, sram, n in _runs(sends.get(j, ())):
                key0 = NOC_KEY_DATA | (slot[pe] << 16) | idx0
                if not m.call("pe_noc_send_words", [q, key0, sram, n]):
                    raise AssertionError("pe_noc_send_words never waits")
            if notify[j]:
                m.write(m.arena, _words(notify[j]))
                if not m.call("pe_noc_notify", [m.arena, len(notify[j]), j, slot[pe]]):
                    raise AssertionError("pe_noc_notify never waits")
            yield True
        m.noc_clock0 += m.now()
        m.clear_counters()
        current.pop(pe, None)

    def waiting(pe: int) -> str:
        j = current[pe]
        counts = np.frombuffer(machines[pe].read(NOC_STATE_ADDR, 4 * len(pes)), dtype="<u4")
        parts = [f"PE {p}: {int(counts[slot[p]])} of {c}" for p, c in need[j] if counts[slot[p]] < c]
        return (f"job {j} (layer {jobs[j]['layer']}, image {jobs[j]['image']}) waits for ready packets from "
                + ", ".join(parts))

    fabric.run({pe: proc(pe, ids) for pe, ids in reg["pe_jobs"]}, waiting)
    out = _outputs(reg, tensors, mem)
    cycles = {pe: int(machines[pe].noc_clock0) for pe in pes}
    return ConcurrentRun(outputs=out, cycles=cycles, packets=fabric.packets, handed=handed)


def barrier_tree(pes, root: int, pes_per_qpe: int, by_qpe: bool = True) -> dict:
    """Each PE's ``(parent, children)`` in a barrier over ``pes`` rooted at ``root``: with
    ``by_qpe``, the first PE of each quad-PE (``root`` first of its own) gathers its quad-PE's
    others and reports to ``root``; else every PE reports to ``root`` directly."""
    pes = [int(p) for p in pes]
    if not by_qpe:
        return {pe: (root, len(pes) - 1) if pe == root else (root, 0) for pe in pes}
    leader: dict = {}
    for pe in [root] + [p for p in pes if p != root]:
        leader.setdefault(pe // pes_per_qpe, pe)
    tree = {}
    for pe in pes:
        lead = leader[pe // pes_per_qpe]
        members = sum(1 for p in pes if p // pes_per_qpe == pe // pes_per_qpe) - 1 if lead == pe else 0
        if pe == root:
            tree[pe] = (root, members + len(leader) - 1)
        else:
            tree[pe] = (root if lead == pe else lead, members)
    return tree


def barrier_pes(count: int, arch=None) -> tuple[list, int]:
    """The chip's PEs of the timing model's barrier over ``count`` PEs
    (:meth:`SpinnArch.barrier_layout`): its grid of quad-PEs placed at the top left of the
    fabric's grid (:meth:`NocFabric.hops`), and its root PE. Returns ``(pes, root)``.

    Raises
    ------
    ValueError
        When the layout does not fit on the chip's grid of quad-PEs.
    """
    from ..target.arch import SpinnArch
    arch = arch if arch is not None else SpinnArch()
    cells, root = arch.barrier_layout(count)
    qpes = -(-arch.pes_per_chip // arch.pes_per_qpe)
    side = math.isqrt(qpes - 1) + 1
    pes = []
    for r, c, n in cells:
        q = r * side + c
        if c >= side or q >= qpes:
            raise ValueError(f"a barrier over {count} PEs: its quad-PE at row {r}, column {c} is off the "
                             f"chip's {side}-wide grid of {qpes} quad-PEs")
        pes += [q * arch.pes_per_qpe + j for j in range(n)]
    r, c, _ = cells[root]
    return pes, (r * side + c) * arch.pes_per_qpe


def run_barrier(pes, master: "int | None" = None, group: int = 1, arch=None, image=None,
                by_qpe: bool = True) -> dict:
    """Run the PE runtime's barrier (``pe_barrier``, :mod:`.noc`) on PEs ``pes`` concurrently in
    the instruction-set simulator; each PE's cycles from its entry to its leaving the barrier
    (its executed instructions priced by :mod:`.cycles`, plus its waits for packets in flight).

    Parameters
    ----------
    pes : sequence of int
        The barrier's PEs (at least one, distinct).
    master : int, optional
        The root: it counts the arrivals and multicasts the release; ``pes[0]`` when omitted.
    group : int
        The barrier's group key (its packets' key field, below ``1 << 24``).
    arch : SpinnArch, optional
        The chip (router latency, geometry); the production chip's when omitted.
    image : PeImage, optional
        An image linked with the NoC driver; a small role's (``relu``) when omitted.
    by_qpe : bool
        Gather each quad-PE's arrivals at its first PE, which reports to the root (the timing
        model's barrier, :meth:`SpinnArch.barrier_cost_cycles`); else every PE reports to the
        root (:func:`barrier_tree`).

    Returns
    -------
    dict
        PE -> cycles.
    """
    from ..target.arch import SpinnArch
    from .iss import PeMachine
    from .memory_map import NOC_KEY_RELEASE
    from .images import noc_role_image
    pes = [int(p) for p in pes]
    if not pes or len(set(pes)) != len(pes):
        raise ValueError(f"a barrier needs distinct PEs, got {pes}")
    master = pes[0] if master is None else int(master)
    if master not in pes:
        raise ValueError(f"master PE {master} is not one of the barrier's PEs {pes}")
    if not 0 <= group < 1 << 24:
        raise ValueError(f"group key {group} outside [0, 2**24)")
    arch = arch if arch is not None else SpinnArch()
    image = image if image is not None else noc_role_image(("relu",))
    fabric = NocFabric(arch)
    fabric.route(NOC_KEY_RELEASE | group, 0xFFFFFFFF, [p for p in pes if p != master])
    machines = {}
    for pe in pes:
        machines[pe] = PeMachine(image.elf, image.name, pe, arch.acc_bits, arch)
        fabric.attach(machines[pe])

    tree = barrier_tree(pes, master, arch.pes_per_qpe, by_qpe)

    def proc(m):
        done = m.call("pe_barrier", [*tree[m.pe], group])
        while not done:
            yield False
            done = m.resume()
        yield True

    fabric.run({pe: proc(machines[pe]) for pe in pes},
               lambda pe: f"barrier {group} (master PE {master}) waits for "
                          + ("arrivals" if pe == master else "the release"))
    return {pe: machines[pe].noc_time() for pe in pes}
