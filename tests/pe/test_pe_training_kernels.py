"""The training step's PE kernels run in the instruction-set simulator (``iss``) against the
default simulator: ``max_pool2d_backward`` (``pool_grad``) and ``cross_entropy_backward``
(``xent_grad``), bit for bit (NaN payloads and signs, infinities, -0.0, subnormals, ties,
overlapping windows, padding, rows of one class, rows streamed through a PE in chunks), and the
NaN rule of the pooling gradient's sums checked against the Arm rule spelled out here."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax
from tvm.ir.prim.expr import FloatImm

pytest.importorskip("unicorn")
pytest.importorskip("elftools")
pytest.importorskip("ziglang")

import tvm_spinn  # noqa: E402
from tvm_spinn.pe import run_program_iss  # noqa: E402
from tvm_spinn.program.ops.loss import STREAM_CHUNK  # noqa: E402
from tvm_spinn.program.ops.pool import max_pool2d_backward  # noqa: E402
from tvm_spinn.runtime import simulator  # noqa: E402
from tvm_spinn.runtime.simulator import run_program  # noqa: E402

_F32 = np.float32
QA, QB, SNAN = 0x7FC01234, 0xFFC00ABC, 0x7F800055  # two quiet NaNs with payloads, a signalling one


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=_F32).reshape(-1).view(np.uint32)


def _same_bits(got, want, what=""):
    g, w = _bits(got), _bits(want)
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, (f"{what}: {bad.size} elements differ, first at {bad[:5]}: want "
                           f"{[hex(v) for v in w[bad[:5]]]} got {[hex(v) for v in g[bad[:5]]]}")


def _specials(rng, shape, fraction=0.2) -> np.ndarray:
    """Normal values with quiet and signalling NaNs (payloads, both signs), infinities, signed
    zeros and subnormals mixed in."""
    x = rng.standard_normal(shape).astype(_F32)
    flat = x.reshape(-1)
    pick = rng.random(flat.size) < fraction
    values = np.array([QA, QB, SNAN, 0x7F800000, 0xFF800000, 0x80000000, 0x00000000, 0x00200000, 0x80100000],
                      np.uint32).view(_F32)
    flat[pick] = rng.choice(values, pick.sum())
    return x


def _program(mod):
    (program,) = tvm_spinn.report(relax.build(mod, target="spinn")).programs
    return program


def _all_modes(program, inputs, monkeypatch):
    """The output of the native plan, the Python step and ``iss`` mode."""
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("TVM_SPINN_SIM_NATIVE", flag)
        simulator.forget_plans()
        outs.append(run_program(program, inputs)[0])
    monkeypatch.delenv("TVM_SPINN_SIM_NATIVE")
    simulator.forget_plans()
    outs.append(run_program_iss(program, inputs)[0])
    return outs


# -- max_pool2d_backward ---------------------------------------------------------------------------

def _pool_grad_module(x_shape, pool, strides, padding):
    n, c, h, w = x_shape
    oh = (h + padding[0] + padding[2] - pool[0]) // strides[0] + 1
    ow = (w + padding[1] + padding[3] - pool[1]) // strides[1] + 1
    bb = relax.BlockBuilder()
    dy = relax.Var("dy", relax.TensorType((n, c, oh, ow), "float32"))
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    with bb.function("main", [dy, x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.grad.max_pool2d_backward(dy, x, pool, strides, padding))
        bb.emit_func_output(out)
    return bb.get(), (n, c, oh, ow)


#: (x shape, pool, strides, padding t, l, b, r)
_GEOMETRIES = [
    ((2, 3, 10, 10), (3, 3), (2, 2), (1, 1, 1, 1)),  # ResNet's stem: overlapping, padded
    ((1, 2, 7, 7), (3, 3), (1, 1), (1, 1, 1, 1)),  # up to 9 windows per element
    ((1, 1, 9, 8), (3, 2), (2, 3), (1, 0, 0, 1)),  # asymmetric padding, stride > pool
    ((1, 1, 6, 6), (2, 2), (3, 3), (0, 0, 0, 0)),  # gaps between windows
    ((1, 1, 4, 5), (4, 5), (1, 1), (2, 2, 2, 2)),  # windows wholly in the padding
    ((2, 1, 5, 6), (1, 1), (1, 1), (0, 0, 0, 0)),  # the identity's gradient
    ((3, 4, 24, 20), (2, 2), (2, 2), (0, 0, 0, 0)),  # tiles over several planes and rows
]


@pytest.mark.parametrize("geometry", _GEOMETRIES)
@pytest.mark.parametrize("data", ["normal", "ties", "all_equal", "specials"])
def test_max_pool_backward_iss_bit_identical(geometry, data, monkeypatch):
    """iss mode, the native plan and the Python step give the same bits (ties keep the window's
    first maximum, overlapping windows' gradients added nearest first, a NaN taken)."""
    x_shape, pool, strides, padding = geometry
    mod, g_shape = _pool_grad_module(x_shape, pool, strides, padding)
    program = _program(mod)
    assert [layer.kind for layer in program.layers] == ["max_pool2d_backward"]
    rng = np.random.default_rng(sum(x_shape) + pool[0])
    x = rng.standard_normal(x_shape).astype(_F32)
    dy = rng.standard_normal(g_shape).astype(_F32)
    if data == "ties":
        x = np.round(np.maximum(x, 0) * 2) / 2
    elif data == "all_equal":
        x[...] = 0.5
    elif data == "specials":
        x, dy = _specials(rng, x_shape), _specials(rng, g_shape, 0.3)
    native, python, iss = _all_modes(program, [dy, x], monkeypatch)
    _same_bits(python, native, "python step")
    _same_bits(iss, native, "iss")
    _same_bits(native, max_pool2d_backward(dy, x, pool, strides, padding), "pool.max_pool2d_backward")


def _m4f_add(a: int, b: int) -> int:
    """Bits of VADD.F32 ``a + b`` on the M4F with FPSCR.DN = 0 (ARMv7-M ARM, FPProcessNaNs): a
    signalling operand quieted (the first's if both are), else the first quiet NaN; an invalid
    sum of numbers (inf + -inf) the default NaN 0x7FC00000; else the IEEE sum."""
    def nan(u):
        return (u & 0x7F800000) == 0x7F800000 and (u & 0x007FFFFF) != 0

    def quiet(u):
        return bool(u & 0x00400000)
    for u in (a, b):
        if nan(u) and not quiet(u):
            return u | 0x00400000
    for u in (a, b):
        if nan(u):
            return u
    with np.errstate(invalid="ignore"):
        s = np.array([a], np.uint32).view(_F32)[0] + np.array([b], np.uint32).view(_F32)[0]
    return 0x7FC00000 if s != s else int(np.array([s], _F32).view(np.uint32)[0])


@pytest.mark.parametrize("terms", [(QA, QB, 0, 0), (SNAN, QA, 0, 0), (QA, SNAN, QB, 0),
                                   (0x7F800000, 0xFF800000, 0, 0), (0x3F800000, QB, QA, 0x40000000)])
def test_pool_grad_nan_sum_follows_the_m4f(terms, monkeypatch):
    """Four 2x2 windows (stride 1) all take the centre of a 3x3 plane, so its gradient is the
    sum of their four output gradients, nearest window first. The PE's VADD takes the window's
    gradient as its first operand: two quiet NaNs give the later window's, inf + -inf the
    default NaN (x86 would keep the first NaN and give 0xFFC00000). Every mode follows it."""
    mod, _ = _pool_grad_module((1, 1, 3, 3), (2, 2), (1, 1), (0, 0, 0, 0))
    program = _program(mod)
    x = np.zeros((1, 1, 3, 3), _F32)
    x[0, 0, 1, 1] = 5.0
    # window (oy, ox) visited in the order (1, 1), (1, 0), (0, 1), (0, 0)
    dy = np.array(terms, np.uint32)[[3, 2, 1, 0]].view(_F32).reshape(1, 1, 2, 2)
    want = 0
    for t in terms:
        want = _m4f_add(t, want)
    for out in _all_modes(program, [dy, x], monkeypatch):
        got = _bits(out)
        assert hex(int(got[4])) == hex(want)
        assert not np.any(np.delete(got, 4))  # +0.0 everywhere else
    if terms[:2] == (QA, QB):
        assert want == QB  # the later window's NaN
    if terms[:2] == (0x7F800000, 0xFF800000):
        assert want == 0x7FC00000


# -- cross_entropy_backward ----------------------------------------------------------------------------

def _xent_grad_module(rows, classes, divisor):
    bb = relax.BlockBuilder()
    z = relax.Var("z", relax.TensorType((rows, classes), "float32"))
    t = relax.Var("t", relax.TensorType((rows,), "int32"))
    with bb.function("main", [z, t]):
        with bb.dataflow():
            sm = bb.emit(relax.op.nn.softmax(z, axis=-1))
            hot = bb.emit(relax.op.one_hot(t, FloatImm("float32", 1.0), FloatImm("float32", 0.0), classes, -1))
            out = bb.emit_output(relax.op.divide(relax.op.subtract(sm, hot), relax.const(_F32(divisor))))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("rows,classes", [(6, 40), (4, 1), (3, 7), (40, 96), (1, 3 * STREAM_CHUNK + 17)])
@pytest.mark.parametrize("data", ["normal", "specials"])
def test_cross_entropy_backward_iss_bit_identical(rows, classes, data, monkeypatch):
    """``(softmax(z) - one_hot(t)) / n`` in iss mode has the default simulator's bits: whole
    rows resident on a PE, rows of one class, a row longer than the PE's SRAM streamed in
    chunks (the statistics carried in the row's order, the exps computed again for the output)."""
    program = _program(_xent_grad_module(rows, classes, 3.0))
    assert [layer.kind for layer in program.layers] == ["cross_entropy_backward"]
    rng = np.random.default_rng(rows * classes)
    z = (rng.standard_normal((rows, classes)) * 4).astype(_F32)
    if data == "specials":
        z = _specials(rng, (rows, classes), 0.05)
        z[0] = rng.standard_normal(classes).astype(_F32)  # one row of numbers among NaN rows
    t = rng.integers(0, classes, rows).astype(np.int32)
    native, python, iss = _all_modes(program, [z, t], monkeypatch)
    _same_bits(python, native, "python step")
    _same_bits(iss, native, "iss")
    if data == "normal":  # an independent check of the mathematics (float64 softmax)
        zz = z.astype(np.float64)
        e = np.exp(zz - zz.max(axis=1, keepdims=True))
        ref = (e / e.sum(axis=1, keepdims=True) - np.eye(classes)[t]) / 3.0
        assert np.allclose(iss, ref, rtol=1e-4, atol=1e-6)


def test_cross_entropy_backward_row_longer_than_the_sram_streams():
    """A vocabulary-sized row (GPT-2's 50,257 classes, 201 KB of logits: more than a PE's SRAM)
    runs on one PE streamed in chunks, with the default simulator's bits."""
    program = _program(_xent_grad_module(1, 50257, 8.0))
    rng = np.random.default_rng(7)
    z = (rng.standard_normal((1, 50257)) * 2).astype(_F32)
    t = np.array([50256], np.int32)
    _same_bits(run_program_iss(program, [z, t])[0], run_program(program, [z, t])[0], "iss")


@pytest.mark.parametrize("label", [-100, 5])
def test_cross_entropy_backward_label_out_of_range(label):
    """A label outside ``[0, classes)`` (``ignore_index`` included: the gradient layer has no
    ignored rows) is the same ValueError in iss mode as in the default simulator."""
    program = _program(_xent_grad_module(3, 5, 3.0))
    z = np.zeros((3, 5), _F32)
    t = np.array([0, label, 1], np.int32)
    message = f"label {label} of row 1 is out of range for 5 classes"
    with pytest.raises(ValueError, match=message):
        run_program(program, [z, t])
    with pytest.raises(ValueError, match=message):
        run_program_iss(program, [z, t])


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_cnn_training_step_in_iss_mode(monkeypatch, loss):
    """One SGD step of a small CNN run as PE code gives the default simulator's loss and
    parameters, bit for bit: with the MSE loss its backward holds ``max_pool2d_backward``; with
    the cross-entropy loss also ``cross_entropy`` and ``cross_entropy_backward`` (every training
    kind)."""
    import sys
    from pathlib import Path
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from training_models import small_cnn

    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    if loss == "mse":
        y = np.random.default_rng(0).standard_normal((4, 10)).astype(_F32)
        expected = {"max_pool2d_backward"}
    else:
        y = np.array([3, 0, 9, 3], dtype=np.int64)
        expected = {"cross_entropy", "cross_entropy_backward", "max_pool2d_backward"}
    results = {}
    for mode in ("layers", "iss"):
        monkeypatch.setenv("TVM_SPINN_SIM_MODE", mode)
        trainer = tvm_spinn.training.compile(small_cnn(), (x,), loss=loss, optimizer=("sgd", {"lr": 0.1}))
        kinds = {layer.kind for p in tvm_spinn.report(trainer.executable).programs for layer in p.layers}
        assert expected <= kinds, kinds
        out = trainer.step(x.numpy(), y)
        results[mode] = out, trainer.parameters()
    (loss_a, params_a), (loss_b, params_b) = results["layers"], results["iss"]
    assert np.float32(loss_a).view(np.uint32) == np.float32(loss_b).view(np.uint32)
    assert sorted(params_a) == sorted(params_b)
    for name in params_a:
        _same_bits(params_b[name], params_a[name], name)

# -- cost models -----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [("pool", (1, 6, 13, 11), (3, 3), (2, 2), (1, 1, 1, 1)),
                                  ("pool", (2, 4, 10, 10), (2, 3), (1, 2), (0, 1, 0, 1)),
                                  ("xent", 24, 50), ("xent", 1, 4100)])
def test_tile_cost_models_against_executed_cycles(case):
    """Each tile's modelled M4F cycles (``pool_grad_tile_cycles``, ``xent_grad_tile_cycles``,
    read from single kernel jobs of other shapes) within 10% of the cycles the tiles executed."""
    rng = np.random.default_rng(4)
    if case[0] == "pool":
        mod, g_shape = _pool_grad_module(*case[1:])
        inputs = [rng.standard_normal(g_shape).astype(_F32), rng.standard_normal(case[1]).astype(_F32)]
    else:
        rows, classes = case[1:]
        mod = _xent_grad_module(rows, classes, 2.0)
        inputs = [rng.standard_normal((rows, classes)).astype(_F32), rng.integers(0, classes, rows).astype(np.int32)]
    record = []
    run_program_iss(_program(mod), inputs, record)
    modelled, executed = sum(r.modelled for r in record), sum(r.cycles for r in record)
    assert executed > 0 and abs(modelled / executed - 1) <= 0.10, (modelled, executed)


@pytest.mark.parametrize("geometry", _GEOMETRIES)
def test_pool_grad_jobs_cover_each_element_once(geometry):
    """The jobs of any tile hold each of its elements exactly once, and their windows include
    every window holding one of them (checked against the windows' definition), also where a
    small SRAM splits the planes into bands."""
    from tvm_spinn.program.ops.pool import pool_grad_jobs
    (n, c, h, w), (kh, kw), (sh, sw), pad = geometry
    pt, pl, pb, pr = pad
    oh, ow = (h + pt + pb - kh) // sh + 1, (w + pl + pr - kw) // sw + 1
    total = n * c * h * w
    for e0, e1, free in ((0, total, 1 << 20), (3, total - 2, 256), (w + 1, w + 2, 1 << 20)):
        seen = np.zeros(total, np.int64)
        for job in pool_grad_jobs(e0, e1, h, w, oh, ow, (kh, kw), (sh, sw), pad, free):
            for f in range(job.lo, job.hi):
                r, col = job.row0 + f // w, f % w
                seen[(job.plane * h + r) * w + col] += 1
                for oy in range(oh):
                    for ox in range(ow):
                        if oy * sh <= r + pt < oy * sh + kh and ox * sw <= col + pl < ox * sw + kw:
                            assert job.oy0 <= oy < job.oy0 + job.nwy and job.ox0 <= ox < job.ox0 + job.nwx
        assert np.array_equal(seen, (np.arange(total) >= e0) & (np.arange(total) < e1))


def test_every_layer_kind_has_a_pe_kernel():
    """Every kind the pattern table offloads (``program.ops.layer_kinds``) has a PE kernel in
    ``iss`` mode for float32 operands: a kind added without one fails here, not on a user's model."""
    from types import SimpleNamespace as NS
    from tvm_spinn.pe.errors import PeCodegenError
    from tvm_spinn.pe.roles import layer_role
    from tvm_spinn.program.ops import layer_kinds

    int_operand = {"cross_entropy": 1, "cross_entropy_backward": 1, "take": 1}  # labels, indices
    attrs = {"power": {"exponent": 2}}
    missing = {}
    for kind in layer_kinds():
        second = int_operand.get(kind)
        tensors = {0: NS(dtype="float32", shape=(4, 8)), 1: NS(dtype="int32" if second else "float32", shape=(4,)),
                   2: NS(dtype="float32", shape=(4, 8))}
        layer = NS(name=f"{kind}_0", kind=kind, mode="fp32", attrs=dict(attrs.get(kind, {})), inputs=[0, 1],
                   output=2, consts={})
        try:
            layer_role(NS(layers=[layer], tensors=tensors), 0)
        except PeCodegenError as e:
            missing[kind] = str(e)
    assert not missing, missing


def _int8_gemm_program(kind: str, xdtype: str, out: str, rounding, relu: bool, epilogue: str):
    """One int8 GEMM layer (``kind``) with ``epilogue``'s constants and attributes (``"dequantize"``:
    scale and bias; ``"requantize"``: quantized bias, multiplier, shift and the output's range;
    ``"none"``), or None where the program format has no such layer (its validator refuses it)."""
    import numpy as np

    from tvm_spinn.program.format import Program
    from tvm_spinn.program.model import Layer, TensorDesc
    from tvm_spinn.target.arch import CHIPS

    m, k, n = 4, 8, 6
    x_shape, w_shape, y_shape = ([1, k, 3, 3], [n, k, 1, 1], [1, n, 3, 3]) if kind == "conv2d" else ([m, k], [k, n], [m, n])
    tensors = [TensorDesc("x", x_shape, xdtype, "input")]
    consts, inputs, values = {}, [0], {}
    if kind == "matmul":
        tensors.append(TensorDesc("b", [k, n], xdtype, "input"))
        inputs.append(1)
    else:
        tensors.append(TensorDesc("w", w_shape, "int8", "const"))
        consts["weight"], values[1] = 1, np.ones(w_shape, np.int8)

    def const(role, array):
        tensors.append(TensorDesc(role, list(array.shape), str(array.dtype), "const"))
        consts[role] = len(tensors) - 1
        values[len(tensors) - 1] = array

    attrs = dict(x_zero=0, x_flip=xdtype == "uint8", relu=relu, out=out)
    if kind == "matmul":
        attrs.update(b_zero=0, b_flip=xdtype == "uint8")
    if kind == "conv2d":
        attrs.update(strides=[1, 1], padding=[0, 0, 0, 0], dilation=[1, 1], groups=1)
    if epilogue == "dequantize":
        const("scale", np.full(n, 0.5, np.float32))
        const("bias", np.zeros(n, np.float32))
    elif epilogue == "requantize":
        const("bias_q", np.zeros(n, np.int32))
        const("multiplier", np.full(n, 1 << 30, np.int32))
        const("shift", np.full(n, 31, np.int32))
        attrs.update(y_zero=0, y_min=0, y_max=100)
    if rounding is not None:
        attrs["rounding"] = rounding
    tensors.append(TensorDesc("y", y_shape, out, "output"))
    layer = Layer(name=f"q{kind}_0", kind=kind, inputs=inputs, output=len(tensors) - 1, consts=consts, attrs=attrs,
                  mode="int8")
    program = Program("main", CHIPS["production"], tensors, [t for t in range(len(tensors)) if tensors[t].role == "input"],
                      [len(tensors) - 1], [layer], constants=values)
    from tvm_spinn.mapping import MappingOptions, map_program
    from tvm_spinn.program.format import ProgramError
    try:  # the validator reads a mapped program
        return Program.from_bytes(map_program(program, program.arch, MappingOptions()).to_bytes())
    except ProgramError:
        return None


def test_every_int8_layer_combination_has_a_pe_kernel():
    """Every int8 layer the program format admits -- (kind, input dtype, output dtype, rounding,
    ReLU) over the kinds of the families with an ``int8`` mode, the quantized dtypes, every dtype
    of the format and every requantization rule, those the format's validator accepts with one
    of the three epilogues' constants -- has a PE kernel in ``iss`` mode: a combination added
    without one fails here."""
    from tvm_spinn.pe.errors import PeCodegenError
    from tvm_spinn.pe.roles import layer_role
    from tvm_spinn.program.ops import families
    from tvm_spinn.program.quant import QUANT_RANGES, ROUNDINGS
    from tvm_spinn.program.validate import DTYPES

    kinds = sorted({kind for family in families() if "int8" in family.modes for kind in family.kinds})
    admitted, missing = {}, {}
    for kind in kinds:
        for xdtype in sorted(QUANT_RANGES):
            for out in sorted(DTYPES):
                for rounding in (None, *ROUNDINGS):
                    for relu in (False, True):
                        for epilogue in ("dequantize", "requantize", "none"):
                            program = _int8_gemm_program(kind, xdtype, out, rounding, relu, epilogue)
                            if program is None:
                                continue
                            combo = (kind, xdtype, out, rounding or "half_up", relu)
                            try:
                                admitted[combo] = layer_role(program, 0)
                            except PeCodegenError as e:
                                missing[combo] = str(e)
    assert not missing, missing
    # the enumeration reaches every epilogue: dequantized float32, both requantization rules, int32 sums
    roles = set(admitted.values())
    assert {("gemm_i8",), ("gemm_i8", "tflite"), ("gemm_i8", "f32", False), ("gemm_i8", "f32", True)} <= roles
    assert {c[0] for c in admitted} == set(kinds) and {c[2] for c in admitted} == {"float32", "int8", "uint8", "int32"}
