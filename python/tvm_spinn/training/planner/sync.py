"""The data-parallel gradient synchronisation after the pipeline and the optimizer update."""

from __future__ import annotations

import math

from ...timing.gemm import gemm_seconds
from .comms import _Comms
from .model import _gathered_params, _layer_params, _untouched_rows
from .records import F32, OPTIMIZERS, Split
from .slot import _resident_share


#: DRAM bytes per parameter of one optimizer update: read the weight, its gradient and the
#: state, write the weight and the state.
_UPDATE_BYTES = {name: F32 * (3 + 2 * k) for name, k in OPTIMIZERS.items()}


#: Element-wise operations per parameter of one update on the M4F (AdamW: the compiled update of
#: :mod:`tvm_spinn.training.adamw`, 14: the decay 1, the first moment 3, the second moment 4,
#: the denominator 3 and the step 3; SGD with momentum: velocity and step; SGD: the step)
_UPDATE_OPS = {"adamw": 14, "momentum": 4, "sgd": 2}


def _update_seconds(arch, optimizer: str, params: float) -> float:
    """One update of ``params`` parameters on a chip: its DRAM traffic or its element-wise work
    on the M4F cores, whichever is longer."""
    return max(_UPDATE_BYTES[optimizer] * params / arch.dram_bw_bytes_s,
               _UPDATE_OPS[optimizer] * params * arch.m4f_elementwise_cycles / (arch.pes_per_chip * arch.clock_hz))


def _bucket_tail(spec, split: Split, seq: int, optimizer: str, arch, comms: "_Comms", stage: int, params: int,
                 slot: dict, offset: float, weights: list, idle: float) -> tuple:
    """``(exposed synchronisation s, exposed update s)`` of block stage ``stage`` after the
    pipeline ends (ZeRO-0): its gradients all-reduced in buckets as the stage's last backward
    completes them, and each bucket updated as its reduction ends.

    The buckets, in the order the last backward completes them: each layer's projections (the
    last layer first; in a layer the backward's order, the last GEMM first; the layer's norms and
    biases with its first GEMM), then the stage's gathered tables' rows (embedding rows; the
    embedding's backward is the pass's last op). A projection's gradient is final when its
    weight-gradient GEMM of the last slot ends: the backward's time (``slot["drain"]``) is shared
    out over the GEMMs in proportion to their modelled time (the input and weight gradients';
    with ZB-H1's deferred weight-gradient pass the tables' rows are final at the end of the
    input-gradient pass, the projections one weight-gradient GEMM after another).

    The stage ends its last backward ``-offset`` seconds before the pipeline (the drain's
    pace, as for a head stage). Every bucket's all-reduce runs on the links, one after another,
    with every block stage's data-parallel groups at once (they share the links they meet);
    its update on the stage's cores, which are free once the stage's last pass ends. The
    tables' rows no step touches (GPT-2's positions from ``seq`` on) have a zero gradient:
    their update does not wait for the reduction, and runs in the stage's ``idle`` time within
    the pipeline (the fill and drain it waits through), what does not fit it at the end.
    The reduction's order per element is the chain's, whatever the buckets: no bit moves."""
    tp, pp, dp = split.tp, split.pp, split.dp
    layers = spec.layers // pp
    groups = split.grid().reshape(-1, dp)
    def seconds(m, k, n, b):  # as :func:`_pass_seconds` prices (and caches) them
        return comms._get(("gemm", m, k, n, b), lambda: gemm_seconds(arch, m, k, n, b))

    # each projection: (its input and weight gradients' seconds, its parameters, its weight gradient's)
    secs = [(seconds(m, n, k, b) + seconds(k, m, n, b), k * n * b, seconds(k, m, n, b)) for m, k, n, b in weights]
    per_layer = _layer_params(spec, tp)
    extra = per_layer - sum(n for _, n, _ in secs)  # norms and biases, with the layer's first GEMM
    tables = max(0, params - layers * per_layer)
    untouched = _untouched_rows(spec, seq, stage)
    deferred = split.zero_bubble
    total_t = layers * sum((w if deferred else t) for t, _, w in secs) or 1.0
    span = slot["drain"] if not deferred else min(slot["drain"], layers * sum(w for _, _, w in secs))
    buckets = []  # (ready s relative to the stage's end, parameters)
    done = 0.0
    for layer in range(layers):  # the last layer's backward first
        for g, (t, n, w) in reversed(list(enumerate(secs))):
            done += (w if deferred else t)
            n = n + (extra if g == 0 else 0)
            buckets.append((-span * (1 - done / total_t), n))
    buckets.append((-span if deferred else 0.0, tables - untouched))  # the tables' touched rows
    buckets.sort(key=lambda b: b[0])  # reduced in the order they are ready (stable: ties in the pass's order)
    link, cores = -math.inf, 0.0  # the cores compute the stage's passes until its end
    for ready, n in buckets:
        if n <= 0:
            continue
        start = max(ready, link)
        link = start + comms.collective("all_reduce", groups, F32 * n)
        cores = max(link, cores) + _update_seconds(arch, optimizer, n)
    cores += max(0.0, _update_seconds(arch, optimizer, untouched) - idle)
    streamed = params - _gathered_params(spec, split, stage)
    if 2 * F32 * streamed <= _resident_share(arch):
        cores += 2 * F32 * streamed / arch.dram_bw_bytes_s  # the resident weights loaded, gradients written back
    sync_end = max(0.0, link + offset)
    return sync_end, max(0.0, cores + offset - sync_end)
