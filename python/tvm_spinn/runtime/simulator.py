"""Bit-exact functional simulator: executes a spinn program tile by tile.

Numerics are those of the hardware path each layer runs on:

- fp32 GEMMs (conv2d, dense, matmul) on the Cortex-M4F: ``acc = fl(acc + fl(a * b))`` with k
  strictly ascending (VMLA.F32 is not fused), in the C++ kernel ``tvm_spinn.sim.gemm_f32``; a
  tile's k-chunks run in order on one PE, so results do not depend on the tiling. Bias is added
  to the finished accumulator, then ReLU.
- reductions (softmax sum, layer_norm mean/variance, mean) are sequential fp32 sums per row
  (``tvm_spinn.sim.row_sum_f32``); element-wise ops are single fp32 operations (numpy float32).
- int8 GEMMs (``mode="int8"``) on the MAC array: raw int8 products into ``acc_bits``-bit
  wrapping accumulators (C++ kernel ``tvm_spinn.sim.gemm_i8``), one k-chunk at a time; the M4F
  adds chunk sums in 32-bit, applies the zero-point terms and the epilogue
  (:mod:`tvm_spinn.program.quant`). ``quantize`` is ``clamp(rint(x / s) + z)`` in fp32 (round
  half to even, VCVTR); ``dequantize`` is ``fl(q - z) * s``.
- Execution modes (``TVM_SPINN_SIM_MODE`` or ``run_program(..., mode=...)``): ``"layers"``
  (default) runs every layer whole: a GEMM layer is one call of a batched, multi-threaded C++
  kernel (``gemm_f32_batched`` / ``gemm_i8_batched`` with the program's k-chunk length, conv
  operands gathered by the C++ ``im2col``; ``TVM_SPINN_SIM_THREADS`` threads, default all cores,
  never changing the bits), every other layer one region covering its whole output; runs of
  consecutive layers whose families describe them natively (:meth:`OpFamily.native`) execute as
  one C++ instruction list per run (``src/sim_plan.cc``; ``TVM_SPINN_SIM_NATIVE=0``: every layer
  from Python, the same bits). ``"tiles"``
  executes the mapping tile by tile and k-chunk by k-chunk (the reference). Each output element's
  arithmetic is independent of the tiling (a GEMM output reduces in ascending k from 0 on one PE),
  so both give the same bits (tests/runtime/test_sim_modes.py).
- ``exp`` (softmax, sigmoid, GELU's erf) and ``tanh`` come from the exp/log unit, modelled by
  one fixed float32 algorithm in C++ (Cephes expf/tanhf; ``tvm_spinn.sim.exp_f32``), so the bits
  do not depend on the host (numpy's float32 ``exp`` gives different bits on its baseline and
  AVX2 paths); ``erf`` (GELU) is the M4F library's rational approximation in fp32
  (Abramowitz-Stegun 7.1.26, |error| < 1.5e-7). Each layer kind's arithmetic is defined by its
  operator family (:mod:`tvm_spinn.program.ops`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ..program import Layer, Program, Tile
from .. import _lib
from .. import options as _options
from .._env import env
from ..program.ops import family_of
from ..program.ops.gemm import GEMM_KINDS
from ..program.ops.movement import Movement
from ..program.ops.native import NativeBuilder, NativeRun
from ..program.ops.elementwise import unary
from ..program.tiles import layer_tiles

__all__ = ["MODES", "check_program", "forget_plans", "native_enabled", "program_plan", "register_mode", "run_program",
           "sim_mode"]

#: Simulator execution modes; ``TVM_SPINN_SIM_MODE`` picks one (default ``"layers"``). ``"iss"``
#: runs generated Cortex-M4F code in an instruction-set simulator (:mod:`tvm_spinn.pe`).
MODES = ("layers", "tiles", "iss")


#: Modes run by packages above the runtime (``"iss"``: :func:`tvm_spinn.pe.run_program_iss`,
#: registered when ``tvm_spinn`` initializes; the runtime does not import them).
_MODE_RUNNERS: dict = {}
#: Compile-time checks of those modes (``"iss"``: every layer has a PE kernel), run by the
#: codegen on each program when the build asks for the mode, so a layer the mode cannot run is
#: named by ``relax.build``, not at the first call.
_MODE_CHECKS: dict = {}


def register_mode(name: str, runner, check=None) -> None:
    """Run mode ``name`` (one of :data:`MODES`) with ``runner(program, inputs) -> outputs``;
    ``check(program)``, if given, raises for a program the mode cannot run (see
    :func:`check_program`)."""
    if name not in MODES:
        raise ValueError(f"simulator mode {name!r}: expected one of {MODES}")
    _MODE_RUNNERS[name] = runner
    if check is not None:
        _MODE_CHECKS[name] = check


def check_program(program: Program) -> None:
    """Raise at compile time for a program the active mode (:func:`sim_mode`) cannot run: the
    mode's registered check (``iss``: a layer without a PE kernel, named with the reason)."""
    check = _MODE_CHECKS.get(sim_mode())
    if check is not None:
        check(program)


def sim_mode(mode: str | None = None) -> str:
    """The execution mode: ``mode`` if given, else ``$TVM_SPINN_SIM_MODE``, else ``"iss"`` where
    the active :class:`~tvm_spinn.options.SpinnOptions` ask for it, else ``"layers"``."""
    mode = mode or env("TVM_SPINN_SIM_MODE") or ("iss" if _options.current().iss else "layers")
    if mode not in MODES:
        raise ValueError(f"simulator mode {mode!r}: expected one of {MODES} (TVM_SPINN_SIM_MODE)")
    return mode

_F32 = np.float32


class _LayerRunner:
    """Tile-by-tile execution of one layer: the operands laid out once by the layer's family
    (``prepare_tiles``), then ``run(tile)`` per tile into ``out``."""

    def __init__(self, program: Program, layer: Layer, env):
        self.p, self.layer, self.env = program, layer, env
        self.out = np.zeros(program.tensors[layer.output].shape, dtype=program.tensors[layer.output].dtype)
        self.family = family_of(layer.kind)
        self.family.prepare_tiles(self)

    def run(self, tile: Tile) -> None:
        self.family.run_tile(self, tile)


# -- tiles: the only access to the program's tiling -------------------------------------------
def _layer_tiles(program: Program, index: int):
    """The tiles of layer ``index``: objects with ``.region`` and ``.k_splits``."""
    return layer_tiles(program, index)


# -- "layers" mode: every layer whole --------------------------------------------------------
class _Whole:
    """A pseudo-tile covering a layer's whole output (its region only)."""

    __slots__ = ("region",)

    def __init__(self, region):
        self.region = region


def _run_whole(program: Program, index: int, layer: Layer, env) -> np.ndarray:
    """Layer ``index`` over its whole output: the family's whole-layer kernel, else its tile
    kernel on one tile covering the output."""
    spec = program.tensors[layer.output]
    family = family_of(layer.kind)
    out = family.run_whole(program, index, layer, env, np.empty(spec.shape, dtype=spec.dtype))
    if out is not None:
        return out
    runner = _LayerRunner(program, layer, env)
    runner.run(_Whole(family.whole_region(layer, runner.out)))
    return runner.out


# -- execution plans: what "layers" mode prepares once per program ---------------------------
# A call of a small model's region costs mostly Python per layer (GEMM shapes, operand views,
# read-only constant views for the FFI, index vectors, dictionary look-ups). A plan does that work
# once per Program: per layer one prepared step ``step(program, env) -> output array`` over a list
# ``env`` indexed by tensor id. Steps hold only read-only prepared constants: every call allocates
# its own outputs and intermediates (nothing a caller holds is written later, and concurrent calls
# share no scratch). The arithmetic is that of _run_whole, operation for operation (same bits).


def native_enabled() -> bool:
    """Whether plans run layer runs natively (``TVM_SPINN_SIM_NATIVE``, default on; ``0``: every
    layer in Python, the reference for the native runs' bits)."""
    return env("TVM_SPINN_SIM_NATIVE", "1") != "0"


class _Plan:
    __slots__ = ("template", "steps", "args", "outputs", "native_layers", "native_runs", "python_layers",
                 "nbytes", "__weakref__")

    # Read-only once built: every program with the same digest runs it
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __init__(self, program: Program, native: bool = True):
        #: the bytes of the constants it holds (what the plan cache weighs it by)
        self.nbytes = sum(int(np.asarray(v).nbytes) for v in program.constants.values())
        tensors = program.tensors
        template: list = [None] * len(tensors)
        for tid, value in program.constants.items():
            template[tid] = value
        self.template = template
        #: (tid, shape, dtype) of the DPS arguments: inputs then outputs (see executor.execute)
        self.args = tuple((tid, tuple(tensors[tid].shape), np.dtype(tensors[tid].dtype))
                          for tid in (*program.inputs, *program.outputs))
        self.outputs = frozenset(program.outputs)
        fused = _fusable_clips(program)  # GEMM layer index -> its clip layer's index
        clip_of = {index: program.layers[j] for index, j in fused.items()}
        absorbed = {j: program.layers[index].output for index, j in fused.items()}
        last_read = {}  # tensor id -> index of the last layer reading it
        for index, layer in enumerate(program.layers):
            for tid in layer.inputs:
                last_read[tid] = index
        steps = []
        run, run_end = None, -1  # the open native run (a NativeBuilder) and its last layer
        self.native_layers = 0
        #: the native runs, in order (what a program's native section stores)
        self.native_runs: list[NativeRun] = []
        #: (layer index, why) of each layer run from Python, in order
        self.python_layers: list[tuple[int, str]] = []

        def close():
            nonlocal run
            if run is not None:
                exported = {t for t in run.values if t in self.outputs or last_read.get(t, -1) > run_end}
                finished = run.finish(exported)
                self.native_runs.append(finished)
                steps.append((None, _native_step(program, finished), None))
                self.native_layers += run.layers
                run = None

        for index, layer in enumerate(program.layers):
            if index in absorbed:  # its GEMM applied the clip: the value is the GEMM's result
                source = absorbed[index]
                if run is not None and source in run.values:
                    run.alias(layer.output, source)
                    run.layers += 1
                    run_end = index
                    continue
                close()
                steps.append((layer.output, lambda program, env, source=source: env[source], None))
                continue
            why = _native_refusal(program, layer) if native else "native runs are off (TVM_SPINN_SIM_NATIVE=0)"
            if why is None:
                if run is None:
                    run = NativeBuilder(program)
                state = run.checkpoint()
                try:
                    done = family_of(layer.kind).native(program, layer, run, clip_of.get(index))
                    why = None if done else f"the {layer.kind} family has no native description of these attributes"
                except Exception as err:  # a malformed layer fails in Python, where _run_whole fails
                    done, why = False, f"{type(err).__name__}: {err}"
                if done:
                    run.layers += 1
                    run_end = index
                    continue
                run.rollback(state)
            self.python_layers.append((index, why))
            close()
            step = _build_step(program, index, layer, clip_of.get(index))
            # step.into(program, env, out): the same values written into ``out`` (None: a new
            # array), for layers that produce a program output
            into = getattr(step, "into", None) if layer.output in self.outputs else None
            steps.append((layer.output, step, into))
        close()
        self.steps = tuple(steps)

    def run(self, program: Program, inputs, outs=None) -> list[np.ndarray]:
        """Outputs of ``program`` on ``inputs``. ``outs``: the caller's output arrays (DPS), which
        layers producing an output may fill directly (the result is then that array); an output
        array sharing memory with an input or another output is not written here."""
        env = self.template.copy()
        for tid, value in zip(program.inputs, inputs):
            env[tid] = value
        into = None
        if outs is not None:
            into = {}
            taken = list(inputs)
            for tid, dst in zip(program.outputs, outs):
                if (type(dst) is np.ndarray and dst.flags.c_contiguous and dst.flags.writeable
                        and tid not in into and not any(np.may_share_memory(dst, v) for v in taken)):
                    into[tid] = dst
                taken.append(dst)
        with np.errstate(all="ignore"):
            if into:
                for tid, step, fill in self.steps:
                    if tid is None:  # a native run: writes its values into env
                        step(env, into)
                        continue
                    dst = into.get(tid) if fill is not None else None
                    env[tid] = step(program, env) if dst is None else fill(program, env, dst)
            else:
                for tid, step, _ in self.steps:
                    if tid is None:
                        step(env, None)
                    else:
                        env[tid] = step(program, env)
        return [env[tid] for tid in program.outputs]


def _native_ok(program: Program, layer: Layer) -> bool:
    """Layers a native run may take: fp32 arithmetic, data movement or int8 GEMMs, every extent
    > 0, every constant present (the conditions of a prepared Python step)."""
    return _native_refusal(program, layer) is None


def _native_refusal(program: Program, layer: Layer) -> str | None:
    """Why a native run may not take ``layer`` (see :func:`_native_ok`), or None."""
    family = family_of(layer.kind)
    if family is None:
        return f"kind {layer.kind} has no operator family"
    if not (layer.mode == "fp32" or (layer.mode == "int8" and (
            isinstance(family, Movement) or layer.kind in GEMM_KINDS))):
        return f"{layer.kind} in mode {layer.mode} has no native description"
    if not all(int(d) > 0 for d in program.tensors[layer.output].shape):
        return "an empty output"
    if not all(tid in program.constants for tid in layer.consts.values()):
        return "a constant operand is not in the program"
    return None


def _layer_named(names: tuple, message: str) -> str:
    """``"tvm_spinn.sim plan: layer <i>: <what>"`` as ``"<layer name>: <what>"``."""
    head, _, rest = message.partition("layer ")
    index, _, what = rest.partition(": ")
    if "tvm_spinn.sim plan" in head and index.isdigit() and int(index) < len(names):
        return f"{names[int(index)]}: {what}"
    return message


def _native_step(program: Program, run: NativeRun):
    """The plan step of a native run: its inputs from ``env`` (contiguous, read-only ones as
    flagged views), its values into new arrays or the caller's output buffers."""
    call, inputs, exported = run.run, run.inputs, run.exported
    _input = _lib._input
    # the layer names, not the program: plans live in a global table and must not keep their
    # program alive (they are dropped with it)
    names = tuple(layer.name for layer in program.layers)

    def step(env, into):
        args = []
        for tid in inputs:
            x = env[tid]
            if not x.flags.c_contiguous:
                x = np.ascontiguousarray(x)
            args.append(_input(x))
        outs = []
        for tid, shape, dtype in exported:
            dst = into.get(tid) if into else None
            outs.append(dst if dst is not None else np.empty(shape, dtype=dtype))
        try:
            call(*args, *outs)
        except IndexError as err:  # a gather's index out of range: name the layer, as Python does
            raise IndexError(_layer_named(names, str(err))) from None
        for (tid, _, _), value in zip(exported, outs):
            env[tid] = value
    return step


#: The plan cache's bounds: plans are dropped least recently used first once there are more
#: than PLAN_CACHE_ENTRIES of them or their constants exceed PLAN_CACHE_BYTES (the newest one is
#: always kept). A model's regions run in turn at every inference, so the count bound leaves room
#: for a model of many regions; the byte bound is the runtime's parsed-program cache's
#: (``executor._CACHE_BYTES``), so a plan outlives its program by at most that much memory.
PLAN_CACHE_ENTRIES = 64
PLAN_CACHE_BYTES = 4 << 30
_PLANS: OrderedDict = OrderedDict()  # (program digest, native) -> _Plan
_PLANS_LOCK = threading.Lock()


def program_plan(program: Program) -> _Plan:
    """The execution plan of ``program`` (built on first use, per :func:`native_enabled`
    setting), from a bounded cache keyed by the program's digest (:attr:`Program.digest`): equal
    programs -- the same bytes, such as one program loaded by two modules -- share one plan, and
    nothing is kept on the program. A plan only reads the program it was built from."""
    key = (program.digest, native_enabled())
    with _PLANS_LOCK:
        plan = _PLANS.get(key)
        if plan is not None:
            _PLANS.move_to_end(key)
            return plan
    plan = _Plan(program, key[1])  # concurrent first calls may both build: equal plans, one is kept
    with _PLANS_LOCK:
        plan = _PLANS.setdefault(key, plan)
        _PLANS.move_to_end(key)
        total = sum(p.nbytes for p in _PLANS.values())
        while len(_PLANS) > 1 and (len(_PLANS) > PLAN_CACHE_ENTRIES or total > PLAN_CACHE_BYTES):
            _, old = _PLANS.popitem(last=False)
            total -= old.nbytes
    return plan


def forget_plans() -> None:
    """Drop every cached execution plan (they are rebuilt on next use): for tests and benchmarks
    that change how plans are built."""
    with _PLANS_LOCK:
        _PLANS.clear()


def _generic_step(index: int, layer: Layer):
    """The unprepared path (:func:`_run_whole`): kinds and cases without a prepared step."""
    return lambda program, env: _run_whole(program, index, layer, env)


def _fusable_clips(program: Program) -> dict[int, int]:
    """{layer index: clip layer index} for fp32 layers of a family that fuses clips
    (:attr:`~tvm_spinn.program.ops.OpFamily.fuses_clip`) whose result only a clip (no ReLU of
    its own, same shape) reads and that is not a program output: the layer's epilogue applies
    the clip (``x < hi ? x : hi``, then ``> lo``: the clip's own operations, in place)."""
    readers: dict[int, list[int]] = {}
    for index, layer in enumerate(program.layers):
        for tid in set(layer.inputs):
            readers.setdefault(tid, []).append(index)
    outputs = set(program.outputs)
    tensors = program.tensors
    fused = {}
    for index, layer in enumerate(program.layers):
        users = readers.get(layer.output, ())
        family = family_of(layer.kind)
        if (family is None or not family.fuses_clip or layer.mode != "fp32"
                or layer.output in outputs or len(users) != 1):
            continue
        clip = program.layers[users[0]]
        if (clip.kind == "clip" and clip.mode == "fp32" and list(clip.inputs) == [layer.output]
                and not clip.attrs.get("relu")
                and tensors[clip.output].shape == tensors[layer.output].shape
                and tensors[clip.output].dtype == tensors[layer.output].dtype == "float32"):
            fused[index] = users[0]
    return fused


def _build_step(program: Program, index: int, layer: Layer, clip: Layer | None = None):
    """The layer's step; ``clip``: a clip layer whose operations this step applies."""
    if layer.mode not in ("fp32", "int8"):
        def unsupported(program, env, name=layer.name, mode=layer.mode):
            raise NotImplementedError(f"layer {name}: mode {mode} is not simulated")
        return unsupported
    family = family_of(layer.kind)
    try:
        tensors = program.tensors
        spec = tensors[layer.output]
        if all(int(d) > 0 for d in spec.shape) and all(tid in program.constants for tid in layer.consts.values()):
            step = family.step(program, layer, clip) if clip is not None else family.step(program, layer)
            if step is not None:
                return step
    except Exception:  # a malformed layer fails when it runs, where _run_whole fails
        pass
    step = _generic_step(index, layer)
    if clip is None:
        return step
    attrs = clip.attrs  # the clip layer's own operations (its step is then a pass-through)
    return lambda program, env: unary("clip", step(program, env), attrs)


def run_program(program: Program, inputs: list[np.ndarray], mode: str | None = None) -> list[np.ndarray]:
    """Execute ``program`` on ``inputs`` (in ``program.inputs`` order); returns its outputs.

    ``mode`` (default ``$TVM_SPINN_SIM_MODE``, else ``"layers"``): ``"layers"`` runs every layer
    whole (from the program's prepared plan, :func:`program_plan`), ``"tiles"`` executes every
    tile of the mapping (reference); the bits are the same. ``"iss"`` runs the program as
    generated PE code in the instruction-set simulator (:func:`tvm_spinn.pe.run_program_iss`:
    the same bits on the layers it lowers, an error naming any layer it cannot)."""
    mode = sim_mode(mode)
    if mode == "layers":
        return program_plan(program).run(program, inputs)
    if mode in _MODE_RUNNERS:
        return _MODE_RUNNERS[mode](program, inputs)
    if mode == "iss":
        raise RuntimeError("simulator mode 'iss': tvm_spinn.pe is not registered (import tvm_spinn)")
    env: dict[int, np.ndarray] = dict(program.constants)
    for tid, value in zip(program.inputs, inputs):
        env[tid] = value
    # IEEE hardware does not trap: overflow to inf, 0/0 = NaN and NaN comparisons are results,
    # not errors, so numpy must not warn about them (nor raise under -W error).
    with np.errstate(all="ignore"):
        for index, layer in enumerate(program.layers):
            if layer.mode not in ("fp32", "int8"):
                raise NotImplementedError(f"layer {layer.name}: mode {layer.mode} is not simulated")
            runner = _LayerRunner(program, layer, env)
            for tile in _layer_tiles(program, index):
                runner.run(tile)
            env[layer.output] = runner.out
    return [env[tid] for tid in program.outputs]
