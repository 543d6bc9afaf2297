"""Tests for the ONNX-level passes in ``tvm_spinn.frontend.onnx_passes``."""

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvm_spinn.frontend import onnx_passes as P

ort = pytest.importorskip("onnxruntime")

FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64


def _ops(model):
    return Counter(n.op_type for n in model.graph.node)


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 9 if opset >= 13 else 7
    if any(not o.type.tensor_type.HasField("shape") for o in m.graph.output):
        # outputs given without shape: let shape inference fill them in
        inferred = onnx.shape_inference.infer_shapes(m, data_prop=True)
        del m.graph.output[:]
        m.graph.output.extend(inferred.graph.output)
    onnx.checker.check_model(m)
    return m


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def _run(model, feeds):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.ir_version = 9  # onnxruntime 1.31 rejects the IR 14 onnx 1.23 writes
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def _same(before, after, feeds, rtol=1e-5, atol=1e-6):
    onnx.checker.check_model(after)
    for a, b in zip(_run(before, feeds), _run(after, feeds)):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=atol)


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------- upgrade_opset


def test_upgrade_opset_converts_old_model():
    # opset 11: Unsqueeze takes axes as attribute
    m = _model([helper.make_node("Unsqueeze", ["x"], ["y"], axes=[0]),
                helper.make_node("Relu", ["y"], ["z"])],
               [helper.make_tensor_value_info("x", FLOAT, [3, 4])],
               [helper.make_tensor_value_info("z", FLOAT, [1, 3, 4])], opset=11)
    new, res = P.upgrade_opset(m)
    assert res.changed and "11" in res.detail
    assert P._opset(new) == 13 and P._opset(m) == 11  # input untouched
    unsq = next(n for n in new.graph.node if n.op_type == "Unsqueeze")
    assert len(unsq.input) == 2 and not unsq.attribute  # axes became an input
    _same(m, new, {"x": _rand((3, 4))})


def test_upgrade_opset_noop_and_failure():
    m = _model([helper.make_node("Relu", ["x"], ["y"])],
               [helper.make_tensor_value_info("x", FLOAT, [2])],
               [helper.make_tensor_value_info("y", FLOAT, [2])])
    new, res = P.upgrade_opset(m)
    assert not res.changed and new == m
    bad = onnx.ModelProto()
    bad.CopyFrom(m)
    bad.opset_import[0].version = 9
    bad.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(ValueError, match="opset 9"):
        P.upgrade_opset(bad)


# ---------------------------------------------------------------- shape_inference


def test_shape_inference_adds_value_info():
    m = _model([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["y"], ["z"])],
               [helper.make_tensor_value_info("x", FLOAT, [2, 3])],
               [helper.make_tensor_value_info("z", FLOAT, None)])
    new, res = P.shape_inference(m)
    assert res.changed
    assert "y" in {v.name for v in new.graph.value_info}
    _, res2 = P.shape_inference(new)
    assert not res2.changed


# ---------------------------------------------------------------- remove_identity


def test_remove_identity_and_dropout():
    nodes = [
        helper.make_node("Identity", ["x"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Dropout", ["b"], ["c"]),
        helper.make_node("Neg", ["c"], ["d"]),
        helper.make_node("Identity", ["d"], ["out"]),  # graph output: rename producer
        helper.make_node("Dropout", ["b"], ["e", "mask"]),  # mask used: keep
        helper.make_node("Cast", ["mask"], ["mask_f"], to=FLOAT),
        helper.make_node("Add", ["e", "mask_f"], ["out2"]),
    ]
    m = _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [2, 3])],
               [helper.make_tensor_value_info("out", FLOAT, [2, 3]),
                helper.make_tensor_value_info("out2", FLOAT, [2, 3])])
    new, res = P.remove_identity(m)
    assert res.changed and "2 Identity nodes" in res.detail and "1 Dropout node" in res.detail
    assert _ops(new)["Identity"] == 0 and _ops(new)["Dropout"] == 1
    assert [o.name for o in new.graph.output] == ["out", "out2"]
    assert _ops(m)["Identity"] == 2  # input untouched
    _same(m, new, {"x": _rand((2, 3))})


def test_remove_identity_keeps_input_passthrough():
    m = _model([helper.make_node("Identity", ["x"], ["y"])],
               [helper.make_tensor_value_info("x", FLOAT, [2])],
               [helper.make_tensor_value_info("y", FLOAT, [2])])
    new, res = P.remove_identity(m)
    assert not res.changed and _ops(new)["Identity"] == 1
    _same(m, new, {"x": _rand((2,))})


# ---------------------------------------------------------------- fold_constants


def _shape_reshape_model():
    """x:[2,3,8] -> Shape -> Gather(0),Gather(1) -> Concat([b,s,2,4]) -> Reshape."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Shape", ["r"], ["shp"]),
        helper.make_node("Gather", ["shp", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["shp", "i1"], ["s"], axis=0),
        helper.make_node("Unsqueeze", ["b", "ax0"], ["b1"]),
        helper.make_node("Unsqueeze", ["s", "ax0"], ["s1"]),
        helper.make_node("Constant", [], ["hd"], value=_init("hd_v", np.array([2, 4], np.int64))),
        helper.make_node("Concat", ["b1", "s1", "hd"], ["newshape"], axis=0),
        helper.make_node("Reshape", ["r", "newshape"], ["y"]),
        # Split with computed sizes: Div(shape[2], 2) -> Concat -> Split
        helper.make_node("Gather", ["shp", "i2"], ["d"], axis=0),
        helper.make_node("Div", ["d", "two"], ["half"]),
        helper.make_node("Unsqueeze", ["half", "ax0"], ["half1"]),
        helper.make_node("Concat", ["half1", "half1"], ["sizes"], axis=0),
        helper.make_node("Split", ["r", "sizes"], ["p", "q"], axis=2),
        helper.make_node("Sub", ["p", "q"], ["z"]),
    ]
    inits = [_init("i0", np.array(0, np.int64)), _init("i1", np.array(1, np.int64)),
             _init("i2", np.array(2, np.int64)), _init("ax0", np.array([0], np.int64)),
             _init("two", np.array(2, np.int64))]
    return _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [2, 3, 8])],
                  [helper.make_tensor_value_info("y", FLOAT, [2, 3, 2, 4]),
                   helper.make_tensor_value_info("z", FLOAT, [2, 3, 4])], inits)


def test_fold_constants_shape_subgraph():
    m = _shape_reshape_model()
    inferred, _ = P.shape_inference(m)
    new, res = P.fold_constants(inferred)
    assert res.changed and "Shape" in res.detail
    assert _ops(new) == Counter({"Relu": 1, "Reshape": 1, "Split": 1, "Sub": 1})
    inits = {t.name: numpy_helper.to_array(t) for t in new.graph.initializer}
    reshape = next(n for n in new.graph.node if n.op_type == "Reshape")
    np.testing.assert_array_equal(inits[reshape.input[1]], [2, 3, 2, 4])
    split = next(n for n in new.graph.node if n.op_type == "Split")
    np.testing.assert_array_equal(inits[split.input[1]], [4, 4])
    assert "i0" not in inits  # dead initializers removed
    _same(m, new, {"x": _rand((2, 3, 8))})


def test_fold_constants_without_static_shape_keeps_shape():
    m = _model([helper.make_node("Shape", ["x"], ["s"]),
                helper.make_node("Reshape", ["x", "s"], ["y"])],
               [helper.make_tensor_value_info("x", FLOAT, ["n", 4])],
               [helper.make_tensor_value_info("y", FLOAT, None)])
    new, res = P.fold_constants(P.shape_inference(m)[0])
    assert not res.changed and _ops(new)["Shape"] == 1


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_fold_constants_opset_variants(opset):
    """Unsqueeze/Squeeze/Split/Slice/ReduceProd with axes as attribute vs input."""
    c = _init("c", np.arange(24, dtype=np.int64).reshape(2, 3, 4))
    inits = [c]
    if opset < 13:
        nodes = [helper.make_node("Unsqueeze", ["c"], ["u"], axes=[0]),
                 helper.make_node("Squeeze", ["u"], ["sq"], axes=[0]),
                 helper.make_node("Split", ["sq"], ["s0", "s1"], axis=2, split=[1, 3])]
    else:
        inits += [_init("ax", np.array([0], np.int64)), _init("sp", np.array([1, 3], np.int64))]
        nodes = [helper.make_node("Unsqueeze", ["c", "ax"], ["u"]),
                 helper.make_node("Squeeze", ["u", "ax"], ["sq"]),
                 helper.make_node("Split", ["sq", "sp"], ["s0", "s1"], axis=2)]
    inits += [_init("st", np.array([1], np.int64)), _init("en", np.array([100], np.int64)),
              _init("sax", np.array([1], np.int64))]
    nodes += [helper.make_node("Slice", ["s1", "st", "en", "sax"], ["sl"]),
              helper.make_node("Transpose", ["sl"], ["t"], perm=[2, 0, 1]),
              helper.make_node("Cast", ["t"], ["tf"], to=FLOAT),
              helper.make_node("Add", ["x", "tf"], ["y"])]
    if opset >= 18:  # num_outputs form
        nodes.append(helper.make_node("Split", ["c"], ["h0", "h1"], axis=2, num_outputs=2))
        nodes.append(helper.make_node("Shape", ["h1"], ["hs"]))
        nodes.append(helper.make_node("ReduceProd", ["hs"], ["numel"], keepdims=0))
    else:
        nodes.append(helper.make_node("Shape", ["s0"], ["hs"]))
        nodes.append(helper.make_node("ReduceProd", ["hs"], ["numel"], keepdims=0))
    nodes.append(helper.make_node("Cast", ["numel"], ["numf"], to=FLOAT))
    nodes.append(helper.make_node("Mul", ["y", "numf"], ["z"]))
    m = _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [3, 2, 2])],
               [helper.make_tensor_value_info("z", FLOAT, None)], inits, opset=opset)
    new, res = P.fold_constants(m)
    assert res.changed
    assert _ops(new) == Counter({"Add": 1, "Mul": 1})
    _same(m, new, {"x": _rand((3, 2, 2))})


def test_fold_constants_misc_ops():
    nodes = [
        helper.make_node("Range", ["r0", "r1", "r2"], ["rng"]),
        helper.make_node("ConstantOfShape", ["cs"], ["ones"],
                         value=_init("v", np.array([1], np.int64))),
        helper.make_node("Equal", ["rng", "ones"], ["eq"]),
        helper.make_node("Where", ["eq", "ones", "rng"], ["w"]),  # [0, 1, 2, 3]
        helper.make_node("Expand", ["w", "exs"], ["ex"]),
        helper.make_node("Cast", ["ex"], ["exf"], to=FLOAT),
        helper.make_node("Div", ["neg7", "two"], ["idiv"]),  # integer truncation: -3
        helper.make_node("Cast", ["idiv"], ["idivf"], to=FLOAT),
        helper.make_node("Add", ["exf", "idivf"], ["k"]),
        helper.make_node("Mul", ["x", "k"], ["y"]),
    ]
    inits = [_init("r0", np.array(0, np.int64)), _init("r1", np.array(4, np.int64)),
             _init("r2", np.array(1, np.int64)), _init("cs", np.array([4], np.int64)),
             _init("exs", np.array([2, 4], np.int64)), _init("neg7", np.array(-7, np.int64)),
             _init("two", np.array(2, np.int64))]
    m = _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [2, 4])],
               [helper.make_tensor_value_info("y", FLOAT, None)], inits)
    new, res = P.fold_constants(m)
    assert _ops(new) == Counter({"Mul": 1})
    k = numpy_helper.to_array(next(t for t in new.graph.initializer if t.name == "k"))
    np.testing.assert_array_equal(k, [[-3, -2, -1, 0]] * 2)
    _same(m, new, {"x": _rand((2, 4))})


@pytest.mark.parametrize("opset", [9, 15])
def test_fold_constants_slice_and_shape_variants(opset):
    """Slice (attributes in opset 9, negative steps / int64 extremes in >= 10),
    Shape start/end (opset 15), Squeeze without axes, Flatten, Tile."""
    c = _init("c", np.arange(24, dtype=np.float32).reshape(1, 4, 6))
    big, small = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    if opset < 10:
        nodes = [helper.make_node("Slice", ["c"], ["sl"], starts=[1, -1], ends=[3, 100],
                                  axes=[1, -1])]
        inits = [c]
        expect_shape = (1, 2, 1)
    else:
        nodes = [helper.make_node("Slice", ["c", "st", "en", "ax", "sp"], ["sl"])]
        inits = [c, _init("st", np.array([big, -2], np.int64)),
                 _init("en", np.array([small, 0], np.int64)),
                 _init("ax", np.array([-1, 1], np.int64)),
                 _init("sp", np.array([-2, -1], np.int64))]
        expect_shape = (1, 2, 3)
    nodes += [helper.make_node("Squeeze", ["sl"], ["sq"]),
              helper.make_node("Flatten", ["sq"], ["fl"], axis=0),  # (1, n)
              helper.make_node("Tile", ["fl", "reps"], ["ti"]),
              helper.make_node("Add", ["x", "ti"], ["y"])]
    inits.append(_init("reps", np.array([2, 1], np.int64)))  # (2, n)
    tiled = int(np.prod(expect_shape))
    if opset >= 15:
        nodes += [helper.make_node("Shape", ["x"], ["xs"], start=-1),
                  helper.make_node("Cast", ["xs"], ["xsf"], to=FLOAT),
                  helper.make_node("Mul", ["y", "xsf"], ["z"])]
    else:
        nodes.append(helper.make_node("Neg", ["y"], ["z"]))
    m = _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [2, tiled])],
               [helper.make_tensor_value_info("z", FLOAT, [2, tiled])], inits, opset=opset)
    new, res = P.fold_constants(m)
    assert res.changed
    assert sum(_ops(new).values()) == 2  # only the Add and the final Mul/Neg remain
    _same(m, new, {"x": _rand((2, tiled))})


def test_fold_constants_caps_expanding_results(monkeypatch):
    """Results above 2**20 elements (and above their inputs' size) are not folded; the
    size-expanding ops are sized by shape inference and never evaluated then."""
    evaluated = []
    real = P._evaluator

    def spy(opset, key):
        evaluated.append(key[0])
        return real(opset, key)

    monkeypatch.setattr(P, "_evaluator", spy)
    big = 1 << 40  # 2**80 elements: evaluating it would not end well
    nodes = [
        helper.make_node("ConstantOfShape", ["cs"], ["huge"]),
        helper.make_node("Expand", ["one", "exs"], ["wide"]),
        helper.make_node("Tile", ["one", "reps"], ["tiled"]),
        helper.make_node("Range", ["r0", "r1", "r2"], ["rng"]),
        helper.make_node("Add", ["col", "row"], ["outer"]),  # 2048 x 2048 by broadcasting
        helper.make_node("Add", ["col", "col"], ["small"]),  # folds
    ]
    for k, v in enumerate(["huge", "wide", "tiled", "rng", "outer", "small"]):
        nodes += [helper.make_node("ReduceMax", [v], [f"m{k}"], keepdims=0),
                  helper.make_node("Add", ["x", f"m{k}"] if k == 0 else [f"y{k - 1}", f"m{k}"],
                                   [f"y{k}"])]
    inits = [_init("cs", np.array([big, big], np.int64)), _init("one", np.ones(1, np.float32)),
             _init("exs", np.array([big], np.int64)), _init("reps", np.array([big], np.int64)),
             _init("r0", np.float32(0)), _init("r1", np.float32(1e9)),
             _init("r2", np.float32(1)),
             _init("col", np.ones((2048, 1), np.float32)),
             _init("row", np.ones((1, 2048), np.float32))]
    m = _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [2])],
               [helper.make_tensor_value_info("y5", FLOAT, None)], inits)
    new, res = P.fold_constants(m)
    assert res.detail == "folded 2 nodes (Addx1, ReduceMaxx1)"  # small, then its max
    kept = _ops(new)
    assert kept["ConstantOfShape"] == kept["Expand"] == kept["Tile"] == kept["Range"] == 1
    assert kept["ReduceMax"] == 5 and kept["Add"] == 1 + 6  # the outer sum and x + ...
    assert not {"ConstantOfShape", "Expand", "Tile", "Range"} & set(evaluated)
    assert "small" not in {t.name for t in new.graph.initializer}  # folded into m5


def test_fold_constants_shares_evaluators():
    """Nodes differing only in value names share one reference evaluator (built once)."""
    P._evaluator.cache_clear()
    new, res = P.fold_constants(_const_chain_model(300))
    assert res.detail == "folded 300 nodes (Addx300)"
    info = P._evaluator.cache_info()
    assert (info.misses, info.hits) == (1, 299)


def test_fold_constants_shape_of_partially_static_input():
    """``Shape`` with start/end folds when the dims it reads are static."""
    m = _model([helper.make_node("Shape", ["x"], ["s"], start=1),
                helper.make_node("Shape", ["x"], ["full"]),
                helper.make_node("Concat", ["s", "s"], ["s2"], axis=0),
                helper.make_node("Cast", ["s2"], ["sf"], to=FLOAT),
                helper.make_node("Cast", ["full"], ["ff"], to=FLOAT),
                helper.make_node("ReduceSum", ["ff"], ["t"], keepdims=0),
                helper.make_node("Add", ["sf", "t"], ["y"])],
               [helper.make_tensor_value_info("x", FLOAT, ["n", 4, 6])],
               [helper.make_tensor_value_info("y", FLOAT, None)], opset=15)
    new, res = P.fold_constants(P.shape_inference(m)[0])
    assert res.detail == "folded 3 nodes (Castx1, Concatx1, Shapex1)"
    assert _ops(new) == Counter({"Shape": 1, "Cast": 1, "ReduceSum": 1, "Add": 1})
    for n in (2, 5):
        x = _rand((n, 4, 6))
        _same(m, new, {"x": x})


def test_fold_constants_mask_and_gather_ops():
    """Trilu -> Equal -> Where (torch's GPT-2 causal mask), Pad, GatherElements, GatherND,
    NonZero, Sign fold to what onnxruntime computes."""
    nodes = [
        helper.make_node("Trilu", ["ones"], ["tri"], upper=0),
        helper.make_node("Equal", ["tri", "zero"], ["eq"]),
        helper.make_node("Where", ["eq", "ninf", "zf"], ["mask"]),
        helper.make_node("Pad", ["mask", "pads", "pv"], ["padded"]),  # (5, 5) -> (5, 6)
        helper.make_node("GatherElements", ["padded", "gidx"], ["ge"], axis=1),
        helper.make_node("NonZero", ["tri"], ["nz"]),  # (2, 15)
        helper.make_node("Transpose", ["nz"], ["nzt"], perm=[1, 0]),
        helper.make_node("GatherND", ["ge", "nzt"], ["gnd"]),  # (15,)
        helper.make_node("Sign", ["gnd"], ["sg"]),
        helper.make_node("ReduceSum", ["sg", "ax0"], ["tot"], keepdims=0),
        helper.make_node("Add", ["x", "mask"], ["y0"]),
        helper.make_node("Add", ["y0", "tot"], ["y"]),
    ]
    inits = [_init("ones", np.ones((5, 5), np.int64)), _init("zero", np.array([0], np.int64)),
             _init("ninf", np.array([-1e4], np.float32)), _init("zf", np.array([0], np.float32)),
             _init("pads", np.array([0, 1, 0, 0], np.int64)), _init("pv", np.float32(-2)),
             _init("gidx", np.array([[5, 0, 1, 2, 3]] * 5, np.int64)),
             _init("ax0", np.array([0], np.int64))]
    m = _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [5, 5])],
               [helper.make_tensor_value_info("y", FLOAT, None)], inits)
    new, res = P.fold_constants(m)
    assert _ops(new) == Counter({"Add": 2}), res.detail
    _same(m, new, {"x": _rand((5, 5))}, rtol=0, atol=0)


def test_fold_constants_absent_optional_input():
    """An empty input name (Slice without ``axes`` but with ``steps``) reaches the reference
    op as None."""
    inits = [_init("c", np.arange(24, dtype=np.float32).reshape(4, 6)),
             _init("st", np.array([1, 0], np.int64)), _init("en", np.array([4, 6], np.int64)),
             _init("sp", np.array([2, 3], np.int64))]
    m = _model([helper.make_node("Slice", ["c", "st", "en", "", "sp"], ["s"]),
                helper.make_node("Add", ["x", "s"], ["y"])],
               [helper.make_tensor_value_info("x", FLOAT, [2, 2])],
               [helper.make_tensor_value_info("y", FLOAT, [2, 2])], inits)
    new, res = P.fold_constants(m)
    assert res.detail == "folded 1 node (Slicex1)"
    s = numpy_helper.to_array(next(t for t in new.graph.initializer if t.name == "s"))
    np.testing.assert_array_equal(s, [[6, 9], [18, 21]])
    _same(m, new, {"x": _rand((2, 2))}, rtol=0, atol=0)


def test_fold_constants_noop():
    m = _model([helper.make_node("Relu", ["x"], ["y"])],
               [helper.make_tensor_value_info("x", FLOAT, [2])],
               [helper.make_tensor_value_info("y", FLOAT, [2])])
    new, res = P.fold_constants(m)
    assert not res.changed and new == m


# ---------------------------------------------------------------- fold_batchnorm


def _conv_bn_model(with_bias=True, extra_consumer=False):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    inits = [_init("w", w),
             _init("scale", rng.uniform(0.5, 2, 4).astype(np.float32)),
             _init("beta", rng.standard_normal(4).astype(np.float32)),
             _init("mean", rng.standard_normal(4).astype(np.float32)),
             _init("var", rng.uniform(0.5, 2, 4).astype(np.float32))]
    conv_in = ["x", "w"]
    if with_bias:
        inits.append(_init("b", rng.standard_normal(4).astype(np.float32)))
        conv_in.append("b")
    nodes = [helper.make_node("Conv", conv_in, ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "scale", "beta", "mean", "var"],
                              ["bn"], epsilon=1e-3),
             helper.make_node("Relu", ["bn"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", FLOAT, None)]
    if extra_consumer:
        nodes.append(helper.make_node("Neg", ["c"], ["y2"]))
        outputs.append(helper.make_tensor_value_info("y2", FLOAT, None))
    return _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [1, 3, 8, 8])], outputs, inits)


@pytest.mark.parametrize("with_bias", [True, False])
def test_fold_batchnorm(with_bias):
    m = _conv_bn_model(with_bias)
    new, res = P.fold_batchnorm(m)
    assert res.changed
    assert _ops(new) == Counter({"Conv": 1, "Relu": 1})
    assert len(new.graph.node[0].input) == 3
    assert {t.name for t in new.graph.initializer} == {new.graph.node[0].input[1],
                                                        new.graph.node[0].input[2]}
    # Folding rounds W*s once in float64->float32 instead of ORT's separate
    # conv and BN float32 roundings; with 27-term dot products and |y| ~ 5 the
    # difference is a few float32 ulps, so allow rtol/atol of 1e-4.
    _same(m, new, {"x": _rand((1, 3, 8, 8))}, rtol=1e-4, atol=1e-4)


def test_fold_batchnorm_skips_shared_conv_output():
    m = _conv_bn_model(extra_consumer=True)
    new, res = P.fold_batchnorm(m)
    assert not res.changed and _ops(new)["BatchNormalization"] == 1


# ---------------------------------------------------------------- canonicalize_gemm


def test_canonicalize_gemm_transb_alpha_beta():
    rng = np.random.default_rng(2)
    inits = [_init("B", rng.standard_normal((5, 4)).astype(np.float32)),
             _init("C", rng.standard_normal(5).astype(np.float32))]
    m = _model([helper.make_node("Gemm", ["x", "B", "C"], ["y"], transB=1, alpha=0.5, beta=2.0)],
               [helper.make_tensor_value_info("x", FLOAT, [3, 4])],
               [helper.make_tensor_value_info("y", FLOAT, [3, 5])], inits)
    new, res = P.canonicalize_gemm(m)
    assert res.changed and "transposed" in res.detail
    node = new.graph.node[0]
    assert node.op_type == "Gemm" and not node.attribute
    b = numpy_helper.to_array(next(t for t in new.graph.initializer if t.name == node.input[1]))
    assert b.shape == (4, 5)
    _same(m, new, {"x": _rand((3, 4))})


def test_canonicalize_gemm_matmul_add():
    rng = np.random.default_rng(3)
    inits = [_init("W", rng.standard_normal((4, 6)).astype(np.float32)),
             _init("bias", rng.standard_normal(6).astype(np.float32)),
             _init("W3", rng.standard_normal((4, 6)).astype(np.float32))]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]),
             helper.make_node("Add", ["bias", "mm"], ["y"]),
             # 3-D input: must stay MatMul+Add
             helper.make_node("MatMul", ["x3", "W3"], ["mm3"]),
             helper.make_node("Add", ["mm3", "bias"], ["y3"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [3, 4]),
                       helper.make_tensor_value_info("x3", FLOAT, [2, 3, 4])],
               [helper.make_tensor_value_info("y", FLOAT, None),
                helper.make_tensor_value_info("y3", FLOAT, None)], inits)
    new, res = P.canonicalize_gemm(P.shape_inference(m)[0])
    assert res.changed and "1 MatMul+Add" in res.detail
    assert _ops(new) == Counter({"Gemm": 1, "MatMul": 1, "Add": 1})
    _same(m, new, {"x": _rand((3, 4)), "x3": _rand((2, 3, 4), 1)})


def test_canonicalize_gemm_fuses_unnamed_matmuls_under_distinct_names():
    """Two unnamed MatMul+Add pairs become two Gemms with distinct node names (onnxruntime
    refuses a graph with duplicate node names)."""
    rng = np.random.default_rng(4)
    inits = [_init(f"W{i}", rng.standard_normal((4, 4)).astype(np.float32)) for i in (1, 2)]
    inits += [_init(f"b{i}", rng.standard_normal(4).astype(np.float32)) for i in (1, 2)]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["m1"]),
             helper.make_node("Add", ["m1", "b1"], ["h"]),
             helper.make_node("MatMul", ["h", "W2"], ["m2"]),
             helper.make_node("Add", ["m2", "b2"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [3, 4])],
               [helper.make_tensor_value_info("y", FLOAT, None)], inits)
    new, res = P.canonicalize_gemm(P.shape_inference(m)[0])
    names = [n.name for n in new.graph.node]
    assert _ops(new) == Counter({"Gemm": 2}) and len(set(names)) == 2, names
    _same(m, new, {"x": _rand((3, 4))})


def test_canonicalize_gemm_noop():
    m = _model([helper.make_node("Gemm", ["x", "y"], ["z"], transB=1)],
               [helper.make_tensor_value_info("x", FLOAT, [3, 4]),
                helper.make_tensor_value_info("y", FLOAT, [5, 4])],
               [helper.make_tensor_value_info("z", FLOAT, [3, 5])])
    new, res = P.canonicalize_gemm(m)
    assert not res.changed and new == m


# ---------------------------------------------------------------- freeze_inputs


def test_freeze_inputs():
    m = _model([helper.make_node("Reshape", ["x", "shape"], ["y"])],
               [helper.make_tensor_value_info("x", FLOAT, [2, 6]),
                helper.make_tensor_value_info("shape", INT64, [3])],
               [helper.make_tensor_value_info("y", FLOAT, None)])
    new, res = P.freeze_inputs(m, {"shape": np.array([3, 2, 2])})
    assert res.changed and [i.name for i in new.graph.input] == ["x"]
    assert numpy_helper.to_array(new.graph.initializer[0]).dtype == np.int64
    x = _rand((2, 6))
    np.testing.assert_array_equal(
        _run(new, {"x": x})[0], _run(m, {"x": x, "shape": np.array([3, 2, 2], np.int64)})[0])
    with pytest.raises(ValueError, match="not a graph input"):
        P.freeze_inputs(m, {"nope": np.array([1])})
    with pytest.raises(ValueError, match="shape"):
        P.freeze_inputs(m, {"shape": np.array([3, 4])})
    _, res = P.freeze_inputs(m, {})
    assert not res.changed


# ---------------------------------------------------------------- run_passes + torch + TVM


def _torch_chunk_model(tmp_path):
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)
            self.drop = torch.nn.Dropout(0.1)
            self.h = 2

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            d = q.shape[-1] // self.h
            q = q.reshape(b, s, self.h, d).transpose(1, 2)
            k = k.reshape(b, s, self.h, d).transpose(1, 2)
            v = v.reshape(b, s, self.h, d).transpose(1, 2)
            att = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
            return self.drop(att @ v).transpose(1, 2).reshape(b, s, self.h * d)

    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    path = tmp_path / "block.onnx"
    torch.onnx.export(Block().eval(), (x,), str(path), dynamo=False, opset_version=17,
                      input_names=["x"])
    return onnx.load(str(path))


def test_run_passes_torch_block(tmp_path):
    m = _torch_chunk_model(tmp_path)
    new, results = P.run_passes(m)
    assert [r.name for r in results] == list(P.DEFAULT_PASSES)
    by_name = {r.name: r for r in results}
    assert by_name["fold_constants"].changed
    before, after = _ops(m), _ops(new)
    assert before["Shape"] > 0 and after["Shape"] == 0 and after["Gather"] == 0
    assert after["Reshape"] == before["Reshape"] and after["Constant"] == 0
    inits = {t.name for t in new.graph.initializer}
    for n in new.graph.node:  # every Reshape/Split/Slice now has constant shape args
        if n.op_type in ("Reshape", "Split", "Slice"):
            assert all(i in inits for i in n.input[1:] if i), n
    _same(m, new, {"x": _rand((2, 5, 16), 4)})
    _, again = P.run_passes(new)  # fixed point: a second run changes nothing
    assert not any(r.changed for r in again)


def test_run_passes_dynamic_batch_partial_fold(tmp_path):
    """With dynamic b/s only the static feature-dim arithmetic folds; the
    model must stay correct for other batch/sequence sizes."""
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return (q.reshape(b, s, 2, d // 2) * k.reshape(b, s, 2, d // 2)).reshape(b, s, d) + v

    torch.manual_seed(0)
    path = tmp_path / "dyn.onnx"
    torch.onnx.export(Block().eval(), (torch.randn(2, 5, 16),), str(path), dynamo=False,
                      opset_version=17, input_names=["x"], dynamic_axes={"x": {0: "b", 1: "s"}})
    m = onnx.load(str(path))
    new, _ = P.run_passes(m)
    before, after = _ops(m), _ops(new)
    assert 0 < after["Shape"] < before["Shape"] and after["Gather"] < before["Gather"]
    inits = {t.name for t in new.graph.initializer}
    for n in new.graph.node:  # chunk boundaries depend only on the static dim
        if n.op_type == "Slice":
            assert all(i in inits for i in n.input[1:] if i), n
    for shape in [(2, 5, 16), (3, 7, 16)]:
        _same(m, new, {"x": _rand(shape, 6)})


def test_run_passes_errors_and_subset():
    m = _model([helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["y"])],
               [helper.make_tensor_value_info("x", FLOAT, [2])],
               [helper.make_tensor_value_info("y", FLOAT, [2])])
    with pytest.raises(ValueError, match="unknown"):
        P.run_passes(m, ["nope"])
    _, results = P.run_passes(m, [], input_values={})
    assert [r.name for r in results] == ["freeze_inputs"]
    new, results = P.run_passes(m, ["remove_identity"])
    assert len(results) == 1 and results[0].changed and _ops(new) == Counter({"Relu": 1})


def test_torch_block_imports_into_tvm(tmp_path):
    tvm = pytest.importorskip("tvm")
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    m = _torch_chunk_model(tmp_path)
    # Without the passes the Shape/Gather chunk subgraph breaks FoldConstant.
    with pytest.raises(Exception, match="ShapeExpr"):
        relax.transform.FoldConstant()(from_onnx(m, keep_params_in_input=False))
    new, _ = P.run_passes(m)
    mod = from_onnx(new, keep_params_in_input=False)
    mod = relax.transform.FoldConstant()(mod)  # raised on shape-only subgraphs before
    ex = relax.build(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    x = _rand((2, 5, 16), 5)
    out = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(out, _run(m, {"x": x})[0], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- linear-time passes (issue 11)


def _chain_model(n, ops=("Identity",)):
    """``x -> Relu -> n passthrough nodes (cycling through ops) -> y``."""
    nodes = [helper.make_node("Relu", ["x"], ["t0"])]
    for i in range(n):
        nodes.append(helper.make_node(ops[i % len(ops)], [f"t{i}"],
                                      [f"t{i + 1}" if i < n - 1 else "y"]))
    return _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [2, 3])],
                  [helper.make_tensor_value_info("y", FLOAT, [2, 3])])


def _const_chain_model(n):
    """``n`` foldable ``Add(c_i, 1)`` nodes, then ``y = x * c_n``."""
    nodes = [helper.make_node("Add", [f"c{i}", "one"], [f"c{i + 1}"]) for i in range(n)]
    nodes.append(helper.make_node("Mul", ["x", f"c{n}"], ["y"]))
    return _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [2, 3])],
                  [helper.make_tensor_value_info("y", FLOAT, [2, 3])],
                  inits=[_init("c0", np.full((3,), 0.5, np.float32)),
                         _init("one", np.ones((3,), np.float32))])


def _qdq_chain_model(n):
    """``n`` blocks ``Q -> DQ -> Relu -> Q -> DQ`` (``[1]`` scales, as onnxruntime writes
    them): simplify_qdq makes every scale scalar and drops the first Q/DQ pair of each."""
    nodes, y = [], "x"
    for i in range(n):
        nodes += [helper.make_node("QuantizeLinear", [y, "s", "z"], [f"q{i}"]),
                  helper.make_node("DequantizeLinear", [f"q{i}", "s", "z"], [f"d{i}"]),
                  helper.make_node("Relu", [f"d{i}"], [f"r{i}"]),
                  helper.make_node("QuantizeLinear", [f"r{i}", "s", "z"], [f"p{i}"]),
                  helper.make_node("DequantizeLinear", [f"p{i}", "s", "z"],
                                   [f"e{i}" if i < n - 1 else "y"])]
        y = f"e{i}"
    return _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [2, 3])],
                  [helper.make_tensor_value_info("y", FLOAT, [2, 3])],
                  inits=[_init("s", np.array([0.05], np.float32)),
                         _init("z", np.array([0], np.int8))])


def _conv_bn_chain_model(n):
    """``n`` blocks ``Conv(1x1) -> BatchNormalization``."""
    rng = np.random.default_rng(0)
    nodes, inits, y = [], [], "x"
    for i in range(n):
        out = f"b{i}" if i < n - 1 else "y"
        nodes += [helper.make_node("Conv", [y, f"w{i}"], [f"c{i}"]),
                  helper.make_node("BatchNormalization",
                                   [f"c{i}", f"g{i}", f"be{i}", f"m{i}", f"v{i}"], [out])]
        inits += [_init(f"w{i}", (np.eye(2) + 0.1 * rng.standard_normal((2, 2)))
                        .astype(np.float32).reshape(2, 2, 1, 1)),
                  _init(f"g{i}", rng.uniform(0.9, 1.1, 2).astype(np.float32)),
                  _init(f"be{i}", (0.01 * rng.standard_normal(2)).astype(np.float32)),
                  _init(f"m{i}", (0.01 * rng.standard_normal(2)).astype(np.float32)),
                  _init(f"v{i}", rng.uniform(0.9, 1.1, 2).astype(np.float32))]
        y = out
    return _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [1, 2, 2, 2])],
                  [helper.make_tensor_value_info("y", FLOAT, [1, 2, 2, 2])], inits=inits)


def _matmul_add_chain_model(n):
    """``n`` blocks ``MatMul -> Add(bias)`` (fused into Gemm) ending in a transB Gemm."""
    rng = np.random.default_rng(0)
    nodes, inits, y = [], [], "x"
    for i in range(n):
        nodes += [helper.make_node("MatMul", [y, f"w{i}"], [f"mm{i}"], name=f"matmul{i}"),
                  helper.make_node("Add", [f"mm{i}", f"bias{i}"], [f"a{i}"])]
        inits += [_init(f"w{i}", (np.eye(3) + 0.05 * rng.standard_normal((3, 3)))
                        .astype(np.float32)),
                  _init(f"bias{i}", (0.01 * rng.standard_normal(3)).astype(np.float32))]
        y = f"a{i}"
    nodes.append(helper.make_node("Gemm", [y, "wt"], ["y"], transB=1, alpha=0.5))
    inits.append(_init("wt", rng.standard_normal((3, 3)).astype(np.float32)))
    return _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [2, 3])],
                  [helper.make_tensor_value_info("y", FLOAT, [2, 3])], inits=inits)


def test_remove_identity_10k_identity_chain():
    m = _chain_model(10_000)
    new, results = P.run_passes(m)
    assert "10000 Identity nodes" in results[DEFAULT_RI].detail
    assert _ops(new) == Counter({"Relu": 1}) and new.graph.node[0].output[0] == "y"
    _same(m, new, {"x": _rand((2, 3))})


def test_remove_identity_10k_dropout_identity_chain():
    m = _chain_model(10_000, ops=("Dropout", "Identity"))
    new, results = P.run_passes(m)
    assert results[DEFAULT_RI].detail == "removed 5000 Dropout nodes, 5000 Identity nodes"
    assert _ops(new) == Counter({"Relu": 1})
    _same(m, new, {"x": _rand((2, 3))})


def test_remove_identity_chain_from_graph_input_keeps_last():
    # every node but the one producing the graph output goes; that one reads a graph input
    m = _model([helper.make_node("Identity", [f"t{i}" if i else "x"],
                                 [f"t{i + 1}" if i < 9_999 else "y"]) for i in range(10_000)],
               [helper.make_tensor_value_info("x", FLOAT, [2])],
               [helper.make_tensor_value_info("y", FLOAT, [2])])
    new, res = P.remove_identity(m)
    assert res.detail == "removed 9999 Identity nodes"
    assert [(list(n.input), list(n.output)) for n in new.graph.node] == [(["x"], ["y"])]


def test_remove_identity_dropout_mask_read_only_by_removed_node():
    # the mask's only reader is a dead Identity; once it is gone the first Dropout goes
    # (before the second, whose output is the graph output and whose input is then ``x``)
    nodes = [helper.make_node("Relu", ["x"], ["v0"]),
             helper.make_node("Dropout", ["x", "", "tm"], ["v1", "m1"]),
             helper.make_node("Identity", ["m1"], ["mi1"]),
             helper.make_node("Dropout", ["v1"], ["v2"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [2])],
               [helper.make_tensor_value_info("v2", FLOAT, [2]),
                helper.make_tensor_value_info("v0", FLOAT, [2])],
               inits=[_init("tm", np.array(False))])
    new, res = P.remove_identity(m)
    assert res.detail == "removed 1 Dropout node, 1 Identity node"
    assert [(n.op_type, list(n.input), list(n.output)) for n in new.graph.node] == [
        ("Relu", ["x"], ["v0"]), ("Dropout", ["x"], ["v2"])]


def test_fold_constants_and_simplify_qdq_long_chains():
    m = _const_chain_model(10_000)
    new, _ = P.run_passes(m)
    assert _ops(new) == Counter({"Mul": 1})
    _same(m, new, {"x": _rand((2, 3))})
    m = _qdq_chain_model(2_000)  # 10,000 nodes
    new, results = P.run_passes(m)
    assert "removed 2000 Q/DQ pairs" in results[DEFAULT_QDQ].detail
    assert _ops(new) == Counter({"Relu": 2000, "QuantizeLinear": 2000,
                                 "DequantizeLinear": 2000})
    _same(m, new, {"x": _rand((2, 3))})


DEFAULT_RI = list(P.DEFAULT_PASSES).index("remove_identity")
DEFAULT_QDQ = list(P.DEFAULT_PASSES).index("simplify_qdq")


def _frontend_lines(fn):
    """Python lines executed in tvm_spinn.frontend while running ``fn()``: an operation
    count (not a time) of the passes' own work."""
    import os
    import sys

    root = os.path.dirname(P.__file__)
    count = [0]

    def local(frame, event, arg):
        if event == "line":
            count[0] += 1
        return local

    def glob(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(root) else None

    old = sys.gettrace()
    sys.settrace(glob)
    try:
        fn()
    finally:
        sys.settrace(old)
    return count[0]


@pytest.mark.parametrize("build,n", [
    (_chain_model, 1_000),
    (lambda n: _chain_model(n, ops=("Dropout", "Identity")), 1_000),
    (_const_chain_model, 1_000),
    (_qdq_chain_model, 200),
    (_conv_bn_chain_model, 250),
    (_matmul_add_chain_model, 250),
], ids=["identity", "dropout", "constants", "qdq", "conv_bn", "matmul_add"])
def test_passes_work_grows_linearly(build, n):
    small, large = build(n), build(2 * n)
    assert len(large.graph.node) >= 2 * len(small.graph.node) - 2
    w_small = _frontend_lines(lambda: P.run_passes(small, check=False))
    w_large = _frontend_lines(lambda: P.run_passes(large, check=False))
    assert w_large <= 2.2 * w_small, (w_small, w_large)


def test_conv_bn_and_matmul_add_chains_numerics():
    for m, feeds, ops in [
            (_conv_bn_chain_model(500), {"x": _rand((1, 2, 2, 2))}, Counter({"Conv": 500})),
            (_matmul_add_chain_model(500), {"x": _rand((2, 3))}, Counter({"Gemm": 501}))]:
        new, _ = P.run_passes(m)
        assert _ops(new) == ops
        _same(m, new, feeds, rtol=1e-4, atol=1e-5)
