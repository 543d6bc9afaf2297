"""Placement and static schedule: tiles to PEs, per-PE ordered task lists with DMA and barriers.

Policy of this first mapper (layer-sequential): every layer's tiles are spread round-robin over
all PEs of the system, starting after the PE that received the previous layer's last tile so
that small layers do not all land on PE 0. Each tile is a ``dma_in`` (inputs and weights from
DRAM), a ``compute`` and a ``dma_out``; a ``barrier`` closes each layer on every PE that took part.
"""

from __future__ import annotations

from ..program import Program
from ..target.arch import SpinnArch
from .tiling import tile_layer

__all__ = ["map_program"]


def map_program(program: Program, arch: SpinnArch) -> Program:
    """Tile, place and schedule ``program`` in place; returns it for chaining."""
    from ..runtime.timing import evaluate

    pes = arch.total_pes
    program.tiles = []
    schedule: list[list[list]] = [[] for _ in range(pes)]
    cursor = 0
    for index in range(len(program.layers)):
        tiles = tile_layer(program, index, arch)
        used = set()
        for tile in tiles:
            tile.pe = cursor % pes
            cursor += 1
            tid = len(program.tiles)
            program.tiles.append(tile)
            used.add(tile.pe)
            queue = schedule[tile.pe]
            queue.append(["dma_in", index, tid, tile.in_bytes + tile.w_bytes])
            queue.append(["compute", index, tid, tile.cycles])
            queue.append(["dma_out", index, tid, tile.out_bytes])
        for pe in sorted(used):
            schedule[pe].append(["barrier", index, -1, 0])
    program.schedule = schedule
    program.timing = evaluate(program, arch).to_dict()
    return program
