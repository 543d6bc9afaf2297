"""The training planner's records: the split, memory per chip, step time and plan, and their constants."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np

from ..errors import TrainingError


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

    pipeline_s: float  # (slots - 1) x the slowest stage's slot + each stage's fill and drain term once
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
    #: each pipeline stage's passes of one slot as a timeline of its slots takes them
    #: (:mod:`.timeline`): ``((forward s, input-gradient s, weight-gradient s, forward hand s,
    #: backward hand s), ...)``, first stage first: the slot's passes (the weight-gradient GEMMs
    #: apart) in proportion to their GEMM time, summing to the stage's slot, and the stage's
    #: fill and drain term beyond them as the delay its forward and its input-gradient pass
    #: hand on to the neighbouring stage
    passes_s: tuple = ()

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


def write_json(result: TrainingPlan, path: str) -> None:
    """Write ``result.to_dict()`` to ``path`` atomically (:func:`tvm_spinn._files.atomic_write`)."""
    from ..._files import atomic_write

    text = json.dumps(result.to_dict(), indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()), what="JSON output")
