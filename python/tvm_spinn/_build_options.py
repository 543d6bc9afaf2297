"""``build_options``: how ``relax.build`` compiles the fallback, set by a thread-local context.

``relax.build`` has no slot for plugin options, so (like :class:`tvm_spinn.MappingOptions`) the
options are read from a context by the spinn-aware default pipeline::

    with tvm_spinn.build_options(tuning_logs="logs"):
        ex = relax.build(mod, target="spinn")

Rules:

* spinn targets always get the fallback treatment; without a context they use
  ``BuildOptions()`` (default schedules on, no tuning logs).
* plain ``llvm``/``cuda`` targets are compiled exactly as TVM does, unless a ``build_options``
  context is active: then the same treatment applies (opt-in).
* ``default_schedules=False`` gives TVM's untuned build (the benchmark's baseline).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ._scoped import ScopedOptions

__all__ = ["BuildOptions", "build_options", "current_build_options", "active_build_options"]


@dataclass(frozen=True)
class BuildOptions(ScopedOptions):
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

    tuning_logs: str | None = None
    default_schedules: bool = True

    def __post_init__(self) -> None:
        if self.tuning_logs is not None:
            if not isinstance(self.tuning_logs, (str, os.PathLike)):
                raise TypeError(f"tuning_logs must be a directory path, got {self.tuning_logs!r}")
            object.__setattr__(self, "tuning_logs", os.fspath(self.tuning_logs))
            if not os.path.isdir(self.tuning_logs):
                raise FileNotFoundError(
                    f"tuning_logs directory {self.tuning_logs!r} does not exist "
                    "(run tvm_spinn.tune(..., work_dir=...) first)"
                )
        if not isinstance(self.default_schedules, bool):
            raise TypeError(f"default_schedules must be a bool, got {self.default_schedules!r}")


def build_options(tuning_logs: str | None = None, default_schedules: bool = True) -> BuildOptions:
    """Options for the fallback of ``relax.build``; use as ``with build_options(...):``.

    Parameters
    ----------
    tuning_logs : str, optional
        Tuning work directory whose records to apply.
    default_schedules : bool
        Default schedules for the untuned PrimFuncs.

    Returns
    -------
    BuildOptions
        A context manager (thread-local; nests, innermost wins).
    """
    return BuildOptions(tuning_logs=tuning_logs, default_schedules=default_schedules)


def current_build_options() -> BuildOptions | None:
    """The innermost active :class:`BuildOptions`, or None outside any context."""
    return BuildOptions.current()


def active_build_options(spinn: bool) -> BuildOptions | None:
    """Options that apply to a build: the context's, else defaults for spinn targets only."""
    current = current_build_options()
    if current is not None:
        return current
    return BuildOptions() if spinn else None
