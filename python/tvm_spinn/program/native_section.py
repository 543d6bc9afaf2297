"""The native section of a spinn program (format version 6): its execution plan as
instructions of the native interpreter, so the C++ ``spinn`` module runs the program without the
Python package.

The layout (and the C++ decoder, which validates every count, offset and slot) is documented in
``src/native_section.h``; the codes and framing constants come from
:mod:`tvm_spinn.program.native_schema`, the one schema the C++ header is generated from. The
plan itself is the simulator's (:func:`tvm_spinn.runtime.simulator.program_plan`): a program
whose layers all have a native description is one native run, whose instruction list, prepared
constants (by reference into the program's constant blob where they are its bytes, else stored
inline) and temporaries the section stores. A program with a layer that needs Python gets a
section naming that layer and why, which the C++ module reports when asked to run it without
the package.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from .model import ProgramError
from .native_schema import SECTION

__all__ = ["NativeStatus", "encode_plan", "encode_python", "section_status"]

_MAGIC = SECTION["magic"]
_ALIGN = SECTION["align"]
_MAX_DIMS = SECTION["max_dims"]
# DLPack type codes (dlpack.h): the dtypes a program's tensors may have
_DL_CODES = {"i": 0, "u": 1, "f": 2, "b": 6}


@dataclass(frozen=True)
class NativeStatus:
    """What a section says: ``runnable``, else the layer (index, name) that needs Python and why."""

    runnable: bool
    layer_index: int = -1
    layer: str = ""
    reason: str = ""


def _dl(dtype) -> tuple[int, int]:
    dtype = np.dtype(dtype)
    if dtype.kind not in _DL_CODES:
        raise ProgramError(f"native section: dtype {dtype} has no DLPack code")
    return _DL_CODES[dtype.kind], dtype.itemsize * 8


def _frame(status: int, body: bytes) -> bytes:
    head_len = 24
    length = head_len + len(body) + 8
    data = _MAGIC + struct.pack("<IIQ", SECTION["version"], status, length) + body
    return data + struct.pack("<II", zlib.crc32(data), 0)


def encode_python(layer_index: int, layer: str, reason: str) -> bytes:
    """A section saying that layer ``layer_index`` (``layer``, -1: the program) needs Python."""
    name, why = layer.encode(), reason.encode()
    body = struct.pack("<qqq", layer_index, len(name), len(why)) + name + why
    return _frame(SECTION["status_python"], body + b"\0" * (-len(body) % 8))


def _locate(array: np.ndarray, ranges) -> int | None:
    """The byte offset in the blob of ``array``'s bytes if they are bytes of a program
    constant (a view of it, e.g. a reshape), else None. ``ranges``: (start, end, blob offset)."""
    if not array.flags.c_contiguous or array.nbytes == 0:
        return None
    start = array.__array_interface__["data"][0]
    for lo, hi, offset in ranges:
        if lo <= start and start + array.nbytes <= hi:
            return offset + (start - lo)
    return None


def _blob_crc(program, offsets: dict[int, int]) -> int:
    """CRC-32 of the constant blob :meth:`Program.to_bytes` writes (constants at ``offsets``,
    zero padding between them), without joining it."""
    crc, size = 0, 0
    for tid in sorted(program.constants):
        pad = offsets[tid] - size
        if pad:
            crc = zlib.crc32(b"\0" * pad, crc)
        arr = np.ascontiguousarray(program.constants[tid])
        crc = zlib.crc32(memoryview(arr.reshape(-1)).cast("B") if arr.ndim else arr.tobytes(), crc)
        size = offsets[tid] + arr.nbytes
    return crc


def encode_plan(program, run, offsets: dict[int, int], blob_bytes: int, header: bytes) -> bytes | None:
    """The section of ``program`` run as the one native run ``run`` (a
    :class:`~tvm_spinn.program.ops.native.NativeRun`); ``offsets``: each constant's byte offset
    in the blob :meth:`Program.to_bytes` writes (of ``blob_bytes``); ``header``: the header text
    it writes (the plan holds for that header only). None if the run's arguments
    are not the program's DPS arguments one for one (an output that is an input or repeated)."""
    n_in = len(program.inputs)
    if len(set(program.outputs)) != len(program.outputs):
        return None
    dps_in = {tid: i for i, tid in enumerate(program.inputs)}
    dps_out = {tid: n_in + i for i, tid in enumerate(program.outputs)}
    exported = [tid for tid, _, _ in run.exported]
    if set(exported) != set(program.outputs) or any(t not in dps_in for t in run.inputs):
        return None
    plan_args = [dps_in[t] for t in run.inputs] + [dps_out[t] for t in exported]
    words: list[int] = []
    args = []
    for tid in (*program.inputs, *program.outputs):
        desc = program.tensors[tid]
        if len(desc.shape) > _MAX_DIMS:
            return None
        code, bits = _dl(desc.dtype)
        shape = [int(d) for d in desc.shape]
        args += [code, bits, len(shape), *shape, *[0] * (_MAX_DIMS - len(shape))]
    ranges = []
    for tid, value in program.constants.items():
        arr = np.asarray(value)
        if arr.flags.c_contiguous and arr.nbytes:
            lo = arr.__array_interface__["data"][0]
            ranges.append((lo, lo + arr.nbytes, offsets[tid]))
    consts, inline = [], bytearray()
    for array in run.consts:
        array = np.ascontiguousarray(array)
        code, bits = _dl(array.dtype)
        offset = _locate(array, ranges)
        if offset is not None:
            consts += [SECTION["const_program"], code, bits, array.size, offset]
            continue
        inline += b"\0" * (-len(inline) % _ALIGN)
        consts += [SECTION["const_inline"], code, bits, array.size, len(inline)]
        inline += array.tobytes()
    words = [blob_bytes, _blob_crc(program, offsets), zlib.crc32(header), n_in, len(program.outputs), len(run.consts), len(plan_args), len(run.temps),
             len(run.code), len(inline), *args, *consts, *plan_args, *run.temps, *run.code]
    body = np.asarray(words, dtype="<i8").tobytes()
    body += b"\0" * (-(24 + len(body)) % _ALIGN)
    body += bytes(inline)
    return _frame(SECTION["status_plan"], body)


def section_status(section: bytes) -> NativeStatus:
    """Read what ``section`` (framing checked) says; the plan's contents are validated by the C++
    decoder when a module is created or loaded."""
    data = bytes(section)
    if len(data) < 32 or data[:8] != _MAGIC:
        raise ProgramError("native section: magic: not a native section")
    version, status, length = struct.unpack_from("<IIQ", data, 8)
    if version != SECTION["version"] or length != len(data):
        raise ProgramError(f"native section: version {version} or length {length} is not supported")
    if struct.unpack_from("<II", data, len(data) - 8) != (zlib.crc32(data[:-8]), 0):
        raise ProgramError("native section: checksum: CRC-32 mismatch (damaged section)")
    if status == SECTION["status_plan"]:
        return NativeStatus(True)
    if status != SECTION["status_python"]:
        raise ProgramError(f"native section: status: {status}")
    index, n_name, n_reason = struct.unpack_from("<qqq", data, 24)
    if 48 + n_name + n_reason > len(data) - 8 or n_name < 0 or n_reason < 0:
        raise ProgramError("native section: layer name: the section ends before it")
    name = data[48:48 + n_name].decode("utf-8", "replace")
    reason = data[48 + n_name:48 + n_name + n_reason].decode("utf-8", "replace")
    return NativeStatus(False, index, name, reason)
