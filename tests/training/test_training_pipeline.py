"""Pipeline parallelism of the compiled step (``parallel={"pp": ...}``): the granule's gradient
program cut into stage programs by layers, run in 1F1B micro-batch order; parameters bitwise
identical to the uncut plans (any dp, micro-batch count, ZeRO), within float32 error of PyTorch;
the stage cut, the schedule and its costing; bad splits named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.training import TrainingError
from tvm_spinn.training.pipeline import layer_of, one_f_one_b, pipeline_makespan, schedule_times, zb_h1
from test_training_lm import ADAMW, _assert_close, gpt2, llama, tokens
from training_models import run_steps as _run, same_bits as _same_bits, torch_adamw

STEPS = 3
#: (name, with_plan options): pipeline plans against the one-chip, one-micro-batch reference
PIPELINE_PLANS = {
    "pp2 mb1": {"pp": 2, "microbatches": 1},
    "pp2 mb4": {"pp": 2, "microbatches": 4},
    "pp2 dp2 mb4": {"pp": 2, "replicas": 2, "microbatches": 4},
    "pp2 dp2 mb2 zero1": {"pp": 2, "replicas": 2, "microbatches": 2, "zero": 1},
    # ZB-H1: the backward cut into input- and weight-gradient programs, the latter deferred
    "pp2 mb4 zb": {"pp": 2, "microbatches": 4, "zero_bubble": True},
    "pp2 dp2 mb4 zb": {"pp": 2, "replicas": 2, "microbatches": 4, "zero_bubble": True},
    "pp2 dp2 mb2 zero1 zb": {"pp": 2, "replicas": 2, "microbatches": 2, "zero": 1, "zero_bubble": True},
}


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer GPT-2 (hidden 32, vocabulary 64; batch 4 of 8 tokens) for a board, one stage."""
    model = gpt2(layers=2, hidden=32, vocab=64)
    ids, labels = tokens(64)
    trainer = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn/board",
                                         parallel={"microbatches": 1})
    return model, trainer, [(ids, labels)] * STEPS


@pytest.mark.slow
def test_pipeline_plans_bitwise_identical_and_close_to_pytorch(tiny):
    """pp = 2 with 1 and 4 micro-batches, with 2 data-parallel replicas and with ZeRO-1: the
    one-stage run's loss curve and parameters bit for bit (5 plans with pp = 1 included), and
    PyTorch's values within float32 error."""
    model, trainer, batches = tiny
    ref = _run(trainer.with_plan(), batches)
    for name, options in PIPELINE_PLANS.items():
        plan = trainer.with_plan(**options)
        assert plan.plan()["pp"] == 2 and plan.pp == 2
        assert _same_bits(_run(plan, batches), ref), name
    assert _same_bits(_run(trainer.with_plan(replicas=2, microbatches=4), batches), ref)
    _assert_close(ref, torch_adamw(model, batches, ADAMW[1]))


@pytest.mark.slow
def test_pipeline_stages_hold_their_layers(tiny):
    """Each stage's backward program returns the gradients of its own layers' parameters; the
    embeddings are the first stage's, the final norm the last's; a stage's forward hands its
    activations to the next (a micro-batch's residual stream at least)."""
    _, trainer, _ = tiny
    plan = trainer.with_plan(pp=2)
    cut = plan._stages[0]
    names = trainer._graph.param_names
    for name, stage in zip(names, cut.param_stage):
        layer = layer_of(name.replace(".", "_"))
        expected = layer // 1 if layer is not None else (1 if "ln_f" in name else 0)
        assert stage == expected, name
    for s, prog in enumerate(cut.backward):
        own = {f"param:{k}" for k, st in enumerate(cut.param_stage) if st == s}
        grads = {cut.grads[k] for k, st in enumerate(cut.param_stage) if st == s}
        assert grads <= set(prog.outputs), s
        assert not ({cut.grads[k] for k in range(len(names))} - grads) & set(prog.outputs), s
        assert own & set(prog.inputs)
    assert cut.loss in cut.forward[1].outputs
    # the stages are cut from the differentiated program, whose LayerNorm is decomposed (two-pass
    # mean and variance on rows): a stage built from the forward graph would keep layer_norm as one
    # op (TOPI: one pass of x and x*x sums on the host; the PE layer_norm kind on spinn): other bits,
    # 1e-9..1e-7 in the gradients
    for prog in cut.forward + cut.backward:
        assert "relax.nn.layer_norm" not in prog.mod.script()
    tokens_x_hidden = 8 * 32 * 4  # one sample's residual stream, float32
    assert cut.boundary_bytes[0] >= tokens_x_hidden


@pytest.mark.slow
def test_resume_across_stage_counts(tiny, tmp_path):
    """Saved after a step with 2 stages and 2 replicas, resumed with one stage: the
    uninterrupted run's bits (a checkpoint holds the unsharded, unstaged state)."""
    _, trainer, batches = tiny
    whole = _run(trainer.with_plan(microbatches=2), batches)
    first = trainer.with_plan(pp=2, replicas=2, microbatches=2)
    first.step(*batches[0])
    first.save(tmp_path / "pp2.npz")
    second = trainer.with_plan(microbatches=4)
    second.load(tmp_path / "pp2.npz")
    losses = [second.step(x, y) for x, y in batches[1:]]
    assert losses == whole[0][1:]
    assert _same_bits((whole[0], second.parameters()), whole)


@pytest.mark.slow
def test_pipeline_simulated_step(tiny):
    """The pipelined step's time is the 1F1B makespan of the stage programs' latencies; the
    stages' gradients reduce per stage over the replicas."""
    _, trainer, _ = tiny
    one = trainer.with_plan(microbatches=4).simulated_step()
    two = trainer.with_plan(pp=2, microbatches=4).simulated_step()
    assert len(two["stage_forward_s"]) == 2 and min(two["stage_backward_s"]) > 0
    assert two["compute_s"] == pytest.approx(pipeline_makespan(2, 4, two["stage_forward_s"],
                                                               two["stage_backward_s"], two["hand_over_s"]))
    assert two["hand_over_s"] > 0
    assert two["total_s"] == pytest.approx(two["compute_s"] + two["local_add_s"] + two["all_reduce_s"]
                                           + two["update_s"] + two["all_gather_s"] + two["host_s"])
    # the stages of one micro-batch together do the uncut program's work
    assert sum(two["stage_forward_s"]) + sum(two["stage_backward_s"]) == pytest.approx(one["microbatch_s"],
                                                                                       rel=0.25)
    dp = trainer.with_plan(pp=2, replicas=2, microbatches=4).simulated_step()
    assert dp["all_reduce"] == "chain" and dp["all_reduce_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_lm_pipeline_matches_the_chip(make):
    """A 2-layer, hidden-64 LM, 3 AdamW steps: one micro-batch on a chip vs 2 stages x 2
    replicas x 4 micro-batches on a board, in 1F1B and in ZB-H1 order, bit for bit; and
    PyTorch's values."""
    model = make()
    ids, labels = tokens()
    batches = [(ids, labels)] * STEPS
    chip = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn",
                                      parallel={"microbatches": 1})
    ref = _run(chip, batches)
    _assert_close(ref, torch_adamw(model, batches, ADAMW[1]))
    board = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn/board",
                                       parallel={"pp": 2, "dp": 2, "microbatches": 4})
    assert board.plan() == {"dp": 2, "tp": 1, "pp": 2, "microbatches": 4, "zero": 0, "granule": 1, "head_stage": False,
                            "head_lag": 0, "zero_bubble": False}
    deferred = board.with_plan(zero_bubble=True)  # from the same initial state (ZB-H1)
    assert _same_bits(_run(board, batches), ref)
    assert _same_bits(_run(deferred, batches), ref)


# -- the schedule (fast) ---------------------------------------------------------------------------
def test_one_f_one_b_order():
    """Each stage warms up with pp - 1 - s forwards, then alternates; every event after the
    ones it needs; every (stage, micro-batch) forward and backward exactly once."""
    events = one_f_one_b(3, 5)
    assert sorted(events) == sorted((k, s, m) for k in "fb" for s in range(3) for m in range(5))
    seen = set()
    for kind, s, m in events:
        if kind == "f" and s > 0:
            assert ("f", s - 1, m) in seen
        if kind == "b":
            assert ("f", s, m) in seen and (s == 2 or ("b", s + 1, m) in seen)
        seen.add((kind, s, m))
    stage0 = [(k, m) for k, s, m in events if s == 0]
    assert stage0[:4] == [("f", 0), ("f", 1), ("f", 2), ("b", 0)]  # 2 warm-up forwards, then 1F1B
    stage2 = [(k, m) for k, s, m in events if s == 2]
    assert stage2[:4] == [("f", 0), ("b", 0), ("f", 1), ("b", 1)]


def _assert_each_once_after_its_needs(events, pp: int, mb: int, kinds: str):
    """Every (kind, stage, micro-batch) event of ``kinds`` exactly once, each after the events it
    reads: a forward after the stage before's, an input-gradient pass after its own forward and
    the stage after's, a weight-gradient pass after its own input-gradient pass."""
    assert sorted(events) == sorted((k, s, m) for k in kinds for s in range(pp) for m in range(mb))
    seen = set()
    for kind, s, m in events:
        if kind == "f" and s > 0:
            assert ("f", s - 1, m) in seen
        if kind == "b":
            assert ("f", s, m) in seen and (s == pp - 1 or ("b", s + 1, m) in seen)
        if kind == "w":
            assert ("b", s, m) in seen
        seen.add((kind, s, m))


def test_one_f_one_b_with_the_last_stage_behind():
    """``lag``: every stage but the last warms up with ``lag`` more forwards (at most the
    micro-batches) and so holds that many more micro-batches in flight while the last stage
    alternates; every event still after the ones it needs, each once;
    lag 0 is plain 1F1B; a bad lag is named."""
    pp, mb, lag = 3, 6, 2
    events = one_f_one_b(pp, mb, lag)
    _assert_each_once_after_its_needs(events, pp, mb, "fb")
    for s in range(pp - 1):  # the warm-up forwards, then 1F1B's first forward and backward
        order = [(k, m) for k, st, m in events if st == s]
        warm = min(pp - 1 - s + lag, mb)
        assert order[:min(warm + 1, mb) + 1] == [("f", m) for m in range(min(warm + 1, mb))] + [("b", 0)]
    assert [(k, m) for k, s, m in events if s == pp - 1][:4] == [("f", 0), ("b", 0), ("f", 1), ("b", 1)]
    assert one_f_one_b(pp, mb, 0) == one_f_one_b(pp, mb)
    assert one_f_one_b(pp, 2, 8)[:4] == (("f", 0, 0), ("f", 0, 1), ("f", 1, 0), ("f", 1, 1))  # at most mb
    for bad in (-1, 1.5, True):
        with pytest.raises(TrainingError, match="head_lag must be an integer >= 0"):
            one_f_one_b(pp, mb, bad)
    # the simulated schedule: equal stages, the last one behind, take no less than plain 1F1B
    assert pipeline_makespan(pp, mb, [1.0] * pp, [2.0] * pp, 0.0, lag) >= pipeline_makespan(
        pp, mb, [1.0] * pp, [2.0] * pp, 0.0) - 1e-12


def test_pipeline_makespan_bubble():
    """Equal stages of forward f and backward b: (m + pp - 1) (f + b) (Megatron's bubble
    fraction (pp - 1) / m), plus the hand-overs on the critical path."""
    assert pipeline_makespan(4, 8, [1.0] * 4, [2.0] * 4, 0.0) == pytest.approx((8 + 3) * 3.0)
    assert pipeline_makespan(1, 8, [1.0], [2.0], 0.5) == pytest.approx(8 * 3.0)
    assert pipeline_makespan(2, 1, [1.0, 1.0], [2.0, 2.0], 0.5) == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)


def test_layer_of_parameter_names():
    assert layer_of("p_lm_transformer_h_3_attn_c_attn_weight") == 3
    assert layer_of("lm.model.layers.12.mlp.up_proj.weight") == 12
    assert layer_of("p_lm_transformer_wte_weight") is None
    assert layer_of("p_lm_transformer_ln_f_bias") is None


# -- bad input (fast: checked before anything is compiled) -----------------------------------------
@pytest.mark.parametrize("options, message", [
    ({"pp": 3}, r"pp=3 does not divide the layers \(2\); pp may be 1, 2"),
    ({"pp": 4}, r"pp=4 does not divide the layers \(2\); pp may be 1, 2"),
])
def test_bad_pipeline_splits(options, message):
    ids, _ = tokens(64)
    with pytest.raises(TrainingError, match=message):
        tvm_spinn.training.compile(gpt2(layers=2, hidden=32, vocab=64), torch.from_numpy(ids), optimizer=ADAMW,
                                   target="spinn/board", parallel=options)


def test_pipeline_needs_a_chip_per_stage():
    ids, _ = tokens(64)
    with pytest.raises(TrainingError, match=r"parallel: dp=1 x pp=2 needs 2 chips, target .* has 1"):
        tvm_spinn.training.compile(gpt2(layers=2, hidden=32, vocab=64), torch.from_numpy(ids), optimizer=ADAMW,
                                   target="spinn", parallel={"pp": 2})


def test_pipeline_needs_a_transformer():
    from training_models import mlp

    with pytest.raises(TrainingError, match="has no transformers configuration"):
        tvm_spinn.training.compile(mlp(), torch.zeros(4, 16), target="spinn/board", parallel={"pp": 2})


@pytest.mark.slow
@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_lm_pipeline_50_steps_match_pytorch(make):
    """50 AdamW steps of a 2-layer LM in 2 stages x 2 replicas x 4 micro-batches on a board:
    loss curve and parameters within float32 error of torch.optim.AdamW."""
    model = make(layers=2, hidden=32, vocab=64)
    ids, labels = tokens(64)
    batches = [(ids, labels)] * 50
    board = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn/board",
                                       parallel={"pp": 2, "dp": 2, "microbatches": 4})
    run = _run(board, batches)
    ref = torch_adamw(model, batches, ADAMW[1])
    _assert_close(run, ref)
    assert ref[0][-1] < 0.9 * ref[0][0]  # it learned


def test_cut_needs_layer_named_parameters():
    """A model whose parameter names carry no layer index cannot be cut by layers: one error
    naming the stage left empty."""
    from tvm_spinn.training.graph import build_train_graph
    from tvm_spinn.training.parallel import grad_module
    from tvm_spinn.training.pipeline import cut_stages
    from training_models import mlp

    graph = build_train_graph(mlp(), (torch.zeros(1, 16),), "cross_entropy", ("sgd", {"lr": 0.1}))
    with pytest.raises(TrainingError, match=r"no parameter names a layer of stage 0 \(layers 0..0"):
        cut_stages(grad_module(graph), graph.param_names, 1, 2, 2)


def test_cut_refuses_a_program_of_several_functions():
    """A stage program is the gradient program's ``main`` cut by layers: a module whose ``main``
    calls another function is refused naming it (the training step's gradient programs inline
    their helpers), and the same module with its helper inlined is cut."""
    from tvm import relax

    from tvm_spinn.training.graph import build_train_graph
    from tvm_spinn.training.parallel import grad_module
    from tvm_spinn.training.pipeline import cut_stages
    from training_models import mlp

    graph = build_train_graph(mlp(), (torch.zeros(1, 16),), "cross_entropy", ("sgd", {"lr": 0.1}))
    names = [f"layers.{k}.{n}" for k, n in enumerate(graph.param_names)]
    adjoint = graph.phases["backbone_loss_adjoint"].without_attr("global_symbol")
    bb = relax.BlockBuilder()
    helper = bb.add_func(adjoint, "adjoint")
    args = [relax.Var(p.name, p.ty) for p in adjoint.params]
    with bb.function("main", args):
        with bb.dataflow():
            out = bb.emit_output(relax.Call(helper, args))
        bb.emit_func_output(out)
    with pytest.raises(TrainingError, match=r"functions besides main \(adjoint\)"):
        cut_stages(bb.get(), names, 1, len(names), 1)
    cut = cut_stages(grad_module(graph), names, 1, len(names), 1)
    assert len(cut.forward) == len(cut.backward) == 1


@pytest.mark.slow
def test_a_head_stage_of_its_own_keeps_the_bits(tiny):
    """The 2-layer GPT-2 cut into 3 stages, a layer each and the LM head's own (from the final
    norm's scale on, the loss included): the final norm's weights on the head's stage, the tied
    table on the first; one granule through the stage programs in pipeline order gives the uncut
    program's loss and gradients bit for bit."""
    from tvm_spinn.training.parallel import _replica_target
    from tvm_spinn.training.pipeline import cut_stages

    _, trainer, (batch, *_) = tiny
    micro = trainer._micro_graph
    names = micro.param_names
    cut = cut_stages(trainer._grad_program(), names, len(micro.input_shapes), 2, 3, head_stage=True)
    for name, stage in zip(names, cut.param_stage):
        layer = layer_of(name)
        assert stage == (layer if layer is not None else 2 if "ln_f" in name else 0), name
    assert cut.loss in cut.forward[2].outputs and "R.matmul" in cut.forward[2].mod.script()  # the logits
    ids, labels = batch
    one = trainer.with_plan()
    # the first granule (one sequence of 8 tokens), as the step cuts it
    inputs = [np.ascontiguousarray(x[:1]) for x in one._check_inputs(ids)]
    targets = np.ascontiguousarray(one._check_labels(labels)[:8])
    whole = one._grad_vm["main"](*[tvm.runtime.tensor(x) for x in inputs], *one._params, tvm.runtime.tensor(targets))
    with _replica_target(trainer._target) as (replica, _):
        fwd = [relax.VirtualMachine(relax.build(p.mod, target=replica), tvm.cpu()) for p in cut.forward]
        bwd = [relax.VirtualMachine(relax.build(p.mod, target=replica), tvm.cpu()) for p in cut.backward]
    values = {f"input:{k}": tvm.runtime.tensor(x) for k, x in enumerate(inputs)}
    values.update({f"param:{k}": p for k, p in enumerate(one._params)})
    values["targets"] = tvm.runtime.tensor(targets)
    for progs, vms in ((cut.forward, fwd), (cut.backward[::-1], bwd[::-1])):
        for prog, vm in zip(progs, vms):
            values.update(zip(prog.outputs, vm["main"](*[values[k] for k in prog.inputs])))
    assert values[cut.loss].numpy().tobytes() == whole[0].numpy().tobytes()
    for key, want in zip(cut.grads, whole[1]):
        assert values[key].numpy().tobytes() == want.numpy().tobytes(), key
    with pytest.raises(TrainingError, match=r"a head stage of its own needs pp >= 2"):
        cut_stages(trainer._grad_program(), names, len(micro.input_shapes), 2, 1, head_stage=True)
    # Llama: the final norm and the untied head on the head's stage, the embedding on the first
    from tvm_spinn.training.graph import build_train_graph
    from tvm_spinn.training.parallel import grad_module

    model = llama(layers=2, hidden=32, vocab=64)
    ll = build_train_graph(model, (torch.from_numpy(ids[:1]),), "cross_entropy", ADAMW)
    cut = cut_stages(grad_module(ll), ll.param_names, 1, 2, 3, head_stage=True)
    stages = dict(zip(ll.param_names, cut.param_stage))
    assert stages["lm.lm_head.weight"] == stages["lm.model.norm.weight"] == 2
    assert stages["lm.model.embed_tokens.weight"] == 0 and stages["lm.model.layers.1.mlp.up_proj.weight"] == 1


@pytest.mark.slow
def test_head_stage_plans_keep_the_bits(tiny):
    """``with_plan(pp=3, head_stage=True)``: the 2-layer GPT-2's layers on 2 stages and its LM head
    and loss on a third, 2 micro-batches in 1F1B order (and 2 stages with the head's own, 2
    replicas): the one-stage run's losses and parameters bit for bit; the simulated step times
    three stage programs; bad head stages named."""
    _, trainer, batches = tiny
    ref = _run(trainer.with_plan(), batches)
    plan = trainer.with_plan(pp=3, head_stage=True, microbatches=2)
    assert plan.plan()["head_stage"] and plan.pp == 3
    assert _same_bits(_run(plan, batches), ref)
    assert _same_bits(_run(trainer.with_plan(pp=2, head_stage=True, replicas=2, microbatches=2), batches), ref)
    sim = plan.simulated_step()
    assert len(sim["stage_forward_s"]) == 3 and all(t > 0 for t in sim["stage_forward_s"] + sim["stage_backward_s"])
    with pytest.raises(TrainingError, match=r"a head stage of its own needs pp >= 2"):
        trainer.with_plan(pp=1, head_stage=True)
    with pytest.raises(TrainingError, match=r"pp - 1=3 does not divide the layers \(2: a head stage"):
        trainer.with_plan(pp=4, head_stage=True)
    with pytest.raises(TrainingError, match=r"head_stage must be True or False, got 1"):
        trainer.with_plan(pp=2, head_stage=1)
    # the head stage 2 micro-batches behind the layers' stages (4 micro-batches): a schedule
    # order only, the same bits
    behind = trainer.with_plan(pp=3, head_stage=True, microbatches=4, head_lag=2)
    assert behind.plan()["head_lag"] == 2
    assert _same_bits(_run(behind, batches), ref)
    assert behind.simulated_step()["compute_s"] > 0
    # and its weight-gradient passes deferred (ZB-H1): the same bits
    deferred = trainer.with_plan(pp=3, head_stage=True, microbatches=4, head_lag=2, zero_bubble=True)
    assert deferred.plan()["zero_bubble"] and _same_bits(_run(deferred, batches), ref)
    with pytest.raises(TrainingError, match=r"head_lag=2 needs a head stage of its own"):
        trainer.with_plan(pp=2, head_lag=2)
    with pytest.raises(TrainingError, match=r"head_lag must be an integer >= 0, got -1"):
        trainer.with_plan(pp=3, head_stage=True, head_lag=-1)
    # given at compile time: the same stages
    model, _, _ = tiny
    ids, _ = batches[0]
    staged = tvm_spinn.training.compile(model, torch.from_numpy(ids), optimizer=ADAMW, target="spinn/board",
                                        parallel={"pp": 3, "head_stage": True, "microbatches": 2})
    assert staged.plan()["head_stage"] and _same_bits(_run(staged, batches), ref)


@pytest.mark.parametrize("options, message", [
    ({"pp": 1, "head_stage": True}, r"parallel: a head stage of its own needs pp >= 2 .*got pp=1"),
    ({"pp": 4, "head_stage": True}, r"parallel: pp - 1=3 does not divide the layers \(2: a head stage"),
    ({"pp": 2, "head_stage": "yes"}, r"parallel: head_stage must be True or False, got 'yes'"),
])
def test_bad_head_stages_are_named_before_compiling(options, message):
    ids, _ = tokens(64)
    with pytest.raises(TrainingError, match=message):
        tvm_spinn.training.compile(gpt2(layers=2, hidden=32, vocab=64), torch.from_numpy(ids), optimizer=ADAMW,
                                   target="spinn/board", parallel=options)


# -- ZB-H1 and the bucketed reduction ---------------------------------------------------------------
def test_zb_h1_order():
    """Every stage's forwards and input-gradient passes in 1F1B's order, each weight-gradient
    pass after its own input-gradient pass; stage ``s`` lets ``s`` of them wait (the first runs
    ``F B W`` once warm, the last defers ``pp - 1``); every event once, after the ones it needs."""
    pp, mb = 4, 6
    events = zb_h1(pp, mb)
    _assert_each_once_after_its_needs(events, pp, mb, "fbw")
    for s in range(pp):
        order = [(k, m) for k, st, m in events if st == s]
        assert [x for x in order if x[0] != "w"] == [(k, m) for k, st, m in one_f_one_b(pp, mb) if st == s]
        waiting = max(sum(1 for k, _ in order[:i] if k == "b") - sum(1 for k, _ in order[:i] if k == "w")
                      for i in range(len(order) - mb))  # before the drain's remaining W passes
        assert waiting == s + 1, s  # s deferred, and the one just computed
    assert zb_h1(3, 6, 2) != zb_h1(3, 6) and sorted(zb_h1(3, 6, 2)) == sorted(zb_h1(3, 6))
    with pytest.raises(TrainingError, match="head_lag must be an integer >= 0"):
        zb_h1(pp, mb, -1)


@pytest.mark.parametrize("pp, mb", [(2, 4), (4, 8), (4, 4), (13, 16)])
def test_zb_h1_makespan_is_qi_et_als(pp, mb):
    """Equal stages, F = 1, B = 1.5, W = 0.75, no hand-over, at least pp micro-batches: ZB-H1's
    ``m (F + B + W) + (pp - 1) (F + B - W)`` (Qi et al. 2024) against 1F1B's ``(m + pp - 1)
    (F + B + W)``; a weight-gradient pass of zero time is 1F1B with the backward B."""
    f, b, w = 1.0, 1.5, 0.75
    zb = pipeline_makespan(pp, mb, [f] * pp, [b] * pp, 0.0, weight_s=[w] * pp)
    assert zb == pytest.approx(mb * (f + b + w) + (pp - 1) * (f + b - w))
    assert pipeline_makespan(pp, mb, [f] * pp, [b + w] * pp, 0.0) == pytest.approx((mb + pp - 1) * (f + b + w))
    assert pipeline_makespan(pp, mb, [f] * pp, [b] * pp, 0.0, weight_s=[0.0] * pp) == pytest.approx(
        pipeline_makespan(pp, mb, [f] * pp, [b] * pp, 0.0))
    with pytest.raises(TrainingError, match="needs their times"):
        schedule_times(zb_h1(pp, mb), [f] * pp, [b] * pp, 0.0)


@pytest.mark.slow
def test_zero_bubble_cut_defers_the_weight_gradients(tiny):
    """``cut_stages(..., zero_bubble=True)``: each stage's backward is an input-gradient program
    (what the lower stages read; on the first stage the tables' gradients, where the input
    gradient ends) and a weight-gradient program (its layers' projection weights' gradients,
    GEMMs reading the saved activations and the input-gradient pass's outputs); one granule
    through F, B and W gives the uncut program's loss and gradients bit for bit."""
    from tvm_spinn.training.parallel import _replica_target
    from tvm_spinn.training.pipeline import cut_stages

    _, trainer, (batch, *_) = tiny
    micro = trainer._micro_graph
    names = micro.param_names
    cut = cut_stages(trainer._grad_program(), names, len(micro.input_shapes), 2, 2, zero_bubble=True)
    plain = cut_stages(trainer._grad_program(), names, len(micro.input_shapes), 2, 2)
    assert plain.weight == () and len(cut.weight) == 2
    assert all(a.mod.script() == b.mod.script() and (a.inputs, a.outputs) == (b.inputs, b.outputs)
               for a, b in zip(cut.forward, plain.forward))  # the forward programs are 1F1B's
    grad_of = dict(zip(names, cut.grads))
    for s in range(2):
        deferred = set(cut.weight[s].outputs)
        for name, stage in zip(names, cut.param_stage):
            if stage == s and layer_of(name) is not None and name.endswith("weight") and (
                    "c_attn" in name or "c_proj" in name or "c_fc" in name):
                assert grad_of[name] in deferred, name  # a projection's weight gradient is deferred
        assert deferred <= set(cut.grads)  # W hands nothing to another stage
        assert "R.matmul" in cut.weight[s].mod.script()
        assert set(cut.backward[s].outputs) & set(cut.weight[s].inputs)  # W reads the input-gradient pass
    assert grad_of["lm.transformer.wte.weight"] in cut.backward[0].outputs  # the table's, with the input gradient
    # what stage 0's backward reads of stage 1's, stage 1's input-gradient pass hands over
    assert set(cut.backward[1].outputs) >= set(plain.backward[0].inputs) & set(plain.backward[1].outputs)
    ids, labels = batch
    one = trainer.with_plan()
    inputs = [np.ascontiguousarray(x[:1]) for x in one._check_inputs(ids)]
    targets = np.ascontiguousarray(one._check_labels(labels)[:8])
    whole = one._grad_vm["main"](*[tvm.runtime.tensor(x) for x in inputs], *one._params, tvm.runtime.tensor(targets))
    with _replica_target(trainer._target) as (replica, _):
        vms = {id(p): relax.VirtualMachine(relax.build(p.mod, target=replica), tvm.cpu())
               for p in cut.forward + cut.backward + cut.weight}
    values = {f"input:{k}": tvm.runtime.tensor(x) for k, x in enumerate(inputs)}
    values.update({f"param:{k}": p for k, p in enumerate(one._params)})
    values["targets"] = tvm.runtime.tensor(targets)
    for prog in (cut.forward[0], cut.forward[1], cut.backward[1], cut.weight[1], cut.backward[0], cut.weight[0]):
        values.update(zip(prog.outputs, vms[id(prog)]["main"](*[values[k] for k in prog.inputs])))
    assert values[cut.loss].numpy().tobytes() == whole[0].numpy().tobytes()
    for key, want in zip(cut.grads, whole[1]):
        assert values[key].numpy().tobytes() == want.numpy().tobytes(), key


@pytest.mark.slow
def test_compiled_zero_bubble_step_against_the_planners_rule(tiny):
    """The compiled step's ZB-H1 and 1F1B pipelines (their schedules simulated from the stage
    programs' latencies, ``compute_s``) against the planners' pricing of a pipeline on the same
    programs' times: ``(slots - 1)`` slots of the slowest stage, then each stage's fill-and-drain
    term once (1F1B: its slot ``F + B + W``). With ZB-H1, Qi et al.'s bubble (the first stage's
    whole slot, every later stage's ``F + B - W``; the simulated schedule without hand-overs is
    exactly that) and the training planner's form for a compute-bound stage (every stage's
    ``F + B``, its slot less its weight gradients once). Each within the hand-overs the
    simulated schedule puts on its path (``2 pp`` of them; the planner overlaps them with the
    compute); the ZB-H1 step is the shorter. Printed with the planner's own figures for the same
    split (its passes priced from the GEMM model alone)."""
    from tvm_spinn.target.registry import arch_of
    from tvm_spinn.training.planner import Split, _Comms, _spec, _step_time

    model, trainer, _ = tiny
    spec = _spec(model.lm.config.to_dict())
    arch = arch_of("spinn/board")
    for dp in (1, 2):
        one = trainer.with_plan(pp=2, replicas=dp, microbatches=4).simulated_step()
        zb = trainer.with_plan(pp=2, replicas=dp, microbatches=4, zero_bubble=True).simulated_step()
        slots = 4 // dp
        f, b, w = zb["stage_forward_s"], zb["stage_backward_s"], zb["stage_weight_s"]
        slot = [x + y + z for x, y, z in zip(f, b, w)]
        # the input- and weight-gradient programs together cost about the uncut backward
        assert slot == pytest.approx([x + y for x, y in zip(one["stage_forward_s"], one["stage_backward_s"])], rel=0.05)
        rule_1f1b = (slots - 1) * max(slot) + sum(slot)
        rule_zb = (slots - 1) * max(slot) + slot[0] + sum(x + y - z for x, y, z in zip(f[1:], b[1:], w[1:]))
        rule_planner = (slots - 1) * max(slot) + sum(x + y for x, y in zip(f, b))
        alone = max(schedule_times(zb_h1(2, slots), f, b, 0.0, w)[1])  # no hand-over
        tol = 2 * 2 * zb["hand_over_s"]
        planned = [_step_time(spec, Split(1, 2, dp, 0, 1, slots, False, False, zero_bubble=z), 8, "adamw", arch,
                              _Comms(arch, True)).pipeline_s for z in (False, True)]
        print(f"dp {dp}, {slots} slots: compiled 1F1B {one['compute_s'] * 1e3:.4f} ms (rule {rule_1f1b * 1e3:.4f}); "
              f"ZB-H1 {zb['compute_s'] * 1e3:.4f} ms, without hand-overs {alone * 1e3:.4f} (Qi et al.'s rule "
              f"{rule_zb * 1e3:.4f}, the planner's {rule_planner * 1e3:.4f}); tolerance {tol * 1e3:.4f} ms; planner "
              f"on the GEMM model: 1F1B {planned[0] * 1e3:.4f} ms, ZB-H1 {planned[1] * 1e3:.4f} ms")
        assert abs(one["compute_s"] - rule_1f1b) <= tol
        assert alone == pytest.approx(rule_zb, rel=1e-9)
        assert abs(zb["compute_s"] - rule_zb) <= tol and abs(zb["compute_s"] - rule_planner) <= tol
        assert zb["compute_s"] < one["compute_s"] and planned[1] < planned[0]


@pytest.mark.slow
def test_bucketed_reduction_keeps_the_bits_and_ends_with_each_stage(tiny):
    """ZeRO-0 with 2 stages and 2 replicas: one bucket a stage (its parameters; the loss reduced on
    its own), each reduced in the chain's order and updated on its own: the one-stage (unbucketed)
    run's bits; each stage's reduction starts as its own last pass ends (the chain over its
    replicas' chips), and the step's exposed tail is the latest bucket's, no longer than the
    whole buffer reduced and updated after the pipeline."""
    from tvm_spinn.target.topology import topology_of
    from tvm_spinn.timing.collectives import chain_all_reduce
    from tvm_spinn.training.timing import executable_latency

    _, trainer, batches = tiny
    ref = _run(trainer.with_plan(), batches)
    for zb in (False, True):
        plan = trainer.with_plan(pp=2, replicas=2, microbatches=4, zero_bubble=zb)
        cut = plan._stages[0]
        assert [b[0] for b in plan._buckets] == [0, 1]
        assert sorted(k for b in plan._buckets for k in b[1]) == list(range(len(cut.param_stage)))
        assert sum(len(b[2]) for b in plan._buckets) == sum(int(np.prod(s)) for s in plan._graph.param_shapes)
        assert 0 not in np.concatenate([b[2] for b in plan._buckets])  # the loss' position
        assert _same_bits(_run(plan, batches), ref), zb
        sim = plan.simulated_step()
        topo = topology_of(plan._system)
        for stage, idx, _, _ in plan._buckets:
            nbytes = 4 * sum(int(np.prod(plan._graph.param_shapes[k])) for k in idx) + (4 if stage == 1 else 0)
            chain = chain_all_reduce(topo, [stage, 2 + stage], nbytes).seconds
            assert sim["bucket_sync_end_s"][stage] == pytest.approx(sim["stage_end_s"][stage] + chain)
        # the whole buffer's way: the stages' chains once the pipeline ends, then the whole update
        chains = [chain_all_reduce(topo, [s, 2 + s], 4 * sum(int(np.prod(shape)) for shape, st in zip(
            plan._graph.param_shapes, cut.param_stage) if st == s) + (4 if s == 1 else 0)).seconds for s in (0, 1)]
        tail = sim["all_reduce_s"] + sim["update_s"]
        assert tail == pytest.approx(max(sim["bucket_update_end_s"]) - sim["compute_s"])
        assert 0 < tail < max(chains) + executable_latency(plan.executable)
    # the non-reproducible mode reduces the whole buffer by the ring after the pipeline
    assert trainer.with_plan(pp=2, replicas=2, microbatches=4, reproducible=False)._buckets is None


@pytest.mark.slow
def test_bucketed_step_with_a_last_stage_without_parameters(tiny):
    """A 3-stage plan (2 layer stages and the head's) whose last stage holds no parameter: the
    final norm's weights reassigned to the first stage's bucket (the update is per element, so
    any grouping of the parameters into buckets gives the same bits). The loss is reduced on its
    own: the step returns the one-chip run's loss and parameters bit for bit, and the timing lists
    keep one entry per stage, 0.0 for the empty one."""
    import dataclasses

    _, trainer, batches = tiny
    ref = _run(trainer.with_plan(), batches)
    plan = trainer.with_plan(pp=3, head_stage=True, microbatches=2)
    cut, *rest = plan._stages
    moved = tuple(0 if st == 2 else st for st in cut.param_stage)
    assert 2 in cut.param_stage and 2 not in moved
    plan._stages = (dataclasses.replace(cut, param_stage=moved), *rest)
    plan._buckets = plan._setup_buckets()
    assert [b[0] for b in plan._buckets] == [0, 1]
    run = _run(plan, batches)
    assert not np.isnan(run[0]).any()
    assert _same_bits(run, ref)
    sim = plan.simulated_step()
    assert len(sim["bucket_sync_end_s"]) == len(sim["bucket_update_end_s"]) == 3
    assert sim["bucket_sync_end_s"][2] == sim["bucket_update_end_s"][2] == 0.0
    for stage in (0, 1):  # one replica: no chain, the update starts as the stage's last pass ends
        assert sim["bucket_sync_end_s"][stage] == sim["stage_end_s"][stage]
        assert sim["bucket_update_end_s"][stage] > sim["stage_end_s"][stage]


@pytest.mark.parametrize("options, message", [
    ({"pp": 1, "zero_bubble": True}, r"parallel: zero_bubble=True \(ZB-H1\) .* needs pp >= 2, got pp=1"),
    ({"pp": 2, "zero_bubble": 1}, r"parallel: zero_bubble must be True or False, got 1"),
])
def test_bad_zero_bubble_is_named_before_compiling(options, message):
    ids, _ = tokens(64)
    with pytest.raises(TrainingError, match=message):
        tvm_spinn.training.compile(gpt2(layers=2, hidden=32, vocab=64), torch.from_numpy(ids), optimizer=ADAMW,
                                   target="spinn/board", parallel=options)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
                                       ("adam", {"lr": 1e-2, "weight_decay": 0.01})], ids=["momentum", "adam"])
def test_bucketed_update_keeps_every_optimizers_state(optimizer):
    """A bucket's state is the scalars (Adam's 0-d running products, the step count) and its
    parameters' entries of each group (momentum; the moments): 2 stages x 2 replicas update
    bucket by bucket to the one-stage run's parameters and optimizer state, bit for bit."""
    ids, labels = tokens(64)
    batches = [(ids, labels)] * STEPS
    trainer = tvm_spinn.training.compile(gpt2(layers=2, hidden=32, vocab=64), torch.from_numpy(ids),
                                         optimizer=optimizer, target="spinn/board", parallel={"microbatches": 1})
    one, staged = trainer.with_plan(microbatches=4), trainer.with_plan(pp=2, replicas=2, microbatches=4)
    assert one._buckets is None and len(staged._buckets) == 2
    assert _same_bits(_run(staged, batches), _run(one, batches))
    for a, b in zip(staged.optimizer_state(), one.optimizer_state()):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert staged.steps == one.steps == STEPS
