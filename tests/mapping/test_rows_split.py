"""A long row of softmax / layer_norm split over several PEs (rows family): same bits as the
whole-row kernel (tiles mode vs layers mode vs an unsplit tiling), chosen only where the modelled
time drops."""

import copy

import numpy as np
import pytest
import torch
from tvm import relax

import tvm_spinn
from tvm_spinn.mapping.tiling import tile_costs
from tvm_spinn.program import Program
from tvm_spinn.program.ops.rows import LAYER_NORM_BLOCK
from tvm_spinn.runtime.simulator import run_program
from tvm_spinn.target.registry import arch_of
from test_program_validation import programs_of, seal, split


class _Rows(torch.nn.Module):
    """A decode step's rows: one 1,024-element row through layer_norm, softmax and a mean."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        with torch.no_grad():  # gamma/beta that are not 1/0, so the chunks' scale and shift show
            self.norm.weight.copy_(torch.linspace(0.5, 1.5, d))
            self.norm.bias.copy_(torch.linspace(-0.25, 0.25, d))

    def forward(self, x):
        y = self.norm(x)
        return torch.softmax(y * 3.0, dim=-1), y.mean(dim=-1, keepdim=True)


@pytest.fixture(scope="module")
def board_rows():
    torch.manual_seed(0)
    model, x = _Rows(1024).eval(), torch.randn(1, 1024) * 4.0 + 1.0
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    (data,) = programs_of(relax.build(mod, target="spinn/board"))
    with torch.no_grad():
        ref = [t.numpy() for t in model(x)]
    return data, x.numpy(), ref


def _rows_layers(program: Program) -> dict[str, int]:
    return {layer.kind: i for i, layer in enumerate(program.layers) if layer.kind in ("layer_norm", "softmax", "mean")}


def _retiled(data: bytes, tiles: dict[int, list[int]]) -> Program:
    version, header, blob = split(data)
    h = copy.deepcopy(header)
    for i, tile in tiles.items():
        h["mapping"]["layers"][i]["tile"] = list(tile)
    return Program.from_bytes(seal(h, blob, version))


def test_long_row_splits_when_it_pays_with_the_same_bits(board_rows):
    data, x, ref = board_rows
    program = Program.from_bytes(data)
    idx = _rows_layers(program)
    assert set(idx) == {"layer_norm", "softmax", "mean"}, [layer.kind for layer in program.layers]
    tiles = {kind: list(program.mapping.layers[i].tile) for kind, i in idx.items()}
    # layer_norm and softmax: one row split into chunks on several PEs (a mean's sum is all
    # serial: only its DMA gets shorter)
    assert tiles["layer_norm"][0] == 1 and tiles["layer_norm"][1] < 1024, tiles
    assert tiles["softmax"][0] == 1 and tiles["softmax"][1] < 1024, tiles

    # bits: tiles mode (each chunk's tile) == layers mode (whole-row kernel) == an unsplit
    # tiling == uneven chunks; close to PyTorch
    layers = run_program(program, [x], mode="layers")
    split_tiles = run_program(program, [x], mode="tiles")
    whole = run_program(_retiled(data, {i: [1, 1024] for i in idx.values()}), [x], mode="tiles")
    uneven = run_program(_retiled(data, {i: [1, 100] for i in idx.values()}), [x], mode="tiles")
    for got in (split_tiles, whole, uneven):
        for a, b in zip(got, layers):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    for a, b in zip(layers, ref):
        np.testing.assert_allclose(a.reshape(b.shape), b, rtol=2e-5, atol=2e-6)


def test_split_lowers_the_modelled_cost(board_rows):
    data, _, _ = board_rows
    program = Program.from_bytes(data)
    arch = arch_of("spinn/board")
    idx = _rows_layers(program)
    for kind in ("layer_norm", "softmax"):
        i = idx[kind]
        tile = list(program.mapping.layers[i].tile)
        chunked, whole = tile_costs(program, i, arch, tile), tile_costs(program, i, arch, [1, 1024])
        assert len(chunked.cycles) == -(-1024 // tile[1]) > 1
        assert chunked.cycles.max() < whole.cycles.max(), kind
        # the chain keeps the serial sums whole: no chunk is faster than the row's serial adds
        # (one dependent add per term where the chunk's terms wait in FPU registers, else a
        # load and an add): softmax's sum adds every element, layer_norm's two sums their
        # blocks' sums (blocked order)
        held = -(-tile[1] // LAYER_NORM_BLOCK) if kind == "layer_norm" else tile[1]
        step = (arch.m4f_chain_cycles if held <= arch.m4f_chain_registers
                else arch.m4f_mem_cycles + arch.m4f_fpu_cycles + arch.m4f_loop_cycles)
        serial = {"layer_norm": 2 * -(-1024 // LAYER_NORM_BLOCK), "softmax": 1024}[kind] * step
        assert chunked.cycles.min() > serial
        # each chunk moves only its part of the row (and of gamma/beta)
        assert chunked.in_bytes.sum() == whole.in_bytes.sum() and chunked.in_bytes.max() < whole.in_bytes.max()
    # a mean is all serial sum: a split's compute only adds hops
    i = idx["mean"]
    assert tile_costs(program, i, arch, [1, 256]).cycles.max() > tile_costs(program, i, arch, [1, 1024]).cycles.max()
