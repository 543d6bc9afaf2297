"""Seeded inputs for the fuzz harness (tests/test_fuzz.py): small valid models built without a
framework (ONNX by ``onnx.helper``, TFLite by the ``tflite`` package's flatbuffer builders),
LLM configs, and the mutations applied to them. Same seed, same bytes."""

from __future__ import annotations

import copy
import math
import struct
import time

import numpy as np

# ------------------------------------------------------------------------------- ONNX models


def onnx_models() -> dict[str, bytes]:
    """Small valid ONNX models: an MLP (MatMul, Add, Relu, Softmax), a CNN (Conv, Relu,
    MaxPool, GlobalAveragePool, Flatten, Gemm) and an MLP with a dynamic batch (``N``)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def init(name, shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.3, name)

    def model(nodes, inputs, outputs, inits, name):
        graph = helper.make_graph(nodes, name, inputs, outputs, inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m.SerializeToString()

    mlp_nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["h1"]),
                 helper.make_node("Relu", ["h1"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["o"]),
                 helper.make_node("Softmax", ["o"], ["y"], axis=-1)]
    mlp_inits = [init("w1", (16, 32)), init("b1", (32,)), init("w2", (32, 8))]
    out = {"mlp": model(mlp_nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], mlp_inits, "mlp")}
    out["dynamic"] = model(mlp_nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                           [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], mlp_inits, "dynamic")
    cnn_nodes = [helper.make_node("Conv", ["x", "k", "kb"], ["c"], pads=[1, 1, 1, 1]),
                 helper.make_node("Relu", ["c"], ["r"]),
                 helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
                 helper.make_node("GlobalAveragePool", ["p"], ["g"]), helper.make_node("Flatten", ["g"], ["f"]),
                 helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], transB=1)]
    out["cnn"] = model(cnn_nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                       [init("k", (8, 3, 3, 3)), init("kb", (8,)), init("fw", (4, 8)), init("fb", (4,))], "cnn")
    return out


# ------------------------------------------------------------------------------ TFLite model


def tflite_model() -> bytes:
    """A float32 TFLite flatbuffer: ``y = relu(x @ W^T + b) + z`` (FULLY_CONNECTED, ADD) with
    x (1, 8), z (1, 4), W (4, 8), b (4,)."""
    import importlib

    import flatbuffers
    from tflite.ActivationFunctionType import ActivationFunctionType

    (Buffer, BuiltinOperator, BuiltinOptions, FullyConnectedOptions, Model, Operator, OperatorCode, SubGraph, Tensor,
     TensorType) = (importlib.import_module(f"tflite.{m}") for m in (
        "Buffer", "BuiltinOperator", "BuiltinOptions", "FullyConnectedOptions", "Model", "Operator", "OperatorCode",
        "SubGraph", "Tensor", "TensorType"))

    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((4, 8)) * 0.3).astype(np.float32)
    bias = (rng.standard_normal(4) * 0.3).astype(np.float32)
    b = flatbuffers.Builder(1024)

    def vector(start, values, fmt):
        start(b, len(values))
        for v in reversed(values):
            b.Prepend(getattr(flatbuffers.number_types, fmt), v)
        return b.EndVector()

    def buffer(data: bytes | None):
        vec = None
        if data is not None:
            vec = b.CreateByteVector(data)
        Buffer.BufferStart(b)
        if vec is not None:
            Buffer.BufferAddData(b, vec)
        return Buffer.BufferEnd(b)

    buffers = [buffer(None), buffer(None), buffer(weight.tobytes()), buffer(bias.tobytes()), buffer(None),
               buffer(None), buffer(None)]
    specs = [("x", [1, 8], 1), ("w", [4, 8], 2), ("b", [4], 3), ("fc", [1, 4], 4), ("z", [1, 4], 5), ("y", [1, 4], 6)]
    tensors = []
    for name, shape, buf in specs:
        n = b.CreateString(name)
        s = vector(Tensor.TensorStartShapeVector, shape, "Int32Flags")
        Tensor.TensorStart(b)
        Tensor.TensorAddShape(b, s)
        Tensor.TensorAddType(b, TensorType.TensorType.FLOAT32)
        Tensor.TensorAddBuffer(b, buf)
        Tensor.TensorAddName(b, n)
        tensors.append(Tensor.TensorEnd(b))
    FullyConnectedOptions.FullyConnectedOptionsStart(b)
    FullyConnectedOptions.FullyConnectedOptionsAddFusedActivationFunction(b, ActivationFunctionType.RELU)
    fc_opts = FullyConnectedOptions.FullyConnectedOptionsEnd(b)
    ops = []
    for code, ins, outs, opts in ((0, [0, 1, 2], [3], fc_opts), (1, [3, 4], [5], None)):
        i = vector(Operator.OperatorStartInputsVector, ins, "Int32Flags")
        o = vector(Operator.OperatorStartOutputsVector, outs, "Int32Flags")
        Operator.OperatorStart(b)
        Operator.OperatorAddOpcodeIndex(b, code)
        Operator.OperatorAddInputs(b, i)
        Operator.OperatorAddOutputs(b, o)
        if opts is not None:
            Operator.OperatorAddBuiltinOptionsType(b, BuiltinOptions.BuiltinOptions.FullyConnectedOptions)
            Operator.OperatorAddBuiltinOptions(b, opts)
        ops.append(Operator.OperatorEnd(b))
    t_vec = b.StartVector(4, len(tensors), 4)
    for t in reversed(tensors):
        b.PrependUOffsetTRelative(t)
    t_vec = b.EndVector()
    o_vec = b.StartVector(4, len(ops), 4)
    for o in reversed(ops):
        b.PrependUOffsetTRelative(o)
    o_vec = b.EndVector()
    sg_in = vector(SubGraph.SubGraphStartInputsVector, [0, 4], "Int32Flags")
    sg_out = vector(SubGraph.SubGraphStartOutputsVector, [5], "Int32Flags")
    sg_name = b.CreateString("main")
    SubGraph.SubGraphStart(b)
    SubGraph.SubGraphAddTensors(b, t_vec)
    SubGraph.SubGraphAddInputs(b, sg_in)
    SubGraph.SubGraphAddOutputs(b, sg_out)
    SubGraph.SubGraphAddOperators(b, o_vec)
    SubGraph.SubGraphAddName(b, sg_name)
    subgraph = SubGraph.SubGraphEnd(b)
    codes = []
    for op in (BuiltinOperator.BuiltinOperator.FULLY_CONNECTED, BuiltinOperator.BuiltinOperator.ADD):
        OperatorCode.OperatorCodeStart(b)
        OperatorCode.OperatorCodeAddDeprecatedBuiltinCode(b, op)
        OperatorCode.OperatorCodeAddBuiltinCode(b, op)
        OperatorCode.OperatorCodeAddVersion(b, 1)
        codes.append(OperatorCode.OperatorCodeEnd(b))

    def offsets(items):
        b.StartVector(4, len(items), 4)
        for x in reversed(items):
            b.PrependUOffsetTRelative(x)
        return b.EndVector()

    codes_vec, sg_vec, buf_vec = offsets(codes), offsets([subgraph]), offsets(buffers)
    desc = b.CreateString("tvm-spinn fuzz seed model")
    Model.ModelStart(b)
    Model.ModelAddVersion(b, 3)
    Model.ModelAddOperatorCodes(b, codes_vec)
    Model.ModelAddSubgraphs(b, sg_vec)
    Model.ModelAddDescription(b, desc)
    Model.ModelAddBuffers(b, buf_vec)
    b.Finish(Model.ModelEnd(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def tflite_reference(x: np.ndarray, z: np.ndarray) -> np.ndarray:
    """What :func:`tflite_model` computes, in numpy."""
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((4, 8)) * 0.3).astype(np.float32)
    bias = (rng.standard_normal(4) * 0.3).astype(np.float32)
    return np.maximum(x @ weight.T + bias, 0) + z


# ------------------------------------------------------------------------------ byte mutation
_WORDS = [0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFE, 4, 8, 16]


def mutate_bytes(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """One seeded damage of ``data``: truncation, bit flips, a random or boundary 32-bit word,
    a zeroed or duplicated span, inserted bytes. Returns (bytes, what was done)."""
    n = len(data)
    kind = int(rng.integers(0, 7))
    buf = bytearray(data)
    if kind == 0 or n < 8:
        cut = int(rng.integers(0, max(n, 1)))
        return bytes(buf[:cut]), f"truncated to {cut} of {n} bytes"
    if kind == 1:
        flips = int(rng.integers(1, 9))
        where = sorted(int(p) for p in rng.integers(0, n * 8, flips))
        for bit in where:
            buf[bit // 8] ^= 1 << (bit % 8)
        return bytes(buf), f"bits {where} flipped"
    if kind == 2:
        pos = int(rng.integers(0, n - 4)) & ~3
        word = _WORDS[int(rng.integers(0, len(_WORDS)))] if rng.random() < 0.7 else int(rng.integers(0, 2**32))
        buf[pos:pos + 4] = struct.pack("<I", word)
        return bytes(buf), f"word at {pos} set to {word:#x}"
    if kind == 3:
        a = int(rng.integers(0, n))
        b = min(n, a + int(rng.integers(1, 64)))
        buf[a:b] = bytes(b - a)
        return bytes(buf), f"bytes {a}:{b} zeroed"
    if kind == 4:
        a = int(rng.integers(0, n))
        b = min(n, a + int(rng.integers(1, 64)))
        return bytes(buf[:b] + buf[a:b] + buf[b:]), f"bytes {a}:{b} duplicated"
    if kind == 5:
        pos = int(rng.integers(0, n))
        extra = rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes()
        return bytes(buf[:pos] + extra + buf[pos:]), f"{len(extra)} bytes inserted at {pos}"
    pos = int(rng.integers(0, n))
    buf[pos] = int(rng.integers(0, 256))
    return bytes(buf), f"byte {pos} set to {buf[pos]}"


# ------------------------------------------------------------------------------ LLM configs
SMALL_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 64,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False}
SMALL_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 128, "n_positions": 64,
              "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
_VALUES = ["64", "", "llama", 64.0, 0.5, True, False, None, [], [64], {}, {"a": {"b": 1}}, -1, 0, 1, 3, 2**31,
           2**63, 10**30, float("nan"), float("inf"), -float("inf"), 1e-300]
_FOREIGN = {"num_local_experts": 8, "num_experts_per_tok": 2, "attn_logit_softcapping": 50.0, "sliding_window": 32,
            "alibi": True, "parallel_attn": True, "partial_rotary_factor": 0.5}


def mutate_config(rng: np.random.Generator) -> tuple[dict, str]:
    """One seeded mutation of a small Llama or GPT-2 config: a field set to a value of another
    type or range, a field removed, a foreign or unknown key added. Returns (config, what)."""
    cfg = copy.deepcopy(SMALL_LLAMA if rng.random() < 0.6 else SMALL_GPT2)
    keys = sorted(cfg)
    kind = int(rng.integers(0, 4))
    if kind <= 1:
        key = keys[int(rng.integers(0, len(keys)))]
        value = _VALUES[int(rng.integers(0, len(_VALUES)))]
        cfg[key] = value
        return cfg, f"{key}={value!r}"
    if kind == 2:
        key = keys[int(rng.integers(0, len(keys)))]
        del cfg[key]
        return cfg, f"{key} removed"
    if rng.random() < 0.5:
        key = sorted(_FOREIGN)[int(rng.integers(0, len(_FOREIGN)))]
        cfg[key] = _FOREIGN[key]
    else:
        key = f"extra_{int(rng.integers(0, 100))}"
        cfg[key] = _VALUES[int(rng.integers(0, len(_VALUES)))]
    return cfg, f"{key}={cfg[key]!r} added"


# ------------------------------------------------------------------------------ shapes
SHAPES = ["x=0,16", "x=-1,16", f"x={2**40},16", "x=" + ",".join(["1"] * 64), "x=2", "x=abc,16", "x=",
          "x=1,16,1", f"x={2**63},16", "y=1,16", "x=1.5,16", "x=3,16"]


# ------------------------------------------------------------------------------ the driver
#: exceptions a clean refusal may raise: what ``tvm-spinn`` prints as one ``error:`` line
CLEAN = (ValueError, OSError)


def case_input(case: dict):
    """The input of ``case`` (regenerated from its seed): bytes, a config, or a shape string."""
    rng = np.random.default_rng(case["seed"])
    if case["kind"] == "onnx":
        return mutate_bytes(onnx_models()[case["model"]], rng)
    if case["kind"] == "tflite":
        return mutate_bytes(tflite_model(), rng)
    if case["kind"] == "config":
        return mutate_config(rng)
    return case["shape"], f"--shape {case['shape']}"


def _inputs(mod) -> list[np.ndarray]:
    """Seeded inputs for the compiled module's parameters; a failure here is the harness's own
    (an AssertionError: never counted as a clean refusal)."""
    shapes = [[int(d) for d in p.ty.shape] for p in mod["main"].params]
    nbytes = sum(8 * math.prod(s) for s in shapes)
    if nbytes > 2**28:
        # the target (one chip, 2 GB of DRAM) cannot hold such inputs: the build should have
        # been refused (MappingError), not succeeded
        raise AssertionError(f"compiled for 'spinn' with {nbytes // 8} input elements ({shapes}): no capacity "
                         "check refused inputs larger than the chip's DRAM")
    try:
        rng = np.random.default_rng(0)
        return [rng.standard_normal(s).astype(str(p.ty.dtype)) for s, p in zip(shapes, mod["main"].params)]
    except Exception as err:
        raise AssertionError(f"harness: no inputs for the module: {type(err).__name__}: {err}") from None


def _nan_lost(got: np.ndarray, want: np.ndarray, reference: str) -> None:
    """A result that differs only where the reference's is NaN/inf (a NaN weight that a ReLU
    turned into a number instead of propagating it as onnxruntime, numpy and PyTorch do): a
    wrong result, named as such."""
    finite = np.isfinite(want)
    if want.shape == got.shape and (~finite & np.isfinite(got)).any() and np.allclose(
            got[finite], want[finite], rtol=1e-3, atol=1e-4):
        raise AssertionError(f"NaN/inf not propagated: {reference} gives non-finite values where spinn's are finite")


def _run_onnx(data: bytes, path: str, shapes: "dict | None") -> str:
    import onnxruntime as ort
    import tvm
    from tvm import relax

    from tvm_spinn.frontend import from_onnx

    with open(path, "wb") as f:
        f.write(data)
    mod = from_onnx(path, shapes)
    ex = relax.build(mod, target="spinn")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    inputs = _inputs(mod)
    out = vm["main"](*(tvm.runtime.tensor(a) for a in inputs))
    got = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
    try:  # the reference: onnxruntime on the same bytes, where it takes them
        sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        want = sess.run(None, {i.name: a for i, a in zip(sess.get_inputs(), inputs)})[0]
    except Exception:
        return "ok (onnxruntime refuses it: no reference)"
    _nan_lost(got, want, "onnxruntime")
    if want.shape != got.shape or not np.allclose(got, want, rtol=1e-3, atol=1e-4, equal_nan=True):
        raise AssertionError(f"WRONG RESULT: max |spinn - onnxruntime| = "
                             f"{np.nanmax(np.abs(got.astype(np.float64) - want)) if want.shape == got.shape else 'shape'}"
                             f" (shapes {got.shape} vs {want.shape})")
    return "ok (matches onnxruntime)"


def _run_tflite(data: bytes) -> str:
    import tvm
    from tvm import relax

    from tvm_spinn.frontend import from_tflite

    mod = from_tflite(data)
    ex = relax.build(mod, target="spinn")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    inputs = _inputs(mod)
    out = vm["main"](*(tvm.runtime.tensor(a) for a in inputs))
    got = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
    want = _tflite_mutant_reference(data, inputs)
    if want is None:
        return "ok (imported and ran; its graph differs from the seed model's: no reference)"
    _nan_lost(got, want, "numpy")
    if want.shape != got.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True):
        raise AssertionError(f"WRONG RESULT: spinn {got} vs numpy {want}")
    return "ok (matches numpy with the file's weights)"


def _tflite_mutant_reference(data: bytes, inputs: list):
    """numpy's ``relu(x @ W^T + b) + z`` with W and b read from ``data``, when its graph is the
    seed model's (same operators, tensors, shapes and types); else None."""
    import importlib

    Model = importlib.import_module("tflite.Model").Model
    seed, mutant = (Model.GetRootAsModel(b, 0) for b in (tflite_model(), data))

    def options(op):
        table = op.BuiltinOptions()
        if table is None:
            return None
        fc = importlib.import_module("tflite.FullyConnectedOptions").FullyConnectedOptions()
        fc.Init(table.Bytes, table.Pos)
        return (fc.FusedActivationFunction(), fc.WeightsFormat(), fc.KeepNumDims(), fc.AsymmetricQuantizeInputs())

    def graph(m):
        sub = m.Subgraphs(0)
        ops = [(m.OperatorCodes(op.OpcodeIndex()).BuiltinCode(), list(op.InputsAsNumpy()), list(op.OutputsAsNumpy()),
                op.BuiltinOptionsType(), options(op)) for op in (sub.Operators(k) for k in range(sub.OperatorsLength()))]
        tensors = [(list(t.ShapeAsNumpy()), t.Type(), t.Buffer(), t.Quantization() is None)
                   for t in (sub.Tensors(k) for k in range(sub.TensorsLength()))]
        return ops, tensors, list(sub.InputsAsNumpy()), list(sub.OutputsAsNumpy())

    try:
        if graph(seed) != graph(mutant) or len(inputs) != 2:
            return None
    except Exception:
        return None
    sub = mutant.Subgraphs(0)
    w, b = (mutant.Buffers(sub.Tensors(k).Buffer()).DataAsNumpy().view(np.float32) for k in (1, 2))
    x, z = inputs
    return np.maximum(x @ w.reshape(4, 8).T + b, 0) + z


def _run_config(cfg: dict, plan: bool) -> str:
    from tvm_spinn import llm

    spec = llm.spec_of(cfg)
    if plan:
        result = llm.plan(cfg, target="spinn/board", seq=min(16, spec.max_positions))
        if not (result.tokens_per_s_per_user > 0 and math.isfinite(result.ttft_s)):
            raise AssertionError(f"WRONG RESULT: plan of a valid config gave {result.tokens_per_s_per_user} tokens/s")
        return "ok (planned)"
    return "ok (spec)"


def _run_shape(shape: str, workdir: str) -> str:
    import os

    from tvm_spinn.cli import main

    model = os.path.join(workdir, "dynamic.onnx")
    if not os.path.exists(model):
        with open(model, "wb") as f:
            f.write(onnx_models()["dynamic"])
    out = os.path.join(workdir, "shape.so")
    try:
        rc = main(["compile", model, "--shape", shape, "-o", out])
    except SystemExit as exit_:  # argument refusals: one line
        if not isinstance(exit_.code, str) or "\n" in exit_.code.strip():
            raise AssertionError(f"SystemExit without a one-line message: {exit_.code!r}") from None
        raise ValueError(exit_.code) from None
    if rc == 0 and not os.path.isfile(out):
        raise AssertionError("rc 0 without the library")
    if rc != 0:
        raise ValueError(f"rc {rc}")
    return "ok (compiled)"


def reproduce(case: dict) -> None:
    """Run one case in this process with its traceback shown (the command a failure prints)."""
    import json
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "case.json")
        with open(path, "w") as f:
            json.dump([case], f)
        print("input:", case_input(case)[1])
        drive(path, tmp, 2**62)


def drive(cases_path: str, workdir: str, limit_bytes: int) -> None:
    """Run the cases of a JSON file in this process (the harness's subprocess), one JSON line
    per case on stdout: ``{"id", "status": "ok" | "refused" | "FAIL", "detail"}``; a ``start``
    line before each, so that a crash or hang names the case that caused it."""
    import json
    import resource
    import traceback
    import warnings

    warnings.simplefilter("ignore")
    if limit_bytes < 2**62:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    with open(cases_path) as f:
        cases = json.load(f)
    for case in cases:
        print(json.dumps({"start": case["id"]}), flush=True)
        status, start = "ok", time.perf_counter()
        try:
            value, _ = case_input(case)
            if case["kind"] == "onnx":
                shapes = {"x": (3, 16)} if case["model"] == "dynamic" else None
                detail = _run_onnx(value, f"{workdir}/case.onnx", shapes)
            elif case["kind"] == "tflite":
                detail = _run_tflite(value)
            elif case["kind"] == "config":
                detail = _run_config(value, case.get("plan", False))
            else:
                detail = _run_shape(value, workdir)
        except CLEAN as err:
            text = str(err).strip()
            status, detail = "refused", f"{type(err).__name__}: {text}"
            if not text or "Traceback" in text:
                status = "FAIL"
        except BaseException as err:  # noqa: BLE001 - everything else is what the fuzzer looks for
            status, detail = "FAIL", f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"
        print(json.dumps({"id": case["id"], "status": status, "detail": detail[:4000],
                          "seconds": round(time.perf_counter() - start, 3)}), flush=True)
