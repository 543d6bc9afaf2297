"""The timing model's free views and dropped barriers (``tvm_spinn.timing.model``).

Synthetic programs, mapped on one chip. The number of barriers a program pays is measured
independently of the model's bookkeeping: the program is timed with two barrier costs and the
difference in cycles is divided by the difference in cost. Bits never depend on any of this:
the functional simulator's output is compared with numpy.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tvm_spinn.mapping import map_program
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.program.ops.base import family_of
from tvm_spinn.runtime.simulator import run_program
from tvm_spinn.target import arch_of
from tvm_spinn.timing.model import evaluate

ARCH = arch_of("spinn")
N = 4096


class _Builder:
    def __init__(self, shape):
        self.tensors = [TensorDesc("x", list(shape), "float32", "input")]
        self.layers = []

    def add(self, kind, inputs, shape, consts=None, **attrs):
        self.tensors.append(TensorDesc(f"t{len(self.tensors)}", list(shape), "float32", "temp"))
        self.layers.append(Layer(f"{kind}{len(self.layers)}", kind, list(inputs), len(self.tensors) - 1,
                                 consts or {}, attrs))
        return len(self.tensors) - 1

    def const(self, shape, value):
        self.tensors.append(TensorDesc(f"c{len(self.tensors)}", list(shape), "float32", "const"))
        return len(self.tensors) - 1, np.full(shape, value, dtype=np.float32)

    def program(self, out):
        self.tensors[out] = dataclasses.replace(self.tensors[out], role="output")
        program = Program("main", ARCH, self.tensors, [0], [out], self.layers)
        return map_program(program, ARCH)


def _barriers(program) -> float:
    """Barriers the program pays: d(cycles) / d(barrier_cycles)."""
    lo, hi = (evaluate(program, dataclasses.replace(ARCH, barrier_cycles=b)).cycles for b in (200, 1200))
    return (hi - lo) / 1000


@pytest.mark.parametrize("kind,in_shape,shape,attrs,view", [
    ("reshape", [1, N], [1, 1, N], {}, True),
    ("permute_dims", [1, 1, N], [1, 1, N], {"axes": [1, 0, 2]}, True),  # moves unit axes only
    ("permute_dims", [1, 64, 64], [1, 64, 64], {"axes": [0, 2, 1]}, False),  # a transpose
    ("broadcast_to", [1, N], [1, 1, N], {}, True),  # adds a unit axis
    ("broadcast_to", [1, N], [2, 1, N], {}, False),  # duplicates the bytes
    ("strided_slice", [1, 1, N], [1, 1, N // 4], {"axes": [2], "begin": [N // 2], "strides": [1]}, True),
    ("strided_slice", [1, 1, N], [1, 1, N // 4], {"axes": [2], "begin": [0], "strides": [4]}, False),
])
def test_views_cost_nothing_and_copies_do(kind, in_shape, shape, attrs, view):
    b = _Builder(in_shape)
    t = b.add("tanh", [0], in_shape)
    v = b.add(kind, [t], shape, **attrs)
    out = b.add("tanh", [v], shape)
    program = b.program(out)
    assert family_of(kind).is_view(program, program.layers[1]) is view
    row = evaluate(program, ARCH).layers[1]
    assert (row.cycles == 0) is view
    if view:
        assert row.noc_bytes == row.dram_bytes == 0
    # the functional result is numpy's either way
    xs = np.random.default_rng(0).standard_normal(in_shape).astype(np.float32)
    (got,) = run_program(program, [xs])
    ref = np.tanh(xs)
    if kind == "permute_dims":
        ref = np.transpose(ref, attrs["axes"])
    elif kind == "broadcast_to":
        ref = np.broadcast_to(ref, shape)
    elif kind == "strided_slice":
        ref = ref[..., attrs["begin"][0]::attrs["strides"][0]][..., :shape[-1]]
    np.testing.assert_allclose(got, np.tanh(np.reshape(ref, shape)), rtol=2e-6, atol=2e-6)


def test_pointwise_chain_pays_one_barrier():
    # seven point-wise layers on the same flat tiles: each PE reads only what it wrote
    b = _Builder([1, N])
    t = 0
    for _ in range(7):
        t = b.add("tanh", [t], [1, N])
    program = b.program(t)
    assert _barriers(program) == 1
    # the dropped barriers come off the earlier rows, whose cycles stay whole numbers
    rows = program.timing.layers
    assert all(type(row.cycles) is int for row in rows), [row.cycles for row in rows]
    assert sum(row.cycles for row in rows) == program.timing.cycles
    assert Program.from_bytes(program.to_bytes()).timing == program.timing


def test_reads_from_other_pes_keep_their_barriers():
    # a layer_norm's row tiles differ from the point-wise layers' flat tiles: the first tanh
    # waits for the whole row (a barrier after the layer_norm) ...
    b = _Builder([1, N])
    g, gv = b.const([N], 1.0)
    be, bv = b.const([N], 0.0)
    y = b.add("layer_norm", [0], [1, N], {"gamma": g, "beta": be}, epsilon=1e-5, center=True, scale=True)
    z = b.add("tanh", [y], [1, N])
    w = b.add("tanh", [z], [1, N])
    dead = b.program(w)
    dead = dataclasses.replace(dead, constants={g: gv, be: bv})
    # ... and the second tanh too: the row it read from other PEs is dead once the first has
    # run, so its buffer may be reused while a slower PE still reads it
    assert _barriers(dead) == 3
    b = _Builder([1, N])
    g, gv = b.const([N], 1.0)
    be, bv = b.const([N], 0.0)
    y = b.add("layer_norm", [0], [1, N], {"gamma": g, "beta": be}, epsilon=1e-5, center=True, scale=True)
    z = b.add("tanh", [y], [1, N])
    w = b.add("add", [z, y], [1, N])  # the row stays live until the add: no barrier before it
    live = b.program(w)
    live = dataclasses.replace(live, constants={g: gv, be: bv})
    assert _barriers(live) == 2
    xs = np.random.default_rng(1).standard_normal((1, N)).astype(np.float32)
    (got,) = run_program(live, [xs])
    ln = (xs - xs.mean()) / np.sqrt(xs.var() + 1e-5)
    np.testing.assert_allclose(got, np.tanh(ln) + ln, rtol=1e-4, atol=1e-4)


def test_split_row_chain_from_registers():
    # a 1024-long softmax row split into chunks that fit the FPU registers sums at one add per
    # element (its sum of exps is sequential)
    b = _Builder([1, 1024])
    y = b.add("softmax", [0], [1, 1024], {})
    program = b.program(y)
    tile = list(program.mapping.layers[0].tile)
    assert 1 < tile[1] <= ARCH.m4f_chain_registers
    slow = dataclasses.replace(ARCH, m4f_chain_registers=1)
    from tvm_spinn.program.ops.rows import Rows  # noqa: PLC0415 - the family under test
    rows = family_of("softmax")
    assert isinstance(rows, Rows)
    lo, hi, _ = rows.expand_regions(program, program.layers[0], tile)
    fast_c = rows.tile_costs(program, program.layers[0], ARCH, tile, lo, hi)[4]
    slow_c = rows.tile_costs(program, program.layers[0], slow, tile, lo, hi)[4]
    # one serial sum over the row: 1024 x (load + add in a loop - add) cycles saved
    load_add = ARCH.m4f_mem_cycles + ARCH.m4f_fpu_cycles + ARCH.m4f_loop_cycles
    assert int(slow_c.max() - fast_c.max()) == 1024 * (load_add - ARCH.m4f_chain_cycles)


def test_split_layer_norm_chains_block_sums():
    # layer_norm's sums are blocked: a 1024-long row splits into chunks, and only the block
    # sums per statistic travel (and straddling blocks' partials), far fewer than the row's elements
    from tvm_spinn.program.ops.rows import LAYER_NORM_BLOCK  # noqa: PLC0415 - the family under test

    b = _Builder([1, 1024])
    g, gv = b.const([1024], 1.0)
    be, bv = b.const([1024], 0.0)
    y = b.add("layer_norm", [0], [1, 1024], {"gamma": g, "beta": be}, epsilon=1e-5, center=True, scale=True)
    program = b.program(y)
    tile = list(program.mapping.layers[0].tile)
    assert tile[1] < 1024
    rows = family_of("layer_norm")
    lo, hi, _ = rows.expand_regions(program, program.layers[0], tile)
    cycles = rows.tile_costs(program, program.layers[0], ARCH, tile, lo, hi)[4]
    # the chained terms (what one more cycle per chained add costs): 2 statistics x the 32
    # block sums at least (plus the partials of blocks straddling chunks), far fewer than the
    # 2 x 1,024 of a sequential sum of the row
    slower = dataclasses.replace(ARCH, m4f_chain_cycles=ARCH.m4f_chain_cycles + 1)
    terms = rows.tile_costs(program, program.layers[0], slower, tile, lo, hi)[4] - cycles
    assert 2 * (1024 // LAYER_NORM_BLOCK) <= terms.min() and terms.max() < 2 * 1024 // 8
    assert cycles.min() >= 2 * (1024 // LAYER_NORM_BLOCK) * ARCH.m4f_chain_cycles
    xs = np.random.default_rng(2).standard_normal((1, 1024)).astype(np.float32) * 3 + 1
    (got,) = run_program(program, [xs])
    ref = (xs.astype(np.float64) - xs.mean(dtype=np.float64)) / np.sqrt(xs.astype(np.float64).var() + 1e-5)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_siblings_reading_one_finished_input_share_a_barrier():
    # two softmaxes of the same row (each reads the elements other PEs wrote): the second reads
    # nothing written since the barrier after the tanh, and the tanh's output it reads stays live,
    # so no barrier stands between the two; the add reads both, after a barrier
    shape = [16, 256]
    b = _Builder(shape)
    t = b.add("tanh", [0], shape)
    s1 = b.add("softmax", [t], shape, axis=-1)
    s2 = b.add("softmax", [t], shape, axis=-1)
    siblings = b.program(b.add("add", [s1, s2], shape))
    assert _barriers(siblings) == 3
    # the second softmax of the first's output waits for it
    b = _Builder(shape)
    t = b.add("tanh", [0], shape)
    s1 = b.add("softmax", [t], shape, axis=-1)
    s2 = b.add("softmax", [s1], shape, axis=-1)
    chained = b.program(b.add("add", [s1, s2], shape))
    assert _barriers(chained) == 4
    # a sibling after a layer whose input dies with it keeps the barrier (that input's buffer
    # may be reused while a slower PE still reads it)
    b = _Builder(shape)
    t = b.add("tanh", [0], shape)
    u = b.add("tanh", [t], shape)
    s1 = b.add("softmax", [u], shape, axis=-1)
    s2 = b.add("softmax", [t], shape, axis=-1)
    dead = b.program(b.add("add", [s1, s2], shape))
    assert _barriers(dead) == 4
    xs = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    (got,) = run_program(siblings, [xs])
    np.testing.assert_allclose(got, 2 * _softmax(np.tanh(xs)), rtol=1e-5, atol=1e-6)
    (got,) = run_program(chained, [xs])
    s = _softmax(np.tanh(xs))
    np.testing.assert_allclose(got, s + _softmax(s), rtol=1e-5, atol=1e-6)
