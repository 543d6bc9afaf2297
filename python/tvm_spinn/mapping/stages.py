"""Timing a shard plan with a pipeline axis: every stage mapped and timed, the sends priced.

:func:`time_pipeline` takes a plan of :func:`.shard.plan_mesh` whose mesh has ``pp`` stages
and returns its :class:`~tvm_spinn.timing.stages.PipelineTiming`:

1. each stage's program (:func:`.shard.stage_programs`) with its plan over the stage's own
   chips (:func:`.shard.stage_plans`) is sharded, mapped on one chip alone (its chips hold only
   its layers' weights: the SRAM of every stage is its own) and timed as the system mapper
   times a plan (:func:`.system.shard_timing`: weight streams, prefetch, the stage's
   collectives);
2. the hand-overs at each cut are priced on the link graph between the stages' chips
   (:func:`.system.stage_ranks`, :func:`tvm_spinn.timing.stages.handover_costs`);
3. the stages and sends compose into the steady-state period and the latency of one input
   (:func:`tvm_spinn.timing.stages.pipeline_timing`).

A tensor a stage receives is read from its chips' DRAM like any program input. The system
mapper plans a region that no board holds over stages of a board each
(:func:`.system.map_on_system`).
"""

from __future__ import annotations

from ..options import MappingOptions
from ..program import Program
from ..target.arch import SpinnArch
from ..target.topology import topology_of
from ..timing.stages import PipelineTiming, handover_costs, pipeline_timing
from .schedule import map_program
from .shard import ShardPlan, shard_program, stage_plans, stage_programs
from .system import shard_timing, stage_ranks

__all__ = ["time_pipeline", "map_stages"]


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
    return map_stages(program, plan, arch, options)[1]


def map_stages(program: Program, plan: ShardPlan, arch: SpinnArch,
               options: MappingOptions | None = None) -> tuple[tuple[Program, ...], PipelineTiming]:
    """Each stage's shard of ``program`` under ``plan`` mapped on one chip of ``arch`` (in
    stage order) and the pipeline's timing (see :func:`time_pipeline`, which raises the same)."""
    ranks = stage_ranks(arch, plan)  # before any mapping: a plan too large fails at once
    chip = arch.replace(chips=1)
    stage_s, shards = [], []
    for stage, sub in zip(stage_programs(program, plan), stage_plans(program, plan)):
        shard = map_program(shard_program(stage, sub), chip, options)
        shards.append(shard)
        stage_s.append(shard_timing(stage, sub, shard, arch).latency_s)
    sends = handover_costs(topology_of(arch), plan.handovers, plan.stages, ranks)
    return tuple(shards), pipeline_timing(stage_s, sends)
