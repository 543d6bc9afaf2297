"""Plan-independent physical bounds (tvm_spinn.timing.bounds): checked against every placement
of small chains, pinned by hand for Llama-2-70B, and exposed on reports and LLM plans."""

from __future__ import annotations

import ast
import importlib.resources
import inspect
import itertools
import math

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.timing import bounds as B
from tvm_spinn.timing.bounds import Workload, decode_workload, physical_bound, program_workload

CONFIGS = importlib.resources.files("tvm_spinn.llm") / "configs"


def test_the_module_imports_nothing_from_the_mapper_the_planner_or_the_timing_model():
    tree = ast.parse(inspect.getsource(B))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    # target.faults: the live chips and boards the system's fault fields leave
    assert imported <= {"__future__", "math", "dataclasses", "numpy", "target.arch", "target.faults",
                        "program.ops"}, imported


# ----------------------------------------------------------------------------- enumeration
def _rates(arch):
    """Per-board rates written out from the arch fields (independent of the module)."""
    chips = min(arch.chips, arch.chips_per_board)
    pes = chips * arch.pes_per_chip
    return dict(
        int8=pes * arch.mac_rows * arch.mac_cols * arch.clock_hz,
        fp32=pes * arch.m4f_flops_per_cycle * arch.clock_hz,
        sram=pes * (arch.sram_bytes - arch.sram_reserved_bytes),
        sram_bw=pes * max(arch.dma_bw_bytes_per_cycle, arch.mac_rows + arch.mac_cols) * arch.clock_hz,
        dram=chips * arch.dram_bytes, dram_bw=chips * arch.dram_bw_bytes_s)


def _pair_bw(arch):
    """Data rate between two neighbouring boards: the edge's serial links at their payload share."""
    return arch.board_serial_links * arch.board_link_bw_bytes_s * arch.link_payload_fraction


def _chip_bw(arch):
    """Data rate into a chip from the others of its board: every link of the chip at its payload share."""
    return arch.links_per_chip * arch.link_bw_bytes_s * arch.link_payload_fraction


def _best_placement(arch, layers, handover):
    """The fastest placement of a chain of ``layers`` ``(int8 MACs, fp32 MACs, bytes)`` found by
    trying every assignment of each layer to a chip of the system and every choice of which
    layers keep their bytes in SRAM. Cost of a placement: the layers one after another, each
    ``max(compute, its bytes over SRAM or DRAM bandwidth)`` on its chip, plus one crossing each
    time the next layer is on another chip: between boards the board hop and the hand-over over
    the board pair's links, between chips of a board the on-board hop and the hand-over over
    the receiving chip's links."""
    per_board = _rates(arch)
    r = {key: value / min(arch.chips, arch.chips_per_board) for key, value in per_board.items()}  # per chip
    board_of = [c // arch.chips_per_board for c in range(arch.chips)]
    board_cross = arch.board_link_hop_s + handover / _pair_bw(arch)
    chip_cross = arch.link_hop_s + handover / _chip_bw(arch)
    best = math.inf
    for where in itertools.product(range(arch.chips), repeat=len(layers)):
        if where[0] != 0:  # chips are alike: the chain may start on chip 0 (boards alike too)
            continue
        for sram in itertools.product((False, True), repeat=len(layers)):
            held = {}
            for u, s, (_, _, nbytes) in zip(where, sram, layers):
                held[(u, s)] = held.get((u, s), 0) + nbytes
            if any(v > (r["sram"] if s else r["dram"]) for (u, s), v in held.items()):
                continue  # does not fit the memories
            t = sum(max(i8 / r["int8"] + f32 / r["fp32"], nbytes / (r["sram_bw"] if s else r["dram_bw"]))
                    for s, (i8, f32, nbytes) in zip(sram, layers))
            t += sum(0.0 if a == b else board_cross if board_of[a] != board_of[b] else chip_cross
                     for a, b in zip(where, where[1:]))
            best = min(best, t)
    return best


def _best_split_placement(arch, layers, handover):
    """The fastest placement of a chain of ``layers`` ``(int8 MACs, fp32 MACs, bytes)``, each layer
    ending at a point where its whole output row is needed, when a layer may also be split evenly
    over a run of two or more consecutive chips (tensor parallelism: each of its chips computes
    a slice of its output from the whole input row). Every assignment of each layer to a chip or
    a run of chips and every choice of SRAM or DRAM for it is tried. Cost: each layer's compute
    or read on its chips (its share of each), one after another; between two layers, unless both
    sit on the same one chip, the slowest receiving chip of the next: its hop (the board hop when
    a sender sits on another board) plus the part of the row it did not make itself over its
    links and, for the part made on other boards, over one board edge; after a split last layer,
    the same into one of its chips. Bytes stay on the chips that hold them."""
    r = {key: value / min(arch.chips, arch.chips_per_board) for key, value in _rates(arch).items()}  # per chip
    board_of = [c // arch.chips_per_board for c in range(arch.chips)]
    sets = [(c,) for c in range(arch.chips)]
    sets += [tuple(range(a, b)) for a in range(arch.chips) for b in range(a + 2, arch.chips + 1)]
    options = [(cs, s) for cs in sets for s in (False, True)]

    def exchange(src, dst):
        if len(src) == 1 and src == dst:
            return 0.0
        worst = 0.0
        for c in dst:
            made = 1 / len(src) if c in src else 0.0
            off_board = sum(1 for a in src if board_of[a] != board_of[c]) / len(src)
            hop = arch.board_link_hop_s if off_board else arch.link_hop_s
            worst = max(worst, hop + max((1 - made) * handover / _chip_bw(arch), off_board * handover / _pair_bw(arch)))
        return worst

    per_layer = []
    for i8, f32, nbytes in layers:
        row = []
        for cs, s in options:
            g = len(cs)
            t = max((i8 / r["int8"] + f32 / r["fp32"]) / g, nbytes / g / (r["sram_bw"] if s else r["dram_bw"]))
            load = np.zeros((arch.chips, 2))
            load[list(cs), int(s)] = nbytes / g
            row.append((t, load))
        per_layer.append(row)
    cross = {(a, b): exchange(options[a][0], options[b][0]) for a in range(len(options)) for b in range(len(options))}
    cap = np.array([r["dram"], r["sram"]])
    best = math.inf
    for pick in itertools.product(range(len(options)), repeat=len(layers)):
        t = sum(per_layer[j][o][0] for j, o in enumerate(pick))
        t += sum(cross[a, b] for a, b in zip(pick, pick[1:]))
        last = options[pick[-1]][0]
        t += exchange(last, last[:1]) if len(last) > 1 else 0.0
        if t >= best:
            continue
        if (sum(per_layer[j][o][1] for j, o in enumerate(pick)) > cap).any():
            continue  # does not fit the memories
        best = t
    return best


SMALL = dict(pes_per_chip=4, sram_bytes=32 * 1024, sram_reserved_bytes=16 * 1024, dram_bytes=256 * 1024)

#: (system, chain of layers (int8 MACs, fp32 MACs, bytes), hand-over bytes, what binds, which
#: placement class the bound's value comes from, the least share of the best placement the bound
#: reaches). Each layer ends where its whole output row is needed (a sync point). The best
#: placement is the faster of the best chain (each layer on one chip) and the best with layers
#: split evenly over runs of chips. The share is below 1 by what the bound grants and these
#: placements cannot have: the bound reads on all ``n`` chips at once and computes on every PE
#: of the system; it splits bytes between chips and between SRAM and DRAM freely; and, for split
#: placements, it lets a reduction into one chip carry only a hop (that chip may have made most
#: of the row, as an uneven split could), so where crossings dominate (slow links: the fourth
#: and fifth cases) it sits far below the best.
CASES = [
    # one board of 2 chips, bytes fit the SRAM: memory (SRAM on both chips at once); the best
    # placement splits the three layers over both chips
    (dict(chips=2, chips_per_board=2), [(0, 0, 40_000)] * 3, 256, "memory", "chain", 0.47),
    # three boards of 2 chips: 1 MB, more than one board holds (640 KiB); the best placement
    # splits layers over chips of several boards
    pytest.param(dict(boards=3, chips_per_board=2), [(0, 0, 250_000)] * 4, 4096, "memory", "split", 0.15,
                 marks=pytest.mark.slow),
    # compute-heavy fp32 layers on two boards: split over all 4 chips, the best is near the bound
    (dict(boards=2, chips_per_board=2), [(0, 2_000_000, 10_000)] * 4, 512, "compute", "chain", 0.99),
    # int8 layers, slow board links and bytes that need two of three boards
    pytest.param(dict(boards=3, chips_per_board=2, board_link_bw_bytes_s=2e6), [(5_000_000, 0, 200_000)] * 4, 65536,
                 "compute", "split", 0.0005, marks=pytest.mark.slow),
    # four chips of one board, slow chip links: every placement pays a half-row exchange or a
    # chain crossing (ms), the bound only a hop on two chips
    (dict(chips=4, chips_per_board=4, link_bw_bytes_s=1e6), [(0, 0, 150_000)] * 3, 8192, "memory", "split", 0.003),
    # the same with fast chip links: spreading the bytes over the 4 chips pays
    (dict(chips=4, chips_per_board=4), [(0, 0, 150_000)] * 3, 8192, "memory", "split", 0.30),
]


def _chain_work(layers, handover):
    """The :class:`Workload` of a chain of layers each ending at a sync point."""
    return Workload(macs_int8=sum(a for a, _, _ in layers), macs_fp32=sum(b for _, b, _ in layers),
                    read_bytes=sum(c for _, _, c in layers), handover_bytes=handover,
                    sync_points=len(layers), largest_phase_bytes=max(c for _, _, c in layers))


@pytest.mark.parametrize("fields, layers, handover, binding, placement, ratio", CASES)
def test_no_placement_beats_the_bound_and_the_bound_is_near_the_best(fields, layers, handover, binding, placement,
                                                                     ratio):
    arch = tvm_spinn.make_system("enum", **SMALL, **fields)
    bound = physical_bound(_chain_work(layers, handover), arch)
    chain = _best_placement(arch, layers, handover)
    split = _best_split_placement(arch, layers, handover)
    best = min(chain, split)
    assert bound.total_s > 0
    assert bound.total_s <= best * (1 + 1e-12), (bound, best)  # no placement, chain or split, beats it
    assert bound.details["chain_bound_s"] <= chain * (1 + 1e-12)  # nor a chain the chain bound
    assert bound.total_s >= ratio * best, (bound.total_s / best)  # and it is not far below the best
    assert bound.binding == binding and bound.details["placement"] == placement
    assert bound.total_s == max(bound.parts().values())


def test_split_placements_beat_the_chain_bound_so_the_bound_counts_them():
    """Four chips, 10 MB/s chip links, two 250 kB layers: splitting both layers over the four
    chips (two exchanges of a part of the row) is faster than any chain and than the chain bound
    (which needs the bytes' two chips and a full-row crossing, or more chips and more crossings);
    the bound stays below it only through the split form."""
    arch = tvm_spinn.make_system("tp", **SMALL, chips=4, chips_per_board=4, link_bw_bytes_s=1e7)
    layers = [(0, 0, 250_000)] * 2
    bound = physical_bound(_chain_work(layers, 8192), arch)
    split = _best_split_placement(arch, layers, 8192)
    assert split < bound.details["chain_bound_s"] <= _best_placement(arch, layers, 8192)
    assert bound.total_s == bound.details["split_bound_s"] <= split


def test_bytes_beyond_one_board_force_crossings_on_every_placement():
    """Bytes that fit only two boards' memories: every chain placement crosses a board edge once
    or more and, the bytes needing four chips, two chips of a board once more; so does the chain
    bound (a bound of 0 communication would pass the first check alone). A placement splitting
    layers pays a board hop at least; the bound stays below both."""
    arch = tvm_spinn.make_system("enum2", **SMALL, boards=3, chips_per_board=2, board_link_bw_bytes_s=1e5)
    layers = [(0, 0, 250_000)] * 4  # 1 MB; a chip holds 256 KiB + 4 x 16 KiB = 320 KiB: 4 chips on 2 boards
    bound = physical_bound(_chain_work(layers, 8192), arch)
    assert bound.details["least_boards"] == 2 and bound.details["least_chips"] == 4
    chain = bound.details["chain"]
    # 4 chips on 2 boards: one board crossing and two between chips of a board
    assert chain["chips"] == 4 and chain["boards"] == 2
    assert chain["communication_s"] == pytest.approx(arch.board_link_hop_s + 8192 / _pair_bw(arch)
                                                     + 2 * (arch.link_hop_s + 8192 / _chip_bw(arch)))
    assert chain["total_s"] == chain["communication_s"] >= 0.9 * _best_placement(arch, layers, 8192)
    # split: the bytes need two boards, so at least one crossing is a board hop
    assert bound.details["split"]["board_crossings"] >= 1 and bound.communication_s >= arch.board_link_hop_s
    assert bound.total_s <= chain["total_s"]


@pytest.mark.slow
def test_bytes_beyond_one_board_split_placements_never_beat_the_bound():
    arch = tvm_spinn.make_system("enum2", **SMALL, boards=3, chips_per_board=2, board_link_bw_bytes_s=1e5)
    layers = [(0, 0, 250_000)] * 4
    bound = physical_bound(_chain_work(layers, 8192), arch)
    assert bound.total_s <= _best_split_placement(arch, layers, 8192)


def test_chip_placements_on_one_board_never_beat_the_bound():
    arch = tvm_spinn.make_system("enum4", **SMALL, chips=4, chips_per_board=4)
    layers = [(2_000_000, 0, 60_000), (0, 300_000, 20_000), (1_000_000, 0, 120_000)]
    bound = physical_bound(_chain_work(layers, 1024), arch)
    best = min(_best_placement(arch, layers, 1024), _best_split_placement(arch, layers, 1024))
    assert 0.2 * best <= bound.total_s <= best


def test_streamed_rows_cross_in_series_one_at_a_time():
    """A hand-over of ``r`` rows that stream: each chain crossing waits for one row, the whole
    hand-over passes the slowest crossing once; one row of the whole is the unstreamed case."""
    arch = tvm_spinn.make_system("rows", **SMALL, chips=4, chips_per_board=4, link_bw_bytes_s=1e6)
    one = physical_bound(Workload(read_bytes=700_000, handover_bytes=8000), arch).details["chain"]
    rows = physical_bound(Workload(read_bytes=700_000, handover_bytes=8000, handover_rows=8), arch).details["chain"]
    assert one["chips"] == rows["chips"] == 3  # 700 kB: 3 chips of 320 KiB
    bw = _chip_bw(arch)
    assert one["communication_s"] == pytest.approx(2 * (arch.link_hop_s + 8000 / bw))
    assert rows["communication_s"] == pytest.approx(2 * (arch.link_hop_s + 1000 / bw) + 7000 / bw)
    with pytest.raises(ValueError, match="handover_rows"):
        Workload(handover_bytes=8, handover_rows=0)
    with pytest.raises(ValueError, match="sync_points"):
        Workload(sync_points=0)


def test_split_crossings_count_sync_points_and_half_rows():
    """The split form by hand on 4 chips of a board: ``S' = min(S, floor(R / rho))`` sync points;
    ``c(n) = max(min(n - 1, 1), min(n - 2, S' - 1))`` crossings on n chips, every other one
    carrying half a row (a reduction into one chip may carry only its hop). More sync points than
    the bytes allow (one stretch holding a third of them) count as three."""
    arch = tvm_spinn.make_system("sync", **SMALL, chips=4, chips_per_board=4, link_bw_bytes_s=1e6)
    work = Workload(read_bytes=120_000, handover_bytes=8000, sync_points=9, largest_phase_bytes=40_000)
    split = physical_bound(work, arch).details["split"]
    assert split["sync_points_counted"] == 3
    hop, half = arch.link_hop_s, arch.link_hop_s + 4000 / _chip_bw(arch)
    r = _rates(arch)
    mem = {n: max(120_000 / (n / 4 * (r["sram_bw"] + r["dram_bw"])), (120_000 - n / 4 * r["sram"]) / (n / 4 * r["dram_bw"]))
           for n in range(1, 5)}
    comm = {1: 0.0, 2: hop, 3: hop, 4: half + hop}
    assert split["chip_level_s"] == pytest.approx(min(max(mem[n], comm[n]) for n in range(1, 5)))


def test_the_memory_part_is_the_best_split_between_sram_and_dram():
    arch = tvm_spinn.make_system("split", **SMALL, chips=2, chips_per_board=2)
    r = _rates(arch)
    for nbytes in (10_000, int(r["sram"]), 300_000, 600_000):
        got = physical_bound(Workload(read_bytes=nbytes), arch).memory_s
        # brute force over the bytes kept in SRAM (both memories read at once)
        xs = np.linspace(0, min(nbytes, r["sram"]), 20001)
        want = np.max([xs / r["sram_bw"], (nbytes - xs) / r["dram_bw"]], axis=0).min()
        assert got == pytest.approx(want, rel=1e-3)


# ----------------------------------------------------------------------------- Llama-2-70B by hand
def _llama70b_by_hand(arch, handover_itemsize=4):
    """The bound of one int8 decode step (batch 1, 2,048 KV slots) written out from the config.

    Bytes read: 68,713,185,280 of int8 GEMM weights (80 blocks and the LM head), 1,318,912 norm
    scales in fp32 (5,275,648 B), one 8,192-byte embedding row and a 1,342,177,280-byte fp32 KV cache:
    70,060,646,400 bytes. A chip holds 2 GiB of DRAM and 148 x 112 KiB = 16,973,824 bytes of SRAM
    (2,164,457,472 in all): 33 chips at least. Per chip: SRAM read at 148 x 20 B x 300 MHz =
    888 GB/s, DRAM at 6.4 GB/s. A chip crossing: 0.5 us + 32,768 B / (6 links x 0.75 GB/s x
    32/72 = 2.0 GB/s) = 16.884 us; a board crossing: 1 us + 32,768 B / (0.25 GB/s x 32/72 =
    0.1111 GB/s) = 295.912 us. ``n`` chips on ``k = ceil(n / 48)`` boards:
    memory(n) = max(R / (n (888e9 + 6.4e9)), (R - n x 16,973,824) / (n x 6.4e9)),
    communication(n) = (k - 1) x 295.912 us + (n - k) x 16.884 us.

    * one board (48 chips): memory(48) = (70,060,646,400 - 814,743,552) / 307.2e9 = 225.410 ms;
      communication 47 x 16.884 us = 0.794 ms: memory binds at 225.4 ms.
    * 24 boards or the cloud: memory falls and communication rises with ``n``; they cross between
      640 chips (memory 14.4525 ms, communication 13 x 295.912 + 626 x 16.884 us = 14.4162 ms)
      and 641 (memory (70,060,646,400 - 641 x 16,973,824) / (641 x 6.4e9) = 14.4258 ms,
      communication 13 x 295.912 + 627 x 16.884 us = 14.4331 ms); 642 chips give max(14.3992,
      14.4500). The least of the maxima is 14.4331 ms at 641 chips on 14 boards, communication
      binding (compute 0.16 ms on 24 boards) for a chain.

    The split form: 161 sync points (two norms a block and the final norm); the largest stretch
    is a block's MLP half, 704,643,072 B, plus its layer's 16,777,216 KV bytes, every vector
    (5,275,648 B) and the embedding row: 726,704,128 B; 70,060,646,400 / 726,704,128 = 96.4, so
    S' = 96 and at most c = 95 crossings count (``c(n) = max(min(n - 1, 1), min(n - 2, 95))``),
    47 of them carrying half a row: 0.5 us + 16,384 B / 2.0 GB/s = 8.692 us between chips,
    1 us + 8.192 us = 9.192 us across a board edge, the other 48 a hop (0.5 us, 1 us).

    * one board: the chain's 225.4 ms (memory on 48 chips binds either way).
    * 24 boards: memory on all 1,152 chips, (70,060,646,400 - 1,152 x 16,973,824) / (1,152 x
      6.4e9) = 6.8504 ms, beats any crossing count (at most 47 x 8.692 + 48 x 0.5 us = 0.4325
      ms): 6.850 ms, memory binding.
    * cloud (34,560 chips): from 4,128 chips on the bytes fit the SRAM; on all 34,560 chips the
      read takes 2.3 us, under the 95 chip crossings' 0.4325 ms, which bind; over boards, memory
      and crossings meet near 77 boards (0.378 ms), lower: 0.4325 ms, communication binding.
    """
    h, i, L, heads, kvh, hd, v = 8192, 28672, 80, 64, 8, 128, 32000
    params = 68_976_648_192  # published
    gemm = L * (h * (heads * hd + 2 * kvh * hd) + heads * hd * h + 3 * h * i) + v * h
    vectors = params - gemm - v * h  # norm scales (fp32)
    kv = 2048 * 2 * L * kvh * hd * 4
    read = gemm * 1 + vectors * 4 + h * 1 + kv  # + one embedding row + KV cache
    compute = gemm / (arch.chips * 148 * 64 * 300e6) + L * 2 * heads * hd * 2048 / (arch.chips * 148 * (16 / 42) * 300e6)  # M4F: 16 MACs in 42 cycles
    S = 148 * (128 - 16) * 1024  # SRAM a chip leaves to data
    s = 148 * 20 * 300e6  # MAC-array operand reads (16 + 4 B a cycle) beat the DMA (8 B)
    d = 6.4e9
    cap = 2 * 1024**3 + S

    def mem(n):
        return max(read / (n * (s + d)), (read - n * S) / (n * d))

    # one serial link of 2 Gbit/s joins two boards, 32 of a packet's 72 bits are data; a chip
    # takes a hand-over in through its 6 links of 6 Gbit/s
    row = h * handover_itemsize
    board = 1e-6 + row / (1 * 0.25e9 * 32 / 72)
    chip = 0.5e-6 + row / (6 * 0.75e9 * 32 / 72)
    best = None
    for n in range(math.ceil(read / cap), arch.chips + 1):
        k = math.ceil(n / 48)
        comm = (k - 1) * board + (n - k) * chip
        total = max(compute, mem(n), comm)
        if best is None or total < best[0]:
            best = (total, n, k, mem(n), comm)
        if comm >= mem(n):
            break
    # split: S' from the largest stretch, half a row into a chip, every other crossing a hop only
    largest = 3 * h * i + kv // L + vectors * 4 + h
    syncs = min(2 * L + 1, read // largest)
    half = row / 2 / (6 * 0.75e9 * 32 / 72)

    def crossings(units, hop):
        c = max(min(units - 1, 1), min(units - 2, syncs - 1))
        return (c // 2) * (hop + half) + (c - c // 2) * hop

    chips = min(max(mem(n), crossings(n, 0.5e-6)) for n in range(math.ceil(read / cap), arch.chips + 1))
    boards = min(max(mem(min(arch.chips, 48 * k)), crossings(k, 1e-6))
                 for k in range(math.ceil(read / (48 * cap)), arch.boards + 1))
    split = max(compute, chips, boards)
    return compute, best, split


@pytest.mark.parametrize("system, total_ms, binding, placement", [
    ("spinn/board", 225.4, "memory", "chain"),
    ("boards24", 6.850, "memory", "split"),
    ("spinn/cloud", 0.4325, "communication", "split"),
])
def test_llama_2_70b_bound_by_hand(system, total_ms, binding, placement):
    arch = (tvm_spinn.make_system("b24", boards=24) if system == "boards24"
            else tvm_spinn.arch_of(tvm_spinn.get_target(system)))
    spec = tvm_spinn.llm.spec_of(str(CONFIGS / "llama-2-70b.json"))
    got = physical_bound(decode_workload(spec, 1, 2048, "int8"), arch)
    compute, (chain, chips, boards, memory, comm), split = _llama70b_by_hand(arch)
    assert got.compute_s == pytest.approx(compute, rel=1e-12)
    c = got.details["chain"]
    assert c["memory_s"] == pytest.approx(memory, rel=1e-12)
    assert c["communication_s"] == pytest.approx(comm, rel=1e-12)
    assert c["total_s"] == pytest.approx(chain, rel=1e-12) and (c["chips"], c["boards"]) == (chips, boards)
    assert got.details["split_bound_s"] == pytest.approx(split, rel=1e-12)
    assert got.total_s == pytest.approx(min(chain, split), rel=1e-12)
    assert got.binding == binding and got.details["placement"] == placement
    assert got.total_s * 1e3 == pytest.approx(total_ms, rel=1e-3)


def test_llama_2_70b_cloud_needs_hundreds_of_crossings_and_int8_handovers_shorten_them():
    """Any placement holding the weights needs 33+ chips; a chain trades DRAM time against
    crossings (641 chips on 14 boards with fp32 hand-overs), a split placement's 95 crossings
    bind on the cloud. int8 hand-overs (a build allowing them) make each crossing cheaper."""
    cloud = tvm_spinn.arch_of(tvm_spinn.get_target("spinn/cloud"))
    spec = tvm_spinn.llm.spec_of(str(CONFIGS / "llama-2-70b.json"))
    fp32 = physical_bound(decode_workload(spec, 1, 2048, "int8"), cloud)
    int8 = physical_bound(decode_workload(spec, 1, 2048, "int8", handover_itemsize=1), cloud)
    _, (chain, chips, _, _, _), split = _llama70b_by_hand(cloud, handover_itemsize=1)
    assert int8.total_s == pytest.approx(min(chain, split), rel=1e-12) and int8.details["chain"]["chips"] == chips
    assert int8.total_s < fp32.total_s and int8.details["chain"]["chips"] > fp32.details["chain"]["chips"]
    assert fp32.details["least_chips"] == 33 and fp32.details["chain"]["chip_crossings"] == 641 - 14
    assert fp32.details["split"]["chip_crossings"] == 95 and fp32.details["split"]["sync_points_counted"] == 96


def test_decode_workload_reads_one_embedding_row_not_the_table():
    spec = tvm_spinn.llm.spec_of(str(CONFIGS / "llama-2-70b.json"))
    w0, w1 = decode_workload(spec, 1, 0, "int8"), decode_workload(spec, 2, 0, "int8")
    assert w0.read_bytes < spec.params - spec.vocab * spec.hidden + 4 * spec.layers * 2 * spec.hidden + spec.hidden
    assert w1.read_bytes - w0.read_bytes == spec.hidden  # one more user: one more row
    assert w1.macs_int8 == 2 * w0.macs_int8
    # the KV cache at the stated context: 2 x layers x kv heads x head_dim x fp32 per slot
    assert decode_workload(spec, 1, 10, "int8").read_bytes - w0.read_bytes == 10 * 2 * 80 * 8 * 128 * 4


def test_bad_workload_and_too_large_for_the_system():
    with pytest.raises(ValueError, match="read_bytes"):
        Workload(read_bytes=-1)
    with pytest.raises(ValueError, match="more than the 1 board"):
        physical_bound(Workload(read_bytes=10**12), tvm_spinn.arch_of(tvm_spinn.get_target("spinn/board")))


def test_the_bound_counts_live_hardware_only():
    """A dead chip neither computes nor holds bytes: the bound of a two-board system with chip 3
    dead counts 95 chips (its compute part 96/95 of the healthy one's), one with a dead board
    counts that board's 48 chips, and neither is below the healthy system's bound."""
    spec = tvm_spinn.llm.spec_of(str(CONFIGS / "llama-2-7b.json"))
    work = decode_workload(spec, 1, 2048, "int8")
    healthy = tvm_spinn.make_system("spinn2-two-bound", boards=2)
    rate = healthy.pes_per_chip * healthy.mac_rows * healthy.mac_cols * healthy.clock_hz  # int8 MACs/s a chip
    fp32 = healthy.pes_per_chip * healthy.m4f_flops_per_cycle * healthy.clock_hz
    for arch, chips, boards in ((healthy, 96, 2), (healthy.replace(dead_chips=(3,)), 95, 2),
                                (healthy.replace(dead_boards=(1,)), 48, 1),
                                (healthy.replace(allocated_boards=(0,)), 48, 1)):
        bound = physical_bound(work, arch)
        assert bound.compute_s == pytest.approx(work.macs_int8 / (chips * rate) + work.macs_fp32 / (chips * fp32))
        d = bound.details
        assert d["chips_on_path"] <= chips and d["split"]["chips"] <= chips and d["chain"]["chips"] <= chips
        assert d["boards_on_path"] <= boards and d["split"]["boards"] <= boards
        assert d.get("live_chips", 96) == chips and d.get("usable_boards", 2) == boards
        assert bound.total_s >= physical_bound(work, healthy).total_s
    # the 7B model's bytes fill the path: 95 live chips, so the path has 95
    assert physical_bound(work, healthy.replace(dead_chips=(3,))).details["chips_on_path"] == 95
    # what one board holds: more than its live chips hold is refused
    one = tvm_spinn.make_system("spinn2-one-bound", boards=1)
    full = Workload(read_bytes=48 * B.chip_capacity_bytes(one))
    physical_bound(full, one)
    with pytest.raises(ValueError, match="more than the 1 board"):
        physical_bound(full, one.replace(dead_chips=(5,)))


# ----------------------------------------------------------------------------- reports and plans
def _gemm_model():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128)).eval()
    return model, torch.randn(4, 256)


def test_report_bound_does_not_depend_on_the_mapping():
    """Two mappings of the same program: the same physical bound, so the slower one has the lower
    efficiency; the programs' own roofline moves with the weights kept resident."""
    from tvm import relax

    model, x = _gemm_model()
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    reps = {}
    for name, options in (("good", tvm_spinn.MappingOptions()), ("naive", tvm_spinn.MappingOptions(naive=True)),
                          ("stream", tvm_spinn.MappingOptions(weights="stream"))):
        with options:
            reps[name] = tvm_spinn.report(relax.build(mod, target="spinn"))
    bounds = {r.physical_bound_s for r in reps.values()}
    assert len(bounds) == 1 and bounds.pop() > 0
    for r in reps.values():
        assert 0 < r.efficiency <= 1 and r.latency_s >= r.physical_bound_s
        assert r.efficiency == pytest.approx(r.physical_bound_s / r.latency_s)
    ranked = sorted(reps.values(), key=lambda r: r.latency_s)
    assert [r.efficiency for r in ranked] == sorted((r.efficiency for r in ranked), reverse=True)
    # the work: 4 x (256 x 512 + 512 x 128) fp32 MACs; weights, biases and the input read once
    r = reps["good"]
    assert r.physical.details["macs_fp32"] == 4 * (256 * 512 + 512 * 128)
    assert r.physical.details["read_bytes"] == 4 * (256 * 512 + 512 + 512 * 128 + 128 + 4 * 256)
    # an input two programs read (a KV cache read by the attention and copied into the returned
    # cache) must be read once: counted once; each program's constants are its own
    one, two = program_workload(r.programs), program_workload(r.programs * 2)
    assert two.description["input_bytes"] == one.description["input_bytes"] == 4 * 256 * 4
    assert two.description["constant_bytes"] == 2 * one.description["constant_bytes"]
    # a program that only moves data (a reshape of the cache into the returned one) adds nothing
    import dataclasses

    prog = r.programs[0]
    copy = dataclasses.replace(prog, layers=[dataclasses.replace(prog.layers[0], kind="reshape", consts={}, gemm=None)])
    assert program_workload([copy]).read_bytes == 0
    assert program_workload([*r.programs, copy]).read_bytes == one.read_bytes
    text = str(r)
    assert "physical bound" in text and "efficiency" in text and "own roofline (diagnostic)" in text


def test_program_workload_counts_gathered_rows_not_the_table():
    from tvm import relax

    torch = pytest.importorskip("torch")

    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(1000, 64)

        def forward(self, ids):
            return self.table(ids) * 2.0

    torch.manual_seed(0)
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 8]])
    mod = tvm_spinn.frontend.from_pytorch(Embed().eval(), (ids,))
    rep = tvm_spinn.report(relax.build(mod, target="spinn"))
    work = program_workload(rep.programs)
    table = 1000 * 64 * 4
    assert work.read_bytes < table / 10
    assert rep.physical.details["read_bytes"] == work.read_bytes


def test_plans_with_different_latencies_share_one_bound(monkeypatch):
    """The bound of an LLM plan is a function of the config, batch, context and system only: the
    plan's alternatives (a worse placement) would get a lower efficiency, never a higher one."""
    from tvm_spinn.llm.plan import plan

    cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 500, "max_position_embeddings": 128}
    result = plan(cfg, target="spinn/board", batch=1, seq=64, dtype="int8")
    spec = tvm_spinn.llm.spec_of(cfg)
    want = physical_bound(decode_workload(spec, 1, 64, "int8"), tvm_spinn.arch_of(tvm_spinn.get_target("spinn/board")))
    assert result.physical_bound_s == want.total_s > 0
    assert result.physical_bound["binding"] == want.binding
    assert result.physical_bound["parts_s"] == want.parts()
    assert 0 < result.efficiency <= 1
    d = result.to_dict()
    assert d["efficiency"] == result.efficiency and d["physical_bound"]["total_s"] == want.total_s
    for alt in result.plan["alternatives"].values():
        assert alt["period_s"] >= 1 / result.tokens_per_s_per_user
        # a tie with the chosen plan differs only in the division's last bit
        assert want.total_s / alt["period_s"] <= result.efficiency * (1 + 1e-12)
    text = result.table()
    assert "physical bound" in text and "efficiency" in text and "plan's own bound" in text
