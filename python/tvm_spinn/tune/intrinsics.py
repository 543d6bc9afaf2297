"""Register only the tensor intrinsics a target needs, and make tuning contexts without the rest.

MetaSchedule's schedule rules for a CPU with VNNI or AVX-512 (or ARM dot products) tensorize
with intrinsics registered by ``tvm.s_tir.tensor_intrin.x86`` (``arm_cpu``...). The package's
``__init__`` imports the modules of every backend, which parse every intrinsic with TVMScript:
about 70 s of CPU here (most of it ``cuda``), and ``TuneContext.__init__`` imports the package.

:func:`ensure_intrinsics` imports just the modules of that package the target needs, each the
real module file under its own name (as ``import`` would, without running the package's
``__init__``); a later ``import tvm.s_tir.tensor_intrin`` runs that ``__init__`` in full and
finds them already imported. :func:`tune_context` makes a ``TuneContext`` through its
registered constructor (what ``TuneContext.__init__`` calls after that import), so tuning never
imports the whole package. Nothing else is put in ``sys.modules``.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys

__all__ = ["ensure_intrinsics", "tune_context"]

_PACKAGE = "tvm.s_tir.tensor_intrin"


def _submodules(kind: str) -> list[str]:
    """The package's modules for a target kind, in import order (dependencies first)."""
    if kind == "cuda":
        return ["cuda"]
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return ["dot_product_common", "arm_cpu"]
    if machine.startswith("riscv"):
        return ["riscv_cpu"]
    return ["x86"]


def _import_submodule(name: str) -> None:
    """Import ``tvm.s_tir.tensor_intrin.<name>`` from its file without the package's __init__."""
    import tvm.s_tir

    full = f"{_PACKAGE}.{name}"
    if full in sys.modules:
        return
    path = os.path.join(os.path.dirname(tvm.s_tir.__file__), "tensor_intrin", f"{name}.py")
    spec = importlib.util.spec_from_file_location(full, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {full} from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module  # as the import system does before running a module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[full]
        raise


def ensure_intrinsics(target) -> None:
    """Make the tensor intrinsics for ``target`` (and its host) available, cheaply.

    Parameters
    ----------
    target : tvm.target.Target
        The tuning target; its kind (and its host's) picks the modules.
    """
    if _PACKAGE in sys.modules:  # the whole package is imported: every intrinsic is registered
        return
    kinds = {target.kind.name}
    if target.host is not None:
        kinds.add(target.host.kind.name)
    for kind in sorted(kinds):
        for name in _submodules(kind):
            _import_submodule(name)


def tune_context(mod, *, target, space_generator, search_strategy, task_name: str, logger,
                 rand_state: int, num_threads: int):
    """A MetaSchedule ``TuneContext`` (same arguments), made without importing every intrinsic.

    ``TuneContext.__init__`` imports ``tvm.s_tir.tensor_intrin`` and then calls the registered
    constructor ``s_tir.meta_schedule.TuneContext``; this calls that constructor with the same
    normalized arguments. Call :func:`ensure_intrinsics` for the target first.

    Returns
    -------
    tvm.s_tir.meta_schedule.TuneContext
        The initialized context.
    """
    import tvm_ffi
    from tvm.s_tir.meta_schedule import SpaceGenerator
    from tvm.s_tir.meta_schedule.logging import get_logging_func
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    if not isinstance(space_generator, SpaceGenerator):
        space_generator = SpaceGenerator.create(space_generator)
    context = tvm_ffi.get_global_func("s_tir.meta_schedule.TuneContext")(
        _normalize_mod(mod), target, space_generator, search_strategy, task_name, int(num_threads),
        int(rand_state), get_logging_func(logger))
    tvm_ffi.get_global_func("s_tir.meta_schedule.TuneContextInitialize")(context)
    return context
