"""tvm_spinn.training: a training step on spinn vs PyTorch and vs the same module built for llvm;
bad input (labels, models, losses, optimizers, checkpoints) -> one clear error."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import tvm_spinn
from tvm_spinn.training import CheckpointError, TrainingError
from tvm_spinn.training.checkpoint import write_checkpoint
from training_models import batchnorm_cnn, classification_data, mlp, small_cnn, torch_reference, transformer

SGD = ("sgd", {"lr": 0.1, "momentum": 0.9})
ADAM = ("adam", {"lr": 0.01})
STEPS = 50

# Tolerance vs PyTorch. Both sides compute the same float32 formulas in different summation
# orders (PyTorch/MKL blocks its GEMMs, spinn tiles K on the PEs, llvm loops serially): one
# GEMM of depth K <= 32 differs by at most ~K*u = 32 * 6e-8 ~ 2e-6 relative. Momentum feeds each
# step's error back into the velocity with gain sum(0.9^k) = 10, and 50 steps add up linearly:
# ~50 * 10 * 2e-6 = 1e-3 relative in the worst case (typically far less: errors are random and
# measured max |diff| ~ 1e-6). The loss goes down to ~1e-4, hence the absolute floor.
RTOL, ATOL_PARAM, ATOL_LOSS = 1e-3, 1e-4, 1e-5


def _batches(n=STEPS):
    x, y = classification_data()
    return [(x, y)] * n  # one batch, trained to overfit: the loss curve has a long range


@pytest.fixture(scope="module")
def mlp_runs():
    model = mlp()
    batches = _batches()
    runs = {}
    spinn = tvm_spinn.training.compile(model, (torch.from_numpy(batches[0][0]),), loss="cross_entropy",
                                       optimizer=SGD, target="spinn")
    llvm = spinn.build_for("llvm")  # the same training module, built for the host, same initial state
    for target, trainer in (("spinn", spinn), ("llvm", llvm)):
        losses = [trainer.step(x, y) for x, y in batches]
        runs[target] = (trainer, losses, trainer.parameters())
    runs["torch"] = (None, *torch_reference(model, batches, "cross_entropy", SGD))
    return model, runs


def test_mlp_sgd_momentum_matches_pytorch(mlp_runs):
    _, runs = mlp_runs
    _, losses, params = runs["spinn"]
    _, ref_losses, ref_params = runs["torch"]
    assert ref_losses[-1] < 0.01 * ref_losses[0]  # it does train: the comparison spans a real curve
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL_LOSS)
    assert sorted(params) == sorted(ref_params)
    for name in ref_params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=RTOL, atol=ATOL_PARAM, err_msg=name)


def test_mlp_spinn_matches_llvm_build(mlp_runs):
    _, runs = mlp_runs
    _, losses, params = runs["spinn"]
    _, llvm_losses, llvm_params = runs["llvm"]
    np.testing.assert_allclose(losses, llvm_losses, rtol=RTOL, atol=ATOL_LOSS)
    for name in llvm_params:
        np.testing.assert_allclose(params[name], llvm_params[name], rtol=RTOL, atol=ATOL_PARAM, err_msg=name)


def test_step_gemms_run_on_the_pes(mlp_runs):
    """Forward (2), dX (1: the first layer's input needs none) and dW (2) GEMMs are offloaded."""
    trainer = mlp_runs[1]["spinn"][0]
    summary = tvm_spinn.summarize_partition(tvm_spinn.partition_for_spinn(trainer.module))
    assert summary.offloaded_ops.get("spinn.matmul") == 5
    assert "relax.matmul" not in summary.fallback_ops
    assert trainer.steps == STEPS


def test_op_placement_per_phase(mlp_runs):
    """Backward GEMMs (dX = dY W^T: 1, dW = dY^T X: 2) and the whole SGD update (but the 0-d step
    counter) run on the PEs; the counts add up to the fused step's partition."""
    trainer = mlp_runs[1]["spinn"][0]
    place = tvm_spinn.training.op_placement(trainer)
    assert place["forward"]["pe"]["spinn.matmul"] == 2 and place["backward"]["pe"]["spinn.matmul"] == 3
    assert not any("matmul" in op for phase in place.values() for op in phase["host"])
    assert place["update"]["host"] == {"relax.add": 1}  # num_steps + 1, a 0-d int64 (host work)
    assert place["update"]["pe"] == {"spinn.add": 4, "spinn.multiply": 8, "spinn.subtract": 4}  # 4 params
    fused = tvm_spinn.summarize_partition(tvm_spinn.partition_for_spinn(trainer.module))
    for where, counts in (("pe", fused.offloaded_ops), ("host", fused.fallback_ops)):
        total = {}
        for phase in place.values():
            for op, n in phase[where].items():
                total[op] = total.get(op, 0) + n
        assert total == dict(counts), where


def test_mse_adam_matches_pytorch():
    model = mlp(seed=3, d_out=4)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    y = rng.standard_normal((8, 4)).astype(np.float32)
    batches = [(x, y)] * 20
    trainer = tvm_spinn.training.compile(model, torch.from_numpy(x), loss="mse", optimizer=ADAM)
    losses = [trainer.step(torch.from_numpy(a), torch.from_numpy(b)) for a, b in batches]
    ref_losses, ref_params = torch_reference(model, batches, "mse", ADAM)
    assert ref_losses[-1] < 0.5 * ref_losses[0]
    # Adam divides by sqrt(v_hat)+eps; TVM and PyTorch arrange the bias corrections differently
    # (a few ulps per step), bounded like the SGD case above by steps * K * u.
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL_LOSS)
    for name in ref_params:
        np.testing.assert_allclose(trainer.parameters()[name], ref_params[name], rtol=RTOL, atol=ATOL_PARAM,
                                   err_msg=name)


def test_imported_relax_module_trains_like_pytorch():
    """A module imported by tvm_spinn.frontend (weights bound as constants): its float32 weight
    constants become param_0.. in order of first use, here PyTorch's parameter order."""
    model = mlp(seed=11)
    x, y = classification_data(seed=12)
    mod = tvm_spinn.frontend.from_pytorch(model, (torch.from_numpy(x),))
    trainer = tvm_spinn.training.compile(mod, x, optimizer=SGD)
    batches = [(x, y)] * 20
    losses = [trainer.step(a, b) for a, b in batches]
    ref_losses, ref_params = torch_reference(model, batches, "cross_entropy", SGD)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL_LOSS)
    params = trainer.parameters()
    assert list(params) == [f"param_{k}" for k in range(4)]
    for (name, ref), got in zip(ref_params.items(), params.values()):
        np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL_PARAM, err_msg=name)
    relu = tvm_spinn.frontend.from_pytorch(torch.nn.ReLU(), (torch.from_numpy(x),))
    with pytest.raises(TrainingError, match="Relax module has no trainable parameters"):
        tvm_spinn.training.compile(relu, x)


@pytest.mark.slow
def test_small_cnn_matches_pytorch_and_llvm():
    """Conv/ReLU/max-pool/linear, 50 steps; conv depth K = C_in*3*3 <= 72 (bound as above: ~4e-6
    per GEMM, within the same tolerances)."""
    model = small_cnn()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 4).astype(np.int64)
    batches = [(x, y)] * STEPS
    spinn = tvm_spinn.training.compile(model, torch.from_numpy(x), optimizer=SGD)
    llvm = spinn.build_for("llvm")
    losses = [spinn.step(a, b) for a, b in batches]
    llvm_losses = [llvm.step(a, b) for a, b in batches]
    ref_losses, ref_params = torch_reference(model, batches, "cross_entropy", SGD)
    assert ref_losses[-1] < 0.01 * ref_losses[0]
    for other in (ref_losses, llvm_losses):
        np.testing.assert_allclose(losses, other, rtol=RTOL, atol=ATOL_LOSS)
    for name in ref_params:
        for other in (ref_params[name], llvm.parameters()[name]):
            np.testing.assert_allclose(spinn.parameters()[name], other, rtol=RTOL, atol=ATOL_PARAM, err_msg=name)


@pytest.mark.slow
def test_batchnorm_in_training_mode_matches_pytorch():
    """BatchNorm2d/1d normalize with the batch's statistics (PyTorch's train mode), 50 steps;
    compiling leaves the model's running statistics untouched."""
    model = batchnorm_cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 4).astype(np.int64)
    batches = [(x, y)] * STEPS
    trainer = tvm_spinn.training.compile(model, torch.from_numpy(x), optimizer=SGD)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    losses = [trainer.step(a, b) for a, b in batches]
    ref_losses, ref_params = torch_reference(model, batches, "cross_entropy", SGD)
    assert ref_losses[-1] < 0.01 * ref_losses[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL_LOSS)
    for name in ref_params:
        np.testing.assert_allclose(trainer.parameters()[name], ref_params[name], rtol=RTOL, atol=ATOL_PARAM,
                                   err_msg=name)


def _transformer_run(steps: int, targets: tuple[str, ...]):
    """A 2-layer transformer (LayerNorm, multi-head softmax attention, GELU MLP; tests/
    training_models.py) trained ``steps`` steps on one sequence batch, on each of ``targets``
    (the same module, same initial state) and in PyTorch."""
    model = transformer()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 6, 8)).astype(np.float32)
    y = rng.integers(0, 10, 4).astype(np.int64)
    batches = [(x, y)] * steps
    first = tvm_spinn.training.compile(model, torch.from_numpy(x), optimizer=SGD, target=targets[0])
    # built before any step: build_for starts from the trainer's current state
    trainers = {t: first if t == targets[0] else first.build_for(t) for t in targets}
    runs = {t: ([tr.step(a, b) for a, b in batches], tr.parameters()) for t, tr in trainers.items()}
    runs["torch"] = torch_reference(model, batches, "cross_entropy", SGD)
    return runs


def _assert_close_runs(got, ref):
    """Loss curves and final parameters within the tolerances above. The transformer's
    reductions are no deeper than the MLP's: GEMMs of K <= 32 (hidden width), softmax over 6
    keys, LayerNorm over 16 features, so the same bound holds."""
    np.testing.assert_allclose(got[0], ref[0], rtol=RTOL, atol=ATOL_LOSS)
    assert sorted(got[1]) == sorted(ref[1])
    for name in ref[1]:
        np.testing.assert_allclose(got[1][name], ref[1][name], rtol=RTOL, atol=ATOL_PARAM, err_msg=name)


def test_transformer_few_steps_match_pytorch():
    """The fast variant: 5 steps on one chip; attention, LayerNorm and GELU backward included."""
    runs = _transformer_run(5, ("spinn",))
    assert runs["torch"][0][-1] < 0.8 * runs["torch"][0][0]
    _assert_close_runs(runs["spinn"], runs["torch"])


def test_gelu_gradients_match_pytorch():
    """GELU's gradients, erf and tanh forms in one model (TVM has neither;
    tvm_spinn.training.gradients adds them)."""
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16),
                                torch.nn.GELU(approximate="tanh"), torch.nn.Linear(16, 10))
    x, y = classification_data(seed=6)
    batches = [(x, y)] * 5
    trainer = tvm_spinn.training.compile(model, torch.from_numpy(x), optimizer=SGD, target="llvm")
    got = ([trainer.step(a, b) for a, b in batches], trainer.parameters())
    _assert_close_runs(got, torch_reference(model, batches, "cross_entropy", SGD))


class _TokenModel(torch.nn.Module):
    """Token ids (batch, seq) -> embedding -> first token and the mean over tokens -> classes;
    a Dropout(p=0) (the identity in training mode too, accepted)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(9)
        self.embed = torch.nn.Embedding(50, 8)
        self.drop = torch.nn.Dropout(0.0)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, ids):
        e = self.drop(self.embed(ids))
        return self.head(torch.cat([e[:, 0], e.mean(dim=1)], dim=-1))


def test_embedding_and_token_select_gradients_match_pytorch():
    """take with (batch, seq) ids and x[:, 0] (a 0-d index): TVM's take_backward only takes 1-d
    indices, graph.py flattens them (repeated ids accumulate their gradients)."""
    model = _TokenModel()
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 12, (4, 6)).astype(np.int64)  # 24 draws of 12 ids: repeats
    y = rng.integers(0, 10, 4).astype(np.int64)
    batches = [(ids, y)] * 5
    trainer = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=SGD, target="llvm")
    got = ([trainer.step(a, b) for a, b in batches], trainer.parameters())
    _assert_close_runs(got, torch_reference(model, batches, "cross_entropy", SGD))


def test_conv_with_trainable_weight_runs_as_gemms_on_the_pes():
    """conv2d with a trainable weight (stride 2 and padding, a non-square kernel) is im2col + a
    GEMM: forward, weight gradient (dY @ cols^T) and data gradient (W^T @ dY) are spinn.matmul;
    no conv2d / conv2d_transpose / reduction is left on the host; 5 steps match PyTorch."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 4, (3, 2), padding=(0, 1)), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 2 * 5, 10))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 7, 7)).astype(np.float32)
    y = rng.integers(0, 10, 2).astype(np.int64)
    batches = [(x, y)] * 5
    trainer = tvm_spinn.training.compile(model, torch.from_numpy(x), optimizer=SGD)
    got = ([trainer.step(a, b) for a, b in batches], trainer.parameters())
    _assert_close_runs(got, torch_reference(model, batches, "cross_entropy", SGD))
    summary = tvm_spinn.summarize_partition(tvm_spinn.partition_for_spinn(trainer.module))
    assert not {"relax.nn.conv2d", "relax.nn.conv2d_transpose", "relax.matmul"} & set(summary.fallback_ops)
    # the 3 bias gradients (collapse_sum_to over batch and pixels) are GEMMs with a ones column
    # (the loss's gradient is one cross_entropy_backward layer: no sum)
    assert not {"relax.collapse_sum_to", "relax.sum"} & set(summary.fallback_ops)
    assert summary.offloaded_ops["spinn.dense"] == 3
    # forward 2 convs + 1 linear; backward dW for all 3, dX for the 2 layers after the first
    assert summary.offloaded_ops["spinn.matmul"] == 8


@pytest.mark.slow
def test_transformer_matches_pytorch_and_llvm_bitwise_on_a_board():
    """50 steps of the 2-layer transformer: loss curve and parameters vs PyTorch and vs the same
    module built for llvm; a board gives the chip's bits."""
    runs = _transformer_run(STEPS, ("spinn", "llvm", "spinn/board"))
    assert runs["torch"][0][-1] < 0.01 * runs["torch"][0][0]
    for other in ("torch", "llvm"):
        _assert_close_runs(runs["spinn"], runs[other])
    assert runs["spinn/board"][0] == runs["spinn"][0]
    for name, value in runs["spinn"][1].items():
        np.testing.assert_array_equal(runs["spinn/board"][1][name].view(np.uint32), value.view(np.uint32),
                                      err_msg=name)


# -- bad input ------------------------------------------------------------------------------------

def test_labels_of_wrong_shape_or_dtype(mlp_runs):
    trainer = mlp_runs[1]["llvm"][0]
    x, y = classification_data()
    with pytest.raises(TrainingError, match=r"labels have shape \(4,\).*\(8,\)"):
        trainer.step(x, y[:4])
    with pytest.raises(TrainingError, match="labels have dtype float32.*cross_entropy"):
        trainer.step(x, y.astype(np.float32))
    with pytest.raises(TrainingError, match="label 10 is out of range for 10 classes"):
        trainer.step(x, np.full(8, 10))
    with pytest.raises(TrainingError, match=r"input 0 has shape \(8, 15\)"):
        trainer.step(x[:, :15], y)


def test_model_without_trainable_parameters():
    frozen = mlp()
    for p in frozen.parameters():
        p.requires_grad_(False)
    x, _ = classification_data()
    with pytest.raises(TrainingError, match="Sequential has no trainable parameters"):
        tvm_spinn.training.compile(frozen, torch.from_numpy(x))
    with pytest.raises(TrainingError, match="ReLU has no trainable parameters"):
        tvm_spinn.training.compile(torch.nn.ReLU(), torch.from_numpy(x))


@pytest.mark.parametrize("kwargs, message", [
    ({"loss": "hinge"}, "unsupported loss 'hinge'"),
    ({"optimizer": ("rmsprop", {"lr": 0.1})}, "unsupported optimizer 'rmsprop'"),
    ({"optimizer": ("sgd", {"lr": 0.1, "foo": 1})}, "unsupported option 'foo' of optimizer 'sgd'"),
    ({"optimizer": ("adam", {})}, "optimizer 'adam' needs a learning rate"),
])
def test_unsupported_loss_or_optimizer(kwargs, message):
    x, _ = classification_data()
    with pytest.raises(TrainingError, match=message):
        tvm_spinn.training.compile(mlp(), torch.from_numpy(x), **kwargs)


def test_training_mode_layers_are_refused():
    x, _ = classification_data()
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Dropout(0.5))  # p = 0 is accepted
    with pytest.raises(TrainingError, match=r"layer 1 \(Dropout\)"):
        tvm_spinn.training.compile(model, torch.from_numpy(x))


def test_op_without_a_gradient_is_named():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(),
                                torch.nn.Linear(16, 10))
    with pytest.raises(TrainingError, match=r"uses relax.nn.adaptive_avg_pool2d, which has no gradient"):
        tvm_spinn.training.compile(model, torch.zeros(2, 3, 9, 9), target="llvm")


class _EveryOther(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x[:, ::2])


def test_strided_slice_gradient_limit_is_named():
    with pytest.raises(TrainingError, match="no gradient for a strided_slice of stride 2"):
        tvm_spinn.training.compile(torch.nn.Sequential(torch.nn.Linear(16, 16), _EveryOther()),
                                   torch.zeros(2, 16), target="llvm")


def test_checkpoint_from_another_model(mlp_runs, tmp_path):
    trainer = mlp_runs[1]["llvm"][0]
    # what Trainer.save of mlp(hidden=24) writes (the same writer; spares a compile)
    other = {n: p.detach().numpy() for n, p in mlp(hidden=24).named_parameters()}
    path = tmp_path / "other.npz"
    write_checkpoint(path, other, trainer.optimizer_state(), trainer._meta())
    with pytest.raises(CheckpointError, match=r"parameter 0.weight has shape \(24, 16\) float32, this model's is \(32, 16\)"):
        trainer.load(path)
    # the same parameters, saved by a trainer with another optimizer (its optimizer field)
    params = trainer.parameters()
    meta = dict(trainer._meta(), optimizer='["adam", {"lr": 0.1}]')
    write_checkpoint(path, params, trainer.optimizer_state(), meta)
    with pytest.raises(CheckpointError, match=r'optimizer \["adam".*this trainer uses .cross_entropy. and \["sgd"'):
        trainer.load(path)
    with pytest.raises(CheckpointError, match="no such file"):
        trainer.load(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="junk.npz: not a readable"):
        trainer.load(tmp_path / "junk.npz")


def test_save_is_atomic(mlp_runs, tmp_path, monkeypatch):
    trainer = mlp_runs[1]["llvm"][0]
    path = tmp_path / "ckpt.npz"
    trainer.save(path)
    before = path.read_bytes()
    umask = os.umask(0)
    os.umask(umask)
    assert (path.stat().st_mode & 0o777) == 0o666 & ~umask  # an ordinary file, not mkstemp's 0600

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", fail)
    with pytest.raises(OSError, match="disk full"):
        trainer.save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.npz"]  # no temporary left behind


def test_step_time_by_phase(mlp_runs):
    """Forward, backward and update timed apart (each phase built alone): all take PE time and
    together make the fused step's time up to what the fused build merges (within 25% here)."""
    trainer = mlp_runs[1]["spinn"][0]
    t = tvm_spinn.training.step_time(trainer)
    assert t["forward_s"] > 0 and t["backward_s"] > 0 and t["update_s"] > 0
    assert t["forward_s"] + t["backward_s"] + t["update_s"] == pytest.approx(t["step_s"], rel=0.25)
    # the host ops left (the loss, the step counter) are a phase of their own, in the total
    assert t["host_s"] > 0 and t["total_s"] == t["step_s"] + t["host_s"]
    parts = t["forward_host_s"] + t["backward_host_s"] + t["update_host_s"]
    assert parts == pytest.approx(t["host_s"], rel=1e-9)
    with pytest.raises(TrainingError, match="needs a trainer built for a spinn target"):
        tvm_spinn.training.step_time(mlp_runs[1]["llvm"][0])


class _Gauss(torch.nn.Module):
    """``exp(-x^2)``: ``exp`` has no PE kind, so it stays on the host between the layers' regions."""

    def forward(self, x):
        return torch.exp(-x * x)


def test_step_time_counts_shared_programs_per_call():
    """Three same-shaped layers cut apart by host ops (``exp``): their regions are one shared
    program called three times (the weights are arguments), which the report lists once; the
    step time counts every call."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(3)]
    model = torch.nn.Sequential(layers[0], _Gauss(), layers[1], _Gauss(), layers[2])
    x, _ = classification_data()
    trainer = tvm_spinn.training.compile(model, torch.from_numpy(x), optimizer=SGD)
    listed = tvm_spinn.report(trainer.executable).latency_s
    assert tvm_spinn.training.step_time(trainer, phases=False)["step_s"] > 1.05 * listed  # 1.08x measured
