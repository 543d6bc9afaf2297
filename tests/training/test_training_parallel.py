"""Data-parallel training (tvm_spinn.training.parallel): final parameters bitwise identical for
1, 2, 3 and 4 replicas (micro-batch gradients summed in ascending order by a chain), resumable across replica
counts; the ring mode's bits depend on the replica count; bad options -> one clear error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.training import TrainingError
from tvm_spinn.training.parallel import add_module
from training_models import mlp, torch_reference

SGD = ("sgd", {"lr": 0.05, "momentum": 0.9})
STEPS, SPLIT, MICRO = 12, 5, 4


def _batches(seed=2, n=STEPS):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 10, 8).astype(np.int64))
            for _ in range(n)]


def _same_bits(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[n].view(np.uint32), b[n].view(np.uint32)) for n in a)


@pytest.fixture(scope="module")
def dp():
    """Micro-batches of 2 samples, on a board (one replica per chip); not stepped by the tests
    (each takes its own copy with with_replicas)."""
    return tvm_spinn.training.compile(mlp(seed=7), torch.zeros(8, 16), optimizer=SGD, target="spinn/board",
                                      data_parallel={"replicas": 1, "microbatches": MICRO})


def _train(trainer, batches):
    return [trainer.step(x, y) for x, y in batches], trainer.parameters()


def test_bits_do_not_depend_on_the_replica_count(dp):
    batches = _batches()
    runs = {r: _train(dp.with_replicas(r), batches) for r in (1, 2, 4)}
    initial = dict(zip(dp._graph.param_names, dp._graph.init_params))
    assert not _same_bits(runs[1][1], initial)  # the parameters moved: equal bits are not trivial
    for r in (2, 4):
        assert runs[r][0] == runs[1][0], r
        assert _same_bits(runs[r][1], runs[1][1]), r
    # and it is the batch's training step: PyTorch on the whole batch (one summation order
    # among others; rounding-level differences, bounded as in test_training.py)
    ref_losses, ref_params = torch_reference(mlp(seed=7), batches, "cross_entropy", SGD)
    np.testing.assert_allclose(runs[1][0], ref_losses, rtol=1e-3, atol=1e-5)
    for name, ref in ref_params.items():
        np.testing.assert_allclose(runs[1][1][name], ref, rtol=1e-3, atol=1e-4, err_msg=name)


def test_ring_mode_bits_depend_on_the_replica_count(dp):
    """The non-reproducible mode (sequential per replica, then a ring): 1 and 4 replicas add in
    other orders, so (on these batches) other bits, within rounding of the reproducible run."""
    batches = _batches()
    fixed = _train(dp.with_replicas(4), batches)
    ring = {r: _train(dp.with_replicas(r, reproducible=False), batches) for r in (1, 4)}
    assert not _same_bits(ring[1][1], ring[4][1])
    for r in (1, 4):
        for name, value in fixed[1].items():
            np.testing.assert_allclose(ring[r][1][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_resume_with_another_replica_count(dp, tmp_path):
    batches = _batches(seed=5)
    whole = _train(dp.with_replicas(1), batches)
    two = dp.with_replicas(2)
    for x, y in batches[:SPLIT]:
        two.step(x, y)
    two.save(tmp_path / "mid.npz")
    four = dp.with_replicas(4)
    four.load(tmp_path / "mid.npz")
    assert four.steps == SPLIT
    losses = [four.step(x, y) for x, y in batches[SPLIT:]]
    assert losses == whole[0][SPLIT:]
    assert _same_bits(four.parameters(), whole[1])


def test_one_microbatch_is_the_fused_step():
    """M = 1: the reduction is empty and the division by 1 exact, so the data-parallel programs
    give the fused step's bits (the split into gradient and update programs changes nothing)."""
    model = mlp(seed=3)
    batches = [(x[:2], y[:2]) for x, y in _batches(seed=6, n=6)]
    fused = tvm_spinn.training.compile(model, torch.zeros(2, 16), optimizer=SGD, target="spinn")
    one = tvm_spinn.training.compile(model, torch.zeros(2, 16), optimizer=SGD, target="spinn",
                                     data_parallel={"replicas": 1, "microbatches": 1})
    a, b = _train(fused, batches), _train(one, batches)
    assert a[0] == b[0] and _same_bits(a[1], b[1])


def test_replica_blocks_are_consecutive_and_cover_the_batch():
    from tvm_spinn.training.parallel import replica_blocks

    assert replica_blocks(8, 4) == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert replica_blocks(7, 3) == ((0, 3), (3, 5), (5, 7))
    assert replica_blocks(4, 1) == ((0, 4),)


def test_three_replicas_uneven_blocks_same_bits(dp):
    """Any split into consecutive blocks keeps the chain's order: 3 replicas (blocks 2, 1, 1)."""
    batches = _batches(seed=8, n=4)
    a, b = _train(dp.with_replicas(1), batches), _train(dp.with_replicas(3), batches)
    assert a[0] == b[0] and _same_bits(a[1], b[1])


def test_pe_add_is_numpy_float32_add():
    """The reduction's additions are done in numpy: the same bits as the simulated PE's fp32 add
    (round to nearest even, subnormals kept, signed zeros)."""
    rng = np.random.default_rng(0)
    n = 4096
    a = rng.standard_normal(n).astype(np.float32) * np.float32(2.0) ** rng.integers(-140, 30, n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) * np.float32(2.0) ** rng.integers(-140, 30, n).astype(np.float32)
    a[:4], b[:4] = [0.0, -0.0, 1e-45, -1e-45], [-0.0, -0.0, -1e-45, 1e-45]
    assert (np.abs(a) < np.finfo(np.float32).tiny).sum() > 100  # subnormals are exercised
    ex = relax.build(add_module(n), target=tvm_spinn.get_target("spinn"))
    summary = tvm_spinn.summarize_partition(tvm_spinn.partition_for_spinn(add_module(n)))
    assert summary.offloaded_ops == {"spinn.add": 1}
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), (a + b).view(np.uint32))


def test_simulated_step_parts(dp):
    """Compute shrinks with the replicas, the all-reduce appears with them; the parts add up."""
    parts = {r: dp.with_replicas(r).simulated_step() for r in (1, 4)}
    for p in parts.values():
        assert p["host_s"] > 0  # the loss stays on the host
        assert p["total_s"] == pytest.approx(p["compute_s"] + p["local_add_s"] + p["all_reduce_s"] + p["update_s"]
                                             + p["host_s"])
    assert parts[1]["compute_s"] == pytest.approx(4 * parts[4]["compute_s"])
    assert parts[1]["all_reduce"] == "none" and parts[4]["all_reduce_s"] > 0
    assert parts[4]["all_reduce"] == "chain"
    assert dp.with_replicas(4, reproducible=False).simulated_step()["all_reduce"] in ("ring", "tree", "multicast")
    # the one-chip replica system is registered only while its programs are built
    assert not [t for t in tvm_spinn.known_targets() if t.endswith("-replica")]


@pytest.mark.parametrize("target, options, message", [
    ("spinn", {"replicas": 2}, r"replicas=2 needs 2 chips, target .* has 1"),
    ("spinn/board", {"replicas": 4, "microbatches": 2}, "replicas=4 > microbatches=2"),
    ("spinn/board", {"replicas": 2, "microbatches": 3}, "batch 8 does not split into microbatches=3"),
    ("spinn/board", {"replica": 2}, "unknown option 'replica'"),
    ("spinn/board", {"replicas": 0}, "replicas must be a positive integer"),
    ("spinn/board", [2], "data_parallel must be a dict"),
])
def test_bad_data_parallel_options(target, options, message):
    with pytest.raises(TrainingError, match=message):
        tvm_spinn.training.compile(mlp(), torch.zeros(8, 16), optimizer=SGD, target=target, data_parallel=options)


def test_data_parallel_needs_a_pytorch_model():
    x = np.zeros((8, 16), np.float32)
    mod = tvm_spinn.frontend.from_pytorch(mlp(), (torch.from_numpy(x),))
    with pytest.raises(TrainingError, match="data_parallel needs a PyTorch model"):
        tvm_spinn.training.compile(mod, x, data_parallel={"replicas": 1})
