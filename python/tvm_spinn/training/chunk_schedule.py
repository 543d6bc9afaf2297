"""The timeline of a pipeline whose micro-batches pass as chunks of consecutive tokens.

A micro-batch cut into ``chunks`` chunks (token-level pipelining, TeraPipe, Li et al. 2021)
enters the stages chunk by chunk, and its passes keep the whole sequence's bits only in a fixed
order (``docs/design/training.md``, the token chunks):

- forwards in ascending chunk order (a chunk's attention reads the earlier chunks' keys);
- input-gradient passes (B) in descending chunk order: a key's gradient sums over the later
  chunks' queries, so a block stage's first B pass of a micro-batch, its last chunk's, waits
  until every chunk of the micro-batch went forward through the last stage, and each later one
  for the chunk after it. A stage that is token-wise (an LM head and loss: each token's
  gradient reads its own token only, ``tokenwise``) runs a chunk's B right after its forward;
- weight-gradient passes (W) in ascending chunk order, each continuing the previous chunk's
  accumulator (the PE GEMM adds into its output, in ascending ``k``): the first, chunk 0's,
  reads chunk 0's output gradient, which the micro-batch's last B pass produces. So every W pass
  of a micro-batch waits for that stage's last B pass of it. Run as one GEMM over the
  micro-batch's tokens instead (``joint_weight_s``), the W pass reduces over all of them in
  ascending ``k``: the same additions in the same order, so the same bits, in one pass.

:func:`chunk_times` simulates such a pipeline: each stage one resource that runs one pass at a
time, a list schedule that starts, whenever a stage is free, the pass that can start earliest
(ties: B, then F, then W, the zero-bubble priority that keeps the input gradients on the
critical path and lets the weight gradients fill idle time); a pass's output reaches the
neighbouring stage ``forward_hand_s[s]`` / ``backward_hand_s[s]`` after it ends (the
collectives and the hand-over on its path). With ``chunk_order=False`` every chunk is an
independent slot (its B right after its own forward through the last stage, its W right after
its B): the assumption of a 1F1B slot count, against which the chunk order's cost shows.
A schedule orders whole passes of one chunk's values: no bit moves.

:func:`chunk_ends` runs the same list schedule to each stage's last end alone, fast enough for
the split search to charge every chunked split's order: a pass's operands come from its own stage
and its two neighbours, so each start refreshes those three stages' next candidate only, and a
heap keyed as above picks the earliest (the same choices, the same floats, as :func:`chunk_times`).
"""

from __future__ import annotations

import heapq

from .errors import TrainingError

__all__ = ["chunk_ends", "chunk_times"]


def _times(name: str, values, stages: int) -> list:
    values = list(values)
    if len(values) != stages or any(not isinstance(v, (int, float)) or v < 0 for v in values):
        raise TrainingError(f"chunk_times: {name} must be {stages} non-negative seconds (one a stage), got "
                            f"{values!r}")
    return [float(v) for v in values]


def _checked(microbatches, chunks, forward_s, backward_s, weight_s, forward_hand_s, backward_hand_s, tokenwise,
             joint_weight_s) -> tuple:
    """The arguments of :func:`chunk_times` as float lists (one a stage), or the bad one named."""
    for name, v in (("microbatches", microbatches), ("chunks", chunks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TrainingError(f"chunk_times: {name} must be an integer >= 1, got {v!r}")
    stages = len(list(forward_s))
    if stages < 1:
        raise TrainingError("chunk_times: forward_s must give at least one stage")
    fwd, bwd, wgt = (_times(n, v, stages) for n, v in (("forward_s", forward_s), ("backward_s", backward_s),
                                                        ("weight_s", weight_s)))
    fh = _times("forward_hand_s", [0.0] * stages if forward_hand_s is None else forward_hand_s, stages)
    bh = _times("backward_hand_s", [0.0] * stages if backward_hand_s is None else backward_hand_s, stages)
    joint = None
    if joint_weight_s is not None:  # None for a stage that keeps one W pass a chunk
        joint_weight_s = list(joint_weight_s)
        joint = _times("joint_weight_s", [0.0 if v is None else v for v in joint_weight_s], stages)
        joint = [None if v is None else t for v, t in zip(joint_weight_s, joint)]
    if tokenwise not in (0, 1) or tokenwise >= stages:
        raise TrainingError(f"chunk_times: tokenwise must be 0 or 1 (and leave a block stage), got {tokenwise!r}")
    return fwd, bwd, wgt, fh, bh, joint


def chunk_times(microbatches: int, chunks: int, forward_s, backward_s, weight_s, forward_hand_s=None,
                backward_hand_s=None, *, tokenwise: int = 0, joint_weight_s=None,
                chunk_order: bool = True) -> tuple[dict, list]:
    """Simulate one step of a chunked pipeline (module docstring).

    Parameters
    ----------
    microbatches, chunks : int
        Micro-batches of a replica's step and the chunks each is cut into.
    forward_s, backward_s, weight_s : sequence of float
        Seconds of one chunk's forward, input-gradient (B) and weight-gradient (W) pass on each
        stage (one entry a stage, first stage first).
    forward_hand_s, backward_hand_s : sequence of float, optional
        Seconds from the end of stage ``s``'s forward (B) pass until stage ``s + 1`` (``s - 1``)
        may start on its output (default 0).
    tokenwise : int
        How many of the last stages are token-wise (0 or 1: a head stage): there a chunk's B
        runs after its own forward, in ascending chunk order.
    joint_weight_s : sequence of float or None, optional
        Seconds of one W pass over a whole micro-batch's tokens on each stage: the stage runs one
        such pass a micro-batch (after its last B pass of it) instead of ``chunks`` W passes
        (``None`` for a stage that keeps one W pass a chunk).
    chunk_order : bool
        Keep the chunk order (default). ``False``: every chunk an independent slot.

    Returns
    -------
    (dict, list)
        The end of every pass, keyed ``(kind, stage, micro-batch, chunk)`` (``kind`` ``"f"``,
        ``"b"`` or ``"w"``; a joint W pass has chunk 0), and each stage's last end.
    """
    fwd, bwd, wgt, fh, bh, joint = _checked(microbatches, chunks, forward_s, backward_s, weight_s, forward_hand_s,
                                            backward_hand_s, tokenwise, joint_weight_s)
    stages = len(fwd)
    last = stages - 1
    # each stage's passes of each kind, in the order the bits fix: forwards ascending,
    # input gradients descending (ascending on a token-wise stage or without the chunk order),
    # weight gradients ascending (one a micro-batch when joint)
    order = {}
    for s in range(stages):
        ascending = not chunk_order or s > last - tokenwise
        order[("f", s)] = [(m, c) for m in range(microbatches) for c in range(chunks)]
        order[("b", s)] = [(m, c) for m in range(microbatches) for c in (range(chunks) if ascending
                                                                          else range(chunks - 1, -1, -1))]
        order[("w", s)] = ([(m, 0) for m in range(microbatches)] if joint is not None and joint[s] is not None
                           else [(m, c) for m in range(microbatches) for c in range(chunks)])
    duration = {"f": fwd, "b": bwd, "w": [wgt[s] if joint is None or joint[s] is None else joint[s]
                                          for s in range(stages)]}
    done: dict = {}
    pos = {key: 0 for key in order}
    free = [0.0] * stages
    rank = {"b": 0, "f": 1, "w": 2}

    def ready(kind: str, s: int, m: int, c: int) -> "float | None":
        """When the pass may start (its operands' arrival), or None while one is missing."""
        needs = []
        if kind == "f":
            if s > 0:
                needs.append((("f", s - 1, m, c), fh[s - 1]))
        elif kind == "b":
            ascending = not chunk_order or s > last - tokenwise
            if s == last or s > last - tokenwise:
                needs.append((("f", s, m, c), 0.0))
            if s < last:
                needs.append((("b", s + 1, m, c), bh[s + 1]))
            if chunk_order and not ascending:
                if s == last:  # the micro-batch's every chunk through the last stage
                    needs.append((("f", s, m, chunks - 1), 0.0))
                elif tokenwise and s == last - tokenwise:  # the token-wise stage hands chunks back in order
                    needs.append((("f", s + 1, m, chunks - 1), 0.0))
        else:
            ascending = not chunk_order or s > last - tokenwise
            if joint is not None and joint[s] is not None:  # one pass over the micro-batch: after its last B
                needs.append((("b", s, m, chunks - 1 if ascending else 0), 0.0))
            else:  # chunk c's output gradient; in descending B order the last B pass gives chunk 0's
                needs.append((("b", s, m, c if ascending else 0), 0.0))
        start = 0.0
        for key, delay in needs:
            if key not in done:
                return None
            start = max(start, done[key] + delay)
        return start

    total = sum(len(v) for v in order.values())
    while len(done) < total:
        best = None
        for s in range(stages):
            for kind in "bfw":
                i = pos[(kind, s)]
                if i == len(order[(kind, s)]):
                    continue
                m, c = order[(kind, s)][i]
                at = ready(kind, s, m, c)
                if at is None:
                    continue
                key = (max(at, free[s]), rank[kind], s)
                if best is None or key < best[0]:
                    best = (key, kind, s, m, c)
        if best is None:
            raise TrainingError("chunk_times: no pass can start (an internal error)")
        (start, _, s), kind, _, m, c = best
        done[(kind, s, m, c)] = free[s] = start + duration[kind][s]
        pos[(kind, s)] += 1
    return done, free


def chunk_ends(microbatches: int, chunks: int, forward_s, backward_s, weight_s, forward_hand_s=None,
               backward_hand_s=None, *, tokenwise: int = 0, joint_weight_s=None, chunk_order: bool = True) -> list:
    """Each stage's last end in :func:`chunk_times`'s schedule (the same arguments, the same floats).

    The schedule starts, of every stage's next pass of each kind whose operands are done, the
    one that can start earliest (ties: B, F, W, then the lower stage). A pass reads only its own
    stage's and its neighbours' passes, so after a start only those three stages' candidates
    change: they are refreshed and the earliest of all is taken from a heap (stale entries are
    skipped by a per-stage version), ``O(passes x log(stages))`` in all.

    Returns
    -------
    list of float
        Each stage's last end, first stage first (the step's pipeline is their maximum).
    """
    fwd, bwd, wgt, fh, bh, joint = _checked(microbatches, chunks, forward_s, backward_s, weight_s, forward_hand_s,
                                            backward_hand_s, tokenwise, joint_weight_s)
    stages, last, n = len(fwd), len(fwd) - 1, microbatches * chunks
    # each stage's passes of a kind in the order the bits fix (chunk_times), as indexes m x chunks + c
    ascending = [not chunk_order or s > last - tokenwise for s in range(stages)]
    up = list(range(n))
    down = [m * chunks + c for m in range(microbatches) for c in range(chunks - 1, -1, -1)]
    jointly = [joint is not None and joint[s] is not None for s in range(stages)]
    order_b = [up if ascending[s] else down for s in range(stages)]
    order_w = [list(range(0, n, chunks)) if jointly[s] else up for s in range(stages)]
    wdur = [joint[s] if jointly[s] else wgt[s] for s in range(stages)]
    # the chunk whose B pass a W pass reads: its own ascending; chunk 0's (the micro-batch's last) descending;
    # a joint pass the micro-batch's last B pass
    f_end = [[None] * n for _ in range(stages)]
    b_end = [[None] * n for _ in range(stages)]
    pos_f, pos_b, pos_w = [0] * stages, [0] * stages, [0] * stages
    free = [0.0] * stages
    head_b = [s == last or s > last - tokenwise for s in range(stages)]  # B reads its own forward
    whole_b = [chunk_order and not ascending[s] and (s == last or (tokenwise and s == last - tokenwise))
               for s in range(stages)]  # B waits for the micro-batch's last chunk's forward (here or next)

    def candidate(s: int):
        """The stage's pass that can start earliest: (start, rank, kind), or None."""
        best = None
        i = pos_b[s]
        if i < n:
            idx = order_b[s][i]
            at, ok = 0.0, True
            if head_b[s]:
                v = f_end[s][idx]
                ok = v is not None
                if ok:
                    at = max(at, v)
            if ok and s < last:
                v = b_end[s + 1][idx]
                ok = v is not None
                if ok:
                    at = max(at, v + bh[s + 1])
            if ok and whole_b[s]:
                v = f_end[s if s == last else s + 1][idx - idx % chunks + chunks - 1]
                ok = v is not None
                if ok:
                    at = max(at, v)
            if ok:
                best = (max(at, free[s]), 0)
        i = pos_f[s]
        if i < n:
            if s == 0:
                at = 0.0
            else:
                v = f_end[s - 1][i]
                at = None if v is None else max(0.0, v + fh[s - 1])
            if at is not None:
                key = (max(at, free[s]), 1)
                if best is None or key < best:
                    best = key
        i = pos_w[s]
        if i < len(order_w[s]):
            idx = order_w[s][i]
            m0 = idx - idx % chunks
            if jointly[s]:
                v = b_end[s][m0 + chunks - 1 if ascending[s] else m0]
            else:
                v = b_end[s][idx if ascending[s] else m0]
            if v is not None:
                key = (max(max(0.0, v), free[s]), 2)
                if best is None or key < best:
                    best = key
        return best

    version = [0] * stages
    heap = []

    def refresh(s: int) -> None:
        version[s] += 1
        c = candidate(s)
        if c is not None:
            heapq.heappush(heap, (c[0], c[1], s, version[s]))

    for s in range(stages):
        refresh(s)
    left = stages * (2 * n) + sum(len(o) for o in order_w)
    while left:
        if not heap:
            raise TrainingError("chunk_ends: no pass can start (an internal error)")
        start, rank, s, v = heapq.heappop(heap)
        if v != version[s]:
            continue
        if rank == 0:
            idx = order_b[s][pos_b[s]]
            b_end[s][idx] = free[s] = start + bwd[s]
            pos_b[s] += 1
        elif rank == 1:
            f_end[s][pos_f[s]] = free[s] = start + fwd[s]
            pos_f[s] += 1
        else:
            free[s] = start + wdur[s]
            pos_w[s] += 1
        left -= 1
        for t in (s - 1, s, s + 1):
            if 0 <= t < stages:
                refresh(t)
    return free
