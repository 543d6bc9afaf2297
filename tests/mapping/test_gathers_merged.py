"""All-gathers of bytes already written go out as one (``mapping.system.issued``), from SRAM.

Llama's decode block slices its query, key and value from one column-parallel GEMM's output;
the query is all-gathered where its reshape into heads cannot carry the split, the key where
its rotary embedding needs its whole head, after a reshape and a permute that moves only unit
axes. Those two layers relabel the key slice's bytes, which the GEMM wrote before the query's
gather is due, so the chips send both in one all-gather (one collective's hop latencies)
instead of two. A key computed by a layer after that point (an element-wise layer) is not
written yet and keeps its own gather. The references are the shapes' byte counts, worked out
here by hand.

What a gather sends is the chip's block where its producer left it, in SRAM
(``system._sent_blocks``): the slice and the permute that make the blocks are views of the
GEMM's output there and cost nothing, not copies to DRAM for no reader.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.mapping.shard import plan_shards
from tvm_spinn.mapping.system import issued
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.program.ops import family_of

ARCH = tvm_spinn.make_system("gathers-merged-3", chips=3, pes_per_chip=8)
HEAD = 16


def _qk(key_layer: str) -> Program:
    """``x`` through a 64 -> 96 dense; its first 64 columns the query (4 heads of 16), the next
    16 the key (one head), each through a reshape into heads, a unit-axis permute and ``rope``;
    ``key_layer``: ``"view"`` (the key's reshape and permute only) or ``"sigmoid"`` (an
    element-wise layer on the key slice before them)."""
    t = [TensorDesc("x", [1, 64], "float32", "input"), TensorDesc("w", [64, 96], "float32", "const"),
         TensorDesc("cos", [1, 1, 1, HEAD], "float32", "input"), TensorDesc("sin", [1, 1, 1, HEAD], "float32", "input")]
    layers = []

    def add(kind, ins, shape, consts=None, **attrs):
        t.append(TensorDesc(f"t{len(t)}", list(shape), "float32", "temp"))
        layers.append(Layer(f"{kind}{len(layers)}", kind, list(ins), len(t) - 1, consts or {}, attrs))
        return len(t) - 1

    y = add("dense", [0], [1, 96], {"weight": 1}, relu=False)
    r = add("reshape", [y], [1, 1, 96])
    q = add("strided_slice", [r], [1, 1, 64], axes=[2], begin=[0], strides=[1])
    k = add("strided_slice", [r], [1, 1, HEAD], axes=[2], begin=[64], strides=[1])
    qh = add("permute_dims", [add("reshape", [q], [1, 1, 4, HEAD])], [1, 4, 1, HEAD], axes=[0, 2, 1, 3])
    qo = add("rope", [qh, 2, 3], [1, 4, 1, HEAD])
    if key_layer == "sigmoid":
        k = add("sigmoid", [k], [1, 1, HEAD])
    kh = add("permute_dims", [add("reshape", [k], [1, 1, 1, HEAD])], [1, 1, 1, HEAD], axes=[0, 2, 1, 3])
    ko = add("rope", [kh, 2, 3], [1, 1, 1, HEAD])
    for tid in (qo, ko):
        t[tid] = dataclasses.replace(t[tid], role="output")
    return Program("main", ARCH, t, [0, 2, 3], [qo, ko], layers, constants={1: np.ones((64, 96), np.float32)})


def _gathers(program: Program) -> tuple[list, list]:
    """``(planned, issued)`` all-gathers before a layer (not the outputs') on 3 chips."""
    plan = plan_shards(program, 3)
    n = len(program.layers)
    planned = [(c.layer, c.nbytes) for c in plan.collectives if c.op == "all_gather" and c.layer < n]
    sent = [(r[0], r[2]) for r in issued(program, plan.collectives) if r[1] == "all_gather" and r[0] < n]
    return planned, sent


def test_the_key_rides_on_the_querys_gather():
    """The query (64 floats) gathered before its reshape, the key (16) before its rope: issued
    as one gather of both, at the query's layer."""
    planned, sent = _gathers(_qk("view"))
    q_bytes, k_bytes = 64 * 4, HEAD * 4
    assert [b for _, b in planned] == [q_bytes, k_bytes]
    assert sent == [(planned[0][0], q_bytes + k_bytes)]


def test_a_key_computed_later_gathers_apart():
    """An element-wise layer on the key after the query's gather is due: its bytes are not
    written then, so its gather stays its own."""
    planned, sent = _gathers(_qk("sigmoid"))
    assert [b for _, b in planned] == [64 * 4, HEAD * 4]
    assert sent == planned


@pytest.mark.parametrize("shape, axes, alias", [
    ((1, 1, 1, HEAD), (0, 2, 1, 3), True),    # unit axes only
    ((1, 1, 4, HEAD), (0, 2, 1, 3), True),    # the heads past a unit axis: the same order
    ((1, 1, HEAD, 1), (0, 1, 3, 2), True),
    ((1, 1, 4, 4), (0, 1, 3, 2), False),      # a transpose
    ((1, 2, 4, HEAD), (0, 2, 1, 3), False),
])
def test_a_unit_axis_permute_aliases_its_input(shape, axes, alias):
    """A permute that keeps the order of the axes longer than one leaves the bytes in place."""
    t = [TensorDesc("x", list(shape), "float32", "input"),
         TensorDesc("y", [shape[a] for a in axes], "float32", "output")]
    layer = Layer("p", "permute_dims", [0], 1, {}, {"axes": list(axes)})
    program = Program("main", ARCH, t, [0], [1], [layer])
    x = np.arange(np.prod(shape)).reshape(shape)
    same = np.array_equal(np.transpose(x, axes).reshape(-1), x.reshape(-1))  # the reference: numpy's bytes
    assert same == alias
    assert family_of("permute_dims").aliases_input(program, layer) == alias


def _timed(program: Program):
    """``(plan, shard, timed plan)`` of ``program`` on the 3 chips, column-parallel."""
    from tvm_spinn.mapping import MappingOptions
    from tvm_spinn.mapping import system as S
    from tvm_spinn.mapping.schedule import _map
    from tvm_spinn.mapping.shard import shard_program
    from tvm_spinn.mapping.tiling import program_work
    from tvm_spinn.target.topology import topology_of

    options = MappingOptions()
    program = program_work(program, ARCH)
    plan = plan_shards(program, 3)

    def map_one(shard, chip, reserved):
        return _map(program_work(shard, chip), chip, "sequential", options, reserved)

    reserved = np.zeros(ARCH.pes_per_chip, dtype=np.int64)
    return plan, shard_program(program, plan), S._time_plan(program, plan, ARCH, topology_of(ARCH), map_one, reserved)


def test_the_gathered_blocks_stay_in_sram():
    """The query slice and the permuted key, read by nothing but their gathers, are the blocks
    the links send: on chip, so the slice and the permute making them are free views."""
    from tvm_spinn.mapping.system import GATHERED_SRAM_SHARE, _sent_blocks

    program = _qk("view")
    plan, shard, timed = _timed(program)
    n = len(program.layers)
    sources = sorted(c.tensor for c in plan.collectives if c.op == "all_gather" and c.layer < n)
    makers = {layer.output: i for i, layer in enumerate(program.layers)}
    assert [program.layers[makers[t]].kind for t in sources] == ["strided_slice", "permute_dims"]
    room = ARCH.pes_per_chip * ARCH.tile_sram_bytes * GATHERED_SRAM_SHARE
    assert _sent_blocks(program, plan, shard, room) == sources
    assert _sent_blocks(program, plan, shard, 0) == []  # no room: left to the memory plan
    layer_s = timed.timing.layer_s
    for t in sources:
        assert layer_s[makers[t]] == 0.0, program.layers[makers[t]].kind
    assert layer_s[0] > 0.0  # the GEMM
