"""Rotary position embedding: ``rope`` (``x * cos + rotate_half(x) * sin``) as one layer.

Transformers' ``apply_rotary_pos_emb`` (Llama, Mistral, Qwen2, Gemma-2, Phi-3...) imports as
seven operators: the two halves of the last axis sliced, the upper half negated, the halves
concatenated in swapped order, the two multiplies by the broadcast tables (``x * cos`` and
the concatenation's ``* sin``) and the add. Offloaded one by one, each is a layer with its own
start, DMA set-up and chip-wide barrier; a decode step's rotation of a few hundred elements is
all overhead. The family matches the whole expression and runs it as one pass over the output.

- Arithmetic (Cortex-M4F, fp32): per element ``e`` of the output, with ``d`` the last axis,
  ``h = d / 2`` and ``j = e mod d``: ``r = j < h ? -x[e + h] : x[e - h]`` (the sign bit
  flipped, as ``negative``), then ``p = x[e] * cos[e]``, ``q = r * sin[e]``, ``y = p + q``:
  the three fp32 operations of the imported graph in its order and with its operand order
  (``multiply(x, cos)``, ``multiply(concat, sin)``, ``add``), each rounded once, NaNs
  propagated by the M4F's rule (:func:`~tvm_spinn.program.ops.elementwise.binary`). The result
  is the unfused layers' bits.
- Operands: ``x`` (``[..., d]``, ``d`` even) and the tables ``cos`` and ``sin``, each
  broadcast to ``x``'s shape (transformers' ``cos.unsqueeze(1)``: one row per position, shared
  by the heads).
- Tiles: ``[elements]`` over the flattened output, like the element-wise kinds. A tile's DMA
  brings its run of ``x``, the run of partners ``x[e -+ h]`` (the other half of each row), and
  its runs of ``cos`` and ``sin``; a partner may live on another PE, so the layer is not
  :attr:`~tvm_spinn.program.ops.base.OpFamily.pointwise` (it waits for the barrier before it).
- Sharding: as an element-wise layer on every axis but the last, whose halves a chip must hold
  together (a split there is gathered).
- PE kernel ``("rope",)`` (:mod:`tvm_spinn.pe.kernels`); natively one ``rope`` instruction
  (C++ ``tvm_spinn.sim`` plan: the same operations).
"""

from __future__ import annotations

import math

import numpy as np

from ..checks import fail
from ..model import Layer
from . import native
from .base import FlatFamily, register
from .elementwise import binary
from .m4f import Mix, pass_cycles
from .sharding import REPLICATE, PointwiseRule, ShardDecision

__all__ = ["Rope", "RopeRule", "rope", "rope_partners", "shape_problem", "ROPE_MIX", "ROPE_JOB_CYCLES"]

_F32 = np.float32

#: Per element, the instructions of the PE kernel ``("rope",)``'s one pass, as the generated
#: code executes them (counted in the instruction-set simulator on a 65,536-element layer: per
#: element 3 VLDR, an LDR of the partner's bits and a VSTR; 2 VMUL, a VADD and the VMOV of the
#: partner into the FPU; 2 IT blocks, the conditional EOR of the sign mask and the conditional
#: MOV of the row position's wrap; 5 integer operations, the compare of the row position and
#: the increments of the position and the four addresses): five loads and stores (two after
#: other instructions, three pipelined), four FPU operations, two selects, five ALU operations.
ROPE_MIX = Mix(loads=2.0, paired=3.0, fpu=4.0, selects=2.0, alu=5.0)
#: Cycles of a ``rope`` job beyond the element-wise kernels' ``m4f_job_cycles``: its eight
#: arguments (four of them on the stack, read by LDR/LDRD), the extra callee-saved registers
#: pushed and popped and the row position's set-up (counted in the instruction-set simulator:
#: 110-113 cycles a job outside the loop on tiles of 2, 3 and 18 elements, against the 93 of
#: the four-argument kernels).
ROPE_JOB_CYCLES = 19.0


def rope_partners(x: np.ndarray) -> np.ndarray:
    """``rotate_half(x)``: per row of the last axis, ``concat(-x[h:], x[:h])`` (``negative``
    flips the sign bit, a NaN's included)."""
    h = x.shape[-1] // 2
    return np.concatenate([np.negative(x[..., h:]), x[..., :h]], axis=-1)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``x * cos + rotate_half(x) * sin`` in float32, the imported graph's operations in its
    order (see the module docstring), ``cos`` and ``sin`` broadcast to ``x``'s shape.

    Raises
    ------
    ValueError
        Naming ``rope`` and the shapes: a last axis that is not even, or tables that do not
        broadcast to ``x``'s shape.
    """
    x = np.asarray(x, dtype=_F32)
    cos, sin = np.asarray(cos, dtype=_F32), np.asarray(sin, dtype=_F32)
    why = shape_problem(x.shape, cos.shape, sin.shape)
    if why:
        raise ValueError(f"rope: {why}")
    return binary("add", binary("multiply", x, cos), binary("multiply", rope_partners(x), sin))


def shape_problem(x, cos, sin) -> str:
    """Why ``x``, ``cos`` and ``sin`` of these shapes are not a rotation's operands, or ``""``."""
    x, cos, sin = tuple(x), tuple(cos), tuple(sin)
    if not x or x[-1] < 2 or x[-1] % 2:
        return f"x of shape {list(x)}: the rotated last axis must have an even length of at least 2"
    for name, t in (("cos", cos), ("sin", sin)):
        if len(t) > len(x) or any(a not in (1, b) for a, b in zip(t[::-1], x[::-1])) or (t and t[-1] != x[-1]):
            return f"{name} of shape {list(t)} does not broadcast to x of shape {list(x)} along its rows"
    return ""


class RopeRule(PointwiseRule):
    """Element-wise placement, except along the rotated (last) axis: each row's two halves must
    be on one chip, so a split there is gathered."""

    def propagate(self, ctx, layer, ins):
        decision = super().propagate(ctx, layer, ins)
        rank = len(ctx.full[layer.output])
        if decision.split == "split" and decision.output.axis == rank - 1:
            return ShardDecision(REPLICATE, "rep", gather_all=True)
        return decision

    def passes_reduction(self, program, layer):
        return False


class Rope(FlatFamily):
    """``rope``: rotary position embedding of ``x`` by the tables ``cos`` and ``sin``."""

    kinds = ("rope",)
    # before the element-wise and movement families, whose operators the pattern contains
    priority = 45

    # -- partition and codegen ---------------------------------------------------------------
    def patterns(self, kit) -> list[tuple]:
        """``add(multiply(x, cos), multiply(concat((negative(x[..., h:]), x[..., :h])), sin))``."""
        from tvm.relax.dpl import is_op, is_tuple, wildcard

        x, cos, sin = wildcard(), wildcard(), wildcard()
        upper = is_op("relax.strided_slice")(x, varg_default_wildcard=True)
        lower = is_op("relax.strided_slice")(x, varg_default_wildcard=True)
        neg = is_op("relax.negative")(upper)
        cat = is_op("relax.concat")(is_tuple([neg, lower]))
        direct = is_op("relax.multiply")(x, cos)
        rotated = is_op("relax.multiply")(cat, sin)
        root = is_op("relax.add")(direct, rotated)
        return [kit.entry("spinn.rope", root, {"input": x, "cos": cos, "sin": sin, "upper": upper, "lower": lower,
                                               "concat": cat, "root": root}, self._check_pattern)]

    @staticmethod
    def _check_pattern(kit, op: str, ctx) -> bool:
        from .movement import normalized_slice

        if not kit.check_tensors(op, ctx, ("input", "cos", "sin")):
            return False
        ann = ctx.annotated_expr
        root = ann["root"]
        shape = kit.static_shape(ann["input"])
        why = shape_problem(shape, kit.static_shape(ann["cos"]), kit.static_shape(ann["sin"]))
        if why:
            return kit.refuse(op, root, why)
        rank, d = len(shape), shape[-1]
        h = d // 2
        axis = int(ann["concat"].attrs.axis)
        if axis % rank != rank - 1:
            return kit.refuse(op, root, f"halves joined along axis {axis}, not the last")
        for name, begin in (("upper", h), ("lower", 0)):
            sliced = normalized_slice(ann[name], shape)
            out = kit.static_shape(ann[name])
            if sliced is None or sliced[0] != [rank - 1] or sliced[1] != [begin] or sliced[2] != [1] or out[-1] != h:
                return kit.refuse(op, root, f"the {name} half is not x[..., {begin}:{begin + h}]")
        # the result has x's shape: cos and sin broadcast to it (shape_problem), and the concat
        # of x's two halves (the checks above) has it, so it needs no check of its own.
        # A tile of one element of each operand stream double-buffered
        return kit.check_fits(op, root, 2 * 5 * 4, "one element")

    def lower(self, lowerer, name: str, kind: str, calls: list, env: dict, layer: Layer) -> None:
        # x is what the slices read; the product reading x directly is ``x * cos``, the other
        # ``concat * sin`` (operand order as imported: the NaN rule depends on it)
        x = next(call for _, call in calls if call.op.name == "relax.strided_slice").args[0]
        products = [call for _, call in calls if call.op.name == "relax.multiply"]
        direct = next(call for call in products if call.args[0].same_as(x))
        rotated = next(call for call in products if call is not direct)
        layer.inputs = [lowerer.operand(x, env), lowerer.operand(direct.args[1], env),
                        lowerer.operand(rotated.args[1], env)]

    # -- validation -----------------------------------------------------------------------------
    def check(self, v, f, kind, mode, ins, consts, out, attrs):
        v.float32_only(f, kind, ins, out, consts, 3)
        why = shape_problem(*(v.shapes[t] for t in ins))
        if why:
            fail(f"{f}.inputs", why)
        v.shape(f"{f}.output", out, v.shapes[ins[0]])
        return (math.prod(v.shapes[out]),), None

    # -- mapping ------------------------------------------------------------------------------
    def work(self, program, layer, arch):
        """Three floating-point operations per element (two multiplies, an add)."""
        return 3 * int(np.prod(program.tensors[layer.output].shape, dtype=np.int64)), None

    def cycles_per_element(self, layer, arch):
        """The PE kernel's one pass (:data:`ROPE_MIX`) priced by the TRM."""
        return pass_cycles((ROPE_MIX,), arch)

    def fixed_cycles(self, layer, arch):
        """One job of the kernel: the element-wise job and :data:`ROPE_JOB_CYCLES`."""
        return arch.m4f_job_cycles + ROPE_JOB_CYCLES

    def tile_costs(self, program, layer, arch, tile, lo, hi):
        """Four input streams (``x``, its partners, ``cos``, ``sin``) and the output, each a
        float32 per element, double-buffered."""
        e = (hi - lo)[:, 0]
        *_, cycles = super().tile_costs(program, layer, arch, tile, lo, hi)
        return 2 * 5 * 4 * e, 4 * 4 * e, 0, 4 * e, cycles

    def smallest_tile_bytes(self, program, layer, arch):
        return 2 * 5 * 4

    # -- functional simulator -----------------------------------------------------------------
    def prepare_tiles(self, runner) -> None:
        """The streams a tile's DMA brings, flattened: ``x``, its rotated partners (the upper
        half's sign flipped), ``cos`` and ``sin`` broadcast to the output."""
        shape = runner.out.shape
        x, c, s = (runner.env[t] for t in runner.layer.inputs)
        runner.flat_in = [np.ascontiguousarray(a, dtype=_F32).reshape(-1) for a in
                          (np.broadcast_to(x, shape), rope_partners(np.asarray(x, dtype=_F32)),
                           np.broadcast_to(c, shape), np.broadcast_to(s, shape))]

    def run_tile(self, runner, tile) -> None:
        (e0, e1), = tile.region
        x, r, c, s = (a[e0:e1] for a in runner.flat_in)
        runner.out.reshape(-1)[e0:e1] = binary("add", binary("multiply", x, c), binary("multiply", r, s))

    def run_whole(self, program, index, layer, env, out):
        out[...] = rope(*(env[t] for t in layer.inputs))
        return out

    def step(self, program, layer):
        tids = list(layer.inputs)
        return lambda program, env: rope(*(env[t] for t in tids))

    def native(self, program, layer, nb, clip=None):
        """One ``rope`` instruction: :func:`rope`'s operations (C++ ``tvm_spinn.sim`` plan), the
        tables read through their broadcast strides."""
        tensors = program.tensors
        shape = [int(d) for d in tensors[layer.output].shape]
        if len(shape) > native.codes()["max_dims"] or any(tensors[t].dtype != "float32" for t in layer.inputs):
            return False
        strides = [native.broadcast_strides([int(d) for d in tensors[t].shape], shape) for t in layer.inputs[1:]]
        if any(s is None for s in strides):
            return False
        x, cos, sin = (nb.read(t) for t in layer.inputs)
        nb.emit("rope", x, cos, sin, nb.write(layer.output), shape[-1] // 2, len(shape), shape, *strides)
        return True


Rope.sharding = RopeRule()
register(Rope())
