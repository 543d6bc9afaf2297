"""The PE kernels as TIR, one PrimFunc per role, lowered to Cortex-M4F objects by TVM's LLVM.

Every kernel is the C-ABI function ``pe_kernel`` (pointers and 32-bit integers in r0-r3, then
on the stack; no floating-point arguments) that the runtime's job loop calls once per job. A job
is one tile, or one reduction chunk of a GEMM tile, as the mapper cut the layer. The arithmetic
is spelled in the order the simulator defines it (:mod:`tvm_spinn.program.ops`), one IEEE fp32
operation per TIR operation: LLVM keeps it (no fast-math flags), so the executed instructions are
the single-precision VADD/VMUL/VCMP the simulator's numbers claim.

Kernels (the ``spec`` of :func:`kernel_object`), each with its arguments in its module:

- :mod:`.elementwise`: ``("binary", op, relu)``, ``("relu",)``, ``("clip",)``, ``("where_less",)``,
  ``("rope",)``;
- :mod:`.activations`: ``("unary", act)`` for ``act`` in :data:`ACTIVATIONS`;
- :mod:`.gemm`: ``("gemm_f32", relu)``, ``("gemm_i8",)``, ``("gemm_i8", "tflite")``, their
  one-row kernels ``("gemm_i8", "gemv")`` and ``("gemm_i8", "tflite_gemv")``, and
  ``("gemm_i8", "f32", relu)`` (the epilogues in :mod:`.i8_epilogues`);
- :mod:`.quantize`: ``("quantize", dtype)``, ``("dequantize", dtype)``;
- :mod:`.rows`: ``("mean",)``, ``("softmax",)``, ``("xent_grad",)``, ``("layer_norm",)``,
  ``("rms_norm",)``, ``("cross_entropy",)``;
- :mod:`.tflite`: ``("mean_tflite", dtype)``, ``("softmax_tflite", dtype)``;
- :mod:`.pool`: ``("pool", op)``, ``("pool_grad",)``;
- :mod:`.movement`: ``("dma",)``, ``("take",)``.

The TIR helpers they share are in :mod:`.common`. :func:`kernel_func` looks a spec's builder up
by its first element; :func:`kernel_object` lowers the PrimFunc to an object.
"""

from __future__ import annotations

import functools
import os
import tempfile

import tvm
from tvm.tirx.build import codegen_build

from .activations import ACTIVATIONS, _unary
from .elementwise import BINARY_OPS, _binary, _clip_kernel, _relu_kernel, _rope, _where_less
from .gemm import _gemm_f32, _gemm_i8
from .i8_epilogues import I8_BIAS_FLAG
from .movement import _dma, _take
from .pool import _pool, _pool_grad
from .quantize import _dequantize, _quantize
from .rows import _cross_entropy, _layer_norm, _mean, _rms_norm, _softmax, _xent_grad
from .tflite import _mean_tflite, _softmax_tflite

__all__ = ["PE_TARGET", "BINARY_OPS", "ACTIVATIONS", "I8_BIAS_FLAG", "kernel_func", "kernel_object"]

#: TVM's LLVM target for the SpiNNaker2 PE: Cortex-M4F, single-precision FPv4, hard-float ABI.
PE_TARGET = {"kind": "llvm", "mtriple": "thumbv7em-none-eabihf", "mcpu": "cortex-m4",
             "mattr": ["+vfp4d16sp"], "mfloat-abi": "hard"}


#: kernel kind (a spec's first element) -> the builder of its PrimFunc from the spec's other elements
_BUILDERS = {
    # elementwise
    "binary": _binary, "relu": _relu_kernel, "clip": _clip_kernel, "where_less": _where_less, "rope": _rope,
    "unary": _unary,
    # GEMMs
    "gemm_f32": _gemm_f32, "gemm_i8": _gemm_i8,
    # quantization
    "quantize": _quantize, "dequantize": _dequantize,
    # rows
    "mean": _mean, "softmax": _softmax, "xent_grad": _xent_grad, "layer_norm": _layer_norm,
    "rms_norm": _rms_norm, "cross_entropy": _cross_entropy,
    "mean_tflite": _mean_tflite, "softmax_tflite": _softmax_tflite,
    # pools and data movement
    "pool": _pool, "pool_grad": _pool_grad, "dma": _dma, "take": _take,
}



def kernel_func(spec: tuple) -> "tvm.tirx.PrimFunc":
    """The TIR PrimFunc ``pe_kernel`` of kernel ``spec`` (see the module docstring)."""
    kind, *params = spec
    func = _BUILDERS[kind](*params)
    return func.with_attr("global_symbol", "pe_kernel")


#: kernels whose ``T.unroll`` loops TIR unrolls itself and then simplifies (LLVM ignores the hint):
#: the fp32 GEMM's register block, whose unrolled indices must fold to constants for its
#: accumulators and operands to stay in FPU registers (the simplifier assumes no NaN: the
#: kernel's float compares are written in forms it leaves alone)
_UNROLLED = frozenset({"gemm_f32"})


@functools.lru_cache(maxsize=64)
def kernel_object(spec: tuple) -> bytes:
    """Kernel ``spec`` compiled by TVM's LLVM to a Cortex-M4F ELF object (bytes)."""
    target = tvm.target.Target(PE_TARGET)
    mod = tvm.IRModule({"pe_kernel": kernel_func(spec).with_attr("target", target)})
    if spec[0] in _UNROLLED:
        with tvm.transform.PassContext(opt_level=3, config={"tirx.UnrollLoop": {"explicit_unroll": True}}):
            mod = tvm.transform.Sequential([tvm.tirx.transform.UnrollLoop(), tvm.tirx.transform.StmtSimplify()])(mod)
    with tvm.transform.PassContext(opt_level=3):
        lib = codegen_build(mod, target)
    with tempfile.TemporaryDirectory(prefix="tvm_spinn_pe_") as tmp:
        path = os.path.join(tmp, "pe_kernel.o")
        lib.write_to_file(path)
        with open(path, "rb") as f:
            return f.read()
