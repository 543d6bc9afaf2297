"""Expert parallelism in the LLM planner: a mixture of experts' experts spread over boards."""

from __future__ import annotations

import importlib
import itertools

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn.llm import experts as X

TINY = {"model_type": "mixtral", "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 256,
        "num_local_experts": 4, "num_experts_per_tok": 2}


def _brute_busiest(experts, boards, picks):
    s = experts // boards
    loads = [max(sum(1 for e in pick if e // s == b) for b in range(boards))
             for pick in itertools.combinations(range(experts), picks)]
    return sum(loads) / len(loads)


@pytest.mark.parametrize("experts,boards,picks", [(8, 8, 2), (8, 4, 2), (8, 2, 2), (8, 2, 3), (16, 4, 4), (4, 2, 2)])
def test_expected_busiest_board_matches_enumeration(experts, boards, picks):
    assert X.expected_busiest(experts, boards, picks) == pytest.approx(_brute_busiest(experts, boards, picks))


def test_expected_busiest_board_by_hand():
    assert X.expected_busiest(8, 8, 2) == 1.0  # one expert a board: the two picks on two boards
    # two experts a board: both picks on one board with probability 4 / C(8, 2)
    assert X.expected_busiest(8, 4, 2) == pytest.approx(1 + 4 / 28)
    with pytest.raises(ValueError, match="must divide"):
        X.expected_busiest(8, 3, 2)


class _Steps:
    def set_postfix_str(self, *_):
        pass

    def update(self, *_):
        pass


@pytest.fixture(scope="module")
def tiny_described():
    from tvm_spinn.llm.describe import describe
    from tvm_spinn.llm.spec import spec_of

    P = importlib.import_module("tvm_spinn.llm.plan")
    spec = spec_of(TINY)
    parts = P._parts(P._meta_model(TINY, spec), spec, 1, 64)
    return spec, {name: describe(module, args, "spinn/board", "int8") for name, module, args in parts if name != "prefill"}


def test_experts_placed_across_four_boards(tiny_described):
    """Four experts over groups of two boards (two a board), the head on a board of its own."""
    from tvm_spinn.target.topology import ring_order, topology_of
    from tvm_spinn.timing.collectives import board_all_to_all
    from tvm_spinn.timing.system import collective_cost

    spec, described = tiny_described
    arch = tvm_spinn.make_system("moe-four-boards", boards=4)
    out = X.records(TINY, spec, arch, "spinn/board", "int8", 1, 64, 4, described, spec.params, 0, _Steps(), {})
    assert {name.split("m")[0] for name in out} == {"experts:ep2", "experts:tp2"}
    # every expert split over the two boards of a group: each board 1/2 of every expert
    for r in (r for name, r in out.items() if name.startswith("experts:tp2")):
        meta = r["meta"]
        assert meta["tp_boards"] == 2 and meta["board_all_reduces_decode_s"] == 2 * 2 * meta["board_all_reduce_s"]
        assert meta["worst_decode_s"] >= r["decode_s"] > meta["board_all_reduces_decode_s"]
    for r in (r for name, r in out.items() if name.startswith("experts:ep")):
        meta = r["meta"]
        assert (meta["ep_boards"], meta["experts_per_board"], meta["experts_active"]) == (2, 2, 2)
        # two picks of four experts, two a board: both on one board with probability 2 / C(4, 2)
        assert meta["busiest_board_experts"] == pytest.approx(1 + 2 / 6)
        assert meta["worst_busiest_board_experts"] == 2
        assert meta["worst_decode_s"] > r["decode_s"] > 0
        # the dispatch: the home's hidden state (fp32) to the other board of the group, each chip
        # its share, then gathered on the board
        board = arch.replace(chips=48, name="b")
        send = np.array([[0.0, 128 * 4], [0.0, 0.0]])
        grid = [list(range(b * 48, b * 48 + 48)) for b in (0, 1)]
        gather = collective_cost(topology_of(board), ring_order(topology_of(board), 48), "all_gather", 128 * 4, False)
        expect = board_all_to_all(topology_of(arch), grid, send).seconds + gather.seconds
        assert meta["dispatch_s"] == pytest.approx(expect, rel=0.5)  # the group's boards may not be 0 and 1
        assert meta["dispatch_s"] > gather.seconds
        # a tiny model's experts all fit the boards' SRAM
        assert meta["expert_resident_share"] == 1.0
        assert r["used"] == (2 * meta["groups"] + 1) * 48
        # a step's experts: the busiest board's picks, each an expert's time
        assert meta["block_decode_s"] > meta["busiest_board_experts"] * meta["expert_decode_s"]


def test_experts_all_reduce_is_the_cheaper_schedule_of_the_cheapest_group(tiny_described):
    """The split experts' all-reduce: of every layout's group, the cheaper of the unpipelined and
    the pipelined schedule, the cheapest group's."""
    from tvm_spinn.llm import board_tp
    from tvm_spinn.target.faults import whole_boards
    from tvm_spinn.timing.collectives import board_group_all_reduce

    spec, described = tiny_described
    arch = tvm_spinn.make_system("moe-six-boards", boards=6)
    out = X.records(TINY, spec, arch, "spinn/board", "int8", 1, 64, 4, described, spec.params, 0, _Steps(), {})
    cpb, _, topo, _, order, _, torus = board_tp.board_setting(arch)
    for r in (r for name, r in out.items() if name.startswith("experts:tp")):
        g = r["meta"]["tp_boards"]
        figures = []
        for lay in board_tp.group_layouts(torus, g, whole_boards(arch)):
            grid = [[int(c) + b * cpb for c in order] for b in lay[0]]
            plain = board_group_all_reduce(topo, grid, spec.hidden * 4).seconds
            piped = board_group_all_reduce(topo, grid, spec.hidden * 4, pipelined=True).seconds
            figures += [plain, piped]
        assert r["meta"]["board_all_reduce_s"] == min(figures)


def test_plan_table_names_the_experts_assumption():
    from types import SimpleNamespace

    from tvm_spinn.llm.plan import Plan

    meta = {"ep_boards": 8, "experts_per_board": 1, "experts_active": 2, "busiest_board_experts": 1.0,
            "expert_resident_share": 0.25, "worst_busiest_board_experts": 1, "worst_decode_s": 0.05}
    (row,) = Plan._machine_rows(SimpleNamespace(plan=meta))
    assert row[0] == "experts" and "2 active a step" in row[1] and "25.0% of experts resident" in row[1]
    assert "20.000 tokens/s per user" in row[1]


@pytest.mark.slow  # ~20 s alone: two slices described and mapped on boards
def test_split_experts_floor_bounds_each_degree_and_cuts_only_slower_ones(register_system):
    """Each ``experts:tp`` degree's floor (all-reduces, hand-overs, loop, head and the share of
    the slice the SRAM cannot keep streamed from DRAM: no mapping) is at most its mapped token;
    a degree left unmapped has a floor no faster than the fastest token found."""
    from tvm_spinn.llm.describe import describe
    from tvm_spinn.llm.spec import spec_of
    from tvm_spinn.target import arch_of, get_target

    P = importlib.import_module("tvm_spinn.llm.plan")
    # chips of 4 PEs (11 MB of resident SRAM a board): a board's share of eight experts streams
    cfg = dict(TINY, hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_local_experts=8,
               num_attention_heads=8)
    tag = register_system(tvm_spinn.make_system("moe-floor-boards", boards=6, pes_per_chip=4), tag="spinn/moe-floor")
    target = get_target(tag)
    arch, spec, seq = arch_of(target), spec_of(cfg), 64
    parts = P._parts(P._meta_model(cfg, spec), spec, 1, seq)
    head_d = describe(parts[2][1], parts[2][2], target, "int8")
    host = {tuple(int(x) for x in a.shape) for a in parts[0][2][1:]}
    board = arch.replace(chips=48, name="moe-floor-board")
    atoms = [a for i, d in enumerate(head_d) for a in P._atoms(i, d.program)]
    head = P._map_stage([P._slice(head_d[i].program, a, b) for i, a, b in P._merge(atoms)], board, host, memo={})
    floors: dict = {}
    out = X._sliced(cfg, spec, arch, target, "int8", 1, seq, 4, spec.params, 0, _Steps(), {}, head, floors=floors)
    assert set(floors) == {2, 4}, floors
    fastest = min(r["decode_s"] for r in out.values())
    mapped = {int(name.split("tp")[1].split("m")[0]) for name in out}
    for g, floor in floors.items():
        if g in mapped:
            assert 0 < floor <= min(r["decode_s"] for name, r in out.items() if name.startswith(f"experts:tp{g}m"))
        else:
            assert floor >= fastest
    assert any(r["meta"]["expert_resident_share"] < 1 for r in out.values())  # the case streams
    read, stored = X._sliced_bytes(spec_of(importlib.import_module("tvm_spinn.llm.board_tp").slice_config(cfg, spec, 2)),
                                   2)
    assert read < stored and X._sliced_floor(read, stored, 1, stored, 4, 1e9) == 0.0
    assert X._sliced_floor(read, stored, 2, stored, 4, 1e9) == pytest.approx(read / 2 / 4e9)
