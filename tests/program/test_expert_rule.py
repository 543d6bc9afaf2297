"""The expert axis (``ep``): each family's expert rule as a table, checked against the unsplit
layer, and the propagator's dispatch all-to-all on a small mixture-of-experts program.

A row is ``(layer, input placement, expected output placement, expected actions)`` on an
expert group of two chips. Then the layer runs per chip with the functional simulator (its
activation re-split as the actions say, the stacked experts' weights cut along the experts) and
the chips' outputs, concatenated along the output's split, must equal the unsplit layer's bit
for bit (small integers: every path is exact).
"""

from __future__ import annotations

import numpy as np
import pytest

from tvm_spinn.mapping import shard as S
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.program.ops.sharding import (EXPERT_RULE, REPLICATE, AllToAll, Mesh, MeshAxis, ShardContext, part,
                                            shard)
from tvm_spinn.runtime.simulator import run_program
from tvm_spinn.target.arch import SpinnArch

N = 2
EP = MeshAxis("ep", N, strict=True, gather_outputs=False)


def _program(kind, x_shape, w_shape, out_shape, attrs=None):
    """One layer: activation ``x``, a constant second operand ``w`` (a matmul's stacked experts
    ``[E, k, n]``, or a dense layer's ``[k, n]`` weight in ``consts``)."""
    tensors = [TensorDesc("x", list(x_shape), "float32", "input"), TensorDesc("w", list(w_shape), "float32", "const"),
               TensorDesc("y", list(out_shape), "float32", "output")]
    inputs, consts = ([0, 1], {}) if kind == "matmul" else ([0], {"weight": 1})
    layer = Layer(name="l", kind=kind, inputs=inputs, output=2, consts=consts, attrs=attrs or {}, mode="fp32")
    return Program("main", SpinnArch(), tensors, [0], [2], [layer],
                   constants={1: np.random.default_rng(1).integers(-3, 4, w_shape).astype(np.float32)})


def _block(x, axis, c):
    size = part(x.shape[axis], N)
    idx = [slice(None)] * x.ndim
    idx[axis] = slice(c * size, (c + 1) * size)
    return x[tuple(idx)]


EXPERTS = lambda: _program("matmul", (2, 4, 3), (2, 3, 5), (2, 4, 5))  # noqa: E731
CASES = [
    # stacked experts: split along the experts whatever the tokens' placement
    ("experts kept", EXPERTS, shard(0), shard(0), ()),
    ("dispatch", EXPERTS, shard(1), shard(0), (AllToAll(0, 0),)),
    ("replicated sliced", EXPERTS, REPLICATE, shard(0), ()),
    # three experts do not split over two chips: the data-parallel rule (the rows follow A)
    ("uneven experts", lambda: _program("matmul", (3, 4, 3), (3, 3, 5), (3, 4, 5)), shard(1), shard(1), ()),
    # any other GEMM: tokens independent, the weight whole on every chip
    ("dense tokens", lambda: _program("dense", (4, 3), (3, 5), (4, 5), {"relu": False}), shard(0), shard(0), ()),
]


@pytest.mark.parametrize("name,factory,placed,expected,before", CASES, ids=[c[0] for c in CASES])
def test_expert_rule_table(name, factory, placed, expected, before):
    program = factory()
    layer = program.layers[0]
    full = [list(t.shape) for t in program.tensors]
    d = S.rule_of(layer).experts(ShardContext(program, full, EP, lambda *_: True), layer, [placed])
    assert (d.output, tuple(d.before)) == (expected, before)
    # per chip: the activation after the actions, the stacked weights cut along the experts
    x = np.random.default_rng(0).integers(-3, 4, full[0]).astype(np.float32)
    now = shard(before[0].axis) if before else placed
    expert_split = expected == shard(0) and program.layers[0].kind == "matmul" and len(full[1]) == 3
    outs = []
    for c in range(N):
        xs = _block(x, now.axis, c) if now.split else (_block(x, 0, c) if expert_split else x)
        w = _block(program.constants[1], 0, c) if expert_split else program.constants[1]
        out = list(full[2])
        out[expected.axis] = part(out[expected.axis], N)
        shapes = [list(xs.shape), list(w.shape), out] + [list(t.shape) for t in program.tensors[3:]]
        chip = Program("main", SpinnArch(), [TensorDesc(t.name, s, t.dtype, t.role) for t, s in zip(program.tensors, shapes)],
                       [0], [2], [Layer(**vars(layer))], constants={1: np.ascontiguousarray(w)})
        outs.append(np.asarray(run_program(chip, [np.ascontiguousarray(xs)], mode="layers")[0]))
    whole = np.asarray(run_program(program, [x], mode="layers")[0])
    assert np.concatenate(outs, axis=expected.axis).tobytes() == whole.tobytes()


def test_expert_rule_is_data():
    assert EXPERT_RULE["expert_gemm"]["S(other)"] == ("S(experts)", "all_to_all")
    assert EXPERT_RULE["otherwise"] == "dp"


def _moe_program():
    """Tokens ``[4, 2, 3]`` (4 tokens' rows for 2 experts) -> experts first -> the stacked experts'
    GEMM -> tokens first again."""
    t = [TensorDesc("x", [4, 2, 3], "float32", "input"), TensorDesc("xe", [2, 4, 3], "float32", "temp"),
         TensorDesc("w", [2, 3, 5], "float32", "const"), TensorDesc("ye", [2, 4, 5], "float32", "temp"),
         TensorDesc("y", [4, 2, 5], "float32", "output")]
    layers = [Layer(name="dispatch", kind="permute_dims", inputs=[0], output=1, consts={}, attrs={"axes": [1, 0, 2]}),
              Layer(name="experts", kind="matmul", inputs=[1, 2], output=3, consts={}, attrs={}),
              Layer(name="combine", kind="permute_dims", inputs=[3], output=4, consts={}, attrs={"axes": [1, 0, 2]})]
    return Program("moe", SpinnArch(), t, [0], [4], layers, constants={2: np.zeros((2, 3, 5), np.float32)})


def test_propagator_dispatches_by_all_to_all():
    program = _moe_program()
    plan = S.plan_mesh(program, Mesh.of(ep=2))
    assert (plan.ep, plan.chips) == (2, 2)
    # the tokens start split; the permute carries the split to axis 1; the experts' GEMM needs
    # the experts' axis: one all-to-all of one chip's half of the tokens' rows
    (c,) = plan.collectives
    assert (c.layer, c.op, c.tensor, c.group, c.nbytes, c.shape) == (1, "all_to_all", 1, "ep", 2 * 4 * 3 * 4 // 2,
                                                                      (1, 4, 3))
    assert plan.shapes[2] == (1, 3, 5)  # each chip one expert's weight
    assert plan.shapes[3] == (1, 4, 5) and plan.shapes[4] == (4, 1, 5)
    local = S.shard_program(program, plan)
    assert local.layers[1].inputs[0] == len(program.tensors)  # reads the re-split copy
    assert local.tensors[-1].shape == [1, 4, 3]
    # the all-to-all costs on a board like the collective itself
    import tvm_spinn
    from tvm_spinn.target.topology import topology_of
    from tvm_spinn.timing import collectives as C
    from tvm_spinn.timing.system import collective_cost

    topo = topology_of(tvm_spinn.arch_of("spinn/board"))
    assert collective_cost(topo, [0, 1], c.op, c.nbytes, c.exact).seconds == C.all_to_all(topo, [0, 1], c.nbytes).seconds


def test_pipeline_stages_compose_with_the_expert_axis():
    """Two stages over an expert group: the dispatch's tokens cross the cut as each chip holds
    them (its half of the tokens, split carried to axis 1 by the permute), and the all-to-all
    runs in the receiving stage, as without stages."""
    program = _moe_program()
    flat, plan = S.plan_mesh(program, Mesh.of(ep=2)), S.plan_mesh(program, Mesh.of(ep=2, pp=2))
    assert (plan.chips, plan.stages) == (4, (0, 1, 1))  # the permute costs nothing: tie, earliest cut
    assert plan.collectives == flat.collectives and plan.shapes == flat.shapes
    (c,) = plan.handovers
    assert (c.layer, c.op, c.tensor, c.group, c.shape, c.nbytes) == (1, "send", 1, "pp", (2, 2, 3), 2 * 2 * 3 * 4)


def test_mesh_refusals():
    program = _moe_program()
    with pytest.raises(ValueError, match="expert axis"):
        S.plan_mesh(program, Mesh.of(ep=2, dp=2))
    assert S.plan_mesh(program, Mesh.of(pp=len(program.layers) + 1)) is None  # more stages than layers
    assert S.plan_mesh(program, Mesh.of(ep=8)) is None  # fewer tokens than chips
