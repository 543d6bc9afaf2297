"""``tvm_spinn.llm.plan``: time a language model on a spinn system from its config alone.

No weight is materialized and the functional simulator never runs: the model is built on the
``meta`` device, one transformer block (decode over a ``seq``-slot KV cache, and prefill of a
``seq``-token prompt) and the head are described with shape/dtype-only weights
(:mod:`.describe`), mapped by the normal mapping compiler and timed by its timing model. The
blocks of a model are identical, so the block is planned once and scaled by the layer count
(``plan["scaled_from_one_layer"]``). The time to first token is the ``seq``-token prompt's own
plan, chunked over board stages (:mod:`tvm_spinn.llm.prefill`, ``plan["prefill"]``).

Up to five placements are compared and the one with the shortest per-user token period is
kept (all are in ``plan["alternatives"]``):

* ``shared``: every block on the same chips (the whole system, at most :data:`SHARED_MAX_CHIPS`),
  one after another, streaming its weights from those chips' DRAM (weights and KV cache striped
  over every chip's DRAM): their weights together do not fit the SRAM;
* ``groups`` (more chips than blocks, groups smaller than a board): the chips are split into
  ``layers + 1`` equal groups, one per block and one for the head, so each group's SRAM serves
  one block and the mapper keeps as many of its weights resident as pays off; a token passes
  through the groups in order, the hidden state handed over between consecutive groups on the
  link graph (:func:`tvm_spinn.timing.collectives.point_to_point`);
* ``pipeline`` (two boards or more): the blocks and the head as a chain of *board stages*, each
  tensor-parallel over its board's chips (the scale-out mapper's plan) with one SRAM ledger per
  board, so a stage keeps its weights resident as far as the board's SRAM holds them (the
  rest streams from that board's DRAM). A block is split into 1, 2, 3... stages at its weight
  GEMMs (balanced by bytes: :func:`_atoms`, :func:`_balanced`), or several blocks share a board
  when there are fewer boards than blocks. Between stages the live activations cross the
  board-to-board links (each chip sends its share to its counterpart, the next board
  all-gathers them). Batch 1: a token's latency is the sum of the stages and hand-overs; a
  batch goes through in micro-batches that fill the pipeline (per-user period ``max(sum,
  micro-batches x slowest stage)``). Boards beyond the chain hold replicas
  (``plan["replicas"]``);
* ``board_tp`` (three boards or more, int8 Llama models): every block tensor-parallel over a
  group of boards, its int32 partial sums all-reduced across them, the groups pipelined
  (:mod:`tvm_spinn.llm.board_tp`); a candidate whose streamed blocks run their fp32 GEMMs in
  MAC-high row tiles (its key ending in ``r``) has ``plan["mapping_row_tiles"]`` ``False``
  (:class:`tvm_spinn.mapping.MappingOptions` ``row_tiles``), the others no such key;
* ``experts`` (three boards or more, a mixture of experts, in place of ``pipeline`` and
  ``board_tp``): the experts spread over groups of boards, the router's dispatch and combine as
  all-to-alls on the board links, the groups pipelined (:mod:`tvm_spinn.llm.experts`).

Every placement's decode step is the whole token: besides its programs and hand-overs, the
sampled token's way back from the last stage (the head's chips) to the first (its route's hop
latencies, ``plan["token_return_s"]``; none for one stage), its arrival at every chip of the first
stage, which starts the next step on it (``plan["step_sync_s"]``; within a stage the programs'
barriers and collectives are in their timing), and the host's I/O: each token out over the host
link (``plan["host_io_decode_s"]``, :attr:`~tvm_spinn.target.arch.SpinnArch.host_link_bw_bytes_s`
and ``host_link_latency_s``), the prompt in and the first token out in the time to first token
(``plan["host_io_prefill_s"]``). :func:`_step_io` costs them.

A batch of users in the ``pipeline`` placement keeps every user's KV cache on every stage, in
SRAM as far as the stage's board has room and in DRAM beyond it, checked per stage
(:mod:`tvm_spinn.llm.batching`: ``plan["kv_cache_users"]``, ``plan["largest_batch"]``); a
placement that cannot hold the batch is left out (``plan["refused"]`` says why). On a system
with faults or a partial allocation (:mod:`tvm_spinn.target.faults`) every placement uses the
live hardware only: its chips and boards (``plan["boards"]``, ``plan["health"]``), its routes
around dead links (:mod:`tvm_spinn.llm.machine`).

On a patch of a machine's torus of boards (the whole machine, or an allocation of it:
:mod:`tvm_spinn.target.allocation`) ``plan(..., patches=True)`` searches the placements on the
patch and on every smaller patch of :data:`~tvm_spinn.target.allocation.ALLOCATION_LADDER` inside it, and the fastest
token is kept: a plan may leave boards idle, so a larger allocation never plans a slower token
than the ladder's smaller ones (``plan["allocated_boards"]``, ``plan["patch"]``: the patch whose
search found the plan, ``plan["boards_used"]``; the other patches' candidates are in
``alternatives`` as ``name@boards``). A caller that plans several allocations of one machine
(a sweep over the ladder) passes one ``searches`` dict to every call, so each patch is
searched once.

The headline is ``efficiency``: the physical bound of a decode step
(:func:`tvm_spinn.timing.bounds.physical_bound` of :func:`~tvm_spinn.timing.bounds.decode_workload`:
every block and the LM head, the KV cache at ``seq`` slots (a sliding window's where that is
shorter: :meth:`~tvm_spinn.llm.ModelSpec.cache_slots`), one embedding row per user; it reads
the system's numbers only, so no plan moves it) over the per-user token period
(``plan.physical_bound_s``, its parts and binding kind in ``plan.physical_bound``).

The plan's own bounds (a diagnostic: they move with the plan; per-user decode steps per second): compute (GEMM operations at the chips' peak), DRAM
(bytes that must cross DRAM per token over the DRAM bandwidth of the chips used), SRAM (resident
weights read once per token at the PEs' DMA bandwidth, an assumption of the timing model) and
links (the hand-overs); ``binding`` names the largest. For ``pipeline`` the stages run one after
another, so the bound is a sum: each mapped program contributes its largest bound (compute,
DRAM: streamed weights and I/O, SRAM: its resident bytes, links: its collectives) to that kind,
the hand-overs go to links, ``bounds_s`` holds the sums per kind (their total is the bound) and
``binding`` the largest; ``plan["bounds_alone_s"]`` sums each kind over all programs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import math
import time

from dataclasses import dataclass

from .spec import MAX_DIM, LLMError, ModelSpec, check_plan_sizes, spec_of
from .wire import WIRES

__all__ = ["Plan", "plan", "DTYPES", "HANDOVER_BYTES", "REDUCE_BYTES", "TOKEN_BYTES"]

DTYPES = {"fp32": 4, "int8": 1}
#: Bytes per element of the activations a stage hands over to the next board, per ``handover``
#: option: ``fp32`` keeps the program's bits; ``fp16`` and ``int8`` (a per-tensor scale) cut
#: the board links' bytes at an accuracy cost (the plan's timing only: the compiled model
#: always hands over fp32)
HANDOVER_BYTES = {"fp32": 4, "fp16": 2, "int8": 1}
#: Bytes per element of the partial sums a block tensor-parallel over boards all-reduces across
#: them (the ``board_tp`` placement and the prompt's plan), per ``reduce`` option: ``int32``
#: sends the int8 GEMMs' int32 accumulators, whose sum is exact in any order (the program's
#: bits), along the trees of :func:`tvm_spinn.timing.collectives.board_group_all_reduce`;
#: ``fp16``, ``bf16`` and ``int8`` (chunks of :data:`tvm_spinn.llm.wire.INT8_CHUNK` elements,
#: an fp32 scale each, counted): each board dequantizes its partial sums with the GEMM's scales
#: and sends each share narrowed to its owner, which adds them in fp32 in board order and sends
#: the sum on narrowed, on the fixed schedule of :mod:`tvm_spinn.llm.wire` (the plan's timing
#: only; the accuracy cost: :func:`tvm_spinn.llm.accuracy.reduce_rounding`)
REDUCE_BYTES = {"int32": 4, **WIRES}
#: Bytes of one user's sampled token (an int32 id): what a decode step sends back to the first
#: stage and out to the host
TOKEN_BYTES = 4
#: Largest chip count a block is mapped over in the shared placement (24 boards)
SHARED_MAX_CHIPS = 24 * 48


@dataclass(frozen=True)
class Plan:
    """Planned LLM inference on a spinn system (timing model; no weights, no simulation)."""

    model: str
    system: str
    chips: int
    batch: int
    seq: int
    dtype: str
    tokens_per_s_per_user: float
    tokens_per_s: float
    ttft_s: float
    decode_latency_s: float
    energy_per_token_j: float
    chips_used: int
    sram_bytes_per_chip: int
    dram_bytes_per_chip: int
    weight_bytes: int
    kv_cache_bytes: int
    bound_tokens_per_s: float
    binding: str
    bounds_s: dict
    plan: dict
    plan_seconds: float
    #: plan-independent lower bound on the per-user token period (seconds) and its parts
    physical_bound_s: float = 0.0
    physical_bound: dict = dataclasses.field(default_factory=dict)

    @property
    def bound_ratio(self) -> float:
        """Achieved per-user tokens/s over the plan's own bound (a diagnostic: it moves with the plan)."""
        return self.tokens_per_s_per_user / self.bound_tokens_per_s if self.bound_tokens_per_s else 0.0

    @property
    def efficiency(self) -> float:
        """The physical bound over the per-user token period (at most 1)."""
        return self.physical_bound_s * self.tokens_per_s_per_user

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["bound_ratio"] = self.bound_ratio
        out["efficiency"] = self.efficiency
        return out

    def table(self) -> str:
        rows = [
            ("model", self.model), ("system", f"{self.system} ({self.chips} chips)"),
            ("batch / seq / dtype", f"{self.batch} / {self.seq}{self.plan.get('seq_note', '')} / {self.dtype}"),
            ("placement", f"{self.plan['placement']}: {self.plan['description']}"),
            ("chips used", f"{self.chips_used}"),
            ("tokens/s per user", f"{self.tokens_per_s_per_user:.3f}"),
            ("tokens/s (aggregate)", f"{self.tokens_per_s:.3f}"),
            ("decode latency", f"{self.decode_latency_s * 1e3:.3f} ms/token"),
            ("  token return", f"{self.plan.get('token_return_s', 0.0) * 1e6:.2f} us (the sampled token, last stage "
                               f"to first: {self.plan.get('token_return_hops', 0)} hop(s))"),
            ("  step synchronisation", f"{self.plan.get('step_sync_s', 0.0) * 1e6:.2f} us (the token to every chip "
                                       f"of the first stage)"),
            ("  host I/O", f"{self.plan.get('host_io_decode_s', 0.0) * 1e6:.2f} us a token out (the prompt in and "
                           f"the first token out: {self.plan.get('host_io_prefill_s', 0.0) * 1e6:.2f} us)"),
            ("time to first token", f"{self.ttft_s * 1e3:.3f} ms" + (
                f" (prefill: {self.plan['prefill']['chunks']} chunk(s) of {self.plan['prefill']['chunk']} tokens "
                f"through {self.plan['prefill']['stages']} stage(s) on {self.plan['prefill']['boards_used']} "
                f"board(s); bound {self.plan['prefill']['bound_s'] * 1e3:.4g} ms, efficiency "
                f"{self.plan['prefill']['efficiency']:.4f})" if "prefill" in self.plan else "")),
            ("energy per token", f"{self.energy_per_token_j:.4g} J"),
            ("physical bound", f"{self.physical_bound_s * 1e3:.4g} ms/token ({1 / self.physical_bound_s:.3f} "
                               f"tokens/s per user), {self.physical_bound['binding']}-bound: " + ", ".join(
                                   f"{k} {v * 1e3:.4g} ms" for k, v in self.physical_bound["parts_s"].items())
                               + "; {chips_on_path} chip(s) on {boards_on_path} board(s) on a token's path".format(
                                   **self.physical_bound["details"])
             if self.physical_bound_s else "n/a"),
            ("efficiency", f"{self.efficiency:.4f} (physical bound / token period)"),
            ("plan's own bound", f"{self.bound_tokens_per_s:.3f} tokens/s, {self.binding}-bound "
                                 f"({self.bound_ratio:.2f} of it reached; diagnostic, moves with the plan)"),
            *self._machine_rows(),
            ("SRAM per chip", f"{self.sram_bytes_per_chip / 2**20:.2f} MiB"),
            ("DRAM per chip", f"{self.dram_bytes_per_chip / 2**30:.3f} GiB"),
            ("weights / KV cache", f"{self.weight_bytes / 1e9:.3f} GB / {self.kv_cache_bytes / 1e9:.3f} GB"),
            ("planned", f"one layer scaled by {self.plan['layers']} layers, in {self.plan_seconds:.1f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def __str__(self) -> str:
        return self.table()

    def _machine_rows(self) -> list:
        """Table rows of a machine with faults (what is usable, the boards used) and of a batch
        (where each user's KV cache lives, the largest batch the stages hold)."""
        rows = []
        if "ep_boards" in self.plan:  # the experts placement: what the timing assumes active
            p = self.plan
            rows.append(("experts", f"{p['experts_active']} active a step, {p['experts_per_board']} a board over "
                                    f"{p['ep_boards']} boards; the busiest board runs {p['busiest_board_experts']:.3f} "
                                    f"of them (expected), {p['expert_resident_share']:.1%} of experts resident; "
                                    f"worst case {p['worst_busiest_board_experts']} on one board, streamed: "
                                    f"{1 / p['worst_decode_s']:.3f} tokens/s per user"))
        health = self.plan.get("health")
        if health:
            dead = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in health.items() if k.startswith("dead") and v)
            alloc = f"boards {health['allocated_boards']} allocated; " if health["allocated_boards"] else ""
            rows.append(("machine", f"{alloc}{health['usable_boards']} of {health['boards']} boards usable "
                                    f"({health['whole_boards']} whole), {health['live_chips']} live chips; "
                                    f"{dead or 'nothing dead'}"))
            if "boards" in self.plan:
                rows.append(("boards used", ", ".join(str(b) for b in self.plan["boards"])))
        users = self.plan.get("kv_cache_users")
        if users:
            groups: dict = {}
            for u in users:
                groups.setdefault((u["sram_bytes"], u["dram_bytes"]), []).append(u["users"])
            parts = [f"users {r[0][0]}-{r[-1][1]}: {a / 1e9:.3f} GB in SRAM, {b / 1e9:.3f} GB in DRAM"
                     for (a, b), r in groups.items()]
            rows.append(("KV cache per user", "; ".join(parts) + f" (over {len(users[0]['boards'])} board(s))"))
            rows.append(("largest batch", f"{self.plan['largest_batch']} users (every stage's SRAM room and DRAM)"))
        return rows


def _config_dict(config) -> dict:
    from .spec import _as_dict

    return _as_dict(config)


def _meta_model(cfg: dict, spec: ModelSpec):
    """The model with one block, on the meta device (no weight memory)."""
    import torch
    import transformers

    from .spec import CAUSAL_LM, transformers_kwargs

    kwargs = transformers_kwargs(cfg, spec, layers=1)  # the checked fields only
    cls = getattr(transformers, CAUSAL_LM[cfg["model_type"]])
    try:
        config = transformers.AutoConfig.for_model(cfg["model_type"], **kwargs)
        config._attn_implementation = "eager"
        with torch.device("meta"):
            return cls(config).eval()
    except Exception as err:  # transformers' own checks of the fields (ranges it validates)
        raise LLMError(f"transformers refuses the config: {type(err).__name__}: {err}") from None


def _parts(model, spec: ModelSpec, batch: int, seq: int):
    """(name, module, example args) of the decode block (over the KV cache's
    :meth:`~ModelSpec.cache_slots`), the prefill block and the head."""
    import torch

    from .graphs import Head, LayerStep

    b, s, h, d, kvh = batch, seq, spec.hidden, spec.head_dim, spec.kv_heads
    c = spec.cache_slots(seq)
    rope = spec.family != "gpt2"  # rotary tables: cos, sin of the rotated channels
    r = spec.rotary_dim or d
    with torch.device("meta"):
        dec_args = [torch.zeros(b, 1, h), torch.zeros(b * kvh, d, c), torch.zeros(b * kvh, c, d),
                    torch.zeros(c, dtype=torch.bool), torch.zeros(c)]
        pre_args = [torch.zeros(b, s, h), torch.zeros(s, s)]
        if rope:
            dec_args += [torch.zeros(b, 1, r), torch.zeros(b, 1, r)]
            pre_args += [torch.zeros(b, s, r), torch.zeros(b, s, r)]
        head_args = [torch.zeros(b, 1, h)]
    # a mixture of experts: a step reads the experts its tokens pick, at most k per token
    k = spec.experts_per_token
    return [("decode", LayerStep(model, spec, s, experts=b * k).eval(), tuple(dec_args)),
            ("prefill", LayerStep(model, spec, s, prompt_len=s, experts=b * s * k).eval(), tuple(pre_args)),
            ("head", Head(model, spec, s).eval(), tuple(head_args))]


def _clone(program):
    """A copy to map once more (descriptor constants shared: they hold no data)."""
    return dataclasses.replace(
        program, tensors=[dataclasses.replace(t) for t in program.tensors],
        layers=[dataclasses.replace(layer, consts=dict(layer.consts), attrs=dict(layer.attrs)) for layer in program.layers],
        inputs=list(program.inputs), outputs=list(program.outputs), constants=dict(program.constants),
        timing=None, mapping=None, memory=None, tiles=None)


@dataclass(frozen=True)
class _Timed:
    latency_s: float
    energy_j: float
    weight_bytes: int
    resident_bytes: int  # weights and KV cache kept in SRAM (the memory plans' resident bytes)
    peak_pe_bytes: int
    chips: int
    kv_bytes: int = 0  # the KV cache the programs hold (their state inputs, every copy their shard plans keep)
    kv_sram_bytes: int = 0  # of it, what their memory plans keep in SRAM


def _kv_write_s(arch, slot_bytes: float, sram_share: float) -> tuple[float, float]:
    """``(SRAM seconds, DRAM seconds)`` of writing a decode step's new key and value (one slot,
    ``slot_bytes``) into a cache held ``sram_share`` in SRAM and the rest in DRAM: one PE's DMA
    into its SRAM, or one chip's DRAM channel (the chip holding the slot), weighted by share."""
    if slot_bytes <= 0:
        return 0.0, 0.0
    sram = (arch.dma_setup_cycles + slot_bytes / arch.dma_bw_bytes_per_cycle) / arch.clock_hz
    return sram_share * sram, (1 - sram_share) * slot_bytes / arch.dram_bw_bytes_s


def _step_io(arch, batch: int, seq: int, last_chip: "int | None", first_chips) -> dict:
    """The parts of a decode step beyond its programs and hand-overs (seconds), for a plan whose
    head samples the token on ``last_chip`` (None: one stage, whose chips all hold the logits
    and sample the token themselves) and whose first stage runs on ``first_chips``.

    * ``token_return_s``: the token (:data:`TOKEN_BYTES` a user, one packet) from ``last_chip``
      to the first stage's first chip: its route's hop latencies on the link graph
      (``link_hop_s`` on a board, ``board_link_hop_s`` across board edges, each covering a
      packet's serialisation); ``token_return_hops`` its hops;
    * ``step_sync_s``: from there to every other chip of the first stage (a multicast along the
      routes: the farthest one's hop latencies), which start the step on it;
    * ``host_io_decode_s``: the token out to the host over the host link (a message's latency
      and its bytes at the link's rate), which takes each token before the next step starts;
    * ``host_io_prefill_s``: the prompt's ``seq`` tokens in and the first token out (part of
      the time to first token).
    """
    from ..target.topology import topology_of

    out = {"token_return_s": 0.0, "token_return_hops": 0, "step_sync_s": 0.0}
    first = [int(c) for c in first_chips]
    if last_chip is not None:
        topo = topology_of(arch)
        root = first[0]
        if int(last_chip) != root:
            cost = topo.transfer_cost([int(last_chip)], [root], batch * TOKEN_BYTES)
            out.update(token_return_s=cost.latency_s, token_return_hops=cost.max_hops)
        others = [c for c in first if c != root]
        if others:
            out["step_sync_s"] = topo.transfer_cost([root] * len(others), others, batch * TOKEN_BYTES).latency_s
    out["host_io_decode_s"] = arch.host_link_latency_s + batch * TOKEN_BYTES / arch.host_link_bw_bytes_s
    out["host_io_prefill_s"] = (2 * arch.host_link_latency_s
                                + batch * (seq + 1) * TOKEN_BYTES / arch.host_link_bw_bytes_s)
    return out


def _map(described, arch, weights: str) -> _Timed:
    """Every program on the whole of ``arch`` (the system planner's ``alone`` policy: replicas).
    The KV cache a program reads is its state (see :class:`~tvm_spinn.mapping.planner.RegionPlan`):
    in SRAM where its memory plan keeps the attention matmuls' operands resident, else in DRAM."""
    from ..mapping import MappingOptions, current_options
    from ..mapping.planner import plan_system

    lat = energy = 0.0
    wbytes = resident = peak = chips = kv = kv_sram = 0
    programs = []
    for d in described:
        program = _clone(d.program)
        program = dataclasses.replace(program, arch=arch)
        programs.append(program)
    plan = plan_system(programs, arch, MappingOptions(weights=weights, split_k=current_options().split_k),
                       policy="alone")
    for d, program, region in zip(described, plan.programs, plan.regions):
        t = program.timing
        lat += t.latency_s
        energy += t.energy_j
        wbytes += d.weight_bytes
        resident += int(program.memory.resident_bytes_total)
        peak = max(peak, int(program.memory.peak_bytes_max))
        chips = max([chips] + [int(row.chips) for row in t.layers])
        kv, kv_sram = kv + region.state_bytes, kv_sram + region.state_sram_bytes
    return _Timed(lat, energy, wbytes, resident, peak, chips, kv, kv_sram)


def _smallest_fitting(need: int, arch) -> str:
    from ..target import arch_of, known_targets

    per_board = arch.chips_per_board * arch.dram_bytes
    fits = sorted((arch_of(t).chips, t) for t in known_targets()
                  if arch_of(t).chips * arch_of(t).dram_bytes >= need and arch_of(t).clock_hz == arch.clock_hz)
    boards = math.ceil(need / per_board)
    named = f"; smallest registered target that fits: {fits[0][1]}" if fits else ""
    return f"it needs at least {boards} board(s) (tvm_spinn.make_system(boards={boards})){named}"


#: Context length planned when none is given (or the model's position limit where that is shorter)
DEFAULT_SEQ = 2048


def plan(config, target="spinn/board", batch: int = 1, seq: "int | None" = None, dtype: str = "int8",
         progress: bool = False, handover: str = "fp32", patches: bool = False,
         searches: "dict | None" = None, reduce: str = "int32") -> Plan:
    """Plan greedy decoding of a transformers model (config only) on a spinn system.

    Parameters
    ----------
    config : str, dict, transformers config or model
        A ``config.json`` path (a ``model_type`` of :data:`~tvm_spinn.llm.spec.FAMILIES`), its dict,
        or a config object.
    target : str or tvm.target.Target
        The spinn system (``spinn``, ``spinn/board``, ``spinn/cloud``, a registered system).
    batch : int
        Users decoding together.
    seq : int, optional
        Context length: the prompt prefilled for the time to first token, and the KV-cache
        slots each decode step attends over (at most the model's sliding window, where it has
        one: :meth:`ModelSpec.cache_slots`). Default :data:`DEFAULT_SEQ`, or the model's
        position limit where that is shorter (the table says so).
    dtype : {"int8", "fp32"}
        Arithmetic and storage of the weight GEMMs (attention and KV cache stay fp32).
    progress : bool
        Show a progress bar (tqdm) over the planning steps.
    handover : {"fp32", "fp16", "int8"}
        Element type of the activations handed over from board to board between pipeline
        stages (:data:`HANDOVER_BYTES`); ``fp32`` keeps the compiled model's bits.
    patches : bool
        Also search every smaller patch of :data:`~tvm_spinn.target.allocation.ALLOCATION_LADDER`
        inside the system and keep the fastest token, so the plan may leave boards idle and a
        larger allocation never plans slower than its patches. Off by default: on the cloud it
        searches seven more systems (several minutes from scratch); a sweep over the ladder
        (``bench/llm.py --part scaling``) has planned them anyway (see ``searches``).
    searches : dict, optional
        The caller's memo of the placements searched on each system, shared by the calls given
        the same dict (keyed by config, request, system and mapping options; the records are a
        function of the key). None: this call's own.
    reduce : {"int32", "fp16", "bf16", "int8"}
        Element type of the partial sums a block tensor-parallel over boards all-reduces
        across them (:data:`REDUCE_BYTES`; the narrow wires: :mod:`tvm_spinn.llm.wire`): the ``board_tp`` placement's all-reduces and the
        prompt's plan's (the ``experts`` placement's stay int32); ``int32`` keeps the compiled
        model's bits. The kept record's description says the wire type, and a narrowed one is
        in ``plan["reduce"]`` (and ``plan["board_all_reduce_wire"]`` of a ``board_tp`` plan).

    Returns
    -------
    Plan

    Raises
    ------
    LLMError
        Unknown ``model_type`` or a bad config field, ``seq`` beyond the model's positions,
        bad ``batch`` / ``dtype``, or a model (weights + KV cache) too large for the system's
        DRAM (the message names the smallest system that fits).
    """
    from ..mapping import MappingError
    from ..target import arch_of, get_target
    from .describe import describe

    start = time.perf_counter()
    cfg = _config_dict(config)
    spec = spec_of(cfg)
    import os

    model_name = (os.path.splitext(os.path.basename(os.fspath(config)))[0] if isinstance(config, (str, os.PathLike))
            else str(cfg.get("_name_or_path") or spec.family))
    seq_note = ""
    if seq is None:
        seq = min(DEFAULT_SEQ, spec.max_positions)
        seq_note = f" (the model's {seq} positions)" if seq < DEFAULT_SEQ else ""
    for name, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIM:
            raise LLMError(f"{name} must be an integer in [1, {MAX_DIM}], got {value!r}")
    if seq > spec.max_positions:
        raise LLMError(f"seq={seq} is longer than the model's position table (config max positions "
                       f"{spec.max_positions})")
    if dtype not in DTYPES:
        raise LLMError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if handover not in HANDOVER_BYTES:
        raise LLMError(f"handover must be one of {sorted(HANDOVER_BYTES)}, got {handover!r}")
    if reduce not in REDUCE_BYTES:
        raise LLMError(f"reduce must be one of {sorted(REDUCE_BYTES)}, got {reduce!r}")
    check_plan_sizes(spec, batch, seq, DTYPES[dtype])
    target = get_target(target)
    arch = arch_of(target)
    weight_bytes = spec.params * DTYPES[dtype]
    slots = spec.cache_slots(seq)  # a sliding window keeps only its last positions
    kv_bytes = batch * slots * spec.kv_bytes_per_token(4)
    from ..target.allocation import allocation_shape, board_name, sub_allocations
    from ..target.faults import health, live_chips, usable_boards

    live = live_chips(arch)  # the chips that work (all of them on a healthy system)
    if weight_bytes + kv_bytes > live.size * arch.dram_bytes:
        raise LLMError(
            f"model too large for target {arch.name} ({live.size} chips, {live.size * arch.dram_bytes / 1e9:.1f} GB "
            f"DRAM): {dtype} weights {weight_bytes / 1e9:.1f} GB + KV cache {kv_bytes / 1e9:.2f} GB (batch={batch}, "
            f"seq={seq}); {_smallest_fitting(weight_bytes + kv_bytes, arch)}")

    from tqdm.auto import tqdm

    steps = tqdm(total=5, desc=f"plan {model_name} on {arch.name}",
                 disable=not progress, leave=False)
    model = _meta_model(cfg, spec)
    described = {}
    for name, module, args in _parts(model, spec, batch, seq):
        steps.set_postfix_str(f"describe {name}")
        described[name] = describe(module, args, target, dtype)
        steps.update()

    L = spec.layers
    stages: dict = {}  # this call's stages mapped on one board (see _map_stage), shared by the patches

    def search(arch, refused: dict) -> dict:
        """The decode placements' records on ``arch`` (the system, or a patch of it)."""
        live = live_chips(arch)
        boards = len(usable_boards(arch)) if arch.chips >= arch.chips_per_board else 0
        candidates = []
        if live.size >= L + 1 and (boards < 2 or live.size // (L + 1) < arch.chips_per_board):
            # one group of chips per block (and one for the head) inside a board: each group's SRAM
            # holds only its block, so the mapper may keep its weights resident (on two or more
            # boards the pipeline placement below is this with whole boards per stage)
            # (a mixture of experts streams its experts: the ones a token picks change every token)
            candidates.append(("groups", live.size // (L + 1), L + 1, "stream" if spec.experts else "auto"))
        if boards >= 2 and arch.chips_per_board >= L + 1 and not arch.has_faults:
            # the same on one board of the system: what a one-board system plans stays a candidate,
            # so more boards never plan a slower token (the groups' hand-overs stay on the board)
            candidates.append(("groups:one-board", arch.chips_per_board // (L + 1), L + 1,
                               "stream" if spec.experts else "auto"))
        # every block on the same chips: their weights together exceed the SRAM, so they stream from
        # DRAM; at most SHARED_MAX_CHIPS chips (mapping one block over more is not practical yet)
        shared = min(live.size, SHARED_MAX_CHIPS)
        if arch.has_faults and shared > arch.chips_per_board:
            shared -= shared % arch.chips_per_board  # timed as whole boards (their chips all work)
        if shared * arch.dram_bytes >= weight_bytes + kv_bytes:
            candidates.append(("shared", shared, 1, "stream"))
        steps.total = 3 + len(candidates) + (len(STAGES_PER_BLOCK) if boards >= 2 else 0)
        records = {}
        peak = arch.peak_int8_ops_s if dtype == "int8" else arch.peak_fp32_flops_s
        gemm_ops = 2 * batch * (spec.step_params(1) - (spec.vocab * spec.hidden if not spec.tied_embeddings else 0)
                                - (spec.max_positions * spec.hidden if spec.family == "gpt2" else 0))
        attn_flops = 2 * 2 * batch * L * spec.heads * spec.head_dim * slots
        sub_board = arch.replace(chips=arch.chips_per_board, name=board_name(arch)) if boards >= 2 else arch
        for placement, group, groups, weights_mode in candidates:
            steps.set_postfix_str(f"map: {placement} on {group} chips")
            # (one board with dead chips: the system itself, its live chips; see target.faults)
            sub = (arch if group == arch.chips or (placement == "shared" and boards <= 1 and group == live.size)
                   else arch.replace(chips=group, name=f"{arch.name}[{group} chips]"))
            try:
                dec, pre, head = (_map(described[k], sub, weights_mode) for k in ("decode", "prefill", "head"))
            except MappingError as err:
                # a block that does not fit a group (e.g. a large batch's prompt, or the prefill's
                # attention scores of many heads on one chip) rules out this placement only
                refused[placement] = str(err)
                steps.update()
                continue
            handoff_dec = 0.0
            if placement.startswith("groups"):
                from ..target.topology import topology_of
                from ..timing.collectives import point_to_point

                # one board of the system: its routes kept on the board (the routing tables are the
                # plan's), as on a one-board system
                topo = topology_of(sub_board if placement == "groups:one-board" else arch)

                def handoff(nbytes):  # the hidden state from each group to the next, one after another
                    return sum(point_to_point(topo, [live[i * group]], [live[(i + 1) * group]], nbytes).seconds
                               for i in range(L))

                handoff_dec = handoff(batch * spec.hidden * HANDOVER_BYTES[handover])
            # the KV cache: in SRAM as far as the block's memory plan kept it there (next to the
            # weights resident before it), the rest in DRAM; each step writes one slot of it
            kv_share = dec.kv_sram_bytes / dec.kv_bytes if dec.kv_bytes else 0.0
            kv_sram = kv_bytes * kv_share
            slot = kv_bytes / (L * slots)
            write_sram, write_dram = (L * w for w in _kv_write_s(sub, slot, kv_share))
            # the token back from the head's group to the first (the groups), the host's I/O
            io = _step_io(sub_board if placement == "groups:one-board" else arch, batch, seq,
                          live[L * group] if placement.startswith("groups") else None, live[:group])
            loop_s = io["token_return_s"] + io["step_sync_s"] + io["host_io_decode_s"]
            decode_s = L * dec.latency_s + head.latency_s + handoff_dec + write_sram + write_dram + loop_s
            used = group * groups
            resident = L * (dec.resident_bytes - dec.kv_sram_bytes) + head.resident_bytes  # weights only
            step_bytes = spec.step_params(batch) * DTYPES[dtype]  # the weights a step reads (experts: the picked)
            streamed = max(0, step_bytes - resident) if placement.startswith("groups") else step_bytes
            # a token visits the groups one after another: each block has only its group's resources
            share = used if placement == "shared" else group
            bounds = {
                "compute": (gemm_ops / peak + attn_flops / arch.peak_fp32_flops_s) * arch.chips / share,
                "dram": (streamed + kv_bytes - kv_sram) / (arch.dram_bw_bytes_s * share) + write_dram,
                "sram": (resident + kv_sram) / (share * arch.pes_per_chip * arch.dma_bw_bytes_per_cycle * arch.clock_hz)
                        + write_sram,
                "links": handoff_dec + loop_s,
            }
            described_groups = (f"{L} blocks + head on {groups} groups of {group} chips, a token passing through "
                                "them in order (hidden state handed over on the links)" if placement.startswith("groups") else
                                f"all {L} blocks and the head on all {group} chips, one after another")
            records[placement] = dict(
                decode_s=decode_s, period_s=decode_s,
                energy_j=(L * dec.energy_j + head.energy_j) / batch, used=used, resident=resident, streamed=streamed,
                kv_sram=kv_sram, sram_pe=max(dec.peak_pe_bytes, pre.peak_pe_bytes, head.peak_pe_bytes),
                dram_chip=int(math.ceil((streamed + kv_bytes - kv_sram) / used)), bounds=bounds,
                bound_s=max(bounds["compute"], bounds["dram"], bounds["sram"]) + bounds["links"],
                binding=max(bounds, key=bounds.get), description=described_groups,
                meta={"chips_per_group": group, "groups": groups, "mapping_weights": weights_mode,
                      "block_decode_s": dec.latency_s + (write_sram + write_dram) / L, "block_prefill_s": pre.latency_s,
                      "head_decode_s": head.latency_s, "handoff_decode_s": handoff_dec,
                      "kv_write_decode_s": write_sram + write_dram, **io})
            steps.update()
        # a mixture of experts across boards: its experts spread over boards (the block's stages
        # of the other placements would keep only the experts one step reads)
        if boards >= 2 and not spec.experts:
            records.update(_pipeline_records(described, spec, arch, model, target, dtype, batch, seq, kv_bytes,
                                             weight_bytes, steps, handover, stages, refused))
        if boards >= 3:
            from . import board_tp, experts

            args = (cfg, spec, arch, target, dtype, batch, seq, HANDOVER_BYTES[handover], described, weight_bytes,
                    kv_bytes, steps, stages)
            records.update(experts.records(*args) if spec.experts else board_tp.records(*args, refused, reduce=reduce))
        return records

    def searched(arch) -> tuple:
        """``search`` on ``arch``, remembered in ``searches``: the records are a function of the
        config, the request, the system and the mapping options only."""
        from ..mapping import current_options

        key = (json.dumps(cfg, sort_keys=True, default=str), batch, seq, dtype, handover, arch,
               json.dumps(current_options().to_dict(), sort_keys=True, default=str), reduce)
        if key not in memo:
            found: dict = {}
            memo[key] = (search(arch, found), found)
        records, found = copy.deepcopy(memo[key])
        return records, found

    memo = {} if searches is None else searches
    records, refused = searched(arch)  # refused: placement -> why it cannot hold this batch
    # every smaller allocation of the ladder inside this one (one per shape): a plan may
    # leave boards idle, so a larger allocation never plans a slower token than a patch of it
    for n, sub in (sub_allocations(arch) if patches else ()):
        found_records, found = searched(sub)
        for k, r in found_records.items():
            r["patch"] = sub
            records[f"{k}@{n}"] = r
        refused.update({f"{k}@{n}": v for k, v in found.items()})
    steps.close()
    if not records:
        raise LLMError(f"no placement of {model_name} on {arch.name} holds batch={batch}, seq={seq}: "
                       + "; ".join(f"{k}: {v}" for k, v in sorted(refused.items())))
    placement = min(records, key=lambda k: (records[k]["period_s"], records[k]["used"], k))
    best = _finish(records[placement])
    resident, streamed = best["resident"], best["streamed"]
    weights_in = ("sram" if streamed == 0 else "dram" if resident == 0 else
                  f"sram+dram ({resident / weight_bytes:.1%} resident)")
    kv_sram = int(round(best["kv_sram"]))
    kv_in = ("sram" if kv_sram >= kv_bytes else "dram" if kv_sram == 0 else
             f"sram+dram ({kv_sram / kv_bytes:.1%} in SRAM)")
    bounds, bound_s = best["bounds"], best["bound_s"]
    meta = {
        "placement": placement.split("@")[0].split(":")[0], "description": f"{best['description']}; weights in {weights_in}, "
                                                            f"KV cache in {kv_in}",
        "layers": L, "scaled_from_one_layer": True, "seq_note": seq_note, "weights_in": weights_in, "resident_weight_bytes": resident,
        "kv_cache_in": kv_in, "kv_cache_sram_bytes": kv_sram, "attention_dtype": "fp32",
        "alternatives": {k: {"decode_s": v["decode_s"], "period_s": v["period_s"],
                             "chips": v["used"], "weights_resident": v["resident"] / weight_bytes}
                         for k, v in sorted(records.items())},
        "timing": "tvm_spinn timing model of the mapped programs (no simulation, no weights)",
        **({"refused": dict(sorted(refused.items()))} if refused else {}),
        **({"health": health(arch)} if arch.has_faults else {}),
        **({"reduce": reduce} if reduce != "int32" else {}),  # the default: the compiled model's bits
        **best["meta"],
    }
    # the boards allocated and the patch of them the plan runs on (the rest idle)
    ran_on = best.get("patch", arch)
    shape = allocation_shape(ran_on) if ran_on.chips >= ran_on.chips_per_board else None
    meta.update(allocated_boards=len(usable_boards(arch)) if arch.chips >= arch.chips_per_board else 0,
                patch=f"{shape[0]}x{shape[1]}" if shape else None,
                boards_used=meta.get("boards_used") or math.ceil(best["used"] / arch.chips_per_board))
    from ..timing.bounds import decode_workload, physical_bound  # TVM: not for the CLI's checks
    from .prefill import plan_prefill
    from .prefill.search import head_described_key

    prefill_memo = {"stages": stages}
    if batch == 1 and slots == seq:
        # the prompt's head (one user's last token, the model built for ``seq`` positions) is
        # the head part described above: the same module and example input
        prefill_memo[head_described_key(cfg, arch, dtype, seq)] = (described["head"], {(1, 1, spec.hidden)})
    # the time to first token: a ``seq``-token prompt's own plan (chunked over board stages)
    prefill = plan_prefill(cfg, target, prompt=seq, dtype=dtype, handover=handover, memo=prefill_memo,
                           model_name=model_name, reduce=reduce)
    meta["prefill"] = prefill.to_dict()
    # the prompt is planned once for the system, whatever the decode placement: every
    # alternative's time to first token is that plan's
    for alternative in meta["alternatives"].values():
        alternative["ttft_s"] = prefill.ttft_s
    physical = physical_bound(decode_workload(spec, batch, slots, dtype), arch)
    return Plan(
        model=model_name, system=arch.name, chips=arch.chips, batch=batch, seq=seq, dtype=dtype,
        tokens_per_s_per_user=1.0 / best["period_s"], tokens_per_s=batch / best["period_s"], ttft_s=prefill.ttft_s,
        decode_latency_s=best["decode_s"], energy_per_token_j=best["energy_j"],
        chips_used=best["used"], sram_bytes_per_chip=int(best["sram_pe"] * arch.pes_per_chip),
        dram_bytes_per_chip=best["dram_chip"], weight_bytes=weight_bytes,
        kv_cache_bytes=kv_bytes, bound_tokens_per_s=1.0 / bound_s, binding=best["binding"], bounds_s=bounds,
        plan=meta, plan_seconds=time.perf_counter() - start, physical_bound_s=physical.total_s,
        physical_bound=physical.to_dict())


def _finish(record: dict) -> dict:
    """The kept record completed with what only it reports (``record["finish"]``: a pipeline
    candidate's prompt block, mapped once a plan rather than once a search); others as they are."""
    finish = record.pop("finish", None)
    return finish(record) if finish is not None else record


def write_json(result: Plan, path: str) -> None:
    """Write ``result.to_dict()`` to ``path`` atomically (a temporary file renamed into place)."""
    from .._files import atomic_write

    text = json.dumps(result.to_dict(), indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))


# ----------------------------------------------------------------------------- pipelined boards
#: Stages one block is split into (contiguous runs of its weight GEMMs, balanced by weight bytes),
#: tried by the ``pipeline`` placement in increasing order.
STAGES_PER_BLOCK = (1, 2, 3, 4, 6, 8)
#: Blocks one board stage may hold (a small model on few boards), tried when they fit its SRAM.
BLOCKS_PER_STAGE = (2, 3, 4)


def _slice(program, a: int, b: int):
    """Layers ``a..b-1`` of ``program`` as a program of their own: what they read and nothing
    else produces becomes an input, what they produce that later layers (or the program's
    caller) read an output; only the constants they use are kept (descriptors: no copy)."""
    layers = program.layers[a:b]
    later = {t for layer in program.layers[b:] for t in layer.inputs} | set(program.outputs)
    produced = {layer.output for layer in layers}
    used = sorted({t for layer in layers for t in (*layer.inputs, *layer.consts.values(), layer.output)})
    remap = {t: i for i, t in enumerate(used)}
    tensors = []
    for t in used:
        d = program.tensors[t]
        if d.role != "const":
            d = dataclasses.replace(d, role=("output" if t in later else "temp") if t in produced else "input")
        tensors.append(d)
    first = [t for t in program.inputs if t in remap and t not in produced]
    inputs = first + [t for t in used if tensors[remap[t]].role == "input" and t not in first]
    return dataclasses.replace(
        program, symbol=f"{program.symbol}[{a}:{b}]", tensors=tensors,
        layers=[dataclasses.replace(layer, inputs=[remap[t] for t in layer.inputs], output=remap[layer.output],
                                    consts={k: remap[v] for k, v in layer.consts.items()}, attrs=dict(layer.attrs))
                for layer in layers],
        inputs=[remap[t] for t in inputs], outputs=[remap[t] for t in used if tensors[remap[t]].role == "output"],
        constants={remap[t]: program.constants[t] for t in used if t in program.constants},
        timing=None, mapping=None, memory=None, tiles=None)


def _atoms(index: int, program) -> list[tuple[int, int, int, int]]:
    """``(program index, first layer, end layer, weight bytes)`` runs of ``program`` cut before each
    weight GEMM (with the ``quantize`` of its input), the units a block is split into stages by."""
    # the operator families load the simulator's library: not at import, so `tvm-spinn plan`'s
    # argument errors come back before TVM and torch are imported
    from ..program.ops import family_of

    cuts = [0]
    for i, layer in enumerate(program.layers):
        if family_of(layer.kind).weight_gemm(layer) and i > 0:
            prev = program.layers[i - 1]
            j = i - 1 if family_of(prev.kind).quantizes(prev) and prev.output == layer.inputs[0] else i
            if j > cuts[-1]:
                cuts.append(j)
    cuts.append(len(program.layers))
    out = []
    for a, b in zip(cuts, cuts[1:]):
        consts = {t for layer in program.layers[a:b] for t in (*layer.inputs, *layer.consts.values())
                  if program.tensors[t].role == "const"}
        out.append((index, a, b, sum(program.tensors[t].nbytes for t in consts)))
    return out


def _balanced(atoms: list, parts: int) -> list[list]:
    """``atoms`` cut into ``parts`` contiguous non-empty runs minimizing the largest run's weight."""
    n = len(atoms)
    w = [0] + list(itertools.accumulate(a[3] for a in atoms))
    best = {(0, 0): (0, None)}
    for k in range(1, parts + 1):
        for j in range(k, n - parts + k + 1):
            best[(k, j)] = min((max(best[(k - 1, i)][0], w[j] - w[i]), i) for i in range(k - 1, j)
                               if (k - 1, i) in best)
    runs, j = [], n
    for k in range(parts, 0, -1):
        i = best[(k, j)][1]
        runs.append(atoms[i:j])
        j = i
    return runs[::-1]


def _merge(run: list) -> list[tuple[int, int, int]]:
    """Consecutive atoms of one described program as one ``(index, first, end)`` slice."""
    out = []
    for index, a, b, _ in run:
        if out and out[-1][0] == index and out[-1][2] == a:
            out[-1] = (index, out[-1][1], b)
        else:
            out.append((index, a, b))
    return out


@dataclass(frozen=True)
class _Stage:
    latency_s: float
    energy_j: float
    weight_bytes: int
    resident_bytes: int
    streamed_bytes_per_chip: int
    peak_pe_bytes: int
    handoff_in_bytes: int
    bounds: dict  # kind -> seconds: each program's largest bound, summed (see _pipeline)
    alone: dict  # kind -> seconds: each kind's bound summed over the programs
    #: of ``handoff_in_bytes``, what the first program reads whole (the rest it takes split: a
    #: row-parallel GEMM's input, each chip its share; no all-gather on arrival)
    handoff_gather_bytes: int = -1
    #: the KV cache the stage's programs read, and what of it their memory plans keep in SRAM
    kv_bytes: int = 0
    kv_sram_bytes: int = 0
    #: each program's latency (its KV write included), in order
    program_s: tuple = ()
    #: each program's bytes streamed from DRAM per chip, in order
    program_streamed: tuple = ()
    #: each program's system timing on the board (its layers' times and collectives:
    #: :class:`~tvm_spinn.program.records.SystemTimingSummary`), in order
    program_timings: tuple = ()
    #: each program's shard plan ``(tp, dp, sp)`` and the latency of every plan its mapping
    #: timed (``{(tp, dp, sp): seconds}``, the fastest where several differ in their row rule)
    program_plans: tuple = ()
    program_candidates: tuple = ()
    #: each program's layers as one chip runs them (its
    #: :class:`~tvm_spinn.program.records.LayerTimingSummary` records: tiles, PEs, cycles), in order
    program_layers: tuple = ()


#: The key of a stage memo (:func:`_map_stage`) that holds the programs' mappings, beside the stages
_MAPPINGS = "mappings"
#: The key of a stage memo that holds the layers' costed tile tables
#: (:class:`~tvm_spinn.mapping.tiling.TileCostMemo`), beside the stages
_TILES = "tiles"


def _map_stage(pieces: list, board, host_shapes: set, slots: int = 0, weights: str = "auto",
               memo: "dict | None" = None, keep_outputs: bool = False) -> _Stage:
    """Map a stage's programs on one board, one after another with one SRAM ledger (each
    program's weights resident in what the earlier ones left, the rest streamed from DRAM).
    ``handoff_in_bytes``: the first program's inputs that the previous stage produced (not the
    KV cache, masks and rotary tables the host or the stage itself provides: ``host_shapes``);
    ``handoff_gather_bytes`` those of them its shard plan reads whole.

    The inputs that are not the host's are in the board's SRAM when a program starts: the
    hand-over from the previous board lands there (see :func:`_pipeline`), and an earlier
    program of the stage produced the others on these chips (their budgets' ``onchip_inputs``,
    see :func:`tvm_spinn.mapping.planner.plan_system`). The KV cache is state kept on the chips: in SRAM where
    the ledger leaves room for it after the weights kept before it (the attention matmuls'
    operands resident: the regions' ``state_sram_bytes``), else in DRAM; each decode step writes one of its
    ``slots`` (:func:`_kv_write_s`), charged to the stage's latency and to the SRAM or DRAM
    bound.

    ``memo``: one :func:`plan` call's stages already mapped, keyed by everything the mapping
    reads (the pieces' structure, the board, the host's shapes, ``slots``, the options,
    ``keep_outputs``): the
    pipeline's split counts share stages (a block's last GEMMs), and the ``board_tp`` placement
    maps the pipeline's head stage again. It also holds the programs' mappings
    (:class:`~tvm_spinn.mapping.schedule.MappingMemo`, each keyed by the program's structure and
    the budget it is mapped under), shared by every stage it maps: stages that differ only in
    some programs (the prompt's block at another context, or with its projections fused or
    apart) map the programs they share under the same budget once.

    ``keep_outputs``: every program leaves its outputs in the chips' SRAM (the next program,
    which reads them there, or the next run of the stage's programs, or the board links take
    them from there), not written to DRAM where it takes at most
    :data:`~tvm_spinn.mapping.system.GATHERED_SRAM_SHARE` of a chip's SRAM (a larger output
    goes to DRAM, as a region's output does): the programs of a block repeated on the same chips
    (the ``board_tp`` slice, whose outputs the next piece, the next block or the all-reduce
    and hand-over read); otherwise an output goes to DRAM, as a region's output does."""
    from ..mapping import MappingOptions, current_options
    from ..mapping.schedule import MappingMemo, structure_key
    from ..mapping.tiling import TileCostMemo

    options = MappingOptions(weights=weights, split_k=current_options().split_k,
                             row_tiles=current_options().row_tiles)
    key = None
    if memo is not None:
        key = (tuple(structure_key(p, board, "stage", options) for p in pieces),
               tuple(sorted(host_shapes)), int(slots)) + (("keep_outputs",) if keep_outputs else ())
        if key in memo:
            return memo[key]
    mappings = None if memo is None else memo.setdefault(_MAPPINGS, MappingMemo())
    # the layers' tile tables, costed once for every stage the memo's plan maps (a block's
    # GEMMs recur across contexts, projection forms, weight modes and shard plans)
    tiles = None if memo is None else memo.setdefault(_TILES, TileCostMemo())
    with tiles if tiles is not None else contextlib.nullcontext():
        stage = _map_stage_now(pieces, board, host_shapes, slots, options, keep_outputs, mappings)
    if key is not None:
        memo[key] = stage
    return stage


def _map_stage_now(pieces: list, board, host_shapes: set, slots: int, options, keep_outputs: bool = False,
                   mappings=None) -> _Stage:
    """:func:`_map_stage` without its memo of stages; ``mappings``: the programs' mappings to
    reuse and add to (:func:`tvm_spinn.mapping.planner.plan_system`'s ``memo``)."""
    from ..mapping.planner import plan_system

    lat = energy = 0.0
    wbytes = resident = streamed = peak = handoff = gather = kv = kv_sram = 0
    bounds = dict.fromkeys(("compute", "dram", "sram", "links"), 0.0)
    alone = dict(bounds)
    sram_bw = board.chips * board.pes_per_chip * board.dma_bw_bytes_per_cycle * board.clock_hz
    # not the host's: handed over from the previous board, or produced by an earlier program of
    # the stage (same tensor ids in the clone)
    onchip = [[t for t in program.inputs if tuple(program.tensors[t].shape) not in host_shapes] for program in pieces]
    # (and, ``keep_outputs``, the outputs each leaves in SRAM)
    kept = [[t for t in program.outputs if t not in program.inputs] if keep_outputs else [] for program in pieces]
    programs = []
    for program in pieces:
        program = _clone(program)
        program = dataclasses.replace(program, arch=board)
        programs.append(program)
    # in order: a stage is a chain of the model's programs whose SRAM the stage search sized
    plan = plan_system(programs, board, options, onchip_inputs=[a + b for a, b in zip(onchip, kept)], policy="in_order",
                       memo=mappings)
    program_s, program_streamed, program_timings, program_plans, program_candidates = [], [], [], [], []
    program_layers = []
    for k, (program, region) in enumerate(zip(plan.programs, plan.regions)):
        before = lat
        handed = onchip[k] if k == 0 else []
        handoff = handoff if k else sum(program.tensors[t].nbytes for t in handed)
        if handed:  # what its shard plan reads whole is all-gathered on arrival
            gather = sum(program.tensors[t].nbytes for t in region.gathered_inputs)
        t, st = program.timing, program.timing.system
        res = int(program.memory.resident_bytes_total)
        lat += t.latency_s
        energy += t.energy_j
        wbytes += sum(x.nbytes for x in program.tensors if x.role == "const")
        resident += res
        streamed += int(st.streamed_bytes_per_chip)
        program_streamed.append(int(st.streamed_bytes_per_chip))
        program_timings.append(st)
        program_layers.append(tuple(t.layers))
        system = program.mapping.system if program.mapping is not None else None
        if system is not None:
            program_plans.append((system.tp, system.dp, system.sp))
            timed: dict = {}
            for c in system.candidates:
                if c.fits:
                    key = (c.tp, c.dp, c.sp)
                    timed[key] = min(timed.get(key, math.inf), c.latency_s)
            program_candidates.append(timed)
        peak = max(peak, int(program.memory.peak_bytes_max))
        kinds = {"compute": st.compute_bound_s, "dram": st.memory_bound_s, "sram": res / sram_bw,
                 "links": st.comm_bound_s}
        top = max(kinds, key=kinds.get)
        bounds[top] += kinds[top]
        for key, value in kinds.items():
            alone[key] += value
        a, b = region.state_bytes, region.state_sram_bytes
        kv, kv_sram = kv + a, kv_sram + b
        if a and slots:  # the step's new key and value written into their slot (every copy at once)
            for where, write in zip(("sram", "dram"), _kv_write_s(board, region.state_tensor_bytes / slots, b / a)):
                lat += write
                bounds[where] += write
                alone[where] += write
        program_s.append(lat - before)
    return _Stage(lat, energy, wbytes, resident, streamed, peak, handoff, bounds, alone, gather, kv, kv_sram,
                  tuple(program_s), tuple(program_streamed), tuple(program_timings),
                  *((tuple(program_plans), tuple(program_candidates)) if len(program_plans) == len(program_s)
                    else ((), ())), tuple(program_layers))


def _pipeline(described: dict, spec: ModelSpec, arch, batch: int, seq: int, host_shapes: set, steps,
              handover: str = "fp32", memo: "dict | None" = None, alone: bool = False):
    """The ``pipeline`` placement: the blocks (and the head) as a chain of board stages, each
    tensor-parallel over its board's chips (the scale-out mapper's plan), keeping its weights
    resident in the board's SRAM where they fit; consecutive stages hand the live activations
    over on the board-to-board links. A block is split into ``s`` stages (:data:`STAGES_PER_BLOCK`,
    at weight-GEMM boundaries, balanced by bytes) or ``m`` blocks share one stage
    (:data:`BLOCKS_PER_STAGE`); the fewest boards that keep the weights resident bound the
    search (more stages only add hand-overs: a token crosses them one after another).
    ``memo``: the stages already mapped (see :func:`_map_stage`). ``alone``: one hand-over
    crosses the board links at a time (one micro-batch in the pipeline), so a hand-over may
    take every edge-disjoint path between the two boards at once
    (:func:`~tvm_spinn.timing.collectives.multipath_point_to_point`), not only the chips'
    direct routes; the cheaper is taken. Returns ``({name: result}`` for each candidate
    mapped, the hand-over cost function)."""
    from ..mapping.planner import resident_capacity
    from ..target.allocation import board_name
    from ..target.faults import board_view, chain_boards, live_chips
    from ..target.topology import ring_order, topology_of
    from ..timing.collectives import multipath_point_to_point, point_to_point
    from ..timing.system import collective_cost

    order = chain_boards(arch)  # stage j on board order[j % boards]: the live boards, whole ones first
    boards = len(order)
    board = arch.replace(chips=arch.chips_per_board, name=board_name(arch))
    budget = resident_capacity(board)
    L = spec.layers
    dec, head = described["decode"], described["head"]
    block_atoms = [a for i, d in enumerate(dec) for a in _atoms(i, d.program)]
    head_atoms = [a for i, d in enumerate(head) for a in _atoms(i, d.program)]
    block_w = sum(a[3] for a in block_atoms)
    head_parts = min(len(head_atoms), max(1, math.ceil(sum(a[3] for a in head_atoms) / budget)))
    topo, board_topo = topology_of(arch), topology_of(board)
    ring = ring_order(board_topo, board.chips)
    costed: dict = {}  # (board, bytes, gathered bytes) -> seconds: the candidates share hand-overs

    def handoff_s(j: int, nbytes: int, gather_bytes: int | None = None) -> float:
        """Stage ``j`` -> ``j + 1``: each chip sends its 1/48 to its counterpart on the next
        board, which all-gathers what its first program reads whole (``gather_bytes``, default
        all of it; an input a row-parallel GEMM reads split stays split)."""
        if nbytes <= 0:
            return 0.0
        gather_bytes = nbytes if gather_bytes is None or gather_bytes < 0 else gather_bytes
        key = (j % boards, nbytes, gather_bytes, alone)
        if key not in costed:
            costed[key] = _handoff_now(j, nbytes, gather_bytes)
        return costed[key]

    def _handoff_now(j: int, nbytes: int, gather_bytes: int) -> float:
        # the handed-over activations are fp32 in the program; carried as ``handover`` elements
        nbytes, gather_bytes = (x * HANDOVER_BYTES[handover] // 4 for x in (nbytes, gather_bytes))
        src, dst = live_chips(arch, order[j % boards]), live_chips(arch, order[(j + 1) % boards])
        n = min(src.size, dst.size)  # a board with dead chips: its live ones, pairwise
        there = board_view(arch, order[(j + 1) % boards])
        there_topo = topology_of(there) if there != board else board_topo
        there_ring = ring_order(there_topo, there_topo.live_chips().size) if there != board else ring
        move = point_to_point(topo, src[:n], dst[:n], nbytes / n).seconds
        if alone and order[j % boards] != order[(j + 1) % boards]:
            move = min(move, multipath_point_to_point(topo, order[j % boards], order[(j + 1) % boards],
                                                      nbytes).seconds)
        return move + (collective_cost(there_topo, there_ring, "all_gather", gather_bytes, False).seconds
                       if gather_bytes else 0.0)

    results = {}
    head_runs = _balanced(head_atoms, head_parts)
    head_stages = None
    options = [("s", s) for s in STAGES_PER_BLOCK if s <= len(block_atoms) and L * s + head_parts <= boards]
    if L + head_parts > boards and boards > head_parts:
        # fewer boards than blocks: several blocks per board, their weights resident as far as
        # the board's SRAM holds them (the fewest blocks per board that fit the boards always
        # tried: streaming then, the replicated plan's rival for filling a pipeline with a batch)
        least = math.ceil(L / (boards - head_parts))
        options += [("m", m) for m in sorted({least} | {m for m in BLOCKS_PER_STAGE if least <= m
                                                          and m * block_w <= budget})]
    slower = 0
    best = math.inf
    for kind, n in options:
        steps.set_postfix_str(f"map: pipeline, {f'{n} stages per block' if kind == 's' else f'{n} blocks per stage'}")
        runs = _balanced(block_atoms, n) if kind == "s" else [block_atoms * n]
        pieces = [[_slice(dec[i].program, a, b) for i, a, b in _merge(run)] for run in runs]
        stages = [_map_stage(p, board, host_shapes, spec.cache_slots(seq), memo=memo) for p in pieces]
        head_pieces = [[_slice(head[i].program, a, b) for i, a, b in _merge(run)] for run in head_runs]
        if head_stages is None:
            head_stages = [_map_stage(p, board, host_shapes, memo=memo) for p in head_pieces]
        copies = L if kind == "s" else math.ceil(L / n)
        chain = [st for _ in range(copies) for st in stages] + head_stages
        if arch.has_faults:  # a stage on a board with dead chips or links: mapped on that board as it is
            from .machine import remap_on_boards

            chain = remap_on_boards(chain, [p for _ in range(copies) for p in pieces] + head_pieces, arch, order,
                                    board, lambda p, view, last: _map_stage(
                                        p, view, host_shapes, 0 if last else spec.cache_slots(seq), memo=memo),
                                    len(head_stages))
        results[f"pipeline:{kind}{n}"] = dict(stages=stages, head_stages=head_stages, chain=chain, kind=kind, n=n)
        steps.update()
        if kind == "s" and all(st.streamed_bytes_per_chip == 0 for st in stages + head_stages):
            break  # every weight resident: more stages per block only add hand-overs
        # more stages per block only pay when they keep more weights resident; two candidates in
        # a row slower than the best so far end the search (planning time)
        total = sum(st.latency_s for st in chain)
        slower = slower + 1 if total >= best else 0
        best = min(best, total)
        if slower >= 2:
            break
    return results, handoff_s


def _pipeline_records(described: dict, spec: ModelSpec, arch, model, target, dtype: str, batch: int, seq: int,
                      kv_bytes: int, weight_bytes: int, steps, handover: str = "fp32",
                      memo: "dict | None" = None, refused: "dict | None" = None) -> dict:
    """The ``pipeline`` candidates (:func:`_pipeline`) as records of :func:`plan`; a candidate
    whose stages do not hold every user's KV cache (:func:`tvm_spinn.llm.batching.stage_caches`)
    is left out, its reason in ``refused``.

    Users go through the chain of stages in micro-batches of ``ceil(batch / stages)`` (one user
    each up to as many users as stages), so a batch fills the pipeline: a user's next token
    starts when its last one leaves the head, and a stage serves the micro-batches one after
    another, so the per-user token period is ``max(sum of stages and hand-overs, micro-batches
    x the slowest stage)``."""
    from .describe import describe

    L = spec.layers
    mb = max(1, math.ceil(batch / (L + 1)))
    if mb != batch:
        described = dict(described)
        for name, module, args in _parts(model, spec, mb, seq):
            if name != "prefill":
                described[name] = describe(module, args, target, dtype)
    host = _parts(model, spec, mb, seq)[0][2][1:]  # KV cache, write/attention masks, rotary tables
    host_shapes = {tuple(int(d) for d in a.shape) for a in host}
    micro = math.ceil(batch / mb)
    raw, handoff_s = _pipeline(described, spec, arch, mb, seq, host_shapes, steps, handover, memo, alone=micro == 1)
    if not raw:
        return {}
    from ..target.allocation import board_name
    from ..target.faults import board_view, chain_boards, live_chips
    from .batching import stage_caches
    from .machine import boards_used

    order = chain_boards(arch)
    board = arch.replace(chips=arch.chips_per_board, name=board_name(arch))
    prompt = described["prefill"]

    def prefill_block():
        """The block's prompt mapped on one board: only the kept record reports it (its SRAM
        peak and ``block_prefill_s``), so it is mapped once a plan, and only where a pipeline
        candidate is kept (:func:`_finish`)."""
        key = ("block_prefill", board)  # the same board in every patch of the system
        if memo is None or key not in memo:
            pre = _map(prompt, board, "auto")
            if memo is None:
                return pre
            memo[key] = pre
        return memo[key]

    def finish(record: dict) -> dict:
        pre = prefill_block()
        record["sram_pe"] = max(record["sram_pe"], pre.peak_pe_bytes)
        record["meta"]["block_prefill_s"] = pre.latency_s
        return record

    out = {}
    for name, r in raw.items():
        chain, kind, n = r["chain"], r["kind"], r["n"]
        hand_in = [0.0] + [handoff_s(j, chain[j + 1].handoff_in_bytes, chain[j + 1].handoff_gather_bytes)
                           for j in range(len(chain) - 1)]
        # the token from the head's board (the chain's last) back to the first, the host's I/O
        first, last = (live_chips(arch, order[j % len(order)]) for j in (0, len(chain) - 1))
        io = _step_io(arch, batch, seq, last[0], first)
        loop_s = io["token_return_s"] + io["step_sync_s"] + io["host_io_decode_s"]
        # every user's KV cache on every stage (micro-batches beyond the SRAM's room in DRAM)
        stage_boards = [order[j % len(order)] for j in range(len(chain))]
        views = {b: board_view(arch, b) if arch.has_faults else board for b in set(stage_boards)}
        caches = stage_caches(chain, hand_in, batch, mb, [views[b] for b in stage_boards], stage_boards, arch)
        if not caches.fits:
            if refused is not None:
                refused[name] = caches.message(arch.name)
            continue
        decode_s = sum(st.latency_s for st in chain) + sum(hand_in) + loop_s + caches.spill_decode_s
        period = max(decode_s, caches.round_s)
        contrib = dict.fromkeys(("compute", "dram", "sram", "links"), 0.0)
        alone = dict(contrib)
        for st, h in zip(chain, hand_in):
            for k in contrib:
                contrib[k] += st.bounds[k]
                alone[k] += st.alone[k]
            contrib["links"] += h
            alone["links"] += h
        contrib["links"] += loop_s
        alone["links"] += loop_s
        bound_s = max(sum(contrib.values()), micro * max(sum(st.bounds.values()) for st in chain))
        # replicated vectors (norm scales) count once per chip in a program's resident bytes;
        # the KV cache kept in SRAM is not a weight
        resident = sum(min(st.resident_bytes - st.kv_sram_bytes, st.weight_bytes) for st in chain)
        kv_all, kv_held = caches.bytes, caches.sram_bytes  # every user's
        blocks = n if kind == "m" else 1
        per_block = len(r["stages"])
        on = boards_used(arch, len(chain))
        used = sum(live_chips(arch, b).size for b in on)
        stage_desc = (f"each of the {L} blocks split into {per_block} board stages" if kind == "s" and per_block > 1
                      else "one board per block" if kind == "s" else f"{n} blocks per board")
        out[name] = dict(
            decode_s=decode_s, period_s=period, energy_j=sum(st.energy_j for st in chain) / mb, used=used,
            resident=resident,
            streamed=max(0, weight_bytes - resident), kv_sram=kv_bytes * (kv_held / kv_all if kv_all else 0.0),
            sram_pe=max(st.peak_pe_bytes for st in chain), finish=finish,  # the prompt's peak: finish
            # a stage's streamed bytes include its KV cache where that is in DRAM
            dram_chip=int(math.ceil(max(st.streamed_bytes_per_chip for st in r["stages"] + r["head_stages"]))),
            bounds=contrib, bound_s=bound_s, binding=max(contrib, key=contrib.get),
            description=(f"pipeline of {len(chain)} board stages ({stage_desc}, the head on {len(r['head_stages'])}), "
                         f"each tensor-parallel over its board's {board.chips} chips; activations handed over "
                         f"stage to stage on the board-to-board links; micro-batches of {mb} user(s)"),
            meta={"stages": len(chain), "boards_per_stage": 1, "stages_per_block": per_block if kind == "s" else None,
                  "blocks_per_stage": blocks, "boards_used": len(chain),
                  "replicas": len(order) // len(chain), "micro_batch": mb,
                  **({"boards": list(on)} if arch.has_faults else {}),
                  "micro_batches": micro, "chips_per_group": board.chips, "groups": len(chain),
                  "mapping_weights": "auto", "bounds_alone_s": alone,
                  "block_decode_s": sum(st.latency_s for st in r["stages"]) * (1 if kind == "s" else 1 / n),
                  "block_prefill_s": None, "head_decode_s": sum(st.latency_s for st in r["head_stages"]),
                  "handoff_decode_s": sum(hand_in), **io,
                  **({"kv_cache_users": caches.users(), "largest_batch": caches.largest_batch,
                      "kv_spill_decode_s": caches.spill_decode_s} if batch > 1 else {}),
                  "stage_plan": [{"latency_s": st.latency_s, "weight_bytes": st.weight_bytes,
                                  "resident_bytes": st.resident_bytes, "weights_in":
                                  "sram" if st.resident_bytes - st.kv_sram_bytes >= st.weight_bytes else
                                  "dram" if st.resident_bytes - st.kv_sram_bytes == 0 else "sram+dram",
                                  "kv_cache_bytes": st.kv_bytes, "kv_cache_sram_bytes": st.kv_sram_bytes,
                                  "handoff_in_bytes": st.handoff_in_bytes,
                                  "handoff_gathered_bytes": st.handoff_gather_bytes}
                                 for st in r["stages"] + r["head_stages"]]})
    return out
