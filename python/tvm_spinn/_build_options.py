"""``build_options``: how ``relax.build`` compiles the fallback, set by a thread-local context.

``relax.build`` has no slot for plugin options, so the ``build`` part of the active
:class:`tvm_spinn.SpinnOptions` is read by the spinn-aware default pipeline::

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

from .options import BuildOptions, SpinnOptions

__all__ = ["BuildOptions", "build_options", "current_build_options", "active_build_options"]


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
        A context manager: enters the active :class:`~tvm_spinn.SpinnOptions` with this
        ``build`` part (thread-local; nests, innermost wins).
    """
    return BuildOptions(tuning_logs=tuning_logs, default_schedules=default_schedules)


def current_build_options() -> BuildOptions | None:
    """The ``build`` part of the innermost active options, or None when it is unset."""
    outer = SpinnOptions.current()
    return None if outer is None else outer.build


def active_build_options(spinn: bool) -> BuildOptions | None:
    """Options that apply to a build: the context's, else defaults for spinn targets only."""
    current = current_build_options()
    if current is not None:
        return current
    return BuildOptions() if spinn else None
