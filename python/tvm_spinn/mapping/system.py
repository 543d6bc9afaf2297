"""Mapping a program onto a multi-chip system: shard plan, stage, capacity, timing by symmetry.

For a system of more than one chip the driver (:func:`map_on_system`):

1. lists candidate shard plans ``(tp, dp)`` (:mod:`.shard`: tensor parallelism with the
   Megatron split inside a board, ``tp <= chips_per_board``, where the 6 Gbit/s links are;
   data parallelism over the batch), scores each by a cheap bound (work and weight stream per
   chip, collectives on the link graph) and maps the best few *on one chip* with the one-chip
   compiler (tiles, placement, memory plan, PE-level timing of the shard): the chips of the
   group run the same shard, so nothing is simulated twice;
2. composes the system timing (:func:`tvm_spinn.timing.system.compose`: weight prefetch,
   collectives, bounds) and keeps the fastest plan (ties: fewer chips);
3. takes the *state* of what the earlier programs of one build put on each chip (a
   :class:`~.budget.SystemState`, threaded by :func:`.planner.plan_system`): SRAM held by resident weights (a later program's weights are resident only
   in what is left: the aggregate SRAM decides, not each program alone) and DRAM holding the
   streamed weight shards and the state (a KV cache) not kept in SRAM, each chip's share under
   its shard plan (:func:`dram_per_chip`), checked against ``arch.dram_bytes``;
4. *pipeline parallelism across boards*: when the current stage (board) cannot hold a
   program's weight shard in its chips' DRAM, the program opens the next stage (the next
   board; the activations are handed over point to point); consecutive programs thus form
   pipeline stages. Boards beyond the stages used hold replicas of the model (data
   parallelism over a stream of inputs: the report's throughput). Opening a stage only to keep
   weights resident in a fresh board's SRAM is not done (left for later).

5. *pipeline stages within a region*: a region that no shard plan of one stage holds is cut
   into the fewest contiguous stages whose programs, each mapped alone on its own whole board,
   fit (:mod:`.stages`: the boards it takes, the cut, each stage's mapping and the pipeline's
   timing; when it opens a board after the build's earlier regions, the hand-in of its inputs
   that are not state). The build's next region continues on its last stage's board, after
   what that stage holds there (the next board when it does not fit).

6. *streams*: a region with state (a KV cache) keeps a copy of it per stream in flight, the
   build's count (:func:`.state.build_flight`, passed in as ``streams`` by the system planner): the
   copies beyond the first in its chips' DRAM, and every input exchanges the copy its memory
   plan keeps in SRAM (:func:`.state.state_copies`, recorded in ``SystemMapping.streams``).

A model that does not fit (no stage left whose DRAM holds the shard) raises
:class:`MappingError` naming the bytes needed, the bytes available and the smallest system
(``make_system(boards=N)``) that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import tvm_ffi

from ..program import Program
from ..program.records import PlanCandidate, SystemMapping, SystemTimingSummary, TimingSummary
from ..program.ops import family_of
from ..target.arch import SpinnArch
from ..target.faults import live_chips, usable_boards
from ..target.topology import ring_order, topology_of
from ..timing.collectives import chain_all_reduce_gathered, chains_all_reduce, point_to_point
from ..timing.model import DRAM, evaluate, transfers
from ..timing.system import chain_fed_chain, chain_led_all_reduce, collective_cost, compose
from .budget import Shortfall, SystemState
from .memory import LEDGER_RESIDENT_SHARE, activation_label, weight_bytes_per_pe
from .shard import ROW_ALWAYS, ShardPlan, plan_shards, recorded_plan, rule_of, shard_program
from .stages import hand_in_cost, handed_in, map_pipeline, pipeline_boards, shortfall, stage_ranks, stages_of
from .state import data_bytes, resident_state, state_copies, state_per_chip, streamed_timing
from .tiling import MappingError, program_work

__all__ = ["map_on_system", "dram_per_chip", "TP_DEGREES", "SP_DEGREES", "overflow_message", "system_tables", "retime", "issued",
           "group_order", "group_ranks", "stage_chips"]

# A model too large for its system is raised at the end of the codegen callback: it crosses
# the FFI boundary as itself, not as a generic RuntimeError.
tvm_ffi.register_error("MappingError", MappingError)

#: Tensor-parallel degrees tried (divisors-friendly sizes up to a board).
TP_DEGREES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 48)
#: Sequence-parallel degrees tried (row blocks per tensor-parallel group, ``tp x sp`` chips).
SP_DEGREES = (2, 3, 4, 6, 8, 12, 16, 24, 48)
#: Candidate plans mapped with the PE-level model after the bound-based pre-selection.
FULL_CANDIDATES = 3
#: Assumption: an all-gathered activation stays in SRAM when it takes at most this share of a
#: chip's SRAM (the rest holds resident weights, the prefetch buffer and tile buffers).
GATHERED_SRAM_SHARE = 1 / 8


@dataclass
class _Ledger:
    """The working copy of a :class:`~.budget.SystemState` while one program is placed."""

    pes: int
    stage: int = 0
    sram: np.ndarray = None
    dram: int = 0
    weights: int = 0
    min_chip_bytes: int = 0
    overflow: str | None = None
    shortfall: Shortfall | None = None
    state: int = 0
    cache: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.sram is None:
            self.sram = np.zeros(self.pes, dtype=np.int64)

    @classmethod
    def of(cls, state: SystemState, pes: int, cache: dict) -> "_Ledger":
        sram = np.zeros(pes, dtype=np.int64)
        sram[:len(state.sram)] = state.sram
        return cls(pes=pes, stage=state.stage, sram=sram, dram=state.dram, weights=state.weights,
                   min_chip_bytes=state.min_chip_bytes, overflow=state.overflow, shortfall=state.shortfall,
                   state=state.state, cache=cache)

    def fresh(self) -> "_Ledger":
        return _Ledger(pes=self.pes)

    def frozen(self) -> SystemState:
        return SystemState(stage=self.stage, sram=tuple(int(v) for v in self.sram), dram=int(self.dram),
                           weights=int(self.weights), min_chip_bytes=int(self.min_chip_bytes), overflow=self.overflow,
                           shortfall=self.shortfall, state=int(self.state))


def stage_chips(arch: SpinnArch) -> int:
    """Chips of a stage a shard plan may use: a board's (its live ones on a system with faults:
    the first usable board's, which :func:`~tvm_spinn.target.topology.ring_order` groups)."""
    if arch.has_faults:
        return int(live_chips(arch, usable_boards(arch)[0]).size)
    return min(arch.chips, arch.chips_per_board)


def _chip_arch(arch: SpinnArch) -> SpinnArch:
    return arch.replace(chips=1)


def group_ranks(topo, plan: ShardPlan) -> dict[str, np.ndarray]:
    """The chips of each collective group of ``plan``: ``"tp"`` (a tensor-parallel group), for
    ``dp > 1`` ``"dp"`` (the chips holding the other batch shares of the same shard) and, for
    ``sp > 1``, ``"sp"`` (the chips holding the other row blocks of the same shard).

    With ``sp > 1`` the ``tp x sp`` chips follow :func:`group_order` with the tensor-parallel
    index inner: a tp group is ``tp`` consecutive chips of it (a compact patch its chain
    all-reduce goes through one hop at a time, the groups disjoint), an sp group every
    ``tp``-th chip, ``"all"`` the whole order. ``"tp"`` is the first tp group; the
    plan's collectives are costed on every one of them and the slowest charged (contention
    between groups is not modelled, as between replicas).
    """
    if plan.sp <= 1:
        groups = {"tp": ring_order(topo, plan.tp)}
        if plan.dp > 1:  # the chips holding the other batch shares of the same shard
            groups["dp"] = ring_order(topo, plan.tp * plan.dp)[::plan.tp][:plan.dp]
        return groups
    order = group_order(topo, plan.tp, plan.sp)
    return {"tp": order[:plan.tp], "sp": order[::plan.tp][:plan.sp], "all": order}


def group_order(topo, tp: int, sp: int) -> np.ndarray:
    """The ``tp * sp`` chips of :func:`ring_order`'s cycle laid out as ``sp`` tensor-parallel
    groups of ``tp`` consecutive entries, each a one-hop path through its chips (memoized on
    the topology).

    A group's chain all-reduce runs down its path and its last rank multicasts the sum back to
    every rank; a value reduced before the chain goes to the first rank, and the next chain
    over the same ranks starts there. So each group is a compact patch of the chips (a
    balanced assignment of the chips to ``sp`` centres, by squared hops, the centres moved to
    their patches' middles until they stay) run through on the path whose ends are nearest
    all its ranks and each other (fewest hops of ``first -> farthest rank``, ``last ->
    farthest rank`` and ``last -> first``); the cycle's segments are kept where their worst
    group counts no more. Which chip holds which rank is a placement choice: every rank runs
    the same program on its own block.
    """
    tp, sp = int(tp), int(sp)
    key = ("group_order", tp, sp)
    hit = topo.memo.get(key)
    if hit is not None:
        return hit
    order = ring = ring_order(topo, tp * sp)
    if 2 < tp <= _PATH_SEARCH_MAX:
        count = len(ring)
        adj = {int(c): {int(x) for x in topo.neighbors[c] if x >= 0} for c in ring}
        pos = {int(c): i for i, c in enumerate(ring)}
        hops = topo.hops(np.repeat(ring, count), np.tile(ring, count)).reshape(count, count)
        best = None
        for groups in ([ring[j * tp:(j + 1) * tp] for j in range(sp)], _patches(hops, ring, tp, sp)):
            laid = [_best_path(adj, [int(c) for c in g], pos, hops) for g in groups]
            rank = (max(score for _, score in laid), sum(score[0] for _, score in laid))
            if best is None or rank < best[0]:
                best = (rank, np.asarray(sum((path for path, _ in laid), []), dtype=np.int64))
        order = best[1]
    order.flags.writeable = False
    topo.memo[key] = order
    return order


def _patches(hops: np.ndarray, ring: np.ndarray, tp: int, sp: int) -> list:
    """:func:`group_order`'s compact patches: ``sp`` lists of ``tp`` chips of ``ring``
    (``hops`` between its entries)."""
    from scipy.optimize import linear_sum_assignment

    def middle(at):  # the chip nearest its farthest member (then nearest them all)
        return int(np.argmin(hops[:, at].max(axis=1) * hops.size + hops[:, at].sum(axis=1)))

    centres = [middle(np.arange(j * tp, (j + 1) * tp)) for j in range(sp)]
    for _ in range(16):
        rows, slots = linear_sum_assignment(np.repeat(hops[:, centres] ** 2, tp, axis=1))
        members = [np.sort(rows[slots // tp == j]) for j in range(sp)]
        moved = [middle(at) for at in members]
        if moved == centres:
            break
        centres = moved
    return [ring[at] for at in members]


_PATH_SEARCH_MAX = 16  # chips a group beyond which its path is the cycle's segment (the search is exponential)


def _best_path(adj: dict, chips: list, pos: dict, hops: np.ndarray) -> tuple:
    """:func:`group_order`'s path through ``chips`` (one hop a step) and its score; the
    cycle's segment ``chips`` itself where no better path is found."""
    at = [pos[c] for c in chips]
    far = hops[:, at].max(axis=1)  # each chip's farthest rank of the group

    def score(a, b):
        return int(far[pos[a]] + far[pos[b]] + hops[pos[b], pos[a]]), int(far[pos[b]])

    own = score(chips[0], chips[-1])
    ends = sorted(score(a, b) + (a, b) for a in chips for b in chips if a != b)
    members = set(chips)
    for total, depth, a, b in ends:
        if (total, depth) >= own:
            break
        path = _hamiltonian(adj, members, a, b)
        if path is not None:
            return path, (total, depth)
    return chips, own


def _hamiltonian(adj: dict, members: set, first: int, last: int, budget: int = 20000) -> "list | None":
    """A path of one-hop steps from ``first`` to ``last`` through every chip of ``members``
    (depth-first, neighbours in id order, at most ``budget`` steps tried), else None."""
    path, seen, tries = [first], {first}, [0]

    def extend(chip) -> bool:
        if len(path) == len(members):
            return chip == last
        for nxt in sorted(adj[chip] & members):
            if nxt in seen or (nxt == last and len(path) < len(members) - 1):
                continue
            tries[0] += 1
            if tries[0] > budget:
                return False
            seen.add(nxt)
            path.append(nxt)
            if extend(nxt):
                return True
            seen.discard(nxt)
            path.pop()
        return False

    return list(path) if extend(first) else None


def _comm(topo, program: Program, plan: ShardPlan, tables=None) -> list[tuple]:
    """``(layer, CollectiveCost, ready)`` of the plan's collectives as issued (:func:`issued`),
    on their groups. ``tables``: the mapped shard's tiles, from which a chain's relaying PEs
    are read (:func:`_relay_pes`); None before the shard is mapped (a plan's estimate), when
    the links pace every chain's segments."""
    if not plan.collectives:
        return []
    groups = group_ranks(topo, plan)
    rows = issued(program, plan.collectives)
    pes = _relay_pes(program, plan, rows, tables)
    fused = _gathered_chain(program, plan, rows)
    if fused is not None:
        # the chains' multicasts reach every chip in more steps, on busier links: the cheaper way,
        # both ways costed alike (the sp chains loading the links at once, as the fused one does)
        (layer, op, nbytes, exact, group, _), gather = rows[fused[0]], rows[fused[1]]
        apart = (_chains_cost(topo, plan, nbytes, gathered=False, relay_pes=pes[fused[0]]).seconds
                 + collective_cost(topo, groups[gather[4]], gather[1], gather[2], gather[3]).seconds)
        if _chains_cost(topo, plan, nbytes, gathered=True, relay_pes=pes[fused[0]]).seconds >= apart:
            fused = None
    if plan.sp <= 1:
        return _group_comm(topo, plan, groups, rows, fused, pes)
    # the sp tp groups run at once over their own segments of the cycle, which differ in shape:
    # each is costed and the slowest one's collectives are charged (the block waits on it)
    order = groups["all"]
    tried = [_group_comm(topo, plan, {**groups, "tp": order[j * plan.tp:(j + 1) * plan.tp]}, rows, fused, pes)
             for j in range(plan.sp)]
    return max(tried, key=lambda out: sum(cost.seconds for _, cost, _ in out))


def output_pes(table) -> "int | None":
    """PEs that hold a layer's finished outputs on a chip (its tiles ``table``): one per distinct
    output region, the PE of its first tile (the region's ``k`` tiles summed there); None for a
    layer without placed tiles."""
    if table is None or not len(table) or (np.asarray(table.pe) < 0).any():
        return None
    regions = np.concatenate([np.asarray(table.lo, dtype=np.int64), np.asarray(table.hi, dtype=np.int64)], axis=1)
    _, first = np.unique(regions, axis=0, return_index=True)
    return int(np.unique(np.asarray(table.pe, dtype=np.int64)[first]).size)


def _relay_pes(program: Program, plan: ShardPlan, rows, tables) -> list:
    """Per row of :func:`issued`'s ``rows``: for a chain (a floating-point all-reduce), the PEs
    of a chip that hold its partial sums, those the layer writing its tensor writes its output
    from (:func:`output_pes`), at most one a word of the chain's bytes (a word is on one PE);
    None for any other row, and for every row without ``tables``."""
    from ..timing.collectives.chips import PACKET_PAYLOAD_BYTES

    out = [None] * len(rows)
    if tables is None:
        return out
    producer = {layer.output: i for i, layer in enumerate(program.layers)}
    sums = iter([c for c in plan.collectives if c.op == "all_reduce" and not c.exact])
    for k, (_, op, nbytes, exact, _, _) in enumerate(rows):
        if op == "all_reduce" and not exact:  # issued() keeps the all-reduces one to one, in order
            i = producer.get(next(sums).tensor)
            pes = None if i is None or i >= len(tables) else output_pes(tables[i])
            out[k] = None if pes is None else min(pes, max(1, -(-int(nbytes) // PACKET_PAYLOAD_BYTES)))
    return out


def _group_comm(topo, plan: ShardPlan, groups: dict, rows, fused, pes) -> list[tuple]:
    """:func:`_comm`'s collectives with ``groups["tp"]`` the tensor-parallel group costed
    (``pes``: each row's relaying PEs, :func:`_relay_pes`)."""
    out = []
    chains = []  # per entry of ``out``: whether it is a chain over the tp group's ranks in order
    for k, (layer, op, nbytes, exact, group, ready) in enumerate(rows):
        if fused is not None and k == fused[1]:
            continue  # delivered by the chains' multicasts
        chains.append(op == "all_reduce" and not exact and group == "tp")
        if fused is not None and k == fused[0]:
            out.append((layer, _chains_cost(topo, plan, nbytes, gathered=True, relay_pes=pes[k]), None))
        elif len(groups[group]) > 1:
            after = rows[k + 1] if k + 1 < len(rows) else None
            if (op == "all_reduce" and exact and ready is None and after is not None and after[:2] == (layer, op)
                    and not after[3] and after[4] == group and after[5] is None
                    and (fused is None or k + 1 not in fused)):
                # an exact all-reduce the chain after it over the same chips waits for (a split
                # row's maximum before its sum): reduced to the chain's first chip, which starts
                # it while the result's multicast to the others runs under the chain
                chain = collective_cost(topo, groups[group], op, after[2], False, pes[k + 1])
                out.append((layer, chain_led_all_reduce(topo, groups[group], nbytes, chain), ready))
            else:
                out.append((layer, collective_cost(topo, groups[group], op, nbytes, exact, pes[k]), ready))
        else:
            chains.pop()  # a group of one: no collective
    # a chain whose result the ranks use only in their own work before the next chain over the
    # same ranks (a split row's sum before its context's chain): its multicast runs under that
    # chain (the fused chains' first group is the tp group's ranks, :func:`_chains_cost`)
    for k in range(len(out) - 1):
        (layer, cost, ready), nxt = out[k], out[k + 1]
        if chains[k] and chains[k + 1] and ready is None and nxt[2] is None and cost.algorithm == "chain" \
                and nxt[1].algorithm == "chain":
            out[k] = (layer, chain_fed_chain(topo, groups["tp"], cost, nxt[1]), ready)
    return out


def _gathered_chain(program: Program, plan: ShardPlan, rows) -> "tuple[int, int] | None":
    """``(chain row, gather row)`` of :func:`issued`'s ``rows`` where the program's output is
    chain all-reduced in each tensor-parallel group and then all-gathered over all the chips
    (the ``sp`` groups' blocks, e.g. the attention's context: one block of heads per row
    block), else None. The chains' last ranks can then multicast their finished sums to every
    chip of all the groups (:func:`~tvm_spinn.timing.collectives.chain_all_reduce_gathered`):
    what the gather would deliver, without the gather; :func:`_comm` times that where it is the
    cheaper (the deeper trees add steps to every chain and share links)."""
    if plan.sp <= 1 or plan.dp > 1:
        return None
    n = len(program.layers)
    chains = [c for c in plan.collectives if c.layer == n and c.op == "all_reduce" and not c.exact]
    if len(chains) != 1 or getattr(chains[0], "group", "tp") != "tp":
        return None
    chain = chains[0]
    gathers = [c for c in plan.collectives if c.layer == n and c.op == "all_gather" and c.tensor == chain.tensor
               and getattr(c, "group", "tp") == "all"]
    # the gather moves exactly the chains' results: one block of the chain's bytes per group
    if len(gathers) != 1 or gathers[0].nbytes != plan.sp * chain.nbytes:
        return None
    at_chain = [k for k, r in enumerate(rows) if r[:5] == (n, "all_reduce", chain.nbytes, False, "tp")]
    at_gather = [k for k, r in enumerate(rows) if r[:5] == (n, "all_gather", gathers[0].nbytes, True, "all")]
    if len(at_chain) != 1 or len(at_gather) != 1:
        return None
    return at_chain[0], at_gather[0]


def _chains_cost(topo, plan: ShardPlan, nbytes: int, gathered: bool, relay_pes: "int | None" = None):
    """The ``sp`` chains of ``tp`` consecutive chips of :func:`group_ranks`'s cycle at once,
    memoized on the topology like :func:`~tvm_spinn.timing.system.collective_cost`:
    ``gathered``, :func:`_gathered_chain`'s fused collective, each chain delivering ``nbytes`` to
    all of them (:func:`~tvm_spinn.timing.collectives.chain_all_reduce_gathered`); else each
    delivering to its own chips only (:func:`~tvm_spinn.timing.collectives.chains_all_reduce`),
    the chain side of :func:`_comm`'s choice, costed as the fused side is; ``relay_pes``: the
    PEs of a chip that hold a segment's partial sums (:func:`_relay_pes`)."""
    order = group_ranks(topo, plan)["all"]
    chains = [order[j * plan.tp:(j + 1) * plan.tp] for j in range(plan.sp)]
    key = ("chain_gathered" if gathered else "chains_apart", order.tobytes(), int(plan.tp), float(nbytes), relay_pes)
    hit = topo.memo.get(key)
    if hit is None:
        cost = chain_all_reduce_gathered if gathered else chains_all_reduce
        hit = topo.memo[key] = cost(topo, chains, nbytes, relay_pes=relay_pes)
    return hit


def _plans(program: Program, chips: int):
    """The shard plans tried on a stage of ``chips`` chips."""
    for tp in TP_DEGREES:
        if tp > chips:
            break
        for dp in range(1, chips // tp + 1):
            if chips // tp % dp and dp != chips // tp:
                continue
            with_row = plan_shards(program, tp, dp, True)
            if with_row is None:
                continue  # dp does not divide the batch (with or without row-parallel GEMMs)
            # without row-parallel GEMMs: another plan only where the first has one
            plans = (with_row, plan_shards(program, tp, dp, False)) if tp > 1 and "row" in with_row.splits \
                else (with_row,)
            for plan in plans:
                if tp == 1 or any(x in ("col", "row", "split") for x in plan.splits):
                    yield plan  # else nothing splits tp ways
        # sequence parallelism: sp row blocks per tp group (dp = 1, row-parallel GEMMs)
        for sp in SP_DEGREES:
            if tp * sp > chips:
                break
            if chips % (tp * sp):
                continue
            plan = plan_shards(program, tp, 1, True, sp)
            if plan is not None and (tp == 1 or any(x in ("col", "row", "split") for x in plan.splits)):
                yield plan


def _candidates(program: Program, arch: SpinnArch, topo, per_chip: bool, work) -> list[tuple[float, ShardPlan]]:
    """Shard plans with a cheap latency estimate each, best first (``per_chip``: by estimate x
    chips, the throughput objective's chip-seconds per inference). ``work``: seconds of each
    layer on one chip (the one-chip plan's PE-level times); a split layer takes ``1 / tp`` of it
    (``1 / (tp sp)`` when its rows are split too), a replicated one all of it."""
    chips = stage_chips(arch)
    state = resident_state(program, range(len(program.layers)))
    out = []
    for plan in _plans(program, chips):
        tp, dp, sp = plan.tp, plan.dp, plan.sp
        comm = sum(cost.seconds for _, cost, _ in _comm(topo, program, plan))
        # the weights and the state (a KV cache) a chip reads: both stream from DRAM (_system_timing)
        shard_w = sum(int(np.prod(s, dtype=np.int64)) * program.tensors[i].nbytes // max(1, int(np.prod(program.tensors[i].shape, dtype=np.int64)))
                      for i, s in enumerate(plan.shapes) if program.tensors[i].role == "const" or i in state)
        # replicated layers do all their work on every chip of the group
        seq = plan.seq or (False,) * len(plan.splits)
        work_s = sum(w / (tp if x in ("col", "row", "split") else 1) / (sp if q else 1)
                     for w, x, q in zip(work, plan.splits, seq)) / dp
        bound = max(work_s, shard_w / arch.dram_bw_bytes_s) + comm
        out.append((bound, plan, shard_w))
    out.sort(key=lambda c: (c[0] * (c[1].chips if per_chip else 1), c[1].chips))
    return out


def issued(program: Program, collectives) -> list[tuple[int, str, int, bool, str, int | None]]:
    """The plan's collectives as the chips issue them, ``(layer, op, bytes, exact, group,
    ready)``: all-gathers over the same group that follow one another in the plan, each of a
    tensor already produced when the first of them is due, go out together as one all-gather of
    their summed bytes (GPT-2's Q, K and V, sliced from one column-parallel GEMM and gathered for
    the attention: one collective's hop latencies instead of three); a tensor that relabels
    bytes written before it (a reshape or a unit-axis permute of a slice, as Llama's key is
    before its rotary embedding: :meth:`~tvm_spinn.program.ops.base.OpFamily.aliases_input`)
    counts as produced when they are. The gathers of the
    program's outputs (``layer == len(layers)``) are not merged: each is issued once its bytes
    are written (``ready``: the index of the layer that writes them, -1 for an input passed
    through; an output that is a reshape, a same-size ``broadcast_to`` or a unit-axis
    ``permute_dims`` of an earlier tensor holds that tensor's bytes) and runs on the links while
    the later layers compute (:func:`tvm_spinn.timing.system.compose`); ``ready`` is None for the others."""
    n = len(program.layers)
    producer = {layer.output: i for i, layer in enumerate(program.layers)}

    def written(tid):
        i = producer.get(tid, -1)
        while i >= 0:
            layer = program.layers[i]
            if not family_of(layer.kind).aliases_input(program, layer):
                break
            i = producer.get(next(x for x in layer.inputs if program.tensors[x].role != "const"), -1)
        return i

    out: list[list] = []
    for c in collectives:
        last = out[-1] if out else None
        group = getattr(c, "group", "tp")
        if c.layer >= n and c.op == "all_gather":
            out.append([c.layer, c.op, c.nbytes, c.exact, group, written(c.tensor)])
            continue
        if (last is not None and c.op == "all_gather" and last[1] == "all_gather" and last[4] == group
                and last[5] is None and written(c.tensor) < last[0]):
            last[2] += c.nbytes
            continue
        out.append([c.layer, c.op, c.nbytes, c.exact, group, None])
    return [tuple(x) for x in out]


def _time_plan(program: Program, plan: ShardPlan, arch: SpinnArch, topo, map_one, reserved: np.ndarray,
               onchip: tuple = (), streams: int = 1):
    """Map ``plan``'s shard on one chip and compose its system timing; ``streams``: the streams
    its state is kept for (:func:`.state.state_copies`)."""
    chip = _chip_arch(arch)
    shard, resident = map_one(shard_program(program, plan), chip, reserved)
    st, exec_cycles = _system_timing(program, plan, shard, shard.tiles.tables, chip, topo, onchip)
    need, exchange = state_copies(shard, streams, arch)
    return _TimedPlan(shard, st, sum(dram_per_chip(shard)) + need, tuple(exec_cycles), resident, exchange)


def dram_per_chip(shard: Program) -> tuple[int, int]:
    """``(weight bytes, state bytes)`` a chip's DRAM holds of a shard mapped on one chip (the
    :func:`~.shard.shard_program` of a plan: its tensors have the chip's local shapes).

    The weights: the shard's constants less what its memory plan keeps resident of them. The
    state (:func:`.state.resident_state`: the inputs kept between calls, such as a KV cache): every
    state tensor whose readers are not all resident streams from DRAM each call, so its copy
    lives there (:func:`.state.state_per_chip`). A resident reader's operand that is not a constant
    (the state kept in SRAM, an activation) takes SRAM, never the weights' DRAM.
    """
    tables = shard.tiles.tables
    operand = 0  # resident bytes of operands that are not constants
    for i in shard.mapping.resident_layers:
        layer = shard.layers[i]
        rule = rule_of(layer)
        if any(rule.cache_operand(layer, pos) and shard.tensors[t].role != "const"
               for pos, t in enumerate(layer.inputs)):
            operand += int(weight_bytes_per_pe(tables[i]).v.sum())
    consts = sum(int(t.nbytes) for t in shard.tensors if t.role == "const")
    weights = max(0, consts - (int(shard.memory.resident_bytes_total) - operand))
    whole, in_sram = state_per_chip(shard)
    return int(weights), int(whole - in_sram)


@dataclass(frozen=True)
class _TimedPlan:
    """A shard plan mapped and timed (:func:`_time_plan`): the mapped shard, its system timing,
    the DRAM bytes a chip needs for it (its state's copies included), the shard's per-layer
    PE-level cycles with its weights on chip (the pre-scores of other plans), the resident
    weight bytes per PE it adds to the build's SRAM ledger and the exchange of its state's SRAM
    copy an input (:func:`.state.state_copies`)."""

    shard: Program
    timing: SystemTimingSummary
    dram_need: int
    exec_cycles: tuple[int, ...]
    resident_pe: dict
    exchange_s: float = 0.0


def _system_timing(program: Program, plan: ShardPlan, shard: Program, tables, chip: SpinnArch, topo,
                   onchip: tuple = ()) -> tuple[SystemTimingSummary, list[int]]:
    """Compose the system timing of a mapped shard (its tiles ``tables``); ``onchip``: the
    program's inputs already in the chips' SRAM when it starts (see
    :attr:`~.budget.RegionBudget.onchip_inputs`). Returns it with the shard's per-layer cycles
    with its weights on chip."""
    resident = set(shard.mapping.resident_layers)
    # A streamed layer's shard is prefetched into SRAM once (the share of the chip's SRAM that
    # residents leave, double-buffered) and its tiles then read it on chip; a shard larger than
    # that is read by the tiles from DRAM as the PE-level schedule does (blocks re-fetched).
    prefetch = chip.pes_per_chip * chip.tile_sram_bytes * (1 - LEDGER_RESIDENT_SHARE) / 2
    # state inputs (a KV cache): held in SRAM by resident layers, else streamed from DRAM by
    # the layers reading them, like a weight shard
    state = resident_state(shard, range(len(shard.layers)))
    stream = []
    for i, layer in enumerate(shard.layers):
        if i in resident or not len(tables[i]):
            stream.append(0)
            continue
        consts = set(layer.consts.values()) | {t for t in layer.inputs if shard.tensors[t].role == "const" or t in state}
        unique = sum(shard.tensors[t].nbytes for t in consts)
        if family_of(layer.kind).gathered_table(layer) is not None:
            # a gather reads only the rows it gathers (an embedding's one token), not its table
            unique = min(unique, int(tables[i].w_bytes.sum()), shard.tensors[layer.output].nbytes)
        if unique <= prefetch:
            stream.append(int(unique))
            continue
        _, w_src, _ = transfers(shard, i, tables[i], chip)
        stream.append(int(tables[i].w_bytes[w_src == DRAM].sum()))
    saved = shard.mapping
    # An all-gathered activation arrives over the chip links, whose packets the router delivers
    # to PEs: it lands in SRAM (when it takes at most GATHERED_SRAM_SHARE of the chip's SRAM),
    # and the layers reading it fetch it over the NoC, not once per tile from DRAM.
    room = chip.pes_per_chip * chip.tile_sram_bytes * GATHERED_SRAM_SHARE
    gathered = [t for t in range(len(program.tensors), len(shard.tensors)) if shard.tensors[t].nbytes <= room]
    gathered += _sent_blocks(program, plan, shard, room)
    # Inputs the region's budget says are already in the chips' SRAM (e.g. a planner's stage
    # whose earlier program, or the hand-over from the previous board, put them there) are
    # read over the NoC too, and cross no DRAM; outputs it names the program leaves in SRAM
    # (for a later program on the same chips, or the links to send) and never writes to DRAM.
    arrived = [t for t in onchip if (t in shard.inputs or t in shard.outputs) and shard.tensors[t].nbytes <= room]
    gathered += arrived
    local = evaluate(replace(shard, mapping=replace(saved, resident_layers=tuple(range(len(shard.layers))),
                                                    onchip_tensors=tuple(sorted(set(saved.onchip_tensors) | set(gathered))))),
                     chip, tables)
    exec_cycles = [row.cycles for row in local.layers]
    colls = _comm(topo, program, plan, tables)
    row_fp32 = {i for i, s in enumerate(plan.splits) if s == "row" and program.layers[i].mode != "int8"}
    # I/O through DRAM: not the inputs already on chip (nor the outputs left there), nor the
    # state (held in SRAM, or streamed above)
    held = set(arrived) | state
    io = sum(shard.tensors[t].nbytes for t in list(shard.inputs) + list(shard.outputs) if t not in held)
    # the most tiles one PE runs per layer: a streamed layer's earlier tiles compute while its
    # later tiles' weights arrive
    waves = [int(np.bincount(np.asarray(t.pe, dtype=np.int64)).max()) if len(t) else 1 for t in tables]
    return compose(program, chip, exec_cycles, stream, colls, plan.chips, row_fp32, io,
                   prefetch_bytes=2 * prefetch, waves=waves), exec_cycles


def _sent_blocks(program: Program, plan: ShardPlan, shard: Program, room: float) -> list[int]:
    """The tensors of ``shard`` that only an all-gather before a layer reads (the layers after
    it read the gathered copy, :func:`~.shard.shard_program`), each of at most ``room`` bytes
    (a limit per tensor, as the gathered copies' own: a block lives only from its producer to
    its all-gather, not for the whole program): the chip's block, which its producer
    leaves in SRAM, where the links' packets are sent from, as the gathered copy lands there.
    Left off chip, the memory plan would write it to DRAM for no reader (and a view producing
    it, such as the slice of a column-parallel GEMM's output that is gathered, would pay as a
    copy)."""
    n = len(program.layers)
    read = {t for layer in shard.layers for t in layer.inputs}
    sent = {c.tensor for c in plan.collectives if c.op == "all_gather" and c.layer < n}
    return sorted(t for t in sent if t not in read and program.tensors[t].role == "temp"
                  and shard.tensors[t].nbytes <= room)


def retime(program: Program, arch: SpinnArch, derive) -> TimingSummary:
    """The timing of a system-mapped (e.g. loaded) program, re-derived from its mapping records:
    what the compiler stored in ``program.timing`` (``derive`` is
    :func:`tvm_spinn.mapping.derive_tables`)."""
    info = program.mapping.system
    plan = recorded_plan(program)
    chip = _chip_arch(arch)
    # the shard's layers with their work on the chip (the compiler timed the shard so)
    shard = program_work(replace(shard_program(program, plan), mapping=replace(program.mapping, system=None)), chip)
    tables = derive(shard, chip)
    shard = replace(shard, timing=evaluate(shard, chip, tables))
    st, _ = _system_timing(program, plan, shard, tables, chip, topology_of(arch))
    timing = _timing_dict(program, shard, plan, st, float(info.handoff_s), arch)
    return streamed_timing(timing, shard, int(info.streams), plan.chips, arch)


def _row_always_sibling(program: Program, best, weights: str) -> ShardPlan | None:
    """The :data:`~.shard.ROW_ALWAYS` variant of the best plan so far, to be timed too when that
    plan streams a weight GEMM that the variant runs row-parallel, else None.

    A column-parallel GEMM keeps whole columns (its full reduction, ``k`` weights each) on a
    PE; where ``k`` is long they are coarse units for the PEs' SRAM (a Llama-2-70B down
    projection on a board: 171 columns of 28,672 int8 weights per chip on 148 PEs, two on some
    PEs, over the ledger's cap: the layer streams). Row-parallel, a chip holds ``k / tp`` rows
    of every column instead and the layout spreads them finely, at the price of all-reducing
    the partial sums (integer sums exact in any order; fp32 ones by the chain in ascending
    ``k``: the bits are the one-chip program's). The timing model decides between the two."""
    if best is None or weights == "stream":
        return None
    plan, shard = best[0], best[2]
    if plan.tp <= 1 or plan.row == ROW_ALWAYS:
        return None
    resident = set(shard.mapping.resident_layers)
    streamed = [i for i, layer in enumerate(program.layers)
                if family_of(layer.kind).weight_gemm(layer) and i not in resident]
    if not streamed:
        return None
    other = plan_shards(program, plan.tp, plan.dp, ROW_ALWAYS, plan.sp) if plan.sp == 1 else None
    if other is None or not any(other.splits[i] == "row" != plan.splits[i] for i in streamed):
        return None
    return other


def map_on_system(program: Program, arch: SpinnArch, options, state: SystemState | None, map_one, key: str | None,
                  cache: dict | None = None, onchip: tuple = (), streams: int = 0) -> tuple[Program, SystemState]:
    """Map ``program`` on the multi-chip ``arch`` (see the module docstring); returns the mapped
    program and the system's state after it.

    ``map_one(shard, chip_arch, reserved)`` maps a shard on one chip (returns the mapped shard
    and its resident bytes per PE); ``state`` is what the
    build's earlier programs hold (None: a program alone, which must fit by itself); ``key`` the
    program's structure key for reusing, through ``cache``, a mapping already made under the
    same state; ``onchip`` the inputs already in the chips' SRAM; ``streams`` the streams its
    state is kept for (the build's inputs in flight, :func:`.state.build_flight`; 0: the region's own
    count, one stream on one stage): each has a copy in the chips' DRAM, and every input
    exchanges the copy the memory plan keeps in SRAM (:func:`.state.state_copies`).
    """
    alone = state is None
    # latency: the fastest plan; throughput (a stream of inputs, the free chips holding
    # replicas): the fewest chip-seconds per inference
    per_chip = getattr(options, "objective", "latency") == "throughput"
    ledger = _Ledger.of(state or SystemState(), arch.pes_per_chip, {} if cache is None else cache)
    topo = topology_of(arch)
    weights = sum(t.nbytes for t in program.tensors if t.role == "const")
    ledger.weights += weights
    ledger.state += sum(program.tensors[t].nbytes for t in resident_state(program, range(len(program.layers))))

    def attempt(led: _Ledger):
        reserved = led.sram.copy()
        cache_key = (key, reserved.tobytes(), led.dram, streams) if key is not None else None
        if cache_key is not None and cache_key in led.cache:
            return led.cache[cache_key]
        best = None
        # The one-chip plan first (the reference under the same model): its per-layer PE-level
        # times weigh the other plans' pre-scores.
        one = plan_shards(program, 1, 1)
        timed = {(1, 1, True, 1): _time_plan(program, one, arch, topo, map_one, reserved, onchip, streams)}
        work = [c / arch.clock_hz for c in timed[(1, 1, True, 1)].exec_cycles]
        cands = _candidates(program, arch, topo, per_chip, work)
        chosen = [c for c in cands if c[1].chips > 1][:FULL_CANDIDATES] + [(0.0, one, 0)]
        results = []

        def consider(plan, timed_plan: _TimedPlan):
            nonlocal best
            st, need = timed_plan.timing, timed_plan.dram_need
            fits = led.dram + need <= arch.dram_bytes
            latency = st.latency_s + timed_plan.exchange_s
            results.append({"tp": plan.tp, "dp": plan.dp, "sp": plan.sp, "row": plan.row, "latency_s": latency,
                            "fits": fits})
            score = (latency * (plan.chips if per_chip else 1), plan.chips)
            if fits and (best is None or score < best[4]):
                best = (plan, st, timed_plan.shard, need, score, timed_plan.resident_pe)

        for _, plan, _ in chosen:
            k = (plan.tp, plan.dp, plan.row, plan.sp)
            consider(plan, timed.get(k) or _time_plan(program, plan, arch, topo, map_one, reserved, onchip, streams))
        sibling = _row_always_sibling(program, best, getattr(options, "weights", "auto"))
        if sibling is not None:
            consider(sibling, _time_plan(program, sibling, arch, topo, map_one, reserved, onchip, streams))
        out = (best, results, min((c[2] for c in cands), default=0))
        if cache_key is not None:
            led.cache[cache_key] = out
        return out

    best, results, min_share = attempt(ledger)
    ledger.min_chip_bytes = max(ledger.min_chip_bytes, min_share)
    handoff = None
    if best is None and not alone:
        # The stage's DRAM is full: the program opens the next stage (board), a pipeline
        # stage; past the system's boards the build keeps counting (virtual stages) to name
        # the smallest system that holds the model, and fails at its end.
        fresh = ledger.fresh()
        fresh.cache = ledger.cache
        best, results, _ = attempt(fresh)
        if best is not None:
            if ledger.stage + 1 >= stages_of(arch):
                ledger.overflow = ledger.overflow or program.symbol
            ledger.stage += 1
            ledger.sram[:] = 0
            ledger.dram = 0
            src = stage_ranks(arch, ledger.stage - 1, best[0].tp * best[0].sp)
            dst = (src + arch.chips_per_board) % arch.chips if not arch.has_faults else \
                stage_ranks(arch, ledger.stage, src.size)
            src = src[:dst.size]
            in_bytes = data_bytes(program) / max(1, best[0].tp * best[0].sp)
            handoff = point_to_point(topo, src, dst, in_bytes) if not np.array_equal(src, dst) else None
    if best is None and ledger.stage >= 0 and ledger.overflow is None and len(program.layers) > 1:
        # No chip group holds the program's weights: its layers over pipeline stages, each on
        # its own board with only its layers' weights. The region takes whole boards from the
        # current stage when that holds nothing yet, else from the next one.
        start = ledger.stage if ledger.dram == 0 and not ledger.sram.any() else ledger.stage + 1
        boards = pipeline_boards(arch, start)
        # the inputs come from the board of the build's earlier regions when it is not the first
        hand = hand_in_cost(program, topo, stage_ranks(arch, ledger.stage, 1), boards[0][1]) \
            if start > ledger.stage and boards else None

        def map_region(stage: Program, board: SpinnArch) -> tuple[Program, SystemState]:
            return map_on_system(stage, board, options, None, map_one, None)

        piped, why = map_pipeline(program, arch, map_region, boards, hand.seconds if hand is not None else 0.0, streams)
        if piped is not None:
            program, last_stage, last = piped
            if hand is not None:
                program = handed_in(program, hand, arch)
            # the build continues on the last stage's board, after what that stage holds there
            ledger.stage = last_stage
            ledger.sram[:] = 0
            ledger.sram[:len(last.sram)] = last.sram
            ledger.dram = last.dram
            return program, ledger.frozen()
        ledger.shortfall = shortfall(program, arch, boards)
        if why is not None:  # its stages fitted but not the copies of their state
            left = tuple(int(chips[0]) // arch.chips_per_board for _, chips in boards)
            ledger.shortfall = replace(ledger.shortfall or Shortfall(left, 0, weights), why=why)
    if best is None:
        # One program's smallest shard does not fit one chip: no system holds it.
        ledger.overflow = ledger.overflow or program.symbol
        ledger.stage = -1
        if alone:
            raise MappingError(overflow_message(ledger.frozen(), arch))
        led = ledger.fresh()
        led.dram = -(1 << 62)  # capacity not checked: this build is failing already
        best, results, _ = attempt(led)
    if alone and ledger.overflow is not None:
        raise MappingError(overflow_message(ledger.frozen(), arch))
    plan, st, shard, need, _, resident = best
    ledger.dram += need
    ledger.sram += _resident_per_pe(resident, arch.pes_per_chip)
    return _install(program, shard, plan, st, results, ledger.stage, handoff, arch, max(1, streams)), ledger.frozen()


def overflow_message(ledger: SystemState, arch: SpinnArch) -> str:
    """The :class:`MappingError` text of a model that does not fit ``arch`` (``ledger``: the
    system's state after the build's last program)."""
    per_chip = arch.dram_bytes + arch.pes_per_chip * arch.tile_sram_bytes
    if ledger.shortfall is not None:
        short = ledger.shortfall
        left, need, weights, why = short.boards, short.need, short.weights, short.why
        where = (f"no board holds region {ledger.overflow}: over pipeline stages (a whole board each) "
                 + (f"it needs at least {need} boards (its {weights} bytes of weights, "
                    f"{arch.chips_per_board * per_chip} bytes a board holds; more than the boards it was tried on), "
                    "and " if need else "")
                 + f"{len(left)} whole board(s) were left to it ({', '.join(map(str, left)) or 'none'})"
                 + (f"; the most stages tried: {why}" if why else ""))
    elif ledger.stage >= 0:
        boards = ledger.stage + 1
        where = (f"the smallest system that holds it is make_system(boards={boards}) "
                 f"({boards * arch.chips_per_board} chips, one pipeline stage per board)")
    else:
        where = (f"no system holds it: one program's smallest shard ({ledger.min_chip_bytes} bytes per chip of "
                 f"weights and state) exceeds a chip's {arch.dram_bytes} bytes of DRAM")
    state = f" and its state (inputs kept between calls, such as a KV cache) {ledger.state} bytes" if ledger.state else ""
    return (f"the model does not fit {arch.name} ({arch.chips} chips): its weights need {ledger.weights} bytes{state}, "
            f"the system holds {arch.chips * per_chip} bytes ({arch.dram_bytes} bytes of DRAM and "
            f"{arch.pes_per_chip * arch.tile_sram_bytes} bytes of SRAM per chip; first program over: "
            f"{ledger.overflow or '?'}); {where}")


def system_tables(program: Program, arch: SpinnArch, derive):
    """The tiles of a system-mapped program: its shard's, on one chip (``derive`` is
    :func:`tvm_spinn.mapping.derive_tables`)."""
    plan = recorded_plan(program)
    shard = replace(shard_program(program, plan), mapping=replace(program.mapping, system=None))
    return derive(shard, _chip_arch(arch))


def _resident_per_pe(resident: dict, pes: int) -> np.ndarray:
    """Resident bytes per PE of one chip (``resident``: bytes by PE of a one-chip mapping)."""
    out = np.zeros(pes, dtype=np.int64)
    for pe, b in resident.items():
        out[int(pe) % pes] += int(b)
    return out


def _install(program: Program, shard: Program, plan: ShardPlan, st, results, stage: int, handoff,
             arch: SpinnArch, streams: int = 1) -> Program:
    """``program`` with the shard's mapping and the system timing, its state kept for
    ``streams`` streams (:func:`.state.state_copies`; a program without state records 1)."""
    if not resident_state(program, range(len(program.layers))):
        streams = 1
    summary = plan.summary()
    system = SystemMapping(
        tp=summary["tp"], dp=summary["dp"], sp=summary["sp"], row=summary["row"], chips=summary["chips"],
        splits=tuple(summary["splits"].items()), stage=stage,
        candidates=tuple(PlanCandidate(**c) for c in results),
        collectives=tuple(plan.collectives),
        handoff_s=handoff.seconds if handoff is not None else 0.0,
        replicated=tuple(tuple(x) for x in summary.get("replicated", ())), streams=int(streams))
    program = replace(program, tiles=shard.tiles,
                      mapping=replace(shard.mapping, system=system, chips_per_layer=(plan.chips,) * len(program.layers)))
    timing = _timing_dict(program, shard, plan, st, system.handoff_s, arch)
    program = replace(program, timing=streamed_timing(timing, shard, system.streams, plan.chips, arch))
    # the whole group's resident bytes (each chip holds its shard's); labels in this program's names
    ranges = tuple(replace(rng, what=activation_label(program, rng.first_layer))
                   if str(rng.what).startswith("activation ") else rng for rng in shard.memory.ranges)
    return replace(program, memory=replace(shard.memory, ranges=ranges,
                                           resident_bytes_total=int(shard.memory.resident_bytes_total) * plan.chips))


def _timing_dict(program: Program, shard: Program, plan: ShardPlan, st, handoff_s: float, arch: SpinnArch) -> TimingSummary:
    """``program.timing`` of a system mapping: the shard's PE-level figures, the system latency."""
    latency = st.latency_s + handoff_s
    clock = arch.clock_hz
    # energy: every chip of the group spends its shard's, the links carry the collectives'
    # bytes (each of them crosses at least one link per rank), all chips idle-burn the rest
    size = {"tp": plan.tp, "sp": plan.sp, "dp": plan.dp, "all": plan.tp * plan.sp}
    links = sum(c.nbytes * max(0, size.get(getattr(c, "group", "tp"), plan.tp) - 1) for c in plan.collectives)
    energy = (shard.timing.energy_j * plan.chips + links * arch.e_link_byte_j
              + arch.p_static_w_per_chip * plan.chips * max(0.0, latency - shard.timing.latency_s))
    coll_bytes = {}
    for c in plan.collectives:
        coll_bytes[c.layer] = coll_bytes.get(c.layer, 0) + c.nbytes
    layers = tuple(replace(row, chips=plan.chips, link_bytes=int(coll_bytes.get(i, 0)),
                           cycles=int(round(st.layer_s[i] * clock))) for i, row in enumerate(shard.timing.layers))
    return replace(shard.timing, latency_s=latency, cycles=int(round(latency * clock)), roofline_s=st.bound_s,
                   throughput_inf_s=1.0 / latency if latency else 0.0, energy_j=energy, system=st,
                   layers=layers, link_bytes=int(sum(c.nbytes for c in plan.collectives)))
