"""Full-integer TFLite models (TensorFlow's own int8) on the MAC arrays, against tf.lite.Interpreter.

The semantics are those of TFLite's reference kernels (``OpResolverType.BUILTIN_REF``), against
which every integer output is compared exactly: convolutions requantize with TFLite's
``MultiplyByQuantizedMultiplier`` (``SaturatingRoundingDoublingHighMul`` then
``RoundingDivideByPOT``: ``rounding="tflite"`` in the program), fully-connected layers with one
rounding (the reference ``FULLY_CONNECTED`` kernel's, the default rule), quantized average pools
round half away from zero (``partition/nhwc.py``), ``SOFTMAX`` and ``MEAN`` are TFLite's integer
kernels (gemmlowp's fixed-point exp and reciprocal; the sum requantized with ``1 / n`` folded into
the multiplier: ``program/ops/rows.py``), exact against the reference and the optimized kernels.

Where TFLite's own kernels round differently from the reference, within one quantization step
(checked, with the count of differing elements printed):
- the default interpreter's optimized kernels without delegates (``BUILTIN_WITHOUT_DEFAULT_DELEGATES``):
  convolutions and fully-connected layers that go through ruy's GEMM requantize with a double
  rounding that breaks ties upwards (``(acc * M0 + 2**30) >> 31``, then ``(v + 2**(r-1)) >> r``)
  instead of away from zero; depthwise convolutions use the reference rule; an int8 ``MEAN``
  over H and W *with* ``keep_dims`` runs ``optimized_integer_ops::Mean`` (without it, the one
  Keras' ``GlobalAveragePooling2D`` emits, the reference kernel);
- the default interpreter (``AUTO``, with the XNNPACK delegate) requantizes in float32, ``MEAN``
  included (its ``SOFTMAX`` agrees exactly).
(``BUILTIN_REF`` aborts the process on MobileNetV2 *with* its classifier head in TF 2.21: the
test uses the feature extractor, 3 x 3 x 1280 outputs.)
"""

from __future__ import annotations

import dataclasses

import logging

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("tflite")
import keras  # noqa: E402

import tvm  # noqa: E402
import tvm_spinn  # noqa: E402,F401  (registers the spinn target)
from tvm import relax  # noqa: E402
from tvm_spinn.frontend.tflite import (  # noqa: E402
    TFLiteImportError, from_keras, from_tflite, keras_to_tflite,
)
import tflite_models as tm  # noqa: E402
from tvm_spinn.program import ProgramError  # noqa: E402
from tvm_spinn.program.format import Program  # noqa: E402
from tvm_spinn.program.quant import (  # noqa: E402
    quantize_multiplier, quantize_multiplier_tflite, requantize, requantize_tflite,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*tf.lite.Interpreter is deprecated:UserWarning")
L = keras.layers
#: interpreter kernels -> quantization steps they may differ by (see the module docstring)
_RESOLVERS = {"BUILTIN_REF": 0, "BUILTIN_WITHOUT_DEFAULT_DELEGATES": 1, "AUTO": 1}


def _by_shape(arrays) -> list[np.ndarray]:
    return sorted(arrays, key=lambda a: (a.size, a.shape))


def _run(mod, x, target="spinn") -> list[np.ndarray]:
    out = relax.VirtualMachine(relax.build(mod, target=target), tvm.cpu())["main"](tvm.runtime.tensor(x))
    return [o.numpy() for o in out] if isinstance(out, tvm.ir.Array) or not hasattr(out, "numpy") else [out.numpy()]


def _check_exact(buf: bytes, mod, inputs, steps=None, resolvers=None) -> dict:
    """Outputs equal to the reference kernels', within one step of the optimized ones;
    ``steps[k]`` (outputs in size order) allows that many steps against every kernel (listed
    where used). Returns {resolver: differing elements}."""
    resolvers = _RESOLVERS if resolvers is None else resolvers
    differ = dict.fromkeys(resolvers, 0)
    for x in inputs:
        got = _by_shape(_run(mod, x))
        for resolver, allowed in resolvers.items():
            want = _by_shape(tm.interpret(buf, x, resolver))
            assert [g.shape for g in got] == [w.shape for w in want]
            for k, (g, w) in enumerate(zip(got, want)):
                assert g.dtype == w.dtype
                step = max(allowed, (steps or {}).get(k, 0))
                diff = np.abs(g.astype(np.int64) - w.astype(np.int64))
                if step:
                    assert diff.max() <= step, (resolver, k, diff.max())
                else:
                    np.testing.assert_array_equal(g, w, err_msg=resolver)
                differ[resolver] += int(np.count_nonzero(diff))
    print("elements differing from tf.lite.Interpreter:", differ)
    return differ


def _summary(mod):
    return tvm_spinn.summarize_partition(tvm_spinn.partition_for_spinn(mod))


@pytest.fixture(scope="module")
def cnn_tflite() -> bytes:
    return keras_to_tflite(tm.cnn(), quantize=tm.calibration((16, 16, 3)))


def test_keras_cnn_matches_interpreter(cnn_tflite):
    mod = from_tflite(cnn_tflite)
    assert mod.attrs["spinn_quant_rounding"] == "tflite"
    summary = _summary(mod)
    ops = summary.offloaded_ops
    # every conv (depthwise included), the dense head, pools, add, mean and softmax run on the
    # MAC path with their requantization fused; one transpose in, one out (the NHWC output)
    assert ops["spinn.qconv2d_bias_requant_tflite"] + ops["spinn.qconv2d_bias_relu_requant_tflite"] == 5
    assert ops["spinn.qdense_bias_requant"] == 1  # FULLY_CONNECTED rounds once (relax_rewrites/folds.py)
    for kind in ("spinn.max_pool2d", "spinn.avg_pool2d", "spinn.add", "spinn.qmean_tflite", "spinn.qsoftmax_tflite"):
        assert ops.get(kind, 0) == 1, kind
    assert "spinn.mean" not in ops and "spinn.softmax" not in ops  # no float mean/softmax left
    assert ops["spinn.permute_dims"] == 2
    # the concat (of dequantized tensors) is offloaded where the movement family has concat
    assert set(summary.fallback_ops) <= {"relax.concat"}
    # both outputs (the head: mean, dense, softmax; the features) exact against the reference
    differ = _check_exact(cnn_tflite, mod, tm.integer_inputs(cnn_tflite, 3))
    assert differ["BUILTIN_REF"] == 0


def test_layers_record_the_tflite_rounding(cnn_tflite):
    programs = tvm_spinn.report(relax.build(from_tflite(cnn_tflite), target="spinn")).programs
    int8 = [(prog, layer) for prog in programs for layer in prog.layers
            if layer.mode == "int8" and layer.attrs["out"] != "float32"]
    rules = sorted((layer.kind, layer.attrs.get("rounding", "half_up")) for _, layer in int8)
    assert rules == [("conv2d", "tflite")] * 5 + [("dense", "half_up")]
    # TFLite's integer mean and softmax run on the M4F with int8 tensors in and out
    rows = sorted((layer.kind, layer.attrs.get("rounding"), prog.tensors[layer.output].dtype)
                  for prog in programs for layer in prog.layers if layer.kind in ("mean", "softmax"))
    assert rows == [("mean", "tflite", "int8"), ("softmax", "tflite", "int8")]
    # their parameters are validated when a program is read
    prog, layer = next((p, layer) for p in programs for layer in p.layers if layer.kind == "softmax")
    prog = _with_attrs(prog, layer, {k: v for k, v in layer.attrs.items() if k != "diff_min"})
    with pytest.raises(ProgramError, match=r"missing key\(s\) \['diff_min'\]"):
        Program.from_bytes(prog.to_bytes())
    # the rule is validated when a program is read
    prog, layer = next((p, layer) for p, layer in int8 if layer.kind == "conv2d")
    prog = _with_attrs(prog, layer, {**layer.attrs, "rounding": "nearest"})
    with pytest.raises(ProgramError, match="rounding"):
        Program.from_bytes(prog.to_bytes())


def _with_attrs(program, layer, attrs):
    """``program`` with ``layer``'s attrs replaced (layers are read-only: a new program)."""
    return dataclasses.replace(program, layers=[dataclasses.replace(x, attrs=attrs) if x is layer else x
                                                for x in program.layers])


def test_dense_network_matches_interpreter():
    model = tm.mlp()
    rep = tm.calibration((32,), count=32, seed=2, normal=True)
    mod = from_keras(model, quantize=rep)
    # (the ReLUs' calibrated ranges start at 0: zero point -128, the clamp is the type's own)
    assert _summary(mod).offloaded_ops == {"spinn.qdense_bias_requant": 3}
    buf = keras_to_tflite(model, quantize=rep)
    _check_exact(buf, mod, tm.integer_inputs(buf, 4))


@pytest.mark.slow  # ~60 s: the converter alone takes ~25 s
def test_mobilenet_v2_matches_interpreter():
    model = tm.mobilenet_v2()
    rep = tm.calibration((96, 96, 3), count=8, seed=3)
    buf = keras_to_tflite(model, quantize=rep)
    mod = from_tflite(buf)
    summary = _summary(mod)
    assert summary.fallback_ops == {} and summary.regions == 1
    assert summary.offloaded_ops["spinn.permute_dims"] == 2  # the input and the NHWC output
    convs = sum(n for k, n in summary.offloaded_ops.items() if k.startswith("spinn.qconv2d"))
    assert convs == 52
    # exact against the reference kernels; the optimized ones differ by one step in some layers,
    # which 52 layers compound (2 steps at most seen)
    differ = _check_exact(buf, mod, tm.integer_inputs(buf, 1),
                          resolvers={"BUILTIN_REF": 0, "BUILTIN_WITHOUT_DEFAULT_DELEGATES": 3, "AUTO": 3})
    assert differ["BUILTIN_REF"] == 0


def _rows_inputs(buf: bytes, count: int) -> list[np.ndarray]:
    """Random inputs over the whole int8 range, and one whose rows stay near their maximum (the
    exp's fine range, where every difference is above ``diff_min``)."""
    inputs = tm.integer_inputs(buf, count)
    near = np.random.default_rng(11).integers(96, 128, size=inputs[0].shape).astype(inputs[0].dtype)
    return inputs + [near]


def _check_op_model(buf: bytes, composite: str, resolvers: dict, monkeypatch) -> None:
    mod = from_tflite(buf)
    ops = _summary(mod).offloaded_ops
    assert ops == {composite: 1}, ops
    inputs = _rows_inputs(buf, 3)
    _check_exact(buf, mod, inputs, resolvers=resolvers)
    # tile by tile (rows split across PEs): the same bits
    whole = _run(mod, inputs[0])[0]
    monkeypatch.setenv("TVM_SPINN_SIM_MODE", "tiles")
    np.testing.assert_array_equal(_run(mod, inputs[0])[0], whole)


_EXACT = {"BUILTIN_REF": 0, "BUILTIN_WITHOUT_DEFAULT_DELEGATES": 0}


# (rows, row length), calibration spread: input scales from ~0.003 to ~0.6 (the int8 softmax's
# multiplier, left shift and diff_min all change with the scale)
@pytest.mark.parametrize("shape, spread", [
    ((16, 10), 1.0),
    pytest.param((8, 37), 0.1, marks=pytest.mark.slow),
    pytest.param((4, 5), 30.0, marks=pytest.mark.slow),
    pytest.param((2, 300), 4.0, marks=pytest.mark.slow),
])
def test_softmax_matches_interpreter(shape, spread, monkeypatch):
    buf = keras_to_tflite(tm.softmax(shape), quantize=tm.calibration(shape, normal=True) * spread)
    # XNNPACK (AUTO) leaves the int8 softmax to TFLite's kernel: exact there too
    _check_op_model(buf, "spinn.qsoftmax_tflite", dict(_EXACT, AUTO=0), monkeypatch)


# (channels, H, W), calibration spread and offset (the output's scale and zero point differ from
# the input's), keep_dims
@pytest.mark.parametrize("shape, spread, keepdims", [
    ((24, 5, 7), 2.0, False),
    pytest.param((16, 3, 3), 0.5, True, marks=pytest.mark.slow),
    pytest.param((8, 16, 16), 1.0, False, marks=pytest.mark.slow),
    pytest.param((32, 1, 9), 8.0, True, marks=pytest.mark.slow),
])
def test_mean_matches_interpreter(shape, spread, keepdims, monkeypatch):
    rep = tm.calibration(shape, normal=True) * spread + 0.3
    buf = keras_to_tflite(tm.mean(shape, keepdims), quantize=rep)
    # XNNPACK (AUTO) runs MEAN itself, requantizing in float: within one step
    _check_op_model(buf, "spinn.qmean_tflite", dict(_EXACT, AUTO=1), monkeypatch)


def test_tflite_rows_need_a_tflite_module(cnn_tflite):
    """The integer softmax/mean patterns are TFLite's arithmetic: a QDQ module without the
    TFLite marker (ONNX, PTQ) keeps the float ops between its quantize/dequantize pairs."""
    mod = from_tflite(cnn_tflite).without_attr("spinn_quant_rounding")
    ops = _summary(mod).offloaded_ops
    assert ops.get("spinn.mean") == 1 and ops.get("spinn.softmax") == 1
    assert not any(name.endswith("_tflite") for name in ops)


@pytest.mark.parametrize("io_dtype", ["uint8", pytest.param("float32", marks=pytest.mark.slow)])
def test_io_types(io_dtype):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 3)), L.Conv2D(4, 3, activation="relu"), L.Flatten(), L.Dense(5)],
                             name=f"io_{io_dtype}")
    tm.randomize(model)
    rep = np.random.default_rng(4).random((8, 8, 8, 3), dtype=np.float32)
    buf = keras_to_tflite(model, quantize=rep, io_dtype=io_dtype)
    mod = from_tflite(buf)
    (param,) = mod["main"].params
    assert str(param.ty.dtype) == io_dtype
    ops = _summary(mod).offloaded_ops
    assert ops.get("spinn.qconv2d_bias_relu_requant_tflite", 0) + ops.get("spinn.qconv2d_bias_requant_tflite", 0) == 1
    if io_dtype == "float32":
        # float edges: TFLite's QUANTIZE rounds x / s half away from zero, relax.quantize half to
        # even; random inputs avoid exact ties, so the integers and outputs agree exactly
        x = np.random.default_rng(5).random((1, 8, 8, 3), dtype=np.float32)
        got = _run(mod, x)[0]
        for resolver in _RESOLVERS:
            np.testing.assert_array_equal(got, tm.interpret(buf, x, resolver)[0])
    else:
        _check_exact(buf, mod, tm.integer_inputs(buf, 2))


def _convert_uint8_v1(graph, x, outputs) -> bytes:
    """The v1 converter's legacy uint8 model of ``graph`` (input ``x``): ``inference_type=uint8``,
    input stats (128, 127), default ranges (0, 6)."""
    tf1 = tf.compat.v1
    with tf1.Session(graph=graph) as sess:
        converter = tf1.lite.TFLiteConverter.from_session(sess, [x], outputs)
        converter.inference_type = tf.uint8
        converter.quantized_input_stats = {"input": (128.0, 127.0)}
        converter.default_ranges_stats = (0, 6)
        return converter.convert()


def _legacy_uint8_tflite() -> bytes:
    """A TF1-style uint8 model (uint8 activations, per-tensor uint8 weights with zero points),
    made with the v1 converter's ``inference_type=uint8`` and default ranges."""
    tf1 = tf.compat.v1
    rng = np.random.default_rng(9)
    graph = tf1.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, (1, 8, 8, 3), name="input")
        w = tf.constant(rng.normal(0, 0.3, (3, 3, 3, 8)).astype("float32"))
        b = tf.constant(rng.normal(0, 0.3, (8,)).astype("float32"))
        y = tf.nn.relu6(tf.nn.bias_add(tf.nn.conv2d(x, w, 1, "SAME"), b))
        wd = tf.constant(rng.normal(0, 0.3, (3, 3, 8, 1)).astype("float32"))
        y = tf.reshape(tf.nn.relu6(tf.nn.depthwise_conv2d(y, wd, [1, 1, 1, 1], "VALID")), (1, -1))
        features = tf.identity(y, name="features")
        logits = tf.identity(tf.matmul(y, tf.constant(rng.normal(0, 0.1, (288, 10)).astype("float32"))),
                             name="logits")
    return _convert_uint8_v1(graph, x, [features, logits])


def test_legacy_uint8_model():
    buf = _legacy_uint8_tflite()
    mod = from_tflite(buf)
    assert str(mod["main"].params[0].ty.dtype) == "uint8"
    ops = _summary(mod).offloaded_ops
    assert ops["spinn.qconv2d_bias_requant_tflite"] == 2 and ops["spinn.qdense_requant"] == 1
    _check_exact(buf, mod, tm.integer_inputs(buf, 3))


def _legacy_uint8_head_tflite() -> bytes:
    """A TF1-style uint8 classifier head: conv, ``reduce_mean`` over H and W (uint8 MEAN with the
    same input and output parameters), matmul, softmax (uint8 SOFTMAX: scale 1/256, zero point 0)."""
    tf1 = tf.compat.v1
    rng = np.random.default_rng(10)
    graph = tf1.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, (1, 8, 8, 3), name="input")
        y = tf.nn.relu6(tf.nn.conv2d(x, tf.constant(rng.normal(0, 0.3, (3, 3, 3, 32)).astype("float32")), 1, "SAME"))
        pooled = tf.reduce_mean(y, axis=[1, 2])
        logits = tf.matmul(pooled, tf.constant(rng.normal(0, 0.5, (32, 10)).astype("float32")))
        outputs = [tf.identity(pooled, name="pooled"), tf.identity(tf.nn.softmax(logits), name="prob")]
    return _convert_uint8_v1(graph, x, outputs)


def test_legacy_uint8_mean_and_softmax():
    buf = _legacy_uint8_head_tflite()
    mod = from_tflite(buf)
    ops = _summary(mod).offloaded_ops
    assert ops["spinn.qmean_tflite"] == 1 and ops["spinn.qsoftmax_tflite"] == 1
    _check_exact(buf, mod, tm.integer_inputs(buf, 6), resolvers=_EXACT)


# -- the requantization rules ------------------------------------------------------------------
def _gemmlowp(acc: int, m0: int, exp: int) -> int:
    """TFLite's MultiplyByQuantizedMultiplier with Python integers (C semantics spelled out)."""
    left, right = max(exp, 0), max(-exp, 0)
    a = acc * (1 << left)
    ab = a * m0
    nudge = (1 << 30) if ab >= 0 else 1 - (1 << 30)
    high = abs(ab + nudge) >> 31
    high = high if ab + nudge >= 0 else -high  # C division truncates toward zero
    mask = (1 << right) - 1
    remainder, threshold = high & mask, (mask >> 1) + (1 if high < 0 else 0)
    return (high >> right) + (1 if remainder > threshold else 0)


def test_requantize_tflite_matches_the_gemmlowp_formulas():
    rng = np.random.default_rng(6)
    mults = np.exp(rng.uniform(np.log(2.0 ** -20), np.log(1.9), 400))
    accs = rng.integers(-(1 << 24), 1 << 24, 400)
    for m, acc in zip(mults, accs):
        m0, shift = quantize_multiplier_tflite(float(m))
        assert 1 << 30 <= m0 < 1 << 31 and abs(m0 * 2.0 ** -shift - m) <= m * 2.0 ** -30
        got = int(requantize_tflite(int(acc), m0, shift, 0, -(1 << 40), 1 << 40))
        assert got == _gemmlowp(int(acc), m0, 31 - shift), (m, acc)


def test_the_two_rules_differ_on_ties():
    # M = 0.25 (M0 = 2**30, a right shift by 1 after the doubling high multiply): acc * M is a
    # tie for acc = 2 mod 4; TFLite rounds the ties away from zero, the default rule up
    m0, shift = quantize_multiplier_tflite(0.25)
    assert (m0, shift) == quantize_multiplier(0.25)
    acc = np.array([-10, -6, -2, 2, 6, 10])
    np.testing.assert_array_equal(requantize_tflite(acc, m0, shift, 0, -128, 127), [-3, -2, -1, 1, 2, 3])
    np.testing.assert_array_equal(requantize(acc, m0, shift, 0, -128, 127), [-2, -1, 0, 1, 2, 3])
    # double rounding (a 1x1 conv of the test CNN): -6369 * M = -23.498, the high multiply gives
    # -6016 = -23.5 * 256 and the shift rounds that away from zero
    m0, shift = quantize_multiplier_tflite(0.0036894420627504587)
    assert int(requantize_tflite(-6369, m0, shift, 0, -128, 127)) == -24
    assert int(requantize(-6369, m0, shift, 0, -128, 127)) == -23
    # the multiplier's mantissa: TFLite rounds ties away from zero, Python's round() to even
    tie = (2 ** 30 + 0.5) / 2 ** 31
    assert quantize_multiplier_tflite(tie)[0] == 2 ** 30 + 1 and quantize_multiplier(tie)[0] == 2 ** 30


# -- unsupported schemes -----------------------------------------------------------------------
def _small() -> keras.Model:
    # the dense weight has >= 1024 elements: the converter leaves smaller tensors in float
    # under dynamic-range quantization
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8, 8, 3)), L.Conv2D(4, 3), L.Flatten(), L.Dense(32)], name="small")


def _convert(model, **settings) -> bytes:
    inp = keras.Input(batch_shape=(1, 8, 8, 3))
    static = keras.Model(inp, model(inp))
    converter = tf.lite.TFLiteConverter.from_keras_model(static)
    for key, value in settings.items():
        if key == "supported_types":
            converter.target_spec.supported_types = value
        elif key == "supported_ops":
            converter.target_spec.supported_ops = value
        else:
            setattr(converter, key, value)
    return converter.convert()


def _rep():
    data = np.random.default_rng(7).random((4, 1, 8, 8, 3), dtype=np.float32)
    return lambda: ([d] for d in data)


def test_int16x8_is_refused():
    buf = _convert(_small(), optimizations=[tf.lite.Optimize.DEFAULT], representative_dataset=_rep(),
                   supported_ops=[tf.lite.OpsSet.EXPERIMENTAL_TFLITE_BUILTINS_ACTIVATIONS_INT16_WEIGHTS_INT8])
    with pytest.raises(TFLiteImportError, match=r"tensor '.+' .* type INT16 .*int16x8"):
        from_tflite(buf)


def test_hybrid_dynamic_range_is_refused():
    buf = _convert(_small(), optimizations=[tf.lite.Optimize.DEFAULT])  # no representative data
    with pytest.raises(TFLiteImportError, match=r"tensor '.+' .* INT8 weight of .* dynamic-range"):
        from_tflite(buf)


def test_float16_weights_fall_back_to_float32():
    """Documented fallback: float16 weights are widened to float32; the model runs in fp32."""
    model = _small()
    buf = _convert(model, optimizations=[tf.lite.Optimize.DEFAULT], supported_types=[tf.float16])
    mod = from_tflite(buf)
    assert "spinn_quant_rounding" not in mod.attrs
    x = np.random.default_rng(8).random((1, 8, 8, 3), dtype=np.float32)
    want = tm.interpret(buf, x, "BUILTIN_WITHOUT_DEFAULT_DELEGATES")[0]
    np.testing.assert_allclose(_run(mod, x)[0], want, rtol=1e-4, atol=1e-5)
    assert _summary(mod).offloaded_ops.get("spinn.dense", 0) + _summary(mod).offloaded_ops.get("spinn.dense_bias", 0) == 1


def test_bad_representative_data():
    with pytest.raises(ValueError, match="representative sample shape"):
        keras_to_tflite(_small(), quantize=np.zeros((2, 4, 4, 3), np.float32))
    with pytest.raises(ValueError, match="empty"):
        keras_to_tflite(_small(), quantize=[])
    with pytest.raises(ValueError, match="io_dtype"):
        keras_to_tflite(_small(), quantize=np.zeros((2, 8, 8, 3), np.float32), io_dtype="int16")



@pytest.fixture(autouse=True)
def _no_fallback_notes():
    """The int8 concat's fallback note, hidden for this module's tests only (a level set at
    import would hide the logger from every later test of the session)."""
    logger = logging.getLogger("tvm_spinn.partition")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)
