"""The pipeline's schedule: chunks through machines in order (a flow shop), its critical
path, and stages of boards taking turns on the chunks."""

from __future__ import annotations

import math

import numpy as np


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
