"""The C++ kernels of a training step's PE layers beyond inference: constant ``pad`` (a ``fill``
then a ``copy``), ``where_less`` and ``max_pool2d_backward`` (``pool_grad``), run in the
simulator's native plans (``src/sim_plan.cc``).

Each op runs on its own in a one-layer program, natively and as the Python step
(``TVM_SPINN_SIM_NATIVE=0``, the reference the training tests were checked against); the two
must have the same bits, and the same bits as numpy (and PyTorch where its rules are TVM's).
Malformed instructions are refused when the plan is created, with one ValueError."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from tvm_spinn import _lib
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.program.ops import native
from tvm_spinn.program.ops.movement import padded
from tvm_spinn.program.ops.pool import max_pool2d_backward
from tvm_spinn.runtime import simulator
from tvm_spinn.target.arch import make_system

_F32 = np.float32
_SNAN = np.array([0x7F800001], np.uint32).view(_F32)[0]  # a signalling NaN (bits must survive a copy)
_QNAN = np.array([0xFFC12345], np.uint32).view(_F32)[0]  # a negative quiet NaN with a payload


def _program(kind: str, in_shapes, out_shape, attrs: dict) -> Program:
    """A program of one float32 layer ``kind`` over inputs of ``in_shapes``."""
    n = len(in_shapes)
    tensors = [TensorDesc(f"in{i}", list(s), "float32", "input") for i, s in enumerate(in_shapes)]
    tensors.append(TensorDesc("out", list(out_shape), "float32", "output"))
    layer = Layer("layer0", kind, list(range(n)), n, attrs=dict(attrs))
    return Program(symbol="kernel", arch=make_system(), tensors=tensors, inputs=list(range(n)),
                   outputs=[n], layers=[layer])


def _native_and_python(program: Program, inputs, monkeypatch) -> tuple[np.ndarray, np.ndarray]:
    """The layer's output from a native plan (checked to run it natively) and from the Python
    step (the plan with native runs off)."""
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("TVM_SPINN_SIM_NATIVE", flag)
        simulator.forget_plans()
        plan = simulator.program_plan(program)
        assert plan.native_layers == (1 if flag == "1" else 0)
        outs.append(plan.run(program, [np.ascontiguousarray(x) for x in inputs])[0])
    return outs[0], outs[1]


def _same_bits(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    want = np.asarray(want, dtype=_F32)
    assert got.dtype == _F32 and got.shape == want.shape, (what, got.shape, want.shape)
    bad = np.flatnonzero(got.reshape(-1).view(np.uint32) != want.reshape(-1).view(np.uint32))
    assert bad.size == 0, (what, bad[:5], got.reshape(-1)[bad[:5]], want.reshape(-1)[bad[:5]])


def _specials(rng, shape, fraction: float = 0.2) -> np.ndarray:
    x = rng.standard_normal(shape).astype(_F32)
    flat = x.reshape(-1)
    pick = rng.random(flat.size) < fraction
    flat[pick] = rng.choice(np.array([np.nan, _SNAN, _QNAN, np.inf, -np.inf, -0.0, 0.0], _F32), pick.sum())
    return x


# -- pad -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,width", [
    ((2, 3, 4, 5), [0, 0, 0, 0, 1, 2, 3, 0]),
    ((2, 3, 4, 5), [0] * 8),  # no padding: a plain copy
    ((7,), [3, 0]),
    ((1,), [0, 4]),
    ((3, 1, 2), [1, 1, 2, 0, 0, 3]),
    ((1, 2, 1, 2, 3), [1, 0, 0, 1, 2, 2, 0, 0, 1, 1]),
    ((2, 2), [5, 5, 5, 5]),  # more padding than input
])
@pytest.mark.parametrize("value", [0.0, -0.0, 1.5, 0.1, 1e-40, -3e38])
def test_pad_kernel_bits(shape, width, value, monkeypatch):
    rng = np.random.default_rng(len(shape) + sum(width))
    x = _specials(rng, shape)
    out_shape = [d + width[2 * k] + width[2 * k + 1] for k, d in enumerate(shape)]
    program = _program("pad", [shape], out_shape, {"pad_width": width, "value": value})
    got, ref = _native_and_python(program, [x], monkeypatch)
    _same_bits(got, ref, "python step")
    _same_bits(got, padded(x, width, value), "movement.padded")
    pairs = [(width[2 * k], width[2 * k + 1]) for k in range(len(shape))]
    _same_bits(got, np.pad(x, pairs, constant_values=_F32(value)), "numpy")
    flat = [w for k in reversed(range(len(shape))) for w in (width[2 * k], width[2 * k + 1])]
    want = torch.nn.functional.pad(torch.from_numpy(x), flat, value=float(_F32(value))).numpy()
    _same_bits(got, want, "torch")


# -- where_less ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shapes", [
    [(2, 3, 4)] * 4,
    [(2, 3, 4), (1,), (3, 1), (2, 1, 4)],  # broadcasts of every operand
    [(1, 5), (4, 1), (), (4, 5)],
    [(), (), (), ()],  # rank 0
    [(3,), (2, 1, 1, 3), (1, 1, 1), (2, 2, 1, 1)],
    [(1, 1, 1, 1, 1, 1, 2), (2, 1, 1, 1, 1, 1, 1), (1, 2, 1, 1, 1, 1, 2), (1,)],
])
def test_where_less_kernel_bits(shapes, monkeypatch):
    rng = np.random.default_rng(len(shapes[0]) * 7 + len(shapes[1]))
    a, b, c, d = (_specials(rng, s, 0.3) for s in shapes)
    if a.size > 1:
        a.reshape(-1)[0] = b.reshape(-1)[0] = 1.0  # a tie: not less, selects d
    out_shape = np.broadcast_shapes(*shapes)
    program = _program("where_less", shapes, out_shape, {})
    got, ref = _native_and_python(program, [a, b, c, d], monkeypatch)
    _same_bits(got, ref, "python step")
    _same_bits(got, np.where(a < b, c, d), "numpy")
    want = torch.where(torch.lt(*(torch.from_numpy(v) for v in (a, b))), torch.from_numpy(c), torch.from_numpy(d))
    _same_bits(got, want.numpy(), "torch")


# -- max_pool2d_backward -------------------------------------------------------------------------

#: (n, c, h, w, pool, strides, padding t, l, b, r)
_POOL_GEOMETRIES = [
    (2, 3, 8, 8, (2, 2), (2, 2), (0, 0, 0, 0)),  # non-overlapping windows
    (2, 3, 10, 10, (3, 3), (2, 2), (1, 1, 1, 1)),  # ResNet's stem: overlapping, padded
    (1, 2, 7, 7, (3, 3), (1, 1), (1, 1, 1, 1)),  # up to 9 windows per element
    (1, 2, 9, 9, (3, 3), (2, 2), (0, 0, 0, 0)),
    (1, 1, 9, 8, (3, 2), (2, 3), (1, 0, 0, 1)),  # non-square, asymmetric padding, stride > pool
    (2, 1, 5, 6, (1, 1), (1, 1), (0, 0, 0, 0)),  # 1x1: the identity's gradient
    (1, 1, 6, 6, (2, 2), (3, 3), (0, 0, 0, 0)),  # gaps between windows
    (1, 1, 4, 5, (4, 5), (1, 1), (2, 2, 2, 2)),  # windows wholly in the padding at the corners
]


def _pool_grad_program(n, c, h, w, pool, strides, padding):
    oh = (h + padding[0] + padding[2] - pool[0]) // strides[0] + 1
    ow = (w + padding[1] + padding[3] - pool[1]) // strides[1] + 1
    program = _program("max_pool2d_backward", [(n, c, oh, ow), (n, c, h, w)], (n, c, h, w),
                       {"pool_size": list(pool), "strides": list(strides), "padding": list(padding)})
    return program, (n, c, oh, ow)


@pytest.mark.parametrize("geometry", _POOL_GEOMETRIES)
@pytest.mark.parametrize("data", ["normal", "relu_ties", "all_equal", "specials"])
def test_max_pool_backward_kernel_bits(geometry, data, monkeypatch):
    """The native kernel has the Python step's bits (TVM's pool_grad: ties keep the first
    maximum of the window, a NaN is taken, a window of -inf or of padding takes nothing)."""
    *shape, pool, strides, padding = geometry
    program, g_shape = _pool_grad_program(*shape, pool, strides, padding)
    rng = np.random.default_rng(sum(shape) + pool[0])
    x = rng.standard_normal(shape).astype(_F32)
    if data == "relu_ties":
        x = np.maximum(x, 0)
    elif data == "all_equal":
        x[...] = 0.5
    elif data == "specials":
        x = _specials(rng, shape, 0.15)
        x[0, 0, 0, :3] = [np.nan, np.inf, -np.inf][:shape[3]]
        x[0, 0, -1, -1] = np.nan  # a NaN before the right and bottom padding: a tap in the padding
        if shape[0] * shape[1] > 1:
            x[-1, -1] = -np.inf  # a plane of -inf: windows with nothing taken
    # one NaN payload in dy: numpy's float32 add of two NaNs keeps either one, by position
    dy = rng.standard_normal(g_shape).astype(_F32)
    dy.reshape(-1)[::5] = rng.choice(np.array([np.inf, -np.inf, -0.0, _QNAN], _F32), dy.reshape(-1)[::5].size)
    got, ref = _native_and_python(program, [dy, x], monkeypatch)
    _same_bits(got, ref, "python step")
    _same_bits(got, max_pool2d_backward(dy, x, pool, strides, padding), "pool.max_pool2d_backward")


#: the geometries PyTorch pools: symmetric padding of at most half the window
_TORCH_GEOMETRIES = [g for g in _POOL_GEOMETRIES
                     if g[6][:2] == g[6][2:] and 2 * g[6][0] <= g[4][0] and 2 * g[6][1] <= g[4][1]]


@pytest.mark.parametrize("geometry", _TORCH_GEOMETRIES)
@pytest.mark.parametrize("ties", [False, True])
def test_max_pool_backward_kernel_matches_pytorch(geometry, ties, monkeypatch):
    """PyTorch's max_pool2d gradient on finite inputs (its tie rule: the first maximum in the
    window gets the gradient, as TVM's). Exact where no element is the maximum of more than two
    windows (a sum of two terms does not depend on the order); else within one rounding per
    addition (PyTorch adds the windows in ascending order, TVM from the nearest backwards)."""
    *shape, pool, strides, padding = geometry
    program, g_shape = _pool_grad_program(*shape, pool, strides, padding)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(_F32)
    if ties:
        x = np.round(np.maximum(x, 0) * 2) / 2  # many equal maxima: 0, 0.5, 1, ...
    dy = rng.standard_normal(g_shape).astype(_F32)
    got, _ = _native_and_python(program, [dy, x], monkeypatch)
    xt = torch.from_numpy(x).requires_grad_(True)
    y = torch.nn.functional.max_pool2d(xt, pool, strides, (padding[0], padding[1]))
    y.backward(torch.from_numpy(dy))
    want = xt.grad.numpy()
    _, idx = torch.nn.functional.max_pool2d(torch.from_numpy(x), pool, strides, (padding[0], padding[1]),
                                            return_indices=True)
    n, c, h, w = shape
    planes = idx.numpy().reshape(n * c, -1)
    hits = np.stack([np.bincount(p, minlength=h * w) for p in planes]).reshape(shape)  # windows per element
    # the argmax is PyTorch's: exactly the elements some window takes receive a gradient
    assert np.array_equal(got != 0, hits > 0)
    if hits.max() <= 2:
        _same_bits(got, want, "torch")
    else:  # each of the hits - 1 additions rounds once: |error| <= (hits - 1) eps sum |terms|
        xa = torch.from_numpy(x).requires_grad_(True)
        torch.nn.functional.max_pool2d(xa, pool, strides, (padding[0], padding[1])).backward(
            torch.from_numpy(np.abs(dy)))
        bound = 2 * np.maximum(hits - 1, 0) * np.finfo(_F32).eps * xa.grad.numpy()
        assert np.all(np.abs(got.astype(np.float64) - want) <= bound)


# -- bad instructions ------------------------------------------------------------------------------

def _plan(code, arg_bytes):
    return _lib._func("tvm_spinn.sim.plan_create")(code, [], arg_bytes, [])


def _op(name):
    return native.codes()[name]


def test_fill_kernel_every_element_size():
    """A fill of 1, 2, 4 and 8-byte elements writes the value's low bytes, n elements only."""
    for size, dtype in ((1, np.uint8), (2, np.uint16), (4, np.uint32), (8, np.uint64)):
        bits = 0x0123456789ABCDEF & ((1 << (8 * size)) - 1)
        run = _plan([_op("fill"), 0, size, 5, bits], [6 * size])
        out = np.full(6, 7, dtype=dtype)
        run(_lib._input(out))
        assert out.tolist() == [bits] * 5 + [7]


@pytest.mark.parametrize("code,args,message", [
    (lambda: [_op("fill"), 0, 4, 5, 0], [16], "slot 0 holds 16 bytes, an instruction needs 20"),
    (lambda: [_op("fill"), 0, 3, 1, 0], [16], "element size 3"),
    (lambda: [_op("fill"), 0, 4, -1, 0], [16], "negative extent -1"),
    (lambda: [_op("pool_grad"), 0, 1, 2, 1, 4, 4, 2, 2, 2, 2, 2, 2, 0, 0], [16, 64, 60],
     "slot 2 holds 60 bytes, an instruction needs 64"),
    (lambda: [_op("pool_grad"), 0, 1, 2, 1, 4, 4, 2, 2, 2, 2, 2, 2, 0, 0], [12, 64, 64],
     "slot 0 holds 12 bytes, an instruction needs 16"),
    (lambda: [_op("pool_grad"), 0, 1, 2, 1, 4, 4, 2, 2, 0, 2, 2, 2, 0, 0], [16, 64, 64],
     "bad max_pool2d_backward geometry"),
    (lambda: [_op("pool_grad"), 0, 1, 2, 1, 4, 4, 2, 2, 2, 2, 2, 2, -1, 0], [16, 64, 64], "negative extent -1"),
    (lambda: [_op("pool_grad"), 0, 1, 2, 1, 4, 4, 2, 2, 2, 2, 2, 2, 0], [16, 64, 64], "truncated instruction"),
    # a broadcast view reading past its operand: c's stride 2 over 4 elements needs 28 bytes
    (lambda: [_op("where_less"), 0, 1, 2, 3, 4, 1, 4, 1, 1, 2, 1, 1], [16, 16, 16, 16, 16],
     "slot 2 holds 16 bytes, an instruction needs 28"),
    (lambda: [_op("where_less"), 0, 1, 2, 3, 4, 1, 4, 1, 1, 1, 1, 1], [16, 16, 16, 16, 12],
     "slot 4 holds 12 bytes, an instruction needs 16"),
    (lambda: [_op("where_less"), 0, 1, 2, 3, 4, 1, 4, 1, -1, 1, 1], [16] * 5, "negative extent -1"),
    (lambda: [_op("where_less"), 0, 1, 2, 3, 4, 9], [16] * 5, "rank 9"),
    (lambda: [_op("where_less"), 0, 1, 2, 3, 4, 1, 4, 1, 1, 1], [16] * 5, "truncated instruction"),
    (lambda: [_op("where_less"), 0, 1, 2, 3, 7, 0], [16] * 5, "slot 7 does not exist"),
])
def test_bad_instructions_are_refused(code, args, message):
    with pytest.raises(ValueError, match=message):
        _plan(code(), args)


# -- in a built module -------------------------------------------------------------------------------

def test_training_layers_run_natively_in_a_built_module(monkeypatch):
    """pad, where_less and max_pool2d_backward from a Relax module built for spinn run in one
    native run (no layer left to a Python step), with the llvm build's bits."""
    import tvm_spinn

    x_shape, g_shape = (2, 3, 8, 8), (2, 3, 4, 4)
    bb = relax.BlockBuilder()
    dy = relax.Var("dy", relax.TensorType(g_shape, "float32"))
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    with bb.function("main", [dy, x]):
        with bb.dataflow():
            g = bb.emit(relax.op.grad.max_pool2d_backward(dy, x, (3, 3), (2, 2), (1, 1, 1, 1)))
            r = bb.emit(relax.op.where(relax.op.less(x, relax.const(0.25)), relax.const(0.0), g))
            out = bb.emit_output(relax.op.nn.pad(r, [0, 0, 0, 0, 1, 0, 2, 1], pad_value=-0.0))
        bb.emit_func_output(out)
    mod = bb.get()
    rng = np.random.default_rng(11)
    args = [_specials(rng, g_shape, 0.1), np.maximum(rng.standard_normal(x_shape).astype(_F32), 0)]
    outs = {}
    for target in ("llvm", "spinn"):
        ex = relax.build(mod, target=target)
        outs[target] = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()
        if target == "spinn":
            programs = [Program.from_bytes(bytes(m["get_program"]())) for m in tvm_spinn.report_modules(ex)
                        if m["get_symbol"]() != "__spinn_manifest__"]
    kinds = sorted(layer.kind for p in programs for layer in p.layers)
    assert {"pad", "where_less", "max_pool2d_backward"} <= set(kinds), kinds
    monkeypatch.setenv("TVM_SPINN_SIM_NATIVE", "1")
    for p in programs:
        plan = simulator.program_plan(p)
        assert plan.native_layers == len(p.layers) and all(tid is None for tid, _, _ in plan.steps), p.layers
    _same_bits(outs["spinn"], outs["llvm"], "llvm build")
