"""AdamW in tvm_spinn.training (``optimizer=("adamw", {...})``): the update is torch.optim.AdamW's
operation sequence (bit for bit against a numpy float32 transcription, within rounding of
PyTorch), a training run matches PyTorch, the state (step count, both moments) makes runs
bitwise reproducible across systems, checkpoints and data-parallel replica counts, its buffers
are the planner's count, and bad options get one clear error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.training import TrainingError
from tvm_spinn.training.graph import make_optimizer
from tvm_spinn.training.trainer import _resolve_target
from training_models import classification_data, mlp, small_cnn, torch_adamw

ADAMW = ("adamw", {"lr": 0.01, "weight_decay": 0.1})
STEPS = 20
F32 = np.float32
U = 2.0 ** -24  # unit roundoff of float32


def numpy_adamw(p, m, v, g, t, lr, betas, eps, weight_decay):
    """One AdamW step in numpy float32, the operation sequence of tvm_spinn.training.adamw
    (torch.optim.AdamW's single-tensor update with one rounding per operation)."""
    b1, b2 = betas
    neg_step, bc2_sqrt = F32(-lr / (1.0 - b1 ** t)), F32(np.sqrt(1.0 - b2 ** t))
    if weight_decay:
        p = p * F32(1.0 - lr * weight_decay)
    w = F32(1.0 - b1)
    m = m + w * (g - m) if w < 0.5 else g - (g - m) * (F32(1) - w)
    v = v * F32(b2) + (F32(1.0 - b2) * g) * g
    return p + (neg_step * m) / (np.sqrt(v) / bc2_sqrt + F32(eps)), m, v


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


# ----------------------------------------------------------------------------- the update alone
@pytest.mark.parametrize("options", [
    {"lr": 0.01, "weight_decay": 0.1},
    {"lr": 0.05, "betas": (0.3, 0.9), "eps": 1e-3, "weight_decay": 0.5},  # lerp's other branch; eps matters
    {"lr": 1e-3},  # torch's default weight decay 1e-2
])
def test_update_is_torch_adamw_step_by_step(options):
    """The update function alone, built for spinn (its element-wise ops on the simulated PEs)
    and for llvm, fed the same gradients as torch.optim.AdamW for 30 steps (scales 1e-6..10,
    some exactly 0): the same bits as the numpy transcription of the operation sequence, and
    within the rounding bound of PyTorch (which fuses lerp's and addcmul's multiply-add)."""
    full = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, **options}
    shapes = [(24, 33), (33,)]
    params = [relax.Var(f"w{i}", relax.TensorType(s, "float32")) for i, s in enumerate(shapes)]
    opt = make_optimizer(("adamw", options)).init(params)
    mod = tvm.IRModule({"main": opt.get_function().with_attr("global_symbol", "main")})
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(s).astype(F32) for s in shapes]
    grads = []
    for _ in range(30):
        gs = [(rng.standard_normal(s) * 10.0 ** rng.integers(-6, 2)).astype(F32) for s in shapes]
        gs[1][:5] = 0.0  # a zero gradient: m = v = 0 there, the step is 0 / eps
        grads.append(gs)

    ref = [(p.copy(), np.zeros_like(p), np.zeros_like(p)) for p in init]
    for t, gs in enumerate(grads, 1):
        ref = [numpy_adamw(*r, g, t, **full) for r, g in zip(ref, gs)]
    tparams = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in init]
    topt = torch.optim.AdamW(tparams, **options)
    for gs in grads:
        for tp, g in zip(tparams, gs):
            tp.grad = torch.from_numpy(g.copy())
        topt.step()

    for target in ("spinn", "llvm"):
        vm = relax.VirtualMachine(relax.build(mod, target=_resolve_target(target)), tvm.cpu())
        cur, state = tuple(tvm.runtime.tensor(p) for p in init), tuple(opt.state)
        for gs in grads:
            cur, state = vm["main"](cur, tuple(tvm.runtime.tensor(g) for g in gs), state)
        assert int(state[0].numpy()) == 30
        for i, (p, m, v) in enumerate(ref):
            np.testing.assert_array_equal(_bits(cur[i].numpy()), _bits(p), err_msg=f"{target} param {i}")
            np.testing.assert_array_equal(_bits(state[1 + i].numpy()), _bits(m), err_msg=f"{target} m {i}")
            np.testing.assert_array_equal(_bits(state[3 + i].numpy()), _bits(v), err_msg=f"{target} v {i}")
    # PyTorch: per step a parameter differs by at most ~u |p| (the decay and the final add) plus
    # the fused multiply-add's saved rounding in m (<= 2u (1 - b1) |g - m| after the weight),
    # divided by the denominator (>= sqrt(1 - b2) |g| / sqrt(bc2)) and scaled by lr / bc1: at most
    # 2u lr / sqrt(1 - b2). Errors in m and v decay with the betas, so N steps add linearly.
    # |p| grows by at most lr max(1, (1 - b1) / sqrt(1 - b2)) a step (Kingma & Ba 2015, Sec. 2.1).
    (b1, b2), lr, n = full["betas"], full["lr"], len(grads)
    pmax = max(float(np.abs(p).max()) for p in init) + n * lr * max(1.0, (1 - b1) / np.sqrt(1 - b2))
    bound = n * U * (2 * pmax + 2 * lr / np.sqrt(1 - b2))
    for i, tp in enumerate(tparams):
        assert np.abs(ref[i][0] - tp.detach().numpy()).max() <= bound, i


# ------------------------------------------------------------------ a training run vs PyTorch
@pytest.fixture(scope="module")
def mlp_trainer():
    model = mlp(seed=3)
    x, _ = classification_data()
    return model, tvm_spinn.training.compile(model, torch.from_numpy(x), optimizer=ADAMW, target="spinn")


# Bound vs PyTorch for a run. Both compute the same float32 formulas with the gradients in
# different summation orders: a GEMM of depth K <= 32 is ~K u = 2e-6 relative, the backward
# chain (softmax, two GEMMs) ~1e-5. Adam's step m/sqrt(v) is invariant to the gradient's scale,
# so a relative gradient error gives about the same relative error of the step, and a step moves
# a parameter by at most lr (1 - b1) / sqrt(1 - b2) = 3.2 lr (Kingma & Ba 2015, Sec. 2.1): after
# N = 20 steps at lr = 0.01, 20 * 0.032 * 1e-5 = 6.4e-6, plus the update's own rounding (a few
# ulps of |p| <= 1 per step, 20 * 4 * 6e-8 = 5e-6): 1e-5 for the parameters and, through the
# loss gradient (|dL/dp|_1 <= 18 on this run), 2e-4 for the losses. (A missing decoupled decay
# moves the weights by N lr wd |p| ~ 1e-2, a missing bias correction by ~N lr.)
ATOL_PARAM, ATOL_LOSS = 1e-5, 2e-4


def test_mlp_adamw_matches_pytorch(mlp_trainer):
    model, trainer = mlp_trainer
    x, y = classification_data()
    batches = [(x, y)] * STEPS
    start = trainer.parameters(), trainer.optimizer_state()
    llvm = trainer.build_for("llvm")
    losses = [trainer.step(a, b) for a, b in batches]
    llvm_losses = [llvm.step(a, b) for a, b in batches]
    ref_losses, ref_params = torch_adamw(model, batches, ADAMW[1])
    assert ref_losses[-1] < 0.1 * ref_losses[0]  # it trains: the comparison spans a real curve
    assert trainer.steps == STEPS
    for got, params in ((losses, trainer.parameters()), (llvm_losses, llvm.parameters())):
        np.testing.assert_allclose(got, ref_losses, rtol=0, atol=ATOL_LOSS)
        assert sorted(params) == sorted(ref_params)
        for name in ref_params:
            np.testing.assert_allclose(params[name], ref_params[name], rtol=0, atol=ATOL_PARAM, err_msg=name)
    trainer._set_state(list(start[0].values()), start[1])  # leave the fixture as it was


def test_update_runs_on_the_pes(mlp_trainer):
    """Every per-element op of the update is offloaded (14 per parameter: decay 1, m 3, v 4,
    denominator 3, step 3); only the 0-d step arithmetic (count, bias corrections) is host work."""
    place = tvm_spinn.training.op_placement(mlp_trainer[1])["update"]
    assert place["pe"] == {"spinn.add": 16, "spinn.divide": 8, "spinn.multiply": 24, "spinn.sqrt": 4,
                           "spinn.subtract": 4}  # 4 parameters
    assert place["host"] == {"relax.add": 1, "relax.astype": 3, "relax.divide": 1, "relax.power": 2,
                             "relax.sqrt": 1, "relax.subtract": 2}


@pytest.mark.slow
def test_small_cnn_adamw_matches_pytorch():
    """A small CNN (two convolutions as im2col GEMMs, max pooling), 20 AdamW steps on the PEs.
    GEMM depths up to 72 (3x3x8): the bound above scaled by 72 / 32."""
    model = small_cnn(seed=1)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 3, 8, 8)).astype(F32)
    y = rng.integers(0, 10, 4).astype(np.int64)
    opts = {"lr": 0.005, "weight_decay": 0.05}
    trainer = tvm_spinn.training.compile(model, torch.from_numpy(x), optimizer=("adamw", opts), target="spinn")
    losses = [trainer.step(x, y) for _ in range(STEPS)]
    ref_losses, ref_params = torch_adamw(model, [(x, y)] * STEPS, opts)
    assert ref_losses[-1] < 0.5 * ref_losses[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=ATOL_LOSS * 72 / 32)
    params = trainer.parameters()
    for name in ref_params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=0, atol=ATOL_PARAM * 72 / 32, err_msg=name)


# ------------------------------------------------------------------------------ reproducibility
def _batches(seed=2, n=12):
    """A different batch every step, so that a resumed run must continue on the right batch."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((8, 16)).astype(F32), rng.integers(0, 10, 8).astype(np.int64)) for _ in range(n)]


def _same_bits(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(_bits(a[n]), _bits(b[n])) for n in a)


def test_bitwise_across_runs_systems_and_resume(mlp_trainer, tmp_path):
    """Chip, the chip again, a board, and the board resumed from the chip's mid-run checkpoint:
    the same losses and parameter bits; the checkpoint carries the step count and both moments
    (resuming with them zeroed gives other bits)."""
    chip = mlp_trainer[1]
    board = chip.build_for("spinn/board")
    batches, split = _batches(), 5
    chip.save(tmp_path / "start.npz")
    losses = []
    for k, (x, y) in enumerate(batches):
        if k == split:
            chip.save(tmp_path / "mid.npz")
        losses.append(chip.step(x, y))
    final = chip.parameters()
    assert not _same_bits(final, dict(zip(chip._graph.param_names, chip._graph.init_params)))

    chip.load(tmp_path / "start.npz")
    assert chip.steps == 0 and [chip.step(x, y) for x, y in batches] == losses
    assert _same_bits(chip.parameters(), final)
    board.load(tmp_path / "start.npz")
    assert [board.step(x, y) for x, y in batches] == losses
    assert _same_bits(board.parameters(), final)
    board.load(tmp_path / "mid.npz")
    assert board.steps == split
    assert [board.step(x, y) for x, y in batches[split:]] == losses[split:]
    assert _same_bits(board.parameters(), final)

    saved = dict(np.load(tmp_path / "mid.npz"))
    state = sorted(k for k in saved if k.startswith("optim/"))
    assert saved[state[0]].dtype == np.int64 and int(saved[state[0]]) == split  # the step count first
    assert len(state) == 1 + 2 * len(final)  # then m and v of each parameter
    for zeroed in ("m", "v", "t"):
        bad = dict(saved)
        keys = {"m": state[1:1 + len(final)], "v": state[1 + len(final):], "t": state[:1]}[zeroed]
        bad.update({k: np.zeros_like(saved[k]) for k in keys})
        np.savez(tmp_path / "bad.npz", **bad)
        board.load(tmp_path / "bad.npz")
        for x, y in batches[split:]:
            board.step(x, y)
        assert not _same_bits(board.parameters(), final), zeroed
    chip.load(tmp_path / "start.npz")  # leave the fixture as it was


def test_data_parallel_bits_do_not_depend_on_the_replica_count(tmp_path):
    """1, 2, 3 and 4 replicas (4 micro-batches, summed in ascending order; 3 replicas own blocks
    of 2, 1 and 1), and a run resumed on 4 replicas from a checkpoint of 2: the same losses and
    parameter bits."""
    dp = tvm_spinn.training.compile(mlp(seed=7), torch.zeros(8, 16), optimizer=ADAMW, target="spinn/board",
                                    data_parallel={"replicas": 1, "microbatches": 4})
    batches, split = _batches(seed=5, n=8), 3
    runs = {}
    for r in (1, 2, 3, 4):
        trainer = dp.with_replicas(r)
        runs[r] = [trainer.step(x, y) for x, y in batches], trainer.parameters()
    assert not _same_bits(runs[1][1], dict(zip(dp._graph.param_names, dp._graph.init_params)))
    for r in (2, 3, 4):
        assert runs[r][0] == runs[1][0] and _same_bits(runs[r][1], runs[1][1]), r
    two = dp.with_replicas(2)
    for x, y in batches[:split]:
        two.step(x, y)
    two.save(tmp_path / "mid.npz")
    four = dp.with_replicas(4)
    four.load(tmp_path / "mid.npz")
    assert four.steps == split
    assert [four.step(x, y) for x, y in batches[split:]] == runs[1][0][split:]
    assert _same_bits(four.parameters(), runs[1][1])


# -------------------------------------------------------------------------------- bad options
@pytest.mark.parametrize("options, message", [
    ({"lr": 0.01, "momentum": 0.9}, r"unsupported option 'momentum' of optimizer 'adamw'"),
    ({"lr": 0.01, "amsgrad": True}, r"amsgrad=True of optimizer 'adamw'"),
    ({"lr": 0.01, "amsgrad": 1}, r"option 'amsgrad' must be a bool"),
    ({"lr": -0.01}, r"optimizer 'adamw': option 'lr' must be >= 0"),
    ({"lr": float("nan")}, r"option 'lr' must be >= 0 and finite"),
    ({"lr": 0.01, "betas": (0.9, 1.0)}, r"option 'betas\[1\]' must be \[0, 1\), got 1.0"),
    ({"lr": 0.01, "betas": (-0.1, 0.999)}, r"option 'betas\[0\]' must be \[0, 1\)"),
    ({"lr": 0.01, "betas": 0.9}, r"option 'betas' must be a pair"),
    ({"lr": 0.01, "eps": 0.0}, r"option 'eps' must be > 0 and finite, got 0.0"),
    ({"lr": 0.01, "eps": -1e-8}, r"option 'eps' must be > 0"),
    ({"lr": 0.01, "weight_decay": -1}, r"option 'weight_decay' must be >= 0"),
    ({"lr": 0.01, "weight_decay": "0.1"}, r"option 'weight_decay' must be a real number"),
    ({}, r"optimizer 'adamw' needs a learning rate 'lr'"),
])
def test_bad_adamw_options(options, message):
    with pytest.raises(TrainingError, match=message):
        make_optimizer(("adamw", options))


def test_bad_option_through_compile_and_good_edge_values():
    with pytest.raises(TrainingError, match=r"amsgrad=True of optimizer 'adamw'"):
        tvm_spinn.training.compile(mlp(), torch.zeros(8, 16), optimizer=("adamw", {"lr": 0.01, "amsgrad": True}))
    opt = make_optimizer(("adamw", {"lr": 0, "betas": [0.0, 0.0], "eps": 1e-30, "weight_decay": 0,
                                    "amsgrad": np.bool_(False)}))
    assert (opt.lr, opt.beta1, opt.beta2, opt.eps, opt.weight_decay) == (0.0, 0.0, 0.0, 1e-30, 0.0)
    assert make_optimizer(("adamw", {"lr": 1e-3})).weight_decay == 1e-2  # torch.optim.AdamW's default


# ------------------------------------------------------------------------- against the planner
@pytest.mark.slow
def test_planner_optimizer_bytes_are_the_buffers_a_build_allocates():
    """A tiny GPT-2 language model compiled with AdamW: the planner's optimizer state for one
    chip (2 fp32 words per parameter) equals the trainer's moment buffers; the only other state
    is the int64 step count."""
    from models import tiny_gpt2_lm

    from tvm_spinn.target import make_system
    from tvm_spinn.training import plan_training

    cfg, lm, ids = tiny_gpt2_lm(n_layer=1)
    trainer = tvm_spinn.training.compile(lm, (ids,), optimizer=("adamw", {"lr": 1e-3}), target="llvm")
    state = trainer.optimizer_state()
    param_bytes = sum(p.nbytes for p in trainer.parameters().values())
    assert [s.dtype for s in state if s.ndim == 0] == [np.int64]
    moments = sum(s.nbytes for s in state if s.ndim > 0)
    plan = plan_training(cfg, make_system("one", chips=1), seq=8, global_batch=2, micro_batch=2, tp=1, pp=1, dp=1,
                         zero=0, recompute=False)
    assert plan.memory.weights == param_bytes
    assert plan.memory.optimizer == moments == 2 * param_bytes
