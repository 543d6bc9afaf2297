"""The simulator's per-program execution plans ("layers" mode): prepared once per program digest, the
same bits as the unprepared per-layer path, no state shared between calls (results a caller holds
are never overwritten; concurrent calls of one program are independent)."""

from __future__ import annotations

import copy
import dataclasses
import gc
import threading
import weakref

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.program import Program
from tvm_spinn.program.ops import elementwise
from tvm_spinn.runtime import simulator
from tvm_spinn.runtime.simulator import program_plan, run_program

import models
from test_sim_modes import _KindsNet


def _programs(ex) -> list[Program]:
    return [Program.from_bytes(bytes(m["get_program"]())) for m in tvm_spinn.report_modules(ex)
            if m["get_symbol"]() != "__spinn_manifest__"]


def _forget_plans():
    """Drop the cached plans (they are rebuilt on the next call)."""
    simulator.forget_plans()


def _unprepared(monkeypatch):
    """Plans whose every step is the unprepared per-layer path (what "layers" mode ran before):
    no native runs, no prepared steps, no fused clips."""
    monkeypatch.setenv("TVM_SPINN_SIM_NATIVE", "0")
    monkeypatch.setattr(simulator, "_build_step", lambda program, index, layer, clip=None: simulator._generic_step(index, layer))
    monkeypatch.setattr(simulator, "_fusable_clips", lambda program: {})  # every layer on its own
    _forget_plans()


def _inputs(x, rng):
    special = x.copy().reshape(-1)
    special[::7] = np.nan
    special[1::11] = np.inf
    special[2::13] = -0.0
    return [x, rng.normal(size=x.shape).astype("float32") * 100, special.reshape(x.shape)]


class _Pools(torch.nn.Module):
    """Pool geometries: padded average pools counting the padding, dilated padded max pools."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        a = torch.nn.functional.avg_pool2d(y, 3, stride=2, padding=1, count_include_pad=True)
        m = torch.nn.functional.max_pool2d(y, 3, stride=2, padding=1, dilation=1)
        d = torch.nn.functional.max_pool2d(y, 2, stride=1, padding=1, dilation=2)
        return a + m + d[:, :, ::2, ::2][:, :, :a.shape[2], :a.shape[3]]


def _cases():
    torch.manual_seed(0)
    cases = {name: models.make(name) for name in ("cnn", "mlp", "transformer")}
    cases["kinds"] = (_KindsNet().eval(), torch.randn(1, 4, 15, 13))
    cases["pools"] = (_Pools().eval(), torch.randn(1, 3, 11, 9))
    return cases


# Every model in fp32; int8 on the transformer (dense and matmul), the kinds net (every conv
# geometry) and the pools; the int8 cnn and mlp (layer kinds of those two) with -m slow.
@pytest.mark.parametrize("name, quantized", [
    *((n, False) for n in ("cnn", "mlp", "transformer", "kinds", "pools")),
    pytest.param("cnn", True, marks=pytest.mark.slow), pytest.param("mlp", True, marks=pytest.mark.slow),
    *((n, True) for n in ("transformer", "kinds", "pools")),
])
def test_plan_gives_the_unprepared_bits(monkeypatch, name, quantized):
    model, x = _cases()[name]
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    rng = np.random.default_rng(0)
    if quantized:
        mod = tvm_spinn.quantize(mod, [rng.normal(size=x.shape).astype("float32") for _ in range(4)])
    ex = relax.build(mod, target="spinn")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    monkeypatch.setenv("TVM_SPINN_SIM_MODE", "layers")
    inputs = _inputs(x.numpy(), rng)
    _forget_plans()
    planned = [vm["main"](tvm.runtime.tensor(v)).numpy() for v in inputs]
    with monkeypatch.context() as m:
        _unprepared(m)
        reference = [vm["main"](tvm.runtime.tensor(v)).numpy() for v in inputs]
    _forget_plans()
    for got, want in zip(planned, reference):
        assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))


def _cnn_program():
    model, x = models.make("cnn")
    (program,) = _programs(relax.build(tvm_spinn.frontend.from_pytorch(model, (x,)), target="spinn"))
    return program, x.numpy()


def test_equal_programs_share_one_plan():
    """Plans are cached by the program's digest: a copy, the same bytes read again and the
    in-memory program all run one plan; a different program gets its own, and nothing is
    kept on the program."""
    program, x = _cnn_program()
    simulator.forget_plans()
    plan = program_plan(program)
    assert program_plan(program) is plan
    twin = copy.deepcopy(program)
    again = Program.from_bytes(program.to_bytes())
    assert again is not program and program_plan(twin) is plan and program_plan(again) is plan
    (a,) = run_program(program, [x], mode="layers")
    (b,) = run_program(again, [x], mode="layers")
    assert np.array_equal(a, b)
    renamed = dataclasses.replace(program, symbol="renamed")
    assert program_plan(renamed) is not plan
    assert not any(isinstance(v, simulator._Plan) for v in vars(program).values())


def test_plan_cache_is_bounded(monkeypatch):
    """Least recently used plans are dropped past the cache's bound; a dropped plan is rebuilt
    (the same steps) on next use."""
    program, x = _cnn_program()
    simulator.forget_plans()
    monkeypatch.setattr(simulator, "PLAN_CACHE_ENTRIES", 2)
    first = program_plan(program)
    ref = weakref.ref(first)
    others = [dataclasses.replace(program, symbol=f"p{i}") for i in range(2)]
    for other in others:
        program_plan(other)
    assert len(simulator._PLANS) == 2
    del first
    gc.collect()
    assert ref() is None  # evicted: nothing else held it
    rebuilt = program_plan(program)
    assert len(rebuilt.steps) == len(program_plan(others[1]).steps)
    (a,) = run_program(program, [x], mode="layers")
    (b,) = run_program(others[0], [x], mode="layers")
    assert np.array_equal(a, b)


def test_results_are_not_overwritten_by_later_calls():
    program, x = _cnn_program()
    rng = np.random.default_rng(0)
    (first,) = run_program(program, [x], mode="layers")
    kept = first.copy()
    for _ in range(3):
        run_program(program, [rng.normal(size=x.shape).astype("float32")], mode="layers")
    assert np.array_equal(first, kept)
    (again,) = run_program(program, [x], mode="layers")
    assert again is not first and np.array_equal(again, kept)


def test_concurrent_calls_of_one_program():
    program, x = _cnn_program()
    rng = np.random.default_rng(0)
    inputs = [rng.normal(size=x.shape).astype("float32") * s for s in (1, 10, 100, 1000)]
    expected = [run_program(program, [v], mode="tiles")[0] for v in inputs]
    errors: list = []

    def worker(i):
        try:
            for _ in range(20):
                (got,) = run_program(program, [inputs[i]], mode="layers")
                if not np.array_equal(got, expected[i]):
                    errors.append(i)
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("lo,hi", [(0.0, 6.0), (-1.0, 1.0), (0.0, 0.5), (-0.0, 6.0), (-3.0, 0.0), (-np.inf, np.inf),
                                   (1.0, 1.0), (np.nan, 1.0), (0.0, np.nan), (2.0, -2.0)])
def test_clip_and_relu_fast_paths_keep_the_bits(lo, hi):
    """fmin/fmax forms against the reference compare-and-select (NaN, signed zeros, infinities)."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=4096) * 4).astype(np.float32)
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, lo, hi, -1.0, 1.0, 6.0, 0.5],
                        dtype=np.float32)
    x[:len(specials) * 8] = np.repeat(specials, 8)
    attrs = {"min": lo, "max": hi}
    reference = elementwise.unary("clip", x, attrs)
    clip = elementwise.clip_fast(lo, hi)
    if clip is not None:
        got = clip(x)
        assert np.array_equal(got.view(np.uint32), reference.view(np.uint32))
    relu = elementwise.relu(x)
    got = elementwise.relu_owned(x.copy())
    assert np.array_equal(got.view(np.uint32), relu.view(np.uint32))


def test_outputs_written_in_place_have_the_same_bits():
    """_Plan.run with the caller's output arrays (the executor's DPS outputs): layers producing
    outputs may fill them directly; an output sharing memory with an input is left alone."""
    for name in ("cnn", "mlp"):
        model, x = models.make(name)
        model_x = x.numpy()
        (program,) = _programs(relax.build(tvm_spinn.frontend.from_pytorch(model, (x,)), target="spinn"))
        plan = program_plan(program)
        (want,) = run_program(program, [model_x], mode="tiles")
        dst = np.full(want.shape, np.nan, dtype=want.dtype)
        (got,) = plan.run(program, [model_x], [dst])
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
        if got is dst:
            again = dst.copy()
            plan.run(program, [model_x * 2], [np.empty_like(dst)])
            assert np.array_equal(dst, again)  # a later call never writes an earlier output
        if want.size == model_x.size and want.dtype == model_x.dtype:
            shared = model_x.copy().reshape(-1)
            alias = shared.reshape(want.shape)
            (res,) = plan.run(program, [shared.reshape(model_x.shape)], [alias])
            assert res is not alias


def _native_and_python(monkeypatch, ex, inputs):
    """Outputs of ``ex`` with native runs and with every layer in Python (prepared steps)."""
    vm = relax.VirtualMachine(ex, tvm.cpu())
    monkeypatch.setenv("TVM_SPINN_SIM_MODE", "layers")
    out = {}
    for native in ("1", "0"):
        monkeypatch.setenv("TVM_SPINN_SIM_NATIVE", native)
        out[native] = [vm["main"](tvm.runtime.tensor(v)).numpy() for v in inputs]
    return out["1"], out["0"]


class _Movement(torch.nn.Module):
    """Every data-movement kind and broadcast binary op a native run describes, on one input."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 12)

    def forward(self, x):  # x [2, 3, 4, 12]
        y = self.fc(x)
        p = y.permute(0, 2, 1, 3)                      # permute_dims
        s = p[:, 1:4:2, :, 2:11:3]                     # strided_slice, steps 2 and 3
        c = torch.cat([s, s * 2.0, s - 1.0], dim=-1)   # concat
        b = c + c.mean(dim=-1, keepdim=True)           # broadcast add over the last axis
        r = b.reshape(2, -1) / (1.0 + b.reshape(2, -1)[:, :1])  # broadcast divide by a column
        return torch.relu(r).reshape(2, 2, 3, 9) * torch.ones(3, 1)  # broadcast multiply


class _Narrow(torch.nn.Module):
    """Convolutions with at most 4 output pixels (computed transposed): im2col'd 3x3 stride 2,
    a 1x1 with bias and a fused ReLU6, on a 4x4 image."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(3, 24, 3, stride=2, padding=1)
        self.b = torch.nn.Conv2d(24, 32, 1)

    def forward(self, x):
        return torch.nn.functional.relu6(self.b(torch.relu(self.a(x))))


class _Depthwise(torch.nn.Module):
    """MobileNet-like blocks: depthwise convs on whole-vector rows (16 wide), ragged rows (13),
    stride 2, and small maps (channels in the lanes), with bias, ReLU6 and none; 1x1 convs and a
    dense layer whose bias and ReLU the GEMM applies as it stores."""

    def __init__(self):
        super().__init__()
        self.expand = torch.nn.Conv2d(3, 16, 1)
        self.dw16 = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.dw_s2 = torch.nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=16, bias=False)
        self.dw_small = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.dw_ragged = torch.nn.Conv2d(3, 6, 3, padding=1, groups=3)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):  # x [n, 3, 16, 16]
        y = torch.nn.functional.relu6(self.dw16(self.expand(x)))
        y = torch.nn.functional.relu6(self.dw_small(self.dw_s2(y)))   # 8x8: channels in lanes
        r = torch.relu(self.dw_ragged(x[:, :, :13, :13]))
        return torch.cat([torch.relu(self.fc(y.mean(dim=(2, 3)))), r.flatten(1)], dim=1)


@pytest.mark.parametrize("name", ["cnn", "mlp", "transformer", "kinds", "pools", "movement", "narrow",
                                  "depthwise"])
def test_native_runs_give_the_python_bits(monkeypatch, name):
    """Native runs (one C++ call per run of layers) against the same plan with every layer in
    Python, on ordinary values, large ones, NaN, infinities and signed zeros."""
    cases = _cases()
    cases["movement"] = (_Movement().eval(), torch.randn(2, 3, 4, 12))
    cases["narrow"] = (_Narrow().eval(), torch.randn(2, 3, 4, 4))
    cases["depthwise"] = (_Depthwise().eval(), torch.randn(2, 3, 16, 16))
    model, x = cases[name]
    ex = relax.build(tvm_spinn.frontend.from_pytorch(model, (x,)), target="spinn")
    inputs = _inputs(x.numpy(), np.random.default_rng(1))
    _forget_plans()
    native, python = _native_and_python(monkeypatch, ex, inputs)
    monkeypatch.setenv("TVM_SPINN_SIM_NATIVE", "1")
    assert all(program_plan(p).native_layers > 0 for p in _programs(ex))
    for got, want in zip(native, python):
        assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))
    monkeypatch.setenv("TVM_SPINN_SIM_MODE", "tiles")  # and the tile-by-tile reference
    reference = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(inputs[0])).numpy()
    assert np.array_equal(native[0].view(np.uint8), reference.view(np.uint8))
    _forget_plans()


def test_native_plan_rejects_malformed_instructions():
    """The interpreter validates every instruction against its buffers when a plan is created:
    a bad plan is a ValueError, never an out-of-bounds access."""
    from tvm_spinn import _lib
    from tvm_spinn.program.ops.native import codes

    create = _lib._func("tvm_spinn.sim.plan_create")
    c = codes()
    x = np.zeros(16, dtype=np.float32)
    ok = [c["unary"], 0, 1, 16, c["unary.relu"], 0, 0, 0]
    run = create(ok, [x], [64], [])
    out = np.empty(16, dtype=np.float32)
    run(out)
    with pytest.raises(ValueError, match="bytes"):
        create([c["unary"], 0, 1, 32, c["unary.relu"], 0, 0, 0], [x], [64], [])  # reads past x
    with pytest.raises(ValueError, match="slot"):
        create([c["unary"], 0, 5, 16, c["unary.relu"], 0, 0, 0], [x], [64], [])
    with pytest.raises(ValueError, match="unknown instruction"):
        create([99], [x], [64], [])
    with pytest.raises(ValueError, match="truncated"):
        create(ok[:5], [x], [64], [])
    with pytest.raises(ValueError, match="reads before its buffer"):
        create([c["copy"], 0, 1, 4, 1, 0, 0, 16, -1, 1], [x], [64], [])
    with pytest.raises(ValueError, match="64 bytes"):
        run(np.empty(8, dtype=np.float32))  # the argument's size is checked per call
    with pytest.raises(ValueError, match="expected 1 arguments"):
        run()


# -- int8: GEMM layers with their epilogues, quantize and dequantize ---------------------------
def _int8_cases():
    """Relax modules of int8 layers (test_int8's builder): conv2d (padded, strided, grouped and
    1x1), dense and batched matmul; uint8 and int8 operands, per-channel and per-tensor scales,
    asymmetric zero points, requantizing (int8 and uint8, with ReLU) and dequantizing epilogues."""
    from test_int8 import qgemm_module

    rng = np.random.default_rng(7)
    w_conv = rng.integers(0, 256, size=(6, 2, 3, 3)).astype("uint8")
    w_1x1 = rng.integers(-127, 128, size=(5, 4, 1, 1)).astype("int8")
    w_dense = rng.integers(-128, 128, size=(40, 24)).astype("int8")
    return {
        "conv_u8_requant": qgemm_module(
            (2, 4, 9, 9), "uint8", w_conv, rng.uniform(0.002, 0.01, 6).astype("float32"),
            rng.integers(100, 150, 6).astype("uint8"), 0.03, 121, bias=rng.normal(size=6), relu=True,
            out=(0.05, 131, "uint8"), wdtype="uint8", conv_attrs=dict(padding=1, strides=2, groups=2)),
        "conv_1x1_dequant": qgemm_module(
            (2, 4, 5, 5), "int8", w_1x1, np.float32(0.004), 0, 0.02, -7, bias=rng.normal(size=5)),
        "dense_per_channel": qgemm_module(
            (3, 40), "uint8", w_dense, rng.uniform(0.001, 0.005, 24).astype("float32"),
            rng.integers(-5, 6, 24).astype("int8"), 0.01, 140, op="dense", bias=rng.normal(size=24),
            relu=True, w_axis=1),
        "dense_requant": qgemm_module(
            (3, 40), "int8", w_dense, np.float32(0.003), 0, 0.01, 5, op="dense", bias=rng.normal(size=24),
            out=(0.04, -3, "int8")),
        "matmul_u8": qgemm_module(
            (2, 3, 8, 20), "uint8", None, 0.02, 140, 0.05, 90, op="matmul", wdtype="uint8",
            b_shape=(2, 3, 20, 6), out=(0.9, 128, "uint8")),
        "matmul_dequant": qgemm_module(
            (2, 3, 8, 20), "int8", None, 0.02, -4, 0.05, 3, op="matmul", b_shape=(1, 3, 20, 6)),
    }


def _qdq_module(axis, dtype):
    """quantize then dequantize (returned both), per channel along ``axis`` or per tensor."""
    from test_int8 import _c

    n = (2, 5, 3, 4)[axis] if axis is not None else 1
    scale = np.linspace(0.01, 0.5, n).astype("float32")
    zero = np.arange(n) - 2 + (128 if dtype == "uint8" else 0)
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType([2, 5, 3, 4], "float32"))
    with bb.function("main", [xv]):
        with bb.dataflow():
            s = _c(scale if n > 1 else scale[0], "float32")
            z = _c(zero if n > 1 else zero[0], dtype)
            q = bb.emit(relax.op.quantize(xv, s, z, axis=-1 if axis is None else axis, out_dtype=dtype))
            d = bb.emit(relax.op.dequantize(q, s, z, axis=-1 if axis is None else axis))
            gv = bb.emit_output(relax.Tuple([q, d]))
        bb.emit_func_output(gv)
    return bb.get()


def _three_ways(monkeypatch, program, inputs):
    """Outputs of ``program``: native runs, every layer in Python, tile by tile."""
    out = []
    for native in ("1", "0"):
        monkeypatch.setenv("TVM_SPINN_SIM_NATIVE", native)
        out.append(run_program(program, inputs, mode="layers"))
    out.append(run_program(program, inputs, mode="tiles"))
    monkeypatch.setenv("TVM_SPINN_SIM_NATIVE", "1")
    return out


def _same_bits(a, b):
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("name,tflite", [
    ("conv_u8_requant", False), ("conv_u8_requant", True), ("conv_1x1_dequant", False),
    ("dense_per_channel", False), ("dense_requant", False), ("dense_requant", True), ("matmul_u8", False),
    ("matmul_u8", True), ("matmul_dequant", False)])
def test_native_int8_gemms_give_the_python_bits(monkeypatch, name, tflite):
    """int8 GEMM layers in native runs (flip, im2col with the zero point as padding, the chunked
    MAC-array GEMM, zero-point terms and epilogue) against the per-layer Python steps and the tile
    reference; ``tflite``: the requantizing layers switched to TFLite's rounding rule."""
    ex = relax.build(_int8_cases()[name], target="spinn")
    rng = np.random.default_rng(8)
    (program,) = _programs(ex)
    gemms = [layer for layer in program.layers if layer.mode == "int8"]
    assert gemms
    if tflite:
        requant = {id(layer) for layer in gemms if layer.attrs["out"] != "float32"}
        assert requant
        program = dataclasses.replace(program, layers=[
            dataclasses.replace(layer, attrs={**layer.attrs, "rounding": "tflite"}) if id(layer) in requant else layer
            for layer in program.layers])
    inputs = []
    for tid in program.inputs:
        spec = program.tensors[tid]
        lo, hi = (0, 256) if spec.dtype == "uint8" else (-128, 128)
        inputs.append(rng.integers(lo, hi, size=spec.shape).astype(spec.dtype))
    native, python, tiles = _three_ways(monkeypatch, program, inputs)
    assert program_plan(program).native_layers == len(program.layers)
    for got, want, ref in zip(native, python, tiles):
        assert _same_bits(got, want) and _same_bits(got, ref)
    if native[0].dtype != np.float32:  # both rails or the interior: not a constant output
        assert len(np.unique(native[0])) > 8
    _forget_plans()


@pytest.mark.parametrize("axis,dtype", [(None, "int8"), (1, "uint8"), (3, "int8")])
def test_native_quantize_dequantize_give_the_python_bits(monkeypatch, axis, dtype):
    """quantize/dequantize in native runs, per tensor and per channel, on ties, saturating values,
    infinities (the range's ends), NaN (0) and signed zeros."""
    (program,) = _programs(relax.build(_qdq_module(axis, dtype), target="spinn"))
    rng = np.random.default_rng(9)
    x = (rng.normal(size=(2, 5, 3, 4)) * 40).astype("float32").reshape(-1)
    x[:6] = [0.25, 0.75, -0.25, np.inf, -np.inf, np.nan]
    x[6:10] = [-0.0, 1e30, -1e30, 0.005]
    x[::11] = np.nan
    native, python, tiles = _three_ways(monkeypatch, program, [x.reshape(2, 5, 3, 4)])
    assert program_plan(program).native_layers == len(program.layers)
    for got, want, ref in zip(native, python, tiles):
        assert _same_bits(got, want) and _same_bits(got, ref)
    q = native[0].reshape(-1)
    lo, hi = (0, 255) if dtype == "uint8" else (-128, 127)
    assert q[3] == hi and q[4] == lo and q[5] == 0 and q[8] == lo  # inf, -inf, NaN, -1e30
    _forget_plans()


def test_native_int8_instructions_are_validated():
    """A qgemm instruction on hand-made buffers gives numpy's ``(a - za) @ b * scale``; bad
    extents, accumulator widths and missing epilogue vectors are ValueErrors at creation."""
    from tvm_spinn import _lib
    from tvm_spinn.program.ops.native import codes

    create = _lib._func("tvm_spinn.sim.plan_create")
    c = codes()
    none = c["none"]
    rng = np.random.default_rng(10)
    a = rng.integers(-128, 128, size=(2, 3)).astype(np.int8)
    b = rng.integers(-128, 128, size=(3, 2)).astype(np.int8)
    scale = np.array([0.5, 0.25], dtype=np.float32)
    index = np.zeros(1, dtype=np.int64)
    consts = [a, b, index, index, scale]

    def word(m=2, acc_bits=24, kind=0, scale_slot=4):  # slots: consts 0-4, out 5, acc 6
        return [c["qgemm"], 0, 1, 5, 6, 1, m, 3, 2, 2, 3, 3, acc_bits, 5, none, 0, none, none, none, 1, 0, kind,
                scale_slot, none, none, none, none, 0, 0, 0, -128, 127]

    run = create(word(), consts, [16], [16])
    out = np.empty((2, 2), dtype=np.float32)
    run(out)
    want = ((a.astype(np.int64) - 5) @ b.astype(np.int64)).astype(np.float32) * scale
    assert np.array_equal(out, want)
    with pytest.raises(ValueError, match="bytes"):
        create(word(m=3), consts, [16], [16])  # A holds 2 x 3
    with pytest.raises(ValueError, match="acc_bits"):
        create(word(acc_bits=40), consts, [16], [16])
    with pytest.raises(ValueError, match="slot"):
        create(word(kind=1), consts, [4], [16])  # requantizing without multipliers
    with pytest.raises(ValueError, match="slot"):
        create(word(scale_slot=none), consts, [16], [16])
