"""Pattern table for offloading to spinn, assembled from the operator families.

Each entry is ``(name, pattern, annotations, check)``. Names are prefixed ``spinn.`` and are
lowered by the family that defines them (:mod:`tvm_spinn.program.ops`). A check returns False
(and logs why) when the hardware cannot hold the op: dynamic shapes, dtypes other than float32,
layouts other than NCHW/OIHW, or a smallest tile that does not fit one PE's SRAM.
"""

from __future__ import annotations

import logging
from typing import Callable

import tvm
from tvm import relax
from tvm.relax import dpl
from tvm.relax.dpl import DFPattern, is_op, wildcard
from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.transform import PatternCheckContext

from ..program.ops import families
from ..target.arch import SpinnArch

__all__ = ["spinn_patterns", "patterns_for", "required_ops", "FallbackReason", "PatternKit",
           "SUPPORTED_DTYPES", "QUANTIZED_DTYPES"]

LOG = logging.getLogger("tvm_spinn.partition")
SUPPORTED_DTYPES = ("float32",)
QUANTIZED_DTYPES = ("int8", "uint8")  # what the MAC array reads (uint8 by flipping the top bit)


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


class PatternKit:
    """What the operator families' patterns and checks use (:meth:`~tvm_spinn.program.ops.
    OpFamily.patterns`): entry builders that bind a check to one architecture and reason log,
    and the operand checks every offloaded op shares (static shapes, dtypes, SRAM fit,
    quantization parameters). A check is ``check(kit, name, ctx) -> bool`` and calls
    :meth:`refuse` (which logs the reason and returns False) when the hardware cannot hold the
    op."""

    SUPPORTED_DTYPES = SUPPORTED_DTYPES
    QUANTIZED_DTYPES = QUANTIZED_DTYPES

    def __init__(self, arch: SpinnArch, log: FallbackReason):
        self.arch = arch
        self.log = log

    # -- entry builders --------------------------------------------------------------------
    def entry(self, name: str, pattern: DFPattern, annotations: dict, check: Callable) -> tuple:
        """A ``FuseOpsByPattern`` entry whose check is ``check(kit, name, ctx)``."""
        # A fused pattern whose intermediate value is also read outside the match (e.g. a ReLU
        # output feeding both the next layer's quantize and a residual add) would leak it as an
        # extra output; a smaller pattern matches instead.
        return (name, pattern, annotations,
                lambda ctx: not has_leaking_intermediate_variables(ctx) and check(self, name, ctx))

    def unary(self, name: str, op: str, check: Callable) -> tuple:
        """``op(input)``."""
        x = wildcard()
        root = is_op(op)(x)
        return self.entry(name, root, {"input": x, "root": root}, check)

    def binary(self, name: str, op: str, check: Callable) -> tuple:
        """``op(lhs, rhs)``."""
        lhs, rhs = wildcard(), wildcard()
        root = is_op(op)(lhs, rhs)
        return self.entry(name, root, {"lhs": lhs, "rhs": rhs, "root": root}, check)

    # -- shapes and dtypes -----------------------------------------------------------------
    static_shape = staticmethod(lambda expr: _static_shape(expr))
    dtype = staticmethod(lambda expr: _dtype(expr))

    def refuse(self, op: str, expr: relax.Expr, reason: str) -> bool:
        """Log why ``op`` stays on the fallback target; returns False."""
        return self.log.refuse(op, expr, reason)

    # -- shared operand checks ---------------------------------------------------------------
    def check_tensors(self, op: str, ctx: PatternCheckContext, names: tuple[str, ...],
                      dtypes: tuple[str, ...] = SUPPORTED_DTYPES) -> bool:
        """The root and the annotated operands ``names`` (those present) are non-empty tensors
        of static shape and one of ``dtypes``; the root is not a scalar."""
        root = ctx.annotated_expr["root"]
        for name in ("root",) + names:
            if name not in ctx.annotated_expr:
                continue
            expr = ctx.annotated_expr[name]
            if not isinstance(expr.ty, relax.TensorType):
                return self.refuse(op, root, f"operand '{name}' is not a tensor")
            if _static_shape(expr) is None:
                return self.refuse(op, root, f"operand '{name}' has a dynamic shape")
            if name == "root" and _static_shape(expr) == ():
                return self.refuse(op, root, "a 0-d (scalar) result is host work")
            if not self.check_nonempty(op, root, name, expr):
                return False
            if _dtype(expr) not in dtypes:
                return self.refuse(op, root, f"operand '{name}' has dtype {_dtype(expr)} (supported: {dtypes})")
        return True

    def check_nonempty(self, op: str, root: relax.Expr, name: str, expr: relax.Expr) -> bool:
        """A zero-size tensor (batch 0, or a GEMM with K = 0) means no work for the PEs: the
        host returns the empty (or, for K = 0, bias-only) result; a program holds no zero-size
        tensors and the tiler has no tile to cut."""
        shape = _static_shape(expr)
        if shape is not None and 0 in shape:
            return self.refuse(op, root, f"operand '{name}' has zero-size shape {shape} (host work)")
        return True

    def check_fits(self, op: str, root: relax.Expr, min_bytes: int, what: str) -> bool:
        """The op's smallest tile (``min_bytes``, from its family: the tiler's own rule) fits
        a PE's tile SRAM."""
        budget = self.arch.tile_sram_bytes
        if min_bytes > budget:
            return self.refuse(op, root, f"{what} needs {min_bytes} bytes of SRAM, a PE has {budget} for tiles")
        return True

    def check_qparams(self, op: str, root: relax.Expr, ctx: PatternCheckContext, scale: str, zero: str,
                      channels: int | None, what: str) -> bool:
        """Scale/zero point constants: scalars, or one per channel when ``channels`` is given."""
        s, z = ctx.annotated_expr[scale], ctx.annotated_expr[zero]
        ns, nz = _numel(_static_shape(s)), _numel(_static_shape(z))
        allowed = (1,) if channels is None else (1, channels)
        if ns not in allowed or nz not in allowed:
            kind = "per-tensor" if channels is None else f"per-tensor or per-channel ({channels})"
            return self.refuse(op, root, f"{what} quantization has {ns} scales / {nz} zero points "
                                         f"(spinn supports {kind})")
        if _dtype(s) != "float32":
            return self.refuse(op, root, f"{what} scale has dtype {_dtype(s)} (need float32)")
        return True

    def check_quantized(self, op: str, root: relax.Expr, expr: relax.Expr, what: str) -> bool:
        """``expr`` is an int8/uint8 tensor of static shape (what the MAC array reads)."""
        if _static_shape(expr) is None:
            return self.refuse(op, root, f"{what} has a dynamic shape")
        if _dtype(expr) not in QUANTIZED_DTYPES:
            return self.refuse(op, root, f"{what} is quantized to {_dtype(expr)} (the MAC array "
                                         f"takes {'/'.join(QUANTIZED_DTYPES)})")
        return True

    def check_dq_axis(self, op: str, root: relax.Expr, ctx: PatternCheckContext, dq: str, scale: str,
                      axis: int) -> bool:
        """A per-channel dequantize runs along ``axis``, to float32."""
        call = ctx.annotated_expr[dq]
        rank = len(_static_shape(call.args[0]))
        if _numel(_static_shape(ctx.annotated_expr[scale])) > 1 and int(call.attrs.axis) % rank != axis % rank:
            return self.refuse(op, root, f"per-channel weights along axis {int(call.attrs.axis)} "
                                         f"(need the output-channel axis {axis % rank})")
        if str(call.attrs.out_dtype) != "float32":
            return self.refuse(op, root, f"dequantize to {call.attrs.out_dtype}")
        return True


def spinn_patterns(arch: SpinnArch, log: FallbackReason | None = None) -> list[tuple]:
    """The spinn pattern table for ``arch``: every operator family's patterns
    (:mod:`tvm_spinn.program.ops`), by family priority, each family's most specific first.

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
    kit = PatternKit(arch, log or FallbackReason())
    return [entry for family in families() for entry in family.patterns(kit)]


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
