"""Stand-alone ``quantize`` (float32 -> int8/uint8) and ``dequantize`` (int8/uint8/int32 ->
float32) on the M4F, per tensor or per channel along ``axis``.

- Arithmetic (fp32): ``quantize`` is ``clamp(rint(x / s) + z)`` (round half to even, VCVTR;
  infinities clamp to the range's ends, a NaN gives 0 as VCVT converts it); ``dequantize`` is
  ``fl(q - z) * s`` with ``q - z`` in 32-bit arithmetic.
- Native runs (``src/sim_plan.cc``, :meth:`QuantizeDequantize.native`): the same operations per
  element, channel ``(i // inner) % channels`` of the flattened tensor.
- Tiles: ``[elements]`` over the flattened output; cycles from the PE kernel's instruction
  mixes (:data:`QDQ_MIXES`, and :data:`QUANTIZE_ELEMENT` with a channel per element; a
  quantize's runs of a channel, :data:`QUANTIZE_RUN`, each with one VDIV of the scale's
  reciprocal, its elements a product corrected twice each).
"""

from __future__ import annotations

import math

import numpy as np

from ..checks import NONNEG, fail
from ..model import Layer
from ..quant import QUANT_RANGES
from . import native
from .base import FlatFamily, register
from .m4f import Mix, mix_cycles, pass_cycles
from .sharding import PointwiseRule

__all__ = ["QuantizeDequantize"]

_F32 = np.float32


#: One element of the PE kernels (:mod:`tvm_spinn.pe.kernels` ``quantize`` and ``dequantize``)
#: as the generated code executes it (instruction classes counted in its executed blocks), by
#: layer kind. quantize on a channel's run (the whole tile of a per-tensor quantize): the load of
#: x and the byte store, VMUL by the run's reciprocal, two Markstein corrections of the quotient
#: (VFMS, VFMA each, and a copy of x for each remainder: the first gives a faithful quotient,
#: the second RN(x / s); one alone is not proven to, the product not being proven within one ulp
#: of it), the NaN test and its branch, VCVTR and its move to the core, QADD of the zero point,
#: SSAT/USAT, and the loop's index and pointer steps and its branch (a body of two elements).
#: dequantize: the loads of q, the zero point and the scale and the store, the 32-bit
#: subtraction, its move to the FPU, VCVT and VMUL.
QDQ_MIXES = {
    "quantize": Mix(loads=1.5, paired=0.5, fpu=5.0, fused=4.0, compares=1.0, alu=5.0, branches=0.5),
    "dequantize": Mix(loads=2.0, paired=2.0, fpu=3.0, alu=2.0),
}
#: One element of a quantize with a channel per element (per-channel along the last axis: the
#: reference's operations): the loads of x, the scale and the zero point and the byte store, one
#: VDIV, the rounding ``(v + 2^23) - 2^23`` with its sign and magnitude tests, the zero point's
#: VCVT and add, both clamps, the NaN test, the conversion and its move to the core.
QUANTIZE_ELEMENT = Mix(loads=3.0, paired=1.0, divides=1.0, fpu=9.0, compares=5.0, selects=5.0, alu=2.0)
#: What the quantize kernel executes once per run of a channel's elements: the loads of the
#: scale (and its bits) and the zero point, the exponent and zero-point range tests and their
#: selects, the run's VDIV of the reciprocal, the run's bounds (a multiply-accumulate, the
#: clamps to the tile) and the entry to and exit from its loop; and once per row of channels
#: (a channel per element): the row's bounds and the loop's entry (pointers to the row's x,
#: scales and zero points).
QUANTIZE_RUN = Mix(loads=5.0, paired=1.0, mla=1.0, divides=1.0, fpu=5.0, selects=2.0, alu=37.0, branches=1.0)
QUANTIZE_ROW = Mix(loads=8.0, paired=2.0, mla=2.0, selects=1.0, alu=16.0, branches=1.0)


class QuantizeDequantize(FlatFamily):
    """quantize and dequantize layers (those not folded into an int8 GEMM)."""

    def cycles_per_element(self, layer, arch):
        """Cycles per element (a quantize's: of a channel's run, the corrected quotient)."""
        return pass_cycles((QDQ_MIXES[layer.kind],), arch)

    def tile_costs(self, program, layer, arch, tile, lo, hi):
        """A quantize tile's cycles: its elements, the job, and one :data:`QUANTIZE_RUN` per run
        of a channel's elements it covers (one for a per-tensor scale), or, with a channel per
        element, the reference's operations per element and one :data:`QUANTIZE_ROW` per row of
        channels."""
        if layer.kind != "quantize":
            return super().tile_costs(program, layer, arch, tile, lo, hi)
        sram, dram_in, w, out, _ = super().tile_costs(program, layer, arch, tile, lo, hi)
        first, e = lo[:, 0], (hi - lo)[:, 0]
        shape = [int(d) for d in program.tensors[layer.output].shape]
        channels = int(np.prod(program.tensors[layer.consts["scale"]].shape, dtype=np.int64))
        inner = int(np.prod(shape[layer.attrs.get("axis", 0) + 1:], dtype=np.int64)) if channels > 1 else 0
        job = self.fixed_cycles(layer, arch)
        if inner == 1:
            rows = -(-(first % channels + e) // channels)
            per, extra = pass_cycles((QUANTIZE_ELEMENT,), arch), rows * mix_cycles(QUANTIZE_ROW, arch)
        else:
            runs = -(-(first % inner + e) // inner) if channels > 1 else np.ones_like(e)
            per, extra = self.cycles_per_element(layer, arch), runs * mix_cycles(QUANTIZE_RUN, arch)
        return sram, dram_in, w, out, np.ceil(e * per + job + np.where(e > 0, extra, 0))

    kinds = ("quantize", "dequantize")
    pointwise = True
    priority = 20

    def quantizes(self, layer: Layer) -> bool:
        return layer.kind == "quantize"

    # -- partition and codegen ---------------------------------------------------------------
    def patterns(self, kit) -> list[tuple]:
        from tvm.relax.dpl import is_const, is_op, wildcard

        entries = []
        for kind in self.kinds:
            x, scale, zero = wildcard(), is_const(), is_const()
            root = is_op(f"relax.{kind}")(x, scale, zero)
            entries.append(kit.entry(f"spinn.{kind}", root, {"input": x, "scale": scale, "zero": zero, "root": root},
                                     self._check_pattern))
        return entries

    @staticmethod
    def _check_pattern(kit, op: str, ctx) -> bool:
        ann = ctx.annotated_expr
        root = ann["root"]
        x = ann["input"]
        shape = kit.static_shape(x)
        if shape is None or kit.static_shape(root) is None:
            return kit.refuse(op, root, "dynamic shape")
        quantized = root if op == "spinn.quantize" else x
        if not kit.check_quantized(op, root, quantized, "tensor"):
            return False
        other = x if op == "spinn.quantize" else root
        if kit.dtype(other) != "float32":
            return kit.refuse(op, root, f"{'input' if op == 'spinn.quantize' else 'output'} dtype {kit.dtype(other)}")
        channels = shape[int(root.attrs.axis) % len(shape)] if shape else 1
        return kit.check_qparams(op, root, ctx, "scale", "zero", channels, "tensor")

    def lower(self, lowerer, name: str, kind: str, calls: list, env: dict, layer: Layer) -> None:
        call = calls[0][1]
        layer.inputs = [lowerer.operand(call.args[0], env)]
        rank = len(lowerer.tensors[layer.inputs[0]].shape)
        scale = call.args[1].value.numpy().astype(np.float32).reshape(-1)
        zero = call.args[2].value.numpy().astype(np.int32).reshape(-1)
        layer.attrs["axis"] = int(call.attrs.axis) % rank if rank else 0
        layer.consts["scale"] = lowerer.add_const("qscale", scale)
        layer.consts["zero"] = lowerer.add_const("qzero", zero)

    # -- validation -----------------------------------------------------------------------------
    def attr_schema(self, kind: str, mode: str):
        return {"axis": NONNEG}, {}

    def check(self, v, f, kind, mode, ins, consts, out, attrs):
        fo = f"{f}.output"
        v.need(f"{f}.inputs", kind, ins, 1)
        ishape = v.shapes[ins[0]]
        v.consts(f, consts, {"scale", "zero"})
        src, dst = (("float32",), ("int8", "uint8")) if kind == "quantize" else (("int8", "uint8", "int32"), ("float32",))
        v.dtype(f"{f}.inputs[0]", ins[0], src)
        v.dtype(fo, out, dst)
        v.shape(fo, out, ishape)
        v.dtype(f"{f}.consts.scale", consts["scale"], ("float32",))
        v.dtype(f"{f}.consts.zero", consts["zero"], ("int32",))
        n = math.prod(v.shapes[consts["scale"]])
        if math.prod(v.shapes[consts["zero"]]) != n:
            fail(f"{f}.consts.zero", f"has {math.prod(v.shapes[consts['zero']])} values, the scale {n}")
        if n != 1:
            axis = attrs["axis"]
            if axis >= len(ishape) or ishape[axis] != n:
                fail(f"{f}.attrs.axis", f"{n} per-channel scales do not match axis {axis} of {ishape}")
        return (math.prod(v.shapes[out]),), None

    # -- mapping ------------------------------------------------------------------------------
    def work(self, program, layer, arch):
        return int(np.prod(program.tensors[layer.output].shape, dtype=np.int64)), None

    # -- functional simulator -----------------------------------------------------------------
    def prepare_tiles(self, runner) -> None:
        layer = runner.layer
        x = runner.env[layer.inputs[0]]
        scale, zero = runner.env[layer.consts["scale"]], runner.env[layer.consts["zero"]]
        if scale.size > 1:
            shape = [1] * x.ndim
            shape[layer.attrs["axis"]] = -1
            scale, zero = scale.reshape(shape), zero.reshape(shape)
        else:
            scale, zero = scale.reshape(()), zero.reshape(())
        shape = runner.out.shape
        runner.flat_in = [np.ascontiguousarray(x).reshape(-1),
                          np.ascontiguousarray(np.broadcast_to(scale, shape)).reshape(-1),
                          np.ascontiguousarray(np.broadcast_to(zero, shape)).reshape(-1)]

    def run_tile(self, runner, tile) -> None:
        (e0, e1), = tile.region
        x, scale, zero = (a[e0:e1] for a in runner.flat_in)
        out = runner.out.reshape(-1)
        if runner.layer.kind == "quantize":
            lo, hi = QUANT_RANGES[str(runner.out.dtype)]
            q = np.clip(np.rint((x / scale).astype(_F32)) + zero.astype(_F32), _F32(lo), _F32(hi))
            q[np.isnan(q)] = 0  # VCVT converts NaN to 0 (numpy's cast of NaN is undefined)
            out[e0:e1] = q.astype(runner.out.dtype)
        else:
            out[e0:e1] = (x.astype(np.int32) - zero).astype(_F32) * scale

    def native(self, program, layer, nb, clip=None) -> bool:
        """The layer as one ``quantize``/``dequantize`` instruction (the arithmetic of
        :meth:`run_tile`)."""
        tensors = program.tensors
        x_tid, out = layer.inputs[0], layer.output
        scale_tid, zero_tid = layer.consts["scale"], layer.consts["zero"]
        if clip is not None or tensors[scale_tid].dtype != "float32" or tensors[zero_tid].dtype != "int32":
            return False
        shape = [int(d) for d in tensors[x_tid].shape]
        count = native.numel(shape)
        channels = native.numel(tensors[scale_tid].shape)
        if count < 1 or native.numel(tensors[zero_tid].shape) != channels:
            return False
        inner = 1
        if channels > 1:
            axis = layer.attrs["axis"]
            if axis >= len(shape) or shape[axis] != channels:
                return False
            inner = native.numel(shape[axis + 1:])
        quantized = tensors[out if layer.kind == "quantize" else x_tid].dtype
        kind = {"int8": 1, "uint8": 2, "int32": 3}.get(str(quantized))
        if kind is None or (layer.kind == "quantize" and kind == 3):
            return False
        nb.emit(layer.kind, nb.read(x_tid), nb.write(out), count, inner, channels, nb.read(scale_tid),
                nb.read(zero_tid), kind)
        return True


QuantizeDequantize.sharding = PointwiseRule()
register(QuantizeDequantize())
