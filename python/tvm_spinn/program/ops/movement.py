"""Data movement: ``reshape``, ``permute_dims`` and ``broadcast_to``, of any dtype a program
holds (bytes are bytes: int8 activations move like float32 ones).

- Arithmetic: none; the DMA engine gathers with strides (the timing model charges about one
  cycle per element of descriptor setup). A reshape of a contiguous value is a relabelling.
- Tiles: ``[elements]`` over the flattened output.
"""

from __future__ import annotations

import math

import numpy as np

from ..checks import check_int, check_list, fail
from ..model import Layer
from .base import FlatFamily, register

__all__ = ["Movement"]


def _axes(v, field: str) -> list[int]:
    return [check_int(x, f"{field}[{i}]", 0) for i, x in enumerate(check_list(v, field))]


class Movement(FlatFamily):
    """reshape, permute_dims and broadcast_to."""

    kinds = ("reshape", "permute_dims", "broadcast_to")
    priority = 60

    # -- partition and codegen ---------------------------------------------------------------
    def patterns(self, kit) -> list[tuple]:
        return [
            kit.binary("spinn.reshape", "relax.reshape", self._check_pattern),  # (x, shape)
            kit.binary("spinn.broadcast_to", "relax.broadcast_to", self._check_pattern),
            kit.unary("spinn.permute_dims", "relax.permute_dims", self._check_pattern),
        ]

    @staticmethod
    def _check_pattern(kit, op: str, ctx) -> bool:
        names = ("lhs",) if op in ("spinn.reshape", "spinn.broadcast_to") else ("input",)
        return kit.check_tensors(op, ctx, names, kit.SUPPORTED_DTYPES + kit.QUANTIZED_DTYPES)

    def lower(self, lowerer, name: str, kind: str, calls: list, env: dict, layer: Layer) -> None:
        call = calls[0][1]
        layer.inputs = [lowerer.operand(call.args[0], env)]
        if kind == "permute_dims":
            rank = len(lowerer.program.tensors[layer.inputs[0]].shape)
            axes = call.attrs.axes
            layer.attrs["axes"] = [int(a) for a in axes] if axes is not None else list(range(rank))[::-1]

    # -- validation -----------------------------------------------------------------------------
    def attr_schema(self, kind: str, mode: str):
        return ({"axes": _axes}, {}) if kind == "permute_dims" else ({}, {})

    def check(self, v, f, kind, mode, ins, consts, out, attrs):
        fo = f"{f}.output"
        v.need(f"{f}.inputs", kind, ins, 1)
        ishape, oshape = v.shapes[ins[0]], v.shapes[out]
        numel = math.prod(oshape)
        v.consts(f, consts, set())
        v.dtype(fo, out, (v.dtypes[ins[0]],))
        if kind == "reshape" and math.prod(ishape) != numel:
            fail(fo, f"reshape of {ishape} to {oshape} changes the element count")
        if kind == "broadcast_to" and v.broadcast(ishape, oshape) != oshape:
            fail(fo, f"{ishape} does not broadcast to {oshape}")
        if kind == "permute_dims":
            axes = attrs["axes"]
            if sorted(axes) != list(range(len(ishape))):
                fail(f"{f}.attrs.axes", f"{axes} is not a permutation of the {len(ishape)} input axes")
            v.shape(fo, out, [ishape[a] for a in axes])
        return (numel,), None

    # -- mapping ------------------------------------------------------------------------------
    def work(self, program, layer, arch):
        return 0, None

    def cycles_per_element(self, layer, arch):
        """Pure data movement: the DMA engine gathers with strides; ~1 cycle/element of setup."""
        return 1

    # -- functional simulator -----------------------------------------------------------------
    def prepare_tiles(self, runner) -> None:
        x = runner.env[runner.layer.inputs[0]]
        kind = runner.layer.kind
        if kind == "permute_dims":
            moved = np.transpose(x, runner.layer.attrs["axes"])
        elif kind == "broadcast_to":
            moved = np.broadcast_to(x, runner.out.shape)
        else:
            moved = x
        runner.flat_in = [np.ascontiguousarray(moved).reshape(-1)]

    def run_tile(self, runner, tile) -> None:
        (e0, e1), = tile.region
        runner.out.reshape(-1)[e0:e1] = runner.flat_in[0][e0:e1]

    def run_whole(self, program, index, layer, env, out):
        x = env[layer.inputs[0]]
        if layer.kind == "permute_dims":
            out[...] = np.transpose(x, layer.attrs["axes"])
        elif layer.kind == "broadcast_to":
            out[...] = np.broadcast_to(x, out.shape)
        elif x.dtype == out.dtype and x.flags.c_contiguous and x.flags.writeable:
            return x.reshape(out.shape)  # pure relabelling: a view (values are never written after they are made)
        else:
            out[...] = np.reshape(x, out.shape)
        return out

    def step(self, program, layer):
        tensors = program.tensors
        shape = tuple(tensors[layer.output].shape)
        dtype = np.dtype(tensors[layer.output].dtype)
        x_tid = layer.inputs[0]
        if layer.kind == "reshape":
            def step(program, env):  # a contiguous value is relabelled, never copied
                x = env[x_tid]
                if x.dtype == dtype and x.flags.c_contiguous and x.flags.writeable:
                    return x.reshape(shape)
                out = np.empty(shape, dtype=dtype)
                out[...] = np.reshape(x, shape)
                return out
            return step
        axes = layer.attrs["axes"] if layer.kind == "permute_dims" else None

        def step(program, env):
            out = np.empty(shape, dtype=dtype)
            x = env[x_tid]
            out[...] = np.transpose(x, axes) if axes is not None else x  # (assignment broadcasts)
            return out
        return step


register(Movement())
