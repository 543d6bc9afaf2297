"""Bounds check of the indices of a ``take`` that runs on the fallback target.

TVM's ``take`` in ``fast`` mode (what the ONNX and PyTorch importers emit) promises that every
index lies in ``[0, extent)`` and reads outside the table when the promise is broken: a crash or
an output made of whatever memory follows the table. The fallback pipeline
(:func:`tvm_spinn.fallback.prepare_fallback`) routes the indices of every such ``take`` through
:func:`checked_indices` first, so an index out of range raises an ``IndexError`` naming the
operation, the index and the extent, as the simulator does for an offloaded ``take``.
"""

from __future__ import annotations

import tvm_ffi

__all__ = ["CHECK_FUNC", "CHECK_ND_FUNC", "checked_indices", "checked_nd_indices"]

#: name of the global function the fallback calls (``call_pure_packed``)
CHECK_FUNC = "tvm_spinn.runtime.checked_indices"
#: the same for the index tuples of ``gather_nd`` / ``scatter_nd`` (last axis: one index per axis)
CHECK_ND_FUNC = "tvm_spinn.runtime.checked_nd_indices"


@tvm_ffi.register_global_func(CHECK_FUNC, override=True)
def checked_indices(indices, table, axis: int, label: str):
    """A copy of ``indices``, or an ``IndexError`` when one lies outside ``[0, extent)``.

    Parameters
    ----------
    indices : tvm.runtime.Tensor
        The ``take``'s indices (any integer dtype, any device).
    table : tvm.runtime.Tensor
        The table they index (only its shape is read).
    axis : int
        The axis of ``table`` they index.
    label : str
        What to call the ``take`` in the error.

    Returns
    -------
    tvm.runtime.Tensor
        A new tensor equal to ``indices`` (a copy: the VM may reuse the storage of ``indices``
        once this call has read it).
    """
    extent = int(table.shape[int(axis)])
    host = indices.numpy()
    if host.size:
        bad = (host < 0) | (host >= extent)
        if bad.any():
            value = int(host[bad].reshape(-1)[0])
            raise IndexError(f"{label}: {label.split()[0]} index {value} is out of range for axis {int(axis)} of "
                             f"extent {extent}")
    from tvm.runtime import tensor

    return tensor(host, device=indices.device)  # host is numpy()'s own copy (0-d stays 0-d)


@tvm_ffi.register_global_func(CHECK_ND_FUNC, override=True)
def checked_nd_indices(indices, table, first_axis: int, label: str):
    """:func:`checked_indices` for index tuples: entry ``j`` of the last axis of ``indices``
    indexes axis ``first_axis + j`` of ``table`` (``gather_nd``, ``scatter_nd``; ``first_axis``
    is the op's batch dims)."""
    host = indices.numpy()
    first = int(first_axis)
    if host.ndim == 0 or host.shape[-1] > len(table.shape) - first:
        raise IndexError(f"{label}: index tuples of length {host.shape[-1] if host.ndim else 0} for a "
                         f"{len(table.shape)}-d table after {first} batch axes")
    for j in range(host.shape[-1] if host.size else 0):
        extent = int(table.shape[first + j])
        column = host[..., j]
        bad = (column < 0) | (column >= extent)
        if bad.any():
            value = int(column[bad].reshape(-1)[0])
            raise IndexError(f"{label}: {label.split()[0]} index {value} is out of range for axis {first + j} of "
                             f"extent {extent}")
    from tvm.runtime import tensor

    return tensor(host, device=indices.device)
