"""Pattern table for offloading to spinn: prefixed names and ``_check_*`` predicates.

Each entry is ``(name, pattern, annotations, check)``. Names are prefixed ``spinn.`` and match
the layer kinds the mapping compiler knows (``tvm_spinn.program.LAYER_KINDS``). A predicate
returns False (and logs why) when the hardware cannot hold the op: dynamic shapes, dtypes other
than float32, layouts other than NCHW/OIHW, or a working set that does not fit one PE's SRAM.
"""

from __future__ import annotations

import logging
from typing import Callable

from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard
from tvm.relax.transform import PatternCheckContext

from ..target.arch import SpinnArch

__all__ = ["spinn_patterns", "FallbackReason", "SUPPORTED_DTYPES"]

LOG = logging.getLogger("tvm_spinn.partition")
SUPPORTED_DTYPES = ("float32",)


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
    def _check_tensors(self, op: str, ctx: PatternCheckContext, names: tuple[str, ...]) -> bool:
        root = ctx.annotated_expr["root"]
        for name in ("root",) + names:
            if name not in ctx.annotated_expr:
                continue
            expr = ctx.annotated_expr[name]
            if not isinstance(expr.ty, relax.TensorType):
                return self.log.refuse(op, root, f"operand '{name}' is not a tensor")
            if _static_shape(expr) is None:
                return self.log.refuse(op, root, f"operand '{name}' has a dynamic shape")
            if _dtype(expr) not in SUPPORTED_DTYPES:
                return self.log.refuse(
                    op, root, f"operand '{name}' has dtype {_dtype(expr)} (supported: {SUPPORTED_DTYPES})"
                )
        return True

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
        # Smallest tile: one output row chunk of one MAC-array block, full window, double buffered.
        wshape = _static_shape(ctx.annotated_expr["weight"])
        window = wshape[2] * wshape[3]
        min_bytes = 2 * 4 * (self.arch.mac_rows * window + window * self.arch.mac_cols
                             + self.arch.mac_rows * self.arch.mac_cols)
        return self._check_fits(op, root, min_bytes, f"a {wshape[2]}x{wshape[3]} window tile")

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
        return True

    def _check_matmul(self, op: str, ctx: PatternCheckContext) -> bool:
        if not self._check_tensors(op, ctx, ("lhs", "rhs")):
            return False
        root = ctx.annotated_expr["root"]
        a = _static_shape(ctx.annotated_expr["lhs"])
        b = _static_shape(ctx.annotated_expr["rhs"])
        if len(a) < 2 or len(b) < 2:
            return self.log.refuse(op, root, "matmul operands must be at least 2-D")
        return True

    def _check_elementwise(self, op: str, ctx: PatternCheckContext) -> bool:
        names = ("lhs",) if op in ("spinn.reshape", "spinn.broadcast_to") else ("lhs", "rhs", "input")
        return self._check_tensors(op, ctx, names)

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
        return True

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
            return self._check_fits(op, root, 2 * 4 * row, f"a row of {row} elements")
        if op == "spinn.softmax":
            axis = int(attrs.axis)
            if axis not in (-1, len(shape) - 1):
                return self.log.refuse(op, root, f"softmax over axis {axis} (only the last axis)")
        else:
            axes = [int(a) % len(shape) for a in attrs.axes]
            if axes != [len(shape) - 1]:
                return self.log.refuse(op, root, f"layer_norm over axes {axes} (only the last axis)")
        # One whole row (in, out, double buffered) must fit a PE.
        return self._check_fits(op, root, 2 * 2 * 4 * shape[-1], f"a row of {shape[-1]} elements")


def _gemm_patterns(prefix: str, op: str, check: Callable) -> list:
    """``op(x, W const)`` with optional constant bias add and ReLU: four patterns, largest first."""
    out = []
    for bias in (True, False):
        for relu in (True, False):
            data, weight = wildcard(), is_const()
            main = is_op(op)(data, weight)
            # "conv" is the conv2d call itself (its attrs are checked); "main" is the GEMM output.
            ann = {"input": data, "weight": weight, "conv": main, "main": main}
            pat: DFPattern = main
            if bias:
                ann["bias"] = b = is_const()
                pat = is_op("relax.add")(pat, b)
            if relu:
                pat = is_op("relax.nn.relu")(pat)
            ann["root"] = pat
            name = prefix + ("_bias" if bias else "") + ("_relu" if relu else "")
            out.append((name, pat, ann, _bind(check, name)))
    return out


def _bind(check: Callable, name: str) -> Callable[[PatternCheckContext], bool]:
    return lambda ctx: check(name, ctx)


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
    return ("spinn.clip", root, {"input": x, "root": root}, _bind(chk._check_elementwise, "spinn.clip"))


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
