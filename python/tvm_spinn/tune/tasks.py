"""Fallback tuning tasks: the fused TIR PrimFuncs left after offloading a model."""

from __future__ import annotations

import hashlib

import tvm
import tvm_ffi

__all__ = ["extract_fallback_tasks", "model_hash", "task_key"]


def extract_fallback_tasks(mod: tvm.IRModule, target: tvm.target.Target) -> list:
    """The MetaSchedule tasks of ``mod``'s fallback for ``target``, sorted by name.

    For spinn targets the supported operators are offloaded first (they are not tuned); the
    rest is legalized and fused exactly like the build does
    (:func:`tvm_spinn.fallback.prepare_fallback`), so tuned records match at build time.

    Parameters
    ----------
    mod : tvm.IRModule
        Relax module (e.g. from :mod:`tvm_spinn.frontend`).
    target : tvm.target.Target
        Build target (spinn, llvm or cuda kind).

    Returns
    -------
    list of tvm.s_tir.meta_schedule.ExtractedTask
    """
    from tvm.s_tir import meta_schedule as ms

    from ..fallback import prepare_fallback
    from ..pipeline import offload_to_spinn
    from ..target.registry import is_spinn_target

    if not isinstance(mod, tvm.IRModule):
        raise TypeError(f"tune expects a Relax IRModule, got {type(mod).__name__}")
    with target:
        if is_spinn_target(target):
            mod = offload_to_spinn(mod, target)
        mod = prepare_fallback(mod)
    tasks = ms.relax_integration.extract_tasks(mod, target)
    tasks = [t for t in tasks if not t.dispatched[0].attrs or
             not t.dispatched[0].attrs.get("tirx.is_scheduled", False)]
    return sorted(tasks, key=lambda t: t.task_name)


def task_key(task) -> str:
    """``name:structural hash`` of a task's PrimFunc module: the same key in every model."""
    return f"{task.task_name}:{tvm_ffi.structural_hash(task.dispatched[0]):x}"


def model_hash(tasks: list) -> str:
    """A stable hash of a model's fallback: its tasks' structures (sorted)."""
    digest = hashlib.sha256()
    for h in sorted(task_key(t) for t in tasks):
        digest.update(h.encode())
    return digest.hexdigest()[:16]
