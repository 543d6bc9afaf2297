"""Row operators: ``softmax`` and ``layer_norm`` over the last axis, ``mean`` over trailing axes.

- Arithmetic (Cortex-M4F, fp32): every sum is a sequential fp32 sum of one row, left to right
  (C++ kernels ``tvm_spinn.sim.row_sum_f32``, ``softmax_f32``, ``layer_norm_f32``); ``softmax``
  is ``e / sum(e)`` with ``e = exp(x - max(x))`` from the exp/log unit's model (the max: the
  row's first NaN if it has one);
  ``layer_norm`` is ``(x - mean) / sqrt(var + eps) * gamma + beta`` with ``mean = sum(x) / d``,
  ``var = sum((x - mean)^2) / d``; ``mean`` is ``sum / d``.
- Tiles: ``[rows]`` over the rows (everything but the normalized or reduced axes); a whole row
  lives on one PE.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ... import _lib
from ..checks import POSINT, check_bool, check_num, fail
from ..model import Layer
from .base import OpFamily, ceil_div, itemsize, register, working_budget

if TYPE_CHECKING:
    from ...target.arch import SpinnArch

__all__ = ["Rows", "smallest_row_tile_bytes"]

_F32 = np.float32


def smallest_row_tile_bytes(row: int, in_bytes: int = 4, out_bytes: int = 4, reduce: bool = False) -> int:
    """SRAM of one row of a softmax / layer_norm (``reduce=False``) or mean (``reduce=True``:
    one output per row), input and output double-buffered."""
    return 2 * (in_bytes * row + out_bytes * (1 if reduce else row))


def _row(program, layer: Layer) -> int:
    """Elements per row: the reduced trailing axes of a mean, else the last axis."""
    return layer.attrs["row"] if layer.kind == "mean" else program.tensors[layer.output].shape[-1]


def _rows(program, layer: Layer) -> int:
    n_out = int(np.prod(program.tensors[layer.output].shape, dtype=np.int64))
    return n_out if layer.kind == "mean" else n_out // _row(program, layer)


def _per_elem(kind: str, arch: "SpinnArch") -> float:
    """M4F operations per element (softmax: max, subtract, exp, sum, divide)."""
    return {"softmax": 3.0 + arch.exp_unit_cycles, "layer_norm": 6.0, "mean": 1.0}[kind]


def _nonneg_num(v, field: str) -> float:
    if check_num(v, field) < 0:
        fail(field, f"{v} must be >= 0")
    return float(v)


def _row_sum(x: np.ndarray) -> np.ndarray:
    """Sequential fp32 sum of each row of ``x`` [rows, row]."""
    out = np.empty(x.shape[0], dtype=_F32)
    x = np.ascontiguousarray(x, dtype=_F32)
    _lib._func("tvm_spinn.sim.row_sum_f32")(_lib._input(x), out)
    return out


def _ffi_in(x: np.ndarray) -> np.ndarray:
    """``x`` as a contiguous float32 kernel input (read-only constants as writable-flagged views)."""
    return _lib._input(np.ascontiguousarray(x, dtype=_F32))


_NONE = np.zeros(0, dtype=_F32)


def _softmax(x: np.ndarray) -> np.ndarray:
    """Rows ``x`` [rows, row]: ``e / sum(e)``, ``e = exp(x - max)`` (C++ ``softmax_f32``)."""
    out = np.empty(x.shape, dtype=_F32)
    _lib._func("tvm_spinn.sim.softmax_f32")(_ffi_in(x), out, 0)
    return out


def _layer_norm(x: np.ndarray, eps, gamma, beta) -> np.ndarray:
    """Rows ``x`` [rows, row] normalized, then scaled and shifted (C++ ``layer_norm_f32``)."""
    out = np.empty(x.shape, dtype=_F32)
    _lib._func("tvm_spinn.sim.layer_norm_f32")(
        _ffi_in(x), _NONE if gamma is None else _ffi_in(gamma), _NONE if beta is None else _ffi_in(beta),
        float(eps), out, 0)
    return out


class Rows(OpFamily):
    """softmax, layer_norm and mean: one row per PE at a time."""

    kinds = ("softmax", "layer_norm", "mean")
    priority = 30

    # -- partition and codegen ---------------------------------------------------------------
    def patterns(self, kit) -> list[tuple]:
        from tvm.relax.dpl import is_const, is_op, wildcard

        gamma, beta, x = is_const(), is_const(), wildcard()
        layer_norm = is_op("relax.nn.layer_norm")(x, gamma, beta)
        return [
            kit.entry("spinn.layer_norm", layer_norm, {"input": x, "gamma": gamma, "beta": beta, "root": layer_norm},
                      self._check_pattern),
            kit.unary("spinn.softmax", "relax.nn.softmax", self._check_pattern),
            kit.unary("spinn.mean", "relax.mean", self._check_pattern),
        ]

    @staticmethod
    def _check_pattern(kit, op: str, ctx) -> bool:
        if not kit.check_tensors(op, ctx, ("input", "gamma", "beta")):
            return False
        root = ctx.annotated_expr["root"]
        shape = kit.static_shape(root)
        attrs = root.attrs
        if op == "spinn.mean":
            in_shape = kit.static_shape(ctx.annotated_expr["input"])
            rank = len(in_shape)
            axes = sorted(int(a) % rank for a in attrs.axis) if attrs.axis is not None else list(range(rank))
            if axes != list(range(rank - len(axes), rank)):
                return kit.refuse(op, root, f"mean over axes {axes} (only trailing axes)")
            row = int(np.prod(in_shape[rank - len(axes):], dtype=np.int64))
            return kit.check_fits(op, root, smallest_row_tile_bytes(row, reduce=True), f"a row of {row} elements")
        if op == "spinn.softmax":
            axis = int(attrs.axis)
            if axis not in (-1, len(shape) - 1):
                return kit.refuse(op, root, f"softmax over axis {axis} (only the last axis)")
        else:
            axes = [int(a) % len(shape) for a in attrs.axes]
            if axes != [len(shape) - 1]:
                return kit.refuse(op, root, f"layer_norm over axes {axes} (only the last axis)")
        # One whole row (in, out, double buffered) must fit a PE.
        return kit.check_fits(op, root, smallest_row_tile_bytes(shape[-1]), f"a row of {shape[-1]} elements")

    def lower(self, lowerer, name: str, kind: str, calls: list, env: dict, layer: Layer) -> None:
        call = calls[0][1]
        layer.inputs = [lowerer.operand(call.args[0], env)]
        if kind == "layer_norm":
            layer.consts["gamma"] = lowerer.operand(call.args[1], env)
            layer.consts["beta"] = lowerer.operand(call.args[2], env)
            layer.attrs["epsilon"] = float(call.attrs.epsilon)
            layer.attrs["center"] = bool(call.attrs.center)
            layer.attrs["scale"] = bool(call.attrs.scale)
        elif kind == "mean":
            in_shape = lowerer.program.tensors[layer.inputs[0]].shape
            axes = call.attrs.axis
            n_axes = len(axes) if axes is not None else len(in_shape)
            layer.attrs["row"] = int(np.prod(in_shape[len(in_shape) - n_axes:], dtype=np.int64))

    # -- validation -----------------------------------------------------------------------------
    def attr_schema(self, kind: str, mode: str):
        if kind == "layer_norm":
            return {"epsilon": _nonneg_num}, {"center": check_bool, "scale": check_bool}
        if kind == "mean":
            return {"row": POSINT}, {}
        return {}, {}

    def check(self, v, f, kind, mode, ins, consts, out, attrs):
        fo = f"{f}.output"
        v.need(f"{f}.inputs", kind, ins, 1)
        ishape, oshape = v.shapes[ins[0]], v.shapes[out]
        v.dtype(f"{f}.inputs[0]", ins[0], ("float32",))
        v.dtype(fo, out, ("float32",))
        numel = math.prod(oshape)
        if kind == "mean":
            v.consts(f, consts, set())
            row = attrs["row"]
            tails = {math.prod(ishape[len(ishape) - n:]) for n in range(len(ishape) + 1)}
            if row not in tails or math.prod(ishape) != numel * row:
                fail(f"{f}.attrs.row", f"{row} is not the size of trailing axes of {ishape} "
                                       f"reducing to {oshape}")
            return (numel,), None
        v.consts(f, consts, {"gamma", "beta"} if kind == "layer_norm" else set())
        v.shape(fo, out, ishape)
        if kind == "layer_norm":
            for role in ("gamma", "beta"):
                v.dtype(f"{f}.consts.{role}", consts[role], ("float32",))
                v.shape(f"{f}.consts.{role}", consts[role], ishape[-1:])
        return (numel // oshape[-1] if oshape else 1,), None  # tiles hold rows of the last axis

    # -- tiles as data ------------------------------------------------------------------------
    def region_extent(self, program, layer):
        return (_rows(program, layer),)

    # -- mapping ------------------------------------------------------------------------------
    def work(self, program, layer, arch):
        return int(_rows(program, layer) * _row(program, layer) * _per_elem(layer.kind, arch)), None

    def smallest_tile_bytes(self, program, layer, arch):
        ie = sum(itemsize(program, tid) for tid in layer.inputs)
        oe = itemsize(program, layer.output)
        return smallest_row_tile_bytes(_row(program, layer), ie, oe, reduce=layer.kind == "mean")

    def choose_tile(self, program, layer, arch, pes, naive):
        ie = sum(itemsize(program, tid) for tid in layer.inputs)
        oe = itemsize(program, layer.output)
        cap = max(1, working_budget(arch) // (2 * (ie + oe) * _row(program, layer)))
        return [max(1, min(cap, ceil_div(_rows(program, layer), pes)))]

    def tile_costs(self, program, layer, arch, tile, lo, hi):
        ie = sum(itemsize(program, tid) for tid in layer.inputs)
        oe = itemsize(program, layer.output)
        row = _row(program, layer)
        r = (hi - lo)[:, 0]
        n = r * row
        n_res = r if layer.kind == "mean" else n
        w_b = row * sum(itemsize(program, tid) for tid in layer.consts.values())
        cycles = np.ceil(n * _per_elem(layer.kind, arch) * arch.m4f_elementwise_cycles / 2)
        return 2 * (ie * n + oe * n_res), ie * n, w_b, oe * n_res, cycles

    # -- functional simulator -----------------------------------------------------------------
    def prepare_tiles(self, runner) -> None:
        x = runner.env[runner.layer.inputs[0]]
        row = runner.layer.attrs["row"] if runner.layer.kind == "mean" else x.shape[-1]
        runner.rows_in = np.ascontiguousarray(x).reshape(-1, row)

    def run_tile(self, runner, tile) -> None:
        (r0, r1), = tile.region
        layer = runner.layer
        x = runner.rows_in[r0:r1]
        if layer.kind == "mean":
            runner.out.reshape(-1)[r0:r1] = _row_sum(x) / _F32(x.shape[-1])
            return
        out_rows = runner.out.reshape(-1, runner.out.shape[-1])
        if layer.kind == "softmax":
            out_rows[r0:r1] = _softmax(x)
            return
        gamma = runner.env[layer.consts["gamma"]] if layer.attrs.get("scale", True) else None
        beta = runner.env[layer.consts["beta"]] if layer.attrs.get("center", True) else None
        out_rows[r0:r1] = _layer_norm(x, _F32(layer.attrs["epsilon"]), gamma, beta)

    def whole_region(self, layer, out):
        return ((0, out.size if layer.kind == "mean" else out.size // max(out.shape[-1], 1)),)

    def step(self, program, layer):
        """The whole output at once: the same rows and operations as :meth:`run_tile`."""
        tensors = program.tensors
        shape = tuple(tensors[layer.output].shape)
        if np.dtype(tensors[layer.output].dtype) != _F32:
            return None
        x_tid = layer.inputs[0]
        rows_shape = (-1, int(layer.attrs["row"]) if layer.kind == "mean" else int(tensors[x_tid].shape[-1]))
        if layer.kind == "mean":
            d = _F32(rows_shape[1])
            return lambda program, env: (_row_sum(np.ascontiguousarray(env[x_tid]).reshape(rows_shape)) / d).reshape(shape)
        if layer.kind == "softmax":
            return lambda program, env: _softmax(np.reshape(env[x_tid], rows_shape)).reshape(shape)
        eps = _F32(layer.attrs["epsilon"])
        # prepared once: contiguous float32 views the FFI accepts (constants are read-only)
        gamma = _ffi_in(program.constants[layer.consts["gamma"]]) if layer.attrs.get("scale", True) else None
        beta = _ffi_in(program.constants[layer.consts["beta"]]) if layer.attrs.get("center", True) else None
        return lambda program, env: _layer_norm(np.reshape(env[x_tid], rows_shape), eps, gamma, beta).reshape(shape)


register(Rows())
