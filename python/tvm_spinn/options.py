"""Every option of a spinn compilation in one typed, immutable struct (IREE/tt-mlir style).

:class:`SpinnOptions` holds the whole configuration as nested frozen records:

* ``mapping`` (:class:`MappingOptions`): how the mapping compiler tiles, places and schedules;
* ``build`` (:class:`BuildOptions` or None): how ``relax.build`` compiles the host fallback.

It reaches a build as an explicit argument (``map_program(..., options=...)``) or as a
thread-local, nestable context that the spinn passes read::

    opts = tvm_spinn.SpinnOptions.from_dict({"mapping": {"mode": "pipelined"}})
    with opts:
        ex = relax.build(mod, target="spinn")

``with MappingOptions(...)`` and ``with tvm_spinn.build_options(...)`` are shorthands that enter
the innermost active options with that part replaced; there is one stack, innermost wins.

Why not ``PassContext(config=...)``: TVM 0.27 accepts only config keys registered in C++
(``TVM_REGISTER_PASS_CONFIG_OPTION``, i.e. ``PassContext::RegisterConfigOption`` in
``libtvm_compiler.so``); Python has no registration call, the wheel ships no ``tvm/ir`` headers,
and ``libtvm_spinn.so`` links only ``libtvm_ffi`` (a stable C ABI), so it cannot register one
without depending on the compiler library's C++ ABI.

Environment variables never carry options; the few debugging switches are read in
:mod:`tvm_spinn._env`.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from dataclasses import replace as _replace

from ._scoped import ScopedOptions

__all__ = ["SpinnOptions", "MappingOptions", "BuildOptions", "current"]


def _type_name(tp) -> str:
    if tp is type(None):
        return "None"
    args = typing.get_args(tp)
    if args:
        return " or ".join(_type_name(a) for a in args)
    return getattr(tp, "__name__", str(tp))


def _matches(value, tp) -> bool:
    args = typing.get_args(tp)
    if args:  # a union such as ``str | None``
        return any(_matches(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _record_type(tp):
    """The options record class inside ``tp`` (``X`` or ``X | None``), else None."""
    for a in typing.get_args(tp) or (tp,):
        if isinstance(a, type) and issubclass(a, _Record):
            return a
    return None


class _Record:
    """Mixin of the option records: typed fields, ``from_dict``, ``replace``, ``as_dict``."""

    @classmethod
    def _hints(cls) -> dict:
        return typing.get_type_hints(cls)

    def _check_types(self) -> None:
        hints = self._hints()
        for f in fields(self):
            value = getattr(self, f.name)
            if not _matches(value, hints[f.name]):
                raise TypeError(f"{type(self).__name__}.{f.name}: expected {_type_name(hints[f.name])}, "
                                f"got {value!r} ({type(value).__name__})")

    @classmethod
    def _converted(cls, data, path: str) -> dict:
        """Keyword arguments from a mapping, checked field by field (errors name ``path.field``)."""
        if not isinstance(data, Mapping):
            raise TypeError(f"{path}: expected a mapping of fields, got {data!r} ({type(data).__name__})")
        hints = cls._hints()
        names = [f.name for f in fields(cls)]
        out = {}
        for key, value in data.items():
            if key not in names:
                raise TypeError(f"{path}: unknown field {key!r} (fields: {', '.join(names)})")
            tp, sub = hints[key], _record_type(hints[key])
            if sub is not None and isinstance(value, Mapping):
                value = sub._build(value, f"{path}.{key}")
            elif not _matches(value, tp):
                raise TypeError(f"{path}.{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
            out[key] = value
        return out

    @classmethod
    def _build(cls, data, path: str):
        kwargs = cls._converted(data, path)
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as err:  # a value check in the record: name the full path
            text, own = str(err), cls.__name__ + "."
            raise type(err)(path + text[len(cls.__name__):] if text.startswith(own) else f"{path}: {text}") from None

    @classmethod
    def from_dict(cls, data: Mapping):
        """The record from a (possibly partial, nested) dict; missing fields take defaults.

        Raises
        ------
        TypeError
            For an unknown field or a value of the wrong type, naming the field's full path and
            the expected type.
        ValueError
            For a value outside the field's allowed set.
        """
        return cls._build(data, cls.__name__)

    def replace(self, **changes):
        """A copy with ``changes``; a nested record's field may be given as a dict of its fields.

        Raises
        ------
        TypeError, ValueError
            As :meth:`from_dict`.
        """
        path = type(self).__name__
        hints = self._hints()
        merged = {}
        for key, value in changes.items():
            sub = _record_type(hints[key]) if key in hints else None
            if sub is not None and isinstance(value, Mapping):
                base = getattr(self, key) or sub()
                value = sub._build({**base.as_dict(), **value}, f"{path}.{key}")
            merged[key] = value
        return type(self)._build({**{f.name: getattr(self, f.name) for f in fields(self)}, **merged}, path)

    def as_dict(self) -> dict:
        """Every field, nested records as dicts (the inverse of :meth:`from_dict`)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.as_dict() if isinstance(value, _Record) else value
        return out


class _Part(_Record):
    """A record that is one field (``_slot``) of :class:`SpinnOptions`; ``with part:`` enters the
    innermost active :class:`SpinnOptions` with that field replaced."""

    _slot = ""

    def __enter__(self):
        outer = SpinnOptions.current() or SpinnOptions()
        _replace(outer, **{self._slot: self}).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        SpinnOptions._state.stack.pop()

    @classmethod
    def current(cls):
        """This part of the innermost active :class:`SpinnOptions`, or None outside any context."""
        outer = SpinnOptions.current()
        return None if outer is None else getattr(outer, cls._slot)


@dataclass(frozen=True)
class MappingOptions(_Part):
    """How the mapping compiler maps a region onto the system.

    Parameters
    ----------
    mode : {"auto", "sequential", "pipelined"}
        ``sequential``: every layer uses all PEs of the chips chosen for it, one layer after
        another (lowest latency for one input). ``pipelined``: layers get disjoint PE groups
        sized by their work and run as a spatial pipeline (highest throughput for a stream of
        inputs). ``auto`` picks by the cost model for ``objective``.
    objective : {"latency", "throughput"}
        What ``auto`` optimizes.
    weights : {"auto", "resident", "stream"}
        Keep weights in SRAM across inferences (loaded once at program load) or stream them from
        DRAM each inference. ``auto`` keeps as many as fit next to the working buffers, most
        re-fetched first, unless the timing model finds streaming them all faster (resident
        weights take the SRAM that would keep activations on chip).
    activations : {"auto", "dram"}
        ``auto`` keeps a layer's output in SRAM for the next layer when it fits (read over the
        NoC); ``dram`` always spills.
    naive : bool
        The baseline the benchmark compares with: fixed 16x4 MAC-shaped tiles, round-robin
        placement, no double buffering, every operand from DRAM, one chip.
    double_buffer : bool
        Load a PE's next tile while it computes the current one (the default). ``False``
        serializes fetch -> compute -> write-back on every PE (the setup of a scheduler that
        stages each layer's operands before computing, e.g. OctopuScheduler on SpiNNaker2).
    scheduler : {"static", "software"}
        ``static`` (the default): the compiled schedule; PEs start each layer on a barrier built
        from NoC packets. ``software``: the setup of a runtime scheduler on one PE (e.g.
        OctopuScheduler on SpiNNaker2), which the timing model costs: per layer the scheduler PE
        sends every worker PE its task descriptor as NoC packets, one worker after another; each
        worker takes an interrupt, reads the descriptor and programs its DMAs; the workers report
        completion with one packet each, which the scheduler takes one by one before it
        dispatches the next layer. The mapping (tiles, placement) is the same; only the timing
        changes. One chip only (the scheduler's packets to other chips are not costed).
    split_k : bool
        Let the mapper split an int8 tile's reduction over PEs when the tiles leave PEs idle
        (the default; kept only where the timing model finds it faster). ``False`` keeps every
        tile's whole reduction on one PE.
    row_tiles : bool
        Let the mapper cut an fp32 GEMM into row tiles of the M4F kernel's register block (the
        default; each tile shape is timed and the fastest kept): one of fewer rows than the MAC
        array, and one of more rows than one register block whose weights are held in SRAM
        (bands one or two register blocks high;
        :func:`tvm_spinn.program.ops.gemm.has_row_tiles` names the programs where the switch
        matters). ``False`` keeps MAC-high row tiles: a caller that times a mapping in a wider
        context (weights fetched ahead of a program while the DRAM channels are idle) compares
        the two tilings there. The bits are the same either way.
    """

    _slot = "mapping"

    mode: str = "auto"
    objective: str = "latency"
    weights: str = "auto"
    activations: str = "auto"
    naive: bool = False
    double_buffer: bool = True
    scheduler: str = "static"
    split_k: bool = True
    row_tiles: bool = True

    def __post_init__(self) -> None:
        self._check_types()
        for name, allowed in (("mode", ("auto", "sequential", "pipelined")),
                              ("objective", ("latency", "throughput")),
                              ("weights", ("auto", "resident", "stream")),
                              ("activations", ("auto", "dram")),
                              ("scheduler", ("static", "software"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"MappingOptions.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def to_dict(self) -> dict:
        """Every field: ``MappingOptions.from_dict(o.to_dict()) == o`` (a program stores its
        options in the form :func:`tvm_spinn.program.format.options_to_json` writes)."""
        return self.as_dict()


@dataclass(frozen=True)
class BuildOptions(_Part):
    """Options of the fallback build.

    Parameters
    ----------
    tuning_logs : str or None
        Work directory of a tuning job (:func:`tvm_spinn.tune`); its records schedule the
        PrimFuncs they match. Validated at build time (missing files, corrupt lines or logs for
        another target kind raise :class:`~tvm_spinn.tune.TuningLogError`).
    default_schedules : bool
        Give every PrimFunc not covered by tuning logs a default schedule (dlight rules plus
        parallel/vectorize on CPU). ``False`` leaves them as TVM's untuned build.
    """

    _slot = "build"

    tuning_logs: str | None = None
    default_schedules: bool = True

    def __post_init__(self) -> None:
        if self.tuning_logs is not None:
            if not isinstance(self.tuning_logs, (str, os.PathLike)):
                raise TypeError(f"BuildOptions.tuning_logs: expected a directory path, got {self.tuning_logs!r}")
            object.__setattr__(self, "tuning_logs", os.fspath(self.tuning_logs))
        self._check_types()
        if self.tuning_logs is not None and not os.path.isdir(self.tuning_logs):
            raise FileNotFoundError(
                f"tuning_logs directory {self.tuning_logs!r} does not exist "
                "(run tvm_spinn.tune(..., work_dir=...) first)"
            )


@dataclass(frozen=True)
class SpinnOptions(_Record, ScopedOptions):
    """Every option of a spinn compilation; ``with options:`` makes it the active one.

    Parameters
    ----------
    mapping : MappingOptions
        How the mapping compiler maps each region.
    build : BuildOptions or None
        How the host fallback is compiled. None: spinn targets use ``BuildOptions()`` and plain
        ``llvm``/``cuda`` targets are compiled exactly as TVM does; a value applies the fallback
        treatment to those targets too (opt-in).
    iss : bool
        Run the spinn regions of a built module called while these options are active as
        generated Cortex-M4F code in the instruction-set simulator (:mod:`tvm_spinn.pe`), the
        same bits as the default simulator, slower. ``$TVM_SPINN_SIM_MODE``, where set, decides
        instead.

    Examples
    --------
    >>> opts = SpinnOptions.from_dict({"mapping": {"mode": "pipelined"}})
    >>> opts.replace(mapping={"weights": "stream"}).mapping.mode
    'pipelined'
    """

    mapping: MappingOptions = MappingOptions()
    build: BuildOptions | None = None
    iss: bool = False

    def __post_init__(self) -> None:
        self._check_types()

    def to_dict(self) -> dict:
        """Every field, nested records as dicts: ``SpinnOptions.from_dict(o.to_dict()) == o``."""
        return self.as_dict()


def current() -> SpinnOptions:
    """The innermost active :class:`SpinnOptions` (defaults when none is active)."""
    return SpinnOptions.current() or SpinnOptions()
