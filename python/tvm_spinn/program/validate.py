"""Load-time validation of a spinn program header (the JSON document of :mod:`.format`).

:func:`validate_header` runs on the parsed JSON, before any dataclass is built from it, whenever
a program is read (:meth:`Program.from_bytes`, so also when a ``spinn`` module is created or
loaded). It proves what the simulator and the timing model rely on, so a program that passes
runs without a Python-level error and its result does not depend on how it was tiled:

- every key of the header, of each tensor, layer and layer mapping is known and has the right JSON type
  (integers are Python ints, never bools or floats);
- shapes are positive integers, at most :data:`MAX_RANK` of them, with at most
  :data:`MAX_ELEMENTS` elements (exact Python integers: no int64 overflow); dtypes come from
  :data:`DTYPES`; constants lie inside the blob, aligned;
- tensor ids are in range and used in their role (inputs, outputs, constants, dataflow order,
  each tensor written once); each layer kind has its inputs, constants, attributes, dtypes and
  output shape (derived from the input shapes as the simulator computes it);
- each layer's mapping (``mapping.layers[i]``) has a tile shape of the layer kind's arity with
  positive sizes, cuts at most :data:`MAX_TILES` tiles, keeps int8 reduction chunks within the
  accumulator's safe length, and names a PE range inside the system. Tiles are a function of
  the tile shape (:mod:`.tiles`), so they cover every output exactly once by construction.

Every failure is a :class:`~tvm_spinn.program.format.ProgramError` whose message starts with the
field, e.g. ``layers[3].inputs[0]: tensor id 99 out of range (12 tensors)``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .checks import (check_dict as _dict, check_int as _int, check_keys as _keys,
                     check_list as _list, check_str as _str, fail as _fail, is_int as _is_int)
from .ops import family_of, layer_kinds
from .tiles import count_tiles, tile_arity, tile_arity_optional

__all__ = [
    "validate_header", "MAX_RANK", "MAX_ELEMENTS", "DTYPES", "HEADER_KEYS", "TENSOR_KEYS",
    "LAYER_KEYS", "LAYER_MAPPING_KEYS", "MAX_TILES",
]

MAX_RANK = 8
#: Cap on the elements of one tensor (2**36: 256 GiB of float32, far beyond any chip system).
MAX_ELEMENTS = 1 << 36
#: Cap on the tiles one layer's tile shape may cut (what expanding them may allocate).
MAX_TILES = 1 << 26
#: Cap on the PEs of a system (SpiNNcloud's 35k chips hold about 5.2M).
MAX_PES = 1 << 24
#: dtype -> itemsize of the tensors a program may hold.
DTYPES = {"float32": 4, "int8": 1, "uint8": 1, "int16": 2, "int32": 4}
ROLES = ("input", "output", "const", "temp")
_ALIGN = 64

HEADER_KEYS = frozenset({"version", "symbol", "arch", "tensors", "inputs", "outputs", "layers",
                         "timing", "mapping", "memory"})
TENSOR_KEYS = frozenset({"name", "shape", "dtype", "role", "offset"})
LAYER_KEYS = frozenset({"name", "kind", "inputs", "consts", "output", "attrs", "gemm", "flops", "mode"})
LAYER_MAPPING_KEYS = frozenset({"tile", "pes"})
#: optional: ``rotate``, the PE of the range equally loaded tiles start from (mapping.placement)
LAYER_MAPPING_OPTIONAL = frozenset({"rotate"})


def _int_array(values: list, field: Callable[[int], str]) -> np.ndarray:
    """``values`` (JSON integers) as int64; names the first bad entry via ``field(index)``."""
    try:
        arr = np.array(values) if values else np.zeros(0, dtype=np.int64)
    except (ValueError, TypeError, OverflowError):  # ragged nesting
        arr = np.zeros((0, 0))
    if arr.dtype.kind != "i" or arr.ndim != 1:  # floats, strings, bools, nested lists, > 2**63
        i = next((i for i, v in enumerate(values) if not _is_int(v)), 0)
        _int(values[i], field(i), -(1 << 62), 1 << 62)
        _fail(field(i), "malformed")
    if len(arr) and (arr.min() < -(1 << 62) or arr.max() > (1 << 62)):
        i = int(np.argmax(np.abs(arr)))
        _int(int(arr[i]), field(i), -(1 << 62), 1 << 62)
    return arr.astype(np.int64)


def _numel(shape: list[int]) -> int:
    return math.prod(shape)  # Python ints: exact


def _broadcast(*shapes: list[int]) -> list[int] | None:
    """numpy's broadcast of ``shapes`` (on Python ints), or None if they do not broadcast."""
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dims = {s[i - rank + len(s)] for s in shapes if i - rank + len(s) >= 0} - {1}
        if len(dims) > 1:
            return None
        out.append(dims.pop() if dims else 1)
    return out


# -- the checker -----------------------------------------------------------------------------------
class _Checker:
    def __init__(self, header: dict, version: int, blob_len: int, blob: "memoryview | bytes | None"):
        self.h, self.version, self.blob_len, self.blob = header, version, blob_len, blob

    # ---------------------------------------------------------------- top level, tensors
    def run(self) -> None:
        h = _keys(self.h, "header", HEADER_KEYS)
        _int(h["version"], "version")
        if h["version"] != self.version:
            _fail("version", f"header says {h['version']}, the binary header says {self.version}")
        if not _str(h["symbol"], "symbol"):
            _fail("symbol", "empty")
        self._arch()
        for key in ("timing", "mapping", "memory"):
            _dict(h[key], key)
        self._tensors()
        self._io()
        extents = self._layers()
        self._layer_mappings(extents)

    def _arch(self) -> None:
        from ..target.arch import ArchError, SpinnArch  # lazy: target/ imports tvm

        try:
            self.arch = SpinnArch.from_dict(_dict(self.h["arch"], "arch"))
        except (ArchError, TypeError, ValueError, ArithmeticError, AttributeError, KeyError) as err:
            _fail("arch", str(err))
        if self.arch.total_pes > MAX_PES:  # per-PE arrays are allocated when tiles are placed
            _fail("arch", f"{self.arch.total_pes} PEs exceed {MAX_PES}")

    def _tensors(self) -> None:
        tensors = _list(self.h["tensors"], "tensors")
        self.shapes: list[list[int]] = []
        self.dtypes: list[str] = []
        self.roles: list[str] = []
        for i, t in enumerate(tensors):
            f = f"tensors[{i}]"
            _keys(t, f, TENSOR_KEYS)
            _str(t["name"], f"{f}.name")
            shape = _list(t["shape"], f"{f}.shape")
            if len(shape) > MAX_RANK:
                _fail(f"{f}.shape", f"rank {len(shape)} exceeds {MAX_RANK}")
            for j, d in enumerate(shape):
                _int(d, f"{f}.shape[{j}]", 1, MAX_ELEMENTS)
            if _numel(shape) > MAX_ELEMENTS:
                _fail(f"{f}.shape", f"{shape} has {_numel(shape)} elements, more than {MAX_ELEMENTS}")
            dtype = _str(t["dtype"], f"{f}.dtype", tuple(DTYPES))
            role = _str(t["role"], f"{f}.role", ROLES)
            offset = _int(t["offset"], f"{f}.offset")
            if role == "const":
                end = offset + _numel(shape) * DTYPES[dtype]
                if offset < 0 or offset % _ALIGN or end > self.blob_len:
                    _fail(f"{f}.offset", f"constant bytes [{offset}, {end}) are not a {_ALIGN}-byte "
                                         f"aligned range of the {self.blob_len}-byte blob")
            elif offset != -1:
                _fail(f"{f}.offset", f"must be -1 for a {role} tensor, got {offset}")
            self.shapes.append(shape)
            self.dtypes.append(dtype)
            self.roles.append(role)

    def _tid(self, v: Any, field: str) -> int:
        return _int(v, field, 0, len(self.shapes) - 1) if self.shapes else _fail(field, "no tensors")

    def _io(self) -> None:
        for key, role in (("inputs", "input"), ("outputs", "output")):
            ids = [self._tid(v, f"{key}[{i}]") for i, v in enumerate(_list(self.h[key], key))]
            if len(set(ids)) != len(ids):
                _fail(key, f"tensor ids repeat: {ids}")
            expected = [i for i, r in enumerate(self.roles) if r == role]
            if sorted(ids) != expected:
                _fail(key, f"lists tensors {sorted(ids)}, but the tensors with role {role!r} are {expected}")
        if not self.h["outputs"]:
            _fail("outputs", "a program needs at least one output")

    # ---------------------------------------------------------------- layers
    def _layers(self) -> list[tuple[int, ...]]:
        layers = _list(self.h["layers"], "layers")
        defined = {i for i, r in enumerate(self.roles) if r in ("input", "const")}
        extents = []
        kinds = layer_kinds()  # the operator families' (registered ones included)
        for li, layer in enumerate(layers):
            f = f"layers[{li}]"
            _keys(layer, f, LAYER_KEYS)
            _str(layer["name"], f"{f}.name")
            kind = _str(layer["kind"], f"{f}.kind", kinds)
            mode = _str(layer["mode"], f"{f}.mode", ("fp32", "int8"))
            family = family_of(kind)
            if mode not in family.modes:
                _fail(f"{f}.mode", f"int8 is a MAC-array mode, not available for {kind}")
            ins = [self._tid(v, f"{f}.inputs[{i}]") for i, v in enumerate(_list(layer["inputs"], f"{f}.inputs"))]
            for i, tid in enumerate(ins):
                if tid not in defined:
                    _fail(f"{f}.inputs[{i}]", f"tensor {tid} is read before any layer writes it")
            consts = _dict(layer["consts"], f"{f}.consts")
            for role, tid in consts.items():
                self._tid(tid, f"{f}.consts.{role}")
                if self.roles[tid] != "const":
                    _fail(f"{f}.consts.{role}", f"tensor {tid} has role {self.roles[tid]!r}, not 'const'")
            out = self._tid(layer["output"], f"{f}.output")
            if self.roles[out] not in ("temp", "output") or out in defined:
                _fail(f"{f}.output", f"tensor {out} (role {self.roles[out]!r}) cannot be written here: "
                                     f"only temp/output tensors, each by one layer")
            attrs = _dict(layer["attrs"], f"{f}.attrs")
            req, opt = family.attr_schema(kind, mode)
            _keys(attrs, f"{f}.attrs", req.keys(), opt.keys())
            for key, value in attrs.items():
                (req.get(key) or opt[key])(value, f"{f}.attrs.{key}")
            _int(layer["flops"], f"{f}.flops", 0)
            extent, gemm = family.check(self, f, kind, mode, ins, consts, out, attrs)
            self.layer_info.append((family, mode, gemm[2] if gemm is not None else None))
            if layer["gemm"] is not None:
                if gemm is None or _list(layer["gemm"], f"{f}.gemm", 3) != gemm:
                    _fail(f"{f}.gemm", f"{layer['gemm']!r:.60} does not match the layer's GEMM {gemm}")
            defined.add(out)
            extents.append(extent)
        for i, tid in enumerate(self.h["outputs"]):
            if tid not in defined:
                _fail(f"outputs[{i}]", f"tensor {tid} is never written by a layer")
        return extents

    def need(self, f: str, what: str, ids: list[int], count: int) -> None:
        if len(ids) != count:
            _fail(f, f"{what} needs {count} input(s), got {len(ids)}")

    def float32_only(self, f: str, what: str, ins: list[int], out: int, consts: dict, count: int) -> None:
        """``count`` float32 inputs, a float32 output and no constants (``f``: the layer's field)."""
        self.need(f"{f}.inputs", what, ins, count)
        for i, tid in enumerate(ins):
            self.dtype(f"{f}.inputs[{i}]", tid, ("float32",))
        self.dtype(f"{f}.output", out, ("float32",))
        self.consts(f, consts, set())

    def consts(self, f: str, consts: dict, required: set[str], optional: set[str] = frozenset()) -> None:
        _keys(consts, f"{f}.consts", required, optional)

    def dtype(self, f: str, tid: int, allowed: tuple[str, ...]) -> str:
        if self.dtypes[tid] not in allowed:
            _fail(f, f"tensor {tid} has dtype {self.dtypes[tid]}, expected {' or '.join(allowed)}")
        return self.dtypes[tid]

    def shape(self, f: str, tid: int, expected: list[int]) -> None:
        if self.shapes[tid] != expected:
            _fail(f, f"tensor {tid} has shape {self.shapes[tid]}, expected {expected}")

    def values(self, f: str, tid: int, lo: int, hi: int) -> None:
        """Integer constant ``tid`` holds values in ``[lo, hi]`` (read from the blob)."""
        if self.blob is None:
            return
        offset, dtype = self.h["tensors"][tid]["offset"], self.dtypes[tid]
        count = _numel(self.shapes[tid])
        values = np.frombuffer(self.blob, dtype=dtype, count=count, offset=offset)
        if count and (values.min() < lo or values.max() > hi):
            bad = values[(values < lo) | (values > hi)][0]
            _fail(f, f"value {int(bad)} is outside [{lo}, {hi}]")

    def rank(self, f: str, tid: int, lo: int, hi: int = MAX_RANK) -> list[int]:
        s = self.shapes[tid]
        if not lo <= len(s) <= hi:
            _fail(f, f"tensor {tid} has rank {len(s)} (shape {s}), expected {lo}..{hi}")
        return s

    broadcast = staticmethod(lambda *shapes: _broadcast(*shapes))

    # ---------------------------------------------------------------- layer mappings
    def _layer_mappings(self, extents: list[tuple[int, ...]]) -> None:
        kinds = [layer["kind"] for layer in self.h["layers"]]
        records = _list(self.h["mapping"].get("layers"), "mapping.layers", len(kinds))
        total = self.arch.total_pes
        for li, (record, kind, extent) in enumerate(zip(records, kinds, extents)):
            f = f"mapping.layers[{li}]"
            _keys(record, f, LAYER_MAPPING_KEYS, LAYER_MAPPING_OPTIONAL)
            arity, extra = tile_arity(kind), tile_arity_optional(kind)
            raw = record["tile"]
            long = extra and isinstance(raw, list) and arity < len(raw) <= arity + extra
            tile = _list(raw, f"{f}.tile", len(raw) if long else arity)
            for j, v in enumerate(tile):
                _int(v, f"{f}.tile[{j}]", 1, MAX_ELEMENTS)
            first, count = _list(record["pes"], f"{f}.pes", 2)
            _int(first, f"{f}.pes[0]", 0, total - 1)
            _int(count, f"{f}.pes[1]", 1, total - first)
            if "rotate" in record:
                _int(record["rotate"], f"{f}.rotate", 0, count - 1)
            cut = count_tiles(extent, tile)
            if cut > MAX_TILES:
                _fail(f"{f}.tile", f"{tile} cuts {cut} tiles, more than {MAX_TILES}")
            family, mode, k = self.layer_info[li]
            family.check_mapping(self.arch, f, mode, k, tile)


def validate_header(header: Any, version: int, blob_len: int,
                    blob: "memoryview | bytes | None" = None) -> None:
    """Check a parsed spinn program header; raise :class:`ProgramError` naming the first defect.

    Parameters
    ----------
    header : Any
        The JSON header as parsed (untrusted: any JSON value).
    version : int
        The format version of the binary header; the JSON's ``version`` must equal it.
    blob_len : int
        Length in bytes of the constant blob; constants must lie inside it.
    blob : memoryview or bytes, optional
        The blob itself: when given, integer constants with a limited range (requantization
        multipliers and shifts) are checked too.

    Raises
    ------
    ProgramError
        ``"<field>: <defect>"``, e.g. ``"layers[2].inputs[0]: 99 is above the maximum 11"``.
    """
    checker = _Checker(header, version, blob_len, blob)
    checker.layer_info = []  # per layer: (its family, mode, GEMM K or None)
    checker.run()
