"""TIR helpers the PE kernel families share: the float32 zero, float32 constants rounded
once, VSQRT, and a stream through the exp/log unit."""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import tirx as T

#: float32 +0.0
_ZERO = T.float32(0)


def _f(v) -> "tvm.tirx.FloatImm":
    """A float32 constant, rounded once from its decimal text (as the C++ literal ``v``f is)."""
    return T.float32(float(np.float32(v)))


def _vsqrt(v):
    """``sqrt(v)`` as LLVM's intrinsic (VSQRT.F32, correctly rounded; no libm call)."""
    return T.call_llvm_pure_intrin("float32", "llvm.sqrt.f32", v)


@T.macro
def _exp_unit(src, dst, n):
    """``dst[0:n] = exp(src[0:n])`` on the exp/log unit (the runtime's driver ``pe_exp``; the
    unit computes the simulator's exp model, see :mod:`.iss`). ``src`` may equal ``dst``."""
    T.evaluate(T.call_extern("int32", "pe_exp", src, dst, n))
