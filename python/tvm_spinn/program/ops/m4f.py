"""The M4F's cost of a PE kernel: its passes over the data, the instructions one element of each
pass executes, by class, priced by the Cortex-M4 TRM's cycle table.

A family states its kernel's work as :class:`Mix` values (one per pass over the data: what the
loop body of the PE kernel, :mod:`tvm_spinn.pe.kernels`, executes per element) plus what runs
once per job, per row or per stream; :func:`pass_cycles` prices them with the
:class:`~tvm_spinn.target.arch.SpinnArch` fields that hold the TRM's numbers
(``m4f_mem_cycles`` 2 and ``m4f_mem_pipelined_cycles`` 1 for loads and stores, ``m4f_fpu_cycles``
1, ``m4f_divide_cycles`` 14 for VDIV and VSQRT, ``m4f_alu_cycles`` 1, ``m4f_branch_cycles`` 2;
the fused multiply-adds VFMA/VFMS at :data:`FUSED_CYCLES`)
and the overheads of the code LLVM emits (``m4f_loop_cycles`` per element and pass,
``m4f_job_cycles`` per job: calibrated, see :mod:`tvm_spinn.target.arch`). The fp32 GEMM's
register blocks are priced the same way by :func:`tvm_spinn.program.ops.gemm.gemm_tile_cycles`.

Named simplifications: a compare whose result the core reads is VCMP + VMRS (two FPU
instructions); a select is IT + a conditional VMOV; a data-dependent branch is counted where
the kernel's common path takes it (the arguments' most frequent branch of a piecewise
function, stated per kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from ...target.arch import SpinnArch

__all__ = ["FUSED_CYCLES", "Mix", "mix_cycles", "pass_cycles"]

#: Cycles of a fused multiply-add (VFMA, VFMS, VFNMA, VFNMS: Cortex-M4 TRM table 7-1, 3 each).
FUSED_CYCLES = 3


@dataclass(frozen=True)
class Mix:
    """Instructions one element of one pass over the data executes, by class.

    Attributes
    ----------
    loads : float
        Loads and stores that follow an instruction other than a load or store (VLDR/VSTR/LDR/STR,
        ``m4f_mem_cycles`` each).
    paired : float
        Loads and stores directly following another (``m4f_mem_pipelined_cycles`` each).
    fpu : float
        Single-cycle FPU arithmetic (VADD, VSUB, VMUL, VNMUL, VABS, VNEG, VMOV, VCVT).
    compares : float
        Floating-point compares read by the core (VCMP + VMRS: two FPU instructions each).
    selects : float
        Conditional selects (IT + a conditional VMOV: one integer and one FPU instruction).
    divides : float
        VDIV.F32 and VSQRT.F32.
    alu : float
        Integer data processing (sign flips, index tests).
    branches : float
        Taken branches of the element's own control flow (not the loop's).
    exp : float
        Elements the pass streams through the exp/log unit (``exp_unit_cycles`` each).
    mla : float
        Integer multiply-accumulates (MLA, MLS: 2 cycles each, TRM table 3-1, priced as two
        ``m4f_alu_cycles``).
    fused : float
        Fused floating-point multiply-adds (VFMA, VFMS: :data:`FUSED_CYCLES` each).
    """

    loads: float = 0.0
    paired: float = 0.0
    fpu: float = 0.0
    compares: float = 0.0
    selects: float = 0.0
    divides: float = 0.0
    alu: float = 0.0
    branches: float = 0.0
    exp: float = 0.0
    mla: float = 0.0
    fused: float = 0.0


def mix_cycles(mix: Mix, arch: "SpinnArch") -> float:
    """Cycles of one element of ``mix`` (its loop body only, without the loop's overhead)."""
    fpu, alu = arch.m4f_fpu_cycles, arch.m4f_alu_cycles
    return (mix.loads * arch.m4f_mem_cycles + mix.paired * arch.m4f_mem_pipelined_cycles
            + mix.fpu * fpu + mix.compares * 2 * fpu + mix.selects * (alu + fpu)
            + mix.divides * arch.m4f_divide_cycles + mix.alu * alu + mix.branches * arch.m4f_branch_cycles
            + mix.exp * arch.exp_unit_cycles + mix.mla * 2 * alu + mix.fused * FUSED_CYCLES)


def pass_cycles(passes: Sequence[Mix], arch: "SpinnArch") -> float:
    """Cycles per element of ``passes`` (one :class:`Mix` per pass over the data), each pass with
    its loop's overhead ``m4f_loop_cycles``."""
    return sum(mix_cycles(m, arch) + arch.m4f_loop_cycles for m in passes)
