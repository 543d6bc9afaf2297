"""What the mapper may keep resident: constant weights and the state a program's inputs carry
from call to call (a KV cache), never an operand the program computes on each call.

A matmul whose right operand a layer of the same program produces (an activation) has nothing
to load at program load: its bytes are written anew every call and move as its tiles read them.
The tile chooser does not cost them as resident either (``weights="resident"``).
"""

from __future__ import annotations

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.mapping import MappingOptions
from tvm_spinn.mapping.memory import held_between_calls
from tvm_spinn.mapping.schedule import _map
from tvm_spinn.mapping.tiling import program_work
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.runtime.simulator import run_program

M, K, N = 8, 768, 192


def _program(chip, computed: bool, const: bool = False):
    """``y = x @ f(w)``: ``f`` a ReLU in the program (``computed``) or the right operand an input
    (a constant of the program with ``const``)."""
    tensors = [TensorDesc("x", [1, M, K], "float32", "input"),
               TensorDesc("w", [1, K, N], "float32", "const" if const else "input")]
    layers = []
    rhs = 1
    if computed:
        tensors.append(TensorDesc("t", [1, K, N], "float32", "temp"))
        layers.append(Layer(name="relu", kind="relu", inputs=[1], output=2))
        rhs = 2
    tensors.append(TensorDesc("y", [1, M, N], "float32", "output"))
    layers.append(Layer(name="mm", kind="matmul", inputs=[0, rhs], output=len(tensors) - 1))
    constants = {1: np.random.default_rng(5).standard_normal((1, K, N)).astype(np.float32)} if const else {}
    return program_work(Program("main", chip, tensors, [0] if const else [0, 1], [len(tensors) - 1], layers,
                                constants=constants), chip)


def _mapped(program, chip, weights):
    return _map(program, chip, "sequential", MappingOptions(weights=weights),
                np.zeros(chip.pes_per_chip, dtype=np.int64))[0]


@pytest.mark.parametrize("weights", ["auto", "resident"])
def test_a_computed_right_operand_is_never_resident(weights):
    chip = tvm_spinn.make_system("one-chip-148")
    program = _program(chip, computed=True)
    assert not held_between_calls(program, 1) and held_between_calls(program, 0)
    got, stream = _mapped(program, chip, weights), _mapped(program, chip, "stream")
    assert got.mapping.resident_layers == ()
    # the operand's bytes are read every call: as many DRAM bytes as streaming it, at least the
    # operand once (K x N fp32) beyond the left operand and the output
    assert got.timing.dram_bytes == stream.timing.dram_bytes
    assert got.timing.dram_bytes >= 4 * (K * N + M * K + M * N)
    assert got.mapping.layers[1].tile == stream.mapping.layers[1].tile
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, M, K)).astype(np.float32)
    w = rng.standard_normal((1, K, N)).astype(np.float32)
    ref = np.zeros((1, M, N), np.float32)
    r = np.maximum(w, 0)
    for j in range(K):  # fl(acc + fl(a * b)), k ascending: the kernels' order
        ref = ref + x[:, :, j, None] * r[:, None, j, :]
    (out,) = run_program(got, [x, w], mode="tiles")
    np.testing.assert_array_equal(out, ref)


def test_an_input_right_operand_stays_state():
    """A right operand the program takes as an input (a KV cache) may stay in SRAM between
    calls: the memory plan keeps it and its bytes are not read from DRAM."""
    chip = tvm_spinn.make_system("one-chip-148")
    program = _program(chip, computed=False)
    assert held_between_calls(program, 0)
    got, stream = _mapped(program, chip, "auto"), _mapped(program, chip, "stream")
    assert got.mapping.resident_layers == (0,)
    assert got.timing.dram_bytes == 4 * (M * K + M * N) < stream.timing.dram_bytes


def test_a_constant_right_operand_stays_resident():
    """A matmul's constant right operand (an imported model's ``x @ W`` with a batched ``x``) is
    loaded once at program load: the memory plan keeps it and a call reads only ``x`` and ``y``."""
    chip = tvm_spinn.make_system("one-chip-148")
    program = _program(chip, computed=False, const=True)
    assert held_between_calls(program, 0)
    got, stream = _mapped(program, chip, "auto"), _mapped(program, chip, "stream")
    assert got.mapping.resident_layers == (0,)
    assert got.timing.dram_bytes == 4 * (M * K + M * N) < stream.timing.dram_bytes
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, M, K)).astype(np.float32)
    w = program.constants[1]
    ref = np.zeros((1, M, N), np.float32)
    for j in range(K):  # fl(acc + fl(a * b)), k ascending: the kernels' order
        ref = ref + x[:, :, j, None] * w[:, None, j, :]
    (out,) = run_program(got, [x], mode="tiles")
    np.testing.assert_array_equal(out, ref)
