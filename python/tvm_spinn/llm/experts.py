"""The ``experts`` placement: a mixture of experts' experts spread over boards (expert parallelism).

A block of a mixture-of-experts model (Mixtral) is its attention, its router and ``E`` gated
MLPs (*experts*), of which the router picks ``k`` per token. The boards are cut into groups of
``ep`` neighbouring boards (``ep`` divides ``E``; :func:`tvm_spinn.llm.board_tp.board_groups`
or :func:`~tvm_spinn.llm.board_tp.board_patches`), each group running a run of ``m``
consecutive blocks, the groups pipelined (the hidden state handed over from one group to the
next, the last to the board of the LM head). In a group:

* the group's first board (its *home*) runs the blocks' attention, router and the sum of the
  picked experts' outputs (the *combine*), tensor-parallel over its chips as the mapper plans it;
* board ``j`` holds experts ``j E / ep .. (j + 1) E / ep - 1`` of each of the group's blocks
  (``s = E / ep`` a block); an expert runs on its board, tensor-parallel over its chips;
* the router's *dispatch* sends each token's hidden state from the home to the boards holding
  the experts it picked, and the *combine* brings the experts' outputs back: two all-to-alls
  between the group's boards on the link graph
  (:func:`tvm_spinn.timing.collectives.board_all_to_all`, each chip its share to its
  counterpart; the receiving board all-gathers what its program reads whole).

Which experts a step reads (the timing's assumption): a token's ``k`` experts; batch 1 times
each block at the *expected* busiest board of a uniformly random pick of ``k`` distinct
experts of ``E`` (:func:`expected_busiest`: the picked experts on one board run one after
another, on different boards at once), each picked expert resident in SRAM with the share of
that board's experts its SRAM keeps. The dispatch and combine are costed as if every board of
the group held a pick (the links of any ``k`` of them carry no more). The *worst case*
(``meta["worst_decode_s"]``) puts ``min(k batch, s)`` picks on one board, each streamed from
DRAM. A batch larger than one is timed at the worst case (the tokens' picks together may
fill a board). The step reads only the picked experts' weights, which is what the plan's
physical bound counts (:func:`tvm_spinn.timing.bounds.decode_workload`).

The ``experts:tp`` candidates split every expert instead (:func:`_sliced`): each board of a
group holds ``1 / g`` of the heads and of every expert's columns, so at batch 1 all ``g``
boards read their share of the ``k`` picked experts at once (with whole experts on boards only
the boards holding a pick work); the partial sums are all-reduced across the group twice a
block. The plan keeps whichever is faster. A degree of ``experts:tp`` is mapped only where a
floor on its token from the sizes alone (:func:`_sliced_floor`) is below the fastest token
found, the degrees in the order of their floors.

The block's programs are the planner's decode block (:mod:`tvm_spinn.llm.describe`), which
evaluates the ``min(E, k batch)`` experts a step can read after the attention and the router
(:class:`tvm_spinn.llm.graphs.LayerStep`): its weight GEMMs' runs (:func:`tvm_spinn.llm.plan._atoms`)
before the first expert's are the home's, one expert's two are an expert board's, and what
follows the last expert's (the routing weights and the combine's adds) is the home's again. Each
part is mapped on one board with the board's SRAM ledger, weights resident and streamed
(:func:`tvm_spinn.llm.plan._map_stage`); no more than those four mappings are made.
"""

from __future__ import annotations

import importlib
import math
from math import comb

import numpy as np

__all__ = ["expected_busiest", "split_block", "records"]

#: Group counts tried (besides every group used): fewer groups hold more blocks each
GROUP_COUNTS = 8


def expected_busiest(experts: int, boards: int, picks: int) -> float:
    """The expected number of picked experts on the busiest board when ``picks`` distinct
    experts of ``experts`` are picked uniformly at random and ``experts / boards`` of them sit
    on each board.

    Exact: ``P(max <= m)`` is the coefficient of ``x^picks`` in ``(sum_{j<=m} C(s, j) x^j)^boards``
    over ``C(experts, picks)``, and ``E[max] = sum_m (1 - P(max <= m))``.
    """
    if experts % boards or not 0 <= picks <= experts:
        raise ValueError(f"expected_busiest: {boards} boards must divide {experts} experts and 0 <= picks "
                         f"({picks}) <= experts")
    s = experts // boards
    total = comb(experts, picks)
    out = 0.0
    for m in range(picks):
        poly = np.zeros(picks + 1, dtype=object)
        poly[0] = 1
        one = [comb(s, j) for j in range(min(m, s) + 1)]
        for _ in range(boards):
            nxt = np.zeros(picks + 1, dtype=object)
            for j, c in enumerate(one):
                nxt[j:] += c * poly[:picks + 1 - j]
            poly = nxt
        out += 1.0 - float(poly[picks]) / total
    return out


def split_block(programs: list, spec, evaluated: int) -> tuple[list, list, list]:
    """``(home before, one expert, home after)`` runs of the decode block's atoms
    (:func:`tvm_spinn.llm.plan._atoms` over its described ``programs``): the block's last
    ``2 evaluated`` weight-GEMM runs are its experts' (gate-and-up, down each), checked against
    the experts' weight bytes."""
    from ..program.ops import family_of

    P = importlib.import_module(".plan", __package__)
    atoms = [a for i, p in enumerate(programs) for a in P._atoms(i, p)]
    gemm = [j for j, (i, a, b, _) in enumerate(atoms)
            if any(family_of(layer.kind).weight_gemm(layer) for layer in programs[i].layers[a:b])]
    if len(gemm) < 2 * evaluated + 1:
        raise RuntimeError(f"the described block has {len(gemm)} weight GEMMs, fewer than its {evaluated} "
                           f"experts' {2 * evaluated} and the attention's")
    first, last = gemm[-2 * evaluated], gemm[-1]
    expert = atoms[first:gemm[-2 * evaluated + 2]] if evaluated > 1 else atoms[first:last + 1]
    # the runs' constants are the experts' GEMM weights (and their scales): 3 h i elements each
    weights = sum(a[3] for a in atoms[first:last + 1])
    per = 3 * spec.hidden * spec.intermediate
    if not per * evaluated <= weights <= per * evaluated * 4 * 1.05:
        raise RuntimeError(f"the described block's last {2 * evaluated} weight GEMMs hold {weights} bytes, not "
                           f"{evaluated} experts of {per} weights")
    return atoms[:first], expert, atoms[last + 1:]


def records(cfg: dict, spec, arch, target, dtype: str, batch: int, seq: int, handover_bytes: int,
            described: dict, weight_bytes: int, kv_bytes: int, steps, memo: "dict | None" = None) -> dict:
    """The ``experts`` candidates as records of :func:`tvm_spinn.llm.plan.plan` (see the module
    docstring); arguments as :func:`tvm_spinn.llm.board_tp.records`."""
    from ..target.faults import whole_boards
    from ..timing.collectives import board_all_to_all, multipath_point_to_point, point_to_point
    from ..timing.system import collective_cost
    from .board_tp import board_setting, group_layouts, pipeline_rest

    P = importlib.import_module(".plan", __package__)
    E, k = spec.experts, spec.experts_per_token
    whole = whole_boards(arch)
    if not E or len(whole) < 3:
        return {}
    cpb, board, topo, board_topo, ring, budget, torus = board_setting(arch)
    L, h = spec.layers, spec.hidden
    evaluated = min(E, batch * k)
    dec = [d.program for d in described["decode"]]
    before, expert, after = split_block(dec, spec, evaluated)
    host = P._parts(P._meta_model(cfg, spec), spec, batch, seq)[0][2][1:]
    host_shapes = {tuple(int(x) for x in a.shape) for a in host}
    slots = spec.cache_slots(seq)

    def stage(atoms, weights, cache):
        pieces = [P._slice(dec[i], a, b) for i, a, b in P._merge(atoms)]
        return P._map_stage(pieces, board, host_shapes, slots if cache else 0, weights=weights, memo=memo)

    steps.set_postfix_str("map: experts across boards")
    home = {w: stage(before + after, w, True) for w in ("auto", "stream")}
    one = {w: stage(expert, w, False) for w in ("auto", "stream")}
    home_w, expert_w = home["auto"].weight_bytes, one["auto"].weight_bytes
    head_atoms = [a for i, d in enumerate(described["head"]) for a in P._atoms(i, d.program)]
    head = P._map_stage([P._slice(described["head"][i].program, a, b) for i, a, b in P._merge(head_atoms)],
                        board, host_shapes, memo=memo)
    steps.update()

    def share(stage_, full):
        """A stage's seconds with its weights resident (``full`` share of them) or streamed."""
        return full * stage_["auto"].latency_s + (1 - full) * stage_["stream"].latency_s

    pairs: dict = {}

    def board_to_board(a: int, b: int, nbytes: float) -> float:
        """The hidden state from board ``a`` to board ``b``: each chip its share to its
        counterpart, or (one token in flight: the links are free) over every edge-disjoint path
        between the boards, the cheaper; each pair costed once."""
        if (a, b, nbytes) not in pairs:
            src, dst = np.arange(cpb) + a * cpb, np.arange(cpb) + b * cpb
            direct = point_to_point(topo, src, dst, nbytes / cpb).seconds
            pairs[(a, b, nbytes)] = (min(direct, multipath_point_to_point(topo, a, b, nbytes).seconds)
                                     if batch == 1 and a != b else direct)
        return pairs[(a, b, nbytes)]

    hidden = batch * h
    gather_in = collective_cost(board_topo, ring, "all_gather", int(hidden * handover_bytes), False).seconds
    gather_out = collective_cost(board_topo, ring, "all_gather", int(hidden * 4), False).seconds
    out = {}
    for ep in sorted(d for d in range(2, E + 1) if E % d == 0 and d + 1 <= len(whole)):
        layouts = group_layouts(torus, ep, whole)
        if not layouts:
            continue
        s = E // ep

        def exchange(groups_):
            """Dispatch (the home's hidden state to every other board of the group, ``handover``
            elements) and combine (each board's expert output back, fp32), on the link graph."""
            grid = [[int(c) + b * cpb for c in range(cpb)] for b in groups_[0]]
            send = np.zeros((ep, ep))
            send[0, 1:] = hidden * handover_bytes
            dispatch = board_all_to_all(topo, grid, send)
            back = np.zeros((ep, ep))
            back[1:, 0] = hidden * 4
            return dispatch, board_all_to_all(topo, grid, back)

        groups = min(layouts, key=lambda lay: (sum(c.seconds for c in exchange(lay)), -len(lay)))
        dispatch, combine = exchange(groups)
        free = [b for b in whole if all(b not in grp for grp in groups)]
        usable = len(groups) - (0 if free else 1)
        if usable < 1:
            continue
        least = math.ceil(L / usable)
        options = sorted({least} | {math.ceil(L / n) for n in range(1, GROUP_COUNTS + 1) if math.ceil(L / n) >= least})
        busiest = expected_busiest(E, ep, k) if batch == 1 else min(s, evaluated)
        worst = min(s, evaluated)
        for m in options:
            n_groups = math.ceil(L / m)
            if m * (s * expert_w + home_w) > cpb * arch.dram_bytes:
                continue  # the home board's blocks and experts exceed its DRAM
            # SRAM: the home board keeps its blocks' attention first (every token reads it),
            # then as many of its experts as fit; the other boards their experts
            home_fit = min(m, int(budget // max(1, home_w)))
            left = max(0.0, budget - home_fit * home_w)
            kept = [min(m * s, int(left // max(1, expert_w)))] + [min(m * s, int(budget // max(1, expert_w)))] * (ep - 1)
            resident_share = sum(kept) / (ep * m * s)  # of a board's experts, on average over the boards
            # a block: the home, the dispatch, the busiest board's picks, the combine
            per_block = [home_fit / m, resident_share]
            exchange_s = dispatch.seconds + gather_in + combine.seconds + gather_out
            block_s = share(home, per_block[0]) + exchange_s + busiest * share(one, per_block[1])
            worst_block_s = share(home, per_block[0]) + exchange_s + worst * one["stream"].latency_s
            # group to group and to the head, home board to home board; the token back to the first home
            head_board, hand, io, loop_s = pipeline_rest(
                arch, batch, seq, groups, free, n_groups,
                lambda src, dst: board_to_board(src[0], dst[0], hidden * handover_bytes), groups[0][:1])
            rest_s = sum(hand) + head.latency_s + loop_s
            decode_s = L * block_s + rest_s
            used = (ep * n_groups + 1) * cpb
            resident = int(min(weight_bytes, n_groups * (home_fit * home_w + sum(kept) * expert_w)
                               + min(head.resident_bytes, head.weight_bytes)))
            kv_share = home["auto"].kv_sram_bytes / home["auto"].kv_bytes if home["auto"].kv_bytes else 0.0
            bounds = {key: L * (per_block[0] * home["auto"].bounds[key] + (1 - per_block[0]) * home["stream"].bounds[key]
                                + busiest * (per_block[1] * one["auto"].bounds[key]
                                             + (1 - per_block[1]) * one["stream"].bounds[key]))
                      + head.bounds[key] for key in home["auto"].bounds}
            bounds["links"] += L * exchange_s + sum(hand) + loop_s
            out[f"experts:ep{ep}m{m}"] = dict(
                decode_s=decode_s, period_s=decode_s, used=used, resident=resident,
                streamed=max(0, weight_bytes - resident), kv_sram=kv_bytes * kv_share, ttft_s=None,
                energy_j=(L * (home["auto"].energy_j + busiest * one["auto"].energy_j) + head.energy_j) / batch,
                sram_pe=max(st.peak_pe_bytes for st in (*home.values(), *one.values(), head)),
                dram_chip=int(math.ceil((m * s * expert_w + m * home_w) / cpb)),
                bounds=bounds, bound_s=sum(bounds.values()), binding=max(bounds, key=bounds.get),
                description=(f"experts across boards: {n_groups} group(s) of {ep} boards, each running {m} "
                             f"block(s) with {s} of the {E} experts a block on each board (the attention, router "
                             f"and combine on the group's first board), the router's dispatch and combine as "
                             f"all-to-alls on the board links; the groups pipelined, the head on one board"),
                meta={"stages": n_groups + 1, "boards_per_stage": ep, "blocks_per_stage": m,
                      "boards_used": ep * n_groups + 1, "ep_boards": ep, "experts_per_board": s, "groups": n_groups,
                      "chips_per_group": ep * cpb, "micro_batch": batch, "micro_batches": 1,
                      "mapping_weights": "auto", "block_decode_s": block_s,
                      "experts_active": k * batch, "busiest_board_experts": busiest,
                      "worst_busiest_board_experts": worst, "expert_resident_share": resident_share,
                      "expert_decode_s": one["auto"].latency_s, "expert_streamed_decode_s": one["stream"].latency_s,
                      "home_decode_s": home["auto"].latency_s,
                      "dispatch_s": dispatch.seconds + gather_in, "combine_s": combine.seconds + gather_out,
                      "worst_decode_s": L * worst_block_s + rest_s,
                      "handoff_decode_s": sum(hand), "head_decode_s": head.latency_s, **io,
                      **({"boards": sorted({b for grp in groups[:n_groups] for b in grp} | {head_board})}
                         if arch.has_faults else {}),
                      "replicas": len(whole) // (ep * n_groups + 1)})
    steps.update()
    out.update(_sliced(cfg, spec, arch, target, dtype, batch, seq, handover_bytes, weight_bytes, kv_bytes, steps,
                       memo, head, min((r["decode_s"] for r in out.values()), default=math.inf)))
    return out


def _sliced(cfg: dict, spec, arch, target, dtype: str, batch: int, seq: int, handover_bytes: int,
            weight_bytes: int, kv_bytes: int, steps, memo, head, best: float = math.inf,
            floors: "dict | None" = None) -> dict:
    """The ``experts:tp`` candidates: every block split over a group of ``g`` boards by heads and
    by every expert's columns (:func:`tvm_spinn.llm.board_tp.slice_config`: each board holds
    ``1 / g`` of the attention and of each of the ``E`` experts, the router whole), so every
    board of the group reads its share of the picked experts at once instead of one board
    reading a whole expert; the partial sums of the attention's output projection and of the
    experts' weighted outputs are all-reduced across the group twice a block
    (:func:`tvm_spinn.timing.collectives.board_group_all_reduce`, the cheaper of its unpipelined
    and pipelined schedules, costed as int32 partial sums of
    the same bytes; the experts' weighted outputs are fp32 sums whose bits depend on ``g``: a
    plan's timing, not a build). A board keeps resident the share of its blocks' slices (all
    ``E`` experts counted) its SRAM holds; a block is timed between its slice mapped resident and
    streaming its weights, weighted by that share (a token's picks are resident with it).

    The degrees are mapped in the order of a floor on their token from the sizes alone
    (:func:`_sliced_floor`), and only while it is below ``best`` (the fastest token found,
    including the whole-expert candidates'); ``floors``, where given, receives each degree's."""
    from ..target.faults import whole_boards
    from ..timing.collectives import board_group_all_reduce, point_to_point
    from .board_tp import board_setting, group_layouts, pipeline_rest, slice_config
    from .describe import describe
    from .spec import spec_of

    P = importlib.import_module(".plan", __package__)
    if dtype != "int8":
        return {}
    whole = whole_boards(arch)
    cpb, board, topo, _, order, budget, torus = board_setting(arch)
    L, E, k = spec.layers, spec.experts, spec.experts_per_token
    evaluated = min(E, batch * k)
    hidden = batch * spec.hidden
    out = {}
    costed: dict = {}

    def hand(src_boards, dst_boards):
        """The hidden state from one group's boards to the next's (or to the head's board),
        each chip its share to its counterpart; each pair costed once."""
        key = (tuple(src_boards), tuple(dst_boards))
        if key not in costed:
            src = np.concatenate([np.arange(cpb) + b * cpb for b in src_boards])
            dst = np.concatenate([np.arange(cpb) + b * cpb for b in dst_boards])
            costed[key] = point_to_point(topo, src, dst, hidden * handover_bytes / cpb).seconds
        return costed[key]

    reduces: dict = {}

    def reduce_of(lay) -> float:
        """The partial sums' all-reduce over a layout's first group (every group of a layout is
        a translate of it on the torus of boards), costed once per group: the cheaper of its two
        schedules, the reduce and the multicast one after the other or pipelined (each segment
        multicast as soon as it is reduced), the same collective and the same sums."""
        key = tuple(lay[0])
        if key not in reduces:
            grid = [[int(c) + b * cpb for c in order] for b in lay[0]]
            reduces[key] = min(board_group_all_reduce(topo, grid, hidden * 4).seconds,
                               board_group_all_reduce(topo, grid, hidden * 4, pipelined=True).seconds)
        return reduces[key]

    degrees = []
    for g in (2, 4, 8):
        sliced = slice_config(cfg, spec, g)
        if sliced is None or g + 1 > len(whole):
            continue
        layouts = group_layouts(torus, g, whole)
        if not layouts:
            continue
        groups = min(layouts, key=lambda lay: (reduce_of(lay), -len(lay)))
        free = [b for b in whole if all(b not in grp for grp in groups)]
        usable = len(groups) - (0 if free else 1)
        if usable < 1:
            continue
        reduce_s = reduce_of(groups)
        least = math.ceil(L / usable)
        options = sorted({least} | {math.ceil(L / n) for n in range(1, GROUP_COUNTS + 1) if math.ceil(L / n) >= least})
        sub = spec_of(sliced)
        read, stored = _sliced_bytes(sub, evaluated)
        floor = math.inf
        for m in options:
            if m * stored > cpb * arch.dram_bytes:
                continue
            _, moves, _, loop_s = pipeline_rest(arch, batch, seq, groups, free, math.ceil(L / m), hand)
            floor = min(floor, L * 2 * reduce_s + sum(moves) + head.latency_s + loop_s + L * _sliced_floor(
                read, stored, m, budget, cpb, board.dram_bw_bytes_s))
        degrees.append((floor, g, sliced, sub, groups, free, reduce_s, options))
    if floors is not None:
        floors.update({d[1]: d[0] for d in degrees})
    for floor, g, sliced, sub, groups, free, reduce_s, options in sorted(degrees, key=lambda d: d[:2]):
        if floor >= best:
            steps.update()
            continue
        steps.set_postfix_str(f"map: experts split over {g} boards")
        parts = P._parts(P._meta_model(sliced, sub), sub, batch, seq)
        dec = [d.program for d in describe(parts[0][1], parts[0][2], target, dtype)]
        host_shapes = {tuple(int(x) for x in a.shape) for a in parts[0][2][1:]}
        _, expert, _ = split_block(dec, sub, evaluated)
        expert_w = sum(a[3] for a in expert)
        mapped = {w: P._map_stage(list(dec), board, host_shapes, sub.cache_slots(seq), weights=w, memo=memo)
                  for w in ("auto", "stream")}
        block_w = mapped["auto"].weight_bytes
        stored = block_w + (E - evaluated) * expert_w  # a board's share of a block, every expert
        for m in options:
            if m * stored > cpb * arch.dram_bytes:
                continue
            n_groups = math.ceil(L / m)
            kept = min(1.0, budget / (m * stored))
            block_s = kept * mapped["auto"].latency_s + (1 - kept) * mapped["stream"].latency_s + 2 * reduce_s
            head_board, hands, io, loop_s = pipeline_rest(arch, batch, seq, groups, free, n_groups, hand)
            decode_s = L * block_s + sum(hands) + head.latency_s + loop_s
            resident = int(min(weight_bytes, n_groups * g * min(budget, m * stored)
                               + min(head.resident_bytes, head.weight_bytes)))
            a, b = mapped["auto"], mapped["stream"]
            bounds = {key: L * (kept * a.bounds[key] + (1 - kept) * b.bounds[key]) + head.bounds[key] for key in a.bounds}
            bounds["links"] += L * 2 * reduce_s + sum(hands) + loop_s
            kv_share = a.kv_sram_bytes / a.kv_bytes if a.kv_bytes else 0.0
            out[f"experts:tp{g}m{m}"] = dict(
                decode_s=decode_s, period_s=decode_s, used=(g * n_groups + 1) * cpb, resident=resident,
                streamed=max(0, weight_bytes - resident), kv_sram=kv_bytes * kv_share, ttft_s=None,
                energy_j=(g * L * a.energy_j + head.energy_j) / batch,
                sram_pe=max(a.peak_pe_bytes, b.peak_pe_bytes, head.peak_pe_bytes),
                dram_chip=int(math.ceil(m * stored / cpb)), bounds=bounds, bound_s=sum(bounds.values()),
                binding=max(bounds, key=bounds.get),
                description=(f"experts split across boards: {n_groups} group(s) of {g} boards, each running {m} "
                             f"block(s) with every board holding 1/{g} of the heads and of each of the {E} "
                             f"experts' columns (the router whole), two all-reduces of partial sums a block on "
                             f"the board links; the groups pipelined, the head on one board"),
                meta={"stages": n_groups + 1, "boards_per_stage": g, "blocks_per_stage": m,
                      "boards_used": g * n_groups + 1, "tp_boards": g, "groups": n_groups,
                      "chips_per_group": g * cpb, "micro_batch": batch, "micro_batches": 1,
                      "mapping_weights": "auto", "block_decode_s": block_s, "experts_active": k * batch,
                      "expert_resident_share": kept, "board_all_reduce_s": reduce_s,
                      # worst case: the picks streamed (not among the experts a board keeps)
                      "worst_decode_s": L * (b.latency_s + 2 * reduce_s) + sum(hands) + head.latency_s + loop_s,
                      "board_all_reduces_decode_s": 2 * L * reduce_s, "handoff_decode_s": sum(hands),
                      "head_decode_s": head.latency_s, **io,
                      **({"boards": sorted({x for grp in groups[:n_groups] for x in grp} | {head_board})}
                         if arch.has_faults else {}),
                      "replicas": len(whole) // (g * n_groups + 1)})
        steps.update()
        best = min([best] + [r["decode_s"] for k, r in out.items() if k.startswith(f"experts:tp{g}m")])
    return out


def _sliced_bytes(sub, evaluated: int) -> tuple[int, int]:
    """``(read, stored)``: bytes of the int8 weight-GEMM matrices of one board's slice of a
    block (:func:`_sliced`; ``sub`` the slice's spec) that a step reads (the attention's and
    ``evaluated`` experts') and that the board stores (every expert's), from the sizes alone:
    lower bounds on the mapped slice's (its scales, router and norms come on top)."""
    from .board_tp import gemm_weight_bytes

    def gemm(experts: int) -> int:  # a gated MLP's three matrices per expert
        return gemm_weight_bytes(sub.hidden, sub.heads, sub.kv_heads, sub.head_dim, sub.intermediate, 3 * experts)

    return gemm(evaluated), gemm(max(sub.experts, evaluated))


def _sliced_floor(read: int, stored: int, m: int, budget: float, chips: int, dram_bw: float) -> float:
    """A lower bound on one block's seconds in an ``experts:tp`` candidate of ``m`` blocks a
    group, besides its all-reduces: the share of its slice the board's SRAM (``budget``) cannot
    keep resident, ``read`` bytes streamed over the board's ``chips`` DRAM channels at best
    (``stored``, ``read``: :func:`_sliced_bytes`)."""
    kept = min(1.0, budget / (m * max(1, stored)))
    return (1 - kept) * read / (chips * dram_bw)
