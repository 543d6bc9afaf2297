"""The plan of a prompt's prefill (a frozen record) and its one-line summaries."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


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
