"""The serialized *spinn program*: the one document handed from the compiler to the runtime.

Binary layout (little-endian), version 5 (version 4's, with a faster digest and row tiles of two
numbers, rows and elements of a row; version 4 -- the
mapping as data: per-layer tile shapes and PE ranges instead of version 3's tile list and
schedule; int8 layers as in version 3, see :mod:`.quant` -- is still read)::

    offset  size  field
    0       8     magic  b"SPINNPRG"
    8       4     u32 format version (PROGRAM_VERSION)
    12      4     u32 reserved (0)
    16      8     u64 header length H
    24      H     header: UTF-8 JSON, keys sorted, no whitespace (see Program.to_json)
    24+H    pad   zero bytes up to a multiple of 64
    ...     8     u64 constant blob length B
    ...     B     constant blob: every constant tensor, C-contiguous, each 64-byte aligned
    (version 6 only: zero bytes up to a multiple of 64, then the native section, whose own
    framing gives its length: the program's execution plan for the C++ module, see
    :mod:`.native_section`)
    ...     32    checksum of all preceding bytes (also the program's name for the runtime):
                  versions 5 and 6: SHA-256 over the XXH3-128 digests of consecutive 32 MiB segments
                  and the byte count (:func:`program_digest`); version 4: BLAKE2b-256

Header JSON fields (all lists in execution order; all ids are indices):

- ``version``, ``symbol`` (Relax global symbol the program implements), ``arch`` (``SpinnArch.to_dict()``; a
  :class:`~tvm_spinn.target.arch.SpinnArch` in memory)
- ``tensors``: ``{name, shape, dtype, role, offset}``; role is ``input`` | ``output`` | ``const``
  | ``temp``; ``offset`` is the byte offset of a ``const`` in the blob (else -1)
- ``inputs`` / ``outputs``: tensor ids in DPS argument order
- ``layers``: ``{name, kind, inputs, consts, output, attrs, gemm, flops, mode}``; ``kind`` is one of
  :data:`LAYER_KINDS`; ``consts`` maps a role (``weight``, ``bias``, ``gamma``, ``beta``, ``rhs``...)
  to a tensor id; ``gemm`` is ``[M, N, K]`` for MAC-path layers; ``mode`` is ``fp32`` (M4F) or
  ``int8`` (MAC array)
- ``mapping``: mode, options, chips per layer, residency decisions, and per layer
  (``mapping.layers[i]``) the tile shape and PE range ``{"tile": [...], "pes": [first, count]}``
  and, optionally, ``"rotate"`` (the PE of the range placement starts from, see
  :func:`tvm_spinn.mapping.placement.place_tiles`)
  (:mod:`.tiles`): every tile, its region and its reduction chunks follow from those; the
  schedule (transfers, order, barriers) is derived by the timing model, never stored, so the
  header is O(layers); over several chips ``mapping.system``, the shard plan; over pipeline
  stages ``mapping.pipeline`` (each stage's layers, chips and one-chip mapping, the sends at
  each cut; :func:`_pipeline_from_json` checks it) and ``timing.pipeline`` (period, latency). A
  :class:`~.records.ProgramMapping` in memory (:func:`mapping_to_json`,
  :func:`mapping_from_json`; ``{}`` before mapping); keys at their defaults (``scheduler``
  static, ``rotate`` 0, no ``system``, no ``replicated`` layers) are left out; ``mapping.options``
  is the :class:`~tvm_spinn.options.MappingOptions` the program was mapped with
  (:func:`options_to_json`, :func:`options_from_json`)
- ``memory``: SRAM plan: per-PE peak bytes, resident weight bytes, checked non-overlapping
  address ranges of the busiest PE (each ``[start, end, first layer, last layer, what]``), a
  :class:`~.records.MemorySummary` in memory (:func:`memory_to_json`, :func:`memory_from_json`;
  ``{}`` before mapping)
- ``timing``: the timing model's result at compile time (see ``tvm_spinn.timing``), a
  :class:`~.records.TimingSummary` in memory (:func:`timing_to_json`, :func:`timing_from_json`;
  ``{}`` before mapping)

Reading is validation: :meth:`Program.from_bytes` checks the framing, then the header against
:mod:`.validate` (every key, type, tensor id, shape, dtype, constant range, per-layer operands,
per-layer tile shapes and PE ranges) before building anything, and raises
:class:`ProgramError` ``"<field>: <defect>"``. The ``spinn`` runtime module runs it when it is
created or loaded (``tvm.runtime.load_module``), so a defective program fails at load.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from typing import TYPE_CHECKING
from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property

import numpy as np
import xxhash

if TYPE_CHECKING:
    from ..target.arch import SpinnArch

from ..options import MappingOptions
from .model import ConstantMap, FrozenMap, Layer, ProgramError, TensorDesc, Tile
from .native_section import section_status
from .ops import layer_kinds
from .records import (
    AddressRange, CollectiveSummary, LayerMapping, LayerTimingSummary, MemorySummary, PlanCandidate, PlanCollective,
    PipelineMapping, PipelineStage, PipelineTimingSummary, ProgramMapping, SystemMapping, SystemTimingSummary,
    TimingSummary,
)

__all__ = [
    "PROGRAM_MAGIC", "PROGRAM_VERSION", "CHECKSUM_BYTES", "LAYER_KINDS", "MAX_HEADER_BYTES", "ProgramError", "TensorDesc", "Layer",
    "FrozenMap", "Tile", "Program", "program_digest", "timing_to_json", "timing_from_json", "memory_to_json", "memory_from_json",
    "mapping_to_json", "mapping_from_json",
]

PROGRAM_MAGIC = b"SPINNPRG"
PROGRAM_VERSION = 5
#: The format of a program that carries a native section (:mod:`.native_section`): version 5's
#: layout with the section between the constant blob and the digest.
NATIVE_PROGRAM_VERSION = 6
_READABLE_VERSIONS = (4, 5, 6)
_ALIGN = 64
#: Bytes of the trailing digest (:func:`program_digest`; :attr:`Program.digest`).
CHECKSUM_BYTES = 32
#: Largest JSON header a program may carry (O(layers): a BERT-base program's is about 1 MB).
MAX_HEADER_BYTES = 1 << 30

#: Layer kinds of the built-in operator families (:mod:`.ops`; :func:`.ops.layer_kinds` also
#: lists families registered later).
LAYER_KINDS = layer_kinds()


@dataclass(frozen=True)
class Program:
    """A compiled spinn program (one offloaded Relax function), a frozen record.

    Every stage that changes a program returns a new one (``dataclasses.replace``); the
    sequences are tuples and the constants a read-only :class:`~.model.ConstantMap` (lists and
    dicts given to the constructor are converted). Unhashable (its constants are arrays): the
    simulator's plan cache keys a program by its :attr:`digest`.
    """

    symbol: str
    arch: SpinnArch
    tensors: tuple[TensorDesc, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    layers: tuple[Layer, ...]
    timing: TimingSummary | None = None
    mapping: ProgramMapping | None = None
    memory: MemorySummary | None = None
    constants: ConstantMap = field(default_factory=ConstantMap, repr=False)
    version: int = PROGRAM_VERSION
    #: The mapper's tiles (:class:`~.tiles.ProgramTiles`), kept in memory only: derived data,
    #: never serialized (``tvm_spinn.mapping.derive_tables`` rebuilds them from ``mapping``).
    tiles: "object | None" = field(default=None, repr=False, compare=False)
    #: The native section (:mod:`.native_section`): the bytes written after the constant blob,
    #: which make the program format version 6 (None: no section, the program's own version).
    native_section: "bytes | None" = field(default=None, repr=False, compare=False)

    __hash__ = None  # type: ignore[assignment] - equal programs may hold distinct arrays

    def __post_init__(self):
        for name in ("tensors", "inputs", "outputs", "layers"):
            value = getattr(self, name)
            if type(value) is not tuple:
                object.__setattr__(self, name, tuple(value))
        if type(self.constants) is not ConstantMap:
            object.__setattr__(self, "constants", ConstantMap(self.constants))

    @cached_property
    def digest(self) -> bytes:
        """The checksum :meth:`to_bytes` ends with (:func:`program_digest` of every byte before
        it), computed once per record: the program's name for the runtime's caches. A program
        read by :meth:`from_bytes` carries the checksum it was read with."""
        return _digest(self._parts())

    # ------------------------------------------------------------------ serialization
    def header(self, offsets: "dict[int, int] | None" = None) -> dict:
        """The header's JSON fields as fresh dicts; ``offsets``: the constants' byte offsets in
        the blob being written (:meth:`to_bytes`), else the descriptors' own."""
        # vars() instead of asdict(): fields are flat JSON values, and asdict's deep copy is
        # the slowest part of compiling a large model.
        tensors = [dict(vars(t)) for t in self.tensors]
        for tid, offset in (offsets or {}).items():
            tensors[tid]["offset"] = offset
        return {
            "version": self.written_version,
            "symbol": self.symbol,
            "arch": self.arch.to_dict(),
            "tensors": tensors,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "layers": [{**vars(layer), "consts": dict(layer.consts), "attrs": dict(layer.attrs)}
                       for layer in self.layers],
            "timing": timing_to_json(self.timing),
            "mapping": mapping_to_json(self.mapping),
            "memory": memory_to_json(self.memory),
        }

    @property
    def written_version(self) -> int:
        """The format version :meth:`to_bytes` writes: 6 with a native section, else the
        program's own (5 for a program read as version 6 whose section was removed)."""
        if self.native_section is not None:
            return NATIVE_PROGRAM_VERSION
        return PROGRAM_VERSION if self.version == NATIVE_PROGRAM_VERSION else self.version

    def blob_offsets(self) -> "tuple[dict[int, int], int]":
        """Each constant's byte offset in the constant blob :meth:`to_bytes` writes, and the
        blob's length (constants in tensor id order, each 64-byte aligned)."""
        offsets: dict[int, int] = {}
        size = 0
        for tid in sorted(self.constants):
            size += -size % _ALIGN
            offsets[tid] = size
            size += np.asarray(self.constants[tid]).nbytes
        return offsets, size

    def to_bytes(self) -> bytes:
        """Serialize deterministically (same program -> same bytes); one copy, one hash pass."""
        return _finish(self._parts())

    def _parts(self) -> list:
        """The serialized program less its digest, as buffers: the framed header, then each
        constant (views, not copies) and its alignment padding. :func:`_finish` joins them.
        Writing changes nothing in the program: the constants' offsets go to the header only."""
        parts: list = []
        offsets: dict[int, int] = {}
        size = 0
        for tid in sorted(self.constants):
            arr = np.asarray(self.constants[tid])  # ascontiguousarray would make 0-d arrays 1-d
            desc = self.tensors[tid]
            if list(arr.shape) != list(desc.shape) or str(arr.dtype) != desc.dtype:
                raise ProgramError(f"constant {desc.name}: array {arr.shape}/{arr.dtype} does not match its descriptor")
            pad = -size % _ALIGN
            if pad:
                parts.append(b"\0" * pad)
                size += pad
            offsets[tid] = size
            data = memoryview(np.ascontiguousarray(arr).reshape(-1)).cast("B") if arr.ndim else arr.tobytes()
            parts.append(data)
            size += len(data)
        text = json.dumps(self.header(offsets), sort_keys=True, separators=(",", ":")).encode()
        head = PROGRAM_MAGIC + struct.pack("<IIQ", self.written_version, 0, len(text)) + text
        head += b"\0" * (-len(head) % _ALIGN) + struct.pack("<Q", size)
        if self.native_section is not None:  # 64-byte aligned after the blob
            parts += [b"\0" * (-(len(head) + size) % _ALIGN), bytes(self.native_section)]
        return [head, *parts]

    @classmethod
    def from_bytes(cls, data: "bytes | memoryview", verify_checksum: bool = True) -> "Program":
        """Parse and validate untrusted bytes (``bytes`` or any buffer, read in place).

        ``verify_checksum=False`` skips only the digest pass over the contents, for bytes the
        caller has just produced with :meth:`to_bytes` (the compiler); every other check runs.

        Checks the binary framing (magic, versions, lengths, checksum), then the header against
        :func:`tvm_spinn.program.validate.validate_header` (types, tensor ids, shapes, dtypes,
        constants inside the blob, per-layer operands, tile shapes and PE ranges) before
        building any object from it.

        Raises
        ------
        ProgramError
            ``"<field>: <defect>"`` for the first defect found; nothing else escapes.
        """
        from ..target.arch import SpinnArch  # lazy: target/ imports tvm
        from .validate import validate_header

        if type(data) is not bytes:
            # Any buffer (a memoryview of a mapped library): read in place, never copied; it
            # is read-only, so constant views over it (np.frombuffer) are read-only as well.
            data = memoryview(data).cast("B")
            if not data.readonly:
                data = data.toreadonly()
        if len(data) < 24 + 8 + CHECKSUM_BYTES or bytes(data[:8]) != PROGRAM_MAGIC:
            raise ProgramError("magic: not a spinn program (bad magic or shorter than its header)")
        version, reserved, hlen = struct.unpack_from("<IIQ", data, 8)
        if version not in _READABLE_VERSIONS:
            raise ProgramError(f"version: spinn program format version {version} is not supported "
                               f"(this runtime reads {', '.join(map(str, _READABLE_VERSIONS))}; "
                               "rebuild the model with this tvm-spinn)")
        if verify_checksum and program_digest(memoryview(data)[:-CHECKSUM_BYTES], version) != bytes(data[-CHECKSUM_BYTES:]):
            raise ProgramError("checksum: spinn program checksum mismatch (truncated or corrupt)")
        if reserved != 0:
            raise ProgramError(f"reserved: must be 0, got {reserved}")
        # The header, its padding and the blob length must fit before the checksum.
        if hlen > min(MAX_HEADER_BYTES, len(data) - 24 - 8 - CHECKSUM_BYTES):
            raise ProgramError(f"header length: {hlen} bytes does not fit the {len(data)}-byte program "
                               f"(or exceeds the {MAX_HEADER_BYTES}-byte cap)")
        pos = 24 + hlen
        header = _parse_header(bytes(data[24:pos]))
        pos += -pos % _ALIGN
        if pos + 8 + CHECKSUM_BYTES > len(data):
            raise ProgramError("blob length: program truncated before the constant blob")
        (blen,) = struct.unpack_from("<Q", data, pos)
        section = None
        if version == NATIVE_PROGRAM_VERSION:
            start = pos + 8 + blen
            start += -start % _ALIGN
            if start + 24 + CHECKSUM_BYTES > len(data):
                raise ProgramError("native section: the program ends before it")
            (slen,) = struct.unpack_from("<Q", data, start + 16)
            if start + slen + CHECKSUM_BYTES != len(data):
                raise ProgramError(f"native section: length {slen} does not end where the checksum starts")
            section = bytes(data[start:start + slen])
            section_status(section)  # framing and CRC; the plan is validated by the C++ module
            blen_end = start - pos - 8  # the blob, then zero padding up to the section
            if any(bytes(data[pos + 8 + blen:start])):
                raise ProgramError("native section: non-zero padding before it")
        else:
            blen_end = blen
        if pos + 8 + blen_end + CHECKSUM_BYTES != len(data) - (0 if section is None else len(section)):
            raise ProgramError(f"blob length: {blen} bytes of constants do not end where the "
                               f"checksum starts ({len(data) - pos - 8 - CHECKSUM_BYTES} bytes there)")
        blob = memoryview(data)[pos + 8: pos + 8 + blen]
        if version == 4:
            _upgrade_rows_tiles(header)
        validate_header(header, version, blen, blob)
        tensors = [TensorDesc(**t) for t in header["tensors"]]
        constants = {}
        for tid, t in enumerate(tensors):
            if t.role == "const":  # offsets checked against the blob by validate_header
                constants[tid] = np.frombuffer(blob[t.offset:t.offset + t.nbytes], dtype=t.dtype).reshape(t.shape)
        program = cls(
            symbol=header["symbol"], arch=SpinnArch.from_dict(header["arch"]), tensors=tensors,
            inputs=header["inputs"], outputs=header["outputs"],
            layers=[Layer(**layer) for layer in header["layers"]],
            timing=timing_from_json(header["timing"]), mapping=mapping_from_json(header["mapping"]), memory=memory_from_json(header["memory"]),
            constants=constants, version=version, native_section=section,
        )
        # the checksum it was read with: verified above, or by the caller over exactly these bytes
        program.__dict__["digest"] = bytes(data[-CHECKSUM_BYTES:])
        return program


# ---------------------------------------------------------------------- records <-> header JSON
_LAYER_TIMING_KEYS = tuple(f.name for f in fields(LayerTimingSummary))
_COLLECTIVE_KEYS = tuple(f.name for f in fields(CollectiveSummary))
_SYSTEM_KEYS = tuple(f.name for f in fields(SystemTimingSummary))
_TIMING_KEYS = tuple(f.name for f in fields(TimingSummary))


def timing_to_json(timing: TimingSummary | None) -> dict:
    """The header's ``timing`` object of ``timing`` (``{}`` for None: not mapped yet); the
    system figures only for a program mapped over several chips."""
    if timing is None:
        return {}
    out = {k: getattr(timing, k) for k in _TIMING_KEYS if k not in ("layers", "system", "pipeline")}
    out["layers"] = [dict(vars(row)) for row in timing.layers]
    if timing.system is not None:
        st = timing.system
        system = {k: getattr(st, k) for k in _SYSTEM_KEYS}
        system["layer_s"] = list(st.layer_s)
        system["collectives"] = [dict(vars(c)) for c in st.collectives]
        out["system"] = system
    if timing.pipeline is not None:  # only a program mapped over pipeline stages has it
        pt = timing.pipeline
        out["pipeline"] = {**{k: getattr(pt, k) for k in _PIPELINE_TIMING_KEYS},
                           "stage_s": list(pt.stage_s), "send_s": list(pt.send_s)}
    return out


def _record(cls, keys: tuple, value, where: str, **nested):
    """``cls`` built from the JSON object ``value`` with exactly the keys ``keys`` (``nested``:
    values already converted); a missing or unknown key is a :class:`ProgramError` at ``where``."""
    if type(value) is not dict:
        raise ProgramError(f"{where}: expected an object, got {type(value).__name__}")
    required = {f.name for f in fields(cls) if f.default is MISSING}
    missing, unknown = sorted(required - value.keys()), sorted(value.keys() - set(keys))
    if missing or unknown:
        raise ProgramError(f"{where}: missing key(s) {missing}, unknown key(s) {unknown}")
    return cls(**{**value, **nested})


def timing_from_json(value) -> TimingSummary | None:
    """The :class:`TimingSummary` of a header's ``timing`` object (None for ``{}``).

    Raises
    ------
    ProgramError
        ``"timing...: <defect>"`` for a missing or unknown key or a list that is not one.
    """
    if value == {}:
        return None
    if type(value) is not dict:
        raise ProgramError(f"timing: expected an object, got {type(value).__name__}")
    layers = _json_list(value.get("layers", []), "timing.layers")
    system = None
    if "system" in value:
        st = value["system"]
        if type(st) is not dict:
            raise ProgramError(f"timing.system: expected an object, got {type(st).__name__}")
        colls = _json_list(st.get("collectives"), "timing.system.collectives")
        system = _record(SystemTimingSummary, _SYSTEM_KEYS, st, "timing.system",
                         layer_s=tuple(_json_list(st.get("layer_s"), "timing.system.layer_s")),
                         collectives=tuple(_record(CollectiveSummary, _COLLECTIVE_KEYS, c,
                                                   f"timing.system.collectives[{i}]") for i, c in enumerate(colls)))
    pipeline = None
    if "pipeline" in value:
        pt = value["pipeline"]
        if type(pt) is not dict:
            raise ProgramError(f"timing.pipeline: expected an object, got {type(pt).__name__}")
        pipeline = _record(PipelineTimingSummary, _PIPELINE_TIMING_KEYS, pt, "timing.pipeline",
                           stage_s=tuple(_json_list(pt.get("stage_s"), "timing.pipeline.stage_s")),
                           send_s=tuple(_json_list(pt.get("send_s"), "timing.pipeline.send_s")))
        for key in ("stage_s", "send_s"):
            for i, v in enumerate(getattr(pipeline, key)):
                if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
                    raise ProgramError(f"timing.pipeline.{key}[{i}]: expected a finite time >= 0, got {v!r}")
        if len(pipeline.stage_s) < 2:
            raise ProgramError(f"timing.pipeline.stage_s: a pipeline has at least 2 stages, got {len(pipeline.stage_s)}")
    return _record(TimingSummary, _TIMING_KEYS, value, "timing", system=system, pipeline=pipeline,
                   layers=tuple(_record(LayerTimingSummary, _LAYER_TIMING_KEYS, row, f"timing.layers[{i}]")
                                for i, row in enumerate(layers)))


_MEMORY_KEYS = tuple(f.name for f in fields(MemorySummary))


def memory_to_json(memory: MemorySummary | None) -> dict:
    """The header's ``memory`` object of ``memory`` (``{}`` for None: not mapped yet); each
    address range as ``[start, end, first layer, last layer, what]``."""
    if memory is None:
        return {}
    out = {k: getattr(memory, k) for k in _MEMORY_KEYS}
    out["ranges"] = [[r.start, r.end, r.first_layer, r.last_layer, r.what] for r in memory.ranges]
    return out


def memory_from_json(value) -> MemorySummary | None:
    """The :class:`MemorySummary` of a header's ``memory`` object (None for ``{}``).

    Raises
    ------
    ProgramError
        ``"memory...: <defect>"`` for a missing or unknown key or a range that is not a list of
        five values.
    """
    if value == {}:
        return None
    if type(value) is not dict:
        raise ProgramError(f"memory: expected an object, got {type(value).__name__}")
    ranges = []
    for i, rng in enumerate(_json_list(value.get("ranges", []), "memory.ranges")):
        if type(rng) is not list or len(rng) != 5:
            raise ProgramError(f"memory.ranges[{i}]: expected [start, end, first layer, last layer, what]")
        ranges.append(AddressRange(*rng))
    return _record(MemorySummary, _MEMORY_KEYS, value, "memory", ranges=tuple(ranges))


#: MappingOptions fields left out of a program's ``mapping.options`` at these values, so a
#: program built with the defaults carries no entry for them.
_OPTIONS_OMITTED_AT = (("double_buffer", True), ("scheduler", "static"), ("split_k", True), ("row_tiles", True))


def options_to_json(options: MappingOptions) -> dict:
    """The header's ``mapping.options`` object of ``options``: every field but those of
    ``_OPTIONS_OMITTED_AT`` at their value there."""
    out = options.as_dict()
    for name, value in _OPTIONS_OMITTED_AT:
        if out[name] == value:
            del out[name]
    return out


def options_from_json(value) -> MappingOptions:
    """The :class:`MappingOptions` of a header's ``mapping.options`` object (a missing field
    takes its default).

    Raises
    ------
    ProgramError
        ``"mapping.options...: <defect>"`` naming an unknown field, a value of the wrong type or
        one outside the field's allowed set.
    """
    if type(value) is not dict:
        raise ProgramError(f"mapping.options: expected an object, got {type(value).__name__}")
    try:
        return MappingOptions.from_dict(value)
    except (TypeError, ValueError) as err:
        text = str(err)
        head = "MappingOptions"
        raise ProgramError("mapping.options" + text[len(head):] if text.startswith(head) else
                           f"mapping.options: {text}") from None


_LAYER_MAPPING_KEYS = tuple(f.name for f in fields(LayerMapping))
_CANDIDATE_KEYS = tuple(f.name for f in fields(PlanCandidate))
_PLAN_COLLECTIVE_KEYS = tuple(f.name for f in fields(PlanCollective))
_SYSTEM_MAPPING_KEYS = tuple(f.name for f in fields(SystemMapping))
_MAPPING_KEYS = tuple(f.name for f in fields(ProgramMapping))
_PIPELINE_TIMING_KEYS = tuple(f.name for f in fields(PipelineTimingSummary))
_PIPELINE_STAGE_KEYS = tuple(f.name for f in fields(PipelineStage))
_PIPELINE_KEYS = tuple(f.name for f in fields(PipelineMapping))


def _system_mapping_to_json(system: SystemMapping) -> dict:
    out = {k: getattr(system, k) for k in _SYSTEM_MAPPING_KEYS if k not in ("replicated", "streams")}
    out["splits"] = dict(system.splits)
    out["candidates"] = [dict(vars(c)) for c in system.candidates]
    out["collectives"] = [dict(vars(c), shape=None if c.shape is None else list(c.shape)) for c in system.collectives]
    if system.replicated:
        out["replicated"] = [list(x) for x in system.replicated]
    if system.streams != 1:  # one stream (the default) left out
        out["streams"] = system.streams
    return out


def mapping_to_json(mapping: ProgramMapping | None) -> dict:
    """The header's ``mapping`` object of ``mapping`` (``{}`` for None: not mapped yet); keys
    at their defaults (``scheduler`` static, a layer's ``rotate`` 0, no ``system``) left out."""
    if mapping is None:
        return {}
    out = {k: getattr(mapping, k) for k in _MAPPING_KEYS if k not in ("layers", "scheduler", "system", "pipeline")}
    out["options"] = options_to_json(mapping.options)
    for k in ("chips_per_layer", "pes_per_layer", "resident_layers", "onchip_tensors"):
        out[k] = list(out[k])
    layers = []
    for rec in mapping.layers:
        row = {"tile": list(rec.tile), "pes": list(rec.pes)}
        if rec.rotate:
            row["rotate"] = rec.rotate
        layers.append(row)
    out["layers"] = layers
    if mapping.scheduler != "static":
        out["scheduler"] = mapping.scheduler
    if mapping.system is not None:
        out["system"] = _system_mapping_to_json(mapping.system)
    if mapping.pipeline is not None:  # only a program mapped over pipeline stages has it
        out["pipeline"] = {
            "stages": [{"first_layer": st.first_layer, "layers": st.layers, "chips": list(st.chips),
                        "mapping": mapping_to_json(st.mapping)} for st in mapping.pipeline.stages],
            "sends": [dict(vars(c), shape=None if c.shape is None else list(c.shape)) for c in mapping.pipeline.sends]}
    return out


def _int_tuple(value, where: str) -> tuple:
    return tuple(_json_list(value, where))


def _system_mapping_from_json(value) -> SystemMapping:
    if type(value) is not dict:
        raise ProgramError(f"mapping.system: expected an object, got {type(value).__name__}")
    splits = value.get("splits")
    if type(splits) is not dict:
        raise ProgramError(f"mapping.system.splits: expected an object, got {type(splits).__name__}")
    colls = []
    for i, c in enumerate(_json_list(value.get("collectives"), "mapping.system.collectives")):
        where = f"mapping.system.collectives[{i}]"
        shape = c.get("shape") if type(c) is dict else None
        colls.append(_record(PlanCollective, _PLAN_COLLECTIVE_KEYS, c, where,
                             **({"shape": _int_tuple(shape, f"{where}.shape")} if shape is not None else {})))
    replicated = []
    for i, x in enumerate(_json_list(value.get("replicated", []), "mapping.system.replicated")):
        if type(x) is not list or len(x) != 2:
            raise ProgramError(f"mapping.system.replicated[{i}]: expected [layer name, reason]")
        replicated.append(tuple(x))
    streams = value.get("streams", 1)
    if type(streams) is not int or streams < 1:
        raise ProgramError(f"mapping.system.streams: expected an int >= 1, got {streams!r}")
    return _record(SystemMapping, _SYSTEM_MAPPING_KEYS, value, "mapping.system", splits=tuple(splits.items()),
                   candidates=tuple(_record(PlanCandidate, _CANDIDATE_KEYS, c, f"mapping.system.candidates[{i}]")
                                    for i, c in enumerate(_json_list(value.get("candidates"),
                                                                     "mapping.system.candidates"))),
                   collectives=tuple(colls), replicated=tuple(replicated))


def mapping_from_json(value) -> ProgramMapping | None:
    """The :class:`ProgramMapping` of a header's ``mapping`` object (None for ``{}``); the
    per-layer tile shapes and PE ranges were checked by the validator.

    Raises
    ------
    ProgramError
        ``"mapping...: <defect>"`` for a missing or unknown key or a list that is not one.
    """
    if value == {}:
        return None
    if type(value) is not dict:
        raise ProgramError(f"mapping: expected an object, got {type(value).__name__}")
    layers = tuple(LayerMapping(tile=tuple(rec["tile"]), pes=tuple(rec["pes"]), rotate=rec.get("rotate", 0))
                   for rec in _json_list(value.get("layers"), "mapping.layers"))
    lists = {k: _int_tuple(value.get(k, []), f"mapping.{k}")
             for k in ("chips_per_layer", "pes_per_layer", "resident_layers", "onchip_tensors") if k in value}
    options = {"options": options_from_json(value["options"])} if "options" in value else {}
    system = _system_mapping_from_json(value["system"]) if "system" in value else None
    pipeline = _pipeline_from_json(value["pipeline"], layers) if "pipeline" in value else None
    return _record(ProgramMapping, _MAPPING_KEYS, value, "mapping", layers=layers, system=system, pipeline=pipeline,
                   **lists, **options)


def _is_int(value) -> bool:
    return type(value) is int


def _pipeline_from_json(value, layers: tuple) -> PipelineMapping:
    """The :class:`PipelineMapping` of a header's ``mapping.pipeline`` object, checked against
    the program's per-layer mapping ``layers``: at least two stages, contiguous in layer order
    from layer 0 to the last, each on its own chips (distinct non-negative ids, as many per
    stage), each stage's mapping the program's records of its layers, and every send at the
    first layer of a stage other than the first.

    Raises
    ------
    ProgramError
        ``"mapping.pipeline...: <defect>"`` naming the field.
    """
    where = "mapping.pipeline"
    if type(value) is not dict:
        raise ProgramError(f"{where}: expected an object, got {type(value).__name__}")
    raw = _json_list(value.get("stages"), f"{where}.stages")
    if len(raw) < 2:
        raise ProgramError(f"{where}.stages: a pipeline has at least 2 stages, got {len(raw)}")
    stages, seen, at = [], set(), 0
    for i, st in enumerate(raw):
        here = f"{where}.stages[{i}]"
        if type(st) is not dict:
            raise ProgramError(f"{here}: expected an object, got {type(st).__name__}")
        for key in ("first_layer", "layers"):
            if key in st and not _is_int(st[key]):
                raise ProgramError(f"{here}.{key}: expected an integer, got {st[key]!r}")
        chips = _int_tuple(st.get("chips"), f"{here}.chips")
        if not chips or not all(_is_int(c) and c >= 0 for c in chips) or seen & set(chips) or len(set(chips)) < len(chips):
            raise ProgramError(f"{here}.chips: expected distinct chip ids >= 0 not in another stage, got {list(chips)}")
        if stages and len(chips) != len(stages[0].chips):
            raise ProgramError(f"{here}.chips: every stage has as many chips ({len(stages[0].chips)}), got {len(chips)}")
        seen |= set(chips)
        if "mapping" not in st:
            raise ProgramError(f"{here}: missing key(s) ['mapping']")
        try:
            sub = mapping_from_json(st["mapping"])
        except ProgramError as err:
            raise ProgramError(f"{here}.{err}") from None
        if sub is None or sub.pipeline is not None:
            raise ProgramError(f"{here}.mapping: expected a one-stage mapping")
        rec = _record(PipelineStage, _PIPELINE_STAGE_KEYS, st, here, chips=chips, mapping=sub)
        if rec.first_layer != at:
            raise ProgramError(f"{here}.first_layer: expected {at} (the stages are contiguous), got {rec.first_layer}")
        if rec.layers != len(sub.layers):
            raise ProgramError(f"{here}.layers: {rec.layers}, but its mapping has {len(sub.layers)} layers")
        if rec.layers < 1 or at + rec.layers > len(layers):
            raise ProgramError(f"{here}.layers: {rec.layers} layers from layer {at} do not fit the program's {len(layers)}")
        if sub.layers != layers[at:at + rec.layers]:
            raise ProgramError(f"{here}.mapping.layers: not the program's mapping of layers {at}..{at + rec.layers - 1}")
        stages.append(rec)
        at += rec.layers
    if at != len(layers):
        raise ProgramError(f"{where}.stages: cover layers 0..{at - 1} of the program's {len(layers)}")
    starts = {st.first_layer for st in stages[1:]}
    sends = []
    for i, c in enumerate(_json_list(value.get("sends", []), f"{where}.sends")):
        here = f"{where}.sends[{i}]"
        shape = c.get("shape") if type(c) is dict else None
        if shape is not None and not all(_is_int(n) and n >= 0 for n in _json_list(shape, f"{here}.shape")):
            raise ProgramError(f"{here}.shape: expected non-negative integers, got {shape!r}")
        rec = _record(PlanCollective, _PLAN_COLLECTIVE_KEYS, c, here,
                      **({"shape": _int_tuple(shape, f"{here}.shape")} if shape is not None else {}))
        if rec.op != "send" or not _is_int(rec.layer) or rec.layer not in starts:
            raise ProgramError(f"{here}: expected a send at the first layer of a stage after the first "
                               f"({sorted(starts)}), got {rec.op!r} at layer {rec.layer!r}")
        sends.append(rec)
    return _record(PipelineMapping, _PIPELINE_KEYS, value, where, stages=tuple(stages), sends=tuple(sends))


def _json_list(value, where: str) -> list:
    if type(value) is not list:
        raise ProgramError(f"{where}: expected a list, got {type(value).__name__}")
    return value


#: Layer kinds whose tile gained a second number (the elements of a row per tile) in version 5.
_ROW_KINDS = ("softmax", "layer_norm", "mean")


def _upgrade_rows_tiles(header: dict) -> None:
    """A version-4 header's row tiles (``[rows]``: whole rows) as version 5 writes them
    (``[rows, row length]``), so the rest of the runtime reads one form. Anything malformed is
    left as it is for the validator to name."""
    try:
        layers, records, tensors = header["layers"], header["mapping"]["layers"], header["tensors"]
        for layer, record in zip(layers, records):
            tile = record.get("tile") if type(record) is dict else None
            if type(layer) is dict and layer.get("kind") in _ROW_KINDS and type(tile) is list and len(tile) == 1:
                row = layer["attrs"]["row"] if layer["kind"] == "mean" else tensors[layer["output"]]["shape"][-1]
                if type(row) is int:
                    record["tile"] = [tile[0], row]
    except (KeyError, IndexError, TypeError):
        pass


#: Bytes per segment of the version-5 digest (each hashed with XXH3-128).
DIGEST_SEGMENT = 32 << 20


class _SegmentDigest:
    """The version-5 digest, fed in pieces of any size: XXH3-128 of each DIGEST_SEGMENT-byte
    segment of the bytes fed, then SHA-256 over those digests and the total byte count. It
    detects damage (bit rot, truncation, a foreign program), not forgery, like the sealed
    library's digest (runtime/loader.py): BLAKE2b-256 (version 4) took ~0.7 s for BERT-base's
    340 MB at compile and at load, XXH3 ~0.04 s."""

    def __init__(self):
        self.root = hashlib.sha256()
        self.leaf = xxhash.xxh3_128()
        self.fill = 0
        self.total = 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), DIGEST_SEGMENT - self.fill)
            self.leaf.update(view[:take])
            self.fill += take
            self.total += take
            view = view[take:]
            if self.fill == DIGEST_SEGMENT:
                self.root.update(self.leaf.digest())
                self.leaf, self.fill = xxhash.xxh3_128(), 0

    def digest(self) -> bytes:
        root = self.root.copy()
        if self.fill or not self.total:
            root.update(self.leaf.digest())
        root.update(struct.pack("<Q", self.total))
        return root.digest()


def program_digest(data, version: int = PROGRAM_VERSION) -> bytes:
    """The checksum a program of format ``version`` stores after ``data`` (every byte before
    it): version 5's segmented XXH3-128/SHA-256 digest, version 4's BLAKE2b-256."""
    if version == 4:
        return hashlib.blake2b(data, digest_size=CHECKSUM_BYTES).digest()
    digest = _SegmentDigest()
    digest.update(data)
    return digest.digest()


def _digest(parts: list) -> bytes:
    digest = _SegmentDigest()
    for part in parts:
        digest.update(part)
    return digest.digest()


def _finish(parts: list) -> bytes:
    """``parts`` (from :meth:`Program._parts`) and their digest (:func:`program_digest`) as one
    ``bytes``."""
    return b"".join([*parts, _digest(parts)])


def _finish_array(parts: list) -> np.ndarray:
    """The bytes of :func:`_finish` in a writable uint8 array (a buffer the runtime module can
    hold through DLPack without a copy). The digest pass and the copies release the GIL on large
    buffers, so a compiler may run this on a worker thread while it lowers the next program."""
    sizes = [memoryview(part).nbytes for part in parts]
    out = np.empty(sum(sizes) + CHECKSUM_BYTES, dtype=np.uint8)
    pos = 0
    for part, size in zip(parts, sizes):
        out[pos:pos + size] = np.frombuffer(part, dtype=np.uint8)
        pos += size
    # The digest is taken over the bytes as copied (not the parts again): the checksum always
    # certifies exactly the bytes this program holds.
    out[pos:] = np.frombuffer(_checksum(memoryview(out)[:pos]), dtype=np.uint8)
    return out


def _reject_constant(name: str):
    raise ValueError(f"non-finite number {name}")


def _parse_header(raw: bytes) -> dict:
    """UTF-8 JSON -> dict; any decoding defect is a :class:`ProgramError` naming ``header``."""
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as err:
        raise ProgramError(f"header: not UTF-8 text (byte {err.start})") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise ProgramError(f"header: not valid JSON ({str(err)[:200]})") from None
    if type(header) is not dict:
        raise ProgramError(f"header: expected a JSON object, got {type(header).__name__}")
    return header


def _checksum(data: "bytes | bytearray | memoryview") -> bytes:
    """The current version's digest of ``data`` (:func:`program_digest`)."""
    return program_digest(data)
