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
slot to the update and from step to step (the update reads and writes them there and moves
only the optimizer state through DRAM, :func:`~.sync._update_seconds`; priced, not built: the
compiled step's update reads its operands from DRAM), not per pass, and
its GEMMs are priced at the tiles the mapper chooses for resident weights (no DRAM traffic to
trade compute against: a slot's few rows take register-block row tiles over every column). Plus the
TP all-reduces of the activations (two a layer forward, two backward, two more when
recomputing; with sequence parallelism each is an all-gather and a reduce-scatter), the
vocab-parallel embedding's and cross-entropy's, and the hand-over to the next
stage (which runs by DMA during the slot's compute), each costed with the step patterns of
:mod:`tvm_spinn.timing.collectives` on the
system's link graph for *every group at once* (all TP groups of a slot, every stage boundary of
every replica, all data-parallel groups: they share the links and board edges they meet; see
:class:`_Comms`). A micro-batch may enter the pipeline as :attr:`Split.chunks` chunks of
consecutive tokens of its sequences (token-level pipelining, TeraPipe, Li et al. 2021: a
causal chunk attends over its sequences' earlier chunks, whose keys and values the stage keeps,
and its own: its attention is priced over those keys, in a steady slot the chunks' mean
prefix, in the fill's first slot the first chunk's and in the drain's last all ``seq`` keys),
so the step takes ``m c - 1`` slots of the slowest of its ``S`` stages' forward and backward of
one chunk and, for the fill and drain (the first slot's forward and the last one's backward
pass every stage), each stage's part once: its slot, and at least one slot's passes and the
collectives they wait for in series (nothing else is there to compute under them while the
first slot fills the stages and the last one drains them). A slot of a single-slot step takes its
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
those GEMMs back on the path (and at least the stage's passes and collectives in series less
those GEMMs); a stage holds its GEMMs' inputs whole and their output gradients
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
collectives in series, spreads over the lag and is crossed once in the fill and drain. A lagged head stage's
collectives and hand-overs of a steady slot load the links together, at the busiest link of all
of them (:meth:`_Comms.joint_busy`) where that is below the sum of each one's own.

Then the gradient synchronisation over the ``dp`` replicas (ZeRO-0: an all-reduce; ZeRO-1: a
reduce-scatter and an all-gather of the updated weights; ZeRO-2: a reduce-scatter per
micro-batch and the all-gather; rows of a gathered table that no token of the step can touch,
GPT-2's positions from ``seq`` on, have a zero gradient on every replica and are left out),
at once as the first stage ends, or, with more than one stage and slot, the cheaper of that
and a bucketed schedule (:func:`_staggered_tail`): each block stage's gradients reduced in
buckets as its last backward completes them (a layer's projections one by one, the tables' rows
last), each bucket updated on the stage's cores as its reduction ends (ZeRO-1/2: its shard, then
the updated bucket all-gathered; :func:`_bucket_tail`), the stages' reductions starting in the
order the drain ends them and sharing the links with those still running (what the other
stages' groups add to a stage's busiest link), and ZeRO-2's reduce-scatters of the earlier
micro-batches run during the pipeline in the links' time its steady slots leave (the
reduction's order per element is the chain's, whatever the buckets); the untouched rows'
update waits for no reduction and runs in the first stage's idle time within the pipeline. A
head stage's groups synchronise on their own, earlier: in 1F1B's drain the head's stage runs its last
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

Modules
-------
Each with one job, in the order they build on each other (none imports this ``__init__``,
which re-exports the public names):

* :mod:`.records`: the frozen records (:class:`Split`, :class:`MemoryPerChip`,
  :class:`StepTime`, :class:`TrainingPlan`), the error and the constants they use;
* :mod:`.model`: what the planner counts of a model (its config, widths per rank, parameters
  per stage, GEMMs, FLOPs);
* :mod:`.memory`: bytes per chip of a split, stage by stage;
* :mod:`.comms`: collectives of concurrent groups on the system's link graph;
* :mod:`.slot`: one stage's pipeline slot (its GEMM passes, tensor-parallel reductions, overlap);
* :mod:`.sync`: the data-parallel gradient synchronisation and the optimizer update;
* :mod:`.step`: the time of one step of a split, by part;
* :mod:`.timeline`: a planned step's pipeline as a timeline of its passes in the order the bits
  fix (:mod:`tvm_spinn.training.chunk_schedule`), against the step's term for independent slots,
  and the charge of that order the search puts on a chunked split's pipeline;
* :mod:`.axes`, :mod:`.fit`: the sizes each axis may take; the smallest system that holds a
  model;
* :mod:`.search`: the split search and :func:`plan_training`.
"""

from __future__ import annotations

from .records import (DEFAULT_GLOBAL_BATCH, DEFAULT_SEQ, LAYOUTS, OPTIMIZERS, MemoryPerChip, Split, StepTime,
                      TrainingPlan, TrainingPlanError, write_json)
from .model import model_flops
from .memory import memory_per_chip
from .fit import smallest_system
from .search import plan_training

# Every other name of the planner stays importable from the package, as the tests and tools read
# some of its internals. A name replaced here reaches no module that calls it: replace it in the
# module that defines it.
from .records import F32, HEAD_LAGS  # noqa: F401
from .model import (TRAINED_MODEL_TYPES, _block_flops, _block_gemms, _gathered_params, _layer_params,  # noqa: F401
                    _spec, _stage_params, _untouched_rows, _vocab_rows, _widths)
from .memory import (_costed_stages, _head_slots, _held_slots, _inflight, _layer_activations, _layer_input,  # noqa: F401
                     _peak_bytes, _stage_activations)
from .comms import _BOUND_GROUPS, _CHAIN_SEGMENTS, _DIRECT_RANKS, _PROBE_BYTES, _Comms  # noqa: F401
from .slot import (RESIDENT_SHARE, _landing, _pass_seconds, _resident_share, _shared_pes_saving,  # noqa: F401
                   _slot_seconds, _tp_reductions)
from .sync import _UPDATE_BYTES, _UPDATE_OPS, _bucket_tail, _update_seconds  # noqa: F401
from .step import _step_time  # noqa: F401
from .axes import _arch_of, _axes, _divisors, _positive  # noqa: F401
from .fit import _does_not_fit, _least_memory  # noqa: F401
from .search import (_chunk_counts, _compute_floor, _head_options, _head_outweighs, _head_widths,  # noqa: F401
                     _split_key)

__all__ = ["TrainingPlan", "MemoryPerChip", "Split", "StepTime", "TrainingPlanError", "plan_training", "LAYOUTS",
           "memory_per_chip", "model_flops", "smallest_system", "write_json", "OPTIMIZERS", "DEFAULT_SEQ",
           "DEFAULT_GLOBAL_BATCH"]
