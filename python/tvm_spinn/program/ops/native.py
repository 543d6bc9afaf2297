"""Native runs: consecutive layers described as one instruction list for the C++ interpreter
``tvm_spinn.sim.plan_create`` (``src/sim_plan.cc``), executed in one FFI call.

Each operator family describes its own layers (:meth:`OpFamily.native`) with a
:class:`NativeBuilder`: it reads operands (:meth:`NativeBuilder.read`), names its result
(:meth:`NativeBuilder.write`), adds prepared constants and scratch buffers, and emits
instructions whose kernels are the ones its Python step calls, so a run gives the same bits as
the per-layer steps. A family that cannot describe a layer returns False before emitting
anything; the simulator's plan then runs that layer in Python and starts a new run after it.

Buffers are symbolic (:class:`Ref`) while a run is built; :meth:`NativeBuilder.finish` numbers
them once the run's inputs and the values it hands back are known: constants, then the call's
arguments (inputs, then exported values), then temporaries.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ... import _lib
from .. import native_schema

__all__ = ["NativeBuilder", "NativeRun", "Ref", "broadcast_strides", "codes", "contiguous_strides", "f32_bits", "numel"]


# Pure memo: the schema's constants, fixed for the process.
@functools.lru_cache(maxsize=None)
def codes() -> dict[str, int]:
    """Instruction and kind codes, from the one schema the C++ interpreter's header is generated
    from (:mod:`tvm_spinn.program.native_schema`)."""
    return native_schema.codes()


def f32_bits(value) -> int:
    """The bits of ``value`` rounded to float32, as the int the instruction stream carries."""
    return int(np.asarray(value, dtype=np.float32).reshape(()).view(np.uint32))


def contiguous_strides(shape) -> list[int]:
    """Row-major element strides of ``shape``."""
    strides, step = [], 1
    for extent in reversed(list(shape)):
        strides.append(step)
        step *= int(extent)
    return strides[::-1]


@dataclass(frozen=True)
class Ref:
    """A buffer while a run is built: ``kind`` ``"value"`` (a tensor id's value), ``"const"`` or
    ``"temp"`` (an index)."""

    kind: str
    key: int


@dataclass(frozen=True)
class NativeRun:
    """A finished run: ``run(*inputs, *exported)`` over the values of ``inputs`` (tensor ids)
    writes the values of ``exported`` (tensor id, shape, dtype)."""

    run: Callable
    inputs: tuple[int, ...]
    exported: tuple[tuple[int, tuple[int, ...], np.dtype], ...]
    layers: int
    #: the plan as :func:`tvm_spinn.sim.plan_create` took it (what a native section stores)
    code: tuple[int, ...] = ()
    consts: tuple[np.ndarray, ...] = ()
    temps: tuple[int, ...] = ()


class NativeBuilder:
    """Collects one run's instructions (see the module docstring)."""

    def __init__(self, program):
        self.program = program
        self.code: list = []  # ints and Refs
        self.consts: list[np.ndarray] = []
        self.temps: list[int] = []  # bytes
        self.values: dict[int, Ref] = {}  # tensor id -> the buffer holding its value
        self.aliases: set[int] = set()  # tensor ids whose value is another's buffer
        self.inputs: list[int] = []  # tensor ids read from outside the run, first use first
        self.layers = 0
        self._const_of: dict[int, Ref] = {}

    # -- what families call --------------------------------------------------------------------
    def read(self, tid: int) -> Ref:
        """The buffer of tensor ``tid``'s value: a program constant, a value this run made, or
        an input of the run."""
        ref = self.values.get(tid)
        if ref is not None:
            return ref
        if tid in self.program.constants:
            ref = self._const_of.get(tid)
            if ref is None:
                ref = self._const_of[tid] = self.const(self.program.constants[tid])
            return ref
        if tid not in self.inputs:
            self.inputs.append(tid)
        return Ref("value", tid)

    def write(self, tid: int) -> Ref:
        """The buffer a layer writes tensor ``tid``'s value into."""
        ref = self.values[tid] = Ref("value", tid)
        return ref

    def alias(self, tid: int, source: int) -> None:
        """Tensor ``tid`` has the bytes of ``source`` (a reshape; a clip applied by its GEMM)."""
        self.values[tid] = self.read(source)
        self.aliases.add(tid)

    def const(self, array) -> Ref:
        """A prepared constant (weights as the kernel reads them, index vectors)."""
        array = np.ascontiguousarray(array)
        self.consts.append(array)
        return Ref("const", len(self.consts) - 1)

    def temp(self, nbytes: int) -> Ref:
        """A scratch buffer of ``nbytes`` (e.g. im2col columns)."""
        self.temps.append(int(nbytes))
        return Ref("temp", len(self.temps) - 1)

    def emit(self, op: str, *words) -> None:
        """Append instruction ``op`` with its words (ints, float32 bits, Refs, or lists of them),
        as many as the schema gives it (:mod:`tvm_spinn.program.native_schema`)."""
        spec = native_schema.instruction(op)
        flat: list = []
        for w in words:
            if isinstance(w, (list, tuple)):
                flat.extend(int(v) for v in w)
            else:
                flat.append(w if isinstance(w, Ref) else int(w))
        want = len(spec.fields)
        if spec.rank_field is not None:
            want += spec.per_dim * int(flat[spec.rank_at - 1])
        if len(flat) != want:
            raise ValueError(f"native instruction {op}: {len(flat)} words, the schema gives it {want}")
        self.code.append(spec.code)
        self.code.extend(flat)

    # -- what the plan calls ------------------------------------------------------------------
    def checkpoint(self):
        return (len(self.code), len(self.consts), len(self.temps), dict(self.values),
                set(self.aliases), list(self.inputs), dict(self._const_of))

    def rollback(self, state) -> None:
        n_code, n_consts, n_temps, values, aliases, inputs, const_of = state
        del self.code[n_code:], self.consts[n_consts:], self.temps[n_temps:]
        self.values, self.aliases, self.inputs, self._const_of = values, aliases, inputs, const_of

    def finish(self, exported: set[int]) -> NativeRun:
        """Number the buffers and create the C++ plan; ``exported``: the tensor ids this run
        made that are read after it (or are program outputs)."""
        tensors = self.program.tensors
        out_ids = sorted(t for t in self.values if t in exported)
        n_consts = len(self.consts)
        arg_of: dict[int, int] = {}
        for tid in self.inputs:
            arg_of.setdefault(tid, len(arg_of))
        in_count = len(arg_of)
        out_slot = {tid: n_consts + in_count + i for i, tid in enumerate(out_ids)}
        n_args = in_count + len(out_ids)
        temp_of: dict[int, int] = {}
        temps = list(self.temps)

        def nbytes(tid):
            spec = tensors[tid]
            return int(np.prod(spec.shape, dtype=np.int64)) * np.dtype(spec.dtype).itemsize

        def slot(ref: Ref) -> int:
            if ref.kind == "const":
                return ref.key
            if ref.kind == "temp":
                return n_consts + n_args + ref.key
            tid = ref.key
            if tid in arg_of:
                return n_consts + arg_of[tid]
            if tid in out_slot and tid not in self.aliases:
                return out_slot[tid]
            if tid not in temp_of:
                temp_of[tid] = len(temps)
                temps.append(nbytes(tid))
            return n_consts + n_args + temp_of[tid]

        code = [slot(w) if isinstance(w, Ref) else w for w in self.code]
        for tid in out_ids:  # an exported alias gets its own copy of the bytes
            if tid in self.aliases:
                n = nbytes(tid)
                code += [codes()["copy"], slot(self.values[tid]), out_slot[tid], 1, 1, 0, 0, n, 1, 1]
        arg_bytes = [nbytes(t) for t in arg_of] + [nbytes(t) for t in out_ids]
        consts = [_lib._input(c) for c in self.consts]
        run = _lib._func("tvm_spinn.sim.plan_create")(code, consts, arg_bytes, temps)
        exported_specs = tuple((t, tuple(int(d) for d in tensors[t].shape), np.dtype(tensors[t].dtype))
                               for t in out_ids)
        return NativeRun(run, tuple(arg_of), exported_specs, self.layers, tuple(int(w) for w in code),
                         tuple(self.consts), tuple(int(t) for t in temps))


def broadcast_strides(shape, out_shape) -> list[int] | None:
    """Element strides reading a row-major ``shape`` broadcast to ``out_shape`` (0 on broadcast
    axes), or None if it does not broadcast."""
    shape, out_shape = list(shape), list(out_shape)
    if len(shape) > len(out_shape):
        return None
    own = contiguous_strides(shape)
    pad = len(out_shape) - len(shape)
    strides = []
    for d, extent in enumerate(out_shape):
        if d < pad:
            strides.append(0)
            continue
        s = shape[d - pad]
        if s == extent:
            strides.append(own[d - pad] if extent != 1 else 0)
        elif s == 1:
            strides.append(0)
        else:
            return None
    return strides


def numel(shape) -> int:
    return int(math.prod(int(d) for d in shape))
