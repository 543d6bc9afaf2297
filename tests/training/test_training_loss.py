"""The loss on the PEs: cross-entropy (``cross_entropy`` per-row losses, the rows ``mean``, and
``cross_entropy_backward``) and MSE (element-wise layers and the rows ``mean``).

The C++ kernels against PyTorch (loss and gradient, float64 references), the log model against
numpy, the training step's placement (no loss op on the host but the 0-d reshape and the
labels' int32 cast), chip vs board bit for bit, and bad labels refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import tvm_spinn
from tvm_spinn import _lib
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.program.ops.loss import cross_entropy_grad, cross_entropy_rows
from tvm_spinn.runtime.simulator import run_program
from tvm_spinn.target.arch import make_system
from training_models import classification_data, mlp, torch_reference

_F32 = np.float32
SGD = ("sgd", {"lr": 0.1, "momentum": 0.9})


def _logits(rng, rows, classes, scale=3.0):
    return (scale * rng.standard_normal((rows, classes))).astype(_F32)


# -- kernels ------------------------------------------------------------------------------------

def test_log_model_is_within_one_ulp_of_numpy_and_keeps_the_special_values():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(1e-3, 1e4, 20000), 10.0 ** rng.uniform(-44, 38, 20000)]).astype(_F32)
    out = np.empty_like(x)
    _lib._func("tvm_spinn.sim.log_f32")(x, out)
    ref = np.log(x.astype(np.float64))
    ulps = np.abs(out.astype(np.float64) - ref) / np.spacing(np.abs(ref.astype(_F32)))
    assert ulps.max() <= 1.0, ulps.max()
    special = np.array([1.0, 0.0, -0.0, -1.0, np.inf, -np.inf, np.nan], _F32)
    got = np.empty_like(special)
    _lib._func("tvm_spinn.sim.log_f32")(special, got)
    assert got[0] == 0.0 and got[1] == -np.inf and got[2] == -np.inf and got[4] == np.inf
    assert np.isnan(got[3]) and np.isnan(got[5]) and np.isnan(got[6])


@pytest.mark.parametrize("rows,classes,scale", [(8, 10, 3.0), (5, 1, 1.0), (3, 1000, 10.0), (16, 7, 40.0)])
def test_cross_entropy_kernels_match_pytorch(rows, classes, scale):
    """Per-row loss, its mean and the gradient of the mean vs PyTorch in float64: within a few
    float32 ulps of the row's terms (one exp/log rounding each, the row's sum of ``classes``
    terms)."""
    rng = np.random.default_rng(rows * classes)
    z = _logits(rng, rows, classes, scale)
    t = rng.integers(0, classes, rows).astype(np.int32)
    zt = torch.tensor(z.astype(np.float64), requires_grad=True)
    per_row = torch.nn.functional.cross_entropy(zt, torch.from_numpy(t).long(), reduction="none")
    mean = per_row.mean()
    mean.backward()
    got = cross_entropy_rows(z, t)
    bound = 8 * np.finfo(_F32).eps * (1 + np.abs(z).max())
    np.testing.assert_allclose(got, per_row.detach().numpy(), rtol=0, atol=bound)
    grad = cross_entropy_grad(z, t, float(rows))
    np.testing.assert_allclose(grad, zt.grad.numpy(), rtol=0, atol=8 * np.finfo(_F32).eps / rows)
    # float32 PyTorch: the same loss and gradient within float32 error
    z32 = torch.tensor(z, requires_grad=True)
    loss32 = torch.nn.functional.cross_entropy(z32, torch.from_numpy(t).long())
    loss32.backward()
    assert abs(float(np.sum(got.astype(np.float64)) / rows) - loss32.item()) <= bound
    np.testing.assert_allclose(grad, z32.grad.numpy(), rtol=0, atol=8 * np.finfo(_F32).eps / rows)


def test_cross_entropy_rows_ignore_index_and_nan():
    z = np.array([[1.0, 2.0, 3.0], [np.nan, 0.0, 1.0], [0.5, 0.5, 0.5]], _F32)
    t = np.array([2, 1, -100], np.int32)
    got = cross_entropy_rows(z, t, ignore_index=-100)
    assert np.isnan(got[1]) and got[2] == 0.0 and not np.signbit(got[2])
    ref = -torch.log_softmax(torch.tensor(z[0], dtype=torch.float64), 0)[2].item()
    assert abs(got[0] - ref) < 1e-6


@pytest.mark.parametrize("fn,args,message", [
    (cross_entropy_rows, (np.zeros((2, 3), _F32), np.array([0, 3], np.int32)), "label 3 of row 1 is out of range for 3"),
    (cross_entropy_rows, (np.zeros((2, 3), _F32), np.array([-1, 0], np.int32)), "label -1 of row 0"),
    (cross_entropy_grad, (np.zeros((2, 3), _F32), np.array([0, -100], np.int32), 2.0), "label -100 of row 1"),
    (cross_entropy_rows, (np.zeros((2, 3), _F32), np.array([0], np.int32)), "labels.shape"),
])
def test_bad_labels_are_one_value_error(fn, args, message):
    with pytest.raises(ValueError, match=message):
        fn(*args)


def _one_layer(kind, z_shape, out_shape, attrs, arch=None) -> Program:
    tensors = [TensorDesc("z", list(z_shape), "float32", "input"), TensorDesc("t", [z_shape[0]], "int32", "input"),
               TensorDesc("out", list(out_shape), "float32", "output")]
    return Program(symbol="loss", arch=arch or make_system(), tensors=tensors, inputs=[0, 1], outputs=[2],
                   layers=[Layer("layer0", kind, [0, 1], 2, attrs=dict(attrs))])


@pytest.mark.parametrize("kind,out,attrs", [("cross_entropy", lambda r, c: (r,), {"ignore_index": -100}),
                                            ("cross_entropy_backward", lambda r, c: (r, c), {"divisor": 12.0})])
def test_layer_tiles_give_the_kernels_bits(kind, out, attrs):
    """The layer mapped on a chip and on a board, run tile by tile ("tiles": every tile of the
    mapping's tiling) and whole, gives the kernel's bits."""
    from tvm_spinn.mapping import map_program
    from tvm_spinn.target.registry import arch_of

    rng = np.random.default_rng(3)
    z = _logits(rng, 12, 33)
    t = rng.integers(0, 33, 12).astype(np.int32)
    want = cross_entropy_rows(z, t) if kind == "cross_entropy" else cross_entropy_grad(z, t, 12.0)
    for system in ("spinn", "spinn/board"):
        arch = arch_of(system)
        program = map_program(_one_layer(kind, z.shape, out(12, 33), attrs, arch), arch)
        assert program.mapping.layers[0].pes[1] > 1  # the rows spread over PEs
        for mode in ("layers", "tiles"):
            (got,) = run_program(program, [z, t], mode=mode)
            assert np.asarray(got).tobytes() == want.tobytes(), (system, mode)


@pytest.mark.parametrize("kind,out,attrs", [("cross_entropy", lambda r, c: (r,), {"ignore_index": -100}),
                                            ("cross_entropy_backward", lambda r, c: (r, c), {"divisor": 6.0})])
def test_a_vocabulary_row_streams_through_one_pe(kind, out, attrs):
    """A row too long for a PE's working SRAM (GPT-2's 50,257 logits) is one streamed row per
    tile: its SRAM is one chunk, its logits read in 2 (forward) or 3 (backward) passes; the
    mapped layer gives the kernel's bits."""
    from tvm_spinn.mapping import map_program
    from tvm_spinn.program.ops import family_of
    from tvm_spinn.program.ops.base import working_budget
    from tvm_spinn.program.ops.loss import STREAM_CHUNK
    from tvm_spinn.program.tiles import layer_tiles

    rows, classes = 6, 50257
    arch = make_system()
    program = map_program(_one_layer(kind, (rows, classes), out(rows, classes), attrs, arch), arch)
    layer = program.layers[0]
    family = family_of(kind)
    assert 8 * classes > working_budget(arch) >= family.smallest_tile_bytes(program, layer, arch)
    tiles = list(layer_tiles(program, 0))
    assert len(tiles) == rows  # one row per tile
    lo = np.array([t.region[0][0] for t in tiles])[:, None]
    hi = np.array([t.region[0][1] for t in tiles])[:, None]
    sram, in_bytes, _, _, _ = family.tile_costs(program, layer, arch, layer_tiles_shape(program), lo, hi)
    assert np.all(np.asarray(sram) <= working_budget(arch))
    passes = 2 if kind == "cross_entropy" else 3
    assert np.all(np.asarray(in_bytes) == passes * 4 * classes + 4)
    rng = np.random.default_rng(6)
    z = _logits(rng, rows, classes)
    t = rng.integers(0, classes, rows).astype(np.int32)
    want = cross_entropy_rows(z, t) if kind == "cross_entropy" else cross_entropy_grad(z, t, 6.0)
    (got,) = run_program(program, [z, t], mode="tiles")
    assert np.asarray(got).tobytes() == want.tobytes()
    assert STREAM_CHUNK < classes


def layer_tiles_shape(program):
    return list(program.mapping.layers[0].tile)


@pytest.mark.parametrize("kind,out,attrs", [("cross_entropy", lambda r, c: (r,), {"ignore_index": 2}),
                                            ("cross_entropy_backward", lambda r, c: (r, c), {"divisor": 3.0})])
def test_native_plan_gives_the_python_steps_bits(kind, out, attrs, monkeypatch):
    """The layer as one instruction of the simulator's native plan (src/sim_plan.cc) and as the
    Python step (``TVM_SPINN_SIM_NATIVE=0``): the same bits; a bad label is a ValueError there too."""
    from tvm_spinn.runtime import simulator

    rng = np.random.default_rng(4)
    z = _logits(rng, 9, 17)
    z[3, 5] = np.nan
    t = rng.integers(0, 17, 9).astype(np.int32)
    t[1] = 2
    program = _one_layer(kind, z.shape, out(9, 17), attrs)
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("TVM_SPINN_SIM_NATIVE", flag)
        simulator.forget_plans()
        plan = simulator.program_plan(program)
        assert plan.native_layers == (1 if flag == "1" else 0)
        outs.append(plan.run(program, [z, t])[0])
        bad = t.copy()
        bad[4] = 17
        with pytest.raises(ValueError, match="label 17 of row 4 is out of range for 17 classes"):
            plan.run(program, [z, bad])
    assert outs[0].tobytes() == outs[1].tobytes()


@pytest.mark.parametrize("kind,out,attrs,message", [
    ("cross_entropy", (4, 5), {"ignore_index": -100}, r"layers\[0\]\.output.*shape \[4, 5\], expected \[4\]"),
    ("cross_entropy_backward", (4, 5), {"divisor": 0.0}, r"layers\[0\]\.attrs\.divisor"),
    ("cross_entropy", (4,), {"ignore_index": 1.5}, r"layers\[0\]\.attrs\.ignore_index"),
])
def test_a_bad_loss_layer_is_named_by_the_validator(kind, out, attrs, message):
    from tvm_spinn.mapping import map_program
    from tvm_spinn.program import ProgramError

    good = {"cross_entropy": (4,), "cross_entropy_backward": (4, 5)}[kind]
    program = map_program(_one_layer(kind, (4, 5), good, {"ignore_index": -100} if kind == "cross_entropy"
                                     else {"divisor": 4.0}), make_system())
    tensors = (*program.tensors[:2], dataclasses.replace(program.tensors[2], shape=list(out)), *program.tensors[3:])
    program = dataclasses.replace(program, tensors=tensors,
                                  layers=(dataclasses.replace(program.layers[0], attrs=dict(attrs)), *program.layers[1:]))
    with pytest.raises(ProgramError, match=message):
        Program.from_bytes(program.to_bytes())


# -- the training step ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ce_runs():
    """An MLP trained 5 SGD-momentum steps with cross-entropy on a chip and a board."""
    model = mlp()
    x, y = classification_data()
    chip = tvm_spinn.training.compile(model, torch.from_numpy(x), optimizer=SGD, target="spinn")
    board = chip.build_for("spinn/board")
    batches = [(x, y)] * 5
    return model, batches, chip, board, [chip.step(a, b) for a, b in batches], [board.step(a, b) for a, b in batches]


def test_cross_entropy_runs_on_the_pes(ce_runs):
    """Forward: the per-row losses and their mean on the PEs (the host reshapes the (1,) mean to
    the 0-d loss and casts the labels to int32); backward: one cross_entropy_backward layer."""
    chip = ce_runs[2]
    place = tvm_spinn.training.op_placement(chip)
    assert place["forward"]["pe"]["spinn.cross_entropy"] == 1 and place["forward"]["pe"]["spinn.mean"] == 1
    assert place["forward"]["host"] == {"relax.astype": 1, "relax.reshape": 1}
    assert place["backward"]["pe"]["spinn.cross_entropy_backward"] == 1
    assert place["backward"]["host"] == {}


def test_cross_entropy_step_matches_pytorch_and_board_bits(ce_runs):
    model, batches, chip, board, losses, board_losses = ce_runs
    ref_losses, ref_params = torch_reference(model, batches, "cross_entropy", SGD)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for name, value in ref_params.items():
        np.testing.assert_allclose(chip.parameters()[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    assert board_losses == losses
    for name, value in chip.parameters().items():
        assert board.parameters()[name].tobytes() == value.tobytes(), name


def test_mse_forward_mean_runs_on_the_pes_and_matches_pytorch():
    model = mlp(seed=3, d_out=4)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 16)).astype(_F32)
    y = rng.standard_normal((8, 4)).astype(_F32)
    chip = tvm_spinn.training.compile(model, torch.from_numpy(x), loss="mse", optimizer=SGD, target="spinn")
    place = tvm_spinn.training.op_placement(chip)
    assert place["forward"]["pe"]["spinn.mean"] == 1 and place["forward"]["host"] == {"relax.reshape": 1}
    board = chip.build_for("spinn/board")
    batches = [(x, y)] * 5
    losses = [chip.step(a, b) for a, b in batches]
    ref_losses, ref_params = torch_reference(model, batches, "mse", SGD)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for name, value in ref_params.items():
        np.testing.assert_allclose(chip.parameters()[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    assert [board.step(a, b) for a, b in batches] == losses
    for name, value in chip.parameters().items():
        assert board.parameters()[name].tobytes() == value.tobytes(), name


def test_a_vocabulary_sized_loss_partitions_onto_the_pes():
    """The graph form of a language model's loss (GPT-2's 50,257 classes): both loss layers are
    offloaded (a row streams through a PE), only the labels' cast and the 0-d reshape stay."""
    import tvm
    from tvm import relax

    from tvm_spinn.training.graph import loss_on_pes

    rows, classes = 4, 50257
    bb = relax.BlockBuilder()
    z = relax.Var("z", relax.TensorType((rows, classes), "float32"))
    t = relax.Var("t", relax.TensorType((rows,), "int64"))
    with bb.function("main", [z, t]):
        with bb.dataflow():
            loss = bb.emit(relax.op.nn.nll_loss(relax.op.nn.log_softmax(z), t))
            out = bb.emit_output(loss)
        bb.emit_func_output(out)
    mod = loss_on_pes(bb.get())
    summary = tvm_spinn.summarize_partition(tvm_spinn.partition_for_spinn(mod, "spinn"))
    assert summary.offloaded_ops == {"spinn.cross_entropy": 1, "spinn.mean": 1}
    assert dict(summary.fallback_ops) == {"relax.astype": 1, "relax.reshape": 1}
    x = np.random.default_rng(7).standard_normal((rows, classes)).astype(_F32)
    y = np.array([0, 50256, 17, 300], np.int64)
    vm = relax.VirtualMachine(relax.build(mod, target="spinn"), tvm.cpu())
    got = float(vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y)).numpy())
    ref = torch.nn.functional.cross_entropy(torch.from_numpy(x).double(), torch.from_numpy(y)).item()
    assert abs(got - ref) < 1e-5


def test_cross_entropy_nan_bits_are_the_m4f_ones():
    # ARMv7-M ARM A2.5.5 (FPSCR.DN = 0): an invalid operation (+inf - +inf, -inf - -inf) gives the
    # default NaN 0x7FC00000 (x86: 0xFFC00000); a signalling operand comes out quieted, payload kept.
    snan = np.array([0x7F800001], np.uint32).view(_F32)[0]
    z = np.array([[1.0, np.inf, 2.0], [np.inf, np.inf, 0.0], [-np.inf, -np.inf, -np.inf],
                  [1.0, snan, 3.0], [1.0, 2.0, 3.0]], _F32)
    t = np.array([0, 1, 2, 1, 2], np.int32)
    want = np.array([0x7FC00000] * 3 + [0x7FC00001], np.uint32)
    assert (cross_entropy_rows(z, t).view(np.uint32)[:4] == want).all()
    grad = cross_entropy_grad(z, t, 4.0)
    assert (grad[:4].view(np.uint32) == want[:, None]).all()
    # the rows without a NaN keep the fast path's bits: the softmax minus the one-hot, over the divisor
    from tvm_spinn.program.ops.rows import _softmax

    p = _softmax(z[4:])
    assert grad[4:].tobytes() == ((p - np.eye(3, dtype=_F32)[2]) / _F32(4.0)).astype(_F32).tobytes()
    # and the softmax kernel, whose NaNs the executed PE code checks, has the same NaNs on these rows
    assert (_softmax(z[:4]).view(np.uint32) == want[:, None]).all()
