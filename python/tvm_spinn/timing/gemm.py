"""The time of an fp32 GEMM on one chip's PEs as the timing model times the compiled layer, in
closed form: what planners that have no program to build (the training planner) charge a GEMM."""

from __future__ import annotations

from .gemm_overlap import gemm_tiles

__all__ = ["gemm_seconds"]


def gemm_seconds(arch, m: int, k: int, n: int, batch: int = 1, resident: bool = False) -> float:
    """Seconds of ``batch`` fp32 GEMMs ``(m x k) @ (k x n)`` on one chip's PEs, as the timing
    model times the compiled layer with its operands on chip.

    The tile is the mapper's (:func:`~tvm_spinn.program.ops.gemm.choose_matmul_tile` for the
    chip's PEs); the busiest PE runs ``ceil(tiles / pes)`` of them at
    :func:`~tvm_spinn.program.ops.gemm.gemm_tile_cycles` each (the instructions the PE kernel
    executes: its ``4 x 4`` register blocks, its ``4 x 1`` right edges, ``1 x 4`` blocks below
    them and single outputs in the corner, the per-step, per-block and per-job overheads: a GEMM
    of a few rows computes its outputs four or one at a time, a reduction of a few terms pays a
    block's set-up for a few steps), double-buffered behind its first tile's two
    operand DMAs and before its last tile's write-back, and the layer ends with the chip's
    barrier (:meth:`~tvm_spinn.target.arch.SpinnArch.barrier_cost_cycles`). Weight traffic from
    DRAM is the planner's own term (the longer of the two is taken), not counted here.

    Parameters
    ----------
    arch : SpinnArch
        The system (one of its chips runs the GEMM).
    m, k, n : int
        The GEMM's rows, reduction and columns (each >= 1).
    batch : int
        Independent GEMMs of that shape in the layer (attention's heads and sequences).
    resident : bool
        The right operand is in SRAM when the GEMM runs (weights the memory plan keeps
        resident, or an activation or gradient the chip has just produced): the tile is chosen
        without charging that operand's DRAM traffic, as the mapper chooses it for a layer whose
        weights are resident. ``False``: the right operand streams from DRAM (weights that do
        not fit, activations stashed there).

    Returns
    -------
    float
        Seconds, at least the FLOPs at the chip's fp32 peak.
    """
    if min(m, k, n, batch) < 1:
        raise ValueError(f"gemm_seconds: a GEMM of {batch} x ({m} x {k}) @ ({k} x {n}) has an empty axis")
    # the tiles' own closed form (one definition of the charge: the training planner's shared-PE
    # schedule runs the same tiles)
    return gemm_tiles(arch, m, k, n, batch, resident).alone_s(arch.pes_per_chip)
