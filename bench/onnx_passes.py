"""ONNX pass manager on long chains: wall time of ``run_passes`` (``remove_identity`` alone for
the Identity chain) against chain length.  Not a test: prints a table.

    python bench/onnx_passes.py [max_nodes]

Measured on the 2-core dev machine (a test suite running beside it, so +-30%), seconds;
"before" is the quadratic implementation (commit e9b5b4a), "after" this script's output:

    chain                      before                          after
    Identity 250/500/1k/2k     0.39 / 1.1 / 4.8 / 44           0.006 / 0.012 / 0.024 / 0.048
    Identity 10k               (minutes)                       0.26
    Conv+BN 2k / 4k / 10k      30 / 77 / -                     0.39 / 0.66 / 1.75
    MatMul+Add 2k / 4k / 10k   0.89 / 7.3 / -                  0.19 / 0.50 / 1.29
    Q/DQ/Relu 2.5k / 5k        0.58 / 1.8                      (2k / 4k / 10k) 0.11 / 0.26 / 0.81

Then the last rows: small BERT and GPT-2 exported by ``torch.onnx.export`` (static, and with
dynamic batch/sequence), if torch and transformers are installed.  fold_constants now
evaluates with ``onnx.reference`` instead of a numpy interpreter of its own; old and new
interleaved in one process (best of 5, ms; the machine under load, so only the ratios count):

    model               run_passes old / new      fold_constants old / new
    constant Add 1k     68 / 95                   26 / 57
    constant Add 10k    1147 / 1285               213 / 554   (~40 us per folded node)
    BERT (134 nodes)    26 / 26                   8.1 / 9.2
    BERT dyn (250)      49 / 46                   11 / 10
    GPT-2 (182)         40 / 35                   9.4 / 12
    GPT-2 dyn (490)     112 / 104                 31 / 15

The first call in a process also builds the reference evaluators (~0.5 ms per distinct
op/attributes; ~0.1 s of imports once).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "tests"), os.path.join(os.path.dirname(__file__), "..", "tests", "frontend")]
import test_onnx_passes as T  # noqa: E402  (the tests' chain builders)
from tvm_spinn.frontend import onnx_passes as P  # noqa: E402


def _transformers_exports(tmp: str):
    """Small BERT and GPT-2 (random weights) exported by ``torch.onnx.export``, static and with
    dynamic batch/sequence; nothing if torch or transformers is missing."""
    try:
        import onnx
        import torch
        import transformers
    except ImportError:
        return

    class Hidden(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids).last_hidden_state

    torch.manual_seed(0)
    ids = torch.randint(0, 100, (1, 16))
    for name, model in [
            ("BERT", transformers.BertModel(transformers.BertConfig(
                vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=128, max_position_embeddings=32))),
            ("GPT-2", transformers.GPT2Model(transformers.GPT2Config(
                vocab_size=100, n_embd=64, n_layer=2, n_head=2, n_positions=32)))]:
        for dyn in (False, True):
            path = os.path.join(tmp, f"{name}{dyn}.onnx")
            axes = {"ids": {0: "b", 1: "s"}} if dyn else None
            torch.onnx.export(Hidden(model.eval()), (ids,), path, dynamo=False,
                              opset_version=17, input_names=["ids"], dynamic_axes=axes)
            yield name + (" dyn" if dyn else ""), onnx.load(path)


def main(max_nodes: int = 10_000) -> None:
    rows = [("Identity", T._chain_model, 1, lambda m: P.remove_identity(m)),
            ("Dropout/Identity", lambda n: T._chain_model(n, ("Dropout", "Identity")), 1, None),
            ("constant Add", T._const_chain_model, 1, None),
            ("Q/DQ/Relu/Q/DQ", T._qdq_chain_model, 5, None),
            ("Conv+BN", T._conv_bn_chain_model, 2, None),
            ("MatMul+Add", T._matmul_add_chain_model, 2, None)]
    print(f"{'chain':18s} {'nodes':>7s} {'seconds':>8s}")
    for name, build, per_block, fn in rows:
        for nodes in sorted({n for n in (250, 500, 1_000, 2_000, 4_000) if n < max_nodes}
                            | {max_nodes}):
            m = build(max(nodes // per_block, 1))
            t = time.perf_counter()
            (fn or (lambda m: P.run_passes(m, check=False)))(m)
            print(f"{name:18s} {len(m.graph.node):7d} {time.perf_counter() - t:8.3f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, m in _transformers_exports(tmp):
            P._evaluator.cache_clear()  # first run: reference evaluators built
            times = []
            for _ in range(3):
                t = time.perf_counter()
                P.run_passes(m, check=False)
                times.append(time.perf_counter() - t)
            print(f"{name:18s} {len(m.graph.node):7d} {times[0]:8.3f}  (warm {min(times):.3f})",
                  flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000)
