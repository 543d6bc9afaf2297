"""Timing a shard plan with a pipeline axis: every stage mapped and timed, the sends priced.

:func:`time_pipeline` takes a plan of :func:`.shard.plan_mesh` whose mesh has ``pp`` stages
and returns its :class:`~tvm_spinn.timing.pipeline.PipelineTiming`:

1. each stage's program (:func:`.shard.stage_programs`) with its plan over the stage's own
   chips (:func:`.shard.stage_plans`) is sharded, mapped on one chip alone (its chips hold only
   its layers' weights: the SRAM of every stage is its own) and timed as the system mapper
   times a plan (:func:`.system.shard_timing`: weight streams, prefetch, the stage's
   collectives);
2. the hand-overs at each cut are priced on the link graph between the stages' chips
   (:func:`.system.stage_ranks`, :func:`tvm_spinn.timing.pipeline.handover_costs`);
3. the stages and sends compose into the steady-state period and the latency of one input
   (:func:`tvm_spinn.timing.pipeline.pipeline_timing`).

A tensor a stage receives is read from its chips' DRAM like any program input.
"""

from __future__ import annotations

from ..options import MappingOptions
from ..program import Program
from ..target.arch import SpinnArch
from ..target.topology import topology_of
from ..timing.pipeline import PipelineTiming, handover_costs, pipeline_timing
from .schedule import map_program
from .shard import ShardPlan, shard_program, stage_plans, stage_programs
from .system import shard_timing, stage_ranks

__all__ = ["time_pipeline"]


def time_pipeline(program: Program, plan: ShardPlan, arch: SpinnArch,
                  options: MappingOptions | None = None) -> PipelineTiming:
    """The timing of ``program`` under ``plan`` (any mesh; one stage when it has no ``pp``
    axis) on ``arch`` (see the module docstring); ``options`` map each stage's shard (None:
    the active ones).

    Raises
    ------
    ValueError
        When the stages need more chips than ``arch`` has (:func:`.system.stage_ranks`).
    MappingError
        When a stage's shard does not fit one chip.
    """
    ranks = stage_ranks(arch, plan)  # before any mapping: a plan too large fails at once
    chip = arch.replace(chips=1)
    stage_s = []
    for stage, sub in zip(stage_programs(program, plan), stage_plans(program, plan)):
        shard = map_program(shard_program(stage, sub), chip, options)
        stage_s.append(shard_timing(stage, sub, shard, arch).latency_s)
    sends = handover_costs(topology_of(arch), plan.handovers, plan.stages, ranks)
    return pipeline_timing(stage_s, sends)
