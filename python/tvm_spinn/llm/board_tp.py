"""The ``board_tp`` placement: every block tensor-parallel over a group of boards, pipelined across groups.

A group of ``g`` boards runs each of its blocks together: board ``j`` holds heads ``j H / g ..
(j + 1) H / g - 1`` (and their KV-cache heads: a KV head shared by several boards' query heads
under grouped-query attention is held by each of them) and columns ``j I / g ..`` of the MLP's
gate and up projections (rows of its down projection). What one board computes is then exactly
the block of a model with ``H / g`` heads, ``I / g`` intermediate columns and the same hidden
size (its *slice*: :func:`slice_config`), mapped on one board by the normal planner with the
board's SRAM ledger (:func:`tvm_spinn.llm.plan._map_stage`), except that the outputs of the
attention's output projection and of the MLP's down projection are partial sums over the
boards: each is all-reduced across the group's boards
(:func:`tvm_spinn.timing.collectives.board_group_all_reduce`, two a block: a reduce and a
multicast over every board edge between the group's boards, or a ring or tree where cheaper)
before the residual add (one all-reduce of their sum where attention and MLP join the residual
together: GPT-J, Falcon; :class:`tvm_spinn.llm.spec.BlockSplit`). GPT-2, GPT-J and Falcon, whose
head size follows from the hidden size, are sliced by narrowing their block's parameters
(:func:`slice_block`), heads that ``g`` does not divide shared as evenly as they go (the largest
share timed), Falcon's single key/value head (multi-query attention) replicated on every board.
The slice's programs are cut where the boards all-reduce (:func:`slice_pieces`): a piece
ends with each projection whose sums are all-reduced, the next starts with the residual add
and reads the reduced row whole from SRAM (an input already on chip: the mapper plans no
gather of it), and the attention over the cache is a piece of its own (its shard plan
chosen for it, not for the MLP). Each piece leaves its outputs in the chips' SRAM, where the
next piece, the next block, the all-reduce or the hand-over reads them (``keep_outputs`` of
:func:`tvm_spinn.llm.plan._map_stage`): an output that takes at most
:data:`~tvm_spinn.mapping.system.GATHERED_SRAM_SHARE` of a chip's SRAM does not go through
DRAM, a larger one is written to DRAM and read from there. The all-reduce works in the
layout the projection left its sums in (each chip of a board its slice, reduced with its
counterparts on the other boards);
its multicast then delivers the whole reduced row to every chip of each board, the board's
routers copying each share to all its chips as it arrives (the on-board all-gather fused into
the multicast, :func:`fused_gathers`): the piece ending at the projection ends with its last
layer, without the gather of its output; a projection whose shard plan leaves its sums on
fewer chips spreads them over the board's first (:func:`_spread`). The residual add after each
all-reduce may also run on its delivery (:func:`fused_adds`): every chip holds the residual row
whole, so its PEs add each part of the reduced row as it arrives, a job a part, instead of a
layer of their own after the last part (its wake-up, set-up and barrier); the all-reduce is
then played out part by part with the add behind it
(:func:`tvm_spinn.timing.collectives.streamed_all_reduce`), and the faster of the cut slice and
this one is kept. An ``rms_norm`` that starts the piece after such an add may run its sums of
squares and their chain on the delivery too (:func:`norms_on_delivery`: each part's chunks
of the norm added, summed and chained as the part arrives), where the pieces shed more than
the deliveries then take. Where the slice could not be
cut, the all-reduce ends in the projection's layout and the slice gathers the row itself. The
slice is also timed as described (:func:`slice_forms`), its programs uncut, and each degree keeps
the faster: a piece as mapped reads its weights from DRAM only while it runs, while an uncut
program's reads run on under its earlier layers' work (the attention over the cache), which may
outweigh the gathers the cut saves where most blocks stream and little SRAM is left to fetch
the pieces' weights ahead. Both forms read each weight once; their DRAM bytes differ only where
the attention's own shard plan holds the KV cache differently: a wide group's slice (a key and
value head per board, a few query heads) runs its attention fastest with the query heads split
over groups of chips and the cache's slots over the chips of a group, each slot's keys and
values held and read by every group (``g = 16`` on Llama-2-70B: 2 copies, 44 kB a chip more a
block than the slots spread over all the board's chips as the uncut program maps them, which
spends more on its softmax's and its context's sums over 48 chips).
The all-reduced sums are the int8 GEMMs' int32 accumulators, exact in any order, so the tokens do
not depend on ``g``; an fp32 model (``dtype="fp32"``) is not planned this way (its sums would
need the bit-exact chain across boards). ``plan(..., reduce="fp16")`` (``"bf16"``, ``"int8"``)
times them narrowed instead: each board dequantizes its partial sums with the GEMMs' scales and
sends each share of the row narrowed to the board that owns it (straight, or up trees rooted at
the owner, pipelined with the way back), which adds them in fp32 in board order and multicasts
the narrowed sum (:mod:`tvm_spinn.llm.wire`: a fixed schedule, since narrow sums added along
the trees would round again at every hop; the tokens
then depend on the rounding: :func:`tvm_spinn.llm.accuracy.reduce_rounding` emulates it).

The model's blocks are split into consecutive runs, one run per group; consecutive groups hand
the hidden state over in slices: the group's last all-reduce stops after its reduce-scatter,
each board sends its slice to a board of the next group, and the next group's all-gather
completes it (:func:`tvm_spinn.timing.collectives.sliced_hand_over`; or every board the whole
state to its counterpart, where that is cheaper); the last group hands it to the board that
runs the LM head. A token's latency is the sum of the groups' runs, their all-reduces, the
hand-overs and the head, with the token's way back from the head's board to the first group and
the host's I/O (:func:`tvm_spinn.llm.plan._step_io`). A board's run of blocks is timed from its
slice mapped twice on one board: alone with its weights resident (the first blocks, as many as
the board's SRAM holds resident, :func:`tvm_spinn.mapping.planner.resident_capacity`) and
streaming its weights from DRAM (the rest; a resident block's piece no slower than streaming,
:func:`_at_most`); a streamed block may fetch part of its weights into
an SRAM buffer during the all-reduces and while its earlier pieces leave the DRAM channels idle
(:func:`_ahead_gains`: a candidate of its own, the buffer taken from the resident blocks' SRAM; the
pieces' weights stream on from piece to piece, one run of reads through the buffer as far as
the SRAM the first block leaves holds it; the block's energy then leaves out its chips' static
power over the seconds saved, :func:`_unburnt_j`); every block may also be streamed so, none kept
resident, where a streamed block's pieces, fetched ahead, run faster than the resident block's
under its one SRAM ledger. A token's energy is that of the programs it
runs, each charging its chips' static power while it runs, as every placement counts it. The
time to first token is the system's prompt plan
(:mod:`tvm_spinn.llm.prefill`), the same for every placement.

Groups are ``g`` neighbouring boards of the torus of boards
(:func:`tvm_spinn.target.topology.board_grid`), in a cycle where ``g`` allows
(:func:`board_groups`), the most nearly square patch (:func:`board_patches`) or the roundest
group of the lattice of boards (:func:`board_compact`: on a torus too large for a patch to close
into a ring, the fewest board hops across), whichever all-reduces faster. The degrees are ranked by what their all-reduces alone cost
a token: on a torus whose rows close into rings of a few boards a wide group all-reduces
fastest, on a larger one (whose patches do not close) a narrow group, which leaves room for
more groups and so for more blocks resident in SRAM, may be the faster. The first
:data:`MAX_MAPPED` of them are mapped in the order of a floor on each one's token, from the
sizes alone (its all-reduces, hand-overs, the token's loop, the head, and the blocks its
groups' SRAM cannot keep streaming their weights from DRAM: :func:`stream_floor`), while the
floor is below the fastest token found. On a system with faults only groups of whole boards
(:func:`tvm_spinn.target.faults.whole_boards`: usable, every chip working) are formed, and the
head runs on a whole board.
While one token is in flight the links are otherwise idle, so an all-reduce's trees may pass
through the boards around the group, a single board's hand-over takes every edge-disjoint
path to the next board, and a group's sliced hand-over sends each slice over every edge-disjoint
path between its two boards where that is cheaper
(:func:`tvm_spinn.timing.collectives.multipath_sliced_hand_over`).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["TP_BOARDS", "slice_config", "slice_shares", "slice_block", "slice_weight_bytes", "gemm_weight_bytes", "stream_floor",
           "block_all_reduces", "board_groups",
           "board_patches", "board_compact", "relay_bands", "RELAY_LINES", "group_layouts", "board_setting",
           "group_caches", "GroupCaches",
           "slice_pieces", "slice_forms", "fused_gathers", "fused_adds", "fused_add_s", "norms_on_delivery",
           "slice_collectives",
           "pipeline_rest", "records"]

#: Boards one block is tensor-parallel over (each must divide the heads and the intermediate
#: size, and leave a board for the head), tried in the order of what their all-reduces alone
#: cost a token, up to :data:`MAX_MAPPED` of them: more boards stream a block's weights from
#: more DRAM at once, fewer leave room for more groups (more blocks resident in SRAM).
TP_BOARDS = (2, 4, 8, 16, 32)
#: Degrees mapped with the PE-level model at most (planning time: each maps a block once more);
#: a degree whose floor (no mapping: see the module docstring) is not below the fastest token
#: found is not mapped. The all-reduces alone rank narrow groups first on a torus whose patches do not
#: wrap, while a wider group streams each block from more DRAM: four mapped degrees reach the
#: widest group of a 24-board torus and the cloud's 32-board groups.
MAX_MAPPED = 4
#: Group counts tried besides every group used and the fewest that keep the blocks resident
GROUP_COUNTS = 8
#: Parts a board's PEs take the reduced row in where the residual add after an all-reduce runs
#: on the all-reduce's delivery (:func:`fused_adds`): each part one job of every PE, started as
#: the part arrives (:func:`tvm_spinn.timing.collectives.streamed_all_reduce`)
FUSED_CHUNKS = 4


def slice_config(cfg: dict, spec, g: int) -> "dict | None":
    """The config of one board's slice of a block tensor-parallel over ``g`` boards, or None
    where ``g`` does not split the heads, the KV heads (or a whole number of boards share one)
    and the intermediate size evenly."""
    if spec.family != "llama" or spec.heads % g or spec.intermediate % g:
        return None
    if spec.kv_heads % g and g % spec.kv_heads:
        return None
    out = dict(cfg)
    out.update(num_attention_heads=spec.heads // g, num_key_value_heads=max(1, spec.kv_heads // g),
               head_dim=spec.head_dim, intermediate_size=spec.intermediate // g)
    return out


def slice_shares(spec, g: int) -> "tuple[int, int, int] | None":
    """``(query heads, key/value heads, intermediate columns)`` of the largest of ``g`` boards'
    shares of a block of a family split by :data:`tvm_spinn.llm.spec.BLOCK_SPLITS`, or None
    where ``g`` boards cannot split it.

    Heads and columns go to the boards as evenly as they divide (board ``j`` of ``g`` takes
    heads ``j H // g .. (j + 1) H // g - 1``): the group waits for its largest share, which is
    what is timed. A key/value head belongs to its query head (every head its own: each board
    caches its heads' keys and values) or to all of them (multi-query attention: the one
    key/value head is replicated, its projection and cache on every board); grouped-query
    attention splits only where its groups do, evenly."""
    from .spec import BLOCK_SPLITS

    H, kv, inter = spec.heads, spec.kv_heads, spec.intermediate
    if spec.family not in BLOCK_SPLITS or spec.experts or g > H or g > inter:
        return None
    if kv == H:
        return -(-H // g), -(-H // g), -(-inter // g)
    if kv == 1:
        return -(-H // g), 1, -(-inter // g)
    if H % g or inter % g or (kv % g and g % kv):
        return None
    return H // g, max(1, kv // g), inter // g


def slice_block(cfg: dict, spec, g: int):
    """``(spec, model)`` of the largest of ``g`` boards' slices of a block (see the module
    docstring): the one-block model on the meta device whose parameters are one board's share,
    or None where ``g`` does not split the block.

    The Llama family is sliced through its config (:func:`slice_config`); the families of
    :data:`tvm_spinn.llm.spec.BLOCK_SPLITS` (whose head size follows from the hidden size) by
    narrowing the parameters their description names to the board's share (:func:`slice_shares`)."""
    import dataclasses

    import torch

    from .spec import BLOCK_SPLITS, spec_of

    P = importlib.import_module(".plan", __package__)
    sliced = slice_config(cfg, spec, g)
    if sliced is not None:
        sub = spec_of(sliced)
        return sub, P._meta_model(sliced, sub)
    shares = slice_shares(spec, g)
    if shares is None:
        return None
    heads, kv, inter = shares
    sub = dataclasses.replace(spec, heads=heads, kv_heads=kv, intermediate=inter)
    d = spec.head_dim
    width = {"q": heads * d, "kv": kv * d, "qkv": (heads + 2 * kv) * d, "mlp": inter}
    model = P._meta_model(cfg, spec)
    block = model.transformer.h[0] if hasattr(model, "transformer") else model.model.layers[0]
    for path, axis, what in BLOCK_SPLITS[spec.family].parameters:
        owner_path, _, leaf = path.rpartition(".")
        owner = block.get_submodule(owner_path)
        param = getattr(owner, leaf, None)
        if param is None:  # a bias the config leaves out
            continue
        shape = list(param.shape)
        shape[axis] = width[what]
        setattr(owner, leaf, torch.nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"),
                                                requires_grad=False))
        if hasattr(owner, "nf"):  # transformers' Conv1D (weight: in x out) keeps its output width
            owner.nf = owner.weight.shape[-1]
    return sub, model


def slice_pieces(programs, reduces: int) -> "tuple[list, tuple[bool, ...]] | None":
    """A slice's described programs cut where the boards all-reduce its partial sums:
    ``(pieces, ends)``, the pieces in order and, per piece, whether it ends at an all-reduce;
    None where the programs do not show the block's ``reduces`` all-reduces.

    Each residual add of the block adds a projection's output (the attention's output
    projection, the MLP's down projection: partial sums over the boards) to the residual
    stream (the block's input, then each residual add's output). The boards all-reduce that
    output between the projection and the add, so the slice is cut there: the add starts the
    next piece, which reads the reduced row from SRAM, whole on every chip as the all-reduce's
    multicast delivers it (an input already on chip, :func:`tvm_spinn.mapping.planner.plan_system`),
    and the piece before ends with the projection (:func:`fused_gathers`). A projection that
    follows the attention over the cached keys and values (layers reading the KV cache:
    :func:`tvm_spinn.mapping.state.resident_state`) starts a piece of its own (with the
    ``quantize`` of its input): the attention is then mapped with the shard plan that suits it
    (its heads and slots split as its softmax's and its context's fixed-order sums cost least)
    and the projection with one of its own.

    Parameters
    ----------
    programs : sequence of Program
        The slice's described programs, in order (the block's input the first one's first).
    reduces : int
        The block's all-reduces (:func:`block_all_reduces`).
    """
    from ..mapping.state import resident_state
    from ..program.ops import family_of

    P = importlib.import_module(".plan", __package__)
    if not programs or not programs[0].inputs:
        return None
    row = tuple(programs[0].tensors[programs[0].inputs[0]].shape)
    pieces, ends, found = [], [], 0
    for program in programs:
        residual = {t for t in program.inputs if tuple(program.tensors[t].shape) == row}
        producer = {layer.output: i for i, layer in enumerate(program.layers)}
        state = resident_state(program, range(len(program.layers)))  # the KV cache
        cuts = {}  # layer index -> whether the piece before it ends at an all-reduce
        for i, layer in enumerate(program.layers):
            acts = [t for t in layer.inputs if program.tensors[t].role != "const"]
            if not family_of(layer.kind).sums_inputs(layer) or len(acts) != 2 or sum(t in residual for t in acts) != 1:
                continue
            projections = _projections(program, producer, next(t for t in acts if t not in residual), residual)
            if not projections:
                return None  # the summed output is not the projections'
            residual.add(layer.output)
            found += 1
            cuts[i] = True
            for j in projections:
                prev = program.layers[j - 1] if j > 0 else None
                if prev is not None and family_of(prev.kind).quantizes(prev) and prev.output == program.layers[j].inputs[0]:
                    j -= 1
                start = max((k for k in cuts if k <= j), default=0)
                if any(t in state for layer in program.layers[start:j] for t in layer.inputs):
                    cuts.setdefault(j, False)  # the attention over the cache before it: a piece of its own
        bounds = [0] + sorted(k for k in cuts if 0 < k < len(program.layers)) + [len(program.layers)]
        for a, b in zip(bounds, bounds[1:]):
            pieces.append(program if (a, b) == (0, len(program.layers)) else P._slice(program, a, b))
            ends.append(bool(cuts.get(b, False)))
    if found != reduces:
        return None
    return pieces, tuple(ends)


def slice_forms(programs, reduces: int) -> list:
    """The ways a slice's described programs are timed on a board, each ``(pieces, ends)`` as
    :func:`slice_pieces` returns them: cut where the boards all-reduce (where the programs show
    the block's ``reduces`` all-reduces); so cut with the residual adds after the all-reduces
    run on their delivery (``(pieces, ends, adds)``, :func:`fused_adds`, where each all-reduce
    has one); then as described (``ends`` None).

    The pieces end without the row's gathers (the all-reduce delivers the row,
    :func:`fused_gathers`) and map the attention with a shard plan of its own, but each piece
    as mapped reads its weights from DRAM only while it runs (what it fetches ahead is bounded
    by the SRAM buffer, :func:`_ahead_gains`); the described programs stream theirs in one run of
    reads under their own work (a large program's DRAM reads overlapping its earlier layers).
    Which is faster depends on how much of the block streams and the SRAM left for the buffer:
    both are timed and the faster kept (:func:`records`)."""
    cut = slice_pieces(programs, reduces)
    onto = fused_adds(*cut) if cut is not None else None
    return ([cut] if cut is not None else []) + ([onto] if onto is not None else []) + [(list(programs), None)]


def _projections(program, producer: dict, tensor: int, residual: set) -> list:
    """The weight GEMMs (layer indices, ascending) whose outputs make ``tensor``: through layers
    of one activation input (reshapes, a bias) and the adds of two such outputs (attention and
    MLP added before the residual: GPT-J, Falcon); empty where anything else makes it."""
    from ..program.ops import family_of

    j = producer.get(tensor)
    if j is None or tensor in residual:
        return []
    layer = program.layers[j]
    if family_of(layer.kind).weight_gemm(layer):
        return [j]
    acts = [t for t in layer.inputs if program.tensors[t].role != "const"]
    if len(acts) == 1:
        return _projections(program, producer, acts[0], residual)
    if family_of(layer.kind).sums_inputs(layer) and len(acts) == 2:
        parts = [_projections(program, producer, t, residual) for t in acts]
        return sorted(parts[0] + parts[1]) if all(parts) else []
    return []


def block_all_reduces(spec) -> int:
    """All-reduces a block tensor-parallel over boards makes (:class:`tvm_spinn.llm.spec.BlockSplit`):
    two (after attention, after the MLP), one where the family adds both to the residual together."""
    from .spec import BLOCK_SPLITS

    split = BLOCK_SPLITS.get(spec.family)
    return split.all_reduces if split is not None else 2


def board_groups(grid: tuple[int, int], g: int) -> list[list[int]]:
    """Board ids in groups of ``g`` neighbouring boards, consecutive groups next to each other.

    An even ``g >= 4`` that fits takes ``g / 2`` columns of two rows of the ``grid`` of boards,
    in a cycle (along the first row, back along the second): a ring all-reduce over it crosses
    one board edge a step. The blocks go left to right along a band of two rows, right to left
    along the next. Otherwise the groups are runs of a snake over the rows."""
    bx, by = grid
    half = g // 2
    if g >= 4 and g % 2 == 0 and by >= 2 and half <= bx:
        out = []
        for band in range(by // 2):
            starts = list(range(0, bx - half + 1, half))
            for c0 in (starts if band % 2 == 0 else starts[::-1]):
                cols = range(c0, c0 + half)
                out.append([a + bx * 2 * band for a in cols] + [a + bx * (2 * band + 1) for a in reversed(cols)])
        return out
    snake = [a + bx * b for b in range(by) for a in (range(bx) if b % 2 == 0 else reversed(range(bx)))]
    return [snake[i:i + g] for i in range(0, len(snake) - g + 1, g)]


def group_layouts(grid: tuple[int, int], g: int, boards, compact: bool = False,
                  relays: bool = False) -> list[list[list[int]]]:
    """The layouts of groups of ``g`` boards on the torus ``grid`` (bands, :func:`board_groups`,
    and patches, :func:`board_patches`; with ``compact`` also the roundest groups,
    :func:`board_compact`; with ``relays`` also two lines of boards with relaying boards between
    them, :func:`relay_bands`, the way of its lines that places the most groups), each kept to the
    groups that lie inside ``boards`` (the live or allocated ones); layouts left empty are
    dropped."""
    inside = set(boards)
    found = (board_groups(grid, g), board_patches(grid, g)) + ((board_compact(grid, g),) if compact else ())
    layouts = [[grp for grp in lay if set(grp) <= inside] for lay in found]
    if relays and _relayed(grid, g):
        # the ways of the lines are one group's shape turned on the lattice of boards (the same
        # edges inside and around it), so one stands for them (each timed costs planning time):
        # the one that places the most groups inside ``boards``, ties to the first way
        ways = [[grp for grp in lay if set(grp) <= inside] for lay in relay_bands(grid, g)]
        if ways:
            layouts.append(max(ways, key=len))
    return [lay for lay in layouts if lay]


def board_compact(grid: tuple[int, int], g: int) -> list[list[int]]:
    """Board ids in groups of ``g`` boards, each the ``g`` boards nearest a centre board: the
    roundest group the lattice of boards allows, translates of one another in a snake over the
    ``grid`` (consecutive groups side by side). Empty where one does not fit (no wrap-around).

    Board ``(a, b)`` (id ``a + bx b``) neighbours ``(a +- 1, b)``, ``(a, b +- 1)`` and
    ``(a + 1, b - 1)``, ``(a - 1, b + 1)`` (:func:`tvm_spinn.target.topology.board_grid`: a
    triangular lattice of boards), so a ``p x q`` patch (:func:`board_patches`) is a rhombus
    whose long diagonal is ``p + q - 2`` board hops; the boards within ``r`` hops of one board
    form a hexagon, about ``sqrt(g)`` hops across. A rounder group has shorter trees (fewer
    board hops on an all-reduce's critical path) and more board edges inside it and around it
    for the shares to spread over. Boards are taken in the order of their hop distance from
    the centre, then of their distance in the plane (``a^2 + a b + b^2``), then of ``(a, b)``;
    a group lists them in that order, the centre first."""
    bx, by = grid
    if g < 1:
        return []
    r = 0
    while 3 * r * (r + 1) + 1 < g:  # the hexagon of radius r holds 3 r (r + 1) + 1 boards
        r += 1
    near = sorted(((abs(a) + abs(b) + abs(a + b)) // 2, a * a + a * b + b * b, a, b)
                  for a in range(-r, r + 1) for b in range(-r, r + 1) if (abs(a) + abs(b) + abs(a + b)) // 2 <= r)
    shape = [(a, b) for _, _, a, b in near[:g]]
    a0, b0 = min(a for a, _ in shape), min(b for _, b in shape)
    shape = [(a - a0, b - b0) for a, b in shape]
    w, h = max(a for a, _ in shape) + 1, max(b for _, b in shape) + 1
    if w > bx or h > by:
        return []
    out = []
    for row in range(by // h):
        cols = range(bx // w) if row % 2 == 0 else reversed(range(bx // w))
        for col in cols:
            out.append([(col * w + a) + bx * (row * h + b) for a, b in shape])
    return out


def board_patches(grid: tuple[int, int], g: int, shape: "tuple[int, int] | None" = None) -> list[list[int]]:
    """Board ids in groups of ``g`` boards, each a ``p x q`` patch of the ``grid`` of boards
    (``shape``; default the most nearly square that fits), the patches in a snake over the grid
    (consecutive patches side by side). A compact patch has more board edges inside it and
    around it than a band of two rows, and a patch as wide (or tall) as the grid closes into a
    ring of the torus: the all-reduces' trees spread over more edges. Empty where the shape
    does not fit."""
    bx, by = grid
    if shape is None:
        shapes = sorted((abs(p - g // p), p, g // p) for p in range(1, g + 1)
                        if g % p == 0 and p <= bx and g // p <= by)
        if not shapes:
            return []
        shape = shapes[0][1:]
    p, q = shape
    if p * q != g or p > bx or q > by:
        return []
    out = []
    for row in range(by // q):
        cols = range(bx // p) if row % 2 == 0 else reversed(range(bx // p))
        for col in cols:
            out.append([(col * p + a) + bx * (row * q + b) for b in range(q) for a in range(p)])
    return out


#: The lines of :func:`relay_bands`: the steps a line takes from board to board, in turn, and the
#: step between the two lines of a group (taken twice: the line between them relays), on the
#: lattice of boards whose board ``(a, b)`` neighbours ``(a +- 1, b)``, ``(a, b +- 1)``, ``(a + 1,
#: b - 1)`` and ``(a - 1, b + 1)`` (:func:`tvm_spinn.target.topology.board_grid`). The three ways
#: are one shape turned on the lattice; they differ in how their pairs tile a grid. A line may
#: also zigzag across two axes (two steps in turn, e.g. ``((0, 1), (-1, 1))``): a hop or two
#: fewer across the group, but on the cloud's torus its 16- and 8-board all-reduces are 1-6 us
#: dearer than the straight lines', so the lines run along the axes.
RELAY_LINES = (
    (((0, 1),), (1, 0)),           # along b, beside it across a
    (((1, 0),), (0, 1)),           # along a, beside it across b
    (((1, 0),), (-1, 1)),          # along a, beside it across the diagonal
)


def _relayed(grid: tuple[int, int], g: int) -> bool:
    """Whether a group of :func:`relay_bands` and the boards next to it are few enough for the
    all-reduce's trees to pass through those boards
    (:data:`~tvm_spinn.timing.collectives.MULTICAST_MAX_RANKS`; else its all-reduce is a ring
    or tree across the group's boards alone, and the layout has nothing to offer: the lines of
    16 boards, with 56 boards next to them)."""
    from ..timing.collectives import MULTICAST_MAX_RANKS

    steps = ((1, 0), (-1, 0), (0, 1), (0, -1), (1, -1), (-1, 1))  # the lattice of boards
    for lay in relay_bands(grid, g)[:1]:
        bx = grid[0]
        group = {(b % bx, b // bx) for b in lay[0]}
        near = {(a + da, c + dc) for a, c in group for da, dc in steps} - group
        return g + len(near) <= MULTICAST_MAX_RANKS
    return False


def relay_bands(grid: tuple[int, int], g: int) -> list[list[list[int]]]:
    """Layouts of groups of ``g`` boards as two parallel lines of ``g / 2`` boards two board hops
    apart, the boards of the line between them (and around them) free to relay the
    all-reduce's trees: one layout per way of :data:`RELAY_LINES`.

    On a torus of boards too large for a patch to close into a ring, a compact patch joins its
    boards by few edges of its own (a 4 x 4 patch 33, each carrying its share of every tree
    part both ways) and reaches the boards around it only from its border. Two lines with a line
    of other boards between them give every member its six board edges to boards that relay
    (two lines of members and the three lines of boards between and beside them): the shares
    spread over about twice the edges of the patch's boundary, at a few more board hops
    across. At batch 1 the boards between are idle while a group all-reduces (they run the
    other blocks of the pipeline), so each pair of groups interleaves: the second group's lines
    lie between and beside the first's (translates by one step across). The pairs tile the
    torus ``grid`` (no wrap-around) in a snake, across the lines, then along them, from one
    line in: on a patch of a larger torus (an allocation, whose link graph ends at its edge)
    the first group's outer line then has a line of relaying boards outside it too (a 16-board
    group on an 8 x 9 patch of the cloud all-reduces about a quarter faster than with its
    outer line on the patch's edge; docs/design/scale-out.md gives the figures).

    Returns
    -------
    list of list of list of int
        Per way of :data:`RELAY_LINES` whose pair fits the grid, the groups (board ids ``a + bx
        b``) in pipeline order; empty for an odd ``g`` or ``g < 4``.
    """
    bx, by = grid
    if g < 4 or g % 2:
        return []
    h = g // 2
    out = []
    for steps, across in RELAY_LINES:
        line = np.zeros((h, 2), dtype=np.int64)
        for k in range(1, h):
            line[k] = line[k - 1] + steps[(k - 1) % len(steps)]
        side = np.asarray(across, dtype=np.int64)
        pair = [np.concatenate([line, line + 2 * side]), np.concatenate([line + side, line + 3 * side])]
        # translates: 4 steps across to the next pair, the line's own length along it
        along = line[-1] + steps[(h - 1) % len(steps)]
        reach = bx + by
        xs, ys = np.meshgrid(np.arange(-reach, reach + 1), np.arange(-reach, reach + 1), indexing="ij")
        shift = (xs.reshape(-1, 1) * 4 * side + ys.reshape(-1, 1) * along)  # (translates, 2)
        both = np.concatenate(pair) + side  # one line in from the first: it relays too
        pos = shift[:, None, :] + both[None, :, :]
        fits = ((pos[..., 0] >= 0) & (pos[..., 0] < bx) & (pos[..., 1] >= 0) & (pos[..., 1] < by)).all(axis=1)
        x, y = xs.reshape(-1)[fits], ys.reshape(-1)[fits]
        groups = []
        for i in np.lexsort((np.where(y % 2 == 0, x, -x), y)):  # snake: across the lines, then along
            for part in pair:
                at = part + side + shift[fits][i]
                groups.append([int(a + bx * b) for a, b in at])
        if groups:
            out.append(groups)
    return out


def _run_s(resident, streamed, blocks: int, fit: int, saved_s: float = 0.0) -> float:
    """Latency of ``blocks`` consecutive blocks on one board: the first ``fit`` (what the board's
    SRAM keeps resident) at the time of a block mapped alone with its weights resident, the
    rest at the time of a block streaming its weights from DRAM, less ``saved_s`` where part of
    each streamed block's weights was fetched ahead (:func:`_ahead_gains`)."""
    return min(blocks, fit) * resident.latency_s + max(0, blocks - fit) * (streamed.latency_s - saved_s)


def _block_variants(resident, streamed, fit: int, fit_ahead: int, saved_s: float, buffer: int,
                    unburnt_j: float) -> list:
    """How a group's blocks may run, each ``(blocks kept resident, seconds each streamed block
    saves, prefetch buffer bytes per chip, static joules each streamed block does not burn,
    tag)``: ``fit`` blocks resident and the rest streamed (tag ``""``); where fetching ahead
    saves time (:func:`_ahead_gains`), ``fit_ahead`` resident beside the buffer and the rest
    streamed and fetched ahead (``"p"``); and, where a streamed block fetched ahead
    (``streamed``'s latency less ``saved_s``) is faster than a resident one (``resident``), every
    block streamed so, none resident (``"s"``): a resident block runs its pieces with the shard
    plans its one SRAM ledger leaves them, while a streamed block's pieces, their weights fetched
    ahead, each run as mapped alone (:func:`_on_chip`). (The buffer stays what the first block
    mapped resident leaves: a bound on what streaming every block leaves.)"""
    out = [(fit, 0.0, 0, 0.0, "")]
    if saved_s > 0:
        out.append((fit_ahead, saved_s, buffer, unburnt_j, "p"))
        if resident.latency_s > streamed.latency_s - saved_s:
            out.append((0, saved_s, buffer, unburnt_j, "s"))
    return out


def _ahead_gains(resident, streamed, reduce_s: float, dram_bw: float, reduces: int = 2,
                 ends: "tuple | None" = None, capacity: float = math.inf) -> tuple[tuple, int]:
    """What a streamed block gains by fetching weights while its DRAM channels are idle.

    The weights do not depend on the token, so each program of the block fetches up to
    ``window x dram_bw`` of its streamed bytes into an SRAM buffer ahead of its start, which
    the program then does not read from DRAM while it runs: it saves those bytes' DRAM time,
    and never more than its time streaming less its time with its weights on chip (the two
    stages' ``program_s``: the slice streaming, and resident or each piece as it runs once its
    weights are fetched, :func:`_on_chip`). A program's window is the time before it while the chips' DRAM
    channels are idle:

    * with ``ends`` (the slice's pieces, :func:`slice_pieces`: whether each ends where the
      boards all-reduce its partial sums) the channels stream on from piece to piece: every
      stretch of idle DRAM time (a piece's run beyond its own streamed bytes' DRAM time, its
      loads first so that it is never delayed, and the all-reduce after a piece that ends at
      one: the links move the sums) fetches the bytes of the pieces after it, in order and as
      far as one block's pieces ahead (cyclically: the next streamed block's first pieces),
      while the buffer's bytes fetched ahead and not yet run stay within ``capacity``
      (:func:`_stream_ahead`, in the steady state of consecutive streamed blocks);
    * without, the all-reduce before each of the block's programs (the previous block's second
      before the first program, the block's first before the MLP's GEMMs), the programs together
      saving at most ``reduces x reduce_s``: the block's all-reduces (two; one where attention
      and MLP join the residual together).

    Parameters
    ----------
    resident, streamed : tvm_spinn.llm.plan._Stage
        The slice with its weights on chip (mapped resident, or :func:`_on_chip`) and mapped
        streaming them.
    reduce_s : float
        One all-reduce's time.
    dram_bw : float
        One chip's DRAM bandwidth (bytes/s).
    reduces : int
        The block's all-reduces (:func:`block_all_reduces`).
    ends : tuple of bool, optional
        Per program of the mappings, whether it ends at an all-reduce (:func:`slice_pieces`).
    capacity : float, optional
        SRAM bytes per chip the pieces' buffer may hold at once (with ``ends``; unbounded by
        default).

    Returns
    -------
    tuple
        ``(seconds each program of a streamed block saves, the SRAM buffer's bytes per chip)``;
        ``((), 0)`` where nothing is saved (among others where the mappings do not say what each
        program streams).
    """
    n = len(streamed.program_s)
    if len(streamed.program_streamed) != n or len(resident.program_s) != n or (ends is not None and len(ends) != n):
        return (), 0
    if ends is not None:
        # seconds of DRAM time each piece saves with its bytes on chip, and the idle stretches
        useful = [min(nbytes / dram_bw, max(0.0, slow - fast))
                  for fast, slow, nbytes in zip(resident.program_s, streamed.program_s, streamed.program_streamed)]
        running = [max(0.0, slow - nbytes / dram_bw) for slow, nbytes in zip(streamed.program_s, streamed.program_streamed)]
        after = [reduce_s if end else 0.0 for end in ends]
        gains, held = _stream_ahead(useful, running, after, capacity / dram_bw)
        return (tuple(gains), int(math.ceil(held * dram_bw))) if sum(gains) > 0 else ((), 0)
    gains, buffer = [], 0
    for fast, slow, nbytes in zip(resident.program_s, streamed.program_s, streamed.program_streamed):
        ahead = min(float(nbytes), reduce_s * dram_bw)  # bytes per chip fetched ahead
        gain = min(ahead / dram_bw, max(0.0, slow - fast))
        gains.append(max(0.0, gain))
        if gain > 0:
            buffer = max(buffer, int(math.ceil(ahead)))
    # the programs together never more than the block's all-reduces
    total = sum(gains)
    if total <= 0:
        return (), 0
    scale = min(1.0, reduces * reduce_s / total)
    return tuple(x * scale for x in gains), buffer


def _unburnt_j(streamed, gains, board) -> float:
    """The static energy a streamed block's mapping charged over the seconds its weights
    fetched ahead take off it (:func:`_ahead_gains`, ``gains`` per program): the block no longer
    runs them, so its chips do not burn their static power over them (its DRAM bytes are read
    all the same, their energy stays). Each program's chips (its mapping's group) over its
    gain; the board's chips where the mapping does not say per program."""
    p = board.p_static_w_per_chip
    if len(streamed.program_timings) != len(gains):
        return p * board.chips * float(sum(gains))
    return p * float(sum(gain * t.chips for gain, t in zip(gains, streamed.program_timings)))


def _stream_ahead(useful, running, after, capacity: float = math.inf, cycles: int = 4) -> tuple[list, float]:
    """The DRAM channel streaming a block's pieces' weights ahead through an SRAM buffer, over
    consecutive streamed blocks (the pieces cyclically), every idle stretch spent at once.

    Piece ``k`` saves up to ``useful[k]`` seconds of DRAM time with its bytes fetched ahead; the
    channel is idle ``running[k]`` seconds while it runs (past its own reads) and ``after[k]``
    seconds after it (its all-reduce). Each stretch fetches for the pieces after the one it
    follows, in order, up to one block's pieces ahead, while the bytes held stay within
    ``capacity`` (seconds of DRAM time): while a piece runs its own bytes fetched ahead are
    counted as held, after it they are not. All quantities are seconds of one chip's DRAM
    channel. The greedy stream is simulated over ``cycles`` blocks from an empty buffer and its
    last block taken (the steady state: a piece's fetches come from the block's pieces before it).

    Returns
    -------
    tuple
        ``(seconds each piece saves, the most seconds' worth of bytes the buffer holds)``, both
        of the last block.
    """
    n = len(useful)
    total = cycles * n
    fetched = [0.0] * (total + n)
    held = peak = 0.0

    def fetch(m: int, window: float, room: float) -> float:
        nonlocal held
        got = 0.0
        for j in range(m + 1, m + n + 1):
            take = min(useful[j % n] - fetched[j], window - got, room - got)
            if take <= 0:
                if window - got <= 0 or room - got <= 0:
                    break
                continue
            fetched[j] += take
            got += take
        held += got
        return got

    for m in range(total):
        before = held  # piece m's own bytes fetched ahead among them
        during = fetch(m, running[m % n], capacity - before)
        held -= fetched[m]  # piece m has run
        fetch(m, after[m % n], capacity - held)
        if m >= total - n:
            peak = max(peak, before + during, held)
    return fetched[total - n:total], peak


def _on_chip(resident, pieces, ends, row_bytes: int, chips: int, scatter_s: float, map_alone, streamed=None,
             handoffs: "tuple | None" = None):
    """``resident`` with each piece's time as it runs with its weights on chip and nothing else
    resident (the floor of what fetching a streamed block's weights ahead saves it,
    :func:`_ahead_gains`): a streamed block keeps no weights resident, so a piece whose weights the
    block's SRAM ledger left partly in DRAM (``resident.program_streamed``) runs, once they are
    fetched ahead, as the piece mapped alone on the board (``map_alone(piece)``: its weights
    resident), timed as the block's pieces are (:func:`fused_gathers`, :func:`_spread`); such a
    piece's timing (its layers and collectives) is then the alone mapping's.

    The weights fetched ahead land where the streamed block's mapping (``streamed``) reads
    them: each chip of the piece's streaming shard plan its share, in its own buffer. A piece
    whose alone mapping takes another plan (fewer chips, each holding more of the weights than
    its buffer share, and handing its outputs to the next piece's chips outside its own time)
    runs with the streaming plan instead, its weights on chip: the alone mapping's time of that
    plan (each plan the mapper timed, :attr:`tvm_spinn.llm.plan._Stage.program_candidates`),
    with that plan's own gathers of its outputs, as a piece not ending at an all-reduce has
    them; one that does runs so without the gather of its row at its end, which the all-reduce
    delivers (:func:`_ahead_of_end`), where that is faster than the alone mapping. A piece
    mapped alone on fewer chips than the next piece runs on hands its outputs on to them
    (``handoffs``, :func:`_handed_on`)."""
    import dataclasses

    if ends is None or len(resident.program_s) != len(pieces):
        return resident
    times = list(resident.program_s)
    timings = list(resident.program_timings) if len(resident.program_timings) == len(pieces) else None
    plans = streamed.program_plans if streamed is not None and len(streamed.program_plans) == len(pieces) else None
    for k, piece in enumerate(pieces):
        if resident.program_streamed[k] <= 0:
            continue
        alone = map_alone(piece)
        if plans is not None and ends[k] and alone.program_plans and alone.program_plans[0] != plans[k]:
            # ending at an all-reduce: the streaming plan with its weights on chip, its row's
            # gather the all-reduce's (as the streamed piece's own timing has it), where faster
            ahead = _ahead_of_end(alone, streamed, k, row_bytes)
            if ahead is not None and ahead < times[k]:
                times[k] = ahead
                if timings is not None:
                    timings[k] = streamed.program_timings[k]
                continue
        if plans is not None and not ends[k] and alone.program_plans and alone.program_plans[0] != plans[k]:
            # the streaming plan with its weights on chip; its KV-cache write as the alone mapping's
            same = alone.program_candidates[0].get(plans[k])
            if same is not None:
                chosen = alone.program_candidates[0].get(alone.program_plans[0], alone.program_timings[0].latency_s)
                times[k] = same + (alone.program_s[0] - chosen)
                if timings is not None:
                    timings[k] = streamed.program_timings[k]  # that plan's layers and collectives
                continue
        alone = _spread(_less(alone, fused_gathers(alone, (ends[k],), row_bytes)), (ends[k],), chips, scatter_s)
        if handoffs is not None and timings is not None and len(alone.program_timings) == 1:
            alone = _handed_on(alone, (ends[k],), (handoffs[k],),
                               (timings[(k + 1) % len(pieces)].chips if k + 1 < len(pieces) else 0,))
        if alone.latency_s < times[k]:
            times[k] = alone.latency_s
            if timings is not None and len(alone.program_timings) == 1:
                timings[k] = alone.program_timings[0]  # its layers and collectives as it runs
    return dataclasses.replace(resident, program_s=tuple(times),
                               **({"program_timings": tuple(timings)} if timings is not None else {}))


def _mac_high(P, mapped, pieces, ends, board, host_shapes, slots: int, memo, fit: int, block_w: int, budget: float,
              cpb: int, hidden: int, scatter_s: float, handoffs, reduce_s: float, reduces: int, shed=None) -> list:
    """The streamed block of a slice mapped with MAC-high row tiles
    (``MappingOptions(row_tiles=False)``), timed as :func:`records` times the mapper's: its
    pieces streaming their weights, each as it runs with them fetched ahead (:func:`_on_chip`,
    mapped alone with the same tiles), and what fetching ahead saves (:func:`_ahead_gains`).
    ``mapped``: the slice mapped resident (the resident blocks keep the mapper's tiles); the
    other arguments as :func:`records` has them for the slice's form (``ends``, ``handoffs``:
    :func:`slice_pieces`, :func:`handoff_gathers`; ``fit``: blocks kept resident without a
    buffer; ``shed``: the delivery's adds and the mapping its norms are charged for,
    :func:`_shed`). Returns ``[(block variants, resident, streamed, on chip, "r")]``
    (:func:`_block_variants`), or ``[]`` where fetching ahead saves nothing with these tiles.

    The mapper ranks each piece's tilings and shard plans alone. A piece's register-block row
    tiles may make a shard plan over fewer chips the faster alone, each of its chips then
    reading more of the piece's streamed bytes (its KV cache share) from its own DRAM: the
    channels are idle for less of the piece's run, and fetch less of the next pieces' weights
    ahead. Which tiling is faster for a streamed block depends on that context."""
    import dataclasses

    from ..mapping import current_options

    def map_alone(piece):
        return P._map_stage([piece], board, host_shapes, slots, memo=memo, keep_outputs=True)

    with dataclasses.replace(current_options(), row_tiles=False):
        streamed = P._map_stage(list(pieces), board, host_shapes, slots, weights="stream", memo=memo,
                                keep_outputs=True)
        resident = mapped
        if ends is not None:
            resident, streamed = (_handed_on(_spread(_less(st, fused_gathers(st, ends, hidden * 4)), ends, cpb, scatter_s),
                                             ends, handoffs) for st in (resident, streamed))
        resident = _at_most(resident, streamed)
        on_chip = _on_chip(resident, pieces, ends, hidden * 4, cpb, scatter_s if ends is not None else 0.0, map_alone,
                           streamed, handoffs)
        resident, streamed, on_chip = (_shed(st, shed, pieces, ends, board) for st in (resident, streamed, on_chip))
    gains, buffer = _ahead_gains(on_chip, streamed, reduce_s, board.dram_bw_bytes_s, reduces, ends,
                                 max(0.0, budget - resident.resident_bytes) / cpb)
    saved = float(sum(gains))
    if saved <= 0:
        return []
    fit_ahead = max(1, int((budget - buffer * cpb) // max(1, block_w)))
    return [(_block_variants(resident, streamed, fit, fit_ahead, saved, buffer, _unburnt_j(streamed, gains, board)),
             resident, streamed, on_chip, "r")]


def _ahead_of_end(alone, streamed, k: int, row_bytes: int) -> "float | None":
    """Seconds of piece ``k`` (ending where the boards all-reduce) run with the streaming
    mapping's shard plan and its weights on chip: that plan's time in the piece's alone mapping
    (:attr:`tvm_spinn.llm.plan._Stage.program_candidates`, its KV-cache write as the alone
    mapping's) less the gather of its row at its end, which the all-reduce delivers
    (:func:`fused_gathers`: the tail the streamed piece's timing of the same plan shows). None
    where the alone mapping did not time that plan."""
    import dataclasses

    same = alone.program_candidates[0].get(streamed.program_plans[k]) if alone.program_candidates else None
    if same is None:
        return None
    chosen = alone.program_candidates[0].get(alone.program_plans[0], alone.program_timings[0].latency_s)
    one = dataclasses.replace(streamed, program_timings=(streamed.program_timings[k],))
    saved = fused_gathers(one, (True,), row_bytes)
    return same + (alone.program_s[0] - chosen) - (saved[0] if saved else 0.0)


def _at_most(resident, streamed):
    """``resident`` with each program at most as long as in ``streamed``: a program whose
    weights stay resident runs no slower than with the shard plan it has streaming them (the
    same plan, its weight loads gone, and no more SRAM than it held as mapped resident where
    that plan splits its weights over more chips), which the block's SRAM ledger may not have
    let it choose (the ledger's earlier programs holding the SRAM it needed to take that plan
    resident, or a gather the all-reduce delivers weighing against it)."""
    import dataclasses

    if len(resident.program_s) != len(streamed.program_s) or resident is streamed:
        return resident
    times = tuple(min(a, b) for a, b in zip(resident.program_s, streamed.program_s))
    return dataclasses.replace(resident, latency_s=resident.latency_s - sum(resident.program_s) + sum(times),
                               program_s=times)


def fused_gathers(stage, ends, row_bytes: int) -> "tuple | None":
    """The seconds each piece of a mapped slice (:func:`slice_pieces`) spends gathering the
    row whose partial sums the boards all-reduce, which the all-reduce delivers itself: its
    on-board all-gather rides on its multicast
    (:func:`tvm_spinn.timing.collectives.board_group_all_reduce`, ``fuse_gather``), every chip
    receiving the whole reduced row.

    A piece that ends where the boards all-reduce hands its output to the all-reduce in the
    layout its shard plan left it; the gather of that output at the piece's end (the mapper
    makes a program's outputs whole on every chip) is the all-reduce's, so the piece ends when
    its last layer does: it saves its latency past its last layer's end
    (:func:`tvm_spinn.timing.system.compose`), where every collective after its last layer is
    an all-gather of the ``row_bytes`` row (else nothing: what else its tail holds is not
    known). The next piece reads the reduced row whole from SRAM, as it arrives (the mapper's
    on-chip inputs): it has no gather of it to save.

    Returns
    -------
    tuple or None
        Per piece, the seconds saved; None where the slice is not cut into pieces or the
        mapping does not have each piece's timing.
    """
    if ends is None or len(stage.program_timings) != len(ends):
        return None
    out = []
    for st, end in zip(stage.program_timings, ends):
        n = len(st.layer_s)
        tail = [c for c in st.collectives if c.layer >= n]
        if not end or not tail or any(c.op != "all_gather" or c.nbytes != row_bytes for c in tail):
            out.append(0.0)
            continue
        out.append(max(0.0, st.latency_s - sum(st.layer_s)))
    return tuple(out)


def _spread(stage, ends, chips: int, scatter_s: float):
    """``stage`` with each piece that ends at an all-reduce on fewer than the board's ``chips``
    (its sums on those chips only) ``scatter_s`` the longer: the all-reduce takes the sums
    spread over the board's chips (one share a chip,
    :func:`tvm_spinn.timing.collectives.board_group_all_reduce`), so they are spread first, as
    long as an on-board all-gather of the row (the same shares over the same routes, the other
    way)."""
    if ends is None or len(stage.program_timings) != len(ends):
        return stage
    extra = [scatter_s if end and st.chips < chips else 0.0 for st, end in zip(stage.program_timings, ends)]
    return _links_added(stage, extra)


def _links_added(stage, extra):
    """``stage`` with ``extra[k]`` seconds of on-board link time added to its piece ``k`` (to its
    latency, its program times and its links' bound); ``stage`` itself where none is added."""
    import dataclasses

    if not any(extra):
        return stage
    bounds, alone = dict(stage.bounds), dict(stage.alone)
    bounds["links"] += sum(extra)
    alone["links"] += sum(extra)
    return dataclasses.replace(stage, latency_s=stage.latency_s + sum(extra), bounds=bounds, alone=alone,
                               program_s=tuple(s + d for s, d in zip(stage.program_s, extra)))


def handoff_gathers(pieces, gather) -> tuple:
    """Per piece of a slice, the seconds to gather its outputs on the chips of the next piece
    (``gather(nbytes)``: an on-board all-gather of that many bytes): what a piece whose shard
    plan leaves its outputs on fewer chips than the next one reads them on pays to hand them on
    (:func:`_handed_on`)."""
    return tuple(gather(sum(int(p.tensors[t].nbytes) for t in p.outputs)) for p in pieces)


def _handed_on(stage, ends, handoffs, next_chips=None):
    """``stage`` with each piece that does not end at an all-reduce and runs on fewer chips
    than the piece after it ``handoffs[k]`` the longer: its outputs (the q, k and v rows a
    projection on one chip makes for the attention over the board's chips) are gathered on the
    next piece's chips before it starts, as a piece mapped on those chips gathers them itself
    (the mapper makes a program's outputs whole on every chip of its group); the next piece
    reads them as inputs already on chip. ``next_chips``: per piece, the chips of the piece
    after it (default: the stage's next program's; 0: none after it). Where the piece's
    mapping timed a plan over at least the next piece's chips (which gathers the outputs
    itself) that is faster than the hand-off makes it, the piece takes that plan's time (the
    mapper chose its plan without the hand-off)."""
    timings = stage.program_timings
    if ends is None or len(timings) != len(ends) or len(handoffs) != len(ends):
        return stage
    if next_chips is None:
        next_chips = tuple(timings[k + 1].chips if k + 1 < len(timings) else 0 for k in range(len(timings)))
    extra = [h if not end and st.chips < after else 0.0
             for st, end, h, after in zip(timings, ends, handoffs, next_chips)]
    if len(stage.program_candidates) == len(ends):
        for k, (timed, plan) in enumerate(zip(stage.program_candidates, stage.program_plans)):
            wide = [t for (tp, dp, sp), t in timed.items() if tp * dp * sp >= next_chips[k]]
            if extra[k] > 0 and wide and plan in timed:
                # the wider plan's time, with the piece's cache write as mapped
                extra[k] = max(0.0, min(extra[k], min(wide) - timed[plan]))
    return _links_added(stage, extra)


def slice_collectives(stage, row_bytes: "int | None" = None) -> dict:
    """Seconds of one block's on-board collectives in a mapped slice, by ``"op algorithm"``
    (e.g. ``"all_reduce chain"``: the attention's floating-point sums, in the one-chip
    program's order), the row gathers of ``row_bytes`` left out (those the all-reduce delivers:
    :func:`fused_gathers`). A breakdown: a collective's seconds, not what it delayed."""
    out: dict = {}
    for st in stage.program_timings:
        for c in st.collectives:
            if row_bytes is not None and c.op == "all_gather" and c.nbytes == row_bytes:
                continue
            key = f"{c.op} {c.algorithm}"
            out[key] = out.get(key, 0.0) + float(c.seconds)
    return dict(sorted(out.items()))


def _less(stage, saved):
    """``stage`` with each program ``saved[k]`` seconds the shorter, and its links bound (each
    program's collectives) without the gathers saved: the stage's ``bounds`` sum each program's
    largest bound (:func:`tvm_spinn.llm.plan._map_stage`), so a program whose largest was its
    links moves its share to what is largest without them."""
    import dataclasses

    bounds, alone = dict(stage.bounds), dict(stage.alone)
    for st, d in zip(stage.program_timings, saved):
        if d <= 0:
            continue
        kinds = {"compute": st.compute_bound_s, "dram": st.memory_bound_s, "links": st.comm_bound_s}
        less = dict(kinds, links=max(0.0, st.comm_bound_s - d))
        top, new = max(kinds, key=kinds.get), max(less, key=less.get)
        # where the links were the largest of the three and the stage counted them (its SRAM
        # bound, the resident bytes at the PEs' DMA rate, was not the program's largest)
        if top == "links" and bounds["links"] >= kinds["links"]:
            bounds["links"] -= kinds["links"]
            bounds[new] += less[new]
        alone["links"] -= kinds["links"] - less["links"]
    return dataclasses.replace(stage, latency_s=stage.latency_s - sum(saved), bounds=bounds, alone=alone,
                               program_s=tuple(s - d for s, d in zip(stage.program_s, saved)))


def fused_adds(pieces, ends) -> "tuple[list, tuple, list] | None":
    """A slice cut where the boards all-reduce (:func:`slice_pieces`) with the residual add
    after each all-reduce run on the all-reduce's delivery: ``(pieces, ends, adds)``, the pieces
    without those adds (a piece left empty dropped), whether each ends at an all-reduce, and
    the adds taken out (``(piece, layer)`` of the cut slice); None where a piece after an
    all-reduce does not start with a residual add of two of its inputs (every all-reduce must
    have one, else the slice is timed as cut).

    The all-reduce's multicast delivers every reduced share to every chip of each board
    (:func:`fused_gathers`), and each chip holds the residual row whole (the block's input, and
    each such add's output, made on every chip the same way): each chip's PEs add each part of
    the reduced row to the residual as it arrives, one job a part (:func:`fused_add_s`), instead
    of a layer of its own after the last part, with its wake-up, its set-up and its barrier. An
    element-wise fp32 add of the same operands: the same bits. The next piece reads the sum
    whole from SRAM, as it read the reduced row."""
    from ..program.ops import family_of

    P = importlib.import_module(".plan", __package__)
    if ends is None or not any(ends) or len(ends) != len(pieces):
        return None
    out_pieces, out_ends, adds = [], [], []
    for k, piece in enumerate(pieces):
        if not ends[k - 1]:  # (piece 0 follows the block's last piece: the block before's)
            out_pieces.append(piece)
            out_ends.append(ends[k])
            continue
        first = piece.layers[0] if piece.layers else None
        acts = [t for t in first.inputs if piece.tensors[t].role != "const"] if first is not None else []
        if first is None or not family_of(first.kind).sums_inputs(first) or len(acts) != 2 \
                or any(t not in piece.inputs for t in acts):
            return None
        adds.append((piece, first))
        if len(piece.layers) > 1:
            out_pieces.append(P._slice(piece, 1, len(piece.layers)))
            out_ends.append(ends[k])
        elif ends[k]:  # an add alone that ends at an all-reduce: nothing left to cut at
            return None
    return out_pieces, tuple(out_ends), adds


def fused_add_s(piece, layer, board, chunks: int = FUSED_CHUNKS) -> float:
    """Seconds a chip's PEs spend on a residual add run on the all-reduce's delivery
    (:func:`fused_adds`): every chip adds the whole row, each of its PEs an equal share of the
    elements, in ``chunks`` parts, each part one job of the PE's job loop woken by the part's
    arrival (its interrupt entry), priced by the layer's operator family as the mapper prices
    the layer's tiles."""
    from ..program.ops import family_of

    fam = family_of(layer.kind)
    elements = int(np.prod(piece.tensors[layer.output].shape, dtype=np.int64))
    cycles = (chunks * (fam.fixed_cycles(layer, board) + board.irq_entry_cycles)
              + math.ceil(elements / board.pes_per_chip) * fam.cycles_per_element(layer, board))
    return float(cycles) / board.clock_hz


def norms_on_delivery(pieces, ends, adds, mapped, board, chunks: int = FUSED_CHUNKS) -> "tuple[tuple, float] | None":
    """The first half of each ``rms_norm`` that starts a piece after an all-reduce, run on the
    all-reduce's delivery with its residual add (:func:`fused_adds`, ``adds`` the add layers
    taken out): ``(seconds each piece sheds, seconds a chip's PEs spend on one all-reduce's
    delivery)``, the second the most of any such norm's; None where no piece starts so.

    The norm's row (one row: a decode step at batch 1) is split over PEs in chunks of whole
    blocks (:meth:`tvm_spinn.program.ops.rows.Rows.choose_tile`; the tiles of its mapping
    ``mapped``, the slice mapped with its weights resident, whose ``program_layers`` give each
    piece's tiles): each chunk's PE sums its blocks' squares, then the block sums travel along
    the chunks in the row's order (the chain), and the last chunk sends ``1 / sqrt`` back for
    the second pass. The all-reduce delivers the row in ``chunks`` consecutive parts, each
    holding whole chunks of the norm (the norm's chunks must divide among the parts, and be no
    more than the PEs its mapping runs it on: one chunk a PE). Each
    chunk's PE adds its own columns of the part to the residual as the part arrives (the add's
    job of :func:`fused_add_s` on the norm's tiles instead of an equal share of the row over all
    the PEs), sums their squares block by block, and passes the chain on once the chunk before
    it has: the chain adds the same block sums in the row's order, so the bits are the norm's.
    Per part, a chip's PEs spend the add of a chunk's columns (its job, interrupt entry and
    elements), a chunk's first pass (:func:`tvm_spinn.program.ops.rows.split_norm_sums`) and
    the chain through the part's chunks (its share of the chain and the hop into the part);
    the piece sheds the first pass and the whole chain, which
    :func:`tvm_spinn.timing.collectives.streamed_all_reduce` charges to the delivery instead
    (each part's work in order, after the part arrives and the part before it is done: the
    last part's work follows the all-reduce's end).
    """
    from ..program.ops import family_of
    from ..program.ops.rows import split_norm_sums

    if ends is None or not adds or len(pieces) != len(ends) or len(mapped.program_layers) != len(pieces):
        return None
    saved, consume = [0.0] * len(pieces), 0.0
    for k, piece in enumerate(pieces):
        layers = mapped.program_layers[k]
        first = piece.layers[0] if piece.layers else None
        if not ends[k - 1] or first is None or not family_of(first.kind).sums_squares_first(first) \
                or first.inputs[0] not in piece.inputs \
                or not layers:
            continue
        shape = tuple(int(d) for d in piece.tensors[first.inputs[0]].shape)
        row, tiles = shape[-1], int(layers[0].tiles)
        # one chunk a PE: a chip's PEs run a part's chunks side by side, as the delivery is charged
        if int(np.prod(shape[:-1], dtype=np.int64)) != 1 or tiles < 2 * chunks or tiles % chunks or row % tiles \
                or tiles > int(layers[0].pes):
            continue
        cols = row // tiles
        first_pass, chain, hop = split_norm_sums(first, row, cols, board)
        add_part = max(family_of(a.kind).fixed_cycles(a, board) + board.irq_entry_cycles
                       + cols * family_of(a.kind).cycles_per_element(a, board) for a in adds)
        saved[k] = (first_pass + chain) / board.clock_hz
        consume = max(consume, chunks * (add_part + first_pass + chain / chunks + hop) / board.clock_hz)
    if not any(saved):
        return None
    return tuple(saved), consume


def _norm_tiles(stage, k: int):
    """The tiles of the first layer of ``stage``'s piece ``k`` (None where it has no layers)."""
    layers = stage.program_layers[k] if k < len(stage.program_layers) else ()
    return int(layers[0].tiles) if layers else None


def _shed(stage, shed, pieces, ends, board):
    """``stage`` with each piece the shorter by what its own norm sheds onto an all-reduce's
    delivery (:func:`norms_on_delivery` on ``stage``'s own tiles: its bounds unchanged, the work
    still done). ``shed``: None, or ``(adds, mapped)``, the add layers on the delivery and the
    mapping whose norm tiles the delivery is charged for; a piece whose norm ``stage`` tiles
    otherwise keeps its norm. A piece never drops below its own DRAM reads
    (``program_streamed``, at ``board.dram_bw_bytes_s``). ``stage`` itself where nothing is
    shed or the stage is not timed per piece."""
    import dataclasses

    if shed is None or len(stage.program_s) != len(pieces):
        return stage
    adds, mapped = shed
    own = norms_on_delivery(pieces, ends, adds, stage, board)
    if own is None:
        return stage
    streamed = stage.program_streamed if len(stage.program_streamed) == len(pieces) else (0,) * len(pieces)
    times = []
    for k, (s, d) in enumerate(zip(stage.program_s, own[0])):
        if d and _norm_tiles(stage, k) != _norm_tiles(mapped, k):
            d = 0.0
        times.append(max(s - d, min(s, streamed[k] / board.dram_bw_bytes_s)))
    if times == list(stage.program_s):
        return stage
    return dataclasses.replace(stage, latency_s=stage.latency_s - (sum(stage.program_s) - sum(times)),
                               program_s=tuple(times))


@dataclass(frozen=True)
class GroupCaches:
    """Every user's KV cache on the boards of each group (see :func:`group_caches`).

    ``need``, ``sram_room``, ``dram_room``: per group, one board's bytes of the batch's cache of
    the group's blocks, and the room its SRAM (beside the resident weights) and its DRAM (beside
    the streamed weights) leave for it; ``largest_batch``: the most users every group holds."""

    batch: int
    need: tuple
    sram_room: tuple
    dram_room: tuple
    largest_batch: int

    @property
    def fits(self) -> bool:
        return all(n <= s + d for n, s, d in zip(self.need, self.sram_room, self.dram_room))

    def message(self, arch_name: str, groups, g: int) -> str:
        """Why the batch does not fit (the first group over), or ``""``."""
        over = next((j for j, (n, s, d) in enumerate(zip(self.need, self.sram_room, self.dram_room)) if n > s + d),
                    None)
        if over is None:
            return ""
        return (f"the KV cache of {self.batch} users does not fit stage {over} (boards {list(groups[over])} of "
                f"{arch_name}, each block tensor-parallel over {g} boards): {self.need[over]} bytes needed per board, "
                f"{self.sram_room[over] + self.dram_room[over]} available ({self.sram_room[over]} in SRAM beside its "
                f"resident weights, {self.dram_room[over]} in DRAM beside its streamed weights); the largest batch "
                f"that fits every stage is {self.largest_batch}")


def group_caches(resident, streamed, sizes, fit: int, batch: int, board, capacity: int) -> GroupCaches:
    """Place the cache of ``batch`` users on the boards of each group.

    A board of a group running ``n`` blocks (``sizes``) holds its slice's cache of them for
    every user: ``n`` times the cache the slice's mapping holds (``resident.kv_bytes``, mapped for
    the whole batch: every copy its shard plans keep, such as each slot's keys and values on
    every group of chips that splits the query heads). It lives in the board's SRAM as far as
    ``capacity`` (the board's resident share, :func:`tvm_spinn.mapping.planner.resident_capacity`)
    has room beside the weights of the ``min(n, fit)`` blocks kept resident (and only where the
    mapping held the cache in SRAM), the rest in the DRAM of the board's chips beside the weights
    streamed from it (the resident blocks' share that did not fit, and every streamed block's).

    Parameters
    ----------
    resident, streamed : tvm_spinn.llm.plan._Stage
        The slice mapped with its weights resident and streaming them.
    sizes : sequence of int
        Blocks per group.
    fit : int
        Blocks a board keeps resident.
    batch : int
        Users.
    board : SpinnArch
        One board.
    capacity : int
        SRAM bytes of the board's resident share.

    Returns
    -------
    GroupCaches
    """
    kept = max(0, resident.resident_bytes - resident.kv_sram_bytes)  # a resident block's weights in SRAM
    rest = max(0, resident.weight_bytes - min(kept, resident.weight_bytes))  # and what it streams
    need, sram, dram = [], [], []
    largest = math.inf
    for n in sizes:
        k = min(n, fit)
        need.append(int(n * resident.kv_bytes))
        sram.append(int(max(0, capacity - k * kept)) if resident.kv_sram_bytes else 0)
        dram.append(int(max(0, board.chips * board.dram_bytes - k * rest - (n - k) * streamed.weight_bytes)))
        if resident.kv_bytes:
            largest = min(largest, (sram[-1] + dram[-1]) * batch // need[-1])
    return GroupCaches(batch, tuple(need), tuple(sram), tuple(dram), int(largest) if largest != math.inf else batch)


def board_setting(arch):
    """What a placement over whole boards of ``arch`` starts from.

    Returns
    -------
    tuple
        ``(chips per board, one board as a system, the system's link graph, the board's link
        graph, the board's ring of chips, the board's resident SRAM share, the torus of boards)``.
    """
    from ..mapping.planner import resident_capacity
    from ..target.allocation import board_name
    from ..target.topology import board_grid, ring_order, topology_of

    cpb = arch.chips_per_board
    board = arch.replace(chips=cpb, name=board_name(arch))  # every allocation of a machine alike
    board_topo = topology_of(board)
    return (cpb, board, topology_of(arch), board_topo, ring_order(board_topo, cpb), resident_capacity(board),
            board_grid(arch.chips // cpb))


def slice_weight_bytes(spec, g: int) -> int:
    """Bytes of the int8 weight-GEMM matrices of the largest of ``g`` boards' slices of a block
    (:func:`slice_block`), from the sizes alone: a lower bound on the slice's constants (its
    scales, biases and norms come on top); 0 where ``g`` does not split the block."""
    H, kv, inter, d, h = spec.heads, spec.kv_heads, spec.intermediate, spec.head_dim, spec.hidden
    if spec.family == "llama":
        if spec.experts or H % g or inter % g or (kv % g and g % kv):
            return 0
        heads, kv, inter = H // g, max(1, kv // g), inter // g
    else:
        shares = slice_shares(spec, g)
        if shares is None:
            return 0
        heads, kv, inter = shares
    mlp = 3 if spec.family == "llama" else 2  # a gated MLP's gate, up and down; else in and out
    return gemm_weight_bytes(h, heads, kv, d, inter, mlp)


def gemm_weight_bytes(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                      mlp_matrices: int) -> int:
    """Bytes of a block's int8 weight-GEMM matrices from its sizes (one byte an element).

    The attention's query, key, value and output projections and the MLP's matrices; the
    scales, biases and norms are not counted.

    Parameters
    ----------
    hidden : int
        The hidden size.
    heads, kv_heads : int
        The query heads and the key-value heads.
    head_dim : int
        The size of a head.
    intermediate : int
        The MLP's inner size.
    mlp_matrices : int
        The MLP matrices of ``hidden x intermediate`` (a gated MLP has three, an ungated two;
        a mixture of experts three per expert counted).

    Returns
    -------
    int
    """
    return (hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
            + mlp_matrices * hidden * intermediate)


def stream_floor(weight_bytes: int, chips: int, dram_bw: float, ahead_s: float) -> float:
    """A lower bound on the seconds a block slice streaming its weights from DRAM adds to a
    token (:func:`_run_s`): its ``weight_bytes`` spread over the board's ``chips`` at best,
    each chip's share read at the chip's DRAM bandwidth ``dram_bw``, less what it may fetch
    ahead during its all-reduces (``ahead_s``: their seconds, :func:`_ahead_gains`)."""
    return max(0.0, weight_bytes / (chips * dram_bw) - ahead_s)


def pipeline_rest(arch, batch: int, seq: int, groups, free, n_groups: int, move, first_boards=None) -> tuple:
    """What a pipeline over the first ``n_groups`` of ``groups`` adds to a token besides its
    blocks, from the placement alone (no mapping).

    The head's board, the hand-overs (each group to the next, then the last group's first
    board to the head's board) and the token's loop back to the chips of ``first_boards``
    with the host's I/O (:func:`tvm_spinn.llm.plan._step_io`).

    Parameters
    ----------
    arch : SpinnArch
        The system.
    batch, seq : int
        The users decoding at once and the context length.
    groups : sequence of sequence of int
        The pipeline's board groups in pipeline order (each a list of board ids).
    free : sequence of int
        The boards no group uses; the head runs on the first, else on the first board of the
        group after the last used.
    n_groups : int
        The groups the pipeline uses (the first ``n_groups`` of ``groups``).
    move : callable
        ``move(src boards, dst boards)``: a hand-over's seconds.
    first_boards : sequence of int, optional
        The boards the token loops back to (default the first group's).

    Returns
    -------
    tuple
        ``(head board, the hand-overs' seconds in pipeline order, the step's I/O figures, the
        loop's seconds: token return, step synchronisation and host I/O)``.
    """
    P = importlib.import_module(".plan", __package__)
    cpb = arch.chips_per_board
    head_board = free[0] if free else groups[n_groups][0]
    moves = [move(groups[j], groups[j + 1]) for j in range(n_groups - 1)]
    moves.append(move(groups[n_groups - 1][:1], [head_board]))
    first = groups[0] if first_boards is None else first_boards
    io = P._step_io(arch, batch, seq, head_board * cpb, [c + b * cpb for b in first for c in range(cpb)])
    return head_board, moves, io, io["token_return_s"] + io["step_sync_s"] + io["host_io_decode_s"]


def records(cfg: dict, spec, arch, target, dtype: str, batch: int, seq: int, handover_bytes: int,
            described: dict, weight_bytes: int, kv_bytes: int, steps, memo: "dict | None" = None,
            refused: "dict | None" = None, reduce: str = "int32", floors: "dict | None" = None) -> dict:
    """The ``board_tp`` candidates as records of :func:`tvm_spinn.llm.plan.plan` (see the module
    docstring); ``handover_bytes``: a hand-over's bytes per user and hidden element;
    ``described``: the whole model's described parts (the head runs as it is); ``memo``: the
    plan's stages already mapped (:func:`tvm_spinn.llm.plan._map_stage`). A candidate whose
    groups' boards do not hold every user's KV cache (:func:`group_caches`) is left out, its
    reason in ``refused``. ``reduce``: the all-reduces' wire type
    (:data:`tvm_spinn.llm.plan.REDUCE_BYTES`: ``int32``, the GEMMs' accumulators, or their
    dequantized sums narrowed to ``fp16`` / ``bf16`` / ``int8`` on the fixed schedule of
    :mod:`tvm_spinn.llm.wire`). ``floors``, where given, receives each
    degree's bound on its token (boards a block -> seconds) for the degrees ranked for mapping."""
    from ..timing.collectives import (board_group_all_reduce, multipath_point_to_point, multipath_sliced_hand_over,
                                      point_to_point, sliced_hand_over)
    from ..timing.system import collective_cost
    P = importlib.import_module(".plan", __package__)
    from ..program.ops.gemm import has_row_tiles
    from .describe import describe
    from .wire import narrow_all_reduce

    from ..target.faults import whole_boards

    whole = whole_boards(arch)  # a group's boards run the same slice: boards with every chip working
    boards = len(whole)
    if dtype != "int8" or boards < 3 or not any(slice_config(cfg, spec, g) is not None or slice_shares(spec, g)
                                                 for g in TP_BOARDS):
        return {}
    reduces_per_block = block_all_reduces(spec)
    reduces_text = "one all-reduce" if reduces_per_block == 1 else "two all-reduces"
    wire = P.REDUCE_BYTES[reduce]  # bytes an element of the partial sums takes on the board links
    sums_text = ("int32 partial sums" if reduce == "int32" else
                 f"{reduce} partial sums (each board's dequantized with the GEMMs' scales, sent straight to "
                 f"each share's owner, added there in fp32 in board order)")
    cpb, board, topo, board_topo, order, budget, torus = board_setting(arch)
    host = P._parts(P._meta_model(cfg, spec), spec, batch, seq)[0][2][1:]
    head_atoms = [a for i, d in enumerate(described["head"]) for a in P._atoms(i, d.program)]
    head_stages = [P._map_stage([P._slice(described["head"][i].program, a, b) for i, a, b in P._merge(head_atoms)],
                                board, {tuple(int(x) for x in a.shape) for a in host}, memo=memo)]
    head_s = sum(st.latency_s for st in head_stages)
    L = spec.layers
    hidden = batch * spec.hidden
    out, best = {}, math.inf

    def handover_s(src_boards, dst_boards, nbytes) -> float:
        """Every board of one group to its counterpart in the next (or all to the head's board),
        each chip its share, at once on the link graph; one board to another also over every
        edge-disjoint path between them (one token in flight: the links are free); a group to
        the next also in slices (the last all-reduce's reduce-scatter on the one group, its
        all-gather on the next), the cheapest."""
        src = np.concatenate([np.arange(cpb) + b * cpb for b in src_boards])
        dst = np.concatenate([np.arange(cpb) + b * cpb for b in dst_boards])
        direct = point_to_point(topo, src, dst, nbytes / cpb).seconds
        if batch == 1 and len(src_boards) == 1 and len(dst_boards) == 1 and src_boards[0] != dst_boards[0]:
            return min(direct, multipath_point_to_point(topo, src_boards[0], dst_boards[0], nbytes).seconds)
        if len(src_boards) == len(dst_boards) > 1 and handover_bytes <= wire:
            # the next group's all-gather is the one the all-reduce (``wire`` bytes an element)
            # ran on this group: a hand-over no wider than that makes it no dearer; one token in
            # flight, each slice also over every edge-disjoint path between its two boards
            sliced = sliced_hand_over(topo, src_boards, dst_boards, nbytes, cpb).seconds
            if batch == 1:
                sliced = min(sliced, multipath_sliced_hand_over(topo, src_boards, dst_boards, nbytes).seconds)
            return min(direct, sliced)
        return direct

    pairs: dict = {}

    def move_s(src_boards, dst_boards) -> float:
        """A user's hidden state handed over between two lists of boards (each pair costed once)."""
        key = (tuple(src_boards), tuple(dst_boards))
        if key not in pairs:
            pairs[key] = handover_s(src_boards, dst_boards, hidden * handover_bytes)
        return pairs[key]

    reduces: dict = {}

    def reduce_of(lay, fused: bool = False) -> float:
        """The partial sums' all-reduce (``wire`` bytes an element) over a layout's first group (every group of a
        layout is a translate of it on the torus of boards), costed once per group: its reduce
        and multicast pipelined, and either no on-board all-gather (the slice's program gathers
        the reduced row itself) or, ``fused``, the on-board all-gather riding on the multicast
        (:func:`fused_gathers`); the first is a bound on the second."""
        key = (tuple(lay[0]), fused)
        if key not in reduces:
            grid = [[int(c) + b * cpb for c in order] for b in lay[0]]
            if reduce == "int32":
                reduces[key] = board_group_all_reduce(topo, grid, hidden * wire, board_gather=fused, pipelined=True,
                                                      fuse_gather=fused).seconds
            else:  # a narrow wire: the fixed schedule, its row delivered to every chip (:mod:`.wire`)
                reduces[key] = narrow_all_reduce(topo, grid, hidden * wire).seconds
        return reduces[key]

    chunk_costs: dict = {}

    def delivered_of(lay, consume_s: float) -> float:
        """The all-reduce of :func:`reduce_of` (its on-board gather fused) with a residual add
        run on its delivery (:func:`fused_adds`, ``consume_s`` a chip's PEs' seconds on it): the
        row's :data:`FUSED_CHUNKS` parts each added as they arrive, played out on the same
        all-reduce's cost of each run of parts
        (:func:`~tvm_spinn.timing.collectives.streamed_all_reduce`)."""
        from ..timing.collectives import streamed_all_reduce

        grid = [[int(c) + b * cpb for c in order] for b in lay[0]]

        def cost_of(nbytes: float) -> float:
            key = (tuple(lay[0]), float(nbytes))
            if key not in chunk_costs:
                chunk_costs[key] = (reduce_of(lay, True) if nbytes == hidden * wire else
                              board_group_all_reduce(topo, grid, nbytes, board_gather=True, pipelined=True,
                                                     fuse_gather=True).seconds if reduce == "int32" else
                              narrow_all_reduce(topo, grid, nbytes).seconds)
            return chunk_costs[key]

        return streamed_all_reduce(cost_of, float(hidden * wire), 0.0, consume_s, FUSED_CHUNKS)

    # each degree's layout: the one whose all-reduce is the cheapest of bands of two rows,
    # patches (the most nearly square only: planning time) and the roundest groups; on a
    # system with faults, groups of whole boards only
    degrees = []
    for g in (g for g in TP_BOARDS if g + 1 <= boards):
        if slice_config(cfg, spec, g) is None and slice_shares(spec, g) is None:
            continue
        layouts = group_layouts(torus, g, whole, compact=True, relays=True)
        if not layouts:
            continue
        groups = min(layouts, key=lambda lay: (reduce_of(lay), -len(lay)))
        free = [b for b in whole if all(b not in grp for grp in groups)]
        if len(groups) - (0 if free else 1) >= 1:  # the head needs a board of its own
            degrees.append((reduces_per_block * L * reduce_of(groups) + head_s, -g, groups, free))
    def floor_of(g: int, groups, free) -> float:
        """A lower bound on the token of every candidate of degree ``g`` (before its slice is
        described or mapped): the all-reduces, the head, and per number of blocks a group runs
        the hand-overs and the token's loop as the candidate costs them, and the blocks a
        group's SRAM cannot keep resident streaming their weights from DRAM (:func:`stream_floor`)."""
        usable = len(groups) - (0 if free else 1)
        least = math.ceil(L / usable)
        w = slice_weight_bytes(spec, g)
        fit = max(1, int(budget // max(1, w)))  # at least the blocks the slice's own bytes let stay
        low = reduce_of(groups)
        per_stream = stream_floor(w, cpb, board.dram_bw_bytes_s, reduces_per_block * max(low, reduce_of(groups, True)))
        out = math.inf
        for n_groups in sorted({math.ceil(L / m) for m in range(least, L + 1)}):
            _, moves, _, loop_s = pipeline_rest(arch, batch, seq, groups, free, n_groups, move_s)
            hand = sum(moves)
            # the fewest blocks streamed with this many groups: the blocks spread as evenly as
            # the candidates' runs allow (every run but the last of the same length)
            streamed = min(sum(max(0, n - fit) for n in [m] * (n_groups - 1) + [L - m * (n_groups - 1)])
                           for m in range(least, L + 1) if math.ceil(L / m) == n_groups)
            out = min(out, reduces_per_block * L * low + head_s + hand + loop_s + streamed * per_stream)
        return out

    # the first MAX_MAPPED degrees in the order of what their all-reduces alone cost a token
    # (on a small torus whose rows close into rings the widest group all-reduces fastest, on a
    # large one a narrow group that leaves room for more groups, every block resident, may be
    # the faster), mapped in the order of their floors (:func:`floor_of`: a bound on each
    # degree's token) while the floor is below the fastest token found: a degree whose floor
    # is not cannot plan a faster token
    ranked = sorted(degrees, key=lambda d: d[:2])[:MAX_MAPPED]
    bounded = [(floor_of(-d[1], d[2], d[3]), d[1], d[2], d[3]) for d in ranked]
    if floors is not None:
        floors.update({-d[1]: d[0] for d in bounded})
    # the reduced row's all-gather over a board's chips, which a piece whose sums sit on some of
    # them waits for (:func:`_spread`): the same board and row for every degree and form
    scatter_s = collective_cost(board_topo, order, "all_gather", hidden * 4, True).seconds
    for floor_s, g, groups, free in sorted(bounded, key=lambda d: d[:2]):
        g = -g
        if floor_s >= best:
            break
        usable = len(groups) - (0 if free else 1)
        steps.set_postfix_str(f"map: blocks tensor-parallel over {g} boards")
        sub, model = slice_block(cfg, spec, g)
        parts = P._parts(model, sub, batch, seq)
        key = ("board_tp_slice", g, batch, seq, dtype)  # described once a plan (every patch of it)
        if memo is None or key not in memo:
            dec = [d.program for d in describe(parts[0][1], parts[0][2], target, dtype)]
            if memo is not None:
                memo[key] = dec
        dec = memo[key] if memo is not None else dec
        host_shapes = {tuple(int(x) for x in a.shape) for a in parts[0][2][1:]}
        block_w = sum(t.nbytes for p in dec for t in p.tensors if t.role == "const")
        # blocks a board keeps resident; the first block on a board always runs as mapped alone
        # (resident as far as the board's SRAM holds it, the rest streamed)
        fit = max(1, int(budget // max(1, block_w)))
        least = math.ceil(L / usable)  # blocks per group with every group used
        # the fewest groups whose SRAM keeps every block resident, and every group used
        # blocks per group: every group used, the fewest groups that keep every block resident,
        # and runs over 1..GROUP_COUNTS groups (fewer hand-overs, more blocks streamed): only
        # arithmetic on the two mapped slices and the hand-overs, no mapping each
        options = sorted({least, max(least, min(L, fit))} | {math.ceil(L / k) for k in range(1, GROUP_COUNTS + 1)
                                                             if math.ceil(L / k) >= least})
        # the slice cut where the boards all-reduce its sums (:func:`slice_pieces`) and the slice
        # as described, both timed: the pieces deliver the reduced row to every chip (no gathers
        # of it) and map the attention on its own, while the slice as one program streams its
        # weights in one run of DRAM reads under its own work; whichever is faster for the
        # groups' blocks is kept (see the module docstring)
        forms = slice_forms(dec, reduces_per_block)
        fit_alone = fit  # blocks kept resident without a prefetch buffer (each form starts from it)
        for pieces, ends, *taken in forms:
            form = "f" if taken else "u" if ends is None and len(forms) > 1 else ""
            fit = fit_alone
            # a slice mapped alone (weights resident as far as they fit) and streaming its weights
            resident = P._map_stage(list(pieces), board, host_shapes, spec.cache_slots(seq), memo=memo,
                                    keep_outputs=True)
            mapped = resident  # as mapped, before the collectives' changes below
            # (streaming also where every block stays resident, for pieces: each resident one at most
            # as long as streaming, :func:`_at_most`)
            streamed = (resident if fit >= max(options) and ends is None else
                        P._map_stage(list(pieces), board, host_shapes, spec.cache_slots(seq), weights="stream", memo=memo,
                                     keep_outputs=True))
            streams = streamed is not resident
            # cut into pieces, the all-reduces take the sums spread over each board's chips and
            # deliver the whole row to every chip (the pieces ending at one without their gathers
            # of it); uncut, they end in the projection's layout and the slice gathers the row itself
            fused = ends is not None
            # a piece on fewer chips than the next hands its outputs on to them
            handoffs = handoff_gathers(pieces, lambda n: collective_cost(board_topo, order, "all_gather", n, True).seconds) \
                if fused else None
            if fused:
                resident, streamed = (_handed_on(_spread(_less(st, fused_gathers(st, ends, hidden * 4)), ends, cpb, scatter_s),
                                                 ends, handoffs)
                                      for st in (resident, streamed))
            resident = _at_most(resident, streamed)
            reduce_s = reduce_of(groups, fused)  # the partial sums, ``reduce`` on the wire
            shed = None
            if taken:  # each with the residual add after it on its delivery
                consume = max(fused_add_s(p, layer, board) for p, layer in taken[0])
                reduce_s = delivered_of(groups, consume)
                # and the rms_norm after the add: its sums of squares and their chain too, where
                # the pieces shed more than the all-reduces' deliveries then take longer
                norms = norms_on_delivery(pieces, ends, [layer for _, layer in taken[0]], mapped, board)
                if norms is not None:
                    with_norms = delivered_of(groups, max(consume, norms[1]))
                    if reduces_per_block * (with_norms - reduce_s) < sum(norms[0]):
                        shed, reduce_s = ([layer for _, layer in taken[0]], mapped), with_norms
            # the streamed blocks' weights fetched partly while the DRAM channels are idle: a buffer
            # per chip out of the SRAM the resident blocks would take (one fewer may stay resident)
            on_chip = _on_chip(resident, pieces, ends, hidden * 4, cpb, scatter_s if fused else 0.0,
                               lambda piece: P._map_stage([piece], board, host_shapes, spec.cache_slots(seq), memo=memo,
                                                          keep_outputs=True), streamed, handoffs)
            resident, streamed, on_chip = (_shed(st, shed, pieces, ends, board) for st in (resident, streamed, on_chip))
            # (the buffer leaves a board's resident share the SRAM the first block holds as mapped
            # alone: that block stays, whatever the buffer)
            gains, buffer = _ahead_gains(on_chip, streamed, reduce_s, board.dram_bw_bytes_s, reduces_per_block, ends,
                                         max(0.0, budget - resident.resident_bytes) / cpb)
            saved = float(sum(gains))
            unburnt = _unburnt_j(streamed, gains, board)
            fit_ahead = max(1, int((budget - buffer * cpb) // max(1, block_w)))
            variants = _block_variants(resident, streamed, fit, fit_ahead, saved, buffer, unburnt)
            # each way the block may run, with the slice's tiling it runs with: the mapper's (each
            # piece's tiles and shard plan the fastest alone) and, where the slice has fp32 GEMMs
            # the mapper may cut into register-block row tiles, the streamed block with MAC-high
            # row tiles (``"r"``): a piece's shard plan that is faster alone may read more of its
            # streamed bytes on each chip, leaving the DRAM channels less idle time to fetch the
            # next pieces' weights ahead; the candidates' records rank the two in context
            tilings = [(variants, resident, streamed, on_chip, "")]
            # (the streamed block holds no weights in SRAM: the register-block row tiles it may
            # take are those of GEMMs below the MAC array's rows, no bands)
            if streams and any(has_row_tiles(p, board) for p in pieces):
                tilings += _mac_high(P, mapped, pieces, ends, board, host_shapes, spec.cache_slots(seq), memo, fit_alone,
                                     block_w, budget, cpb, hidden, scatter_s, handoffs, reduce_s, reduces_per_block, shed)
            for per_group, (fit, saved_s, buffer_b, unburnt_j, tag), resident, streamed, on_chip, tiling in (
                    (n, v, *t[1:]) for t in tilings for n in options for v in t[0]):
                n_groups = math.ceil(L / per_group)
                sizes = [per_group] * (n_groups - 1) + [L - per_group * (n_groups - 1)]
                # every user's cache of a group's blocks on each of its boards
                caches = group_caches(resident, streamed, sizes, fit, batch, board, budget - buffer_b * cpb)
                if not caches.fits:
                    if refused is not None:
                        refused[f"board_tp:g{g}m{per_group}{tag}{form}{tiling}"] = caches.message(arch.name, groups, g)
                    continue
                blocks_s = sum(_run_s(resident, streamed, n, fit, saved_s) for n in sizes)
                ahead_s = sum(max(0, n - fit) for n in sizes) * saved_s
                reduces_s = reduces_per_block * L * reduce_s
                # the hand-overs; the token from the head's board back to the first group's boards, the host's I/O
                head_board, hand, io, loop_s = pipeline_rest(arch, batch, seq, groups, free, n_groups, move_s)
                decode_s = blocks_s + reduces_s + sum(hand) + head_s + loop_s
                used = (g * n_groups + 1) * cpb
                kept = sum(min(n, fit) for n in sizes) * g * (resident.resident_bytes - resident.kv_sram_bytes)
                head_kept = sum(min(st.resident_bytes, st.weight_bytes) for st in head_stages)
                kept = min(weight_bytes, int(kept) + head_kept)
                kv_share = resident.kv_sram_bytes / resident.kv_bytes if resident.kv_bytes else 0.0
                # the plan's own bound (a diagnostic): each mapped program's largest bound, per block
                # as mapped (resident or streaming), the board collectives on the links; the DRAM
                # reads fetched ahead run under the all-reduces and the other pieces' work: counted once
                bounds = {k: sum(min(n, fit) * resident.bounds[k] + max(0, n - fit) * streamed.bounds[k] for n in sizes)
                          + sum(st.bounds[k] for st in head_stages) for k in resident.bounds}
                bounds["dram"] = max(0.0, bounds["dram"] - ahead_s)
                bounds["links"] += reduces_s + sum(hand) + loop_s
                out[f"board_tp:g{g}m{per_group}{tag}{form}{tiling}"] = dict(
                    decode_s=decode_s, period_s=decode_s, used=used, resident=kept,
                    streamed=max(0, weight_bytes - kept), kv_sram=kv_bytes * kv_share,
                    energy_j=(g * sum(min(n, fit) * resident.energy_j + max(0, n - fit) * (streamed.energy_j - unburnt_j)
                                      for n in sizes)
                              + sum(st.energy_j for st in head_stages)) / batch,
                    sram_pe=max([resident.peak_pe_bytes, streamed.peak_pe_bytes] + [st.peak_pe_bytes for st in head_stages]),
                    dram_chip=int(math.ceil(max(0, per_group - fit) * streamed.streamed_bytes_per_chip)),
                    bounds=bounds, bound_s=sum(bounds.values()), binding=max(bounds, key=bounds.get),
                    description=(f"each block tensor-parallel over a group of {g} boards ({g * cpb} chips: heads and "
                                 f"MLP columns split across the boards, {reduces_text} of {sums_text} a block "
                                 f"on the board links), {n_groups} group(s) of {per_group} block(s) pipelined, the "
                                 f"hidden state handed over group to group in slices, the head on one board"
                                 + (f"; the streamed blocks' weights fetched {buffer_b / 1e6:.2f} MB a chip ahead "
                                    f"during the all-reduces" if tag else "")
                                 + ("; every block streamed (faster than kept resident)" if tag == "s" else "")
                                 + ("; each slice run as one program (the faster than cut at its all-reduces)"
                                    if form == "u" else "")
                                 + ("; the residual adds run on the all-reduces' delivery" if form == "f" else "")
                                 + ("; the streamed blocks' fp32 GEMMs in MAC-high row tiles (faster with their "
                                    "weights fetched ahead)" if tiling else "")),
                    meta={"stages": n_groups + 1, "boards_per_stage": g, "blocks_per_stage": per_group,
                          "boards_used": g * n_groups + 1, "tp_boards": g, "groups": n_groups,
                          **({"boards": sorted({b for grp in groups[:n_groups] for b in grp} | {head_board})}
                             if arch.has_faults else {}),
                          "chips_per_group": g * cpb, "micro_batch": batch, "micro_batches": 1,
                          "mapping_weights": "auto", "block_decode_s": blocks_s / L,
                          # the streamed blocks mapped with MAC-high row tiles (:func:`_mac_high`)
                          **({"mapping_row_tiles": False} if tiling == "r" else {}),
                          "board_all_reduce_s": reduce_s, "board_all_reduces_decode_s": reduces_s,
                          **({"board_all_reduce_wire": reduce} if reduce != "int32" else {}),
                          "board_gather_fused": fused, "board_add_fused": bool(taken),
                          # (the streamed blocks' pieces fetched ahead run as on chip)
                          "slice_collectives_s": slice_collectives((on_chip if tag else streamed)
                                                                   if per_group > fit else resident,
                                                                   hidden * 4 if fused else None),
                          "prefetch_bytes_per_chip": buffer_b, "prefetch_saved_decode_s": ahead_s,
                          "handoff_decode_s": sum(hand), "head_decode_s": head_s, **io,
                          **({"largest_batch": caches.largest_batch} if batch > 1 else {}),
                          "replicas": boards // (g * n_groups + 1)})
        # the best number of groups of this degree is kept
        mine = [k for k in out if k.startswith(f"board_tp:g{g}m")]
        steps.update()
        if not mine:
            continue
        keep = min(mine, key=lambda k: (out[k]["period_s"], out[k]["used"], k))
        for k in mine:
            if k != keep:
                del out[k]
        best = min(best, out[keep]["period_s"])
    return out
