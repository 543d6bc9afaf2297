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

Hooks (TVM 0.27 offers no registry for them; each forwards everything that is not a spinn build
to TVM's own object, unchanged). Line numbers are TVM 0.27's Python sources:

* ``relax.pipeline.PIPELINE_MAP["default"]``. ``relax.build`` (``tvm/relax/vm_build.py``,
  ``build``, lines 249-265) turns the pipeline *name* it is given, ``"default"`` unless the
  caller names another, into a pass with ``relax.get_pipeline(name)`` for every target without a
  ``"gpu"`` key, and ``get_pipeline`` (``tvm/relax/pipeline.py`` line 241) returns
  ``PIPELINE_MAP[name](**kwargs)``: the target is not consulted, and the ``"default"`` entry,
  ``default_build_pipeline`` (lines 80-105), is a fixed list of passes with no extension point
  (no pass in it reads a registered hook that could partition and run ``RunCodegen``; its
  ``LegalizeOps`` reads the ``FLegalize`` operator attribute, which only replacing TVM's own
  would change). Nothing on this path reads the target's attributes or a ``PassContext`` key to
  choose passes, and ``register_pipeline`` refuses a name that exists (lines 252-253). So
  ``relax.build(mod, target="spinn")`` reaches the spinn pipeline only through this entry;
  without it the README's ``relax.build(mod, target="spinn")`` would build everything for the
  host. The wrapper is :func:`tvm_spinn.pipeline.spinn_pipeline` around TVM's factory: for a
  non-spinn target it runs TVM's pass as it is (or, inside ``with tvm_spinn.build_options()``,
  the opted-in fallback treatment). ``"default_build"`` and every other name stay TVM's.
* ``relax.get_default_pipeline``: for a target with a ``"gpu"`` key (``spinn/cuda``) the same
  branch (``vm_build.py`` lines 258-263) calls ``relax.get_default_pipeline(target)``, looked up
  on ``tvm.relax`` at each build, which dispatches on the target *kind* alone
  (``pipeline.py`` lines 330-347; ``cuda`` -> ``backend.cuda.get_default_pipeline``, whose pass
  lists in ``tvm/relax/backend/cuda/pipeline.py`` are fixed). A ``spinn/cuda`` without the
  ``"gpu"`` key would take the ``"default"`` branch instead, but TVM's GPU passes need that key
  on the target: the dlight GPU rules (``tvm/s_tir/dlight/gpu/base.py`` line 40; without them
  the CUDA kernels have no thread bindings), ``DispatchSortScan`` / ``DispatchSampling``
  (``BackendDispatcher.is_gpu_target``, ``tvm/relax/backend/utils.py`` line 35), the scatter
  legalizations (``tvm/relax/transform/legalize_ops/manipulate.py`` line 253) and MetaSchedule's
  task extraction (``tvm/s_tir/meta_schedule/relax_integration.py`` line 465): a ``cuda``
  target without that key builds, even through TVM's CUDA pipeline, an executable with no
  ``cuda`` module at all (the unscheduled kernels stay in the host's ``llvm`` module). The wrapper
  returns TVM's pipeline object itself for every non-spinn target outside a ``build_options``
  context.

``ex.export_library(path)`` is TVM's own method: TVM serializes each spinn module through its
``SaveToBytes`` into the library's module blob, and ``tvm.runtime.load_module`` reads it back
through the ``ffi.Module.load_from_bytes.spinn`` global function, where the module's container
verifies itself (``src/container.h``); :func:`tvm_spinn.load_module` loads such a library too.
:func:`tvm_spinn.export_library` writes the sealed library (every byte under a digest, programs
mapped in place at load).

:func:`install` runs once, when the package is imported (by TVM's ``tvm.backends`` autoload at
``import tvm``, or directly). ``TVM_DEVICE_BACKEND_AUTOLOAD=0`` keeps ``import tvm`` free of all of
it. :data:`TVM_ORIGINALS` keeps the objects the two hooks wrap.
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
