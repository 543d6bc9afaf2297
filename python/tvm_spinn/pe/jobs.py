"""Job tables: each PE's jobs of a spinn program as a host loader replays them, with the data
placement and the DMA descriptors that bring every operand into SRAM and every result out.

The ``iss`` execution (:mod:`.execute`) places a tile's operands in its PE's SRAM, runs the
kernel's jobs and reads the results back; the host computes the operands' layout there (the
broadcasts, the fp32 GEMM's transposed ``[k, 4]`` panels, a convolution's im2col, the pools'
padded bands, the hand-off of a reduction split over PEs). :func:`job_tables` records that
work once, at export, as data: the program's tensors get a DRAM layout (byte offsets in one
region), and each job becomes a list of steps (operands put into SRAM by strided DMA
descriptors from DRAM or as literal words, the kernel's argument words, results got from SRAM
into DRAM by scatter descriptors). A loader (:mod:`.loader`) replays the steps from the firmware
directory alone.

How a layer's steps are found (no per-kind code): the layer's runner of :mod:`.execute` runs
twice against a recording stand-in for the PE (no instruction is executed), its input tensors
replaced by *probes*: float32 words that name their element (``id + 1``, then ``-(id + 1 +
2**23)`` in the second run), and every word the PE hands back likewise naming the word read. A
word that is the same in both runs is a literal (an address, a shape, a fill value, a constant
the host derives from attributes); a word that is ``v`` in the first run and ``-(v + 2**23)``
in the second is the named element moved there; anything else (a value the host computes from
the data: an ``abs``, a ``max`` with zero, an offset, a scale all break that relation) means the
layer's operands are not a relayout, and the layer gets no job table (its reason is recorded). The output tensor's
elements name the words read that hold them; words read that are not output (a partial sum
handed on to the next PE of a split reduction) land in the layer's scratch area of DRAM, from
where a later put takes them. The recorded relayout is expanded and compared with the probes'
words before it is returned. 32-bit integer tensors carry the same probes as integers.

A layer that reads or writes a 1-byte tensor (int8 GEMMs, quantize, dequantize, TFLite's integer
kernels) is probed in byte passes (:class:`_Pass`): every byte of its 1-byte tensors and every
byte read back carries a base-256 digit of its id, mapped by a non-linear byte permutation in
the second pass, one pass per further digit; two more passes with the constants' own values tell
the words the host derives from the constants alone (an int8 GEMM's weight column sums), which
become literal bytes. Its placements are byte descriptors (``dram8``: the DMA engine's element
size ``EB`` = 1).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

from . import view
from .errors import PeCodegenError
from .memory_map import REMOTE_BASE, arena_start

__all__ = ["job_tables", "dram_layout", "dram_init", "descriptors", "expand", "expand_all", "ready_signals"]

#: Probe ids: a layer's input elements take [0, _READS), the words it reads back [_READS, _SPAN);
#: probe ``id`` is ``id + 1`` in the first run and ``-(id + 1 + _SPAN)`` in the second (every
#: probe an exact float32 integer: at most 2**24 in magnitude).
_READS = 1 << 22
_SPAN = 1 << 23
_ALIGN = 64
_F32 = np.float32
#: Address lists up to this long are split into runs with Python integers (no array calls).
_SMALL = 64


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def dram_layout(program) -> dict:
    """The DRAM placement of the program's tensors: constants first (the region's initial
    contents), then every other tensor in id order, each ``_ALIGN``-byte aligned.

    Returns ``{"tensors": [{id, dtype, shape, role, offset, bytes}], "init_bytes", "bytes"}``
    (``role``: ``const``, ``input``, ``output`` or ``temp``).
    """
    consts = view.constants(program)
    inputs, outputs = set(view.program_inputs(program)), set(view.program_outputs(program))
    order = sorted(consts) + [t for t in range(len(program.tensors)) if t not in consts]
    tensors, pos, init = [], 0, 0
    for tid in order:
        shape = [int(d) for d in view.tensor_shape(program, tid)]
        dtype = np.dtype(view.tensor_dtype(program, tid))
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        role = ("const" if tid in consts else "input" if tid in inputs else "output" if tid in outputs else "temp")
        tensors.append({"id": int(tid), "dtype": dtype.name, "shape": shape, "role": role, "offset": pos,
                        "bytes": size})
        pos = _align(pos + size)
        if tid in consts:
            init = pos
    return {"tensors": tensors, "init_bytes": init, "bytes": pos}


def dram_init(program, layout: dict) -> bytes:
    """The region's initial DRAM contents: its constants at their offsets (``init_bytes`` long)."""
    consts = view.constants(program)
    out = bytearray(layout["init_bytes"])
    for rec in layout["tensors"]:
        if rec["role"] == "const":
            data = np.ascontiguousarray(consts[rec["id"]], dtype=rec["dtype"]).tobytes()
            out[rec["offset"]:rec["offset"] + len(data)] = data
    return bytes(out)


# -- descriptors ---------------------------------------------------------------------------
def descriptors(addr: np.ndarray) -> list[list]:
    """Strided descriptors (``[offset, [c0..c3], [s0..s3]]``, byte offsets and strides, ``c0``
    innermost: the DMA engine's form, :data:`~.memory_map.DMA_REGS`) whose elements, in order,
    are the byte addresses ``addr``: maximal runs of one stride, then consecutive runs of one
    shape a fixed distance apart merged into one more dimension, up to four."""
    a = np.asarray(addr, dtype=np.int64).reshape(-1)
    n = a.size
    if n == 0:
        return []
    # where each run of equal differences ends (exclusive): the greedy runs below step over
    # whole runs rather than single elements (Python integers: one step per run, no array calls)
    if n <= _SMALL:  # most placements' runs are short: plain integers beat array calls there
        al = a.tolist()
        dl = [y - x for x, y in zip(al, al[1:])]
        ends = [k for k in range(1, n - 1) if dl[k] != dl[k - 1]]
    else:
        d = np.diff(a)
        ends = (np.flatnonzero(d[1:] != d[:-1]) + 1).tolist()
        al, dl = a.tolist(), d.tolist()
    ends.append(n - 1)
    starts, counts, strides = [], [], []
    i, j = 0, 0  # j: the first run end past i
    while i < n:  # rank 1: maximal arithmetic runs, greedily from the first element
        if i + 1 == n:
            starts.append(al[i]), counts.append(1), strides.append(0)
            break
        while ends[j] <= i:
            j += 1
        e = ends[j]
        starts.append(al[i]), counts.append(e - i + 1), strides.append(dl[i])
        i = e + 1
    blocks = [(s, (c,), (st,)) for s, c, st in zip(starts, counts, strides)]
    for _ in range(3):  # ranks 2-4: runs of equal blocks a fixed distance apart
        merged, i, nb = [], 0, len(blocks)
        while i < nb:
            s0, c0, st0 = blocks[i]
            j = i + 1
            if j < nb and blocks[j][1] == c0 and blocks[j][2] == st0:
                delta = blocks[j][0] - s0
                while (j + 1 < nb and blocks[j + 1][1] == c0 and blocks[j + 1][2] == st0
                       and blocks[j + 1][0] - blocks[j][0] == delta):
                    j += 1
                merged.append((s0, c0 + (j - i + 1,), st0 + (delta,)))
                i = j + 1
            else:
                merged.append((s0, c0 + (1,), st0 + (0,)))
                i += 1
        blocks = merged
    return [[s, list(c), list(st)] for s, c, st in blocks]


def expand(desc: list) -> np.ndarray:
    """The byte addresses of one descriptor ``[offset, counts, strides]``, in the engine's order."""
    off, counts, strides = desc
    idx = np.array([off], dtype=np.int64)
    for c, s in zip(counts[::-1], strides[::-1]):  # the outermost first: c0 varies fastest
        idx = np.add.outer(idx, np.arange(c, dtype=np.int64) * s).reshape(-1)
    return idx


def expand_all(descs: list) -> np.ndarray:
    """The byte addresses of descriptors ``[offset, counts, strides]`` one after another, in the
    engine's order (:func:`expand` of each, concatenated; computed for all at once)."""
    if not descs:
        return np.zeros(0, dtype=np.int64)
    if len(descs) == 1:
        return expand(descs[0])
    off = np.array([d[0] for d in descs], dtype=np.int64)
    counts = np.array([d[1] for d in descs], dtype=np.int64)
    strides = np.array([d[2] for d in descs], dtype=np.int64)
    sizes = np.prod(counts, axis=1)
    which = np.repeat(np.arange(len(descs)), sizes)
    # each element's index within its descriptor, split into the engine's i0 (fastest) .. i3
    rest = np.arange(which.size, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    addr = off[which]
    for dim in range(counts.shape[1]):
        c = counts[which, dim]
        addr += (rest % c) * strides[which, dim]
        rest //= c
    return addr


# -- the recording stand-in ----------------------------------------------------------------
class _Unsupported(Exception):
    pass


def _probes(ids: np.ndarray, second: bool) -> np.ndarray:
    """The float32 probe words of ``ids`` in the first or the second run. The second run's map
    (negated, offset by ``_SPAN``) is one that no ``abs``, ``max``, offset or scale commutes with,
    so host arithmetic on a probe never passes for a copy of it."""
    v = np.asarray(ids, dtype=np.float64) + 1
    return (-(v + _SPAN) if second else v).astype(_F32)


def _int_probes(ids: np.ndarray, second: bool) -> np.ndarray:
    """The 32-bit integer probe words of ``ids``: ``id + 1``, then ``-(id + 1 + _SPAN)`` (as
    the float32 probes, in integers: no float32 probe's bits satisfy it, nor the other way)."""
    v = np.asarray(ids, dtype=np.int64) + 1
    return (-(v + _SPAN) if second else v).astype(np.int32)


def _sbox() -> bytes:
    """The AES S-box (FIPS-197 5.1.1: the inverse in GF(2^8), then its affine map): a byte
    permutation without fixed points (``S[x] != x``) and far from affine, so no byte arithmetic
    the host could do (a sign flip ``x ^ 0x80``, a negation, an offset) keeps ``B == S[A]``
    for more than a few values of a digit."""
    exp, log, x = [0] * 255, [0] * 256, 1
    for i in range(255):  # powers of the generator 3
        exp[i], log[x] = x, i
        x ^= (x << 1) ^ (0x11B if x & 0x80 else 0)
    out = []
    for a in range(256):
        b = exp[(255 - log[a]) % 255] if a else 0
        out.append(b ^ (((b << 1) | (b >> 7)) & 0xFF) ^ (((b << 2) | (b >> 6)) & 0xFF)
                   ^ (((b << 3) | (b >> 5)) & 0xFF) ^ (((b << 4) | (b >> 4)) & 0xFF) ^ 0x63)
    return bytes(out)


#: The second pass's map of a byte probe's digit (:func:`_sbox`).
_SBOX = _sbox()
#: The key of the region's initial DRAM bytes in the export's per-image cache (no image's name).
_INIT = "(dram init)"
#: Byte probe ids (1-byte tensors' elements and bytes read back) are below this: three digits.
_BYTE_IDS = 1 << 24


class _Pass(NamedTuple):
    """One probe run of a layer with 1-byte tensors: byte probe ``id`` carries its base-256
    digit ``digit``, mapped by :data:`_SBOX` in the ``second`` pass; ``real``: the program's
    constants hold their own values (the runs that tell words derived from constants alone)."""

    second: bool
    digit: int
    real: bool = False


def _byte_probes(ids: np.ndarray, pas: _Pass) -> np.ndarray:
    d = ((np.asarray(ids, dtype=np.int64) >> (8 * pas.digit)) & 0xFF).astype(np.uint8)
    return np.frombuffer(_SBOX, dtype=np.uint8)[d] if pas.second else d


class _PeLike(Protocol):
    """What the layer runners of :mod:`.execute` use of a PE: the :class:`~.iss.PeMachine`
    that executes, or the recording stand-in that :func:`job_tables` probes them with."""

    arena: int
    stall: float
    blocks: dict
    taken: dict

    def load(self, pe: "int | None" = None) -> None: ...

    def clear_counters(self) -> None: ...

    def write(self, address: int, data: bytes) -> None: ...

    def place_remote(self, data: bytes, key=None) -> int: ...

    def read(self, address: int, nbytes: int) -> bytes: ...

    def run(self, jobs, mac_in_flight: bool = False) -> None: ...


class _Env(dict):
    """The layer's tensors as probes, made on first use (the tensors the layer reads): float32
    and 32-bit integer tensors as word probes (ids from ``next``), and in a byte pass
    (``pas`` set) 1-byte tensors as byte probes (ids from the trace's byte counter); with
    ``pas.real`` the program's constants hold their own values (their ids still allocated)."""

    def __init__(self, program, second: bool, trace: "_Trace | None" = None, pas: "_Pass | None" = None):
        super().__init__()
        self.p, self.second, self.next, self.ranges = program, second, 0, {}
        self.t, self.pas, self.branges = trace, pas, {}
        self.consts = view.constants(program) if pas is not None and pas.real else {}

    def __contains__(self, tid) -> bool:
        return True

    def __getitem__(self, tid):
        if not dict.__contains__(self, tid):
            shape = view.tensor_shape(self.p, tid)
            dtype = np.dtype(view.tensor_dtype(self.p, tid))
            size = int(np.prod(shape, dtype=np.int64))
            if dtype.itemsize == 1 and self.pas is not None and dtype.kind in "iu":
                lo = self.t.bnext
                if lo + size > _BYTE_IDS:
                    raise _Unsupported(f"reads and writes back more than {_BYTE_IDS} bytes")
                self.t.bnext += size
                self.branges[tid] = (lo, size)
                value = _byte_probes(np.arange(lo, lo + size), self.pas).view(dtype).reshape(shape)
            elif dtype == _F32 or (dtype.itemsize == 4 and dtype.kind in "iu"):
                if self.next + size > _READS:
                    raise _Unsupported(f"reads more than {_READS} elements")
                self.ranges[tid] = (self.next, size)
                ids = np.arange(self.next, self.next + size)
                value = (_probes(ids, self.second) if dtype == _F32 else
                         _int_probes(ids, self.second).astype(dtype)).reshape(shape)
                self.next += size
            else:
                raise _Unsupported(f"reads tensor {tid} of dtype {dtype.name} (job tables place float32 words, "
                                   "32-bit integer words and 8-bit integer bytes)")
            if tid in self.consts:  # a pass with the constants' own values: the ids stay allocated
                value = np.array(self.consts[tid], dtype=dtype).reshape(shape)
            dict.__setitem__(self, tid, value)
        return dict.__getitem__(self, tid)

    def get(self, tid, default=None):
        return self[tid]


class _Recorder(_PeLike):
    """One role's PE as the runners see it: every placement, run and read recorded in order."""

    def __init__(self, trace: "_Trace", name: str, arena: int, arch):
        self.t, self.name, self.arena, self.arch = trace, name, arena, arch
        self.stall, self.pe = 0.0, 0
        self.blocks, self.taken = {}, {}  # nothing executes: no cycles to count

    def load(self, pe=None):
        if pe is not None:
            self.pe = pe
        self.t.ops.append(("load", self.pe))

    def clear_counters(self):
        pass

    def write(self, address: int, data: bytes):
        self.t.ops.append(("put", int(address), bytes(data)))

    def place_remote(self, data: bytes, key=None) -> int:
        self.t.ops.append(("remote", bytes(data)))
        return REMOTE_BASE

    def read(self, address: int, nbytes: int) -> bytes:
        if self.t.pas is not None:  # a byte pass: every byte read back named
            r0 = self.t.bnext
            if r0 + nbytes > _BYTE_IDS:
                raise _Unsupported(f"reads and writes back more than {_BYTE_IDS} bytes")
            self.t.bnext += nbytes
            self.t.breads.append((r0, nbytes))
            self.t.ops.append(("get", int(address), r0, nbytes))
            return _byte_probes(np.arange(r0, r0 + nbytes), self.t.pas).tobytes()
        if nbytes % 4:
            raise _Unsupported(f"reads {nbytes} bytes back (not whole words)")
        n = nbytes // 4
        r0 = self.t.reads
        if r0 + n > _SPAN - _READS:
            raise _Unsupported(f"reads more than {_SPAN - _READS} words back")
        self.t.reads += n
        self.t.ops.append(("get", int(address), r0, n))
        return _probes(np.arange(_READS + r0, _READS + r0 + n), self.t.second).tobytes()

    def read_status(self, address: int, nbytes: int) -> bytes:
        """A kernel's status words the host checks (:func:`.execute._read_status`): a ``check``
        step; the runner sees the status of a run that refused nothing (zeros)."""
        self.t.ops.append(("check", int(address), int(nbytes)))
        return bytes(nbytes)

    def run(self, jobs, mac_in_flight: bool = False):
        self.t.ops.append(("run", [[int(a) & 0xFFFFFFFF for a in job] for job in jobs], bool(mac_in_flight)))


class _Trace:
    def __init__(self, second: bool, pas: "_Pass | None" = None):
        self.second, self.ops, self.reads = second, [], 0
        self.pas, self.bnext, self.breads = pas, 0, []


def _probe(program, images, index: int, table, second: bool, arenas: dict, pas: "_Pass | None" = None):
    from .execute import _RUNNERS, _Run, program_role_kind
    trace = _Trace(second, pas)
    env = _Env(program, second, trace, pas)
    name = images.layers[index]
    if name not in arenas:  # one ELF parse per image, not per probe run
        from .iss import image_symbols
        arenas[name] = arena_start(image_symbols(images.images[name].elf)["_end"])
    arena = arenas[name]
    rec = _Recorder(trace, name, arena, view.arch_of(program))

    class _Replay(_Run):
        def machine(self, i, pe) -> _PeLike:
            rec.load(pe)
            return rec

    try:
        out = _RUNNERS[program_role_kind(images, index)](_Replay(program, images, None), index, env, table)
    except PeCodegenError:
        raise
    except (ValueError, IndexError, ArithmeticError) as why:
        # a runner that checks its data (labels, indices) refuses the probe words: the layer's
        # host work reads values, it is not a relayout
        raise _Unsupported(f"the host's work reads the data ({why})") from why
    return trace, env, out


def _decode(a: bytes, b: bytes, where: str, int_ids: "np.ndarray | None" = None) -> np.ndarray:
    """Per word of a placement: -1 for a literal, else the probe id it carries (``int_ids``:
    per input id, whether it is a 32-bit integer tensor's, whose words carry integer probes)."""
    if len(a) != len(b):
        raise _Unsupported(f"{where}: the two runs place different sizes")
    if len(a) % 4:
        if a != b:
            raise _Unsupported(f"{where}: {len(a)} bytes of data not in whole words")
        return None
    wa, wb = np.frombuffer(a, "<u4"), np.frombuffer(b, "<u4")
    ids = np.full(wa.size, -1, dtype=np.int64)
    moved = wa != wb
    fa = wa[moved].view(_F32).astype(np.float64)
    fb = wb[moved].view(_F32).astype(np.float64)
    ok = (fb == -(fa + _SPAN)) & (fa >= 1) & (fa <= _SPAN) & (fa == np.floor(fa))
    got = fa.astype(np.int64) - 1
    has_int = int_ids is not None and bool(np.any(int_ids))
    if has_int:
        ia = wa[moved].view(np.int32).astype(np.int64)
        ib = wb[moved].view(np.int32).astype(np.int64)
        iok = ~ok & (ib == -(ia + _SPAN)) & (ia >= 1) & (ia <= _SPAN)
        got[iok] = ia[iok] - 1
        # a float32 probe names a float32 element, an integer probe an integer one
        inside = got < int_ids.size
        named_int = np.zeros(got.size, dtype=bool)
        named_int[inside] = int_ids[got[inside]]
        ok = (ok & ~named_int) | (iok & named_int)
    if not ok.all():
        raise _Unsupported(f"{where}: a word the host computes from the data (not a relayout)")
    ids[moved] = got
    return ids


def _parts(ids: np.ndarray, data: bytes, addr: np.ndarray, memo: dict) -> list:
    """A placement's parts in order: ``["dram", offset, counts, strides]`` descriptors of the
    moved words (``addr``: each word's DRAM byte address, where ``ids`` names an element),
    ``["fill", word, n]`` for a run of one literal word, ``["bytes", hex]`` else."""
    words = np.frombuffer(data, "<u4")
    lit = ids < 0
    cuts = [0, *(np.flatnonzero(lit[1:] != lit[:-1]) + 1).tolist(), ids.size]
    first_lit = bool(lit[0]) if ids.size else False
    out = []
    for r, (i, j) in enumerate(zip(cuts, cuts[1:])):  # alternating runs of literal and moved words
        if first_lit == (r % 2 == 0):
            run = words[i:j]
            if np.all(run == run[0]):
                out.append(["fill", int(run[0]), j - i])
            else:
                out.append(["bytes", run.tobytes().hex()])
        else:
            out += [["dram", *d] for d in _shifted_descriptors(addr[i:j], memo)]
    return out


def _placement_parts(ids: np.ndarray, data: bytes, addr: np.ndarray, moved: np.ndarray, memo: dict) -> list:
    """:func:`_parts` through ``memo``: a placement whose literal words are another's and whose
    moved words' addresses are that one's moved by a constant has that one's parts with their
    descriptors moved by it (each run's descriptors are its addresses' shifted), so the
    windows and panels a layer places again at other addresses are split into runs once."""
    lit = ids < 0
    if not np.any(moved):
        return _parts(ids, data, addr, memo)
    words = np.frombuffer(data, "<u4")
    base = int(addr[np.argmax(moved)])
    key = ("placement", lit.tobytes(), words[lit].tobytes(), (addr[moved] - base).tobytes())
    rel = memo.get(key)
    if rel is None:
        rel = memo[key] = [[p[0], p[1] - base, *p[2:]] if p[0] == "dram" else p
                           for p in _parts(ids, data, addr, memo)]
    return [[p[0], p[1] + base, list(p[2]), list(p[3])] if p[0] == "dram" else list(p) for p in rel]


def _shifted_descriptors(addr: np.ndarray, memo: dict) -> list:
    """:func:`descriptors` of ``addr``, through ``memo``: a list's descriptors moved by a
    constant are its descriptors with their offsets moved by it, so a layout repeated at other
    addresses (each tile's window rows, each panel) is split into runs once."""
    base = int(addr[0])
    offsets = addr - base
    key = offsets.tobytes()
    rel = memo.get(key)
    if rel is None:
        rel = descriptors(offsets)
        # the descriptors must give back exactly the addresses (checked once per pattern: a
        # shifted pattern's descriptors are its own, shifted)
        if not np.array_equal(expand_all(rel), offsets):
            raise AssertionError("descriptors do not reproduce the addresses they stand for")
        memo[key] = rel
    return [[base + off, list(c), list(st)] for off, c, st in rel]


def _layer_jobs(program, images, index: int, table, layout: dict, scratch0: int, job0: int,
                writer: _Writers, arenas: dict) -> tuple[list, int]:
    """The jobs of layer ``index`` (ids from ``job0``) and the scratch bytes it uses."""
    if _byte_layer(program, index):
        return _byte_layer_jobs(program, images, index, table, layout, scratch0, job0, writer, arenas)
    memo: dict = {}  # the layer's address lists relative to their first -> descriptors (_shifted_descriptors)
    ta, env_a, out_a = _probe(program, images, index, table, False, arenas)
    tb, env_b, out_b = _probe(program, images, index, table, True, arenas)
    if len(ta.ops) != len(tb.ops) or env_a.ranges != env_b.ranges:
        raise _Unsupported("the host's work depends on the data")
    offsets = {rec["id"]: rec["offset"] for rec in layout["tensors"]}
    out_id = view.layer_output(program, index)
    if np.dtype(view.tensor_dtype(program, out_id)).itemsize != 4:
        raise _Unsupported(f"writes tensor {out_id} of dtype {view.tensor_dtype(program, out_id)} "
                           "(job tables place float32 words, 32-bit integer words and 8-bit integer bytes)")
    int_ids = _int_ids(program, env_a)
    # where each word read lands: the output element that holds it, else a scratch word
    got = _decode(np.ascontiguousarray(out_a).tobytes(), np.ascontiguousarray(out_b).tobytes(), "output")
    if got is None or np.any(got < _READS):
        raise _Unsupported("output elements not read back from a PE")
    dest = np.full(ta.reads, -1, dtype=np.int64)
    dest[got - _READS] = offsets[out_id] + 4 * np.arange(got.size, dtype=np.int64)
    if np.unique(got).size != got.size:
        raise _Unsupported("one word read into two output elements")
    loose = np.flatnonzero(dest < 0)
    dest[loose] = scratch0 + 4 * np.arange(loose.size, dtype=np.int64)
    # per DRAM byte, the job that last wrote it (the layer's writes undone if it is not a relayout)
    wrote = writer.grow(scratch0 + 4 * loose.size)
    tensor_at = sorted((lo, lo + n, tid) for tid, (lo, n) in env_a.ranges.items())

    # probe id -> DRAM byte address: the tensors' ranges start at ``starts`` (ascending)
    starts = np.array([lo for lo, _, _ in tensor_at] or [0], dtype=np.int64)
    bases = np.array([offsets[tid] - 4 * lo for lo, _, tid in tensor_at] or [0], dtype=np.int64)

    def address_of(ids: np.ndarray) -> np.ndarray:
        rd = ids >= _READS
        addr = bases[np.searchsorted(starts, ids, side="right") - 1] + 4 * ids
        addr[rd] = dest[ids[rd] - _READS]
        return addr

    jobs, job = [], None
    for k, (a, b) in enumerate(zip(ta.ops, tb.ops)):
        if a[0] != b[0]:
            raise _Unsupported("the host's work depends on the data")
        kind = a[0]
        if kind == "load":
            if a != b:
                raise _Unsupported("the PEs depend on the data")
            job = {"id": job0 + len(jobs), "layer": index, "pe": int(a[1]), "image": images.layers[index],
                   "after": set(), "steps": []}
            jobs.append(job)
            continue
        if job is None:
            raise _Unsupported(f"a placement before any image load ({kind})")
        if kind in ("put", "remote"):
            ids = _decode(a[-1], b[-1], f"placement {k}", int_ids)
            if kind == "put" and a[1] != b[1]:
                raise _Unsupported("a placement's address depends on the data")
            if ids is None:
                parts = [["bytes", a[-1].hex()]]
            else:
                moved = ids >= 0
                addr = np.zeros(ids.size, dtype=np.int64)
                addr[moved] = address_of(ids[moved])
                parts = _placement_parts(ids, a[-1], addr, moved, memo)
                # the jobs whose results this placement reads
                job["after"].update(_distinct(wrote[addr[moved]]))  # words: written whole
            job["steps"].append(["put", a[1], parts] if kind == "put" else ["remote", parts])
        elif kind == "run":
            if a != b:
                raise _Unsupported("a job's arguments depend on the data")
            job["steps"].append(["run", a[1], a[2]])
        elif kind == "check":
            job["steps"].append(["check", a[1]])
        else:  # get
            if a != b:
                raise _Unsupported("a read depends on the data")
            _, addr, r0, n = a
            for j in range(4):
                writer.set(dest[r0:r0 + n] + j, job["id"])
            job["steps"].append(["get", addr, [["dram", *d] for d in _shifted_descriptors(dest[r0:r0 + n], memo)]])
    for job in jobs:
        job["after"] = _ranges(sorted(job["after"] - {job["id"], -1}))
    return jobs, 4 * loose.size


class _Writers:
    """Per DRAM byte, the job that last wrote it (-1: none), with the writes of the layer being
    recorded undone by :meth:`rollback` (a layer left to the host writes nothing)."""

    def __init__(self, size: int):
        self.arr, self.undo = np.full(size, -1, dtype=np.int64), []

    def grow(self, size: int) -> np.ndarray:
        """The array, at least ``size`` bytes long (new bytes: no writer)."""
        if size > self.arr.size:
            self.undo.append(self.arr.size)  # an int: the length to cut back to
            self.arr = np.concatenate([self.arr, np.full(size - self.arr.size, -1, dtype=np.int64)])
        return self.arr

    def set(self, idx: np.ndarray, job: int) -> None:
        self.undo.append((idx, self.arr[idx].copy()))
        self.arr[idx] = job

    def commit(self) -> None:
        self.undo = []

    def rollback(self) -> None:
        for entry in reversed(self.undo):
            if isinstance(entry, int):
                self.arr = self.arr[:entry].copy()
            else:
                self.arr[entry[0]] = entry[1]
        self.undo = []


def _int_ids(program, env: _Env) -> np.ndarray:
    """Per word probe id of ``env``, whether its tensor is a 32-bit integer one."""
    out = np.zeros(env.next, dtype=bool)
    for tid, (lo, n) in env.ranges.items():
        out[lo:lo + n] = np.dtype(view.tensor_dtype(program, tid)).kind in "iu"
    return out


def _byte_layer(program, index: int) -> bool:
    """Whether layer ``index`` reads or writes a 1-byte tensor (its steps are found by byte passes)."""
    layer = program.layers[index]
    return any(np.dtype(view.tensor_dtype(program, t)).itemsize == 1
               for t in (*layer.inputs, *layer.consts.values(), layer.output))


class _Bytes:
    """A placement of a layer with 1-byte tensors as its passes saw it: per byte, ``lit``
    (the same in every pass), ``addr`` (the DRAM byte address of the element it carries, -1
    if none), ``bid`` (the byte probe id it carries, -1 if none) and the passes' bytes ``v``."""

    def __init__(self, seqs: list, where: str, words, nb: int):
        if any(len(x) != len(seqs[0]) for x in seqs):
            raise _Unsupported(f"{where}: the runs place different sizes")
        v = np.stack([np.frombuffer(x, dtype=np.uint8) for x in seqs])
        n = v.shape[1]
        self.v, self.lit = v, np.all(v == v[0], axis=0)
        self.addr = np.full(n, -1, dtype=np.int64)
        self.bid = np.full(n, -1, dtype=np.int64)
        nw = n // 4
        if nw and words is not None:  # words of float32 and 32-bit integer tensors, from the start on
            w = np.ascontiguousarray(v[:, :4 * nw]).view("<u4")
            ids = _word_ids(w, words[1])
            hit = np.flatnonzero(ids >= 0)
            if hit.size:
                base = words[0](ids[hit])
                for j in range(4):  # a word's bytes, even those its two probes share, are moved
                    self.addr[4 * hit + j] = base + j
                    self.lit[4 * hit + j] = False
        # bytes of 1-byte tensors and bytes read back: B == S[A], the id's digits in the passes
        sbox = np.frombuffer(_SBOX, dtype=np.uint8)
        cand = ~self.lit & (self.addr < 0) & (v[1] == sbox[v[0]])
        bid = v[0].astype(np.int64)
        for k in range(2, v.shape[0]):
            bid |= v[k].astype(np.int64) << (8 * (k - 1))
        cand &= bid < nb
        self.bid[cand] = bid[cand]


def _word_ids(w: np.ndarray, int_ids: np.ndarray) -> np.ndarray:
    """Per word of the passes' words ``w`` ``[passes, n]``: the word probe id it carries (the
    first two passes' relation, the same word in the others, the probe's kind its tensor's), or -1."""
    ids = np.full(w.shape[1], -1, dtype=np.int64)
    # a probe word differs between the first two passes, and the second's top byte is a
    # negated probe's: 0xCB (float32 in -[2**23, 2**24]) or 0xFF (an integer there)
    top = w[1] >> 24
    at = np.flatnonzero((w[0] != w[1]) & ((top == 0xCB) | (top == 0xFF)))
    if at.size == 0:
        return ids
    w = w[:, at]
    wa, wb = w[0], w[1]
    same = (w[2:] == wa).all(axis=0) if w.shape[0] > 2 else True
    with np.errstate(invalid="ignore"):  # any bits: signalling NaNs, infinities among them
        fa, fb = wa.view(_F32).astype(np.float64), wb.view(_F32).astype(np.float64)
        fok = same & (fb == -(fa + _SPAN)) & (fa >= 1) & (fa <= _SPAN) & (fa == np.floor(fa))
        fid = np.where(fok, fa, 0).astype(np.int64) - 1
    ia, ib = wa.view(np.int32).astype(np.int64), wb.view(np.int32).astype(np.int64)
    iok = same & ~fok & (ib == -(ia + _SPAN)) & (ia >= 1) & (ia <= _SPAN)
    got = np.where(fok, fid, np.where(iok, ia - 1, -1))
    inside = (got >= 0) & (got < int_ids.size)
    named_int = np.zeros(got.size, dtype=bool)
    named_int[inside] = int_ids[got[inside]]
    ok = inside & ((fok & ~named_int) | (iok & named_int))
    ids[at[ok]] = got[ok]
    return ids


def _byte_parts(lit: np.ndarray, values: np.ndarray, addr: np.ndarray, memo: dict) -> list:
    """A byte placement's parts in order: ``["dram8", offset, counts, strides]`` descriptors of
    the moved bytes (at ``addr``), ``["fill", word, n]`` for a whole-word run of one literal word,
    ``["bytes", hex]`` for other literal runs."""
    n = lit.size
    cuts = [0, *(np.flatnonzero(lit[1:] != lit[:-1]) + 1).tolist(), n]
    out = []
    for i, j in zip(cuts, cuts[1:]):
        if i == j:
            continue
        if lit[i]:
            run = values[i:j].tobytes()
            w = np.frombuffer(run, dtype="<u4") if (j - i) % 4 == 0 else None
            if w is not None and np.all(w == w[0]):
                out.append(["fill", int(w[0]), w.size])
            else:
                out.append(["bytes", run.hex()])
        else:
            out += [["dram8", *d] for d in _shifted_descriptors(addr[i:j], memo)]
    return out


def _placement_byte_parts(lit: np.ndarray, values: np.ndarray, addr: np.ndarray, memo: dict) -> list:
    """:func:`_byte_parts` through ``memo`` (as :func:`_placement_parts`: a placement another's
    moved by a constant has that one's parts, their descriptors moved by it)."""
    moved = ~lit
    if not moved.any():
        return _byte_parts(lit, values, addr, memo)
    base = int(addr[np.argmax(moved)])
    key = ("bytes", lit.tobytes(), values[lit].tobytes(), (addr[moved] - base).tobytes())
    rel = memo.get(key)
    if rel is None:
        rel = memo[key] = [[p[0], p[1] - base, *p[2:]] if p[0] == "dram8" else p
                           for p in _byte_parts(lit, values, addr, memo)]
    return [[p[0], p[1] + base, list(p[2]), list(p[3])] if p[0] == "dram8" else list(p) for p in rel]


def _byte_layer_jobs(program, images, index: int, table, layout: dict, scratch0: int, job0: int,
                     writer: _Writers, arenas: dict) -> tuple[list, int]:
    """:func:`_layer_jobs` of a layer with 1-byte tensors: byte passes (:class:`_Pass`) name every
    byte of those tensors and every byte read back; words the host derives from the constants
    alone (an int8 GEMM's weight column sums) become literal bytes, told by two more passes with
    the constants' own values."""
    memo: dict = {}

    def probe(pas):
        return _probe(program, images, index, table, pas.second, arenas, pas)

    runs = [probe(_Pass(False, 0)), probe(_Pass(True, 0))]
    nb = runs[0][0].bnext
    digits = max(1, -(-max(nb - 1, 1).bit_length() // 8))
    runs += [probe(_Pass(False, k)) for k in range(1, digits)]
    traces, envs, outs = zip(*runs)
    t0, e0 = traces[0], envs[0]

    def same_shape(ts, es):
        return all(len(t.ops) == len(t0.ops) and t.bnext == nb and t.breads == t0.breads and e.ranges == e0.ranges
                   and e.branges == e0.branges and [o[0] for o in t.ops] == [o[0] for o in t0.ops]
                   for t, e in zip(ts, es))

    if not same_shape(traces, envs):
        raise _Unsupported("the host's work depends on the data")
    offsets = {rec["id"]: rec["offset"] for rec in layout["tensors"]}
    out_id = view.layer_output(program, index)
    baddr = np.full(nb, -1, dtype=np.int64)  # byte probe id -> its DRAM byte address
    for tid, (lo, n) in e0.branges.items():
        baddr[lo:lo + n] = offsets[tid] + np.arange(n, dtype=np.int64)
    is_read = np.zeros(nb, dtype=bool)
    for r0, n in t0.breads:
        is_read[r0:r0 + n] = True
    tensor_at = sorted((lo, tid) for tid, (lo, _) in e0.ranges.items())
    starts = np.array([lo for lo, _ in tensor_at] or [0], dtype=np.int64)
    bases = np.array([offsets[tid] - 4 * lo for lo, tid in tensor_at] or [0], dtype=np.int64)

    def word_address(ids: np.ndarray) -> np.ndarray:
        return bases[np.searchsorted(starts, ids, side="right") - 1] + 4 * ids

    words = (word_address, _int_ids(program, e0)) if e0.next else None
    # the output: every byte one read back, each read byte at most once
    out = _Bytes([np.ascontiguousarray(o).tobytes() for o in outs], "output", None, nb)
    if np.any(out.bid < 0) or not np.all(is_read[out.bid]):
        raise _Unsupported("output elements not read back from a PE")
    if np.unique(out.bid).size != out.bid.size:
        raise _Unsupported("one byte read into two output elements")
    baddr[out.bid] = offsets[out_id] + np.arange(out.bid.size, dtype=np.int64)
    loose = np.flatnonzero(is_read & (baddr < 0))
    baddr[loose] = scratch0 + np.arange(loose.size, dtype=np.int64)

    placed = {}  # op index -> its _Bytes
    for k, op in enumerate(t0.ops):
        if op[0] in ("put", "remote"):
            b = _Bytes([t.ops[k][-1] for t in traces], f"placement {k}", words, nb)
            hit = b.bid >= 0
            b.addr[hit] = baddr[b.bid[hit]]
            placed[k] = b
    literal = {}  # op index -> the values of the bytes derived from the constants alone
    # two more passes with the constants' own values: what the host derives from them alone
    # (column sums, a flag for zero points that are all 0) is what it computes at export
    real = [probe(_Pass(second, 0, real=True)) for second in (False, True)]
    if not same_shape([r[0] for r in real], [r[1] for r in real]):
        raise _Unsupported("the host's work depends on the data")
    c1, c2 = (r[0].ops for r in real)
    if _INIT not in arenas:  # the constants' bytes, once per export
        arenas[_INIT] = np.frombuffer(dram_init(program, layout), dtype=np.uint8)
    init = arenas[_INIT]
    for k, b in placed.items():
        x1, x2 = (np.frombuffer(c[k][-1], dtype=np.uint8) for c in (c1, c2))
        if x1.size != b.lit.size or x2.size != b.lit.size:
            raise _Unsupported(f"placement {k}: the runs place different sizes")
        # what the passes with real constants must hold where the decoding is right: a
        # constant element's own byte, an input's or a read's probe byte, the literal
        moved = b.addr >= 0
        in_init = moved & (b.addr < init.size)
        want1, want2 = b.v[0].copy(), b.v[1].copy()
        want1[in_init] = want2[in_init] = init[b.addr[in_init]]
        bad = ~(b.lit | moved) | (x1 != want1) | (x2 != want2)
        if np.any(bad & (x1 != x2)):
            raise _Unsupported(f"placement {k}: a word the host computes from the data (not a relayout)")
        b.lit = b.lit | bad  # words derived from the constants alone: literal, their values
        b.addr[bad] = -1
        literal[k] = np.where(bad, x1, b.v[0])
    for k, op in enumerate(t0.ops):
        if op[0] == "run":  # the arguments the constants' own values give
            if c1[k] != c2[k]:
                raise _Unsupported("a job's arguments depend on the data")
            for t in traces:
                t.ops[k] = c1[k]
    wrote = writer.grow(scratch0 + loose.size)
    jobs, job = [], None
    for k, op in enumerate(t0.ops):
        kind = op[0]
        if kind == "load":
            if any(t.ops[k] != op for t in traces):
                raise _Unsupported("the PEs depend on the data")
            job = {"id": job0 + len(jobs), "layer": index, "pe": int(op[1]), "image": images.layers[index],
                   "after": set(), "steps": []}
            jobs.append(job)
            continue
        if job is None:
            raise _Unsupported(f"a placement before any image load ({kind})")
        if kind in ("put", "remote"):
            if kind == "put" and any(t.ops[k][1] != op[1] for t in traces):
                raise _Unsupported("a placement's address depends on the data")
            b = placed[k]
            if np.any(~b.lit & (b.addr < 0)):
                raise _Unsupported(f"placement {k}: a word the host computes from the data (not a relayout)")
            values = literal.get(k, b.v[0])
            parts = _placement_byte_parts(b.lit, values, b.addr, memo)
            moved = b.addr[~b.lit]
            job["after"].update(_distinct(wrote[moved]))
            job["steps"].append(["put", op[1], parts] if kind == "put" else ["remote", parts])
        elif kind == "run":
            if any(t.ops[k] != op for t in traces):
                raise _Unsupported("a job's arguments depend on the data")
            job["steps"].append(["run", op[1], op[2]])
        elif kind == "check":
            job["steps"].append(["check", op[1]])
        else:  # get
            if any(t.ops[k] != op for t in traces):
                raise _Unsupported("a read depends on the data")
            _, address, r0, n = op
            dest = baddr[r0:r0 + n]
            writer.set(dest, job["id"])
            job["steps"].append(["get", address, [["dram8", *d] for d in _shifted_descriptors(dest, memo)]])
    for job in jobs:
        job["after"] = _ranges(sorted(job["after"] - {job["id"], -1}))
    return jobs, int(loose.size)


def _distinct(x: np.ndarray) -> list:
    """The distinct values of the job ids ``x`` (-1 included), ascending (``np.unique``'s, by
    counting where the ids span a short range: a placement reads a few consecutive jobs)."""
    if x.size == 0:
        return []
    lo, hi = int(x.min()), int(x.max())
    if hi - lo > 4 * x.size + 1024:
        return np.unique(x).tolist()
    return (np.flatnonzero(np.bincount(x - lo)) + lo).tolist()


def _ranges(ids: list) -> list:
    """Ascending job ids as inclusive ranges ``[[first, last], ...]`` (a layer's jobs are
    consecutive, so a job waiting for a whole layer names one range)."""
    out = []
    for i in ids:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def job_tables(program, images) -> dict:
    """The program's DRAM layout and every layer's jobs (see the module's docstring).

    Returns ``{"dram": layout (with "scratch": [offset, bytes]), "jobs": [...], "host": [{layer,
    reason}]}``: the jobs in execution order (each ``{id, layer, pe, image, after, steps}``);
    ``host`` the layers whose host-side work is not a relayout (the loader cannot run those).
    """
    layout = dram_layout(program)
    tables = view.placed_tiles(program)
    scratch0 = layout["bytes"]
    jobs, host, pos = [], [], scratch0
    writer = _Writers(scratch0)  # per DRAM byte, the last job that wrote it
    arenas: dict = {}  # image -> its arena's first address; _INIT -> the initial DRAM bytes
    for index in range(view.layer_count(program)):
        try:
            layer_jobs, used = _layer_jobs(program, images, index, tables[index], layout, pos, len(jobs), writer,
                                           arenas)
        except _Unsupported as why:
            writer.rollback()
            host.append({"layer": index, "reason": str(why)})
            continue
        writer.commit()
        jobs += layer_jobs
        pos = _align(pos + used)
    layout["scratch"] = [scratch0, pos - scratch0]
    layout["bytes"] = pos
    return {"dram": layout, "jobs": jobs, "host": host}


def ready_signals(jobs: list, on_pe: dict, sends: dict) -> tuple[dict, dict]:
    """Per job, the PEs its ready packet goes to, and the ``(slot PE, count)`` pairs its PE
    waits for (count: that many packets from that PE, its data packets and ready packets
    counted over its jobs in order)."""
    consumers: dict = {}
    for job in jobs:
        for a, b in job["after"]:
            for i in range(a, b + 1):
                if on_pe[i] != job["pe"]:
                    consumers.setdefault(i, set()).add(job["pe"])
    notify = {j["id"]: sorted(consumers.get(j["id"], ())) for j in jobs}
    sent: dict = {}  # (producer PE, consumer PE) -> packets so far
    index: dict = {}  # (job, consumer PE) -> the count once its last packet is in
    for job in jobs:  # ids ascend in each PE's order, so counting in id order counts in PE order
        for q, _, _ in sends.get(job["id"], ()):
            sent[(job["pe"], q)] = sent.get((job["pe"], q), 0) + 1
        for q in notify[job["id"]]:
            key = (job["pe"], q)
            sent[key] = sent.get(key, 0) + 1
            index[(job["id"], q)] = sent[key]
    need: dict = {}
    for job in jobs:
        pairs: dict = {}
        for a, b in job["after"]:
            for i in range(a, b + 1):
                p = on_pe[i]
                if p != job["pe"]:
                    pairs[p] = max(pairs.get(p, 0), index[(i, job["pe"])])
        need[job["id"]] = sorted(pairs.items())
    return notify, need
