"""Simulator time of one training step of a small CNN (Conv, BatchNorm in training mode, ReLU,
max pool, Conv, ReLU, Linear) with its ``pad``, ``where_less`` and ``max_pool2d_backward``
layers run by their C++ kernels ("native", the default) against the same layers run as Python
steps ("python": those three families' native descriptions switched off, the rest native), side
by side in one process; the two runs' losses and parameters must be bitwise equal.

Times ``trainer.step`` (wall clock, this machine, noisy when shared): the median over
``--steps`` steps per mode, the modes alternated in ``--rounds`` rounds after a warm-up. Also
counts, per mode, the layers of the step's programs run in native runs and those left to
Python steps.

    python bench/training_kernels.py
    python bench/training_kernels.py --batch 16 --side 16 --steps 10 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import numpy as np
import torch

import tvm_spinn
from tvm_spinn.program.ops.elementwise import Select
from tvm_spinn.program.ops.movement import Movement
from tvm_spinn.program.ops.pool import PoolGrad
from tvm_spinn.runtime import executor, simulator

KINDS = ("pad", "where_less", "max_pool2d_backward")


def small_cnn(side: int) -> torch.nn.Module:
    torch.manual_seed(0)
    flat = 8 * ((side // 2) - 2) ** 2
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(flat, 10))


def _forget_plans() -> None:
    simulator.forget_plans()


@contextlib.contextmanager
def python_steps():
    """The three kinds' layers as Python steps (their families describe nothing natively)."""
    saved = Movement.native, Select.native, PoolGrad.native
    move = Movement.native

    def movement_native(self, program, layer, nb, clip=None):
        return False if layer.kind == "pad" else move(self, program, layer, nb, clip)

    Movement.native = movement_native
    Select.native = PoolGrad.native = lambda self, program, layer, nb, clip=None: False
    _forget_plans()
    try:
        yield
    finally:
        Movement.native, Select.native, PoolGrad.native = saved
        _forget_plans()


def layer_counts() -> tuple[int, int, int]:
    """(layers in native runs, layers left to Python steps, of them pad/where_less/pool grads)."""
    native = python = kinds = 0
    for program in executor._CACHE.values():
        plan = simulator.program_plan(program)
        native += plan.native_layers
        by_output = {layer.output: layer for layer in program.layers}
        for tid, _, _ in plan.steps:
            if tid is not None and tid in by_output:
                python += 1
                kinds += by_output[tid].kind in KINDS
    return native, python, kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--side", type=int, default=16, help="image side (pixels)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per mode and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    model = small_cnn(args.side)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, 3, args.side, args.side)).astype(np.float32)
    y = rng.integers(0, 10, args.batch).astype(np.int64)
    t0 = time.perf_counter()
    native = tvm_spinn.training.compile(model, torch.from_numpy(x), optimizer=("sgd", {"lr": 0.05, "momentum": 0.9}))
    python = native.build_for("spinn")  # the same step and initial state
    print(f"compiled in {time.perf_counter() - t0:.1f} s; batch {args.batch}, {args.side}x{args.side} images")

    trainers = {"native": (native, contextlib.nullcontext), "python": (python, python_steps)}
    times = {mode: [] for mode in trainers}
    losses = {mode: [] for mode in trainers}
    counts = {}
    for round_ in range(args.rounds + 1):  # round 0: warm-up (plans built, caches filled)
        for mode, (trainer, ctx) in trainers.items():
            with ctx():
                for _ in range(args.steps if round_ else 1):
                    t = time.perf_counter()
                    losses[mode].append(trainer.step(x, y))
                    if round_:
                        times[mode].append(time.perf_counter() - t)
                counts[mode] = layer_counts()

    same = losses["native"] == losses["python"] and all(
        np.array_equal(a.view(np.uint32), native.parameters()[k].view(np.uint32))
        for k, a in python.parameters().items())
    print(f"{'mode':<8}{'step ms (median)':>18}{'min ms':>10}{'native layers':>15}{'python layers':>15}"
          f"{'of them pad/where/pool-grad':>30}")
    for mode in ("python", "native"):
        n, p, k = counts[mode]
        print(f"{mode:<8}{1e3 * statistics.median(times[mode]):>18.2f}{1e3 * min(times[mode]):>10.2f}"
              f"{n:>15}{p:>15}{k:>30}")
    ratio = statistics.median(times["python"]) / statistics.median(times["native"])
    print(f"speedup python -> native: {ratio:.2f}x; losses and parameters bitwise equal: {same}")
    if not same:
        raise SystemExit("native and python steps differ")


if __name__ == "__main__":
    main()
