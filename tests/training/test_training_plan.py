"""Training plans from a config (``tvm_spinn.training.plan_training``) against references.

The references are written here from the papers, independently of the planner, and re-derived
for this machine's training: every tensor fp32 (4 bytes), no fp16/bf16 copy, no master copy of
the weights, and no dropout (the trainer refuses it). The parameter counts come from
transformers' own models (built on the meta device: no weight memory), not from the planner's
config reader.
"""

from __future__ import annotations

import json
import math
import pathlib
import time

import numpy as np
import pytest

from tvm_spinn.llm.spec import LLMError, spec_of
from tvm_spinn.target import make_system
from tvm_spinn.training import TrainingPlanError, plan_training
from tvm_spinn.training.planner import Split, memory_per_chip, model_flops

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "python" / "tvm_spinn" / "llm" / "configs"
GIB = 2**30


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def _transformers_params(name: str) -> int:
    """Ψ: parameters of the transformers model of the shipped config (meta device)."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(**_config(name))
    cls = transformers.LlamaForCausalLM if cfg.model_type == "llama" else transformers.GPT2LMHeadModel
    with torch.device("meta"):
        model = cls(cfg)
    return sum(p.numel() for p in model.parameters())  # a tied head is one parameter


@pytest.fixture(scope="module")
def params():
    return {name: _transformers_params(name) for name in ("gpt2-xl", "llama-2-7b")}


# ------------------------------------------------------------------------- model states (ZeRO)
@pytest.mark.parametrize("name", ["gpt2-xl", "llama-2-7b"])
@pytest.mark.parametrize("dp", [1, 8, 64])
def test_model_states_match_zero_and_deepspeed(name, dp, params):
    """ZeRO (Rajbhandari et al. 2020, Sec. 5.1, Fig. 1): with mixed-precision Adam a model of Ψ
    parameters holds 2Ψ fp16 weights, 2Ψ fp16 gradients and KΨ optimizer state, K = 12 (fp32
    master weights, momentum, variance); P_os shards the K part over N_d replicas, P_os+g the
    gradients too. In fp32 training the weights are the master copy and the gradients are fp32:
    4Ψ weights, 4Ψ gradients, K = 8 (AdamW's two moments). So
        stage 0: 16Ψ, stage 1 (P_os): 8Ψ + 8Ψ/N_d, stage 2 (P_os+g): 4Ψ + 12Ψ/N_d.
    DeepSpeed's estimator (deepspeed.runtime.zero.stage_1_and_2.
    estimate_zero2_model_states_mem_needs, no offload) gives 4Ψ + 16Ψ/N per GPU: fp16 weights
    and a full fp16 gradient buffer (2Ψ + 2Ψ) and, per partition, fp32 master weights, fp32
    gradients, momentum and variance (16). Re-derived for fp32: the full gradient buffer is the
    fp32 gradient (4Ψ), so the partition keeps the two moments only: 4Ψ + 4Ψ + 8Ψ/N, which is
    ZeRO's stage 1 (full gradients, sharded optimizer)."""
    spec = spec_of(_config(name))
    psi = params[name]
    assert spec.params == psi
    zero_paper = {0: 16 * psi, 1: 8 * psi + 8 * psi / dp, 2: 4 * psi + 12 * psi / dp}
    deepspeed_fp32 = 4 * psi + 4 * psi + 8 * psi / dp
    for zero in (0, 1, 2):
        mem = memory_per_chip(spec, Split(1, 1, dp, zero, 1, 1, False), 1024, "adamw", 2 * GIB)
        states = mem.weights + mem.gradients + mem.optimizer
        assert states == pytest.approx(zero_paper[zero], rel=1e-9), zero
        if zero == 1:
            assert states == pytest.approx(deepspeed_fp32, rel=1e-9)
    sgd = memory_per_chip(spec, Split(1, 1, dp, 0, 1, 1, False), 1024, "sgd", 2 * GIB)
    assert sgd.optimizer == 0 and sgd.weights == sgd.gradients == 4 * psi


# ---------------------------------------------------------------------- activations (Korthikanti)
def _korthikanti_fp32(s, b, h, a, t, sequence_parallel):
    """Bytes of one GPT layer's stored activations (Korthikanti et al. 2022, Sec. 4.1), for
    fp32 and no dropout. The paper's fp16 terms: attention 11sbh + 5as²b (QKV input 2sbh, Q and
    K 4sbh, softmax output 2as²b, dropout mask as²b, dropout output 2as²b, V 2sbh, projection
    input 2sbh, dropout mask sbh), MLP 19sbh (inputs 2sbh and 8sbh, GeLU input 8sbh, mask sbh),
    two LayerNorm inputs 4sbh: sbh(34 + 5as/h). Without dropout the three masks (as²b + 2sbh) and
    the dropout output (2as²b, the AV matmul then reads the softmax output) go: 32sbh + 2as²b; in
    fp32 every element takes twice the bytes: 64sbh + 4as²b. Tensor parallel without sequence
    parallelism (Sec. 4.2.1) keeps the LayerNorm inputs (4sbh fp16), the QKV input and the first
    MLP input (2sbh each) replicated, 8sbh in fp16, 16sbh in fp32, and splits the rest by t;
    with sequence parallelism (Sec. 4.2.2) everything is split by t."""
    if sequence_parallel:
        return (64 * s * b * h + 4 * a * s * s * b) / t
    return 16 * s * b * h + (48 * s * b * h + 4 * a * s * s * b) / t


@pytest.mark.parametrize("t", [1, 5, 25])
@pytest.mark.parametrize("sp", [False, True])
def test_activations_match_korthikanti(t, sp):
    spec = spec_of(_config("gpt2-xl"))  # a GPT: MLP 4h, multi-head attention, as the paper
    s, b, h, a, L = 1024, 2, spec.hidden, spec.heads, spec.layers
    layer = _korthikanti_fp32(s, b, h, a, t, sp)
    # one stage, one micro-batch: the layers' activations (the last stage adds the logits and the
    # final LayerNorm's input and output, Sec. 4.3's output terms in fp32: 4sbv/t, 2 x 4sbh; the
    # vocabulary padded to a multiple of t, as Megatron's vocab-parallel embedding does)
    out_terms = 4 * s * b * math.ceil(spec.vocab / t) + (2 * 4 * s * b * h) / (t if sp else 1)
    mem = memory_per_chip(spec, Split(t, 1, 1, 0, b, 1, False, sp), s, "sgd", 2**60)
    assert mem.activations_no_recompute == pytest.approx(L * layer + out_terms, rel=1e-6)
    # 1F1B (Sec. 4.3): the first stage holds p micro-batches of L/p layers, L layers' worth
    p = 4
    mem = memory_per_chip(spec, Split(t, p, 1, 0, b, 8, False, sp), s, "sgd", 2**60)
    assert mem.stage == 0
    assert mem.activations_no_recompute == pytest.approx(L * layer, rel=1e-6)
    # full recomputation (Sec. 5): each layer keeps its input, 2sbh in fp16, 4sbh in fp32 (/t
    # with sequence parallelism), p micro-batches on the first stage, plus one layer recomputed
    keep = 4 * s * b * h / (t if sp else 1)
    assert mem.activations_recompute == pytest.approx(L * keep + layer, rel=1e-6)


# ------------------------------------------------------------------------------------ FLOPs
def test_flops_match_megatron():
    """Narayanan et al. 2021 (Megatron-LM at scale), eq. 3: a GPT step of B sequences of s
    tokens takes 96BsLh²(1 + s/6h + V/16Lh) FLOPs with full recomputation: the forward of every
    block 24Bsh² + 4Bs²h, the head 2BshV; backward twice the forward; recomputation one more
    forward of the blocks. Without recomputation: 72BsLh²(1 + s/6h + V/12Lh)."""
    spec = spec_of(_config("gpt2-xl"))
    B, s, L, h, V = 512, 1024, spec.layers, spec.hidden, spec.vocab
    assert model_flops(spec, B * s, s) == pytest.approx(72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h)),
                                                        rel=1e-12)
    assert model_flops(spec, B * s, s, recompute=True) == pytest.approx(
        96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h)), rel=1e-12)


@pytest.mark.parametrize("name", ["llama-2-7b", "llama-2-13b", "llama-2-70b"])
def test_llama_flops_are_six_n_tokens_plus_attention(name):
    """6 N D (Kaplan et al. 2020) with N the GEMM weights (attention projections with grouped
    key/value heads, the three SwiGLU matrices, the LM head), plus the attention matmuls'
    3 x 2 x 2 x s x (heads x head_dim) FLOPs per token and layer (the s/6h term above)."""
    c = _config(name)
    h, i, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    q = h
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    n = L * (h * q + 2 * h * kv + q * h + 3 * h * i) + V * h
    B, s = 8, 4096
    ref = 6 * n * B * s + 12 * L * B * s * s * q
    assert model_flops(spec_of(c), B * s, s) == pytest.approx(ref, rel=1e-12)


# -------------------------------------------------------------------------------- the plans
def test_plan_fits_and_reports_consistently():
    plan = plan_training(CONFIGS / "gpt2-xl.json", "spinn/board", global_batch=64, seq=512)
    m, split = plan.memory, plan.split
    assert m.fits and m.total <= 2 * GIB and split.chips <= 48
    assert plan.tokens_per_s == pytest.approx(64 * 512 / plan.time_per_step_s)
    assert 0 < plan.efficiency <= 1 and 0 < plan.utilisation <= 1
    # the chosen split is the fastest: any split given by hand is no faster
    for tp, pp, dp in ((1, 12, 4), (5, 8, 1), (1, 48, 1), (5, 4, 2)):
        given = plan_training(CONFIGS / "gpt2-xl.json", "spinn/board", global_batch=64, seq=512, tp=tp, pp=pp, dp=dp)
        assert (given.split.tp, given.split.pp, given.split.dp) == (tp, pp, dp)
        assert given.time_per_step_s >= plan.time_per_step_s * (1 - 1e-12)
        assert given.bound_s == plan.bound_s  # the physical bound does not depend on the plan
    again = plan_training(CONFIGS / "gpt2-xl.json", "spinn/board", global_batch=64, seq=512)
    assert again.to_dict() == plan.to_dict()


def test_any_transformers_config():
    """A transformers config object plans like its dict (here a small Llama with grouped heads)."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=8000,
                                   max_position_embeddings=512)
    plan = plan_training(cfg, "spinn/board", seq=256, global_batch=32)
    assert plan.params == _count(cfg) and plan.memory.fits
    assert plan.to_dict()["split"] == plan_training(cfg.to_dict(), "spinn/board", seq=256,
                                                    global_batch=32).to_dict()["split"]


def _count(cfg) -> int:
    import torch
    import transformers

    with torch.device("meta"):
        return sum(p.numel() for p in transformers.LlamaForCausalLM(cfg).parameters())


def test_reproducible_reductions_cost_no_less():
    """The fastest mode may take Megatron's reduce-scatters; the reproducible one runs the
    layers' TP reductions in the canonical order (25 leaves over tp = 5: each rank adds its 5
    leaves to the running sum one by one, a direct reduce-scatter sends a piece a leaf): its
    slots' compute and collectives take longer."""
    kw = dict(global_batch=64, seq=512, tp=5, pp=8, dp=1, zero=0, recompute=True)
    exact = plan_training(CONFIGS / "gpt2-xl.json", "spinn/board", **kw)
    fast = plan_training(CONFIGS / "gpt2-xl.json", "spinn/board", reproducible=False, **kw)
    assert fast.time_per_step_s <= exact.time_per_step_s
    assert fast.step.compute_s + fast.step.tp_comm_s < exact.step.compute_s + exact.step.tp_comm_s


def test_search_finds_what_costing_every_split_finds():
    """The branch and bound returns the split that costing every fitting split in full (a chunked
    split charged its chunk order) finds."""
    import itertools

    from tvm_spinn.training.planner import LAYOUTS, _Comms, _chunk_counts, _compute_floor, _head_options, _step_time
    from tvm_spinn.training.planner.timeline import charge_chunk_order

    cfg = {**_config("gpt2-xl"), "n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 1000, "n_positions": 128}
    system, seq, batch = make_system("twelve", chips=12), 64, 8
    plan = plan_training(cfg, system, seq=seq, global_batch=batch, recompute=False)
    spec, comms, alone = spec_of(cfg), _Comms(system, True), _Comms(system, True, alone=True)
    divisors = lambda n: [d for d in range(1, n + 1) if n % d == 0]  # noqa: E731
    best = math.inf
    for tp, pp, dp in itertools.product((1, 2, 4), divisors(4), divisors(batch)):
        if tp * pp * dp > 12:
            continue
        for mb, zero, chunks, layout, (head, spread, lag), zb in itertools.product(
                divisors(batch // dp), (0, 1, 2), _chunk_counts(seq), LAYOUTS, _head_options(spec, tp, pp, dp, 12),
                (False, True)):
            if zb and (pp + (head > 0) < 2 or batch // dp // mb * chunks < 2):
                continue  # nothing to defer the weight gradients into: one stage, or one slot
            split = Split(tp, pp, dp, zero, mb, batch // dp // mb, False, True, chunks, layout, head, spread, lag, zb)
            if split.chips <= 12 and memory_per_chip(spec, split, seq, "adamw", system.dram_bytes).fits:
                step = _step_time(spec, split, seq, "adamw", system, comms)
                full = step.total_s
                # the search's two lower bounds (the compute floor that orders the splits, the
                # step with every collective costed for its first groups alone) hold for every split
                floor = _compute_floor(spec, split, seq, system, comms)
                bound = _step_time(spec, split, seq, "adamw", system, alone).total_s
                assert floor <= bound * (1 + 1e-12) and bound <= full * (1 + 1e-12), split
                # the search charges a chunked split its chunk order (never below the term)
                best = min(best, charge_chunk_order(split, step).total_s)
    assert plan.time_per_step_s == pytest.approx(best, rel=1e-12)
    costed = [t for _, _, t in plan.search if t is not None]
    assert len(costed) == plan.candidates and min(costed) == plan.time_per_step_s
    # every pruned bound is a lower bound no smaller than the chosen step
    assert all(b >= plan.time_per_step_s * (1 - 1e-12) for _, b, t in plan.search if t is None)


def test_concurrent_groups_share_the_board_edges():
    """Groups that cross the same board edge at once cost more than one alone, and the first
    few groups' cost (the search's pruning bound) lies between."""
    from tvm_spinn.training.planner import _Comms

    system = make_system("two", boards=2)
    groups = np.array([[i, 48 + i] for i in range(16)])
    for reproducible in (True, False):
        together, few = _Comms(system, reproducible), _Comms(system, reproducible, alone=True)
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            one = together.collective(op, groups[:1], 2**22)
            bound, full = few.collective(op, groups, 2**22), together.collective(op, groups, 2**22)
            assert one <= bound * (1 + 1e-12) and bound <= full * (1 + 1e-12), (op, reproducible)
            assert full > 2 * one, (op, reproducible)


def test_model_too_large_names_the_smallest_system():
    with pytest.raises(TrainingPlanError, match="does not fit spinn/board") as err:
        plan_training(CONFIGS / "llama-2-7b.json", "spinn/board", seq=1024, global_batch=64)
    boards = err.value.smallest_boards
    assert boards > 1 and f"make_system(boards={boards})" in str(err.value)
    # the smallest indeed: it fits there and not on one board less
    plan = plan_training(CONFIGS / "llama-2-7b.json", make_system("s", boards=boards), seq=1024, global_batch=64)
    assert plan.memory.fits and plan.split.chips > (boards - 1) * 48
    with pytest.raises(TrainingPlanError, match="does not fit"):
        plan_training(CONFIGS / "llama-2-7b.json", make_system("t", boards=boards - 1), seq=1024, global_batch=64)


@pytest.mark.slow  # ~28 s of CPU (more wall time on a loaded machine): its collectives are costed on the cloud's links
def test_seventy_b_on_the_cloud():
    start, cpu = time.perf_counter(), time.process_time()
    plan = plan_training(CONFIGS / "llama-2-70b.json", "spinn/cloud")
    cpu = time.process_time() - cpu
    print(f"\nLlama-2-70B on spinn/cloud planned in {cpu:.1f} CPU s ({time.perf_counter() - start:.1f} s wall)"
          f"\n{plan.table()}")
    assert cpu < 60  # the target: planning Llama-2-70B training on the cloud in under a minute
    assert plan.memory.fits and plan.split.chips <= 720 * 48
    assert plan.memory.total == pytest.approx(plan.memory.weights + plan.memory.gradients + plan.memory.optimizer
                                              + plan.memory.activations)


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=3), r"tp=3 does not divide the attention heads \(25\).*one of \[1, 5, 25\]"),
    (dict(pp=5), r"pp=5 does not divide the layers \(48\).*one of \[1, 2, 3, 4, 6, 8, 12, 16, 24, 48\]"),
    (dict(dp=3), r"dp=3 does not divide the global batch \(512 sequences\).*one of \[1, 2, 4, 8"),
    (dict(micro_batch=3), r"micro_batch=3 does not divide the global batch \(512 sequences\)"),
    (dict(dp=4, micro_batch=256), r"micro_batch=256 does not divide the batch per replica \(512 / dp 4 = 128"),
    (dict(zero=3), r"zero must be 0, 1 or 2"),
    (dict(optimizer="lamb"), r"optimizer must be one of"),
    (dict(seq=4096), r"seq=4096 is more than the model's 1024 positions"),
    (dict(global_batch=0), r"global_batch must be a positive integer"),
    (dict(min_chunk_tokens=0), r"min_chunk_tokens must be a positive integer, got 0"),
    (dict(tp=25, pp=48, dp=512), r"more than the 48"),
    (dict(tp=1, pp=1, dp=1), r"does not fit spinn/board .* no split with tp=1, pp=1, dp=1 keeps a chip"),
])
def test_bad_arguments_name_the_axis(kwargs, message):
    with pytest.raises(TrainingPlanError, match=message):
        plan_training(CONFIGS / "gpt2-xl.json", "spinn/board", **kwargs)


def test_grouped_query_heads_replicate_past_their_count():
    """Llama-2-70B has 8 key/value heads for 64 query heads: TP 16 keeps one key/value head on
    each rank (Megatron replicates them), so its K and V projections do not shrink past TP 8."""
    spec = spec_of(_config("llama-2-70b"))
    h, d, i = spec.hidden, spec.head_dim, spec.intermediate
    for tp in (8, 16, 64):
        kv = max(1, 8 // tp) * d
        ref = h * (h // tp + 2 * kv) + h // tp * h + 3 * h * i // tp + 2 * h
        mem = memory_per_chip(spec, Split(tp, 80, 1, 0, 1, 1, False), 64, "sgd", 2**60)
        # the last stage: one block, the final norm and the LM head's vocab shard
        assert mem.stage == 79 and mem.weights == 4 * (ref + h + math.ceil(spec.vocab / tp) * h)
    with pytest.raises(TrainingPlanError, match=r"tp=12 does not divide .* key/value heads \(8\)"):
        plan_training(_config("llama-2-70b"), "spinn/cloud", tp=12)


@pytest.mark.parametrize("change, field", [
    ({"model_type": "mixtral"}, "model_type"),
    ({"n_head": 0}, "n_head"),
    ({"n_layer": "48"}, "n_layer"),
])
def test_bad_config_names_the_field(change, field):
    with pytest.raises(LLMError, match=f"'{field}'"):
        plan_training({**_config("gpt2-xl"), **change}, "spinn/board")


# ---------------------------------------------------------------------------- the command line
def test_cli_plan_train_writes_json_and_refuses_bad_splits(tmp_path, capsys):
    from tvm_spinn.cli import main

    out = tmp_path / "plan.json"
    args = ["plan", "--train", str(CONFIGS / "gpt2-xl.json"), "--target", "spinn/board", "--batch", "64",
            "--seq", "512", "--no-progress"]
    assert main(args + ["--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "memory per chip" in text and "efficiency" in text
    data = json.loads(out.read_text())
    ref = plan_training(CONFIGS / "gpt2-xl.json", "spinn/board", global_batch=64, seq=512)
    assert data == json.loads(json.dumps(ref.to_dict()))
    bad = tmp_path / "bad.json"
    assert main(args + ["--tp", "2", "--json", str(bad)]) == 2
    assert "tp=2 does not divide" in capsys.readouterr().err and not bad.exists()
    assert main(["plan", str(CONFIGS / "gpt2-xl.json"), "--zero", "1"]) == 2
    assert "--zero applies to training plans" in capsys.readouterr().err
    assert main(["plan", "--train", str(CONFIGS / "gpt2-xl.json"), "--dtype", "int8"]) == 2
    assert "--dtype applies to inference plans" in capsys.readouterr().err


# ------------------------------------------------------------------- against an actual build
@pytest.mark.slow
def test_plan_matches_the_buffers_a_build_allocates():
    """A tiny GPT-2 language model (transformers, random weights, untied head) compiled by
    ``tvm_spinn.training.compile`` with AdamW: the planner's weights, gradients and optimizer
    state for one chip (TP = PP = DP = 1) equal the bytes of the trainer's parameter buffers,
    the gradients the step's backward function returns and the optimizer-state buffers (TVM's
    Adam adds three scalars: the step count and the two betas' powers)."""
    from models import tiny_gpt2_lm
    from tvm import relax

    import tvm_spinn

    cfg, lm, ids = tiny_gpt2_lm(n_layer=2)
    trainer = tvm_spinn.training.compile(lm, (ids,), optimizer=("adam", {"lr": 1e-3, "weight_decay": 0.01}),
                                         target="llvm")
    param_bytes = sum(p.numpy().nbytes for p in trainer._params)
    state = [s.numpy() for s in trainer._state]
    scalars = [s for s in state if s.ndim == 0]
    state_bytes = sum(s.nbytes for s in state if s.ndim > 0)

    def tensor_bytes(ty):
        if isinstance(ty, relax.TupleType):
            return sum(tensor_bytes(f) for f in ty.fields)
        return int(np.prod([int(d) for d in ty.shape])) * 4 if ty.shape is not None and len(ty.shape) else 0

    adjoint = trainer._graph.phases["backbone_loss_adjoint"].ret_ty
    grad_bytes = tensor_bytes(adjoint.fields[1])  # (loss, gradients)
    plan = plan_training(cfg, make_system("one", chips=1), seq=8, global_batch=2, micro_batch=2, tp=1, pp=1, dp=1,
                         zero=0, recompute=False)
    assert len(scalars) == 3
    assert plan.memory.weights == param_bytes
    assert plan.memory.gradients == grad_bytes == param_bytes
    assert plan.memory.optimizer == state_bytes == 2 * param_bytes


def test_resident_share_is_the_mapping_ledgers():
    """The planner keeps a stage's weights and gradients in SRAM within the share the mapping's
    memory plans leave to resident weights (a copy: the training layer may not import mapping)."""
    from tvm_spinn.mapping.memory import LEDGER_RESIDENT_SHARE
    from tvm_spinn.training.planner import RESIDENT_SHARE

    assert RESIDENT_SHARE == LEDGER_RESIDENT_SHARE


@pytest.mark.parametrize("layout", ["tp,pp,dp", "tp,dp,pp", "dp,tp,pp"])
def test_head_stage_chips_are_distinct_and_hold_the_head(layout):
    """A split with the LM head on a stage of its own numbers every chip once, and the head's
    ranks hold the vocab-parallel head (a tied table's only copy: the first stage holds none)."""
    from tvm_spinn.training.planner import _stage_params

    split = Split(2, 3, 2, 0, 1, 4, False, True, 1, layout, 4)
    ids = np.concatenate([split.grid().reshape(-1), split.head_grid().reshape(-1)])
    assert sorted(ids.tolist()) == list(range(split.chips)) and split.chips == (2 * 3 + 4) * 2
    spec = spec_of({**_config("gpt2-xl"), "n_layer": 6, "n_embd": 64, "n_head": 4, "vocab_size": 1000,
                    "n_positions": 64})
    h, v = spec.hidden, spec.vocab
    assert _stage_params(spec, 2, 3, 3, 4) == 2 * h + -(-v // 4) * h  # the final norm and a quarter of the head
    no_head = _stage_params(spec, 2, 3, 0, 0) - _stage_params(spec, 2, 3, 0, 4)
    assert no_head == -(-v // 2) * h  # the first stage's copy of the tied table is gone


@pytest.mark.parametrize("layout", ["tp,pp,dp", "tp,dp,pp", "dp,tp,pp"])
def test_a_spread_head_lies_on_the_block_stages_chips(layout):
    """A head spread over the block stages (Split.spread_head) uses no chip of its own: its ranks
    are each replica's block-stage chips in stage-major order; every stage holds a share of the
    head's rows (a tied table's only copy: the first stage holds no other), the last the final
    norm."""
    from tvm_spinn.training.planner import _stage_params, _vocab_rows

    split = Split(2, 3, 2, 0, 1, 4, False, True, 1, layout, 0, True, 2)
    ranks, grid = split.head_ranks(), split.grid()
    assert split.chips == 12 and split.head_width == 6 and ranks.shape == (2, 6)
    for d in range(2):
        assert [int(ranks[d, s * 2 + t]) for s in range(3) for t in range(2)] == [
            int(grid[t, s, d]) for s in range(3) for t in range(2)]
    assert sorted(ranks.reshape(-1).tolist()) == list(range(12))
    spec = spec_of({**_config("gpt2-xl"), "n_layer": 6, "n_embd": 64, "n_head": 4, "vocab_size": 1000,
                    "n_positions": 64})
    h, v = spec.hidden, spec.vocab
    rows = _vocab_rows(spec, 6)
    assert rows == 2 * 125  # 8 leaves of 125 rows over 6 ranks: the busiest holds two
    middle = _stage_params(spec, 2, 3, 1, 0, True) - _stage_params(spec, 2, 3, 1, 0, False)
    assert middle == rows * h
    # the first stage: the head's rows instead of a vocab-parallel copy of the tied table
    assert _stage_params(spec, 2, 3, 0, 0, True) - _stage_params(spec, 2, 3, 0, 0, False) == rows * h - (v // 2) * h
    # the last stage: its share of the head's rows in place of a vocab-parallel copy of the tied
    # table (the final norm stays on it either way)
    assert _stage_params(spec, 2, 3, 2, 0, True) - _stage_params(spec, 2, 3, 2, 0, False) == rows * h - (v // 2) * h


@pytest.mark.parametrize("width", [7, 12, 48, 100, 144, 300])
def test_a_spread_heads_rows_are_its_busiest_ranks_leaves(width):
    """Ranks hold whole consecutive leaves of the vocabulary (where the width does not divide
    them, some one more): the planner prices the busiest rank's rows as the compiled step's
    vocabulary shard assigns them (VocabShard.rank_leaf_ranges)."""
    from tvm_spinn.training.planner import _spec, _vocab_rows
    from tvm_spinn.training.tp_chain import vocab_leaves
    from tvm_spinn.training.vocab_parallel import VocabShard

    spec = _spec({**_config("gpt2-xl"), "n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": 3072,
                  "vocab_size": 50257})
    leaves = vocab_leaves(12, 3072, 50257)
    shard = VocabShard("lm_head.weight", "column", 0, 50257, leaves=leaves)
    busiest = max(sum(b - a for ((a, b),) in shard.rank_leaf_ranges(r, width)) for r in range(width))
    assert _vocab_rows(spec, width) == busiest


def test_a_spread_head_on_a_board():
    """GPT-2 small on one board, pipelined over 4 stages: spreading the head over the pipeline's
    chips (its GEMMs a share of every chip's work, its collectives on the board's links) beats
    the same split with the head on the last block stage, and every stage's compute carries the
    head's share."""
    import dataclasses

    from tvm_spinn.timing.gemm import gemm_seconds
    from tvm_spinn.training.planner import _Comms, _step_time, _vocab_rows

    system = make_system("one-board", boards=1)
    cfg = {**_config("gpt2-xl"), "n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": None, "vocab_size": 50257,
           "n_positions": 1024}
    spec, comms = spec_of(cfg), _Comms(system, True)
    split = Split(12, 4, 1, 0, 1, 8, False, True, 16, "tp,pp,dp", 0, True, 2)
    spread = _step_time(spec, split, 256, "adamw", system, comms)
    on_last = _step_time(spec, dataclasses.replace(split, spread_head=False, head_lag=0), 256, "adamw", system, comms)
    assert spread.total_s < on_last.total_s
    # the first stage computes its layers and a share of the head: its three GEMMs for the
    # slot's tokens and the rank's vocabulary rows (at least: its leaves' additions come on top)
    tokens, rows = 256 // split.chunks, _vocab_rows(spec, split.tp * split.pp)
    share = (gemm_seconds(system, tokens, spec.hidden, rows) + gemm_seconds(system, tokens, rows, spec.hidden)
             + gemm_seconds(system, spec.hidden, tokens, rows))
    first = {j: c for j, c, *_ in spread.stages_s}[0] - {j: c for j, c, *_ in on_last.stages_s}[0]
    assert first >= share * (1 - 1e-9)


def test_resident_weights_gemm_price_is_the_compiled_gemms_time(monkeypatch):
    """A stage whose weights stay in SRAM prices its GEMMs at the tile the mapper chooses for
    resident weights (no DRAM traffic charged for them): for a pipeline slot's 8 rows through a
    TP-12 shard of GPT-2 small's QKV projection, register-block row tiles over every column
    (one round of ``4 x 4`` blocks), the compiled layer's time with that tile (at most 5% above), and
    faster than the streamed weights' tile (which trades compute for fewer weight fetches)."""
    import tvm
    from tvm import relax

    from tvm_spinn.program.ops.gemm import GemmShape, choose_matmul_tile
    from tvm_spinn.program.ops.gemm import family as gemm_family
    from tvm_spinn.report import report
    from tvm_spinn.target.registry import arch_of
    from tvm_spinn.timing.gemm import gemm_seconds
    from tvm_spinn.training.parallel import _replica_target

    m, k, n = 8, 768, 192
    with _replica_target(tvm.target.Target("spinn/board")) as (chip, _):
        arch = arch_of(chip)
        tile = choose_matmul_tile(GemmShape(1, m, n, k), arch, arch.pes_per_chip, resident=True)
        assert tile[0] == 4 and tile[1] % 4 == 0  # whole 4 x 4 register blocks
        assert tile != choose_matmul_tile(GemmShape(1, m, n, k), arch, arch.pes_per_chip)
        monkeypatch.setattr(gemm_family, "choose_gemm_tile", lambda *args, **kwargs: tile)
        bb = relax.BlockBuilder()
        a = relax.Var("a", relax.TensorType((1, m, k), "float32"))
        b = relax.Var("b", relax.TensorType((1, k, n), "float32"))
        with bb.function("main", [a, b]):
            with bb.dataflow():
                out = bb.emit_output(bb.emit(relax.op.matmul(a, b)))
            bb.emit_func_output(out)
        compiled = sum(p.timing.latency_s for p in report(relax.build(bb.get(), target=chip)).programs)
        priced = gemm_seconds(arch, m, k, n, resident=True)
        # at most 5% above it: the price charges the tile's whole operands before it computes,
        # the compiled layer loads the later reduction chunks behind the first one's compute
        assert compiled <= priced <= 1.05 * compiled
        assert priced < 0.9 * gemm_seconds(arch, m, k, n)


def test_a_resident_stage_prices_its_gemms_with_the_resident_tiles():
    """GPT-2 small's 24-board split of one layer a stage: every block stage's weights fit the
    resident SRAM share, so its compute is the layers' GEMMs with the weights at the resident
    tiles (plus the canonical order's leaf additions), not streamed; a steady slot's passes
    share the PEs (less what that gives back at the resident tiles)."""
    from tvm_spinn.training.planner import _Comms, _pass_seconds, _shared_pes_saving, _step_time
    from tvm_spinn.training.planner.model import _block_gemms

    system = make_system("g24", boards=24)
    cfg = {**_config("gpt2-xl"), "n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": None, "vocab_size": 50257,
           "n_positions": 1024}
    spec, comms = spec_of(cfg), _Comms(system, True)
    split = Split(12, 12, 4, 0, 1, 2, False, True, 32, "dp,tp,pp", 96, False, 4, True)
    step = _step_time(spec, split, 256, "adamw", system, comms)
    weights, attention = _block_gemms(spec, 8, 256, 12, 1, 32)
    # a chunked slot's attention reads the earlier chunks' keys and values from the stash
    resident = sum(_pass_seconds(system, weights, comms, True, attention))
    streamed = sum(_pass_seconds(system, weights, comms, False, attention))
    middle = {j: c for j, c, *_ in step.stages_s}[split.pp - 1]
    shared = _shared_pes_saving(system, weights, comms, True, attention, False, False, 1)
    assert 0 < shared < 0.5 * resident
    assert resident < 0.9 * streamed
    assert resident - shared <= middle < streamed


def test_a_large_vocabulary_gets_a_head_stage():
    """GPT-2 small's proportions (the head ~5 blocks' GEMMs): the plan gives the head a stage of
    its own, faster than the same split with the head on the last block stage."""
    import dataclasses

    from tvm_spinn.training.planner import _Comms, _step_time

    cfg = {**_config("gpt2-xl"), "n_layer": 6, "n_embd": 64, "n_head": 4, "vocab_size": 20000, "n_positions": 64}
    system = make_system("forty-eight", chips=48)
    plan = plan_training(cfg, system, seq=64, global_batch=8, recompute=False)
    assert plan.split.head_tp > 0, plan.split.line()
    on_last = dataclasses.replace(plan.split, head_tp=0, head_lag=0)
    alone = _step_time(spec_of(cfg), on_last, 64, "adamw", system, _Comms(system, True))
    assert plan.time_per_step_s < alone.total_s
    assert plan.step.stages_s[-1][0] == plan.split.pp  # the head's stage is costed


@pytest.mark.parametrize("lag", [2, 4, 8])
def test_a_head_stage_behind_the_blocks_waits_for_no_collective(lag):
    """A head stage ``lag`` slots behind the last block stage (Split.head_lag): its slot is at least
    its compute and its path (its passes plus the collectives they wait for) over the lag, and at
    most the same head stage's slot with no lag; the fill and drain cross the whole path once, and the block stages hold
    ``lag`` more slots."""
    import dataclasses

    from tvm_spinn.training.planner import _Comms, _inflight, _step_time

    cfg = {**_config("gpt2-xl"), "n_layer": 6, "n_embd": 64, "n_head": 4, "vocab_size": 20000, "n_positions": 64}
    system = make_system("forty-eight", chips=48)
    spec, comms = spec_of(cfg), _Comms(system, True)
    split = Split(4, 2, 2, 0, 1, 4, False, True, 16, "tp,dp,pp", 8)
    behind = dataclasses.replace(split, head_lag=lag)
    steps = {s: _step_time(spec, s, 64, "adamw", system, comms) for s in (split, behind)}
    (_, comp, coll, _, slot0), (_, comp_l, coll_l, _, slot) = (steps[s].stages_s[-1] for s in (split, behind))
    assert (comp, coll) == (comp_l, coll_l)  # the same passes and collectives
    assert max(comp, (comp + coll) / lag) * (1 - 1e-12) <= slot <= slot0 * (1 + 1e-12)
    assert _inflight(behind, 0) == min(split.stages + lag, split.slots) and _inflight(split, 0) == split.stages


def test_min_chunk_tokens_bounds_the_chunks_searched():
    """``min_chunk_tokens`` only narrows the search: every split costed keeps at least that many
    tokens a chunk, and the default (every power-of-two cut) finds a step no slower. The model
    (short per-chunk compute beside a long pipeline) is one whose fastest plan cuts its
    sequences below 64 tokens a chunk, so the bound changes the plan."""
    cfg = {**_config("gpt2-xl"), "n_layer": 16, "n_embd": 128, "n_head": 4, "vocab_size": 512, "n_positions": 128}
    system, seq = make_system("thirty-two", chips=32), 128
    plans = {k: plan_training(cfg, system, seq=seq, global_batch=2, recompute=False, min_chunk_tokens=k)
             for k in (1, 64, seq)}
    for k, plan in plans.items():
        assert all(seq // split.chunks >= k for split, _, _ in plan.search), k
    assert plans[seq].split.chunks == 1
    assert plans[1].time_per_step_s <= plans[64].time_per_step_s <= plans[seq].time_per_step_s
    assert seq // plans[1].split.chunks < 64, plans[1].split.line()
    assert plans[1].time_per_step_s < plans[64].time_per_step_s


def test_a_pipelined_chain_approaches_its_busiest_link():
    """The reproducible chain of a large message costs what its busiest link needs to carry it
    (every segment crosses every hop once; the fill and the segments' DMAs are a small part),
    and never less: it is pipelined, not charged its slowest hop on every step. A chain that
    crosses to another board may split that hop over the boards' edge-disjoint paths: cheaper
    than its chip route, never cheaper than the bytes leaving the board by all its edges."""
    from tvm_spinn.target.topology import edge_rate, topology_of
    from tvm_spinn.training.planner import _Comms

    system = make_system("two", boards=2)
    topo = topology_of(system)
    n = float(2**24)
    for op in ("reduce_scatter", "all_reduce"):
        for ranks in (np.arange(0, 48, 4), np.arange(0, 96, 2)):  # on one board; across two
            src, dst = ranks[:-1], ranks[1:]
            if op == "all_reduce":  # the finished segments flow back at once
                src, dst = np.concatenate([src, ranks[1:]]), np.concatenate([dst, ranks[:-1]])
            chip = topo.evaluate(src, dst, n)[0].bandwidth_s  # every hop on its chip route
            cost = _Comms(system, True).collective(op, ranks[None, :], n)
            if ranks.max() < 48:
                assert chip <= cost <= 1.1 * chip, (op, cost / chip)
            else:
                assert n / edge_rate(topo)[:6].sum() <= cost < 0.75 * chip, (op, cost / chip)


def test_a_slots_collectives_overlap_the_other_passes_compute():
    """With several slots in flight (1F1B pairs one slot's forward with another's backward) a
    stage's slot takes its PEs' time and its hand-overs' at least, and less than its
    collectives and its compute one after the other; a single slot overlaps only its
    backward's collectives, under the weight-gradient GEMMs (half the backward's compute, a
    third of the slot's), so it takes its compute and its collectives less that third."""
    cfg = {**_config("gpt2-xl"), "n_layer": 4, "n_embd": 256, "n_head": 8, "vocab_size": 1000, "n_positions": 256}
    system = make_system("twelve", chips=12)
    kw = dict(seq=256, global_batch=4, tp=4, dp=1, zero=0, recompute=False)
    many = plan_training(cfg, system, micro_batch=1, pp=2, **kw)
    one = plan_training(cfg, system, micro_batch=4, pp=1, **kw)  # one slot: no chunks without a pipeline
    for plan, overlap in ((many, True), (one, False)):
        split = plan.split
        per = (plan.step.pipeline_s - plan.step.bubble_s) / split.slots  # the slowest stage's slot
        floor = max(max(c, h) for _, c, t, h, _ in plan.step.stages_s)
        serial = max(t + max(c, h) for _, c, t, h, _ in plan.step.stages_s)
        assert floor <= per * (1 + 1e-12) and per < serial * (1 - 1e-3), (split.line(), per, serial)
        # the stages' slots as reported: the slowest is the pace the pipeline's slots take
        assert max(slot for *_, slot in plan.step.stages_s) == pytest.approx(per, rel=1e-12)
        if not overlap:
            assert per >= max(c + t - min(t, c / 3) for _, c, t, _, _ in plan.step.stages_s) * (1 - 1e-12)


def test_board_edge_hand_overs_and_on_board_collectives_load_different_links():
    """TP groups on one board and a stage boundary between boards: the hand-overs' time is the
    board edge's, the collectives' the on-board links', so a slot takes less than the two one
    after the other (the summed cost charged where they share links) but no less than either."""
    from tvm_spinn.training.planner import _Comms, _slot_seconds

    system = make_system("two-boards", boards=2)
    comms = _Comms(system, True)
    tp_groups = np.arange(96).reshape(8, 12)  # 12 consecutive chips a group: one board each
    assert comms.on_boards(tp_groups) and not comms.on_boards(np.arange(40, 64).reshape(1, 24))
    src, dst = np.arange(48), np.arange(48, 96)  # stage 0 on board 0 hands over to stage 1 on board 1
    n = float(2**16)
    hand = comms.handover(np.concatenate([src, dst]), np.concatenate([dst, src]), n)
    legs = comms.onboard(np.concatenate([src, dst]), np.concatenate([dst, src]), n)
    ag, ag_busy = comms.collective_parts("all_gather", tp_groups, 12 * n)
    assert 0 < legs < hand and 0 < ag_busy < ag
    f_s, b_s = 1e-4, 2e-4
    joint = _slot_seconds(f_s, b_s, ag, ag, hand, True, pp_shared=legs, tp_busy=2 * ag_busy)
    summed = _slot_seconds(f_s, b_s, ag, ag, hand, True)
    assert summed == pytest.approx(2 * ag + hand)
    assert max(hand, 2 * ag_busy + legs, f_s + b_s) <= joint < summed


def test_a_board_to_board_hand_over_spreads_over_the_board_paths():
    """A stage on one board handing over to a stage on another uses the boards' edge-disjoint
    paths: cheaper than every chip's own route, and no cheaper than the bytes leaving the
    sending board through all its edges at once."""
    from tvm_spinn.target.topology import edge_rate, topology_of
    from tvm_spinn.timing.collectives import point_to_point
    from tvm_spinn.training.planner import _Comms

    system = make_system("four", boards=4)
    topo = topology_of(system)
    src, dst, n = np.arange(48), np.arange(48, 96), float(2**16)
    cost = _Comms(system, True).handover(src, dst, n)
    direct = point_to_point(topo, src, dst, n).seconds
    floor = 48 * n / edge_rate(topo)[:6].sum()
    assert floor <= cost < 0.75 * direct, (floor, cost, direct)
    # a hand-over that stays on its board takes the chip routes
    assert _Comms(system, True).handover(src[:24], src[24:], n) == point_to_point(topo, src[:24], src[24:], n).seconds


def test_the_loss_sum_is_priced_as_the_chain_it_runs():
    """The loss' sum of exponentials runs one class after another over the ranks (no rank holds a
    partial sum to send directly): in the reproducible mode it is priced as the chain alone,
    which a small group's direct reduce-scatter would undercut; the fastest mode keeps every
    algorithm."""
    from tvm_spinn.training.planner import _Comms

    system = make_system("two", boards=2)
    group, n = np.array([[0, 1]]), 4.0 * 3 * 256  # two ranks: the direct exchange is one hop, the chain two
    exact = _Comms(system, True)
    chained = exact.collective_parts("all_reduce", group, n, chain=True)
    assert chained == exact._at("all_reduce", group, "chain", n)
    free = exact.collective_parts("all_reduce", group, n)
    assert free == min(exact._at("all_reduce", group, a, n) for a in ("chain", "direct"))
    assert free[0] < chained[0]  # the direct form is cheaper here, and not the order the loss takes
    fast = _Comms(system, False)
    assert fast.collective_parts("all_reduce", group, n, chain=True) == fast.collective_parts("all_reduce", group, n)


def test_gemm_seconds_is_the_compiled_gemms_time():
    """The planner's GEMM price (``gemm_seconds``) against the timing model's latency of the
    compiled one-GEMM program on one chip, for compute-bound shapes the planner prices: a slot's
    few token rows (2, 16), a weight gradient reducing over 16 tokens, attention's batched
    matmuls and a large GEMM (all compute-bound on the chip). Within 1.5% (the compiled layer overlaps its DMAs per tile; the
    price charges the first tile's loads and the last one's write-back: about 1.3 us more on the
    batched attention shapes, whose compute is about 120 us), and never below the
    FLOPs at the chip's fp32 peak (which a 2-row GEMM exceeds 2.5-fold: it computes its outputs
    one at a time)."""
    import tvm
    from tvm import relax

    from tvm_spinn.report import report
    from tvm_spinn.target.registry import arch_of
    from tvm_spinn.timing.gemm import gemm_seconds
    from tvm_spinn.training.parallel import _replica_target

    with _replica_target(tvm.target.Target("spinn/board")) as (chip, _):
        arch = arch_of(chip)
        peak = 2.0 * arch.m4f_flops_per_cycle * arch.clock_hz * arch.pes_per_chip
        for m, k, n, batch in ((2, 768, 2304, 1), (16, 768, 768, 1), (768, 16, 3072, 1), (256, 768, 3072, 1),
                               (8, 64, 256, 12), (8, 256, 64, 12), (8, 768, 192, 1)):
            bb = relax.BlockBuilder()
            a = relax.Var("a", relax.TensorType((batch, m, k), "float32"))
            b = relax.Var("b", relax.TensorType((batch, k, n), "float32"))
            with bb.function("main", [a, b]):
                with bb.dataflow():
                    out = bb.emit_output(bb.emit(relax.op.matmul(a, b)))
                bb.emit_func_output(out)
            programs = report(relax.build(bb.get(), target=chip)).programs
            compiled = sum(p.timing.latency_s for p in programs)
            priced = gemm_seconds(arch, m, k, n, batch)
            assert priced == pytest.approx(compiled, rel=0.015), (m, k, n, batch)
            assert priced >= 2 * batch * m * k * n / peak
    assert gemm_seconds(arch, 2, 768, 2304) > 2.5 * 2 * 2 * 768 * 2304 / peak  # a 2-row GEMM: outputs one at a time
    with pytest.raises(ValueError, match="empty axis"):
        gemm_seconds(arch, 0, 768, 2304)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_first_stage_reads_its_tokens_embedding_rows_from_dram(family):
    """A pipelined model's first stage reads, in the forward, the embedding rows of the slot's
    tokens (GPT-2: its token and position rows; Llama: its token rows) and, in the backward,
    reads and writes their gradients: on a chip whose DRAM is so slow that it paces every pass,
    the first stage's slot is its activations written and read back and three times those
    rows' bytes, worked out by hand."""
    import dataclasses

    from tvm_spinn.training.planner import _Comms, _inflight, _stage_activations, _step_time

    if family == "gpt2":
        cfg = {**_config("gpt2-xl"), "n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "n_positions": 64}
    else:
        cfg = {**_config("llama-2-7b"), "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
               "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000,
               "max_position_embeddings": 64}
    system = dataclasses.replace(make_system("two", chips=2), dram_bw_bytes_s=1.0)  # a byte a second
    spec, comms = spec_of(cfg), _Comms(system, True)
    split = Split(1, 2, 1, 0, 1, 4, False, True, 1)
    seq, tokens = 16, 16  # one sequence a slot
    rows = 4 * tokens * 64 * (2 if family == "gpt2" else 1)  # fp32 rows of the slot's tokens
    assert rows == (8192 if family == "gpt2" else 4096)
    comp = {j: c for j, c, *_ in _step_time(spec, split, seq, "adamw", system, comms).stages_s}
    # the weights fit the resident SRAM (streamed once a step, with the update): a pass moves
    # its activations and the embedding rows only
    stored = {j: _stage_activations(spec, split, seq, j, False) // _inflight(split, j) for j in (0, 1)}
    assert comp[0] == pytest.approx(2 * stored[0] + 3 * rows, rel=1e-12)
    assert comp[1] == pytest.approx(2 * stored[1], rel=1e-12)  # no gathered table on the last stage


def _tiny_gpt2(vocab: int = 1000) -> dict:
    return {**_config("gpt2-xl"), "n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": vocab, "n_positions": 64}


@pytest.mark.parametrize("lag", [0, 2, 3, 4, 8])
def test_a_head_stage_holds_the_slots_behind_it_up_to_the_slots(lag):
    """A head stage holds the hidden states and logits of the slot it computes and of the
    ``head_lag`` slots behind it, never more slots than the step has (as the block stages'
    count caps)."""
    from tvm_spinn.training.planner import _stage_activations

    spec, seq, slots = spec_of(_tiny_gpt2()), 16, 4
    split = Split(1, 2, 1, 0, 1, slots, False, True, 1, "tp,pp,dp", 2, False, lag)
    per_slot = 2 * 4 * seq * 64 + 4 * seq * 500  # norm input and output (fp32), half the logits
    held = {0: 1, 2: 3, 3: 4, 4: 4, 8: 4}[lag]
    assert _stage_activations(spec, split, seq, 2, False) == held * per_slot


@pytest.mark.parametrize("lag, slots", [(0, 4), (2, 4), (2, 8), (3, 4), (4, 4), (8, 4)])
def test_a_spread_head_holds_what_a_head_stage_holds(lag, slots):
    """A spread head's ranks each hold, beside their layers' activations, the hidden states and
    their share of the logits of as many slots as a head stage holds: the one the head computes
    and the ``head_lag`` behind it, up to the slots."""
    from tvm_spinn.training.planner import _layer_activations, _stage_activations, _vocab_rows

    spec, seq = spec_of(_tiny_gpt2()), 16
    split = Split(1, 2, 1, 0, 1, slots, False, True, 1, "tp,pp,dp", 0, True, lag)
    inflight = min(2 + lag, slots)  # 1F1B's two stages and the lag, up to the slots
    layers = 2 * inflight * _layer_activations(spec, 1, seq, seq, False)
    head = min(1 + lag, slots) * (2 * 4 * seq * 64 + 4 * seq * _vocab_rows(spec, 2))
    assert _stage_activations(spec, split, seq, 0, False) == layers + head


def test_the_search_keeps_the_head_lags_below_the_slots(monkeypatch):
    """The search prices a head that runs behind the last block stage only where the step has
    more slots than the lag (every split it weighs passes its memory test first)."""
    from tvm_spinn.training.planner import search

    weighed, peak = [], search._peak_bytes
    monkeypatch.setattr(search, "_peak_bytes", lambda spec, split, *a: weighed.append(split) or peak(spec, split, *a))
    plan = plan_training(_tiny_gpt2(20000), make_system("forty-eight", chips=48), seq=64, global_batch=8,
                         recompute=False)
    lagged = [s for s in weighed if s.head_lag]
    assert lagged and plan.split.head_lag < plan.split.slots
    assert all(s.head_lag < s.slots for s in lagged), min(lagged, key=lambda s: s.slots - s.head_lag).line()


@pytest.mark.parametrize("fields, field", [
    (dict(head_tp=2, spread_head=True), "spread_head"),
    (dict(head_tp=2, head_lag=-1), "head_lag"),
    (dict(head_lag=2), "head_lag"),
    (dict(pp=1, spread_head=True), "spread_head"),
    (dict(zero_bubble=1), "zero_bubble"),
    (dict(pp=1, zero_bubble=True), "zero_bubble"),
])
def test_a_split_names_the_field_it_cannot_take(fields, field):
    """A head's placement the planner cannot price is refused when the split is made, naming
    the field; the placements it prices are made."""
    import dataclasses

    base = dict(tp=1, pp=2, dp=1, zero=0, micro_batch=1, micro_batches=4, recompute=False)
    with pytest.raises(ValueError, match=f"Split: {field}="):
        Split(**{**base, **fields})
    for good in (dict(head_tp=2, head_lag=2), dict(spread_head=True, head_lag=2), dict(spread_head=True), {}):
        assert dataclasses.replace(Split(**base), **good).head_width in (1, 2)


def _gpt2_small_24_boards():
    """GPT-2 small's 24-board split of ``bench/training.py`` (TP 12 x PP 12 x DP 4, 8 chunks of 32
    tokens, a head stage of 96 chips) with its system and link costs."""
    from tvm_spinn.training.planner import _Comms

    spec = spec_of({**_config("gpt2-xl"), "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024})
    system = make_system("gpt2-small-24-boards", boards=24)
    split = Split(12, 12, 4, 0, 1, 2, False, True, 8, "dp,tp,pp", 96)
    return spec, system, _Comms(system, True), split


def test_zero_bubble_takes_the_weight_gradients_off_the_fill_and_drain():
    """ZB-H1 (Split.zero_bubble): the steady slots are 1F1B's; the fill and drain shrink, by at
    most twice each stage's weight-gradient GEMMs and at least once them less the backward's
    collectives that ran under them (each block stage's weight gradients computed here from
    the GEMM model, one layer a stage: its four projections' ``dW = A^T dY``)."""
    import dataclasses

    from tvm_spinn.timing.gemm import gemm_seconds
    from tvm_spinn.training.planner import _step_time

    spec, system, comms, split = _gpt2_small_24_boards()
    zb = dataclasses.replace(split, zero_bubble=True)
    one, zero = (_step_time(spec, s, 256, "adamw", system, comms) for s in (split, zb))
    assert one.stages_s == zero.stages_s  # the same slots
    tokens, h, tp = 32, 768, 12
    # qkv (h -> 3h / tp), the attention's output (h / tp -> h), the MLP's (h -> 4h / tp, 4h / tp -> h)
    shapes = [(tokens, h, 3 * h // tp), (tokens, h // tp, h), (tokens, h, 4 * h // tp), (tokens, 4 * h // tp, h)]
    w = sum(gemm_seconds(system, k, m, n, 1) for m, k, n in shapes)
    fills = 1 + (split.pp - 1)  # the first block stage and the last's, pp - 1 times (the head stage's GEMMs differ)
    saved = one.pipeline_s - zero.pipeline_s
    tp_b = max(t for _, _, t, _, _ in one.stages_s[:2])  # a block slot's collectives, an upper bound of the backward's
    assert saved > 0 and fills * (w - tp_b) <= saved * (1 + 1e-9)
    head_w = one.stages_s[-1][1]  # the head stage's whole compute bounds its weight gradients
    assert saved <= 2 * (fills * w + head_w) * (1 + 1e-9)
    assert zero.total_s < one.total_s
    assert zero.compute_s <= zero.pipeline_s  # its fill and drain's compute shrink with it


def test_zero_bubble_holds_its_deferred_passes_operands():
    """A ZB-H1 stage holds, for every slot held, its layers' GEMM inputs whole and their
    output gradients until the weight-gradient pass reads them: per token and layer the
    query/key/value, the MLP's hidden width and four hidden widths (here at TP 12: 64 + 2 x 64 +
    256 + 4 x 768 fp32 values). Slots held: stage 0 the 13 of 1F1B (12 block stages and the
    head's); the last block stage 2 under 1F1B, but a micro-batch's 8 chunks whole (its
    reverse-order backward starts once all 8 went forward, its ascending weight-gradient passes
    end with the first chunk's input-gradient pass)."""
    import dataclasses

    from tvm_spinn.training.planner import _stage_activations

    spec, _, _, split = _gpt2_small_24_boards()
    zb = dataclasses.replace(split, zero_bubble=True)
    for stage, slots in ((0, 13), (split.pp - 1, 8)):
        extra = _stage_activations(spec, zb, 256, stage, False) - _stage_activations(spec, split, 256, stage, False)
        assert extra == 1 * slots * 4 * 32 * (64 + 2 * 64 + 256 + 4 * 768)
    assert _stage_activations(spec, zb, 256, split.pp, False) == _stage_activations(spec, split, 256, split.pp, False)


def test_chunked_sequences_hold_a_micro_batch_whole():
    """With chunked sequences a block stage holds at least one micro-batch's chunks whole: its
    backward runs the chunks in reverse order, the last chunk's first, once all went forward.
    GPT-2 small's 24-board split's last block stage (1F1B: 2 slots in flight) holds its 8 chunks'
    activations, one layer each (here worked out per token at TP 12 with sequence parallelism:
    4 x 768 / 12 norm and GEMM inputs, 2 x 64 query and attention output, 2 x 64 keys and
    values, 2 x 256 MLP, 1 x 256 softmax scores), and two micro-batches' whole keys and values
    (2 x 256 tokens x 2 x 64); unchunked (one slot, 2 in flight) two slots' activations."""
    import dataclasses

    from tvm_spinn.training.planner import _stage_activations

    spec, _, _, split = _gpt2_small_24_boards()
    per_token = 4 * 768 // 12 + 2 * 64 + 2 * 64 + 2 * 256 + 256
    last = split.pp - 1
    kv = 2 * 256 * 2 * 64  # two micro-batches of one 256-token sequence
    assert _stage_activations(spec, split, 256, last, False) == 4 * (8 * 32 * per_token + kv)
    whole = dataclasses.replace(split, chunks=1, micro_batches=16)
    assert _stage_activations(spec, whole, 256, last, False) == 4 * 2 * 256 * per_token


def test_bucketed_gradient_reduction_overlaps_the_last_backward():
    """ZeRO-0 with more than one stage: the first stage's gradients are all-reduced in buckets as
    its last backward completes them and each bucket updated as its reduction ends, so the
    exposed synchronisation and update are at most the whole stage's all-reduce and update after
    the pipeline, and at least the last bucket's (layer 0's query/key/value projection with its
    norms and biases, final only when the pass ends): both computed here from the layer's sizes.
    The stage's projections fit its resident SRAM share, so the last bucket's update reads and
    writes only AdamW's two state vectors in DRAM (the weight and gradient stay in SRAM), and
    with ZB-H1 (qkv's bucket the last to be reduced) that update is all that is exposed: the
    earlier buckets' updates end under the later buckets' reductions, and the untouched position
    rows update in the pipeline's idle time."""
    import dataclasses

    from tvm_spinn.training.planner import _UPDATE_BYTES, _UPDATE_OPS, _step_time, _untouched_rows

    spec, system, comms, split = _gpt2_small_24_boards()

    def update(n, in_sram=False):
        nbytes = 4 * 2 * 2 * n if in_sram else _UPDATE_BYTES["adamw"] * n
        return max(nbytes / system.dram_bw_bytes_s,
                   _UPDATE_OPS["adamw"] * n * system.m4f_elementwise_cycles / (system.pes_per_chip * system.clock_hz))

    groups = split.grid().reshape(-1, split.dp)
    h, tp = 768, 12
    layer = h * 3 * h // tp + 3 * h // tp + h * h // tp + 2 * h * 4 * h // tp + 4 * h // tp + 6 * h
    positions = 1024 * h
    stage0 = layer + positions
    touched = stage0 - _untouched_rows(spec, 256, 0)
    last = h * 3 * h // tp + 3 * h // tp + 6 * h + 4 * h // tp  # qkv, with the layer's norms and biases
    whole = comms.collective("all_reduce", groups, 4 * touched) + update(stage0)
    least = comms.collective("all_reduce", groups, 4 * last) + update(last, in_sram=True)
    for zb in (False, True):
        step = _step_time(spec, dataclasses.replace(split, zero_bubble=zb), 256, "adamw", system, comms)
        exposed = step.dp_comm_s + step.optimizer_s
        assert least * (1 - 1e-9) <= exposed < whole, (zb, least, exposed, whole)
        if zb:  # the tables' rows are final before the deferred weight-gradient pass: qkv's bucket is last
            assert step.optimizer_s == pytest.approx(update(last, in_sram=True), rel=1e-9), step.optimizer_s


def test_fill_and_drain_cross_each_stage_with_its_collectives_in_series():
    """The pipeline's first slot reaches the last stage through every stage's forward and the
    collectives it waits for, and the last slot's input gradient returns through every stage's
    backward and its collectives: nothing else is there to compute under them. So beyond the
    steady slots (``slots - 1`` at the pacing stage's slot) each stage adds at least its slot's
    compute and collectives in series, less (ZB-H1) its deferred weight-gradient GEMMs and the
    collectives that ran under them: ``compute + TP - 2 W`` (1F1B: ``compute + TP - W``), with
    the weight gradients computed here from the GEMM model (a block stage's four projections'
    ``dW = A^T dY``, the head stage's vocabulary rows' ``dW``)."""
    import dataclasses

    from tvm_spinn.timing.gemm import gemm_seconds
    from tvm_spinn.training.planner import _step_time

    spec, system, comms, split = _gpt2_small_24_boards()
    tokens, h, tp = 32, 768, 12
    shapes = [(tokens, h, 3 * h // tp), (tokens, h // tp, h), (tokens, h, 4 * h // tp), (tokens, 4 * h // tp, h)]
    w_block = sum(gemm_seconds(system, k, m, n, 1) for m, k, n in shapes)
    w_head = gemm_seconds(system, h, tokens, -(-spec.vocab // split.head_tp), 1)
    own = [0] + [split.pp - 1] * (split.pp - 1) + [split.pp]  # each stage once (the middle ones: the last's)
    for zb in (False, True):
        step = _step_time(spec, dataclasses.replace(split, zero_bubble=zb), 256, "adamw", system, comms)
        stages = {j: (comp, tp_s, total) for j, comp, tp_s, _, total in step.stages_s}
        per = max(total for _, _, total in stages.values())
        fill = step.pipeline_s - (split.slots - 1) * per
        least = sum(stages[j][0] + stages[j][1] - (1 + zb) * (w_head if j == split.pp else w_block) for j in own)
        assert fill >= least * (1 - 1e-6), (zb, fill, least)


@pytest.mark.parametrize("chunks", [1, 2, 8, 64])
def test_a_chunk_attends_over_the_keys_up_to_its_last_token(chunks):
    """A sequence cut into chunks: chunk ``c`` attends over the keys of its sequence's tokens
    up to its own last one (the later keys do not exist yet when it passes), so a slot's two
    attention matmuls are priced at the chunks' mean prefix (enumerated here); a whole sequence
    over all ``seq`` keys (the causal mask on the full scores). The projections do not change."""
    from tvm_spinn.training.planner import _block_gemms

    spec = spec_of({**_config("gpt2-xl"), "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024})
    seq, sequences, tp = 256, 2, 12
    tokens = sequences * seq // chunks
    weights, attention = _block_gemms(spec, tokens, seq, tp, sequences, chunks)
    prefix = np.arange(1, chunks + 1) * (seq // chunks)  # each chunk's keys: up to its last token
    mean = seq if chunks == 1 else math.ceil(prefix.mean())
    rows, heads = seq // chunks, sequences * spec.heads // tp
    assert attention == [(rows, 64, mean, heads), (rows, mean, 64, heads)]
    assert weights == _block_gemms(spec, tokens, seq, tp, sequences)[0]
    assert mean <= seq and (chunks == 1 or mean < seq)


@pytest.mark.parametrize("chunks", [1, 4, 16])
def test_each_chunk_is_priced_at_its_own_prefix(chunks):
    """Chunk ``c`` of ``k`` attends over ``(c + 1) seq / k`` keys: the first chunk over its own
    tokens', the last over all ``seq`` (the full-context matmuls of a whole sequence); the step's
    executed attention FLOPs are those prefixes' sum (enumerated here), the full ``seq x seq``
    count with one chunk."""
    from tvm_spinn.training.planner import _block_gemms

    spec = spec_of({**_config("gpt2-xl"), "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024})
    seq, sequences, tp = 512, 2, 4
    tokens = sequences * seq // chunks
    rows, heads = seq // chunks, sequences * spec.heads // tp
    for c in range(chunks):
        keys = (c + 1) * seq // chunks
        assert _block_gemms(spec, tokens, seq, tp, sequences, chunks, c)[1] == [
            (rows, 64, keys, heads), (rows, keys, 64, heads)]
    # the last chunk's matmuls: a whole sequence's full context, on the chunk's rows
    whole_seq = _block_gemms(spec, sequences * seq, seq, tp, sequences)[1]
    assert [(rows,) + g[1:] for g in whole_seq] == _block_gemms(spec, tokens, seq, tp, sequences, chunks,
                                                                chunks - 1)[1]
    with pytest.raises(ValueError, match=f"chunk {chunks} of {chunks}"):
        _block_gemms(spec, tokens, seq, tp, sequences, chunks, chunks)
    # executed FLOPs: 3 passes of each layer's attention, 2 matmuls of 2 FLOPs a multiply-add,
    # every chunk of every sequence over its prefix
    step_tokens = 8 * seq
    attention = 3 * spec.layers * 2 * 2 * (step_tokens // seq) * spec.hidden * sum(
        (seq // chunks) * (c + 1) * seq // chunks for c in range(chunks))
    full = 3 * spec.layers * 2 * 2 * step_tokens * seq * spec.hidden
    whole = model_flops(spec, step_tokens, seq)
    assert model_flops(spec, step_tokens, seq, chunks=chunks) == whole - full + attention
    assert (chunks == 1) == (attention == full)


def test_the_fill_and_drain_cross_at_the_first_and_last_chunks_contexts():
    """A chunked pipeline's fill and drain are at least each stage's first slot's forward (the
    first chunk: its own keys only) and last slot's backward (the last chunk: all ``seq`` keys)
    in series, computed here from the GEMM model at those contexts; the steady slots' mean
    context would leave the drain's last backward short of its full-context attention."""
    from tvm_spinn.training.planner import _Comms, _pass_seconds, _step_time

    seq, chunks, tp, pp = 2048, 16, 1, 4
    spec = spec_of({**_config("gpt2-xl"), "n_layer": 8, "n_embd": 768, "n_head": 12, "n_positions": seq,
                    "vocab_size": 256})
    system = make_system("four", chips=pp)
    comms = _Comms(system, True)
    split = Split(tp, pp, 1, 0, 1, 2, False, True, chunks)
    step = _step_time(spec, split, seq, "adamw", system, comms)
    tokens, h, heads = seq // chunks, spec.hidden, spec.heads
    weights = [(tokens, h, 3 * h, 1), (tokens, h, h, 1), (tokens, h, 4 * h, 1), (tokens, 4 * h, h, 1)]

    def block(keys):
        return _pass_seconds(system, weights, comms, False, [(tokens, 64, keys, heads), (tokens, keys, 64, heads)])

    first, last = block(seq // chunks), block(seq)
    layers = spec.layers // pp
    crossing = layers * (first[0] + last[1] + last[2])  # a stage's first forward and last backward
    per = max(total for _, _, _, _, total in step.stages_s)
    fill = step.pipeline_s - (split.slots - 1) * per
    assert fill >= pp * crossing * (1 - 1e-9), (fill, pp * crossing)
