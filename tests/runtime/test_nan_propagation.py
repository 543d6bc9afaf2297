"""NaN and infinities propagate as in PyTorch; optimizer settings are checked by name.

- relu, clip, max pooling, GEMM/convolution epilogues and softmax give NaN where PyTorch does,
  offloaded to spinn and on the fallback's llvm build alike (the same bits, NaN payloads
  included), and a training batch holding a NaN or an infinity gives a NaN loss.
- A negative, NaN or infinite learning rate (or momentum, weight decay, eps, betas outside
  ``[0, 1)``), a value of the wrong type, or an unknown key is one :class:`TrainingError`
  naming the optimizer and the setting, before anything is built.
"""

import numpy as np
import pytest
import torch

import tvm_spinn
from tvm_spinn.training import TrainingError
from tvm_spinn.training.graph import make_optimizer

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("name, options, message", [
    ("sgd", {"lr": -1.0}, r"option 'lr' must be >= 0 and finite, got -1.0"),
    ("sgd", {"lr": NAN}, r"option 'lr' must be >= 0 and finite, got nan"),
    ("sgd", {"lr": INF}, r"option 'lr' must be >= 0 and finite, got inf"),
    ("sgd", {"lr": "0.1"}, r"option 'lr' must be a real number, got str '0.1'"),
    ("sgd", {"lr": True}, r"option 'lr' must be a real number, got bool True"),
    ("sgd", {"lr": None}, r"option 'lr' must be a real number, got NoneType None"),
    ("sgd", {"lr": 0.1, "momentum": -0.5}, r"option 'momentum' must be >= 0"),
    ("sgd", {"lr": 0.1, "weight_decay": NAN}, r"option 'weight_decay' must be >= 0"),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": "yes"}, r"option 'nesterov' must be a bool, got str"),
    ("sgd", {"lr": 0.1, "lr_decay": 0.1}, r"unsupported option 'lr_decay' of optimizer 'sgd'"),
    ("sgd", {"lr": 0.1, 3: 0.1}, r"unsupported option 3 of optimizer 'sgd'"),
    ("adam", {"lr": 1e-3, "betas": (0.9, 1.0)}, r"option 'betas\[1\]' must be \[0, 1\), got 1.0"),
    ("adam", {"lr": 1e-3, "betas": (-0.1, 0.999)}, r"option 'betas\[0\]' must be \[0, 1\)"),
    ("adam", {"lr": 1e-3, "betas": 0.9}, r"option 'betas' must be a pair"),
    ("adam", {"lr": 1e-3, "eps": -1e-8}, r"option 'eps' must be >= 0"),
    ("adam", {"lr": 1e-3, "eps": NAN}, r"option 'eps' must be >= 0"),
    ("adam", {"lr": -1e-3}, r"optimizer 'adam': option 'lr' must be >= 0"),
])
def test_bad_optimizer_settings_are_refused_by_name(name, options, message):
    with pytest.raises(TrainingError, match=message):
        make_optimizer((name, options))
    # the negative and out-of-range values are PyTorch's own refusals (it lets NaN, inf and
    # bools through its `value < 0` checks: a NaN step there gives NaN parameters)
    known = {k: v for k, v in options.items() if isinstance(k, str) and k in ("lr", "momentum", "weight_decay",
                                                                              "betas", "eps")}
    betas = known.get("betas") if isinstance(known.get("betas"), tuple) else ()
    out_of_range = [v for v in known.values() if isinstance(v, float) and v < 0] + [b for b in betas if not 0 <= b < 1]
    if out_of_range:
        cls = torch.optim.SGD if name == "sgd" else torch.optim.Adam
        with pytest.raises(ValueError):
            cls([torch.nn.Parameter(torch.zeros(1))], **known)


@pytest.mark.parametrize("optimizer", [("rmsprop", {"lr": 0.1}), (["sgd"], {"lr": 0.1})])
def test_unknown_optimizer_name(optimizer):
    with pytest.raises(TrainingError, match="unsupported optimizer"):
        make_optimizer(optimizer)


def test_valid_settings_build_and_numpy_scalars_are_numbers():
    assert make_optimizer(("sgd", {"lr": np.float32(0.5), "momentum": np.float64(0.9), "nesterov": np.bool_(True)}))
    assert make_optimizer(("adam", {"lr": 0, "betas": [0.0, 0.5], "eps": 0.0, "weight_decay": 1}))


def test_compile_refuses_a_negative_learning_rate_before_building():
    model = torch.nn.Linear(4, 2)
    with pytest.raises(TrainingError, match="optimizer 'sgd': option 'lr' must be >= 0 and finite, got -1.0"):
        tvm_spinn.training.compile(model, torch.zeros(2, 4), optimizer=("sgd", {"lr": -1.0}))


# -- NaN and infinities through the operators: as PyTorch, offloaded or on the fallback --------
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

_SPECIALS = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1.5, -2.5, 3e38], np.float32)


def _specials(shape, seed=0):
    """Random values with every special (NaN, +-inf, signed zeros) sprinkled in."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    at = rng.choice(flat.size, size=min(flat.size, 3 * len(_SPECIALS)), replace=False)
    flat[at] = np.resize(_SPECIALS, len(at))
    return x


def _build_run(fn, inputs, target, consts=()):
    bb = relax.BlockBuilder()
    params = [relax.Var(f"a{i}", relax.TensorType(x.shape, "float32")) for i, x in enumerate(inputs)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(fn(*params, *[relax.const(c) for c in consts]))
        bb.emit_func_output(out)
    if target == "llvm":  # the fallback's pipeline (what runs beside the offloaded operators)
        with tvm_spinn.build_options():
            ex = relax.build(bb.get(), target="llvm")
    else:
        ex = relax.build(bb.get(), target=target)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy()


_W = np.random.default_rng(3).standard_normal((16, 8)).astype(np.float32)
_B = np.random.default_rng(4).standard_normal((8,)).astype(np.float32)
_K = np.random.default_rng(5).standard_normal((4, 2, 3, 3)).astype(np.float32)
_KD = np.random.default_rng(6).standard_normal((2, 1, 3, 3)).astype(np.float32)

_F = torch.nn.functional
_OPS = {
    "relu": (lambda x: relax.op.nn.relu(x), torch.relu, (6, 40)),
    "clip": (lambda x: relax.op.clip(x, -1.0, 1.0), lambda t: torch.clamp(t, -1.0, 1.0), (6, 40)),
    "add_relu": (lambda x: relax.op.nn.relu(relax.op.add(x, x)), lambda t: torch.relu(t + t), (6, 40)),
    "softmax": (lambda x: relax.op.nn.softmax(x, axis=-1), lambda t: torch.softmax(t, -1), (6, 40)),
    "max_pool2d": (lambda x: relax.op.nn.max_pool2d(x, (3, 3), (2, 2), padding=(1, 1)),
                   lambda t: _F.max_pool2d(t, 3, 2, 1), (2, 3, 9, 9)),
    "dense_relu": (lambda x, w, b: relax.op.nn.relu(relax.op.add(relax.op.matmul(x, w), b)),
                   lambda t: torch.relu(t @ torch.from_numpy(_W) + torch.from_numpy(_B)), (6, 16), (_W, _B)),
    "conv_relu": (lambda x, k: relax.op.nn.relu(relax.op.nn.conv2d(x, k, padding=1)),
                  lambda t: torch.relu(_F.conv2d(t, torch.from_numpy(_K), padding=1)), (1, 2, 8, 8), (_K,)),
    "depthwise_relu": (lambda x, k: relax.op.nn.relu(relax.op.nn.conv2d(x, k, padding=1, groups=2)),
                       lambda t: torch.relu(_F.conv2d(t, torch.from_numpy(_KD), padding=1, groups=2)),
                       (1, 2, 8, 8), (_KD,)),
}


def _nan_equal(got, want, exact):
    assert np.array_equal(np.isnan(got), np.isnan(want)), (np.argwhere(np.isnan(got) != np.isnan(want))[:5])
    ok = ~np.isnan(want)
    if exact:
        np.testing.assert_array_equal(got[ok], want[ok])
    else:
        np.testing.assert_allclose(got[ok], want[ok], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("target", ["spinn", "llvm"])
@pytest.mark.parametrize("name", sorted(_OPS))
def test_specials_propagate_as_in_pytorch(name, target):
    """NaN, +-inf and signed zeros: NaN where PyTorch gives NaN (bitwise equal elsewhere for the
    exact ops; GEMM-based ones to rounding), offloaded to spinn and on the fallback's llvm."""
    fn, ref, shape, *consts = _OPS[name]
    consts = consts[0] if consts else ()
    x = _specials(shape)
    with torch.no_grad():
        want = ref(torch.from_numpy(x)).numpy()
    assert np.isnan(want).any()
    got = _build_run(fn, [x], target, consts)
    _nan_equal(got, want, exact=name in ("relu", "clip", "add_relu", "max_pool2d"))


def test_offloaded_and_fallback_agree_bit_for_bit():
    """The same operator gives the same bits, NaN payloads included, wherever it runs."""
    for name in ("relu", "clip", "max_pool2d"):
        fn, _, shape = _OPS[name][:3]
        x = _specials(shape, seed=1)
        x.view(np.uint32).reshape(-1)[::17] = 0x7FC01234  # a NaN with a payload
        a, b = _build_run(fn, [x], "spinn"), _build_run(fn, [x], "llvm")
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=name)


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_nan_or_inf_batch_gives_pytorchs_loss(loss, value):
    """A NaN (or an infinity, which a GEMM turns into inf - inf = NaN) in a training batch: the
    step's loss is NaN as PyTorch's, not a finite number."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Flatten(), torch.nn.Linear(64, 4))
    x = torch.randn(4, 1, 8, 8)
    y = torch.tensor([0, 1, 2, 3]) if loss == "cross_entropy" else torch.randn(4, 4)
    trainer = tvm_spinn.training.compile(model, (x,), loss=loss, optimizer=("sgd", {"lr": 0.1}))
    assert np.isfinite(trainer.step(x.numpy(), y.numpy()))
    x[1, 0, 2, 3] = float(value)
    with torch.no_grad():
        want = (_F.cross_entropy if loss == "cross_entropy" else _F.mse_loss)(model(x), y).item()
    got = trainer.step(x.numpy(), y.numpy())
    assert np.isnan(want) and np.isnan(got), (got, want)
