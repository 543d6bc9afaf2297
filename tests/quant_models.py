"""Small float ONNX models and their onnxruntime-quantized versions (helper module, no tests).

Used by ``tests/frontend/test_onnx_quant.py`` and meant to be reused by benchmarks and tutorials. Everything
is deterministic: weights come from ``numpy.random.default_rng(seed)`` and calibration inputs
from :func:`calib_inputs` with a fixed seed, and the models are built with ``onnx.helper`` (no
exporter involved, so the graph is the same on every run).

Typical use::

    import quant_models as qm
    f = qm.float_cnn(tmp / "cnn.onnx")
    q = qm.ort_quantize(f, tmp / "cnn_qdq.onnx", qm.calib_inputs(f), per_channel=True)
    out = qm.ort_run(q, qm.calib_inputs(f, n=1, seed=123)[0])

All models are saved with ``ir_version=9`` (onnxruntime 1.31 rejects the IR 14 onnx 1.23 writes by
default) and opset 17.
"""

from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple, Union

import numpy as np
import onnx
import onnx.version_converter
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "CNN_INPUT_SHAPE",
    "MLP_INPUT_SHAPE",
    "VARIANTS",
    "BENCH_VARIANTS",
    "float_cnn",
    "float_mlp",
    "calib_inputs",
    "ort_quantize",
    "quantized_cnn",
    "quantized_mlp",
    "output_step",
    "ort_run",
    "save",
]

PathLike = Union[str, "os.PathLike[str]"]

OPSET = 17
IR_VERSION = 9

CNN_INPUT_SHAPE = (1, 3, 16, 16)
MLP_INPUT_SHAPE = (4, 32)

#: Named ``ort_quantize`` keyword sets covering the schemes the importer must accept.
VARIANTS: Dict[str, dict] = {
    "qdq_tensor_u8_asym": dict(fmt="QDQ", per_channel=False, activation_type="uint8",
                               symmetric_activations=False),
    "qdq_channel_u8_asym": dict(fmt="QDQ", per_channel=True, activation_type="uint8",
                                symmetric_activations=False),
    "qdq_tensor_s8_sym": dict(fmt="QDQ", per_channel=False, activation_type="int8",
                              symmetric_activations=True),
    "qdq_channel_s8_asym": dict(fmt="QDQ", per_channel=True, activation_type="int8",
                                symmetric_activations=False),
    "qdq_channel_s8_sym_asymw": dict(fmt="QDQ", per_channel=True, activation_type="int8",
                                     symmetric_activations=True, symmetric_weights=False),
    "qop_tensor_u8_asym": dict(fmt="QOperator", per_channel=False, activation_type="uint8",
                               symmetric_activations=False),
    "qop_channel_s8_asym": dict(fmt="QOperator", per_channel=True, activation_type="int8",
                                symmetric_activations=False),
}


#: ``(label, ort_quantize kwargs)`` pairs, in a stable order (for benchmarks and tables).
BENCH_VARIANTS = list(VARIANTS.items())


def save(model: onnx.ModelProto, path: PathLike) -> str:
    """Save ``model`` with ``ir_version=9`` after ``onnx.checker``; return the path as ``str``."""
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    path = os.fspath(path)
    onnx.save(model, path)
    return path


def _he(rng: np.random.Generator, shape: Sequence[int], fan_in: int) -> np.ndarray:
    return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)


def _bias(rng: np.random.Generator, n: int) -> np.ndarray:
    return (rng.standard_normal(n) * 0.1).astype(np.float32)


def _finish(nodes, inits, inp, out_name, out_shape, name, path):
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info(inp[0], TensorProto.FLOAT, inp[1])],
        [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, out_shape)],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="tvm_spinn.tests.quant_models")
    model = onnx.shape_inference.infer_shapes(model)
    return save(model, path)


def float_cnn(path: PathLike, seed: int = 0) -> str:
    """A small float CNN (input ``x`` of :data:`CNN_INPUT_SHAPE`, output ``logits`` (1, 10)).

    ``Conv 3->8 k3 p1 + Relu`` -> ``Conv 8->16 k3 s2 p1 + Relu`` -> ``Conv 16->16 k3 p1`` ->
    residual ``Add`` + ``Relu`` -> depthwise ``Conv 16 k3 p1 group 16 + Relu`` ->
    ``GlobalAveragePool`` -> ``Flatten`` -> ``Gemm(transB=1)`` (as torch exports ``nn.Linear``).

    Returns the path it was saved to.
    """
    rng = np.random.default_rng(seed)
    inits = {
        "w1": _he(rng, (8, 3, 3, 3), 27), "b1": _bias(rng, 8),
        "w2": _he(rng, (16, 8, 3, 3), 72), "b2": _bias(rng, 16),
        "w3": _he(rng, (16, 16, 3, 3), 144), "b3": _bias(rng, 16),
        "w4": _he(rng, (16, 1, 3, 3), 9), "b4": _bias(rng, 16),
        "fc_w": _he(rng, (10, 16), 16), "fc_b": _bias(rng, 10),
    }
    p1 = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", **p1),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", strides=[2, 2], **p1),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], name="conv3", **p1),
        helper.make_node("Add", ["c3", "r2"], ["s3"], name="residual"),
        helper.make_node("Relu", ["s3"], ["r3"], name="relu3"),
        helper.make_node("Conv", ["r3", "w4", "b4"], ["c4"], name="dwconv", group=16, **p1),
        helper.make_node("Relu", ["c4"], ["r4"], name="relu4"),
        helper.make_node("GlobalAveragePool", ["r4"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], name="fc", transB=1),
    ]
    return _finish(nodes, inits, ("x", CNN_INPUT_SHAPE), "logits", (1, 10), "float_cnn", path)


def float_mlp(path: PathLike, seed: int = 0) -> str:
    """A small float MLP with one activation x activation MatMul.

    Input ``x`` of :data:`MLP_INPUT_SHAPE` (4, 32); output ``y`` (4, 4)::

        h1 = Relu(MatMul(x, w1[32, 64]) + b1)
        h2 = Relu(MatMul(h1, w2[64, 32]) + b2)
        q  = MatMul(h2, wq[32, 16]);  k = MatMul(h2, wk[32, 16])
        y  = MatMul(q, Transpose(k))          # activation x activation

    Returns the path it was saved to.
    """
    rng = np.random.default_rng(seed)
    inits = {
        "w1": _he(rng, (32, 64), 32), "b1": _bias(rng, 64),
        "w2": _he(rng, (64, 32), 64), "b2": _bias(rng, 32),
        "wq": _he(rng, (32, 16), 32), "wk": _he(rng, (32, 16), 32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"], name="fc1"),
        helper.make_node("Add", ["m1", "b1"], ["a1"], name="fc1_bias"),
        helper.make_node("Relu", ["a1"], ["h1"], name="relu1"),
        helper.make_node("MatMul", ["h1", "w2"], ["m2"], name="fc2"),
        helper.make_node("Add", ["m2", "b2"], ["a2"], name="fc2_bias"),
        helper.make_node("Relu", ["a2"], ["h2"], name="relu2"),
        helper.make_node("MatMul", ["h2", "wq"], ["q"], name="proj_q"),
        helper.make_node("MatMul", ["h2", "wk"], ["k"], name="proj_k"),
        helper.make_node("Transpose", ["k"], ["kt"], name="k_t", perm=[1, 0]),
        helper.make_node("MatMul", ["q", "kt"], ["y"], name="scores"),
    ]
    return _finish(nodes, inits, ("x", MLP_INPUT_SHAPE), "y", (4, 4), "float_mlp", path)


def _input_specs(model: onnx.ModelProto):
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = tuple(int(d.dim_value) for d in tt.shape.dim)
        specs.append((vi.name, shape, helper.tensor_dtype_to_np_dtype(tt.elem_type)))
    return specs


def _as_model(model_or_path) -> onnx.ModelProto:
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path
    return onnx.load(os.fspath(model_or_path))


def calib_inputs(model_or_path, n: int = 8, seed: int = 0) -> List[Dict[str, np.ndarray]]:
    """``n`` seeded feed dicts (standard normal float32) for the model's graph inputs."""
    model = _as_model(model_or_path)
    rng = np.random.default_rng(seed)
    return [{name: rng.standard_normal(shape).astype(dtype)
             for name, shape, dtype in _input_specs(model)} for _ in range(n)]


class _Reader:
    """``onnxruntime.quantization.CalibrationDataReader`` over a fixed list of feed dicts."""

    def __init__(self, feeds):
        self._feeds = [dict(f) for f in feeds]
        self._it = iter(self._feeds)

    def get_next(self):
        return next(self._it, None)

    def rewind(self):
        self._it = iter(self._feeds)


def ort_quantize(float_path: PathLike, out_path: PathLike,
                 calib_inputs: Sequence[Dict[str, np.ndarray]], *, fmt: str = "QDQ",
                 per_channel: bool = False, activation_type: str = "uint8",
                 symmetric_activations: bool = False, symmetric_weights: bool = True,
                 weight_type: str = "int8") -> str:
    """Quantize a float model with ``onnxruntime.quantization.quantize_static`` (MinMax).

    Parameters
    ----------
    float_path, out_path : path
        Float model in, quantized model out (re-saved with ``ir_version=9``).
    calib_inputs : sequence of dict
        Calibration feeds (e.g. :func:`calib_inputs`).
    fmt : ``"QDQ"`` or ``"QOperator"``
        QDQ inserts QuantizeLinear/DequantizeLinear pairs around float ops; QOperator writes
        QLinearConv/QLinearMatMul/QLinearAdd... operators.
    per_channel : bool
        Per-output-channel weight scales (Conv axis 0, MatMul/Gemm per column).
    activation_type, weight_type : ``"uint8"`` or ``"int8"``
    symmetric_activations, symmetric_weights : bool
        ``ActivationSymmetric`` / ``WeightSymmetric`` (symmetric: zero point 0 for int8, 128 for
        uint8).

    Returns
    -------
    str
        ``out_path``.
    """
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    qtypes = {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8}
    formats = {"QDQ": QuantFormat.QDQ, "QOperator": QuantFormat.QOperator}
    if fmt not in formats:
        raise ValueError(f"fmt must be 'QDQ' or 'QOperator', got {fmt!r}")
    if activation_type not in qtypes or weight_type not in qtypes:
        raise ValueError(f"activation_type/weight_type must be 'uint8' or 'int8', "
                         f"got {activation_type!r}/{weight_type!r}")
    out_path = os.fspath(out_path)
    quantize_static(
        os.fspath(float_path), out_path, _Reader(calib_inputs),
        quant_format=formats[fmt], per_channel=per_channel,
        activation_type=qtypes[activation_type], weight_type=qtypes[weight_type],
        extra_options={"ActivationSymmetric": bool(symmetric_activations),
                       "WeightSymmetric": bool(symmetric_weights)},
    )
    return save(onnx.load(out_path), out_path)


def _quantized(builder, name, directory, n_calib, n_eval, seed, quant_kwargs):
    directory = os.fspath(directory)
    f = builder(os.path.join(directory, f"{name}_float.onnx"), seed=seed)
    label = "_".join(f"{k}-{v}" for k, v in sorted(quant_kwargs.items())) or "default"
    q = ort_quantize(f, os.path.join(directory, f"{name}_{label}.onnx"),
                     calib_inputs(f, n=n_calib, seed=seed), **quant_kwargs)
    name_in = _input_specs(onnx.load(f))[0][0]
    evals = [feed[name_in] for feed in calib_inputs(f, n=n_eval, seed=seed + 1000)]
    return q, evals


def quantized_cnn(directory: PathLike, *, n_calib: int = 8, n_eval: int = 8, seed: int = 0,
                  **quant_kwargs) -> Tuple[str, List[np.ndarray]]:
    """:func:`float_cnn` quantized by :func:`ort_quantize` (``quant_kwargs``) in ``directory``.

    Returns ``(path, eval_inputs)``: the quantized model's path and ``n_eval`` seeded inputs
    (arrays for the single input ``x``) distinct from the ``n_calib`` calibration inputs.
    """
    return _quantized(float_cnn, "cnn", directory, n_calib, n_eval, seed, quant_kwargs)


def quantized_mlp(directory: PathLike, *, n_calib: int = 8, n_eval: int = 8, seed: int = 0,
                  **quant_kwargs) -> Tuple[str, List[np.ndarray]]:
    """:func:`float_mlp` quantized like :func:`quantized_cnn`; returns ``(path, eval_inputs)``."""
    return _quantized(float_mlp, "mlp", directory, n_calib, n_eval, seed, quant_kwargs)


def output_step(model_or_path, output: int = 0) -> float:
    """Quantization step (scale) of a quantized model's float output: the scale of the
    ``DequantizeLinear`` producing graph output ``output`` (per-tensor scales only)."""
    model = _as_model(model_or_path)
    name = model.graph.output[output].name
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.output[0] == name:
            return float(np.asarray(inits[node.input[1]]).reshape(-1)[0])
    raise ValueError(f"graph output {name!r} is not produced by a DequantizeLinear")


def ort_run(model_or_path, feeds: Dict[str, np.ndarray],
            disable_optimizations: bool = False) -> List[np.ndarray]:
    """Run a model on onnxruntime's CPU provider; returns the list of outputs.

    ``disable_optimizations=True`` runs the graph as written (no QDQ fusion into integer kernels).
    """
    import onnxruntime as ort

    model = _as_model(model_or_path)
    if model.ir_version > IR_VERSION:
        m = onnx.ModelProto()
        m.CopyFrom(model)
        m.ir_version = IR_VERSION
        model = m
    opts = ort.SessionOptions()
    if disable_optimizations:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    return sess.run(None, dict(feeds))


def _requantize(real: np.ndarray, scale, zero_point) -> np.ndarray:
    """ONNX QuantizeLinear: round half to even, add the zero point, saturate to its type."""
    info = np.iinfo(zero_point.dtype)
    q = np.round(real / np.float32(scale)) + zero_point.astype(np.float64)
    return np.clip(q, info.min, info.max).astype(zero_point.dtype)


def _dequantize(q: np.ndarray, scale, zero_point) -> np.ndarray:
    return (q.astype(np.float64) - zero_point.astype(np.float64)) * np.float64(scale)


def _ms_ops():
    """numpy versions of the com.microsoft QOperator ops onnxruntime's quantizer writes, from
    their contrib-op specs (QLinearAdd, QLinearGlobalAveragePool, QGemm, and the ones of
    :func:`_ms_ops_more`), for onnx's
    ReferenceEvaluator (which implements the standard QLinearConv/QLinearMatMul itself)."""
    from onnx.reference.op_run import OpRun

    class QLinearAdd(OpRun):
        op_domain = "com.microsoft"

        def _run(self, a, a_s, a_zp, b, b_s, b_zp, c_s, c_zp):
            return (_requantize(_dequantize(a, a_s, a_zp) + _dequantize(b, b_s, b_zp),
                                c_s, c_zp),)

    class QLinearGlobalAveragePool(OpRun):
        op_domain = "com.microsoft"

        def _run(self, x, x_s, x_zp, y_s, y_zp, channels_last=0):
            axes = (1, 2) if channels_last else tuple(range(2, x.ndim))
            mean = _dequantize(x, x_s, x_zp).mean(axis=axes, keepdims=True)
            return (_requantize(mean, y_s, y_zp),)

    class QGemm(OpRun):
        op_domain = "com.microsoft"

        def _run(self, a, a_s, a_zp, b, b_s, b_zp, c=None, y_s=None, y_zp=None,
                 alpha=1.0, transA=0, transB=0):
            a_r = _dequantize(a, a_s, a_zp)
            b_zp_ = b_zp.reshape(-1, 1) if (transB and b_zp.size > 1) else b_zp
            b_s_ = np.asarray(b_s).reshape(-1, 1) if (transB and np.size(b_s) > 1) else b_s
            b_r = _dequantize(b, b_s_, b_zp_)
            a_r = a_r.T if transA else a_r
            b_r = b_r.T if transB else b_r
            y = a_r @ b_r
            if c is not None:  # int32, scale alpha * a_scale * b_scale: added before alpha
                y = y + c.astype(np.float64) * np.float64(a_s) * np.asarray(b_s, np.float64)
            y = alpha * y
            if y_s is None:
                return (y.astype(np.float32),)
            return (_requantize(y, y_s, y_zp),)

    return [QLinearAdd, QLinearGlobalAveragePool, QGemm, *_ms_ops_more(OpRun)]


def onnx_reference_run(model_or_path, feeds: Dict[str, np.ndarray]) -> List[np.ndarray]:
    """Run a quantized model with onnx's ReferenceEvaluator (numpy; no CPU-specific kernels).

    The reference for QOperator models on CPUs where onnxruntime's int8 kernels are not exact
    (its integer ops run on those kernels even with graph optimizations disabled).
    """
    from onnx.reference import ReferenceEvaluator

    model = _as_model(model_or_path)
    # The evaluator implements Q/DQ from opset 19 on; 17 -> 21 changes nothing these models use.
    model = onnx.version_converter.convert_version(model, 21)
    return ReferenceEvaluator(model, new_ops=_ms_ops()).run(None, feeds)


def _zp(zero_point, like: np.ndarray) -> np.ndarray:
    """A contrib op's optional zero point: 0 of the quantized input's type when absent."""
    return np.zeros((), like.dtype) if zero_point is None else zero_point


def _ms_ops_more(OpRun):
    """The elementwise/pooling/softmax com.microsoft QOperator ops (QLinearMul, QLinearSigmoid,
    QLinearLeakyRelu, QLinearConcat, QLinearAveragePool, QLinearSoftmax), from their contrib-op
    specs: dequantize the inputs, compute in float64, requantize (round half to even, saturate).
    """

    class QLinearMul(OpRun):
        op_domain = "com.microsoft"

        def _run(self, a, a_s, a_zp, b, b_s, b_zp, c_s, c_zp):
            prod = _dequantize(a, a_s, _zp(a_zp, a)) * _dequantize(b, b_s, _zp(b_zp, b))
            return (_requantize(prod, c_s, _zp(c_zp, a)),)

    class QLinearSigmoid(OpRun):
        op_domain = "com.microsoft"

        def _run(self, x, x_s, x_zp, y_s, y_zp):
            y = 1.0 / (1.0 + np.exp(-_dequantize(x, x_s, _zp(x_zp, x))))
            return (_requantize(y, y_s, _zp(y_zp, x)),)

    class QLinearLeakyRelu(OpRun):
        op_domain = "com.microsoft"

        def _run(self, x, x_s, x_zp, y_s, y_zp, alpha=0.01):
            r = _dequantize(x, x_s, _zp(x_zp, x))
            return (_requantize(np.where(r >= 0, r, np.float64(np.float32(alpha)) * r), y_s,
                                _zp(y_zp, x)),)

    class QLinearConcat(OpRun):
        op_domain = "com.microsoft"

        def _run(self, y_s, y_zp, *xs, axis=None):
            parts = [_dequantize(x, s, z) for x, s, z in zip(xs[0::3], xs[1::3], xs[2::3])]
            return (_requantize(np.concatenate(parts, axis=axis), y_s, y_zp),)

    class QLinearAveragePool(OpRun):
        op_domain = "com.microsoft"

        def _run(self, x, x_s, x_zp, y_s, y_zp, auto_pad="NOTSET", ceil_mode=0, channels_last=0,
                 count_include_pad=0, kernel_shape=None, pads=None, strides=None):
            # only what the tests use: NCHW, no padding, floor
            if channels_last or ceil_mode or any(pads or ()) or auto_pad not in ("NOTSET", None):
                raise NotImplementedError("QLinearAveragePool: padding/ceil_mode/channels_last")
            (kh, kw), (sh, sw) = kernel_shape, strides or (1, 1)
            r = _dequantize(x, x_s, _zp(x_zp, x))
            win = np.lib.stride_tricks.sliding_window_view(r, (kh, kw), axis=(2, 3))
            mean = win[:, :, ::sh, ::sw].mean(axis=(-2, -1))
            return (_requantize(mean, y_s, _zp(y_zp, x)),)

    class QLinearSoftmax(OpRun):
        op_domain = "com.microsoft"

        def _run(self, x, x_s, x_zp, y_s, y_zp, axis=-1, opset=13):
            r = _dequantize(x, x_s, _zp(x_zp, x))
            if opset < 13:  # coerced to 2D at axis
                shape, r = r.shape, r.reshape(int(np.prod(r.shape[:axis])), -1)
                axis = 1
            e = np.exp(r - r.max(axis=axis, keepdims=True))
            y = e / e.sum(axis=axis, keepdims=True)
            if opset < 13:
                y = y.reshape(shape)
            return (_requantize(y, y_s, _zp(y_zp, x)),)

    return [QLinearMul, QLinearSigmoid, QLinearLeakyRelu, QLinearConcat, QLinearAveragePool,
            QLinearSoftmax]


def ort_int8_kernels_exact() -> bool:
    """Whether onnxruntime's fused int8 kernels (MLAS) accumulate exactly on this CPU.

    On x86 without VNNI, MLAS's u8s8 GEMMs multiply with ``vpmaddubsw``, which saturates pairs of
    int8 products to int16 (onnxruntime documents this and recommends ``reduce_range`` there), so
    its QLinearConv/QLinearMatMul/fused-QDQ results can be off by several output steps.
    """
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags
