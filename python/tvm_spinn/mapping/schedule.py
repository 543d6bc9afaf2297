"""The mapping compiler's driver: tiles, placement, memory plan, static schedule, timing.

Per PE the schedule is an ordered task list ``[op, layer, tile, amount, where]``:
``dma_in`` (activation operand), ``dma_w`` (weight operand; ``local`` when the block is already
in SRAM: resident across inferences or fetched by an earlier tile of the same group; ``noc``
when another PE already read the block from DRAM in this layer and the NoC multicasts it),
``compute``, ``dma_out`` (``local`` when the output stays on-chip for its consumers),
``link`` (all-gather of a layer's input over the chip links, on the first PE of each chip) and
``barrier`` (closes a layer on every PE that took part). The timing model walks exactly this.
"""

from __future__ import annotations

from ..program import Program
from ..target.arch import SpinnArch
from .memory import plan_memory
from .options import MappingOptions, current_options
from .placement import choose_chips, pipeline_groups, place_tiles
from .tiling import MappingError, tile_layer

__all__ = ["map_program"]


def _assign(program: Program, arch: SpinnArch, mode: str, options: MappingOptions) -> tuple[list[list[int]], list[int]]:
    n = len(program.layers)
    ppc = arch.pes_per_chip
    if options.naive:
        return [list(range(ppc)) for _ in range(n)], [1] * n
    if arch.chips == 1 and mode != "pipelined":
        return [list(range(ppc)) for _ in range(n)], [1] * n
    # Layer flops are only known after tiling; tile once on one chip to learn them.
    for i in range(n):
        tile_layer(program, i, arch, pes=ppc)
    if mode == "pipelined":
        groups = pipeline_groups(program, arch)
        if groups is not None:
            chips = [len({pe // ppc for pe in g}) for g in groups]
            return groups, chips
    chips = choose_chips(program, arch)
    return [list(range(c * ppc)) for c in chips], chips


def _build(program: Program, arch: SpinnArch, mode: str, options: MappingOptions) -> None:
    from ..timing import evaluate

    n = len(program.layers)
    pe_sets, chips = _assign(program, arch, mode, options)
    program.tiles = []
    for i in range(n):
        tiles = tile_layer(program, i, arch, pes=len(pe_sets[i]), naive=options.naive)
        if options.naive:
            for k, tile in enumerate(tiles):
                tile.pe = pe_sets[i][k % len(pe_sets[i])]
                tile.chip = tile.pe // arch.pes_per_chip
        else:
            place_tiles(tiles, pe_sets[i], arch)
        program.tiles.extend(tiles)

    weights = "stream" if options.naive else options.weights
    activations = "dram" if options.naive else options.activations
    try:
        plan = plan_memory(program, arch, weights, activations)
    except MappingError:
        if activations == "dram":
            raise
        plan = plan_memory(program, arch, weights, "dram")  # fragmentation: spill activations

    resident = set(plan.resident_layers)
    onchip = set(plan.onchip_tensors)
    schedule: list[list[list]] = [[] for _ in range(arch.total_pes)]
    budget = arch.tile_sram_bytes
    prev_chips = None
    tiles_of: list[list[tuple[int, object]]] = [[] for _ in program.layers]
    for tid, tile in enumerate(program.tiles):
        tiles_of[tile.layer].append((tid, tile))
    for i, layer in enumerate(program.layers):
        acts = [tid for tid in layer.inputs if program.tensors[tid].role != "const"]
        in_src = "noc" if acts and all(tid in onchip for tid in acts) else "dram"
        out_dst = "local" if layer.output in onchip else "dram"
        layer_chips = sorted({pe // arch.pes_per_chip for pe in pe_sets[i]})
        if len(layer_chips) > 1 or (prev_chips is not None and layer_chips != prev_chips):
            in_bytes = sum(program.tensors[tid].nbytes for tid in acts)
            c = len(layer_chips)
            gather = in_bytes * (c - 1) // c if c > 1 else in_bytes
            if gather:
                for chip in layer_chips:
                    schedule[chip * arch.pes_per_chip].append(["link", i, -1, gather, "link"])
        prev_chips = layer_chips
        held: set[tuple[int, int]] = set()
        fetched: set[int] = set()  # weight groups already read from DRAM in this layer
        used = set()
        for tid, tile in tiles_of[i]:
            used.add(tile.pe)
            queue = schedule[tile.pe]
            queue.append(["dma_in", i, tid, tile.in_bytes, in_src])
            if tile.w_bytes:
                if i in resident or (tile.pe, tile.group) in held:
                    queue.append(["dma_w", i, tid, tile.w_bytes, "local"])
                else:
                    # The NoC multicasts a block to every PE that needs it: one DRAM read per group.
                    shared = tile.group >= 0 and tile.group in fetched and not options.naive
                    queue.append(["dma_w", i, tid, tile.w_bytes, "noc" if shared else "dram"])
                    fetched.add(tile.group)
                    if tile.group >= 0 and tile.w_bytes + tile.sram_bytes <= budget and not options.naive:
                        held.add((tile.pe, tile.group))
            queue.append(["compute", i, tid, tile.cycles, "pe"])
            queue.append(["dma_out", i, tid, tile.out_bytes, out_dst])
        for pe in sorted(used):
            schedule[pe].append(["barrier", i, -1, 0, "pe"])
    program.schedule = schedule
    program.mapping = {
        "mode": mode, "options": options.to_dict(), "chips_per_layer": chips,
        "pes_per_layer": [len(s) for s in pe_sets], "double_buffer": not options.naive,
        "resident_layers": plan.resident_layers, "onchip_tensors": plan.onchip_tensors,
    }
    program.memory = {
        "peak_bytes_max": max(plan.peak_bytes.values(), default=0),
        "resident_bytes_total": sum(plan.resident_bytes.values()),
        "busiest_pe": plan.busiest_pe, "ranges": plan.ranges,
    }
    # The per-tile trace is recomputed on demand (report.to_perfetto), not stored.
    program.timing = evaluate(program, arch).to_dict(trace=False)


def map_program(program: Program, arch: SpinnArch, options: MappingOptions | None = None) -> Program:
    """Tile, place, plan memory, schedule and time ``program`` in place; returns it.

    ``mode="auto"`` maps sequentially for the latency objective; for the throughput objective it
    maps both ways and keeps the one with the higher simulated throughput.
    """
    options = options or current_options()
    if options.naive or options.mode != "auto":
        _build(program, arch, "sequential" if options.mode == "auto" else options.mode, options)
        return program
    _build(program, arch, "sequential", options)
    if options.objective == "throughput":
        seq = (program.timing["throughput_inf_s"], program.tiles, program.schedule, program.mapping,
               program.memory, program.timing)
        _build(program, arch, "pipelined", options)
        if seq[0] >= program.timing["throughput_inf_s"]:
            (_, program.tiles, program.schedule, program.mapping, program.memory, program.timing) = seq
    return program
