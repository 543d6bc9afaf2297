"""The ``rope`` family: transformers' rotary embedding (``x * cos + rotate_half(x) * sin``) runs
as one layer with the bits of the nine layers it replaces and of PyTorch; its PE kernel, run in
the instruction-set simulator, gives the same bits at the timing model's cycles (+-10%);
operands that are not a rotation are refused, naming the op and the shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.program import ops
from tvm_spinn.program.ops.rope import Rope, RopeRule, rope
from tvm_spinn.program.ops.sharding import MeshAxis, REPLICATE, ShardContext, shard


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Rotary(torch.nn.Module):
    """transformers' ``apply_rotary_pos_emb`` on a scaled input (so that x is a layer's output)."""

    def forward(self, x, cos, sin):
        x = x * 1.5
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return x * cos + _rotate_half(x) * sin


def _special(x: torch.Tensor) -> torch.Tensor:
    """NaNs of both signs, infinities and signed zeros among random values."""
    flat = x.reshape(-1)
    values = [float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0]
    for i, v in enumerate(values):
        flat[(7 * i + 3) % flat.numel()] = v
    return x


def _inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, _, n, d = shape
    x = _special(torch.randn(*shape, generator=g) * 3)
    cos, sin = torch.randn(b, n, d, generator=g), torch.randn(b, n, d, generator=g)
    return x, cos, sin


def _bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).tobytes()


@pytest.mark.parametrize("shape", [(1, 4, 1, 128), (2, 3, 5, 16), (1, 2, 3, 2)])
def test_the_op_alone_has_torchs_bits(shape):
    x, cos, sin = _inputs(shape)
    want = x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)
    got = rope(x.numpy(), cos.numpy()[:, None], sin.numpy()[:, None])
    # NaN payloads aside (the M4F's rule, not x86's), every value's bits are torch's
    nan = np.isnan(want.numpy())
    assert np.array_equal(np.isnan(got), nan)
    assert _bits(got[~nan]) == _bits(want.numpy()[~nan])
    # and within float32 rounding of the float64 arithmetic
    x64, c64, s64 = (t.double().numpy() for t in (x, cos.unsqueeze(1), sin.unsqueeze(1)))
    h = shape[-1] // 2
    rot64 = np.concatenate([-x64[..., h:], x64[..., :h]], axis=-1)
    ref = x64 * c64 + rot64 * s64
    finite = np.isfinite(ref)
    scale = np.abs(x64 * c64) + np.abs(rot64 * s64)
    assert np.all(np.abs(got[finite] - ref[finite]) <= 4 * np.finfo(np.float32).eps * scale[finite] + 1e-30)


@pytest.mark.parametrize("args, match", [
    (((2, 5), (5,), (5,)), r"rope: x of shape \[2, 5\]: the rotated last axis must have an even length"),
    (((2, 4, 8), (3, 8), (4, 8)), r"rope: cos of shape \[3, 8\] does not broadcast to x of shape \[2, 4, 8\]"),
    (((2, 4, 8), (4, 8), (4, 4)), r"rope: sin of shape \[4, 4\] does not broadcast to x of shape \[2, 4, 8\]"),
    (((4,), (1, 4), (4,)), r"rope: cos of shape \[1, 4\] does not broadcast to x of shape \[4\]"),
])
def test_operands_that_are_not_a_rotation_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        rope(*(np.zeros(s, dtype=np.float32) for s in args))


def _build(shape, target="spinn"):
    x, cos, sin = _inputs(shape)
    mod = tvm_spinn.frontend.from_pytorch(_Rotary().eval(), (x, cos, sin))
    return (x, cos, sin), relax.build(mod, target=target)


def _run(ex, args):
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(a.numpy()) for a in args)).numpy()


def _kinds(ex):
    return [layer.kind for p in tvm_spinn.report(ex).programs for layer in p.layers]


@pytest.fixture
def unfused():
    """The build without the family: the nine imported operators, each a layer."""
    family = ops.family_of("rope")
    ops.unregister(family)
    yield
    ops.register(family)


@pytest.mark.parametrize("shape", [(1, 4, 1, 128), (2, 3, 5, 16)])
def test_one_layer_with_the_unfused_programs_bits(shape, monkeypatch, request):
    args, ex = _build(shape)
    kinds = _kinds(ex)
    assert kinds.count("rope") == 1 and not {"concat", "strided_slice", "negative"} & set(kinds), kinds
    from tvm_spinn.program.native_section import section_status

    (program,) = tvm_spinn.report(ex).programs
    assert section_status(program.native_section).runnable  # the C++ plan runs the rope layer too
    got = {}
    for mode, native in (("layers", "1"), ("layers", "0"), ("tiles", "1")):
        monkeypatch.setenv("TVM_SPINN_SIM_MODE", mode)
        monkeypatch.setenv("TVM_SPINN_SIM_NATIVE", native)
        got[mode + native] = _run(ex, args)
    monkeypatch.delenv("TVM_SPINN_SIM_NATIVE")
    got["layers"] = got["layers1"]
    assert _bits(got["layers1"]) == _bits(got["layers0"]) == _bits(got["tiles1"])
    request.getfixturevalue("unfused")
    _, plain = _build(shape)
    plain_kinds = _kinds(plain)
    assert "rope" not in plain_kinds and {"concat", "strided_slice", "negative"} <= set(plain_kinds)
    monkeypatch.setenv("TVM_SPINN_SIM_MODE", "layers")
    assert _bits(_run(plain, args)) == _bits(got["layers"])
    # and PyTorch's, NaN payloads aside
    with torch.no_grad():
        want = _Rotary()(*args).numpy()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got["layers"]), nan) and _bits(got["layers"][~nan]) == _bits(want[~nan])


def test_a_layer_is_fewer_layers_and_less_time():
    args, ex = _build((1, 8, 1, 128))
    fused = tvm_spinn.report(ex).programs[0]
    family = ops.family_of("rope")
    ops.unregister(family)
    try:
        _, plain_ex = _build((1, 8, 1, 128))
    finally:
        ops.register(family)
    plain = tvm_spinn.report(plain_ex).programs[0]
    assert len(fused.layers) + 6 == len(plain.layers)  # seven layers (two multiplies, two slices, negative, concat, add) become one
    assert fused.timing.latency_s < plain.timing.latency_s


@pytest.mark.parametrize("shape", [(1, 8, 3, 16), (2, 4, 5, 64), (1, 3, 7, 10)])
def test_the_pe_kernel_gives_the_bits_at_the_modelled_cycles(shape):
    from tvm_spinn.pe import run_program_iss

    args, ex = _build(shape)
    named = dict(zip(("x", "cos", "sin"), (a.numpy() for a in args)))
    with torch.no_grad():
        want = _Rotary()(*args).numpy()
    (program,) = tvm_spinn.report(ex).programs
    record = []
    (got,) = run_program_iss(program, [named[program.tensors[t].name] for t in program.inputs], record)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and _bits(got[~nan]) == _bits(want[~nan])
    index = [layer.kind for layer in program.layers].index("rope")
    runs = [r for r in record if r.layer == index]
    modelled, executed = sum(r.modelled for r in runs), sum(r.cycles for r in runs)
    assert runs and abs(executed / modelled - 1) <= 0.10, (executed, modelled)


def test_a_last_axis_that_is_not_even_stays_unfused_with_the_reason(caplog):
    class Odd(torch.nn.Module):
        def forward(self, x, cos, sin):  # "halves" of 2 and 3 elements: not a rotation
            x = x * 1.5
            return x * cos + torch.cat((-x[..., 3:], x[..., :3]), dim=-1) * sin

    x, cos, sin = torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5)
    mod = tvm_spinn.frontend.from_pytorch(Odd().eval(), (x, cos, sin))
    with caplog.at_level("WARNING", logger="tvm_spinn.partition"):
        ex = relax.build(mod, target="spinn")
    assert "rope" not in _kinds(ex)
    assert any("spinn.rope" in r.getMessage() and "x of shape [2, 5]" in r.getMessage() and "even length" in r.getMessage()
               for r in caplog.records)
    with torch.no_grad():
        want = Odd()(x, cos, sin).numpy()
    assert _bits(_run(ex, (x, cos, sin))) == _bits(want)


def test_sharding_keeps_each_rows_halves_on_one_chip():
    class P:  # the program view a rule reads
        tensors = [type("T", (), {"role": "act"})() for _ in range(4)]

    layer = type("L", (), {"inputs": [0, 1, 2], "output": 3})()
    full = [[1, 8, 1, 128], [1, 1, 1, 128], [1, 1, 1, 128], [1, 8, 1, 128]]
    ctx = ShardContext(P(), full, MeshAxis("tp", 4), lambda *a: False)
    rule = RopeRule()
    # heads split: kept (the tables broadcast along it, sliced for free)
    heads = rule.propagate(ctx, layer, [shard(1), REPLICATE, REPLICATE])
    assert heads.split == "split" and heads.output == shard(1)
    # the rotated axis split: gathered, each chip rotates whole rows
    rows = rule.propagate(ctx, layer, [shard(3), REPLICATE, REPLICATE])
    assert rows.split == "rep" and rows.gather_all
    assert isinstance(ops.family_of("rope"), Rope) and ops.family_of("rope").sharding is not None


def test_a_program_whose_rope_tables_do_not_fit_x_is_refused_naming_the_layer():
    import dataclasses

    from tvm_spinn.program import Program, ProgramError

    _, ex = _build((2, 3, 5, 16))
    (program,) = tvm_spinn.report(ex).programs
    program = dataclasses.replace(program, native_section=None)
    index = [layer.kind for layer in program.layers].index("rope")
    rope_layer = program.layers[index]
    # the rope reads the host's (2, 5, 16) table itself, not its (2, 1, 5, 16) expansion
    table = next(layer.inputs[0] for layer in program.layers if layer.output == rope_layer.inputs[1])
    layers = list(program.layers)
    layers[index] = dataclasses.replace(rope_layer, inputs=[rope_layer.inputs[0], table, rope_layer.inputs[2]])
    bad = dataclasses.replace(program, layers=layers)
    with pytest.raises(ProgramError, match=rf"layers\[{index}\]\.inputs: cos of shape \[2, 5, 16\] does not "
                                           r"broadcast to x of shape \[2, 3, 5, 16\]"):
        Program.from_bytes(bad.to_bytes())
