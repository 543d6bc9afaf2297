"""User-given parallel plans (``tvm_spinn.training.compile(..., parallel=...)``): parameters
bitwise identical whatever the micro-batch count, the data-parallel replica count and the
optimizer-state sharding (ZeRO-1/2), equal to the one-chip run and within float32 error of
PyTorch; a checkpoint resumes under another plan with the same bits; a split that does not
divide its axis, or a checkpoint of another granule or model -> one error naming it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tvm_spinn
from tvm_spinn.training import CheckpointError, TrainingError
from test_training_lm import ADAMW, _assert_close, gpt2, llama, tokens
from training_models import mlp, run_steps as _run, same_bits as _same_bits, torch_adamw

STEPS = 3
#: (name, with_plan options) on a board: micro-batch counts 1, 2, 4; 1, 2, 4 replicas; ZeRO 0, 1, 2
PLANS = {
    "dp1 mb2": {"replicas": 1, "microbatches": 2},
    "dp1 mb4": {"replicas": 1, "microbatches": 4},
    "dp2 mb2": {"replicas": 2, "microbatches": 2},
    "dp4 mb4": {"replicas": 4, "microbatches": 4},
    "zero1 dp2 mb4": {"replicas": 2, "microbatches": 4, "zero": 1},
    "zero2 dp4 mb4": {"replicas": 4, "microbatches": 4, "zero": 2},
    "zero1 dp3 mb4": {"replicas": 3, "microbatches": 4, "zero": 1},
}


@pytest.fixture(scope="module")
def tiny():
    """A 1-layer GPT-2 (hidden 32, vocabulary 64; batch 4 of 8 tokens), compiled once for a
    board: one micro-batch on one replica (a chip of the board) is the reference plan."""
    model = gpt2(layers=1, hidden=32, vocab=64)
    ids, labels = tokens(64)
    trainer = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn/board",
                                         parallel={"dp": 1, "microbatches": 1})
    return model, trainer, [(ids, labels)] * STEPS


def test_plans_bitwise_identical_and_close_to_pytorch(tiny):
    model, trainer, batches = tiny
    ref = _run(trainer.with_plan(), batches)
    initial = dict(zip(trainer._graph.param_names, trainer._graph.init_params))
    assert any(ref[1][n].tobytes() != v.tobytes() for n, v in initial.items())  # the parameters moved
    for name, options in PLANS.items():
        assert _same_bits(_run(trainer.with_plan(**options), batches), ref), name
    _assert_close(ref, torch_adamw(model, batches, ADAMW[1]))


def test_zero_shards_the_optimizer_state(tiny):
    """ZeRO: each replica holds the state of its slice of the parameters only; the gathered
    state is the unsharded run's, bit for bit."""
    _, trainer, batches = tiny
    plain = trainer.with_plan(replicas=4, microbatches=4)
    sharded = trainer.with_plan(replicas=4, microbatches=4, zero=1)
    for x, y in batches:
        plain.step(x, y), sharded.step(x, y)
    total = sum(v.size for v in plain.parameters().values())
    shards = sharded.optimizer_state_shards()
    assert len(shards) == 4
    assert [int(s[0]) for s in shards] == [STEPS] * 4  # every replica counts the steps
    sizes = [s[1].size for s in shards]  # the first moments of each replica's slice
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
    assert all(b.shape == (n,) for s, n in zip(shards, sizes) for b in s[1:])
    for a, b in zip(sharded.optimizer_state(), plain.optimizer_state()):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert sharded.steps == STEPS


def test_resume_under_another_plan(tiny, tmp_path):
    """Saved under ZeRO-2 on 4 replicas, resumed on one replica with 2 micro-batches (and the
    other way round): the uninterrupted run's bits."""
    _, trainer, batches = tiny
    whole = _run(trainer.with_plan(), batches)
    first = trainer.with_plan(replicas=4, microbatches=4, zero=2)
    first.step(*batches[0])
    first.save(tmp_path / "mid.npz")
    second = trainer.with_plan(replicas=1, microbatches=2)
    second.load(tmp_path / "mid.npz")
    assert second.steps == 1
    losses = [second.step(x, y) for x, y in batches[1:]]
    assert losses == whole[0][1:]
    assert _same_bits((whole[0], second.parameters()), whole)


def test_microbatch_count_changes_bits_of_data_parallel_granules():
    """The rule's counterpart: with data_parallel= the granule is the micro-batch, so 1 and 2
    micro-batches sum the batch's gradient in other orders (other bits); parallel= (granule:
    one sample) gives one result for both. A small MLP (fast to compile)."""
    rng = np.random.default_rng(4)
    batches = [(rng.standard_normal((4, 16)).astype(np.float32), rng.integers(0, 10, 4).astype(np.int64))
               for _ in range(4)]
    sgd = ("sgd", {"lr": 0.05, "momentum": 0.9})
    old = [_run(tvm_spinn.training.compile(mlp(seed=5), torch.zeros(4, 16), optimizer=sgd, target="spinn",
                                           data_parallel={"replicas": 1, "microbatches": m}), batches)
           for m in (1, 2)]
    assert not _same_bits(old[0], old[1])
    new = tvm_spinn.training.compile(mlp(seed=5), torch.zeros(4, 16), optimizer=sgd, target="spinn",
                                     parallel={"microbatches": 1})
    sample = _run(new.with_plan(microbatches=2), batches)
    assert _same_bits(sample, _run(new.with_plan(microbatches=4), batches))
    # a granule of 2 samples: its own bits, the same for 1 and 2 micro-batches (and 2's bits are
    # data_parallel's at 2 micro-batches: the same granule, the same sums)
    pairs = tvm_spinn.training.compile(mlp(seed=5), torch.zeros(4, 16), optimizer=sgd, target="spinn",
                                       parallel={"microbatches": 1, "granule": 2})
    assert pairs.granule == 2 and new.granule == 1
    by_pairs = _run(pairs.with_plan(), batches)  # with_plan: a copy (pairs itself is not stepped)
    assert _same_bits(by_pairs, _run(pairs.with_plan(microbatches=2), batches))
    assert _same_bits(by_pairs, old[1]) and not _same_bits(by_pairs, sample)


@pytest.mark.slow
@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_lm_plans_match_the_chip(make):
    """A 2-layer, hidden-64 LM, 3 AdamW steps: one micro-batch on a chip (``spinn``) vs every
    plan above on a board, bit for bit; and PyTorch's values."""
    model = make()
    ids, labels = tokens()
    batches = [(ids, labels)] * STEPS
    chip = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn",
                                      parallel={"microbatches": 1})
    ref = _run(chip, batches)
    _assert_close(ref, torch_adamw(model, batches, ADAMW[1]))
    board = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn/board",
                                       parallel={"microbatches": 1})
    for name, options in PLANS.items():
        assert _same_bits(_run(board.with_plan(**options), batches), ref), name


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, message", [
    ({"tp": 3}, r"tp=3 does not divide the attention heads \(2\); tp may be 1, 2"),
    ({"pp": 3}, r"pp=3 does not divide the layers \(2\); pp may be 1, 2"),
    ({"microbatches": 3}, r"microbatches=3 does not divide the batch \(4\); microbatches may be 1, 2, 4"),
    ({"dp": 4, "microbatches": 2}, r"dp=4 > microbatches=2: .*microbatches may be 4"),
    ({"zero": 3}, "zero must be 0 .*, 1 .* or 2"),
    ({"dp": 0}, "dp must be a positive integer"),
    ({"replicas": 2}, "unknown option 'replicas'"),
    ({"tp": 4}, r"tp=4 does not divide the attention heads \(2\); tp may be 1, 2"),
    ({"granule": 3}, r"granule=3 does not divide the batch \(4\); granule may be 1, 2, 4"),
    ({"granule": 2, "microbatches": 4},
     r"microbatches=4 does not divide the batch's granules \(2: batch 4 in granules of 2 samples\); "
     "microbatches may be 1, 2"),
])
def test_bad_splits_name_the_axis_and_the_sizes_that_work(options, message):
    """Checked before anything is compiled (each case takes milliseconds)."""
    ids, _ = tokens(64)
    with pytest.raises(TrainingError, match=message):
        tvm_spinn.training.compile(gpt2(layers=2, hidden=32, vocab=64), torch.from_numpy(ids), optimizer=ADAMW,
                                   target="spinn/board", parallel=options)


def test_batch_norm_is_refused_under_a_granule_smaller_than_the_batch():
    from training_models import batchnorm_cnn

    with pytest.raises(TrainingError, match=r"layer 1 \(BatchNorm2d\) normalizes with the statistics of its batch"):
        tvm_spinn.training.compile(batchnorm_cnn(), torch.zeros(4, 3, 8, 8), target="spinn",
                                   parallel={"microbatches": 2})


def test_bad_plan_for_the_system_and_for_with_plan(tiny):
    _, trainer, _ = tiny
    with pytest.raises(TrainingError, match=r"microbatches=3 does not divide the batch's granules \(4"):
        trainer.with_plan(microbatches=3)
    with pytest.raises(TrainingError, match="parallel: dp=8 > microbatches=4"):
        trainer.with_plan(replicas=8, microbatches=4)
    with pytest.raises(TrainingError, match="zero must be"):
        trainer.with_plan(zero=5)
    ids, _ = tokens(64)
    with pytest.raises(TrainingError, match=r"parallel: dp=2 needs 2 chips, target .* has 1"):
        tvm_spinn.training.compile(gpt2(layers=1, hidden=32, vocab=64), torch.from_numpy(ids), optimizer=ADAMW,
                                   target="spinn", parallel={"dp": 2})


def test_checkpoint_of_another_granule_or_model_is_refused(tiny, tmp_path):
    """A checkpoint whose gradient granule differs (a data_parallel= run: granule = its
    micro-batch) would continue with other bits: refused, naming both granules. One of another
    model: refused, naming the parameter. Nothing is changed by a refused load."""
    _, trainer, batches = tiny
    plan = trainer.with_plan()
    plan.step(*batches[0])
    before = plan.parameters()
    params = {n: v for n, v in before.items()}
    state = plan.optimizer_state()
    from tvm_spinn.training.checkpoint import write_checkpoint

    meta = {**plan._meta(), "granule": "2"}
    write_checkpoint(tmp_path / "g2.npz", params, state, meta)
    with pytest.raises(CheckpointError, match=r"granules of 2 sample\(s\), this trainer's granule is 1"):
        plan.load(tmp_path / "g2.npz")
    other = dict(params)
    name = sorted(other)[0]
    other[name] = np.zeros((3,) + other[name].shape, np.float32)
    write_checkpoint(tmp_path / "other.npz", other, state, plan._meta())
    with pytest.raises(CheckpointError, match=f"parameter {name} has shape"):
        plan.load(tmp_path / "other.npz")
    assert _same_bits(([], plan.parameters()), ([], before)) and plan.steps == 1


def test_simulated_step_of_plans(tiny):
    """The same bits at other costs: compute splits over the replicas (a granule's program per
    sample), ZeRO updates a shard and gathers the parameters; the parts add up."""
    _, trainer, _ = tiny
    parts = {name: trainer.with_plan(**options).simulated_step() for name, options in (
        ("dp1", {"replicas": 1, "microbatches": 4}), ("dp4", {"replicas": 4, "microbatches": 4}),
        ("zero1 dp4", {"replicas": 4, "microbatches": 4, "zero": 1}))}
    for p in parts.values():
        assert p["total_s"] == pytest.approx(p["compute_s"] + p["local_add_s"] + p["all_reduce_s"] + p["update_s"]
                                             + p["all_gather_s"] + p["host_s"])
    assert parts["dp1"]["compute_s"] == pytest.approx(4 * parts["dp4"]["compute_s"])
    assert parts["dp4"]["all_gather_s"] == 0 < parts["zero1 dp4"]["all_gather_s"]
    assert parts["zero1 dp4"]["update_s"] < parts["dp4"]["update_s"]
    assert parts["zero1 dp4"]["all_reduce"] == "chain"


@pytest.mark.parametrize("optimizer", [("sgd", {"lr": 0.1}), ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
                                       ("adam", {"lr": 1e-2, "weight_decay": 0.01}), ("adamw", {"lr": 1e-2})],
                         ids=["sgd", "momentum", "adam", "adamw"])
def test_zero_keeps_the_bits_of_every_optimizer(optimizer):
    """Every optimizer's state (no buffer; momentum; Adam's 0-d running products and moments;
    AdamW's moments) shards and gathers exactly: ZeRO-1 on 2 and 4 replicas and ZeRO-2 on 3
    (uneven shards) give the unsharded run's parameters and state, bit for bit. A small MLP."""
    rng = np.random.default_rng(1)
    batches = [(rng.standard_normal((4, 16)).astype(np.float32), rng.integers(0, 10, 4).astype(np.int64))
               for _ in range(3)]
    trainer = tvm_spinn.training.compile(mlp(seed=2), torch.zeros(4, 16), optimizer=optimizer, target="spinn/board",
                                         parallel={"microbatches": 4})
    runs = []
    for options in ({}, {"replicas": 2, "zero": 1}, {"replicas": 3, "zero": 2}, {"replicas": 4, "zero": 1}):
        plan = trainer.with_plan(**options)
        runs.append((_run(plan, batches), plan.optimizer_state()))
    for (run, state), options in zip(runs[1:], ({"dp": 2}, {"dp": 3}, {"dp": 4})):
        assert _same_bits(run, runs[0][0]), options
        assert all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(state, runs[0][1])), options
