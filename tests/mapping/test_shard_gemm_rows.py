"""A chip's shard of a GEMM whose rows are split while its left operand is read whole.

A matmul on a replicated left operand (a decode step's query heads, a program input) whose
output rows the shard plan splits over the chips reads only its rows of that operand: the
shard's GEMM is the output's rows, not the operand's. References: the output's local shape
(the plan's), the left operand's rows in the program as written (every matmul of a program
computes its left operand's rows), and the tile regions' count of multiply-adds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tvm import relax

import tvm_spinn
from tvm_spinn.mapping.shard import plan_shards, shard_program
from tvm_spinn.program.ops import family_of
from tvm_spinn.program.ops.gemm.geometry import gemm_shape

HEADS, HEAD_DIM, SLOTS = 4, 32, 64


class _Attention(torch.nn.Module):
    def forward(self, q, kt, v):
        return torch.softmax(q @ kt, dim=-1) @ v


@pytest.fixture(scope="module")
def attention():
    torch.manual_seed(0)
    args = (torch.randn(1, HEADS, HEAD_DIM), torch.randn(1, HEAD_DIM, SLOTS), torch.randn(1, SLOTS, HEAD_DIM))
    mod = tvm_spinn.frontend.from_pytorch(_Attention().eval(), args)
    return tvm_spinn.report(relax.build(mod, target="spinn")).programs


def _matmuls(program):
    return [i for i, layer in enumerate(program.layers) if layer.kind == "matmul"]


def test_program_as_written_keeps_the_left_operands_rows(attention):
    """In a program as written the output's rows are the left operand's: the GEMM view (and so
    every tile, its cycles and the program's bytes) is what it was."""
    seen = 0
    for program in attention:
        for i in _matmuls(program):
            layer = program.layers[i]
            a = program.tensors[layer.inputs[0]].shape
            g = gemm_shape(program, layer)
            assert (g.m, g.k) == (a[-2], a[-1])
            seen += 1
    assert seen == 2


@pytest.mark.parametrize("tp,sp", [(2, 1), (4, 1), (2, 2), (4, 4)])
def test_shard_computes_only_its_rows(attention, tp, sp):
    """The scores' matmul on the replicated query rows, split over ``tp`` (and ``sp``) chips:
    each chip's GEMM has the output's local rows, fewer than the query's, and its tiles' regions
    cover exactly them (the multiply-adds of the local output, not of every query row)."""
    program = attention[0]
    plan = plan_shards(program, tp, 1, True, sp)
    assert plan is not None
    shard = shard_program(program, plan)
    i = _matmuls(program)[0]
    layer = shard.layers[i]
    a, out = shard.tensors[layer.inputs[0]].shape, shard.tensors[layer.output].shape
    assert a[-2] == HEADS and out[-2] < HEADS  # the operand read whole, the rows split
    g = gemm_shape(shard, layer)
    assert (g.m, g.n, g.k) == (out[-2], out[-1], a[-1])
    fam = family_of(layer.kind)
    flops, _ = fam.work(shard, layer, program.arch)
    assert flops == 2 * int(np.prod(out, dtype=np.int64)) * HEAD_DIM
    lo, hi, _ = fam.expand_regions(shard, layer, [1, 1, HEAD_DIM])
    assert int(np.prod(hi - lo, axis=1).sum()) == int(np.prod(out, dtype=np.int64))
    assert int(hi[:, 1].max()) == out[-2]
