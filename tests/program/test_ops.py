"""Per-op sweep over the spinn pattern table: each op x shapes x epilogues, spinn vs llvm.

Like TVM's ``test_codegen_cublas.py``: every case is a tiny Relax module built directly with
``relax.BlockBuilder``, built once for ``spinn`` and once for plain ``llvm`` (the independent
reference), run on the same seeded inputs, and compared. Every case also asserts that the op it
is about really ran on spinn (the layer kinds the built executable's spinn programs hold, and no
fallback op left in the partitioned module), so a case cannot pass by falling back to the host.

Tolerances (fp32; ``eps = 2**-23``):

- GEMMs and sums (conv2d, dense, matmul, avg/adaptive pooling, mean): both sides sum ``K`` products
  in fp32, possibly in different orders; each is within ``gamma_K * sum|a||b|`` of the exact
  value (Higham, Accuracy and Stability of Numerical Algorithms, 3.1), so they differ by at most
  ``2 * K * eps * sum|a||b|`` per element, plus one rounding of a bias add, ReLU being exact.
  ``sum|a||b|`` is computed by the llvm build of the same module on ``|x|`` and ``|W|``.
- Single fp32 operations (add, subtract, multiply, divide, relu, clip, max pooling, data
  movement): IEEE results are correctly rounded on both sides: bit-identical.
- Transcendentals (sigmoid, tanh, softmax's exp): the simulator's exp/tanh are numpy's float32
  (<= 1 ulp on glibc), llvm's are its own expansions, composed in 2-3 fp32 operations: 2 ulp of
  the result (``rtol = 2 eps``, measured 2). GELU (erf: a rational approximation with ``|error| <
  1.5e-7``, or tanh) is ``0.5 x (1 + erf)``: ``1 + erf`` cancels for negative ``x``, so the error
  scales with ``|x|``, not the result: ``atol`` = 1 ulp of ``max|x| = 4`` (measured exactly that).
  layer_norm: 4 ulp plus 4 ulp of the output scale (the final ``+ beta`` cancels).
- int8 quantize / dequantize: exact. int8 GEMMs: llvm evaluates the QDQ graph in fp32
  (dequantized products summed in fp32, fp32 bias, fp32 ``x / scale`` before rounding); spinn
  accumulates exactly in integers, rounds the bias to the accumulator scale and requantizes in
  fixed point. Both round the same real value, so an int8 output may differ by one step where
  that value lies within fp32 error of a rounding boundary (and must be equal almost everywhere);
  a float32 output is within ``(K + 3) * eps * (s_x s_w sum|x - z_x||w| + |bias|)``. The
  hardware's own integer arithmetic is checked bit for bit in ``test_int8.py``.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_spinn

EPS32 = float(np.finfo(np.float32).eps)
TRANSCENDENTAL_RTOL = 2 * EPS32  # 2 ulp: measured 2 for sigmoid, tanh, softmax
GELU_ATOL = 4 * EPS32  # 1 ulp of the inputs' magnitude (|x| <= 4): 1 + erf cancels for x < 0


# -- module builders ------------------------------------------------------------------------------
def _module(inputs: dict[str, tuple[tuple[int, ...], str]], body: Callable) -> tvm.IRModule:
    """``main(*inputs) = body(bb, *vars)`` as a one-function dataflow module."""
    bb = relax.BlockBuilder()
    params = [relax.Var(name, relax.TensorType(list(shape), dtype)) for name, (shape, dtype) in inputs.items()]
    with bb.function("main", params):
        with bb.dataflow():
            gv = bb.emit_output(body(bb, *params))
        bb.emit_func_output(gv)
    return bb.get()


def _c(value, dtype: str = "float32") -> relax.Constant:
    return relax.const(np.asarray(value).astype(dtype), dtype)


@dataclass
class Case:
    """One sweep case.

    ``make(consts)`` returns the module with its constants (weights) taken from ``consts``, so the
    GEMM error bound can rebuild it on ``|W|``. ``kinds`` are the spinn layer kinds that must
    appear in the built program; ``terms`` is ``K`` for sums/GEMMs (0 = not a sum); ``exact``
    asks for bit equality, else ``rtol/atol`` apply.
    """

    make: Callable[[dict], tvm.IRModule]
    inputs: list[np.ndarray]
    kinds: set[str]
    consts: dict = field(default_factory=dict)
    terms: int = 0
    exact: bool = False
    rtol: float = TRANSCENDENTAL_RTOL
    atol: float = 0.0


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _randn(seed: int, *shape: int) -> np.ndarray:
    return _rng(seed).standard_normal(shape).astype("float32")


def _epilogue(bb, y, bias, relu):
    if bias is not None:
        y = bb.emit(relax.op.add(y, _c(bias)))
    if relu:
        y = bb.emit(relax.op.nn.relu(y))
    return y


def conv_case(xshape, wshape, *, bias=False, relu=False, seed=0, **attrs) -> Case:
    """conv2d (NCHW/OIHW) with optional per-channel bias and ReLU."""
    w = _randn(seed + 1, *wshape)
    consts = {"w": w}
    if bias:
        consts["b"] = _randn(seed + 2, 1, wshape[0], 1, 1)

    def make(c):
        def body(bb, x):
            y = bb.emit(relax.op.nn.conv2d(x, _c(c["w"]), **attrs))
            return _epilogue(bb, y, c.get("b"), relu)
        return _module({"x": (xshape, "float32")}, body)

    return Case(make, [_randn(seed, *xshape)], {"conv2d"}, consts, terms=wshape[1] * wshape[2] * wshape[3])


def dense_case(xshape, n, *, bias=False, relu=False, seed=0) -> Case:
    """matmul with a constant [K, N] weight (dense) + optional bias and ReLU."""
    k = xshape[-1]
    consts = {"w": _randn(seed + 1, k, n)}
    if bias:
        consts["b"] = _randn(seed + 2, n)

    def make(c):
        def body(bb, x):
            y = bb.emit(relax.op.matmul(x, _c(c["w"])))
            return _epilogue(bb, y, c.get("b"), relu)
        return _module({"x": (xshape, "float32")}, body)

    return Case(make, [_randn(seed, *xshape)], {"dense"}, consts, terms=k)


def matmul_case(ashape, bshape, seed=0) -> Case:
    """matmul of two activations (broadcast batch dims)."""
    make = lambda c: _module({"a": (ashape, "float32"), "b": (bshape, "float32")},  # noqa: E731
                             lambda bb, a, b: bb.emit(relax.op.matmul(a, b)))
    return Case(make, [_randn(seed, *ashape), _randn(seed + 1, *bshape)], {"matmul"}, terms=ashape[-1])


def unary_case(fn, shape, kind, seed=0, exact=False, lo=-4.0, hi=4.0, rtol=TRANSCENDENTAL_RTOL, atol=0.0) -> Case:
    x = _rng(seed).uniform(lo, hi, shape).astype("float32")
    make = lambda c: _module({"x": (shape, "float32")}, lambda bb, v: bb.emit(fn(v)))  # noqa: E731
    return Case(make, [x], {kind}, exact=exact, rtol=rtol, atol=atol)


def binary_case(fn, ashape, bshape, kind, seed=0, relu=False, positive_rhs=False) -> Case:
    a = _randn(seed, *ashape)
    b = _rng(seed + 1).uniform(0.5, 2.0, bshape).astype("float32") if positive_rhs else _randn(seed + 1, *bshape)

    def body(bb, x, y):
        out = bb.emit(fn(x, y))
        return bb.emit(relax.op.nn.relu(out)) if relu else out

    make = lambda c: _module({"a": (ashape, "float32"), "b": (bshape, "float32")}, body)  # noqa: E731
    return Case(make, [a, b], {kind}, exact=True)


def pool_case(op, shape, kind, seed=0, **attrs) -> Case:
    make = lambda c: _module({"x": (shape, "float32")}, lambda bb, v: bb.emit(op(v, **attrs)))  # noqa: E731
    exact = kind == "max_pool2d"
    pool = attrs.get("pool_size", (1, 1))
    terms = 0 if exact else int(np.prod(pool))
    return Case(make, [_randn(seed, *shape)], {kind}, terms=terms, exact=exact)


def data_movement_case(fn, shape, kind, seed=0, alone=True) -> Case:
    """A data-movement op alone, or feeding a multiply in the same region."""
    def body(bb, x):
        y = bb.emit(fn(x))
        return y if alone else bb.emit(relax.op.multiply(y, y))
    make = lambda c: _module({"x": (shape, "float32")}, body)  # noqa: E731
    return Case(make, [_randn(seed, *shape)], {kind} if alone else {kind, "multiply"}, exact=True)


def layer_norm_case(shape, seed=0) -> Case:
    d = shape[-1]
    consts = {"g": _randn(seed + 1, d), "b": _randn(seed + 2, d)}

    def make(c):
        return _module({"x": (shape, "float32")},
                       lambda bb, x: bb.emit(relax.op.nn.layer_norm(x, _c(c["g"]), _c(c["b"]), axes=[-1])))

    # Mean and variance are sequential fp32 sums of d terms on both sides (the same order: measured
    # <= 4 ulp); the final "+ beta" can cancel, so allow 4 ulp of the output scale (|y| ~ 4).
    return Case(make, [_randn(seed, *shape)], {"layer_norm"}, consts, rtol=4 * EPS32, atol=16 * EPS32)


def _fp32_cases() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    # conv2d: every epilogue, stride, dilation, groups (incl. depthwise), asymmetric padding
    for bias in (False, True):
        for relu in (False, True):
            cases[f"conv2d-b{int(bias)}-r{int(relu)}"] = conv_case((1, 3, 9, 9), (8, 3, 3, 3), bias=bias, relu=relu, padding=1)
    cases["conv2d-stride2"] = conv_case((2, 4, 10, 10), (6, 4, 3, 3), bias=True, strides=2, padding=1)
    cases["conv2d-dilation2"] = conv_case((1, 4, 12, 12), (8, 4, 3, 3), relu=True, dilation=2, padding=2)
    cases["conv2d-dilation-stride-asym-pad"] = conv_case((1, 3, 11, 9), (5, 3, 3, 2), strides=(2, 1), dilation=(2, 3), padding=(1, 0, 2, 1))
    cases["conv2d-groups2"] = conv_case((1, 8, 7, 7), (6, 4, 3, 3), bias=True, groups=2, padding=1)
    cases["conv2d-depthwise"] = conv_case((1, 8, 7, 7), (8, 1, 3, 3), bias=True, relu=True, groups=8, padding=1)
    cases["conv2d-1x1"] = conv_case((1, 16, 5, 5), (4, 16, 1, 1))
    # dense
    for bias in (False, True):
        for relu in (False, True):
            cases[f"dense-b{int(bias)}-r{int(relu)}"] = dense_case((4, 24), 10, bias=bias, relu=relu)
    cases["dense-3d"] = dense_case((2, 3, 17), 9, bias=True)
    # matmul of two activations
    cases["matmul-2d"] = matmul_case((5, 7), (7, 3))
    cases["matmul-batched"] = matmul_case((2, 3, 4, 8), (2, 3, 8, 5))
    cases["matmul-broadcast"] = matmul_case((2, 4, 6), (6, 3))
    # row ops
    cases["layer_norm"] = layer_norm_case((3, 5, 16))
    cases["softmax"] = unary_case(lambda v: relax.op.nn.softmax(v, axis=-1), (4, 33), "softmax")
    cases["mean-last"] = Case(lambda c: _module({"x": ((3, 4, 20), "float32")},
                                                lambda bb, v: bb.emit(relax.op.mean(v, axis=[-1]))),
                              [_randn(0, 3, 4, 20)], {"mean"}, terms=20)
    cases["mean-trailing2-keepdims"] = Case(lambda c: _module({"x": ((2, 3, 6, 5), "float32")},
                                                              lambda bb, v: bb.emit(relax.op.mean(v, axis=[2, 3], keepdims=True))),
                                            [_randn(0, 2, 3, 6, 5)], {"mean"}, terms=30)
    # pooling
    mp, ap = relax.op.nn.max_pool2d, relax.op.nn.avg_pool2d
    cases["max_pool2d"] = pool_case(mp, (1, 3, 8, 8), "max_pool2d", pool_size=(2, 2), strides=(2, 2))
    cases["max_pool2d-pad"] = pool_case(mp, (2, 2, 9, 9), "max_pool2d", pool_size=(3, 3), strides=(2, 2), padding=(1, 1))
    cases["max_pool2d-dilation"] = pool_case(mp, (1, 2, 9, 8), "max_pool2d", pool_size=(2, 3), dilation=(2, 1), padding=(1, 0, 0, 2))
    for cip in (False, True):
        cases[f"avg_pool2d-pad-cip{int(cip)}"] = pool_case(ap, (1, 3, 9, 9), "avg_pool2d", pool_size=(3, 3), strides=(2, 2),
                                                           padding=(1, 1), count_include_pad=cip)
    cases["avg_pool2d-cip-asym"] = pool_case(ap, (1, 2, 7, 6), "avg_pool2d", pool_size=(2, 3), padding=(0, 1, 1, 2),
                                             count_include_pad=True)
    cases["adaptive_avg_pool2d"] = Case(lambda c: _module({"x": ((1, 4, 8, 6), "float32")},
                                                          lambda bb, v: bb.emit(relax.op.nn.adaptive_avg_pool2d(v, (2, 3)))),
                                        [_randn(0, 1, 4, 8, 6)], {"avg_pool2d"}, terms=8)
    cases["global_avg_pool"] = Case(lambda c: _module({"x": ((2, 5, 4, 4), "float32")},
                                                      lambda bb, v: bb.emit(relax.op.nn.adaptive_avg_pool2d(v, (1, 1)))),
                                    [_randn(0, 2, 5, 4, 4)], {"avg_pool2d"}, terms=16)
    # element-wise unary (single ops)
    cases["relu"] = unary_case(relax.op.nn.relu, (3, 17), "relu", exact=True)
    cases["clip"] = unary_case(lambda v: relax.op.clip(v, -1.5, 2.0), (2, 3, 11), "clip", exact=True)
    cases["sigmoid"] = unary_case(relax.op.sigmoid, (5, 13), "sigmoid", lo=-12, hi=12)
    cases["tanh"] = unary_case(relax.op.tanh, (5, 13), "tanh", lo=-6, hi=6)
    cases["gelu"] = unary_case(relax.op.nn.gelu, (4, 19), "gelu", atol=GELU_ATOL)
    cases["gelu_tanh"] = unary_case(relax.op.nn.gelu_tanh, (4, 19), "gelu_tanh", atol=GELU_ATOL)
    cases["negative"] = unary_case(relax.op.negative, (3, 17), "negative", exact=True)
    cases["sqrt"] = unary_case(relax.op.sqrt, (4, 9), "sqrt", exact=True, lo=0.0, hi=50.0)  # VSQRT: correctly rounded
    cases["rsqrt"] = unary_case(relax.op.rsqrt, (4, 9), "rsqrt", exact=True, lo=1e-3, hi=50.0)  # sqrt, then divide
    cases["power-2"] = unary_case(lambda v: relax.op.power(v, _c(2.0)), (2, 3, 7), "power", exact=True)  # x*x: the rounded square
    # (x*x)*x rounds twice, llvm's powf once: one ulp apart at most
    cases["power-3"] = unary_case(lambda v: relax.op.power(v, _c(3.0)), (2, 3, 7), "power", rtol=2 * EPS32)
    # element-wise binary, with and without broadcasting
    for name, fn in (("add", relax.op.add), ("subtract", relax.op.subtract), ("multiply", relax.op.multiply)):
        cases[f"{name}"] = binary_case(fn, (3, 4, 5), (3, 4, 5), name)
        cases[f"{name}-bcast"] = binary_case(fn, (2, 3, 4, 5), (4, 1), name)
    cases["divide"] = binary_case(relax.op.divide, (3, 4, 5), (3, 4, 5), "divide", positive_rhs=True)
    cases["divide-bcast"] = binary_case(relax.op.divide, (2, 3, 6), (3, 1), "divide", positive_rhs=True)
    cases["add_relu"] = binary_case(relax.op.add, (2, 8, 3, 3), (2, 8, 3, 3), "add", relu=True)
    # data movement
    for alone in (True, False):
        tag = "" if alone else "-then-multiply"
        cases["reshape" + tag] = data_movement_case(lambda v: relax.op.reshape(v, (6, 10)), (3, 4, 5), "reshape", alone=alone)
        cases["permute_dims" + tag] = data_movement_case(lambda v: relax.op.permute_dims(v, [0, 2, 1]), (2, 3, 7),
                                                         "permute_dims", alone=alone)
        cases["broadcast_to" + tag] = data_movement_case(lambda v: relax.op.broadcast_to(v, (4, 3, 5)), (3, 1),
                                                         "broadcast_to", alone=alone)
        cases["expand_dims" + tag] = data_movement_case(lambda v: relax.op.expand_dims(v, [0, 2]), (3, 5), "reshape", alone=alone)
        cases["squeeze" + tag] = data_movement_case(lambda v: relax.op.squeeze(v, [1]), (3, 1, 5), "reshape", alone=alone)
        cases["concat" + tag] = data_movement_case(lambda v: relax.op.concat([v, relax.op.negative(v), v], axis=1),
                                                   (2, 3, 4), "concat", alone=alone)
    # strided slices: steps, negative bounds and steps, clamped ends, several axes
    for tag, (shape, axes, begin, end, strides) in {
        "last-half": ((2, 8, 6), [2], [3], [6], [1]),
        "step2": ((2, 9, 6), [1], [1], [9], [2]),
        "negative-bounds": ((4, 10), [1], [-7], [-1], [1]),
        "reverse": ((3, 10), [1], [8], [1], [-3]),
        "clamped": ((3, 10), [0, 1], [1, -100], [100, 4], [1, 1]),
        "rotary-halves": ((1, 2, 5, 8), [3, 3][:1], [4], [2**31 - 1], [1]),
    }.items():
        cases[f"strided_slice-{tag}"] = data_movement_case(
            lambda v, a=axes, b=begin, e=end, s=strides: relax.op.strided_slice(v, a, b, e, s), shape, "strided_slice")
    # split (a tuple): rewritten to one strided slice per part before partitioning
    for tag, spec in {"sections": 3, "indices": [2, 7]}.items():
        def split_body(bb, v, spec=spec):
            parts = bb.emit(relax.op.split(v, spec, axis=1))
            return bb.emit(relax.op.concat([relax.TupleGetItem(parts, 2), relax.TupleGetItem(parts, 0)], axis=1))
        cases[f"split-{tag}"] = Case(lambda c, body=split_body: _module({"x": ((2, 12, 3), "float32")}, body),
                                     [_randn(0, 2, 12, 3)], {"strided_slice", "concat"}, exact=True)
    # gathers: an embedding table (constant) by int32 token ids, another axis, a computed table,
    # and the index modes on out-of-range indices
    for tag, (tshape, ishape, axis, mode, lo, hi) in {
        "embedding": ((50, 8), (1, 7), 0, "fast", 0, 50),
        "axis1": ((4, 9, 3), (5,), 1, "fast", 0, 9),
        "clip": ((12, 4), (2, 6), 0, "clip", -20, 30),
        "wrap": ((12, 4), (2, 6), 0, "wrap", -20, 30),
    }.items():
        cases[f"take-{tag}"] = take_case(tshape, ishape, axis, mode, lo, hi)
    cases["take-computed-table"] = Case(
        lambda c: _module({"t": ((6, 5), "float32"), "i": ((4,), "int32")},
                          lambda bb, t, i: bb.emit(relax.op.take(relax.op.negative(t), i, axis=0))),
        [_randn(0, 6, 5), np.array([5, 0, 2, 2], "int32")], {"take", "negative"}, exact=True)
    return cases


def test_take_out_of_range_index_names_the_layer():
    """``fast`` promises in-range indices (the host kernel would read out of bounds): the
    simulator raises, naming the index and the extent."""
    case = take_case((10, 4), (3,), 0, "fast", 0, 10)
    ex = relax.build(case.make(case.consts), target="spinn")
    messages = []
    for native in ("1", "0"):  # a native run (C++) and the Python step say the same
        with pytest.MonkeyPatch.context() as m:
            m.setenv("TVM_SPINN_SIM_NATIVE", native)
            with pytest.raises(IndexError, match="take index 10 is out of range for axis 0 of extent 10") as info:
                _run(ex, [np.array([1, 10, 2], "int32")])
        messages.append(str(info.value))
    assert messages[0] == messages[1] and messages[0].split(":")[0], messages


def test_take_roofline_counts_the_gathered_rows_not_the_table():
    """An embedding lookup moves the rows it gathers: the DRAM bound charges those (7 rows of
    64 floats), not the 1000-row table (streamed from DRAM, not kept resident in SRAM)."""
    case = take_case((1000, 64), (1, 7), 0, "fast", 0, 1000)
    with tvm_spinn.MappingOptions(weights="stream"):
        ex = relax.build(case.make(case.consts), target="spinn")
    rep = tvm_spinn.report(ex)
    arch = tvm_spinn.arch_of(tvm_spinn.get_target("spinn"))
    moved = 7 * 4 + 2 * 7 * 64 * 4  # indices in; gathered rows read; rows written out
    assert rep.roofline_s == pytest.approx(moved / arch.total_dram_bw_bytes_s, rel=1e-9)
    assert rep.latency_s >= rep.physical_bound_s > 0


def take_case(tshape, ishape, axis, mode, lo, hi, seed=0) -> Case:
    consts = {"t": _randn(seed + 1, *tshape)}
    make = lambda c: _module({"i": (ishape, "int32")},  # noqa: E731
                             lambda bb, i: bb.emit(relax.op.take(_c(c["t"]), i, axis=axis, mode=mode)))
    return Case(make, [_rng(seed).integers(lo, hi, ishape).astype("int32")], {"take"}, consts, exact=True)


FP32_CASES = _fp32_cases()


def _run(ex, inputs: list[np.ndarray]) -> np.ndarray:
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy()


def _spinn_kinds(ex) -> set[str]:
    return {row["kind"] for row in tvm_spinn.report(ex).layers}


def _assert_offloaded(mod: tvm.IRModule, ex, kinds: set[str]) -> None:
    """No op of ``mod`` stayed on the host and the spinn programs hold the expected layers."""
    summary = tvm_spinn.summarize_partition(tvm_spinn.partition_for_spinn(mod))
    assert not summary.fallback_ops and not summary.fallback_reasons, summary
    got = _spinn_kinds(ex)
    assert kinds <= got, f"expected spinn layers {kinds}, the program has {got}"


@pytest.mark.parametrize("name", list(FP32_CASES))
def test_op_matches_llvm(name):
    case = FP32_CASES[name]
    mod = case.make(case.consts)
    ex = relax.build(mod, target="spinn")
    _assert_offloaded(mod, ex, case.kinds)
    got = _run(ex, case.inputs)
    ref = _run(relax.build(mod, target="llvm"), case.inputs)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if case.exact:
        np.testing.assert_array_equal(got, ref)
    elif case.terms:
        # 2 * K * eps * sum|a||b| (see the module docstring), sum|a||b| from llvm on |x|, |W|;
        # plus one rounding of the result (bias add / final divide).
        mag = _run(relax.build(case.make({k: np.abs(v) for k, v in case.consts.items()}), target="llvm"),
                   [np.abs(a) for a in case.inputs])
        bound = (2 * case.terms + 2) * EPS32 * mag + np.finfo(np.float32).tiny
        assert np.all(np.abs(got - ref) <= bound), float(np.max(np.abs(got - ref) - bound))
    else:
        np.testing.assert_allclose(got, ref, rtol=case.rtol, atol=case.atol)


# -- int8 ---------------------------------------------------------------------------------------
def _qgemm_module(op: str, xshape, wq: np.ndarray, *, bias=None, relu=False, requant=True, **attrs) -> tvm.IRModule:
    """[quantize](relu(op(dequantize(xq), dequantize(Wq)) + bias)) with per-channel weights."""
    channels = wq.shape[0] if op == "conv2d" else wq.shape[1]
    sw = np.linspace(0.01, 0.03, channels).astype("float32")

    def body(bb, xq):
        x = bb.emit(relax.op.dequantize(xq, _c(0.05), _c(3, "int8")))
        w = bb.emit(relax.op.dequantize(_c(wq, "int8"), _c(sw), _c(np.zeros(channels), "int8"),
                                        axis=0 if op == "conv2d" else 1))
        y = bb.emit(relax.op.nn.conv2d(x, w, **attrs) if op == "conv2d" else relax.op.matmul(x, w))
        if bias is not None:
            y = bb.emit(relax.op.add(y, _c(bias.reshape((1, -1, 1, 1) if op == "conv2d" else (-1,)))))
        if relu:
            y = bb.emit(relax.op.nn.relu(y))
        if requant:
            y = bb.emit(relax.op.quantize(y, _c(0.2), _c(-5, "int8"), out_dtype="int8"))
        return y

    return _module({"xq": (xshape, "int8")}, body)


def _int8_cases() -> dict[str, tuple[tvm.IRModule, list[np.ndarray], set[str]]]:
    rng = _rng(11)
    x4 = rng.integers(-128, 128, (1, 4, 7, 7)).astype("int8")
    x2 = rng.integers(-128, 128, (16, 24)).astype("int8")
    wc = rng.integers(-127, 128, (8, 4, 3, 3)).astype("int8")
    wd = rng.integers(-127, 128, (24, 12)).astype("int8")
    wdw = rng.integers(-127, 128, (4, 1, 3, 3)).astype("int8")
    bc, bd = rng.standard_normal(8).astype("float32"), rng.standard_normal(12).astype("float32")
    xf = (rng.standard_normal((2, 3, 5)) * 4).astype("float32")
    qa = rng.integers(-128, 128, (2, 6, 20)).astype("int8")
    qb = rng.integers(-128, 128, (2, 20, 9)).astype("int8")

    def _qmatmul(bb, a, b):  # two int8 activations on the MAC array, requantized
        x = bb.emit(relax.op.dequantize(a, _c(0.05), _c(-2, "int8")))
        y = bb.emit(relax.op.dequantize(b, _c(0.02), _c(1, "int8")))
        z = bb.emit(relax.op.matmul(x, y))
        return bb.emit(relax.op.quantize(z, _c(0.25), _c(3, "int8"), out_dtype="int8"))

    def _int8_permute(bb, x):  # int8 activations move as bytes
        y = bb.emit(relax.op.permute_dims(x, [0, 2, 3, 1]))
        return bb.emit(relax.op.dequantize(y, _c(0.1), _c(-7, "int8")))
    cases = {
        "qconv2d-bias-relu-requant": (_qgemm_module("conv2d", x4.shape, wc, bias=bc, relu=True, padding=1), [x4], {"conv2d"}),
        "qconv2d-dilation-stride": (_qgemm_module("conv2d", x4.shape, wc, strides=2, dilation=2, padding=2), [x4], {"conv2d"}),
        "qconv2d-depthwise": (_qgemm_module("conv2d", x4.shape, wdw, groups=4, padding=1), [x4], {"conv2d"}),
        "qdense-bias-relu-requant": (_qgemm_module("dense", x2.shape, wd, bias=bd, relu=True), [x2], {"dense"}),
        "quantize": (_module({"x": (xf.shape, "float32")}, lambda bb, v: bb.emit(
            relax.op.quantize(v, _c(0.05), _c(-3, "int8"), out_dtype="int8"))), [xf], {"quantize"}),
        "quantize-uint8-per-channel": (_module({"x": (xf.shape, "float32")}, lambda bb, v: bb.emit(
            relax.op.quantize(v, _c([0.02, 0.05, 0.1]), _c([120, 128, 130], "uint8"), axis=1, out_dtype="uint8"))),
            [xf], {"quantize"}),
        "dequantize": (_module({"x": (x2.shape, "int8")}, lambda bb, v: bb.emit(
            relax.op.dequantize(v, _c(0.07), _c(5, "int8")))), [x2], {"dequantize"}),
        "qmatmul-requant": (_module({"a": (qa.shape, "int8"), "b": (qb.shape, "int8")}, _qmatmul), [qa, qb], {"matmul"}),
        "int8-permute_dims": (_module({"x": (x4.shape, "int8")}, _int8_permute), [x4], {"permute_dims", "dequantize"}),
    }
    return cases


INT8_CASES = _int8_cases()


@pytest.mark.parametrize("name", list(INT8_CASES))
def test_int8_op_matches_llvm_exactly(name):
    mod, inputs, kinds = INT8_CASES[name]
    ex = relax.build(mod, target="spinn")
    _assert_offloaded(mod, ex, kinds)
    if kinds & {"conv2d", "dense", "matmul"}:
        assert {row["mode"] for row in tvm_spinn.report(ex).layers if row["kind"] in kinds} == {"int8"}
    got = _run(ex, inputs)
    ref = _run(relax.build(mod, target="llvm"), inputs)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if kinds & {"conv2d", "dense", "matmul"}:  # one step at most, and rarely (see the module docstring)
        diff = np.abs(got.astype(np.int64) - ref.astype(np.int64))
        assert diff.max() <= 1 and np.count_nonzero(diff) <= 1 + 0.02 * diff.size, (diff.max(), np.count_nonzero(diff))
        assert len(np.unique(ref)) > 10  # not a saturated, trivially equal output
    else:
        np.testing.assert_array_equal(got, ref)


def test_int8_dense_fp32_output_within_the_fp32_sum_bound():
    rng = _rng(12)
    x = rng.integers(-128, 128, (5, 40)).astype("int8")
    w = rng.integers(-127, 128, (40, 7)).astype("int8")
    bias = rng.standard_normal(7).astype("float32")
    mod = _qgemm_module("dense", x.shape, w, bias=bias, requant=False)
    ex = relax.build(mod, target="spinn")
    _assert_offloaded(mod, ex, {"dense"})
    got = _run(ex, [x])
    ref = _run(relax.build(mod, target="llvm"), [x])
    sw = np.linspace(0.01, 0.03, 7)  # as _qgemm_module sets them (s_x = 0.05, z_x = 3)
    mag = 0.05 * sw * (np.abs(x.astype(np.float64) - 3) @ np.abs(w.astype(np.float64))) + np.abs(bias)
    assert np.all(np.abs(got.astype(np.float64) - ref) <= (40 + 3) * EPS32 * mag)
    assert not np.array_equal(got, np.zeros_like(got))


# -- edge cases -----------------------------------------------------------------------------------
def _max_pool_module(shape, **attrs) -> tvm.IRModule:
    return _module({"x": (shape, "float32")}, lambda bb, v: bb.emit(relax.op.nn.max_pool2d(v, **attrs)))


def _ort_max_pool(x: np.ndarray, **attrs) -> np.ndarray:
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    node = helper.make_node("MaxPool", ["x"], ["y"], **attrs)
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * x.ndim)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9  # onnxruntime rejects onnx 1.23's default IR version
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_max_pool_window_entirely_in_padding_gives_lowest_float():
    """ONNX MaxPool kernel [2,1], dilations [2,1], pads [1,0,1,0] on a 1x1 input: the only window
    reads two padding rows; onnxruntime and TVM give the lowest float32, not -inf."""
    x = np.array([[[[5.0]]]], "float32")
    mod = _max_pool_module(x.shape, pool_size=(2, 1), dilation=(2, 1), padding=(1, 0, 1, 0))
    ex = relax.build(mod, target="spinn")
    _assert_offloaded(mod, ex, {"max_pool2d"})
    got = _run(ex, [x])
    ort_ref = _ort_max_pool(x, kernel_shape=[2, 1], dilations=[2, 1], pads=[1, 0, 1, 0])
    np.testing.assert_array_equal(got, ort_ref)
    np.testing.assert_array_equal(got, _run(relax.build(mod, target="llvm"), [x]))
    assert got.ravel()[0] == np.finfo(np.float32).min


def _fallback_llvm(mod):
    """``mod`` built for llvm by the fallback's pipeline (what runs beside offloaded operators)."""
    with tvm_spinn.build_options():
        return relax.build(mod, target="llvm")


def test_max_pool_of_nan_matches_llvm():
    """NaNs in and around windows, with padding. TVM's max reducer is ``acc > v ? acc : v`` from
    the lowest float, a NaN propagated (PyTorch's max pooling), and the same model must give the
    same answer whether the pool is offloaded or not: compare with the fallback's llvm build,
    NaNs included, and with PyTorch."""
    x = _randn(5, 2, 3, 7, 7)
    x[_rng(6).random(x.shape) < 0.2] = np.nan
    x[0, 0, 0, 0] = -np.inf  # a window of -inf and padding: lowest float on both
    mod = _max_pool_module(x.shape, pool_size=(3, 2), strides=(2, 1), padding=(1, 1))
    ex = relax.build(mod, target="spinn")
    _assert_offloaded(mod, ex, {"max_pool2d"})
    got = _run(ex, [x])
    ref = _run(_fallback_llvm(mod), [x])
    assert np.isnan(ref).any() and not np.isnan(ref).all()
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))  # NaN payloads too
    torch = pytest.importorskip("torch")
    want = torch.nn.functional.max_pool2d(torch.from_numpy(x), (3, 2), (2, 1), (1, 1)).numpy()
    np.testing.assert_array_equal(got, want)  # NaN where PyTorch's is


_SPECIALS = np.array([-1e30, -100.0, -89.0, -0.0, 0.0, 1e-40, 88.7, 100.0, 3e38, np.inf, -np.inf, np.nan], "float32")


@pytest.mark.parametrize("name,fn,arity", [
    ("sigmoid", relax.op.sigmoid, 1), ("tanh", relax.op.tanh, 1), ("gelu", relax.op.nn.gelu, 1),
    ("gelu_tanh", relax.op.nn.gelu_tanh, 1), ("relu", relax.op.nn.relu, 1),
    ("clip", lambda v: relax.op.clip(v, -1.0, 1.0), 1), ("softmax", relax.op.nn.softmax, 1),
    ("divide", relax.op.divide, 2), ("multiply", relax.op.multiply, 2), ("add", relax.op.add, 2),
])
def test_special_values_match_llvm_without_numpy_warnings(name, fn, arity):
    """inf, NaN, overflow, 0/0 and denormals: IEEE results like the llvm build, and no numpy
    RuntimeWarning escapes the simulator (warnings are errors here)."""
    x = np.tile(_SPECIALS, (len(_SPECIALS), 1))  # every pair of specials for the binary ops
    ins = [x, x.T.copy()][:arity]
    mod = _module({f"a{i}": (x.shape, "float32") for i in range(arity)}, lambda bb, *v: bb.emit(fn(*v)))
    ex = relax.build(mod, target="spinn")
    _assert_offloaded(mod, ex, set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _run(ex, ins)
    # relu and clip propagate NaN as PyTorch (the fallback's llvm build too; TVM's own does not)
    ref = _run(_fallback_llvm(mod) if name in ("relu", "clip") else relax.build(mod, target="llvm"), ins)
    if name in ("sigmoid", "tanh", "gelu", "gelu_tanh", "softmax"):  # transcendental: see the docstring
        # denormal results (tanh(1e-40)) may come back flushed to zero from llvm's expansion
        atol = GELU_ATOL if name.startswith("gelu") else float(np.finfo(np.float32).tiny)
        np.testing.assert_allclose(got, ref, rtol=TRANSCENDENTAL_RTOL, atol=atol)  # equal_nan, inf == inf
    else:
        np.testing.assert_array_equal(got, ref)


def _onnx_conv_net(path) -> str:
    """Conv + Relu -> MaxPool -> MatMul (constant) + Add -> Softmax, input ``x`` [N, 3, 8, 8]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = _rng(21)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype("float32"), n) for n, s in
             (("w", (4, 3, 3, 3)), ("b", (4,)), ("fc", (4, 5)), ("fb", (5,)))]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("MatMul", ["p", "fc"], ["m"]), helper.make_node("Add", ["m", "fb"], ["a"]),
             helper.make_node("Softmax", ["a"], ["y"], axis=-1)]
    graph = helper.make_graph(nodes, "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 4, 5])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return str(path)


def test_zero_batch_from_shape_dict_gives_an_empty_result(tmp_path):
    """An ONNX model imported with batch 0 in ``shape_dict``: the result has onnxruntime's shape
    (0, 4, 4, 5), the zero-size ops stay on the host with a logged reason (instead of dividing by
    zero in the tiler), and the same model with batch 2 is still offloaded."""
    import onnxruntime as ort

    path = _onnx_conv_net(tmp_path / "net.onnx")
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for batch in (0, 2):
        mod = tvm_spinn.frontend.from_onnx(path, shape_dict={"x": (batch, 3, 8, 8)})
        summary = tvm_spinn.summarize_partition(tvm_spinn.partition_for_spinn(mod))
        x = _randn(batch, batch, 3, 8, 8)
        got = _run(relax.build(mod, target="spinn"), [x])
        want = sess.run(None, {"x": x})[0]
        assert got.shape == want.shape == (batch, 4, 4, 5) and got.dtype == want.dtype
        if batch == 0:
            assert not summary.offloaded_ops and summary.fallback_reasons, summary
            assert all("zero-size" in r for r in summary.fallback_reasons.values()), summary
        else:
            assert not summary.fallback_ops and not summary.fallback_reasons, summary
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # 27-term conv sums


def test_tiler_names_a_zero_size_tensor():
    """A program built by hand with a zero-size tensor: one MappingError naming layer and dim."""
    from tvm_spinn.mapping.tiling import tile_layer

    case = FP32_CASES["dense-b0-r0"]
    mod = case.make(case.consts)
    (prog,) = tvm_spinn.report(relax.build(mod, target="spinn")).programs
    layer = prog.layers[0]
    tensors = list(prog.tensors)
    tensors[layer.output] = dataclasses.replace(tensors[layer.output], shape=[0, 10])
    prog = dataclasses.replace(prog, tensors=tensors)
    with pytest.raises(tvm_spinn.MappingError, match=rf"layer {layer.name}: tensor \d+ has a zero-size shape \(0, 10\) \(dim 0\)"):
        tile_layer(prog, 0, tvm_spinn.SpinnArch())
