"""Python side of the ``spinn`` runtime module: argument checks, program cache, dispatch.

The C++ module (``src/module.cc``) carries the serialized program inside the executable and, when
the VM calls its symbol, forwards ``(key, program_getter, symbol, *dps_args)`` to the global
function registered here. Parsed programs are cached by content key.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import tvm_ffi

from ..program import Program
from .simulator import run_program

__all__ = ["SpinnRuntimeError", "execute", "load_program"]

_CACHE: "OrderedDict[str, Program]" = OrderedDict()
_CACHE_SIZE = 32
_LOCK = threading.Lock()


class SpinnRuntimeError(ValueError):
    """Bad arguments for a spinn program (names the argument)."""


def load_program(key: str, getter) -> Program:
    with _LOCK:
        program = _CACHE.get(key)
        if program is not None:
            _CACHE.move_to_end(key)
            return program
    program = Program.from_bytes(bytes(getter()))
    with _LOCK:
        _CACHE[key] = program
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return program


def _check(program: Program, index: int, tid: int, arg) -> np.ndarray:
    desc = program.tensors[tid]
    role = "input" if desc.role == "input" else "output"
    try:
        arr = np.from_dlpack(arg)
    except Exception as err:  # not a tensor, or not on the host
        raise SpinnRuntimeError(
            f"{program.symbol}: {role} '{desc.name}' (argument {index}) must be a host tensor: {err}"
        ) from None
    if list(arr.shape) != list(desc.shape) or str(arr.dtype) != desc.dtype:
        raise SpinnRuntimeError(
            f"{program.symbol}: {role} '{desc.name}' (argument {index}) expects shape "
            f"{tuple(desc.shape)} {desc.dtype}, got {tuple(arr.shape)} {arr.dtype}"
        )
    return arr


@tvm_ffi.register_global_func("tvm_spinn.runtime.execute", override=True)
def execute(key: str, getter, symbol: str, *args) -> None:
    """Run the program of ``symbol`` on DPS arguments (inputs then outputs)."""
    program = load_program(key, getter)
    n_in, n_out = len(program.inputs), len(program.outputs)
    if len(args) != n_in + n_out:
        raise SpinnRuntimeError(
            f"{symbol}: expected {n_in} inputs and {n_out} outputs, got {len(args)} arguments"
        )
    ins = [_check(program, i, tid, a) for i, (tid, a) in enumerate(zip(program.inputs, args))]
    outs = [_check(program, n_in + i, tid, a) for i, (tid, a) in enumerate(zip(program.outputs, args[n_in:]))]
    results = run_program(program, ins)
    for dst, src in zip(outs, results):
        np.copyto(dst, src)
