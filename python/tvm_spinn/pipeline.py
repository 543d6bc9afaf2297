"""Hook spinn into ``relax.build``: the default pipeline offloads for spinn targets.

``relax.build(mod, target)`` takes its pipeline from ``relax.pipeline.PIPELINE_MAP["default"]``,
or, for targets whose keys contain ``"gpu"`` (``spinn/cuda``), from
``relax.get_default_pipeline(target)``. We wrap both: when the target's keys contain ``"spinn"``,
the module is partitioned (unless it already is), ``RunCodegen`` runs for ``spinn`` and a
manifest is recorded; then the rest goes through the fallback's own pipeline (llvm: TVM's
default build pipeline; cuda: TVM's CUDA pipeline with dlight schedules). Other targets are
untouched.
"""

from __future__ import annotations

import json
import logging

import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax import pipeline as _relax_pipeline

from .codegen import make_manifest_module
from .partition import partition_for_spinn, summarize_partition
from .fallback import run_fallback
from .target.registry import arch_of, is_spinn_target
from ._build_options import current_build_options

__all__ = ["offload_to_spinn", "install"]

_ORIGINAL: dict = {}
LOG = logging.getLogger("tvm_spinn.pipeline")


def _is_partitioned(mod: tvm.IRModule) -> bool:
    return any(
        isinstance(f, relax.Function) and f.attrs is not None and f.attrs.get("Codegen") == "spinn"
        for _, f in mod.functions_items()
    )


def _spinn_constants(mod: tvm.IRModule) -> set:
    """Handles of the tensors bound as constants inside ``Codegen="spinn"`` functions."""
    found: set = set()

    def visit(expr) -> None:
        value = getattr(expr, "value", None)
        if isinstance(expr, Constant) and isinstance(value, tvm.runtime.Tensor):
            found.add(value.__chandle__())

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function) and func.attrs is not None and func.attrs.get("Codegen") == "spinn":
            relax.analysis.post_order_visit(func, visit)
    return found


def _drop_embedded_constants(mod: tvm.IRModule, embedded: set) -> tvm.IRModule:
    """Remove the spinn weights from ``const_name_to_constant``.

    ``RunCodegen`` lists every constant of an external function there, and the VM executable
    stores that map in its ``const_loader`` module for codegens that bind weights at load time.
    The spinn codegen embeds its weights in the program instead, so keeping them would store every
    offloaded weight twice in an exported library. Other codegens' constants stay.
    """
    if not embedded or mod.attrs is None or "const_name_to_constant" not in mod.attrs:
        return mod
    consts = mod.attrs["const_name_to_constant"]
    kept = {name: value for name, value in consts.items() if value.__chandle__() not in embedded}
    if len(kept) == len(consts):
        return mod
    return mod.with_attr("const_name_to_constant", kept)


def offload_to_spinn(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """Partition (if needed) and codegen the spinn regions of ``mod`` for ``target``."""
    arch = arch_of(target)
    failure = None
    if not _is_partitioned(mod):
        try:
            mod = partition_for_spinn(mod, target)
        except Exception as err:  # noqa: BLE001 - offloading is an optimization, never a failure
            # Some graphs (control flow, data-dependent shapes) trip TVM passes used by the
            # partitioner; the model must still build, entirely on the fallback target.
            failure = f"partitioning failed, everything runs on the fallback: {(str(err).splitlines() or [type(err).__name__])[0]}"
            LOG.warning("spinn: %s", failure)
    summary = summarize_partition(mod)
    if failure:
        summary.fallback_reasons["<module>"] = failure
    embedded = _spinn_constants(mod)
    if _is_partitioned(mod):  # RunCodegen only when something is offloaded (loops crash it)
        mod = relax.transform.RunCodegen({"spinn": {"arch": json.dumps(arch.to_dict(), sort_keys=True)}})(mod)
    mod = _drop_embedded_constants(mod, embedded)
    manifest = {
        "system": arch.name, "chips": arch.chips, "fallback": arch.host_fallback,
        "target": str(target), "regions": summary.regions,
        "offloaded_ops": summary.offloaded_ops, "fallback_ops": summary.fallback_ops,
        "fallback_reasons": summary.fallback_reasons,
    }
    ext = list(mod.attrs["external_mods"]) if mod.attrs and "external_mods" in mod.attrs else []
    return mod.with_attr("external_mods", ext + [make_manifest_module(manifest)])


def _wrap(name: str):
    original = _ORIGINAL[name]

    def factory(**kwargs):
        base = original(**kwargs)

        @tvm.transform.module_pass(opt_level=0, name="SpinnDefaultPipeline")
        def _pipeline(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
            target = tvm.target.Target.current(allow_none=True)
            if not is_spinn_target(target):
                return run_fallback(base, mod, target, spinn=False)
            return run_fallback(base, offload_to_spinn(mod, target), target, spinn=True)

        return _pipeline

    return factory


def _wrap_target_pipeline(original):
    def get_default_pipeline(target: tvm.target.Target):
        base = original(target)
        if not is_spinn_target(target):
            if current_build_options() is None:
                return base

            @tvm.transform.module_pass(opt_level=0, name="SpinnFallbackPipeline")
            def _plain(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
                return run_fallback(base, mod, target, spinn=False)

            return _plain

        @tvm.transform.module_pass(opt_level=0, name="SpinnTargetPipeline")
        def _pipeline(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
            with target:
                mod = offload_to_spinn(mod, target)
            return run_fallback(base, mod, target, spinn=True)

        return _pipeline

    get_default_pipeline._spinn = True
    get_default_pipeline.__doc__ = original.__doc__
    return get_default_pipeline


def install() -> None:
    """Register the spinn-aware default pipelines (idempotent)."""
    if not getattr(relax.get_default_pipeline, "_spinn", False):
        wrapped = _wrap_target_pipeline(relax.get_default_pipeline)
        relax.get_default_pipeline = wrapped
        _relax_pipeline.get_default_pipeline = wrapped
    for name in ("default", "default_build"):
        current = _relax_pipeline.PIPELINE_MAP[name]
        if getattr(current, "_spinn", False):
            continue
        _ORIGINAL[name] = current
        wrapped = _wrap(name)
        wrapped._spinn = True
        _relax_pipeline.PIPELINE_MAP[name] = wrapped
