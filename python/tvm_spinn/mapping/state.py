"""The state a region keeps on its chips between calls, and the streams it keeps it for.

A region's *state* is its inputs read only as the cached operand of their readers (a KV cache,
a recurrent state: :func:`resident_state`): the chips hold it between calls instead of reading
it in on each one, so a call moves only its other inputs (:func:`data_inputs`). Each chip holds
its share under the region's shard plan (:func:`state_per_chip`, :func:`chip_bytes`).

A build's inputs go through its regions in turn while its boards and links overlap, so it keeps
several in flight (:func:`build_flight`), each a stream with its own copy of every region's
state: the copy the memory plan keeps in SRAM is the running stream's, the others wait in DRAM,
and every input exchanges the SRAM copy for the next stream's (:func:`state_copies`,
:func:`streamed_timing`, :func:`with_streams`; the count a region holds copies for is in its
records, :func:`region_streams`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from ..program import Program
from ..program.records import TimingSummary
from ..target.arch import SpinnArch
from ..target.faults import usable_boards
from .shard import recorded_plan, rule_of

if TYPE_CHECKING:  # the return annotation only: timing.stages is imported where it is used
    from ..timing.stages import PipelineTiming

__all__ = ["resident_state", "data_inputs", "data_bytes", "state_per_chip", "chip_bytes", "state_copies",
           "streamed_timing", "with_streams", "region_streams", "build_flight"]


def state_copies(shard: Program, streams: int, arch: SpinnArch) -> tuple[int, float]:
    """What keeping a mapped program's state for ``streams`` streams costs a chip over one
    stream: ``(DRAM bytes, seconds an input)``. Each stream has its own copy; the one the memory
    plan keeps in SRAM is the running stream's, the others wait in DRAM (each copy whole there:
    the SRAM one is exchanged through it), and every input exchanges the SRAM copy for the next
    stream's (:func:`tvm_spinn.timing.stages.state_exchange_s`). ``(0, 0.0)`` for one stream.
    ``shard``: a program mapped on one chip or a system-mapped one (its chip's share,
    :func:`state_per_chip`)."""
    from ..timing.stages import state_exchange_s

    if streams <= 1:
        return 0, 0.0
    whole, in_sram = state_per_chip(shard)
    return (streams - 1) * whole, state_exchange_s(in_sram, arch.dram_bw_bytes_s)


def streamed_timing(timing: TimingSummary, shard: Program, streams: int, chips: int, arch: SpinnArch) -> TimingSummary:
    """``timing`` (of one stream) with the exchange of the SRAM copy of the state between
    ``streams`` streams (:func:`state_copies`) on each of ``chips`` chips: one input's latency
    includes it, its bytes cross each chip's DRAM (``dram_bytes`` is a chip's), its energy is
    the DRAM's and the chips' static power meanwhile."""
    _, seconds = state_copies(shard, streams, arch)
    if not seconds:
        return timing
    moved = 2 * state_per_chip(shard)[1]
    latency = timing.latency_s + seconds
    return replace(timing, latency_s=latency, cycles=int(round(latency * arch.clock_hz)),
                   throughput_inf_s=1.0 / latency, dram_bytes=int(timing.dram_bytes + moved),
                   energy_j=timing.energy_j + chips * (moved * arch.e_dram_byte_j + arch.p_static_w_per_chip * seconds))


def data_inputs(program: Program) -> list[int]:
    """The inputs of ``program`` a call moves: all but its state (:func:`resident_state`, held
    on the chips between calls, such as a KV cache), in input order. A hand-over of the inputs
    from the chips of the region before carries these."""
    state = resident_state(program, range(len(program.layers)))
    return [t for t in program.inputs if t not in state]


def data_bytes(program: Program) -> int:
    """Bytes of ``program``'s :func:`data_inputs`: what a call's hand-over of its inputs moves."""
    return sum(program.tensors[t].nbytes for t in data_inputs(program))


def resident_state(program: Program, resident) -> set[int]:
    """Inputs of ``program`` read only as the right operand of ``matmul`` layers that are all in
    ``resident`` (layer indices whose operands the memory plan keeps in SRAM): state the chips
    hold between calls, such as a KV cache (:func:`.shard._cache_inputs` splits it so that each
    chip keeps the part its attention reads), not read from DRAM on each call."""
    resident = set(resident)
    readers: dict[int, list] = {}
    for i, layer in enumerate(program.layers):
        for pos, tid in enumerate(layer.inputs):
            readers.setdefault(tid, []).append((i, layer, pos))
    return {tid for tid in program.inputs if program.tensors[tid].role != "const" and readers.get(tid)
            and all(rule_of(layer).cache_operand(layer, pos) and i in resident for i, layer, pos in readers[tid])}


def with_streams(program: Program, streams: int, arch: SpinnArch) -> Program:
    """A system-mapped ``program`` (mapped for one stream) with its state kept for ``streams``
    streams: recorded in ``mapping.system.streams`` (a program without state keeps 1) and the
    exchange of its SRAM copy in its timing (:func:`streamed_timing`)."""
    system = program.mapping.system
    if streams <= 1 or not resident_state(program, range(len(program.layers))):
        return program
    return replace(program, mapping=replace(program.mapping, system=replace(system, streams=int(streams))),
                   timing=streamed_timing(program.timing, program, streams, int(system.chips), arch))


def region_streams(program: Program) -> int:
    """The streams a mapped region keeps its state for (each input in flight a stream with its
    own copy of the state), as its records say: ``mapping.system.streams``, over pipeline
    stages its stages'; 1 off the multi-chip path.

    Parameters
    ----------
    program : Program
        A mapped program.

    Returns
    -------
    int
    """
    pipe = program.mapping.pipeline
    systems = [st.mapping.system for st in pipe.stages] if pipe is not None else [program.mapping.system]
    return max((int(s.streams) for s in systems if s is not None), default=1)


def build_flight(programs, arch: SpinnArch) -> "PipelineTiming":
    """A build's stream of inputs through its mapped regions, as a pipeline: each input goes
    through every region in turn (the latency is the sum of theirs), while in steady state the
    boards and links overlap, each on its own input. ``stage_s``: each board's busy time an
    input (the regions on it one after another; a region over pipeline stages counts each
    stage on its own board, any other region on its stage's board: on a system with faults,
    the stage-th usable board), in board order; the period is the longest of the boards' and
    of the link transfers each input makes (a pipelined region's sends and the hand-in of its
    inputs); ``binding`` names it (``"board <b>"``, ``"send <symbol> <k>"``, ``"hand-in
    <symbol>"``). Its :attr:`~tvm_spinn.timing.stages.PipelineTiming.in_flight` is the
    streams the build keeps in flight, each with its own copy of every region's state.

    Parameters
    ----------
    programs : sequence of Program
        The build's mapped regions, in the order they run.
    arch : SpinnArch
        The system.

    Returns
    -------
    PipelineTiming
    """
    from ..timing.stages import PipelineTiming

    usable = usable_boards(arch)
    busy: dict[int, float] = {}
    links: list[tuple[float, str]] = []
    for p in programs:
        pipe = p.mapping.pipeline
        if pipe is not None:  # over pipeline stages: each stage's time on its board
            t = p.timing.pipeline
            parts = [(st.chips[0] // arch.chips_per_board, s) for st, s in zip(pipe.stages, t.stage_s)]
            links += [(s, f"send {p.symbol} {k}") for k, s in enumerate(t.send_s)]
            links.append((max(0.0, p.timing.latency_s - t.latency_s), f"hand-in {p.symbol}"))
        else:
            stage = p.mapping.system.stage if p.mapping.system is not None else 0
            parts = [(usable[stage] if stage < len(usable) else stage, p.timing.latency_s)]
        for board, seconds in parts:
            busy[board] = busy.get(board, 0.0) + seconds
    boards = sorted(busy)
    period, binding = 0.0, f"board {boards[0]}" if boards else "board 0"
    for seconds, what in [(busy[b], f"board {b}") for b in boards] + links:
        if seconds > period:
            period, binding = seconds, what
    return PipelineTiming(tuple(float(busy[b]) for b in boards), (), float(period), binding,
                          float(sum(p.timing.latency_s for p in programs)))


def state_per_chip(program: Program) -> tuple[int, int]:
    """``(state bytes, of them in SRAM)`` one chip of a mapped ``program`` holds of one copy of
    its state (:func:`resident_state`: the inputs it keeps between calls, such as a KV cache):
    in SRAM, the state its memory plan keeps resident (:func:`chip_bytes`)."""
    every = resident_state(program, range(len(program.layers)))
    kept = resident_state(program, program.mapping.resident_layers)
    return chip_bytes(program, every), chip_bytes(program, kept)


def chip_bytes(program: Program, tensors) -> int:
    """Bytes of ``tensors`` (ids of ``program``) one chip of a system-mapped ``program`` holds:
    its share of each under the shard plan (the plan's local shape; exact: a plan's shares
    divide the tensors' extents); off the multi-chip path, the tensors' own bytes."""
    shapes = recorded_plan(program).shapes if program.mapping.system is not None else None
    out = 0
    for t in sorted(int(t) for t in tensors):
        x = program.tensors[t]
        if shapes is None:
            out += int(x.nbytes)
        else:  # the tensor's bytes scaled by the chip's share of its elements
            out += int(x.nbytes) * int(np.prod(shapes[t], dtype=np.int64)) // max(1, int(np.prod(x.shape, dtype=np.int64)))
    return out
