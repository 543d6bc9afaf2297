"""The search over layouts and chunk sizes that plans a prompt (:func:`plan_prefill`)."""

from __future__ import annotations

import math

import numpy as np

from ..spec import MAX_DIM, LLMError, ModelSpec
from .chunk import _EXAMPLE_CONTEXT, ChunkStep, _cfg_key, _describe_chunk, _map_alone, _plan_module
from .result import PrefillPlan
from .schedule import _critical_path, flow_shop_s, replicated_flow_shop
from .workload import prefill_bound


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


def head_described_key(cfg: dict, arch, dtype: str, context: int) -> tuple:
    """The key of a :func:`plan_prefill` memo's described head (the final norm and LM head of
    one user's last token, its model built for ``context`` positions): the decode plan, which
    describes the same part at batch 1, hands its own over under it."""
    return ("head-described", _cfg_key(cfg), repr(arch.replace(chips=1, name="")), dtype, int(context))


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

    from ...target import arch_of, get_target
    from ...target.arch import FAULT_FIELDS
    from ...target.faults import board_view, live_chips, usable_boards, whole_boards
    from ...target.topology import board_grid, ring_order, topology_of
    from ...timing.collectives import board_all_reduce, point_to_point, sliced_hand_over, water_fill
    from ...timing.system import collective_cost
    from ...mapping.planner import resident_capacity
    from .. import board_tp
    from ..spec import spec_of
    from ..wire import narrow_all_reduce

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
            from ..describe import describe

            described_key = head_described_key(cfg, arch, dtype, min(prompt, slots))
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
                        from ..describe import DescribedProgram

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
            from ...program.ops import family_of

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
