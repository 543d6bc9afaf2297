"""Every unary/binary op of TVM's PyTorch importer through the fallback's default schedules.

The cases cover the ``# unary`` and ``# binary`` sections of
``ExportedProgramImporter.create_convert_map`` (checked by :func:`test_sweep_covers_importer`).
Each case is built three ways and compared:

- ``torch``: the eager PyTorch result (the reference),
- ``llvm``: TVM's plain llvm build (no default schedules), which must match torch,
- ``spinn``: ``relax.build(target="spinn")``, i.e. partitioning plus the fallback's default CPU
  schedules (parallel + vectorized loops), which must match the llvm build.

All cases are imported as one model and built once per target; when that fails, the
group is bisected so that each failure is reported by its own case.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from tvm import relax

import tvm_spinn

#: 16384 elements: large enough that the default schedule parallelizes and vectorizes
SHAPE = (4, 64, 64)


@dataclass
class Case:
    """One sweep case: a torch function of ``arity`` inputs drawn from ``domain``."""

    name: str
    fn: Callable
    covers: tuple = ()
    domain: str = "real"  # real | unit | pos | ge1 | int | bool | small
    arity: int = 1
    shape: tuple = SHAPE


def _c(name, fn, *covers, domain="real", arity=1, shape=SHAPE):
    return Case(name, fn, tuple(covers) or (name,), domain, arity, shape)


CASES = [
    # unary
    _c("abs.default", torch.abs),
    _c("acos.default", torch.acos, domain="unit"),
    _c("acosh.default", torch.acosh, domain="ge1"),
    _c("asin.default", torch.asin, domain="unit"),
    _c("asinh.default", torch.asinh),
    _c("atan.default", torch.atan),
    _c("atanh.default", torch.atanh, domain="unit"),
    _c("bitwise_not.default", torch.bitwise_not, domain="int"),
    _c("ceil.default", torch.ceil),
    _c("celu.default", lambda x: F.celu(x, alpha=0.7)),
    _c("clamp.default", lambda x: torch.clamp(x, -0.5, 0.7)),
    _c("clamp_min.default", lambda x: torch.clamp_min(x, -0.3)),
    _c("clamp_max.default", lambda x: torch.clamp_max(x, 0.4)),
    _c("cos.default", torch.cos),
    _c("cosh.default", torch.cosh),
    _c("elu.default", F.elu),
    _c("erf.default", torch.erf),
    _c("exp.default", torch.exp),
    _c("expm1.default", torch.expm1),
    _c("floor.default", torch.floor),
    _c("gelu.default", F.gelu),
    _c("gelu.tanh", lambda x: F.gelu(x, approximate="tanh"), "gelu.default"),
    _c("hardsigmoid.default", F.hardsigmoid),
    _c("hardswish.default", F.hardswish, "hardswish.default", "hardswish_.default"),
    _c("hardtanh.default", lambda x: F.hardtanh(x, -0.6, 0.8), "hardtanh.default", "hardtanh_.default"),
    _c("isfinite.default", lambda x: torch.isfinite(1.0 / x), domain="small"),
    _c("isinf.default", lambda x: torch.isinf(1.0 / x), domain="small"),
    _c("isnan.default", lambda x: torch.isnan(torch.sqrt(x))),
    _c("isin.Tensor_Tensor", lambda x, y: torch.isin(x, y[0, 0, :6].contiguous()), domain="int", arity=2),
    _c("leaky_relu.default", lambda x: F.leaky_relu(x, 0.2), "leaky_relu.default", "leaky_relu_.default"),
    _c("log.default", torch.log, domain="pos"),
    _c("log2.default", torch.log2, domain="pos"),
    _c("log10.default", torch.log10, domain="pos"),
    _c("log1p.default", torch.log1p, domain="pos"),
    _c("logical_not.default", torch.logical_not, domain="bool"),
    _c("logical_and.default", torch.logical_and, domain="bool", arity=2),
    _c("logical_or.default", torch.logical_or, domain="bool", arity=2),
    _c("logical_xor.default", torch.logical_xor, domain="bool", arity=2),
    _c("log_softmax.int", lambda x: F.log_softmax(x, dim=-1), "log_softmax.int", "_log_softmax.default"),
    _c("neg.default", torch.neg),
    _c("pad.default", lambda x: F.pad(x, (1, 2, 0, 1), mode="reflect"), "pad.default"),
    _c("constant_pad_nd.default", lambda x: F.pad(x, (1, 2, 3, 0), value=0.5)),
    _c("copy.default", lambda x, y: x.clone().copy_(y[:, :1]), arity=2),
    _c("pixel_shuffle.default", lambda x: F.pixel_shuffle(x, 2), shape=(1, 16, 16, 16)),
    _c("prelu.default", lambda x: F.prelu(x, torch.linspace(0.1, 0.4, 4)), shape=(2, 4, 32, 32)),
    _c("reciprocal.default", torch.reciprocal, domain="pos"),
    _c("relu.default", torch.relu, "relu.default", "relu_.default"),
    _c("relu6.default", F.relu6, "relu6.default", "relu6_.default"),
    _c("round.default", torch.round),
    _c("round.decimals", lambda x: torch.round(x * 10, decimals=1)),
    _c("rsqrt.default", torch.rsqrt, domain="pos"),
    _c("scalar_tensor.default", lambda x: x + torch.scalar_tensor(1.5)),
    _c("scatter.src", lambda x, y: torch.scatter(x, 2, torch.arange(4).view(1, 1, 4).expand(4, 64, 4), y[:, :, :4]),
       arity=2),
    _c("scatter.value", lambda x: torch.scatter(x, 2, torch.arange(4).view(1, 1, 4).expand(4, 64, 4), 2.5)),
    _c("rsub.Tensor", lambda x, y: torch.rsub(x, y), arity=2),
    _c("rsub.Scalar", lambda x: torch.rsub(x, 2.0)),
    _c("selu.default", F.selu),
    _c("sigmoid.default", torch.sigmoid),
    _c("sign.default", torch.sign),
    _c("silu.default", F.silu, "silu.default", "silu_.default"),
    _c("sin.default", torch.sin),
    _c("sinh.default", torch.sinh),
    _c("softmax.int", lambda x: F.softmax(x, dim=-1), "softmax.int", "_softmax.default"),
    _c("softplus.default", lambda x: F.softplus(x, beta=2.0, threshold=1.5)),
    _c("softshrink.default", lambda x: F.softshrink(x, 0.3)),
    _c("softsign.default", F.softsign),
    _c("sqrt.default", torch.sqrt, domain="pos"),
    _c("square.default", torch.square),
    _c("tan.default", torch.tan, domain="unit"),
    _c("tanh.default", torch.tanh),
    _c("tril.default", lambda x: torch.tril(x, 1)),
    _c("triu.default", lambda x: torch.triu(x, -1)),
    _c("trunc.default", torch.trunc),
    # binary
    _c("add.Tensor", torch.add, "add.Tensor", "add_.Tensor", arity=2),
    _c("add.Scalar", lambda x: x + 1.25),
    _c("atan2.default", torch.atan2, arity=2),
    _c("bitwise_and.Tensor", torch.bitwise_and, "bitwise_and.Tensor", "__and__.Tensor", domain="int", arity=2),
    _c("bitwise_and.Scalar", lambda x: torch.bitwise_and(x, 6), "bitwise_and.Scalar", "__and__.Scalar",
       domain="int"),
    _c("bitwise_or.Tensor", torch.bitwise_or, "bitwise_or.Tensor", "bitwise_or_.Tensor", "__or__.Tensor",
       domain="int", arity=2),
    _c("bitwise_or.Scalar", lambda x: torch.bitwise_or(x, 5), "bitwise_or.Scalar", "bitwise_or_.Scalar",
       "__or__.Scalar", domain="int"),
    _c("bitwise_xor.Tensor", torch.bitwise_xor, "bitwise_xor.Tensor", "__xor__.Tensor", domain="int", arity=2),
    _c("bitwise_xor.Scalar", lambda x: torch.bitwise_xor(x, 3), "bitwise_xor.Scalar", "__xor__.Scalar",
       domain="int"),
    _c("div.Tensor", torch.div, arity=2, domain="pos"),
    _c("div.Scalar", lambda x: x / 3.0),
    _c("div.Tensor_mode.floor", lambda x, y: torch.div(x, y, rounding_mode="floor"), "div.Tensor_mode",
       arity=2, domain="pos"),
    _c("div.Tensor_mode.trunc", lambda x, y: torch.div(x - 1, y, rounding_mode="trunc"), "div.Tensor_mode",
       arity=2, domain="pos"),
    _c("eq.Tensor", lambda x, y: torch.eq(x, y), arity=2, domain="int"),
    _c("eq.Scalar", lambda x: torch.eq(x, 3), domain="int"),
    _c("floor_divide.default", torch.floor_divide, arity=2, domain="pos"),
    _c("fmod.Tensor", torch.fmod, arity=2, domain="pos"),
    _c("fmod.Scalar", lambda x: torch.fmod(x, 0.3)),
    _c("logaddexp.default", torch.logaddexp, arity=2),
    _c("ge.Tensor", torch.ge, arity=2),
    _c("ge.Scalar", lambda x: torch.ge(x, 0.1)),
    _c("gt.Tensor", torch.gt, arity=2),
    _c("gt.Scalar", lambda x: torch.gt(x, 0.1)),
    _c("le.Tensor", torch.le, arity=2),
    _c("le.Scalar", lambda x: torch.le(x, 0.1)),
    _c("lt.Tensor", torch.lt, arity=2),
    _c("lt.Scalar", lambda x: torch.lt(x, 0.1)),
    _c("matmul.default", torch.matmul, "matmul.default", arity=2, shape=(4, 16, 16)),
    _c("mm.default", torch.mm, arity=2, shape=(16, 16)),
    _c("maximum.default", torch.maximum, "maximum.default", "max.other", arity=2),
    _c("minimum.default", torch.minimum, "minimum.default", "min.other", arity=2),
    _c("max.default", lambda x: torch.max(x).reshape(1)),
    _c("min.default", lambda x: torch.min(x).reshape(1)),
    _c("remainder.Tensor", torch.remainder, arity=2, domain="pos"),
    _c("remainder.Scalar", lambda x: torch.remainder(x, 0.3)),
    _c("mul.Tensor", torch.mul, "mul.Tensor", "mul_.Tensor", arity=2),
    _c("mul.Scalar", lambda x: x * 1.75),
    _c("ne.Tensor", torch.ne, arity=2, domain="int"),
    _c("ne.Scalar", lambda x: torch.ne(x, 2), domain="int"),
    _c("outer.default", torch.outer, arity=2, shape=(37,)),
    _c("pow.Scalar", lambda x: torch.pow(2.0, x)),
    _c("pow.Tensor_Scalar", lambda x: torch.pow(x, 3)),
    _c("pow.Tensor_Tensor", torch.pow, arity=2, domain="pos"),
    _c("sub.Tensor", torch.sub, arity=2),
    _c("sub.Scalar", lambda x: x - 0.75),
]

#: convert-map keys in those sections that no tensor-level case can reach, and why
EXCLUDED = {
    "dropout.default": "identity in eval mode: no op reaches the importer",
    "dropout_.default": "identity in eval mode",
    "native_dropout.default": "identity in eval mode",
    "exponential.default": "random sampling: no deterministic reference",
    "to_sparse.default": "sparse layout: no dense computation",
    "neg": "SymInt arithmetic on shapes, not a tensor op",
    "add": "SymInt arithmetic on shapes",
    "sub": "SymInt arithmetic on shapes",
    "mul": "SymInt arithmetic on shapes",
    "floordiv": "SymInt arithmetic on shapes",
    "mod": "SymInt arithmetic on shapes",
}


def _importer_keys() -> list[str]:
    """The convert-map keys between ``# unary`` and ``# linear algebra`` in TVM's importer."""
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    src = inspect.getsource(ExportedProgramImporter.create_convert_map)
    section = src[src.index("# unary"):src.index("# linear algebra")]
    return sorted(set(re.findall(r'^\s*"([^"]+)":', section, flags=re.M)))


def _inputs(case: Case) -> list[torch.Tensor]:
    rng = np.random.default_rng(sum(map(ord, case.name)))  # per-case, run-independent seed
    out = []
    for _ in range(case.arity):
        if case.domain == "int":
            out.append(torch.from_numpy(rng.integers(-20, 20, case.shape).astype("int32")))
        elif case.domain == "bool":
            out.append(torch.from_numpy(rng.random(case.shape) > 0.5))
        else:
            lo, hi = {"real": (-2, 2), "unit": (-0.9, 0.9), "pos": (0.1, 3), "ge1": (1.1, 3),
                      "small": (-2, 2)}[case.domain]
            x = rng.uniform(lo, hi, case.shape).astype("float32")
            if case.domain == "small":
                x.reshape(-1)[::7] = 0.0  # 1/0 = inf
            out.append(torch.from_numpy(x))
    return out


class _Wrap(torch.nn.Module):
    """``cases`` side by side: ``forward`` takes their inputs in order, returns their outputs."""

    def __init__(self, cases):
        super().__init__()
        self.cases = cases

    def forward(self, *xs):
        outs, k = [], 0
        for case in self.cases:
            outs.append(case.fn(*xs[k:k + case.arity]))
            k += case.arity
        return tuple(outs)


def _build_and_run(cases, inputs, target) -> list:
    """Import ``cases`` as one model, build it for ``target``, run it: one output per case.

    ``llvm`` is TVM's own build (no spinn options active); ``spinn`` gets the fallback's
    default schedules."""
    flat = tuple(x for xs in inputs for x in xs)
    mod = tvm_spinn.frontend.from_pytorch(_Wrap(cases), flat)
    if target == "spinn":
        with tvm_spinn.build_options(default_schedules=True):
            ex = relax.build(mod, target=target)
    else:
        ex = relax.build(mod, target=target)
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(x.numpy()) for x in flat])
    outs = [out] if hasattr(out, "numpy") else list(out)
    return [o.numpy() for o in outs]


def _bisect(cases, inputs, target) -> list:
    """Outputs of ``cases``; a group that fails to import or build is split until the failing
    cases stand alone, and their entry is then the error message (a ``str``)."""
    try:
        return _build_and_run(cases, inputs, target)
    except Exception as err:  # noqa: BLE001 - reported by the failing case's test
        if len(cases) == 1:
            return [f"{type(err).__name__}: {str(err).splitlines()[0]}"]
    half = len(cases) // 2
    return _bisect(cases[:half], inputs[:half], target) + _bisect(cases[half:], inputs[half:], target)


@pytest.fixture(scope="module")
def sweep():
    """Every case through torch, llvm (plain) and spinn (default schedules): name -> results.

    All cases are imported and built as one model (one export, one build per target); when
    that fails, the group is bisected so that each failure is reported by its own case.
    """
    inputs = [_inputs(case) for case in CASES]
    data = {case.name: {"torch": case.fn(*[x.clone() for x in xs]).numpy()}
            for case, xs in zip(CASES, inputs)}
    for target in ("llvm", "spinn"):
        for case, out in zip(CASES, _bisect(CASES, inputs, target)):
            data[case.name][target] = out
    return data


def test_sweep_covers_importer():
    covered = {key for case in CASES for key in case.covers}
    missing = [k for k in _importer_keys() if k not in covered and k not in EXCLUDED]
    assert not missing, f"importer ops without a sweep case: {missing}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_op_default_schedules(sweep, case):
    got = sweep[case.name]
    for label in ("llvm", "spinn"):
        assert not isinstance(got[label], str), f"{label} build of {case.name} failed: {got[label]}"
    ref = got["torch"]
    assert got["spinn"].shape == ref.shape and got["llvm"].shape == ref.shape
    if ref.dtype.kind in "biu":
        np.testing.assert_array_equal(got["llvm"], ref)
        np.testing.assert_array_equal(got["spinn"], ref)
        return
    np.testing.assert_allclose(got["llvm"], ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["spinn"], got["llvm"], rtol=1e-5, atol=1e-6)


def test_float16_math_builds_where_llvm_does():
    """float16 ``erf`` has a scalar but no vector lowering on llvm (float32's does): the default
    schedule must keep such loops scalar. Ops llvm cannot lower at all in float16 (``asin``,
    ``sinh``...) fail for both targets alike and are not listed."""
    from tvm_spinn.fallback import _vectorizes

    assert not _vectorizes("llvm", "tirx.erf", "float16", ("float16",))
    assert _vectorizes("llvm", "tirx.exp", "float32", ("float32",))
    ops = ["erf", "atanh", "tanh", "exp", "sqrt", "sin", "tan", "log", "sigmoid"]
    x = relax.Var("x", relax.TensorType((64, 256), "float16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.emit_output(relax.Tuple([getattr(relax.op, name)(x) for name in ops]))
        bb.emit_func_output(gv)
    xs = np.random.default_rng(0).uniform(0.05, 0.9, (64, 256)).astype("float16")
    got = {}
    for target in ("llvm", "spinn"):
        out = relax.VirtualMachine(relax.build(bb.get(), target=target), tvm.cpu())["main"](
            tvm.runtime.tensor(xs))
        got[target] = [o.numpy().astype("float32") for o in out]
    for name, spinn, llvm in zip(ops, got["spinn"], got["llvm"]):
        want = getattr(torch, name)(torch.from_numpy(xs).float()).numpy()
        np.testing.assert_allclose(llvm, want, rtol=2e-3, atol=2e-3, err_msg=name)
        np.testing.assert_allclose(spinn, llvm, rtol=2e-3, atol=2e-3, err_msg=name)  # 1 fp16 ulp
