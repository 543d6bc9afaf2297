"""Every point where tvm_spinn plugs into TVM, in one place.

Registrations (TVM's own registries; nothing of TVM's is replaced):

* target tags ``spinn``, ``spinn/board``, ``spinn/cloud``, ``spinn/cuda``... (``target.tag``;
  :func:`tvm_spinn.target.register_default_tags`),
* the BYOC codegen ``relax.ext.spinn`` and the runtime callback (global functions, registered
  when :mod:`tvm_spinn.codegen` and :mod:`tvm_spinn.runtime.executor` are imported),
* the error type ``tvm_spinn.SpinnRuntimeError`` (``tvm_ffi.register_error``), so a runtime
  failure crosses the FFI as itself,
* the named pipeline ``"spinn"`` (``relax.register_pipeline``):
  ``relax.build(mod, target="spinn", relax_pipeline="spinn")``.

Hooks (TVM offers no registry for them; each forwards everything that is not a spinn build to
TVM's own object, unchanged):

* ``relax.pipeline.PIPELINE_MAP["default"]``. ``relax.build`` (``tvm/relax/vm_build.py``,
  ``build``, the ``relax_pipeline`` branch) resolves the pipeline *name* it is given, ``"default"``
  unless the caller names another, with ``relax.get_pipeline(name)`` for every target without a
  ``"gpu"`` key; the target is not consulted, so a target-dependent default exists only by
  wrapping that entry. The wrapper is :func:`tvm_spinn.pipeline.spinn_pipeline` around TVM's
  factory: for a non-spinn target it runs TVM's pass as it is (or, inside
  ``with tvm_spinn.build_options()``, the opted-in fallback treatment). ``"default_build"`` and
  every other name stay TVM's.
* ``relax.get_default_pipeline``: for a target with a ``"gpu"`` key (``spinn/cuda``) the same
  branch calls ``relax.get_default_pipeline(target)`` instead, which dispatches on the target
  *kind* (``cuda``) alone. The wrapper returns TVM's pipeline object itself for every non-spinn
  target outside a ``build_options`` context.
* ``tvm.runtime.Executable.export_library``: ``ex.export_library(path)`` of an executable holding
  spinn modules writes a sealed library (:func:`tvm_spinn.export_library`, which
  :func:`tvm_spinn.load_module` verifies), as the README's quick start shows. ``relax.build``
  constructs the executable itself (``VMExecutable(lib)`` at the end of ``_vmlink``), so a build
  cannot hand back an object that seals, and the seal covers the linked file's bytes, which exist
  only after TVM's ``fcompile`` returns. Every other export (no spinn module, ``fcompile``
  given, ``.tar``/``.wasm``) calls TVM's method with the same arguments.
  :func:`tvm_spinn.export_library` is the API; the hook only keeps TVM's spelling working.

:func:`install` runs once, when the package is imported (by TVM's ``tvm.backends`` autoload at
``import tvm``, or directly). ``TVM_DEVICE_BACKEND_AUTOLOAD=0`` keeps ``import tvm`` free of all of
it. :data:`TVM_ORIGINALS` keeps the objects the hooks wrap.
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax
from tvm.relax import pipeline as _relax_pipeline

__all__ = ["install", "tvm_pipeline", "TVM_ORIGINALS", "PIPELINE_NAME"]

#: Name of the spinn pipeline in ``relax.pipeline.PIPELINE_MAP``.
PIPELINE_NAME = "spinn"

#: The TVM objects the hooks wrap, by hook name (filled by :func:`install`, read-only after).
TVM_ORIGINALS: dict[str, Any] = {}

_SPINN_ATTR = "_tvm_spinn_hook"


def tvm_pipeline(target: "tvm.target.Target | None") -> tvm.transform.Pass:
    """TVM's own Relax pipeline for ``target``, as ``relax.build`` picks it without tvm_spinn.

    Parameters
    ----------
    target : tvm.target.Target or None
        The build target.

    Returns
    -------
    tvm.transform.Pass
        ``relax.get_default_pipeline(target)`` for a target with a ``"gpu"`` key, else TVM's
        ``"default"`` pipeline.
    """
    default = TVM_ORIGINALS.get("default", _relax_pipeline.PIPELINE_MAP["default"])
    if target is not None and "gpu" in target.keys:
        try:
            return TVM_ORIGINALS.get("get_default_pipeline", relax.get_default_pipeline)(target)
        except (ValueError, AttributeError):  # as relax.build: no pipeline for this kind
            return default()
    return default()


def _pipeline_factory(**kwargs) -> tvm.transform.Pass:
    """``PIPELINE_MAP["spinn"]``: the spinn pipeline over TVM's pipeline for the target."""
    from .pipeline import spinn_pipeline

    if kwargs:
        raise TypeError(f"the {PIPELINE_NAME!r} pipeline takes no options, got {sorted(kwargs)}")
    return spinn_pipeline(tvm_pipeline)


def _default_factory(original):
    def default(**kwargs) -> tvm.transform.Pass:
        from .pipeline import spinn_pipeline

        return spinn_pipeline(original(**kwargs))

    default.__doc__ = original.__doc__
    setattr(default, _SPINN_ATTR, True)
    return default


def _get_default_pipeline(original):
    def get_default_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
        from ._build_options import current_build_options
        from .pipeline import spinn_pipeline
        from .target.registry import is_spinn_target

        base = original(target)
        if not is_spinn_target(target) and current_build_options() is None:
            return base
        return spinn_pipeline(base, target)

    get_default_pipeline.__doc__ = original.__doc__
    setattr(get_default_pipeline, _SPINN_ATTR, True)
    return get_default_pipeline


def install() -> None:
    """Register tvm_spinn with TVM and install the two pipeline hooks (idempotent).

    Called when the package is imported; see the module docstring for what is registered
    where and why each hook exists.
    """
    import tvm_ffi

    from .runtime import executor
    from .target import register_default_tags

    register_default_tags()
    tvm_ffi.register_error("tvm_spinn.SpinnRuntimeError", executor.SpinnRuntimeError)
    if PIPELINE_NAME not in _relax_pipeline.PIPELINE_MAP:
        relax.register_pipeline(PIPELINE_NAME)(_pipeline_factory)

    current = _relax_pipeline.PIPELINE_MAP["default"]
    if not getattr(current, _SPINN_ATTR, False):
        TVM_ORIGINALS["default"] = current
        _relax_pipeline.PIPELINE_MAP["default"] = _default_factory(current)
    # relax.build calls it as ``relax.get_default_pipeline`` (the name in tvm.relax)
    if not getattr(relax.get_default_pipeline, _SPINN_ATTR, False):
        TVM_ORIGINALS["get_default_pipeline"] = relax.get_default_pipeline
        relax.get_default_pipeline = _get_default_pipeline(relax.get_default_pipeline)
