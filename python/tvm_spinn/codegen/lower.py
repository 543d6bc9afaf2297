"""Lower one partitioned Relax function (``Codegen="spinn"``) to a layer graph.

The result is a :class:`tvm_spinn.program.Program` with tensors and layers but no tiles yet;
the mapping compiler (:mod:`tvm_spinn.mapping`) adds tiles, placement, schedule and timing.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from tvm import relax
from tvm.ir.expr import Constant

from ..program import Program, TensorDesc
from ..program.model import LayerDraft
from ..program.ops import LoweringError, family_for_composite
from ..target.arch import SpinnArch

__all__ = ["lower_function", "LoweringError"]


def _host_view(tensor) -> np.ndarray:
    """A read-only numpy view of a constant's data, without a copy.

    The program only reads its constants (``Program.to_bytes`` copies them into the blob), and
    a BERT-base build would otherwise copy every offloaded weight once more here. The view keeps
    the tensor alive; tensors numpy cannot view (not on the host, not contiguous) are copied."""
    try:
        value = np.from_dlpack(tensor)
    except (TypeError, ValueError, BufferError, RuntimeError):
        return np.ascontiguousarray(tensor.numpy())
    if not value.flags.c_contiguous:
        return np.ascontiguousarray(value)
    value.flags.writeable = False
    return value


def _shape(expr: relax.Expr) -> list[int]:
    return [int(d.value) for d in expr.ty.shape.values]


class _Lowerer:
    """Collects one region's tensors, constants and layers; :meth:`lower` returns them as a
    (frozen) :class:`Program`."""

    def __init__(self, symbol: str, arch: SpinnArch):
        self.symbol, self.arch = symbol, arch
        self.tensors: list[TensorDesc] = []
        self.inputs: list[int] = []
        self.outputs: list[int] = []
        self.layers: list = []
        self.constants: dict[int, np.ndarray] = {}
        self.var_ids: dict[relax.Var, int] = {}
        self.const_ids: dict[Constant, int] = {}

    # -- tensors --------------------------------------------------------------------------
    def _new_tensor(self, name: str, expr: relax.Expr, role: str) -> int:
        ty = expr.ty
        if not isinstance(ty, relax.TensorType):
            raise LoweringError(f"{name}: only tensors can cross a spinn region, got {ty}")
        self.tensors.append(TensorDesc(name=name, shape=_shape(expr), dtype=str(ty.dtype), role=role))
        return len(self.tensors) - 1

    def const(self, expr: Constant) -> int:
        if expr not in self.const_ids:
            tid = self._new_tensor(f"const{len(self.const_ids)}", expr, "const")
            value = _host_view(expr.value)
            self.constants[tid] = value.reshape(self.tensors[tid].shape)
            self.const_ids[expr] = tid
        return self.const_ids[expr]

    def operand(self, expr: relax.Expr, env: dict) -> int:
        if isinstance(expr, Constant):
            return self.const(expr)
        if isinstance(expr, relax.Var) and expr in env:
            return env[expr]
        raise LoweringError(f"unsupported operand {type(expr).__name__} in a spinn region")

    # -- function -------------------------------------------------------------------------
    def lower(self, func: relax.Function) -> Program:
        for param in func.params:
            tid = self._new_tensor(param.name, param, "input")
            self.var_ids[param] = tid
            self.inputs.append(tid)
        body = func.body
        local_funcs: dict[relax.Var, relax.Function] = {}
        for block in body.blocks:
            for binding in block.bindings:
                value = binding.value
                if isinstance(value, relax.Function):
                    local_funcs[binding.var] = value
                    continue
                if isinstance(value, relax.Call):
                    callee = value.op
                    comp = local_funcs.get(callee) if isinstance(callee, relax.Var) else None
                    if comp is None:
                        raise LoweringError(f"unexpected call {callee} in spinn region {self.symbol}")
                    args = [self.operand(a, self.var_ids) for a in value.args]
                    out = self._new_tensor(binding.var.name, binding.var, "temp")
                    self._lower_composite(comp, args, out)
                    self.var_ids[binding.var] = out
                elif isinstance(value, relax.Tuple):
                    self.var_ids[binding.var] = [self.operand(f, self.var_ids) for f in value.fields]
                elif isinstance(value, relax.Var):
                    self.var_ids[binding.var] = self.var_ids[value]
                else:
                    raise LoweringError(f"unsupported binding {type(value).__name__} in spinn region")
        result = body.body
        outs = result.fields if isinstance(result, relax.Tuple) else [result]
        for out in outs:
            tid = self.operand(out, self.var_ids)
            if isinstance(tid, list):
                raise LoweringError("nested tuple outputs are not supported")
            desc = self.tensors[tid]
            if desc.role != "temp":
                raise LoweringError(f"region output {desc.name} must be computed in the region")
            self.tensors[tid] = replace(desc, role="output")
            self.outputs.append(tid)
        return Program(symbol=self.symbol, arch=self.arch, tensors=self.tensors, inputs=self.inputs,
                       outputs=self.outputs, layers=self.layers, constants=self.constants)

    def _lower_composite(self, comp: relax.Function, args: list[int], out: int) -> None:
        name = str(comp.attrs["Composite"])
        env = {p: a for p, a in zip(comp.params, args)}
        calls = []
        for block in comp.body.blocks:
            for binding in block.bindings:
                if not isinstance(binding.value, relax.Call):
                    raise LoweringError(f"{name}: unexpected binding {type(binding.value).__name__}")
                calls.append((binding.var, binding.value))
        kind = name.split(".", 1)[1]
        layer = LayerDraft(name=f"{kind}_{len(self.layers)}", kind=kind, inputs=[], output=out)
        family = family_for_composite(kind)
        if family is None:
            raise LoweringError(f"composite {name} has no spinn layer lowering")
        family.lower(self, name, kind, calls, env, layer)
        self.layers.append(layer.freeze())

    def add_const(self, name: str, value: np.ndarray) -> int:
        """A new constant tensor holding ``value`` (made contiguous); returns its id."""
        tid = len(self.tensors)
        value = np.ascontiguousarray(value)
        self.tensors.append(TensorDesc(name=f"{name}{tid}", shape=list(value.shape),
                                               dtype=str(value.dtype), role="const"))
        self.constants[tid] = value
        return tid


def lower_function(func: relax.Function, symbol: str, arch: SpinnArch) -> Program:
    """Lower a merged spinn region to an (unmapped) :class:`Program`.

    Parameters
    ----------
    func : relax.Function
        A function with ``Codegen="spinn"`` whose body calls ``Composite="spinn.*"`` functions.
    symbol : str
        Its global symbol (the name the VM calls).
    arch : SpinnArch
        The target system.
    """
    return _Lowerer(symbol, arch).lower(func)
