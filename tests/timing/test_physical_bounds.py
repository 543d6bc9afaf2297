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
    assert imported <= {"__future__", "math", "dataclasses", "numpy", "target.arch", "program.ops"}, imported


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


def _best_placement(arch, layers, handover, pair_bw, unit="boards"):
    """The fastest placement of a chain of ``layers`` ``(int8 MACs, fp32 MACs, bytes)`` found by
    trying every assignment of each layer to a board (or chip: ``unit="chips"``) and every choice
    of which layers keep their bytes in SRAM. Cost of a placement: the layers one after another,
    each ``max(compute, its bytes over SRAM or DRAM bandwidth)`` on its unit, plus one crossing
    (hop + hand-over over the pair's bandwidth) each time the next layer is on another unit
    (none between chips of a board, which the bound does not charge either)."""
    r = _rates(arch)  # per board
    n_units = arch.chips if unit == "chips" else arch.boards
    if unit == "chips":  # one board: each chip has its share
        r = {key: value / arch.chips for key, value in r.items()}
    cross = 0.0 if unit == "chips" else arch.board_link_hop_s + handover / pair_bw
    best = math.inf
    for where in itertools.product(range(n_units), repeat=len(layers)):
        for sram in itertools.product((False, True), repeat=len(layers)):
            held = {}
            for u, s, (_, _, nbytes) in zip(where, sram, layers):
                held[(u, s)] = held.get((u, s), 0) + nbytes
            if any(v > (r["sram"] if s else r["dram"]) for (u, s), v in held.items()):
                continue  # does not fit the memories
            t = sum(max(i8 / r["int8"] + f32 / r["fp32"], nbytes / (r["sram_bw"] if s else r["dram_bw"]))
                    for s, (i8, f32, nbytes) in zip(sram, layers))
            t += cross * sum(a != b for a, b in zip(where, where[1:]))
            best = min(best, t)
    return best


SMALL = dict(pes_per_chip=4, sram_bytes=32 * 1024, sram_reserved_bytes=16 * 1024, dram_bytes=256 * 1024)

#: (system, chain of layers (int8 MACs, fp32 MACs, bytes), hand-over bytes, what binds, the least
#: share of the best placement the bound reaches: below 1 where the bound lets the boards on a
#: token's path (or a board's chips) read and compute at once while a chain placement takes its
#: layers one after another, or splits a layer's bytes between SRAM and DRAM where a placement
#: keeps a layer in one of them)
CASES = [
    # one board of 2 chips, bytes fit the SRAM: memory (SRAM) against compute
    (dict(chips=2, chips_per_board=2), [(0, 0, 40_000)] * 3, 256, "memory", 0.75),
    # three boards of 2 chips: 1 MB, more than one board holds (640 KiB): crossings
    (dict(boards=3, chips_per_board=2), [(0, 0, 250_000)] * 4, 4096, "communication", 0.15),
    # compute-heavy fp32 layers on two boards
    (dict(boards=2, chips_per_board=2), [(0, 2_000_000, 10_000)] * 4, 512, "compute", 0.45),
    # int8 layers, slow board links and bytes that need two of three boards: one crossing
    (dict(boards=3, chips_per_board=2, board_link_bw_bytes_s=2e6), [(5_000_000, 0, 200_000)] * 4, 65536,
     "communication", 0.9),
]


@pytest.mark.parametrize("fields, layers, handover, binding, ratio", CASES)
def test_no_placement_beats_the_bound_and_the_bound_is_near_the_best(fields, layers, handover, binding, ratio):
    arch = tvm_spinn.make_system("enum", **SMALL, **fields)
    work = Workload(macs_int8=sum(a for a, _, _ in layers), macs_fp32=sum(b for _, b, _ in layers),
                    read_bytes=sum(c for _, _, c in layers), handover_bytes=handover)
    bound = physical_bound(work, arch)
    pair_bw = _pair_bw(arch)
    best = _best_placement(arch, layers, handover, pair_bw)
    assert bound.total_s > 0
    assert bound.total_s <= best * (1 + 1e-12), (bound, best)  # no placement beats it
    assert bound.total_s >= ratio * best, (bound.total_s / best)  # and it is not far below the best
    if binding:
        assert bound.binding == binding
    assert bound.total_s == max(bound.parts().values())


def test_bytes_beyond_one_board_force_crossings_on_every_placement():
    """Bytes that fit only two boards' memories: every placement crosses once or more, and so
    does the bound (a bound of 0 communication would pass the first check alone)."""
    arch = tvm_spinn.make_system("enum2", **SMALL, boards=3, chips_per_board=2, board_link_bw_bytes_s=1e5)
    layers = [(0, 0, 250_000)] * 4  # 1 MB; a board holds 2 x (256 KiB + 4 x 16 KiB) = 640 KiB
    work = Workload(read_bytes=1_000_000, handover_bytes=8192)
    bound = physical_bound(work, arch)
    assert bound.details["least_boards"] == 2 and bound.communication_s > 0
    pair_bw = _pair_bw(arch)
    best = _best_placement(arch, layers, 8192, pair_bw)
    assert bound.communication_s == pytest.approx(arch.board_link_hop_s + 8192 / pair_bw)
    assert bound.binding == "communication" and bound.total_s <= best and bound.total_s >= 0.2 * best


def test_chip_placements_on_one_board_never_beat_the_bound():
    arch = tvm_spinn.make_system("enum4", **SMALL, chips=4, chips_per_board=4)
    layers = [(2_000_000, 0, 60_000), (0, 300_000, 20_000), (1_000_000, 0, 120_000)]
    work = Workload(macs_int8=3_000_000, macs_fp32=300_000, read_bytes=200_000, handover_bytes=1024)
    bound = physical_bound(work, arch)
    best = _best_placement(arch, layers, 1024, 1.0, unit="chips")
    assert 0.2 * best <= bound.total_s <= best


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
def _llama70b_by_hand(arch, boards, handover_itemsize=4):
    """The bound of one int8 decode step (batch 1, 2,048 KV slots) written out from the config."""
    h, i, L, heads, kvh, hd, v = 8192, 28672, 80, 64, 8, 128, 32000
    params = 68_976_648_192  # published
    gemm = L * (h * (heads * hd + 2 * kvh * hd) + heads * hd * h + 3 * h * i) + v * h
    vectors = params - gemm - v * h  # norm scales (fp32)
    read = gemm * 1 + vectors * 4 + h * 1 + 2048 * 2 * L * kvh * hd * 4  # + one embedding row + KV cache
    chips = min(arch.chips, 48)
    pes = chips * 148
    compute = gemm / (arch.chips * 148 * 64 * 300e6) + L * 2 * heads * hd * 2048 / (arch.chips * 148 * (16 / 42) * 300e6)  # M4F: 16 MACs in 42 cycles
    S = pes * (128 - 16) * 1024  # SRAM a board leaves to data
    s = pes * 20 * 300e6  # MAC-array operand reads (16 + 4 B a cycle) beat the DMA (8 B)
    d = chips * 6.4e9
    cap = chips * (2 * 1024**3 + 148 * (128 - 16) * 1024)
    # one serial link of 2 Gbit/s joins two boards, 32 of a packet's 72 bits are data
    crossing = 1e-6 + h * handover_itemsize / (1 * 0.25e9 * 32 / 72)
    best = None
    for k in range(math.ceil(read / cap), boards + 1):
        mem = max(read / (k * (s + d)), (read - k * S) / (k * d))
        total = max(compute, mem, (k - 1) * crossing)
        if best is None or total < best[0]:
            best = (total, k, mem, (k - 1) * crossing)
    return compute, best


@pytest.mark.parametrize("system, boards, total_ms, binding, k", [
    ("spinn/board", 1, 225.4, "memory", 1),
    ("boards24", 24, 6.850, "memory", 24),
    ("spinn/cloud", 720, 6.850, "memory", 24),
])
def test_llama_2_70b_bound_by_hand(system, boards, total_ms, binding, k):
    arch = (tvm_spinn.make_system("b24", boards=24) if system == "boards24"
            else tvm_spinn.arch_of(tvm_spinn.get_target(system)))
    spec = tvm_spinn.llm.spec_of(str(CONFIGS / "llama-2-70b.json"))
    got = physical_bound(decode_workload(spec, 1, 2048, "int8"), arch)
    compute, (total, path, memory, comm) = _llama70b_by_hand(arch, boards)
    assert got.compute_s == pytest.approx(compute, rel=1e-12)
    assert got.memory_s == pytest.approx(memory, rel=1e-12)
    assert got.communication_s == pytest.approx(comm, rel=1e-12)
    assert got.total_s == pytest.approx(total, rel=1e-12) and got.details["boards_on_path"] == path == k
    assert got.binding == binding and got.total_s * 1e3 == pytest.approx(total_ms, rel=1e-3)


def test_llama_2_70b_cloud_needs_dozens_of_crossings_and_int8_handovers_shorten_them():
    """Any placement holding the weights in SRAM needs 75+ boards; the bound trades DRAM time
    against crossings (24 boards on a token's path with fp32 hand-overs). int8 hand-overs (a
    build allowing them) make each crossing nearly 4x cheaper: more boards pay."""
    cloud = tvm_spinn.arch_of(tvm_spinn.get_target("spinn/cloud"))
    spec = tvm_spinn.llm.spec_of(str(CONFIGS / "llama-2-70b.json"))
    fp32 = physical_bound(decode_workload(spec, 1, 2048, "int8"), cloud)
    int8 = physical_bound(decode_workload(spec, 1, 2048, "int8", handover_itemsize=1), cloud)
    _, (total, path, _, _) = _llama70b_by_hand(cloud, 720, handover_itemsize=1)
    assert int8.total_s == pytest.approx(total, rel=1e-12) and int8.details["boards_on_path"] == path
    assert int8.total_s < fp32.total_s and int8.details["boards_on_path"] > fp32.details["boards_on_path"]


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
        assert want.total_s / alt["period_s"] <= result.efficiency
    text = result.table()
    assert "physical bound" in text and "efficiency" in text and "plan's own bound" in text
