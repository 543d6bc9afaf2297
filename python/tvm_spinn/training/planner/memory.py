"""Bytes per chip of a split: weights, gradients, optimizer state and activations per pipeline stage."""

from __future__ import annotations

from .model import _stage_params, _vocab_rows, _widths
from .records import F32, OPTIMIZERS, MemoryPerChip, Split


def _layer_activations(spec, tp: int, tokens: int, seq: int, sequence_parallel: bool) -> int:
    """Bytes one layer stores for the backward pass for ``tokens`` tokens (sequences of
    ``seq``) on one TP rank (see the module docstring)."""
    h, i, q, kv = _widths(spec, tp)
    mlp = 3 * i if spec.family == "llama" else 2 * i
    wide = 4 * h  # the norms' inputs, the attention's and the MLP's inputs
    wide = -(-wide // tp) if sequence_parallel else wide  # split over the sequence, or replicated
    scores = (spec.heads // tp) * seq  # softmax outputs per token
    return F32 * tokens * (wide + 2 * q + 2 * kv + mlp + scores)


def _layer_input(spec, tp: int, tokens: int, sequence_parallel: bool) -> int:
    """Bytes of one layer's input on one TP rank (what full recomputation keeps)."""
    return F32 * tokens * (-(-spec.hidden // tp) if sequence_parallel else spec.hidden)


def _stage_activations(spec, split: "Split", seq: int, stage: int, recompute: bool) -> int:
    tp, pp, mb = split.tp, split.pp, split.micro_batch
    tokens = mb * seq // split.chunks  # one pipeline slot's tokens
    if split.head_tp and stage == pp:
        # the head's stage, last of the pipeline (one slot in flight, and head_lag more waiting
        # for it, up to the slots): the final norm's input and output on every rank (the head
        # reads all of the slot's hidden states) and its share of the logits
        return _head_slots(split) * (2 * F32 * tokens * spec.hidden + F32 * tokens * -(-spec.vocab // split.head_tp))
    layers = spec.layers // split.pp
    held = _held_slots(split, stage)
    sp = split.sequence_parallel and tp > 1
    layer = _layer_activations(spec, tp, tokens, seq, sp)
    if recompute:
        total = layers * held * _layer_input(spec, tp, tokens, sp) + layer
    else:
        total = layers * held * layer
    if split.zero_bubble and stage < pp:
        # a deferred weight-gradient pass reads its GEMMs' inputs whole (the column-parallel
        # ones' as gathered over the sequence) and their output gradients, held from the
        # input-gradient pass until it runs: counted for every slot held (with chunked
        # sequences, every chunk of a micro-batch: see :func:`_held_slots`)
        h, i, q, kv = _widths(spec, tp)
        total += layers * held * F32 * tokens * (q + 2 * kv + i + 4 * h)
    if split.chunks > 1:
        # a chunk attends over the keys and values of its sequences' earlier chunks: each
        # micro-batch with a chunk in flight keeps its whole sequences' keys and values
        _, _, _, kv = _widths(spec, tp)
        sequences = min(split.micro_batches, -(-held // split.chunks) + 1)
        total += layers * sequences * F32 * mb * seq * 2 * kv
    if split.spread_head:
        # each rank holds, for every slot whose head passes are in flight (as a head stage: the
        # one it computes and head_lag more, up to the slots), the slot's final hidden states
        # whole (the norm's output, and its input for the norm's gradient) and its share of the
        # logits
        total += _head_slots(split) * (2 * F32 * tokens * spec.hidden + F32 * tokens * _vocab_rows(spec, tp * split.pp))
    elif stage == split.pp - 1 and not split.head_tp:  # the final norm's input and output, the logits
        total += 2 * _layer_input(spec, tp, tokens, sp) + F32 * tokens * -(-spec.vocab // tp)
    return total


def _head_slots(split: "Split") -> int:
    """Slots whose head passes a head stage or a spread head holds at once: the one it
    computes and the :attr:`Split.head_lag` behind it, up to the slots (as :func:`_inflight`)."""
    return min(1 + split.head_lag, split.slots)


def _held_slots(split: "Split", stage: int) -> int:
    """Slots whose activations block stage ``stage`` holds at once: :func:`_inflight`, and with
    chunked sequences at least a micro-batch's :attr:`Split.chunks`. The backward runs a
    micro-batch's chunks in reverse order (a key's gradient sums over the later chunks'
    queries), so its first input-gradient pass, the last chunk's, starts once all of the
    micro-batch's chunks went forward through every stage; and the weight-gradient passes run
    in ascending chunk order (each continues the previous chunk's accumulator), so under ZB-H1
    the deferred passes' operands of every chunk stay until the first chunk's input-gradient
    pass. A micro-batch's chunks are held whole."""
    inflight = _inflight(split, stage)
    return max(inflight, split.chunks) if split.chunks > 1 else inflight


def _inflight(split: "Split", stage: int) -> int:
    """Slots block stage ``stage`` holds at once under 1F1B: one for each later stage (a head's
    stage among them) up to the slots, and :attr:`Split.head_lag` more (the head's passes run
    that many slots behind the last block stage)."""
    return min(split.stages + split.head_lag - stage, split.slots)


def memory_per_chip(spec, split: Split, seq: int, optimizer: str, capacity: int) -> MemoryPerChip:
    """Bytes per chip of ``split`` (the most loaded pipeline stage), see the module docstring."""
    best = None
    for stage in _costed_stages(split):
        p = _stage_params(spec, split.tp, split.pp, stage, split.head_tp, split.spread_head)
        shard = -(-p // split.dp)
        grads = shard if split.zero >= 2 else p
        state = OPTIMIZERS[optimizer] * (shard if split.zero >= 1 else p)
        acts = {r: _stage_activations(spec, split, seq, stage, r) for r in (False, True)}
        mem = MemoryPerChip(F32 * p, F32 * grads, F32 * state, acts[split.recompute], acts[False], acts[True],
                            stage, capacity)
        if best is None or mem.total > best.total:
            best = mem
    return best


def _peak_bytes(spec, split: Split, seq: int, optimizer: str) -> int:
    """:attr:`MemoryPerChip.total` of ``split`` (its recomputation mode only: the search's fit
    test, cheaper than :func:`memory_per_chip`)."""
    most = 0
    for stage in _costed_stages(split):
        p = _stage_params(spec, split.tp, split.pp, stage, split.head_tp, split.spread_head)
        shard = -(-p // split.dp)
        grads = shard if split.zero >= 2 else p
        state = OPTIMIZERS[optimizer] * (shard if split.zero >= 1 else p)
        most = max(most, F32 * (p + grads + state) + _stage_activations(spec, split, seq, stage, split.recompute))
    return most


def _costed_stages(split: Split) -> list:
    """The stages whose memory and time differ: the first and last block stage (the others are
    the last's but for its head) and the head's own stage (``pp``) where there is one."""
    return sorted({0, split.pp - 1} | ({split.pp} if split.head_tp else set()))
