"""The prompt as its own plan: chunked prefill pipelined over boards (time to first token).

A prompt of ``n`` tokens is cut into chunks of ``C`` tokens that flow through a pipeline of
*stages*, so the stages work on different chunks at once. A stage is a group of ``g``
neighbouring boards (:func:`tvm_spinn.llm.board_tp.board_groups`) running ``m`` consecutive
blocks, each block tensor-parallel over the group (for ``g >= 2`` each board runs the block's
slice, :func:`tvm_spinn.llm.board_tp.slice_config`, whose int32 partial sums are all-reduced
across the boards twice a block: :func:`tvm_spinn.timing.collectives.board_all_reduce`) and,
inside a board, over its chips as the mapper plans it (the int8 weight GEMMs at ``M = C`` on the
MAC arrays). Between stages each chunk's hidden state (``C x hidden`` elements of the plan's
``handover`` type) crosses the board links, each chip sending its share to its counterpart on
the next group (:func:`tvm_spinn.timing.collectives.point_to_point`; between groups of several
boards in slices where that is cheaper, :func:`tvm_spinn.timing.collectives.sliced_hand_over`),
then all-gathered on the receiving board where its first program reads it whole. Between one-board stages the hand-over
also takes relay paths: the edge-disjoint paths of board edges between the two boards that no
other hand-over's routes or relays use (every hand-over runs at once in the pipeline's steady
state), its shares split so that they finish together.

Chunk ``k`` attends over the ``(k + 1) C`` keys written so far (its own included: a
sliding window keeps at most the window's); its keys and values are the program's outputs,
written into the KV cache of the stage's chips, where that stage's blocks keep them. A block's
chunk is one program (:class:`ChunkStep`, described with descriptor weights by
:mod:`.describe`) mapped on one board by the normal mapper with the board's SRAM ledger
(:func:`tvm_spinn.llm.plan._map_stage`) at the first chunk's context and at the last's; the
chunks between are timed on the straight line between the two (attention's work is linear in
the context, the weight GEMMs' constant). A stage of ``m`` blocks runs the first blocks its SRAM
keeps resident at the time of the block mapped with ``weights="auto"`` and the rest at the time
of the block streaming its weights (as :func:`tvm_spinn.llm.board_tp._run_s`).

The pipeline is timed as a flow shop (:func:`flow_shop_s`): the machines are the stages and the
board links between them, in order, each taking the chunks in order; on identical machines of
time ``t`` per chunk that is ``(machines + chunks - 1) t``. After the last chunk the last token's
hidden state goes to the board of the LM head, which produces the first token; the host link
carries the prompt in and the token out (:func:`tvm_spinn.llm.plan._step_io`).

Searched: the chunk size (powers of two from :data:`MIN_CHUNK` that divide the prompt, and the
whole prompt: all of them up to :data:`EXHAUSTIVE` sizes, else a climb from the size that
makes as many chunks as stages, taking the first faster neighbour, the smaller first), the boards a block is tensor-parallel over (:data:`TP_BOARDS`, at the best
chunk size of one board per block) and the blocks a stage runs (every stage used, two or four
times fewer stages, or one). One board runs every block as one stage. A layout whose stages
stream some of their blocks' weights is mapped with them streamed only when, timed with those
blocks at the mapper's own choice (``auto``, never slower than streaming), it could beat the
best layout found. A layout whose lower bound already exceeds the best time found is not timed
(``prune``): a machine of its pipeline running every chunk between the first chunk's way there
and the last one's way on; for boards taking turns, a last-stage board's chunks one after
another; for a block over several boards, before its slice is mapped, the all-reduces and
hand-overs alone (the layouts over boards taking turns are searched before those wider blocks).
One prompt is planned (a batch's prompts would follow it through the pipeline).

Where the system has the boards, a stage of one block may also run on ``r`` neighbouring boards
(:data:`REPLICAS`), each holding the block's weights and its whole KV cache and taking every
``r``-th chunk, so a stage starts a chunk while its other boards still run the earlier ones
(:func:`replicated_flow_shop`). A chunk's attention reads every earlier chunk's keys and
values: each board sends the chunk's keys and values (fp32) to the stage's other boards as soon
as the block's work before its attention (its norm and the key, query and value projections,
mapped alone: ``prefix``) has written them, each chip its share at once on the link graph, and a
chunk's attention waits for those of the chunks before it (writing the received keys and values
into a board's cache is not timed: ``2 x kv_heads x head_dim`` fp32 values a token and block). Each board hands a chunk over to its
counterpart on the next stage (every pair at once on the link graph), charged the keys' and
values' transfer on top of its own (the two may share board edges and are not timed together on
the link graph). The chunk sizes are climbed again from the best layout's of one board a
block (healthy systems only). The prompt's plan is the system's, whatever the
decode placement: every decode alternative's time to first token is this plan's.

On a system with faults or a partial allocation (:mod:`tvm_spinn.target.faults`) the prompt
runs on the live hardware only: stages of one board on the usable boards (the whole ones first),
a block tensor-parallel over whole boards only, and a stage or the head on a board with dead
chips or links mapped on that board as it is (:func:`~tvm_spinn.target.faults.board_view`);
``PrefillPlan.boards`` names the boards used.

The bound next to it (:func:`prefill_bound`) is the project's physical bound
(:func:`tvm_spinn.timing.bounds.physical_bound`) of the prompt's work (:func:`prefill_workload`):
its MACs at the system's peak, every weight read once, and the least crossings a placement needs.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass

import numpy as np

from .spec import MAX_DIM, LLMError, ModelSpec

__all__ = ["PrefillPlan", "ChunkStep", "plan_prefill", "prefill_workload", "prefill_bound", "flow_shop_s",
           "flow_shop_path", "replicated_flow_shop", "chunk_sizes", "TP_BOARDS", "REPLICAS", "MIN_CHUNK"]

#: Smallest chunk searched (tokens). Every power of two from it is a candidate: a chunk's time on a
#: stage whose on-board collectives and hand-over carry its rows is nearly proportional to its
#: tokens, so a smaller chunk shortens the pipeline's fill (each stage's first chunk and
#: hand-over), while each chunk pays the fixed costs (a streamed block's weights re-read, the
#: hops' latencies) once; the climb (:func:`plan_prefill`) stops where they balance
MIN_CHUNK = 1
#: Boards a block is tensor-parallel over in the prefill search (1: a block on one board)
TP_BOARDS = (1, 2, 4)
#: Boards a one-block stage may run on, each taking every ``r``-th chunk (1: one board a stage)
REPLICAS = (2, 4, 8)
#: Chunk-size ladders this short are searched whole; longer ones by a climb (see :func:`plan_prefill`)
EXHAUSTIVE = 2


def _plan_module():
    # ``tvm_spinn.llm.plan`` is the function the package exports; the module by its full name
    return importlib.import_module(".plan", __package__)


def chunk_sizes(prompt: int) -> list[int]:
    """Chunk sizes searched for a prompt of ``prompt`` tokens: the powers of two from
    :data:`MIN_CHUNK` that divide it (every chunk full), and the whole prompt."""
    out = []
    c = MIN_CHUNK
    while c < prompt:
        if prompt % c == 0:
            out.append(c)
        c *= 2
    return out + [prompt]


def flow_shop_s(times) -> float:
    """Makespan of chunks flowing through machines in order, each machine taking the chunks in
    order and one at a time: ``times[m][k]`` seconds of chunk ``k`` on machine ``m``.

    ``finish[m][k] = max(finish[m - 1][k], finish[m][k - 1]) + times[m][k]``; equal times ``t``
    give ``(machines + chunks - 1) t``."""
    times = np.asarray(times, dtype=np.float64)
    if times.ndim != 2 or times.size == 0:
        raise ValueError(f"times must be machines x chunks (non-empty), got shape {times.shape}")
    # Python floats (the same IEEE doubles): the recurrence is sequential, and numpy's per-element
    # access would cost several times the arithmetic
    finish = [0.0] * times.shape[1]
    for row in times.tolist():
        # finish[k] = max(previous machine's finish[k], this machine's finish[k - 1]) + row[k]
        done = 0.0
        for k, t in enumerate(row):
            f = finish[k]
            done = (done if done > f else f) + t
            finish[k] = done
    return float(finish[-1])


def flow_shop_path(times) -> list[tuple[int, int]]:
    """A critical path of :func:`flow_shop_s`'s schedule: the ``(machine, chunk)`` cells, first
    to last, whose times add up to the makespan.

    From the last cell back, each cell's predecessor is the one its start waited for: the same
    chunk on the previous machine or the previous chunk on the same machine (the former on a
    tie)."""
    times = np.asarray(times, dtype=np.float64)
    if times.ndim != 2 or times.size == 0:
        raise ValueError(f"times must be machines x chunks (non-empty), got shape {times.shape}")
    machines, chunks = times.shape
    finish = []
    above = [0.0] * chunks
    for row in times.tolist():
        done = 0.0
        mine = []
        for f, t in zip(above, row):
            done = (done if done > f else f) + t
            mine.append(done)
        finish.append(mine)
        above = mine
    path = [(machines - 1, chunks - 1)]
    m, k = path[0]
    while m or k:
        up = finish[m - 1][k] if m else -math.inf
        left = finish[m][k - 1] if k else -math.inf
        m, k = (m - 1, k) if up >= left else (m, k - 1)
        path.append((m, k))
    return path[::-1]


def replicated_flow_shop(stages, prefix, handovers, replicas: int, kv_s: float) -> tuple[float, dict]:
    """Makespan of chunks through stages of ``replicas`` boards each running the stage's blocks,
    chunk ``k`` on replica ``k mod replicas`` (round robin), and where the time goes.

    ``stages[j][k]``: chunk ``k``'s seconds on stage ``j``; ``prefix[j][k]``: of them, the
    seconds until its keys and values are written (the blocks' work before their attention
    reads the cache); ``handovers[j][k]``: its hand-over from stage ``j`` to ``j + 1``, each
    replica to its counterpart (one fewer row than ``stages``). A replica takes its chunks in
    order, one at a time; a chunk's attention needs every earlier chunk's keys and values, which
    an earlier chunk's replica sends the others ``kv_s`` after writing them. So chunk ``k`` on
    stage ``j`` starts when it has arrived and its replica is free, waits at its attention for
    the earlier chunks' keys and values, and finishes the rest of its blocks; one replica is the
    flow shop (:func:`flow_shop_s`).

    Returns
    -------
    tuple
        The makespan and, of its critical path (from the last chunk's finish back, each
        cell to the constraint its start or its attention waited for), the seconds of blocks,
        of hand-overs and of waits for other replicas' keys and values (``kv_s``), with the
        cells of each.
    """
    stages = np.asarray(stages, dtype=np.float64)
    prefix = np.asarray(prefix, dtype=np.float64)
    handovers = np.asarray(handovers, dtype=np.float64)
    if (stages.ndim != 2 or stages.size == 0 or prefix.shape != stages.shape or handovers.ndim != 2
            or handovers.shape != (stages.shape[0] - 1, stages.shape[1])):
        raise ValueError(f"stages and prefix must be stages x chunks (non-empty) with one hand-over row fewer, "
                         f"got {stages.shape}, {prefix.shape} and {handovers.shape}")
    prefix = np.minimum(prefix, stages)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    S, n = stages.shape
    R = replicas
    # Python floats (the same IEEE doubles) in the sequential recurrences: numpy's per-element
    # access would cost several times the arithmetic
    st, pre, ho = stages.tolist(), prefix.tolist(), handovers.tolist()
    finish = [[0.0] * n for _ in range(S)]
    began_by_replica = [[False] * n for _ in range(S)]  # else by its arrival
    kv_src = [[-1] * n for _ in range(S)]  # the chunk whose keys and values its attention waited for
    hand_by_previous = [[False] * n for _ in range(max(S - 1, 0))]  # else by its stage's finish
    arrive = [0.0] * n
    for j in range(S):
        free = [0.0] * R
        ready = [-math.inf] * R  # per replica: when the other chunks' keys and values are all there
        ready_src = [-1] * R
        st_j, pre_j, fin_j, src_j, by_j = st[j], pre[j], finish[j], kv_src[j], began_by_replica[j]
        for k in range(n):
            r = k % R
            a, f = arrive[k], free[r]
            begin = a if a > f else f
            by_j[k] = f > a
            p = pre_j[k]
            attend = begin + p
            if ready[r] > attend:
                attend, src_j[k] = ready[r], ready_src[r]
            done = attend + st_j[k] - p
            fin_j[k] = done
            free[r] = done
            if R > 1:
                kv = begin + p + kv_s
                for q in range(R):
                    if q != r and kv > ready[q]:
                        ready[q], ready_src[q] = kv, k
        if j < S - 1:
            last = [0.0] * R
            done_k = [0.0] * n
            ho_j, prev_j = ho[j], hand_by_previous[j]
            for k in range(n):
                r = k % R
                f, l = fin_j[k], last[r]
                prev_j[k] = l > f
                d = (f if f > l else l) + ho_j[k]
                done_k[k] = d
                last[r] = d
            arrive = done_k
    finish = np.array(finish)
    kv_src = np.array(kv_src, dtype=np.int64)
    began_by_replica = np.array(began_by_replica, dtype=bool)
    hand_by_previous = np.array(hand_by_previous, dtype=bool).reshape(max(S - 1, 0), n)
    out = dict(blocks_s=0.0, handovers_s=0.0, kv_s=0.0, stage_steps=0, handover_steps=0, kv_steps=0)
    on = np.zeros(S, dtype=np.int64)  # the path's stage cells on each stage, and their seconds
    on_s = np.zeros(S)
    j, k = S - 1, int(np.argmax(finish[-1]))
    makespan = float(finish[j, k])
    node = "finish"
    while True:
        if node == "finish":
            out["stage_steps"] += 1
            on[j] += 1
            if kv_src[j, k] >= 0:  # the rest of its blocks after the wait, the transfer, the source's prefix
                t = stages[j, k] - prefix[j, k] + prefix[j, kv_src[j, k]]
                out["kv_s"] += kv_s
                out["kv_steps"] += 1
                on_s[j] += kv_s
                k = int(kv_src[j, k])
            else:
                t = stages[j, k]
            out["blocks_s"] += t
            on_s[j] += t
            node = "begin"
        elif node == "begin":
            if began_by_replica[j, k]:
                k, node = k - R, "finish"
            elif j == 0:
                break
            else:
                j, node = j - 1, "hand"
        else:  # a hand-over from stage j: after the previous one of its replica pair, or its chunk's finish
            out["handovers_s"] += handovers[j, k]
            out["handover_steps"] += 1
            if hand_by_previous[j, k]:
                k -= R
            else:
                node = "finish"
    steady = int(np.argmax(on))  # the stage holding most of the path's cells (the first of a tie)
    out.update(steady_steps=int(on[steady]), steady_s=float(on_s[steady]), fill_drain_s=makespan - float(on_s[steady]))
    return makespan, out


def _critical_path(rows: list, reduces: list) -> dict:
    """Where a pipeline's time goes: the cells of its flow shop's critical path
    (:func:`flow_shop_path`; ``rows``: stages and hand-overs alternating, ``reduces[m]``: the
    all-reduce seconds in each of machine ``m``'s cells), summed by kind. ``steady_s``: the
    path's cells on the machine that holds most of them (its chunks one after another);
    ``fill_drain_s``: the rest (the first chunk's way to that machine, the last chunk's from
    it)."""
    path = flow_shop_path(rows)
    on = {}
    for m, _ in path:
        on[m] = on.get(m, 0) + 1
    steady_machine = max(sorted(on), key=lambda m: on[m])
    out = dict.fromkeys(("blocks_s", "all_reduces_s", "handovers_s", "steady_s", "fill_drain_s"), 0.0)
    out.update(stage_steps=0, handover_steps=0, steady_steps=on[steady_machine])
    for m, k in path:
        t = float(rows[m][k])
        if m % 2:
            out["handovers_s"] += t
            out["handover_steps"] += 1
        else:
            out["blocks_s"] += t - reduces[m]
            out["all_reduces_s"] += reduces[m]
            out["stage_steps"] += 1
        out["steady_s" if m == steady_machine else "fill_drain_s"] += t
    return out


def prefill_workload(spec: ModelSpec, prompt: int, dtype: str, handover_itemsize: int = 4):
    """The :class:`~tvm_spinn.timing.bounds.Workload` of a prompt's prefill up to the first token.

    MACs: every block's weight GEMMs for each of the ``prompt`` tokens (``dtype``; a mixture of
    experts: the router and the ``experts_per_token`` experts each token picks), the causal
    attention's two matmuls (fp32: query ``i`` against ``i + 1`` keys, at most a sliding
    window's), and the LM head for the last token. Bytes read: every weight once (a mixture of
    experts: the experts the prompt's tokens can pick, ``min(experts, prompt x experts_per_token)``
    a block, every one of them for a prompt of a few tokens), the vectors and the prompt's
    embedding rows. Hand-over: the prompt's residual stream (``prompt`` rows of
    ``hidden`` elements of ``handover_itemsize`` bytes); sync points: two norms a block and the
    final norm. Largest stretch: as :func:`tvm_spinn.timing.bounds.decode_workload` without a
    cache (the prompt's keys are computed, not read)."""
    from ..timing.bounds import Workload

    itemsize = {"int8": 1, "fp32": 4}[dtype]
    h, i, v = spec.hidden, spec.intermediate, spec.vocab
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    mlp = 3 if spec.family == "llama" else 2
    # a mixture of experts stores every expert and a router; a token runs k of them, the prompt
    # reads those its tokens pick
    stored_experts, per_token = max(1, spec.experts), max(1, spec.experts_per_token)
    read_experts = min(stored_experts, prompt * per_token)
    attn, router = h * (q + 2 * kv) + q * h, spec.experts * h
    block = attn + mlp * h * i * stored_experts + router
    read_block = attn + mlp * h * i * read_experts + router
    tables = (0 if spec.tied_embeddings else v * h) + (spec.max_positions * h if spec.family == "gpt2" else 0)
    vectors = spec.params - spec.layers * block - v * h - tables
    rows = prompt * h * ((0 if spec.tied_embeddings else 1) + (1 if spec.family == "gpt2" else 0))
    window = spec.sliding_window or prompt
    # query i sees min(i + 1, window) keys
    keys = sum(min(j + 1, window) for j in range(prompt)) if window < prompt else prompt * (prompt + 1) // 2
    attention = spec.layers * 2 * spec.heads * spec.head_dim * keys
    gemm = prompt * spec.layers * (attn + mlp * h * i * min(per_token, stored_experts) + router) + v * h
    weights = (spec.layers * read_block + v * h) * itemsize + vectors * 4 + rows * itemsize
    largest = max(attn, mlp * h * i * read_experts, v * h) * itemsize + vectors * 4 + rows * itemsize
    return Workload(macs_int8=gemm if dtype == "int8" else 0,
                    macs_fp32=attention + (gemm if dtype == "fp32" else 0),
                    read_bytes=int(weights), handover_bytes=prompt * h * handover_itemsize, handover_rows=prompt,
                    sync_points=2 * spec.layers + 1, largest_phase_bytes=int(min(largest, weights)),
                    description={"prompt": prompt, "dtype": dtype, "weight_bytes_read": int(weights),
                                 "attention_macs": attention, "gemm_macs": gemm})


def prefill_bound(spec: ModelSpec, prompt: int, dtype: str, arch, handover_itemsize: int = 4):
    """Plan-independent lower bound on the time to first token (a
    :class:`~tvm_spinn.timing.bounds.PhysicalBound` of :func:`prefill_workload` on ``arch``)."""
    from ..timing.bounds import physical_bound

    return physical_bound(prefill_workload(spec, prompt, dtype, handover_itemsize), arch)


def _chunk_step_class():
    from .graphs import LayerStep

    class _Chunk(LayerStep):
        """One block on a chunk of ``C`` prompt tokens after ``P`` earlier ones:
        ``forward(x (b, C, hidden), k_cache (b * kv_heads, head_dim, P + C), v_cache (b *
        kv_heads, P + C, head_dim), mask (C, P + C)[, cos, sin])`` -> ``(x, k, v)``; the chunk's
        keys and values (``k``, ``v``) are written into the cache's last ``C`` slots, which the
        attention reads with the earlier ones (planning only: shapes, not values, matter)."""

        def forward(self, x, k_cache, v_cache, mask, *rope):
            def cache_fn(i, k_t, v):
                return k_cache, v_cache, k_t, v

            cos, sin = (list(rope) + [None, None])[:2]
            return self._layer(0, x, cache_fn, mask, cos, sin)

    return _Chunk


def ChunkStep(model, spec: ModelSpec, context: int, fuse: bool = True):
    """The block of ``model`` (a one-block model) on a chunk attending over ``context`` keys
    (see the returned module's docstring); ``fuse``: the projections that read one input as one
    GEMM each (:class:`~tvm_spinn.llm.graphs.LayerStep`), or each its own."""
    return _chunk_step_class()(model, spec, context, fuse=fuse).eval()


#: The context's axes among :func:`_chunk_args` (argument index -> {axis: symbol}): the keys of
#: the K cache, the V cache and the mask
_CONTEXT_DIMS = {1: {2: "context"}, 2: {1: "context"}, 3: {1: "context"}}
#: The chunk's and the context's axes among :func:`_chunk_args`: the hidden state's and the
#: rotary tables' tokens, the mask's rows (the chunk) and the context's axes
_CHUNK_DIMS = {0: {1: "chunk"}, 1: {2: "context"}, 2: {1: "context"}, 3: {0: "chunk", 1: "context"},
               4: {1: "chunk"}, 5: {1: "chunk"}}
#: The example sizes the block is exported at with both symbolic (distinct, so that torch keeps
#: them two symbols; a chunk of at least 2, as the sizes bound to it: torch specializes 1)
_EXAMPLE_CHUNK, _EXAMPLE_CONTEXT = 4, 12


def _chunk_args(spec: ModelSpec, chunk: int, context: int) -> tuple:
    import torch

    d, kvh = spec.head_dim, spec.kv_heads
    with torch.device("meta"):
        args = [torch.zeros(1, chunk, spec.hidden), torch.zeros(kvh, d, context), torch.zeros(kvh, context, d),
                torch.zeros(chunk, context)]
        if spec.family != "gpt2":  # rotary tables of the rotated channels (GPT-J: the first rotary_dim)
            r = spec.rotary_dim or d
            args += [torch.zeros(1, chunk, r), torch.zeros(1, chunk, r)]
    return tuple(args)


@dataclass(frozen=True)
class PrefillPlan:
    """A prompt's prefill planned on a spinn system (timing model; no weights, no simulation).

    ``ttft_s``: time to first token; ``bound_s``: the plan-independent bound
    (:func:`prefill_bound`), ``efficiency = bound_s / ttft_s``; ``parts_s``: the pipeline
    (``pipeline_s``, the flow shop of stages and hand-overs), the last token to the head's
    board, the head, the host's I/O; ``busiest``: the resource the pipeline waits on
    (``stage``: a stage's programs, ``links``: a hand-over between stages) and its seconds
    summed over the chunks; ``candidates``: every layout and chunk size timed."""

    model: str
    system: str
    prompt: int
    dtype: str
    handover: str
    chunk: int
    chunks: int
    tp_boards: int
    blocks_per_stage: int
    stages: int
    boards_used: int
    ttft_s: float
    bound_s: float
    bound: dict
    parts_s: dict
    busiest: dict
    stage_chunk_s: tuple  # a stage's blocks on the first chunk and on the last
    handover_chunk_s: float
    candidates: tuple
    #: the boards the prompt runs on (its stages' and the head's; never a dead one)
    boards: tuple = ()
    #: where the time goes: ``critical_path`` (the flow shop's critical path,
    #: :func:`flow_shop_path`, summed by kind), ``block_chunk_s`` (one block on the first chunk and on the
    #: last), ``block_bounds_s`` (what binds the mapped block at the first chunk, each kind
    #: alone), ``all_reduces_chunk_s`` (a block's all-reduces on a chunk across its boards)
    breakdown: dict = dataclasses.field(default_factory=dict)
    #: boards each one-block stage runs on, each taking every ``replicas``-th chunk
    #: (:func:`replicated_flow_shop`); ``breakdown`` then also gives ``kv_chunk_s`` (a chunk's
    #: keys and values to the stage's other boards) and ``prefix_chunk_s`` (a block's chunk
    #: until its keys and values are written)
    replicas: int = 1

    @property
    def efficiency(self) -> float:
        """The bound over the time to first token (at most 1)."""
        return self.bound_s / self.ttft_s if self.ttft_s > 0 else float("nan")

    def breakdown_line(self) -> str:
        """One line: the pipeline's critical path by kind and one block's chunk."""
        b = self.breakdown
        if not b:
            return ""
        cp = b["critical_path"]
        bounds = ", ".join(f"{k} {v * 1e3:.3g}" for k, v in b["block_bounds_s"].items())
        kv = (f" + {cp['kv_steps']} waits for another board's keys and values ({cp['kv_s'] * 1e3:.4g} ms)"
              if "kv_s" in cp else "")
        turns = (f"each stage on {self.replicas} boards taking turns (keys and values to the others "
                 f"{b['kv_chunk_s'] * 1e3:.3g} ms, written after {b['prefix_chunk_s'] * 1e3:.3g} ms); "
                 if self.replicas > 1 else "")
        return (f"{turns}pipeline {self.parts_s['pipeline_s'] * 1e3:.4g} ms = {cp['stage_steps']} stage steps "
                f"({cp['blocks_s'] * 1e3:.4g} ms blocks + {cp['all_reduces_s'] * 1e3:.4g} ms all-reduces){kv} + "
                f"{cp['handover_steps']} hand-overs ({cp['handovers_s'] * 1e3:.4g} ms); steady "
                f"{cp['steady_s'] * 1e3:.4g} ms ({cp['steady_steps']} chunks on one machine), fill/drain "
                f"{cp['fill_drain_s'] * 1e3:.4g} ms; a block's chunk {b['block_chunk_s'][0] * 1e3:.3g}-"
                f"{b['block_chunk_s'][1] * 1e3:.3g} ms (alone, ms: {bounds}), all-reduces "
                f"{b['all_reduces_chunk_s'] * 1e3:.3g} ms, hand-over {self.handover_chunk_s * 1e3:.3g} ms")

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["efficiency"] = self.efficiency
        out["candidates"] = [dict(c) for c in self.candidates]
        return out

    def line(self) -> str:
        """One line: TTFT, layout, bound and efficiency."""
        return (f"{self.ttft_s * 1e3:.4g} ms for {self.prompt} tokens: {self.chunks} chunk(s) of {self.chunk} through "
                f"{self.stages} stage(s) of {self.blocks_per_stage} block(s) on {self.tp_boards} board(s) "
                f"{f'x {self.replicas} taking turns ' if self.replicas > 1 else ''}"
                f"({self.boards_used} boards); bound {self.bound_s * 1e3:.4g} ms ({self.bound['binding']}), "
                f"efficiency {self.efficiency:.4f}; waits on {self.busiest['kind']} "
                f"({self.busiest['seconds'] * 1e3:.4g} ms over the chunks)")


def _cfg_key(cfg: dict) -> str:
    import json

    return json.dumps(cfg, sort_keys=True, default=str)


def _describe_chunk(cfg: dict, spec: ModelSpec, target, dtype: str, chunk: int, context: int, memo: dict,
                    g: int = 1, fuse: bool = True):
    """The chunk block's programs (described once per config, slice over ``g`` boards, chip,
    dtype, chunk, context and ``fuse``: see :func:`ChunkStep`); ``spec``: the slice's
    (:func:`tvm_spinn.llm.board_tp.slice_block`)."""
    from ..target import arch_of
    from . import board_tp
    from .describe import bind_dims, describe, describe_imported, imported
    from .spec import spec_of

    key = ("chunk", _cfg_key(cfg), g, repr(arch_of(target).replace(chips=1, name="")), dtype, chunk, context, fuse)
    if key not in memo:
        P = _plan_module()
        model_key = ("model", _cfg_key(cfg), g)
        if model_key not in memo:
            memo[model_key] = (P._meta_model(cfg, spec) if g == 1 else
                               board_tp.slice_block(cfg, spec_of(cfg), g)[1])
        model = memo[model_key]
        args = _chunk_args(spec, chunk, context)
        # the block imported once with the chunk and the context symbolic (the hidden state's
        # tokens, the cache's and the mask's key axis), bound to each chunk size and context:
        # the module their own import gives (the block's graph depends on neither value, from a
        # chunk of 2 on: one token's attention skips a reshape); failing that, once per chunk
        # size with the context symbolic; where torch ties the context to a constant, each
        # context is exported alone
        dims = {i: axes for i, axes in _CHUNK_DIMS.items() if i < len(args)}
        block_key = ("block-imported", _cfg_key(cfg), g, fuse)
        if block_key not in memo:
            try:
                memo[block_key] = imported(ChunkStep(model, spec, _EXAMPLE_CONTEXT, fuse),
                                           _chunk_args(spec, _EXAMPLE_CHUNK, _EXAMPLE_CONTEXT), dims=dims,
                                           derived=True)
            except Exception:  # noqa: BLE001 - torch's constraint errors have no common base
                memo[block_key] = None
        described = None
        if chunk >= 2 and memo[block_key] is not None:
            mod, n_weights = memo[block_key]
            try:
                bound = bind_dims(mod, dims, {"chunk": chunk, "context": context})
            except ValueError:  # torch kept a size constant: not this module
                bound = None
            if bound is not None:
                described = describe_imported(bound, n_weights, target, dtype)
        if described is None:
            import_key = ("chunk-imported", _cfg_key(cfg), g, chunk, fuse)
            if import_key not in memo:
                try:
                    memo[import_key] = imported(ChunkStep(model, spec, context, fuse), args, dims=_CONTEXT_DIMS)
                except Exception:  # noqa: BLE001 - torch's constraint errors have no common base
                    memo[import_key] = None
            if memo[import_key] is None:
                described = describe(ChunkStep(model, spec, context, fuse), args, target, dtype)
            else:
                mod, n_weights = memo[import_key]
                described = describe_imported(bind_dims(mod, _CONTEXT_DIMS, {"context": context}), n_weights,
                                              target, dtype)
        memo[key] = ([d.program for d in described], {tuple(int(x) for x in a.shape) for a in args[1:]})
    return memo[key]


@dataclass(frozen=True)
class _Alone:
    latency_s: float
    handoff_gather_bytes: int = 0


def _map_alone(described: list, arch, weights: str) -> _Alone:
    """Programs on the whole of a system smaller than a board, one after another
    (:func:`tvm_spinn.llm.plan._map`: no board ledger, no hand-over)."""
    return _Alone(_plan_module()._map(described, arch, weights).latency_s)


def _check(spec: ModelSpec, prompt, chunk) -> None:
    if isinstance(prompt, bool) or not isinstance(prompt, int) or not 1 <= prompt <= MAX_DIM:
        raise LLMError(f"prompt must be an integer in [1, {MAX_DIM}] (tokens), got {prompt!r}")
    if prompt > spec.max_positions:
        raise LLMError(f"prompt={prompt} is longer than the model's position table (config max positions "
                       f"{spec.max_positions})")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= prompt
                              or prompt % chunk):
        raise LLMError(f"chunk must be an integer in [1, prompt={prompt}] dividing the prompt, got {chunk!r}")


def plan_prefill(config, target="spinn/board", prompt: int = 2048, dtype: str = "int8", handover: str = "fp32",
                 chunk: "int | None" = None, tp_boards: "tuple | None" = None, memo: "dict | None" = None,
                 model_name: "str | None" = None, search: str = "climb", relays: bool = True,
                 reduce: str = "int32", prune: bool = True) -> PrefillPlan:
    """Plan the prefill of one ``prompt``-token prompt (the time to first token) on a spinn system.

    Parameters
    ----------
    config : str, dict, transformers config or model
        As :func:`tvm_spinn.llm.plan`.
    target : str or tvm.target.Target
        The spinn system.
    prompt : int
        Prompt tokens (at most the model's positions).
    dtype : {"int8", "fp32"}
        Arithmetic and storage of the weight GEMMs (attention stays fp32).
    handover : {"fp32", "fp16", "int8"}
        Element type of the hidden states crossing between stages
        (:data:`tvm_spinn.llm.plan.HANDOVER_BYTES`).
    chunk : int, optional
        Plan this chunk size only (it must divide the prompt); default: searched
        (:func:`chunk_sizes`).
    tp_boards : tuple of int, optional
        Boards a block may be tensor-parallel over (default :data:`TP_BOARDS`).
    memo : dict, optional
        Described and mapped programs to share between calls of one process (planning time).
    model_name : str, optional
        Name shown in the plan (default: the config's file name or family).
    search : {"climb", "all"}
        How chunk sizes are searched: a climb to a local minimum (few mappings), or every size
        (the mapper's costs are not always unimodal in the chunk size).
    relays : bool
        Hand-overs between one-board stages of a healthy system also take the edge-disjoint
        relay paths through neighbouring boards that no other hand-over uses (default), or only
        their chips' own routes (False).
    reduce : {"int32", "fp16", "bf16", "int8"}
        Element type of the partial sums a block tensor-parallel over boards all-reduces
        across them (:data:`tvm_spinn.llm.plan.REDUCE_BYTES`; ``int32`` keeps the model's bits;
        the narrow wires: :mod:`tvm_spinn.llm.wire`).
    prune : bool
        Leave untimed a layout whose lower bound (a machine of its pipeline running every chunk
        between the first chunk's way there and the last one's way on) exceeds the best time
        found (default; the same plan, in less planning time), or time every layout the search
        reaches (False: ``candidates`` holds them all).

    Returns
    -------
    PrefillPlan

    Raises
    ------
    LLMError
        A bad config field, ``prompt`` not a positive integer or beyond the model's positions,
        a bad ``chunk``, ``dtype`` or ``handover``.
    """
    import os

    from ..target import arch_of, get_target
    from ..target.arch import FAULT_FIELDS
    from ..target.faults import board_view, live_chips, usable_boards, whole_boards
    from ..target.topology import board_grid, ring_order, topology_of
    from ..timing.collectives import board_all_reduce, point_to_point, sliced_hand_over, water_fill
    from ..timing.system import collective_cost
    from ..mapping.planner import resident_capacity
    from . import board_tp
    from .spec import spec_of
    from .wire import narrow_all_reduce

    P = _plan_module()
    cfg = P._config_dict(config)
    spec = spec_of(cfg)
    _check(spec, prompt, chunk)
    if dtype not in P.DTYPES:
        raise LLMError(f"dtype must be one of {sorted(P.DTYPES)}, got {dtype!r}")
    if handover not in P.HANDOVER_BYTES:
        raise LLMError(f"handover must be one of {sorted(P.HANDOVER_BYTES)}, got {handover!r}")
    if reduce not in P.REDUCE_BYTES:
        raise LLMError(f"reduce must be one of {sorted(P.REDUCE_BYTES)}, got {reduce!r}")
    if search not in ("climb", "all"):
        raise LLMError(f"search must be 'climb' or 'all', got {search!r}")
    if model_name is None:
        model_name = (os.path.splitext(os.path.basename(os.fspath(config)))[0]
                      if isinstance(config, (str, os.PathLike)) else str(cfg.get("_name_or_path") or spec.family))
    target = get_target(target)
    arch = arch_of(target)
    memo = {} if memo is None else memo
    cpb = min(arch.chips, arch.chips_per_board)
    total_boards = max(1, arch.chips // arch.chips_per_board)
    # one board of any system of these chips maps alike: the name is not the system's, so a memo
    # shared between systems reuses the board's mappings (a whole board: no fault of the
    # system's; a one-board system keeps its dead chips and links, which are the board's)
    board = (arch if arch.chips < arch.chips_per_board else
             arch.replace(chips=cpb, name="spinn board (prefill)") if total_boards == 1 else
             arch.replace(chips=cpb, name="spinn board (prefill)", **dict.fromkeys(FAULT_FIELDS, ())))
    # less than a board: one stage on every chip, mapped as the plan's one-group placements are
    small = arch.chips < arch.chips_per_board
    budget = resident_capacity(board)
    topo, board_topo = topology_of(arch), topology_of(board)
    ring = ring_order(board_topo, board_topo.live_chips().size if board.has_faults else cpb)
    # the live hardware only (:mod:`tvm_spinn.target.faults`): stages on usable boards, a block
    # tensor-parallel over whole boards only, a stage on a board with dead chips or links mapped
    # on that board as it is (:func:`~tvm_spinn.target.faults.board_view`)
    live_boards = usable_boards(arch) if total_boards > 1 else (0,)
    whole = set(whole_boards(arch)) if total_boards > 1 else {0}
    boards = len(live_boards)
    views = {}

    def view_of(b: int):
        if total_boards == 1 or b in whole:
            return board
        if b not in views:
            views[b] = board_view(arch, b)
        return views[b]
    item = P.HANDOVER_BYTES[handover]
    L = spec.layers
    slots = spec.cache_slots(prompt)
    stages_memo = memo.setdefault("stages", {})

    def head_on(on) -> float:
        """The head: the final norm and LM head of the last token, on one board (as the decode plan)."""
        head_key = ("head", _cfg_key(cfg), repr(on), dtype, min(prompt, slots))
        if head_key not in memo:
            from .describe import describe

            described_key = ("head-described", _cfg_key(cfg), repr(arch.replace(chips=1, name="")), dtype,
                             min(prompt, slots))
            if described_key not in memo:
                model = P._meta_model(cfg, spec)
                _, module, args = P._parts(model, spec, 1, min(prompt, slots))[2]
                memo[described_key] = (describe(module, args, target, dtype), {tuple(int(x) for x in args[0].shape)})
            head, host = memo[described_key]
            atoms = [a for i, d in enumerate(head) for a in P._atoms(i, d.program)]
            memo[head_key] = (_map_alone(list(head), on, "auto").latency_s if small else P._map_stage(
                [P._slice(head[i].program, a, b) for i, a, b in P._merge(atoms)], on, host,
                memo=stages_memo).latency_s)
        return memo[head_key]

    head_s = head_on(board)

    def contexts(c: int) -> list[int]:
        # chunk k attends over (k + 1) c keys, at most the window's slots and its own
        return [min((k + 1) * c, slots + c if slots < prompt else (k + 1) * c) for k in range(prompt // c)]

    def block_times(g: int, c: int, stream: bool, on=None) -> "dict | None":
        """A block's (slice's) chunk on one board (``on``, default a whole one) at each chunk's
        context: weights as the mapper keeps them (``auto``) and, where ``stream``, streamed from
        DRAM; the blocks the board keeps resident and the bytes its first program gathers."""
        on = board if on is None else on
        key = (g, c, stream, id(on))
        if key not in timed:
            timed[key] = _block_times(g, c, stream, on)
        return timed[key]

    timed: dict = {}

    def _block_times(g: int, c: int, stream: bool, on) -> "dict | None":
        sub = _slice_spec(g)
        if sub is None:
            return None
        ctx = contexts(c)
        ends = sorted({ctx[0], ctx[-1]})
        mapped = {}
        for mode in ("auto", "stream") if stream else ("auto",):
            for end in ends:
                # the block with its projections fused and, where that fuses any, each its own:
                # the faster kept (a fused GEMM's output columns are split over the chips in
                # concatenated order, so the slices that part them gather the output over the
                # chip links, which at a chunk's many tokens can cost more than the GEMMs saved)
                for fuse in (True, False) if fuses(g) else (True,):
                    programs, host = _describe_chunk(cfg, sub, target, dtype, c, end, memo, g, fuse)
                    if small:
                        from .describe import DescribedProgram

                        got = _map_alone([DescribedProgram(p, 0) for p in programs], on, mode)
                    else:
                        got = P._map_stage(list(programs), on, host, 0, weights=mode, memo=stages_memo)
                    if (mode, end) not in mapped or got.latency_s < mapped[(mode, end)].latency_s:
                        mapped[(mode, end)] = got
        first = mapped[("auto", ends[0])]

        def line(mode):
            a, b = mapped[(mode, ends[0])].latency_s, mapped[(mode, ends[-1])].latency_s
            span = ends[-1] - ends[0]
            return np.array([a + (b - a) * (x - ends[0]) / span if span else a for x in ctx])

        auto = line("auto")
        room = budget if on is board else resident_capacity(on)
        # what binds the mapped block at the first chunk's context (each kind alone)
        bounds = {k: float(v) for k, v in sorted(getattr(first, "alone", {}).items())}
        return dict(auto=auto, stream=line("stream") if stream else auto, bounds=bounds,
                    fit=max(1, int(room // max(1, _block_weight(g, c)))), gather=max(0, first.handoff_gather_bytes))

    fused_any: dict = {}

    def fuses(g: int) -> bool:
        """Whether the block's step (of the slice over ``g`` boards) fuses any projections."""
        if g not in fused_any:
            model_key = ("model", _cfg_key(cfg), g)
            if model_key not in memo:
                memo[model_key] = P._meta_model(cfg, spec) if g == 1 else board_tp.slice_block(cfg, spec, g)[1]
            fused_any[g] = len(ChunkStep(memo[model_key], _slice_spec(g), _EXAMPLE_CONTEXT).fused) > 0
        return fused_any[g]

    slice_specs: dict = {}

    def _slice_spec(g: int) -> "ModelSpec | None":
        """The spec of one board's slice of a block over ``g`` boards (None: not split that way)."""
        if g not in slice_specs:
            got = (spec, None) if g == 1 else board_tp.slice_block(cfg, spec, g)
            slice_specs[g] = None if got is None else got[0]
        return slice_specs[g]

    def _block_weight(g: int, c: int) -> int:
        """Weight bytes of one board's share of a block (its slice's GEMM weights and vectors);
        of a mixture of experts, the router and the experts a chunk of ``c`` tokens can pick
        (``min(experts, c x experts_per_token)``: the chunk's block evaluates them)."""
        sub = _slice_spec(g)
        q, kv = sub.heads * sub.head_dim, sub.kv_heads * sub.head_dim
        mlp = 3 if sub.family == "llama" else 2
        experts = min(sub.experts, c * sub.experts_per_token) if sub.experts else 1
        return (sub.hidden * (q + 2 * kv) + q * sub.hidden + mlp * sub.hidden * sub.intermediate * experts
                + sub.experts * sub.hidden) * P.DTYPES[dtype]

    grid = board_grid(total_boards)
    pair_memo: dict = {}

    def layout(g: int) -> list:
        """Groups of ``g`` boards in stage order: neighbouring boards (:func:`board_tp.board_groups`),
        usable ones only; with faults one board a stage takes the whole boards first, a group of
        several boards whole ones only."""
        if total_boards == 1:
            return [[0]]
        groups = board_tp.board_groups(grid, g)
        if not arch.has_faults:
            return groups
        if g == 1:
            snake = [grp[0] for grp in groups if grp[0] in live_boards]
            return [[b] for b in snake if b in whole] + [[b] for b in snake if b not in whole]
        return [grp for grp in groups if set(grp) <= whole]

    def chips_of(grp) -> np.ndarray:
        return np.concatenate([live_chips(arch, b) for b in grp])

    def handover_s(groups, j: int, nbytes: float, gather: float, sliced: bool = True) -> float:
        """Group ``j`` to group ``j + 1`` on the link graph, each chip its share (a group of
        several boards also in slices where ``sliced``, :func:`~tvm_spinn.timing.collectives.
        sliced_hand_over`, the cheaper), and the receiving board's all-gather of what its first
        program reads whole."""
        key = (len(groups[j]), j, nbytes, gather, sliced)
        if key not in pair_memo:
            src, dst = chips_of(groups[j]), chips_of(groups[j + 1])
            n = min(src.size, dst.size)  # a board with dead chips: its live ones, pairwise
            share = nbytes / cpb if n == len(groups[j]) * cpb else nbytes * len(groups[j]) / n
            s = point_to_point(topo, src[:n], dst[:n], share).seconds
            if sliced and len(groups[j]) > 1 and n == len(groups[j]) * cpb and item <= P.REDUCE_BYTES[reduce]:
                # in slices: the group's last all-reduce (its partial sums' bytes an element: a
                # hand-over no wider makes it no dearer) stops after its reduce-scatter, each
                # board sends its slice and the next group's all-gather completes it, as the
                # all-reduce's second half would have on this group
                s = min(s, sliced_hand_over(topo, groups[j], groups[j + 1], nbytes, cpb).seconds)
            if gather:
                there = view_of(groups[j + 1][0])
                there_topo = board_topo if there is board else topology_of(there)
                there_ring = ring if there is board else ring_order(there_topo, there_topo.live_chips().size)
                s += collective_cost(there_topo, there_ring, "all_gather", int(gather), False).seconds
            pair_memo[key] = s
        return pair_memo[key]

    def relay_paths(groups, stages: int) -> list:
        """Per hand-over of a pipeline of ``stages`` one-board stages (all of them at once in
        its steady state): the paths of board edges that carry part of it beside its chips'
        own routes. A hand-over's own routes keep their edges (every pair's reserved first); of
        the edge-disjoint paths between its two boards (:meth:`~tvm_spinn.target.topology.
        Topology.board_paths`) it takes, pair by pair in stage order, those that share no
        edge with any reserved route or with a path an earlier pair took, so no serial link
        carries two hand-overs."""
        key = ("relays", stages)
        if key not in pair_memo:
            pairs = [(groups[j][0], groups[j + 1][0]) for j in range(stages - 1)]
            taken = set()
            for a, b in pairs:
                _, links = topo.route_links(np.arange(cpb) + a * cpb, np.arange(cpb) + b * cpb)
                taken.update(int(e) for e in topo.link_group[links] if e >= 0)
            out = []
            for a, b in pairs:
                keep = [p for p in topo.board_paths(a, b) if not taken & set(p)]
                for p in keep:
                    taken.update(p)
                out.append(tuple(keep))
            pair_memo[key] = out
        return pair_memo[key]

    def multipath_handover_s(groups, stages: int, j: int, nbytes: float, gather: float) -> float:
        """Hand-over ``j`` of a pipeline of one-board stages, every hand-over at once: the
        chips' own routes (each chip its share to its counterpart) and the relay paths
        (:func:`relay_paths`) carry shares that finish together
        (:func:`~tvm_spinn.timing.collectives.water_fill`), then the receiving board's
        all-gather as :func:`handover_s`. The boards' chips move the shares to and from their
        edges on on-board links, each several times an edge's rate (as
        :func:`~tvm_spinn.timing.collectives.multipath_point_to_point`)."""
        key = ("multipath", stages, j, nbytes, gather)
        if key not in pair_memo:
            a, b = groups[j][0], groups[j + 1][0]
            paths = relay_paths(groups, stages)[j]
            alone = handover_s(groups, j, nbytes, gather)
            if not paths:
                pair_memo[key] = alone
            else:
                own, _ = topo.evaluate(np.arange(cpb) + a * cpb, np.arange(cpb) + b * cpb, nbytes / cpb)
                costs = [topo.path_cost(p) for p in paths]
                rates = [nbytes / own.bandwidth_s] + [c[0] for c in costs]
                seconds, _ = water_fill(rates, [own.latency_s] + [c[1] for c in costs], float(nbytes))
                # the receiving board's all-gather, as the direct hand-over pays it
                pair_memo[key] = min(alone, seconds + alone - point_to_point(
                    topo, np.arange(cpb) + a * cpb, np.arange(cpb) + b * cpb, nbytes / cpb).seconds)
        return pair_memo[key]

    def prefix_s(c: int, on) -> "float | None":
        """Seconds of one block's chunk until its keys and values are written: its programs
        up to the first that reads the KV cache, that one cut before its first matmul of
        activations (the attention's), mapped on ``on`` with weights as the mapper keeps them;
        None where the block has no such matmul."""
        key = ("prefix", c)
        if key not in timed:
            from ..program.ops import family_of

            programs, host = _describe_chunk(cfg, spec, target, dtype, c, contexts(c)[0], memo, 1)
            pieces = []
            for program in programs:
                at = next((i for i, layer in enumerate(program.layers) if family_of(layer.kind).activation_gemm(layer)), None)
                if at is None:
                    pieces.append(program)
                    continue
                if at:
                    pieces.append(P._slice(program, 0, at))
                break
            else:
                pieces = None
            timed[key] = (None if not pieces else
                          P._map_stage(pieces, on, host, 0, weights="auto", memo=stages_memo).latency_s)
        return timed[key]

    def _replicated(r: int, best: dict, start: int) -> dict:
        """The best of ``best`` and the layouts of one block a stage on ``r`` boards (at
        chunk sizes climbed from ``start``): each stage a group of ``r`` neighbouring boards
        (:func:`board_tp.board_groups`), chunk ``k`` on board ``k mod r`` of each; a chunk's
        keys and values (the stage's block's, fp32) sent from its board to the group's others
        each chip its share at once (:func:`~tvm_spinn.timing.collectives.point_to_point`), a
        hand-over every board of a group to its counterpart on the next at once."""
        groups = layout(r)
        free = sorted(b for b in live_boards if all(b not in grp for grp in groups))
        if len(groups) - (0 if free else 1) < L:
            return best
        kv_bytes = 2 * spec.kv_heads * spec.head_dim * 4  # a token's key and value of one block, fp32
        src = np.tile(chips_of(groups[0][:1]), r - 1)
        dst = chips_of(groups[0][1:])
        seen: dict = {}

        def evaluate_r(c: int, above: float = math.inf) -> float:
            """Chunk size ``c``'s time to first token; where a lower bound of it exceeds
            ``above``, that bound (the layout is not timed)."""
            if c in seen:
                return seen[c][0]
            times = block_times(1, c, False)
            n = prompt // c
            if times is None:
                seen[c] = (math.inf, None)
                return math.inf
            gather = times["gather"] * item // 4
            kv = point_to_point(topo, src, dst, c * kv_bytes / cpb).seconds
            hand = [handover_s(groups, j, c * spec.hidden * item, gather, sliced=False) for j in range(L - 1)]
            # a hand-over may cross the board edges the keys and values take: charged both
            hand = [h + kv for h in hand]
            # a bound from below (planning time): each board of the last stage runs its chunks one
            # after another, its first one no earlier than it crossed every stage before
            auto = times["auto"]
            busy = np.array([float(np.sum(auto[q::r])) for q in range(min(r, n))])
            lower = float(np.max(busy + (L - 1) * auto[:busy.size])) + sum(hand) + head_s + host_io
            if lower * (1 - 1e-9) > above:  # a margin for the sums' rounding
                seen[c] = (lower, None)
                return lower
            pre = prefix_s(c, board)
            if pre is None:
                seen[c] = (math.inf, None)
                return math.inf
            stage_rows = np.tile(auto, (L, 1))
            pipeline, path = replicated_flow_shop(stage_rows, np.full((L, n), pre),
                                                  np.array(hand)[:, None] + np.zeros(n), r, kv)
            head_board = groups[L][0] if L < len(groups) else free[0]
            last = point_to_point(topo, [int(live_chips(arch, groups[L - 1][(n - 1) % r])[0])],
                                  [int(live_chips(arch, head_board)[0])], spec.hidden * item).seconds
            ttft = pipeline + last + head_s + host_io
            on = sorted({b for grp in groups[:L] for b in grp} | {head_board})
            path = dict(path, all_reduces_s=0.0)
            record = dict(tp_boards=1, replicas=r, chunk=c, chunks=n, blocks_per_stage=1, stages=L,
                          boards_used=L * r + 1, ttft_s=ttft, pipeline_s=pipeline, head_s=head_s, boards=on,
                          head_handover_s=last, handover_chunk_s=max(hand, default=0.0), all_reduces_chunk_s=0.0,
                          kv_chunk_s=kv, prefix_chunk_s=pre,
                          stage_total_s=float(np.sum(times["auto"])) / r, links_total_s=n * max(hand, default=0.0) / r,
                          stage_chunk_s=(float(times["auto"][0]), float(times["auto"][-1])),
                          block_chunk_s=(float(times["auto"][0]), float(times["auto"][-1])),
                          block_bounds_s=times["bounds"], critical_path=path)
            candidates.append(record)
            seen[c] = (ttft, record)
            return ttft

        ladder = chunk_sizes(prompt)
        at = ladder.index(start)
        here = evaluate_r(ladder[at])
        while True:
            above = here if prune else math.inf
            step = next((k for k in (at - 1, at + 1) if 0 <= k < len(ladder) and evaluate_r(ladder[k], above) < here),
                        None)
            if step is None:
                break
            at, here = step, seen[ladder[step]][0]
        top = min((v for v in seen.values() if v[1] is not None), key=lambda v: (v[0], v[1]["boards_used"]),
                  default=None)
        return top[1] if top is not None and top[0] < best["ttft_s"] else best

    host_io = P._step_io(arch, 1, prompt, None, [0])["host_io_prefill_s"]
    candidates = []
    best = None
    widths = [g for g in (tp_boards or TP_BOARDS) if g == 1 or (boards >= g + 1 and dtype == "int8")]
    sizes = [chunk] if chunk is not None else chunk_sizes(prompt)

    def turns(best: "dict | None") -> "dict | None":
        """The best of ``best`` and the layouts of one-block stages on boards taking turns."""
        one = min((r for r in candidates if r["tp_boards"] == 1), key=lambda r: r["ttft_s"], default=None)
        if best is not None and one is not None and not small and not arch.has_faults and total_boards > 1:
            # one block a stage on each of ``r`` boards, the chunks dealt round robin (see
            # :func:`replicated_flow_shop`), at the chunk sizes climbed from the best of one board a block
            for r in REPLICAS:
                best = _replicated(r, best, one["chunk"])
        return best

    # the best of the layouts without boards taking turns (the wider blocks' chunk size)
    climb_best = None
    took_turns = False
    for g in widths:
        if g != 1 and not took_turns and any(r["tp_boards"] == 1 for r in candidates):
            # boards taking turns before wider blocks: a faster best leaves more of those unmapped
            best, took_turns = turns(best), True
        groups = layout(g)
        # the head needs a board of its own when the blocks run on several boards (a whole one first)
        free = sorted((b for b in live_boards if all(b not in grp for grp in groups)), key=lambda b: (b not in whole, b))
        usable = 1 if boards == 1 else min(L, len(groups) if free else len(groups) - 1)
        if usable < 1:
            continue
        least = math.ceil(L / usable)
        per_stage = sorted({least} | {m for m in (2 * least, 4 * least, L) if m <= L})
        evaluated: dict = {}

        def evaluate(c: int) -> float:
            """The best TTFT of chunk size ``c`` over the stage sizes (records every layout)."""
            nonlocal best, climb_best
            if c in evaluated:
                return evaluated[c]
            # a stage of more blocks than its board keeps resident streams the rest
            if _slice_spec(g) is None:
                evaluated[c] = math.inf
                return math.inf
            n = prompt // c
            if g > 1 and prune and best is not None:
                # a bound from below before mapping the slice (planning time): each stage runs
                # its blocks' all-reduces on every chunk, each hand-over carries every chunk
                # (the receiving board's gather left out); a machine of the flow shop running
                # every chunk, each other machine one chunk
                ranks = [[int(x) + b * cpb for x in ring] for b in groups[0]]
                reduce_s = board_tp.block_all_reduces(spec) * board_all_reduce(topo, ranks, c * spec.hidden * P.REDUCE_BYTES[reduce]).seconds
                lowest = math.inf
                for m in per_stage:
                    stages = math.ceil(L / m)
                    cells = [m * reduce_s] * (stages - 1) + [(L - m * (stages - 1)) * reduce_s]
                    if stages > 1:
                        cells += [handover_s(groups, 0, c * spec.hidden * item, 0)] * (stages - 1)
                    lowest = min(lowest, sum(cells) + (n - 1) * max(cells) + host_io)
                if lowest * (1 - 1e-9) > best["ttft_s"]:  # a margin for the sums' rounding
                    evaluated[c] = lowest
                    return lowest
            block_w = _block_weight(g, c)
            fit = max(1, int(budget // max(1, block_w)))
            times = block_times(g, c, False)
            if times is None:
                evaluated[c] = math.inf
                return math.inf
            reduce_s = 0.0
            if g > 1:
                ranks = [[int(x) + b * cpb for x in ring] for b in groups[0]]
                # the partial sums' wire type: int32 on the ring or tree, a narrow wire on its
                # fixed schedule (:mod:`.wire`)
                reduce_s = board_tp.block_all_reduces(spec) * (board_all_reduce(
                    topo, ranks, c * spec.hidden * P.REDUCE_BYTES[reduce]) if reduce == "int32" else narrow_all_reduce(
                    topo, ranks, c * spec.hidden * P.REDUCE_BYTES[reduce])).seconds
            c_best = math.inf

            def timed_layout(m: int, times: dict, ttft_only: bool = False,
                             above: "float | None" = None) -> "dict | float | None":
                """The layout of ``m`` blocks a stage at chunk size ``c`` (``times``: a whole
                board's block times); where ``ttft_only``, its time to first token alone; None
                where a lower bound of that exceeds ``above`` (the layout is not timed)."""

                def times_on(j: int) -> dict:
                    """The block times of stage ``j`` on its board as it is (a group: whole boards)."""
                    view = view_of(groups[j][0]) if g == 1 else board
                    return times if view is board else block_times(g, c, True, view)

                stages = math.ceil(L / m)
                sizes_m = [m] * (stages - 1) + [L - m * (stages - 1)]
                rows, links, reduces = [], [], []
                hand = (handover_s(groups, 0, c * spec.hidden * item, times["gather"] * item // 4)
                        if stages > 1 else 0.0)
                for j, blocks in enumerate(sizes_m):
                    t = times_on(j)
                    k = min(blocks, fit if t is times else t["fit"])
                    rows.append(k * t["auto"] + (blocks - k) * t["stream"] + blocks * reduce_s)
                    reduces += [blocks * reduce_s, 0.0]
                    if j < stages - 1:
                        # one-board stages of a healthy system: every hand-over at once over its
                        # own routes and the edge-disjoint relay paths left to it
                        here = (multipath_handover_s(groups, stages, j, c * spec.hidden * item,
                                                     times["gather"] * item // 4)
                                if relays and g == 1 and not arch.has_faults and total_boards > 1 else hand)
                        rows.append(np.full(n, here))
                        links.append(here)
                if above is not None:
                    # a bound from below (planning time): some machine runs every chunk, after the
                    # first chunk crossed the machines before it and before the last crosses those after
                    first = np.cumsum([0.0] + [float(r[0]) for r in rows[:-1]])
                    after = np.cumsum([0.0] + [float(r[-1]) for r in rows[:0:-1]])[::-1]
                    lower = float(np.max(first + np.array([float(np.sum(r)) for r in rows]) + after)) + host_io
                    if lower * (1 - 1e-9) > above:  # a margin for the sums' rounding
                        return None
                pipeline = flow_shop_s(rows)
                # the last token's hidden state to the head's board (its own board beyond the stages)
                last, head_here, head_board = 0.0, head_s, None
                if boards > 1:
                    head_board = groups[stages][0] if stages < len(groups) else free[0]
                    src = groups[stages - 1][0]
                    if head_board != src:
                        last = point_to_point(topo, [int(live_chips(arch, src)[0])], [int(live_chips(arch, head_board)[0])],
                                              spec.hidden * item).seconds
                    if view_of(head_board) is not board:
                        head_here = head_on(view_of(head_board))
                ttft = pipeline + last + head_here + host_io
                if ttft_only:
                    return ttft
                path = _critical_path(rows, reduces)
                stage_total = max(float(np.sum(r)) for r in rows[::2])
                link_total = n * max(links, default=0.0)
                on = sorted({b for grp in groups[:stages] for b in grp} | ({head_board} if head_board is not None else set()))
                record = dict(tp_boards=g, replicas=1, chunk=c, chunks=n, blocks_per_stage=m, stages=stages,
                              boards_used=stages * g + (1 if boards > 1 else 0), ttft_s=ttft, pipeline_s=pipeline,
                              head_s=head_here, boards=on,
                              head_handover_s=last, handover_chunk_s=max(links, default=0.0),
                              all_reduces_chunk_s=reduce_s,
                              stage_total_s=stage_total, links_total_s=link_total,
                              stage_chunk_s=(float(rows[0][0]), float(rows[0][-1])),
                              block_chunk_s=(float(times["auto"][0]), float(times["auto"][-1])),
                              block_bounds_s=times["bounds"], critical_path=path)
                return record

            for m in per_stage:
                full = times
                if m > fit:  # its stages stream the blocks beyond the resident ones
                    # streaming a block's weights is never faster than the mapper's choice
                    # (``auto`` takes the faster of keeping and streaming them), so a layout timed
                    # with its streamed blocks at the ``auto`` times bounds it from below: one no
                    # better than the best so far is left unmapped (planning time)
                    if best is not None and (timed_layout(m, times, True, best["ttft_s"] if prune else None)
                                          or math.inf) > best["ttft_s"]:
                        continue
                    full = block_times(g, c, True)
                # a layout whose bound exceeds the best found is left untimed: it cannot be the
                # best, nor move the climb (whose current size holds the best)
                record = timed_layout(m, full, above=None if best is None or not prune else best["ttft_s"])
                if record is None:
                    continue
                ttft = record["ttft_s"]
                candidates.append(record)
                c_best = min(c_best, ttft)
                if best is None or (ttft, record["boards_used"]) < (best["ttft_s"], best["boards_used"]):
                    best = record
                if climb_best is None or (ttft, record["boards_used"]) < (climb_best["ttft_s"],
                                                                           climb_best["boards_used"]):
                    climb_best = record
            evaluated[c] = c_best
            return c_best

        # the chunk sizes' TTFT falls and then rises (the pipeline's fill, which small chunks
        # shorten, against each chunk's fixed costs and weight reads): start where the chunks
        # about match the stages (whose fill they then halve), go to the better neighbour while
        # it is faster; a wider block (g > 1) at the best size found so far
        ladder = sizes if climb_best is None else [climb_best["chunk"]]
        if len(ladder) <= EXHAUSTIVE or search == "all":
            for c in ladder:
                evaluate(c)
            continue
        at = min(range(len(ladder)), key=lambda k: (abs(math.log2(prompt / ladder[k] / math.ceil(L / least))), k))
        here = evaluate(ladder[at])
        while True:
            # the smaller neighbour first (smaller chunks shorten the fill); the first faster one is taken
            step = next((k for k in (at - 1, at + 1) if 0 <= k < len(ladder) and evaluate(ladder[k]) < here), None)
            if step is None:
                break
            at, here = step, evaluated[ladder[step]]
    if not took_turns:
        best = turns(best)
    if best is None:
        raise LLMError(f"no prefill layout of {model_name} fits {arch.name}")
    bound = prefill_bound(spec, prompt, dtype, arch, item)
    busiest = ({"kind": "links", "seconds": best["links_total_s"]} if best["links_total_s"] > best["stage_total_s"]
               else {"kind": "stage", "seconds": best["stage_total_s"]})
    return PrefillPlan(
        model=model_name, system=arch.name, prompt=prompt, dtype=dtype, handover=handover, chunk=best["chunk"],
        chunks=best["chunks"], tp_boards=best["tp_boards"], blocks_per_stage=best["blocks_per_stage"],
        stages=best["stages"], boards_used=best["boards_used"], ttft_s=best["ttft_s"], bound_s=bound.total_s,
        bound=bound.to_dict(), parts_s={"pipeline_s": best["pipeline_s"], "head_handover_s": best["head_handover_s"],
                                        "head_s": best["head_s"], "host_io_s": host_io},
        busiest=busiest, stage_chunk_s=best["stage_chunk_s"], handover_chunk_s=best["handover_chunk_s"],
        candidates=tuple(sorted(candidates, key=lambda r: (r["ttft_s"], r["boards_used"]))),
        boards=tuple(best["boards"]), replicas=best["replicas"],
        breakdown={k: best[k] for k in ("critical_path", "block_chunk_s", "block_bounds_s", "all_reduces_chunk_s",
                                        "kv_chunk_s", "prefix_chunk_s") if k in best})
