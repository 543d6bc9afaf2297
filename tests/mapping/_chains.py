"""Small programs the pipeline tests cut into stages: a chain of dense layers and a residual block.

Shared by ``test_pipeline_axis.py``, ``test_pipeline_timing.py``, ``test_pipeline_mapping.py`` and
``test_pipeline_regions.py``
(``tests/conftest.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import numpy as np

from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.target.arch import SpinnArch

F32 = 4  # bytes per float32


def chain(n: int = 4, k: int = 1024, seed: int = 7, symbol: str = "main") -> Program:
    """``n`` dense layers of ``k x k`` float32 weights (seeded, scaled by ``1 / sqrt(k)``) on
    one row ``x[1, k]``; layers 0, 2, ... apply a relu. Its output is the last layer's."""
    rng = np.random.default_rng(seed)
    tensors = [TensorDesc("x", [1, k], "float32", "input")] + \
        [TensorDesc(f"w{i}", [k, k], "float32", "const") for i in range(n)]
    layers, prev = [], 0
    for i in range(n):
        tensors.append(TensorDesc(f"y{i}", [1, k], "float32", "output" if i == n - 1 else "temp"))
        layers.append(Layer(name=f"fc{i}", kind="dense", inputs=[prev], output=len(tensors) - 1,
                            consts={"weight": 1 + i}, attrs={"relu": i % 2 == 0}))
        prev = len(tensors) - 1
    consts = {1 + i: (rng.standard_normal((k, k)) / np.sqrt(k)).astype(np.float32) for i in range(n)}
    return Program(symbol, SpinnArch(), tensors, [0], [prev], layers, constants=consts)


def chain_reference(program: Program, x: np.ndarray) -> np.ndarray:
    """The output of :func:`chain`'s program on ``x`` in float64 (dense weights are
    ``[in, out]``; relu after layers 0, 2, ...)."""
    out = x.astype(np.float64)
    for i, layer in enumerate(program.layers):
        out = out @ program.constants[layer.consts["weight"]].astype(np.float64)
        out = np.maximum(out, 0) if i % 2 == 0 else out
    return out


def residual(batch: int = 4, seed: int = 0) -> Program:
    """fc0 x[b,8] -> z[b,8]; fc1 z -> h[b,16]; relu h -> a; fc2 a -> y[b,8]; add y + z -> o;
    softmax o -> p (the output). ``z`` is read six layers later: it crosses every cut after fc0."""
    rng = np.random.default_rng(seed)
    tensors = [TensorDesc("x", [batch, 8], "float32", "input"),
               TensorDesc("w0", [8, 8], "float32", "const"), TensorDesc("w1", [8, 16], "float32", "const"),
               TensorDesc("w2", [16, 8], "float32", "const"),
               TensorDesc("z", [batch, 8], "float32", "temp"), TensorDesc("h", [batch, 16], "float32", "temp"),
               TensorDesc("a", [batch, 16], "float32", "temp"), TensorDesc("y", [batch, 8], "float32", "temp"),
               TensorDesc("o", [batch, 8], "float32", "temp"), TensorDesc("p", [batch, 8], "float32", "output")]
    layers = [Layer(name="fc0", kind="dense", inputs=[0], output=4, consts={"weight": 1}, attrs={"relu": False}),
              Layer(name="fc1", kind="dense", inputs=[4], output=5, consts={"weight": 2}, attrs={"relu": False}),
              Layer(name="act", kind="relu", inputs=[5], output=6),
              Layer(name="fc2", kind="dense", inputs=[6], output=7, consts={"weight": 3}, attrs={"relu": False}),
              Layer(name="res", kind="add", inputs=[7, 4], output=8),
              Layer(name="sm", kind="softmax", inputs=[8], output=9)]
    constants = {tid: rng.standard_normal(tensors[tid].shape).astype(np.float32) for tid in (1, 2, 3)}
    return Program("main", SpinnArch(), tensors, [0], [9], layers, constants=constants)


def build_and_run(mod, x: np.ndarray, target):
    """``mod`` built for ``target`` and its ``main`` run on ``x`` on the host's VM: the
    executable and the output (the pipelined builds' tests compare targets this way)."""
    import tvm
    from tvm import relax

    ex = relax.build(mod, target=target)
    return ex, relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
