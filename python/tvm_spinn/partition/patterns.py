"""Pattern table for offloading to spinn: prefixed names and ``_check_*`` predicates.

Each entry is ``(name, pattern, annotations, check)``. Names are prefixed ``spinn.`` and match
the layer kinds the mapping compiler knows (``tvm_spinn.program.LAYER_KINDS``). A predicate
returns False (and logs why) when the hardware cannot hold the op: dynamic shapes, dtypes other
than float32, layouts other than NCHW/OIHW, or a working set that does not fit one PE's SRAM.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import tvm
from tvm import relax
from tvm.relax import dpl
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard
from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.transform import PatternCheckContext

from ..mapping.tiling import smallest_gemm_tile_bytes, smallest_pool_tile_bytes, smallest_row_tile_bytes
from ..target.arch import SpinnArch

__all__ = ["spinn_patterns", "patterns_for", "required_ops", "FallbackReason", "SUPPORTED_DTYPES",
           "QUANTIZED_DTYPES"]

LOG = logging.getLogger("tvm_spinn.partition")
SUPPORTED_DTYPES = ("float32",)
QUANTIZED_DTYPES = ("int8", "uint8")  # what the MAC array reads (uint8 by flipping the top bit)
_DATA_MOVEMENT = ("spinn.reshape", "spinn.permute_dims", "spinn.broadcast_to")


class FallbackReason:
    """Collects why matched ops were refused; the partitioner reports them."""

    def __init__(self) -> None:
        self.reasons: dict[str, str] = {}

    def refuse(self, op: str, expr: relax.Expr, reason: str) -> bool:
        shape = _shape_str(expr)
        key = f"{op}{shape}"
        if key not in self.reasons:
            self.reasons[key] = reason
            LOG.warning("spinn: %s %s stays on the fallback target: %s", op, shape, reason)
        return False


def _shape_str(expr: relax.Expr) -> str:
    ty = getattr(expr, "ty", None)
    shape = getattr(ty, "shape", None)
    return f"[{', '.join(str(d) for d in shape.values)}]" if shape is not None else "[?]"


def _static_shape(expr: relax.Expr) -> tuple[int, ...] | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = []
    for d in ty.shape.values:
        if not hasattr(d, "value"):
            return None
        dims.append(int(d.value))
    return tuple(dims)


def _dtype(expr: relax.Expr) -> str:
    return str(expr.ty.dtype)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Checker:
    """``_check_*`` predicates bound to one architecture and one reason log."""

    def __init__(self, arch: SpinnArch, log: FallbackReason):
        self.arch = arch
        self.log = log

    # -- shared ---------------------------------------------------------------------------
    def _check_tensors(self, op: str, ctx: PatternCheckContext, names: tuple[str, ...],
                       dtypes: tuple[str, ...] = SUPPORTED_DTYPES) -> bool:
        root = ctx.annotated_expr["root"]
        for name in ("root",) + names:
            if name not in ctx.annotated_expr:
                continue
            expr = ctx.annotated_expr[name]
            if not isinstance(expr.ty, relax.TensorType):
                return self.log.refuse(op, root, f"operand '{name}' is not a tensor")
            if _static_shape(expr) is None:
                return self.log.refuse(op, root, f"operand '{name}' has a dynamic shape")
            if name == "root" and _static_shape(expr) == ():
                return self.log.refuse(op, root, "a 0-d (scalar) result is host work")
            if not self._check_nonempty(op, root, name, expr):
                return False
            if _dtype(expr) not in dtypes:
                return self.log.refuse(
                    op, root, f"operand '{name}' has dtype {_dtype(expr)} (supported: {dtypes})"
                )
        return True

    def _check_nonempty(self, op: str, root: relax.Expr, name: str, expr: relax.Expr) -> bool:
        # A zero-size tensor (e.g. batch 0, or a GEMM with K = 0) means no work for the PEs: the
        # host returns the empty (or, for K = 0, bias-only) result; a program holds no
        # zero-size tensors and the tiler has no tile to cut.
        shape = _static_shape(expr)
        if shape is not None and 0 in shape:
            return self.log.refuse(op, root, f"operand '{name}' has zero-size shape {shape} (host work)")
        return True

    def _check_gemm_fits(self, op: str, root: relax.Expr, k: int, elem_bytes: int) -> bool:
        # The tiler's own smallest tile (mapping.tiling): what passes here always tiles.
        return self._check_fits(op, root, smallest_gemm_tile_bytes(self.arch, k, elem_bytes, elem_bytes),
                                f"the smallest GEMM tile (K={k})")

    def _check_fits(self, op: str, root: relax.Expr, min_bytes: int, what: str) -> bool:
        budget = self.arch.tile_sram_bytes
        if min_bytes > budget:
            return self.log.refuse(
                op, root, f"{what} needs {min_bytes} bytes of SRAM, a PE has {budget} for tiles"
            )
        return True

    # -- per op ---------------------------------------------------------------------------
    def _check_conv2d(self, op: str, ctx: PatternCheckContext) -> bool:
        if not self._check_tensors(op, ctx, ("input", "weight", "bias")):
            return False
        root = ctx.annotated_expr["root"]
        attrs = ctx.annotated_expr["conv"].attrs
        if attrs.data_layout != "NCHW" or attrs.kernel_layout != "OIHW":
            return self.log.refuse(op, root, f"layout {attrs.data_layout}/{attrs.kernel_layout} (need NCHW/OIHW)")
        if str(attrs.out_dtype) not in ("", "None", "float32"):
            return self.log.refuse(op, root, f"out_dtype {attrs.out_dtype}")
        if "bias" in ctx.annotated_expr and not self._check_channel_bias(op, ctx, axis=1, rank=4):
            return False
        wshape = _static_shape(ctx.annotated_expr["weight"])
        return self._check_gemm_fits(op, root, wshape[1] * wshape[2] * wshape[3], 4)

    def _check_channel_bias(self, op: str, ctx: PatternCheckContext, axis: int, rank: int) -> bool:
        root = ctx.annotated_expr["root"]
        out_shape = _static_shape(ctx.annotated_expr["main"])
        bshape = _static_shape(ctx.annotated_expr["bias"])
        channels = out_shape[axis]
        padded = (1,) * (rank - len(bshape)) + tuple(bshape)
        expect = tuple(channels if i == axis % rank else 1 for i in range(rank))
        if padded != expect and _numel(bshape) != 1:
            return self.log.refuse(op, root, f"bias shape {bshape} is not per-channel {expect}")
        return True

    def _check_dense(self, op: str, ctx: PatternCheckContext) -> bool:
        if not self._check_tensors(op, ctx, ("input", "weight", "bias")):
            return False
        root = ctx.annotated_expr["root"]
        ashape = _static_shape(ctx.annotated_expr["input"])
        wshape = _static_shape(ctx.annotated_expr["weight"])
        if len(wshape) != 2 or len(ashape) < 1:
            return self.log.refuse(op, root, f"weight rank {len(wshape)} (need a 2-D constant)")
        if "bias" in ctx.annotated_expr:
            oshape = _static_shape(ctx.annotated_expr["main"])
            bshape = _static_shape(ctx.annotated_expr["bias"])
            if tuple(d for d in bshape if d != 1) not in ((), (oshape[-1],)) or bshape[-1] not in (1, oshape[-1]):
                return self.log.refuse(op, root, f"bias shape {bshape} is not per-output-feature")
        return self._check_gemm_fits(op, root, wshape[0], 4)

    def _check_matmul(self, op: str, ctx: PatternCheckContext) -> bool:
        if not self._check_tensors(op, ctx, ("lhs", "rhs")):
            return False
        root = ctx.annotated_expr["root"]
        a = _static_shape(ctx.annotated_expr["lhs"])
        b = _static_shape(ctx.annotated_expr["rhs"])
        if len(a) < 2 or len(b) < 2:
            return self.log.refuse(op, root, "matmul operands must be at least 2-D")
        return self._check_gemm_fits(op, root, a[-1], 4)

    def _check_elementwise(self, op: str, ctx: PatternCheckContext) -> bool:
        names = ("lhs",) if op in ("spinn.reshape", "spinn.broadcast_to") else ("lhs", "rhs", "input")
        if op in _DATA_MOVEMENT:  # bytes are bytes: int8 activations move like fp32 ones
            return self._check_tensors(op, ctx, names, SUPPORTED_DTYPES + QUANTIZED_DTYPES)
        return self._check_tensors(op, ctx, names)

    def _check_clip(self, op: str, ctx: PatternCheckContext) -> bool:
        # clamp_min/clamp_max/hardsigmoid import as clip(x, lo, +inf) / clip(x, -inf, hi);
        # a spinn program holds finite attributes only (its header is strict JSON).
        root = ctx.annotated_expr["root"]
        for bound in root.args[1:3]:
            inner = getattr(bound, "value", bound)
            value = float(getattr(inner, "value", inner))
            if not math.isfinite(value):
                return self.log.refuse(op, root, f"clip bound {value} is not finite")
        return self._check_elementwise(op, ctx)

    def _check_pool2d(self, op: str, ctx: PatternCheckContext) -> bool:
        if not self._check_tensors(op, ctx, ("input",)):
            return False
        root = ctx.annotated_expr["root"]
        attrs = root.attrs
        if attrs.layout != "NCHW" or attrs.out_layout != "NCHW":
            return self.log.refuse(op, root, f"layout {attrs.layout} (need NCHW)")
        if getattr(attrs, "ceil_mode", False):
            return self.log.refuse(op, root, "ceil_mode=True")
        if op == "spinn.adaptive_avg_pool2d":
            ishape = _static_shape(ctx.annotated_expr["input"])
            oshape = _static_shape(root)
            if ishape[2] % oshape[2] or ishape[3] % oshape[3]:
                return self.log.refuse(op, root, f"adaptive pool {ishape[2:]}->{oshape[2:]} is not uniform")
            pool_h, dil_h, pad_w = ishape[2] // oshape[2], 1, 0
        else:
            pool_h, dil_h, pad_w = int(attrs.pool_size[0]), int(attrs.dilation[0]), int(attrs.padding[1]) + int(attrs.padding[3])
        in_w, out_w = _static_shape(ctx.annotated_expr["input"])[3], _static_shape(root)[3]
        need = smallest_pool_tile_bytes(in_w, out_w, pool_h, dil_h, pad_w)
        return self._check_fits(op, root, need, f"one output row of a {in_w}-wide plane")

    def _check_row_op(self, op: str, ctx: PatternCheckContext) -> bool:
        if not self._check_tensors(op, ctx, ("input", "gamma", "beta")):
            return False
        root = ctx.annotated_expr["root"]
        shape = _static_shape(root)
        attrs = root.attrs
        if op == "spinn.mean":
            in_shape = _static_shape(ctx.annotated_expr["input"])
            rank = len(in_shape)
            axes = sorted(int(a) % rank for a in attrs.axis) if attrs.axis is not None else list(range(rank))
            if axes != list(range(rank - len(axes), rank)):
                return self.log.refuse(op, root, f"mean over axes {axes} (only trailing axes)")
            row = _numel(in_shape[rank - len(axes):])
            return self._check_fits(op, root, smallest_row_tile_bytes(row, reduce=True), f"a row of {row} elements")
        if op == "spinn.softmax":
            axis = int(attrs.axis)
            if axis not in (-1, len(shape) - 1):
                return self.log.refuse(op, root, f"softmax over axis {axis} (only the last axis)")
        else:
            axes = [int(a) % len(shape) for a in attrs.axes]
            if axes != [len(shape) - 1]:
                return self.log.refuse(op, root, f"layer_norm over axes {axes} (only the last axis)")
        # One whole row (in, out, double buffered) must fit a PE.
        return self._check_fits(op, root, smallest_row_tile_bytes(shape[-1]), f"a row of {shape[-1]} elements")

    # -- int8 (QDQ) -------------------------------------------------------------------------
    def _check_qparams(self, op: str, root: relax.Expr, ctx: PatternCheckContext, scale: str, zero: str,
                       channels: int | None, what: str) -> bool:
        """Scale/zero point constants: scalars, or one per channel when ``channels`` is given."""
        s, z = ctx.annotated_expr[scale], ctx.annotated_expr[zero]
        ns, nz = _numel(_static_shape(s)), _numel(_static_shape(z))
        allowed = (1,) if channels is None else (1, channels)
        if ns not in allowed or nz not in allowed:
            kind = "per-tensor" if channels is None else f"per-tensor or per-channel ({channels})"
            return self.log.refuse(op, root, f"{what} quantization has {ns} scales / {nz} zero points "
                                             f"(spinn supports {kind})")
        if _dtype(s) != "float32":
            return self.log.refuse(op, root, f"{what} scale has dtype {_dtype(s)} (need float32)")
        return True

    def _check_quantized(self, op: str, root: relax.Expr, expr: relax.Expr, what: str) -> bool:
        if _static_shape(expr) is None:
            return self.log.refuse(op, root, f"{what} has a dynamic shape")
        if _dtype(expr) not in QUANTIZED_DTYPES:
            return self.log.refuse(op, root, f"{what} is quantized to {_dtype(expr)} (the MAC array "
                                             f"takes {'/'.join(QUANTIZED_DTYPES)})")
        return True

    def _check_dq_axis(self, op: str, root: relax.Expr, ctx: PatternCheckContext, dq: str, scale: str,
                       axis: int) -> bool:
        call = ctx.annotated_expr[dq]
        rank = len(_static_shape(call.args[0]))
        if _numel(_static_shape(ctx.annotated_expr[scale])) > 1 and int(call.attrs.axis) % rank != axis % rank:
            return self.log.refuse(op, root, f"per-channel weights along axis {int(call.attrs.axis)} "
                                             f"(need the output-channel axis {axis % rank})")
        if str(call.attrs.out_dtype) != "float32":
            return self.log.refuse(op, root, f"dequantize to {call.attrs.out_dtype}")
        return True

    def _check_qgemm(self, op: str, ctx: PatternCheckContext) -> bool:
        """``gemm(dequantize(xq), dequantize(wq))`` [+ bias] [relu] [quantize] on the MAC array."""
        ann = ctx.annotated_expr
        root = ann["root"]
        main = ann["main"]
        if _static_shape(main) is None or _static_shape(root) is None:
            return self.log.refuse(op, root, "dynamic shape")
        for name in ("root", "main", "xq", "wq"):
            if not self._check_nonempty(op, root, name, ann[name]):
                return False
        is_conv, is_dense = op.startswith("spinn.qconv2d"), op.startswith("spinn.qdense")
        out_shape = _static_shape(main)
        channels = out_shape[1] if is_conv else out_shape[-1]
        for q, s, z, what in (("xq", "sx", "zx", "activation"), ("wq", "sw", "zw", "weight")):
            if not self._check_quantized(op, root, ann[q], what):
                return False
            per_channel = channels if (what == "weight" and (is_conv or is_dense or len(_static_shape(ann[q])) >= 2)) else None
            if not self._check_qparams(op, root, ctx, s, z, per_channel, what):
                return False
        if not self._check_dq_axis(op, root, ctx, "xdq", "sx", -1):
            return False
        w_axis = 0 if is_conv else -1
        if not self._check_dq_axis(op, root, ctx, "wdq", "sw", w_axis):
            return False
        if is_conv:
            attrs = ann["main"].attrs
            if attrs.data_layout != "NCHW" or attrs.kernel_layout != "OIHW":
                return self.log.refuse(op, root, f"layout {attrs.data_layout}/{attrs.kernel_layout} (need NCHW/OIHW)")
            wshape = _static_shape(ann["wq"])
            if not self._check_gemm_fits(op, root, wshape[1] * wshape[2] * wshape[3], 1):
                return False
        elif is_dense and len(_static_shape(ann["wq"])) != 2:
            return self.log.refuse(op, root, "weight must be a 2-D constant")
        elif not is_dense and (len(_static_shape(ann["xq"])) < 2 or len(_static_shape(ann["wq"])) < 2):
            return self.log.refuse(op, root, "matmul operands must be at least 2-D")
        if not is_conv:
            k = _static_shape(ann["wq"])[0] if is_dense else _static_shape(ann["xq"])[-1]
            if not self._check_gemm_fits(op, root, k, 1):
                return False
        if str(getattr(main.attrs, "out_dtype", "")) not in ("", "None", "float32", "void"):
            return self.log.refuse(op, root, f"out_dtype {main.attrs.out_dtype}")
        if "bias" in ann:
            if _dtype(ann["bias"]) != "float32":
                return self.log.refuse(op, root, f"bias dtype {_dtype(ann['bias'])}")
            if is_conv and not self._check_channel_bias(op, ctx, axis=1, rank=4):
                return False
            bshape = _static_shape(ann["bias"])
            if not is_conv and (tuple(d for d in bshape if d != 1) not in ((), (channels,)) or bshape[-1] not in (1, channels)):
                return self.log.refuse(op, root, f"bias shape {bshape} is not per-output-feature")
        if "quant" in ann:
            if str(ann["quant"].attrs.out_dtype) not in QUANTIZED_DTYPES:
                return self.log.refuse(op, root, f"output quantized to {ann['quant'].attrs.out_dtype}")
            if not self._check_qparams(op, root, ctx, "sy", "zy", None, "output"):
                return False
        return True

    def _check_qdq(self, op: str, ctx: PatternCheckContext) -> bool:
        """Stand-alone quantize (fp32 -> int8/uint8) or dequantize on the M4F."""
        ann = ctx.annotated_expr
        root = ann["root"]
        x = ann["input"]
        shape = _static_shape(x)
        if shape is None or _static_shape(root) is None:
            return self.log.refuse(op, root, "dynamic shape")
        quantized = root if op == "spinn.quantize" else x
        if not self._check_quantized(op, root, quantized, "tensor"):
            return False
        other = x if op == "spinn.quantize" else root
        if _dtype(other) != "float32":
            return self.log.refuse(op, root, f"{'input' if op == 'spinn.quantize' else 'output'} dtype {_dtype(other)}")
        channels = shape[int(root.attrs.axis) % len(shape)] if shape else 1
        return self._check_qparams(op, root, ctx, "scale", "zero", channels, "tensor")


def _epilogue(main: DFPattern, ann: dict, bias: bool, relu: bool) -> DFPattern:
    """Wrap a GEMM pattern in the optional constant bias add and ReLU (annotated in ``ann``)."""
    pat = main
    if bias:
        ann["bias"] = b = is_const()
        pat = is_op("relax.add")(pat, b)
    if relu:
        pat = is_op("relax.nn.relu")(pat)
    return pat


def _gemm_patterns(prefix: str, op: str, check: Callable) -> list:
    """``op(x, W const)`` with optional constant bias add and ReLU: four patterns, largest first."""
    out = []
    for bias in (True, False):
        for relu in (True, False):
            data, weight = wildcard(), is_const()
            main = is_op(op)(data, weight)
            # "conv" is the conv2d call itself (its attrs are checked); "main" is the GEMM output.
            ann = {"input": data, "weight": weight, "conv": main, "main": main}
            ann["root"] = pat = _epilogue(main, ann, bias, relu)
            name = prefix + ("_bias" if bias else "") + ("_relu" if relu else "")
            out.append((name, pat, ann, _bind(check, name)))
    return out


def _qgemm_patterns(prefix: str, op: str, check: Callable, weight_const: bool) -> list:
    """``op(dequantize(xq), dequantize(wq))`` with optional bias, ReLU and output ``quantize``.

    Eight patterns, largest first. With ``weight_const`` the weight is an int8 constant (conv2d,
    dense); otherwise both operands are activations (matmul, no bias/ReLU variants).
    """
    out = []
    for requant in (True, False):
        for bias in ((True, False) if weight_const else (False,)):
            for relu in ((True, False) if weight_const else (False,)):
                xq, sx, zx = wildcard(), is_const(), is_const()
                wq, sw, zw = (is_const() if weight_const else wildcard()), is_const(), is_const()
                xdq = is_op("relax.dequantize")(xq, sx, zx)
                wdq = is_op("relax.dequantize")(wq, sw, zw)
                main = is_op(op)(xdq, wdq)
                ann = {"xq": xq, "sx": sx, "zx": zx, "xdq": xdq, "wq": wq, "sw": sw, "zw": zw,
                       "wdq": wdq, "main": main}
                pat = _epilogue(main, ann, bias, relu)
                if requant:
                    sy, zy = is_const(), is_const()
                    pat = is_op("relax.quantize")(pat, sy, zy)
                    ann.update(quant=pat, sy=sy, zy=zy)
                ann["root"] = pat
                name = prefix + ("_bias" if bias else "") + ("_relu" if relu else "") + ("_requant" if requant else "")
                out.append((name, pat, ann, _bind(check, name)))
    return out


def _qdq(name: str, op: str, chk: "_Checker"):
    x, scale, zero = wildcard(), is_const(), is_const()
    root = is_op(op)(x, scale, zero)
    return (name, root, {"input": x, "scale": scale, "zero": zero, "root": root}, _bind(chk._check_qdq, name))


def _bind(check: Callable, name: str) -> Callable[[PatternCheckContext], bool]:
    # A fused pattern whose intermediate value is also read outside the match (e.g. a ReLU output
    # feeding both the next layer's quantize and a residual add) would leak it as an extra
    # output; a smaller pattern matches instead.
    return lambda ctx: not has_leaking_intermediate_variables(ctx) and check(name, ctx)


def _unary(name: str, op: str, chk: _Checker, checker=None):
    x = wildcard()
    root = is_op(op)(x)
    return (name, root, {"input": x, "root": root}, _bind(checker or chk._check_elementwise, name))


def _binary(name: str, op: str, chk: _Checker):
    lhs, rhs = wildcard(), wildcard()
    root = is_op(op)(lhs, rhs)
    return (name, root, {"lhs": lhs, "rhs": rhs, "root": root}, _bind(chk._check_elementwise, name))


def _binary_relu(name: str, op: str, chk: _Checker):
    """Residual add followed by ReLU: one element-wise pass instead of two."""
    lhs, rhs = wildcard(), wildcard()
    root = is_op("relax.nn.relu")(is_op(op)(lhs, rhs))
    return (name, root, {"lhs": lhs, "rhs": rhs, "root": root}, _bind(chk._check_elementwise, name))


def _clip(chk: _Checker):
    x = wildcard()
    root = is_op("relax.clip")(x, wildcard(), wildcard())  # bounds are PrimValue arguments
    return ("spinn.clip", root, {"input": x, "root": root}, _bind(chk._check_clip, "spinn.clip"))


def spinn_patterns(arch: SpinnArch, log: FallbackReason | None = None) -> list[tuple]:
    """The spinn pattern table for ``arch``, most specific patterns first.

    Parameters
    ----------
    arch : SpinnArch
        Target architecture (SRAM size decides what fits).
    log : FallbackReason, optional
        Collects the reasons ops were refused.

    Returns
    -------
    list of tuple
        ``(name, pattern, annotations, check)`` entries for ``FuseOpsByPattern``.
    """
    chk = _Checker(arch, log or FallbackReason())
    lhs, rhs = wildcard(), wildcard()
    matmul = is_op("relax.matmul")(lhs, rhs)
    gamma, beta, x = is_const(), is_const(), wildcard()
    layer_norm = is_op("relax.nn.layer_norm")(x, gamma, beta)
    return [
        *_qgemm_patterns("spinn.qconv2d", "relax.nn.conv2d", chk._check_qgemm, weight_const=True),
        *_qgemm_patterns("spinn.qdense", "relax.matmul", chk._check_qgemm, weight_const=True),
        *_qgemm_patterns("spinn.qmatmul", "relax.matmul", chk._check_qgemm, weight_const=False),
        _qdq("spinn.quantize", "relax.quantize", chk),
        _qdq("spinn.dequantize", "relax.dequantize", chk),
        *_gemm_patterns("spinn.conv2d", "relax.nn.conv2d", chk._check_conv2d),
        *_gemm_patterns("spinn.dense", "relax.matmul", chk._check_dense),
        ("spinn.matmul", matmul, {"lhs": lhs, "rhs": rhs, "root": matmul},
         _bind(chk._check_matmul, "spinn.matmul")),
        ("spinn.layer_norm", layer_norm, {"input": x, "gamma": gamma, "beta": beta, "root": layer_norm},
         _bind(chk._check_row_op, "spinn.layer_norm")),
        _unary("spinn.softmax", "relax.nn.softmax", chk, chk._check_row_op),
        _unary("spinn.mean", "relax.mean", chk, chk._check_row_op),
        _unary("spinn.max_pool2d", "relax.nn.max_pool2d", chk, chk._check_pool2d),
        _unary("spinn.avg_pool2d", "relax.nn.avg_pool2d", chk, chk._check_pool2d),
        _unary("spinn.adaptive_avg_pool2d", "relax.nn.adaptive_avg_pool2d", chk, chk._check_pool2d),
        _unary("spinn.relu", "relax.nn.relu", chk),
        _unary("spinn.gelu", "relax.nn.gelu", chk),
        _unary("spinn.gelu_tanh", "relax.nn.gelu_tanh", chk),
        _unary("spinn.sigmoid", "relax.sigmoid", chk),
        _unary("spinn.tanh", "relax.tanh", chk),
        _clip(chk),
        _binary("spinn.reshape", "relax.reshape", chk),
        _binary("spinn.broadcast_to", "relax.broadcast_to", chk),
        _unary("spinn.permute_dims", "relax.permute_dims", chk),
        _binary_relu("spinn.add_relu", "relax.add", chk),
        _binary("spinn.add", "relax.add", chk),
        _binary("spinn.subtract", "relax.subtract", chk),
        _binary("spinn.multiply", "relax.multiply", chk),
        _binary("spinn.divide", "relax.divide", chk),
    ]


def required_ops(pattern: DFPattern) -> frozenset:
    """Names of the operators every match of ``pattern`` calls (a subset where unsure).

    Parameters
    ----------
    pattern : DFPattern
        A dataflow pattern.

    Returns
    -------
    frozenset of str
        Operator names (``"relax.matmul"``...): a module calling none of one of them cannot
        match ``pattern``. Alternatives (``|``) require only what both sides require; pattern
        kinds not listed here require nothing.
    """
    if isinstance(pattern, dpl.CallPattern):
        found = set(required_ops(pattern.op))
        op = getattr(pattern.op, "expr", None) if isinstance(pattern.op, dpl.ExprPattern) else None
        if isinstance(op, tvm.ir.Op):
            found.add(str(op.name))
        for arg in pattern.args or ():
            found |= required_ops(arg)
        return frozenset(found)
    if isinstance(pattern, dpl.OrPattern):
        return required_ops(pattern.left) & required_ops(pattern.right)
    if isinstance(pattern, dpl.AndPattern):
        return required_ops(pattern.left) | required_ops(pattern.right)
    if isinstance(pattern, dpl.TupleGetItemPattern):
        return required_ops(pattern.tuple)
    if isinstance(pattern, dpl.TuplePattern):
        return frozenset().union(*(required_ops(f) for f in pattern.fields))
    if isinstance(pattern, (dpl.AttrPattern, dpl.DataTypePattern, dpl.ShapePattern, dpl.TypePattern)):
        return required_ops(pattern.pattern)
    return frozenset()


def patterns_for(patterns: list[tuple], ops: "set[str] | frozenset") -> list[tuple]:
    """The entries of ``patterns`` that can match a module calling only the operators ``ops``.

    ``FuseOpsByPattern`` tries every pattern on every binding; most of a model's patterns name
    operators it never calls (no conv or QDQ in a transformer). Dropping those entries leaves the
    matches, their order and the checks run (only matches are checked) unchanged.
    """
    return [entry for entry in patterns if required_ops(entry[1]) <= ops]
