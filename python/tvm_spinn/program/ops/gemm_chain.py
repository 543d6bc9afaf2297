"""A GEMM that continues a partial sum: ``C = P + A @ B`` accumulated from ``P``.

The fp32 GEMM of a PE adds the k terms of each output into one accumulator in ascending k,
rounding after every product and every addition (``acc = fl(acc + fl(a * b))``, VMLA.F32 is
not fused; :mod:`tvm_spinn.runtime.simulator`), starting from zero. A GEMM whose k range is cut
into consecutive pieces ``[k0, k1), [k1, k2), ...`` therefore gives the one-chip bits if the
piece on ``[k1, k2)`` starts its accumulator at the finished accumulator of ``[k0, k1)``
instead of at zero, and so on: the additions are then the same pairs of the same values in the
same order: a row-parallel GEMM chained over ranks, rank ``r`` receiving the partial sum of the
ranks before it and continuing it over its own k range, keeps the one-chip bits (serially; the
compiled training step's tensor parallelism takes the canonical leaf order of
:mod:`tvm_spinn.training.tp_chain` instead, which its ranks compute at once). Bias and
activation belong after the last piece (the one-chip GEMM adds its bias to the finished
accumulator).

The arithmetic is the simulator's C++ kernel ``tvm_spinn.sim.gemm_f32`` (``C += A @ B``), the
same code that computes every fp32 GEMM tile, so the pieces and the whole GEMM agree bit for
bit by construction. :data:`PACKED` names a destination-passing global function
``(partial, a, b, out)`` a Relax program calls with ``call_dps_packed``.
"""

from __future__ import annotations

import numpy as np
import tvm

from ... import _lib

__all__ = ["PACKED", "gemm_continue", "register_packed"]

#: the global function a Relax program calls: ``(partial [M, N], a [M, K], b [K, N], out [M, N])``
PACKED = "tvm_spinn.gemm_continue"


def gemm_continue(partial: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``partial + a @ b`` with the k terms added to ``partial`` one by one in ascending k
    (a new float32 array ``[M, N]``).

    Raises
    ------
    ValueError
        When the operands are not float32 matrices of matching shapes.
    """
    a, b, partial = (np.asarray(t) for t in (a, b, partial))
    if a.ndim != 2 or b.ndim != 2 or partial.ndim != 2 or a.shape[1] != b.shape[0] \
            or partial.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"gemm_continue: partial {partial.shape} + a {a.shape} @ b {b.shape} do not match "
                         "([M, N] + [M, K] @ [K, N])")
    if not a.dtype == b.dtype == partial.dtype == np.float32:
        raise ValueError(f"gemm_continue: float32 operands only, got {partial.dtype}, {a.dtype}, {b.dtype}")
    out = np.array(partial, dtype=np.float32, order="C")
    _lib.gemm_f32(np.ascontiguousarray(a), np.ascontiguousarray(b), out)
    return out


def _packed(partial, a, b, out) -> None:
    out.copyfrom(gemm_continue(partial.numpy(), a.numpy(), b.numpy()))


def register_packed() -> str:
    """Register :data:`PACKED` (idempotent); returns its name."""
    if tvm.get_global_func(PACKED, allow_missing=True) is None:
        tvm.register_global_func(PACKED, _packed)
    return PACKED
