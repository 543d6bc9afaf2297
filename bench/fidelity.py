"""Fidelity benchmark: the timing model against published SpiNNaker2 silicon measurements.

Every published measurement is a *case*: a program of the same kind built here (the papers'
shapes could not be read, so the shapes are ours, fixed before any calibration), mapped with the
product's own mapper and costed with its own timing model (:func:`tvm_spinn.mapping.map_program`,
:func:`tvm_spinn.timing.evaluate`), in the setup the measurement was taken in (mapping options,
chip preset). Each row prints the measured value, the modelled one and their ratio; a case is
*held out* when no constant of the model was looked at against it (at least a third are), and
a *calibration input* when the model takes the measured figure itself (a published cost of the
measured setup's software): such a row validates nothing and is counted apart.

Sources:

- [OJCAS26] the production-chip paper, arXiv 2607.24396 (IEEE OJCAS 2026), Table 3: int8
  inference with the operators "allocated entirely in the on-chip SRAM": 4.563 TOPS, 2.219 W
  at 300 MHz / 0.8 V (2.06 TOPS/W); 2.281 TOPS, 0.825 W at 150 MHz / 0.5 V (2.77 TOPS/W);
  4.563 of 5.837 TOPS = 78% for a transformer matmul tiled over the whole chip (Section 4.3).
- [Octopus] OctopuScheduler on one production chip (IEEE NICE 2025, and its multi-layer
  extension, arXiv 2507.13736): fully-connected
  layers at batch 1 reach 16-19% MAC utilisation ("1 of 4 MAC-array rows used"); an MLP layer
  streaming its weights from DRAM takes 323 us = weight fetch 192 us + MAC array 29 us + the
  rest serial (per-layer fetch -> compute -> write-back, one scheduler PE); ~13 us of scheduling
  per layer, 39 us of set-up and 93 us of clean-up per inference (the scheduler software's
  costs, not the silicon's: :data:`tvm_spinn.timing.software.OCTOPUS_SCHEDULER`).

    python bench/fidelity.py            # every case
    python bench/fidelity.py --quick    # the cheap cases (those tests/timing/test_fidelity.py checks)
    python bench/fidelity.py --schedule 64   # the stream-dram M=64 layer's schedule per worker PE

Exits non-zero only when a case fails to run (it is a benchmark: errors are printed, not
asserted; ``tests/timing/test_fidelity.py`` asserts the cases that meet the +-15% target).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
from tvm_spinn.mapping import MappingOptions, map_program
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.program.records import LayerTimingSummary
from tvm_spinn.target.arch import CHIPS, SpinnArch
from tvm_spinn.timing import evaluate
from tvm_spinn.timing.software import OCTOPUS_SCHEDULER as OCTOPUS_COSTS

#: The target band of every case with a silicon figure: modelled / measured in [0.85, 1.15].
TOLERANCE = 0.15


@dataclass(frozen=True)
class Result:
    """What a case's program reports: the measured layer's and the whole program's figures."""

    value: float
    note: str = ""


@dataclass(frozen=True)
class Case:
    """One published measurement and the program that models it."""

    name: str
    source: str
    setup: str
    measured: float
    unit: str
    held_out: bool
    cheap: bool
    model: Callable[[], Result]
    #: a calibration input: the model takes the measured figure itself (a published cost of the
    #: measured setup's software), so the row checks that the model uses it, and validates
    #: nothing; counted apart from the validation cases
    calibration: bool = False

    def run(self) -> tuple[float, float, str]:
        r = self.model()
        return r.value, r.value / self.measured, r.note


# -- programs ------------------------------------------------------------------------------------
def _dense(tensors: list[TensorDesc], x: int, k: int, n: int, i: int, out: str = "int8") -> Layer:
    """An int8 dense layer reading tensor ``x``: ``y = requantize(x @ W)`` (int8 output), or with
    ``out="int32"`` the raw int32 sums ``x @ W`` (no epilogue)."""
    consts = {"weight": len(tensors)}
    tensors.append(TensorDesc(f"w{i}", [k, n], "int8", "const"))
    for role, dtype in (("bias_q", "int32"), ("multiplier", "int32"), ("shift", "int32")) if out == "int8" else ():
        consts[role] = len(tensors)
        tensors.append(TensorDesc(f"{role}{i}", [n], dtype, "const"))
    m = tensors[x].shape[0]
    tensors.append(TensorDesc(f"y{i}", [m, n], out, "temp"))
    attrs = dict(x_zero=0, x_flip=False, relu=False, out=out)
    return Layer(name=f"dense{i}", kind="dense", inputs=[x], output=len(tensors) - 1, consts=consts,
                 attrs=attrs, mode="int8")


def dense_chain(m: int, k: int, n: int, layers: int, arch: SpinnArch, last: str = "int8") -> Program:
    """``layers`` int8 dense layers ``[m, k] @ [k, n]`` (then ``[m, n] @ [n, n]``...) in a row,
    the last one with a ``last`` output (``int32``: its raw sums)."""
    tensors = [TensorDesc("x", [m, k], "int8", "input")]
    body, x = [], 0
    for i in range(layers):
        layer = _dense(tensors, x, k if i == 0 else n, n, i, last if i == layers - 1 else "int8")
        body.append(layer)
        x = layer.output
    tensors[x] = replace(tensors[x], role="output")
    return Program("main", arch, tensors, [0], [x], body)


def _mapped(program: Program, arch: SpinnArch, options: MappingOptions) -> Program:
    return map_program(program, arch, options)


def _on_chip(p: Program, arch: SpinnArch) -> Program:
    """``p`` with its inputs and outputs in SRAM too, timed again by the product's
    :func:`~tvm_spinn.timing.evaluate` on a mapping that says so."""
    onchip = tuple(sorted(set(p.mapping.onchip_tensors) | set(p.inputs) | set(p.outputs)))
    p = replace(p, mapping=replace(p.mapping, onchip_tensors=onchip))
    return replace(p, timing=evaluate(p, arch))


def _middle(m: int, k: int, arch: SpinnArch, split_k: bool = True) -> tuple[Program, LayerTimingSummary]:
    """A chain of three ``[m, k] @ [k, k]`` int8 dense layers with their weights resident in SRAM
    and the activations kept on chip: the middle layer has every operand in SRAM (the paper's
    "operators allocated entirely in the on-chip SRAM"). ``split_k=False``: each output's whole
    reduction on one PE (OctopuScheduler's partitioning of a layer: output features over the PEs;
    tvm-spinn's own tile chooser may also split a reduction over PEs and exchange partial sums)."""
    p = _mapped(dense_chain(m, k, k, 3, arch), arch, MappingOptions(weights="resident", split_k=split_k))
    return p, p.timing.layers[1]


def _matmul_sram(m: int, k: int, arch: SpinnArch) -> tuple[Program, LayerTimingSummary]:
    """The chip paper's measured int8 matmul ([OJCAS26] Table 3): one ``[m, k] @ [k, k]`` layer
    with raw int32 sums (the int8 GEMM with an ``int32`` output: the MAC array's sums, no
    requantization, no zero points), weights resident and its input and output in SRAM too
    (every operand on chip)."""
    p = _mapped(dense_chain(m, k, k, 1, arch, last="int32"), arch, MappingOptions(weights="resident"))
    p = _on_chip(p, arch)
    return p, p.timing.layers[0]


def sram_tops(m: int, k: int, chip: str) -> Callable[[], Result]:
    def run() -> Result:
        arch = CHIPS[chip]
        p, mid = _matmul_sram(m, k, arch)
        tops = mid.flops / (mid.cycles / arch.clock_hz) / 1e12
        return Result(tops, f"{mid.pes} PEs, {mid.tiles} tiles, {mid.cycles} cycles, "
                            f"compute {mid.compute_cycles / max(1, mid.pes):.0f}/PE")
    return run


def sram_tops_w(m: int, k: int, chip: str) -> Callable[[], Result]:
    """Whole-program TOPS/W of the :func:`_matmul_sram` program (the paper's setup: every
    operator's operands on chip)."""
    def run() -> Result:
        arch = CHIPS[chip]
        p, _ = _matmul_sram(m, k, arch)
        t = p.timing
        return Result(t.flops / t.energy_j / 1e12,
                      f"{t.flops / t.latency_s / 1e12:.3f} TOPS at {t.energy_j / t.latency_s:.3f} W "
                      f"(silicon: {'4.563 TOPS at 2.219' if chip == 'production' else '2.281 TOPS at 0.825'} W)")
    return run


def fc_utilisation(k: int) -> Callable[[], Result]:
    """Batch-1 fully-connected layer, weights in SRAM, partitioned as OctopuScheduler does
    (``split_k=False``, see :func:`_middle`): MACs / (cycles x PEs used x array MACs). The note gives
    tvm-spinn's own schedule of the layer (reductions split where faster)."""
    def util(mid, arch):
        return mid.flops / 2 / (mid.cycles * max(1, mid.pes) * arch.macs_per_cycle)

    def run() -> Result:
        arch = CHIPS["production"]
        _, mid = _middle(1, k, arch, split_k=False)
        _, own = _middle(1, k, arch)
        return Result(util(mid, arch), f"{mid.pes} PEs, {mid.cycles} cycles; tvm-spinn's own schedule "
                                       f"{own.pes} PEs, {own.cycles} cycles (utilisation {util(own, arch):.3f})")
    return run


#: The streamed layer's weights: 1024 x 1200 int8 = 1.2288 MB ([Octopus]: 1.23 MB).
STREAM_K, STREAM_N = 1024, 1200


#: OctopuScheduler's setup ([Octopus]): one scheduler PE dispatches every layer to the worker
#: PEs and collects their completion packets; per tile fetch -> compute -> write-back, every
#: operand in DRAM.
OCTOPUS = dict(scheduler="software", double_buffer=False)


def _software_breakdown(p: Program, arch: SpinnArch) -> str:
    """The phases of a software-scheduled layer (the timing model's own cost functions):
    the scheduler's dispatch, the DRAM fetch, the busiest PE's MAC and write-back time and the
    completion gather (every worker's packet taken one by one)."""
    from tvm_spinn.timing.model import LOCAL, scheduler_path_cycles, software_dispatch, transfers

    table = p.tiles.tables[0]
    us = 1e6 / arch.clock_hz
    _, sent = software_dispatch(table, arch)
    _, _, out_dst = transfers(p, 0, table, arch)
    write = np.where((out_dst != LOCAL) & (table.out_bytes > 0),
                     arch.dma_setup_cycles + table.out_bytes / arch.dma_bw_bytes_per_cycle, 0.0)
    mac = float(np.bincount(table.pe, weights=table.cycles).max())
    wb = float(np.bincount(table.pe, weights=write).max())
    workers = len(np.unique(table.pe))
    gather = (workers + 1) * arch.task_word_cycles + scheduler_path_cycles(arch)
    t = p.timing
    return (f"{workers} workers: dispatch {sent * us:.1f} us, fetch {t.dram_bytes / arch.dram_bw_bytes_s * 1e6:.1f} us "
            f"({t.dram_bytes / 1e6:.2f} MB), MAC busiest PE {mac * us:.1f} us, write-back {wb * us:.2f} us, "
            f"completion {gather * us:.2f} us")


def stream_latency(m: int) -> Callable[[], Result]:
    """One int8 dense layer whose weights stream from DRAM, in OctopuScheduler's setup
    (:data:`OCTOPUS`: a software scheduler PE, per-tile fetch -> compute -> write-back, weights
    and activations in DRAM, one chip). Latency in microseconds; the note gives the phases and
    tvm-spinn's own (static, double-buffered) schedule of the same streamed layer."""
    def run() -> Result:
        arch = CHIPS["production"]
        setup = MappingOptions(weights="stream", activations="dram", **OCTOPUS)
        p = _mapped(dense_chain(m, STREAM_K, STREAM_N, 1, arch), arch, setup)
        own = _mapped(dense_chain(m, STREAM_K, STREAM_N, 1, arch), arch, MappingOptions(weights="stream"))
        return Result(p.timing.latency_s * 1e6,
                      f"{_software_breakdown(p, arch)} (silicon: fetch 192, MAC 29); tvm-spinn's own static "
                      f"double-buffered schedule {own.timing.latency_s * 1e6:.1f} us")
    return run


def stream_schedule(m: int) -> dict:
    """The :func:`stream_latency` layer's schedule per worker PE, from the timing model's own
    functions (:func:`~tvm_spinn.timing.model.transfers`,
    :func:`~tvm_spinn.timing.model.software_dispatch`,
    :func:`~tvm_spinn.timing.model.shared_dram_run`,
    :func:`~tvm_spinn.timing.model.multicast_readers`): which bytes each worker reads from DRAM and
    receives over the NoC, when its task arrives, when its MAC work runs and when it finishes,
    and for every input row block how many tiles read it from DRAM and how many receive it by
    multicast. Times in microseconds from the layer's start (after the scheduler's set-up).

    Returns ``{"program", "workers": [per-PE dict], "inputs": [per-block dict], "tiles": [per-tile
    dict, PE order]}``.
    """
    from tvm_spinn.timing.model import (DRAM, LOCAL, NOC, multicast_readers, shared_dram_run, software_dispatch,
                                        transfers)

    arch = CHIPS["production"]
    setup = MappingOptions(weights="stream", activations="dram", **OCTOPUS)
    p = _mapped(dense_chain(m, STREAM_K, STREAM_N, 1, arch), arch, setup)
    table = p.tiles.tables[0]
    in_src, w_src, out_dst = srcs = transfers(p, 0, table, arch)
    ready, _ = software_dispatch(table, arch)
    run = shared_dram_run(table, srcs, arch, ready, multicast_readers(p, 0, table, srcs))
    us = 1e6 / arch.clock_hz
    order, begin, end = run["order"], run["begin"] * us, run["end"] * us
    tiles = [dict(tile=int(i), pe=int(table.pe[i]), rows=(int(table.lo[i, 1]), int(table.hi[i, 1])),
                  cols=(int(table.lo[i, 2]), int(table.hi[i, 2])), group=int(table.group[i]),
                  input={DRAM: "dram", NOC: "noc", LOCAL: "local"}[int(in_src[i])],
                  weight={DRAM: "dram", NOC: "noc", LOCAL: "local"}[int(w_src[i])],
                  mac_start=float(begin[j]), mac_end=float(end[j]))
             for j, i in enumerate(order.tolist())]
    workers = []
    for k, pe in enumerate(run["pes"].tolist()):
        mine = table.pe == pe
        first = int(np.flatnonzero(mine)[0])
        workers.append(dict(
            pe=pe, tiles=int(mine.sum()), ready=float(ready[first] * us),
            w_dram=int(table.w_bytes[mine & (w_src == DRAM)].sum()), w_noc=int(table.w_bytes[mine & (w_src == NOC)].sum()),
            in_dram=int(table.in_bytes[mine & (in_src == DRAM)].sum()),
            in_noc=int(table.in_bytes[mine & (in_src == NOC)].sum()),
            out_dram=int(table.out_bytes[mine & (out_dst == DRAM)].sum()),
            mac=float(table.cycles[mine].sum() * us),
            first_mac=min(t["mac_start"] for t in tiles if t["pe"] == pe), finish=float(run["finish"][k] * us)))
    blocks = {}
    for i in range(len(table)):
        key = (int(table.lo[i, 1]), int(table.hi[i, 1]))
        b = blocks.setdefault(key, {"rows": key, "dram": 0, "noc": 0, "local": 0, "pes": set()})
        b[{DRAM: "dram", NOC: "noc", LOCAL: "local"}[int(in_src[i])]] += 1
        b["pes"].add(int(table.pe[i]))
    inputs = [dict(b, pes=len(b["pes"])) for _, b in sorted(blocks.items())]
    for b in inputs:
        # read_before: the reading tile's MAC start (its DRAM read of the block ended before);
        # first_use: the earliest MAC of a tile computing on a multicast copy of the block
        mine = [x for x in tiles if x["rows"] == b["rows"]]
        b["read_before"] = max((x["mac_start"] for x in mine if x["input"] == "dram"), default=float("nan"))
        b["first_use"] = min((x["mac_start"] for x in mine if x["input"] == "noc"), default=float("nan"))
    return {"program": p, "workers": workers, "inputs": inputs, "tiles": tiles}


def print_schedule(m: int) -> None:
    """Print :func:`stream_schedule` (``--schedule M``): every worker PE, the input row blocks'
    reads and the slowest worker's tiles."""
    s = stream_schedule(m)
    t = s["program"].timing
    arch = CHIPS["production"]
    print(f"stream-dram M={m}: {len(s['workers'])} workers, layer {t.latency_s * 1e6:.1f} us (set-up "
          f"{OCTOPUS_COSTS.setup_s * 1e6:.0f} + clean-up {OCTOPUS_COSTS.cleanup_s * 1e6:.0f} us included), "
          f"DRAM {t.dram_bytes} B = {t.dram_bytes / arch.dram_bw_bytes_s * 1e6:.1f} us of the channel")
    for b in s["inputs"]:
        print(f"  input rows {b['rows'][0]}-{b['rows'][1]}: read from DRAM by {b['dram']} tile(s), "
              f"multicast to {b['noc']} tile(s), kept in SRAM for {b['local']}, on {b['pes']} PEs; "
              f"its DRAM read ends by {b['read_before']:.1f} us, first used by a receiver at {b['first_use']:.1f} us")
    print(f"  {'pe':>4s} {'tiles':>5s} {'ready':>6s} {'w dram':>7s} {'w noc':>6s} {'in dram':>7s} {'in noc':>7s} "
          f"{'out':>5s} {'MAC us':>6s} {'1st MAC':>7s} {'finish':>7s}")
    for w in s["workers"]:
        print(f"  {w['pe']:4d} {w['tiles']:5d} {w['ready']:6.1f} {w['w_dram']:7d} {w['w_noc']:6d} {w['in_dram']:7d} "
              f"{w['in_noc']:7d} {w['out_dram']:5d} {w['mac']:6.1f} {w['first_mac']:7.1f} {w['finish']:7.1f}")
    slow = max(s["workers"], key=lambda w: w["finish"])
    print(f"  the last worker to finish, PE {slow['pe']}:")
    for tile in (x for x in s["tiles"] if x["pe"] == slow["pe"]):
        print(f"    tile {tile['tile']}: rows {tile['rows']}, cols {tile['cols']}, input {tile['input']}, "
              f"weights {tile['weight']}, MAC {tile['mac_start']:.1f}-{tile['mac_end']:.1f} us")


def layer_fixed_cost() -> Result:
    """The fixed cost of one layer: what one more one-block int8 layer (4 x 16 x 16) adds to a
    program on one chip, every operand from DRAM, in OctopuScheduler's setup (:data:`OCTOPUS`);
    microseconds. The note gives the static schedule's cost of the same layer (a barrier of
    NoC packets)."""
    arch = CHIPS["production"]

    def added(options):
        one, two = (_mapped(dense_chain(4, 16, 16, n, arch), arch, options).timing.latency_s for n in (1, 2))
        return (two - one) * 1e6

    soft = added(MappingOptions(naive=True, **OCTOPUS))
    return Result(soft, f"static schedule {added(MappingOptions(naive=True)):.2f} us")


def cases() -> list[Case]:
    src_t3 = "[OJCAS26] Table 3"
    src_o = "[Octopus] arXiv 2507.13736"
    sram = "one int8 matmul with int32 sums, weights resident, every operand on chip"
    out = []
    for chip, mhz, tops in (("production", 300, 4.563), ("production-150mhz", 150, 2.281)):
        for (m, k), held in (((2048, 256), False), ((512, 256), mhz == 300), ((4096, 128), True)):
            out.append(Case(f"matmul-sram-{mhz} {m}x{k}x{k}", src_t3 + (", S4.3" if mhz == 300 else ""),
                            f"{sram}, {mhz} MHz", tops, "TOPS", held, True, sram_tops(m, k, chip)))
    for k, held in ((1024, False), (512, True)):
        out.append(Case(f"fc-batch1 1x{k}x{k}", src_o + " (MAC utilisation 16-19%)",
                        "batch-1 dense, weights resident", 0.175, "MAC util", held, True, fc_utilisation(k)))
    for m, held in ((16, False), (1, True), (64, True)):
        out.append(Case(f"stream-dram M={m}", src_o + " (323 us MLP layer)",
                        "1.23 MB weights from DRAM, software scheduler, fetch -> MAC -> write-back", 323.0, "us", held, True,
                        stream_latency(m)))
    out.append(Case("layer-fixed-cost", src_o + " (~13 us/layer, scheduler software)",
                    "one more tiny int8 layer, naive, software scheduler", 13.0, "us", False, True, layer_fixed_cost,
                    calibration=True))
    for chip, mhz, tw, (m, k), held in (("production", 300, 2.06, (2048, 256), False),
                                         ("production-150mhz", 150, 2.77, (2048, 256), False),
                                         ("production", 300, 2.06, (512, 256), True)):
        out.append(Case(f"tops-w-{mhz} {m}x{k}x{k}", src_t3 + f" ({tw} TOPS/W)", f"whole program, {sram}, input and output in SRAM, {mhz} MHz",
                        tw, "TOPS/W", held, True, sram_tops_w(m, k, chip)))
    return out


def _kind(case: Case) -> str:
    """The row's kind: ``held`` out, ``fit`` (looked at while calibrating) or ``cal`` (a
    calibration input)."""
    return "cal" if case.calibration else "held" if case.held_out else "fit"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the cheap cases")
    ap.add_argument("--schedule", type=int, metavar="M",
                    help="print the stream-dram M layer's schedule per worker PE instead")
    args = ap.parse_args(argv)
    if args.schedule is not None:
        if args.schedule < 1:
            ap.error(f"--schedule M: the layer's rows M must be >= 1, got {args.schedule}")
        print_schedule(args.schedule)
        return 0
    rows, crashed = [], 0
    for case in cases():
        if args.quick and not case.cheap:
            continue
        try:
            value, ratio, note = case.run()
        except Exception as exc:  # a bench: report and go on
            crashed += 1
            rows.append((case, None, None, f"CRASH {type(exc).__name__}: {exc}"))
            continue
        rows.append((case, value, ratio, note))
    print(f"{'case':32s} {'kind':4s} {'measured':>9s} {'modelled':>9s} {'ratio':>6s} {'ok':3s} unit      source / notes")
    inside = 0
    for case, value, ratio, note in rows:
        if value is None:
            print(f"{case.name:32s} {_kind(case):4s} {case.measured:9.3f} {'-':>9s} {'-':>6s} {'!':3s} {case.unit:9s} {note}")
            continue
        ok = abs(ratio - 1.0) <= TOLERANCE
        inside += ok and not case.calibration
        print(f"{case.name:32s} {_kind(case):4s} {case.measured:9.3f} {value:9.3f} "
              f"{ratio:6.2f} {'ok' if ok else 'NO':3s} {case.unit:9s} {case.source}; {note}")
    checks = [c for c, *_ in rows if not c.calibration]
    print(f"{inside} of {len(checks)} validation cases within +-{TOLERANCE:.0%} (held out: "
          f"{sum(c.held_out for c in checks)} of {len(checks)}); calibration inputs (the model takes "
          f"the measured figure): {len(rows) - len(checks)}")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
