"""Issue 11 (compile speed): the faster partitioning passes give the same module as TVM's.

``partition_for_spinn`` folds constants with :mod:`tvm_spinn.partition.fold` (``FoldConstant``
that skips legalizing calls it cannot fold). These tests run the partitioning both ways, the
fast passes and the reference ones they replace (TVM's ``FoldConstant``), and require
structurally equal modules (constants compared bit for bit) on small zoo models and on
synthetic graphs that exercise the corner cases (creation ops reading only a shape, tuple
arguments, constants bound to variables).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax import transform
from tvm.script import relax as R

import tvm_spinn
from tvm_spinn.partition import fold
from tvm_spinn.partition import partition as part

tf = pytest.importorskip("transformers")

from test_zoo import ZOO  # noqa: E402

MODELS = ["resnet", "mobilenet_v2", "bert", "gpt2", "llama"]


def _import(name):
    torch.manual_seed(0)
    model, x = ZOO[name]()
    return tvm_spinn.frontend.from_pytorch(model.eval(), (x,))


def _reference_partition(mod, monkeypatch):
    """``partition_for_spinn`` with TVM's own ``FoldConstant``."""
    with monkeypatch.context() as m:
        m.setattr(part, "FoldConstant", transform.FoldConstant())
        return part.partition_for_spinn(mod)


@pytest.fixture(scope="module")
def zoo_modules():
    return {name: _import(name) for name in MODELS}


@pytest.mark.parametrize("name", MODELS)
def test_partition_matches_reference(name, zoo_modules, monkeypatch):
    mod = zoo_modules[name]
    fast = part.partition_for_spinn(mod)
    ref = _reference_partition(mod, monkeypatch)
    tvm.ir.assert_structural_equal(fast, ref)
    assert fast.script() == ref.script()
    fast_summary, ref_summary = part.summarize_partition(fast), part.summarize_partition(ref)
    assert fast_summary == ref_summary
    assert fast_summary.offloaded_ops


@pytest.mark.parametrize("name", MODELS)
def test_fold_constant_matches_tvm(name, zoo_modules):
    mod = part._ConvertConvLayout(part._DecomposeTrainingBatchNorm(zoo_modules[name]))
    tvm.ir.assert_structural_equal(fold.FoldConstant(mod), transform.FoldConstant()(mod))


@tvm.script.ir_module
class _Corners:
    @R.function
    def main(x: R.Tensor((2, 8), "float32"), s: R.Shape([2, 8])):
        with R.dataflow():
            c = R.const(np.arange(16, dtype="float32").reshape(2, 8))
            idx = R.const(np.array([1, 0, 1], dtype="int64"))
            # creation ops that read only the shape of a run-time tensor: folded by TVM
            ones = R.ones_like(x)
            full = R.full_like(x, R.const(3.0, "float32"))
            zeros = R.zeros(R.shape([2, 8]), "float32")
            # constant-only computations: folded
            cc = R.add(c, c)
            taken = R.take(cc, idx, axis=0)
            moved = R.permute_dims(R.reshape(c, R.shape([8, 2])), axes=[1, 0])
            as_int = R.astype(c, "int32")
            # run-time operands: not folded (through a tuple, too)
            y = R.add(x, c)
            z = R.multiply(ones, y)
            cat = R.concat((x, c), axis=0)
            cat_c = R.concat((c, cc), axis=1)
            w = R.add(R.add(z, full), R.add(zeros, moved))
            out = (w, cat, cat_c, taken, as_int)
            R.output(out)
        return out


def test_fold_constant_corner_cases():
    mod = _Corners
    ref = transform.FoldConstant()(mod)
    got = fold.FoldConstant(mod)
    tvm.ir.assert_structural_equal(got, ref)
    # the reference folded the creation ops of a run-time shape and the constant math
    text = ref.script()
    for op in ("R.ones_like", "R.full_like", "R.zeros(", "R.take", "R.astype"):
        assert op not in text, op
    assert "R.concat((x," in text


def test_fold_constant_restores_legalization():
    before = {name: tvm.ir.Op.get(name).get_attr("FLegalize") for name in sorted(fold._READS_EVERY_TENSOR_ARG)}
    build = tvm_ffi.get_global_func("tirx.build")
    fold.FoldConstant(_Corners)
    for name, legalize in before.items():
        assert tvm.ir.Op.get(name).get_attr("FLegalize").same_as(legalize), name
    assert tvm_ffi.get_global_func("tirx.build").same_as(build)
    # legalization of run-time calls works as before outside the pass
    legalized = transform.LegalizeOps()(_Corners)
    assert "R.add(" not in legalized["main"].script()


def test_fold_constant_restores_legalization_on_error(monkeypatch):
    before = tvm.ir.Op.get("relax.add").get_attr("FLegalize")

    def boom(mod):
        raise RuntimeError("boom")

    monkeypatch.setattr(fold.transform, "FoldConstant", lambda: boom)
    with pytest.raises(RuntimeError, match="boom"):
        fold.FoldConstant(_Corners)
    assert tvm.ir.Op.get("relax.add").get_attr("FLegalize").same_as(before)


# ---- FoldLayoutConstants: large constants stand in as parameters for the rewrites ----

from tvm_spinn.relax_rewrites import folds as rewrites  # noqa: E402

_RNG = np.random.default_rng(0)
_W = _RNG.standard_normal((6, 4)).astype("float32")
_W2 = _RNG.standard_normal((4, 6)).astype("float32")
_SYM = (lambda a: (a + a.T).astype("float32"))(_RNG.standard_normal((4, 4)))


def _layout_module(dup_weight: bool, fold_to_existing: bool):
    w_dup = _W.copy() if dup_weight else _RNG.standard_normal((6, 4)).astype("float32")
    # a symmetric matrix: its folded transpose has the data of a constant that exists
    sym_src = _SYM if fold_to_existing else _RNG.standard_normal((4, 4)).astype("float32")
    other = _RNG.standard_normal((4, 4)).astype("float32")

    @tvm.script.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((3, 4), "float32"), q: R.Tensor((4, 6), "float32")):
            with R.dataflow():
                wt = R.permute_dims(R.const(_W), axes=[1, 0])  # folded
                y = R.matmul(x, wt)
                y2 = R.matmul(x, wt)  # the same fold again below: merged
                w_dup_t = R.permute_dims(R.const(w_dup), axes=[1, 0])  # maybe equal data
                y3 = R.matmul(x, w_dup_t)
                c = R.const(_W2)
                chain = R.reshape(R.permute_dims(c, axes=[1, 0]), R.shape([4, 6]))  # through a var
                y4 = R.matmul(x, chain)
                sym = R.add(R.matmul(x, R.permute_dims(R.const(sym_src))), R.matmul(x, R.const(other)))
                as_int = R.astype(R.const(_W2), "int32")
                runtime = R.permute_dims(q)  # a run-time tensor: kept
                small = R.reshape(R.const(np.arange(4, dtype="float32")), R.shape([2, 2]))
                dup = R.reshape(x, R.shape([12]))
                dup2 = R.reshape(x, R.shape([12]))  # duplicate work: merged by the rewrite's CSE
                out = (y, y2, y3, y4, sym, as_int, runtime, small, dup, dup2)
                R.output(out)
            return out

    return Module


def _both_folds(func):
    return rewrites._fold_layout(func), rewrites._fold_layout_reference(func)


@pytest.mark.parametrize("dup_weight", [False, True])
@pytest.mark.parametrize("fold_to_existing", [False, True])
@pytest.mark.parametrize("hide_min", [1, 16, 1 << 14])
def test_fold_layout_matches_reference(dup_weight, fold_to_existing, hide_min, monkeypatch):
    monkeypatch.setattr(rewrites, "_HIDE_MIN_ELEMENTS", hide_min)
    func = _layout_module(dup_weight, fold_to_existing)["main"]
    used_reference = []
    reference = rewrites._fold_layout_reference
    monkeypatch.setattr(rewrites, "_fold_layout_reference", lambda f: used_reference.append(1) or reference(f))
    fast, ref = rewrites._fold_layout(func), reference(func)
    # equal data in distinct large constants (or a fold producing it): the reference runs
    assert bool(used_reference) == (dup_weight or fold_to_existing or hide_min > 24), used_reference
    tvm.ir.assert_structural_equal(fast, ref)
    assert fast.script() == ref.script()
    assert "R.permute_dims(q" in fast.script()
    assert fast.script().count("R.permute_dims") == 1


@tvm.script.ir_module
class _OutputConst:
    @R.function
    def main(x: R.Tensor((4, 6), "float32")):
        with R.dataflow():
            wt = R.permute_dims(R.const(_W), axes=[1, 0])
            R.output(wt)
        gv = R.add(wt, x)
        return (wt, gv)


@pytest.mark.parametrize("hide_min", [1, 1 << 14])
def test_fold_layout_output_constant(hide_min, monkeypatch):
    monkeypatch.setattr(rewrites, "_HIDE_MIN_ELEMENTS", hide_min)
    fast, ref = _both_folds(_OutputConst["main"])
    tvm.ir.assert_structural_equal(fast, ref)
    assert fast.script() == ref.script()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("hide_min", [64, 1 << 14])
def test_fold_layout_zoo_matches_reference(name, hide_min, zoo_modules, monkeypatch):
    monkeypatch.setattr(rewrites, "_HIDE_MIN_ELEMENTS", hide_min)
    mod = part._ConvertConvLayout(part._DecomposeTrainingBatchNorm(zoo_modules[name]))
    fast, ref = _both_folds(mod["main"])
    tvm.ir.assert_structural_equal(fast, ref)
    assert fast.script() == ref.script()


@pytest.mark.parametrize("shape,axes", [((768, 3072), [1, 0]), ((5, 130), [1, 0]), ((2, 3, 4), [2, 0, 1]),
                                        ((3, 4), None)])
def test_fold_layout_constant_bits(shape, axes):
    """The folded values are the bits TVM's own legalize + build computes."""
    data = _RNG.standard_normal(shape).astype("float32")
    bb = relax.BlockBuilder()
    with bb.function("main", []):
        with bb.dataflow():
            out = bb.emit_output(relax.op.permute_dims(relax.const(data), axes))
        bb.emit_func_output(out)
    func = bb.get()["main"]
    folded = rewrites._fold_layout(func)
    tvm_folded = transform.FoldConstant()(tvm.IRModule({"main": func}))["main"]
    got, want = folded.body.body, tvm_folded.body.body
    assert isinstance(got, tvm.ir.expr.Constant) and isinstance(want, tvm.ir.expr.Constant)
    assert got.value.numpy().tobytes() == want.value.numpy().tobytes()
    assert got.value.numpy().shape == want.value.numpy().shape


@pytest.mark.parametrize("name", ["resnet", "mobilenet_v2"])
@pytest.mark.parametrize("hide_min", [1, 64, 1 << 14])
def test_fold_batch_norm_matches_reference(name, hide_min, zoo_modules, monkeypatch):
    monkeypatch.setattr(rewrites, "_HIDE_MIN_ELEMENTS", hide_min)
    mod = transform.FoldConstant()(part._ConvertConvLayout(part._DecomposeTrainingBatchNorm(zoo_modules[name])))
    func = mod["main"]
    fast, ref = rewrites.fold_batch_norm(func), rewrites._fold_batch_norm(func, None)
    tvm.ir.assert_structural_equal(fast, ref)
    assert fast.script() == ref.script()
    assert "batch_norm" in func.script() and "batch_norm" not in ref.script()


def test_fold_batch_norm_parameters_not_folded(monkeypatch):
    """A weight or statistic that is a parameter (not a constant) keeps its batch norm."""
    monkeypatch.setattr(rewrites, "_HIDE_MIN_ELEMENTS", 1)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 2, 4, 4], "float32"))
    w = relax.Var("w", relax.TensorType([2, 2, 1, 1], "float32"))
    ones, zeros = (relax.const(np.full(2, v, "float32")) for v in (1.0, 0.0))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            c0 = bb.emit(relax.op.nn.conv2d(x, relax.const(np.ones((2, 2, 1, 1), "float32"))))
            n0 = bb.emit(relax.TupleGetItem(bb.emit(relax.op.nn.batch_norm(c0, ones, zeros, zeros, ones, axis=1, training=False)), 0))
            c1 = bb.emit(relax.op.nn.conv2d(n0, w))
            n1 = bb.emit(relax.TupleGetItem(bb.emit(relax.op.nn.batch_norm(c1, ones, zeros, zeros, ones, axis=1, training=False)), 0))
            out = bb.emit_output(n1)
        bb.emit_func_output(out)
    func = bb.get()["main"]
    fast, ref = rewrites.fold_batch_norm(func), rewrites._fold_batch_norm(func, None)
    tvm.ir.assert_structural_equal(fast, ref)
    assert ref.script().count("batch_norm") == 1


@tvm.script.ir_module
class _Repeated:
    @R.function
    def main(x: R.Tensor((2, 8), "float32")):
        with R.dataflow():
            a = R.full_like(x, R.const(1.0, "float32"))
            b = R.full_like(x, R.const(2.0, "float32"))
            c = R.full_like(x, R.const(1.0, "float32"))
            out = R.add(R.add(a, b), R.add(c, x))
            R.output(out)
        return out


def test_fold_constant_builds_no_more_kernels_than_tvm():
    build = tvm_ffi.get_global_func("tirx.build")
    built = []

    def counting(func, *args):
        built.append(func)
        return build(func, *args)

    tvm.register_global_func("tirx.build", counting, override=True)
    try:
        got = fold.FoldConstant(_Repeated)
        fast_builds = len(built)
        built.clear()
        ref = transform.FoldConstant()(_Repeated)
        ref_builds = len(built)
    finally:
        tvm.register_global_func("tirx.build", build, override=True)
    tvm.ir.assert_structural_equal(got, ref)
    assert "full_like" not in ref.script()
    # TVM: the three full_like and add(a, b) fold (a kernel each); the run-time add is built by
    # neither. Here the two full_like of 1.0 share one kernel, built once.
    assert ref_builds == 4 and fast_builds == 3


# ---- import clean-ups (frontend.fixups): the same hiding ----

from tvm_spinn.frontend import fixups  # noqa: E402


@pytest.fixture(scope="module")
def raw_zoo_modules():
    """The zoo models as TVM's importer emits them, before the clean-ups."""
    import tvm_spinn.frontend.pytorch as pytorch_frontend

    mp = pytest.MonkeyPatch()
    mp.setattr(pytorch_frontend, "FixupImported", lambda mod: mod)
    try:
        return {name: _import(name) for name in ("bert", "gpt2", "llama")}
    finally:
        mp.undo()


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
@pytest.mark.parametrize("hide_min", [1, 64, 1 << 14])
def test_fixups_match_reference(name, hide_min, raw_zoo_modules, monkeypatch):
    monkeypatch.setattr(fixups, "_HIDE_MIN_ELEMENTS", hide_min)
    func = raw_zoo_modules[name]["main"]
    fast, ref = fixups.fixup(func), fixups._fixup(func, None)
    tvm.ir.assert_structural_equal(fast, ref)
    assert fast.script() == ref.script()


@pytest.mark.parametrize("hide_min", [1, 1 << 14])
def test_fixups_negative_take_of_hidden_index(hide_min, monkeypatch):
    monkeypatch.setattr(fixups, "_HIDE_MIN_ELEMENTS", hide_min)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([5, 3], "float32"))
    m = relax.Var("m", relax.TensorType([4], "bool"))
    idx = relax.const(np.array([-1, 0, -5, 2], "int64"))
    with bb.function("main", [x, m]):
        with bb.dataflow():
            t = bb.emit(relax.op.take(x, idx, axis=0))
            c = bb.emit(relax.op.equal(m, m))
            out = bb.emit_output(relax.Tuple([t, c]))
        bb.emit_func_output(out)
    func = bb.get()["main"]
    fast, ref = fixups.fixup(func), fixups._fixup(func, None)
    tvm.ir.assert_structural_equal(fast, ref)
    taken = [e for e in ref.body.blocks[0].bindings if isinstance(e.value, relax.Call) and e.value.op.name == "relax.take"]
    assert taken[0].value.args[1].value.numpy().tolist() == [4, 0, 0, 2]


def test_fold_constant_leaves_tvm_state_alone(monkeypatch):
    """While the pass runs, the operators' ``FLegalize`` and ``tirx.build`` are TVM's own."""
    names = sorted(fold._READS_EVERY_TENSOR_ARG)[:8]
    before = {name: tvm.ir.Op.get(name).get_attr("FLegalize") for name in names}
    build = tvm_ffi.get_global_func("tirx.build")
    tvm_fold = transform.FoldConstant
    seen = []

    def checking():
        def run(mod):
            seen.append(all(tvm.ir.Op.get(n).get_attr("FLegalize").same_as(f) for n, f in before.items())
                        and tvm_ffi.get_global_func("tirx.build").same_as(build))
            return tvm_fold()(mod)
        return run

    monkeypatch.setattr(fold.transform, "FoldConstant", checking)
    got = fold.FoldConstant(_Corners)
    assert seen == [True]
    tvm.ir.assert_structural_equal(got, tvm_fold()(_Corners))


def test_fold_constant_concurrent_runs_agree():
    """No lock and no shared state: runs on several threads give TVM's result each."""
    from concurrent.futures import ThreadPoolExecutor

    ref = transform.FoldConstant()(_Corners)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: fold.FoldConstant(_Corners), range(8)))
    for got in results:
        tvm.ir.assert_structural_equal(got, ref)


# ---- quantized weights hidden from constant folding: the same hiding ----

from tvm_spinn.partition import qweights  # noqa: E402


def _qweights_reference(mod):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qweights, "HiddenConstants", lambda func, n: type("NoHiding", (), {"hidden": {}})())
        return qweights.hide_quantized_weights(mod)


@pytest.mark.parametrize("hide_min", [1, 16, 1 << 14])
@pytest.mark.parametrize("op", ["conv2d", "dense"])
def test_hide_quantized_weights_matches_reference(hide_min, op, monkeypatch):
    from test_int8 import qgemm_module

    rng = np.random.default_rng(0)
    if op == "conv2d":
        wq = rng.integers(-127, 128, (8, 4, 3, 3)).astype("int8")
        mod = qgemm_module((1, 4, 8, 8), "int8", wq, 0.02, 0, 0.05, 3, op="conv2d",
                           bias=rng.standard_normal(8).astype("float32"), relu=True)
    else:
        wq = rng.integers(-127, 128, (32, 16)).astype("int8")
        mod = qgemm_module((4, 32), "int8", wq, 0.02, 0, 0.05, 3, op="dense")
    monkeypatch.setattr(qweights, "_HIDE_MIN_ELEMENTS", hide_min)
    fast, fast_consts = qweights.hide_quantized_weights(mod)
    ref, ref_consts = _qweights_reference(mod)
    tvm.ir.assert_structural_equal(fast, ref, map_free_vars=True)
    assert fast.script() == ref.script()
    assert sorted(fast_consts) == sorted(ref_consts) and fast_consts
    for name in fast_consts:
        got, want = list(fast_consts[name].values()), list(ref_consts[name].values())
        assert len(got) == len(want) and all(a.same_as(b) for a, b in zip(got, want))
    restored = qweights.restore_quantized_weights(fast, fast_consts)
    tvm.ir.assert_structural_equal(restored, qweights.restore_quantized_weights(ref, ref_consts))
