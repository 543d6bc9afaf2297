"""Timing of a program split over many chips, by symmetry: one chip's shard plus the collectives.

The chips of a tensor-/data-parallel group run identical shards (:mod:`tvm_spinn.mapping.shard`),
so one chip's shard is timed with the PE-level model (:func:`tvm_spinn.timing.evaluate` on a
one-chip system) and nothing here grows with the chip count but the collectives, which are
costed on the link graph (:mod:`.collectives`: ring, tree or, for an all-gather, multicast
trees, whichever is cheapest, hops and shared links included; floating-point partial sums by
the bit-exact chain).

*Weight prefetch*: weights do not depend on activations, so a chip streams the weight shards
of the next layers from its DRAM into a prefetch buffer in SRAM while earlier layers compute
and communicate, as far ahead as the buffer holds (a shard's room is freed when its layer
ends; a layer whose PEs run several tiles each frees a tile's weight block once that tile has
computed, so after its last byte only its waves not yet done hold theirs). Per layer ``i``, with ``C_i`` the collective before it and ``X_i`` its PE-level time
with weights on chip, ``load_end_i`` is when the last byte of its shard has arrived: the DRAM
channel streams the shards one after another at its rate, each byte as soon as the buffer has
room for it beside the unfinished layers' shards (a shard larger than the buffer streams its
rest once the layers before it have ended, its layer reading it as it arrives)::

    start_i     = max(end_{i-1} + C_i, load_end_i)
    end_i       = start_i + X_i (+ the chain's pipeline fill on row-parallel fp32 layers)

so a DRAM-bound decode runs at the DRAM rate and collectives shorter than the streams hide
under them.

*Bounds*, side by side: compute (the work at the peak of the chips used, per layer mode),
memory (bytes each chip must move through its DRAM: its streamed weight shard and its share of
the program's inputs and outputs; SRAM-resident weights cost nothing) and communication (the
plan's collectives on the topology). ``latency / max(bounds)`` is the headline ratio.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..program import Program
from ..program.records import CollectiveSummary, SystemTimingSummary
from ..target.arch import SpinnArch
from .collectives import all_gather, all_reduce, all_to_all, chain_all_reduce
from .collectives.cost import _remember

__all__ = ["compose", "collective_cost", "chain_led_all_reduce", "chain_fed_chain"]


#: Collective costs kept per topology (:attr:`~tvm_spinn.target.topology.Topology.memo`)
_COSTS_KEPT = 4096


def _keep(memo: dict, key: tuple, cost) -> None:
    """``cost`` kept in a topology's memo under ``key``, the costs of its kind (``key[0]``)
    dropped first when they number more than :data:`_COSTS_KEPT` (each kind counted on its own:
    :func:`~.collectives.cost._remember`)."""
    _remember(memo, key, cost, _COSTS_KEPT)


def collective_cost(topo, ranks, op: str, nbytes: int, exact: bool, relay_pes: "int | None" = None):
    """Cost of one collective of a shard plan on ``topo`` (a :class:`~.collectives.CollectiveCost`).

    ``relay_pes``: for a chain (a floating-point all-reduce), the PEs of a rank that hold a
    segment's partial sums (:func:`~.collectives.chain_all_reduce`); None where the caller has
    no mapping (the links pace the chain's segments).

    Memoized on the topology per operation, ranks, size and relaying PEs: a build asks for the
    same few collectives many times and each costs a routing pass over the whole link graph
    (207,360 links on ``spinn/cloud``).
    """
    ranks = np.asarray(ranks, dtype=np.int64)
    key = ("collective", op, bool(exact), ranks.tobytes(), float(nbytes), relay_pes)
    memo = topo.memo
    hit = memo.get(key)
    if hit is not None:
        return hit
    if op == "all_gather":
        cost = all_gather(topo, ranks, nbytes)
    elif op == "all_to_all":  # a re-split (the expert axis's dispatch and combine): moves data, sums nothing
        cost = all_to_all(topo, ranks, nbytes)
    elif exact:  # integer partial sums: any order, the cheaper of ring and tree
        cost = all_reduce(topo, ranks, nbytes)
    else:
        cost = chain_all_reduce(topo, ranks, nbytes, relay_pes=relay_pes)
    _keep(memo, key, cost)
    return cost


def chain_led_all_reduce(topo, ranks, nbytes: int, chain):
    """An exact all-reduce whose result the chain all-reduce after it (``chain``, over the same
    ``ranks`` in chain order) needs: e.g. a split row's maximum, which every rank subtracts
    before it adds its terms into the chain's sum. The chain's first rank starts as soon as it
    holds the result, so the values are reduced to it (every rank's value to it at once, the
    transfers' bytes summed per link, as :meth:`~tvm_spinn.target.topology.Topology.evaluate`
    costs them: a reduction that combines them on the way carries no more), and its multicast
    of the result to the other ranks runs while the chain moves: rank ``i`` needs it only when
    the chain's first segment reaches it, ``i`` of that segment's hop steps after the start
    (``CollectiveCost.step_s``); where the multicast's route to a rank is slower than that, the
    difference is added. The step is the shortest of the chain's at any segment count it was
    costed for (``chain.by_segments``):
    :func:`compose` may cut the chain into more segments than its own cheapest count, and a
    shorter step brings every rank's need of the result earlier. Returns the cheaper of that
    and the all-reduce by itself (:func:`collective_cost`), as a
    :class:`~.collectives.CollectiveCost` (``algorithm="reduce-first"`` where the former).

    Memoized on the topology per ranks, size and step, as :func:`collective_cost` is: each
    call otherwise runs a routing pass over the whole link graph per rank."""
    from .collectives import CollectiveCost

    ranks = np.asarray(ranks, dtype=np.int64)
    c = ranks.size
    costed = [k for k in (chain, *chain.by_segments) if k.steps >= 1]
    if c < 2 or nbytes == 0 or not costed:
        return collective_cost(topo, ranks, "all_reduce", nbytes, True)
    step = min(k.step_s if k.step_s > 0.0 else k.seconds / k.steps for k in costed)
    key = ("chain_led", ranks.tobytes(), float(nbytes), float(step))
    memo = topo.memo
    hit = memo.get(key)
    if hit is not None:
        return hit
    whole = collective_cost(topo, ranks, "all_reduce", nbytes, True)
    first = np.full(c - 1, ranks[0])
    up = topo.transfer_cost(ranks[1:], first, float(nbytes))
    lag = max(topo.transfer_cost(ranks[:1], ranks[i:i + 1], float(nbytes)).seconds - i * step for i in range(1, c))
    seconds = up.seconds + max(0.0, lag)
    cost = whole if seconds >= whole.seconds else CollectiveCost(
        "all_reduce", "reduce-first", seconds, float(up.max_link_bytes), int(up.max_hops), int(up.board_hops), 1,
        int(c), float(nbytes))
    _keep(memo, key, cost)
    return cost


def chain_fed_chain(topo, ranks, first, second):
    """A chain all-reduce (``first``, over ``ranks`` in chain order) whose result the ranks use
    only in their own work before the next chain over the same ranks (``second``): e.g. a split
    row's sum, which every rank divides its terms by before its partial context, which the
    context's chain then continues rank after rank. Rank ``i`` of the second chain needs its
    own work done only when that chain's first segment reaches it, ``i`` of its hop steps
    (``second.step_s``, its shortest at any segment count it was costed for) after the first
    rank starts it; every rank does the same work in between, so rank ``i`` may receive the
    first chain's result that much later than rank 0. The first chain's multicast from its
    last rank then delays the second only by its route to rank 0 and, where the route to a rank
    ``i`` is longer than that by more than ``i`` of the second chain's steps, the difference:
    the first chain is charged ``max_i(h_i * tree step - i * second step)`` for its tree
    (``h_i``: rank ``i``'s hops from the last rank) instead of its deepest route's ``D`` steps.
    The additions and their order are the first chain's: the bits do not change. The first
    chain's later segments still cross its tree after its first one (its tail, ``m - 1``
    periods): only where that tail is no longer than the second chain's first step, before
    whose end the second chain's segments are not yet on the links, is the saving taken (a
    longer tail would share links with the second chain's segments).

    Returns ``first`` with those seconds (at each segment count it was costed for, too), or
    ``first`` itself where nothing is saved."""
    ranks = np.asarray(ranks, dtype=np.int64)
    c = ranks.size
    steps = [k.step_s for k in (second, *second.by_segments) if k.step_s > 0.0]
    if c < 2 or not steps or first.step_s <= 0.0:
        return first
    step2 = min(steps)
    hops = topo.hops(np.full(c, ranks[-1]), ranks).astype(np.float64)
    relay = float(topo.relay_word_s)

    def fed(cost):
        tree = cost.step_s - relay  # a tree hop: the first segment's step without a rank's relay
        if cost.step_s <= 0.0 or tree <= 0.0:
            return cost
        tail = cost.seconds - (c - 1) * cost.step_s - hops.max() * tree  # the later segments' periods
        if tail > step2 * (1.0 + 1e-9):
            return cost
        saved = hops.max() * tree - max(0.0, float((hops * tree - np.arange(c) * step2).max()))
        return replace(cost, seconds=cost.seconds - saved) if saved > 0.0 else cost

    out = fed(first)
    if out is first:
        return first
    return replace(out, by_segments=tuple(fed(k) for k in first.by_segments))


def _load_end(start: float, nbytes: float, room: float, dram: float, ends, stream_bytes, kept=None) -> float:
    """When the last byte of a weight shard of ``nbytes`` has arrived in a chip's prefetch buffer
    of ``room`` bytes, its stream starting at ``start`` (the previous shard's last byte), the
    earlier layers ending at ``ends`` having streamed ``stream_bytes``.

    The DRAM channel moves bytes into whatever room the buffer has: the earlier layers' shards
    hold theirs until their layer ends, so a shard's first bytes load ahead into the room left
    and the rest as that room is freed. Once the earlier layers have all ended the layer itself
    runs: a shard larger than the buffer never sits in it whole (its layer reads it as it
    arrives), so its rest streams at the DRAM rate without waiting for room.

    ``kept`` (optional, per earlier layer): the share of its shard a layer still holds from
    ``start`` until it ends (default 1: all of it); see :func:`_kept_share`.
    """
    pending = [(float(ends[j]), min(float(stream_bytes[j]), room) * (1.0 if kept is None else float(kept[j])))
               for j in range(len(ends)) if ends[j] > start]
    held = sum(nb for _, nb in pending)  # the unfinished layers' bytes in the buffer
    t, loaded = start, 0.0
    for end, nb in pending:  # ends are in layer order, so in time order
        ahead = min(room - held - loaded, (end - t) * dram, nbytes - loaded)
        if ahead > 0:
            loaded += ahead
            if loaded >= nbytes:
                return t + ahead / dram
        t = max(t, end)
        held -= nb
    return t + (nbytes - loaded) / dram


def _kept_share(t: float, end: float, seconds: float, waves: int) -> float:
    """The share of a streamed layer's shard still in the prefetch buffer at time ``t`` (at or
    after its last byte), the layer ending at ``end`` after ``seconds`` of compute in ``waves``
    tiles a PE: a tile that has computed frees its weight block, so only the waves not yet
    done (the one computing included) hold theirs; one wave holds the whole shard until the
    layer ends."""
    if waves <= 1 or seconds <= 0.0:
        return 1.0
    left = (end - t) / (seconds / waves)  # waves of compute left at ``t``
    return min(1.0, math.ceil(left - 1e-9) / waves) if left > 0 else 0.0


def _chain_segments(collectives, row_fp32, x) -> list:
    """``collectives`` with each chain that follows row-parallel fp32 layers cut into the
    segments cheapest for the chain and those layers' fill together.

    A row-parallel fp32 layer's ranks continue one accumulator in the one-chip program's order
    (:func:`~.collectives.chain_all_reduce`), so a rank computes its partial sums of a segment
    only once the segment has reached it: the layer's compute ``x`` runs segment by segment down
    the chain and pays the pipeline's fill, ``(c - 1) / m`` of it (:func:`compose`). More
    segments shorten the fill; the chain's cost at each count is its own
    (:attr:`~.collectives.CollectiveCost.by_segments`); the count is the static schedule's
    choice, so it is the one whose chain and fill together cost least (the chain's own cheapest
    among them). The chain whose fill a layer pays is the first after it
    (the last issued at that layer), as :func:`compose` charges it; ``x``: per layer, its
    seconds with its weights on chip."""
    items = [tuple(item) for item in collectives]
    last = {}  # layer -> index of the last chain issued before it (the one its fill is charged)
    for k, item in enumerate(items):
        if item[1].algorithm == "chain" and item[1].ranks > 1:
            last[int(item[0])] = k
    at = sorted(last)
    work: dict[int, float] = {}
    for i in sorted(row_fp32):
        nxt = next((j for j in at if j > i), None)
        if nxt is not None:
            work[nxt] = work.get(nxt, 0.0) + float(x[i])
    for layer, seconds in sorted(work.items()):
        k = last[layer]
        cost = items[k][1]
        if not cost.by_segments:
            continue
        best = min(cost.by_segments,
                   key=lambda c: (c.seconds + seconds * (c.ranks - 1) / max(1, c.segments), c.segments))
        if best.segments != cost.segments:
            items[k] = (items[k][0], replace(best, by_segments=cost.by_segments)) + items[k][2:]
    return items


def compose(program: Program, arch: SpinnArch, exec_cycles, stream_bytes, collectives,
            chips: int, row_fp32: "set[int] | frozenset" = frozenset(), io_bytes: int = 0,
            prefetch_bytes: float = 0.0, waves=None) -> SystemTimingSummary:
    """Latency and bounds of ``program`` on ``chips`` chips from its shard's per-layer figures.

    Parameters
    ----------
    program : Program
        The full program (its layers' ``flops`` and ``mode`` give the compute bound).
    arch : SpinnArch
        The chip's parameters (clock, DRAM bandwidth, peaks per PE).
    exec_cycles : sequence of int
        Per layer, the shard's PE-level cycles with its weights on chip.
    stream_bytes : sequence of int
        Per layer, the weight bytes one chip streams from its DRAM (0 when resident).
    collectives : sequence of (layer, CollectiveCost) or (layer, CollectiveCost, ready)
        The plan's collectives, each before ``layer`` (``len(layers)``: after the last). A
        collective with ``ready`` not None (a gather of a program output, ready once layer
        ``ready`` has ended; -1: at the start) is issued then and runs on the links while the
        later layers compute; the program ends when it is done.
    chips : int
        Chips of the group (compute bound).
    row_fp32 : set of int
        Row-parallel fp32 layers: their compute is pipelined with the chain all-reduce that
        follows them, paying its fill ``(tp - 1) / m`` of the layer's time.
    io_bytes : int
        Bytes of the program's inputs and outputs one chip reads/writes in DRAM.
    prefetch_bytes : float
        SRAM a chip gives to prefetched weight shards: loads run ahead while the shards of the
        layers not yet finished fit in it (0: one layer of lookahead at most).
    waves : sequence of int, optional
        Per layer, the most tiles one PE of the shard runs (None: one each). A streamed layer
        whose PEs run several tiles in turn computes its earlier tiles while the later ones'
        weights arrive (double buffering, as the PE-level model loads ahead of compute): it
        starts once its first tiles' share of the shard has arrived and, after the last byte,
        has only its last tiles' share of ``exec_cycles`` left.
    """
    clock = arch.clock_hz
    n = len(program.layers)
    comm = np.zeros(n + 1)
    fill = {}
    timings = []
    early: list[tuple[int, float]] = []  # (ready layer, seconds): output gathers issued early
    blocking: dict[int, list[float]] = {}
    for item in _chain_segments(collectives, row_fp32, [float(c) / clock for c in exec_cycles]):
        layer, cost = item[0], item[1]
        ready = item[2] if len(item) > 2 else None
        comm[layer] += cost.seconds
        if ready is not None and layer >= n:
            early.append((int(ready), float(cost.seconds)))
        else:
            blocking.setdefault(int(layer), []).append(float(cost.seconds))
        timings.append(CollectiveSummary(int(layer), cost.op, cost.algorithm, int(cost.nbytes), float(cost.seconds),
                                        int(cost.hops), int(cost.board_hops)))
        if cost.algorithm == "chain" and cost.ranks > 1:
            fill[layer] = (cost.ranks - 1) / max(1, cost.segments)
    # the chain after a row-parallel layer: the layer's compute pays the pipeline fill
    extra = np.zeros(n)
    consumers = sorted(fill)
    for i in sorted(row_fp32):
        nxt = next((j for j in consumers if j > i), None)
        if nxt is not None:
            extra[i] = fill[nxt]
    dram = arch.dram_bw_bytes_s
    load_end = end = 0.0
    layer_s, ends = [], []
    xs, wave_of = [], []  # per layer: compute seconds and tiles a PE (the buffer it frees as it runs)
    # The collectives a layer waits for run when the layer before it ends; a gather of a
    # program output goes out once its tensor is written and uses the links whenever those
    # are not moving a collective a layer waits for (which has priority), overlapping the
    # layers after it: it never delays them, and the program ends when the last one is done.
    busy: list[tuple[float, float]] = []  # link intervals of the waited-for collectives
    for i in range(n):
        comm_end = end
        for seconds in blocking.get(i, ()):
            busy.append((comm_end, comm_end + seconds))
            comm_end += seconds
        b = int(stream_bytes[i])
        x = float(exec_cycles[i]) / clock * (1.0 + extra[i])
        # the buffer frees a layer's shard as its tiles compute and whole when the layer ends:
        # the stream waits for room (a layer streaming nothing moves nothing through it)
        if b:
            kept = [_kept_share(load_end, ends[j], xs[j], wave_of[j]) for j in range(i)]
            load_end = _load_end(load_end, b, prefetch_bytes, dram, ends, stream_bytes, kept)
        n_waves = max(1, int(waves[i])) if waves is not None and b else 1
        xs.append(x)
        wave_of.append(n_waves)
        if n_waves > 1:
            first = load_end - (n_waves - 1) / n_waves * b / dram  # the first tiles' weights in
            start = max(comm_end, end, first)
            new_end = max(start + x, load_end + x / n_waves)
        else:
            start = max(comm_end, load_end)
            new_end = start + x
        layer_s.append(new_end - end)
        ends.append(new_end)
        end = new_end
    for seconds in blocking.get(n, ()):
        busy.append((end, end + seconds))
        end += seconds
    # the output gathers, in the order their tensors are ready, in the links' free time
    cursor, j = 0.0, 0
    for ready, seconds in sorted(early):
        t = max(cursor, ends[ready] if 0 <= ready < len(ends) else (end if ready >= 0 else 0.0))
        left = seconds
        while left > 0:
            while j < len(busy) and busy[j][1] <= t:
                j += 1
            if j < len(busy) and busy[j][0] <= t:
                t = busy[j][1]
                continue
            gap = (busy[j][0] - t) if j < len(busy) else left
            step = min(gap, left)
            t += step
            left -= step
        cursor = t
        end = max(end, t)
    fp32 = sum(layer.flops for layer in program.layers if layer.mode != "int8")
    int8 = sum(layer.flops for layer in program.layers if layer.mode == "int8")
    compute = (fp32 / (arch.peak_fp32_flops_s / arch.chips) + int8 / (arch.peak_int8_ops_s / arch.chips)) / chips
    streamed = int(sum(stream_bytes))
    memory = (streamed + io_bytes) / dram
    comm_total = float(comm.sum())
    bounds = {"compute": compute, "memory": memory, "communication": comm_total}
    binding = max(bounds, key=lambda k: (bounds[k], k))
    return SystemTimingSummary(latency_s=end, compute_bound_s=compute, memory_bound_s=memory, comm_bound_s=comm_total,
                               binding=binding, chips=chips, streamed_bytes_per_chip=streamed, layer_s=tuple(layer_s),
                               collectives=tuple(timings), bound_s=max(compute, memory, comm_total))
