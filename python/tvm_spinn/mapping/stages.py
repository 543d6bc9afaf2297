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

A tensor a stage receives is read from its chips' DRAM like any program input.

:func:`plan_pipeline` is the system plan of a program that does not fit one chip group: the
fewest stages, cut by :func:`.shard.pipeline_stages`, whose every stage's shard fits its chips.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..options import MappingOptions
from ..program import Program
from ..target.arch import SpinnArch
from ..target.topology import topology_of
from ..timing.stages import PipelineTiming, handover_costs, pipeline_timing
from ..program.ops.sharding import Mesh, MeshAxis
from .memory import check_capacity
from .schedule import map_program
from .shard import ShardPlan, plan_mesh, shard_program, stage_plans, stage_programs
from .system import shard_timing, stage_ranks
from .tiling import MappingError

__all__ = ["time_pipeline", "plan_pipeline", "PipelinePlan", "map_stages"]


@dataclass(frozen=True)
class PipelinePlan:
    """A program's plan over pipeline stages (:func:`plan_pipeline`): the shard plan (its mesh
    has the ``pp`` axis), each stage's chips in mesh position order, the timing and each
    stage's shard mapped on one chip (:func:`map_stages`)."""

    plan: ShardPlan
    ranks: tuple[tuple[int, ...], ...]
    timing: PipelineTiming
    programs: tuple[Program, ...] = field(default=(), compare=False, repr=False)

    @property
    def stages(self) -> int:
        return self.plan.pp


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


def _with_pp(mesh: Mesh, pp: int) -> Mesh:
    return Mesh(tuple(a for a in mesh.axes if a.name != "pp") + (MeshAxis("pp", pp, strict=True),))


def plan_pipeline(program: Program, arch: SpinnArch, mesh: Mesh | None = None,
                  options: MappingOptions | None = None) -> PipelinePlan:
    """The plan of ``program`` on ``arch`` over the fewest pipeline stages that hold it.

    Each stage runs ``mesh`` (its axes other than ``pp``; None: one chip a stage); ``pp`` goes
    up from 1 until every stage's shard fits a chip (:func:`.memory.check_capacity`, then the
    mapping of :func:`time_pipeline`) or the stages no longer fit ``arch``
    (:func:`.system.stage_ranks`). Fewer stages are preferred: each cut adds its sends to the
    latency, and the chips left over hold replicas.

    Raises
    ------
    MappingError
        When no number of stages holds the program, naming the largest tried and why its
        stages do not fit.
    """
    mesh = mesh if mesh is not None else Mesh.of()
    chip = arch.replace(chips=1)
    why, limit, tried = "", "", 0
    for pp in range(1, len(program.layers) + 1):
        plan = plan_mesh(program, _with_pp(mesh, pp))
        if plan is None:
            continue
        try:
            ranks = stage_ranks(arch, plan)
        except ValueError as err:
            limit = f"; {err}"
            break
        tried = pp
        try:
            for stage, sub in zip(stage_programs(program, plan), stage_plans(program, plan)):
                check_capacity(shard_program(stage, sub), chip)
            shards, timing = map_stages(program, plan, arch, options)
        except MappingError as err:
            why = f" (with {pp}: {err})"
            continue
        return PipelinePlan(plan=plan, ranks=tuple(tuple(int(c) for c in r) for r in ranks), timing=timing,
                            programs=shards)
    per = mesh.chips // mesh.size("pp")
    raise MappingError(f"{program.symbol} does not fit {arch.name} in 1..{tried} pipeline stages of {per} "
                       f"chip(s){why}{limit}")
