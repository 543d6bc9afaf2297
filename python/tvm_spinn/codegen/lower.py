"""Lower one partitioned Relax function (``Codegen="spinn"``) to a layer graph.

The result is a :class:`tvm_spinn.program.Program` with tensors and layers but no tiles yet;
the mapping compiler (:mod:`tvm_spinn.mapping`) adds tiles, placement, schedule and timing.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant

from ..program import Layer, Program, TensorDesc
from ..program.quant import QUANT_RANGES, quantize_multiplier, to_signed

__all__ = ["lower_function", "LoweringError"]


class LoweringError(ValueError):
    """A composite function the spinn layer set cannot express (names the composite)."""


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


def _prim_float(value) -> float:
    inner = getattr(value, "value", value)  # relax.PrimValue -> FloatImm -> float
    return float(getattr(inner, "value", inner))


def _ints(values) -> list[int]:
    return [int(v) for v in values]


class _Lowerer:
    def __init__(self, symbol: str, arch: dict):
        self.program = Program(symbol=symbol, arch=arch, tensors=[], inputs=[], outputs=[], layers=[])
        self.var_ids: dict[relax.Var, int] = {}
        self.const_ids: dict[Constant, int] = {}

    # -- tensors --------------------------------------------------------------------------
    def _new_tensor(self, name: str, expr: relax.Expr, role: str) -> int:
        ty = expr.ty
        if not isinstance(ty, relax.TensorType):
            raise LoweringError(f"{name}: only tensors can cross a spinn region, got {ty}")
        self.program.tensors.append(TensorDesc(name=name, shape=_shape(expr), dtype=str(ty.dtype), role=role))
        return len(self.program.tensors) - 1

    def const(self, expr: Constant) -> int:
        if expr not in self.const_ids:
            tid = self._new_tensor(f"const{len(self.const_ids)}", expr, "const")
            value = _host_view(expr.value)
            self.program.constants[tid] = value.reshape(self.program.tensors[tid].shape)
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
            self.program.inputs.append(tid)
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
                        raise LoweringError(f"unexpected call {callee} in spinn region {self.program.symbol}")
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
            desc = self.program.tensors[tid]
            if desc.role != "temp":
                raise LoweringError(f"region output {desc.name} must be computed in the region")
            desc.role = "output"
            self.program.outputs.append(tid)
        return self.program

    def _lower_composite(self, comp: relax.Function, args: list[int], out: int) -> None:
        name = str(comp.attrs["Composite"])
        env = {p: a for p, a in zip(comp.params, args)}
        calls = []
        for block in comp.body.blocks:
            for binding in block.bindings:
                if not isinstance(binding.value, relax.Call):
                    raise LoweringError(f"{name}: unexpected binding {type(binding.value).__name__}")
                calls.append((binding.var, binding.value))
        ops = [c.op.name for _, c in calls]
        kind = name.split(".", 1)[1]
        layer = Layer(name=f"{kind}_{len(self.program.layers)}", kind=kind, inputs=[], output=out)
        main = calls[0][1]
        if kind.startswith(("qconv2d", "qdense", "qmatmul")):
            self._lower_qgemm(layer, name, calls, env)
        elif kind in ("quantize", "dequantize"):
            self._lower_qdq(layer, main, env)
        elif kind.startswith(("conv2d", "dense")):
            base = "conv2d" if kind.startswith("conv2d") else "dense"
            layer.kind = base
            layer.inputs = [self.operand(main.args[0], env)]
            layer.consts["weight"] = self.operand(main.args[1], env)
            layer.attrs["relu"] = "relax.nn.relu" in ops
            if "relax.add" in ops:
                add = calls[ops.index("relax.add")][1]
                bias = add.args[1] if not add.args[1].same_as(calls[0][0]) else add.args[0]
                layer.consts["bias"] = self._bias(bias, out, base, name)
            if base == "conv2d":
                a = main.attrs
                layer.attrs.update(
                    strides=_ints(a.strides), padding=_ints(a.padding), dilation=_ints(a.dilation),
                    groups=int(a.groups),
                )
        elif kind in ("matmul", "add", "subtract", "multiply", "divide", "add_relu"):
            layer.inputs = [self.operand(x, env) for x in main.args]
            if kind == "add_relu":
                layer.kind, layer.attrs["relu"] = "add", True
        elif kind == "layer_norm":
            layer.inputs = [self.operand(main.args[0], env)]
            layer.consts["gamma"] = self.operand(main.args[1], env)
            layer.consts["beta"] = self.operand(main.args[2], env)
            layer.attrs["epsilon"] = float(main.attrs.epsilon)
            layer.attrs["center"] = bool(main.attrs.center)
            layer.attrs["scale"] = bool(main.attrs.scale)
        elif kind == "softmax":
            layer.inputs = [self.operand(main.args[0], env)]
        elif kind == "mean":
            layer.inputs = [self.operand(main.args[0], env)]
            in_shape = self.program.tensors[layer.inputs[0]].shape
            axes = main.attrs.axis
            n_axes = len(axes) if axes is not None else len(in_shape)
            layer.attrs["row"] = int(np.prod(in_shape[len(in_shape) - n_axes:], dtype=np.int64))
        elif kind in ("max_pool2d", "avg_pool2d"):
            a = main.attrs
            layer.inputs = [self.operand(main.args[0], env)]
            layer.attrs.update(
                pool_size=_ints(a.pool_size), strides=_ints(a.strides), padding=_ints(a.padding),
                dilation=_ints(a.dilation), count_include_pad=bool(getattr(a, "count_include_pad", False)),
            )
        elif kind == "adaptive_avg_pool2d":
            layer.inputs = [self.operand(main.args[0], env)]
            in_shape = self.program.tensors[layer.inputs[0]].shape
            out_shape = self.program.tensors[out].shape
            kh, kw = in_shape[2] // out_shape[2], in_shape[3] // out_shape[3]
            layer.kind = "avg_pool2d"
            layer.attrs.update(pool_size=[kh, kw], strides=[kh, kw], padding=[0, 0, 0, 0],
                               dilation=[1, 1], count_include_pad=True)
        elif kind in ("relu", "gelu", "gelu_tanh", "sigmoid", "tanh", "reshape", "broadcast_to"):
            layer.inputs = [self.operand(main.args[0], env)]
        elif kind == "clip":
            layer.inputs = [self.operand(main.args[0], env)]
            layer.attrs["min"], layer.attrs["max"] = (_prim_float(a) for a in main.args[1:3])
        elif kind == "permute_dims":
            layer.inputs = [self.operand(main.args[0], env)]
            rank = len(self.program.tensors[layer.inputs[0]].shape)
            axes = main.attrs.axes
            layer.attrs["axes"] = _ints(axes) if axes is not None else list(range(rank))[::-1]
        else:
            raise LoweringError(f"composite {name} has no spinn layer lowering")
        self.program.layers.append(layer)

    # -- int8 -------------------------------------------------------------------------------
    def _add_const(self, name: str, value: np.ndarray) -> int:
        tid = len(self.program.tensors)
        value = np.ascontiguousarray(value)
        self.program.tensors.append(TensorDesc(name=f"{name}{tid}", shape=list(value.shape),
                                               dtype=str(value.dtype), role="const"))
        self.program.constants[tid] = value
        return tid

    def _lower_qgemm(self, layer: Layer, name: str, calls: list, env: dict) -> None:
        """An int8 GEMM (see :mod:`tvm_spinn.program.quant` for the arithmetic)."""
        by_var = dict(calls)
        ops = {c.op.name: c for _, c in calls}
        main = next(c for _, c in calls if c.op.name in ("relax.nn.conv2d", "relax.matmul"))
        xdq, wdq = by_var[main.args[0]], by_var[main.args[1]]
        base = "conv2d" if main.op.name == "relax.nn.conv2d" else ("dense" if layer.kind.startswith("qdense") else "matmul")
        layer.kind, layer.mode = base, "int8"
        layer.name = f"q{base}_{len(self.program.layers)}"  # e.g. qconv2d_4 (fused epilogue in attrs)
        out_shape = _shape(main)
        channels = out_shape[1] if base == "conv2d" else out_shape[-1]

        def qparams(dq, per_channel: bool) -> tuple[np.ndarray, np.ndarray, str]:
            scale = np.asarray(dq.args[1].value.numpy(), dtype=np.float64).reshape(-1)
            zero = dq.args[2].value.numpy().astype(np.int64).reshape(-1)
            dtype = str(dq.args[0].ty.dtype)
            zero = zero - (128 if dtype == "uint8" else 0)  # the array sees uint8 with its top bit flipped
            if per_channel:
                scale, zero = np.broadcast_to(scale, (channels,)), np.broadcast_to(zero, (channels,))
            return scale, zero, dtype

        sx, zx, xdtype = qparams(xdq, False)
        sw, zw, wdtype = qparams(wdq, base != "matmul")
        layer.inputs = [self.operand(xdq.args[0], env)]
        layer.attrs.update(x_zero=int(zx[0]), x_flip=xdtype == "uint8", relu="relax.nn.relu" in ops)
        if base == "matmul":  # both operands are activations, per-tensor
            layer.inputs.append(self.operand(wdq.args[0], env))
            layer.attrs.update(b_zero=int(zw[0]), b_flip=wdtype == "uint8")
            s_acc = np.broadcast_to(sx[0] * sw[0], (channels,))
        else:
            weight = wdq.args[0]
            if not isinstance(weight, Constant):
                raise LoweringError(f"{name}: the int8 weight must be a constant")
            layer.consts["weight"] = self._add_const("qweight", to_signed(weight.value.numpy()))
            if np.any(zw != 0):
                layer.consts["w_zero"] = self._add_const("wzero", zw.astype(np.int32))
            if base == "conv2d":
                a = main.attrs
                layer.attrs.update(strides=_ints(a.strides), padding=_ints(a.padding),
                                   dilation=_ints(a.dilation), groups=int(a.groups))
            s_acc = sx[0] * sw
        bias = None
        if "relax.add" in ops:
            add = ops["relax.add"]
            b = add.args[1] if isinstance(add.args[1], Constant) else add.args[0]
            bias = np.broadcast_to(b.value.numpy().astype(np.float64).reshape(-1), (channels,))
        quant = ops.get("relax.quantize")
        if quant is None:
            layer.attrs["out"] = "float32"
            layer.consts["scale"] = self._add_const("qscale", s_acc.astype(np.float32))
            if bias is not None:
                layer.consts["bias"] = self._add_const("bias", bias.astype(np.float32))
            return
        ydtype = str(quant.attrs.out_dtype)
        sy = float(np.asarray(quant.args[1].value.numpy(), dtype=np.float64).reshape(-1)[0])
        zy = int(quant.args[2].value.numpy().reshape(-1)[0])
        lo, hi = QUANT_RANGES[ydtype]
        mult, shift = np.zeros(channels, np.int32), np.zeros(channels, np.int32)
        for c in range(channels):
            try:
                mult[c], shift[c] = quantize_multiplier(float(s_acc[c]) / sy)
            except ValueError as err:
                raise LoweringError(f"{name}: channel {c}: {err}") from None
        with np.errstate(divide="ignore", invalid="ignore"):
            bias_q = np.where(s_acc > 0, np.rint((bias if bias is not None else 0.0) / s_acc), 0.0)
        if np.any(np.abs(bias_q) >= 2**31):
            raise LoweringError(f"{name}: the quantized bias does not fit 32 bits (scales too small)")
        layer.attrs.update(out=ydtype, y_zero=zy, y_min=max(lo, zy) if layer.attrs["relu"] else lo, y_max=hi)
        layer.consts["bias_q"] = self._add_const("biasq", bias_q.astype(np.int32))
        layer.consts["multiplier"] = self._add_const("mult", mult)
        layer.consts["shift"] = self._add_const("shift", shift)

    def _lower_qdq(self, layer: Layer, call: relax.Call, env: dict) -> None:
        """quantize (fp32 -> int8/uint8) or dequantize, per-tensor or along ``axis``."""
        layer.inputs = [self.operand(call.args[0], env)]
        rank = len(_shape(call.args[0]))
        scale = call.args[1].value.numpy().astype(np.float32).reshape(-1)
        zero = call.args[2].value.numpy().astype(np.int32).reshape(-1)
        layer.attrs["axis"] = int(call.attrs.axis) % rank if rank else 0
        layer.consts["scale"] = self._add_const("qscale", scale)
        layer.consts["zero"] = self._add_const("qzero", zero)

    def _bias(self, bias: relax.Expr, out: int, base: str, name: str) -> int:
        if not isinstance(bias, Constant):
            raise LoweringError(f"{name}: bias must be a constant")
        channels = self.program.tensors[out].shape[1 if base == "conv2d" else -1]
        value = np.broadcast_to(bias.value.numpy().reshape(-1), (channels,)).astype(np.float32)
        return self._add_const("bias", value)


def lower_function(func: relax.Function, symbol: str, arch: dict) -> Program:
    """Lower a merged spinn region to an (unmapped) :class:`Program`.

    Parameters
    ----------
    func : relax.Function
        A function with ``Codegen="spinn"`` whose body calls ``Composite="spinn.*"`` functions.
    symbol : str
        Its global symbol (the name the VM calls).
    arch : dict
        ``SpinnArch.to_dict()`` of the target system.
    """
    return _Lowerer(symbol, arch).lower(func)
