"""The int8 GEMM with an ``int32`` output: the MAC array's raw 32-bit sums, no epilogue, no zero
points (the chip paper's measured matmul, ``bench/fidelity.py``), exact against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_spinn.mapping import MappingOptions, map_program
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.program import ProgramError
from tvm_spinn.program.ops.gemm import int8_side
from tvm_spinn.runtime.simulator import run_program
from tvm_spinn.target.arch import CHIPS


def int32_program(kind: str, m: int, k: int, n: int, w=None, attrs=None) -> Program:
    """One int8 ``dense`` (constant weight ``w``) or ``matmul`` (two inputs) with int32 sums."""
    arch = CHIPS["production"]
    tensors = [TensorDesc("x", [m, k], "int8", "input")]
    if kind == "dense":
        tensors.append(TensorDesc("w", [k, n], "int8", "const"))
        layer_consts, inputs = {"weight": 1}, [0]
    else:
        tensors.append(TensorDesc("b", [k, n], "int8", "input"))
        layer_consts, inputs = {}, [0, 1]
    tensors.append(TensorDesc("y", [m, n], "int32", "output"))
    a = dict(x_zero=0, x_flip=False, relu=False, out="int32")
    if kind == "matmul":
        a.update(b_zero=0, b_flip=False)
    a.update(attrs or {})
    layer = Layer(name=f"{kind}0", kind=kind, inputs=inputs, output=len(tensors) - 1, consts=layer_consts,
                  attrs=a, mode="int8")
    constants = {1: w} if kind == "dense" else {}
    return Program("main", arch, tensors, inputs, [len(tensors) - 1], [layer], constants=constants)


@pytest.mark.parametrize("kind,m,k,n", [("dense", 7, 40, 12), ("dense", 5, 1200, 9), ("matmul", 6, 600, 10)])
def test_int32_sums_equal_numpy(kind, m, k, n):
    """Extreme operands (every product -128 * -128) included; k = 600 and 1200 run in
    accumulator-safe chunks whose sums the M4F adds in 32-bit."""
    rng = np.random.default_rng(11)
    x = rng.integers(-128, 128, size=(m, k)).astype(np.int8)
    w = rng.integers(-128, 128, size=(k, n)).astype(np.int8)
    x[0], w[:, 0] = -128, -128
    program = int32_program(kind, m, k, n, w)
    feeds = [x] if kind == "dense" else [x, w]
    mapped = map_program(program, program.arch, MappingOptions())
    (got,) = run_program(mapped, feeds)
    want = x.astype(np.int64) @ w.astype(np.int64)
    assert got.dtype == np.int32 and np.array_equal(got, want.astype(np.int32))
    assert got[0, 0] == 128 * 128 * k
    side = int8_side(mapped, mapped.layers[0])
    assert side.int32_out and not (side.row_sums or side.col_sums or side.fp32_out)


@pytest.mark.parametrize("attrs,match", [
    (dict(x_zero=3), "x_zero"),
    (dict(relu=True), "relu"),
    (dict(y_zero=0, y_min=-128, y_max=127), "requantizing"),
])
def test_int32_output_carries_no_epilogue(attrs, match):
    """A program's bytes are checked when loaded: an int32 output with a zero point, a ReLU or
    requantization fields is refused, naming the field."""
    good = int32_program("dense", 4, 16, 8, np.ones((16, 8), np.int8))
    good = map_program(good, good.arch, MappingOptions())
    assert Program.from_bytes(good.to_bytes()).layers[0].attrs["out"] == "int32"
    bad = int32_program("dense", 4, 16, 8, np.ones((16, 8), np.int8), attrs)
    bad = map_program(bad, bad.arch, MappingOptions())
    with pytest.raises(ProgramError, match=match):
        Program.from_bytes(bad.to_bytes())
