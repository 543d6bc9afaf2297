"""Reproducibility of tvm_spinn.training: final parameters bitwise identical across runs, across
spinn systems (chip, board) and across save/load/resume (the rule: tvm_spinn.training's docstring)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import tvm_spinn
from training_models import mlp

SGD = ("sgd", {"lr": 0.05, "momentum": 0.9})
STEPS, SPLIT = 16, 7


def _batches(seed=2, n=STEPS):
    """A different batch every step, so that a resumed run must continue on the right batch."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 10, 8).astype(np.int64))
            for _ in range(n)]


def _assert_same_bits(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name].view(np.uint32), b[name].view(np.uint32), err_msg=name)


@pytest.fixture(scope="module")
def trainers():
    model = mlp(seed=7)
    example = torch.zeros(8, 16)
    chip = tvm_spinn.training.compile(model, example, optimizer=SGD, target="spinn")
    return {"spinn": chip, "spinn/board": chip.build_for("spinn/board")}


def test_bitwise_across_runs_systems_and_resume(trainers, tmp_path):
    batches = _batches()
    chip, board = trainers["spinn"], trainers["spinn/board"]
    start = tmp_path / "start.npz"
    chip.save(start)  # the initial state, to run again from it

    # run 1 on a chip, uninterrupted; a checkpoint half-way
    losses1 = []
    for k, (x, y) in enumerate(batches):
        if k == SPLIT:
            chip.save(tmp_path / "mid.npz")
        losses1.append(chip.step(x, y))
    final1 = chip.parameters()
    assert losses1[-1] < losses1[0]  # the parameters did move: equal bits are not trivially equal

    # run 2 on the same chip trainer from the same start: the same bits
    chip.load(start)
    assert chip.steps == 0
    losses2 = [chip.step(x, y) for x, y in batches]
    assert losses2 == losses1
    _assert_same_bits(chip.parameters(), final1)

    # run 3 on a board (another PE count, another tiling): the same bits
    board.load(start)
    losses3 = [board.step(x, y) for x, y in batches]
    assert losses3 == losses1
    _assert_same_bits(board.parameters(), final1)

    # run 4: resume on the board from the chip's half-way checkpoint: the same bits
    board.load(tmp_path / "mid.npz")
    assert board.steps == SPLIT
    losses4 = [board.step(x, y) for x, y in batches[SPLIT:]]
    assert losses4 == losses1[SPLIT:]
    _assert_same_bits(board.parameters(), final1)


def test_resume_needs_the_optimizer_state(trainers, tmp_path):
    """The momentum buffers are part of the state: resuming with them zeroed gives other bits
    (so the resume test above does test that the checkpoint carries them)."""
    chip = trainers["spinn"]
    batches = _batches(seed=4)
    chip.save(tmp_path / "s.npz")
    for x, y in batches[:SPLIT]:
        chip.step(x, y)
    chip.save(tmp_path / "mid.npz")
    for x, y in batches[SPLIT:]:
        chip.step(x, y)
    final = chip.parameters()
    params = dict(np.load(tmp_path / "mid.npz"))
    zeroed = {k: (np.zeros_like(v) if k.startswith("optim/") and v.ndim else v) for k, v in params.items()}
    np.savez(tmp_path / "zeroed.npz", **zeroed)
    chip.load(tmp_path / "zeroed.npz")
    for x, y in batches[SPLIT:]:
        chip.step(x, y)
    assert any(not np.array_equal(chip.parameters()[n], final[n]) for n in final)


_CHILD = r"""
import hashlib, json, os, sys
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]  # this module, the shared model builders
import numpy as np, torch, tvm_spinn
from test_training_repro import SGD, _batches
from training_models import mlp
trainer = tvm_spinn.training.compile(mlp(seed=7), torch.zeros(8, 16), optimizer=SGD, target=sys.argv[2])
for x, y in _batches():
    trainer.step(x, y)
print(json.dumps({n: hashlib.sha256(p.tobytes()).hexdigest() for n, p in sorted(trainer.parameters().items())}))
"""


@pytest.mark.slow
def test_bitwise_across_processes():
    """Fresh processes (compile included) on a chip and a board, with 1 and 2 host threads (TVM's
    pool for the host ops, the simulator's): the same parameter bytes."""
    tests = os.path.dirname(os.path.abspath(__file__))
    digests = []
    for target, threads in (("spinn", "1"), ("spinn", "2"), ("spinn/board", "2")):
        env = dict(os.environ, TVM_NUM_THREADS=threads, TVM_SPINN_SIM_THREADS=threads)
        out = subprocess.run([sys.executable, "-c", _CHILD, tests, target], capture_output=True, text=True,
                             check=True, timeout=600, env=env)
        digests.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert digests[0] == digests[1] == digests[2]
