"""Scale-out (issue 12): shard plans (Megatron split), capacity, residency, bounds, symmetry, bits.

References: the sequential float32 sum for the chain all-reduce (numpy, one accumulator), the
PyTorch model and the one-chip build for the functional results (bitwise), the byte counts of
the model's weights for capacity.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.mapping import MappingError
from tvm_spinn.mapping.shard import plan_shards
from tvm_spinn.target.topology import topology_of
from tvm_spinn.timing import collectives as C


def _bert(layers=1, hidden=128, heads=4, seq=32):
    import transformers as tf

    from test_zoo import _Field

    torch.manual_seed(0)
    cfg = tf.BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=4 * hidden, vocab_size=1000)
    return _Field(tf.BertModel(cfg), "last_hidden_state").eval(), torch.randint(0, 1000, (1, seq))


@pytest.fixture(scope="module")
def bert():
    model, x = _bert()
    return model, x, tvm_spinn.frontend.from_pytorch(model, (x,))


def _run(mod, target, x):
    ex = relax.build(mod, target=target)
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    return out.numpy(), tvm_spinn.report(ex)


def test_megatron_split_one_all_reduce_per_block(bert):
    """Q/K/V and the first MLP GEMM column-parallel, the output projection and the second MLP
    GEMM row-parallel: two all-reduces per encoder layer, no all-gather inside a block."""
    _, _, mod = bert
    rep = tvm_spinn.report(relax.build(mod, target="spinn"))
    reduces, splits = 0, {}
    for program in rep.programs:
        plan = plan_shards(program, 4)
        reduces += sum(c.op == "all_reduce" for c in plan.collectives)
        for layer, s in zip(program.layers, plan.splits):
            if layer.kind == "dense":
                splits[s] = splits.get(s, 0) + 1
    assert reduces == 2  # one encoder layer: attention block + MLP block
    assert splits == {"col": 4, "row": 2}  # Q, K, V, fc1 | out-proj, fc2


def test_sequence_parallel_plan_splits_rows_and_heads(bert):
    """tp 2 x sp 4: LayerNorms on row blocks with no all-gather before them, the all-reduces
    over the tp group on a quarter of the rows, the attention on heads x query-row blocks with
    only its keys gathered (over the sp group), the outputs gathered once over all 8 chips.
    Shapes and bytes from the config (hidden 128, 4 heads of 32, sequence 32, fp32)."""
    _, _, mod = bert
    rep = tvm_spinn.report(relax.build(mod, target="spinn"))
    hidden, heads, seq, tp, sp = 128, 4, 32, 2, 4
    layer_norms = scores = key_gathers = 0
    for program in rep.programs:
        plan = plan_shards(program, tp, 1, True, sp)
        assert plan.chips == tp * sp and plan.summary()["sp"] == sp
        n = len(program.layers)
        by_layer = {}
        for c in plan.collectives:
            by_layer.setdefault(c.layer, []).append(c)
        for i, layer in enumerate(program.layers):
            shape = plan.shapes[layer.output]
            if layer.kind == "layer_norm":
                layer_norms += 1
                assert plan.seq[i] and tuple(shape) == (1, seq // sp, hidden)
                assert not [c for c in by_layer.get(i, []) if c.tensor in layer.inputs]
            if layer.kind == "matmul" and list(program.tensors[layer.output].shape) == [heads, seq, seq]:
                scores += 1  # Q K^T and P V (head size = sequence here): a chip's heads and query rows
                assert tuple(shape) == (heads // tp, seq // sp, seq)
                gathered = [c for c in by_layer.get(i, []) if c.op == "all_gather"]
                if gathered:  # K^T of the chip's heads, every key row: over the sp group
                    key_gathers += 1
                    assert [(c.group, c.nbytes, c.shape) for c in gathered] == [
                        ("sp", heads // tp * 32 * seq * 4, (heads // tp, 32, seq))]
        for c in plan.collectives:
            if c.op == "all_reduce":  # the two Megatron all-reduces: a quarter of the rows each
                assert (c.group, c.nbytes) == ("tp", seq // sp * hidden * 4)
            if c.layer >= n:  # outputs leave whole: one all-gather over all chips
                assert c.group == "all" and c.nbytes == program.tensors[c.tensor].nbytes
        assert sum(c.op == "all_reduce" for c in plan.collectives) <= 2
    assert layer_norms == 3 and scores == 2 and key_gathers == 1
    with pytest.raises(ValueError, match="sequence parallelism"):
        plan_shards(rep.programs[0], 2, 2, True, 2)


def test_output_gathers_overlap_later_layers_and_yield_the_links():
    """compose: a program output's all-gather runs from when its tensor is written, in the
    links' time left free by the collectives layers wait for; it never delays a layer, and
    the program ends when it is done."""
    from types import SimpleNamespace

    from tvm_spinn.timing.system import compose

    arch = tvm_spinn.arch_of(tvm_spinn.get_target("spinn"))
    program = SimpleNamespace(layers=[SimpleNamespace(flops=0, mode="fp32") for _ in range(3)])
    ms = arch.clock_hz // 1000
    cycles = [ms, ms, ms]  # three layers of 1 ms

    def cost(seconds):
        return C.CollectiveCost("all_gather", "ring", seconds, 0.0, 1, 0, 1, 2, 1.0)

    alone = compose(program, arch, cycles, [0, 0, 0], [], 1)
    assert alone.latency_s == pytest.approx(3e-3)
    # written by layer 0 (ends at 1 ms), 1.5 ms on the links: overlaps layers 1 and 2
    early = compose(program, arch, cycles, [0, 0, 0], [(3, cost(1.5e-3), 0)], 1)
    assert early.layer_s == alone.layer_s and early.latency_s == pytest.approx(3e-3)
    # 2.5 ms: the program waits 0.5 ms for it after its last layer
    assert compose(program, arch, cycles, [0, 0, 0], [(3, cost(2.5e-3), 0)], 1).latency_s == pytest.approx(3.5e-3)
    # a 1 ms collective layer 2 waits for takes the links first (from 2 ms): the output
    # gather, 1.5 ms from 1 ms, is held up by it and ends at 3.5 ms; layer 2 ends at 4 ms
    both = compose(program, arch, cycles, [0, 0, 0], [(2, cost(1e-3)), (3, cost(1.5e-3), 0)], 1)
    assert both.latency_s == pytest.approx(4e-3)
    both = compose(program, arch, cycles, [0, 0, 0], [(2, cost(1e-3)), (3, cost(2.5e-3), 0)], 1)
    assert both.latency_s == pytest.approx(4.5e-3)  # 1 ms before, 1.5 ms after the blocking one
    # without a ready layer it is an ordinary end-of-program collective
    assert compose(program, arch, cycles, [0, 0, 0], [(3, cost(1.5e-3))], 1).latency_s == pytest.approx(4.5e-3)


def test_chain_all_reduce_gives_the_sequential_bits():
    """Chips continuing one accumulator over consecutive k blocks give the one-chip sum."""
    rng = np.random.default_rng(0)
    terms = rng.standard_normal((96, 50)).astype(np.float32) * np.float32(1e3)
    sequential = np.zeros(50, np.float32)
    for row in terms:
        sequential = sequential + row
    for chips in (2, 3, 8, 12):
        acc = np.zeros(50, np.float32)
        for block in np.array_split(terms, chips):  # chip i adds its block into what it receives
            for row in block:
                acc = acc + row
        assert np.array_equal(acc.view(np.uint32), sequential.view(np.uint32))
    tree = C.fixed_order_sum([b.sum(0, dtype=np.float32) for b in np.array_split(terms, 8)])
    assert not np.array_equal(tree.view(np.uint32), sequential.view(np.uint32))  # a tree would not


def test_chain_all_reduce_cost_on_the_graph():
    arch = tvm_spinn.make_system("chain", boards=1)
    topo = topology_of(arch)
    # two neighbours, one segment: down the chain and back, one hop each way at a time, and the
    # second rank's relay of a word with its term added (receive, add, send)
    cost = C.chain_all_reduce(topo, [0, 1], 1 << 20, segments=(1,))
    assert cost.steps == 2
    relay = (2 * arch.task_word_cycles + arch.m4f_fpu_cycles) / arch.clock_hz
    assert cost.seconds == pytest.approx(2 * ((1 << 20) / arch.payload_bw("chip") + arch.link_hop_s) + relay)
    # two segments: the second follows the first a link's time for its bytes later (its hops'
    # latency is not paid again)
    two = C.chain_all_reduce(topo, [0, 1], 1 << 20, segments=(2,))
    half = (1 << 19) / arch.payload_bw("chip")
    assert two.seconds == pytest.approx(2 * (half + arch.link_hop_s) + relay + half)
    # segments pipeline a long chain: far cheaper than one segment, and more bytes cost more
    long1 = C.chain_all_reduce(topo, list(range(12)), 1 << 20, segments=(1,))
    best = C.chain_all_reduce(topo, list(range(12)), 1 << 20)
    assert best.seconds < long1.seconds / 4
    assert C.chain_all_reduce(topo, list(range(12)), 1 << 21).seconds > best.seconds
    # leaving the board pays the slower board links
    two = topology_of(tvm_spinn.make_system("chain2", boards=2))
    on, off = C.chain_all_reduce(two, [0, 1], 1 << 20), C.chain_all_reduce(two, [0, 48], 1 << 20)
    assert off.seconds > on.seconds and off.board_hops > 0


def test_bits_do_not_depend_on_the_plan(bert, register_system):
    """One chip, a board and a two-board system: different plans, the same bits."""
    model, x, mod = bert
    results, plans, seq = {}, {}, {}
    tags = {"chip": "spinn", "board": "spinn/board",
            "2boards": register_system(tvm_spinn.make_system("scale-2b", boards=2))}
    for key, tag in tags.items():
        results[key], rep = _run(mod, tag, x.numpy())
        plans[key] = [m.get("system", {}).get("tp", 1) for m in rep.mapping]
        seq[key] = [m.get("system", {}).get("sp", 1) for m in rep.mapping]
    assert max(plans["board"]) > 1 and max(plans["chip"]) == 1
    assert max(seq["board"]) > 1  # the cost model picks heads x row blocks for the attention
    first = results["chip"]
    for key, value in results.items():
        assert np.array_equal(value.view(np.uint32), first.view(np.uint32)), key
    with torch.no_grad():
        np.testing.assert_allclose(first, model(x).numpy(), rtol=1e-4, atol=1e-4)


def test_symmetry_one_chip_simulated_whatever_the_system(bert):
    """The board and the 720-board cloud time the same shard: same tiles, same plan."""
    _, _, mod = bert
    board = tvm_spinn.report(relax.build(mod, target="spinn/board"))
    cloud = tvm_spinn.report(relax.build(mod, target="spinn/cloud"))
    assert [m["layers"] for m in board.mapping] == [m["layers"] for m in cloud.mapping]
    assert [m["system"]["tp"] for m in board.mapping] == [m["system"]["tp"] for m in cloud.mapping]
    for m in cloud.mapping:  # every tile on the PEs of one chip: one chip's shard
        assert all(first + count <= 148 for first, count in (r["pes"] for r in m["layers"]))


def test_bounds_are_lower_bounds_and_report_names_the_binding_one(bert):
    _, _, mod = bert
    for options in (tvm_spinn.MappingOptions(), tvm_spinn.MappingOptions(weights="stream")):
        with options:
            rep = tvm_spinn.report(relax.build(mod, target="spinn/board"))
        for p in rep.programs:
            s = p.timing.system
            assert s.latency_s >= s.compute_bound_s * (1 - 1e-9)
            assert s.latency_s >= s.memory_bound_s * (1 - 1e-9)
            assert s.latency_s >= s.comm_bound_s * (1 - 1e-9)
            assert s.binding in ("compute", "memory", "communication")
        text = str(rep)
        assert "plan" in text and "binds" in text
    streamed = sum(p.timing.system.streamed_bytes_per_chip for p in rep.programs)
    assert streamed > 0  # weights="stream": each chip streams its shard


def test_weights_resident_when_aggregate_sram_holds_them(bert, register_system):
    """The small BERT's shards mostly fit the board's SRAM: far fewer bytes streamed per
    inference than when every weight streams; on chips with little SRAM they stream from each
    chip's DRAM."""
    _, _, mod = bert

    def streamed(target, **options):
        with tvm_spinn.MappingOptions(**options):
            rep = tvm_spinn.report(relax.build(mod, target=target))
        return sum(p.timing.system.streamed_bytes_per_chip for p in rep.programs)

    resident, stream = streamed("spinn/board"), streamed("spinn/board", weights="stream")
    assert resident < 0.25 * stream
    tiny = register_system(tvm_spinn.make_system("scale-tiny-sram", boards=1, pes_per_chip=4, sram_bytes=32 * 1024))
    assert streamed(tiny) > resident


class _Blocks(torch.nn.Module):
    """Dense blocks separated by a host op (floor), so each block is its own program."""

    def __init__(self, blocks: int, width: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = torch.floor(layer(x))
        return x


def _capacity_system(register_system, boards: int, dram: int):
    arch = tvm_spinn.make_system(f"cap-{boards}-{dram}", boards=boards, pes_per_chip=2, pes_per_qpe=2,
                                  sram_bytes=32 * 1024, dram_bytes=dram)
    return register_system(arch)


def test_capacity_boundary_names_bytes_and_smallest_system(register_system):
    torch.manual_seed(0)
    width, blocks = 480, 4
    model, x = _Blocks(blocks, width).eval(), torch.randn(1, width)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    # per chip: a 48-way shard of one block is ~19 KB; a chip's SRAM (2 PEs) keeps a little of it
    dram = 24 * 1024
    with pytest.raises(MappingError) as err:
        relax.build(mod, target=_capacity_system(register_system, 1, dram))
    text = str(err.value)
    assert f"need {weight_bytes} bytes" in text and "make_system(boards=" in text
    boards = int(re.search(r"make_system\(boards=(\d+)\)", text).group(1))
    assert boards > 1
    out, rep = _run(mod, _capacity_system(register_system, boards, dram), x.numpy())  # the named system holds it
    assert max(m["system"]["stage"] for m in rep.mapping) == boards - 1  # one stage per board
    one_chip, _ = _run(mod, "spinn", x.numpy())  # the one-chip program (no capacity check)
    assert np.array_equal(out.view(np.uint32), one_chip.view(np.uint32))
    with pytest.raises(MappingError):
        relax.build(mod, target=_capacity_system(register_system, boards - 1, dram))


def test_data_parallel_batch_same_bits():
    """A batch of 8 images on a board: the batch is split over chips (data parallelism); the
    result is the one-chip build's, bit for bit, and PyTorch's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(32, 10)).eval()
    x = torch.randn(8, 3, 16, 16)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    one, _ = _run(mod, "spinn", x.numpy())
    board, rep = _run(mod, "spinn/board", x.numpy())  # latency: the batch spread over chips
    assert max(m["system"]["dp"] for m in rep.mapping) > 1
    assert np.array_equal(board.view(np.uint32), one.view(np.uint32))
    with torch.no_grad():
        np.testing.assert_allclose(one, model(x).numpy(), rtol=1e-4, atol=1e-4)


def test_output_partial_sums_are_reduced_before_the_row_blocks_gather():
    """tp 2 x sp 2: a column-parallel then a row-parallel fp32 GEMM leave the program's output
    as partial sums over the tp group, split in row blocks over sp. Before the outputs leave
    whole (one all-gather over all four chips) the partial sums are all-reduced over the tp
    group, by the bit-exact chain (fp32), on the chip's row block: rows / sp x columns x 4
    bytes."""
    from tvm_spinn.program import Layer, Program, TensorDesc
    from tvm_spinn.target import arch_of

    rows, k, mid, cols, tp, sp = 4, 16, 32, 8, 2, 2
    tensors = [TensorDesc("x", [rows, k], "float32", "input"), TensorDesc("w1", [k, mid], "float32", "const"),
               TensorDesc("h", [rows, mid], "float32", "temp"), TensorDesc("w2", [mid, cols], "float32", "const"),
               TensorDesc("y", [rows, cols], "float32", "output")]
    layers = [Layer("fc1", "dense", [0], 2, {"weight": 1}, {"relu": False}),
              Layer("fc2", "dense", [2], 4, {"weight": 3}, {"relu": False})]
    program = Program("main", arch_of("spinn/board"), tensors, [0], [4], layers,
                      constants={1: np.ones((k, mid), np.float32), 3: np.ones((mid, cols), np.float32)})
    plan = plan_shards(program, tp, 1, True, sp)
    assert plan.splits == ("col", "row")
    end = [(c.op, c.group, c.nbytes, c.exact) for c in plan.collectives if c.layer >= len(layers) and c.tensor == 4]
    assert end == [("all_reduce", "tp", rows // sp * cols * 4, False), ("all_gather", "all", rows * cols * 4, True)]


def test_weight_streams_load_ahead_into_the_room_the_buffer_has():
    """compose: a weight shard's bytes stream into the prefetch buffer as soon as it has room
    beside the unfinished layers' shards, and a shard larger than the buffer streams its rest
    once the layers before it have ended (it never waits for the whole buffer to empty)."""
    from types import SimpleNamespace

    from tvm_spinn.timing.system import compose

    arch = tvm_spinn.arch_of(tvm_spinn.get_target("spinn"))
    program = SimpleNamespace(layers=[SimpleNamespace(flops=0, mode="int8") for _ in range(3)])
    ms = arch.clock_hz // 1000
    per_ms = arch.dram_bw_bytes_s / 1000  # bytes the DRAM channel moves in 1 ms
    room = per_ms  # a buffer of 1 ms of stream
    cycles = [ms, ms, ms]

    def latency(big):
        # layer 0: nothing streamed; layer 1: 0.5 ms of stream; layer 2: ``big`` ms of stream
        return compose(program, arch, cycles, [0, int(0.5 * per_ms), int(big * per_ms)], [], 1,
                       prefetch_bytes=room).latency_s

    # layer 1 loads in [0, 0.5] ms and runs in [1, 2] ms. Layer 2 (2 ms of stream): 0.5 ms of
    # it loads into the room left beside layer 1's shard in [0.5, 1] ms, the rest (1.5 ms) once
    # layer 1 ends at 2 ms: its last byte at 3.5 ms, it ends at 4.5 ms (waiting for the whole
    # buffer to empty: 2 + 2 + 1 = 5 ms)
    assert latency(2.0) == pytest.approx(4.5e-3)
    # a shard of the buffer's size: 0.5 ms ahead, 0.5 ms after 2 ms, ends at 2.5 + 1 ms
    assert latency(1.0) == pytest.approx(3.5e-3)
    # one that fits beside layer 1's: loaded in [0.5, 0.9] ms, layer 2 runs after layer 1
    assert latency(0.4) == pytest.approx(3e-3)
    # the latency grows with the shard's size, with no step at the buffer's size
    sizes = np.linspace(0.4, 2.0, 17)
    lat = [latency(s) for s in sizes]
    assert all(b >= a - 1e-12 for a, b in zip(lat, lat[1:]))
    assert latency(1.0 + 1e-3) - latency(1.0) < 2e-6


def test_a_layer_of_several_tiles_a_pe_frees_its_computed_tiles_weights_for_the_next_stream():
    """compose: once a streamed layer's last byte is in, its earlier tiles have computed and
    freed their weight blocks, so the next layer's shard loads into that room during its last
    wave, even behind a shard larger than the buffer and a layer that streams nothing; with one
    tile a PE the shard is held whole until the layer ends."""
    from types import SimpleNamespace

    from tvm_spinn.timing.system import compose

    arch = tvm_spinn.arch_of(tvm_spinn.get_target("spinn"))
    program = SimpleNamespace(layers=[SimpleNamespace(flops=0, mode="int8") for _ in range(3)])
    ms = arch.clock_hz // 1000
    per_ms = arch.dram_bw_bytes_s / 1000
    # layer 0: 2 ms of stream into a 1 ms buffer, 1.5 ms of compute; layer 1: nothing streamed,
    # no work; layer 2: 0.5 ms of stream, 1 ms of compute
    stream, cycles = [int(2 * per_ms), 0, int(0.5 * per_ms)], [int(1.5 * ms), 0, ms]

    def latency(waves):
        return compose(program, arch, cycles, stream, [], 1, prefetch_bytes=per_ms, waves=waves).latency_s

    # three tiles a PE: layer 0 starts at 2/3 ms and ends 0.5 ms after its last byte (2 ms);
    # from 2 ms it holds its last wave's third of the buffer, so layer 2's 0.5 ms load in
    # [2, 2.5] ms: layer 2 runs in [2.5, 3.5] ms (holding the whole buffer to 2.5 ms: 4 ms)
    assert latency([3, 1, 1]) == pytest.approx(3.5e-3)
    # one tile a PE: layer 0 runs in [2, 3.5] ms holding the buffer; layer 2 loads in [3.5, 4]
    assert latency([1, 1, 1]) == pytest.approx(5e-3)
    assert latency(None) == pytest.approx(5e-3)


def test_a_streamed_layer_of_several_tiles_a_pe_computes_while_its_weights_arrive():
    """compose: a streamed layer whose PEs run several tiles each starts once its first tiles'
    weights are in and computes them while the rest stream; after its last byte it has only
    its last tiles' share of the work left (one tile a PE: after the whole stream)."""
    from types import SimpleNamespace

    from tvm_spinn.timing.system import compose

    arch = tvm_spinn.arch_of(tvm_spinn.get_target("spinn"))
    program = SimpleNamespace(layers=[SimpleNamespace(flops=0, mode="int8")])
    ms = arch.clock_hz // 1000
    stream = [int(2 * arch.dram_bw_bytes_s / 1000)]  # 2 ms of stream
    cycles = [int(1.5 * ms)]  # 1.5 ms of compute with the weights on chip

    def latency(waves):
        return compose(program, arch, cycles, stream, [], 1, prefetch_bytes=0.0, waves=waves).latency_s

    assert latency(None) == pytest.approx(3.5e-3) and latency([1]) == pytest.approx(3.5e-3)
    # three tiles a PE: the last third (0.5 ms) after the last byte at 2 ms
    assert latency([3]) == pytest.approx(2.5e-3)
    # compute longer than the stream: from the first third's weights (2/3 ms) on, 6 ms of work
    long = compose(program, arch, [6 * ms], stream, [], 1, waves=[3]).latency_s
    assert long == pytest.approx(2e-3 / 3 + 6e-3)
