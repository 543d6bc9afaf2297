"""The one reader of the ``TVM_SPINN_*`` environment variables.

Options of a compilation live in :class:`tvm_spinn.SpinnOptions` (explicit arguments or a
``with`` context). Environment variables are for debugging and for the machine's setup only:
none of them changes what a build produces for a given options struct, except
``TVM_SPINN_HOST_MCPU`` (which CPU the host fallback is compiled for, read once when the targets
are registered at import). Every Python read goes through :func:`env`, which accepts only the
names below, so the table is the complete list.

=========================  ======================================================================
Variable                   Effect
=========================  ======================================================================
TVM_SPINN_SIM_MODE         Default simulator execution mode when ``run_program(mode=None)``
                           (``layers``, ``tiles``, or ``iss``: generated PE code, emulated).
TVM_SPINN_SIM_NATIVE       ``0``: simulator plans run every layer through its Python reference.
TVM_SPINN_SIM_THREADS      Threads of the C++ simulator kernels (default all cores; the bits never
                           depend on it). Also read by the C++ library (``ConfiguredThreads`` in
                           ``src/kernels.cc``) when a call passes ``threads=0``.
TVM_SPINN_HOST_MCPU        LLVM CPU of the host fallback (``""``: LLVM's generic CPU).
TVM_SPINN_VERBOSE          Non-empty and not ``0``: show the libraries' chatter.
TVM_SPINN_DEBUG_SCHEDULE   Non-empty: print why a default schedule rule left a PrimFunc unscheduled.
TVM_SPINN_LIBRARY_PATH     Load ``libtvm_spinn.so`` from this path instead of the package's.
TVM_SPINN_CACHE            Directory of downloaded test data (ONNX node-test cases).
=========================  ======================================================================
"""

from __future__ import annotations

import os

__all__ = ["ENV", "env"]

#: Every environment variable the package reads -> one line on what it does.
ENV = {
    "TVM_SPINN_SIM_MODE": "default simulator execution mode",
    "TVM_SPINN_SIM_NATIVE": "0: simulator plans run every layer in Python",
    "TVM_SPINN_SIM_THREADS": "threads of the C++ simulator kernels",
    "TVM_SPINN_HOST_MCPU": "LLVM CPU of the host fallback",
    "TVM_SPINN_VERBOSE": "show the libraries' chatter",
    "TVM_SPINN_DEBUG_SCHEDULE": "print default-schedule failures",
    "TVM_SPINN_LIBRARY_PATH": "path of libtvm_spinn.so",
    "TVM_SPINN_CACHE": "directory of downloaded test data",
}


def env(name: str, default: str | None = None) -> str | None:
    """The value of the ``TVM_SPINN_*`` variable ``name``, or ``default`` when unset.

    Parameters
    ----------
    name : str
        One of :data:`ENV`'s keys.
    default : str, optional
        Returned when the variable is not set.

    Raises
    ------
    KeyError
        If ``name`` is not in :data:`ENV` (a variable read nowhere else must be listed here).
    """
    if name not in ENV:
        raise KeyError(f"{name!r} is not a tvm_spinn environment variable (known: {sorted(ENV)})")
    return os.environ.get(name, default)
