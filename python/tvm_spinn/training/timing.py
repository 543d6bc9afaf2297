"""Simulated time of a training step on its spinn system, by phase (forward + loss, backward,
optimizer update).

The fused step (one ``main``) is what :meth:`Trainer.step` runs; to split its time, each of
SetupTrainer's functions is built on its own for the same target and timed by the report:
``backbone_loss`` (forward and loss), ``backbone_loss_adjoint`` (forward, loss and backward:
the backward phase is its time minus the forward's) and ``optimizer``. Only the offloaded
programs have a simulated time; host (fallback) ops are counted, not timed
(:func:`~tvm_spinn.training.op_placement` lists them per phase).

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

__all__ = ["step_time", "executable_latency"]

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
    return sum(p.timing["latency_s"] * max(1, calls.get(p.symbol, 0)) for p in programs)


def _latency(func: relax.Function, target) -> float:
    mod = FixupImported(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
    return executable_latency(relax.build(mod, target=target))


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
        ``step_s`` (the fused step's offloaded programs), and with ``phases`` ``forward_s``,
        ``backward_s``, ``update_s`` (their sum may differ from ``step_s`` by what the fused
        build merges across phase boundaries).
    """
    from ..target.registry import is_spinn_target

    if not is_spinn_target(trainer._target):
        raise TrainingError(f"step_time needs a trainer built for a spinn target, not {trainer._target}")
    if hasattr(trainer, "simulated_step"):
        raise TrainingError("step_time: a data-parallel trainer is timed by its simulated_step()")
    out = {"step_s": executable_latency(trainer.executable)}
    if phases:
        t = {k: _latency(trainer._graph.phases[name], trainer._target) for k, name in _PHASES}
        out.update(forward_s=t["forward"], backward_s=max(0.0, t["adjoint"] - t["forward"]), update_s=t["update"])
    return out
