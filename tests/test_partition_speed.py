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
    fold.FoldConstant(_Corners)
    for name, legalize in before.items():
        assert tvm.ir.Op.get(name).get_attr("FLegalize").same_as(legalize), name
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
