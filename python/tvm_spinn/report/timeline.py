"""Timelines of a compiled program: Perfetto (Chrome trace JSON) and matplotlib plots.

Both files are written through :mod:`tvm_spinn._files`: the path is checked before the
timeline is computed (a device, FIFO, socket or directory is refused with
:class:`~tvm_spinn._files.OutputPathError`), and the file appears complete or not at all.
"""

from __future__ import annotations

import json
import os

from .._files import atomic_output, atomic_write, output_destination
from ..mapping import derive_tables
from ..program import Program
from ..program.tiles import ProgramTiles
from ..timing import evaluate_traced
from ..target.arch import SpinnArch

__all__ = ["to_perfetto", "plot"]


def _timeline(program: Program, arch: SpinnArch):
    """The timing, its per-tile trace and the program's tiles (derived if not in memory)."""
    tiles = program.tiles if program.tiles is not None else ProgramTiles(derive_tables(program, arch))
    return (*evaluate_traced(program, arch, tiles.tables), tiles)


def to_perfetto(programs: list[Program], path: str) -> str:
    """Write a Chrome-trace JSON (open it in https://ui.perfetto.dev): one track per PE,
    one slice per tile's compute, one slice per layer on a "layers" track.

    Raises
    ------
    tvm_spinn._files.OutputPathError
        ``path`` is a device (``/dev/null`` included), FIFO, socket or directory.
    """
    output_destination(path, "Perfetto trace")  # refuse before the timeline is computed
    events = []
    offset_us = 0.0
    for index, program in enumerate(programs):
        arch = program.arch
        timing, trace, tiles = _timeline(program, arch)
        us = 1e6 / arch.clock_hz
        for row in timing.layers:
            events.append({"name": row.name, "cat": "layer", "ph": "X", "pid": index, "tid": -1,
                           "ts": offset_us + row.start_cycle * us, "dur": row.cycles * us,
                           "args": {"kind": row.kind, "tiles": row.tiles, "pes": row.pes,
                                    "dram_bytes": row.dram_bytes, "utilization": row.utilization}})
        for pe, tile, start, end in trace:
            layer = program.layers[int(tiles.layer_of(tile))]
            events.append({"name": layer.name, "cat": layer.kind, "ph": "X", "pid": index, "tid": pe,
                           "ts": offset_us + start * us, "dur": (end - start) * us})
        events.append({"name": "process_name", "ph": "M", "pid": index, "args": {"name": f"region {index}: {program.symbol}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": index, "tid": -1, "args": {"name": "layers"}})
        offset_us += timing.cycles * us
    doc = {"traceEvents": events, "displayTimeUnit": "ns"}

    text = json.dumps(doc, separators=(",", ":"), sort_keys=True)
    atomic_write(path, lambda f: f.write(text.encode()), what="Perfetto trace")
    return path


def plot(programs: list[Program], path: str) -> str:
    """PE-utilization heatmap (PE x layer) and a layer timeline, saved as an image.

    The format follows the extension of ``path`` (``.png`` when it has none).

    Raises
    ------
    tvm_spinn._files.OutputPathError
        ``path`` is a device (``/dev/null`` included), FIFO, socket or directory.
    """
    output_destination(path, "timeline plot")  # refuse before the figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows, names, spans = [], [], []
    start = 0.0
    for program in programs:
        arch = program.arch
        timing, trace, tiles = _timeline(program, arch)
        busy = np.zeros((len(program.layers), arch.total_pes))
        for pe, tile, s, e in trace:
            busy[int(tiles.layer_of(tile)), pe] += e - s
        for i, row in enumerate(timing.layers):
            rows.append(busy[i] / max(row.cycles, 1))
            names.append(row.name)
            spans.append((start + row.start_cycle / arch.clock_hz, row.cycles / arch.clock_hz))
        start += timing.latency_s
    heat = np.array(rows) if rows else np.zeros((1, 1))
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(10, 3 + 0.25 * len(names)), constrained_layout=True)
    im = ax0.imshow(heat, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=1)
    ax0.set_xlabel("PE")
    ax0.set_yticks(range(len(names)), names, fontsize=7)
    ax0.set_title("PE utilization per layer (compute cycles / layer cycles)")
    fig.colorbar(im, ax=ax0)
    for i, (s, d) in enumerate(spans):
        ax1.barh(i, d * 1e3, left=s * 1e3)
    ax1.set_yticks(range(len(names)), names, fontsize=7)
    ax1.invert_yaxis()
    ax1.set_xlabel("time (ms)")
    ax1.set_title("layer timeline")

    try:
        extension = os.path.splitext(path)[1]
        with atomic_output(path, what="timeline plot", suffix=extension) as tmp:
            fig.savefig(tmp, dpi=100, format=extension.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return path
