"""Training-mode batch norm (``model.train()``) normalizes with the batch's statistics on spinn.

Partitioning folds and decomposes batch norms for inference (running statistics); a batch norm
whose ``training`` attribute is set must not be: it is spelled out with batch statistics first.
"""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn


def _run(mod, target, *args):
    ex = relax.build(mod, target=target)
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args])
    if hasattr(out, "numpy"):
        return [out.numpy()]
    return [o.numpy() for o in out]


@pytest.mark.parametrize("dims", [2, 1])
def test_torch_train_mode_batch_norm_matches_torch_and_llvm(dims):
    """TVM's importer keeps ``training=True``; spinn must match torch (and llvm) in train mode."""
    from tvm.relax.frontend.torch import from_exported_program

    torch.manual_seed(0)
    if dims == 2:
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
        x = torch.randn(2, 3, 8, 8)
    else:
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
        x = torch.randn(8, 6)
    bn = model[1]
    with torch.no_grad():  # running statistics far from the batch's: using them is visible
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    model.train()
    mod = from_exported_program(torch.export.export(model, (x,)), keep_params_as_input=False,
                                unwrap_unit_return_tuple=True)
    ref = model(x).detach().numpy()
    llvm = _run(mod, "llvm", x.numpy())[0]
    spinn = _run(mod, "spinn", x.numpy())[0]
    np.testing.assert_allclose(llvm, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(spinn, llvm, rtol=1e-5, atol=1e-5)
    eval_ref = model.eval()(x).detach().numpy()  # the failure mode: running statistics
    assert np.abs(spinn - eval_ref).max() > 0.1


@pytest.mark.parametrize("axis", [1, 3])  # (TVM's llvm legalization rejects axis=-1)
def test_relax_training_batch_norm_updates_running_statistics(axis):
    """All three outputs (normalized data, new running mean, new running variance)."""
    rng = np.random.default_rng(0)
    shape = (4, 3, 5, 6)
    channels = shape[axis]
    x = rng.normal(1.0, 2.0, shape).astype("float32")
    gamma, beta = rng.uniform(0.5, 1.5, channels).astype("float32"), rng.normal(size=channels).astype("float32")
    rmean, rvar = rng.normal(size=channels).astype("float32"), rng.uniform(0.5, 2, channels).astype("float32")
    momentum, eps = 0.2, 1e-3

    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [xv]):
        with bb.dataflow():
            bn = bb.emit(relax.op.nn.batch_norm(
                xv, relax.const(gamma), relax.const(beta), relax.const(rmean), relax.const(rvar),
                axis=axis, epsilon=eps, momentum=momentum, training=True))
            out = bb.emit_output(relax.Tuple([relax.TupleGetItem(bn, i) for i in range(3)]))
        bb.emit_func_output(out)
    mod = bb.get()

    axes = tuple(i for i in range(4) if i != axis % 4)
    bshape = [1] * 4
    bshape[axis] = channels
    mean, var = x.astype("float64").mean(axes), x.astype("float64").var(axes)
    y = (x - mean.reshape(bshape)) / np.sqrt(var.reshape(bshape) + eps) * gamma.reshape(bshape) \
        + beta.reshape(bshape)
    expected = [y, (1 - momentum) * rmean + momentum * mean, (1 - momentum) * rvar + momentum * var]
    llvm = _run(mod, "llvm", x)
    spinn = _run(mod, "spinn", x)
    for got_l, got_s, want in zip(llvm, spinn, expected):
        np.testing.assert_allclose(got_l, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_s, got_l, rtol=1e-5, atol=1e-5)


def test_inference_batch_norm_still_folds():
    """Eval-mode batch norms keep being folded into the convolution (nothing left over)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()
    mod = tvm_spinn.frontend.from_pytorch(model, (torch.randn(1, 3, 8, 8),))
    parted = tvm_spinn.partition_for_spinn(mod)
    assert "batch_norm" not in parted.script()


def test_conv_fold_leaves_training_batch_norm_alone():
    """``FoldBatchNorm`` (also used by PTQ's ``prepare``) folds running statistics only."""
    from tvm.relax.frontend.torch import from_exported_program

    from tvm_spinn.relax_rewrites.folds import FoldBatchNorm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).train()
    mod = from_exported_program(torch.export.export(model, (torch.randn(2, 3, 8, 8),)),
                                keep_params_as_input=False, unwrap_unit_return_tuple=True)
    assert "training=True" in FoldBatchNorm(mod).script()
