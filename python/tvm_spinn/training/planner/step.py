"""The time of one training step of a split (:func:`_step_time`), by part."""

from __future__ import annotations

import numpy as np

from .comms import _Comms
from .memory import _costed_stages, _held_slots, _stage_activations
from .model import (_attention_at, _block_gemms, _gathered_params, _position_rows, _stage_params,
                    _untouched_rows, _vocab_rows)
from .records import F32, Split, StepTime
from .slot import (_fresh_attention, _landing, _pass_seconds, _resident_share, _shared_pes_saving, _slot_seconds,
                   _tp_reductions)
from .sync import _staggered_tail, _update_seconds


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
    from ..tp_chain import kv_replicas, vocab_leaves

    v_leaves = vocab_leaves(spec.heads, spec.intermediate, spec.vocab)

    def vocab_per(width: int) -> int:
        """Leaves of the vocabulary the busiest rank of ``width`` adds one by one (reproducible
        mode)."""
        return max(1, -(-v_leaves // width)) if comms.reproducible else 1

    # one block's GEMMs on a rank (forward, input gradients, weight gradients), of them the
    # weights' gradients; the LM head's for ``rows`` vocabulary rows on a rank
    weights, attention = _block_gemms(spec, tokens, seq, tp, split.micro_batch, split.chunks)
    # a micro-batch cut into chunks: the steady slots are priced at the chunks' mean context,
    # which their sum is while the attention GEMMs' time is linear in the context (their
    # context is the GEMMs' k or n; the fixed cost of a GEMM is the same for every chunk). The
    # fill's first slot (the first chunk, the shortest context) and the drain's last (the last
    # chunk, all ``seq`` keys) cross the stages alone, each at its own context
    chunk_gemms = ([weights + _block_gemms(spec, tokens, seq, tp, split.micro_batch, split.chunks, c)[1]
                    for c in (0, split.chunks - 1)] if split.chunks > 1 else None)

    passes_by = {}
    fresh = _fresh_attention(spec, split, tokens, arch)

    def block_passes(on_chip: bool) -> tuple:
        """``(block, weight gradients, first chunk's block, last chunk's block, shared)`` seconds
        of a layer's passes, with the stage's weights in SRAM (``on_chip``: the mapper chooses
        its tiles for resident weights) or streamed from DRAM, and each other right operand where
        it is when its GEMM runs (:func:`_pass_seconds`); ``shared``: what a steady slot's passes
        give back sharing the PEs (:func:`_shared_pes_saving`)."""
        if on_chip not in passes_by:
            def priced(gemms):
                return _pass_seconds(arch, gemms[:len(weights)], comms, on_chip, gemms[len(weights):], fresh,
                                     split.recompute)

            block = priced(weights + attention)
            first, last = ((block, block) if chunk_gemms is None else tuple(priced(g) for g in chunk_gemms))
            shared = (_shared_pes_saving(arch, weights, comms, on_chip, attention, fresh, split.recompute,
                                         _attention_at(spec)) if slots > 1 else 0.0)
            passes_by[on_chip] = (block, _pass_seconds(arch, weights, comms, on_chip)[2], first, last, shared)
        return passes_by[on_chip]

    def head_s(rows: int, on_chip: bool) -> tuple:
        return _pass_seconds(arch, [(tokens, spec.hidden, rows, 1)], comms, on_chip)

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

        def head_joint(rows: tuple) -> "float | None":
            """A steady slot's head transfers on the links at once: the forward's all-gather,
            the backward's reduce-scatter and loss sums (by the algorithms they are priced by),
            the hand-overs both ways and the tied table's ``rows`` ``(src, dst, bytes)`` (or
            ``()``), their busiest link together (:meth:`_Comms.slot_busy`); None where an
            algorithm's transfers are not listed (the trees')."""
            src = np.concatenate([last, mine, *rows[:2]])
            dst = np.concatenate([mine, last, *rows[1::-1]])
            sizes = np.concatenate([np.full(2 * last.size, act / tp)]
                                   + ([np.full(2 * rows[0].size, float(rows[2]))] if rows else []))
            collectives = [("all_gather", head_grid, act, 1, False),
                           ("reduce_scatter", head_grid, act, vocab_per(heads), False),
                           ("all_reduce", head_grid, 3 * F32 * tokens, 1, True)]
            return comms._get(("head_joint", head_grid.shape, head_grid.tobytes(), src.tobytes(), dst.tobytes(),
                               sizes.tobytes(), act, tokens, vocab_per(heads)),
                              lambda: comms.slot_busy(collectives, src, dst, sizes))
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
        # the stage's GEMM weights and their gradients fit its chips' resident SRAM share: they
        # stay there from the first slot to the update, and its GEMMs run with them in SRAM
        fits = 2 * F32 * streamed <= resident
        block_s, weights_s, first_s, last_s, shared_s = block_passes(fits)
        # bytes of the embedding rows (GPT-2's token and position rows) a slot's tokens read
        rows = F32 * tokens * spec.hidden * (2 if spec.family == "gpt2" else 1) if stage == 0 else 0
        held = _stage_activations(spec, split, seq, stage, split.recompute)
        stored = held // max(1, _held_slots(split, stage))
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
        # the fill's first slot's forward and the drain's last slot's backward: their blocks'
        # GEMMs at those chunks' contexts instead of the mean
        first_f = 0.0 if heads and stage == pp else layers * (first_s[0] - block_s[0])
        last_b = 0.0 if heads and stage == pp else layers * (
            sum(last_s[1:]) - sum(block_s[1:]) + (last_s[0] - block_s[0] if split.recompute else 0.0))
        if spread:  # every rank its share of the head's GEMMs
            width, head_rows = tp * pp, _vocab_rows(spec, tp * pp)
        else:
            head_rows = -(-spec.vocab // width) if stage == stages - 1 else 0
        head_pass = 0.0
        if head_rows:  # the LM head's vocabulary rows on this rank
            h_f, h_d, h_w = head_s(head_rows, fits)
            head_pass = h_f + h_d + h_w
            f_gemm, b_gemm, w_gemm = f_gemm + h_f, b_gemm + h_d + h_w, w_gemm + h_w
        # DRAM: activations written in the forward and read back in the backward; the weights
        # read in each pass and the gradients accumulated (read and written), unless they and
        # the gradients fit the chip's resident SRAM share: then they stay there from the
        # first slot to the update, which updates them there (:func:`_update_seconds`)
        passes = 2 + split.recompute
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
        # a steady slot's block passes on the PEs together (the forward of one slot, the backward
        # of another and the weight gradients: _shared_pes_saving); a pass that waits on DRAM
        # keeps its time (the traffic's, not the PEs')
        pe_s = f_s + b_s - (0.0 if waits or (heads and stage == pp) else layers * shared_s)
        # both passes' DRAM traffic runs on the one DRAM port whatever the PEs overlap
        pe_s = max(pe_s, dram_f + dram_b)
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
        links_of = dict(overlap=slots > 1, pp_shared=pp_on, tp_busy=busy, w_s=hides)
        total = _slot_seconds(f_s, b_s, tp_f, tp_b, pp_s, pe_s=pe_s, **links_of)
        # the fill's first slot and the drain's last have no other slot's pass to share the PEs
        # with: their part of the fill and drain is the slot with its passes in series
        series = total if pe_s == f_s + b_s else _slot_seconds(f_s, b_s, tp_f, tp_b, pp_s, **links_of)
        # a spread head's path (its collectives; its GEMMs are in this stage's compute) of one
        # slot overlaps the next head_lag slots
        total = max(total, spread_path / max(1, split.head_lag))
        series = max(series, spread_path / max(1, split.head_lag))
        path = total
        if heads and stage == pp and split.head_lag and slots > 1:
            # a head stage behind the last block stage (Split.head_lag): its passes wait for no
            # collective (the PEs and the links are the resources, as in _slot_seconds); one
            # slot's path (passes and collectives in series) spreads over the lag and is crossed
            # once in the fill and drain
            chain = f_s + tp_f + b_s + tp_b
            # the links: each collective's busiest link and the hand-overs' added, or all of
            # them together where they meet on few links (the head's transfers of a slot run at once)
            # (the tied table's rows leave the head's chips in the same slot)
            rows = (rows_src, rows_dst, slot_rows) if spec.tied_embeddings else ()
            links = head_joint(rows)
            if links is None:
                links = min(tp_f + tp_b, busy) + min(pp_s, pp_on) + min(rows_io, rows_on)
            total = series = max(f_s + b_s, links, pp_s, chain / split.head_lag)
            path = max(total, chain)
        fill, drain_s = series, b_s
        cross_f = 0.0
        if split.zero_bubble and slots > 1:
            # ZB-H1 (Qi et al. 2024): the weight-gradient passes leave the backward's path across
            # the stages and fill the idle time of the fill and drain, which then take
            # ``F + B - W`` of the stage rather than its slot ``F + B + W``; the backward's
            # collectives that ran under those GEMMs are on the path again. A backward that waits
            # on DRAM saves nothing (its time is the traffic's, not the GEMMs')
            w = 0.0 if dram_b > b_gemm else w_gemm
            fill = max(f_s + b_s - w, series - 2 * w + min(tp_b, hides))
            drain_s = b_s - w
        if stages > 1 and slots > 1 and not (heads and stage == pp and split.head_lag):
            # the fill's first slot and the drain's last cross the stages one after another: the
            # first slot reaches the last stage only after each earlier stage's forward and the
            # collectives that forward waits for, and the last slot's input gradient returns
            # through each stage's backward and its collectives, whatever the stage computes of
            # other slots meanwhile. So a stage's part of the fill and drain is at least one
            # slot's passes and collectives in series (:func:`_slot_seconds` without overlap),
            # less the weight-gradient GEMMs ZB-H1 defers (and the collectives that ran under
            # them: a lower bound of the path). A lagged head stage's path is counted whole (above).
            # (the first slot's forward and the last slot's backward, at their chunks' contexts)
            f_first, b_last = max(f_gemm + first_f, dram_f), max(b_gemm + last_b, dram_b)
            alone = _slot_seconds(f_first, b_last, tp_f, tp_b, pp_s, overlap=False,
                                  w_s=min(w_gemm, b_last / 2))
            fill = max(fill, alone - (w if split.zero_bubble else 0.0))
            cross_f = f_first + tp_f  # the first slot's forward and the collectives it waits for
        # the links' busy time in a steady slot: its collectives' bytes and its hand-overs (all of
        # them counted on the busiest link: what is left of the slot is what other transfers get)
        links = min(tp_f + tp_b, busy) + pp_s
        per_stage[stage] = dict(total=total, path=path, comp=pe_s, tp=tp_f + tp_b, pp=pp_s, waits=waits,
                                drain=drain_s, params=streamed, fits=fits, fill=fill, comp_fill=min(f_s + b_s, fill),
                                links=links, head=head_pass, f=f_s, b=max(0.0, b_s - w_gemm), w=w_gemm,
                                cross_f=cross_f)
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
    # on the slowest rank: each stage's ranks price their share with their stage's weights,
    # the head's rows among them, resident where they fit) once more
    spread_head_s = max(st["head"] for st in per_stage.values())
    pipeline = (over_pipeline("total", "fill")
                + sum(per_stage[j]["path"] - per_stage[j]["total"] for j in sorted(set(own)))
                + (spread_path + spread_head_s if spread else 0.0))
    # each stage's passes as a timeline of its slots takes them (StepTime.passes_s)
    passes = []
    for i, j in enumerate(own):
        st = per_stage[j]
        scale = st["total"] / max(st["f"] + st["b"] + st["w"], 1e-30)
        f_i, b_i, w_i = st["f"] * scale, st["b"] * scale, st["w"] * scale
        if st["total"] > st["comp"]:  # a slot paced by the links: deferring the W GEMMs does not shorten it
            b_i, w_i = b_i + w_i, 0.0
        extra = st["fill"] - f_i - b_i + (st["path"] - st["total"] if j == pp and stages > pp else 0.0)
        if spread and i == pp - 1:
            extra += spread_path + spread_head_s
        hand_f = min(max(0.0, st["cross_f"] - f_i), max(0.0, extra))
        passes.append(tuple(float(v) for v in (f_i, b_i, w_i, hand_f, max(0.0, extra - hand_f))))
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
        # a stage whose weights and gradients fit its resident SRAM share updates them there
        # (only the optimizer state in DRAM, :func:`_update_seconds`); its gathered tables' rows
        # are in DRAM (a shard: its parameters in proportion)
        shard = -(-params // dp) if split.zero >= 1 else params
        streamed = params - _gathered_params(spec, split, stage)
        in_sram = params > 0 and 2 * F32 * streamed <= resident
        return _update_seconds(arch, optimizer, shard, shard * streamed / params if in_sram else 0.0)

    def sync(groups: np.ndarray, params: int) -> float:
        if split.zero == 0:
            return comms.collective("all_reduce", groups, F32 * params)
        scatters = m if split.zero == 2 else 1
        return (scatters * comms.collective("reduce_scatter", groups, F32 * params)
                + comms.collective("all_gather", groups, F32 * params))

    # the block stages end within the drain of each other: their groups synchronise at once (the
    # largest stage's bytes), as the first stage ends; the tied table's synchronisation too
    block = [(_stage_params(spec, tp, pp, j, heads, spread), j) for j in sorted({0, pp - 1})]
    dp_blocks = sync(grid.reshape(-1, dp), max(n - _untouched_rows(spec, seq, j, _position_rows(split, seq))
                                               for n, j in block))
    tail = (max(dp_blocks, tied), max(update(n, j) for n, j in block))
    if stages > 1 and slots > 1:
        # or bucketed: each block stage's gradients reduced as its last backward completes them,
        # the stages' in the order the drain ends them, each bucket updated as its reduction ends
        # (:func:`_staggered_tail`); the faster of the two schedules. The updates (and ZeRO's
        # gathers after them) wait for the tied table's synchronisation as for the one at once
        synced, updated, reduced = _staggered_tail(spec, split, seq, optimizer, arch, comms, block, per_stage, per,
                                                   weights, pipeline - slots * per_stage[0]["total"])
        tail = min(tail, (synced + max(0.0, tied - max(0.0, reduced)), updated), key=sum)
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
                                  for j, st in sorted(per_stage.items())),
                    passes_s=tuple(passes))
