"""The int8 GEMM's dequantizing (float32 output) and TFLite requantizing epilogues as PE code:
the ``gemm_i8`` kernel's ``f32`` and ``tflite`` variants run in the instruction-set simulator
against the simulator's arithmetic (:func:`tvm_spinn.program.ops.gemm.reference.int8_finish`,
:func:`tvm_spinn.program.quant.requantize_tflite`) bit for bit, directly on extreme operands and
on whole layers and models in ``iss`` mode."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tvm import relax

pytest.importorskip("unicorn")
pytest.importorskip("elftools")
pytest.importorskip("ziglang")

import tvm_spinn  # noqa: E402
from tvm_spinn.pe import run_program_iss  # noqa: E402
from tvm_spinn.pe.images import role_image  # noqa: E402
from tvm_spinn.pe.iss import PeMachine  # noqa: E402
from tvm_spinn.pe.kernels.i8_epilogues import i8_dsp_table  # noqa: E402
from tvm_spinn.program.ops.gemm.geometry import int8_block_columns  # noqa: E402
from tvm_spinn.program.ops.gemm.reference import int8_finish  # noqa: E402
from tvm_spinn.program.quant import requantize_tflite  # noqa: E402
from tvm_spinn.runtime.simulator import run_program  # noqa: E402
from tvm_spinn.target.arch import SpinnArch  # noqa: E402

from test_int8 import qgemm_module  # noqa: E402

_F32 = np.float32
QNAN, SNAN = 0x7FC01234, 0xFF800055


def _f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(_F32)


def _run_last_chunk(spec, acc, rowsum, colsum, head, columns, flags, out_dtype):
    """Kernel ``spec``'s last chunk run directly on one tile: the array's sums are zero (k = 4
    zero operands), so the accumulator is ``acc``; returns the output ``[m, n]``."""
    arch = SpinnArch()
    image = role_image(spec)
    machine = PeMachine(image.elf, image.name, 0, arch.acc_bits, arch)
    m, n = acc.shape
    k = 4
    consts = np.concatenate([np.asarray(head, np.int64), np.asarray(columns, np.int64).ravel()])
    # then the next chunk's five words (none) and the host's per-column table of the DSP paths
    consts = np.concatenate([consts, np.zeros(5, np.int64), i8_dsp_table(consts)])
    out = np.zeros(m * n, out_dtype)
    arrays = [np.zeros(m * k, np.int8), np.zeros(k * n, np.int8), np.zeros(m * n, np.int32),
              acc.astype(np.int64).astype(np.int32), np.asarray(rowsum, np.int64).astype(np.int32),
              np.asarray(colsum, np.int64).astype(np.int32), consts.astype(np.uint32).view(np.int32), out]
    addr, pointers = machine.arena, []
    for arr in arrays:
        pointers.append(addr)
        machine.write(addr, arr.tobytes())
        addr += -(-arr.nbytes // 8) * 8
    machine.run([pointers + [m, n, k, 2 | flags | int8_block_columns(m, n, arch) << 8]])
    return np.frombuffer(machine.read(pointers[-1], out.nbytes), out_dtype).reshape(m, n)


def _operands(rng, m, n):
    """int32 accumulators, row and column sums at the int32 extremes (zero-point terms that wrap
    in 32 bits) and per-column weight zero points, the even columns without zero-point terms."""
    acc = rng.integers(-(1 << 31), 1 << 31, size=(m, n))
    acc[2:] = rng.integers(-3000, 3000, size=(m - 2, n))
    acc[0, :], acc[1, :] = -(1 << 31), (1 << 31) - 1
    acc[2, ::3] = 0
    zw = rng.integers(-128, 128, size=n)
    rowsum = rng.integers(-(1 << 31), 1 << 31, size=m)
    colsum = rng.integers(-(1 << 31), 1 << 31, size=n)
    zw[::2], colsum[::2] = 0, 0
    return acc, zw, rowsum, colsum


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dequantize_epilogue_extreme_scales_bit_identical(relu, with_bias):
    """``y = fl(v) * scale [+ bias]`` then the ReLU, run directly: per-channel scales at the
    float32 extremes (+-0, subnormal, the largest finite, +-inf, a quiet NaN), biases with
    infinities, -0.0 and NaNs (quiet and signalling, with payloads), accumulators at the int32 extremes and zero-point terms that
    wrap in 32 bits (``0 * inf`` and ``inf - inf``: the M4F's default NaN 0x7FC00000, not the
    host's 0xFFC00000; ``-0.0`` from a zero sum and a negative scale, made +0.0 by the ReLU)."""
    rng = np.random.default_rng(5 + relu + 2 * with_bias)
    m, n = 7, 24
    acc, zw, rowsum, colsum = _operands(rng, m, n)
    scale = rng.uniform(-0.01, 0.01, size=n).astype(_F32)
    scale[:12] = [0.0, -0.0, 1e-45, -3e-39, 3.4e38, -3.4e38, np.inf, -np.inf, _f32(QNAN), 1.0, -1.0, 2.0 ** -30]
    bias = rng.normal(size=n).astype(_F32)
    bias[[0, 1, 6, 13, 17]] = [np.inf, -0.0, -np.inf, -0.0, np.inf]
    bias[19] = _f32(QNAN + 7)
    # NaN scale and NaN bias: the signalling bias wins (column 8), else the product's (12)
    bias[8], scale[12], bias[12] = _f32(SNAN), _f32(QNAN + 1), _f32(QNAN + 2)
    zx, kk = 77, 300
    columns = np.stack([zw, bias.view(np.int32), scale.view(np.int32), np.zeros(n, np.int64)], axis=1)
    spec = ("gemm_i8", "f32", relu)
    got = _run_last_chunk(spec, acc, rowsum, colsum, [zx, kk, 0, 0, 0], columns, (1 << 20) if with_bias else 0, _F32)
    epi = {"scale": scale, **({"bias": bias} if with_bias else {})}
    ch = np.arange(n)[None, :]
    want = int8_finish(acc.astype(np.int64), np.int64(zx), zw[ch], lambda: rowsum[:, None], lambda: colsum[None, :],
                       kk, epi, {"out": "float32", "relu": relu}, ch)
    assert want.dtype == _F32
    wb, gb = want.view(np.uint32), got.view(np.uint32)
    diff = np.argwhere(wb != gb)
    assert diff.size == 0, [(tuple(d), hex(wb[tuple(d)]), hex(gb[tuple(d)])) for d in diff[:5]]
    # the cases the test is for are present
    assert np.any(wb == 0x7FC00000) and np.any(np.isinf(want)) and np.any(np.isnan(want))
    if not relu:
        assert np.any(wb == 0x80000000)


def test_tflite_requantization_over_the_shift_range_bit_identical():
    """TFLite's requantization run directly against :func:`requantize_tflite`: every shift of
    ``[1, 62]`` (multipliers of 2**30 down to 2**-31: a left shift, none, and right shifts up to
    31), accumulators and quantized biases at the int32 extremes (their sum and its left shift
    wrap in 32 bits), zero-point terms that wrap, negative ties, saturated outputs, int8 and
    uint8 zero points."""
    rng = np.random.default_rng(23)
    m, n = 8, 62
    shift = np.arange(1, 63, dtype=np.int64)
    m0 = rng.integers(1 << 30, 1 << 31, size=n)
    m0[5] = 1 << 30
    acc, zw, rowsum, colsum = _operands(rng, m, n)
    scale = np.ldexp(100.0, shift.astype(int) - 30)  # sums of the size each shift brings near int8
    acc[3:] = np.clip(rng.normal(size=(m - 3, n)) * scale, -2.0 ** 31, 2.0 ** 31 - 1).astype(np.int64)
    # exact ties of the final rounding division: v * M0 / 2**31 = (2j + 1) / 2 * 2**right
    acc[4, 40:] = -(3 << (shift[40:] - 32)) // 2
    bias = rng.integers(-(1 << 31), 1 << 31, size=n)
    # the even columns (no zero-point terms) with a bias of the sums' size: outputs inside the range
    bias[::2] = np.clip(rng.normal(size=n // 2) * scale[::2], -2.0 ** 31, 2.0 ** 31 - 1).astype(np.int64)
    zx, kk = -9, 300
    for ydt, (y_zero, y_min, y_max) in (("int8", (-5, -128, 127)), ("uint8", (131, 131, 255))):
        columns = np.stack([zw, bias, m0, shift], axis=1)
        got = _run_last_chunk(("gemm_i8", "tflite"), acc, rowsum, colsum, [zx, kk, y_zero, y_min, y_max], columns, 0,
                              np.dtype(ydt))
        v = (acc - zw * rowsum[:, None] - zx * colsum + kk * zx * zw).astype(np.int32).astype(np.int64)
        want = requantize_tflite(v + bias, m0, shift, y_zero, y_min, y_max).astype(ydt)
        assert np.array_equal(got, want), np.argwhere(got != want)[:5]
        inside = (want > y_min) & (want < y_max)
        assert inside[:, shift < 31].sum() > 5 and inside[:, shift > 31].sum() > 20 and not inside.all()


def _int8_programs(mod, tflite: bool = False):
    if tflite:
        from tvm_spinn.program.quant import QUANT_ROUNDING_ATTR
        mod = mod.with_attr(QUANT_ROUNDING_ATTR, "tflite")
    programs = tvm_spinn.report(relax.build(mod, target="spinn")).programs
    return [p for p in programs if any(layer.mode == "int8" for layer in p.layers)]


def _assert_same_bits(program, inputs):
    want, got = run_program(program, inputs), run_program_iss(program, inputs)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and w.shape == g.shape
        wb = w.reshape(-1).view(np.uint32 if w.dtype == _F32 else np.uint8)
        gb = g.reshape(-1).view(wb.dtype)
        diff = np.flatnonzero(wb != gb)
        assert diff.size == 0, (f"{diff.size} differ, first at {diff[:5]}: default {[hex(v) for v in wb[diff[:5]]]} "
                                f"iss {[hex(v) for v in gb[diff[:5]]]}")
    return want


def _layer(program, kind):
    (layer,) = [layer for layer in program.layers if layer.kind == kind]
    return layer


def _feed(rng, program):
    return [rng.integers(0 if program.tensors[t].dtype == "uint8" else -128,
                         256 if program.tensors[t].dtype == "uint8" else 128,
                         size=program.tensors[t].shape).astype(program.tensors[t].dtype) for t in program.inputs]


# dense: ragged tiles, per-channel weight zero points, uint8 input, a reduction of two
# accumulator-safe chunks (k = 600 on the 24-bit array) and one split over PEs (k = 2048, batch 1)
@pytest.mark.parametrize("xdtype,m,k,relu,bias,zx", [("int8", 5, 40, False, True, 5), ("uint8", 7, 600, True, True, 131),
                                                     ("int8", 3, 24, True, False, 0), ("int8", 1, 2048, False, True, -7)])
def test_dequantized_dense_bit_identical(xdtype, m, k, relu, bias, zx):
    """int8 dense with a float32 output (every :func:`tvm_spinn.quantize` model's GEMMs): the
    ``gemm_i8`` kernel's dequantizing epilogue in ``iss`` mode gives the default simulator's bits."""
    rng = np.random.default_rng(k + m)
    n = 19
    w = rng.integers(-127, 128, size=(k, n)).astype("int8")
    sw = rng.uniform(0.001, 0.01, size=n).astype("float32")
    zw = rng.integers(-3, 4, size=n).astype("int8")
    mod = qgemm_module((m, k), xdtype, w, sw, zw, 0.02, zx, op="dense", relu=relu, w_axis=1,
                       bias=rng.normal(size=n).astype("float32") if bias else None)
    (program,) = _int8_programs(mod)
    dense = _layer(program, "dense")
    assert dense.mode == "int8" and dense.attrs["out"] == "float32" and dense.attrs["relu"] == relu
    if k == 2048:
        from tvm_spinn.mapping.schedule import derive_tables
        table = derive_tables(program, program.arch)[program.layers.index(dense)]
        assert table.lo.shape[1] == 4 and (table.lo[:, 3] > 0).any()  # the reduction is split over PEs
    want = _assert_same_bits(program, _feed(rng, program))
    assert len(np.unique(want[0])) > n // 2  # not a constant output
    if relu:
        assert np.any(want[0] == 0) and not np.any(np.signbit(want[0]))


def test_dequantized_dense_extreme_scales_bit_identical():
    """The layer's scales and bias at the float32 extremes (set in the program's constants): the
    default simulator (native plan) follows the M4F's NaNs -- ``0 * inf`` and ``inf - inf``
    give 0x7FC00000 -- and ``iss`` mode executes them."""
    rng = np.random.default_rng(3)
    n, k = 16, 40
    w = rng.integers(-127, 128, size=(k, n)).astype("int8")
    mod = qgemm_module((6, k), "int8", w, rng.uniform(0.001, 0.01, size=n).astype("float32"),
                       np.zeros(n, "int8"), 0.02, 0, op="dense", w_axis=1, bias=rng.normal(size=n).astype("float32"))
    (program,) = _int8_programs(mod)
    dense = _layer(program, "dense")
    scale, bias = (program.constants[dense.consts[r]].copy() for r in ("scale", "bias"))
    scale[:8] = [0.0, -0.0, np.inf, -np.inf, 3.4e38, 1e-45, _f32(SNAN), -3.4e38]
    bias[:8] = [-0.0, -0.0, -np.inf, -np.inf, 3.4e38, np.inf, 1.0, _f32(QNAN)]
    program = dataclasses.replace(program, constants={**program.constants, dense.consts["scale"]: scale,
                                                      dense.consts["bias"]: bias})
    x = rng.integers(-128, 128, size=(6, k)).astype("int8")
    x[0] = 0  # zero sums: 0 * inf
    (want,) = _assert_same_bits(program, [x])
    bits = want.view(np.uint32)
    assert bits[0, 2] == 0x7FC00000 and np.any(bits[:, 3] == 0x7FC00000)  # 0 * inf, inf - inf
    assert bits[0, 1] == 0x80000000 and np.all(bits[:, 6] == SNAN | 0x00400000)


@pytest.mark.parametrize("xdtype,groups,per_channel,relu", [("int8", 1, True, True), ("uint8", 4, False, False)])
def test_dequantized_conv2d_bit_identical(xdtype, groups, per_channel, relu):
    """int8 conv2d with a float32 output (the tile transposed: its channels are the kernel's
    columns): per-channel or per-tensor scales and zero points, groups, ReLU."""
    rng = np.random.default_rng(11 + groups)
    cin, o = 8, 16
    x_shape = (1, cin, 9, 7)
    w = rng.integers(-127, 128, size=(o, cin // groups, 3, 3)).astype("int8")
    sw = rng.uniform(0.002, 0.02, size=o).astype("float32") if per_channel else np.float32(0.01)
    zw = rng.integers(-3, 4, size=np.shape(sw)).astype("int8")
    mod = qgemm_module(x_shape, xdtype, w, sw, zw, 0.02, 7 if xdtype == "int8" else 131, relu=relu,
                       bias=rng.normal(size=o).astype("float32"), conv_attrs=dict(strides=2, padding=1, groups=groups))
    (program,) = _int8_programs(mod)
    conv = _layer(program, "conv2d")
    assert conv.mode == "int8" and conv.attrs["out"] == "float32"
    _assert_same_bits(program, _feed(rng, program))


def test_dequantized_matmul_bit_identical():
    """int8 matmul of two uint8 activations (both zero points nonzero, batched) with a float32
    output."""
    rng = np.random.default_rng(8)
    mod = qgemm_module((2, 3, 16, 20), "uint8", None, 0.02, 140, 0.05, 90, op="matmul", wdtype="uint8",
                       b_shape=(2, 3, 20, 12))
    (program,) = _int8_programs(mod)
    assert _layer(program, "matmul").attrs["out"] == "float32"
    _assert_same_bits(program, _feed(rng, program))


@pytest.mark.parametrize("xdtype,ydtype,relu,cin,groups,per_channel", [
    ("int8", "int8", True, 6, 1, True), ("uint8", "uint8", False, 64, 1, True), ("int8", "int8", False, 12, 12, False)])
def test_tflite_requantized_conv2d_bit_identical(xdtype, ydtype, relu, cin, groups, per_channel):
    """int8 conv2d with TFLite's requantization (``rounding="tflite"``: the convolutions of a
    model from :func:`tvm_spinn.frontend.from_tflite`; TFLite's fully-connected layers round
    once): per-channel or per-tensor multipliers, zero points, ReLU as the clamp, uint8 in and
    out, a depthwise convolution, and a reduction of two accumulator-safe chunks (k = 576)."""
    rng = np.random.default_rng(31 + cin)
    zx = 5 if xdtype == "int8" else 131
    zy = -3 if ydtype == "int8" else 120
    o = 12
    w = rng.integers(-127, 128, size=(o, cin // groups, 3, 3)).astype("int8")
    sw = rng.uniform(0.002, 0.02, size=o).astype("float32") if per_channel else np.float32(0.01)
    mod = qgemm_module((1, cin, 8, 8), xdtype, w, sw, np.zeros(np.shape(sw), "int8"), 0.02, zx, relu=relu,
                       bias=rng.normal(size=o).astype("float32"), out=(0.1 * np.sqrt(cin // groups), zy, ydtype),
                       conv_attrs=dict(padding=1, groups=groups))
    (program,) = _int8_programs(mod, tflite=True)
    layer = _layer(program, "conv2d")
    assert layer.attrs.get("rounding") == "tflite" and layer.attrs["out"] == ydtype
    want = _assert_same_bits(program, _feed(rng, program))
    lo, hi = (-128, 127) if ydtype == "int8" else (0, 255)
    assert len(np.unique(want[0])) > 10 and np.any((want[0] > lo) & (want[0] < hi))


def _model_iss_same_bits(ex, inputs, monkeypatch) -> list:
    """The model's output called in ``iss`` mode (every spinn region's layers as PE code, each
    region run once) equals the default simulator's bit for bit; returns the int8 GEMM roles run."""
    import tvm

    import tvm_spinn.pe as pe
    from tvm_spinn.pe.firmware import programs_of
    from tvm_spinn.pe.roles import layer_role

    monkeypatch.delenv("TVM_SPINN_SIM_MODE", raising=False)
    programs = programs_of(ex)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    args = [tvm.runtime.tensor(x) for x in inputs]

    def outputs(res):
        return [r.numpy() for r in res] if isinstance(res, (list, tuple)) or hasattr(res, "__len__") and not hasattr(
            res, "numpy") else [res.numpy()]

    want = outputs(vm["main"](*args))
    calls = []
    real = pe.run_program_iss
    monkeypatch.setattr(pe, "run_program_iss", lambda p, i: calls.append(p.symbol) or real(p, i))
    with tvm_spinn.SpinnOptions(iss=True):
        got = outputs(vm["main"](*args))
    assert sorted(calls) == sorted(p.symbol for p in programs)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and w.shape == g.shape
        np.testing.assert_array_equal(w.view(np.uint8), g.view(np.uint8))
    return sorted({layer_role(p, i) for p in programs for i, layer in enumerate(p.layers) if layer.mode == "int8"})


def test_quantized_mlp_in_iss_mode_bit_identical(monkeypatch):
    """A :func:`tvm_spinn.quantize` model (an MLP: int8 dense layers requantized between them and
    the last one with a float32 output and its bias, quantize/dequantize, softmax) in ``iss`` mode."""
    import models

    model, x = models.make("mlp")
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    rng = np.random.default_rng(1)
    mod = tvm_spinn.quantize(mod, [rng.normal(size=tuple(x.shape)).astype("float32") for _ in range(4)])
    roles = _model_iss_same_bits(relax.build(mod, target="spinn"), [x.numpy()], monkeypatch)
    assert ("gemm_i8", "f32", False) in roles


@pytest.mark.slow  # ~40 s: the quantized CNN's convolutions and the transformer block's GEMMs in the ISS
@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_quantized_zoo_model_in_iss_mode_bit_identical(name, monkeypatch):
    """The small CNN and transformer block of the test models quantized by
    :func:`tvm_spinn.quantize` (int8 conv2d, depthwise conv2d, dense and matmul with float32
    outputs) in ``iss`` mode."""
    import models

    model, x = models.make(name)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    rng = np.random.default_rng(1)
    mod = tvm_spinn.quantize(mod, [rng.normal(size=tuple(x.shape)).astype("float32") for _ in range(4)])
    roles = _model_iss_same_bits(relax.build(mod, target="spinn"), [x.numpy()], monkeypatch)
    assert any(r[:2] == ("gemm_i8", "f32") for r in roles)


@pytest.mark.slow  # ~60 s: TensorFlow's converter, then every tile of the model in the ISS
def test_tflite_int8_cnn_in_iss_mode_bit_identical(monkeypatch):
    """The test zoo's TFLite int8 CNN (:func:`tflite_models.cnn`: TFLite-rounded convolutions, a
    depthwise one, a requantized dense, residual add, pools, concat, integer mean and softmax)
    in ``iss`` mode: every layer has PE code."""
    pytest.importorskip("tensorflow")
    pytest.importorskip("tflite")
    import tflite_models as tm
    from tvm_spinn.frontend.tflite import from_tflite, keras_to_tflite

    mod = from_tflite(keras_to_tflite(tm.cnn(), quantize=tm.calibration((16, 16, 3))))
    x = np.random.default_rng(2).integers(-128, 128, size=(1, 16, 16, 3)).astype("int8")
    roles = _model_iss_same_bits(relax.build(mod, target="spinn"), [x], monkeypatch)
    assert ("gemm_i8", "tflite") in roles and ("gemm_i8",) in roles


@pytest.mark.parametrize("length", [0, 3, 6, 7, 8, 10])
def test_dsp_table_rejects_consts_of_a_wrong_length(length):
    """Consts of a length not 5 + 4 * columns: one ValueError naming the function and both lengths."""
    with pytest.raises(ValueError, match=rf"i8_dsp_table.*expected .*got {length}$"):
        i8_dsp_table(np.zeros(length, np.int64))


def test_dsp_table_has_eight_words_per_column():
    """A valid length: eight words a column (zero columns: none)."""
    assert i8_dsp_table(np.zeros(5, np.int64)).shape == (0,)
    consts = np.array([1, 4, 0, -128, 127] + [2, 0, 1 << 30, 33] * 3, np.int64)
    table = i8_dsp_table(consts).reshape(3, 8)
    # c0 = K zx zw = 4 * 1 * 2, the multiplier, ra = 2**0 + 128 * 2, s = 1
    assert table[:, :4].tolist() == [[8, 1 << 30, 1 + (128 << 1), 1]] * 3
