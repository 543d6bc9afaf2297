"""The mapping compiler's driver: tile shapes, placement, memory plan, timing.

A layer's mapping is data: its tile shape and the contiguous PE range it runs on
(``program.mapping.layers[i]``, a :class:`~tvm_spinn.program.records.LayerMapping` of ``tile``,
``pes = (first, count)`` and ``rotate``, the PE placement starts from past PEs holding residents,
see :func:`_resident_layout`). Everything else
is derived from those, vectorized: the tiles with their bytes and cycles
(:func:`~.tiling.tile_costs`), their placement (:func:`~.placement.place_tiles`), the transfers
and timeline the timing model works out (:mod:`tvm_spinn.timing`). The compiler keeps the
derived tiles in memory (``program.tiles``) for the memory planner and the timing model; the
serialized program stores only the per-layer records, and :func:`derive_tables` rebuilds the
same tiles from them (e.g. for a timeline of a loaded program).
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from ..program import Program
from ..program.ops import family_of
from ..program.records import AddressRange, LayerMapping, MemorySummary, ProgramMapping
from ..program.tiles import ProgramTiles, TileTable
from ..target.arch import SpinnArch
from .memory import LEDGER_RESIDENT_SHARE, activation_label, check_capacity, held_between_calls, plan_memory, weight_bytes_per_pe
from .options import MappingOptions, current_options
from .placement import choose_chips, pipeline_groups, place_tiles
from .budget import RegionBudget, SystemState
from .stages import pipeline_tables
from .system import map_on_system, overflow_message, system_tables
from .tiling import MappingError, choose_tile, program_work, tile_costs

__all__ = ["map_program", "map_region", "derive_tables", "MappingMemo", "structure_key"]


def _assign(program: Program, arch: SpinnArch, mode: str, options: MappingOptions) -> tuple[list[tuple[int, int]], list[int]]:
    """``([(first PE, PE count)] per layer, chips per layer)``."""
    n = len(program.layers)
    ppc = arch.pes_per_chip
    if options.naive or (arch.chips == 1 and mode != "pipelined"):
        return [(0, ppc)] * n, [1] * n
    if mode == "pipelined":
        groups = pipeline_groups(program, arch)
        if groups is not None:
            chips = [len({pe // ppc for pe in g}) for g in groups]
            return [(g[0], len(g)) for g in groups], chips
    chips = choose_chips(program, arch)
    return [(0, c * ppc) for c in chips], chips


def _place(program: Program, index: int, arch: SpinnArch, tile, first: int, count: int, naive: bool,
           rotate: int = 0) -> TileTable:
    return place_tiles(tile_costs(program, index, arch, tile), first, count, arch, naive=naive, rotate=rotate)


def derive_tables(program: Program, arch: SpinnArch) -> list[TileTable]:
    """The placed tiles of every layer of a mapped (or loaded) program, from its per-layer
    mapping records: the same tables the compiler built."""
    if program.mapping.system is not None:  # the tiles of one chip's shard (see .system)
        return system_tables(program, arch, derive_tables)
    if program.mapping.pipeline is not None:  # each stage's, on its chip (see .system)
        return pipeline_tables(program, arch, derive_tables)
    naive = program.mapping.options.naive
    program = program_work(program, arch)
    tables = []
    for i, record in enumerate(program.mapping.layers):
        first, count = record.pes
        tables.append(_place(program, i, arch, list(record.tile), first, count, naive, int(record.rotate)))
    return tables


class MappingMemo:
    """Mappings made during one system plan, for reuse by later programs of the same structure.

    A mapping (tile shapes, placement, memory plan, timing) depends on a program's tensor
    shapes, dtypes and roles, its layers, the architecture, the options and its budget, never on
    the constants' data: BERT's twelve encoder layers are one structure. Every later program of
    a structure already mapped gets copies of the first one's results, its activations' address
    ranges relabelled with its own tensor names. Owned by one :func:`.planner.plan_system` call,
    or by its caller across calls (its ``memo``): every entry is keyed by all that its mapping reads.
    """

    def __init__(self):
        self.structures: dict = {}  # structure key -> a one-chip mapping (see _entry)
        self.system: dict = {}  # (structure key, budget) -> a system mapping (see .system)


def structure_key(program: Program, arch: SpinnArch, mode: str, options: MappingOptions, onchip: tuple = ()) -> str:
    """Everything a mapping reads from ``program`` and its inputs: the header without the
    symbol, the tensor names (labels only) and the mapping results, with the target, the mapping
    mode, the options and the inputs already in SRAM. Two programs with equal keys map alike: a
    memo of mappings (:class:`MappingMemo`, the LLM planner's stage memo) is keyed by it."""
    header = program.header()  # fresh dicts: safe to edit
    for field in ("symbol", "mapping", "timing", "memory"):
        header.pop(field)
    for tensor in header["tensors"]:
        tensor.pop("name")
    # inputs the budget says are already in SRAM (see .system._system_timing) time differently
    onchip = sorted(int(t) for t in onchip)
    return json.dumps([header, arch.to_dict(), mode, options.to_dict()] + ([onchip] if onchip else []), sort_keys=True)


def _replay(program: Program, entry: tuple) -> Program:
    """``program`` with the mapping of a program of the same structure (see
    :class:`MappingMemo`), its activations' address ranges labelled with its own names."""
    tables, mapping, timing, memory, activation_ranges = entry
    ranges = list(memory.ranges)
    for k in activation_ranges:
        ranges[k] = replace(ranges[k], what=activation_label(program, ranges[k].first_layer))
    # frozen records: shared, never edited
    return replace(program, tiles=ProgramTiles(tables), mapping=mapping, timing=timing,
                   memory=replace(memory, ranges=tuple(ranges)))


def _entry(program: Program) -> tuple:
    """What :func:`_replay` needs of a freshly mapped ``program``."""
    ranges = program.memory.ranges
    labelled = [k for k, rng in enumerate(ranges) if rng.what == activation_label(program, rng.first_layer)]
    return (program.tiles.tables, program.mapping, program.timing,
            program.memory, labelled)


def _build(program: Program, arch: SpinnArch, mode: str, options: MappingOptions, state: SystemState | None = None,
           memo: MappingMemo | None = None, onchip: tuple = (), streams: int = 0) -> tuple[Program, SystemState | None]:
    """``(mapped program, state)``: on a multi-chip system (sequential, not naive) the system's
    state after it (``state``: what the build's earlier programs hold, None: the program
    alone), else None."""
    table = memo.structures if memo is not None else None
    key = structure_key(program, arch, mode, options, onchip) if table is not None else None
    check_capacity(program, arch)  # before any tile array (they grow with the tensors) is built
    program = program_work(program, arch)
    if arch.chips > 1 and mode == "sequential" and not options.naive:

        def map_one(shard, chip, reserved):
            return _map(program_work(shard, chip), chip, "sequential", options, reserved)

        return map_on_system(program, arch, options, state, map_one, key, memo.system if memo is not None else None,
                             tuple(onchip), streams)
    if key is not None and key in table:
        return _replay(program, table[key]), None
    program, _ = _map(program, arch, mode, options)
    if key is not None:
        table[key] = _entry(program)
    return program, None


def _map(program: Program, arch: SpinnArch, mode: str, options: MappingOptions,
         reserved=None) -> tuple[Program, dict[int, int]]:
    """Map ``program`` (its layers' work already set); ``reserved``: SRAM bytes per PE held by
    earlier programs' resident weights (:func:`~.memory.plan_memory`). Returns the mapped
    program and the resident weight bytes per PE of its own (what a build's SRAM ledger adds
    for it)."""
    from ..timing import evaluate

    n = len(program.layers)
    ranges, chips = _assign(program, arch, mode, options)
    tables, records = [], []
    for i in range(n):
        first, count = ranges[i]
        tile = choose_tile(program, i, arch, pes=count, naive=options.naive,
                           resident=options.weights == "resident" and held_between_calls(program, i))
        tables.append(_place(program, i, arch, tile, first, count, options.naive))
        records.append(LayerMapping(tile=tuple(int(v) for v in tile), pes=(int(first), int(count))))

    weights = "stream" if options.naive else options.weights
    activations = "dram" if options.naive else options.activations
    base = ProgramMapping(mode=mode, options=options, chips_per_layer=tuple(chips),
                          pes_per_layer=tuple(count for _, count in ranges),
                          double_buffer=not options.naive and options.double_buffer, layers=(),
                          scheduler=options.scheduler)
    # weights="auto": residency competes with on-chip activations for SRAM, and keeping weights
    # can push activations out to DRAM; the timing model decides between the greedy residency
    # plan and streaming every weight (ties keep the weights). Under a build's SRAM ledger
    # (``reserved``) a layout that spreads the weight blocks for residency competes too
    # (:func:`_resident_layout`; ties keep the default tiles).
    layouts = [(tables, records)]
    if reserved is not None and weights != "stream" and not options.naive:
        alt = _resident_layout(program, arch, ranges, tables, records, reserved)
        if alt is not None:
            layouts.append(alt)
        split = _split_layout(program, arch, ranges, *(alt or (tables, records)), reserved)
        if split is not None:
            layouts.append(split)
        rounds = _one_round_layout(program, arch, *(split or alt or (tables, records)))
        if rounds is not None:
            layouts.append(rounds)
    candidates = [(t, r, weights) for t, r in layouts]
    if weights == "auto":
        candidates.append((tables, records, "stream"))
    best = first_plan = None
    for tabs, recs, choice in candidates:
        if choice == "stream" and choice != weights:
            if not first_plan.resident_layers:  # nothing kept: streaming gives this very plan
                break
            if _keeps_every_activation(program, first_plan, activations):
                break  # streaming cannot win: see _keeps_every_activation
        program = replace(program, tiles=ProgramTiles(tabs))
        plan = _plan(program, arch, choice, activations, tabs, reserved)
        if first_plan is None:
            first_plan = plan
        program = replace(program, mapping=replace(base, layers=tuple(recs), resident_layers=tuple(plan.resident_layers),
                                                   onchip_tensors=tuple(plan.onchip_tensors)))
        timing = evaluate(program, arch, tabs)
        if best is None or timing.cycles < best[2].cycles:
            best = (plan, program.mapping, timing, tabs)
    plan, mapping, timing, tabs = best
    program = replace(program, mapping=mapping, timing=timing, tiles=ProgramTiles(tabs), memory=_memory_summary(plan))
    return program, dict(plan.resident_bytes)


def _ledger_start(arch: SpinnArch, ranges, reserved):
    """``(cap, budget, held)`` a resident layout starts from: the residents' cap per PE, a
    tile's working SRAM, and per PE (over the layers' ranges) the bytes this build's earlier
    programs hold (``reserved``)."""
    from ..program.ops.base import working_budget

    top = max([first + count for first, count in ranges] + [len(reserved)])
    held = np.zeros(top, dtype=np.int64)
    held[:len(reserved)] = reserved
    return int(arch.tile_sram_bytes * LEDGER_RESIDENT_SHARE), working_budget(arch), held


def _place_rotated(program: Program, i: int, arch: SpinnArch, tile, held, first: int, count: int, units: int):
    """Layer ``i``'s tiles of ``tile`` placed on PEs ``first..first + count - 1`` starting at the
    window of ``units`` PEs (wrapping around the range) whose fullest PE holds the fewest
    resident bytes in ``held``, then the fewest in all: where the layer's first round goes.
    Returns ``(placed, pes, weight bytes per those PEs, rotate)``."""
    ring = np.concatenate([held[first:first + count], held[first:first + count]])
    window = np.lib.stride_tricks.sliding_window_view(ring, units)[:count]
    rotate = int(np.lexsort((np.arange(count), window.sum(axis=1), window.max(axis=1)))[0])
    placed = _place(program, i, arch, tile, first, count, False, rotate)
    per_pe = weight_bytes_per_pe(placed)
    return placed, per_pe.pes(), per_pe.values(), rotate


def _resident_layout(program: Program, arch: SpinnArch, ranges, tables, records, reserved):
    """Tiles and placement of the weight GEMMs (``dense``) that spread their weight blocks for
    residency under a build's SRAM ledger; ``(tables, records)``, or None when no layer changes.

    The default tiles minimize a layer's time alone: an int8 decode GEMM takes MAC-array-wide
    column tiles holding the whole reduction, so 150 tiles on 148 PEs put two weight blocks on
    two PEs (over the ledger's cap: the whole layer streams), and every layer starts at PE 0,
    so a program's layers and the earlier programs' residents pile up on the first PEs. Here a
    layer's output columns per tile are the ``tn`` with the fewest weight columns on the busiest
    PE (``ceil(ceil(n / tn) / PEs) * tn``; ties keep the default, then the wider tile), and its
    tiles start (``rotate``) at the window of PEs whose fullest holds the fewest resident bytes
    so far (this build's earlier programs, then this program's earlier layers whose blocks fit
    the cap). Only layers with one tile per weight block (a decode step's rows fit one tile)
    are laid out. Only the output columns per tile change: every output still sums its whole
    reduction in ascending ``k`` on one PE, so the bits are those of the default tiles. The
    caller keeps this layout only when the timing model finds it faster.
    """
    cap, budget, held = _ledger_start(arch, ranges, reserved)
    out_tables, out_records, changed = list(tables), list(records), False
    for i, layer in enumerate(program.layers):
        table = tables[i]
        if "resident" not in family_of(layer.kind).layouts(layer) or not len(table) or int(table.group.min()) < 0 \
                or not int(table.w_bytes.max()):
            continue
        if len(table) != int(table.group.max()) + 1:
            continue  # several row tiles share each block (not a decode step): left as chosen
        first, count = ranges[i]
        tm, tn, tk, *rest = (int(v) for v in records[i].tile)
        parts = rest[0] if rest else 1  # a split reduction: each column block in parts
        n = int(layer.gemm[1])

        def busiest(c: int) -> int:  # weight columns (of K / parts) on the busiest PE
            return -(-(-(-n // c) * parts) // count) * c

        options = sorted({tn, *(max(1, -(-n * parts // (j * count))) for j in range(1, 9))},
                         key=lambda c: (busiest(c), c != tn, -c))
        tile = [tm, tn, tk, *rest]
        for c in options:
            if busiest(c) >= busiest(tn) and c != tn:
                continue
            if parts > 1 and -(-n // c) * parts > count and c != tn:
                # the parts of a split reduction run side by side (one round); whole-reduction
                # tiles may take several rounds (``busiest`` counts them)
                continue
            costs = tile_costs(program, i, arch, [tm, c, tk, *rest])
            if int(costs.sram_bytes.max()) > budget and c != tn:
                continue
            tile = [tm, c, tk, *rest]
            break
        placed, pes, b, rotate = _place_rotated(program, i, arch, tile, held, first, count,
                                                min(count, -(-n // tile[1]) * parts))
        if (held[pes] + b <= cap).all():
            held[pes] += b
        if tile[1] != tn or rotate:
            changed = True
            out_tables[i] = placed
            out_records[i] = LayerMapping(tile=tuple(int(v) for v in tile), pes=(int(first), int(count)),
                                          rotate=int(rotate))
    return (out_tables, out_records) if changed else None


def _split_layout(program: Program, arch: SpinnArch, ranges, tables, records, reserved):
    """The layout ``(tables, records)`` of :func:`_resident_layout` (or the default) with each
    int8 decode weight GEMM's reduction split over PEs where that is faster and its weight
    blocks still fit the residents' cap; None when no layer changes.

    A resident layout keeps a decode GEMM's weight blocks small by spreading its columns over
    the PEs (a Llama-2-70B gate projection's 598 columns per chip: 120 tiles of 5 columns), but
    each tile then streams the whole reduction through the MAC array once per ``mac_cols``
    columns (two passes of 8,192 for 5 columns). Cutting the reduction into ``p`` parts on
    chunk boundaries (:func:`~tvm_spinn.program.ops.gemm.k_part_bounds`) gives each PE ``1 /
    p`` of a wider column block: about the same weight bytes per PE, fewer passes of a shorter
    reduction. Per layer the ``(columns, parts)`` with every tile in one round, the busiest
    PE's weight block under the cap (next to what this build's earlier programs and this
    program's earlier layers hold) and the fewest cycles of its slowest tile are kept when
    faster than the current tile. Integer partial sums are exact in any order: the bits are
    those of the unsplit tile. The caller keeps this layout only when the timing model finds
    it faster."""
    from ..program.ops import gemm

    if not current_options().split_k:  # reductions split over PEs switched off (MappingOptions)
        return None
    cap, budget, held = _ledger_start(arch, ranges, reserved)
    out_tables, out_records, changed = list(tables), list(records), False
    for i, layer in enumerate(program.layers):
        table = tables[i]
        if "split_k" not in family_of(layer.kind).layouts(layer) or not len(table) or int(table.group.min()) < 0 \
                or not int(table.w_bytes.max()):
            continue
        tm, tn, tk, *rest = (int(v) for v in records[i].tile)
        first, count = records[i].pes
        parts = rest[0] if rest else 1
        if len(table) != (int(table.group.max()) + 1) or int(table.lo[:, 0].max()) > 0 \
                or -(-int(layer.gemm[0]) // tm) > 1:
            continue  # several row tiles share each block (not a decode step): left as chosen
        n, k = int(layer.gemm[1]), int(layer.gemm[2])
        chunks = gemm.splits_of(k, tk)

        def slowest(t):  # cycles of the busiest PE: its tiles one after another
            return float(np.bincount(t.pe - first, weights=t.cycles).max())

        now = slowest(table)
        best = None
        widths = sorted({tn} | {arch.mac_cols * j for j in range(1, 17)})
        for c in widths:
            blocks = -(-n // c)
            most = min(chunks, count // blocks)
            # in one round more parts mean a shorter reduction per PE; the reducer's tail grows
            # by one partial-sum block a part: the two largest counts are the candidates
            for q in sorted({max(1, most - 1), most}):
                if (c, q) == (tn, parts) or not 1 <= blocks * q <= count:
                    continue
                tile = [tm, c, tk, q] if q > 1 else [tm, c, tk]
                costs = tile_costs(program, i, arch, tile)
                if int(costs.sram_bytes.max()) > budget or int(costs.w_bytes.max()) > cap:
                    continue
                key = (float(costs.cycles.max()), blocks * q)
                if key[0] < now and (best is None or key < best[0]):
                    best = (key, tile)
        if best is None:
            continue
        tile = best[1]
        placed, pes, b, rotate = _place_rotated(program, i, arch, tile, held, first, count,
                                                len(tile_costs(program, i, arch, tile).pe))
        if not (held[pes] + b <= cap).all():
            continue  # it would not stay resident where it lands: keep the current tile
        held[pes] += b
        changed = True
        out_tables[i] = placed
        out_records[i] = LayerMapping(tile=tuple(int(v) for v in tile), pes=(int(first), int(count)),
                                      rotate=int(rotate))
    return (out_tables, out_records) if changed else None


def _one_round_layout(program: Program, arch: SpinnArch, tables, records):
    """``(tables, records)`` with each fp32 ``matmul`` whose tiles take two rounds or more on
    some PE re-cut into wider column blocks that run in one round, where its slowest PE then
    takes fewer cycles; None when no layer changes.

    A decode step's attention matmuls are many small tiles (a slot-split score matmul on one
    chip of a Llama-2-70B board: 8 KV heads x 22 blocks of 2 slots = 176 tiles on 148 PEs, so
    28 PEs run two); the tile chooser's estimate puts every tile's operand load on the NoC ahead
    of the last tile's compute and prefers them to 120 tiles of 3 slots. Every fp32 output
    still sums its whole reduction in ascending ``k`` on one PE: the bits are the same. The
    caller keeps this layout only when the timing model finds it faster."""
    from ..program.ops.base import working_budget
    from ..program.ops.gemm import gemm_shape

    budget = working_budget(arch)
    out_tables, out_records, changed = list(tables), list(records), False
    for i, layer in enumerate(program.layers):
        table = tables[i]
        if "one_round" not in family_of(layer.kind).layouts(layer) or not len(table):
            continue
        first, count = records[i].pes
        per_pe = np.bincount(table.pe - first)
        if per_pe.max() < 2:
            continue
        tm, tn, tk, *rest = (int(v) for v in records[i].tile)
        g = gemm_shape(program, layer)
        rows = g.batch * -(-g.m // tm)
        now = float(np.bincount(table.pe - first, weights=table.cycles).max())
        best = None
        for blocks in range(count // rows, 0, -1):
            c = -(-g.n // blocks)
            if c <= tn:
                continue
            costs = tile_costs(program, i, arch, [tm, c, tk, *rest])
            if len(costs.pe) > count or int(costs.sram_bytes.max()) > budget:
                continue
            slowest = float(costs.cycles.max())
            if slowest < now and (best is None or slowest < best[0]):
                best = (slowest, [tm, c, tk, *rest])
            break  # the narrowest one-round width: wider ones only add work to a PE
        if best is None:
            continue
        changed = True
        out_tables[i] = place_tiles(tile_costs(program, i, arch, best[1]), first, count, arch)
        out_records[i] = LayerMapping(tile=tuple(int(v) for v in best[1]), pes=(int(first), int(count)))
    return (out_tables, out_records) if changed else None


def _memory_summary(plan) -> MemorySummary:
    """``program.memory`` of a memory plan."""
    return MemorySummary(peak_bytes_max=max(plan.peak_bytes.values(), default=0),
                         resident_bytes_total=sum(plan.resident_bytes.values()), busiest_pe=plan.busiest_pe,
                         ranges=tuple(AddressRange(*rng) for rng in plan.ranges))


def _keeps_every_activation(program: Program, plan, activations: str) -> bool:
    """Whether ``plan`` keeps on chip every activation any plan could keep.

    Then streaming the weights instead cannot be faster, and the build skips planning and timing
    it: the streaming plan would keep at most the same activations on chip and fetch every
    weight, and the timing model's cycles never decrease when a transfer moves from on-chip
    (resident weights, on-chip activations) to DRAM. Its timing would never be strictly better,
    and ties keep the weights, so the chosen plan is the same.
    """
    if activations == "dram":
        return True  # neither plan keeps any activation
    producer = {layer.output for layer in program.layers}
    consumed = {tid for layer in program.layers for tid in layer.inputs}
    # the candidates plan_memory considers: temporaries produced and read by layers
    eligible = {tid for tid in producer & consumed if program.tensors[tid].role == "temp"}
    return eligible <= set(plan.onchip_tensors)


def _plan(program: Program, arch: SpinnArch, weights: str, activations: str, tables, reserved=None):
    try:
        return plan_memory(program, arch, weights, activations, tables=tables, reserved=reserved)
    except MappingError:
        if activations == "dram":
            raise
        # fragmentation: spill activations
        return plan_memory(program, arch, weights, "dram", tables=tables, reserved=reserved)


def map_region(program: Program, arch: SpinnArch, options: MappingOptions, state: SystemState | None = None,
               memo: MappingMemo | None = None, onchip: tuple = (), streams: int = 0) -> tuple[Program, SystemState | None]:
    """Map ``program`` under ``state`` (see :func:`map_program`); returns the mapped program
    and the system's state after it (None off the multi-chip path, where programs share
    nothing). ``streams``: those its state is kept for (:attr:`~.budget.RegionBudget.streams`)."""
    if options.scheduler == "software" and arch.chips > 1:
        # the setup models one chip's scheduler PE: its packets' chip-to-chip hops are not costed
        raise ValueError(f"MappingOptions.scheduler='software' models a scheduler PE on one chip; "
                         f"{arch.name} has {arch.chips} chips")
    with options:  # the families' tile choice and the layouts read the active options (split_k)
        if options.naive or options.mode != "auto":
            return _build(program, arch, "sequential" if options.mode == "auto" else options.mode, options, state,
                          memo, onchip, streams)
        program, after = _build(program, arch, "sequential", options, state, memo, onchip, streams)
        if options.objective == "throughput" and arch.chips == 1:  # several chips: replicas (see .system)
            piped, _ = _build(program, arch, "pipelined", options, state, memo, onchip)
            if program.timing.throughput_inf_s < piped.timing.throughput_inf_s:
                program = replace(program, tiles=piped.tiles, mapping=piped.mapping, memory=piped.memory,
                                  timing=piped.timing)
    return program, after


def _graph_copy(program: Program) -> Program:
    """``program``'s graph as the mapper starts from it: without the tiles of an earlier
    mapping (records and constants' arrays shared: they are frozen, or read and never
    written)."""
    return replace(program, tiles=None)


def map_program(program: Program, arch: SpinnArch, options: MappingOptions | None = None,
                budget: RegionBudget | None = None) -> Program:
    """Tile, place, plan memory and time ``program``: returns the mapped program, a new one
    (``program`` itself is left as it was).

    ``mode="auto"`` maps sequentially for the latency objective; for the throughput objective on
    one chip it maps both ways and keeps the one with the higher simulated throughput. On
    several chips (not ``naive``, not ``mode="pipelined"``) :func:`.system.map_on_system` maps
    by shard plans; the throughput objective there picks the fewest chip-seconds per inference
    (the free chips hold replicas).

    ``budget``: the part of the system the program gets (what other programs hold, inputs
    already on chip), as :func:`.planner.plan_system` decided it for a region of a build;
    None: the program alone on the system. A program that does not fit raises
    :class:`MappingError`.
    """
    options = options or current_options()
    program = _graph_copy(program)
    if budget is None:
        return map_region(program, arch, options)[0]
    program, after = map_region(program, arch, options, budget.held, None, budget.onchip_inputs, budget.streams)
    if after is not None and after.overflow is not None:
        raise MappingError(overflow_message(after, arch))
    return program
