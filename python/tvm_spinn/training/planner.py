"""Training plans from a transformers config alone: memory per chip, split, time per step.

:func:`plan_training` plans fp32 training of a decoder-only transformer (GPT-2 or Llama
architecture, :mod:`tvm_spinn.llm.spec`) on a spinn system without any weight: it chooses the
tensor x pipeline x data parallel split (Megatron-LM's TP, 1F1B pipeline, DP), the ZeRO stage
(0, 1, 2) and activation recomputation by a cost model, or takes the ones given, and returns a
frozen :class:`TrainingPlan`.

Layout
------
The ``tp x pp x dp`` chips used are numbered in one of three orders (:attr:`Split.layout`,
innermost axis first, :data:`LAYOUTS`): ``tp,pp,dp`` (chip ``c`` holds TP rank ``c % tp`` of
stage ``(c // tp) % pp`` of replica ``c // (tp pp)``: a TP group is ``tp`` consecutive chips,
one hop apart on a board, :mod:`tvm_spinn.target.topology`, a stage's successor the next
``tp``), ``tp,dp,pp`` (the replicas of a stage side by side: its data-parallel groups stay on
its board where ``tp dp`` divides it) or ``dp,tp,pp`` (each data-parallel group on consecutive
chips). A head stage's chips follow each replica's block stages in the first order, and all
block stages in the others, its data-parallel groups on consecutive chips
(:meth:`Split.head_grid`). The search takes the fastest.

Memory per chip (bytes, fp32: everything 4 bytes an element)
------------------------------------------------------------
Mixed-precision estimators (Megatron-LM, DeepSpeed) keep fp16/bf16 weights and gradients and
an fp32 master copy; here every tensor is fp32 and there is no master copy:

* weights ``4 P`` and gradients ``4 P`` for the ``P`` parameters of the chip's TP rank of its
  stage: the blocks' projections split by ``tp`` (Megatron's column/row split; column biases
  split, row biases and norms replicated), the embedding and an untied LM head split by vocab
  (a tied head is a copy of the embedding on the last stage when ``pp > 1``; GPT-2's position
  table replicated);
* optimizer state ``4 k P`` with ``k`` = 2 (AdamW), 1 (SGD with momentum), 0 (SGD). ZeRO-1
  divides the optimizer state by ``dp``, ZeRO-2 the gradients too (ZeRO, Rajbhandari et al.
  2020, with ``K = 4 k`` and 4-byte weights and gradients: stage 2 holds ``4 P + (4 + 4 k) P /
  dp``); ZeRO-2 therefore reduce-scatters the gradients after every micro-batch (its full
  gradient never exists), ZeRO-0 and ZeRO-1 once a step;
* activations (Korthikanti et al. 2022, Sec. 4, re-derived for fp32 without dropout: the
  trainer refuses dropout, so there are no masks and no dropout outputs, and every stored
  tensor takes 4 bytes): one layer stores, per token, its two norms' inputs, the attention's
  input, Q, K and V, the attention output, the MLP input and its hidden activations (GPT-2: the
  GELU's input and output, ``2 i``; Llama: gate, up and their product, ``3 i``), and ``s``
  softmax outputs per head. The four ``hidden``-wide tensors are split over the sequence on the
  TP ranks with sequence parallelism (Korthikanti et al.'s Sec. 4.2.2; the default), else
  replicated on them; the rest is split by heads or by the MLP's width. 1F1B keeps ``min(pp - j, m)`` micro-batches in
  flight on stage ``j`` (the first stage holds the most; a head stage counts among the stages,
  and a head :attr:`Split.head_lag` slots behind adds that many); the last stage also holds the
  final norm's input and output and the logits (``vocab / tp`` per token; a head stage or a
  spread head holds them for each slot in flight on it). Full recomputation keeps
  only each layer's input (``4 hidden`` bytes per token) and one layer's activations while it
  is recomputed.

Time per step
-------------
Per micro-batch and stage: the GEMMs of a slot's tokens on a rank (the projections' ``1 / tp``
shares, attention's two matmuls per head over the full ``s`` context; backward each GEMM's
input gradient and its weight gradient; recomputation one more forward of the blocks), each
priced as the timing model times the compiled GEMM on a chip (:func:`~tvm_spinn.timing.gemm.gemm_seconds`: the
mapper's tile, the PE kernel's register blocks and per-block and per-job overheads, the
layer's barrier; a few tokens' rows, computed one output at a time, cost several times the fp32 peak's
time, a weight gradient reducing over a few tokens pays each block's set-up), or the DRAM
traffic (weights read in each pass, gradients accumulated, stored activations written and read
back; the embedding tables' rows of the slot's tokens only, they are gathered from) at
:attr:`~tvm_spinn.target.arch.SpinnArch.dram_bw_bytes_s`, whichever is longer. A stage whose
GEMM weights and their gradients fit the chip's resident SRAM share (:data:`RESIDENT_SHARE` of
every PE's tile SRAM, as the mapping keeps resident weights) keeps them there from the first
slot to the update: loaded and written back once a step (with the update), not per pass. Plus the
TP all-reduces of the activations (two a layer forward, two backward, two more when
recomputing; with sequence parallelism each is an all-gather and a reduce-scatter), the
vocab-parallel embedding's and cross-entropy's, and the hand-over to the next
stage (which runs by DMA during the slot's compute), each costed with the step patterns of
:mod:`tvm_spinn.timing.collectives` on the
system's link graph for *every group at once* (all TP groups of a slot, every stage boundary of
every replica, all data-parallel groups: they share the links and board edges they meet; see
:class:`_Comms`). A micro-batch may enter the pipeline as :attr:`Split.chunks` chunks of
consecutive tokens of its sequences (token-level pipelining, TeraPipe, Li et al. 2021: a
causal chunk attends over its sequences' earlier chunks, whose keys and values the stage keeps),
so the step takes ``m c - 1`` slots of the slowest of its ``S`` stages' forward and backward of
one chunk and, for the fill and drain (the first slot's forward and the last one's backward
pass every stage at that stage's pace), each stage's slot once: at most ``(m c + S - 1)`` of the
slowest's (the bubble, at most ``(S - 1) / (m c)``). A slot of a single-slot step takes its
TP collectives plus the longer of its compute and its hand-overs; with more slots, 1F1B pairs
the forward of one slot with the backward of another, independent of it, so the links carry
one pass's collectives while the PEs compute the other: the slot takes the longest of its
compute, its collectives and hand-overs (they share the links), and either pass with its own
collectives (:func:`_slot_seconds`). Where a stage's TP groups each lie on one board and its
hand-overs cross board edges, the two meet only on the on-board legs of the hand-overs' routes
(:meth:`_Comms.onboard`): the links then take the longer of the board edges' time and the
on-board links' (collectives plus those legs). The links carry a collective's bytes for its
busy time only (its busiest link's, :meth:`_Comms.collective_parts`; hop latencies and DMA
set-ups hold back the pass that waits for it, not other transfers), and the backward's
collectives run under its weight-gradient GEMMs, which no later GEMM of the pass reads
(Megatron-LM's overlap of the tensor-parallel backward communication).

A pipeline schedule shrinks the fill and drain (searched; a schedule order only: every pass
reads its own slot's values, so no bit moves). :attr:`Split.zero_bubble` splits each
backward into its input-gradient pass and its weight-gradient pass and defers the latter into the
idle time (ZB-H1, Qi et al. 2024): a slot's backward crosses the stages at the input-gradient
passes' pace, and each stage's fill and drain term is its slot less twice its weight-gradient
GEMMs (``F + B - W`` rather than ``F + B + W``), with the backward's collectives that ran under
those GEMMs back on the path; a stage holds its GEMMs' inputs whole and their output gradients
until the deferred pass reads them.

The LM head may take a pipeline stage of its own (:attr:`Split.head_tp` chips a replica,
vocab-parallel, a width of its own: the blocks' ``tp`` divides the attention heads, the head's
GEMM only the vocabulary, and GPT-2 small's head is 31% of its FLOPs): the last block stage's
ranks hand their shares of the slot's hidden states to the head's ranks, which all-gather them;
the head's partial input gradients are reduce-scattered over its ranks and handed back. A tied
table then lives on the head's stage only: it streams the first stage the rows of each slot's
tokens and takes their gradients back during the pipeline (beside the first stage's
hand-overs); only the first slot's rows and the last slot's gradients are exposed.

The head may instead be spread over every chip of the replica's block stages
(:attr:`Split.spread_head`, vocabulary parallelism over the pipeline as Yeung et al. 2024 balance
it): each of the ``tp pp`` ranks holds a share of the vocabulary's leaves (stage-major, the
busiest rank's whole leaves priced where the width does not divide them) and computes its share
of the head's GEMMs beside its layers; each slot's final hidden states are all-gathered onto
every rank, the loss' sums chained over the ranks and the input gradient reduced back to the last
stage's ranks, on the links every stage's collectives use. A head stage or a spread head may run
:attr:`Split.head_lag` slots behind the last block stage (searched): the last block stage then
holds that many more slots, and the head's passes wait for no collective (it gathers later
slots' hidden states while it computes one, and computes another slot's pass while one's loss
sums and input gradient are reduced): a slot's path through the head, its passes and
collectives in series, spreads over the lag and is crossed once in the fill and drain.

Then the gradient synchronisation over the ``dp`` replicas (ZeRO-0: an all-reduce; ZeRO-1: a
reduce-scatter and an all-gather of the updated weights; ZeRO-2: a reduce-scatter per
micro-batch and the all-gather; rows of a gathered table that no token of the step can touch,
GPT-2's positions from ``seq`` on, have a zero gradient on every replica and are left out). With
ZeRO-0 and more than one stage the block stages' gradients are all-reduced in buckets as each
stage's last backward completes them (a layer's projections one by one, the tables' rows last)
and each bucket updated on the stage's cores as its reduction ends (:func:`_bucket_tail`; the
reduction's order per element is the chain's, whatever the buckets); the untouched rows' update
waits for no reduction and runs in the first stage's idle time within the pipeline. Otherwise
the block stages' groups synchronise all at once as the first stage ends; a head stage's on
their own, earlier: in 1F1B's drain the head's stage runs its last
backward ``pp`` backward passes before the first stage (each at least the slowest stage's
backward compute), so its synchronisation starts that much earlier (hidden behind the drain;
:attr:`StepTime.dp_hidden_s`); a tied embedding's
(Megatron's all-reduce of its two copies' gradients, or the last stage's copy handing the
replica's token rows to the first stage and their gradients back, the cheaper) and the
optimizer update (its DRAM traffic or its element-wise work on the M4F cores, whichever is
longer). In the reproducible mode (the default) every floating-point reduction is a pipelined
chain in ascending rank order (:class:`_Comms`; the order of
:func:`~tvm_spinn.timing.collectives.chain_all_reduce` that the compiled data-parallel step
and the bit-exact tensor-parallel collectives run), or a *direct* reduce-scatter: every rank
sends each shard's owner its piece and the owner adds the pieces in ascending rank order (the
same order); ranks hold consecutive blocks of the reduced axis (micro-batches, or a GEMM's
``k``), so the additions do not depend on the split. A GEMM that reduces over a
tensor-parallel sharded ``k`` (a row-parallel projection's forward, a column-parallel one's
input gradient) adds its terms in the canonical order of :mod:`tvm_spinn.training.tp_chain`,
which the compiled step runs on every split, one chip included: ``k`` cut into a fixed number of
leaves that every admissible ``tp`` divides, each leaf a GEMM from zero, the leaves added in
order. Each rank computes its leaves' GEMMs (the parallel ``1 / tp`` share), adds them to the
running sums on its cores one leaf at a time, and the reduction over the ranks is the chain or
the direct reduce-scatter above with one piece a leaf (:meth:`_Comms.collective_parts`). The
vocab-parallel LM head's input gradient takes the same order over the vocabulary's leaves
(:func:`~tvm_spinn.training.tp_chain.vocab_leaves`; a head stage's width divides them), and the
loss' sum of exponentials the one-chip kernel's, one class after another in ascending order: a
chain over the ranks in rank order (:mod:`tvm_spinn.training.vocab_parallel`, as the compiled
step runs it).
What is not modelled: link sharing between the head
stage's gradient synchronisation and the other stages' drain, and the host's share of the step.

Search: every split that fits is ordered by its blocks' GEMM time alone; a split's step with each
collective costed for its first few groups only is a lower bound of its full cost, and splits are costed
in full in the order of that bound until no other can be faster (branch and bound: the result
is the fastest split, as costing them all would find).

The physical bound (:mod:`tvm_spinn.timing.training_bound`) does not depend on the plan;
``efficiency = bound / time``.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import math
import os
import time
from dataclasses import dataclass

import numpy as np

from ..timing.gemm import gemm_seconds
from .errors import TrainingError

__all__ = ["TrainingPlan", "MemoryPerChip", "Split", "StepTime", "TrainingPlanError", "plan_training", "LAYOUTS",
           "memory_per_chip", "model_flops", "smallest_system", "write_json", "OPTIMIZERS", "DEFAULT_SEQ",
           "DEFAULT_GLOBAL_BATCH"]

#: chip orders a split may take, innermost axis first: each replica's stages side by side (the
#: TP groups of a stage next to those of the next), the replicas of a stage side by side (a
#: stage's data-parallel groups on one board where they fit), or the replicas of a TP rank
#: side by side (each data-parallel group on consecutive chips)
LAYOUTS = ("tp,pp,dp", "tp,dp,pp", "dp,tp,pp")
#: fp32 optimizer-state elements per parameter
OPTIMIZERS = {"adamw": 2, "momentum": 1, "sgd": 0}
#: bytes per fp32 element
F32 = 4
#: Sequence length planned when none is given (or the model's positions where fewer)
DEFAULT_SEQ = 2048
#: Sequences per step when none is given
DEFAULT_GLOBAL_BATCH = 512
#: slots the LM head's passes may run behind the last block stage (:attr:`Split.head_lag`,
#: searched): a head stage's or a spread head's
HEAD_LAGS = (2, 4, 8)
#: DRAM bytes per parameter of one optimizer update: read the weight, its gradient and the
#: state, write the weight and the state.
_UPDATE_BYTES = {name: F32 * (3 + 2 * k) for name, k in OPTIMIZERS.items()}
#: Element-wise operations per parameter of one update on the M4F (AdamW: the compiled update of
#: :mod:`tvm_spinn.training.adamw`, 14: the decay 1, the first moment 3, the second moment 4,
#: the denominator 3 and the step 3; SGD with momentum: velocity and step; SGD: the step)
_UPDATE_OPS = {"adamw": 14, "momentum": 4, "sgd": 2}


class TrainingPlanError(TrainingError):
    """A training plan that cannot be made: a split that does not divide, a bad argument, or a
    model that does not fit the system (then :attr:`smallest_chips` and :attr:`smallest_boards`
    name the smallest system that holds it)."""

    def __init__(self, message: str, smallest_chips: "int | None" = None, smallest_boards: "int | None" = None):
        super().__init__(message)
        self.smallest_chips = smallest_chips
        self.smallest_boards = smallest_boards


@dataclass(frozen=True)
class Split:
    """How the chips share the work: ``tp x pp x dp`` chips, ZeRO stage, micro-batches."""

    tp: int
    pp: int
    dp: int
    zero: int
    micro_batch: int
    micro_batches: int
    recompute: bool
    sequence_parallel: bool = True
    #: pipeline slots per micro-batch: its sequences cut into this many chunks of consecutive
    #: tokens that enter the pipeline one after another (1: the whole micro-batch)
    chunks: int = 1
    #: chip order, innermost axis first (see the module docstring's Layout): one of :data:`LAYOUTS`
    layout: str = "tp,pp,dp"
    #: chips of a pipeline stage of its own for the final norm, the LM head and the loss in each
    #: replica (vocab-parallel over them, a width of its own: the head's GEMM is not bounded by
    #: the heads as the blocks' is); 0: the head on the last block stage at the blocks' ``tp``
    head_tp: int = 0
    #: the final norm, the LM head and the loss vocabulary-parallel over every chip of the
    #: replica's block stages (``tp x pp`` ranks, each its share of the vocabulary's leaves in
    #: stage-major rank order), time-shared with the blocks (the head's GEMM work spread evenly
    #: over the pipeline, as Yeung et al. 2024's vocabulary parallelism does): no chip of its own
    spread_head: bool = False
    #: slots the head's passes run behind the last block stage (a head stage's or a spread
    #: head's; 0: 1F1B as it is, the head's passes waiting for their collectives). The last
    #: block stage runs this many more slots ahead (and holds their activations), so the head
    #: gathers later slots' hidden states while it computes one and computes another slot's pass
    #: while one's loss sums and input gradient are reduced: one slot's path through the head,
    #: its passes and collectives in series, spreads over this many slots, and is crossed once in
    #: the fill and drain
    head_lag: int = 0
    #: the backward split into its input-gradient pass and its weight-gradient pass, the latter
    #: deferred into the pipeline's idle time (ZB-H1, Qi et al. 2024, "Zero Bubble Pipeline
    #: Parallelism"): a slot's backward crosses the stages at the input-gradient passes' pace, so
    #: the fill and drain take ``F + B - W`` of each stage rather than ``F + B + W``
    zero_bubble: bool = False

    def __post_init__(self):
        # a head's placement the step prices no way: one clear error naming the field
        if self.spread_head and self.head_tp:
            raise ValueError(f"Split: spread_head=True with head_tp={self.head_tp}: the head is spread over the "
                             "block stages or on a stage of its own, not both")
        if self.spread_head and self.pp < 2:
            raise ValueError(f"Split: spread_head=True needs pp >= 2 (pp={self.pp}): with one stage the head is "
                             "on the last block stage")
        if self.head_lag < 0:
            raise ValueError(f"Split: head_lag={self.head_lag} must be >= 0")
        if self.head_lag and not (self.head_tp or self.spread_head):
            raise ValueError(f"Split: head_lag={self.head_lag} needs a head stage (head_tp > 0) or a spread head "
                             "(spread_head=True): a head on the last block stage runs with its blocks")
        if not isinstance(self.zero_bubble, bool):
            raise ValueError(f"Split: zero_bubble={self.zero_bubble!r} must be True or False")
        if self.zero_bubble and self.stages < 2:
            raise ValueError(f"Split: zero_bubble=True needs more than one pipeline stage (pp={self.pp} and no head "
                             "stage): there is no fill or drain to defer the weight gradients into")

    @property
    def chips(self) -> int:
        return (self.tp * self.pp + self.head_tp) * self.dp

    @property
    def stages(self) -> int:
        """Pipeline stages: the block stages and the head's stage where it has one."""
        return self.pp + (self.head_tp > 0)

    @property
    def slots(self) -> int:
        """Pipeline inputs per replica and step: micro-batches times chunks."""
        return self.micro_batches * self.chunks

    def grid(self) -> np.ndarray:
        """``(tp, pp, dp)`` chip ids: the chip of TP rank ``t`` of block stage ``p`` of replica
        ``d``. A head stage's chips (:meth:`head_grid`) follow each replica's last block stage
        in the ``tp,pp,dp`` order, and all block stages in the others (one more stage after
        the last, its replicas side by side)."""
        sizes = {"tp": self.tp, "pp": self.pp, "dp": self.dp}
        index = {"tp": np.arange(self.tp)[:, None, None], "pp": np.arange(self.pp)[None, :, None],
                 "dp": np.arange(self.dp)[None, None, :]}
        chip, stride = 0, 1
        for axis in self.layout.split(","):
            chip = chip + stride * index[axis]
            stride *= sizes[axis]
            if axis == "pp" and self.layout == LAYOUTS[0]:
                stride += self.head_tp  # each replica's head chips after its block stages
        return chip

    def head_grid(self) -> np.ndarray:
        """``(dp, head_tp)`` chip ids of the head stage's ranks (empty without one)."""
        d, r = np.arange(self.dp)[:, None], np.arange(self.head_tp)[None, :]
        if self.layout == LAYOUTS[0]:
            return d * (self.tp * self.pp + self.head_tp) + self.tp * self.pp + r
        # after the block stages, each of its data-parallel groups on consecutive chips (its
        # gradients, the largest of a stage, synchronise on a board where the replicas fit it)
        return self.tp * self.pp * self.dp + d + self.dp * r

    def head_ranks(self) -> np.ndarray:
        """``(dp, tp pp)`` chip ids of each replica's ranks of a spread head
        (:attr:`spread_head`): stage-major, rank ``s tp + t`` the chip of TP rank ``t`` of stage
        ``s``, so the vocabulary's leaves run over the stages in order."""
        return np.ascontiguousarray(self.grid().transpose(2, 1, 0)).reshape(self.dp, self.pp * self.tp)

    @property
    def head_width(self) -> int:
        """Ranks the LM head's vocabulary is split over: a head stage's, a spread head's (every
        chip of a replica's block stages) or the last block stage's TP ranks."""
        return self.head_tp or (self.tp * self.pp if self.spread_head else self.tp)

    def line(self) -> str:
        head = f" + {self.head_tp} x {self.dp} head" if self.head_tp else ""
        return (f"TP {self.tp} x PP {self.pp} x DP {self.dp}{head} = {self.chips} chips"
                + (f" (chips in {self.layout.replace(',', ', ')} order)" if self.layout != LAYOUTS[0] else "")
                + f", ZeRO-{self.zero}, {self.micro_batches} micro-batch(es) of {self.micro_batch}"
                + (f" in {self.chunks} sequence chunks each" if self.chunks > 1 else "")
                + (f", LM head on a stage of its own of {self.head_tp} chip(s) a replica" if self.head_tp else "")
                + (f", LM head spread over the {self.tp * self.pp} chips of a replica's stages" if self.spread_head
                   else "")
                + (f", the head {self.head_lag} slots behind" if self.head_lag else "")
                + (", weight gradients deferred (zero bubble, ZB-H1)" if self.zero_bubble else "")
                + f", recomputation {'on' if self.recompute else 'off'}"
                + (", sequence parallel" if self.sequence_parallel and self.tp > 1 else ""))


@dataclass(frozen=True)
class MemoryPerChip:
    """Bytes on the most loaded chip (the pipeline stage with the largest total)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int  # of the chosen mode
    activations_no_recompute: int
    activations_recompute: int
    stage: int  # the pipeline stage these bytes are on
    capacity: int  # the chip's DRAM

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step by part (their sum is the step)."""

    pipeline_s: float  # (slots - 1) x the slowest stage's slot + each stage's slot once (fill and drain)
    bubble_s: float  # of it, beyond slots x the slowest stage's slot
    compute_s: float  # of it, the GEMMs (or DRAM) of the slowest stage, all micro-batches
    tp_comm_s: float  # of it, TP all-reduces
    pp_comm_s: float  # of it, stage hand-overs
    dp_comm_s: float  # gradient synchronisation (and ZeRO's all-gather)
    optimizer_s: float  # the update
    dram_bound: bool = False  # the slowest stage's passes wait on DRAM rather than on the GEMMs
    #: the head stage's gradient synchronisation run during the pipeline's drain (not in the sum)
    dp_hidden_s: float = 0.0
    #: one slot of each costed stage: ``((stage, compute s, TP s, hand-over s, slot s), ...)``
    #: (the slot: those parts as they overlap, :func:`_slot_seconds`; the slowest paces the
    #: pipeline); stage ``pp`` is the head's own stage
    stages_s: tuple = ()

    @property
    def total_s(self) -> float:
        return self.pipeline_s + self.dp_comm_s + self.optimizer_s


@dataclass(frozen=True)
class TrainingPlan:
    """A planned training step (cost model; no weights, no simulation). See the module docstring."""

    model: str
    system: str
    chips: int
    params: int
    seq: int
    global_batch: int
    optimizer: str
    reproducible: bool
    split: Split
    memory: MemoryPerChip
    step: StepTime
    flops_per_step: float  # Megatron's count: forward and backward GEMMs, no recomputation
    executed_flops_per_step: float  # with the recomputed forward
    tokens_per_s: float
    utilisation: float  # flops_per_step / (time x fp32 peak of the chips used)
    bound_s: float
    bound_binding: str
    bound_parts_s: tuple  # ((kind, seconds), ...)
    candidates: int  # splits costed by the search
    plan_seconds: float = dataclasses.field(default=0.0, compare=False)
    #: the search: ``(split, lower bound s, step s or None where the bound pruned it)`` for every
    #: split whose bound was taken, in the order taken (for plots; not in :meth:`to_dict`)
    search: tuple = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def time_per_step_s(self) -> float:
        return self.step.total_s

    @property
    def efficiency(self) -> float:
        """The physical bound over the time per step (at most 1)."""
        return self.bound_s / self.step.total_s

    def to_dict(self) -> dict:
        """Plain dict (JSON-ready, deterministic: the planning time is left out)."""
        out = dataclasses.asdict(dataclasses.replace(self, search=()))
        out.pop("plan_seconds")
        out.pop("search")
        out["bound_parts_s"] = dict(self.bound_parts_s)
        out["memory"]["total"] = self.memory.total
        out["step"]["total_s"] = self.step.total_s
        out["split"]["chips"] = self.split.chips
        out.update(time_per_step_s=self.time_per_step_s, efficiency=self.efficiency)
        return out

    def table(self) -> str:
        gib = 2**30
        m = self.memory
        rows = [
            ("model", f"{self.model} ({self.params / 1e9:.3f} B parameters)"),
            ("system", f"{self.system} ({self.chips} chips)"),
            ("step", f"{self.global_batch} sequences x {self.seq} tokens, {self.optimizer}, fp32, "
                     f"{'reproducible' if self.reproducible else 'fastest'} reductions"),
            ("split", self.split.line()),
            ("memory per chip", f"{m.total / gib:.3f} GiB of {m.capacity / gib:.3f} GiB (stage {m.stage}): weights "
                                f"{m.weights / gib:.3f}, gradients {m.gradients / gib:.3f}, optimizer "
                                f"{m.optimizer / gib:.3f}, activations {m.activations / gib:.3f}"),
            ("activations", f"{m.activations_no_recompute / gib:.3f} GiB without recomputation, "
                            f"{m.activations_recompute / gib:.3f} GiB with"),
            ("time per step", f"{self.step.total_s:.4g} s (pipeline {self.step.pipeline_s:.4g} s, of it bubble "
                              f"{self.step.bubble_s:.4g} s, TP {self.step.tp_comm_s:.4g} s, PP "
                              f"{self.step.pp_comm_s:.4g} s; DP {self.step.dp_comm_s:.4g} s; update "
                              f"{self.step.optimizer_s:.4g} s)"),
            ("tokens/s", f"{self.tokens_per_s:.4g}"),
            ("utilisation", f"{self.utilisation:.4f} (model FLOPs / fp32 peak of the chips used)"),
            ("physical bound", f"{self.bound_s:.4g} s, {self.bound_binding}-bound: " + ", ".join(
                f"{k} {v:.4g} s" for k, v in self.bound_parts_s)),
            ("efficiency", f"{self.efficiency:.4f} (physical bound / time per step)"),
            ("planned", f"{self.candidates} splits costed in {self.plan_seconds:.2f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def __str__(self) -> str:
        return self.table()


# --------------------------------------------------------------------------------- the model
def _spec(config):
    from ..llm.spec import FAMILIES, LLMError, _as_dict, spec_of  # the config reader (json only)

    cfg = _as_dict(config)
    model_type = cfg.get("model_type")
    if model_type in FAMILIES and model_type not in TRAINED_MODEL_TYPES:
        # the counts below know GPT-2's and Llama's blocks only: another block is refused, not
        # planned as one of them (an unknown type is spec_of's error)
        raise LLMError(f"config field 'model_type' is {model_type!r}: training plans model types "
                       f"{', '.join(TRAINED_MODEL_TYPES)}")
    return spec_of(cfg)


#: model types whose blocks the training planner counts (GPT-2's and the Llama family's)
TRAINED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "phi3")


def _widths(spec, tp: int = 1):
    """``(hidden, intermediate, query, key/value)`` widths on one TP rank: the heads and the MLP
    split by ``tp``; key/value heads split too, or, with more ranks than key/value heads
    (grouped-query attention), one key/value head on each rank (replicated, as Megatron does)."""
    kv_heads = spec.kv_heads // tp if spec.kv_heads % tp == 0 else 1
    return spec.hidden, spec.intermediate // tp, spec.heads // tp * spec.head_dim, kv_heads * spec.head_dim


def _layer_params(spec, tp: int) -> int:
    """Parameters of one block on one TP rank: column-parallel weights and biases split,
    row-parallel biases and norms replicated."""
    h, i, q, kv = _widths(spec, tp)
    if spec.family == "gpt2":
        split = h * (q + 2 * kv) + (q + 2 * kv) + q * h + 2 * h * i + i
        replicated = h + h + 4 * h  # the two row-parallel biases, two LayerNorms (scale, shift)
    else:
        split = h * (q + 2 * kv) + q * h + 3 * h * i
        split += (q + 2 * kv) * (spec.attention_bias or spec.qkv_bias) + 2 * i * spec.mlp_bias
        replicated = 2 * h + h * spec.attention_bias + h * spec.mlp_bias  # two RMSNorms, row biases
    return split + replicated


def _vocab_rows(spec, width: int) -> int:
    """Rows of the LM head's weight on the busiest of ``width`` vocabulary-parallel ranks of a
    spread head: its whole leaves of the vocabulary's canonical order
    (:func:`~tvm_spinn.training.tp_chain.vocab_leaves`, ``ceil(vocab / leaves)`` rows each),
    consecutive leaves a rank, some ranks one more where ``width`` does not divide them (the
    compiled step's :class:`~tvm_spinn.training.vocab_parallel.VocabShard` assignment); a
    ``1 / width`` share with more ranks than leaves."""
    from .tp_chain import vocab_leaves

    leaves = vocab_leaves(spec.heads, spec.intermediate, spec.vocab)
    if width > leaves:
        return -(-spec.vocab // width)
    return -(-leaves // width) * -(-spec.vocab // leaves)


def _stage_params(spec, tp: int, pp: int, stage: int, head_tp: int = 0, spread: bool = False) -> int:
    """Parameters on one TP rank of pipeline stage ``stage`` (``stage == pp``: a rank of the
    head's stage of ``head_tp`` chips; ``spread``: the head's rows spread over every stage's
    ranks, :attr:`Split.spread_head`)."""
    h, v = spec.hidden, spec.vocab
    norm = 2 * h if spec.family == "gpt2" else h  # the final norm
    if head_tp and stage == pp:  # the final norm and the LM head (a tied one: the only copy)
        return norm + -(-v // head_tp) * h
    table = -(-v // tp) * h  # vocab-parallel, padded to a multiple of tp
    n = spec.layers // pp * _layer_params(spec, tp)
    if stage == 0:
        # a tied table on a head stage (or spread with the head) hands the token rows to the
        # first stage instead
        n += ((0 if (head_tp or spread) and spec.tied_embeddings else table)
              + (spec.max_positions * h if spec.family == "gpt2" else 0))
    if spread:  # a share of the head's rows on every rank; the final norm on the last stage
        return n + _vocab_rows(spec, tp * pp) * h + (norm if stage == pp - 1 else 0)
    if head_tp:
        return n
    if stage == pp - 1:
        n += 2 * h if spec.family == "gpt2" else h  # the final norm
        if not spec.tied_embeddings or pp > 1:
            n += table  # the LM head (a tied one is the embedding's copy on the last stage)
    return n


def _gathered_params(spec, split: "Split", stage: int) -> int:
    """Of a stage's parameters on one rank, the tables only gathered from (the token embedding
    on the first stage, GPT-2's position table): a pass reads the rows of its tokens only."""
    if stage != 0:
        return 0
    h = spec.hidden
    table = 0 if (split.head_tp or split.spread_head) and spec.tied_embeddings else -(-spec.vocab // split.tp) * h
    return table + (spec.max_positions * h if spec.family == "gpt2" else 0)


def _untouched_rows(spec, seq: int, stage: int) -> int:
    """Parameters of a stage's gathered tables whose gradient no step can touch: GPT-2's
    position rows from ``seq`` on (every sequence of the step takes positions ``0 .. seq - 1``).
    Their gradient is zero on every replica, so the data-parallel synchronisation leaves them
    out (its sum would be those zeros: the bits do not change); the update still runs over them
    (weight decay)."""
    if stage != 0 or spec.family != "gpt2":
        return 0
    return max(0, spec.max_positions - seq) * spec.hidden


def _layer_activations(spec, tp: int, tokens: int, seq: int, sequence_parallel: bool) -> int:
    """Bytes one layer stores for the backward pass for ``tokens`` tokens (sequences of
    ``seq``) on one TP rank (see the module docstring)."""
    h, i, q, kv = _widths(spec, tp)
    mlp = 3 * i if spec.family == "llama" else 2 * i
    wide = 4 * h  # the norms' inputs, the attention's and the MLP's inputs
    wide = -(-wide // tp) if sequence_parallel else wide  # split over the sequence, or replicated
    scores = (spec.heads // tp) * seq  # softmax outputs per token
    return F32 * tokens * (wide + 2 * q + 2 * kv + mlp + scores)


def _layer_input(spec, tp: int, tokens: int, sequence_parallel: bool) -> int:
    """Bytes of one layer's input on one TP rank (what full recomputation keeps)."""
    return F32 * tokens * (-(-spec.hidden // tp) if sequence_parallel else spec.hidden)


def _stage_activations(spec, split: "Split", seq: int, stage: int, recompute: bool) -> int:
    tp, pp, mb = split.tp, split.pp, split.micro_batch
    tokens = mb * seq // split.chunks  # one pipeline slot's tokens
    if split.head_tp and stage == pp:
        # the head's stage, last of the pipeline (one slot in flight, and head_lag more waiting
        # for it, up to the slots): the final norm's input and output on every rank (the head
        # reads all of the slot's hidden states) and its share of the logits
        return _head_slots(split) * (2 * F32 * tokens * spec.hidden + F32 * tokens * -(-spec.vocab // split.head_tp))
    layers = spec.layers // split.pp
    inflight = _inflight(split, stage)
    sp = split.sequence_parallel and tp > 1
    layer = _layer_activations(spec, tp, tokens, seq, sp)
    if recompute:
        total = layers * inflight * _layer_input(spec, tp, tokens, sp) + layer
    else:
        total = layers * inflight * layer
    if split.zero_bubble and stage < pp:
        # a deferred weight-gradient pass reads its GEMMs' inputs whole (the column-parallel
        # ones' as gathered over the sequence) and their output gradients, held from the
        # input-gradient pass until it runs: counted for every slot in flight
        h, i, q, kv = _widths(spec, tp)
        total += layers * inflight * F32 * tokens * (q + 2 * kv + i + 4 * h)
    if split.chunks > 1:
        # a chunk attends over the keys and values of its sequences' earlier chunks: each
        # micro-batch with a chunk in flight keeps its whole sequences' keys and values
        _, _, _, kv = _widths(spec, tp)
        sequences = min(split.micro_batches, -(-inflight // split.chunks) + 1)
        total += layers * sequences * F32 * mb * seq * 2 * kv
    if split.spread_head:
        # each rank holds, for every slot whose head passes are in flight (as a head stage: the
        # one it computes and head_lag more, up to the slots), the slot's final hidden states
        # whole (the norm's output, and its input for the norm's gradient) and its share of the
        # logits
        total += _head_slots(split) * (2 * F32 * tokens * spec.hidden + F32 * tokens * _vocab_rows(spec, tp * split.pp))
    elif stage == split.pp - 1 and not split.head_tp:  # the final norm's input and output, the logits
        total += 2 * _layer_input(spec, tp, tokens, sp) + F32 * tokens * -(-spec.vocab // tp)
    return total


def _head_slots(split: "Split") -> int:
    """Slots whose head passes a head stage or a spread head holds at once: the one it
    computes and the :attr:`Split.head_lag` behind it, up to the slots (as :func:`_inflight`)."""
    return min(1 + split.head_lag, split.slots)


def _inflight(split: "Split", stage: int) -> int:
    """Slots block stage ``stage`` holds at once under 1F1B: one for each later stage (a head's
    stage among them) up to the slots, and :attr:`Split.head_lag` more (the head's passes run
    that many slots behind the last block stage)."""
    return min(split.stages + split.head_lag - stage, split.slots)


def memory_per_chip(spec, split: Split, seq: int, optimizer: str, capacity: int) -> MemoryPerChip:
    """Bytes per chip of ``split`` (the most loaded pipeline stage), see the module docstring."""
    best = None
    for stage in _costed_stages(split):
        p = _stage_params(spec, split.tp, split.pp, stage, split.head_tp, split.spread_head)
        shard = -(-p // split.dp)
        grads = shard if split.zero >= 2 else p
        state = OPTIMIZERS[optimizer] * (shard if split.zero >= 1 else p)
        acts = {r: _stage_activations(spec, split, seq, stage, r) for r in (False, True)}
        mem = MemoryPerChip(F32 * p, F32 * grads, F32 * state, acts[split.recompute], acts[False], acts[True],
                            stage, capacity)
        if best is None or mem.total > best.total:
            best = mem
    return best


def _peak_bytes(spec, split: Split, seq: int, optimizer: str) -> int:
    """:attr:`MemoryPerChip.total` of ``split`` (its recomputation mode only: the search's fit
    test, cheaper than :func:`memory_per_chip`)."""
    most = 0
    for stage in _costed_stages(split):
        p = _stage_params(spec, split.tp, split.pp, stage, split.head_tp, split.spread_head)
        shard = -(-p // split.dp)
        grads = shard if split.zero >= 2 else p
        state = OPTIMIZERS[optimizer] * (shard if split.zero >= 1 else p)
        most = max(most, F32 * (p + grads + state) + _stage_activations(spec, split, seq, stage, split.recompute))
    return most


def _costed_stages(split: Split) -> list:
    """The stages whose memory and time differ: the first and last block stage (the others are
    the last's but for its head) and the head's own stage (``pp``) where there is one."""
    return sorted({0, split.pp - 1} | ({split.pp} if split.head_tp else set()))


def _block_flops(spec, tokens: int, seq: int, tp: int = 1) -> tuple[int, int]:
    """(GEMM FLOPs of one block's forward for ``tokens`` tokens on one of ``tp`` ranks, of it
    the attention's two ``seq x seq`` matmuls)."""
    h, i, q, kv = _widths(spec, tp)
    mlp = 3 if spec.family == "llama" else 2
    weights = h * (q + 2 * kv) + q * h + mlp * h * i
    attention = 2 * 2 * tokens * seq * q  # Q K^T and (softmax) V, the full s x s (as Megatron counts)
    return 2 * tokens * weights + attention, attention


def _block_gemms(spec, tokens: int, seq: int, tp: int, sequences: int) -> tuple[list, list]:
    """One block's GEMMs on one of ``tp`` ranks for a slot of ``tokens`` tokens of ``sequences``
    sequences, ``[(m, k, n, batch)]``: the projections (``tokens`` rows; GPT-2's fused Q/K/V
    and its MLP, Llama's separate projections and gated MLP), and attention's two matmuls per
    head and sequence over the full ``seq`` context (as :func:`_block_flops` counts them)."""
    h, i, q, kv = _widths(spec, tp)
    if spec.family == "gpt2":
        weights = [(tokens, h, q + 2 * kv, 1), (tokens, q, h, 1), (tokens, h, i, 1), (tokens, i, h, 1)]
    else:
        weights = [(tokens, h, q, 1), (tokens, h, kv, 1), (tokens, h, kv, 1), (tokens, q, h, 1),
                   (tokens, h, i, 1), (tokens, h, i, 1), (tokens, i, h, 1)]
    rows, heads = max(1, tokens // sequences), sequences * (q // spec.head_dim)
    attention = [(rows, spec.head_dim, seq, heads), (rows, seq, spec.head_dim, heads)]
    return weights, attention


def _pass_seconds(arch, gemms: list, comms: "_Comms") -> tuple[float, float, float]:
    """``(forward, input gradients, weight gradients)`` seconds of ``gemms`` ``[(m, k, n, batch)]``
    (:func:`~tvm_spinn.timing.gemm.gemm_seconds`, cached on ``comms``): the backward of ``Y = A B`` is ``dA = dY B^T``
    (``m x n`` by ``n x k``) and ``dB = A^T dY`` (``k x m`` by ``m x n``)."""
    def seconds(m, k, n, b):
        return comms._get(("gemm", m, k, n, b), lambda: gemm_seconds(arch, m, k, n, b))

    def passes():
        fwd = sum(seconds(m, k, n, b) for m, k, n, b in gemms)
        dgrad = sum(seconds(m, n, k, b) for m, k, n, b in gemms)
        wgrad = sum(seconds(k, m, n, b) for m, k, n, b in gemms)
        return fwd, dgrad, wgrad

    return comms._get(("passes", tuple(gemms)), passes)


def model_flops(spec, tokens: int, seq: int, recompute: bool = False) -> int:
    """FLOPs of one step of ``tokens`` tokens: the blocks' and the LM head's GEMMs, forward and
    backward (three passes), plus one more forward of the blocks with full recomputation."""
    block, _ = _block_flops(spec, tokens, seq)
    head = 2 * tokens * spec.hidden * spec.vocab
    return (4 if recompute else 3) * spec.layers * block + 3 * head


# ----------------------------------------------------------------------------- communication
#: segment counts a pipelined chain reduction chooses from (each segment costs a DMA set-up on
#: every rank it passes, so the cheapest count stays well inside this range)
_CHAIN_SEGMENTS = tuple(2**k for k in range(13))
#: groups costed together for a lower bound of all of them at once (a subset shares fewer links)
_BOUND_GROUPS = 8
#: most ranks a direct reduce-scatter is costed for: its ``c (c - 1)`` pieces shrink with ``c``,
#: so wider groups take the chain or the ring (and costing it on the link graph grows as ``c**2``:
#: Llama-2-70B's cloud plan takes 21 s of CPU with 16, several times that with 48, same plan)
_DIRECT_RANKS = 16
#: message size at which a collective's affine cost is sampled (any size > 0 gives the same line)
_PROBE_BYTES = float(2**20)


class _Comms:
    """Collectives of concurrent groups on the system's link graph, cached by (op, groups, bytes).

    ``groups`` is a ``(g, c)`` array of chip ids: ``g`` groups of ``c`` ranks that run the same
    collective at the same time (every TP group of a stage slot, every DP group of the step),
    so their transfers share the links they meet (:meth:`Topology.evaluate` sums the bytes per
    link and per board edge). The algorithms are the step patterns of
    :mod:`tvm_spinn.timing.collectives` repeated over the groups:

    * fastest mode: the cheapest of the ring, the binomial tree and the reproducible mode's
      algorithms, and for a single group also the multicast algorithms
      (:func:`~tvm_spinn.timing.collectives.all_reduce` ``"auto"``);
    * both modes, for groups of up to :data:`_DIRECT_RANKS` ranks: the *direct* reduce-scatter
      (each rank sends every shard's owner its piece at once; the owner adds them in ascending
      rank order), and for an all-reduce the finished shards sent to every rank the same way;
    * reproducible mode: floating-point additions in one fixed order, a *pipelined chain*: the
      buffer cut into segments that flow from rank 0 to rank ``c - 1``, each rank adding its
      partial sums into the running sum (the ascending order of
      :func:`~tvm_spinn.timing.collectives.chain_all_reduce`, the order the compiled data-parallel
      step and the bit-exact tensor-parallel collectives use); an all-reduce sends each finished
      segment back down the chain on the reverse links at the same time, a reduce-scatter sends
      each finished segment on to its owner; the segments stream at the busiest link's rate
      after the first has crossed every hop (:meth:`_chain`). A single
      group may also use :func:`~tvm_spinn.timing.collectives.chain_all_reduce` (the multicast
      broadcast). All-gathers add nothing: any algorithm is exact.
    """

    def __init__(self, arch, reproducible: bool, alone: bool = False, shared: "_Comms | None" = None):
        from ..target.topology import board_grid, topology_of

        self.alone = alone  # cost each collective for its first few groups only (a lower bound)

        self.topo = topology_of(arch)
        self.per_board = arch.chips_per_board
        self.boards = max(1, -(-arch.chips // arch.chips_per_board))
        self.row = board_grid(self.boards)[0] if self.boards > 1 else 1  # boards along a torus row
        self.reproducible = reproducible
        self.dma_s = arch.dma_setup_cycles / arch.clock_hz  # one segment's DMA on a rank
        self.cache: dict = {}
        # the board paths and a pair's bytes split over them depend on the system only: a
        # ``shared`` instance's (the search's lower-bound costing beside its full one) are reused
        self.paths: dict = shared.paths if shared is not None else {}

    def _get(self, key, make, cache: "dict | None" = None):
        cache = self.cache if cache is None else cache
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = make()
        return hit

    def collective(self, op: str, groups: np.ndarray, nbytes: float) -> float:
        """Seconds of collective ``op`` run by every group of ``groups`` at once: the cheapest
        algorithm. An algorithm is costed over all the groups only when its cost for the first
        few groups (a subset of the transfers: a lower bound of it) is below the cheapest found
        so far."""
        return self.collective_parts(op, groups, nbytes)[0]

    def collective_parts(self, op: str, groups: np.ndarray, nbytes: float, leaves: int = 1,
                         chain: bool = False) -> tuple:
        """``(seconds, busy seconds)`` of :meth:`collective`: its time, and of it the time its
        busiest link (or board edge) carries bytes. The rest (hop latencies, DMA set-ups, a
        pipelined chain's fill) delays the collective's ranks but leaves the links free for
        other transfers.

        ``leaves``: each rank's partial sum is that many leaves of the canonical order
        (:mod:`tvm_spinn.training.tp_chain`), added to the running sum one by one: the chain
        carries one buffer as before, the direct reduce-scatter one piece a leaf (a rank may
        not add its leaves first).

        ``chain``: in the reproducible mode, the chain alone (a sum whose order is one element
        after another across the ranks, as the loss' sum of exponentials in ascending class
        order: no rank's partial sum exists to send directly)."""
        groups = np.ascontiguousarray(groups, dtype=np.int64)
        if groups.ndim != 2 or groups.shape[1] < 2 or nbytes <= 0:
            return 0.0, 0.0
        groups = groups[:_BOUND_GROUPS] if self.alone else self._window(groups)
        n = float(nbytes)
        names = ("chain",) if chain and self.reproducible else self._algorithms(op, groups.shape[0], groups.shape[1])
        if groups.shape[0] == 1:
            return min(self._at(op, groups, a, n, leaves) for a in names)
        few = groups[:_BOUND_GROUPS] if groups.shape[0] > _BOUND_GROUPS else groups[:1]
        floors = {a: self._at(op, few, a, n, leaves)[0] for a in names}
        best = (math.inf, math.inf)
        for a in sorted(names, key=lambda a: (floors[a], a)):
            if floors[a] >= best[0]:
                break
            best = min(best, self._at(op, groups, a, n, leaves))
        return best

    def _algorithms(self, op: str, g: int, c: int) -> tuple:
        direct = ("direct",) if c <= _DIRECT_RANKS else ()
        if self.reproducible and op != "all_gather":
            return ("chain", *direct)
        # the fixed-order algorithms are valid in the fastest mode too (it is never slower)
        exact = ("chain",) if op != "all_gather" else ()
        return ("ring", "tree", *exact, *direct, "multicast") if g == 1 else ("ring", "tree", *exact, *direct)

    def _at(self, op: str, groups: np.ndarray, algorithm: str, n: float, leaves: int = 1) -> tuple:
        """``(seconds, busy seconds)`` of one algorithm for ``n`` bytes (its affine lines cached
        per group pattern; each line ``(seconds per byte, seconds, busy seconds per byte)``).
        A direct reduction of ``leaves`` leaves a rank sends that many pieces: its reduce-scatter
        carries ``leaves`` times the bytes (an all-reduce's gather half does not)."""
        lines = self._get((op, algorithm, groups.shape, groups.tobytes()),
                          lambda: self._lines(op, groups, algorithm))
        if algorithm == "direct" and leaves > 1 and op != "all_gather":
            n = n * leaves if op == "reduce_scatter" else n * (leaves + 1) / 2
        return min(((a * n + b, busy * n) for a, b, busy in lines), default=(math.inf, math.inf))

    @staticmethod
    def _affine(cost) -> tuple:
        """``(seconds per byte, seconds)`` of a cost function of the message size: every
        candidate is a fixed set of routes whose link loads scale with the bytes, so its time is
        affine in them (:meth:`Topology.link_seconds` is a maximum of loads over rates)."""
        one, two = cost(_PROBE_BYTES), cost(2 * _PROBE_BYTES)
        return (two - one) / _PROBE_BYTES, 2 * one - two

    def _window(self, groups: np.ndarray) -> np.ndarray:
        """The groups that lie on the system's first boards, when the rest repeat them.

        Chip ids number the boards one after another and a split's layout repeats along them,
        so the groups on ``4 x`` the boards one group spans (at least two periods of any
        pattern that repeats within that span), and for groups on several boards a row of the
        torus of boards more (so a stretch that wraps to the next row is among them), load
        their boards' links as every other stretch of boards is loaded: their concurrent cost
        is every group's. Where that window is the whole system, all groups are costed."""
        per_board = self.per_board
        top = groups.max(axis=1)
        span = int((top // per_board - groups.min(axis=1) // per_board).max()) + 1
        # the window also holds a row of the torus of boards and the next board: board ids run
        # along rows, so groups that straddle the end of a row (longer routes) are among it
        boards = 4 * span + (self.row + 1 if span > 1 else 0)
        if boards >= self.boards:
            return groups
        window = boards * per_board
        inside = groups[top < window]
        return inside if inside.size else groups

    def _lines(self, op: str, groups: np.ndarray, algorithm: str) -> list:
        """One algorithm of ``op`` over ``groups`` as affine costs (class docstring); none where
        it is not built for these ranks."""
        from ..timing import collectives as co

        g, c = groups.shape
        if algorithm == "chain":
            return self._chain(op, groups)
        ranks = groups.reshape(-1)
        if algorithm == "direct":
            # every rank sends each other rank its piece (``n / c``) of that rank's shard at
            # once; the owner adds the pieces in ascending rank order (a fixed order: the
            # chain's); an all-reduce then sends each finished shard to every other rank the
            # same way; an all-gather is that second step alone
            src, dst = (x.reshape(-1) for x in np.meshgrid(np.arange(c), np.arange(c), indexing="ij"))
            keep = src != dst
            offset = (np.arange(g) * c)[:, None]
            step, _ = self.topo.evaluate(ranks[(offset + src[keep][None, :]).reshape(-1)],
                                         ranks[(offset + dst[keep][None, :]).reshape(-1)], _PROBE_BYTES / c)
            repeats = 2 if op == "all_reduce" else 1
            per_byte = repeats * step.bandwidth_s / _PROBE_BYTES
            return [(per_byte, repeats * step.latency_s, per_byte)]
        if algorithm == "multicast":  # one group: the multicast trees
            fn = {"all_reduce": co.all_reduce, "all_gather": co.all_gather, "reduce_scatter": co.reduce_scatter}[op]
            try:
                a, b = self._affine(lambda n: fn(self.topo, ranks, n, algorithm="multicast").seconds)
                return [(a, b, a)]
            except ValueError:  # no multicast trees over these ranks
                return []
        # the algorithm's steps over every group at once, each step's bandwidth term per byte and
        # its latency (collectives._evaluate sums the steps the same way)
        offset = (np.arange(g) * c)[:, None]
        per_byte, fixed = 0.0, 0.0
        for src, dst, size, repeats in co._steps(op, algorithm, c, _PROBE_BYTES):
            step, _ = self.topo.evaluate(ranks[(offset + src[None, :]).reshape(-1)],
                                         ranks[(offset + dst[None, :]).reshape(-1)], np.tile(size, g))
            per_byte += repeats * step.bandwidth_s / _PROBE_BYTES
            fixed += repeats * step.latency_s
        return [(per_byte, fixed, per_byte)]

    def _route_seconds(self, src: np.ndarray, dst: np.ndarray, nbytes) -> tuple:
        """For concurrent transfers ``src[i] -> dst[i]`` of ``nbytes``: the seconds all of them
        take together (the busiest link or board edge), and per transfer the seconds its route's
        busiest link takes to carry what all of them put on it and its summed hop latencies."""
        topo = self.topo
        nbytes = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), src.shape)
        transfer, links = topo.route_links(src, dst)
        if not links.size:
            return 0.0, np.zeros(src.size), np.zeros(src.size)
        load = np.bincount(links, weights=nbytes[transfer], minlength=topo.nodes * 6)
        seconds = load / topo.link_bw
        used = np.flatnonzero(load)
        group = topo.link_group[used]
        edge = used[group >= 0]
        if edge.size:  # a board edge's serial link(s) carry all its chip links' bytes
            per_group = np.bincount(topo.link_group[edge], weights=load[edge], minlength=topo.group_bw.size)
            seconds[edge] = np.maximum(seconds[edge], per_group[topo.link_group[edge]]
                                       / topo.group_bw[topo.link_group[edge]])
        route = np.zeros(src.size)
        np.maximum.at(route, transfer, seconds[links])
        latency = np.bincount(transfer, weights=topo.link_hop_s[links], minlength=src.size)
        return float(seconds.max()), route, latency

    def _chain(self, op: str, groups: np.ndarray) -> list:
        """The pipelined chain of every group at once, one affine cost per segment count.

        The message of ``n`` bytes flows down each chain in ``m`` segments (an all-reduce's
        finished segments flow back up at the same time; a reduce-scatter's leave the last rank
        for their owners as they finish). The links carry every segment once, so the stream
        takes the busiest link's (or board edge's) time for the whole message with all these
        transfers at once; the first segment takes every hop of its chain before the stream
        flows (the fill: each hop's busiest link's time for ``n / m`` bytes and its hop
        latencies), and every segment is one DMA (``dma_setup_cycles``) on every rank it
        passes. (Charging each of the ``m + c - 2`` steps the slowest hop's time and latency
        would make a chain that crosses a few slow board edges pay them on all its on-board
        hops.)"""
        g, c = groups.shape
        src, dst = groups[:, :-1].reshape(-1), groups[:, 1:].reshape(-1)
        sizes = np.full(src.size, _PROBE_BYTES)
        if op == "all_reduce":  # the reduce forward and the finished segments back, concurrently
            pairs, hops = (np.concatenate([src, dst]), np.concatenate([dst, src])), 2 * (c - 1)
            sizes = np.concatenate([sizes, sizes])
        else:
            pairs, hops = (src, dst), c - 1
        chain = sizes.size
        if op == "reduce_scatter":  # the last rank sends every other rank its shard
            last, owners = np.repeat(groups[:, -1], c - 1), groups[:, :-1].reshape(-1)
            pairs = (np.concatenate([pairs[0], last]), np.concatenate([pairs[1], owners]))
            sizes = np.concatenate([sizes, np.full(last.size, _PROBE_BYTES / c)])
        ways = 2 if op == "all_reduce" else 1
        lines = []
        for stream, route, latency in self._routings(pairs[0], pairs[1], sizes):
            # the fill: a segment's way along the slowest group's chain (both ways for an
            # all-reduce)
            fill = float(route[:chain].reshape(ways, g, c - 1).sum(axis=(0, 2)).max())
            lat = float(latency[:chain].reshape(ways, g, c - 1).sum(axis=(0, 2)).max())
            tail_s = tail_lat = 0.0
            if op == "reduce_scatter":
                # the last segment's way to its owner after the chain: a ``c / m`` share of its
                # shard's route (the whole shard where the segments are fewer than the owners)
                tail_s, tail_lat = float(route[chain:].max()), float(latency[chain:].max())
            lines += [((stream + fill / m + tail_s * min(1.0, c / m)) / _PROBE_BYTES,
                       lat + tail_lat + (m + hops) * self.dma_s, stream / _PROBE_BYTES) for m in _CHAIN_SEGMENTS]
        return lines

    def _routings(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> list:
        """The ways concurrent transfers may be routed, each as :meth:`_route_seconds` gives
        it: every transfer on its chip route; and where some cross between boards, those split
        over the edge-disjoint paths of boards (:meth:`_edge_seconds`; a chain hop that
        crosses a board edge need not take the one edge its chip route meets)."""
        out = [self._route_seconds(src, dst, sizes)]
        cross = src // self.per_board != dst // self.per_board
        if self.boards < 2 or not cross.any():
            return out
        edges = self._edge_seconds(src[cross] // self.per_board, dst[cross] // self.per_board, sizes[cross])
        if edges is None:
            return out
        stream, route, latency = (0.0, np.zeros(src.size), np.zeros(src.size))
        if not cross.all():
            stream, route[~cross], latency[~cross] = self._route_seconds(src[~cross], dst[~cross], sizes[~cross])
        route[cross], latency[cross] = edges[1], edges[2]
        out.append((max(stream, edges[0]), route, latency))
        return out

    def handover(self, src: np.ndarray, dst: np.ndarray, nbytes: float) -> float:
        """Seconds of the concurrent point-to-point transfers ``src[i] -> dst[i]``: each on its
        chip route (:func:`~tvm_spinn.timing.collectives.point_to_point`), or, where every
        transfer leaves its board, the cheaper of that and the boards' edge-disjoint paths
        (:meth:`_board_paths`)."""
        from ..timing.collectives import point_to_point

        if nbytes <= 0 or src.size == 0:
            return 0.0
        src, dst = self._pairs(src, dst)
        return self._get(("p2p", src.tobytes(), dst.tobytes(), float(nbytes)),
                         lambda: min(point_to_point(self.topo, src, dst, nbytes).seconds,
                                     self._board_paths(src, dst, float(nbytes))))

    def _pairs(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The transfers ``src[i] -> dst[i]`` a costing counts: the bound's first groups
        alone, else the pipeline window's (:meth:`_window`), as contiguous arrays."""
        pairs = np.stack([np.ascontiguousarray(src.reshape(-1)), np.ascontiguousarray(dst.reshape(-1))], axis=1)
        pairs = pairs[:_BOUND_GROUPS] if self.alone else self._window(pairs)
        return np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])

    def onboard(self, src: np.ndarray, dst: np.ndarray, nbytes: float) -> float:
        """Seconds the busiest *on-board* chip link takes to carry the concurrent transfers
        ``src[i] -> dst[i]`` of ``nbytes`` on their chip routes (the board-to-board links left
        out): the share of a hand-over that meets collectives confined to boards. A hand-over
        whose time is a board edge's (:meth:`_board_paths`) puts only this on the links such
        collectives use; one that stays on its board, all of it."""
        if nbytes <= 0 or src.size == 0:
            return 0.0
        src, dst = self._pairs(src, dst)

        def routed() -> np.ndarray:  # the transfers' on-board links, once per set of transfers
            _, links = self.topo.route_links(src, dst)
            return links[self.topo.link_group[links] < 0]

        def make() -> float:
            topo = self.topo
            inside = self._get(("onboard_links", key), routed)
            if not inside.size:
                return 0.0
            load = np.bincount(inside, weights=np.full(inside.size, float(nbytes)), minlength=topo.nodes * 6)
            return float((load / topo.link_bw).max())

        key = (src.tobytes(), dst.tobytes())
        return self._get(("onboard", *key, float(nbytes)), make)

    def on_boards(self, groups: np.ndarray) -> bool:
        """Whether every group's ranks lie on one board (its collectives leave the board-to-board
        links free)."""
        boards = np.asarray(groups).reshape(len(groups), -1) // self.per_board
        return bool((boards == boards[:, :1]).all())

    def _board_paths(self, src: np.ndarray, dst: np.ndarray, nbytes: float) -> float:
        """Seconds of transfers that all leave their boards, the bytes from each board to each
        other board split over the edge-disjoint paths of boards between the two
        (:meth:`~tvm_spinn.target.topology.Topology.board_paths`, shares by
        :func:`~tvm_spinn.timing.collectives.water_fill` as
        :func:`~tvm_spinn.timing.collectives.multipath_point_to_point` splits one transfer):
        the shares of all board pairs at once load the board edges, the busiest edge binds
        (the chip links on either side outrun a board edge), plus the longest used path's
        latency. ``inf`` where a transfer stays on its board."""
        a, b = src // self.per_board, dst // self.per_board
        if self.boards < 2 or (a == b).any():
            return math.inf
        found = self._edge_seconds(a, b, np.full(src.size, nbytes))
        return math.inf if found is None else found[0] + float(found[2].max())

    def _edge_seconds(self, a: np.ndarray, b: np.ndarray, sizes: np.ndarray):
        """Transfers from board ``a[i]`` to another board ``b[i]`` of ``sizes[i]`` bytes, each
        board pair's bytes split over its edge-disjoint board paths (:meth:`_board_paths`):
        ``(busiest edge's seconds, per transfer its pair's busiest used edge's seconds and its
        longest used path's latency)``, or None where two boards have no path."""
        from ..target.topology import edge_rate

        keys, at = np.unique(a * self.boards + b, return_inverse=True)  # board pairs
        totals = np.bincount(at, weights=sizes)
        load = np.zeros(self.boards * 6)
        used, lats = [], np.zeros(keys.size)
        for p, (key, total) in enumerate(zip(keys.tolist(), totals.tolist())):
            split = self._get(("edge_split", key, total), lambda: self._pair_split(key, total), self.paths)
            if split is None:
                return None
            edges, parts, lats[p] = split
            # the paths are edge-disjoint (no edge twice in ``edges``): one scatter adds each
            # edge's share as the path-by-path additions would
            load[edges] += parts
            used.append(edges)
        rate = edge_rate(self.topo)
        seconds = np.divide(load, rate, out=np.zeros_like(load), where=rate > 0)
        pair = np.array([seconds[e].max() for e in used])
        return float(seconds.max()), pair[at], lats[at]

    def _pair_split(self, key: int, total: float):
        """One board pair's ``total`` bytes over its board paths (:meth:`_edge_seconds`):
        ``(the used paths' edge ids, each edge's bytes, the longest used path's latency)``, or
        None where the boards have no path. The paths' edges are found once per pair and the
        bytes' shares once per displacement and bytes: the search meets the same pairs and
        bytes in split after split."""
        from ..timing.collectives import water_fill

        paths, rates, lat, edges, path_of, disjoint = self._get(
            ("pair_edges", key), lambda: self._pair_edges(*self._paths(*divmod(key, self.boards))), self.paths)
        if not paths:
            return None
        _, share = self._get(("fill", tuple(rates), tuple(lat), total), lambda: water_fill(rates, lat, total),
                             self.paths)
        used = share > 0
        latency = max(l for l, u in zip(lat, used.tolist()) if u)
        if disjoint:
            keep = used[path_of]
            return edges[keep], share[path_of][keep], latency
        load = np.zeros(self.boards * 6)  # paths that share an edge: add path by path
        for path, part in zip(paths, share):
            if part > 0:
                load[path] += part
        edges = np.flatnonzero(load)
        return edges, load[edges], latency

    @staticmethod
    def _pair_edges(paths, rates, lat) -> tuple:
        """A board pair's :meth:`_paths` and ``(every path's edge ids one after another, each
        edge's path, whether no edge is on two paths)``."""
        if not paths:
            return paths, rates, lat, None, None, False
        edges = np.concatenate(paths)
        path_of = np.repeat(np.arange(len(paths)), [len(p) for p in paths])
        return paths, rates, lat, edges, path_of, np.unique(edges).size == edges.size

    def _paths(self, x: int, y: int) -> tuple:
        """``(edge ids of each board path from board x to board y, their rates, latencies)``.
        The torus of boards looks the same from every board (unless some fault breaks it), so
        the paths and their costs are found once per displacement, from board 0, and moved."""
        topo = self.topo
        if topo.faulty:
            return self._get(("board_paths", x, y), lambda: self._costed_paths(x, y), self.paths)
        bx, by = topo.grid
        dx, dy = (y % bx - x % bx) % bx, (y // bx - x // bx) % by
        paths, rates, lats = self._get(("board_paths_by", dx, dy), lambda: self._costed_paths(0, dx + bx * dy),
                                       self.paths)
        sx, sy = x % bx, x // bx
        moved = [((path // 6 % bx + sx) % bx + bx * ((path // 6 // bx + sy) % by)) * 6 + path % 6 for path in paths]
        return moved, rates, lats

    def _costed_paths(self, x: int, y: int) -> tuple:
        paths = self.topo.board_paths(x, y)
        costs = [self.topo.path_cost(p) for p in paths]
        return [np.asarray(p, dtype=np.int64) for p in paths], [c[0] for c in costs], [c[1] for c in costs]


#: Share of every PE's tile SRAM that may hold resident weights: the mapping's memory ledger
#: share (``tvm_spinn.mapping.memory.LEDGER_RESIDENT_SHARE``, which the training layer may not
#: import; a test keeps the two equal)
RESIDENT_SHARE = 0.5


def _resident_share(arch) -> float:
    """SRAM bytes a chip keeps for resident weights (:data:`RESIDENT_SHARE` of every PE's tile
    SRAM, as the mapping's memory plans leave it)."""
    return RESIDENT_SHARE * arch.pes_per_chip * arch.tile_sram_bytes


def _landing(tp: int, heads: int) -> np.ndarray:
    """The head rank each of ``tp`` block ranks hands its share to: spread evenly over the
    head's ranks (so over its boards), round robin where there are fewer of them."""
    t = np.arange(tp)
    return t * heads // tp if heads >= tp else t % heads


def _tp_reductions(spec, tokens: int, tp: int, tp_groups: np.ndarray, comms: "_Comms", arch, sp: bool) -> dict:
    """One layer's reductions over the sharded axes in the canonical order
    (:func:`~tvm_spinn.training.tp_chain.layer_reductions`), per pass: the collectives' seconds
    and busy seconds over every TP group at once (``"forward_s"``, ``"forward_busy"``, ...: with
    sequence parallelism an all-gather of the block's input and a reduce-scatter of each
    reduction's leaves, else an all-reduce; the chain or the direct algorithm, each rank's
    ``leaves / tp`` leaves added one by one) and a rank's seconds adding its leaves to the running
    sums on its cores (``"forward_add_s"``, ``"backward_add_s"``). With more ranks than key/value
    heads the backward also all-reduces each replicated head's key and value gradients over its
    replicas (:func:`~tvm_spinn.training.tp_chain.group_sum`). The GEMMs are the ranks' parallel
    ``1 / tp`` shares, as in Megatron's split."""
    from .tp_chain import kv_replicas, layer_reductions

    h, i, q, kv = _widths(spec)
    act = F32 * tokens * spec.hidden
    add_s = arch.m4f_elementwise_cycles / (arch.pes_per_chip * arch.clock_hz)

    def make():
        out = {f"{p}_{k}": 0.0 for p in ("forward", "backward") for k in ("s", "busy", "add_s")}
        gather = comms.collective_parts("all_gather", tp_groups, act) if sp else (0.0, 0.0)
        for kind, m, _, n, leaves, _ in layer_reductions(spec.family, h, q, kv, i, tokens, spec.heads,
                                                         spec.kv_heads):
            per_rank = leaves // tp  # every admissible tp divides the leaves (:func:`.tp_chain.admissible_tp`)
            s, busy = comms.collective_parts("reduce_scatter" if sp else "all_reduce", tp_groups, F32 * m * n,
                                             per_rank)
            out[f"{kind}_s"] += s
            out[f"{kind}_busy"] += busy
            out[f"{kind}_add_s"] += per_rank * m * n * add_s
        replicas = kv_replicas(spec.kv_heads, tp)
        if replicas > 1:
            # a replicated key/value head: the gradients of its keys and values (every token, one
            # head's features) summed over its replicas in rank order and returned to each
            # (:func:`.tp_chain.group_sum`), one all-reduce each over every head's replicas at once;
            # a chain in the reproducible mode (each replica adds its query head's term in turn: no
            # pre-added partial sum exists to send directly)
            heads = tp_groups.reshape(-1, replicas)
            for _ in ("keys", "values"):
                s, busy = comms.collective_parts("all_reduce", heads, F32 * tokens * spec.head_dim, chain=True)
                out["backward_s"] += s
                out["backward_busy"] += busy
        # an all-gather before each of the forward's two reductions (the block's input, the MLP's
        # input) and each of the backward's two (the inputs its weight gradients read)
        for kind in ("forward", "backward"):
            out[f"{kind}_s"] += 2 * gather[0]
            out[f"{kind}_busy"] += 2 * gather[1]
        return out

    return comms._get(("tp_reductions", spec.family, h, i, q, kv, spec.heads, spec.kv_heads, tokens, tp, sp,
                       tp_groups.shape, tp_groups.tobytes()), make)


def _slot_seconds(f_s: float, b_s: float, tp_f: float, tp_b: float, pp_s: float, overlap: bool,
                  pp_shared: "float | None" = None, tp_busy: "float | None" = None, w_s: float = 0.0) -> float:
    """Seconds of one stage's pipeline slot: its forward and backward passes (``f_s``, ``b_s``
    of compute), the TP collectives each waits for (``tp_f``, ``tp_b``) and the stage's
    hand-overs (``pp_s``, by DMA, on the links the collectives use).

    Without ``overlap`` (one slot: its backward waits for its forward) the passes and their
    collectives run one after the other and the hand-overs under the compute. With it (the
    forward of one slot and the backward of another, independent, as 1F1B pairs them) the PEs
    and the links are two resources that both passes share: the slot takes the busier
    resource, or the longer pass with its own collectives (each pass's GEMMs wait for the
    collective before them), whichever is longer.

    ``pp_shared`` is the part of the hand-overs' time on the links the collectives use (default:
    all of it). Where the collectives stay on their boards and the hand-overs' time is the
    board edges' (a stage boundary between boards), the two load different links: the links
    then take the longer of the board edges' time (``pp_s``) and the on-board links' (the
    collectives and the hand-overs' on-board legs).

    ``tp_busy`` is the part of the collectives' time their links carry bytes (default: all of
    it): the rest (hop latencies, DMA set-ups, a chain's fill) holds back the pass that waits
    for the collective, not the other pass's transfers on the links.

    ``w_s`` is the backward's weight-gradient GEMMs' time: no later GEMM of the pass reads
    them, so the backward's collectives (the input gradients' reductions, the inputs gathered
    for the weight gradients) run while the PEs compute them (Megatron-LM's overlap of the
    tensor-parallel backward communication with the weight-gradient GEMMs, Narayanan et al.
    2021): the backward waits for the part of its collectives longer than they."""
    shared = pp_s if pp_shared is None else min(pp_s, pp_shared)
    if not overlap:
        return tp_f + tp_b - min(tp_b, w_s) + max(f_s + b_s, pp_s)
    busy = tp_f + tp_b if tp_busy is None else min(tp_f + tp_b, tp_busy)
    return max(f_s + b_s, busy + shared, pp_s, f_s + tp_f, b_s + tp_b - min(tp_b, w_s))


def _step_time(spec, split: Split, seq: int, optimizer: str, arch, comms: _Comms) -> StepTime:
    tp, pp, dp, heads = split.tp, split.pp, split.dp, split.head_tp
    m, slots, stages = split.micro_batches, split.slots, split.stages
    tokens = split.micro_batch * seq // split.chunks  # one pipeline slot's
    dram = arch.dram_bw_bytes_s
    layers = spec.layers // pp
    act = F32 * tokens * spec.hidden  # the residual stream
    grid = split.grid()
    # every TP group of every stage and replica runs its collective of a slot at once
    tp_groups = grid.reshape(tp, -1).T
    sp = split.sequence_parallel and tp > 1
    # Megatron's all-reduce of a block's output; with sequence parallelism an all-gather before
    # the block and a reduce-scatter after it (the same bytes on the links)
    if sp:
        ar, ar_busy = np.add(comms.collective_parts("all_gather", tp_groups, act),
                             comms.collective_parts("reduce_scatter", tp_groups, act))
    else:
        ar, ar_busy = comms.collective_parts("all_reduce", tp_groups, act)
    # every stage boundary of every replica hands over at once (forward one way, backward back)
    hand = 0.0
    hand_src = hand_dst = np.zeros(0, np.int64)
    if pp > 1:
        src, dst = grid[:, :-1, :], grid[:, 1:, :]
        hand_src = np.concatenate([src.reshape(-1), dst.reshape(-1)])
        hand_dst = np.concatenate([dst.reshape(-1), src.reshape(-1)])
        hand = comms.handover(hand_src, hand_dst, act / tp if sp else act)
    # collectives confined to boards and hand-overs between boards meet on the on-board links
    # only (the hand-overs' legs to the board edges): see _slot_seconds
    tp_local = comms.on_boards(tp_groups)
    hand_on = comms.onboard(hand_src, hand_dst, act / tp if sp else act) if pp > 1 and tp_local else hand
    head_grid = split.head_grid()
    head_fwd = head_bwd = head_rs = head_ag = 0.0
    from .tp_chain import kv_replicas, vocab_leaves

    v_leaves = vocab_leaves(spec.heads, spec.intermediate, spec.vocab)

    def vocab_per(width: int) -> int:
        """Leaves of the vocabulary the busiest rank of ``width`` adds one by one (reproducible
        mode)."""
        return max(1, -(-v_leaves // width)) if comms.reproducible else 1

    # one block's GEMMs on a rank (forward, input gradients, weight gradients), of them the
    # weights' gradients; the LM head's for ``rows`` vocabulary rows on a rank
    weights, attention = _block_gemms(spec, tokens, seq, tp, split.micro_batch)
    block_s = _pass_seconds(arch, weights + attention, comms)
    weights_s = _pass_seconds(arch, weights, comms)[2]

    def head_s(rows: int) -> tuple:
        return _pass_seconds(arch, [(tokens, spec.hidden, rows, 1)], comms)

    spread = split.spread_head
    spread_busy = spread_path = 0.0
    if spread:
        # the head spread over every chip of the replica's stages: each slot's final hidden
        # states (the last stage's shares) all-gathered onto every rank, the loss' three scalars
        # a token chained over the ranks in the vocabulary's order, the input gradient reduced
        # over the ranks in the leaves' order and the shares handed to the last stage's ranks;
        # every replica at once. The blocks' passes do not wait for them (the last stage runs
        # :attr:`Split.head_lag` slots ahead of the head's passes): the links carry their bytes, and
        # a slot's path through them is crossed once in the fill and drain
        ranks = split.head_ranks()
        width = tp * pp
        last = np.ascontiguousarray(grid[:, pp - 1, :].T).reshape(-1)  # replica-major
        mine = ranks[:, _landing(tp, width)].reshape(-1)
        s_ag = comms.collective_parts("all_gather", ranks, act)
        s_loss = comms.collective_parts("all_reduce", ranks, 3 * F32 * tokens, chain=True)
        s_rs = comms.collective_parts("reduce_scatter", ranks, act, vocab_per(width))
        s_back = comms.handover(mine, last, act / tp)
        spread_busy = s_ag[1] + s_loss[1] + s_rs[1] + s_back
        spread_path = s_ag[0] + s_loss[0] + s_rs[0] + s_back
        spread_head_s = sum(head_s(_vocab_rows(spec, width)))  # a rank's passes of the head's GEMMs

    if heads:
        # the head's stage: every rank reads the slot's hidden states whole: each rank of the
        # last block stage hands its share to one head rank, which all-gather them (forward);
        # the ranks' partial input gradients (each rank's share of the vocabulary) are
        # reduce-scattered in rank order and the shares handed back (backward); the loss'
        # three scalars a token all-reduced over the ranks
        last = np.ascontiguousarray(grid[:, pp - 1, :].T).reshape(-1)  # replica-major
        mine = head_grid[:, _landing(tp, heads)].reshape(-1)
        head_fwd = comms.handover(last, mine, act / tp)
        head_ag, head_ag_busy = comms.collective_parts("all_gather", head_grid, act)
        # the reductions over the vocabulary in the canonical order: a piece a leaf (direct)
        head_rs, head_rs_busy = comms.collective_parts("reduce_scatter", head_grid, act, vocab_per(heads))
        head_bwd = comms.handover(mine, last, act / tp)
        # the head's hand-overs both ways at once, and with the other stages' where they move
        # as many bytes a transfer: they run concurrently on the links they share
        head_io = min(head_fwd + head_bwd, comms.handover(np.concatenate([last, mine]),
                                                          np.concatenate([mine, last]), act / tp))
        last_io = hand + head_io
        if pp > 1 and (sp or tp == 1):
            last_io = min(last_io, comms.handover(np.concatenate([hand_src, last, mine]),
                                                  np.concatenate([hand_dst, mine, last]), act / tp))
        head_loss, head_loss_busy = comms.collective_parts("all_reduce", head_grid, 3 * F32 * tokens, chain=True)
        both = (np.concatenate([last, mine]), np.concatenate([mine, last]))
        head_local = comms.on_boards(head_grid)
        head_io_on = comms.onboard(*both, act / tp) if head_local or tp_local else head_io
        last_on = hand_on + head_io_on if tp_local else last_io
        head_io_on = head_io_on if head_local else head_io
    rows_io = rows_on = 0.0
    if (heads or spread) and spec.tied_embeddings:
        # the tied table's only copy is on the head's stage (or spread with the head over the
        # replica's chips): it hands the first stage the rows of each slot's tokens as the
        # pipeline runs and takes their gradients back after the slot's backward (one slot's
        # rows each way a slot, beside the first stage's hand-overs; a spread table's rows come
        # from chips all over the replica, here from ``tp`` of them spread evenly)
        rows_src = (mine if spread else head_grid[:, _landing(tp, heads)].reshape(-1))
        rows_dst = np.ascontiguousarray(grid[:, 0, :].T).reshape(-1)
        slot_rows = F32 * tokens * spec.hidden / (tp if sp else 1)
        both = (np.concatenate([rows_src, rows_dst]), np.concatenate([rows_dst, rows_src]))
        rows_io = comms.handover(*both, slot_rows)
        rows_on = comms.onboard(*both, slot_rows) if tp_local else rows_io
    # reproducible TP: the GEMMs that reduce over a sharded axis run in the compiled step's
    # canonical order (:mod:`.tp_chain`): the ranks' leaves at once (the parallel shares the
    # block's FLOPs count), each rank adding its leaves to the running sums one by one, and a
    # fixed-order reduce-scatter (or all-reduce) a reduction, every TP group at once
    canon = _tp_reductions(spec, tokens, tp, tp_groups, comms, arch, sp) if comms.reproducible and tp > 1 else None
    # Megatron's split with more ranks than key/value heads: each replicated head's key and value
    # gradients all-reduced over its replicas (the reproducible mode counts them in ``canon``)
    kv_r = kv_replicas(spec.kv_heads, tp)
    kv_ar = (comms.collective_parts("all_reduce", tp_groups.reshape(-1, kv_r), F32 * tokens * spec.head_dim)
             if kv_r > 1 and canon is None else (0.0, 0.0))
    resident = _resident_share(arch)
    add_s = arch.m4f_elementwise_cycles / (arch.pes_per_chip * arch.clock_hz)  # one fp32 addition a chip
    per_stage = {}
    for stage in _costed_stages(split):
        params = _stage_params(spec, tp, pp, stage, heads, spread)
        # the GEMMs' weights, read in every pass; the gathered tables' rows of the slot's tokens
        streamed = params - _gathered_params(spec, split, stage)
        # bytes of the embedding rows (GPT-2's token and position rows) a slot's tokens read
        rows = F32 * tokens * spec.hidden * (2 if spec.family == "gpt2" else 1) if stage == 0 else 0
        held = _stage_activations(spec, split, seq, stage, split.recompute)
        stored = held // max(1, _inflight(split, stage))
        # the GEMMs at the product's cost (:func:`~tvm_spinn.timing.gemm.gemm_seconds`): the backward computes each
        # GEMM's input gradient and its weight gradient (its other operand's, for attention);
        # a recomputing backward runs the forward once more
        if heads and stage == pp:
            f_gemm = b_gemm = w_gemm = 0.0
            width = heads
        else:
            width = tp
            f_gemm = layers * block_s[0]
            b_gemm = layers * (block_s[1] + block_s[2] + (block_s[0] if split.recompute else 0.0))
            w_gemm = layers * weights_s  # the weight-gradient GEMMs, which no later GEMM of the pass reads
        if spread:  # every rank its share of the head's GEMMs
            width, head_rows = tp * pp, _vocab_rows(spec, tp * pp)
        else:
            head_rows = -(-spec.vocab // width) if stage == stages - 1 else 0
        if head_rows:  # the LM head's vocabulary rows on this rank
            h_f, h_d, h_w = head_s(head_rows)
            f_gemm, b_gemm, w_gemm = f_gemm + h_f, b_gemm + h_d + h_w, w_gemm + h_w
        # DRAM: activations written in the forward and read back in the backward; the weights
        # read in each pass and the gradients accumulated (read and written), unless they and
        # the gradients fit the chip's resident SRAM share: then they stay there from the
        # first slot to the update (loaded and written back once a step, with the update)
        passes = 2 + split.recompute
        fits = 2 * F32 * streamed <= resident
        dram_f = (stored + rows + (0 if fits else F32 * streamed)) / dram
        dram_b = (stored + 2 * rows + (0 if fits else F32 * streamed * (passes - 1) + 2 * F32 * streamed)) / dram
        rc = split.recompute
        if canon is not None and not (heads and stage == pp):  # the leaves' additions on the cores
            f_gemm += layers * canon["forward_add_s"]
            b_gemm += layers * (canon["backward_add_s"] + rc * canon["forward_add_s"])
        if comms.reproducible and (stage == stages - 1 or spread) and width > 1:
            # the head's input gradient: a rank adds its vocabulary leaves to the running sums
            b_gemm += vocab_per(width) * tokens * spec.hidden * add_s
        f_s, b_s = max(f_gemm, dram_f), max(b_gemm, dram_b)
        waits = dram_f > f_gemm or dram_b > b_gemm
        if heads and stage == pp:
            tp_f, tp_b, pp_s, pp_on = head_ag + head_loss, head_rs, head_io, head_io_on
            busy = head_ag_busy + head_loss_busy + head_rs_busy
        else:
            # + the vocab-parallel embedding's; a tied table on the head's stage hands the
            # first stage the rows of its tokens instead (no reduction over its ranks)
            lookup = stage == 0 and not ((heads or spread) and spec.tied_embeddings)
            n_f = (2 + (2 if split.recompute else 0)) * layers + lookup
            tp_f, tp_b = n_f * ar, 2 * layers * (ar + kv_ar[0])
            busy = (n_f + 2 * layers) * ar_busy + 2 * layers * kv_ar[1]
            if canon is not None:  # the layers' reductions in the canonical order
                tp_f = (1 + rc) * layers * canon["forward_s"] + lookup * ar
                tp_b = layers * canon["backward_s"]
                busy = (layers * ((1 + rc) * canon["forward_busy"] + canon["backward_busy"]) + lookup * ar_busy)
            if stage == pp - 1 and tp > 1 and not heads and not spread:  # vocab-parallel head: its input gradient, the loss' scalars
                loss, loss_busy = comms.collective_parts("all_reduce", tp_groups, 3 * F32 * tokens, chain=True)
                grad, grad_busy = (np.add(comms.collective_parts("all_gather", tp_groups, act),
                                          comms.collective_parts("reduce_scatter", tp_groups, act, vocab_per(tp)))
                                   if sp else comms.collective_parts("all_reduce", tp_groups, act, vocab_per(tp)))
                tp_b += grad + loss
                busy += grad_busy + loss_busy
            pp_s, pp_on = (last_io, last_on) if heads and stage == pp - 1 else (hand, hand_on)
            if stage == 0:
                pp_s, pp_on = pp_s + rows_io, pp_on + rows_on
            busy += spread_busy  # a spread head's collectives on every rank's links
        # a slot's hand-overs run by DMA during its compute (1F1B sends one micro-batch's
        # activations while it computes the next) and share the links with its TP collectives;
        # with more than one slot, 1F1B's steady state pairs the forward of one slot with the
        # backward of another, which do not depend on each other: the PEs compute one while the
        # links carry the other's collectives (each pass waits for its own collectives, and
        # the links carry all of them and the hand-overs)
        hides = min(w_gemm, b_s / 2)  # the weight-gradient GEMMs that the backward's collectives run under
        total = _slot_seconds(f_s, b_s, tp_f, tp_b, pp_s, overlap=slots > 1, pp_shared=pp_on, tp_busy=busy,
                              w_s=hides)
        # a spread head's path (its collectives; its GEMMs are in this stage's compute) of one
        # slot overlaps the next head_lag slots
        total = max(total, spread_path / max(1, split.head_lag))
        path = total
        if heads and stage == pp and split.head_lag and slots > 1:
            # a head stage behind the last block stage (Split.head_lag): its passes wait for no
            # collective (the PEs and the links are the resources, as in _slot_seconds); one
            # slot's path (passes and collectives in series) spreads over the lag and is crossed
            # once in the fill and drain
            chain = f_s + tp_f + b_s + tp_b
            total = max(f_s + b_s, min(tp_f + tp_b, busy) + min(pp_s, pp_on), pp_s, chain / split.head_lag)
            path = max(total, chain)
        fill, drain_s = total, b_s
        if split.zero_bubble and slots > 1:
            # ZB-H1 (Qi et al. 2024): the weight-gradient passes leave the backward's path across
            # the stages and fill the idle time of the fill and drain, which then take
            # ``F + B - W`` of the stage rather than its slot ``F + B + W``; the backward's
            # collectives that ran under those GEMMs are on the path again. A backward that waits
            # on DRAM saves nothing (its time is the traffic's, not the GEMMs')
            w = 0.0 if dram_b > b_gemm else w_gemm
            fill = max(f_s + b_s - w, total - 2 * w + min(tp_b, hides))
            drain_s = b_s - w
        per_stage[stage] = dict(total=total, path=path, comp=f_s + b_s, tp=tp_f + tp_b, pp=pp_s, waits=waits,
                                drain=drain_s, params=streamed, fits=fits, fill=fill, comp_fill=min(f_s + b_s, fill))
    slowest = max(per_stage.values(), key=lambda st: st["total"])
    per = slowest["total"]
    # 1F1B with stages of unequal slots: the slowest stage paces the slots, and the first slot's
    # forward and the last slot's backward pass every stage at that stage's own pace, so the
    # fill and drain take each stage's slot once (the middle block stages are the last block
    # stage's but for the head's hand-overs: its slot bounds theirs) rather than the slowest's
    own = [0] + [pp - 1] * (pp - 1) + ([pp] if stages > pp else [])

    def over_pipeline(key: str, fill: "str | None" = None) -> float:  # a slot's part, over the slots as paced
        return (slots - 1) * slowest[key] + sum(per_stage[j][fill or key] for j in own)

    # the fill and drain cross a lagged head stage's whole path of one slot; a spread head's
    # passes of the first slot and the last (its collectives and the head's forward and backward
    # on one rank) once more
    pipeline = (over_pipeline("total", "fill")
                + sum(per_stage[j]["path"] - per_stage[j]["total"] for j in sorted(set(own)))
                + (spread_path + spread_head_s if spread else 0.0))
    # the drain of 1F1B: stage j runs its last backward j backward passes before the first
    # stage ends (each at least the slowest stage's backward compute: the drain's pace), so
    # its gradient synchronisation and update start that much earlier
    drain = max(st["drain"] for st in per_stage.values())
    tied = 0.0
    if spec.tied_embeddings and (pp > 1 or heads):
        rows = F32 * (split.micro_batch * m * seq) * spec.hidden / (tp if sp else 1)
        first = grid[:, 0, :].reshape(-1)
        if heads or spread:
            # the head's stage keeps the only copy and streams each slot's token rows to the
            # first stage and their gradients back during the pipeline (the slots' hand-overs
            # above): the first slot's rows before it, the last slot's gradients after it
            tied = 2 * comms.handover(rows_src, rows_dst, slot_rows)
        else:
            # the tied table on the first and last stage: Megatron all-reduces its two
            # gradients, or the last stage keeps the only copy and hands the rows of the
            # replica's tokens to the first and their gradients back; the cheaper
            table = F32 * -(-spec.vocab // tp) * spec.hidden
            last = grid[:, pp - 1, :].reshape(-1)
            tied = min(comms.collective("all_reduce", np.stack([first, last], axis=1), table),
                       2 * comms.handover(last, first, rows))
    # gradient synchronisation over the replicas (ZeRO-2 keeps only its shard of the gradients:
    # reduce-scattered after every micro-batch) and the update
    def update(params: int, stage: int) -> float:
        shard = -(-params // dp) if split.zero >= 1 else params
        seconds = max(_UPDATE_BYTES[optimizer] * shard / dram, _UPDATE_OPS[optimizer] * shard
                      * arch.m4f_elementwise_cycles / (arch.pes_per_chip * arch.clock_hz))
        streamed = params - _gathered_params(spec, split, stage)
        if 2 * F32 * streamed <= resident:
            seconds += 2 * F32 * streamed / dram  # the resident weights loaded, their gradients written back
        return seconds

    def sync(groups: np.ndarray, params: int) -> float:
        if split.zero == 0:
            return comms.collective("all_reduce", groups, F32 * params)
        scatters = m if split.zero == 2 else 1
        return (scatters * comms.collective("reduce_scatter", groups, F32 * params)
                + comms.collective("all_gather", groups, F32 * params))

    # the block stages end within the drain of each other: their groups synchronise at once (the
    # largest stage's bytes), as the first stage ends; the tied table's synchronisation too
    block = [(_stage_params(spec, tp, pp, j, heads, spread), j) for j in sorted({0, pp - 1})]
    if split.zero == 0 and stages > 1 and slots > 1:
        # bucketed: each block stage's gradients all-reduced as its last backward completes
        # them and each bucket updated as its reduction ends (:func:`_bucket_tail`)
        # block stage j's last backward ends j backward passes before the first stage's (at
        # least the block stages' backward each)
        pace = min(per_stage[j]["drain"] for _, j in block)
        tail = max((_bucket_tail(spec, split, seq, optimizer, arch, comms, j, n, per_stage[j],
                                 -j * pace, weights, pipeline - slots * per_stage[0]["total"]) for n, j in block),
                   key=sum)
        tail = (max(tail[0], tied), tail[1])
    else:
        dp_blocks = sync(grid.reshape(-1, dp), max(n - _untouched_rows(spec, seq, j) for n, j in block))
        tail = (max(dp_blocks, tied), max(update(n, j) for n, j in block))
    hidden = 0.0
    if heads:
        # the head's stage, last of the pipeline, ends ``pp`` backward passes before the first
        params = _stage_params(spec, tp, pp, pp, heads)
        dp_head = sync(np.ascontiguousarray(head_grid.T), params)
        head_tail = (max(0.0, dp_head - pp * drain, tied), update(params, pp))
        if sum(head_tail) > sum(tail):
            tail = head_tail
        hidden = min(dp_head, pp * drain)
    dp_exposed, opt_s = tail
    return StepTime(pipeline_s=pipeline, bubble_s=pipeline - slots * per, compute_s=over_pipeline("comp", "comp_fill"),
                    tp_comm_s=over_pipeline("tp"), pp_comm_s=over_pipeline("pp"), dp_comm_s=dp_exposed,
                    optimizer_s=opt_s, dram_bound=slowest["waits"], dp_hidden_s=hidden,
                    stages_s=tuple((j, st["comp"], st["tp"], st["pp"], st["total"])
                                  for j, st in sorted(per_stage.items())))


# ------------------------------------------------------------------------------------ search
def _update_seconds(arch, optimizer: str, params: float) -> float:
    """One update of ``params`` parameters on a chip: its DRAM traffic or its element-wise work
    on the M4F cores, whichever is longer."""
    return max(_UPDATE_BYTES[optimizer] * params / arch.dram_bw_bytes_s,
               _UPDATE_OPS[optimizer] * params * arch.m4f_elementwise_cycles / (arch.pes_per_chip * arch.clock_hz))


def _bucket_tail(spec, split: Split, seq: int, optimizer: str, arch, comms: "_Comms", stage: int, params: int,
                 slot: dict, offset: float, weights: list, idle: float) -> tuple:
    """``(exposed synchronisation s, exposed update s)`` of block stage ``stage`` after the
    pipeline ends (ZeRO-0): its gradients all-reduced in buckets as the stage's last backward
    completes them, and each bucket updated as its reduction ends.

    The buckets, in the order the last backward completes them: each layer's projections (the
    last layer first; in a layer the backward's order, the last GEMM first; the layer's norms and
    biases with its first GEMM), then the stage's gathered tables' rows (embedding rows; the
    embedding's backward is the pass's last op). A projection's gradient is final when its
    weight-gradient GEMM of the last slot ends: the backward's time (``slot["drain"]``) is shared
    out over the GEMMs in proportion to their modelled time (the input and weight gradients';
    with ZB-H1's deferred weight-gradient pass the tables' rows are final at the end of the
    input-gradient pass, the projections one weight-gradient GEMM after another).

    The stage ends its last backward ``-offset`` seconds before the pipeline (the drain's
    pace, as for a head stage). Every bucket's all-reduce runs on the links, one after another,
    with every block stage's data-parallel groups at once (they share the links they meet);
    its update on the stage's cores, which are free once the stage's last pass ends. The
    tables' rows no step touches (GPT-2's positions from ``seq`` on) have a zero gradient:
    their update does not wait for the reduction, and runs in the stage's ``idle`` time within
    the pipeline (the fill and drain it waits through), what does not fit it at the end.
    The reduction's order per element is the chain's, whatever the buckets: no bit moves."""
    tp, pp, dp = split.tp, split.pp, split.dp
    layers = spec.layers // pp
    groups = split.grid().reshape(-1, dp)
    def seconds(m, k, n, b):  # as :func:`_pass_seconds` prices (and caches) them
        return comms._get(("gemm", m, k, n, b), lambda: gemm_seconds(arch, m, k, n, b))

    # each projection: (its input and weight gradients' seconds, its parameters, its weight gradient's)
    secs = [(seconds(m, n, k, b) + seconds(k, m, n, b), k * n * b, seconds(k, m, n, b)) for m, k, n, b in weights]
    per_layer = _layer_params(spec, tp)
    extra = per_layer - sum(n for _, n, _ in secs)  # norms and biases, with the layer's first GEMM
    tables = max(0, params - layers * per_layer)
    untouched = _untouched_rows(spec, seq, stage)
    deferred = split.zero_bubble
    total_t = layers * sum((w if deferred else t) for t, _, w in secs) or 1.0
    span = slot["drain"] if not deferred else min(slot["drain"], layers * sum(w for _, _, w in secs))
    buckets = []  # (ready s relative to the stage's end, parameters)
    done = 0.0
    for layer in range(layers):  # the last layer's backward first
        for g, (t, n, w) in reversed(list(enumerate(secs))):
            done += (w if deferred else t)
            n = n + (extra if g == 0 else 0)
            buckets.append((-span * (1 - done / total_t), n))
    buckets.append((-span if deferred else 0.0, tables - untouched))  # the tables' touched rows
    buckets.sort(key=lambda b: b[0])  # reduced in the order they are ready (stable: ties in the pass's order)
    link, cores = -math.inf, 0.0  # the cores compute the stage's passes until its end
    for ready, n in buckets:
        if n <= 0:
            continue
        start = max(ready, link)
        link = start + comms.collective("all_reduce", groups, F32 * n)
        cores = max(link, cores) + _update_seconds(arch, optimizer, n)
    cores += max(0.0, _update_seconds(arch, optimizer, untouched) - idle)
    streamed = params - _gathered_params(spec, split, stage)
    if 2 * F32 * streamed <= _resident_share(arch):
        cores += 2 * F32 * streamed / arch.dram_bw_bytes_s  # the resident weights loaded, gradients written back
    sync_end = max(0.0, link + offset)
    return sync_end, max(0.0, cores + offset - sync_end)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _positive(name: str, value, allow_none: bool = True):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise TrainingPlanError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _axes(spec, global_batch: int, tp, pp, dp, micro_batch):
    """The sizes each axis may take; a given size that does not divide is an error naming the
    axis, what it must divide and the sizes that would work."""
    from .tp_chain import admissible_tp, canonical_leaves

    # the widths the compiled step builds (one rule for both: :func:`.tp_chain.admissible_tp`)
    tp_ok = admissible_tp(spec.heads, spec.kv_heads, spec.intermediate, spec.head_dim)
    _, qkv_leaves = canonical_leaves(spec.heads, spec.kv_heads, spec.intermediate, spec.head_dim)
    pp_ok = _divisors(spec.layers)
    dp_ok = _divisors(global_batch)
    for name, value, ok, what in (
            ("tp", tp, tp_ok, f"the attention heads ({spec.heads}) and the intermediate size "
                              f"({spec.intermediate}), or is neither a divisor nor a multiple of the key/value "
                              f"heads ({spec.kv_heads}), or does not divide the {qkv_leaves} leaves of the "
                              f"query/key/value input gradient (of {spec.kv_heads} x {spec.head_dim} key/value "
                              "features)"),
            ("pp", pp, pp_ok, f"the layers ({spec.layers})"),
            ("dp", dp, dp_ok, f"the global batch ({global_batch} sequences)")):
        if value is not None and value not in ok:
            raise TrainingPlanError(f"{name}={value} does not divide {what}; {name} may be one of {ok}")
    if micro_batch is not None and dp is not None and (global_batch // dp) % micro_batch:
        raise TrainingPlanError(
            f"micro_batch={micro_batch} does not divide the batch per replica ({global_batch} / dp {dp} = "
            f"{global_batch // dp} sequences); micro_batch may be one of {_divisors(global_batch // dp)}")
    return ([tp] if tp else tp_ok), ([pp] if pp else pp_ok), ([dp] if dp else dp_ok)


def _least_memory(spec, chips: int, axes, global_batch, seq, optimizer, zero, micro_batch, recompute, capacity,
                  sequence_parallel):
    """The split of at most ``chips`` chips with the least memory per chip, or None."""
    tps, pps, dps = axes
    best = None
    for t in tps:
        for p in pps:
            fit = [d for d in dps if t * p * d <= chips]
            if not fit:
                continue
            d = max(fit)
            z = 2 if zero is None else zero
            mb = micro_batch or 1
            if (global_batch // d) % mb:
                continue
            r = True if recompute is None else recompute
            split = Split(t, p, d, z, mb, global_batch // (d * mb), r, sequence_parallel)
            mem = memory_per_chip(spec, split, seq, optimizer, capacity)
            if best is None or mem.total < best[0].total:
                best = (mem, split)
    return best


def smallest_system(spec, arch, global_batch: int, seq: int, optimizer: str, *, tp=None, pp=None, dp=None,
                    zero=None, micro_batch=None, recompute=None,
                    sequence_parallel: bool = True) -> "tuple[int, Split] | None":
    """The fewest chips (part of one board, else whole boards) on which some split of the model
    fits the chips' DRAM, and that split (the one with the least memory per chip); None when no
    number of chips does (e.g. one layer's activations alone exceed a chip)."""
    spec = spec if hasattr(spec, "layers") else _spec(spec)
    axes = _axes(spec, global_batch, tp, pp, dp, micro_batch)
    capacity = arch.dram_bytes

    def fits(chips):
        found = _least_memory(spec, chips, axes, global_batch, seq, optimizer, zero, micro_batch, recompute,
                              capacity, sequence_parallel)
        return found if found and found[0].fits else None

    per_board = arch.chips_per_board
    for chips in range(1, per_board + 1):
        found = fits(chips)
        if found:
            return chips, found[1]
    most = max(axes[0]) * max(axes[1]) * max(axes[2])  # beyond it no split uses more chips
    hi = -(-most // per_board)
    if not fits(hi * per_board):
        return None
    lo = 1  # fits(lo * per_board) is False
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * per_board):
            hi = mid
        else:
            lo = mid
    return hi * per_board, fits(hi * per_board)[1]


def _arch_of(system):
    from ..target.arch import SpinnArch

    if isinstance(system, SpinnArch):
        return system, system.name
    from ..target.registry import arch_of

    return arch_of(system), str(system)


def plan_training(config, system="spinn/board", *, seq: "int | None" = None, global_batch: "int | None" = None,
                  micro_batch: "int | None" = None, optimizer: str = "adamw", tp: "int | None" = None,
                  pp: "int | None" = None, dp: "int | None" = None, zero: "int | None" = None,
                  recompute: "bool | None" = None, sequence_parallel: bool = True,
                  reproducible: bool = True, min_chunk_tokens: int = 1) -> TrainingPlan:
    """Plan fp32 training of a transformers model (config only) on a spinn system.

    Parameters
    ----------
    config : str, dict, transformers config or model
        A ``config.json`` path (``model_type`` ``llama`` or ``gpt2``), its dict or a config
        object (:func:`tvm_spinn.llm.spec_of`).
    system : str or SpinnArch
        A spinn target (``spinn``, ``spinn/board``, ``spinn/cloud``, a registered system) or a
        :class:`~tvm_spinn.target.arch.SpinnArch` (e.g. ``make_system(boards=24)``).
    seq : int, optional
        Tokens per sequence; default :data:`DEFAULT_SEQ` or the model's positions where fewer.
    global_batch : int, optional
        Sequences per step (default :data:`DEFAULT_GLOBAL_BATCH`).
    micro_batch : int, optional
        Sequences per micro-batch; searched when not given.
    optimizer : {"adamw", "momentum", "sgd"}
        AdamW (two fp32 moments), SGD with momentum (one), plain SGD (none).
    tp, pp, dp : int, optional
        Tensor, pipeline and data parallel sizes; each searched when not given.
    zero : {0, 1, 2}, optional
        ZeRO stage (optimizer state, then gradients sharded over ``dp``); searched when not given.
    recompute : bool, optional
        Full activation recomputation; searched when not given.
    sequence_parallel : bool
        Megatron's sequence parallelism (Korthikanti et al. 2022) with ``tp > 1``: the norms,
        the residual stream and the blocks' inputs split over the sequence on the TP ranks.
    reproducible : bool
        Reductions in the fixed order whatever the split (tree collectives); ``False`` lets the
        cost model take the faster ring.
    min_chunk_tokens : int
        Fewest tokens of a sequence in a pipeline chunk the search considers (default 1: every
        power-of-two cut of the sequence; the cost model prices what small chunks cost, so a
        larger value only narrows the search, e.g. to plan faster).

    Returns
    -------
    TrainingPlan
        The fastest split that fits the chips' DRAM (ties: fewer chips).

    Raises
    ------
    LLMError
        An unknown ``model_type`` or a config field out of range (naming the field).
    TrainingPlanError
        A bad argument or a split that does not divide (naming the axis and the sizes that
        would), or a model that fits no split of the system (naming the smallest system that
        holds it: :attr:`TrainingPlanError.smallest_chips` / ``smallest_boards``).
    """
    start = time.perf_counter()
    spec = _spec(config)
    from ..llm.spec import _as_dict

    cfg = _as_dict(config) if not isinstance(config, (str, os.PathLike)) else {}
    model = (os.path.splitext(os.path.basename(os.fspath(config)))[0] if isinstance(config, (str, os.PathLike))
             else str(cfg.get("_name_or_path") or spec.family))
    if optimizer not in OPTIMIZERS:
        raise TrainingPlanError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    if zero is not None and (isinstance(zero, bool) or zero not in (0, 1, 2)):
        raise TrainingPlanError(f"zero must be 0, 1 or 2, got {zero!r}")
    if recompute is not None and not isinstance(recompute, bool):
        raise TrainingPlanError(f"recompute must be True, False or None (searched), got {recompute!r}")
    for name, value in (("reproducible", reproducible), ("sequence_parallel", sequence_parallel)):
        if not isinstance(value, bool):
            raise TrainingPlanError(f"{name} must be True or False, got {value!r}")
    if seq is None:
        seq = min(DEFAULT_SEQ, spec.max_positions)
    seq = _positive("seq", seq, allow_none=False)
    if seq > spec.max_positions:
        raise TrainingPlanError(f"seq={seq} is more than the model's {spec.max_positions} positions")
    global_batch = _positive("global_batch", DEFAULT_GLOBAL_BATCH if global_batch is None else global_batch,
                             allow_none=False)
    min_chunk_tokens = _positive("min_chunk_tokens", min_chunk_tokens, allow_none=False)
    tp, pp, dp, micro_batch = (_positive(n, v) for n, v in (("tp", tp), ("pp", pp), ("dp", dp),
                                                            ("micro_batch", micro_batch)))
    if micro_batch is not None and global_batch % micro_batch:
        raise TrainingPlanError(f"micro_batch={micro_batch} does not divide the global batch ({global_batch} "
                                f"sequences); micro_batch may be one of {_divisors(global_batch)}")
    arch, system_name = _arch_of(system)
    tps, pps, dps = _axes(spec, global_batch, tp, pp, dp, micro_batch)
    capacity = arch.dram_bytes
    if tp and pp and dp and tp * pp * dp > arch.chips:
        raise TrainingPlanError(f"tp {tp} x pp {pp} x dp {dp} = {tp * pp * dp} chips, more than the "
                                f"{arch.chips} of {system_name}")
    zeros = [zero] if zero is not None else [0, 1, 2]
    recomputes = [recompute] if recompute is not None else [False, True]
    comms = _Comms(arch, reproducible)
    # every split that fits, ordered by its compute alone (a lower bound of its step), so the
    # search costs the collectives of the promising ones only
    candidates = []
    for t in tps:
        for p in pps:
            for d in dps:
                if t * p * d > arch.chips:
                    continue
                per_replica = global_batch // d
                for mb in ([micro_batch] if micro_batch else _divisors(per_replica)):
                    if per_replica % mb:
                        continue
                    for z in (zeros if d > 1 else [zeros[0] if zero is not None else 0]):
                        for r in recomputes:
                            for k in (_chunk_counts(seq, min_chunk_tokens) if p > 1 else (1,)):
                                for (h, spread, lag), zb in itertools.product(
                                        _head_options(spec, t, p, d, arch.chips), (False, True)):
                                    if lag >= per_replica // mb * k:
                                        continue  # the head runs behind at most the other slots
                                    if zb and (p + (h > 0) < 2 or per_replica // mb * k < 2):
                                        continue  # nothing to defer into: one stage, or one slot
                                    split = Split(t, p, d, z, mb, per_replica // mb, r, sequence_parallel, k,
                                                  LAYOUTS[0], h, spread, lag, zb)
                                    # memory and the compute floor do not depend on the chip order
                                    if _peak_bytes(spec, split, seq, optimizer) > capacity:
                                        continue
                                    floor = _compute_floor(spec, split, seq, arch, comms)
                                    key = _split_key(split)
                                    for order in (LAYOUTS[:1] if d == 1 else LAYOUTS if p > 1 or h else LAYOUTS[::2]):
                                        # the split in this chip order is made when it is costed
                                        candidates.append((floor, split.chips, key[:9] + (order,) + key[10:], split,
                                                           order))
    if not candidates:
        found = smallest_system(spec, arch, global_batch, seq, optimizer, tp=tp, pp=pp, dp=dp, zero=zero,
                                micro_batch=micro_batch, recompute=recompute, sequence_parallel=sequence_parallel)
        fixed = ", ".join(f"{k}={v}" for k, v in (("tp", tp), ("pp", pp), ("dp", dp), ("zero", zero),
                                                  ("micro_batch", micro_batch), ("recompute", recompute))
                          if v is not None)
        raise _does_not_fit(model, system_name, arch, found, f" with {fixed}" if fixed else "")
    candidates.sort(key=lambda c: c[:3])
    # branch and bound: a split's step with every collective costed for one group alone (no
    # other group on its links) is a lower bound of its step with all groups at once, and far
    # cheaper; splits are costed in full in the order of that bound until none can be faster
    alone = _Comms(arch, reproducible, alone=True, shared=comms)
    best, costed, queue, search = None, 0, [], {}

    def settle(limit: float):
        nonlocal best, costed
        while queue and queue[0][0] < limit and (best is None or queue[0][0] < best[0]):
            bound, _, _, split, mem = heapq.heappop(queue)
            step = _step_time(spec, split, seq, optimizer, arch, comms)
            search[split] = (split, bound, step.total_s)
            costed += 1
            key = (step.total_s, split.chips, _split_key(split))
            if best is None or key < best:
                best = (*key, step, split, mem)

    for floor, chips, _, split, order in candidates:
        mem = None
        split = split if split.layout == order else dataclasses.replace(split, layout=order)
        settle(floor)
        if best is not None and floor >= best[0]:
            break  # sorted by floor: nothing later can be faster
        bound = _step_time(spec, split, seq, optimizer, arch, alone).total_s
        search[split] = (split, bound, None)
        if best is None or bound < best[0]:
            heapq.heappush(queue, (bound, chips, _split_key(split), split, mem))
    settle(math.inf)
    step, split, _ = best[3:]
    mem = memory_per_chip(spec, split, seq, optimizer, capacity)
    from ..timing.training_bound import training_bound

    tokens = global_batch * seq
    bound = training_bound(spec, tokens, seq, optimizer, arch)
    flops = model_flops(spec, tokens, seq)
    peak_used = 2.0 * arch.m4f_flops_per_cycle * arch.clock_hz * arch.pes_per_chip * split.chips
    return TrainingPlan(
        model=model, system=system_name, chips=arch.chips, params=spec.params, seq=seq, global_batch=global_batch,
        optimizer=optimizer, reproducible=reproducible, split=split, memory=mem, step=step,
        flops_per_step=float(flops), executed_flops_per_step=float(model_flops(spec, tokens, seq, split.recompute)),
        tokens_per_s=tokens / step.total_s, utilisation=flops / (step.total_s * peak_used),
        bound_s=bound.total_s, bound_binding=bound.binding,
        bound_parts_s=tuple(sorted(bound.parts().items())), candidates=costed,
        plan_seconds=time.perf_counter() - start, search=tuple(search.values()))


def _chunk_counts(seq: int, min_tokens: int = 1) -> list:
    """Chunk counts a pipeline may cut its sequences into: powers of two dividing ``seq`` with
    at least ``min_tokens`` tokens a chunk (1: whole sequences). The cost model prices what a
    small chunk costs (each slot's weight reads, its hand-overs' hop latencies and DMA set-ups,
    its collectives' fixed terms), so the search weighs them against the shorter fill and drain
    itself; a larger ``min_tokens`` only narrows the search."""
    out, k = [1], 2
    while seq % k == 0 and seq // k >= min_tokens:
        out.append(k)
        k *= 2
    return out


def _head_widths(spec, tp: int, pp: int, dp: int, chips: int) -> list:
    """Head-stage widths a split may take: 0 (the head on the last block stage) and, where the
    LM head's GEMM outweighs a block stage's (it would be the pipeline's slowest part), ``tp``
    times a power of two, as far as the chips and the vocabulary's canonical leaves
    (:func:`~tvm_spinn.training.tp_chain.vocab_leaves`) go."""
    from .tp_chain import vocab_leaves

    out, width = [0], tp
    if not _head_outweighs(spec, pp):
        return out
    # a width divides the vocabulary's canonical leaves, so each rank holds whole leaves
    leaves = vocab_leaves(spec.heads, spec.intermediate, spec.vocab)
    while (tp * pp + width) * dp <= chips and leaves % width == 0:
        out.append(width)
        width *= 2
    return out


def _head_options(spec, tp: int, pp: int, dp: int, chips: int) -> list:
    """``(head_tp, spread_head, head_lag)`` a split may take: the head on the last block stage,
    on a stage of its own (:func:`_head_widths`), or, with more than one stage and where the LM
    head's GEMM outweighs a block stage's, spread over every chip of the replica's stages
    (:attr:`Split.spread_head`); a head stage 0 or :data:`HEAD_LAGS` slots behind the last
    block stage, a spread head one of :data:`HEAD_LAGS` (its collectives are outside the blocks'
    passes); the search keeps the lags below the split's slots."""
    widths = _head_widths(spec, tp, pp, dp, chips)
    stage = [(w, False, lag) for w in widths for lag in ((0,) + HEAD_LAGS if w else (0,))]
    return stage + ([(0, True, lag) for lag in HEAD_LAGS] if pp > 1 and _head_outweighs(spec, pp) else [])


def _head_outweighs(spec, pp: int) -> bool:
    """The LM head's weights outnumber a block stage's (the head would pace the pipeline)."""
    h, i, q, kv = _widths(spec)
    block = (h * (q + 2 * kv) + q * h + (3 if spec.family == "llama" else 2) * h * i) * (spec.layers // pp)
    return spec.vocab * spec.hidden > block


def _split_key(split: Split) -> tuple:
    """A total order of splits (ties of the search go to the first)."""
    return (split.tp, split.pp, split.dp, split.zero, split.micro_batch, split.micro_batches, split.recompute,
            split.sequence_parallel, split.chunks, split.layout, split.head_tp, split.spread_head, split.head_lag,
            split.zero_bubble)


def _compute_floor(spec, split: Split, seq: int, arch, comms: "_Comms") -> float:
    """The blocks' GEMM time of the pipeline alone (:func:`~tvm_spinn.timing.gemm.gemm_seconds`, as :func:`_step_time`
    prices them): a lower bound of the split's step (in either mode: the canonical order's
    GEMMs are the ranks' parallel shares, its additions and collectives only add to them)."""
    tokens = split.micro_batch * seq // split.chunks
    weights, attention = _block_gemms(spec, tokens, seq, split.tp, split.micro_batch)
    f, d, w = _pass_seconds(arch, weights + attention, comms)
    per = spec.layers // split.pp * (f + d + w + split.recompute * f)
    if not split.zero_bubble:
        return (split.slots + split.pp - 1) * per
    # ZB-H1: each stage's fill and drain term at least F + B - W
    fill = per - spec.layers // split.pp * _pass_seconds(arch, weights, comms)[2]
    return (split.slots - 1) * per + split.pp * fill


def _does_not_fit(model: str, system: str, arch, found, given: str = "") -> TrainingPlanError:
    if found is None:
        return TrainingPlanError(f"{model} does not fit {system} ({arch.chips} chips of {arch.dram_bytes} bytes "
                                 f"DRAM): no split{given} keeps a chip within its DRAM on any number of these "
                                 "chips; fix fewer sizes, or plan a shorter seq or a smaller micro_batch")
    chips, split = found
    boards = -(-chips // arch.chips_per_board)
    where = (f"{chips} chips (part of one board)" if chips < arch.chips_per_board
             else f"{boards} board(s) ({boards * arch.chips_per_board} chips): tvm_spinn.make_system(boards={boards})")
    named = ""
    try:
        from ..target.registry import arch_of, known_targets

        fits = sorted((arch_of(t).chips, t) for t in known_targets()
                      if arch_of(t).chips >= chips and arch_of(t).dram_bytes == arch.dram_bytes
                      and arch_of(t).clock_hz == arch.clock_hz)
        named = f"; smallest registered target that holds it: {fits[0][1]}" if fits else ""
    except ValueError:
        pass
    return TrainingPlanError(f"{model} does not fit {system} ({arch.chips} chips): training it needs at least "
                             f"{where}, e.g. {split.line()}{named}", smallest_chips=chips,
                             smallest_boards=boards)


def write_json(result: TrainingPlan, path: str) -> None:
    """Write ``result.to_dict()`` to ``path`` atomically (:func:`tvm_spinn._files.atomic_write`)."""
    from .._files import atomic_write

    text = json.dumps(result.to_dict(), indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()), what="JSON output")
