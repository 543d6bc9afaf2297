"""Simulated time of a training step on its spinn system, by phase (forward + loss, backward,
optimizer update).

The fused step (one ``main``) is what :meth:`Trainer.step` runs; to split its time, each of
SetupTrainer's functions is built on its own for the same target and timed by the report:
``backbone_loss`` (forward and loss), ``backbone_loss_adjoint`` (forward, loss and backward:
the backward phase is its time minus the forward's) and ``optimizer``. The offloaded programs
have a simulated time; the host (fallback) operators left (:func:`~tvm_spinn.training.
op_placement` lists them per phase) are timed apart, as a ``host`` phase, by the host's
roofline (:func:`host_time`: per operator call ``host_op_s`` plus the bytes it reads and writes
over ``host_mem_bw_bytes_s``, fields of the system's arch; transfers between the board and the
host are not modelled). The PEs and the host run one after the other in a step (each host op
waits for its operands), so the step's total is their sum.

A program is counted once per call: in a training step the weights are arguments, so the
regions of identical layers (and the update of same-shaped parameters) are one shared function
called several times, which :func:`tvm_spinn.report` (a sum over distinct programs) counts once.
"""

from __future__ import annotations

import re
from collections import Counter

import tvm
from tvm import relax

from ..frontend.fixups import FixupImported
from .errors import TrainingError

__all__ = ["step_time", "executable_latency", "host_time"]

#: Host operators that relabel their operand (a view in the VM): no bytes moved.
_VIEWS = frozenset({"relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.flatten"})

_PHASES = (("forward", "backbone_loss"), ("adjoint", "backbone_loss_adjoint"), ("update", "optimizer"))


def executable_latency(ex) -> float:
    """Simulated seconds of one call of ``main``: each spinn program's latency times the number
    of its call sites in the VM code (no loops in a training step: call sites = calls)."""
    from ..report import report

    try:
        programs = report(ex).programs
    except ValueError:  # nothing offloaded: no spinn programs, no PE time
        return 0.0
    calls = Counter(re.findall(r"call\s+(\S+)\s+in:", ex.as_text()))
    return sum(p.timing.latency_s * max(1, calls.get(p.symbol, 0)) for p in programs)


def _tensor_bytes(ty) -> int:
    """Bytes of a tensor (or tuple of tensors) type with a static shape; 0 where unknown."""
    if isinstance(ty, relax.TupleType):
        return sum(_tensor_bytes(f) for f in ty.fields)
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return 0
    try:
        n = 1
        for d in ty.shape:
            n *= int(d)
    except (TypeError, ValueError):
        return 0
    return n * tvm.DataType(str(ty.dtype)).bits // 8


def host_time(mod: tvm.IRModule, target) -> tuple[float, Counter]:
    """Modelled seconds of the host operators of ``mod`` (partitioned for the spinn ``target``)
    and their counts.

    Each call of an operator the partition leaves on the host costs ``arch.host_op_s`` plus the
    bytes of its tensor operands and result over ``arch.host_mem_bw_bytes_s`` (a memory-bound
    roofline: the host operators of a training step, data movement, selections and reductions,
    do O(1) work per byte); a reshape is a relabelling (no bytes).
    """
    from ..partition import partition_for_spinn
    from ..target.registry import arch_of

    arch = arch_of(target)
    part = partition_for_spinn(mod, target)
    ops: Counter = Counter()
    total = [0.0]

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            name = expr.op.name
            if not name.startswith("relax.") or name.startswith(("relax.call_", "relax.builtin")):
                return
            ops[name] += 1
            moved = 0 if name in _VIEWS else sum(_tensor_bytes(a.ty) for a in expr.args) + _tensor_bytes(expr.ty)
            total[0] += arch.host_op_s + moved / arch.host_mem_bw_bytes_s

    for _, func in part.functions_items():
        if not isinstance(func, relax.Function) or (func.attrs and any(
                k in func.attrs for k in ("Codegen", "Composite", "Primitive"))):
            continue
        relax.analysis.post_order_visit(func.body, visit)
    return total[0], ops


def _phase_module(func: relax.Function) -> tvm.IRModule:
    return FixupImported(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))


def _latency(func: relax.Function, target) -> float:
    return executable_latency(relax.build(_phase_module(func), target=target))


def step_time(trainer, phases: bool = True) -> dict:
    """Simulated seconds of one training step.

    Parameters
    ----------
    trainer : Trainer
        A trainer compiled for a spinn target (not a data-parallel one: see
        :meth:`~.parallel.DataParallelTrainer.simulated_step`).
    phases : bool
        Also time the phases (three more builds of the step's parts).

    Returns
    -------
    dict
        ``step_s`` (the fused step's offloaded programs), ``host_s`` (its host operators,
        :func:`host_time`), ``total_s`` (their sum), and with ``phases`` ``forward_s``,
        ``backward_s``, ``update_s`` (PE time; their sum may differ from ``step_s`` by what
        the fused build merges across phase boundaries) and ``forward_host_s``,
        ``backward_host_s``, ``update_host_s`` (the host phase split the same way).
    """
    from ..target.registry import is_spinn_target

    if not is_spinn_target(trainer._target):
        raise TrainingError(f"step_time needs a trainer built for a spinn target, not {trainer._target}")
    if hasattr(trainer, "simulated_step"):
        raise TrainingError("step_time: a data-parallel trainer is timed by its simulated_step()")
    target = trainer._target
    out = {"step_s": executable_latency(trainer.executable)}
    out["host_s"] = host_time(trainer.module, target)[0]
    out["total_s"] = out["step_s"] + out["host_s"]
    if phases:
        t = {k: _latency(trainer._graph.phases[name], target) for k, name in _PHASES}
        h = {k: host_time(_phase_module(trainer._graph.phases[name]), target)[0] for k, name in _PHASES}
        out.update(forward_s=t["forward"], backward_s=max(0.0, t["adjoint"] - t["forward"]), update_s=t["update"],
                   forward_host_s=h["forward"], backward_host_s=max(0.0, h["adjoint"] - h["forward"]),
                   update_host_s=h["update"])
    return out
