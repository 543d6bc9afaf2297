"""The chain a bit-exact tensor-parallel GEMM runs, and its seconds: one model for the compiled
step (:func:`tvm_spinn.training.tensor_parallel.tp_compute`) and the planner
(:func:`tvm_spinn.training.plan_training`).

A GEMM that reduces over a tensor-parallel sharded axis (a row-parallel projection's forward, a
column-parallel projection's input gradient) keeps the one-chip bits by running as a *chain*:
the sharded axis, ascending, is cut into runs of consecutive indices owned by one rank, and each
run continues the accumulator the run before it finished, passed from rank to rank
(:mod:`tvm_spinn.program.ops.gemm_chain`). Its rows are independent sums, so the rows are cut
into blocks that follow one another down the chain: block ``b + 1`` of run ``j`` overlaps block
``b`` of run ``j + 1`` on the next rank (:func:`chain_makespan`).

:func:`layer_chains` lists one transformer block's chain GEMMs from its sizes (the ones
:func:`~tvm_spinn.training.tensor_parallel.split_gemms` finds in a compiled GPT-2 or Llama block),
:func:`chain_blocks` the row blocks a chain pipelines and :func:`chain_seconds` the seconds of
one chain given the seconds of one run of one block and of one hop: the compiled step prices a
block's run by simulating its GEMM, the planner at the chips' peak.
"""

from __future__ import annotations

__all__ = ["chain_makespan", "chain_blocks", "chain_seconds", "layer_chains"]


def chain_makespan(ranks, run_s, hop_s: float, blocks: int) -> float:
    """Seconds of a chain over row blocks: run ``j`` (on rank ``ranks[j]``, ``run_s[j]`` seconds
    per block) of block ``b`` starts when run ``j - 1`` of block ``b`` has finished and its
    partial sum has crossed to the rank (``hop_s``, none when the rank continues its own run)
    and the rank is free. The rows of a GEMM are independent sums, so block ``b + 1``'s run
    ``j`` may overlap block ``b``'s run ``j + 1`` on the next rank: the chain pipelines (every
    row's additions keep their order). Events are taken in wavefronts ``j + b``, runs in order.

    Runs of equal seconds ``r`` with consecutive runs on different ranks and a rank's runs at
    least ``blocks`` runs apart (every chain of :func:`chain_seconds`: a rank's blocks are done
    before its next run's first block arrives) finish at ``(j + b + 1) r + j hop`` (by
    induction over the wavefronts: both of an event's predecessors end at ``(j + b) r + j
    hop``), so the chain takes ``(runs + blocks - 1) r + (runs - 1) hop``: taken in closed form."""
    ranks = list(ranks)
    n = len(ranks)
    if n and blocks >= 1 and all(t == run_s[0] for t in run_s[:n]):
        last: dict = {}
        apart = True
        for j, rank in enumerate(ranks):
            if rank in last and j - last[rank] < max(2, blocks):
                apart = False
                break
            last[rank] = j
        if apart:
            return (n + blocks - 1) * run_s[0] + (n - 1) * hop_s
    done: dict = {}
    free: dict = {}
    for wave in range(len(ranks) + blocks - 1):
        for j, rank in enumerate(ranks):
            b = wave - j
            if not 0 <= b < blocks:
                continue
            ready = done[(j - 1, b)] + (hop_s if ranks[j - 1] != rank else 0.0) if j else 0.0
            done[(j, b)] = free[rank] = max(ready, free.get(rank, 0.0)) + run_s[j]
    return max(done.values()) if done else 0.0


def chain_blocks(m: int, tp: int) -> int:
    """Row blocks a chain of ``m`` rows over ``tp`` ranks pipelines: the most blocks, at most
    ``tp`` (one a rank keeps every rank busy once the chain is full), that divide the rows."""
    return max(b for b in range(1, max(1, min(m, tp)) + 1) if m % b == 0)


def chain_seconds(runs, m: int, n: int, tp: int, block_s, hop_s) -> float:
    """Seconds of the chain GEMM ``[m, k] @ [k, n]`` over ``runs`` (``(rank, k0, k1)``,
    ascending): :func:`chain_makespan` over :func:`chain_blocks` row blocks, each run of a block
    taking ``block_s(rows, k1 - k0, n)`` seconds and each hop ``hop_s(bytes)`` for the block's
    fp32 partial sum."""
    blocks = chain_blocks(m, tp)
    rows = m // blocks
    return chain_makespan([r for r, _, _ in runs], [block_s(rows, k1 - k0, n) for _, k0, k1 in runs],
                          hop_s(4 * rows * n), blocks)


def _runs(extent: int, tp: int, parts: int = 1) -> tuple:
    """``(rank, k0, k1)`` runs of an axis of ``parts`` equal parts, each split over the ranks in
    order (a fused QKV weight: three parts, so each rank one run in each)."""
    part = extent // parts
    step = part // tp
    return tuple((r, p * part + r * step, p * part + (r + 1) * step) for p in range(parts) for r in range(tp))


def layer_chains(family: str, hidden: int, q: int, kv: int, intermediate: int, m: int, tp: int) -> tuple:
    """One transformer block's chain GEMMs for ``m`` rows over ``tp`` ranks: ``(pass, m, k, n,
    runs)`` with ``pass`` ``"forward"`` (the row-parallel projections: attention output, MLP
    down) or ``"backward"`` (the column-parallel projections' input gradients).

    Parameters
    ----------
    family : {"gpt2", "llama"}
        GPT-2 (fused QKV ``c_attn``, ``c_fc``) or Llama (``q/k/v_proj``, ``gate/up_proj``).
    hidden, q, kv, intermediate : int
        The residual width, the queries' and the keys'/values' features (all heads), the MLP's
        hidden features.
    """
    h, i = hidden, intermediate
    forward = [("forward", m, q, h, _runs(q, tp)), ("forward", m, i, h, _runs(i, tp))]
    if family == "gpt2":
        backward = [("backward", m, q + 2 * kv, h, _runs(q + 2 * kv, tp, 3)), ("backward", m, i, h, _runs(i, tp))]
    else:
        backward = [("backward", m, q, h, _runs(q, tp)), ("backward", m, kv, h, _runs(kv, tp)),
                    ("backward", m, kv, h, _runs(kv, tp)), ("backward", m, i, h, _runs(i, tp)),
                    ("backward", m, i, h, _runs(i, tp))]
    return tuple(forward + backward)
