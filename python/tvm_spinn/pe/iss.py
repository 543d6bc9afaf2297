"""The instruction-set simulator: one PE running one image in ``unicorn`` (Cortex-M, Thumb-2,
FPv4-SP), its MAC array and exp/log unit modelled memory-mapped peripherals.

A :class:`PeMachine` maps the PE's SRAM (:mod:`.memory_map`), loads the image's segments, and
runs job blocks from the reset vector (initial SP and ``_start`` from the vector table) to
``pe_halt``. Host code places tile data in SRAM (what the DMA would do) between runs. Any
emulator error (unmapped or misaligned access, undefined instruction) or a run past its
instruction budget is raised as :class:`~.errors.IssFault` naming the PE, the image and the
program counter. Executed basic blocks are counted (with taken branches), so :mod:`.cycles`
can price the executed instructions, and the clock (:meth:`PeMachine.now`) advances block by
block as they execute; the cycles the M4F waits on the exp/log unit (its modelled
latency and rate, ``SpinnArch.exp_unit_latency_cycles`` and ``exp_unit_cycles``) are counted in
:attr:`PeMachine.stall`.

The MAC array runs concurrently with the M4F. A start (CTRL written 1) reads the operands and
fixes the run's end at the M4F's cycle count then (:func:`~.cycles.executed_cycles`) plus the
array's modelled cycles, the timing model's: ``mac_passes(m, n) * (k + mac_readout_cycles)``
(:func:`tvm_spinn.program.ops.gemm.geometry.mac_passes`). A read of CTRL is the wait: the M4F
stalls until that end (the cycles still to go are added to :attr:`PeMachine.stall`; none when
the M4F's own work took longer), the sums are written to C, and CTRL reads 0. A start while a
run is pending, or a run still pending at ``pe_halt`` (its sums never awaited) unless the host
continues the PE's jobs in a further run (:meth:`PeMachine.run`'s ``mac_in_flight``), is an
:class:`~.errors.IssFault`: firmware must wait for every run it starts.

The DMA engine runs one strided descriptor (:data:`~.memory_map.DMA_REGS`) at a time,
concurrently with the M4F like the MAC array: a start gathers the elements (from this PE's SRAM
or from the memory outside it, which the host places at :data:`~.memory_map.REMOTE_BASE` with
:meth:`PeMachine.place_remote`) into SRAM and fixes the transfer's end at the M4F's cycle count
plus one :data:`~tvm_spinn.program.ops.movement.DMA_ELEMENT_CYCLES` per element; a read of CTRL
waits for that end. With :data:`~.memory_map.DMA_SCATTER` set the strides address the
destination instead (the source read in order; where two elements land on one address the later
one stays, as the engine writes them in order). A start while a transfer is pending, a transfer
reading or writing outside mapped memory, an ``EB`` word with unknown bits, or a transfer still
pending at ``pe_halt`` is an :class:`~.errors.IssFault`.

The exp/log unit computes the simulator's exp and log models itself (C++ ``ExpModel`` and
``LogModel`` through :func:`tvm_spinn.program.ops.elementwise.exp_f32` and
:func:`~tvm_spinn.program.ops.elementwise.log_f32`), so the PE code's exp and log are those
models' bits by construction, as on the chip, where they are the unit's.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import io
import struct

import numpy as np
from elftools.elf.elffile import ELFFile
from unicorn import UC_ARCH_ARM, UC_HOOK_BLOCK, UC_MODE_MCLASS, UC_MODE_THUMB, Uc, UcError
from unicorn.arm_const import (UC_ARM_REG_LR, UC_ARM_REG_PC, UC_ARM_REG_R0, UC_ARM_REG_R1, UC_ARM_REG_R2,
                               UC_ARM_REG_R3, UC_ARM_REG_SP)

from .errors import IssFault
from .memory_map import (ARENA_END, DMA_BASE, DMA_BYTES, DMA_EB_MASK, DMA_REGS, DMA_SCATTER,
                         DMA_START, EXP_BASE, EXP_BYTES,
                         EXP_FUNC_EXP, EXP_FUNC_LOG, EXP_REGS, EXP_START, JOB_ADDR, JOB_WORDS, MAC_BASE, MAC_BYTES, MAC_REGS,
                         MAC_START, NOC_BASE, NOC_BYTES, NOC_FAULT_CODES, NOC_KEY_ARRIVE, NOC_KEY_RELEASE, NOC_REGS,
                         REMOTE_BASE,
                         SRAM_BASE, SRAM_BYTES, arena_start)

__all__ = ["PeMachine", "image_symbols", "MAX_INSTRUCTIONS"]

#: The NoC interface's registers by word offset.
_NOC_NAMES = {off: reg for reg, off in NOC_REGS.items()}
#: The DMA engine's registers by word offset.
_DMA_NAMES = {off: reg for reg, off in DMA_REGS.items()}

#: Instruction budget of one run (a runaway loop becomes an IssFault, never a hang).
MAX_INSTRUCTIONS = 200_000_000


@functools.lru_cache(maxsize=64)
def _parsed(image: bytes) -> tuple:
    """An image's loadable segments ``(address, data, memory size)`` and its symbols (as
    :func:`image_symbols`), parsed once per process (concurrent PEs load the same images often)."""
    elf = ELFFile(io.BytesIO(image))
    segments = tuple((int(seg["p_paddr"]), seg.data(), int(seg["p_memsz"])) for seg in elf.iter_segments()
                     if seg["p_type"] == "PT_LOAD")
    return segments, tuple(sorted(image_symbols(image).items()))


def image_symbols(image: bytes) -> dict[str, int]:
    """Function and linker symbols of an ELF image: name -> address (Thumb bit cleared)."""
    elf = ELFFile(io.BytesIO(image))
    table = elf.get_section_by_name(".symtab")
    return {s.name: int(s["st_value"]) & ~1 for s in table.iter_symbols() if s.name and not s.name.startswith("$")}


class PeMachine:
    """One PE with ``image`` loaded.

    Parameters
    ----------
    image : bytes
        A linked PE image (:func:`tvm_spinn.pe.link.link_image`).
    name : str
        The image's name (in fault messages).
    pe : int
        The PE's index (in fault messages).
    acc_bits : int
        Width of the MAC array's signed accumulators (``SpinnArch.acc_bits``).
    arch : SpinnArch, optional
        The exp/log unit's timing (``exp_unit_cycles``, ``exp_unit_latency_cycles``); the
        production chip's when omitted.
    """

    def __init__(self, image: bytes, name: str, pe: int, acc_bits: int, arch=None):
        from ..target.arch import SpinnArch
        self.name, self.pe, self.acc_bits = name, pe, int(acc_bits)
        arch = arch if arch is not None else SpinnArch()
        self.exp_rate, self.exp_latency = float(arch.exp_unit_cycles), int(arch.exp_unit_latency_cycles)
        self.arch = arch
        #: the MAC array's run in flight: ``(c, ldc, sums, end cycle)``, or None
        self.mac_pending = None
        self.uc = Uc(UC_ARCH_ARM, UC_MODE_THUMB | UC_MODE_MCLASS)
        self.uc.mem_map(SRAM_BASE, SRAM_BYTES)
        self._take_image(image)
        self.uc.mmio_map(MAC_BASE, MAC_BYTES, self._mac_read, None, self._mac_write, None)
        self.exp = dict.fromkeys(EXP_REGS, 0)
        self.uc.mmio_map(EXP_BASE, EXP_BYTES, self._exp_read, None, self._exp_write, None)
        self.dma = dict.fromkeys(DMA_REGS, 0)
        #: the DMA engine's transfer in flight: its end cycle, or None
        self.dma_pending = None
        self.uc.mmio_map(DMA_BASE, DMA_BYTES, self._dma_read, None, self._dma_write, None)
        #: bytes mapped at REMOTE_BASE, and the key of the data placed there
        self.remote_bytes, self.remote_key = 0, None
        #: cycles the M4F waited on peripherals since the counters were cleared
        self.stall = 0.0
        self.blocks: dict[tuple[int, int], int] = {}
        self.taken: dict[tuple[int, int], int] = {}
        #: cycles of the executed blocks so far (each whole, its exit priced as it leaves): the
        #: clock, kept as the blocks run so a peripheral's start or wait never rescans them
        self.block_cycles = 0
        #: per block: (cycles falling through, extra cycles when its exit is taken)
        self._prices: dict[tuple[int, int], tuple[int, int]] = {}
        self._prev = None
        self.uc.hook_add(UC_HOOK_BLOCK, self._on_block)
        self.mac_calls = 0
        #: the NoC interface: received packets ``(key, payload, source PE, arrival cycle)``
        #: oldest first, the registers written, the fabric that carries packets between PEs
        #: (:class:`~.multi.NocFabric`; alone, a packet to another PE is kept in ``noc_sent``)
        self.noc_rx: collections.deque = collections.deque()
        self.noc_regs = dict.fromkeys(NOC_REGS, 0)
        self.noc_fabric = None
        self.noc_sent: list = []
        #: the PE's cycles before its counters were last cleared (packets' times are
        #: ``noc_clock0 + now()``), and whether its last run stopped on an empty RX FIFO
        self.noc_clock0 = 0
        self.noc_blocked = False
        #: the clock at the PE's last yield on a read of RX_COUNT (the read it stands for)
        self.noc_resumed = None
        #: the group key of the ``pe_barrier`` this PE is in (its packets are popped unread:
        #: each pop is checked against the static schedule's guarantee), or None
        self.noc_barrier = None
        #: whether the head packet's key was read (a key the code reads, the code checks)
        self.noc_key_read = False
        self.uc.mmio_map(NOC_BASE, NOC_BYTES, self._noc_read, None, self._noc_write, None)
        #: per image (its SHA-256), its blocks' prices (a PE that loads another image keeps them)
        self._image_prices = {hashlib.sha256(image).digest(): self._prices}

    def _take_image(self, image: bytes) -> None:
        """Load ``image`` (its segments, symbols, data area, initial SP and entry)."""
        segments, symbols = _parsed(image)
        self.segments = list(segments)
        self.load()
        self.symbols = dict(symbols)
        self.arena = arena_start(self.symbols["_end"])
        if self.arena > ARENA_END:
            raise IssFault(self.pe, self.name, 0, f"image of {self.symbols['_end']} bytes leaves no SRAM for data")
        self.sp0, self.entry = struct.unpack("<II", bytes(self.uc.mem_read(SRAM_BASE, 8)))

    def boot(self, image: bytes, name: str) -> None:
        """Load another image on this PE (its segments over the old one's; the rest of SRAM,
        the NoC state among it, and the received packets are kept)."""
        self.name = name
        self._take_image(image)
        # code at the old image's addresses: drop the emulator's translations; the blocks'
        # prices are the new image's
        self.uc.ctl_flush_tb()
        self._prices = self._image_prices.setdefault(hashlib.sha256(image).digest(), {})

    def load(self, pe: "int | None" = None) -> None:
        """(Re)load the image as a PE's boot would: its segments, zero-filled to their memory
        size (``.bss``). ``pe``: the PE this machine now stands for (one machine serves every PE
        of a role, one after another)."""
        if pe is not None:
            self.pe = pe
        # a boot resets the peripherals: the MAC array's registers read 0, no run in flight
        self.mac = dict.fromkeys(MAC_REGS, 0)
        self.mac_pending = None
        for addr, data, memsz in self.segments:
            self.uc.mem_write(addr, data + b"\0" * (memsz - len(data)))

    # -- peripherals ---------------------------------------------------------------------------
    def _mac_read(self, uc, offset, size, data):
        for reg, off in MAC_REGS.items():
            if off == offset:
                if reg == "CTRL":
                    self._mac_wait()
                    return 0
                return self.mac[reg]
        return 0

    def _mac_write(self, uc, offset, size, value, data):
        for reg, off in MAC_REGS.items():
            if off == offset:
                self.mac[reg] = value & 0xFFFFFFFF
        if offset == MAC_REGS["CTRL"] and value == MAC_START:
            self._mac_run()

    def now(self) -> int:
        """The M4F's cycles since the counters were cleared (executed instructions, the current
        basic block whole, and peripheral waits): :func:`~.cycles.executed_cycles`'s total,
        kept as the blocks execute."""
        return self.block_cycles - int(-self.stall // 1)

    def _mac_run(self) -> None:
        """Start the MAC array: int8 products into ``acc_bits``-bit wrapping accumulators, kept
        sign-extended as int32 until the wait writes them to C (the wrap is modular: wrapping
        each step or at the end is equal); the run ends ``mac_passes(m, n) * (k +
        mac_readout_cycles)`` cycles from now."""
        from ..program.ops.gemm.geometry import mac_passes
        pc = self.uc.reg_read(UC_ARM_REG_PC)
        if self.mac_pending is not None:
            raise IssFault(self.pe, self.name, pc, "MAC array started while a run is in flight (no wait)")
        m, n, k = self.mac["M"], self.mac["N"], self.mac["K"]
        ldb, ldc = self.mac["LDB"], self.mac["LDC"]
        if ldb < n or ldc < n:
            raise IssFault(self.pe, self.name, pc, f"MAC array row strides LDB={ldb}, LDC={ldc} below N={n}")
        a = np.frombuffer(self.read(self.mac["A"], m * k), dtype=np.int8).reshape(m, k).astype(np.int64)
        raw = np.frombuffer(self.read(self.mac["B"], (k - 1) * ldb + n if k else 0), dtype=np.int8)
        b = np.lib.stride_tricks.as_strided(raw, shape=(k, n), strides=(ldb, 1)).astype(np.int64)
        s = a @ b
        half = np.int64(1) << (self.acc_bits - 1)
        s = (((s + half) & ((half << 1) - 1)) - half).astype(np.int32)
        cycles = int(mac_passes(m, n, self.arch)) * (k + int(self.arch.mac_readout_cycles))
        self.mac_pending = (self.mac["C"], ldc, s, self.now() + cycles)
        self.mac_calls += 1

    def _mac_wait(self) -> None:
        """The M4F waits for the run in flight (if any): stalls until its end, then its sums
        are in C."""
        if self.mac_pending is None:
            return
        c, ldc, s, end = self.mac_pending
        self.mac_pending = None
        self.stall += max(0, end - self.now())
        m, n = s.shape
        if m and n:
            span = np.frombuffer(self.read(c, 4 * ((m - 1) * ldc + n)), dtype=np.int32).copy()
            np.lib.stride_tricks.as_strided(span, shape=(m, n), strides=(4 * ldc, 4))[:] = s
            self.write(c, span.tobytes())

    def _exp_read(self, uc, offset, size, data):
        for reg, off in EXP_REGS.items():
            if off == offset:
                return self.exp[reg] if reg != "CTRL" else 0  # the M4F's wait is counted in stall
        return 0

    def _exp_write(self, uc, offset, size, value, data):
        for reg, off in EXP_REGS.items():
            if off == offset:
                self.exp[reg] = value & 0xFFFFFFFF
        if offset == EXP_REGS["CTRL"] and value == EXP_START:
            self._exp_run()

    def _exp_run(self) -> None:
        """The exp/log unit: ``N`` float32 arguments at SRC to their exps (FUNC
        :data:`~.memory_map.EXP_FUNC_EXP`) or natural logs (:data:`~.memory_map.EXP_FUNC_LOG`)
        at DST (the simulator's exp and log models); the M4F, polling CTRL, waits the
        pipeline's fill and one result per ``exp_unit_cycles``."""
        from ..program.ops.elementwise import exp_f32, log_f32
        n = self.exp["N"]
        funcs = {EXP_FUNC_EXP: exp_f32, EXP_FUNC_LOG: log_f32}
        if self.exp["FUNC"] not in funcs:
            pc = self.uc.reg_read(UC_ARM_REG_PC)
            raise IssFault(self.pe, self.name, pc, f"exp/log unit function {self.exp['FUNC']} is not modelled "
                                                   f"(exp: {EXP_FUNC_EXP}, log: {EXP_FUNC_LOG})")
        x = np.frombuffer(self.read(self.exp["SRC"], 4 * n), dtype=np.float32)
        self.write(self.exp["DST"], funcs[self.exp["FUNC"]](x).tobytes())
        self.stall += self.exp_latency + n * self.exp_rate

    def _dma_read(self, uc, offset, size, data):
        if offset == DMA_REGS["CTRL"]:
            self._dma_wait()
            return 0
        for reg, off in DMA_REGS.items():
            if off == offset:
                return self.dma[reg]
        return 0

    def _dma_write(self, uc, offset, size, value, data):
        reg = _DMA_NAMES.get(offset)
        if reg is not None:
            self.dma[reg] = value & 0xFFFFFFFF
        if offset == DMA_REGS["CTRL"] and value == DMA_START:
            self._dma_run()

    def _dma_run(self) -> None:
        """Start the DMA engine on the descriptor in its registers: the elements land in SRAM
        now (nothing reads them before the wait), the transfer ends one
        ``DMA_ELEMENT_CYCLES`` per element from now."""
        from ..program.ops.movement import DMA_ELEMENT_CYCLES
        pc = self.uc.reg_read(UC_ARM_REG_PC)
        if self.dma_pending is not None:
            raise IssFault(self.pe, self.name, pc, "DMA engine started while a transfer is in flight (no wait)")
        d = self.dma
        eb, scatter = d["EB"] & DMA_EB_MASK, bool(d["EB"] & DMA_SCATTER)
        if d["EB"] & ~(DMA_EB_MASK | DMA_SCATTER):
            raise IssFault(self.pe, self.name, pc, f"DMA EB word {d['EB']:#x} has unknown bits (element bytes "
                           f"{DMA_EB_MASK:#x}, scatter {DMA_SCATTER:#x})")
        counts = np.array([d["C3"], d["C2"], d["C1"], d["C0"]], dtype=np.int64)
        strides = np.array([d[f"S{i}"] for i in (3, 2, 1, 0)], dtype=np.int64)
        strides = np.where(strides >= 1 << 31, strides - (1 << 32), strides)
        n = int(np.prod(counts))
        if n and 1 <= eb <= 16 and counts[0] == counts[1] == counts[2] == 1 and strides[3] == eb:
            # one contiguous run on both sides (either direction): the bytes in order
            try:
                self.uc.mem_write(d["DST"], bytes(self.uc.mem_read(d["SRC"], n * eb)))
            except (UcError, OverflowError) as err:
                raise IssFault(self.pe, self.name, pc, f"DMA transfer of {n} elements from {d['SRC']:#x} to "
                               f"{d['DST']:#x} outside mapped memory ({err})") from None
        elif n:
            if not 1 <= eb <= 16:
                raise IssFault(self.pe, self.name, pc, f"DMA element of {eb} bytes (1 to 16)")
            grids = np.meshgrid(*[np.arange(c, dtype=np.int64) for c in counts], indexing="ij")
            offsets = sum(g * s for g, s in zip(grids, strides)).reshape(-1)
            lo, hi = int(offsets.min()), int(offsets.max()) + eb
            src, dst = (d["SRC"], d["DST"] + lo) if scatter else (d["SRC"] + lo, d["DST"])
            try:
                if scatter:  # in order: where two land on one address the later one stays
                    data = np.frombuffer(bytes(self.uc.mem_read(src, n * eb)), dtype=np.uint8).reshape(n, eb)
                    last = n - 1 - np.unique(offsets[::-1], return_index=True)[1]
                    span = np.frombuffer(bytes(self.uc.mem_read(dst, hi - lo)), dtype=np.uint8).copy()
                    span[(offsets[last] - lo)[:, None] + np.arange(eb)] = data[last]
                    self.uc.mem_write(dst, span.tobytes())
                else:
                    raw = np.frombuffer(bytes(self.uc.mem_read(src, hi - lo)), dtype=np.uint8)
                    self.uc.mem_write(dst, raw[(offsets - lo)[:, None] + np.arange(eb)].tobytes())
            except (UcError, OverflowError) as err:
                raise IssFault(self.pe, self.name, pc, f"DMA transfer of {n} elements from {src:#x} to "
                               f"{dst:#x} outside mapped memory ({err})") from None
        self.dma_pending = self.now() + n * DMA_ELEMENT_CYCLES

    def _dma_wait(self) -> None:
        """The M4F waits for the transfer in flight (if any) to end."""
        if self.dma_pending is not None:
            self.stall += max(0, self.dma_pending - self.now())
            self.dma_pending = None

    def place_remote(self, data: bytes, key=None) -> int:
        """Place ``data`` in the memory outside the PE that its DMA engine reads (mapped at
        :data:`~.memory_map.REMOTE_BASE`, grown as needed); its address. ``key``: data already
        placed under an equal key is kept, not written again."""
        if key is not None and key == self.remote_key:
            return REMOTE_BASE
        need = max(4096, -(-len(data) // 4096) * 4096)
        if need > self.remote_bytes:
            if self.remote_bytes:
                self.uc.mem_unmap(REMOTE_BASE, self.remote_bytes)
            self.uc.mem_map(REMOTE_BASE, need)
            self.remote_bytes = need
        self.uc.mem_write(REMOTE_BASE, bytes(data))
        self.remote_key = key
        return REMOTE_BASE

    def clear_counters(self) -> None:
        """Forget the executed blocks, taken branches and peripheral waits counted so far."""
        self.mac_pending = self.dma_pending = None
        self.blocks.clear()
        self.taken.clear()
        self.block_cycles = 0
        self.stall = 0.0

    # -- execution -----------------------------------------------------------------------------
    def _on_block(self, uc, address, size, data):
        key = (address, size)
        self.blocks[key] = self.blocks.get(key, 0) + 1
        price = self._prices.get(key)
        if price is None:
            from .cycles import block_price
            price = self._prices[key] = block_price(self, address, size)
        self.block_cycles += price[0]
        prev = self._prev
        if prev is not None and prev[0] + prev[1] != address:
            self.taken[prev] = self.taken.get(prev, 0) + 1
            self.block_cycles += self._prices[prev][1]
        self._prev = key

    def read(self, address: int, nbytes: int) -> bytes:
        try:
            return bytes(self.uc.mem_read(address, nbytes))
        except UcError as err:
            raise IssFault(self.pe, self.name, address, f"host read of {nbytes} bytes outside SRAM ({err})") from None

    def write(self, address: int, data: bytes) -> None:
        try:
            self.uc.mem_write(address, bytes(data))
        except UcError as err:
            raise IssFault(self.pe, self.name, address, f"host write of {len(data)} bytes outside SRAM ({err})") from None

    def run(self, jobs: list[list[int]], mac_in_flight: bool = False) -> None:
        """Run the image's kernel once per job (each a list of at most JOB_WORDS arguments).
        ``mac_in_flight``: the jobs may end with a MAC-array run in flight, which the next run's
        jobs wait for (the PE keeps running between the host's placements of operands);
        otherwise such a run is a fault."""
        words = [len(jobs)]
        for args in jobs:
            if len(args) > JOB_WORDS:
                raise ValueError(f"a job has {len(args)} arguments (at most {JOB_WORDS})")
            words += [int(a) & 0xFFFFFFFF for a in args] + [0] * (JOB_WORDS - len(args))
        self.write(JOB_ADDR, struct.pack(f"<{len(words)}I", *words))
        halt = self.symbols["pe_halt"]
        self.uc.reg_write(UC_ARM_REG_SP, self.sp0)
        self._prev = None
        try:
            self.uc.emu_start(self.entry | 1, halt, count=MAX_INSTRUCTIONS)
        except UcError as err:
            pc = self.uc.reg_read(UC_ARM_REG_PC)
            raise IssFault(self.pe, self.name, pc, f"emulation fault: {err}") from None
        pc = self.uc.reg_read(UC_ARM_REG_PC)
        if pc & ~1 != halt:
            raise IssFault(self.pe, self.name, pc, f"did not reach pe_halt within {MAX_INSTRUCTIONS} instructions")
        if self.mac_pending is not None and not mac_in_flight:
            self.mac_pending = None
            raise IssFault(self.pe, self.name, pc, "reached pe_halt with a MAC array run never waited for")
        if self.dma_pending is not None:
            self.dma_pending = None
            raise IssFault(self.pe, self.name, pc, "reached pe_halt with a DMA transfer never waited for")

    # -- the NoC interface -------------------------------------------------------------------
    def noc_time(self) -> int:
        """The PE's clock as the NoC sees it: cycles before the last clear plus :meth:`now`."""
        return self.noc_clock0 + self.now()

    def _noc_head(self, reg: str):
        if not self.noc_rx:
            pc = self.uc.reg_read(UC_ARM_REG_PC)
            raise IssFault(self.pe, self.name, pc, f"NoC {reg} read with an empty RX FIFO")
        return self.noc_rx[0]

    def _noc_read(self, uc, offset, size, data):
        if offset == NOC_REGS["RX_COUNT"]:
            if self.noc_resumed is not None:
                # the polls between a yield and this read stand for the one read at the yield
                self.stall -= self.noc_time() - self.noc_resumed
                self.noc_resumed = None
            if self.noc_fabric is not None:
                # the PE yields until a packet arrives, or, when another PE could still send it
                # one by the cycle of this read, until that PE has run that far
                when = max(self.noc_time(), self.noc_rx[0][3]) if self.noc_rx else None
                if when is None or self.noc_fabric.earlier(self.pe, when):
                    self.noc_blocked = True
                    self.noc_resumed = self.noc_time()
                    self.uc.emu_stop()
                    return 0
            elif not self.noc_rx:
                return 0
            # a packet still on its way: the M4F polls until it lands; then the packets that
            # have landed by that cycle (those still on their way are not yet in the FIFO)
            self.stall += max(0, self.noc_rx[0][3] - self.noc_time())
            now = self.noc_time()
            return sum(1 for p in self.noc_rx if p[3] <= now)
        if offset == NOC_REGS["RX_KEY"]:
            self.noc_key_read = True
            return self._noc_head("RX_KEY")[0]
        if offset == NOC_REGS["RX_PAYLOAD"]:
            return self._noc_head("RX_PAYLOAD")[1]
        if offset == NOC_REGS["RX_SOURCE"]:
            return self._noc_head("RX_SOURCE")[2]
        if offset == NOC_REGS["PE_ID"]:
            return self.pe
        reg = _NOC_NAMES.get(offset)
        return self.noc_regs[reg] if reg is not None else 0

    def _noc_write(self, uc, offset, size, value, data):
        value &= 0xFFFFFFFF
        reg = _NOC_NAMES.get(offset)
        if reg is not None:
            self.noc_regs[reg] = value
        if offset == NOC_REGS["TX_SEND"]:
            packet = (self.noc_regs["TX_DEST"], self.noc_regs["TX_KEY"], value)
            if self.noc_fabric is not None:
                self.noc_fabric.send(self, *packet)
            elif packet[0] == self.pe:
                self.noc_rx.append((packet[1], packet[2], self.pe, self.noc_time()))
            else:
                self.noc_sent.append(packet)
        elif offset == NOC_REGS["RX_POP"]:
            key, _, source, _ = self._noc_head("RX_POP")
            group, read, self.noc_key_read = self.noc_barrier, self.noc_key_read, False
            if group is not None and not read and key not in (NOC_KEY_ARRIVE | group, NOC_KEY_RELEASE | group):
                # pe_barrier counts packets without reading their keys: the schedule must send a
                # PE in a barrier nothing but its group's arrivals and release
                pc = self.uc.reg_read(UC_ARM_REG_PC)
                raise IssFault(self.pe, self.name, pc, f"packet key {key:#x} from PE {source} popped unread "
                                                       f"in barrier group {group} (only its arrivals "
                                                       f"{NOC_KEY_ARRIVE | group:#x} may arrive there)")
            self.noc_rx.popleft()
        elif offset == NOC_REGS["FAULT"]:
            pc = self.uc.reg_read(UC_ARM_REG_PC)
            what = NOC_FAULT_CODES.get(value, "unknown fault code")
            raise IssFault(self.pe, self.name, pc, f"NoC driver fault {value}: {what} "
                                                   f"(detail {self.noc_regs['FAULT_DETAIL']:#x})")

    def call(self, symbol: str, args=()) -> bool:
        """Run the image's routine ``symbol`` on up to four argument words (AAPCS: r0-r3), from
        a fresh stack, until it returns (to ``pe_halt``). True when it returned; False when it
        stopped waiting on an empty RX FIFO of a PE on a fabric (:meth:`resume` continues it)."""
        if symbol not in self.symbols:
            raise IssFault(self.pe, self.name, 0, f"image has no routine {symbol!r} (not linked with it)")
        if len(args) > 4:
            raise ValueError(f"{symbol}: {len(args)} arguments (at most 4 in registers)")
        for reg, a in zip((UC_ARM_REG_R0, UC_ARM_REG_R1, UC_ARM_REG_R2, UC_ARM_REG_R3), args):
            self.uc.reg_write(reg, int(a) & 0xFFFFFFFF)
        self.uc.reg_write(UC_ARM_REG_SP, self.sp0)
        self.uc.reg_write(UC_ARM_REG_LR, self.symbols["pe_halt"] | 1)
        self._prev = None
        # pe_barrier's third argument is its group key (see the ``noc_barrier`` attribute)
        self.noc_barrier = int(args[2]) & 0xFFFFFF if symbol == "pe_barrier" and len(args) > 2 else None
        self.noc_key_read = False
        return self._left(self._go(self.symbols[symbol]))

    def resume(self) -> bool:
        """Continue a routine that stopped on an empty RX FIFO (see :meth:`call`)."""
        return self._left(self._go(self.uc.reg_read(UC_ARM_REG_PC)))

    def _left(self, done: bool) -> bool:
        """``done``, leaving the barrier (its pop check) when the routine returned."""
        if done:
            self.noc_barrier = None
        return done

    def _go(self, start: int) -> bool:
        halt = self.symbols["pe_halt"]
        self.noc_blocked = False
        try:
            self.uc.emu_start(start | 1, halt, count=MAX_INSTRUCTIONS)
        except UcError as err:
            pc = self.uc.reg_read(UC_ARM_REG_PC)
            raise IssFault(self.pe, self.name, pc, f"emulation fault: {err}") from None
        pc = self.uc.reg_read(UC_ARM_REG_PC)
        if pc & ~1 == halt:
            return True
        if self.noc_blocked:
            return False
        raise IssFault(self.pe, self.name, pc, f"did not reach pe_halt within {MAX_INSTRUCTIONS} instructions")
