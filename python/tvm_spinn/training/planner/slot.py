"""Costs of one pipeline slot of a stage: its GEMM passes, its tensor-parallel reductions, their overlap."""

from __future__ import annotations

import numpy as np

from ...timing.gemm_overlap import GemmTiles, gemm_tiles, shared_pes_seconds
from .comms import _Comms
from .model import _widths
from .records import F32


def _pass_seconds(arch, gemms: list, comms: "_Comms", resident: bool = False, attention: list = (),
                  fresh: bool = False, recomputed: bool = False) -> tuple[float, float, float]:
    """``(forward, input gradients, weight gradients)`` seconds of a stage's GEMMs ``[(m, k, n,
    batch)]`` (:func:`~tvm_spinn.timing.gemm.gemm_seconds`: each GEMM's :func:`_tiles` alone on the
    chip, the same float): the backward of
    ``Y = A B`` is ``dA = dY B^T`` (``m x n`` by ``n x k``) and ``dB = A^T dY`` (``k x m`` by
    ``m x n``). Each GEMM is priced with the tiles for a right operand held in SRAM
    (``resident=True``) exactly where that operand is in SRAM when the GEMM runs:

    - ``gemms``, whose ``B`` is a weight: ``Y = A B`` and ``dA = dY B^T`` read the weight, in SRAM
      when ``resident`` (the stage's weights fit its resident share), else streamed from DRAM;
      ``dB = A^T dY`` reads the output gradient ``dY`` the backward has just produced on chip.
    - ``attention``, whose ``B`` is an activation of the slot (the keys ``K^T``, the values ``V``):
      ``Y = A B`` reads them in SRAM when ``fresh`` (the slot's own projections have just
      produced every key and value it attends over), else from the stash in DRAM; ``dA = dY B^T``
      reads the forward's keys and values, stashed in DRAM for the backward unless the backward
      recomputes them (``recomputed``: then as fresh as in the forward); ``dB = A^T dY`` reads
      the output gradient just produced on chip."""
    pes = arch.pes_per_chip

    def seconds(m, k, n, b, on_chip):
        return _tiles(arch, comms, m, k, n, b, on_chip).alone_s(pes)

    def passes():
        fwd = (sum(seconds(m, k, n, b, resident) for m, k, n, b in gemms)
               + sum(seconds(m, k, n, b, fresh) for m, k, n, b in attention))
        dgrad = (sum(seconds(m, n, k, b, resident) for m, k, n, b in gemms)
                 + sum(seconds(m, n, k, b, fresh and recomputed) for m, k, n, b in attention))
        wgrad = sum(seconds(k, m, n, b, True) for m, k, n, b in list(gemms) + list(attention))
        return fwd, dgrad, wgrad

    return comms._get(("passes", tuple(gemms), resident, tuple(attention), fresh, recomputed), passes, comms.gemms)


def _tiles(arch, comms: "_Comms", m: int, k: int, n: int, batch: int, resident: bool) -> GemmTiles:
    """One GEMM's tiles on a chip (:func:`~tvm_spinn.timing.gemm_overlap.gemm_tiles`), searched
    once per shape and operand placement for a plan's search (``comms.gemms``): :func:`_pass_seconds`
    prices the GEMM from them (:meth:`~tvm_spinn.timing.gemm_overlap.GemmTiles.alone_s`,
    :func:`~tvm_spinn.timing.gemm.gemm_seconds`' very float) and :func:`_shared_pes_saving`
    schedules them, so the mapper's tile search runs once for both."""
    return comms._get(("tiles", m, k, n, batch, resident), lambda: gemm_tiles(arch, m, k, n, batch, resident),
                      comms.gemms)


def _shared_pes_saving(arch, gemms: list, comms: "_Comms", resident: bool = False, attention: list = (),
                       fresh: bool = False, recomputed: bool = False, attention_at: int = 1) -> float:
    """Seconds one layer's passes of a steady 1F1B slot give back when its forward and the other
    slot's backward share the chip's PEs (:func:`~tvm_spinn.timing.gemm_overlap.shared_pes_seconds`),
    against :func:`_pass_seconds`' sum of the three passes run one GEMM after another.

    In 1F1B's steady state a stage computes the forward of one slot and the backward of another,
    which do not depend on each other, and the weight-gradient GEMMs, which no later GEMM of the
    slot reads (their sums are read by the update; a slot's may run in the next slot, the last
    one's in the drain). So the PEs one pass's GEMM leaves idle in its last round (8 rows: a
    QKV forward's 96 tiles on 148 PEs) run the other pass's tiles and the weight gradients'. The
    forward is a chain of the layer's GEMMs (``gemms[:attention_at]``, the attention's two, the
    rest: each reads the one before), the backward the chain of their input gradients in
    reverse order (after the forward's GEMMs once more when it recomputes them), each attention
    matmul's second-operand gradient (the keys', the values') right after its input gradient:
    the key and value projections' input and weight gradients read them. The projections' weight
    gradients are the free GEMMs; each GEMM priced with its operands where :func:`_pass_seconds`
    finds them. Every tile keeps its arithmetic: no bit moves."""
    def make() -> float:
        def tiles(m, k, n, b, on_chip):
            return _tiles(arch, comms, m, k, n, b, on_chip)

        order = ([(g, resident) for g in gemms[:attention_at]] + [(g, None) for g in attention]
                 + [(g, resident) for g in gemms[attention_at:]])
        forward = [tiles(m, k, n, b, fresh if on is None else on) for (m, k, n, b), on in order]
        dgrad = []
        for (m, k, n, b), on in order[::-1]:
            dgrad.append(tiles(m, n, k, b, fresh and recomputed if on is None else on))
            if on is None:  # the attention's dB (dK, dV): read by the key/value projection's gradients
                dgrad.append(tiles(k, m, n, b, True))
        wgrad = [tiles(k, m, n, b, True) for (m, k, n, b), on in order[::-1] if on is not None]
        backward = (forward if recomputed else []) + dgrad
        pes = arch.pes_per_chip
        alone = sum(g.alone_s(pes) for g in forward + backward + wgrad)
        return max(0.0, alone - shared_pes_seconds(arch, [forward, backward], wgrad))

    return comms._get(("shared_pes", tuple(gemms), resident, tuple(attention), fresh, recomputed, attention_at),
                      make, comms.gemms)


def _fresh_attention(spec, split, tokens: int, arch) -> bool:
    """Whether a slot's attention finds every key and value it attends over in SRAM: a sequence
    that passes whole (one chunk: a chunked slot also reads the earlier chunks' keys and values,
    stashed in DRAM) whose keys and values on a rank fit the tile SRAM the resident weights
    leave (:func:`_resident_share`)."""
    kv = _widths(spec, split.tp)[3]
    spare = arch.pes_per_chip * arch.tile_sram_bytes - _resident_share(arch)
    return split.chunks == 1 and 2 * F32 * tokens * kv <= spare


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
    from ..tp_chain import kv_replicas, layer_reductions

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
                  pp_shared: "float | None" = None, tp_busy: "float | None" = None, w_s: float = 0.0,
                  pe_s: "float | None" = None) -> float:
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
    2021): the backward waits for the part of its collectives longer than they.

    ``pe_s`` is the PEs' time for both passes run together (with ``overlap``; default ``f_s +
    b_s``, one GEMM after another): the GEMMs of two independent passes share the PEs
    (:func:`_shared_pes_saving`), while each pass still takes its own GEMMs' time in series."""
    shared = pp_s if pp_shared is None else min(pp_s, pp_shared)
    if not overlap:
        return tp_f + tp_b - min(tp_b, w_s) + max(f_s + b_s, pp_s)
    busy = tp_f + tp_b if tp_busy is None else min(tp_f + tp_b, tp_busy)
    return max(f_s + b_s if pe_s is None else pe_s, busy + shared, pp_s, f_s + tp_f, b_s + tp_b - min(tp_b, w_s))
