"""Each operator family's sharding rule as a table, checked against the unsplit layer.

A row is ``(layer, input placements, mesh axis) -> (output placement, what runs before)``. The
rule (:class:`~tvm_spinn.program.ops.sharding.ShardingRule` of the layer's family) must give
that decision; then the layer is run per chip with the functional simulator: each activation
input sliced as its placement after the decision's gathers says (``R``: whole, ``S(a)``: the
chip's block along ``a``, ``P``: the whole tensor on chip 0 and zeros elsewhere), each constant
cut as the propagator cuts it, and the chips' outputs combined as the output placement says
(``R``: every chip holds the unsplit result, ``S(a)``: the blocks concatenated, ``P``: summed,
the all-reduce). The values are small integers, so every path is exact: the combined result
must equal the unsplit layer's bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tvm_spinn.mapping import shard as S
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.program.ops import family_of
from tvm_spinn.program.ops.sharding import (PARTIAL, REPLICATE, ROW_ALWAYS, GatherInput, Mesh, MeshAxis, RowAllReduce,
                                            ShardContext, part, shard)
from tvm_spinn.runtime.simulator import run_program
from tvm_spinn.target.arch import SpinnArch

N = 2  # chips along the axis


def _program(kind, ins, out_shape, consts=(), attrs=None, dtype="float32", out_dtype=None, mode="fp32"):
    """One layer of ``kind``: ``ins`` = [(shape, dtype)] activations, ``consts`` = [(name, shape, dtype)]."""
    tensors = [TensorDesc(f"x{i}", list(s), d, "input") for i, (s, d) in enumerate(ins)]
    cmap = {}
    for name, shape, d in consts:
        tensors.append(TensorDesc(name, list(shape), d, "const"))
        cmap[name] = len(tensors) - 1
    tensors.append(TensorDesc("y", list(out_shape), out_dtype or dtype, "output"))
    out = len(tensors) - 1
    layer = Layer(name="l", kind=kind, inputs=list(range(len(ins))), output=out, consts=cmap, attrs=attrs or {},
                  mode=mode)
    rng = np.random.default_rng(0)
    constants = {tid: _values(rng, tensors[tid].shape, tensors[tid].dtype) for tid in cmap.values()}
    if kind == "layer_norm":
        constants[cmap["gamma"]] = np.ones(tensors[cmap["gamma"]].shape, np.float32)
    if kind == "quantize":  # a valid scale and zero point
        constants[cmap["scale"]] = np.full(tensors[cmap["scale"]].shape, 0.5, np.float32)
        constants[cmap["zero"]] = np.zeros(tensors[cmap["zero"]].shape, np.int32)
    return Program("main", SpinnArch(), tensors, list(range(len(ins))), [out], [layer], constants=constants)


def _values(rng, shape, dtype):
    if dtype == "int32" and shape and len(shape) == 1:
        return rng.integers(0, 3, shape).astype(dtype)
    if dtype.startswith("int"):
        return rng.integers(-3, 4, shape).astype(dtype)
    return rng.integers(-3, 4, shape).astype(np.float32)


def _decide(program, ins, axis):
    layer = program.layers[0]
    full = [list(t.shape) for t in program.tensors]
    ctx = ShardContext(program, full, axis, lambda layer, x: True)
    return S.rule_of(layer).propagate(ctx, layer, list(ins))


def _block(x, axis, c):
    n = x.shape[axis]
    size = part(n, N)
    idx = [slice(None)] * x.ndim
    idx[axis] = slice(c * size, min(n, (c + 1) * size))
    return x[tuple(idx)]


def _run_sharded(program, inputs, ins, decision, axis, r_axes):
    """Per chip: the layer on its slices; returns the chips' outputs."""
    layer = program.layers[0]
    placed = list(ins)
    for action in decision.before:
        if isinstance(action, GatherInput):
            placed[action.pos] = REPLICATE
    if decision.gather_all:
        placed = [REPLICATE] * len(placed)
    full = [list(t.shape) for t in program.tensors]
    local = [list(s) for s in full]
    rule = S.rule_of(layer)
    if decision.split in ("col", "row", "split"):
        if axis.strict:
            if decision.output.split and rule.shrinks_row_consts(layer):
                S._seq_consts(program, layer, decision.output.axis, N, full, local)
        else:
            S._shard_consts(program, layer, rule, decision.split, N, full, local, decision.output)
    outs = []
    for c in range(N):
        args = []
        for pos, (x, p) in enumerate(zip(inputs, placed)):
            if p.split:
                x = _block(x, p.axis, c)
            elif p == REPLICATE and decision.output.split:
                # an R operand is sliced for free: along the axis matching the output's split
                # (from the end, or as the case names it)
                a = r_axes.get(pos) if pos in r_axes else x.ndim + decision.output.axis - len(full[layer.output])
                if a is not None and 0 <= a < x.ndim and x.shape[a] == full[layer.output][decision.output.axis]:
                    x = _block(x, a, c)
            elif p.partial:
                x = x if c == 0 else np.zeros_like(x)
            args.append(np.ascontiguousarray(x))
        tensors = [TensorDesc(t.name, list(t.shape), t.dtype, t.role) for t in program.tensors]
        chip_layer = Layer(**vars(layer))
        attrs = None if axis.strict else rule.local_attrs(layer, decision.split, N)  # tensor axis only
        if attrs is not None:
            chip_layer = dataclasses.replace(chip_layer, attrs=attrs)
        constants = {}
        for tid, value in program.constants.items():
            for a, (n_full, n_local) in enumerate(zip(full[tid], local[tid])):
                if n_local != n_full:
                    value = _block(value, a, c)
            constants[tid] = np.ascontiguousarray(value)
            tensors[tid] = dataclasses.replace(tensors[tid], shape=list(value.shape))
        for tid, x in zip(program.inputs, args):
            tensors[tid] = dataclasses.replace(tensors[tid], shape=list(x.shape))
        out_shape = list(full[layer.output])
        if decision.output.split:
            out_shape = list(_block(np.empty(out_shape), decision.output.axis, c).shape)
        tensors[layer.output] = dataclasses.replace(tensors[layer.output], shape=out_shape)
        chip = Program("main", SpinnArch(), tensors, list(program.inputs), list(program.outputs), [chip_layer],
                       constants=constants)
        (y,) = run_program(chip, args, mode="layers")
        outs.append(np.asarray(y))
    return outs


def _combine(outs, placement):
    if placement.split:
        return np.concatenate(outs, axis=placement.axis)
    if placement.partial:
        return sum(o.astype(np.float64) for o in outs[1:]).astype(outs[0].dtype) + outs[0] if len(outs) > 1 else outs[0]
    for o in outs[1:]:
        assert o.tobytes() == outs[0].tobytes()
    return outs[0]


TP = MeshAxis("tp", N, row=True)
TP_ALWAYS = MeshAxis("tp", N, row=ROW_ALWAYS)
SP = MeshAxis("sp", N, strict=True)
DP = MeshAxis("dp", N, strict=True, gather_outputs=False)
R = REPLICATE
POOL = {"pool_size": [2, 2], "strides": [2, 2], "padding": [0, 0, 0, 0]}

# (id, program factory, input placements, axis, expected output, expected split, expected `before`, gather_all)
CASES = [
    ("dense col", lambda: _program("dense", [((4, 6), "float32")], (4, 8), [("weight", (6, 8), "float32"),
                                                                           ("bias", (8,), "float32")],
                                   {"relu": False}), [R], TP, shard(1), "col", (GatherInput(0),), False),
    ("dense row", lambda: _program("dense", [((4, 6), "float32")], (4, 8), [("weight", (6, 8), "float32")],
                                   {"relu": False}), [shard(1)], TP_ALWAYS, PARTIAL, "row", (), False),
    ("dense no row", lambda: _program("dense", [((4, 6), "float32")], (4, 8), [("weight", (6, 8), "float32")],
                                      {"relu": False}), [shard(1)], MeshAxis("tp", N, row=False), shard(1), "col",
     (GatherInput(0),), False),
    ("dense sp rows", lambda: _program("dense", [((4, 6), "float32")], (4, 8), [("weight", (6, 8), "float32")],
                                       {"relu": False}), [R], SP, shard(0), "split", (), False),
    ("matmul heads", lambda: _program("matmul", [((2, 4, 6), "float32"), ((2, 6, 5), "float32")], (2, 4, 5)),
     [shard(0), R], TP, shard(0), "split", (), False),
    ("matmul columns", lambda: _program("matmul", [((2, 4, 6), "float32"), ((2, 6, 5), "float32")], (2, 4, 5)),
     [R, shard(2)], TP, shard(2), "split", (), False),
    ("matmul row-parallel", lambda: _program("matmul", [((4, 6), "float32"), ((6, 5), "float32")], (4, 5)),
     [shard(1), shard(0)], TP_ALWAYS, PARTIAL, "row", (), False),
    ("matmul sp keys", lambda: _program("matmul", [((2, 4, 6), "float32"), ((2, 6, 4), "float32")], (2, 4, 4)),
     [shard(1), shard(2)], SP, shard(1), "split", (GatherInput(1),), False),
    ("conv2d output channels", lambda: _program("conv2d", [((1, 3, 6, 6), "float32")], (1, 4, 4, 4),
                                                [("weight", (4, 3, 3, 3), "float32"), ("bias", (4,), "float32")],
                                                {"strides": [1, 1], "padding": [0, 0, 0, 0], "dilation": [1, 1], "groups": 1}), [R], TP, shard(1), "col", (GatherInput(0),), False),
    ("conv2d groups", lambda: _program("conv2d", [((1, 4, 6, 6), "float32")], (1, 4, 4, 4),
                                       [("weight", (4, 1, 3, 3), "float32")], {"strides": [1, 1], "padding": [0, 0, 0, 0], "dilation": [1, 1], "groups": 4}), [R], TP, shard(1), "split", (),
     False),
    ("conv2d sp replicated", lambda: _program("conv2d", [((1, 4, 6, 6), "float32")], (1, 4, 4, 4),
                                              [("weight", (4, 1, 3, 3), "float32")], {"strides": [1, 1], "padding": [0, 0, 0, 0], "dilation": [1, 1], "groups": 4}), [shard(2)], SP, R, "rep",
     (), True),
    ("quantize follows", lambda: _program("quantize", [((4, 6), "float32")], (4, 6),
                                          [("scale", (1,), "float32"), ("zero", (1,), "int32")], {"axis": 1},
                                          out_dtype="int8"), [shard(0)], TP, shard(0), "split", (), False),
    ("where_less follows", lambda: _program("where_less", [((4, 6), "float32")] * 4, (4, 6)),
     [shard(1), shard(1), R, shard(1)], TP, shard(1), "split", (), False),
    ("layer_norm keeps rows", lambda: _program("layer_norm", [((4, 8), "float32")], (4, 8),
                                              [("gamma", (8,), "float32"), ("beta", (8,), "float32")],
                                              {"epsilon": 1e-5}), [shard(0)], TP, shard(0), "split", (), False),
    ("layer_norm gathers features", lambda: _program("layer_norm", [((4, 8), "float32")], (4, 8),
                                                    [("gamma", (8,), "float32"), ("beta", (8,), "float32")],
                                                    {"epsilon": 1e-5}), [shard(1)], TP, R, "rep",
     (GatherInput(0),), False),
    ("softmax rows", lambda: _program("softmax", [((4, 8), "float32")], (4, 8)), [shard(0)], SP, shard(0),
     "split", (), False),
    ("max_pool channels", lambda: _program("max_pool2d", [((1, 4, 4, 4), "float32")], (1, 4, 2, 2), (),
                                           {"pool_size": [2, 2], "strides": [2, 2], "padding": [0, 0, 0, 0],
                                            "dilation": [1, 1]}), [shard(1)], TP, shard(1), "split", (), False),
    ("max_pool rows gathered", lambda: _program("max_pool2d", [((1, 4, 4, 4), "float32")], (1, 4, 2, 2), (),
                                                {"pool_size": [2, 2], "strides": [2, 2], "padding": [0, 0, 0, 0],
                                                 "dilation": [1, 1]}), [shard(2)], TP, R, "rep",
     (GatherInput(0),), False),
    ("add follows", lambda: _program("add", [((4, 6), "float32"), ((6,), "float32")], (4, 6)),
     [shard(0), R], TP, shard(0), "split", (), False),
    ("add disagreeing splits", lambda: _program("add", [((4, 6), "float32"), ((4, 6), "float32")], (4, 6)),
     [shard(0), shard(1)], TP, R, "rep", (), True),
    ("relu sp", lambda: _program("relu", [((4, 6), "float32")], (4, 6)), [shard(0)], SP, shard(0), "split", (),
     False),
    ("reshape carries", lambda: _program("reshape", [((4, 6), "float32")], (2, 2, 6)), [shard(0)], TP, shard(0),
     "split", (), False),
    ("permute carries", lambda: _program("permute_dims", [((4, 6), "float32")], (6, 4), (), {"axes": [1, 0]}),
     [shard(0)], TP, shard(1), "split", (), False),
    ("reshape of partial sums", lambda: _program("reshape", [((4, 6), "float32")], (24,)), [PARTIAL], TP, PARTIAL,
     "split", (), False),
    ("take rows sp", lambda: _program("take", [((4,), "int32")], (4, 6), [("table", (5, 6), "float32")],
                                      {"axis": 0, "mode": "clip"}), [R], SP, shard(0), "split", (), False),
    ("take index rows sp", lambda: _program("take", [((4, 2), "int32")], (4, 2, 6), [("table", (5, 6), "float32")],
                                            {"axis": 0, "mode": "clip"}), [R], SP, shard(0), "split", (), False),
    ("take follows indices", lambda: _program("take", [((4, 2), "int32")], (4, 2, 6),
                                              [("table", (5, 6), "float32")], {"axis": 0, "mode": "clip"}),
     [shard(0)], TP, shard(0), "split", (), False),
    ("take table columns", lambda: _program("take", [((5, 6), "float32"), ((4,), "int32")], (4, 6), (),
                                            {"axis": 0, "mode": "clip"}), [shard(1), R], TP, shard(1), "split", (),
     False),
    ("take table rows gathered", lambda: _program("take", [((6, 3), "float32"), ((4,), "int32")], (4, 3), (),
                                                  {"axis": 0, "mode": "clip"}), [shard(0), R], TP, R, "rep",
     (GatherInput(0),), False),
    # the data axis (dp): every family keeps the batch split; replicated operands stay replicated
    ("relu dp", lambda: _program("relu", [((4, 6), "float32")], (4, 6)), [shard(0)], DP, shard(0), "split", (),
     False),
    ("add dp bias", lambda: _program("add", [((2, 4, 6), "float32"), ((6,), "float32")], (2, 4, 6)),
     [shard(0), R], DP, shard(0), "split", (), False),
    ("where_less dp", lambda: _program("where_less", [((4, 6), "float32")] * 4, (4, 6)),
     [shard(0), shard(0), shard(0), R], DP, shard(0), "split", (), False),
    ("quantize dp", lambda: _program("quantize", [((4, 6), "float32")], (4, 6),
                                     [("scale", (1,), "float32"), ("zero", (1,), "int32")], {"axis": 1},
                                     out_dtype="int8"), [shard(0)], DP, shard(0), "split", (), False),
    ("dense dp batch", lambda: _program("dense", [((2, 4, 6), "float32")], (2, 4, 8), [("weight", (6, 8), "float32"),
                                                                                      ("bias", (8,), "float32")],
                                        {"relu": False}), [shard(0)], DP, shard(0), "split", (), False),
    ("dense dp replicated", lambda: _program("dense", [((4, 6), "float32")], (4, 8), [("weight", (6, 8), "float32")],
                                             {"relu": False}), [R], DP, R, "rep", (), False),
    ("dense dp reduction gathered", lambda: _program("dense", [((4, 6), "float32")], (4, 8),
                                                     [("weight", (6, 8), "float32")], {"relu": False}), [shard(1)],
     DP, R, "rep", (), True),
    ("matmul dp batch", lambda: _program("matmul", [((2, 4, 6), "float32"), ((2, 6, 5), "float32")], (2, 4, 5)),
     [shard(0), shard(0)], DP, shard(0), "split", (), False),
    ("matmul dp batch of A", lambda: _program("matmul", [((2, 4, 6), "float32"), ((2, 6, 5), "float32")], (2, 4, 5)),
     [shard(0), R], DP, shard(0), "split", (), False),
    ("matmul dp rows", lambda: _program("matmul", [((4, 6), "float32"), ((6, 5), "float32")], (4, 5)),
     [shard(0), R], DP, shard(0), "split", (), False),
    ("matmul dp reduction gathered", lambda: _program("matmul", [((4, 6), "float32"), ((6, 5), "float32")], (4, 5)),
     [shard(1), shard(0)], DP, R, "rep", (), True),
    ("conv2d dp batch", lambda: _program("conv2d", [((2, 3, 6, 6), "float32")], (2, 4, 4, 4),
                                         [("weight", (4, 3, 3, 3), "float32"), ("bias", (4,), "float32")],
                                         {"strides": [1, 1], "padding": [0, 0, 0, 0], "dilation": [1, 1], "groups": 1}),
     [shard(0)], DP, shard(0), "split", (), False),
    ("conv2d dp channels gathered", lambda: _program("conv2d", [((2, 4, 6, 6), "float32")], (2, 4, 4, 4),
                                                     [("weight", (4, 4, 3, 3), "float32")],
                                                     {"strides": [1, 1], "padding": [0, 0, 0, 0], "dilation": [1, 1],
                                                      "groups": 1}), [shard(1)], DP, R, "rep", (), True),
    ("max_pool dp batch", lambda: _program("max_pool2d", [((2, 4, 4, 4), "float32")], (2, 4, 2, 2), (),
                                           {"pool_size": [2, 2], "strides": [2, 2], "padding": [0, 0, 0, 0],
                                            "dilation": [1, 1]}), [shard(0)], DP, shard(0), "split", (), False),
    ("layer_norm dp batch", lambda: _program("layer_norm", [((2, 4, 8), "float32")], (2, 4, 8),
                                            [("gamma", (8,), "float32"), ("beta", (8,), "float32")],
                                            {"epsilon": 1e-5}), [shard(0)], DP, shard(0), "split", (), False),
    ("softmax dp features gathered", lambda: _program("softmax", [((4, 8), "float32")], (4, 8)), [shard(1)], DP, R,
     "rep", (), True),
    ("reshape dp carries", lambda: _program("reshape", [((4, 6), "float32")], (4, 2, 3)), [shard(0)], DP, shard(0),
     "split", (), False),
    ("permute dp carries", lambda: _program("permute_dims", [((4, 6), "float32")], (6, 4), (), {"axes": [1, 0]}),
     [shard(0)], DP, shard(1), "split", (), False),
    ("concat dp features", lambda: _program("concat", [((4, 3), "float32"), ((4, 2), "float32")], (4, 5), (),
                                            {"axis": 1}), [shard(0), shard(0)], DP, shard(0), "split", (), False),
    ("concat dp of the batch gathered", lambda: _program("concat", [((2, 3), "float32"), ((2, 3), "float32")],
                                                         (4, 3), (), {"axis": 0}), [shard(0), shard(0)], DP, R,
     "rep", (), True),
    ("take dp indices", lambda: _program("take", [((4, 2), "int32")], (4, 2, 6), [("table", (5, 6), "float32")],
                                         {"axis": 0, "mode": "clip"}), [shard(0)], DP, shard(0), "split", (), False),
    # the sequence axis (sp): families not covered above
    ("quantize sp", lambda: _program("quantize", [((4, 6), "float32")], (4, 6),
                                     [("scale", (1,), "float32"), ("zero", (1,), "int32")], {"axis": 1},
                                     out_dtype="int8"), [shard(0)], SP, shard(0), "split", (), False),
    ("where_less sp", lambda: _program("where_less", [((4, 6), "float32")] * 4, (4, 6)),
     [shard(0), R, shard(0), shard(0)], SP, shard(0), "split", (), False),
    ("layer_norm sp rows", lambda: _program("layer_norm", [((4, 8), "float32")], (4, 8),
                                           [("gamma", (8,), "float32"), ("beta", (8,), "float32")],
                                           {"epsilon": 1e-5}), [shard(0)], SP, shard(0), "split", (), False),
    ("max_pool sp replicated", lambda: _program("max_pool2d", [((1, 4, 4, 4), "float32")], (1, 4, 2, 2), (),
                                                {"pool_size": [2, 2], "strides": [2, 2], "padding": [0, 0, 0, 0],
                                                 "dilation": [1, 1]}), [shard(2)], SP, R, "rep", (), True),
    ("reshape sp carries", lambda: _program("reshape", [((4, 6), "float32")], (4, 2, 3)), [shard(0)], SP, shard(0),
     "split", (), False),
    ("concat sp replicated", lambda: _program("concat", [((4, 3), "float32"), ((4, 2), "float32")], (4, 5), (),
                                              {"axis": 1}), [shard(0), shard(0)], SP, R, "rep", (), True),
    ("pool_grad channels", lambda: _program("max_pool2d_backward", [((1, 4, 2, 2), "float32"), ((1, 4, 4, 4), "float32")],
                                            (1, 4, 4, 4), (), POOL), [shard(1), shard(1)], TP, shard(1), "split", (),
     False),
    ("pool_grad channels of dy", lambda: _program("max_pool2d_backward", [((1, 4, 2, 2), "float32"),
                                                                         ((1, 4, 4, 4), "float32")], (1, 4, 4, 4), (),
                                                  POOL), [shard(1), R], TP, shard(1), "split", (), False),
    ("pool_grad batch", lambda: _program("max_pool2d_backward", [((2, 2, 2, 2), "float32"), ((2, 2, 4, 4), "float32")],
                                         (2, 2, 4, 4), (), POOL), [shard(0), shard(0)], DP, shard(0), "split", (),
     False),
    ("pool_grad rows gathered", lambda: _program("max_pool2d_backward", [((1, 2, 2, 4), "float32"),
                                                                        ((1, 2, 4, 8), "float32")], (1, 2, 4, 8), (),
                                                 POOL), [shard(2), shard(2)], TP, R, "rep", (), True),
    ("pool_grad disagreeing splits", lambda: _program("max_pool2d_backward", [((2, 2, 2, 2), "float32"),
                                                                             ((2, 2, 4, 4), "float32")], (2, 2, 4, 4),
                                                      (), POOL), [shard(0), shard(1)], TP, R, "rep", (), True),
    ("pool_grad sp replicated", lambda: _program("max_pool2d_backward", [((1, 2, 4, 2), "float32"),
                                                                        ((1, 2, 8, 4), "float32")], (1, 2, 8, 4), (),
                                                 POOL), [R, R], SP, R, "rep", (), True),
    ("cross_entropy rows", lambda: _program("cross_entropy", [((4, 6), "float32"), ((4,), "int32")], (4,), (),
                                            {"ignore_index": -100}), [shard(0), shard(0)], DP, shard(0), "split", (),
     False),
    ("cross_entropy rows, labels sliced", lambda: _program("cross_entropy", [((4, 6), "float32"), ((4,), "int32")],
                                                           (4,), (), {"ignore_index": -100}), [shard(0), R], SP,
     shard(0), "split", (), False),
    ("cross_entropy classes gathered", lambda: _program("cross_entropy", [((4, 6), "float32"), ((4,), "int32")], (4,),
                                                        (), {"ignore_index": -100}), [shard(1), R], TP, R, "rep", (),
     True),
    ("cross_entropy_backward rows", lambda: _program("cross_entropy_backward", [((4, 6), "float32"), ((4,), "int32")],
                                                     (4, 6), (), {"divisor": 4.0}), [shard(0), shard(0)], DP,
     shard(0), "split", (), False),
    ("cross_entropy_backward rows, labels sliced", lambda: _program(
        "cross_entropy_backward", [((4, 6), "float32"), ((4,), "int32")], (4, 6), (), {"divisor": 4.0}), [shard(0), R],
     TP, shard(0), "split", (), False),
]

#: the axis of a replicated operand a chip slices for its output block, where it is not the
#: output's split axis counted from the end (a gather's indices lead its output)
R_AXES = {"take rows sp": {0: 0}, "take index rows sp": {0: 0}, "cross_entropy_backward rows, labels sliced": {1: 0}}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rule_table_and_shards_match_the_unsplit_layer(case):
    _, make, ins, axis, want_out, want_split, want_before, want_all = case
    program = make()
    d = _decide(program, ins, axis)
    assert (d.output, d.split, tuple(d.before), d.gather_all) == (want_out, want_split, want_before, want_all), d
    rng = np.random.default_rng(1)
    inputs = []
    for tid in program.inputs:
        t = program.tensors[tid]
        if t.dtype == "int32":  # a gather's indices
            inputs.append(rng.integers(0, 5, t.shape).astype(np.int32))
        else:
            inputs.append(_values(rng, t.shape, t.dtype))
    (whole,) = run_program(program, inputs, mode="layers")
    whole = np.asarray(whole)
    got = _combine(_run_sharded(program, inputs, ins, d, axis, R_AXES.get(case[0], {})), d.output)
    assert got.shape == whole.shape
    assert got.tobytes() == whole.tobytes()


def test_softmax_split_along_its_rows_all_reduces_the_row_statistics():
    program = _program("softmax", [((4, 8), "float32")], (4, 8))
    d = _decide(program, [shard(1)], TP)
    # the row maxima (exact in any order), then the chained sums of exp(x - max)
    assert d.output == shard(1) and d.before == (RowAllReduce(0, 4 * 4, True), RowAllReduce(0, 4 * 4, False))


def test_a_family_without_a_rule_is_replicated_and_named(monkeypatch):
    from tvm_spinn.program.ops.pool import PoolGrad

    monkeypatch.setattr(PoolGrad, "sharding", None)  # a family that states no rule
    program = _program("max_pool2d_backward", [((1, 2, 2, 2), "float32"), ((1, 2, 4, 4), "float32")],
                       (1, 2, 4, 4), (), POOL)
    assert family_of("max_pool2d_backward").sharding is None
    d = _decide(program, [shard(1), shard(1)], TP)
    assert (d.output, d.gather_all) == (R, True)
    plan = S.plan_shards(program, 2)
    assert plan.splits == ("rep",)
    assert plan.replicated == (("l", "operator family PoolGrad states no sharding rule"),)
    assert plan.summary()["replicated"] == [["l", "operator family PoolGrad states no sharding rule"]]
    assert S.plan_shards(program, 1).replicated == ()


def test_every_family_states_a_rule():
    from tvm_spinn.program.ops import layer_kinds

    assert [k for k in layer_kinds() if family_of(k).sharding is None] == []


# -- the mesh and the one pass over it ---------------------------------------------------------
def test_the_mesh_is_data():
    mesh = Mesh.of(tp=2, sp=3)
    assert mesh.chips == 6 and [a.name for a in mesh.active] == ["tp", "sp"]
    assert (mesh.size("dp"), mesh.size("ep"), mesh.size("pp")) == (1, 1, 1)
    assert Mesh.of(dp=4, ep=2, pp=3).chips == 24
    with pytest.raises(ValueError, match="name must be one of"):
        MeshAxis("xp", 2)
    with pytest.raises(ValueError, match="size must be a positive int"):
        MeshAxis("tp", 0)
    with pytest.raises(ValueError, match="each axis at most once"):
        Mesh((MeshAxis("tp", 2), MeshAxis("tp", 2)))
    with pytest.raises(ValueError, match="in the order"):
        Mesh((MeshAxis("dp", 2), MeshAxis("tp", 2)))


def test_pipeline_axis_needs_a_layer_per_stage():
    # (the expert axis: tests/program/test_expert_rule.py; the pipeline axis's stages and
    # hand-overs: tests/mapping/test_pipeline_axis.py)
    program = _program("relu", [((4, 6), "float32")], (4, 6))
    assert S.plan_mesh(program, Mesh.of(pp=2)) is None
    plan = S.plan_mesh(program, Mesh.of(tp=2, pp=1))
    assert plan.pp == 1 and plan.stages == () and plan.handovers == ()


def _chain(batch=4):
    """dense [b, 6] -> [b, 8], then softmax, then a concat along the batch with the input's
    relu (a layer that cannot keep the batch split)."""
    tensors = [TensorDesc("x", [batch, 6], "float32", "input"), TensorDesc("w", [6, 8], "float32", "const"),
               TensorDesc("h", [batch, 8], "float32", "temp"), TensorDesc("p", [batch, 8], "float32", "temp"),
               TensorDesc("q", [2 * batch, 8], "float32", "output")]
    layers = [Layer(name="fc", kind="dense", inputs=[0], output=2, consts={"weight": 1}, attrs={"relu": False}),
              Layer(name="sm", kind="softmax", inputs=[2], output=3),
              Layer(name="cat", kind="concat", inputs=[2, 3], output=4, attrs={"axis": 0})]
    return Program("main", SpinnArch(), tensors, [0], [4], layers)


def test_one_pass_places_every_tensor_on_every_axis():
    program = _chain()
    plan = S.plan_mesh(program, Mesh.of(tp=2, dp=2, row=True))
    tp_, dp_ = [a.name for a in plan.mesh.axes].index("tp"), [a.name for a in plan.mesh.axes].index("dp")
    # x: the batch split on dp; h: columns on tp (column-parallel dense), rows on dp
    assert (plan.placements[0][tp_], plan.placements[0][dp_]) == (R, shard(0))
    assert (plan.placements[2][tp_], plan.placements[2][dp_]) == (shard(1), shard(0))
    assert plan.shapes[0] == (2, 6) and plan.shapes[1] == (6, 4) and plan.shapes[2] == (2, 4)
    # the softmax keeps the column split (its row statistics all-reduced over tp); the concat of
    # the batch cannot keep the batch split: h and p are gathered over dp, each chip its columns
    assert [(c.layer, c.op, c.tensor, c.group) for c in plan.collectives] == [
        (1, "all_reduce", 2, "tp"), (1, "all_reduce", 2, "tp"), (2, "all_gather", 2, "dp"),
        (2, "all_gather", 3, "dp"), (3, "all_gather", 4, "tp")]
    assert [c.shape for c in plan.collectives[2:]] == [(4, 4), (4, 4), (8, 8)]
    assert [c.nbytes for c in plan.collectives[2:]] == [4 * 4 * 4, 4 * 4 * 4, 8 * 8 * 4]
    assert plan.shapes[4] == (8, 4)  # the output: whole batch, the chip's columns until the end
    shard_ = S.shard_program(program, plan)
    assert [t.shape for t in shard_.tensors[5:]] == [[4, 4], [4, 4]]  # the gathered copies
    assert [shard_.layers[2].inputs] == [[5, 6]]


def test_the_data_axis_keeps_the_batch_and_leaves_outputs_split():
    program = _chain()
    program = dataclasses.replace(program, layers=program.layers[:2], outputs=[3])
    plan = S.plan_shards(program, 1, 2)
    assert plan.collectives == () and plan.shapes[3] == (2, 8) and plan.shapes[1] == (6, 8)
    assert S.plan_shards(_chain(3), 1, 2) is None  # 2 does not divide a batch of 3


@pytest.mark.parametrize("kind,attrs,sums,contracts", [
    ("add", {}, True, False),
    ("add", {"relu": True}, False, False),   # add + relu is not a plain sum
    ("multiply", {}, False, False),
    ("matmul", {}, False, True),
    ("dense", {}, False, False),
    ("relu", {}, False, False),
])
def test_structural_hooks_the_llm_planner_cuts_slices_at(kind, attrs, sums, contracts):
    """The hooks the LLM planner reads instead of kind strings: a plain ``add`` sums its
    inputs (a residual add), a ``matmul`` multiplies two activations (the attention)."""
    from types import SimpleNamespace

    from tvm_spinn.program.ops import family_of

    layer = SimpleNamespace(kind=kind, attrs=attrs, consts={}, mode="fp32")
    family = family_of(kind)
    assert family.sums_inputs(layer) is sums
    assert family.activation_gemm(layer) is contracts
