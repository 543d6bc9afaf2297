"""A batch of users in a pipeline of board stages: where each user's KV cache lives, and what it costs.

The ``pipeline`` placement (:func:`tvm_spinn.llm.plan.plan`) runs a batch of ``B`` users as
continuous micro-batches of ``mb`` users: micro-batch ``k`` holds users ``k mb .. (k + 1) mb - 1``,
the micro-batches follow one another through the chain of stages (a stage works on one while the
next stage works on the one before), and a user's next token enters the chain as soon as its
last one has left the head and come back to the first stage. Each stage is mapped once for one
micro-batch: its SRAM ledger holds that micro-batch's cache of the stage's blocks
(:attr:`~tvm_spinn.llm.plan._Stage.kv_bytes`, every copy its shard plans keep, of it
``kv_sram_bytes`` in SRAM). But the stage keeps the cache of *every* user, since every
micro-batch comes back to it each token. So, per stage (:func:`stage_caches`):

* the cache of all ``B`` users is ``B / mb`` times the mapped micro-batch's;
* it lives in the stage's SRAM, micro-batch by micro-batch, as far as the board's resident share
  (:func:`tvm_spinn.mapping.planner.resident_capacity`, of its live chips) has room beside the
  weights the mapping kept resident, and only where the mapping held the micro-batch's cache in
  SRAM; the other micro-batches' caches live in the board's DRAM, next to the weights it streams;
* a micro-batch whose cache is in DRAM while the mapping read it from SRAM reads it from the
  board's DRAM each token: ``kv_sram_bytes`` over the DRAM bandwidth of the board's live chips,
  added to that micro-batch's time in the stage;
* the whole batch's cache must fit the board's SRAM room and DRAM
  (:attr:`~tvm_spinn.target.arch.SpinnArch.dram_bytes` a chip, less the streamed weights):
  otherwise the placement does not hold the batch, and the message names the stage, its board,
  the bytes needed and available, and the largest batch that fits every stage.

The per-user token period is then ``max(a user's token latency, the busiest stage's time for
all micro-batches)``: the latency of the last micro-batch (whose cache spills first) and
``max over stages of (B / mb) x (stage + hand-over into it) + the spilled micro-batches' DRAM
reads``. Aggregate tokens/s is ``B`` over that period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["StageCache", "BatchCaches", "stage_caches"]


@dataclass(frozen=True)
class StageCache:
    """One stage's KV cache for every user of the batch.

    Attributes
    ----------
    stage : int
        Index in the chain (token order).
    board : int
        The board it runs on.
    bytes : int
        The cache of all users for the stage's blocks.
    sram_bytes, dram_bytes : int
        Of it, in the board's SRAM and in its DRAM.
    sram_micro_batches : int
        Micro-batches whose cache is in SRAM (the first ones).
    micro_batch_sram_bytes : int
        Of one such micro-batch's cache, what is in SRAM (the mapping's ledger: the rest of it
        is in DRAM).
    sram_room : int
        SRAM the board's resident share leaves beside the stage's resident weights.
    dram_room : int
        DRAM of the board's live chips less the weights streamed from it.
    spill_s : float
        Extra time of one micro-batch step in this stage whose cache moved to DRAM.
    """

    stage: int
    board: int
    bytes: int
    sram_bytes: int
    dram_bytes: int
    sram_micro_batches: int
    micro_batch_sram_bytes: int
    sram_room: int
    dram_room: int
    spill_s: float

    @property
    def fits(self) -> bool:
        """Whether the board holds every user's cache."""
        return self.dram_bytes <= self.dram_room


@dataclass(frozen=True)
class BatchCaches:
    """The caches of a batch along a chain of stages (see the module docstring).

    Attributes
    ----------
    stages : tuple of StageCache
    batch, micro_batch, micro_batches : int
        Users, users per micro-batch and micro-batches.
    largest_batch : int
        The most users every stage's SRAM room and DRAM hold.
    round_s : float
        The busiest stage's time for all micro-batches (their hand-overs into it included).
    spill_decode_s : float
        What the last micro-batch's token latency gains from reading its cache from DRAM.
    """

    stages: tuple
    batch: int
    micro_batch: int
    micro_batches: int
    largest_batch: int
    round_s: float
    spill_decode_s: float

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    @property
    def sram_bytes(self) -> int:
        return sum(s.sram_bytes for s in self.stages)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.stages)

    def message(self, arch_name: str) -> str:
        """Why the batch does not fit (the first stage over), or ``""``."""
        over = next((s for s in self.stages if not s.fits), None)
        if over is None:
            return ""
        return (f"the KV cache of {self.batch} users does not fit stage {over.stage} (board {over.board} of "
                f"{arch_name}): {over.bytes} bytes needed, {over.sram_room + over.dram_room} available "
                f"({over.sram_room} in SRAM beside its resident weights, {over.dram_room} in DRAM beside its "
                f"streamed weights); the largest batch that fits every stage is {self.largest_batch}")

    def users(self) -> list[dict]:
        """Where each micro-batch's users keep their cache: ``users`` (first, last), bytes in SRAM
        and DRAM over all stages, and the boards holding it."""
        out = []
        for k in range(self.micro_batches):
            first, last = k * self.micro_batch, min(self.batch, (k + 1) * self.micro_batch) - 1
            share = (last - first + 1) / self.micro_batch
            sram = sum(s.micro_batch_sram_bytes if k < s.sram_micro_batches else 0 for s in self.stages)
            total = sum(s.bytes // self.micro_batches for s in self.stages)
            out.append({"users": [first, last], "micro_batch": k, "sram_bytes": int(sram * share),
                        "dram_bytes": int((total - sram) * share),
                        "boards": sorted({s.board for s in self.stages if s.bytes})})
        return out


def stage_caches(chain, hand_in, batch: int, micro_batch: int, views, boards, arch) -> BatchCaches:
    """Place the cache of ``batch`` users on a chain of mapped stages (see the module docstring).

    Parameters
    ----------
    chain : sequence
        The stages (:class:`tvm_spinn.llm.plan._Stage`), each mapped for one micro-batch.
    hand_in : sequence of float
        Seconds of the hand-over into each stage.
    batch, micro_batch : int
        Users, and users per micro-batch (what each stage was mapped for).
    views : sequence of SpinnArch
        The board each stage runs on, as a system of its own
        (:func:`tvm_spinn.target.faults.board_view`).
    boards : sequence of int
        Each stage's board id (for messages and reports).
    arch : SpinnArch
        The system.

    Returns
    -------
    BatchCaches
    """
    from ..mapping.planner import resident_capacity
    from ..target.faults import live_chips

    micro = math.ceil(batch / micro_batch)
    stages, largest, spill_decode, round_s = [], math.inf, 0.0, 0.0
    for j, (st, h, view, b) in enumerate(zip(chain, hand_in, views, boards)):
        chips = int(live_chips(view).size)
        need = st.kv_bytes * batch // micro_batch  # every user's cache of this stage's blocks
        sram_used = max(0, st.resident_bytes - st.kv_sram_bytes)  # resident weights (replicas counted per chip)
        streamed = max(0, st.weight_bytes - min(sram_used, st.weight_bytes))
        sram_room = max(0, int(resident_capacity(view) * chips / view.chips) - sram_used)
        dram_room = max(0, chips * arch.dram_bytes - streamed)
        if micro == 1 or st.kv_bytes == 0:
            held = micro if st.kv_sram_bytes else 0  # the mapping's ledger held the whole batch
        else:
            held = min(micro, sram_room // st.kv_bytes) if st.kv_sram_bytes else 0
        sram = held * st.kv_sram_bytes
        spill = st.kv_sram_bytes / (chips * arch.dram_bw_bytes_s) if held < micro else 0.0
        stages.append(StageCache(j, int(b), int(need), int(sram), int(need - sram), int(held), int(st.kv_sram_bytes),
                                 int(sram_room), int(dram_room), spill))
        if st.kv_bytes:
            largest = min(largest, (sram_room + dram_room) * micro_batch // st.kv_bytes)
        round_s = max(round_s, micro * (st.latency_s + h) + (micro - held) * spill)
        spill_decode += spill
    return BatchCaches(tuple(stages), batch, micro_batch, micro, int(largest) if largest != math.inf else batch,
                       round_s, spill_decode)
