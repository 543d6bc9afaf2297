"""What the partition accepts always tiles: its SRAM checks call the tiler's own smallest-tile
functions (``tvm_spinn.mapping.tiling.smallest_*_tile_bytes``).

Each op is built for systems whose PE SRAM sits just below, at and above the op's smallest
tile: the build never fails, the op is offloaded exactly when its smallest tile fits (refused
with an SRAM reason otherwise), and mapping the refused layer directly raises ``MappingError``
naming the layer and the smallest SRAM that fits.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.mapping import MappingError, map_program
from tvm_spinn.mapping.tiling import smallest_tile_bytes
from tvm_spinn.program import Layer, Program, TensorDesc

# op -> (module, input); sizes chosen so the smallest tiles differ between ops
CASES = {
    "conv2d": (torch.nn.Conv2d(24, 8, 3, padding=1), torch.randn(1, 24, 8, 8)),
    "dense": (torch.nn.Linear(40, 12), torch.randn(3, 40)),
    "layer_norm": (torch.nn.LayerNorm(300), torch.randn(2, 300)),
    "softmax": (torch.nn.Softmax(dim=-1), torch.randn(2, 500)),
    "max_pool2d": (torch.nn.MaxPool2d(5, stride=1, padding=2), torch.randn(1, 2, 6, 120)),
}


def _probe(op: str) -> tuple[Program, int]:
    """A one-layer program of ``op`` at the case's shapes (for the expected smallest tile)."""
    _, x = CASES[op]
    shape = list(x.shape)
    t = [TensorDesc("x", shape, "float32", "input")]
    if op == "conv2d":
        t += [TensorDesc("w", [8, 24, 3, 3], "float32", "const"), TensorDesc("y", [1, 8, 8, 8], "float32", "output")]
        layer = Layer("conv", "conv2d", [0], 2, {"weight": 1},
                      {"strides": [1, 1], "padding": [1, 1, 1, 1], "dilation": [1, 1], "groups": 1, "relu": False})
    elif op == "dense":
        t += [TensorDesc("w", [40, 12], "float32", "const"), TensorDesc("y", [3, 12], "float32", "output")]
        layer = Layer("dense", "dense", [0], 2, {"weight": 1}, {"relu": False})
    elif op == "layer_norm":
        t += [TensorDesc("g", [300], "float32", "const"), TensorDesc("b", [300], "float32", "const"),
              TensorDesc("y", shape, "float32", "output")]
        layer = Layer("ln", "layer_norm", [0], 3, {"gamma": 1, "beta": 2}, {"epsilon": 1e-5, "center": True, "scale": True})
    elif op == "softmax":
        t += [TensorDesc("y", shape, "float32", "output")]
        layer = Layer("sm", "softmax", [0], 1)
    else:
        t += [TensorDesc("y", shape, "float32", "output")]
        layer = Layer("pool", "max_pool2d", [0], 1, attrs={"pool_size": [5, 5], "strides": [1, 1], "padding": [2, 2, 2, 2],
                                                           "dilation": [1, 1], "count_include_pad": False})
    return Program("probe", {}, t, [0], [len(t) - 1], [layer]), 0


@pytest.mark.parametrize("op", sorted(CASES))
def test_partition_offloads_exactly_what_tiles(op, register_system):
    model, x = CASES[op]
    program, index = _probe(op)
    base = tvm_spinn.SpinnArch()
    need = smallest_tile_bytes(program, index, base)
    mod = tvm_spinn.frontend.from_pytorch(model.eval(), (x,))
    with torch.no_grad():
        expected = model(x).numpy()
    for delta in (-1, 0, 1):
        arch = tvm_spinn.make_system(f"fits-{op}-{delta + 1}", sram_bytes=need + delta + base.sram_reserved_bytes)
        assert arch.tile_sram_bytes == need + delta
        ex = relax.build(mod, target=register_system(arch))  # never a MappingError
        offloaded = tvm_spinn.report(ex).offloaded_ops
        assert any(k.startswith(f"spinn.{op}") for k in offloaded) == (delta >= 0), (op, delta, offloaded)
        got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy())).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
        program = dataclasses.replace(program, arch=arch)
        if delta < 0:
            with pytest.raises(MappingError, match=rf"layer {program.layers[0].name}: its smallest tile needs {need} bytes.*sram_bytes >= {need + base.sram_reserved_bytes}"):
                map_program(program, arch)
        else:
            map_program(program, arch)
