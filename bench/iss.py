"""M4F cycles: the timing model's per-tile costs against the cycles of the generated code as
executed in the instruction-set simulator (``tvm_spinn.pe``).

For each op kind, a small program is compiled for ``spinn``, its tiles run as Cortex-M4F code in
``unicorn``, and the executed instructions are priced by the Cortex-M4 TRM's cycle tables
(:mod:`tvm_spinn.pe.cycles`). Printed per op kind: the timing model's cycles (the sum of its
tile costs, which use ``m4f_flops_per_cycle``, ``m4f_elementwise_cycles`` or the MAC array's
rate), the executed cycles (the cycles the M4F waits on the exp/log unit included: its modelled
latency and rate), their ratio and the error of the model, and the executed cycles per element
(element-wise) or per multiply-accumulate (GEMMs).

Calibration and hold-out: the timing model's M4F costs are structural (each family's passes over
the data and instructions per element, priced by the TRM's cycles: :mod:`tvm_spinn.program.ops.m4f`,
:func:`tvm_spinn.program.ops.gemm.geometry.fp32_tile_cycles`); only the overheads of the code
LLVM emits are calibrated: ``m4f_loop_cycles`` and ``m4f_job_cycles`` on the element-wise
``add`` at two shapes (those two rows are marked ``calib``; every other row is ``held-out``).
The fp32 GEMM kernel's cost is its executed instructions counted per unit (a trip of a
register block's unrolled reduction loop, a block, an edge column, an output alone, a job:
the ``F32_*`` mixes of :mod:`tvm_spinn.program.ops.gemm.geometry`); a second table runs the
kernel directly on 18 tile shapes, every one held out (the small cases' GEMM tiles are one or
two columns wide, a model's get full 4 x 4 register blocks). The bench solves the
calibration rows for the constants (the model is linear in them on fixed tiles) and prints them
beside the values :class:`~tvm_spinn.target.arch.SpinnArch` holds, and per row the model's error
at the SpinnArch values and at the solved ones; the held-out target is +-10%. For int8 GEMMs the
executed cycles are the kernel's software pipeline with the MAC array a peripheral that runs
concurrently for its modelled cycles (the waits on it included): the M4F drives the array
block by block, forms the activation's row or column sums where a zero point needs them, adds
the chunks' sums and requantizes one block while the array computes the next. Their modelled
cycles are the same pipeline priced by the int8 kernel's cost model
(:func:`tvm_spinn.program.ops.gemm.geometry.int8_pipelined_cycles`, whose instruction mixes were
read from the kernel's executed blocks at tile shapes run directly; every program row is held
out); a second line gives the M4F's share alone (model and executed) and what the timing model
charges the layer. A third table runs the int8 kernel directly on larger tiles (several column
blocks, several reduction chunks) and prints the array's cycles, the M4F's, their sum (no
overlap), their maximum (full overlap) and the executed pipeline.
The ``f32`` rows (an int8 GEMM with a float32 output: the dequantizing epilogue), the
``tflite`` rows (TFLite's requantization, ``rounding="tflite"``) and the others (the
one-rounding requantization) run the kernel's epilogues, priced by their own counted mixes
(``I8_DEQUANT_CODE`` per ReLU and bias variant, ``I8_TFLITE_CODE`` and ``I8_REQUANT_CODE`` per
clamp form and weight zero point: counted at tile shapes run directly, the calibration rows of
a fourth table, which also runs each variant on held-out shapes; every program row is held out).
The ``cross_entropy`` rows (the per-row loss; its cost model, :func:`tvm_spinn.program.ops.loss.cross_entropy_tile_cycles`,
is the softmax kernel's counted phases plus the label and log phase counted at one-job runs of
1 and 9 rows of 5 columns: every row is held out) reach rows of one resident row per PE (3,500
classes) and rows streamed through the PE in chunks (5,000 and GPT-2's 50,257).
The training kernels' rows (``pool_grad``: ``max_pool2d_backward``; ``xent_grad``:
``cross_entropy_backward``, a row of 5,000 classes streamed through its PE in chunks) are held
out: their cost models' pieces (:data:`tvm_spinn.program.ops.pool.POOL_GRAD_CODE`,
:data:`tvm_spinn.program.ops.loss.XENT_GRAD_CODE`) were read from single kernel jobs run
directly, none of these shapes.
A fifth table runs the fp32 row kernels (softmax, layer_norm, rms_norm, mean) directly on one
whole-row tile of rows from 1 to 250 columns (the row kernels' cost model was counted at rows of 1
and 2 rows of 1 to 8 columns: every shape here is held out).
A sixth table splits the executed cycles of the int8 tiles of ``bench/fidelity.py``'s silicon
cases (and of the ``int8 dense 32x256x64`` layer) into the kernel's phases (the runtime's job
loop, the MAC array's drivers, the kernel's fixed work, the operand sums, the chunks' adds, the
epilogue and the waits on the array: :func:`tvm_spinn.pe.runners.gemm.int8_tile_phases`),
beside what the timing model charges the tile and the pipeline's cost model.
Usage: ``python bench/iss.py`` (``--only PREFIX [PREFIX ...]``: the cases named so, no calibration;
``--only rows``: the row-kernel table alone; ``--only phases``: the int8 phase table alone).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from tvm import relax

import tvm_spinn
from tvm_spinn.pe import PeCodegenError, run_program_iss
from tvm_spinn.pe.view import gemm_view, layer_attrs, layer_kind, layer_mode, tensor_shape, layer_output

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "quant"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


class _Op(torch.nn.Module):
    def __init__(self, fn, module=None):
        super().__init__()
        self.fn, self.module = fn, module

    def forward(self, *xs):
        return self.fn(self.module, *xs)


def _torch_case(fn, module, *shapes):
    torch.manual_seed(0)
    xs = tuple(torch.randn(*s) for s in shapes)
    mod = tvm_spinn.frontend.from_pytorch(_Op(fn, module).eval(), xs)
    return mod, [x.numpy() for x in xs]


def rng_inputs(shape, dtype):
    rng = np.random.default_rng(1)
    if dtype == "float32":
        return (rng.standard_normal(shape) * 3.0).astype(np.float32)
    return rng.integers(-128, 128, size=shape).astype(dtype)


def _qdq_module(op: str, shape, axis: "int | None" = -1):
    """``quantize`` (fp32 -> int8) or ``dequantize`` (int8 -> fp32) with a per-channel scale and
    zero point over ``axis`` (None: one scale and zero point), between two fp32 element-wise
    layers."""
    bb = relax.BlockBuilder()
    dtype = "float32" if op == "quantize" else "int8"
    x = relax.Var("x", relax.TensorType(list(shape), dtype))
    channels = 1 if axis is None else shape[axis]
    scale = np.linspace(0.01, 0.05, channels).astype(np.float32)
    zero = np.arange(channels).astype(np.int8) % 7 - 3
    scale, zero = (relax.const(scale if axis is not None else scale[0]), relax.const(zero if axis is not None else zero[0]))
    axis = -1 if axis is None else axis
    with bb.function("main", [x]):
        with bb.dataflow():
            if op == "quantize":
                y = bb.emit(relax.op.quantize(bb.emit(relax.op.multiply(x, relax.const(np.float32(2.0)))),
                                              scale, zero, axis=axis, out_dtype="int8"))
            else:
                y = bb.emit(relax.op.multiply(bb.emit(relax.op.dequantize(x, scale, zero, axis=axis)),
                                              relax.const(np.float32(2.0))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _ce_case(rows: int, classes: int):
    """``nll_loss(log_softmax(2 z), t, reduction="none")`` (the ``cross_entropy`` layer after an
    element-wise one) on logits ``[rows, classes]`` and int32 labels, every fifth ignored."""
    bb = relax.BlockBuilder()
    z = relax.Var("z", relax.TensorType([rows, classes], "float32"))
    t = relax.Var("t", relax.TensorType([rows], "int32"))
    with bb.function("main", [z, t]):
        with bb.dataflow():
            lsm = bb.emit(relax.op.nn.log_softmax(bb.emit(relax.op.multiply(z, relax.const(np.float32(2.0))))))
            out = bb.emit_output(bb.emit(relax.op.nn.nll_loss(lsm, t, reduction="none", ignore_index=-100)))
        bb.emit_func_output(out)
    rng = np.random.default_rng(rows * classes)
    labels = rng.integers(0, classes, rows).astype(np.int32)
    labels[::5] = -100
    return bb.get(), [rng_inputs((rows, classes), "float32"), labels]


def _rotary(x, cos, sin):
    """transformers' ``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin``."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def _pool_grad_case(x_shape, pool, strides, padding):
    """``max_pool2d_backward`` (a training step's gradient of a max pooling) on its own."""
    n, c, h, w = x_shape
    g_shape = (n, c, (h + padding[0] + padding[2] - pool[0]) // strides[0] + 1,
               (w + padding[1] + padding[3] - pool[1]) // strides[1] + 1)
    bb = relax.BlockBuilder()
    dy = relax.Var("dy", relax.TensorType(g_shape, "float32"))
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    with bb.function("main", [dy, x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.grad.max_pool2d_backward(dy, x, pool, strides, padding))
        bb.emit_func_output(out)
    return bb.get(), [rng_inputs(g_shape, "float32"), rng_inputs(x_shape, "float32")]


def _xent_grad_case(rows: int, classes: int):
    """``cross_entropy_backward``: ``(softmax(z) - one_hot(t)) / rows``."""
    from tvm.ir.prim.expr import FloatImm
    bb = relax.BlockBuilder()
    z = relax.Var("z", relax.TensorType((rows, classes), "float32"))
    t = relax.Var("t", relax.TensorType((rows,), "int32"))
    with bb.function("main", [z, t]):
        with bb.dataflow():
            sm = bb.emit(relax.op.nn.softmax(z, axis=-1))
            hot = bb.emit(relax.op.one_hot(t, FloatImm("float32", 1.0), FloatImm("float32", 0.0), classes, -1))
            out = bb.emit_output(relax.op.divide(relax.op.subtract(sm, hot), relax.const(np.float32(rows))))
        bb.emit_func_output(out)
    labels = np.random.default_rng(2).integers(0, classes, size=rows).astype(np.int32)
    return bb.get(), [rng_inputs((rows, classes), "float32"), labels]


def _int8_dense_case(rng):
    """The ``int8 dense 32x256x64`` case: its module and input (drawn from ``rng``)."""
    from test_int8 import qgemm_module
    x = rng.integers(-128, 128, size=(32, 256)).astype("int8")
    w = rng.integers(-127, 128, size=(256, 64)).astype("int8")
    mod = qgemm_module(x.shape, "int8", w, np.float32(0.003), 0, 0.01, 2, op="dense", out=(0.5, 0, "int8"))
    return mod, [x]


def _cases():
    yield "add", _torch_case(lambda m, a, b: a + b, None, (64, 96), (64, 96))
    yield "multiply", _torch_case(lambda m, a, b: a * b, None, (64, 96), (64, 96))
    yield "relu", _torch_case(lambda m, a: torch.relu(a + 1.0), None, (64, 96))
    yield "add 150x200", _torch_case(lambda m, a, b: a + b, None, (150, 200), (150, 200))
    yield "add 31x77", _torch_case(lambda m, a, b: a + b, None, (31, 77), (31, 77))
    yield "dense 32x64x48", _torch_case(lambda m, x: m(x), torch.nn.Linear(64, 48, bias=False), (32, 64))
    yield "dense 8x256x64", _torch_case(lambda m, x: m(x), torch.nn.Linear(256, 64, bias=False), (8, 256))
    yield "dense 20x100x36", _torch_case(lambda m, x: m(x), torch.nn.Linear(100, 36, bias=False), (20, 100))
    yield "matmul 24x40x16", _torch_case(lambda m, a, b: a @ b, None, (24, 40), (40, 16))
    yield "conv2d 3->16 3x3", _torch_case(lambda m, x: m(x), torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), (1, 3, 16, 16))
    yield "softmax 64x96", _torch_case(lambda m, a: torch.softmax(a * 2.0, dim=-1), None, (64, 96))
    yield "layer_norm 64x96", _torch_case(lambda m, a: m(a * 2.0), torch.nn.LayerNorm(96), (64, 96))
    yield "rms_norm 64x96", _torch_case(
        lambda m, a: m * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)), torch.nn.Parameter(torch.ones(96)),
        (64, 96))
    yield "gelu 64x96", _torch_case(lambda m, a: torch.nn.functional.gelu(a * 2.0), None, (64, 96))
    yield "sigmoid 64x96", _torch_case(lambda m, a: torch.sigmoid(a * 2.0), None, (64, 96))
    yield "tanh 64x96", _torch_case(lambda m, a: torch.tanh(a * 2.0), None, (64, 96))
    yield "clip 64x96", _torch_case(lambda m, a: torch.clamp(a * 2.0, -0.5, 0.5), None, (64, 96))
    yield "subtract 64x96", _torch_case(lambda m, a, b: a - b, None, (64, 96), (64, 96))
    yield "divide 64x96", _torch_case(lambda m, a, b: a / b, None, (64, 96), (64, 96))
    yield "negative 64x96", _torch_case(lambda m, a: -(a * 2.0), None, (64, 96))
    yield "sqrt 64x96", _torch_case(lambda m, a: torch.sqrt(a * 2.0), None, (64, 96))
    yield "rsqrt 64x96", _torch_case(lambda m, a: torch.rsqrt(a * 2.0), None, (64, 96))
    yield "power2 64x96", _torch_case(lambda m, a: (a * 2.0).pow(2), None, (64, 96))
    yield "power3 64x96", _torch_case(lambda m, a: (a * 2.0).pow(3), None, (64, 96))
    yield "gelu_tanh 64x96", _torch_case(lambda m, a: torch.nn.functional.gelu(a * 2.0, approximate="tanh"), None,
                                         (64, 96))
    yield "strided_slice 64x96", _torch_case(lambda m, a: (a * 2.0)[8:40, 16:80:2] + 1.0, None, (64, 96))
    yield "broadcast_to 1x96->64", _torch_case(lambda m, a: (a * 2.0).expand(64, 96) + 1.0, None, (1, 96))
    yield "max_pool2d 3x3/2", _torch_case(lambda m, a: torch.nn.functional.max_pool2d(a * 2.0, 3, 2, 1), None,
                                          (1, 8, 24, 24))
    yield "max_pool2d 2x2/2", _torch_case(lambda m, a: torch.nn.functional.max_pool2d(a * 2.0, 2, 2), None,
                                          (1, 16, 20, 20))
    yield "avg_pool2d 2x2/2", _torch_case(lambda m, a: torch.nn.functional.avg_pool2d(a * 2.0, 2, 2), None,
                                          (1, 16, 20, 20))
    yield "avg_pool2d 3x3/1", _torch_case(lambda m, a: torch.nn.functional.avg_pool2d(a * 2.0, 3, 1, 1), None,
                                          (1, 8, 16, 16))
    yield "avg_pool2d 4x4/4", _torch_case(lambda m, a: torch.nn.functional.avg_pool2d(a * 2.0, 4, 4), None,
                                          (1, 8, 24, 24))
    yield "avg_pool2d 7x7/1", _torch_case(lambda m, a: torch.nn.functional.avg_pool2d(a * 2.0, 7, 1), None,
                                          (1, 8, 14, 14))
    yield "avg_pool2d 5x3/2", _torch_case(lambda m, a: torch.nn.functional.avg_pool2d(a * 2.0, (5, 3), 2, (2, 1)),
                                          None, (1, 6, 17, 17))
    yield "max_pool2d 4x4/4", _torch_case(lambda m, a: torch.nn.functional.max_pool2d(a * 2.0, 4, 4), None,
                                          (1, 8, 24, 24))
    yield "max_pool2d 7x7/1", _torch_case(lambda m, a: torch.nn.functional.max_pool2d(a * 2.0, 7, 1), None,
                                          (1, 8, 14, 14))
    yield "pool_grad 2x2/2", _pool_grad_case((1, 8, 16, 16), (2, 2), (2, 2), (0, 0, 0, 0))
    yield "pool_grad 3x3/2 pad 1", _pool_grad_case((2, 8, 16, 16), (3, 3), (2, 2), (1, 1, 1, 1))
    yield "pool_grad 3x3/1 pad 1", _pool_grad_case((1, 4, 12, 12), (3, 3), (1, 1), (1, 1, 1, 1))
    yield "pool_grad 5x3/2 pad 2,1", _pool_grad_case((1, 6, 17, 17), (5, 3), (2, 2), (2, 1, 2, 1))
    yield "pool_grad 2x2/2 32x32", _pool_grad_case((2, 16, 32, 32), (2, 2), (2, 2), (0, 0, 0, 0))
    yield "xent_grad 64x96", _xent_grad_case(64, 96)
    yield "xent_grad 300x10", _xent_grad_case(300, 10)
    yield "xent_grad 4x3000", _xent_grad_case(4, 3000)
    yield "xent_grad 2x5000 stream", _xent_grad_case(2, 5000)
    yield "mean 64x96", _torch_case(lambda m, a: (a * 2.0).mean(-1), None, (64, 96))
    yield "where_less 64x96", _torch_case(lambda m, a, b: torch.where(a < b, a * 2.0, b * 3.0), None, (64, 96), (64, 96))
    yield "where_less 31x77", _torch_case(lambda m, a, b: torch.where(a < b, a * 2.0, b * 3.0), None, (31, 77), (31, 77))
    yield "rope 8x3x16", _torch_case(lambda m, x, c, s: _rotary(x * 2.0, c, s), None, *[(1, 8, 3, 16)] * 3)
    yield "rope 4x5x64", _torch_case(lambda m, x, c, s: _rotary(x * 2.0, c, s), None, *[(2, 4, 5, 64)] * 3)
    yield "transpose 64x96", _torch_case(lambda m, a: (a * 2.0).t() + 1.0, None, (64, 96))
    yield "concat 64x96|64x32", _torch_case(lambda m, a, b: torch.cat([a * 2.0, b * 3.0], dim=1) + 1.0, None,
                                            (64, 96), (64, 32))
    yield "concat 3x(2x24x40) ax1", _torch_case(lambda m, a, b, c: torch.cat([a * 2.0, b * 3.0, c * 4.0], dim=1) + 1.0,
                                                None, (2, 24, 40), (2, 24, 40), (2, 24, 40))
    yield "pad 64x96 (1,2,3,0)", _torch_case(
        lambda m, a: torch.nn.functional.pad(a * 2.0, (1, 2, 3, 0), value=-0.0) + 1.0, None, (64, 96))
    yield "pad 1x8x24x24 (1,1,1,1)", _torch_case(
        lambda m, a: torch.nn.functional.pad(a * 2.0, (1, 1, 1, 1), value=0.5) + 1.0, None, (1, 8, 24, 24))
    yield "embedding 16->64", _torch_case(lambda m, a: m((a.abs() * 10).long() % 50), torch.nn.Embedding(50, 64),
                                          (16,))
    yield "embedding 2x40->24", _torch_case(lambda m, a: m((a.abs() * 10).long() % 30), torch.nn.Embedding(30, 24),
                                            (2, 40))
    yield "quantize 64x96", (_qdq_module("quantize", (64, 96)), [rng_inputs((64, 96), "float32")])
    yield "quantize 64x96 rows", (_qdq_module("quantize", (64, 96), 0), [rng_inputs((64, 96), "float32")])
    yield "quantize 64x96 tensor", (_qdq_module("quantize", (64, 96), None), [rng_inputs((64, 96), "float32")])
    yield "dequantize 64x96", (_qdq_module("dequantize", (64, 96)), [rng_inputs((64, 96), "int8")])
    for rows, classes in ((64, 96), (31, 77), (200, 10), (8, 1000), (2, 3500), (3, 5000), (2, 50257)):
        yield f"cross_entropy {rows}x{classes}", _ce_case(rows, classes)
    from test_int8 import qgemm_module
    rng = np.random.default_rng(0)
    yield "int8 dense 32x256x64", _int8_dense_case(rng)
    xc = rng.integers(-128, 128, size=(1, 16, 12, 12)).astype("int8")
    wc = rng.integers(-127, 128, size=(32, 16, 3, 3)).astype("int8")
    mod = qgemm_module(xc.shape, "int8", wc, np.float32(0.003), 0, 0.01, 2, out=(0.5, 0, "int8"),
                       conv_attrs=dict(padding=1))
    yield "int8 conv2d 16->32 3x3", (mod, [xc])
    x = rng.integers(-128, 128, size=(24, 96)).astype("int8")
    w = rng.integers(-127, 128, size=(96, 40)).astype("int8")
    zw = rng.integers(-3, 4, size=40).astype("int8")
    mod = qgemm_module(x.shape, "int8", w, rng.uniform(0.001, 0.005, size=40).astype("float32"), zw, 0.01, 0,
                       op="dense", out=(0.3, -4, "int8"), w_axis=1)
    yield "int8 dense 24x96x40 zw", (mod, [x])
    a = rng.integers(0, 256, size=(2, 16, 48)).astype("uint8")
    b = rng.integers(0, 256, size=(2, 48, 20)).astype("uint8")
    mod = qgemm_module(a.shape, "uint8", None, 0.02, 140, 0.05, 90, op="matmul", wdtype="uint8",
                       b_shape=b.shape, out=(0.9, 128, "uint8"))
    yield "int8 matmul 2x16x48x20", (mod, [a, b])
    xc = rng.integers(-128, 128, size=(1, 8, 10, 10)).astype("int8")
    wc = rng.integers(-127, 128, size=(16, 8, 3, 3)).astype("int8")
    mod = qgemm_module(xc.shape, "int8", wc, np.float32(0.003), 1, 0.01, -3, out=(0.5, 0, "int8"),
                       relu=True, conv_attrs=dict(padding=1))
    yield "int8 conv2d 8->16 zw", (mod, [xc])
    # the dequantizing epilogue (float32 outputs: every tvm_spinn.quantize model's GEMMs) and
    # TFLite's requantization (rounding="tflite": a TFLite model's convolutions)
    x = rng.integers(-128, 128, size=(32, 256)).astype("int8")
    w = rng.integers(-127, 128, size=(256, 64)).astype("int8")
    mod = qgemm_module(x.shape, "int8", w, rng.uniform(0.001, 0.005, size=64).astype("float32"), 0, 0.01, 2,
                       op="dense", bias=rng.normal(size=64).astype("float32"), relu=True, w_axis=1)
    yield "int8 dense 32x256x64 f32", (mod, [x])
    xc = rng.integers(-128, 128, size=(1, 16, 12, 12)).astype("int8")
    wc = rng.integers(-127, 128, size=(32, 16, 3, 3)).astype("int8")
    mod = qgemm_module(xc.shape, "int8", wc, np.float32(0.003), 0, 0.01, 2, bias=rng.normal(size=32).astype("float32"),
                       conv_attrs=dict(padding=1))
    yield "int8 conv2d 16->32 f32", (mod, [xc])
    from tvm_spinn.program.quant import QUANT_ROUNDING_ATTR
    mod = qgemm_module(xc.shape, "int8", wc, rng.uniform(0.001, 0.005, size=32).astype("float32"), 0, 0.01, 2,
                       out=(0.5, 0, "int8"), relu=True, conv_attrs=dict(padding=1))
    yield "int8 conv2d 16->32 tflite", (mod.with_attr(QUANT_ROUNDING_ATTR, "tflite"), [xc])
    xc = rng.integers(-128, 128, size=(1, 8, 10, 10)).astype("int8")
    wc = rng.integers(-127, 128, size=(16, 8, 3, 3)).astype("int8")
    mod = qgemm_module(xc.shape, "int8", wc, np.float32(0.003), 1, 0.01, -3, out=(0.5, 0, "int8"),
                       relu=True, conv_attrs=dict(padding=1))
    yield "int8 conv2d 8->16 zw tflite", (mod.with_attr(QUANT_ROUNDING_ATTR, "tflite"), [xc])
    # other shapes and variants of both epilogues (held out: none of them was read to count the
    # epilogues' mixes): no bias and no ReLU, uint8 operands with zero points, per-channel
    # scales, a ReLU without a bias, a batched matmul of two activations
    x = rng.integers(-128, 128, size=(10, 72)).astype("int8")
    w = rng.integers(-127, 128, size=(72, 30)).astype("int8")
    mod = qgemm_module(x.shape, "int8", w, np.float32(0.004), 0, 0.02, -5, op="dense")
    yield "int8 dense 10x72x30 f32", (mod, [x])
    xu = rng.integers(0, 256, size=(1, 6, 9, 9)).astype("uint8")
    wu = rng.integers(0, 256, size=(20, 6, 3, 3)).astype("uint8")
    mod = qgemm_module(xu.shape, "uint8", wu, rng.uniform(0.001, 0.005, size=20).astype("float32"), 128, 0.01, 120,
                       relu=True, conv_attrs=dict(padding=1), wdtype="uint8")
    yield "uint8 conv2d 6->20 f32 relu", (mod, [xu])
    a = rng.integers(0, 256, size=(2, 11, 40)).astype("uint8")
    b = rng.integers(0, 256, size=(2, 40, 13)).astype("uint8")
    mod = qgemm_module(a.shape, "uint8", None, 0.02, 140, 0.05, 90, op="matmul", wdtype="uint8", b_shape=b.shape)
    yield "uint8 matmul 2x11x40x13 f32", (mod, [a, b])
    xc = rng.integers(-128, 128, size=(1, 24, 6, 6)).astype("int8")
    wc = rng.integers(-127, 128, size=(40, 24, 1, 1)).astype("int8")
    mod = qgemm_module(xc.shape, "int8", wc, rng.uniform(0.001, 0.005, size=40).astype("float32"), 0, 0.01, 3,
                       out=(0.4, 5, "int8"), relu=True)  # TFLite's fully-connected layers round once: half up
    yield "int8 conv2d 1x1 24->40 tflite", (mod.with_attr(QUANT_ROUNDING_ATTR, "tflite"), [xc])
    xu = rng.integers(0, 256, size=(1, 4, 7, 7)).astype("uint8")
    wu = rng.integers(0, 256, size=(12, 4, 3, 3)).astype("uint8")
    mod = qgemm_module(xu.shape, "uint8", wu, np.float32(0.004), 131, 0.02, 125, out=(0.3, 128, "uint8"),
                       bias=rng.normal(size=12).astype("float32"), conv_attrs=dict(padding=1), wdtype="uint8")
    yield "uint8 conv2d 4->12 tflite", (mod.with_attr(QUANT_ROUNDING_ATTR, "tflite"), [xu])
    try:  # TFLite's integer softmax, from a converted full-integer model
        import tflite_models as tm
        from tvm_spinn.frontend.tflite import from_tflite, keras_to_tflite
    except ImportError as err:
        print(f"tflite softmax cases skipped: {err}")
        return
    for shape, spread in (((16, 10), 1.0), ((2, 300), 4.0), ((64, 3), 1.0), ((1, 1000), 2.0)):
        mod = from_tflite(keras_to_tflite(tm.softmax(shape), quantize=tm.calibration(shape, normal=True) * spread))
        yield f"tflite softmax {shape[0]}x{shape[1]}", (mod, [rng.integers(-128, 128, size=(1,) + shape).astype("int8")])
    for shape in ((24, 5, 7), (8, 16, 16)):  # TFLite's integer mean over the spatial axes
        rep = tm.calibration(shape, normal=True) * 2.0 + 0.3
        mod = from_tflite(keras_to_tflite(tm.mean(shape), quantize=rep))
        yield f"tflite mean {'x'.join(map(str, shape))}", (mod, [rng.integers(-128, 128, size=(1,) + shape).astype("int8")])


#: the calibration rows ``(case, layer kind)`` of the element-wise constants (see the module docstring)
CALIBRATION = {("add", "add"): "loop, job", ("add 150x200", "add"): "loop, job"}
#: the fp32 GEMM kernel's tile shapes ``(m, n, k)`` run directly (the small cases' tiles are all
#: one or two columns wide; a model's GEMMs get full 4 x 4 blocks), none of them a shape the
#: ``F32_*`` mixes were counted at
KERNEL_SHAPES = ((16, 1, 64), (8, 1, 256), (4, 4, 64), (16, 16, 64), (16, 4, 128), (32, 32, 32), (5, 7, 40),
                 (1, 64, 64), (64, 4, 64), (12, 8, 96), (3, 3, 50), (8, 8, 16), (20, 9, 30), (8, 12, 20),
                 (2, 16, 128), (16, 1, 27), (16, 2, 27), (8, 3, 100), (24, 24, 65), (13, 17, 33))
#: the calibrated SpinnArch constants: the element-wise ones, then the GEMM kernel's
CONSTANTS = ("m4f_loop_cycles", "m4f_job_cycles")
#: the target of the model's error on held-out rows
TARGET = 0.10


def _measure():
    """Per layer of every case: ``(case, program, layer index, executed tile runs)``."""
    for name, (mod, inputs) in _cases():
        ex = relax.build(mod, target="spinn")
        for program in tvm_spinn.report(ex).programs:
            feeds = [x if x.dtype == np.dtype(program.tensors[t].dtype) else
                     np.zeros(program.tensors[t].shape, program.tensors[t].dtype)
                     for t, x in zip(program.inputs, inputs)]
            record = []
            try:
                run_program_iss(program, feeds, record)
            except PeCodegenError as err:
                print(f"{name:24s} not lowered: {err}")
                continue
            for index in sorted({r.layer for r in record}):
                yield name, program, index, [r for r in record if r.layer == index]


def _modelled(program, index: int, rows, arch) -> float:
    """The timing model's cycles of the tiles ``rows`` ran; for an int8 GEMM the generated
    kernel's software pipeline (:func:`tvm_spinn.program.ops.gemm.geometry.int8_pipelined_cycles`:
    the M4F's work and the MAC array's runs, overlapped as the kernel overlaps them)."""
    from tvm_spinn.mapping.schedule import derive_tables
    table = derive_tables(program, arch)[index]
    if _int8_gemm(program, index):
        return sum(_int8_tile(program, index, table, r.tile, arch)[0] for r in rows)
    return float(sum(table.cycles[r.tile] for r in rows)) - _waited(program, index, rows, arch)


def _waited(program, index: int, rows, arch) -> float:
    """The cycles the timing model charges the tiles ``rows`` ran beyond the code they execute
    (a split row's chain: :meth:`tvm_spinn.program.ops.rows.Rows.chain_wait`; the ISS runs the
    chunks one after another and passes the partials itself)."""
    from tvm_spinn.mapping.schedule import derive_tables
    from tvm_spinn.program.ops.base import family_of
    family = family_of(layer_kind(program, index))
    if not hasattr(family, "chain_wait"):
        return 0.0
    table = derive_tables(program, arch)[index]
    wait = family.chain_wait(program, program.layers[index], arch, program.mapping.layers[index].tile, table.lo,
                             table.hi)
    return float(sum(wait[r.tile] for r in rows))


def _int8_gemm(program, index: int) -> bool:
    return layer_mode(program, index) == "int8" and layer_kind(program, index) in ("dense", "matmul", "conv2d")


def _int8_tile(program, index: int, table, t: int, arch) -> tuple[float, float]:
    """The int8 GEMM kernel's cycles of tile ``t`` of layer ``index`` by the cost model: the
    pipeline's, and the M4F's share alone."""
    from dataclasses import replace
    from tvm_spinn.pe.view import gemm_chunk
    from tvm_spinn.program.ops.gemm.geometry import int8_m4f_cycles, int8_pipelined_cycles, int8_side, splits_of
    lo, hi = table.lo[t], table.hi[t]
    vm, vn = int(hi[1] - lo[1]), int(hi[2] - lo[2])
    side = int8_side(program, program.layers[index])
    k, k0 = gemm_view(program, index).k, 0
    if table.lo.shape[1] > 3:  # a part of a reduction split over PEs: the last one finishes
        k0, k1 = int(lo[3]), int(hi[3])
        side = replace(side, epilogue=k1 == k)
        k = k1 - k0
    kc = gemm_chunk(program, index)
    return (int8_pipelined_cycles(vm, vn, k, kc, arch, side, starts=k0 == 0),
            float(int8_m4f_cycles(vm, vn, k, splits_of(k, kc), arch, side)))


def _lstsq(rows, constants, arch, model):
    """The ``constants`` that zero the relative error of ``rows`` (``(key, executed)``) of the
    linear ``model(key, arch)``: one model run per constant gives the system."""
    zero = arch.replace(**dict.fromkeys(constants, 0.0))
    unit = 1000.0  # large, so the model's rounding up of each tile is negligible
    base = np.array([model(key, zero) for key, _ in rows])
    coef = np.array([[(model(key, zero.replace(**{c: unit})) - b) / unit for c in constants]
                     for (key, _), b in zip(rows, base)])
    executed = np.array([e for _, e in rows], dtype=np.float64)
    solved, *_ = np.linalg.lstsq(coef / executed[:, None], (executed - base) / executed, rcond=None)
    return dict(zip(constants, (float(v) for v in solved)))


def _solve(results, arch):
    """The element-wise constants from the calibration rows (their fixed tiles)."""
    rows = [((program, index, rows), sum(r.cycles for r in rows)) for name, program, index, rows in results
            if (name, layer_kind(program, index)) in CALIBRATION]
    return _lstsq(rows, CONSTANTS, arch, lambda key, a: _modelled(*key, a))


def _kernel_runs(arch):
    """``(m, n, k) -> executed cycles`` of one job of the fp32 GEMM kernel (first and last chunk)."""
    from tvm_spinn.pe.runners.gemm import gemm_f32_job_cycles
    return gemm_f32_job_cycles(KERNEL_SHAPES, arch)


def _kernel_table(arch) -> None:
    from tvm_spinn.program.ops.gemm.geometry import fp32_tile_cycles
    runs = _kernel_runs(arch)
    print(f"\nfp32 GEMM kernel, one job per tile shape (every shape held out)\n{'m x n x k':14s} {'modelled':>10s} "
          f"{'executed':>10s} {'model err':>9s} {'+-10%':>5s} {'exec/MAC':>8s}")
    within = 0
    for key in KERNEL_SHAPES:
        modelled, executed = float(fp32_tile_cycles(*key, 1, arch)), runs[key]
        err = (modelled - executed) / executed
        within += abs(err) <= TARGET
        print(f"{'x'.join(map(str, key)):14s} {modelled:10.0f} {executed:10d} {err:+9.1%} "
              f"{'yes' if abs(err) <= TARGET else 'no':>5s} {executed / np.prod(key):8.2f}")
    print(f"held-out kernel shapes within +-{TARGET:.0%}: {within} of {len(KERNEL_SHAPES)}")


#: int8 GEMM kernel runs, ``(rows, cols, k, chunk, row sums, column sums, requantize)`` -> whether
#: it is a calibration shape (the int8 mixes were read from those; the others are held out)
INT8_SHAPES = {(16, 4, 64, 64, False, False, False): True, (16, 8, 64, 64, False, False, False): True,
               (16, 8, 64, 64, False, False, True): True, (16, 16, 64, 64, False, False, True): True,
               (32, 8, 64, 64, False, False, True): True, (19, 8, 64, 64, False, False, True): True,
               (16, 64, 512, 256, False, False, False): True, (16, 16, 192, 64, False, False, False): True,
               (16, 4, 256, 256, False, False, True): False, (16, 64, 1024, 256, False, False, True): False,
               (16, 64, 2048, 511, False, False, True): False, (64, 64, 256, 256, False, False, True): False,
               (1, 96, 1024, 511, False, False, True): False, (1, 64, 2048, 511, False, False, True): False,
               (4, 128, 1024, 256, False, False, True): False, (144, 32, 144, 144, False, False, True): False,
               (24, 40, 96, 96, True, False, True): False, (7, 10, 300, 100, True, True, True): False,
               (32, 64, 600, 511, False, False, False): False}


def int8_kernel_run(machine, rows, cols, k, chunk, row_sums, col_sums, requant, rng):
    """Run the ``gemm_i8`` kernel on one ``rows x cols`` tile with reduction ``k`` in chunks of
    ``chunk`` as the ``iss`` mode does (:func:`tvm_spinn.pe.execute.run_int8_tile`); returns the
    accumulator (int32), the exact sums, the executed cycles and the cycles waited on the MAC
    array."""
    from tvm_spinn.pe.cycles import executed_cycles
    from tvm_spinn.pe.execute import run_int8_tile
    from tvm_spinn.pe.runners.gemm import int8_dsp_consts, int8_seeded_operands

    a, b = int8_seeded_operands(rows, cols, k, rng)
    q = int8_dsp_consts(k, cols)
    flags = (2 if requant else 0) | (4 if row_sums else 0) | (8 if col_sums else 0)
    acc = run_int8_tile(machine, a, b, chunk, q, flags)
    want = (a.astype(np.int64) @ b.astype(np.int64)).astype(np.int32)
    return acc, want, executed_cycles(machine)[0], machine.stall


def _int8_kernel_table(arch) -> None:
    from tvm_spinn.pe.images import role_image
    from tvm_spinn.pe.iss import PeMachine
    from tvm_spinn.pe.runners.gemm import int8_array_cycles
    from tvm_spinn.program.ops.gemm.geometry import Int8Side, int8_m4f_cycles, int8_pipelined_cycles, splits_of
    image = role_image(("gemm_i8",))
    machine = PeMachine(image.elf, image.name, 0, arch.acc_bits, arch)
    rng = np.random.default_rng(0)
    print(f"\nint8 GEMM kernel, one tile per shape (rows x cols x k / chunk, sums: r rows, c columns, q: requantized)\n"
          f"{'shape':22s} {'set':8s} {'array':>8s} {'M4F':>8s} {'sum':>8s} {'max':>8s} {'modelled':>9s} "
          f"{'executed':>9s} {'model err':>9s} {'+-10%':>5s} {'exec/max':>8s}")
    held = within = 0
    for key, calib in INT8_SHAPES.items():
        rows, cols, k, chunk, rs, cs, rq = key
        acc, want, executed, _ = int8_kernel_run(machine, *key, rng)
        if not np.array_equal(acc, want):
            raise AssertionError(f"int8 kernel {key}: the accumulator differs from the exact sums")
        side = Int8Side(row_sums=rs, col_sums=cs, int32_out=not rq, col_zero=True)
        array = int8_array_cycles(rows, cols, k, chunk, arch)
        m4f = float(int8_m4f_cycles(rows, cols, k, splits_of(k, chunk), arch, side))
        modelled = int8_pipelined_cycles(rows, cols, k, chunk, arch, side)
        err = (modelled - executed) / executed
        ok = "" if calib else ("yes" if abs(err) <= TARGET else "no")
        held += not calib
        within += (not calib) and abs(err) <= TARGET
        name = f"{rows}x{cols}x{k}/{chunk}" + ("r" if rs else "") + ("c" if cs else "") + ("q" if rq else "")
        print(f"{name:22s} {'calib' if calib else 'held-out':8s} {array:8d} {m4f:8.0f} {array + m4f:8.0f} "
              f"{max(array, m4f):8.0f} {modelled:9.0f} {executed:9d} {err:+9.1%} {ok:>5s} "
              f"{executed / max(array, m4f):8.2f}")
    print(f"held-out int8 kernel shapes within +-{TARGET:.0%}: {within} of {held}")


#: the int8 kernel's epilogue variants run directly: name -> (role, job flags, the shift of the
#: column constants ``zw, bias, multiplier, shift`` (None: the float32 bits of the bias and the
#: scale), the output's ``y_zero, y_min, y_max``)
EPILOGUES = {"f32": (("gemm_i8", "f32", False), 2, None, (0, -128, 127)),
             "f32 bias": (("gemm_i8", "f32", False), 2 | 1 << 20, None, (0, -128, 127)),
             "f32 relu": (("gemm_i8", "f32", True), 2, None, (0, -128, 127)),
             "f32 bias relu": (("gemm_i8", "f32", True), 2 | 1 << 20, None, (0, -128, 127)),
             "tflite": (("gemm_i8", "tflite"), 2, 40, (0, -128, 127)),
             "tflite relu": (("gemm_i8", "tflite"), 2, 40, (-5, -5, 127)),
             "requant": (("gemm_i8",), 2, 40, (0, -128, 127)),
             "requant relu": (("gemm_i8",), 2, 40, (-5, -5, 127)),
             "requant gemv": (("gemm_i8", "gemv"), 2, 40, (0, -128, 127)),
             "req gemv relu": (("gemm_i8", "gemv"), 2, 40, (-5, -5, 127)),
             "tflite gemv": (("gemm_i8", "tflite_gemv"), 2, 40, (0, -128, 127))}
#: the shapes ``(rows, cols)`` the epilogues' mixes were counted at (``k = 16``, one chunk: the
#: calibration rows), and held-out shapes ``(rows, cols, k, chunk, row sums)``
EPILOGUE_CALIB = ((4, 4), (8, 4), (7, 4), (4, 8), (1, 4), (1, 12))
EPILOGUE_HELD = ((16, 16, 64, 64, False), (13, 20, 48, 48, True), (3, 40, 96, 32, False), (32, 8, 200, 64, True),
                 (6, 24, 30, 30, False), (1, 64, 256, 128, False), (48, 32, 72, 72, True))
#: the one-row kernel's (``("gemm_i8", "gemv")``, which the layers of one-row tiles run): its
#: column counted at one-row shapes, held out on one-row tiles of one to three chunks
EPILOGUE_GEMV_CALIB = ((1, 4), (1, 12))
EPILOGUE_GEMV_HELD = ((1, 64, 256, 128, False), (1, 40, 96, 32, True), (1, 8, 1024, 511, False),
                      (1, 96, 1024, 511, True), (1, 24, 30, 30, False))


def _epilogue_run(machine, rows, cols, k, chunk, flags, shift, rng, out=(0, -128, 127)) -> int:
    """Executed cycles of one ``gemm_i8`` tile with an epilogue (``flags`` bit 1) run directly;
    ``out``: the output's zero point and bounds."""
    from tvm_spinn.pe.cycles import executed_cycles
    from tvm_spinn.pe.execute import _Arena, gemm_i8_tile
    a = rng.integers(-128, 128, (rows, k)).astype(np.int8)
    b = rng.integers(-128, 128, (k, cols)).astype(np.int8)
    if shift is None:  # the bias's and the scale's float32 bits
        col = [1, int(np.float32(0.5).view(np.int32)), int(np.float32(0.01).view(np.int32)), 0]
    else:
        col = [1, 100, 1 << 30, shift]
    q = np.concatenate([[3, k, *out], np.tile(col, cols)])
    machine.load(0)
    machine.clear_counters()
    gemm_i8_tile(machine, _Arena(machine, None, None), a, b, chunk, 0, k, q, flags, out_bytes=1 if shift else 4)
    return executed_cycles(machine)[0]


def _epilogue_table(arch) -> None:
    from tvm_spinn.pe.images import role_image
    from tvm_spinn.pe.iss import PeMachine
    from tvm_spinn.program.ops.gemm.geometry import Int8Side, int8_pipelined_cycles
    rng = np.random.default_rng(0)
    print(f"\nint8 GEMM epilogues, one tile per shape (rows x cols x k / chunk, r: the kernel forms row sums)\n"
          f"{'epilogue':14s} {'shape':16s} {'set':8s} {'modelled':>9s} {'executed':>9s} {'model err':>9s} {'+-10%':>5s}")
    held = within = 0
    for name, (spec, flags, shift, out) in EPILOGUES.items():
        image = role_image(spec)
        machine = PeMachine(image.elf, image.name, 0, arch.acc_bits, arch)
        requant = shift is not None
        side = dict(fp32_out=not requant, relu="relu" in name and not requant, bias="bias" in name,
                    tflite=name.startswith("tflite"), col_zero=requant, narrow=requant and out[2] - out[1] != 255,
                    gemv="gemv" in name)
        counted, held_out = (EPILOGUE_GEMV_CALIB, EPILOGUE_GEMV_HELD) if "gemv" in name else (EPILOGUE_CALIB,
                                                                                            EPILOGUE_HELD)
        shapes = [(r, c, 16, 16, False, True) for r, c in counted] + [s + (False,) for s in held_out]
        for rows, cols, k, chunk, rs, calib in shapes:
            executed = _epilogue_run(machine, rows, cols, k, chunk, flags | (4 if rs else 0), shift, rng, out)
            modelled = int8_pipelined_cycles(rows, cols, k, chunk, arch, Int8Side(row_sums=rs, **side))
            err = (modelled - executed) / executed
            ok = "" if calib else ("yes" if abs(err) <= TARGET else "no")
            held += not calib
            within += (not calib) and abs(err) <= TARGET
            print(f"{name:14s} {f'{rows}x{cols}x{k}/{chunk}' + ('r' if rs else ''):16s} "
                  f"{'calib' if calib else 'held-out':8s} {modelled:9.0f} {executed:9d} {err:+9.1%} {ok:>5s}")
    print(f"held-out epilogue shapes within +-{TARGET:.0%}: {within} of {held}")


#: row kernels run directly on one whole-row tile (rows x columns, every phase in one run): the
#: bench's program rows hold 96 columns; these reach rows as short as a few columns
ROW_SHAPES = ((16, 1), (16, 3), (16, 5), (16, 8), (16, 17), (8, 33), (6, 42), (4, 96), (3, 127), (2, 250))


def row_kernel_run(machine, kind: str, rows: int, cols: int, rng) -> int:
    """Run the fp32 row kernel ``kind`` on one whole-row tile as the ``iss`` mode does (its phases
    as one job list; layer_norm with gamma and beta, rms_norm with its weight); the executed
    cycles, the exp/log unit's waits included. Checks the outputs against the kernels' defining
    sums in float64 (within fp32 rounding)."""
    from tvm_spinn.pe.cycles import executed_cycles
    x = (rng.standard_normal((rows, cols)) * 2.0).astype(np.float32)
    gamma, beta = rng.uniform(0.5, 1.5, cols).astype(np.float32), rng.standard_normal(cols).astype(np.float32)
    px = machine.arena
    py, pst = px + x.nbytes, px + 2 * x.nbytes
    pg = pst + 16 * rows
    pb = pg + gamma.nbytes
    machine.write(px, x.tobytes())
    machine.write(pst, np.zeros(4 * rows, np.float32).tobytes())
    machine.write(pg, gamma.tobytes())
    machine.write(pb, beta.tobytes())
    eps = int(np.float32(1e-5).view(np.uint32))
    from tvm_spinn.program.ops.rows import ROW_CODE
    phases = len(ROW_CODE[kind])  # the kernel's phases, one job each
    if kind == "mean":  # one chunk holding the whole row: from +0.0, the mean written
        jobs = [[px, pst, py, rows, cols, 3, cols]]
    elif kind == "softmax":
        jobs = [[px, py, pst, rows, cols, ph, 3] for ph in range(phases)]
    elif kind == "layer_norm":
        jobs = [[px, py, pst, pg, pb, rows, cols, ph, 3 | 4 | 8, 0, cols, eps] for ph in range(phases)]
    else:
        jobs = [[px, py, pst, pg, rows, cols, ph, 3 | 4, 0, cols, eps] for ph in range(phases)]
    machine.clear_counters()
    machine.run(jobs)
    xd = x.astype(np.float64)
    if kind == "mean":
        y = np.frombuffer(machine.read(py, 4 * rows), np.float32)
        np.testing.assert_allclose(y, xd.mean(1), rtol=1e-5, atol=1e-5)
        return executed_cycles(machine)[0]
    y = np.frombuffer(machine.read(py, x.nbytes), np.float32).reshape(rows, cols)
    if kind == "softmax":
        e = np.exp(xd - xd.max(axis=1, keepdims=True))
        want = e / e.sum(axis=1, keepdims=True)
    elif kind == "layer_norm":
        want = (xd - xd.mean(1, keepdims=True)) / np.sqrt(xd.var(1, keepdims=True) + 1e-5) * gamma + beta
    else:
        want = gamma * (xd / np.sqrt((xd * xd).mean(1, keepdims=True) + 1e-5))
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)
    return executed_cycles(machine)[0]


def _row_kernel_table(arch) -> None:
    """The row kernels' timing model (:func:`tvm_spinn.program.ops.rows.Rows` whole-row tiles:
    its passes per element, what a row computes once, the phases' jobs) against the kernels run
    directly on short and long rows."""
    from tvm_spinn.pe.images import role_image
    from tvm_spinn.pe.iss import PeMachine
    from tvm_spinn.program.ops.rows import row_tile_cycles
    rng = np.random.default_rng(0)
    print("\nfp32 row kernels, one whole-row tile per shape (rows x columns)\n"
          f"{'kind':12s} {'shape':8s} {'modelled':>9s} {'executed':>9s} {'model err':>9s} {'+-10%':>5s} {'exec/elem':>9s}")
    held = within = 0
    for kind in ("softmax", "layer_norm", "rms_norm", "mean"):
        image = role_image((kind,))
        machine = PeMachine(image.elf, image.name, 0, arch.acc_bits, arch)
        for rows, cols in ROW_SHAPES:
            executed = row_kernel_run(machine, kind, rows, cols, rng)
            modelled = float(np.ceil(row_tile_cycles(kind, rows, cols, arch)))
            err = (modelled - executed) / executed
            held += 1
            within += abs(err) <= TARGET
            print(f"{kind:12s} {f'{rows}x{cols}':8s} {modelled:9.0f} {executed:9d} {err:+9.1%} "
                  f"{'yes' if abs(err) <= TARGET else 'no':>5s} {executed / (rows * cols):9.2f}")
    print(f"row kernel shapes within +-{TARGET:.0%}: {within} of {held}")


def phase_tiles(arch) -> list:
    """The int8 GEMM tiles whose executed cycles :func:`_phase_table` splits, as the mapper cuts
    them: ``bench/fidelity.py``'s silicon cases (their programs built and mapped as that bench
    does, on the production chip) and this bench's ``int8 dense 32x256x64``. Per case ``(name,
    image, rows, cols, k, chunk, side)``: the measured layer's PE image
    (:func:`~tvm_spinn.pe.roles.layer_role`), its first tile's rows and columns (every tile of
    these layers has that shape), the reduction, the mapper's chunk and the layer's
    :func:`~tvm_spinn.program.ops.gemm.geometry.int8_side`."""
    import fidelity
    import tvm_spinn
    from tvm import relax
    from tvm_spinn.mapping import MappingOptions
    from tvm_spinn.mapping.schedule import derive_tables
    from tvm_spinn.pe.roles import layer_role
    from tvm_spinn.pe.view import gemm_chunk, gemm_view
    from tvm_spinn.program.ops.gemm.geometry import int8_side
    from tvm_spinn.target.arch import CHIPS

    chip = CHIPS["production"]
    cases = [(f"matmul-sram {m}x{k}x{k}", fidelity._matmul_sram(m, k, chip)[0], 0)
             for m, k in ((512, 256), (2048, 256), (4096, 128))]
    cases += [(f"fc-batch1 1x{k}x{k}", fidelity._middle(1, k, chip, split_k=False)[0], 1) for k in (1024, 512)]
    setup = MappingOptions(weights="stream", activations="dram", **fidelity.OCTOPUS)
    cases += [(f"stream-dram M={m}", fidelity._mapped(fidelity.dense_chain(m, fidelity.STREAM_K, fidelity.STREAM_N, 1,
                                                                           chip), chip, setup), 0) for m in (1, 16, 64)]
    mod, _ = _int8_dense_case(np.random.default_rng(0))
    (program,) = tvm_spinn.report(relax.build(mod, target="spinn")).programs
    (index,) = [i for i, layer in enumerate(program.layers) if layer.mode == "int8"]
    cases.append(("int8 dense 32x256x64", program, index))
    out = []
    for name, p, i in cases:
        table = derive_tables(p, p.arch)[i]
        rows, cols = (int(v) for v in table.hi[0, 1:3] - table.lo[0, 1:3])
        out.append((name, layer_role(p, i), rows, cols, gemm_view(p, i).k, gemm_chunk(p, i), int8_side(p, p.layers[i])))
    return out


def _phase_table(arch) -> None:
    """Where each :func:`phase_tiles` tile's executed cycles go
    (:func:`tvm_spinn.pe.runners.gemm.int8_tile_phases`), beside what the timing model charges
    the tile (:func:`~tvm_spinn.program.ops.gemm.geometry.gemm_tile_cycles`) and the pipeline's
    cost model (:func:`~tvm_spinn.program.ops.gemm.geometry.int8_pipelined_cycles`), both on the
    case's own side (its zero points, its output)."""
    from tvm_spinn.pe.runners.gemm import INT8_PHASES, int8_tile_phases
    from tvm_spinn.program.ops.gemm.geometry import gemm_tile_cycles, int8_pipelined_cycles, splits_of
    heads = ("charged", "model", "executed", "array") + INT8_PHASES + ("exposed",)
    print("\nint8 GEMM tiles, executed cycles by phase (exposed: executed less the array's busy cycles)\n"
          f"{'case (its tile)':42s} " + " ".join(f"{h:>12s}" for h in heads))
    for name, spec, rows, cols, k, chunk, side in phase_tiles(arch):
        p = int8_tile_phases(spec, rows, cols, k, chunk, arch, side)
        charged = float(np.ceil(gemm_tile_cycles(rows, cols, k, splits_of(k, chunk), arch, "int8", side)))
        model = int8_pipelined_cycles(rows, cols, k, chunk, arch, side)
        cells = [charged, model, p["executed"], p["array"]] + [p[h] for h in INT8_PHASES] + [p["executed"] - p["array"]]
        label = f"{name} ({rows}x{cols}x{k}/{chunk}{' int32' if side.int32_out else ''})"
        print(f"{label:42s} " + " ".join(f"{c:12.0f}" for c in cells))


def main() -> None:
    import argparse
    from tvm_spinn.target.arch import SpinnArch
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", default=None,
                        help="run only the cases whose name starts with one of these (no calibration)")
    args = parser.parse_args()
    arch = SpinnArch()
    if args.only == ["phases"]:
        _phase_table(arch)
        return
    if args.only:
        global _cases
        every = _cases
        _cases = lambda: ((n, c) for n, c in every() if n.startswith(tuple(args.only)))  # noqa: E731
    results = list(_measure())
    implied = _solve(results, arch) if not args.only else {c: getattr(arch, c) for c in CONSTANTS}
    calibrated = arch.replace(**{k: max(v, 0.0) for k, v in implied.items()})
    print(f"{'case':24s} {'layer kind':16s} {'set':8s} {'tiles':>6s} {'modelled':>10s} {'executed':>10s} "
          f"{'model err':>9s} {'solved':>8s} {'+-10%':>5s} {'exec/unit':>10s}")
    held, within, seen, kinds = 0, 0, set(), {}
    for name, program, index, rows in results:
        kind, mode = layer_kind(program, index), layer_mode(program, index)
        if layer_attrs(program, index).get("rounding") == "tflite":  # TFLite's integer row kernels
            mode = "tflite"
        modelled, executed = _modelled(program, index, rows, arch), sum(r.cycles for r in rows)
        if (kind, mode, modelled, executed) in seen:  # a case's leading op, measured before
            continue
        seen.add((kind, mode, modelled, executed))
        recal = _modelled(program, index, rows, calibrated)
        if kind in ("dense", "matmul", "conv2d"):
            g = gemm_view(program, index)
            units, unit = g.batch * g.m * g.n * g.k, "MAC"
        elif kind == "cross_entropy":  # a loss per row: per logit
            units, unit = int(np.prod(tensor_shape(program, program.layers[index].inputs[0]))), "logit"
        else:
            units, unit = int(np.prod(tensor_shape(program, layer_output(program, index)))), "elem"
        err, err_cal = (modelled - executed) / executed, (recal - executed) / executed
        calib = CALIBRATION.get((name, kind))
        ok = ""
        if not calib:
            held += 1
            within += abs(err) <= TARGET
            ok = "yes" if abs(err) <= TARGET else "no"
            kinds.setdefault((mode, kind), []).append(abs(err) <= TARGET)
        print(f"{name:24s} {mode + ' ' + kind:16s} {'calib' if calib else 'held-out':8s} {len(rows):6d} "
              f"{modelled:10.0f} {executed:10d} {err:+9.1%} {err_cal:+8.1%} {ok:>5s} {executed / units:6.2f}/{unit}")
        waited = _waited(program, index, rows, arch)
        if waited:
            print(f"{'':24s} a split row's chain: the timing model charges these tiles {waited:+.0f} cycles more "
                  "(the partials and statistics they wait for; not executed code)")
        if _int8_gemm(program, index):
            from tvm_spinn.mapping.schedule import derive_tables
            table = derive_tables(program, arch)[index]
            m4f_model = sum(_int8_tile(program, index, table, r.tile, arch)[1] for r in rows)
            m4f_exec = executed - sum(r.waited for r in rows)
            print(f"{'':24s} M4F share alone: modelled {m4f_model:.0f}, executed {m4f_exec:.0f} "
                  f"({(m4f_model - m4f_exec) / m4f_exec:+.1%}); the timing model charges these tiles "
                  f"{sum(r.modelled for r in rows):.0f} cycles (the longer of the MAC array and the M4F's chunk and "
                  "operand-sum adds)")
    print()
    for field in CONSTANTS:
        print(f"calibration: {field} = {getattr(arch, field):.2f} in SpinnArch; the calibration rows solve to "
              f"{implied[field]:.2f} (column 'solved': the model at the solved values, same tiles)")
    print(f"held-out rows within +-{TARGET:.0%} of the executed cycles at SpinnArch's constants: "
          f"{within} of {held}; op kinds all within: {sum(all(v) for v in kinds.values())} of {len(kinds)} "
          "(int8 GEMM rows: the M4F's share)")
    if not args.only:
        _kernel_table(arch)
    if not args.only or any("int8".startswith(o) or o.startswith("int8") for o in args.only):
        _int8_kernel_table(arch)
        _epilogue_table(arch)
        _phase_table(arch)
    if not args.only or "rows" in args.only:
        _row_kernel_table(arch)


if __name__ == "__main__":
    main()
