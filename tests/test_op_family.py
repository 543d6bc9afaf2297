"""Adding an operator touches one module: a family defined and registered here (``abs``,
which the built-in families leave on the host) is partitioned, lowered, validated, tiled,
mapped, timed and simulated with no other change; its results match PyTorch, with the same bits
in both simulator modes, on a chip and on a board."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.program import ops
from tvm_spinn.program.ops.base import FlatFamily, OpFamily


class Absolute(FlatFamily):
    """``|x|`` on float32: one sign-bit clear per element on the M4F (tiles and their costs: the
    flat element-wise defaults of :class:`FlatFamily`)."""

    kinds = ("abs",)
    priority = 55

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


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = torch.nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.c2(torch.abs(self.c1(x)))


@pytest.fixture
def abs_family():
    family = ops.register(Absolute())
    yield family
    ops.unregister(family)


def _build(target):
    torch.manual_seed(0)
    model, x = _Net().eval(), torch.randn(1, 3, 10, 9)
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
