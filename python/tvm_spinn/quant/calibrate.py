"""Calibration: run samples through an instrumented copy of the model and choose activation ranges.

The instrumented module's ``main`` returns every tensor that will be quantized; it is built with
``relax.build(..., target="llvm")`` (a plain llvm target offloads nothing) and run once per sample
(twice for histogram methods: a min/max pass fixes the histogram range, a second pass fills it).
All statistics are accumulated in float64 numpy, in sample order, so the result is deterministic.

Range -> (scale, zero point), math in float64, scales stored as float32 (see
:func:`activation_qparams`).
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

import tvm
from tvm import relax

from .scheme import QuantizationError, QuantScheme

LOG = logging.getLogger(__name__)

__all__ = [
    "InputSpec", "input_specs", "normalize_samples", "instrument", "collect_ranges",
    "percentile_range", "entropy_threshold", "activation_qparams",
]

PROGRESS_MIN_SAMPLES = 8  # show a tqdm bar above this many samples


class InputSpec:
    """Name, static shape and dtype of one parameter of ``main``."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str):
        self.name, self.shape, self.dtype = name, shape, dtype

    def __repr__(self):
        return f"{self.name}: {self.dtype}{list(self.shape)}"


def input_specs(func: relax.Function) -> list[InputSpec]:
    """The parameters of ``func``; static-shaped tensors are required."""
    specs = []
    for p in func.params:
        ty = p.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None or not hasattr(ty.shape, "values"):
            raise QuantizationError(f"input {p.name!r} of main is not a tensor with a known shape ({ty})")
        dims = []
        for d in ty.shape.values:
            if not isinstance(d, tvm.tirx.IntImm):
                raise QuantizationError(
                    f"input {p.name!r} has a dynamic shape {list(ty.shape.values)}: quantization needs static shapes"
                )
            dims.append(int(d))
        specs.append(InputSpec(p.name, tuple(dims), str(ty.dtype)))
    return specs


def _as_array(value):
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach"):  # torch.Tensor
        value = value.detach().cpu()
    if hasattr(value, "numpy"):
        return np.asarray(value.numpy())
    return np.asarray(value)


def normalize_samples(calibration_data, specs: Sequence[InputSpec]) -> list[list[np.ndarray]]:
    """Each calibration sample as a list of arrays in parameter order, validated.

    A sample is a dict ``{input name: array}``, a list/tuple of arrays in parameter order, or
    (one-input models) a single array. ``calibration_data`` is an iterable of samples; a dict or
    an array of exactly the input's shape is taken as one sample, and an array with one more
    leading axis as a stack of samples.

    Raises
    ------
    QuantizationError
        No samples; unknown or missing input names; wrong number of arrays; an array whose
        shape or dtype differs from the input's (the message names the input, expected and got).
    """
    names = [s.name for s in specs]
    if calibration_data is None:
        raise QuantizationError("calibration_data is None: pass an iterable of samples")
    if isinstance(calibration_data, dict):
        calibration_data = [calibration_data]
    elif isinstance(calibration_data, np.ndarray) or hasattr(calibration_data, "detach"):
        arr = _as_array(calibration_data)
        if len(specs) != 1:
            raise QuantizationError(
                f"calibration_data is a single array but the model has {len(specs)} inputs {names}: "
                "pass an iterable of dicts or tuples"
            )
        if tuple(arr.shape) == specs[0].shape:
            calibration_data = [arr]
        elif arr.ndim == len(specs[0].shape) + 1 and tuple(arr.shape[1:]) == specs[0].shape:
            calibration_data = list(arr)
        else:
            raise QuantizationError(
                f"calibration_data for input {names[0]!r}: expected an array of shape {list(specs[0].shape)} "
                f"or a stack [N, {', '.join(map(str, specs[0].shape))}], got shape {list(arr.shape)}"
            )
    try:
        iterator = iter(calibration_data)
    except TypeError:
        raise QuantizationError(
            f"calibration_data must be an iterable of samples, got {type(calibration_data).__name__}"
        ) from None
    samples = []
    for idx, sample in enumerate(iterator):
        if isinstance(sample, dict):
            unknown = [k for k in sample if k not in names]
            if unknown:
                raise QuantizationError(
                    f"calibration sample {idx}: unknown input name(s) {unknown}; the model's inputs are {names}"
                )
            missing = [n for n in names if n not in sample]
            if missing:
                raise QuantizationError(f"calibration sample {idx}: missing input(s) {missing}")
            arrays = [sample[n] for n in names]
        elif isinstance(sample, (list, tuple)):
            if len(sample) != len(specs):
                raise QuantizationError(
                    f"calibration sample {idx}: {len(sample)} arrays for {len(specs)} inputs {names}"
                )
            arrays = list(sample)
        else:
            if len(specs) != 1:
                raise QuantizationError(
                    f"calibration sample {idx} is a single {type(sample).__name__} but the model has "
                    f"{len(specs)} inputs {names}: use a dict or a tuple"
                )
            arrays = [sample]
        out = []
        for spec, value in zip(specs, arrays):
            try:
                arr = _as_array(value)
            except Exception as err:  # noqa: BLE001 - report what could not be converted
                raise QuantizationError(
                    f"calibration sample {idx}, input {spec.name!r}: cannot convert "
                    f"{type(value).__name__} to an array ({err})"
                ) from None
            if tuple(arr.shape) != spec.shape or str(arr.dtype) != spec.dtype:
                raise QuantizationError(
                    f"calibration sample {idx}, input {spec.name!r}: expected {spec.dtype} of shape "
                    f"{list(spec.shape)}, got {arr.dtype} of shape {list(arr.shape)}"
                )
            out.append(np.ascontiguousarray(arr))
        samples.append(out)
    if not samples:
        raise QuantizationError("calibration_data has no samples: pass at least one")
    return samples


# -- instrumented module ----------------------------------------------------------------------

def instrument(mod: tvm.IRModule, targets: Sequence[relax.Var]) -> tvm.IRModule:
    """A copy of ``mod`` whose ``main`` returns the tuple of ``targets``.

    ``targets`` are parameters of ``main`` or variables bound in its body (dataflow variables
    included: the copy is converted out of dataflow form so they are visible at the end).
    """
    func = mod["main"]
    params = list(func.params)
    where = []
    positions = {}
    for bi, block in enumerate(func.body.blocks):
        for ji, binding in enumerate(block.bindings):
            positions[binding.var] = (bi, ji)
    for t in targets:
        if any(t.same_as(p) for p in params):
            where.append(("param", next(i for i, p in enumerate(params) if t.same_as(p))))
        else:
            where.append(("binding",) + positions[t])
    flat = relax.transform.ToNonDataflow()(tvm.IRModule({"main": func}))["main"]
    blocks = list(flat.body.blocks)
    assert [len(b.bindings) for b in blocks] == [len(b.bindings) for b in func.body.blocks]
    outs = []
    for w in where:
        if w[0] == "param":
            outs.append(flat.params[w[1]])
        else:
            outs.append(blocks[w[1]].bindings[w[2]].var)
    body = relax.SeqExpr(blocks, relax.Tuple(outs))
    new = relax.Function(flat.params, body, relax.TupleType([o.ty for o in outs]), flat.is_pure, flat.attrs)
    new = relax.BlockBuilder().normalize(new)
    return tvm.IRModule({"main": new})


# -- range selection --------------------------------------------------------------------------

def percentile_range(hist: np.ndarray, lo: float, hi: float, percentile: float, signed: bool):
    """Clipping range from a histogram.

    ``signed=True``: ``hist`` covers ``[lo, hi]`` and the range is the ``(100 - p)``-th and
    ``p``-th percentiles. ``signed=False``: ``hist`` is of ``|x|`` over ``[0, hi]`` and the range
    is ``(-t, t)`` with ``t`` its ``p``-th percentile. Percentiles are interpolated linearly inside
    a bin; results never exceed the observed extremes.
    """
    hist = hist.astype(np.float64)
    total = hist.sum()
    if total <= 0 or hi <= lo:
        return lo, hi
    edges = np.linspace(lo, hi, len(hist) + 1)
    cdf = np.concatenate([[0.0], np.cumsum(hist)]) / total

    def at(q):
        i = int(np.searchsorted(cdf, q, side="left"))
        i = min(max(i, 1), len(hist))
        c0, c1 = cdf[i - 1], cdf[i]
        frac = 0.0 if c1 <= c0 else (q - c0) / (c1 - c0)
        return float(edges[i - 1] + frac * (edges[i] - edges[i - 1]))

    p = percentile / 100.0
    if p >= 1.0:
        return (lo, hi) if signed else (-hi, hi)
    if signed:
        return max(lo, at(1.0 - p)), min(hi, at(p))
    t = min(hi, at(p))
    return -t, t


def entropy_threshold(hist: np.ndarray, amax: float, levels: int = 128) -> float:
    """TensorRT-style KL-divergence threshold for a histogram of ``|x|`` over ``[0, amax]``.

    For each candidate ``i`` bins (``levels <= i <= len(hist)``) the reference distribution
    ``P`` is the first ``i`` bins with everything beyond folded into bin ``i - 1``; ``Q`` merges
    the first ``i`` bins into ``levels`` groups and spreads each group's mass evenly over its
    non-empty bins. The threshold is the upper edge of the ``i`` minimising ``KL(P || Q)``
    (ties: the smallest ``i``). Empty ``Q`` bins where ``P > 0`` are floored at ``1e-12``.
    :func:`collect_ranges` leaves exact zeros out of the histogram: they are quantized exactly
    at any scale, and a ReLU's mass at 0 would otherwise pull the threshold far down.
    """
    hist = hist.astype(np.float64)
    nbins = len(hist)
    if amax <= 0 or hist.sum() <= 0 or nbins <= levels:
        return float(amax)
    width = amax / nbins
    suffix = np.concatenate([np.cumsum(hist[::-1])[::-1], [0.0]])  # suffix[i] = sum(hist[i:])
    best_i, best_kl = nbins, np.inf
    for i in range(levels, nbins + 1):
        sliced = hist[:i]
        p = sliced.copy()
        p[-1] += suffix[i]
        # Group boundaries: `levels` groups of i // levels bins, the last takes the remainder.
        step = i // levels
        starts = np.arange(levels) * step
        sums = np.add.reduceat(sliced, starts)
        nonzero = (sliced != 0).astype(np.float64)
        counts = np.add.reduceat(nonzero, starts)
        group = np.minimum(np.arange(i) // step, levels - 1)
        avg = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
        q = avg[group] * nonzero
        psum, qsum = p.sum(), q.sum()
        if qsum <= 0:
            continue
        mask = p > 0
        pn = p[mask] / psum
        qn = np.maximum(q[mask] / qsum, 1e-12)
        kl = float(np.sum(pn * np.log(pn / qn)))
        if kl < best_kl:
            best_kl, best_i = kl, i
    return float(best_i * width)


def activation_qparams(lo: float, hi: float, dtype: str, symmetric: bool) -> tuple[np.float32, int]:
    """Scale and zero point of an activation range ``[lo, hi]``.

    The range is first widened to include 0 (``lo <= 0 <= hi``) so zero is exact. Then, in
    float64:

    - asymmetric int8: ``scale = (hi - lo) / 255``, ``zero = clamp(round(-lo / scale) - 128, -128, 127)``;
    - asymmetric uint8: ``scale = (hi - lo) / 255``, ``zero = clamp(round(-lo / scale), 0, 255)``;
    - symmetric: ``scale = max(|lo|, |hi|) / 127``, ``zero = 0`` (int8) or ``128`` (uint8).

    ``round`` is round-half-to-even. The scale is stored as float32 and the zero point is computed
    from that stored value. An empty range (all zeros) gets ``scale = 1.0``.
    Quantization is then ``q = clamp(round(x / scale) + zero)``, ``x' = (q - zero) * scale``.
    """
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise QuantizationError(f"non-finite activation range [{lo}, {hi}]")
    qmin, qmax = (-128, 127) if dtype == "int8" else (0, 255)
    if symmetric:
        scale = max(-lo, hi) / 127.0
    else:
        scale = (hi - lo) / 255.0
    scale32 = np.float32(scale)
    if not (scale32 > 0 and np.isfinite(scale32)):
        scale32 = np.float32(1.0)
    if symmetric:
        zero = 0 if dtype == "int8" else 128
    else:
        zero = int(np.round(-lo / np.float64(scale32))) + qmin
        zero = min(max(zero, qmin), qmax)
    return scale32, zero


# -- statistics -------------------------------------------------------------------------------

def _progress(items, desc):
    if len(items) <= PROGRESS_MIN_SAMPLES:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="sample", leave=False)


def _run_all(vm, samples, desc):
    for sample in _progress(samples, desc):
        outs = vm["main"](*[tvm.runtime.tensor(a) for a in sample])
        yield [o.numpy() for o in outs]


def _refuse_empty_ranges(mod: tvm.IRModule, samples: list[list[np.ndarray]],
                         labels: Sequence[str], lo: np.ndarray, hi: np.ndarray) -> None:
    """Raise when a calibrated tensor never varies: its scale would be arbitrary.

    With all-zero (or otherwise constant) calibration data every activation is constant, the
    range ``[v, v]`` says nothing about real inputs, and the int8 model's error is of the order
    of the whole output range. The message names the first such tensor and the model inputs
    that do not vary across the samples (the usual cause)."""
    empty = [i for i in range(len(labels)) if lo[i] == hi[i]]
    if not empty:
        return
    names = [p.name for p in mod["main"].params]

    def varies(j: int) -> bool:
        values = np.concatenate([np.asarray(sample[j]).ravel() for sample in samples])
        return values.size > 0 and values.min() != values.max()

    constant = [name for j, name in enumerate(names) if j < len(samples[0]) and not varies(j)]
    i = empty[0]
    more = f" (and {len(empty) - 1} more tensor(s))" if len(empty) > 1 else ""
    where = f"the {labels[i]} is constant ({lo[i]:g}) over all {len(samples)} sample(s){more}"
    if not constant:
        # The inputs vary but this tensor does not (a dead ReLU, a zero-initialised branch):
        # a real property of the model, quantized with the zero-range fallback scale.
        LOG.warning("calibration: %s although the inputs vary; it is quantized with scale 1",
                    where)
        return
    raise QuantizationError(
        f"calibration: {where}, so its quantization range is empty: calibration input(s) "
        f"{constant} hold one constant value in every sample. Calibrate with representative "
        "inputs (not all zeros).")


def collect_ranges(mod: tvm.IRModule, targets: Sequence[relax.Var], labels: Sequence[str],
                   samples: list[list[np.ndarray]], scheme: QuantScheme) -> list[tuple[float, float]]:
    """Clipping range ``(lo, hi)`` of each target tensor over the calibration samples.

    ``labels`` name the targets in error messages (e.g. ``"input of conv2d_1"``).
    """
    if not targets:
        return []
    from ..fallback import check_take_indices

    # calibration samples are user inputs: an id past an embedding table is an IndexError here
    ex = relax.build(check_take_indices(instrument(mod, targets)), target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    n = len(targets)
    lo = np.full(n, np.inf)
    hi = np.full(n, -np.inf)
    for outs in _run_all(vm, samples, "calibrating (min/max)"):
        for i, arr in enumerate(outs):
            if not np.all(np.isfinite(arr)):
                raise QuantizationError(f"calibration: the {labels[i]} has non-finite values")
            lo[i] = min(lo[i], float(arr.min()))
            hi[i] = max(hi[i], float(arr.max()))
    _refuse_empty_ranges(mod, samples, labels, lo, hi)
    if scheme.calibration == "minmax":
        return [(float(a), float(b)) for a, b in zip(lo, hi)]

    # Histogram pass. Signed histograms over [lo, hi] for asymmetric percentile ranges, |x|
    # histograms over [0, max|x|] otherwise (symmetric percentile, entropy).
    signed = scheme.calibration == "percentile" and not scheme.symmetric_activations
    bins = scheme.num_bins
    hists = np.zeros((n, bins), dtype=np.float64)
    spans = [(lo[i], hi[i]) if signed else (0.0, max(-lo[i], hi[i])) for i in range(n)]
    for outs in _run_all(vm, samples, f"calibrating ({scheme.calibration})"):
        for i, arr in enumerate(outs):
            a, b = spans[i]
            if b <= a:
                continue
            x = arr.astype(np.float64).ravel() if signed else np.abs(arr.astype(np.float64)).ravel()
            if scheme.calibration == "entropy":
                # Exact zeros (e.g. after ReLU) are represented exactly at any scale; left in bin 0
                # they dominate the KL terms of the first group and pull the threshold down.
                x = x[x != 0]
            hists[i] += np.histogram(x, bins=bins, range=(a, b))[0]
    out = []
    for i in range(n):
        a, b = spans[i]
        if b <= a:
            out.append((float(lo[i]), float(hi[i])))
            continue
        if scheme.calibration == "percentile":
            r = percentile_range(hists[i], a, b, scheme.percentile, signed)
            r = (max(float(lo[i]), r[0]), min(float(hi[i]), r[1]))
        else:
            nonneg = lo[i] >= 0 and not scheme.symmetric_activations
            t = entropy_threshold(hists[i], b, levels=256 if nonneg else 128)
            r = (max(float(lo[i]), -t), min(float(hi[i]), t))
        out.append(r)
    return out
