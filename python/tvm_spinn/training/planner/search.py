"""The split search: every split that fits, costed by branch and bound; :func:`plan_training`."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import os
import time

from .axes import _arch_of, _axes, _divisors, _positive
from .comms import _Comms
from .fit import _does_not_fit, smallest_system
from .memory import _peak_bytes, memory_per_chip
from .model import _attention_at, _block_gemms, _gathered_params, _spec, _stage_params, _widths, model_flops
from .records import (DEFAULT_GLOBAL_BATCH, DEFAULT_SEQ, F32, HEAD_LAGS, LAYOUTS, OPTIMIZERS, Split, TrainingPlan,
                      TrainingPlanError)
from .slot import _fresh_attention, _pass_seconds, _resident_share, _shared_pes_saving
from .step import _step_time
from .timeline import charge_chunk_order


def plan_training(config, system="spinn/board", *, seq: "int | None" = None, global_batch: "int | None" = None,
                  micro_batch: "int | None" = None, optimizer: str = "adamw", tp: "int | None" = None,
                  pp: "int | None" = None, dp: "int | None" = None, zero: "int | None" = None,
                  recompute: "bool | None" = None, sequence_parallel: bool = True,
                  reproducible: bool = True, min_chunk_tokens: int = 1) -> TrainingPlan:
    """Plan fp32 training of a transformers model (config only) on a spinn system.

    Parameters
    ----------
    config : str, dict, transformers config or model
        A ``config.json`` path (``model_type`` ``llama`` or ``gpt2``), its dict or a config
        object (:func:`tvm_spinn.llm.spec_of`).
    system : str or SpinnArch
        A spinn target (``spinn``, ``spinn/board``, ``spinn/cloud``, a registered system) or a
        :class:`~tvm_spinn.target.arch.SpinnArch` (e.g. ``make_system(boards=24)``).
    seq : int, optional
        Tokens per sequence; default :data:`DEFAULT_SEQ` or the model's positions where fewer.
    global_batch : int, optional
        Sequences per step (default :data:`DEFAULT_GLOBAL_BATCH`).
    micro_batch : int, optional
        Sequences per micro-batch; searched when not given.
    optimizer : {"adamw", "momentum", "sgd"}
        AdamW (two fp32 moments), SGD with momentum (one), plain SGD (none).
    tp, pp, dp : int, optional
        Tensor, pipeline and data parallel sizes; each searched when not given.
    zero : {0, 1, 2}, optional
        ZeRO stage (optimizer state, then gradients sharded over ``dp``); searched when not given.
    recompute : bool, optional
        Full activation recomputation; searched when not given.
    sequence_parallel : bool
        Megatron's sequence parallelism (Korthikanti et al. 2022) with ``tp > 1``: the norms,
        the residual stream and the blocks' inputs split over the sequence on the TP ranks.
    reproducible : bool
        Reductions in the fixed order whatever the split (tree collectives); ``False`` lets the
        cost model take the faster ring.
    min_chunk_tokens : int
        Fewest tokens of a sequence in a pipeline chunk the search considers (default 1: every
        power-of-two cut of the sequence; the cost model prices what small chunks cost, so a
        larger value only narrows the search, e.g. to plan faster).

    Returns
    -------
    TrainingPlan
        The fastest split that fits the chips' DRAM (ties: fewer chips).

    Raises
    ------
    LLMError
        An unknown ``model_type`` or a config field out of range (naming the field).
    TrainingPlanError
        A bad argument or a split that does not divide (naming the axis and the sizes that
        would), or a model that fits no split of the system (naming the smallest system that
        holds it: :attr:`TrainingPlanError.smallest_chips` / ``smallest_boards``).
    """
    start = time.perf_counter()
    spec = _spec(config)
    from ...llm.spec import _as_dict

    cfg = _as_dict(config) if not isinstance(config, (str, os.PathLike)) else {}
    model = (os.path.splitext(os.path.basename(os.fspath(config)))[0] if isinstance(config, (str, os.PathLike))
             else str(cfg.get("_name_or_path") or spec.family))
    if optimizer not in OPTIMIZERS:
        raise TrainingPlanError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    if zero is not None and (isinstance(zero, bool) or zero not in (0, 1, 2)):
        raise TrainingPlanError(f"zero must be 0, 1 or 2, got {zero!r}")
    if recompute is not None and not isinstance(recompute, bool):
        raise TrainingPlanError(f"recompute must be True, False or None (searched), got {recompute!r}")
    for name, value in (("reproducible", reproducible), ("sequence_parallel", sequence_parallel)):
        if not isinstance(value, bool):
            raise TrainingPlanError(f"{name} must be True or False, got {value!r}")
    if seq is None:
        seq = min(DEFAULT_SEQ, spec.max_positions)
    seq = _positive("seq", seq, allow_none=False)
    if seq > spec.max_positions:
        raise TrainingPlanError(f"seq={seq} is more than the model's {spec.max_positions} positions")
    global_batch = _positive("global_batch", DEFAULT_GLOBAL_BATCH if global_batch is None else global_batch,
                             allow_none=False)
    min_chunk_tokens = _positive("min_chunk_tokens", min_chunk_tokens, allow_none=False)
    tp, pp, dp, micro_batch = (_positive(n, v) for n, v in (("tp", tp), ("pp", pp), ("dp", dp),
                                                            ("micro_batch", micro_batch)))
    if micro_batch is not None and global_batch % micro_batch:
        raise TrainingPlanError(f"micro_batch={micro_batch} does not divide the global batch ({global_batch} "
                                f"sequences); micro_batch may be one of {_divisors(global_batch)}")
    arch, system_name = _arch_of(system)
    tps, pps, dps = _axes(spec, global_batch, tp, pp, dp, micro_batch)
    capacity = arch.dram_bytes
    if tp and pp and dp and tp * pp * dp > arch.chips:
        raise TrainingPlanError(f"tp {tp} x pp {pp} x dp {dp} = {tp * pp * dp} chips, more than the "
                                f"{arch.chips} of {system_name}")
    zeros = [zero] if zero is not None else [0, 1, 2]
    recomputes = [recompute] if recompute is not None else [False, True]
    comms = _Comms(arch, reproducible)
    # every split that fits, ordered by its compute alone (a lower bound of its step), so the
    # search costs the collectives of the promising ones only
    candidates = []
    for t in tps:
        for p in pps:
            for d in dps:
                if t * p * d > arch.chips:
                    continue
                per_replica = global_batch // d
                for mb in ([micro_batch] if micro_batch else _divisors(per_replica)):
                    if per_replica % mb:
                        continue
                    for z in (zeros if d > 1 else [zeros[0] if zero is not None else 0]):
                        for r in recomputes:
                            for k in (_chunk_counts(seq, min_chunk_tokens) if p > 1 else (1,)):
                                for (h, spread, lag), zb in itertools.product(
                                        _head_options(spec, t, p, d, arch.chips), (False, True)):
                                    if lag >= per_replica // mb * k:
                                        continue  # the head runs behind at most the other slots
                                    if zb and (p + (h > 0) < 2 or per_replica // mb * k < 2):
                                        continue  # nothing to defer into: one stage, or one slot
                                    split = Split(t, p, d, z, mb, per_replica // mb, r, sequence_parallel, k,
                                                  LAYOUTS[0], h, spread, lag, zb)
                                    # memory and the compute floor do not depend on the chip order
                                    if _peak_bytes(spec, split, seq, optimizer) > capacity:
                                        continue
                                    floor = _compute_floor(spec, split, seq, arch, comms)
                                    key = _split_key(split)
                                    for order in (LAYOUTS[:1] if d == 1 else LAYOUTS if p > 1 or h else LAYOUTS[::2]):
                                        # the split in this chip order is made when it is costed
                                        candidates.append((floor, split.chips, key[:9] + (order,) + key[10:], split,
                                                           order))
    if not candidates:
        found = smallest_system(spec, arch, global_batch, seq, optimizer, tp=tp, pp=pp, dp=dp, zero=zero,
                                micro_batch=micro_batch, recompute=recompute, sequence_parallel=sequence_parallel)
        fixed = ", ".join(f"{k}={v}" for k, v in (("tp", tp), ("pp", pp), ("dp", dp), ("zero", zero),
                                                  ("micro_batch", micro_batch), ("recompute", recompute))
                          if v is not None)
        raise _does_not_fit(model, system_name, arch, found, f" with {fixed}" if fixed else "")
    candidates.sort(key=lambda c: c[:3])
    # branch and bound: a split's step with every collective costed for one group alone (no
    # other group on its links) is a lower bound of its step with all groups at once, and far
    # cheaper; splits are costed in full in the order of that bound until none can be faster
    alone = _Comms(arch, reproducible, alone=True, shared=comms)
    best, costed, queue, search = None, 0, [], {}

    def settle(limit: float):
        nonlocal best, costed
        while queue and queue[0][0] < limit and (best is None or queue[0][0] < best[0]):
            bound, _, _, split, mem = heapq.heappop(queue)
            step = _step_time(spec, split, seq, optimizer, arch, comms)
            key = (step.total_s, split.chips, _split_key(split))
            if best is None or key < best[:3]:
                # a chunked split's pipeline in the order the bits fix: at least its term, so the
                # bound holds, and a split already slower than the best needs no timeline
                step = charge_chunk_order(split, step)
                key = (step.total_s, *key[1:])
            search[split] = (split, bound, step.total_s)
            costed += 1
            if best is None or key < best:
                best = (*key, step, split, mem)

    for floor, chips, _, split, order in candidates:
        mem = None
        split = split if split.layout == order else dataclasses.replace(split, layout=order)
        settle(floor)
        if best is not None and floor >= best[0]:
            break  # sorted by floor: nothing later can be faster
        bound = _step_time(spec, split, seq, optimizer, arch, alone).total_s
        search[split] = (split, bound, None)
        if best is None or bound < best[0]:
            heapq.heappush(queue, (bound, chips, _split_key(split), split, mem))
    settle(math.inf)
    step, split, _ = best[3:]
    mem = memory_per_chip(spec, split, seq, optimizer, capacity)
    from ...timing.training_bound import training_bound

    tokens = global_batch * seq
    bound = training_bound(spec, tokens, seq, optimizer, arch)
    flops = model_flops(spec, tokens, seq)
    peak_used = 2.0 * arch.m4f_flops_per_cycle * arch.clock_hz * arch.pes_per_chip * split.chips
    return TrainingPlan(
        model=model, system=system_name, chips=arch.chips, params=spec.params, seq=seq, global_batch=global_batch,
        optimizer=optimizer, reproducible=reproducible, split=split, memory=mem, step=step,
        flops_per_step=float(flops), executed_flops_per_step=float(model_flops(spec, tokens, seq, split.recompute, split.chunks)),
        tokens_per_s=tokens / step.total_s, utilisation=flops / (step.total_s * peak_used),
        bound_s=bound.total_s, bound_binding=bound.binding,
        bound_parts_s=tuple(sorted(bound.parts().items())), candidates=costed,
        plan_seconds=time.perf_counter() - start, search=tuple(search.values()))


def _chunk_counts(seq: int, min_tokens: int = 1) -> list:
    """Chunk counts a pipeline may cut its sequences into: powers of two dividing ``seq`` with
    at least ``min_tokens`` tokens a chunk (1: whole sequences). The cost model prices what a
    small chunk costs (each slot's weight reads, its hand-overs' hop latencies and DMA set-ups,
    its collectives' fixed terms), so the search weighs them against the shorter fill and drain
    itself; a larger ``min_tokens`` only narrows the search."""
    out, k = [1], 2
    while seq % k == 0 and seq // k >= min_tokens:
        out.append(k)
        k *= 2
    return out


def _head_widths(spec, tp: int, pp: int, dp: int, chips: int) -> list:
    """Head-stage widths a split may take: 0 (the head on the last block stage) and, where the
    LM head's GEMM outweighs a block stage's (it would be the pipeline's slowest part), ``tp``
    times a power of two, as far as the chips and the vocabulary's canonical leaves
    (:func:`~tvm_spinn.training.tp_chain.vocab_leaves`) go."""
    from ..tp_chain import vocab_leaves

    out, width = [0], tp
    if not _head_outweighs(spec, pp):
        return out
    # a width divides the vocabulary's canonical leaves, so each rank holds whole leaves
    leaves = vocab_leaves(spec.heads, spec.intermediate, spec.vocab)
    while (tp * pp + width) * dp <= chips and leaves % width == 0:
        out.append(width)
        width *= 2
    return out


def _head_options(spec, tp: int, pp: int, dp: int, chips: int) -> list:
    """``(head_tp, spread_head, head_lag)`` a split may take: the head on the last block stage,
    on a stage of its own (:func:`_head_widths`), or, with more than one stage and where the LM
    head's GEMM outweighs a block stage's, spread over every chip of the replica's stages
    (:attr:`Split.spread_head`); a head stage 0 or :data:`HEAD_LAGS` slots behind the last
    block stage, a spread head one of :data:`HEAD_LAGS` (its collectives are outside the blocks'
    passes); the search keeps the lags below the split's slots."""
    widths = _head_widths(spec, tp, pp, dp, chips)
    stage = [(w, False, lag) for w in widths for lag in ((0,) + HEAD_LAGS if w else (0,))]
    return stage + ([(0, True, lag) for lag in HEAD_LAGS] if pp > 1 and _head_outweighs(spec, pp) else [])


def _head_outweighs(spec, pp: int) -> bool:
    """The LM head's weights outnumber a block stage's (the head would pace the pipeline)."""
    h, i, q, kv = _widths(spec)
    block = (h * (q + 2 * kv) + q * h + (3 if spec.family == "llama" else 2) * h * i) * (spec.layers // pp)
    return spec.vocab * spec.hidden > block


def _split_key(split: Split) -> tuple:
    """A total order of splits (ties of the search go to the first)."""
    return (split.tp, split.pp, split.dp, split.zero, split.micro_batch, split.micro_batches, split.recompute,
            split.sequence_parallel, split.chunks, split.layout, split.head_tp, split.spread_head, split.head_lag,
            split.zero_bubble)


def _compute_floor(spec, split: Split, seq: int, arch, comms: "_Comms") -> float:
    """The blocks' GEMM time of the pipeline alone (:func:`~tvm_spinn.timing.gemm.gemm_seconds`, as :func:`_step_time`
    prices them): a lower bound of the split's step (in either mode: the canonical order's
    GEMMs are the ranks' parallel shares, its additions and collectives only add to them)."""
    tokens = split.micro_batch * seq // split.chunks
    weights, attention = _block_gemms(spec, tokens, seq, split.tp, split.micro_batch, split.chunks)
    layers = spec.layers // split.pp

    fresh = _fresh_attention(spec, split, tokens, arch)

    def floor(resident: bool) -> float:  # a stage's GEMMs with its weights in SRAM or streamed
        f, d, w = _pass_seconds(arch, weights, comms, resident, attention, fresh, split.recompute)
        per = layers * (f + d + w + split.recompute * f)
        # a steady slot's passes share the PEs (_shared_pes_saving); each stage's fill and drain
        # term is at least its passes in series (1F1B's F + B + W, ZB-H1's F + B - W)
        steady = per - (layers * _shared_pes_saving(arch, weights, comms, resident, attention, fresh,
                                                    split.recompute, _attention_at(spec))
                        if split.slots > 1 else 0.0)
        if not split.zero_bubble:
            return (split.slots - 1) * steady + split.pp * per
        fill = per - layers * _pass_seconds(arch, weights, comms, resident)[2]
        return (split.slots - 1) * steady + split.pp * fill

    # the step prices each block stage's GEMMs with its weights resident where they fit the SRAM
    # share (:func:`_step_time`): with every stage one way the floor is that way's, else the cheaper
    # (the middle stages hold what stage 1 holds: the first and last add the tables and the head)
    fits = {2 * F32 * (_stage_params(spec, split.tp, split.pp, j, split.head_tp, split.spread_head)
                       - _gathered_params(spec, split, j)) <= _resident_share(arch)
            for j in sorted({0, min(1, split.pp - 1), split.pp - 1})}
    return min(floor(resident) for resident in sorted(fits))
