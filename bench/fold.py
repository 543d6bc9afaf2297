"""Constant folding before partitioning: tvm-spinn's ``FoldConstant`` against TVM's, BERT-base.

Imports BERT-base (12 x 768, sequence 128, random weights, seed 0) with the PyTorch frontend,
applies the passes that run before folding in ``partition_for_spinn``, then times
:func:`tvm_spinn.partition.fold.FoldConstant` and ``relax.transform.FoldConstant`` on the same
module (best of ``--repeat`` interleaved runs each) and counts the kernels each builds (``tirx.build``
calls). The two results are checked structurally equal.

    python bench/fold.py [--quick] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import tvm
import tvm_ffi
from tvm.relax import transform

import tvm_spinn
from tvm_spinn.partition import fold
from tvm_spinn.partition import partition as part

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_zoo import _Field  # noqa: E402


def _module(quick: bool) -> tvm.IRModule:
    import transformers as tf

    torch.manual_seed(0)
    if quick:
        config, seq = tf.BertConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=1024), 64
    else:
        config, seq = tf.BertConfig(), 128
    model = _Field(tf.BertModel(config), "last_hidden_state").eval()
    mod = tvm_spinn.frontend.from_pytorch(model, (torch.randint(0, 1000, (1, seq)),))
    return part._ConvertConvLayout(part._DecomposeTrainingBatchNorm(mod))


def _builds(run) -> int:
    """Kernels ``run()`` builds: ``tirx.build`` calls, counted for this measurement only."""
    build = tvm_ffi.get_global_func("tirx.build")
    count = [0]

    def counting(*args):
        count[0] += 1
        return build(*args)

    tvm.register_global_func("tirx.build", counting, override=True)
    try:
        run()
    finally:
        tvm.register_global_func("tirx.build", build, override=True)
    return count[0]


def _best(run, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a 2-layer 256-wide BERT")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    mod = _module(args.quick)
    ours, theirs = (lambda: fold.FoldConstant(mod)), (lambda: transform.FoldConstant()(mod))
    tvm.ir.assert_structural_equal(ours(), theirs())
    best = [float("inf"), float("inf")]
    for _ in range(args.repeat):  # interleaved: a change of the machine's load hits both alike
        best = [min(best[0], _best(ours, 1)), min(best[1], _best(theirs, 1))]
    rows = [("tvm_spinn FoldConstant", best[0], _builds(ours)),
            ("relax FoldConstant", best[1], _builds(theirs))]
    print(f"BERT-base{' (quick)' if args.quick else ''}: constant folding before partitioning")
    print(f"{'pass':<24}{'seconds':>10}{'kernels built':>16}")
    for name, seconds, builds in rows:
        print(f"{name:<24}{seconds:>10.3f}{builds:>16}")
    print(f"speed-up over TVM's pass: {rows[1][1] / rows[0][1]:.2f}x")


if __name__ == "__main__":
    main()
