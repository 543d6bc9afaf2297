"""The pipeline axis (``pp``) of the shard planner: stages, the tensors each cut hands over, bytes.

A row of the tables is a small program and a mesh; the plan must cut the layers into the stated
contiguous stages (balanced by the families' work, checked against a brute force over every
cut) and hand over, at each cut, exactly the tensors live across it with the bytes one chip
holds of them there. The other axes run through the cuts unchanged: a ``pp`` plan's
collectives and local shapes are the plan's without ``pp``. Last, the stages' programs, each
mapped and run on its own chip with the tensors handed over from the previous one, give the
whole program's outputs bit for bit.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tvm_spinn.mapping import map_program
from tvm_spinn.mapping import shard as S
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.program.ops import family_of
from tvm_spinn.program.ops.sharding import Mesh
from tvm_spinn.runtime.simulator import run_program
from tvm_spinn.target.arch import SpinnArch

from _chains import F32, residual


def _side_by_side(sizes):
    """Independent relu layers over inputs of ``sizes`` elements (each layer's work: its size)."""
    tensors, layers = [], []
    for k, n in enumerate(sizes):
        tensors += [TensorDesc(f"x{k}", [n], "float32", "input"), TensorDesc(f"y{k}", [n], "float32", "output")]
    # inputs first, then outputs: a program lists its tensors of each role in id order
    order = [2 * k for k in range(len(sizes))] + [2 * k + 1 for k in range(len(sizes))]
    new = {old: i for i, old in enumerate(order)}
    tensors = [tensors[old] for old in order]
    layers = [Layer(name=f"r{k}", kind="relu", inputs=[new[2 * k]], output=new[2 * k + 1]) for k in range(len(sizes))]
    n = len(sizes)
    return Program("main", SpinnArch(), tensors, list(range(n)), list(range(n, 2 * n)), layers)


def _bottleneck(costs, stages):
    return max(sum(c for c, s in zip(costs, stages) if s == k) for k in set(stages))


# -- stage assignment ----------------------------------------------------------------------------
@pytest.mark.parametrize("sizes, pp, stages", [
    ([4, 4, 4, 4], 2, (0, 0, 1, 1)),
    ([8, 1, 1, 1, 1, 1, 1, 1, 1], 2, (0, 1, 1, 1, 1, 1, 1, 1, 1)),
    ([1, 1, 1, 1, 8], 2, (0, 0, 0, 0, 1)),
    ([2, 2, 2, 2, 2, 2], 3, (0, 0, 1, 1, 2, 2)),
    ([5, 1, 1, 5], 3, (0, 1, 1, 2)),
    ([3, 3, 3], 3, (0, 1, 2)),
    ([7, 2, 2, 2], 1, (0, 0, 0, 0)),
])
def test_stages_are_contiguous_and_balance_the_families_work(sizes, pp, stages):
    program = _side_by_side(sizes)
    costs = [family_of(layer.kind).work(program, layer, program.arch)[0] for layer in program.layers]
    assert costs == sizes  # the relu family's own cost hook: one operation per element
    got = S.pipeline_stages(program, pp)
    assert got == stages
    # the smallest largest stage over every contiguous cut into pp non-empty stages
    n = len(sizes)
    best = min(_bottleneck(costs, [sum(i >= c for c in cuts) for i in range(n)])
               for cuts in itertools.combinations(range(1, n), pp - 1))
    assert _bottleneck(costs, got) == best
    plan = S.plan_mesh(program, Mesh.of(pp=pp))
    assert plan.stages == (stages if pp > 1 else ()) and plan.pp == pp and plan.chips == pp
    assert plan.handovers == ()  # independent layers: nothing is live across a cut


def test_stage_refusals():
    program = _side_by_side([1, 2, 3])
    assert S.plan_mesh(program, Mesh.of(pp=4)) is None  # more stages than layers
    for bad in (0, 4, 1.5, True):
        with pytest.raises(ValueError, match="pp must be an int from 1 to the program's 3 layers"):
            S.pipeline_stages(program, bad)


# -- which tensors cross each cut, and their bytes ---------------------------------------------
B = 4  # batch rows of residual
# the layers' work (the families' hooks): fc0 512, fc1 1024, relu 64, fc2 1024, add 32, softmax 160
Z, Z2, H, H2 = (B, 8), (B // 2, 8), (B, 16), (B // 2, 16)
# (mesh, stages, hand-overs as (cut layer, tensor name, shape one chip sends, bytes))
CUTS = [
    # 1536 | 1280: z (read by the add) and h cross
    (Mesh.of(pp=2), (0, 0, 1, 1, 1, 1), [(2, "z", Z, 32 * F32), (2, "h", H, 64 * F32)]),
    # 512 | 1088 | 1216: z crosses both cuts (relayed by the middle stage), then the relu's a
    (Mesh.of(pp=3), (0, 1, 1, 2, 2, 2),
     [(1, "z", Z, 32 * F32), (3, "z", Z, 32 * F32), (3, "a", H, 64 * F32)]),
    # tp=2: fc1 gathers the column-split z before it (a widening GEMM), so z crosses whole and
    # h column-parallel, each chip its 8 columns
    (Mesh.of(tp=2, pp=2), (0, 0, 1, 1, 1, 1), [(2, "z", Z, 32 * F32), (2, "h", (B, 8), 32 * F32)]),
    # tp=2 over three stages: z crosses the first cut split (the gather runs in stage 1), the
    # second whole
    (Mesh.of(tp=2, pp=3), (0, 1, 1, 2, 2, 2),
     [(1, "z", (B, 4), 16 * F32), (3, "z", Z, 32 * F32), (3, "a", (B, 8), 32 * F32)]),
    # tp=2, a stage per layer: y leaves fc2 as row-parallel partial sums; each chip sends its
    # full-size sums (a split would send half), the all-reduce runs in the add's stage
    (Mesh.of(tp=2, pp=6), (0, 1, 2, 3, 4, 5),
     [(1, "z", (B, 4), 16 * F32), (2, "z", Z, 32 * F32), (2, "h", (B, 8), 32 * F32), (3, "z", Z, 32 * F32),
      (3, "a", (B, 8), 32 * F32), (4, "z", Z, 32 * F32), (4, "y", Z, 32 * F32), (5, "o", Z, 32 * F32)]),
    # dp=2: each replica its two rows
    (Mesh.of(dp=2, pp=2), (0, 0, 1, 1, 1, 1), [(2, "z", Z2, 16 * F32), (2, "h", H2, 32 * F32)]),
    # tp=2 x sp=2: row blocks over sp, columns over tp (z gathered over tp only)
    (Mesh.of(tp=2, sp=2, pp=2), (0, 0, 1, 1, 1, 1), [(2, "z", Z2, 16 * F32), (2, "h", (B // 2, 8), 16 * F32)]),
    # one stage per layer: z relayed through every stage after fc0
    (Mesh.of(pp=6), (0, 1, 2, 3, 4, 5),
     [(1, "z", Z, 32 * F32), (2, "z", Z, 32 * F32), (2, "h", H, 64 * F32), (3, "z", Z, 32 * F32),
      (3, "a", H, 64 * F32), (4, "z", Z, 32 * F32), (4, "y", Z, 32 * F32), (5, "o", Z, 32 * F32)]),
]


@pytest.mark.parametrize("mesh, stages, sends", CUTS, ids=[str(m.chips) + ":" + ",".join(
    f"{a.name}{a.size}" for a in m.active) for m, _, _ in CUTS])
def test_each_cut_hands_over_its_live_tensors(mesh, stages, sends):
    program = residual()
    plan = S.plan_mesh(program, mesh)
    assert plan.stages == stages and plan.chips == mesh.chips
    names = [t.name for t in program.tensors]
    assert [(c.layer, names[c.tensor], c.shape, c.nbytes) for c in plan.handovers] == sends
    assert {(c.op, c.group, c.exact) for c in plan.handovers} == {("send", "pp", True)}
    assert all(c.nbytes == int(np.prod(c.shape)) * F32 for c in plan.handovers)
    # the other axes are propagated through the cuts unchanged
    flat = S.plan_mesh(program, Mesh(tuple(a for a in mesh.axes if a.name != "pp")))
    assert plan.collectives == flat.collectives and plan.shapes == flat.shapes and plan.splits == flat.splits
    assert [p[:-1] for p in plan.placements] == list(flat.placements)  # (pp: the last axis)
    summary = plan.summary()
    assert summary["pp"] == mesh.size("pp") and summary["handovers"] == len(sends)


# -- the stages give the whole program's outputs -----------------------------------------------
@pytest.mark.parametrize("mesh", [Mesh.of(pp=2), Mesh.of(pp=3), Mesh.of(tp=2, dp=2, pp=3), Mesh.of(pp=6)],
                         ids=["pp2", "pp3", "tp2dp2pp3", "pp6"])
def test_pipelined_stages_give_the_whole_programs_outputs(mesh):
    program = residual()
    x = np.random.default_rng(1).standard_normal((B, 8)).astype(np.float32)
    arch = SpinnArch()
    whole = run_program(map_program(program, arch), [x])
    plan = S.plan_mesh(program, mesh)
    stages = S.stage_programs(program, plan)
    assert len(stages) == mesh.size("pp")
    values = {0: x}  # tensor id of the whole program -> its value, as the stages hand it over
    for s, stage in enumerate(stages):
        # a stage's tensors are the whole program's it touches, renumbered in id order
        lo = plan.stages.index(s)
        layers = program.layers[lo:lo + len(stage.layers)]
        used = sorted({tid for layer in layers for tid in (*layer.inputs, layer.output, *layer.consts.values())})
        assert [t.name for t in stage.tensors] == [program.tensors[tid].name for tid in used]
        received = {c.tensor for c in plan.handovers if c.layer == lo}
        ins = [used[i] for i in stage.inputs]
        assert set(ins) <= received | set(program.inputs) and set(ins) - set(program.inputs) <= received
        outs = run_program(map_program(stage, arch), [values[tid] for tid in ins])
        values.update({used[i]: v for i, v in zip(stage.outputs, outs)})
        # what the next cut sends is here (written now, or relayed from an earlier stage)
        for c in plan.handovers:
            if c.layer == lo + len(stage.layers):
                assert c.tensor in values
    got = [values[tid] for tid in program.outputs]
    assert len(got) == len(whole)
    for a, b in zip(got, whole):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    # and the whole program is right (numpy reference)
    c = program.constants
    z = x @ c[1]
    o = np.maximum(z @ c[2], 0) @ c[3] + z
    e = np.exp(o - o.max(axis=1, keepdims=True))
    np.testing.assert_allclose(whole[0], e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)
