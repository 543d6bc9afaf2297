"""tvm_spinn.llm.plan and ``tvm-spinn plan``: LLM timing from a config alone (meta device,
weights as shape/dtype descriptors, the mapping compiler and timing model, no simulation)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import tvm_spinn  # noqa: E402
from tvm_spinn import llm  # noqa: E402
from tvm_spinn.cli import main  # noqa: E402
from tvm_spinn.llm.describe import describe  # noqa: E402
from tvm_spinn.llm.graphs import LayerStep  # noqa: E402
from tvm_spinn.llm.plan import plan  # noqa: E402

CONFIGS = importlib.resources.files("tvm_spinn.llm") / "configs"

SMALL_LLAMA = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
               "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 1000, "max_position_embeddings": 512}


def _no_simulation(monkeypatch):
    from tvm_spinn.runtime import simulator

    def refuse(*args, **kwargs):
        raise AssertionError("planning ran the functional simulator")

    monkeypatch.setattr(simulator, "run_program", refuse)


@pytest.mark.parametrize("name, params", [("llama-2-7b", 6_738_415_616), ("llama-2-13b", 13_015_864_320),
                                          ("llama-2-70b", 68_976_648_192), ("gpt2-xl", 1_557_611_200)])
def test_shipped_configs_have_the_published_sizes(name, params):
    # parameter counts as published with the checkpoints (transformers' num_parameters())
    path = CONFIGS / f"{name}.json"
    assert path.is_file(), "the configs ship as package data"
    assert llm.spec_of(str(path)).params == params


def _block(family):
    if family == "llama":
        cfg = tf.LlamaConfig(hidden_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=256, vocab_size=512, max_position_embeddings=64)
        cls = tf.LlamaForCausalLM
    else:
        cfg = tf.GPT2Config(n_embd=128, n_layer=1, n_head=4, vocab_size=512, n_positions=64)
        cls = tf.GPT2LMHeadModel
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    real = cls(cfg).eval()
    with torch.device("meta"):
        meta = cls(cfg).eval()
    return real, meta, llm.spec_of(cfg)


def _decode_args(spec, seq, device):
    rows = spec.kv_heads
    args = [torch.zeros(1, 1, spec.hidden), torch.zeros(rows, spec.head_dim, seq), torch.zeros(rows, seq, spec.head_dim),
            torch.zeros(seq, dtype=torch.bool), torch.zeros(seq)]
    if spec.family == "llama":
        args += [torch.zeros(1, 1, spec.head_dim), torch.zeros(1, 1, spec.head_dim)]  # distinct: no aliasing
    return tuple(a.to(device) for a in args)


@pytest.mark.parametrize("family, rel", [("gpt2", 1e-12), pytest.param("llama", 1e-12, marks=pytest.mark.slow)])
def test_described_block_times_like_the_block_compiled_with_its_weights(family, rel, monkeypatch):
    """The reference: the same block with real weights through from_pytorch + relax.build."""
    from tvm import relax

    from tvm_spinn.llm.plan import _map
    from tvm_spinn.target import arch_of

    real, meta, spec = _block(family)
    seq, target = 32, "spinn/board"
    built = tvm_spinn.report(relax.build(tvm_spinn.frontend.from_pytorch(LayerStep(real, spec, seq), _decode_args(spec, seq, "cpu")),
                                         target=target))
    _no_simulation(monkeypatch)
    described = describe(LayerStep(meta, spec, seq).eval(), _decode_args(spec, seq, "meta"), target, "fp32")
    for d in described:  # matrices are descriptors: zero-strided views with no data behind them
        for tid, arr in d.program.constants.items():
            if arr.ndim == 2:
                assert arr.strides == (0, 0) and arr.shape == tuple(d.program.tensors[tid].shape)
    timed = _map(described, arch_of(target), "auto")
    assert timed.latency_s == pytest.approx(built.latency_s, rel=rel)
    assert timed.energy_j == pytest.approx(built.energy_j, rel=rel)
    # the weights as the compiler holds them (up to a vector or a few scalars)
    assert timed.weight_bytes == pytest.approx(built.weight_bytes, rel=1e-2)
    assert len(described) == built.regions


def test_plan_cli_writes_the_json_and_prints_a_table(tmp_path, monkeypatch, capsys):
    _no_simulation(monkeypatch)
    config = tmp_path / "small.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    out = tmp_path / "plan.json"
    rc = main(["plan", str(config), "--target", "spinn/board", "--batch", "2", "--seq", "256", "--dtype", "int8",
               "--json", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tokens/s per user" in printed and "one layer scaled by 4 layers" in printed
    data = json.loads(out.read_text())
    for key in ("tokens_per_s_per_user", "tokens_per_s", "ttft_s", "energy_per_token_j", "chips_used",
                "sram_bytes_per_chip", "dram_bytes_per_chip", "plan", "bound_tokens_per_s", "binding"):
        assert key in data, key
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left
    p = data["plan"]
    assert p["scaled_from_one_layer"] and p["layers"] == 4 and set(p["alternatives"]) == {"groups", "shared"}
    # the placement with the shortest token period is kept (shared since all-gathers multicast)
    assert p["placement"] == min(p["alternatives"], key=lambda k: p["alternatives"][k]["period_s"])
    # the step's parts: the blocks, the head, the hand-overs, the token back to the first group
    # (none on one group) and to every chip of it, and the token out to the host
    assert data["decode_latency_s"] == pytest.approx(4 * p["block_decode_s"] + p["head_decode_s"] + p["handoff_decode_s"]
                                                     + p["token_return_s"] + p["step_sync_s"] + p["host_io_decode_s"])
    assert p["host_io_decode_s"] > 0 and (p["token_return_s"] > 0) == (p["placement"] == "groups")
    assert data["tokens_per_s"] == pytest.approx(2 * data["tokens_per_s_per_user"])
    # the headline: the physical bound (the config, batch, context and system only) over the period
    assert 0 < data["efficiency"] <= 1
    assert data["efficiency"] == pytest.approx(data["physical_bound_s"] * data["tokens_per_s_per_user"])
    assert data["physical_bound"]["binding"] in ("compute", "memory", "communication")
    assert "physical bound" in printed and "plan's own bound" in printed
    assert data["binding"] in ("compute", "dram", "sram", "links")  # the plan's own bound (diagnostic)
    spec = llm.spec_of(SMALL_LLAMA)
    assert data["weight_bytes"] == spec.params  # int8
    assert data["kv_cache_bytes"] == 2 * 256 * spec.kv_bytes_per_token(4)


def test_plan_bad_input_names_the_field(tmp_path, capsys):
    bad = tmp_path / "bert.json"
    bad.write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    assert main(["plan", str(bad), "--no-progress"]) == 2
    assert "'model_type' is 'bert'" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "missing.json"), "--no-progress"]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(llm.LLMError, match="seq=4096 is longer"):
        plan(SMALL_LLAMA, seq=4096)
    with pytest.raises(llm.LLMError, match="dtype must be one of"):
        plan(SMALL_LLAMA, seq=64, dtype="fp8")
    # capacity: 7B in fp32 (27 GB) on one chip (2 GB of DRAM) names the smallest system that fits
    with pytest.raises(llm.LLMError, match="model too large for target spinn2-chip.*smallest registered target "
                                            "that fits: spinn/board"):
        plan(str(CONFIGS / "llama-2-7b.json"), target="spinn", dtype="fp32")
    # checked before any work: one line, exit status 2
    assert main(["plan", str(CONFIGS / "llama-2-7b.json"), "--json", str(tmp_path / "no" / "x.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name, target, seq, layers", [("llama-2-70b", "spinn/board", 2048, 80),
                                                        ("llama-2-70b", "spinn/cloud", 2048, 80),
                                                        ("gpt2-xl", "spinn/board", 1024, 48)])
def test_plan_shipped_models(name, target, seq, layers, monkeypatch):
    _no_simulation(monkeypatch)
    result = plan(str(CONFIGS / f"{name}.json"), target=target, batch=1, seq=seq, dtype="int8")
    assert result.model == name and result.plan["layers"] == layers
    assert 0 < result.tokens_per_s_per_user and 0 < result.efficiency <= 1
    assert result.weight_bytes == llm.spec_of(str(CONFIGS / f"{name}.json")).params
    assert np.isfinite(result.energy_per_token_j) and result.ttft_s > result.decode_latency_s
    alts = result.plan["alternatives"]
    assert min(v["period_s"] for v in alts.values()) == pytest.approx(1 / result.tokens_per_s_per_user)
    p = result.plan
    if target == "spinn/cloud":
        # pipelines of board stages: 1, 2, 3... stages per block are costed (a block's weights do
        # not fit one board's SRAM resident); four boards per block hold every weight GEMM in SRAM
        # (all but the embedding table, read one row per token)
        assert {"pipeline:s1", "pipeline:s2", "pipeline:s4", "shared"} <= set(alts)
        assert alts["pipeline:s2"]["weights_resident"] < 0.5 < 0.99 < alts["pipeline:s4"]["weights_resident"]
        # but a block then crosses board edges three times more; splitting every block over a
        # group of boards (its all-reduces over the graph of boards) is faster than any pipeline
        assert p["placement"] == "board_tp" and p["tp_boards"] >= 8
        assert min(v["period_s"] for k, v in alts.items() if k.startswith("pipeline")) > 1 / result.tokens_per_s_per_user
        assert result.chips_used == p["boards_used"] * 48 == (p["tp_boards"] * p["groups"] + 1) * 48
        assert p["board_all_reduces_decode_s"] == pytest.approx(2 * 80 * p["board_all_reduce_s"])
        assert sum(result.bounds_s.values()) == pytest.approx(1 / result.bound_tokens_per_s)
        assert result.binding == max(result.bounds_s, key=result.bounds_s.get)
    elif target == "spinn/board" and name == "llama-2-70b":
        assert p["kv_cache_in"] == "dram"  # shared placement: the weights stream, the cache too


@functools.lru_cache(maxsize=1)
def _attention_program():
    """The described program of a small Llama decode block that holds its attention (64 slots)."""
    from tvm_spinn.llm.graphs import LayerStep

    _, meta, spec = _block("llama")
    seq = 64
    target = tvm_spinn.get_target("spinn/board")
    described = describe(LayerStep(meta, spec, seq).eval(), _decode_args(spec, seq, "meta"), target, "fp32")
    return seq, next(d.program for d in described if any(layer.kind == "softmax" for layer in d.program.layers))


@pytest.mark.parametrize("tp, split", [pytest.param(2, "heads", marks=pytest.mark.slow), (4, "slots")])
def test_decode_attention_reads_its_share_of_the_kv_cache(tp, split):
    """The KV cache is split over the tensor-parallel chips (by its 2 KV heads when tp divides
    them, else by its slots): each chip reads 1/tp of it. A slot split makes the softmax
    distributed (the row maxima all-reduced exactly, the exp sums by the bit-exact chain) and
    the context matmul row-parallel; a head split needs no collective inside the attention."""
    from tvm_spinn.mapping.shard import plan_shards

    seq, program = _attention_program()
    t = program.tensors
    caches = [tid for tid in program.inputs if len(t[tid].shape) == 3 and seq in t[tid].shape]
    assert len(caches) == 2
    plan = plan_shards(program, tp)
    for tid in caches:  # each chip holds 1/tp of K^T and of V
        assert np.prod(plan.shapes[tid]) * tp == np.prod(t[tid].shape)
        assert (plan.shapes[tid][0] * tp == t[tid].shape[0]) == (split == "heads")
    soft = next(i for i, layer in enumerate(program.layers) if layer.kind == "softmax")
    at_softmax = [c for c in plan.collectives if c.layer == soft]
    context = next(i for i, layer in enumerate(program.layers) if i > soft and layer.kind == "matmul")
    rows = int(np.prod(t[program.layers[soft].output].shape[:-1]))
    if split == "slots":
        assert [(c.op, c.exact, c.nbytes) for c in at_softmax] == [("all_reduce", True, 4 * rows),
                                                                     ("all_reduce", False, 4 * rows)]
        assert plan.splits[context] == "row"
    else:
        assert at_softmax == [] and plan.splits[context] == "split"
    assert not any(c.op == "all_gather" and c.tensor in caches for c in plan.collectives)


def _two_boards(register_system) -> str:
    return register_system(tvm_spinn.make_system("spinn2-two-boards", boards=2), tag="spinn/two-boards")


@pytest.mark.slow  # ~5-9 s: torch.export of three parts and mapping on two boards
def test_multi_board_system_pipelines_blocks_with_weights_in_sram(monkeypatch, register_system):
    """On two boards a block of ~63 MB (fp32) streams from DRAM in the shared placement, while
    the pipeline gives the block its own board, whose SRAM holds nearly all of it, and the head
    the other: the cost model picks the pipeline because it is faster, and its bound is the sum
    of the per-program bounds and the hand-overs."""
    _no_simulation(monkeypatch)
    cfg = dict(SMALL_LLAMA, hidden_size=1024, intermediate_size=4096, num_hidden_layers=1)
    result = plan(cfg, target=_two_boards(register_system), batch=1, seq=16, dtype="fp32")
    p, alts = result.plan, result.plan["alternatives"]
    # (the groups placement on one board of the two is costed too: what one board plans)
    assert set(alts) == {"pipeline:s1", "shared", "groups:one-board"}
    assert p["placement"] == "pipeline" and alts["pipeline:s1"]["period_s"] < min(
        alts["shared"]["period_s"], alts["groups:one-board"]["period_s"])
    assert alts["shared"]["weights_resident"] == 0
    assert p["stages"] == 2 and p["boards_per_stage"] == 1 and p["boards_used"] == 2 and result.chips_used == 96
    block, head = p["stage_plan"]
    assert head["weights_in"] == "sram" and block["resident_bytes"] >= 0.9 * block["weight_bytes"]
    assert p["resident_weight_bytes"] >= 0.9 * result.weight_bytes and p["weights_in"].startswith("sram")
    assert block["handoff_in_bytes"] == head["handoff_in_bytes"] == 1024 * 4  # the hidden state
    assert result.decode_latency_s == pytest.approx(block["latency_s"] + head["latency_s"] + p["handoff_decode_s"]
                                                    + p["token_return_s"] + p["step_sync_s"] + p["host_io_decode_s"])
    assert result.tokens_per_s_per_user == pytest.approx(1 / result.decode_latency_s)
    # the bound: per-program largest bounds plus hand-overs, summed by kind; binding the largest
    assert sum(result.bounds_s.values()) == pytest.approx(1 / result.bound_tokens_per_s)
    assert result.binding == max(result.bounds_s, key=result.bounds_s.get)
    assert result.bounds_s["links"] >= p["handoff_decode_s"] > 0
    # 65 MB (fp32 weights) fit one board's memories: no crossing is forced, the physical bound
    # reads them from the SRAM and DRAM of both boards at once
    assert result.physical_bound["details"]["least_boards"] == 1 and 0 < result.efficiency <= 1


def test_pipeline_stages_cut_a_block_at_its_weight_gemms():
    """The pipeline's units: a described program cut before each weight GEMM (with its
    quantize), each run of layers a program of its own whose inputs are what it reads and
    nothing in it produces, and runs balanced by weight bytes."""
    from tvm_spinn.llm.plan import _atoms, _balanced, _slice

    _, program = _attention_program()
    atoms = _atoms(0, program)
    assert [a[1] for a in atoms[1:]] == [a[2] for a in atoms[:-1]] and atoms[-1][2] == len(program.layers)
    dense = [i for i, layer in enumerate(program.layers) if layer.kind == "dense" and "weight" in layer.consts]
    assert len(atoms) == len(dense) + (dense[0] > 0)  # each weight GEMM starts an atom
    consts = {t for t in range(len(program.tensors)) if program.tensors[t].role == "const"}
    assert sum(a[3] for a in atoms) == sum(program.tensors[t].nbytes for t in consts)
    for _, a, b, w in atoms:
        piece = _slice(program, a, b)
        t = piece.tensors
        assert [layer.name for layer in piece.layers] == [layer.name for layer in program.layers[a:b]]
        produced = {layer.output for layer in piece.layers}
        read = {x for layer in piece.layers for x in layer.inputs if t[x].role != "const"}
        assert set(piece.inputs) == read - produced and all(t[x].role == "input" for x in piece.inputs)
        assert all(t[x].role == "output" and x in produced for x in piece.outputs)
        assert sum(x.nbytes for x in t if x.role == "const") == w and set(piece.constants) == \
            {i for i, x in enumerate(t) if x.role == "const"}
    fake = [(0, i, i + 1, w) for i, w in enumerate([5, 1, 1, 4, 4, 4])]
    runs = _balanced(fake, 3)
    assert [[a[1] for a in run] for run in runs] == [[0], [1, 2, 3], [4, 5]]  # largest run 8: the optimum


def test_kv_cache_in_sram_when_it_fits_else_dram():
    """A decode block's KV cache is state kept on the chips: in SRAM when the stage's SRAM
    ledger has room for it (the attention matmuls' operands resident, counted in the resident
    bytes), else in DRAM; and holding it in SRAM is never slower than streaming it from DRAM
    on the same system (the same weights streamed in both)."""
    from tvm_spinn.llm.plan import _map_stage
    from tvm_spinn.mapping import MappingOptions
    from tvm_spinn.mapping.planner import plan_system
    from tvm_spinn.mapping.system import resident_state

    seq, program = _attention_program()
    t = program.tensors
    caches = {tid for tid in program.inputs if len(t[tid].shape) == 3 and seq in t[tid].shape}
    kv = sum(t[tid].nbytes for tid in caches)
    assert kv == 2 * 2 * 32 * seq * 4  # K^T and V of 2 KV heads of 32, fp32
    host = {tuple(t[tid].shape) for tid in caches} | {(seq,)}
    # two chips of 4 PEs: 32 KiB of SRAM per PE leave room for the cache, 24 KiB do not
    fits = tvm_spinn.make_system("kv-fits", chips=2, pes_per_chip=4, sram_bytes=32 * 1024)
    full = tvm_spinn.make_system("kv-full", chips=2, pes_per_chip=4, sram_bytes=24 * 1024)
    held, spilled = (_map_stage([program], arch, host, seq) for arch in (fits, full))
    assert held.kv_bytes == spilled.kv_bytes == kv
    assert held.kv_sram_bytes == kv and held.resident_bytes >= kv
    # (the post-attention RMSNorm's 1 KB weight may stay resident; none of the cache does)
    assert spilled.kv_sram_bytes == 0 and spilled.resident_bytes < kv
    # the same system, the cache held (weights="auto") or streamed (weights="stream")
    timed, state = {}, {}
    for weights in ("auto", "stream"):
        mapped = dataclasses.replace(program, timing=None, mapping=None, memory=None, tiles=None, arch=fits)
        plan = plan_system([mapped], fits, MappingOptions(weights=weights))
        (region,), (mapped,) = plan.regions, plan.programs
        timed[weights], state[weights] = mapped, (region.state_bytes, region.state_sram_bytes)
    assert resident_state(timed["auto"], timed["auto"].mapping.resident_layers) == caches
    assert state["auto"] == (kv, kv) and state["stream"] == (kv, 0)
    assert timed["auto"].timing.latency_s <= timed["stream"].timing.latency_s
    # streamed, the cache crosses DRAM each step (the bound's I/O); held, it does not
    assert timed["stream"].timing.system.streamed_bytes_per_chip > timed["auto"].timing.system.streamed_bytes_per_chip


def test_shard_plan_estimates_count_the_kv_cache_a_chip_reads():
    """The shard plans are ranked by an estimate before the best few are timed in full: it
    counts the bytes a chip reads from DRAM, its share of the weights and of the KV cache (the
    state streamed like a weight shard), so a plan that holds each slot's keys and values on
    several chips (the query heads split over groups of chips) ranks behind one that spreads
    the slots over every chip."""
    from tvm_spinn.mapping.system import _candidates
    from tvm_spinn.target import arch_of
    from tvm_spinn.target.topology import topology_of

    seq, program = _attention_program()
    t = program.tensors
    caches = {tid for tid in program.inputs if len(t[tid].shape) == 3 and seq in t[tid].shape}
    arch = arch_of("spinn/board")
    work = [0.0] * len(program.layers)  # no compute: the estimate is the DRAM reads and the collectives
    cands = _candidates(program, arch, topology_of(arch), False, work)
    assert len(cands) > 1
    for bound, plan, _ in cands:
        read = sum(int(np.prod(plan.shapes[i])) * x.nbytes // int(np.prod(x.shape))
                   for i, x in enumerate(t) if x.role == "const" or i in caches)
        assert read >= sum(t[i].nbytes for i in caches) // plan.chips
        assert bound >= read / arch.dram_bw_bytes_s
