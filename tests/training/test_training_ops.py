"""The PE layers a training step needs beyond inference (issue 14): constant ``pad`` (im2col's
padding, col2im's zero-padded slice gradients), ``where_less`` (ReLU's gradient), 9-input
``concat`` (a 3x3 im2col), BatchNorm's batch statistics as row means, and ``max_pool2d``'s
gradient. Data movement and selection are exact: bits equal to the same module built for llvm
in both simulator modes; the batch statistics keep llvm's summation order (sequential fp32 in
ascending flattened index), so they are bit-equal too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.program import ProgramError  # noqa: F401 - the error check() expects
from tvm_spinn.program.ops.movement import MAX_CONCAT_INPUTS
from tvm_spinn.training import graph as train_graph
from test_program_validation import check, edited, layer_index, programs_of


def _module(params, body):
    """``main(params) -> body(*vars)`` as a Relax module (one dataflow block)."""
    bb = relax.BlockBuilder()
    xs = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in params]
    with bb.function("main", xs):
        with bb.dataflow():
            out = bb.emit_output(body(*xs))
        bb.emit_func_output(out)
    return bb.get()


def _run_all(mod, inputs, monkeypatch):
    """Outputs of ``mod`` built for llvm and for spinn (simulator in "tiles" and "layers")."""
    out = {}
    args = [tvm.runtime.tensor(x) for x in inputs]
    for target in ("llvm", "spinn"):
        vm = relax.VirtualMachine(relax.build(mod, target=target), tvm.cpu())
        for mode in (("tiles", "layers") if target == "spinn" else ("layers",)):
            monkeypatch.setenv("TVM_SPINN_SIM_MODE", mode)
            out[target, mode] = vm["main"](*args).numpy()
    return out


def _assert_same_bits(outs):
    ref = outs["llvm", "layers"]
    for key, got in outs.items():
        assert got.shape == ref.shape and got.tobytes() == ref.tobytes(), key


def _specials(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    special = np.array([np.nan, -0.0, 0.0, -np.inf, np.inf, -1.0], np.float32)
    x.reshape(-1)[:min(6, x.size)] = special[:min(6, x.size)]
    return x


def _offloaded(mod):
    return tvm_spinn.summarize_partition(tvm_spinn.partition_for_spinn(mod))


@pytest.mark.parametrize("width,value", [([0, 0, 0, 0, 1, 2, 3, 0], 0.0), ([1, 0, 0, 2, 1, 1, 0, 0], -0.0),
                                         ([0, 0, 1, 1, 0, 0, 2, 2], 1.5)])
def test_pad_on_the_pes_has_llvm_bits(width, value, monkeypatch):
    rng = np.random.default_rng(0)
    mod = _module([("x", (2, 3, 5, 4))],
                  lambda x: relax.op.multiply(relax.op.nn.pad(x, width, pad_value=value), relax.const(1.0)))
    summary = _offloaded(mod)
    assert summary.offloaded_ops.get("spinn.pad") == 1 and not summary.fallback_ops, summary
    _assert_same_bits(_run_all(mod, [_specials(rng, (2, 3, 5, 4))], monkeypatch))


def test_where_less_on_the_pes_has_llvm_bits(monkeypatch):
    """ReLU's gradient ``where(x < 0, 0, dy)`` and a broadcast four-operand select; NaN, -0.0
    and infinities in both the compared and the selected operands."""
    rng = np.random.default_rng(1)
    zero = relax.const(0.0)
    relu_grad = _module([("x", (2, 3, 4, 5)), ("dy", (2, 3, 4, 5))],
                        lambda x, dy: relax.op.where(relax.op.less(x, zero), zero, dy))
    select = _module([("a", (2, 1, 4, 5)), ("b", (3, 1, 5)), ("c", (2, 3, 4, 5)), ("d", (5,))],
                     lambda a, b, c, d: relax.op.where(relax.op.less(a, b), c, d))
    for mod, shapes in ((relu_grad, [(2, 3, 4, 5)] * 2), (select, [(2, 1, 4, 5), (3, 1, 5), (2, 3, 4, 5), (5,)])):
        summary = _offloaded(mod)
        assert summary.offloaded_ops == {"spinn.where_less": 1} and not summary.fallback_ops, summary
        _assert_same_bits(_run_all(mod, [_specials(rng, s) for s in shapes], monkeypatch))


def test_nine_input_concat_on_the_pes(monkeypatch):
    rng = np.random.default_rng(2)
    params = [(f"x{i}", (2, 3, 1, 4)) for i in range(MAX_CONCAT_INPUTS)]
    mod = _module(params, lambda *xs: relax.op.concat(xs, axis=2))
    assert _offloaded(mod).offloaded_ops == {"spinn.concat": 1}
    _assert_same_bits(_run_all(mod, [_specials(rng, s) for _, s in params], monkeypatch))
    # the training graph splits wider im2col concats to this width (it may not import program)
    assert train_graph._CONCAT_INPUTS == MAX_CONCAT_INPUTS


def test_batch_statistics_run_as_row_means_with_llvm_bits(monkeypatch):
    """BatchNorm's training-mode ``mean``/``variance`` over (N, H, W), rewritten to row means of
    the permuted input: the rewritten module on the PEs gives the bits of the original module
    on llvm (topi's sums are sequential in ascending flattened index too)."""
    rng = np.random.default_rng(3)
    x_shape = (4, 3, 5, 6)

    def stats(x):
        m = relax.op.mean(x, [0, 2, 3], keepdims=True)
        v = relax.op.variance(x, [0, 2, 3], keepdims=False)
        return relax.Tuple([m, v, relax.op.variance(x, [2, 3])])

    mod = _module([("x", x_shape)], stats)
    rewritten = train_graph._batch_stats_on_rows(mod)
    summary = _offloaded(rewritten)
    assert not summary.fallback_ops and summary.offloaded_ops.get("spinn.mean") == 4, summary
    x = rng.standard_normal(x_shape).astype(np.float32) * 3 + 1
    want = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x))
    want = [w.numpy() for w in want]
    np.testing.assert_allclose(want[1], x.var(axis=(0, 2, 3), dtype=np.float64), rtol=1e-5)
    for mode in ("tiles", "layers"):
        monkeypatch.setenv("TVM_SPINN_SIM_MODE", mode)
        vm = relax.VirtualMachine(relax.build(rewritten, target="spinn"), tvm.cpu())
        got = [g.numpy() for g in vm["main"](tvm.runtime.tensor(x))]
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.tobytes() == w.tobytes(), mode


@pytest.mark.slow
def test_seven_by_seven_im2col_has_no_host_concat():
    """A 7x7 kernel's 49 slices are joined per kernel row, then the rows: every concat fits a
    PE pattern; the GEMM form equals the convolution."""
    w_shape, x_shape = (2, 1, 7, 7), (1, 1, 9, 9)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    w = relax.Var("w", relax.TensorType(w_shape, "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.conv2d(x, w, strides=2, padding=3))
        bb.emit_func_output(out)
    conv = bb.get()
    gemm = tvm.IRModule({"main": train_graph._conv_as_gemm(conv["main"])})
    summary = _offloaded(gemm)
    assert summary.offloaded_ops.get("spinn.concat") == 8 and "relax.concat" not in summary.fallback_ops, summary
    assert summary.offloaded_ops.get("spinn.pad") == 1, summary
    rng = np.random.default_rng(4)
    args = [rng.standard_normal(s).astype(np.float32) for s in (x_shape, w_shape)]
    got = relax.VirtualMachine(relax.build(gemm, target="llvm"), tvm.cpu())["main"](
        *[tvm.runtime.tensor(a) for a in args]).numpy()
    want = torch.nn.functional.conv2d(*(torch.from_numpy(a) for a in args), stride=2, padding=3).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bad_pad_and_select_layers_are_refused():
    """A program whose pad widths do not match its rank, or whose select has three operands,
    fails validation naming the field."""
    pad = _module([("x", (1, 2, 3, 3))], lambda x: relax.op.multiply(relax.op.nn.pad(x, [0, 0, 0, 0, 1, 1, 1, 1]),
                                                                     relax.const(2.0)))
    (data,) = programs_of(relax.build(pad, target="spinn"))

    def short_widths(header):
        header["layers"][layer_index(header, "pad")]["attrs"]["pad_width"] = [1, 1]
    check(edited(data, short_widths), r"pad_width.*2 per axis")

    zero = relax.const(0.0)
    sel = _module([("x", (2, 3)), ("dy", (2, 3))], lambda x, dy: relax.op.where(relax.op.less(x, zero), zero, dy))
    (data,) = programs_of(relax.build(sel, target="spinn"))

    def three_operands(header):
        header["layers"][layer_index(header, "where_less")]["inputs"].pop()
    check(edited(data, three_operands), r"inputs")


def test_host_time_is_the_host_roofline_of_the_ops_left(register_system):
    """A step's host operators are timed by the host's roofline: per call ``host_op_s`` plus the
    bytes read and written over ``host_mem_bw_bytes_s`` (here log_softmax, which has no PE kind,
    of an (8, 10) float32 array: 320 bytes in, 320 out); a reshape moves no bytes; the PE ops
    cost nothing here."""
    from tvm_spinn.target.registry import arch_of
    from tvm_spinn.training.timing import host_time

    mod = _module([("x", (8, 10))], lambda x: relax.op.reshape(
        relax.op.nn.log_softmax(relax.op.multiply(x, relax.const(2.0))), (80,)))
    arch = arch_of("spinn")
    seconds, ops = host_time(mod, "spinn")
    assert dict(ops) == {"relax.nn.log_softmax": 1}  # the multiply and the reshape run on the PEs
    assert seconds == pytest.approx(arch.host_op_s + 640 / arch.host_mem_bw_bytes_s, rel=1e-12)
    # the same ops on a slower host take longer
    slow = register_system(arch.replace(name="slow-host", host_mem_bw_bytes_s=1e9))
    assert host_time(mod, slow)[0] == pytest.approx(arch.host_op_s + 640 / 1e9, rel=1e-12)


@pytest.mark.parametrize("pool,stride,pad,side", [(3, 2, 1, 10), (2, 2, 0, 8), (3, 1, 1, 7), (3, 2, 0, 9)])
def test_max_pool_backward_on_the_pes_has_llvm_bits(pool, stride, pad, side, monkeypatch):
    """TVM's pool_grad: argmax ties (ReLU'd input, many zeros), NaN, infinities and -0.0 in
    the input, overlapping windows (3x3 stride 2, ResNet's stem) whose gradients add up."""
    rng = np.random.default_rng(5)
    x_shape = (2, 3, side, side)
    o = (side + 2 * pad - pool) // stride + 1
    g_shape = (2, 3, o, o)

    def grad(dy, x):
        return relax.op.grad.max_pool2d_backward(dy, x, (pool, pool), (stride, stride), (pad,) * 4)

    mod = _module([("dy", g_shape), ("x", x_shape)], grad)
    summary = _offloaded(mod)
    assert summary.offloaded_ops == {"spinn.max_pool2d_backward": 1} and not summary.fallback_ops, summary
    x = np.maximum(rng.standard_normal(x_shape).astype(np.float32), 0)  # ties at 0
    x[0, 0, 0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    x[1, 2] = -np.inf  # a plane of -inf: windows with nothing taken
    dy = _specials(rng, g_shape)
    _assert_same_bits(_run_all(mod, [dy, x], monkeypatch))
