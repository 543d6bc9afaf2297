"""The data-parallel gradient synchronisation after the pipeline and the optimizer update."""

from __future__ import annotations

import math

import numpy as np

from .comms import _Comms
from .model import _gathered_params, _layer_params, _position_rows, _stage_params, _untouched_rows
from .records import F32, OPTIMIZERS, Split
from .slot import _pass_seconds, _resident_share


#: DRAM bytes per parameter of one optimizer update: read the weight, its gradient and the
#: state, write the weight and the state.
_UPDATE_BYTES = {name: F32 * (3 + 2 * k) for name, k in OPTIMIZERS.items()}


#: DRAM bytes per parameter of an update whose weight and gradient are in the PEs' tile SRAM (a
#: stage's resident weights, :func:`~.slot._resident_share`): only the state is read and
#: written; the weight is updated where it is and stays there for the next step's passes.
_STATE_BYTES = {name: F32 * 2 * k for name, k in OPTIMIZERS.items()}


#: Element-wise operations per parameter of one update on the M4F (AdamW: the compiled update of
#: :mod:`tvm_spinn.training.adamw`, 14: the decay 1, the first moment 3, the second moment 4,
#: the denominator 3 and the step 3; SGD with momentum: velocity and step; SGD: the step)
_UPDATE_OPS = {"adamw": 14, "momentum": 4, "sgd": 2}


def _update_seconds(arch, optimizer: str, params: float, resident: float = 0.0) -> float:
    """One update of ``params`` parameters on a chip: its DRAM traffic or its element-wise work
    on the M4F cores, whichever is longer. ``resident`` of them have their weight and gradient
    in the tile SRAM (a stage whose weights fit its resident share): their update reads and
    writes only the optimizer state in DRAM (:data:`_STATE_BYTES`); each PE updates the weights
    it holds, and the element-wise work is the same wherever the operands are."""
    dram = _UPDATE_BYTES[optimizer] * (params - resident) + _STATE_BYTES[optimizer] * resident
    return max(dram / arch.dram_bw_bytes_s,
               _UPDATE_OPS[optimizer] * params * arch.m4f_elementwise_cycles / (arch.pes_per_chip * arch.clock_hz))


def _stream_end(start: float, seconds: float, free: float) -> float:
    """When a transfer of ``seconds`` (on links of its own) that starts at ``start`` ends, where
    before time 0 the links carry it only in their ``free`` share (the rest of their time goes
    to the pipeline's own collectives and hand-overs) and from 0 on in full."""
    if start >= 0.0:
        return start + seconds
    inside = -start * free  # the transfer's seconds the free share carries before 0
    if seconds <= inside:
        return start + (seconds / free if seconds > 0.0 else 0.0)
    return seconds - inside


def _bucket_tail(spec, split: Split, seq: int, optimizer: str, arch, comms: "_Comms", stage: int, params: int,
                 slot: dict, offset: float, weights: list, idle: float, groups: np.ndarray, before: tuple = (),
                 free: float = 0.0) -> tuple:
    """``(exposed synchronisation s, exposed update s, the reductions' end s)`` of block stage
    ``stage`` after the pipeline ends (the last: when its last reduction ends, before its
    updates and gathers; relative to the pipeline's end): its gradients reduced in buckets as the stage's last backward completes them,
    and each bucket updated as its reduction ends.

    The buckets, in the order the last backward completes them: each layer's projections (the
    last layer first; in a layer the backward's order, the last GEMM first; the layer's norms and
    biases with its first GEMM), then the stage's gathered tables' rows (embedding rows; the
    embedding's backward is the pass's last op). A projection's gradient is final when its
    weight-gradient GEMM of the last slot ends: the backward's time (``slot["drain"]``) is shared
    out over the GEMMs in proportion to their modelled time (the input and weight gradients';
    with ZB-H1's deferred weight-gradient pass the tables' rows are final at the end of the
    input-gradient pass, the projections one weight-gradient GEMM after another).

    The stage ends its last backward ``-offset`` seconds before the pipeline (the drain's
    pace, as for a head stage). Every bucket's reduction runs on the links, one after another,
    over the stage's data-parallel ``groups``; its update on the stage's cores, which are free
    once the stage's last pass ends. ZeRO-0 all-reduces a bucket and updates it whole; ZeRO-1
    and ZeRO-2 reduce-scatter it, update the rank's shard and all-gather the updated bucket, the
    gathers on the links after the last bucket's reduce-scatter (each once its update has
    ended). The links first carry the work ``before`` (``(ready s, seconds)`` relative to the
    stage's end: the other stages' reductions, which end earlier in the drain, and ZeRO-2's
    earlier micro-batches', :func:`_staggered_tail`), one item after another as it is ready,
    before the stage's end in the ``free`` share the pipeline's slots leave them
    (:func:`_stream_end`).

    The tables' rows no step touches (GPT-2's positions from ``seq`` on) have a zero gradient:
    their update does not wait for the reduction, and runs in the stage's ``idle`` time within
    the pipeline (the fill and drain it waits through), what does not fit it at the end.
    The reduction's order per element is the chain's, whatever the buckets: no bit moves."""
    tp, pp, dp = split.tp, split.pp, split.dp
    layers = spec.layers // pp
    sharded = split.zero >= 1

    def passes(g):  # (input gradient, weight gradient) seconds, as the stage's slot prices them
        return _pass_seconds(arch, [g], comms, slot["fits"])[1:]

    def shard(n: int) -> int:  # parameters of ``n`` a rank updates
        return -(-n // dp) if sharded else n

    # each projection: (its input and weight gradients' seconds, its parameters, its weight gradient's)
    secs = [(sum(passes(g)), g[1] * g[2] * g[3], passes(g)[1]) for g in weights]
    per_layer = _layer_params(spec, tp)
    extra = per_layer - sum(n for _, n, _ in secs)  # norms and biases, with the layer's first GEMM
    tables = max(0, params - layers * per_layer)
    untouched = _untouched_rows(spec, seq, stage, _position_rows(split, seq))
    deferred = split.zero_bubble
    total_t = layers * sum((w if deferred else t) for t, _, w in secs) or 1.0
    span = slot["drain"] if not deferred else min(slot["drain"], layers * sum(w for _, _, w in secs))
    # the projections' weights and gradients stay in SRAM from the first slot to the update
    # where the stage's fit its resident share (``slot["fits"]``): their buckets update from
    # there; the tables' gathered rows are in DRAM
    resident = 2 * F32 * (params - _gathered_params(spec, split, stage)) <= _resident_share(arch)
    buckets = []  # (ready s relative to the stage's end, parameters, whether in SRAM)
    done = 0.0
    for layer in range(layers):  # the last layer's backward first
        for g, (t, n, w) in reversed(list(enumerate(secs))):
            done += (w if deferred else t)
            n = n + (extra if g == 0 else 0)
            buckets.append((-span * (1 - done / total_t), n, resident))
    buckets.append((-span if deferred else 0.0, tables - untouched, False))  # the tables' touched rows
    buckets.sort(key=lambda b: b[0])  # reduced in the order they are ready (stable: ties in the pass's order)
    link, cores = -math.inf, 0.0  # the cores compute the stage's passes until its end
    for ready, busy in sorted(before):
        link = _stream_end(max(ready, link), busy, free)
    updated = []  # (the bucket's update's end, its parameters)
    for ready, n, in_sram in buckets:
        if n <= 0:
            continue
        start = max(ready, link)
        link = start + comms.collective("reduce_scatter" if sharded else "all_reduce", groups, F32 * n)
        cores = max(link, cores) + _update_seconds(arch, optimizer, shard(n), shard(n) if in_sram else 0)
        updated.append((cores, n))
    reduced = link  # the last bucket's reduction ends
    for end, n in (updated if sharded else ()):  # ZeRO-1/2: the updated buckets gathered
        link = max(link, end) + comms.collective("all_gather", groups, F32 * n)
    cores += max(0.0, _update_seconds(arch, optimizer, shard(untouched)) - idle)
    sync_end = max(0.0, link + offset)
    return sync_end, max(0.0, cores + offset - sync_end), reduced + offset


def _staggered_tail(spec, split: Split, seq: int, optimizer: str, arch, comms: "_Comms", block: list,
                    per_stage: dict, per: float, weights: list, idle: float) -> tuple:
    """``(exposed synchronisation s, exposed update s, the reductions' end s)`` after the
    pipeline ends (:func:`_bucket_tail`) of the block stages' data-parallel reductions, each stage's in buckets as its last backward completes
    them (:func:`_bucket_tail`) and the stages' one after another as 1F1B's drain ends them.

    Block stage ``j``'s last backward ends ``j`` backward passes before the first stage's (at
    least the block stages' backward each: ``pace``), so the stages' reductions start in turn,
    the last stage's first. Each shares the links with those still running: every stage's
    data-parallel groups are a translate of the others' (the same replicas, ``tp`` chips over),
    so each other stage adds ``1 / (pp - 1)`` of what all of them add to the busiest link's
    busy time over one stage's reduction alone (:meth:`_Comms.collective_parts`; nothing where
    the stages' groups meet on no link); a stage's own buckets are costed over its groups alone
    (the first stage's groups: the others' are translates of them),
    after the earlier stages' parts (:func:`_stream_end`, in the links' ``free`` share before
    the stage's end: what its steady slots leave them). The second stage, which the drain ends
    just before the first, is priced too (its reduction has one stage fewer before it, but one
    drain pace less to run in). ZeRO-2 also reduce-scatters
    every earlier micro-batch's gradients during the pipeline, every stage's at once (the
    last backward of micro-batch ``m - i`` ends ``i`` micro-batches' slots before the stage's).
    The reductions' order per element is the chain's, whatever the schedule: no bit moves."""
    pp, dp, zero = split.pp, split.dp, split.zero
    grid = split.grid()
    every = grid.reshape(-1, dp)
    op = "reduce_scatter" if zero else "all_reduce"
    touched = max(n - _untouched_rows(spec, seq, j, _position_rows(split, seq)) for n, j in block)

    def cost(groups: np.ndarray, nbytes: float) -> tuple:  # (seconds, busy) of a reduction (and gather)
        s = comms.collective_parts(op, groups, nbytes)
        return tuple(np.add(s, comms.collective_parts("all_gather", groups, nbytes))) if zero else s

    # what the other stages' reductions add to the busiest link of one stage's (none where the
    # stages' groups meet on no link), one stage's part of it
    # one stage's groups: the first's (the others' are translates of them, costed the same)
    groups = np.ascontiguousarray(grid[:, 0, :])
    alone = cost(groups, F32 * touched)
    share = max(0.0, cost(every, F32 * touched)[1] - alone[1]) / max(1, pp - 1)
    pace = min(per_stage[j]["drain"] for _, j in block)
    period = split.chunks * per  # one micro-batch's slots
    scatter = comms.collective_parts("reduce_scatter", every, F32 * touched)[1] if zero == 2 else 0.0
    tails = []
    # the first and last block stage, and the second, which ends just before the first in the
    # drain (the middle stages' slots and parameters are the last's but for the head's rows)
    for j in sorted({j for _, j in block} | ({1} if pp > 2 else set())):
        n = _stage_params(spec, split.tp, pp, j, split.head_tp, split.spread_head)
        slot = per_stage[j] if j in per_stage else per_stage[pp - 1]
        free = max(0.0, 1.0 - slot["links"] / per)
        later = [(-(k - j) * pace, share) for k in range(pp - 1, j, -1)]  # stages that end before it
        micro = [(-i * period, scatter) for i in range(split.micro_batches - 1, 0, -1)] if zero == 2 else []
        tails.append(_bucket_tail(spec, split, seq, optimizer, arch, comms, j, n, slot, -j * pace, weights,
                                  idle, groups, tuple(later + micro), free))
    return max(tails, key=lambda tail: tail[0] + tail[1])
