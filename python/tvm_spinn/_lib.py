"""Loader and typed wrappers of the C++ runtime library ``lib/libtvm_spinn.so``.

The library registers global functions in the tvm-ffi registry when it is loaded:

* ``tvm_spinn.runtime.create_module(symbol, program) -> Module`` (module kind ``"spinn"``),
  ``tvm_spinn.runtime.save_to_bytes(Module) -> Bytes``, ``tvm_spinn.runtime.version()``,
* ``ffi.Module.load_from_bytes.spinn(Bytes) -> Module`` (used by ``tvm.runtime.load_module``),
* ``tvm_spinn.runtime.{begin,end}_external_export()``: while a sealed library is exported, spinn
  modules serialize a reference to their program (container version 3) and hand the programs
  to ``tvm_spinn.runtime.loader``, which stores them after the ELF contents,
* ``tvm_spinn.sim.{gemm_f32, gemm_i8, gemm_i16, row_sum_f32}``: bit-exact hardware kernels;
  ``tvm_spinn.sim.{gemm_f32_batched, gemm_i8_batched, gemm_i16_batched, im2col}``: whole-layer
  versions (one call per layer, multi-threaded: ``TVM_SPINN_SIM_THREADS``, default all cores).

This module depends on ``tvm_ffi`` only (not on ``tvm``) so that importing it stays cheap.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import threading
from pathlib import Path
from typing import Any

import tvm_ffi

from ._env import env

__all__ = [
    "LIBRARY_PATH",
    "create_module",
    "gemm_f32",
    "gemm_f32_batched",
    "gemm_i16",
    "gemm_i16_batched",
    "gemm_i8",
    "gemm_i8_batched",
    "im2col",
    "load_library",
    "load_module_from_bytes",
    "row_sum_f32",
    "save_to_bytes",
    "transpose2d",
    "version",
]

#: Default accumulator width of the integer GEMM kernels (bits, signed two's complement): the test
#: chip's. The simulator always passes the program's ``SpinnArch.acc_bits`` (24 on the production
#: chip) explicitly; this default only serves direct calls.
DEFAULT_ACC_BITS = 29

#: Where ``pip install -e .`` (CMake) places the library. ``TVM_SPINN_LIBRARY_PATH`` overrides.
LIBRARY_PATH = Path(__file__).resolve().parent / "lib" / "libtvm_spinn.so"

# A global function the library registers; if it already exists, a copy of the library is
# loaded (loading a second copy would abort: duplicate registration in a static initializer).
_PROBE_FUNC = "tvm_spinn.runtime.version"

_lock = threading.Lock()
_loaded_path: str | None = None
_handle: ctypes.CDLL | None = None  # keeps the library mapped for the process lifetime


def _library_path() -> Path:
    override = env("TVM_SPINN_LIBRARY_PATH")
    return Path(override).expanduser().resolve() if override else LIBRARY_PATH


def load_library() -> str:
    """Load ``libtvm_spinn.so`` once per process and return its path.

    Raises
    ------
    ImportError
        If the library has not been built, or cannot be loaded.
    """
    global _loaded_path, _handle
    if _loaded_path is not None:
        return _loaded_path
    with _lock:
        if _loaded_path is not None:
            return _loaded_path
        path = _library_path()
        if tvm_ffi.get_global_func(_PROBE_FUNC, allow_missing=True) is not None:
            # Already registered by a library loaded some other way (e.g. another checkout).
            _loaded_path = str(path)
            return _loaded_path
        if not path.is_file():
            raise ImportError(
                f"tvm_spinn runtime library not found at {path}. Build it with "
                f"`pip install -e .` from the tvm-spinn source tree (this runs CMake and "
                f"places libtvm_spinn.so there), or set TVM_SPINN_LIBRARY_PATH."
            )
        try:
            # tvm_ffi is imported above, so libtvm_ffi.so (our only non-system dependency) is
            # already mapped and satisfies the library's DT_NEEDED entry.
            _handle = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            raise ImportError(
                f"failed to load tvm_spinn runtime library {path}: {err}. Rebuild it with "
                f"`pip install -e .` against apache-tvm-ffi {tvm_ffi.__version__}."
            ) from err
        _loaded_path = str(path)
        return _loaded_path


# Pure memo: a global function of the loaded library, fixed for the process.
@functools.lru_cache(maxsize=None)
def _func(name: str) -> Any:
    load_library()
    return tvm_ffi.get_global_func(name)


class _ReadOnlyInput:
    """A writable-flagged numpy view of a read-only array's memory (keeps the array alive)."""

    def __init__(self, array: Any) -> None:
        self.base = array
        iface = dict(array.__array_interface__)
        iface["data"] = (iface["data"][0], False)
        self.__array_interface__ = iface


def _input(array: Any) -> Any:
    """DLPack cannot export read-only numpy arrays (e.g. a program's constants, views of its
    blob): the kernels only read their inputs, so such an input is passed as a writable-flagged
    view of the same memory instead of a copy."""
    flags = getattr(array, "flags", None)
    if flags is not None and not getattr(flags, "writeable", True):
        if hasattr(array, "__array_interface__"):
            import numpy as np

            return np.asarray(_ReadOnlyInput(array))
        return array.copy()
    return array


def gemm_f32(a: Any, b: Any, c: Any) -> None:
    """``C += A @ B`` in float32, in place, with hardware (non-fused VMLA.F32) rounding.

    ``A[M,K]``, ``B[K,N]``, ``C[M,N]``: C-contiguous float32 host arrays (numpy, torch, or
    any DLPack tensor). For each output the k terms are added in ascending order and both the
    product and the sum are rounded to float32.
    """
    _func("tvm_spinn.sim.gemm_f32")(_input(a), _input(b), c)


def gemm_i8(a: Any, b: Any, c: Any, acc_bits: int = DEFAULT_ACC_BITS) -> int:
    """``C += A @ B`` with int8 ``A``/``B`` and int32 ``C``, in place.

    Products are exact; each addition wraps to a signed ``acc_bits``-bit accumulator
    (``2 <= acc_bits <= 32``), k ascending. Returns the number of wrap events (overflows).
    """
    return int(_func("tvm_spinn.sim.gemm_i8")(_input(a), _input(b), c, operator.index(acc_bits)))


def gemm_i16(a: Any, b: Any, c: Any, acc_bits: int = DEFAULT_ACC_BITS) -> int:
    """As :func:`gemm_i8` with int16 operands (16-bit mode). Returns the wrap count."""
    return int(_func("tvm_spinn.sim.gemm_i16")(_input(a), _input(b), c, operator.index(acc_bits)))


def _batch_index(index: Any, batch: int, count: int) -> Any:
    """``index`` as a C-contiguous int64 array; ``None``: ``b % count`` (conv groups)."""
    import numpy as np

    if index is None:
        return np.arange(batch, dtype=np.int64) % max(count, 1)
    return _input(np.ascontiguousarray(index, dtype=np.int64))


def gemm_f32_batched(a: Any, b: Any, c: Any, a_index: Any = None, b_index: Any = None,
                     threads: int = 0) -> None:
    """``C[i] += A[a_index[i]] @ B[b_index[i]]`` for every ``i``, float32, in place.

    ``A[a_count,M,K]``, ``B[b_count,K,N]``, ``C[batch,M,N]`` (C-contiguous float32 numpy arrays);
    ``a_index``/``b_index``: int64 ``[batch]`` (default ``i % a_count`` / ``i % b_count``). Each
    output is :func:`gemm_f32`'s: k ascending, product and sum rounded separately. ``threads``:
    0 = ``$TVM_SPINN_SIM_THREADS``, else all cores (small jobs run on one); the bits never
    depend on it.
    """
    batch = c.shape[0]
    _func("tvm_spinn.sim.gemm_f32_batched")(
        _input(a), _input(b), c, _batch_index(a_index, batch, a.shape[0]),
        _batch_index(b_index, batch, b.shape[0]), operator.index(threads))


def gemm_i8_batched(a: Any, b: Any, c: Any, chunk: int, acc_bits: int = DEFAULT_ACC_BITS,
                    a_index: Any = None, b_index: Any = None, threads: int = 0) -> int:
    """``C[i] += A[a_index[i]] @ B[b_index[i]]`` (int8 operands, int32 ``C``) as the MAC array
    with the M4F: k in chunks of ``chunk``, each accumulated from 0 on a wrapping signed
    ``acc_bits``-bit accumulator (as :func:`gemm_i8`), the chunk sums added to ``C`` in int32
    (wrapping). Returns the accumulators' wrap count. Indexes and threads as
    :func:`gemm_f32_batched`."""
    batch = c.shape[0]
    return int(_func("tvm_spinn.sim.gemm_i8_batched")(
        _input(a), _input(b), c, _batch_index(a_index, batch, a.shape[0]),
        _batch_index(b_index, batch, b.shape[0]), operator.index(chunk), operator.index(acc_bits),
        operator.index(threads)))


def gemm_i16_batched(a: Any, b: Any, c: Any, chunk: int, acc_bits: int = DEFAULT_ACC_BITS,
                     a_index: Any = None, b_index: Any = None, threads: int = 0) -> int:
    """As :func:`gemm_i8_batched` with int16 operands."""
    batch = c.shape[0]
    return int(_func("tvm_spinn.sim.gemm_i16_batched")(
        _input(a), _input(b), c, _batch_index(a_index, batch, a.shape[0]),
        _batch_index(b_index, batch, b.shape[0]), operator.index(chunk), operator.index(acc_bits),
        operator.index(threads)))


def im2col(x: Any, kernel: tuple[int, int], strides=(1, 1), dilation=(1, 1),
           padding=(0, 0, 0, 0), groups: int = 1, fill: Any = 0, out_hw: tuple[int, int] | None = None,
           threads: int = 0) -> Any:
    """im2col of NCHW ``x``: ``[n * groups, (C / groups) * kh * kw, oh * ow]`` with rows in the
    OIHW weight's ``(c, i, j)`` order and columns ``oy * ow + ox``; padding
    (top, left, bottom, right) reads ``fill``. Pure data movement (numpy in, numpy out)."""
    import numpy as np

    x = np.ascontiguousarray(x)
    n, c, h, w = x.shape
    kh, kw = kernel
    sh, sw = strides
    dh, dw = dilation
    pt, pl, pb, pr = padding
    if out_hw is None and min(sh, sw, dh, dw) < 1:
        out_hw = (0, 0)  # the library rejects the geometry
    if out_hw is None:
        out_hw = ((h + pt + pb - dh * (kh - 1) - 1) // sh + 1, (w + pl + pr - dw * (kw - 1) - 1) // sw + 1)
    oh, ow = (max(int(v), 0) for v in out_hw)
    groups = max(int(groups), 1)
    out = np.empty((n * groups, (c // groups) * kh * kw, oh * ow), dtype=x.dtype)
    fill_arr = np.array([fill], dtype=x.dtype)
    _func("tvm_spinn.sim.im2col")(
        _input(x), out, fill_arr,
        [int(v) for v in (groups, kh, kw, sh, sw, dh, dw, pt, pl, oh, ow)], operator.index(threads))
    return out


def row_sum_f32(x: Any, out: Any) -> None:
    """``out[r] = sum(X[r, :])`` in float32, strictly left to right from ``0.0``, in place."""
    _func("tvm_spinn.sim.row_sum_f32")(_input(x), out)


def transpose2d(src: Any, dst: Any, threads: int = 0) -> None:
    """``dst[c, r] = src[r, c]`` for C-contiguous 2-D host arrays of one 1/2/4/8-byte dtype:
    a cache-blocked copy on ``threads`` threads (0: ``TVM_SPINN_SIM_THREADS`` or all cores;
    one thread below about 4 M elements)."""
    _func("tvm_spinn.sim.transpose2d")(_input(src), dst, operator.index(threads))


def create_module(symbol: str, program: bytes) -> tvm_ffi.Module:
    """Create a ``"spinn"`` runtime module for the offloaded function ``symbol``.

    ``mod[symbol](*inputs, *outputs)`` forwards to the global ``tvm_spinn.runtime.execute``
    as ``execute(key, program_getter, symbol, *inputs, *outputs)``; ``key`` is unique to the
    module object in this process. ``mod["get_program"]()``, ``mod["get_symbol"]()`` and
    ``mod["get_key"]()`` expose the contents. When the package is imported, the program is
    validated here (and by :func:`load_module_from_bytes`): a defective one raises
    ``tvm_spinn.program.ProgramError`` naming the field.
    """
    return _func("tvm_spinn.runtime.create_module")(str(symbol), bytes(program))


def save_to_bytes(mod: tvm_ffi.Module) -> bytes:
    """The module's ``SaveToBytes()`` (for a spinn module: its versioned container)."""
    return bytes(_func("tvm_spinn.runtime.save_to_bytes")(mod))


def load_module_from_bytes(data: bytes) -> tvm_ffi.Module:
    """Inverse of :func:`save_to_bytes` for spinn modules; raises ``ValueError`` on a bad container
    and ``ProgramError`` (a ``ValueError``) on an invalid program."""
    return _func("ffi.Module.load_from_bytes.spinn")(bytes(data))


def version() -> str:
    """Version string of the loaded runtime library, e.g. ``"spinn-runtime 0.1.0"``."""
    return str(_func("tvm_spinn.runtime.version")())
