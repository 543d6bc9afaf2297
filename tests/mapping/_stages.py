"""What a mesh plan with a pipeline axis means for each stage, for the pipeline tests: each
stage's chips on a system (:func:`stage_ranks`) and each stage's shard plan
(:func:`stage_plans`). The mapper places and plans its stages itself
(:func:`tvm_spinn.mapping.stages.map_stages`); these state the contract the cut is checked
against (``tests/conftest.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from tvm_spinn.mapping.shard import _stage_parts
from tvm_spinn.mapping.stages import stage_ranks as _stage_ranks, stages_of
from tvm_spinn.mapping.system import stage_chips
from tvm_spinn.program.ops.sharding import Mesh


def stage_ranks(arch, plan) -> tuple:
    """Per pipeline stage of ``plan``, its chips in mesh position order: stage ``s`` on board
    ``s`` (its first chips; with faults, its usable board's live chips) when each stage fits a
    board and the system has a board per stage, else on chips ``s * n .. (s + 1) * n - 1``
    (``n``: the chips of a stage), as on part of a board. The position ``j`` of every stage is
    the same chip of its board, so a hand-over goes from each chip to its counterpart.

    The mapper places a region's stages on whole boards
    (:func:`tvm_spinn.mapping.stages.pipeline_boards`); the tests also place stages on part of
    a board, to price the sends of a mesh with a ``pp`` axis on a system smaller than a board
    (:func:`tvm_spinn.timing.stages.handover_costs`).

    Raises
    ------
    ValueError
        When the stages need more chips than ``arch`` has.
    """
    per = plan.chips // plan.pp
    if per <= stage_chips(arch) and plan.pp <= stages_of(arch):
        return tuple(np.asarray(_stage_ranks(arch, s, per), dtype=np.int64) for s in range(plan.pp))
    if plan.chips > arch.chips or arch.has_faults:
        raise ValueError(f"stage_ranks: {plan.pp} stages of {per} chips need {plan.chips} chips"
                         + (" on distinct usable boards" if arch.has_faults else "")
                         + f"; {arch.name} has {arch.chips}")
    return tuple(np.arange(s * per, (s + 1) * per, dtype=np.int64) for s in range(plan.pp))


def stage_plans(program, plan) -> tuple:
    """The shard plan of each program of :func:`tvm_spinn.mapping.shard.stage_programs` over the
    stage's own chips (``plan`` without its pipeline axis, ``(plan,)`` on one stage).

    Each is ``plan`` cut to the stage: its layers' splits and the collectives before them,
    its tensors' shapes and placements as ``plan`` has them (a tensor received split stays
    split: the stage's shard program holds what the sending chip sent), renumbered as the
    stage's program. The gathers of program outputs at the end go to the stage that writes
    the output, at its end.

    The mapper does not need it (:func:`tvm_spinn.mapping.stages.map_stages` plans each stage's
    program afresh on its board); it states what a mesh plan with ``pp`` and other axes means
    for each stage, the contract :func:`tvm_spinn.mapping.shard.stage_programs` and
    :func:`tvm_spinn.mapping.shard.shard_program` are checked against.
    """
    if plan.pp == 1:
        return (plan,)
    mesh = Mesh(tuple(a for a in plan.mesh.axes if a.name != "pp"))
    keep = [k for k, a in enumerate(plan.mesh.axes) if a.name != "pp"]
    n = len(program.layers)
    writer = {layer.output: i for i, layer in enumerate(program.layers)}
    out = []
    for lo, hi, used, _, _, _ in _stage_parts(program, plan):
        new = {tid: k for k, tid in enumerate(used)}
        names = {layer.name for layer in program.layers[lo:hi]}
        colls = []
        for c in plan.collectives:
            if lo <= c.layer < hi:
                at = c.layer - lo
            elif c.layer >= n and lo <= writer.get(c.tensor, -1) < hi:
                at = hi - lo
            else:
                continue
            if c.tensor not in new:
                raise ValueError(f"stage_plans: the {c.op} before layer {c.layer} is on tensor {c.tensor}, "
                                 f"which stage {plan.stages[lo]} does not hold")
            colls.append(replace(c, layer=at, tensor=new[c.tensor]))
        out.append(replace(plan, splits=plan.splits[lo:hi], collectives=tuple(colls),
                           shapes=tuple(plan.shapes[tid] for tid in used),
                           seq=plan.seq[lo:hi] if plan.seq else (),
                           replicated=tuple(x for x in plan.replicated if x[0] in names), mesh=mesh,
                           placements=tuple(tuple(plan.placements[tid][k] for k in keep) for tid in used)
                           if plan.placements else (),
                           pp=1, stages=(), handovers=()))
    return tuple(out)
