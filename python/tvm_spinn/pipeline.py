"""The spinn build pipeline: offload the spinn regions, then build the rest for the fallback.

For a spinn target (its keys contain ``"spinn"``) the module is partitioned (unless it already
is), ``RunCodegen`` runs for ``spinn`` and a manifest is recorded; then the rest goes through the
fallback's own pipeline (llvm: TVM's default build pipeline; cuda: TVM's CUDA pipeline with
dlight schedules). How ``relax.build`` reaches this pipeline is :mod:`tvm_spinn.integration`'s
business.
"""

from __future__ import annotations

import json
import logging

import tvm
from tvm import relax
from tvm.ir.expr import Constant

from .codegen import make_manifest_module
from .partition import partition_for_spinn, summarize_partition
from .fallback import run_fallback
from .target.registry import arch_of, is_spinn_target

__all__ = ["offload_to_spinn", "spinn_pipeline"]

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


def spinn_pipeline(base, target: "tvm.target.Target | None" = None) -> tvm.transform.Pass:
    """The spinn build pipeline: offload to spinn, then the fallback's pipeline.

    Registered as ``relax.pipeline.PIPELINE_MAP["spinn"]``
    (``relax.build(mod, target="spinn", relax_pipeline="spinn")``); ``relax.build`` with the
    default pipeline reaches it too (see :mod:`tvm_spinn.integration`).

    Parameters
    ----------
    base : tvm.transform.Pass or callable
        The fallback target's pipeline, applied last, or a function of the build target that
        returns it (TVM's pipeline for that target: :func:`tvm_spinn.integration.tvm_pipeline`).
    target : tvm.target.Target, optional
        The build target. Default: the current target when the pass runs (``relax.build``
        runs its pipeline inside ``with target``).

    Returns
    -------
    tvm.transform.Pass
        For a spinn target: partition (unless already partitioned), codegen, manifest, then the
        fallback pipeline. For any other target: ``base``, with the fallback treatment of
        :func:`tvm_spinn.fallback.run_fallback` only inside ``with tvm_spinn.build_options()``.
    """

    @tvm.transform.module_pass(opt_level=0, name="SpinnPipeline")
    def _pipeline(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        build_target = target if target is not None else tvm.target.Target.current(allow_none=True)
        fallback = base if isinstance(base, tvm.transform.Pass) else base(build_target)
        if not is_spinn_target(build_target):
            return run_fallback(fallback, mod, build_target, spinn=False)
        with build_target:
            mod = offload_to_spinn(mod, build_target)
        return run_fallback(fallback, mod, build_target, spinn=True)

    return _pipeline
