"""Python side of the ``spinn`` runtime module: argument checks, program cache, dispatch.

The C++ module (``src/module.cc``) carries the serialized program inside the executable. When a
module is created or loaded (``tvm.runtime.load_module``), it calls :func:`validate_program`,
which parses and validates the program (:meth:`Program.from_bytes`): a defective program raises
:class:`~tvm_spinn.program.ProgramError` naming the field, at load, and nothing runs. When the VM
calls the module's symbol, it forwards ``(key, program_getter, symbol, *dps_args)`` to
:func:`execute`. Parsed programs are cached by ``key``, unique to each module object in the
process (two modules never share a cache entry, whatever their bytes claim).

A program's digest of its contents (:func:`~tvm_spinn.program.format.program_digest`) is verified
when it is read, except for bytes
whose every byte was verified just before: the compiler's own output (:class:`compiled`) and
programs inside a library whose integrity trailer :func:`tvm_spinn.load_module` has checked
(:class:`sealed_file`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np
import tvm_ffi

from ..program import Program, ProgramError
from .simulator import program_plan, run_program, sim_mode

_from_dlpack = np.from_dlpack

__all__ = ["SpinnRuntimeError", "compiled", "sealed_file", "trust_next", "execute", "load_program", "validate_program"]

# ProgramError crosses the C++ module loader (a Python callback raising inside
# tvm.runtime.load_module) as itself, not as a generic RuntimeError.
tvm_ffi.register_error("tvm_spinn.ProgramError", ProgramError)

_CACHE: "OrderedDict[str, Program]" = OrderedDict()
# Bounded by bytes, not by count: a model may have many small regions (MobileNetV2 has 52), and
# re-parsing a program at every call is what the cache avoids. Least recently used first out.
_CACHE_BYTES = 4 << 30
_SIZES: dict[str, int] = {}
_LOCK = threading.Lock()
# Bytes this thread's compiler just serialized (see compiled()): their digest pass is skipped.
_COMPILED = threading.local()


class SpinnRuntimeError(ValueError):
    """Bad arguments for a spinn program (names the argument)."""


def _remember(key: str, program: Program, nbytes: int) -> None:
    with _LOCK:
        _CACHE[key] = program
        _SIZES[key] = nbytes
        _CACHE.move_to_end(key)
        while len(_CACHE) > 1 and sum(_SIZES.values()) > _CACHE_BYTES:
            old, _ = _CACHE.popitem(last=False)
            del _SIZES[old]


def load_program(key: str, getter) -> Program:
    """The parsed program of a module: from the cache, else parsed (and validated) again."""
    with _LOCK:
        program = _CACHE.get(key)
        if program is not None:
            _CACHE.move_to_end(key)
            return program
    raw = _program_buffer(getter())
    program = Program.from_bytes(raw)
    _remember(key, program, len(raw))
    return program


def _program_buffer(data):
    """A module's program as Python reads it: ``bytes`` as they are; a program mapped from a
    sealed library (a uint8 ``tvm_ffi.Tensor`` over the file's memory map) as a read-only view,
    without a copy, so the constants parsed from it cannot be written through."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return data
    array = _from_dlpack(data)
    array.flags.writeable = False
    return memoryview(array)


class compiled:  # noqa: N801 - a context manager used like a function
    """While active, a module created from exactly ``data`` (the bytes the compiler just wrote
    with :meth:`Program.to_bytes`) is validated without the digest pass over its contents:
    every other check runs, and the bytes are compared in full first."""

    def __init__(self, data: bytes):
        self.data = data

    def __enter__(self):
        _COMPILED.data = self.data

    def __exit__(self, *exc):
        _COMPILED.data = None


class sealed_file:  # noqa: N801 - a context manager used like a function
    """While active, programs loaded on this thread come from a library whose every byte was
    just verified against its integrity trailer (:func:`tvm_spinn.load_module`): they are
    validated without the digest pass over their contents (every other check runs). Each module
    has its own cache key, so a program's claimed digest never selects another's cache entry."""

    def __enter__(self):
        _COMPILED.sealed = True

    def __exit__(self, *exc):
        _COMPILED.sealed = False


def trust_next(view: np.ndarray) -> None:
    """The next program validated on this thread is ``view``, whose digest the caller has just
    checked (the loader's plain-TVM path, which hashes candidates to pick the right one): its
    validation skips the digest pass once, for exactly that memory."""
    _COMPILED.next_view = view


def _same_bytes(raw, trusted) -> bool:
    """Whether ``raw`` holds exactly ``trusted``: equal ``bytes`` (``tvm_ffi.Bytes`` is one), or
    a view of the very same memory (a module over the compiler's own uint8 array, see
    ``codegen._module_over``), which needs no comparison."""
    if isinstance(raw, bytes) and isinstance(trusted, bytes):
        return raw == trusted
    try:
        got, want = np.frombuffer(raw, dtype=np.uint8), np.frombuffer(trusted, dtype=np.uint8)
    except (TypeError, ValueError):
        return False
    return got.size == want.size and got.ctypes.data == want.ctypes.data


@tvm_ffi.register_global_func("tvm_spinn.runtime.validate_program", override=True)
def validate_program(symbol: str, data: bytes, key: str) -> None:
    """Validate the program of a ``spinn`` module being created or loaded (called from C++).

    Parameters
    ----------
    symbol : str
        The module's global symbol; the program must implement it.
    data : bytes or tvm_ffi.Tensor
        The serialized program (or, for the compile manifest module, its manifest); a program
        stored after the ELF contents of a sealed library arrives as a uint8 tensor over the
        library's memory map (read in place, never copied).
    key : str
        The module's content key; the parsed program is cached under it for the first call.

    Raises
    ------
    ProgramError
        Naming the defective field; the module is then not created.
    """
    from ..program.manifest import MANIFEST_MAGIC, MANIFEST_SYMBOL

    if symbol == MANIFEST_SYMBOL:  # a JSON document for reports, never executed
        raw = bytes(_program_buffer(data))
        try:
            ok = raw.startswith(MANIFEST_MAGIC) and type(json.loads(raw[len(MANIFEST_MAGIC):])) is dict
        except (ValueError, RecursionError):
            ok = False
        if not ok:
            raise ProgramError(f"manifest: module {MANIFEST_SYMBOL} does not hold a JSON manifest")
        return
    trusted = getattr(_COMPILED, "data", None)
    checked, _COMPILED.next_view = getattr(_COMPILED, "next_view", None), None  # consumed here
    raw = _program_buffer(data)
    verified = getattr(_COMPILED, "sealed", False) or any(
        view is not None and _same_bytes(raw, view) for view in (trusted, checked))
    program = Program.from_bytes(raw, verify_checksum=not verified)
    if program.symbol != symbol:
        raise ProgramError(f"symbol: the program implements {program.symbol!r}, its module is {symbol!r}")
    _remember(key, program, len(raw))


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


def _accelerator_tensor(arg):
    """``arg`` if it is a TVM tensor in an accelerator's memory (a ``spinn/cuda`` fallback's
    GPU buffers), else None: such arguments are staged through host copies."""
    device = getattr(arg, "device", None)
    if device is None or not hasattr(arg, "copyfrom") or getattr(device, "dlpack_device_type", lambda: 1)() == 1:
        return None
    return arg


@tvm_ffi.register_global_func("tvm_spinn.runtime.execute", override=True)
def execute(key: str, getter, symbol: str, *args) -> None:
    """Run the program of ``symbol`` on DPS arguments (inputs then outputs)."""
    program = load_program(key, getter)
    plan = program_plan(program)
    specs = plan.args  # (tid, shape, dtype) of inputs then outputs, prepared once per program
    if len(args) != len(specs):
        n_in, n_out = len(program.inputs), len(program.outputs)
        raise SpinnRuntimeError(
            f"{symbol}: expected {n_in} inputs and {n_out} outputs, got {len(args)} arguments"
        )
    arrays, device_outputs = [], []
    n_in = len(program.inputs)
    for index, ((tid, shape, dtype), arg) in enumerate(zip(specs, args)):
        try:
            arr = _from_dlpack(arg)
        except Exception:  # not a tensor, or not on the host
            arr = None
            device = _accelerator_tensor(arg)
            if device is not None:  # spinn/cuda: the VM hands us GPU tensors; the simulator runs on host memory
                arg = device.numpy() if index < n_in else np.empty(tuple(device.shape), str(device.dtype))
                if index >= n_in:
                    device_outputs.append((index - n_in, device))
                arr = _from_dlpack(arg)
            # else: _check below names the argument
        if arr is None or arr.shape != shape or arr.dtype != dtype:
            arr = _check(program, index, tid, arg)  # raises SpinnRuntimeError (or accepts)
        arrays.append(arr)
    ins, outs = arrays[:n_in], arrays[n_in:]
    if sim_mode() == "layers":  # layers producing outputs may write them in place
        results = plan.run(program, ins, outs)
    else:
        results = run_program(program, ins)
    for dst, src in zip(outs, results):
        if src is not dst:
            np.copyto(dst, src)
    for position, device in device_outputs:
        device.copyfrom(outs[position])
