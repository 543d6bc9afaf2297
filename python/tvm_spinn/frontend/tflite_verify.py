"""Bounds check of a TFLite flatbuffer before anything reads it.

The ``tflite`` package's generated readers are lazy and check nothing: a damaged offset makes
them raise ``struct.error`` deep inside the importer, or read the wrong bytes without an error
(a corrupt vtable offset can point before the buffer's start, which Python's ``struct`` reads
counting from the end). The Python ``flatbuffers`` package has no verifier, so
:func:`verify` walks the tables of the TFLite schema the importer reads -- the model, operator
codes, subgraphs, tensors, quantization, operators and their option tables, buffers, metadata
and signatures -- as flatbuffers' C++ ``Verifier`` does: every table, vtable, vector and
string must lie inside the buffer, every field inside its table, every string be UTF-8, and
every index (operator code, tensor, buffer, subgraph) in range. A file that passes can be read
without an out-of-bounds access; one that does not is one :class:`ValueError` subclass (the
caller's) naming the field path and what is wrong.
"""

from __future__ import annotations

import struct

__all__ = ["verify"]

# A table's fields by vtable slot: a scalar's byte size, or the kind of what its offset points to.
_ANY = "any"  # a table of a union (builtin options, quantization details): fields checked to lie inside it
_TENSOR_MAP = {0: "string", 1: 4}
_SIGNATURE_DEF = {0: ("tables", _TENSOR_MAP), 1: ("tables", _TENSOR_MAP), 2: "string", 4: 4}
_METADATA = {0: "string", 1: 4}
_BUFFER = {0: ("vector", 1), 1: 8, 2: 8}
_SPARSITY = {0: ("vector", 4), 1: ("vector", 4), 2: ("tables", _ANY)}
_QUANTIZATION = {0: ("vector", 4), 1: ("vector", 4), 2: ("vector", 4), 3: ("vector", 8), 4: 1, 5: ("table", _ANY),
                 6: 4}
_TENSOR = {0: ("vector", 4), 1: 1, 2: 4, 3: "string", 4: ("table", _QUANTIZATION), 5: 1, 6: ("table", _SPARSITY),
           7: ("vector", 4), 8: 1, 9: ("tables", _ANY)}
_OPERATOR = {0: 4, 1: ("vector", 4), 2: ("vector", 4), 3: 1, 4: ("table", _ANY), 5: ("vector", 1), 6: 1,
             7: ("vector", 1), 8: ("vector", 4), 9: 8, 10: 8, 11: 1, 12: ("table", _ANY), 13: 4}
_SUBGRAPH = {0: ("tables", _TENSOR), 1: ("vector", 4), 2: ("vector", 4), 3: ("tables", _OPERATOR), 4: "string", 5: 4}
_OPERATOR_CODE = {0: 1, 1: "string", 2: 4, 3: 4}
_MODEL = {0: 4, 1: ("tables", _OPERATOR_CODE), 2: ("tables", _SUBGRAPH), 3: "string", 4: ("tables", _BUFFER),
          5: ("vector", 4), 6: ("tables", _METADATA), 7: ("tables", _SIGNATURE_DEF)}

_NAMES = {id(_MODEL): "model", id(_OPERATOR_CODE): "operator_codes", id(_SUBGRAPH): "subgraphs",
          id(_TENSOR): "tensors", id(_OPERATOR): "operators", id(_BUFFER): "buffers", id(_METADATA): "metadata",
          id(_SIGNATURE_DEF): "signature_defs", id(_TENSOR_MAP): "tensor_maps", id(_QUANTIZATION): "quantization",
          id(_SPARSITY): "sparsity"}


class _Damaged(Exception):
    pass


class _Walker:
    def __init__(self, buf: bytes):
        self.buf = buf
        self.n = len(buf)
        self.fields: dict[int, dict[int, int]] = {}  # table position -> {slot: offset in table}

    def _read(self, fmt: str, pos: int, size: int, what: str):
        if pos < 0 or pos + size > self.n:
            raise _Damaged(f"{what}: offset {pos} is outside the file ({self.n} bytes)")
        return struct.unpack_from(fmt, self.buf, pos)[0]

    def vector(self, pos: int, itemsize: int, what: str) -> tuple[int, int]:
        length = self._read("<I", pos, 4, what)
        if pos + 4 + length * itemsize > self.n:
            raise _Damaged(f"{what}: a vector of {length} elements at offset {pos} runs past the end of the "
                           f"file ({self.n} bytes)")
        return pos + 4, length

    def string(self, pos: int, what: str) -> None:
        start, length = self.vector(pos, 1, what)
        if start + length >= self.n:  # the terminating zero byte
            raise _Damaged(f"{what}: a string at offset {pos} runs past the end of the file")
        try:
            bytes(self.buf[start:start + length]).decode("utf-8")
        except UnicodeDecodeError as err:
            raise _Damaged(f"{what}: a string that is not UTF-8 ({err.reason} at byte {err.start})") from None

    def table(self, pos: int, schema, what: str) -> None:
        soffset = self._read("<i", pos, 4, what)
        vtable = pos - soffset
        vsize = self._read("<H", vtable, 2, f"{what} (its vtable)")
        tsize = self._read("<H", vtable + 2, 2, f"{what} (its vtable)")
        if vsize < 4 or vsize % 2 or vtable + vsize > self.n or tsize < 4 or pos + tsize > self.n:
            raise _Damaged(f"{what}: a table at offset {pos} with a vtable of {vsize} bytes at offset {vtable} "
                           f"for {tsize} bytes of fields does not fit the file ({self.n} bytes)")
        fields = {}
        for slot in range((vsize - 4) // 2):
            off = self._read("<H", vtable + 4 + 2 * slot, 2, what)
            if off and not 4 <= off < tsize:
                raise _Damaged(f"{what}: field {slot} at offset {off} lies outside its table ({tsize} bytes)")
            if off:
                fields[slot] = off
        self.fields[pos] = fields
        if schema is _ANY:
            return
        for slot, kind in schema.items():
            off = fields.get(slot)
            if off is None:
                continue
            where = f"{what}.field{slot}"
            size = kind if isinstance(kind, int) else 4
            if off + size > tsize:
                raise _Damaged(f"{where}: a {size}-byte field at offset {off} of a {tsize}-byte table")
            if isinstance(kind, int):
                continue
            target = pos + off + self._read("<I", pos + off, 4, where)
            if kind == "string":
                self.string(target, where)
            elif kind[0] == "vector":
                self.vector(target, kind[1], where)
            elif kind[0] == "table":
                self.table(target, kind[1], where)
            else:  # a vector of tables, each element an offset from itself
                start, length = self.vector(target, 4, where)
                name = _NAMES.get(id(kind[1]), where)
                for k in range(length):
                    p = start + 4 * k
                    self.table(p + self._read("<I", p, 4, where), kind[1], f"{name}[{k}]")


def _check_indices(model, n_bytes: int) -> None:
    """Indices between tables (read through the ``tflite`` package, safe once the walk passed)."""
    n_codes, n_buffers, n_subgraphs = model.OperatorCodesLength(), model.BuffersLength(), model.SubgraphsLength()
    if n_subgraphs < 1:
        raise _Damaged("the model has no subgraphs")
    for b in range(n_buffers):
        buffer = model.Buffers(b)
        if buffer.Offset() > 1 and buffer.Offset() + buffer.Size() > n_bytes:
            raise _Damaged(f"buffers[{b}]: {buffer.Size()} bytes at offset {buffer.Offset()} lie outside the file")
    for s in range(n_subgraphs):
        sub = model.Subgraphs(s)
        n_tensors = sub.TensorsLength()
        if s == 0 and sub.OutputsLength() == 0:  # the imported graph would compute nothing
            raise _Damaged("subgraphs[0] (the model's graph) has no outputs")
        for k in range(n_tensors):
            if sub.Tensors(k).Buffer() >= n_buffers:
                raise _Damaged(f"subgraphs[{s}].tensors[{k}]: buffer index {sub.Tensors(k).Buffer()} out of range "
                               f"({n_buffers} buffers)")
        for kind, length, at in (("inputs", sub.InputsLength(), sub.Inputs), ("outputs", sub.OutputsLength(), sub.Outputs)):
            for k in range(length):
                if not 0 <= at(k) < n_tensors:
                    raise _Damaged(f"subgraphs[{s}].{kind}[{k}]: tensor index {at(k)} out of range ({n_tensors} tensors)")
        for o in range(sub.OperatorsLength()):
            op = sub.Operators(o)
            if op.OpcodeIndex() >= n_codes:
                raise _Damaged(f"subgraphs[{s}].operators[{o}]: operator code index {op.OpcodeIndex()} out of range "
                               f"({n_codes} codes)")
            for kind, length, at in (("inputs", op.InputsLength(), op.Inputs),
                                     ("outputs", op.OutputsLength(), op.Outputs)):
                for k in range(length):
                    if not -1 <= at(k) < n_tensors:  # -1: an optional input left out
                        raise _Damaged(f"subgraphs[{s}].operators[{o}].{kind}[{k}]: tensor index {at(k)} out of "
                                       f"range ({n_tensors} tensors)")


def verify(buf: bytes, where: str, error: type):
    """Check the flatbuffer ``buf`` of a TFLite model; return its ``tflite.Model.Model``.

    Parameters
    ----------
    buf : bytes
        The file's contents.
    where : str
        The file name, for messages.
    error : type
        The exception class raised (:class:`~tvm_spinn.frontend.tflite.TFLiteImportError`).
    """
    import tflite.Model

    Model = tflite.Model.Model if hasattr(tflite.Model, "Model") else tflite.Model
    bad = f"TFLite file {where!r} is not a valid TFLite model"
    if len(buf) < 8 or not Model.ModelBufferHasIdentifier(buf, 0):
        raise error(f"{bad} (missing the 'TFL3' flatbuffer identifier)")
    walker = _Walker(buf)
    try:
        walker.table(struct.unpack_from("<I", buf, 0)[0], _MODEL, "model")
        model = Model.GetRootAsModel(buf, 0)
        _check_indices(model, len(buf))
    except _Damaged as err:
        raise error(f"{bad} (damaged: {err})") from None
    return model
