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

from .model import ProgramError
from .tiles import chunk_length, count_tiles, tile_arity

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
_QRANGE = {"int8": (-128, 127), "uint8": (0, 255)}
_ALIGN = 64

HEADER_KEYS = frozenset({"version", "symbol", "arch", "tensors", "inputs", "outputs", "layers",
                         "timing", "mapping", "memory"})
TENSOR_KEYS = frozenset({"name", "shape", "dtype", "role", "offset"})
LAYER_KEYS = frozenset({"name", "kind", "inputs", "consts", "output", "attrs", "gemm", "flops", "mode"})
LAYER_MAPPING_KEYS = frozenset({"tile", "pes"})

_GEMM = ("conv2d", "dense", "matmul")
_BINARY = ("add", "subtract", "multiply", "divide")
_UNARY = ("relu", "gelu", "gelu_tanh", "sigmoid", "tanh")
_ROWS = ("softmax", "layer_norm", "mean")
_POOLS = ("max_pool2d", "avg_pool2d")
_MOVES = ("reshape", "permute_dims", "broadcast_to")
_QDQ = ("quantize", "dequantize")


def _fail(field: str, message: str) -> None:
    raise ProgramError(f"{field}: {message}")


# -- JSON value checks ---------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return type(v) is int  # JSON integers; bool is a subclass of int and is refused


def _int(v: Any, field: str, lo: int | None = None, hi: int | None = None) -> int:
    if not _is_int(v):
        _fail(field, f"expected an integer, got {v!r:.60}")
    if lo is not None and v < lo:
        _fail(field, f"{v} is below the minimum {lo}")
    if hi is not None and v > hi:
        _fail(field, f"{v} is above the maximum {hi}")
    return v


def _bool(v: Any, field: str) -> bool:
    if type(v) is not bool:
        _fail(field, f"expected true/false, got {v!r:.60}")
    return v


def _num(v: Any, field: str) -> float:
    try:
        ok = type(v) in (int, float) and math.isfinite(float(v))
    except OverflowError:  # an integer beyond the float range
        ok = False
    if not ok:
        _fail(field, f"expected a finite number, got {v!r:.60}")
    return float(v)


def _str(v: Any, field: str, choices: tuple[str, ...] | None = None) -> str:
    if type(v) is not str:
        _fail(field, f"expected a string, got {v!r:.60}")
    if choices is not None and v not in choices:
        _fail(field, f"{v!r:.60} is not one of {list(choices)}")
    return v


def _list(v: Any, field: str, length: int | None = None) -> list:
    if type(v) is not list:
        _fail(field, f"expected a list, got {type(v).__name__}")
    if length is not None and len(v) != length:
        _fail(field, f"expected {length} entries, got {len(v)}")
    return v


def _dict(v: Any, field: str) -> dict:
    if type(v) is not dict:
        _fail(field, f"expected an object, got {type(v).__name__}")
    return v


def _keys(d: Any, field: str, required: frozenset | set, optional: frozenset | set = frozenset()) -> dict:
    d = _dict(d, field)
    missing = sorted(set(required) - d.keys())
    if missing:
        _fail(field, f"missing key(s) {missing}")
    unknown = sorted(d.keys() - set(required) - set(optional))
    if unknown:
        _fail(field, f"unknown key(s) {[str(k)[:40] for k in unknown]}")
    return d


def _ints(v: Any, field: str, length: int, lo: int) -> list[int]:
    return [_int(x, f"{field}[{i}]", lo) for i, x in enumerate(_list(v, field, length))]


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


# -- attribute schemas ---------------------------------------------------------------------------
_Check = Callable[[Any, str], Any]
_POS2: _Check = lambda v, f: _ints(v, f, 2, 1)  # noqa: E731
_PAD4: _Check = lambda v, f: _ints(v, f, 4, 0)  # noqa: E731
_POSINT: _Check = lambda v, f: _int(v, f, 1)  # noqa: E731
_NONNEG: _Check = lambda v, f: _int(v, f, 0)  # noqa: E731
_ZERO: _Check = lambda v, f: _int(v, f, -128, 255)  # noqa: E731
_CONV = {"strides": _POS2, "padding": _PAD4, "dilation": _POS2, "groups": _POSINT}
_POOL = {"pool_size": _POS2, "strides": _POS2, "padding": _PAD4, "dilation": _POS2}
_INT8_GEMM = {"x_zero": _ZERO, "x_flip": _bool, "relu": _bool,
              "out": lambda v, f: _str(v, f, ("float32", "int8", "uint8"))}
_REQUANT = {"y_zero": _ZERO, "y_min": _ZERO, "y_max": _ZERO}
_RELU = {"relu": _bool}


def _nonneg_num(v: Any, field: str) -> float:
    if _num(v, field) < 0:
        _fail(field, f"{v} must be >= 0")
    return float(v)


def _attr_schema(kind: str, mode: str) -> tuple[dict[str, _Check], dict[str, _Check]]:
    """``(required, optional)`` attributes of a layer kind in a mode."""
    if mode == "int8":
        req = dict(_INT8_GEMM)
        if kind == "conv2d":
            req.update(_CONV)
        if kind == "matmul":
            req.update(b_zero=_ZERO, b_flip=_bool)
        return req, dict(_REQUANT)
    if kind == "conv2d":
        return dict(_CONV), dict(_RELU)
    if kind in ("dense", "matmul") or kind in _BINARY or kind in _UNARY:
        return {}, dict(_RELU)
    if kind == "clip":
        return {"min": _num, "max": _num}, dict(_RELU)
    if kind == "layer_norm":
        return {"epsilon": _nonneg_num}, {"center": _bool, "scale": _bool}
    if kind == "mean":
        return {"row": _POSINT}, {}
    if kind in _POOLS:
        return dict(_POOL), {"count_include_pad": _bool}
    if kind == "permute_dims":
        return {"axes": lambda v, f: [_int(x, f"{f}[{i}]", 0) for i, x in enumerate(_list(v, f))]}, {}
    if kind in _QDQ:
        return {"axis": _NONNEG}, {}
    return {}, {}  # softmax, reshape, broadcast_to


_KINDS = _GEMM + _BINARY + _UNARY + ("clip",) + _ROWS + _POOLS + _MOVES + _QDQ


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
        for li, layer in enumerate(layers):
            f = f"layers[{li}]"
            _keys(layer, f, LAYER_KEYS)
            _str(layer["name"], f"{f}.name")
            kind = _str(layer["kind"], f"{f}.kind", _KINDS)
            mode = _str(layer["mode"], f"{f}.mode", ("fp32", "int8"))
            if mode == "int8" and kind not in _GEMM:
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
            req, opt = _attr_schema(kind, mode)
            _keys(attrs, f"{f}.attrs", req.keys(), opt.keys())
            for key, value in attrs.items():
                (req.get(key) or opt[key])(value, f"{f}.attrs.{key}")
            _int(layer["flops"], f"{f}.flops", 0)
            self.layer_index = li
            extent, gemm = self._kind(f, kind, mode, ins, consts, out, attrs)
            if gemm is not None:
                self.gemm_k[li] = gemm[2]
            if layer["gemm"] is not None:
                if gemm is None or _list(layer["gemm"], f"{f}.gemm", 3) != gemm:
                    _fail(f"{f}.gemm", f"{layer['gemm']!r:.60} does not match the layer's GEMM {gemm}")
            defined.add(out)
            extents.append(extent)
        for i, tid in enumerate(self.h["outputs"]):
            if tid not in defined:
                _fail(f"outputs[{i}]", f"tensor {tid} is never written by a layer")
        return extents

    def _need(self, f: str, what: str, ids: list[int], count: int) -> None:
        if len(ids) != count:
            _fail(f, f"{what} needs {count} input(s), got {len(ids)}")

    def _consts(self, f: str, consts: dict, required: set[str], optional: set[str] = frozenset()) -> None:
        _keys(consts, f"{f}.consts", required, optional)

    def _dtype(self, f: str, tid: int, allowed: tuple[str, ...]) -> str:
        if self.dtypes[tid] not in allowed:
            _fail(f, f"tensor {tid} has dtype {self.dtypes[tid]}, expected {' or '.join(allowed)}")
        return self.dtypes[tid]

    def _shape(self, f: str, tid: int, expected: list[int]) -> None:
        if self.shapes[tid] != expected:
            _fail(f, f"tensor {tid} has shape {self.shapes[tid]}, expected {expected}")

    def _values(self, f: str, tid: int, lo: int, hi: int) -> None:
        """Integer constant ``tid`` holds values in ``[lo, hi]`` (read from the blob)."""
        if self.blob is None:
            return
        offset, dtype = self.h["tensors"][tid]["offset"], self.dtypes[tid]
        count = _numel(self.shapes[tid])
        values = np.frombuffer(self.blob, dtype=dtype, count=count, offset=offset)
        if count and (values.min() < lo or values.max() > hi):
            bad = values[(values < lo) | (values > hi)][0]
            _fail(f, f"value {int(bad)} is outside [{lo}, {hi}]")

    def _rank(self, f: str, tid: int, lo: int, hi: int = MAX_RANK) -> list[int]:
        s = self.shapes[tid]
        if not lo <= len(s) <= hi:
            _fail(f, f"tensor {tid} has rank {len(s)} (shape {s}), expected {lo}..{hi}")
        return s

    def _kind(self, f: str, kind: str, mode: str, ins: list[int], consts: dict, out: int,
              attrs: dict) -> tuple[tuple[int, ...], list[int] | None]:
        """Check one layer's operands; returns its tile index space and GEMM ``[m, n, k]``."""
        fo = f"{f}.output"
        oshape = self.shapes[out]
        numel = _numel(oshape)
        if kind in _GEMM:
            return self._gemm(f, kind, mode, ins, consts, out, attrs)
        self._need(f"{f}.inputs", kind, ins, 2 if kind in _BINARY else 1)
        ishape = self.shapes[ins[0]]
        if kind in _MOVES:
            self._consts(f, consts, set())
            self._dtype(fo, out, (self.dtypes[ins[0]],))
            if kind == "reshape" and _numel(ishape) != numel:
                _fail(fo, f"reshape of {ishape} to {oshape} changes the element count")
            if kind == "broadcast_to" and _broadcast(ishape, oshape) != oshape:
                _fail(fo, f"{ishape} does not broadcast to {oshape}")
            if kind == "permute_dims":
                axes = attrs["axes"]
                if sorted(axes) != list(range(len(ishape))):
                    _fail(f"{f}.attrs.axes", f"{axes} is not a permutation of the {len(ishape)} input axes")
                self._shape(fo, out, [ishape[a] for a in axes])
            return (numel,), None
        if kind in _QDQ:
            self._consts(f, consts, {"scale", "zero"})
            src, dst = (("float32",), ("int8", "uint8")) if kind == "quantize" else (("int8", "uint8", "int32"), ("float32",))
            self._dtype(f"{f}.inputs[0]", ins[0], src)
            self._dtype(fo, out, dst)
            self._shape(fo, out, ishape)
            self._dtype(f"{f}.consts.scale", consts["scale"], ("float32",))
            self._dtype(f"{f}.consts.zero", consts["zero"], ("int32",))
            n = _numel(self.shapes[consts["scale"]])
            if _numel(self.shapes[consts["zero"]]) != n:
                _fail(f"{f}.consts.zero", f"has {_numel(self.shapes[consts['zero']])} values, the scale {n}")
            if n != 1:
                axis = attrs["axis"]
                if axis >= len(ishape) or ishape[axis] != n:
                    _fail(f"{f}.attrs.axis", f"{n} per-channel scales do not match axis {axis} of {ishape}")
            return (numel,), None
        for i, tid in enumerate(ins):
            self._dtype(f"{f}.inputs[{i}]", tid, ("float32",))
        self._dtype(fo, out, ("float32",))
        if kind in _BINARY:
            self._consts(f, consts, set())
            b = _broadcast(ishape, self.shapes[ins[1]])
            if b is None:
                _fail(f"{f}.inputs", f"shapes {ishape} and {self.shapes[ins[1]]} do not broadcast")
            self._shape(fo, out, b)
            return (numel,), None
        if kind in _UNARY or kind in ("clip", "softmax"):
            self._consts(f, consts, set())
            self._shape(fo, out, ishape)
            if kind == "softmax":  # tiles hold rows of the last axis
                return (numel // oshape[-1] if oshape else 1,), None
            return (numel,), None
        if kind == "layer_norm":
            self._consts(f, consts, {"gamma", "beta"})
            self._shape(fo, out, ishape)
            for role in ("gamma", "beta"):
                self._dtype(f"{f}.consts.{role}", consts[role], ("float32",))
                self._shape(f"{f}.consts.{role}", consts[role], ishape[-1:])
            return (numel // oshape[-1] if oshape else 1,), None
        if kind == "mean":
            self._consts(f, consts, set())
            row = attrs["row"]
            tails = {_numel(ishape[len(ishape) - n:]) for n in range(len(ishape) + 1)}
            if row not in tails or _numel(ishape) != numel * row:
                _fail(f"{f}.attrs.row", f"{row} is not the size of trailing axes of {ishape} "
                                        f"reducing to {oshape}")
            return (numel,), None
        # pools
        self._consts(f, consts, set())
        n, c, h, w = self._rank(f"{f}.inputs[0]", ins[0], 4, 4)
        kh, kw = attrs["pool_size"]
        (sh, sw), (dh, dw), (pt, pl, pb, pr) = attrs["strides"], attrs["dilation"], attrs["padding"]
        oh, ow = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1, (w + pl + pr - dw * (kw - 1) - 1) // sw + 1
        if oh < 1 or ow < 1:
            _fail(f"{f}.attrs.pool_size", f"the window is larger than the padded {h}x{w} input")
        self._shape(fo, out, [n, c, oh, ow])
        return (n * c, oh), None

    def _gemm(self, f: str, kind: str, mode: str, ins: list[int], consts: dict, out: int,
              attrs: dict) -> tuple[tuple[int, ...], list[int]]:
        fo = f"{f}.output"
        int8 = mode == "int8"
        act = ("int8", "uint8") if int8 else ("float32",)
        self._need(f"{f}.inputs", kind, ins, 2 if kind == "matmul" else 1)
        for i, tid in enumerate(ins):
            self._dtype(f"{f}.inputs[{i}]", tid, act)
        if kind == "conv2d":
            n, c, h, w = self._rank(f"{f}.inputs[0]", ins[0], 4, 4)
            wt = consts.get("weight")
            if wt is None:
                _fail(f"{f}.consts", "missing key(s) ['weight']")
            o, cg, kh, kw = self._rank(f"{f}.consts.weight", wt, 4, 4)
            groups = attrs["groups"]
            if c % groups or o % groups or c // groups != cg:
                _fail(f"{f}.attrs.groups", f"{groups} groups do not split input {self.shapes[ins[0]]} "
                                           f"and weight {self.shapes[wt]}")
            (sh, sw), (dh, dw), (pt, pl, pb, pr) = attrs["strides"], attrs["dilation"], attrs["padding"]
            oh = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
            ow = (w + pl + pr - dw * (kw - 1) - 1) // sw + 1
            if oh < 1 or ow < 1:
                _fail(f"{f}.consts.weight", f"the kernel is larger than the padded {h}x{w} input")
            self._shape(fo, out, [n, o, oh, ow])
            batch, m, nn, k, channels = n * groups, o // groups, oh * ow, cg * kh * kw, o
        elif kind == "dense":
            x = self._rank(f"{f}.inputs[0]", ins[0], 1)
            wt = consts.get("weight")
            if wt is None:
                _fail(f"{f}.consts", "missing key(s) ['weight']")
            kk, nn = self._rank(f"{f}.consts.weight", wt, 2, 2)
            if x[-1] != kk:
                _fail(f"{f}.consts.weight", f"{self.shapes[wt]} does not multiply input {x}")
            self._shape(fo, out, x[:-1] + [nn])
            batch, m, k, channels = 1, _numel(x[:-1]), kk, nn
        else:
            a = self._rank(f"{f}.inputs[0]", ins[0], 2)
            b = self._rank(f"{f}.inputs[1]", ins[1], 2)
            bs = _broadcast(a[:-2], b[:-2])
            if a[-1] != b[-2] or bs is None:
                _fail(f"{f}.inputs", f"{a} and {b} do not multiply")
            self._shape(fo, out, bs + [a[-2], b[-1]])
            batch, m, nn, k, channels = _numel(bs), a[-2], b[-1], a[-1], b[-1]
        if kind != "matmul":
            self._dtype(f"{f}.consts.weight", consts["weight"], ("int8",) if int8 else ("float32",))
        if int8:
            self._int8_epilogue(f, kind, ins, consts, out, attrs, channels, k)
        else:
            self._dtype(fo, out, ("float32",))
            self._consts(f, consts, set() if kind == "matmul" else {"weight"},
                         set() if kind == "matmul" else {"bias"})
            if "bias" in consts:
                self._dtype(f"{f}.consts.bias", consts["bias"], ("float32",))
                self._shape(f"{f}.consts.bias", consts["bias"], [channels])
        return (batch, m, nn), [m, nn, k]

    def _int8_epilogue(self, f: str, kind: str, ins: list[int], consts: dict, out: int, attrs: dict,
                       channels: int, k: int) -> None:
        if attrs["x_flip"] != (self.dtypes[ins[0]] == "uint8"):
            _fail(f"{f}.attrs.x_flip", f"must be {self.dtypes[ins[0]] == 'uint8'} for a {self.dtypes[ins[0]]} input")
        if kind == "matmul" and attrs["b_flip"] != (self.dtypes[ins[1]] == "uint8"):
            _fail(f"{f}.attrs.b_flip", f"must be {self.dtypes[ins[1]] == 'uint8'} for a {self.dtypes[ins[1]]} input")
        for key in ("x_zero", "b_zero"):
            if key in attrs and not -128 <= attrs[key] <= 127:
                _fail(f"{f}.attrs.{key}", f"{attrs[key]} is outside the signed int8 range")
        weight = set() if kind == "matmul" else {"weight"}
        odt = attrs["out"]
        self._dtype(f"{f}.output", out, (odt,))
        if odt == "float32":
            self._consts(f, consts, weight | {"scale"}, {"bias", "w_zero"})
            if set(_REQUANT) & attrs.keys():
                _fail(f"{f}.attrs", f"y_zero/y_min/y_max belong to a requantizing epilogue, output is {odt}")
            roles = {"scale": "float32", "bias": "float32"}
        else:
            self._consts(f, consts, weight | {"bias_q", "multiplier", "shift"}, {"w_zero"})
            missing = sorted(set(_REQUANT) - attrs.keys())
            if missing:
                _fail(f"{f}.attrs", f"missing key(s) {missing} of the requantizing epilogue")
            lo, hi = _QRANGE[odt]
            if not lo <= attrs["y_min"] <= attrs["y_max"] <= hi or not lo <= attrs["y_zero"] <= hi:
                _fail(f"{f}.attrs.y_min", f"y_zero/y_min/y_max must lie in [{lo}, {hi}] with y_min <= y_max")
            roles = {"bias_q": "int32", "multiplier": "int32", "shift": "int32"}
        roles["w_zero"] = "int32"
        for role, dtype in roles.items():
            if role in consts:
                self._dtype(f"{f}.consts.{role}", consts[role], (dtype,))
                self._shape(f"{f}.consts.{role}", consts[role], [channels])
        if odt != "float32":
            # Fixed-point multiplier ranges of program/quant.py: a shift outside [1, 62] makes
            # the rounding term 1 << (shift - 1) negative or the shift exceed the int64 width.
            self._values(f"{f}.consts.multiplier", consts["multiplier"], 0, (1 << 31) - 1)
            self._values(f"{f}.consts.shift", consts["shift"], 1, 62)
        self.int8_layers.append((self.layer_index, k))

    # ---------------------------------------------------------------- layer mappings
    def _layer_mappings(self, extents: list[tuple[int, ...]]) -> None:
        from .gemm import safe_k_chunk

        kinds = [layer["kind"] for layer in self.h["layers"]]
        records = _list(self.h["mapping"].get("layers"), "mapping.layers", len(kinds))
        total = self.arch.total_pes
        int8 = dict(self.int8_layers)
        for li, (record, kind, extent) in enumerate(zip(records, kinds, extents)):
            f = f"mapping.layers[{li}]"
            _keys(record, f, LAYER_MAPPING_KEYS)
            tile = _list(record["tile"], f"{f}.tile", tile_arity(kind))
            for j, v in enumerate(tile):
                _int(v, f"{f}.tile[{j}]", 1, MAX_ELEMENTS)
            first, count = _list(record["pes"], f"{f}.pes", 2)
            _int(first, f"{f}.pes[0]", 0, total - 1)
            _int(count, f"{f}.pes[1]", 1, total - first)
            cut = count_tiles(extent, tile)
            if cut > MAX_TILES:
                _fail(f"{f}.tile", f"{tile} cuts {cut} tiles, more than {MAX_TILES}")
            if li in int8:
                k = int8[li]
                chunk = chunk_length(k, tile[2])
                limit = safe_k_chunk(self.arch)
                if chunk > limit:
                    _fail(f"{f}.tile[2]", f"k-chunks of {chunk} products overflow the "
                                          f"{self.arch.acc_bits}-bit accumulator (at most {limit})")


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
    checker.int8_layers = []  # (layer index, K) of int8 GEMMs
    checker.gemm_k = {}  # layer index -> K of every GEMM
    checker.run()
