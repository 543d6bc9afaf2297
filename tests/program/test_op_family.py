"""Adding an operator touches one module: a family defined and registered here (``abs``,
which the built-in families leave on the host) is partitioned, lowered, validated, tiled,
mapped, sharded over a board's chips by the rule it states, timed and simulated with no other
change; its results match PyTorch, with the same bits in both simulator modes, on a chip and on
a board. The same family without a sharding rule runs replicated, and the plan says why."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.program import ops
from tvm_spinn.mapping.shard import plan_shards
from tvm_spinn.mapping.system import recorded_plan
from tvm_spinn.program.ops.base import FlatFamily, OpFamily
from tvm_spinn.program.ops.sharding import PointwiseRule


class Absolute(FlatFamily):
    """``|x|`` on float32: one sign-bit clear per element on the M4F (tiles and their costs: the
    flat element-wise defaults of :class:`FlatFamily`)."""

    kinds = ("abs",)
    priority = 55
    #: point-wise: a split of its input carries to its output unchanged
    sharding = PointwiseRule()

    def patterns(self, kit):
        return [kit.unary("spinn.abs", "relax.abs", lambda kit, op, ctx: kit.check_tensors(op, ctx, ("input",)))]

    def lower(self, lowerer, name, kind, calls, env, layer):
        layer.inputs = [lowerer.operand(calls[0][1].args[0], env)]

    def check(self, v, f, kind, mode, ins, consts, out, attrs):
        v.need(f"{f}.inputs", kind, ins, 1)
        v.dtype(f"{f}.inputs[0]", ins[0], ("float32",))
        v.dtype(f"{f}.output", out, ("float32",))
        v.consts(f, consts, set())
        v.shape(f"{f}.output", out, v.shapes[ins[0]])
        return (int(np.prod(v.shapes[out])),), None

    def work(self, program, layer, arch):
        return int(np.prod(program.tensors[layer.output].shape)), None

    def prepare_tiles(self, runner):
        runner.flat = np.ascontiguousarray(runner.env[runner.layer.inputs[0]]).reshape(-1)

    def run_tile(self, runner, tile):
        (e0, e1), = tile.region
        runner.out.reshape(-1)[e0:e1] = np.abs(runner.flat[e0:e1])


class AbsoluteNoRule(Absolute):
    """The same operator, stating no sharding rule."""

    sharding = None


class _Net(torch.nn.Module):
    def __init__(self, channels=8, out=4):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, channels, 3, padding=1)
        self.c2 = torch.nn.Conv2d(channels, out, 3, padding=1)

    def forward(self, x):
        return self.c2(torch.abs(self.c1(x)))


@pytest.fixture
def abs_family():
    family = ops.register(Absolute())
    yield family
    ops.unregister(family)


def _build(target, wide=False):
    """The small net; ``wide``: 32 channels on 32 x 32 pixels, enough work that a board's
    mapper spreads it over chips."""
    torch.manual_seed(0)
    model = (_Net(32, 32) if wide else _Net()).eval()
    x = torch.randn(1, 3, 32, 32) if wide else torch.randn(1, 3, 10, 9)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    return model, x, mod, relax.build(mod, target=target)


@pytest.mark.parametrize("target", ["spinn", "spinn/board"])
def test_a_family_registered_in_one_module_runs_end_to_end(abs_family, monkeypatch, target):
    model, x, mod, ex = _build(target)
    summary = tvm_spinn.partition.summarize_partition(tvm_spinn.partition.partition_for_spinn(mod, target))
    assert summary.offloaded_ops.get("spinn.abs") == 1 and summary.regions == 1, summary
    assert "relax.abs" not in summary.fallback_ops
    rep = tvm_spinn.report(ex)
    layers = [layer for p in rep.programs for layer in p.layers]
    assert [layer.kind for layer in layers].count("abs") == 1
    vm = relax.VirtualMachine(ex, tvm.cpu())
    outputs = {}
    for mode in ("layers", "tiles"):
        monkeypatch.setenv("TVM_SPINN_SIM_MODE", mode)
        outputs[mode] = vm["main"](tvm.runtime.tensor(x.numpy())).numpy()
    assert outputs["layers"].tobytes() == outputs["tiles"].tobytes()
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(outputs["layers"], want, rtol=1e-5, atol=1e-5)


def test_without_the_family_abs_stays_on_the_host():
    _, _, mod, _ = _build("spinn")
    summary = tvm_spinn.partition.summarize_partition(tvm_spinn.partition.partition_for_spinn(mod))
    assert summary.fallback_ops.get("relax.abs") == 1 and summary.regions == 2, summary


def test_a_kind_belongs_to_one_family(abs_family):
    class Clash(OpFamily):
        kinds = ("abs",)

    with pytest.raises(ValueError, match="already defined by Absolute"):
        ops.register(Clash())
    assert ops.family_of("abs") is abs_family
    assert "abs" in ops.layer_kinds()


def _abs_program(ex):
    for program in tvm_spinn.report(ex).programs:
        for i, layer in enumerate(program.layers):
            if layer.kind == "abs":
                return program, i
    raise AssertionError("no abs layer")


def test_the_family_shards_on_a_board_by_its_own_rule(abs_family):
    model, x, _, ex = _build("spinn/board", wide=True)
    program, i = _abs_program(ex)
    chosen = recorded_plan(program)
    assert chosen.chips > 1 and chosen.splits[i] == "split", chosen.summary()
    assert not chosen.replicated
    for tp in (2, 4):
        plan = plan_shards(program, tp)
        # the first convolution is column-parallel (channels), abs keeps the channel split,
        # the second convolution gathers its input: nothing is gathered before abs
        assert plan.splits[i] == "split"
        out = program.layers[i].output
        assert plan.shapes[out][1] == -(-program.tensors[out].shape[1] // tp)
        assert not [c for c in plan.collectives if c.layer == i]
    vm = relax.VirtualMachine(ex, tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x.numpy())).numpy()
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), rtol=1e-5, atol=1e-5)


def test_a_family_without_a_rule_is_replicated_with_the_reason():
    family = ops.register(AbsoluteNoRule())
    try:
        _, _, _, ex = _build("spinn/board", wide=True)
        program, i = _abs_program(ex)
        plan = plan_shards(program, 4)
        assert plan.splits[i] == "rep"
        assert ("all_gather", program.layers[i].inputs[0]) in [(c.op, c.tensor) for c in plan.collectives if c.layer == i]
        reason = "operator family AbsoluteNoRule states no sharding rule"
        assert plan.replicated == ((program.layers[i].name, reason),)
        chosen = recorded_plan(program)
        if chosen.chips > 1:
            assert chosen.splits[i] == "rep" and program.mapping.system.replicated == ((program.layers[i].name, reason),)
            assert reason in str(tvm_spinn.report(ex))
    finally:
        ops.unregister(family)


def test_movement_and_gather_refuse_a_per_element_price():
    """Movement and gather tiles are priced by their descriptors or indices (``tile_costs``):
    the flat families' per-element hook refuses, naming the family, and a movement layer of a
    kind neither strided nor a scatter has no tile cost (an error naming the kind)."""
    from tvm_spinn.program import Layer, Program, TensorDesc
    from tvm_spinn.program.ops.base import MappingError
    from tvm_spinn.target.arch import SpinnArch

    arch = SpinnArch()
    tensors = [TensorDesc("x", [4, 8], "float32", "input"), TensorDesc("y", [8, 4], "float32", "output")]
    reshape = Layer(name="r", kind="reshape", inputs=[0], output=1, attrs={"shape": [8, 4]})
    program = Program("main", arch, tensors, [0], [1], [reshape])
    lo, hi = np.array([[0]]), np.array([[32]])
    movement, gather = ops.family_of("reshape"), ops.family_of("take")
    sram, *_, cycles = movement.tile_costs(program, reshape, arch, None, lo, hi)
    assert sram == 2 * (4 + 4) * 32 and cycles[0] > 0
    for family in (movement, gather):
        with pytest.raises(NotImplementedError, match=type(family).__name__):
            family.cycles_per_element(reshape, arch)
    odd = Layer(name="o", kind="squeeze", inputs=[0], output=1)
    with pytest.raises(MappingError, match="'squeeze'"):
        movement.tile_costs(program, odd, arch, None, lo, hi)
