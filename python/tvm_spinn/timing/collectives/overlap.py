"""An all-reduce streamed between the layer that produces its row and the layer that consumes it.

A row-parallel projection's partial sums need not be complete before the all-reduce starts,
nor the reduced row complete before the next layer starts, where the producer makes the row
chunk by chunk (its output columns in turn) and the consumer reads it chunk by chunk (an
element-wise layer such as a residual add): the collective-matmul decomposition
(Wang et al., ASPLOS 2023). Integer partial sums are exact in any order and an element-wise
consumer computes each element as before, so the bits do not change; only the time does.

:func:`streamed_all_reduce` plays the three out chunk by chunk with the all-reduce's own cost
function (the one the caller plans with): chunk ``i`` of ``C`` is produced at
``(i + 1) / C`` of the producer's time; the all-reduce delivers it once every chunk from any
``j <= i`` on has had the cost of an all-reduce of chunks ``j..i`` since chunk ``j`` was ready
(a link-bound schedule's chunks follow one another on the busiest edge, each paying the
hop latencies once, in the pipeline); the consumer takes ``1 / C`` of its time on each chunk
in order, once it is delivered and the chunk before it is done.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

__all__ = ["MAX_CHUNKS", "streamed_all_reduce"]

#: The most chunks :func:`streamed_all_reduce` plays out: its work grows as the square of the
#: chunks (each chunk's delivery looks at every run that ends with it), and a row cut finer
#: than a few thousand chunks pays each chunk's hop latency for no more overlap.
MAX_CHUNKS = 4096


def streamed_all_reduce(cost_of: Callable[[float], float], nbytes: float, produce_s: float, consume_s: float,
                        chunks: int) -> float:
    """Seconds from the producer's start to the consumer's end, the row streamed in ``chunks``.

    Parameters
    ----------
    cost_of : callable
        ``cost_of(m)``: seconds of the all-reduce of ``m`` bytes of the row (the caller's cost
        function; it must not fall as ``m`` grows).
    nbytes : float
        Bytes of the whole row.
    produce_s : float
        Seconds of the producing layer's work that makes the row column by column (the part of
        it that can hand chunks on as they are done; 0: the row is complete at the start).
    consume_s : float
        Seconds of the consuming layer's work that reads the row element by element (0: none).
    chunks : int
        Chunks the row is cut into (1: produce, all-reduce and consume one after another), at
        most :data:`MAX_CHUNKS`.

    Returns
    -------
    float
        The three's seconds together: ``produce_s + cost_of(nbytes) + consume_s`` with one
        chunk, never more with several, never below ``cost_of(nbytes)``.

    Raises
    ------
    ValueError
        ``chunks`` not an integer in 1..:data:`MAX_CHUNKS`, or a byte count or time negative or not finite.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= MAX_CHUNKS:
        raise ValueError(f"chunks must be an integer in 1..{MAX_CHUNKS}, got {chunks!r}")
    for name, value in (("nbytes", nbytes), ("produce_s", produce_s), ("consume_s", consume_s)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    c = chunks
    # the all-reduce of k consecutive chunks, k = 1..C (the last: the whole row)
    cost = np.array([0.0] + [float(cost_of(nbytes * k / c)) for k in range(1, c + 1)])
    ready = produce_s * np.arange(1, c + 1) / c
    done = 0.0  # the consumer's end of the chunk before
    for i in range(c):
        # chunk i is delivered with the last of the runs j..i that start when chunk j is ready
        # (a max-plus convolution of a general cost: quadratic, vectorised, hence the bound)
        delivered = float(np.max(ready[: i + 1] + cost[i + 1:0:-1]))
        done = max(delivered, done) + consume_s / c
    # (a schedule may always leave the row whole: never dearer than that)
    return min(done, produce_s + cost[c] + consume_s)
