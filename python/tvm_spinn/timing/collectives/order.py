"""The fixed reduction order: the one order of additions a bit-exact all-reduce keeps, whatever the
chip count.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def reduction_order(logical: int) -> tuple[tuple[int, int], ...]:
    """The fixed order in which ``logical`` partial sums are added, independent of chip count.

    A balanced pairwise tree over *logical* ranks (shards of the reduced dimension, fixed by the
    model, not by the plan): level ``w = 1, 2, 4, ...`` adds partial ``left + w`` into ``left``
    for every ``left`` a multiple of ``2w``; the result ends in partial 0. A missing right
    operand (``left + w >= logical``) is skipped, never replaced by zero: ``-0.0 + 0.0`` is
    ``+0.0``, so padding would change bits.

    A plan on any number of chips reproduces these bits when each chip owns an aligned block of
    logical ranks (:func:`chip_blocks`): the chip adds its block in this order (the steps inside
    the block), and the binomial tree all-reduce over the chips (:func:`all_reduce`,
    ``reproducible=True``) performs exactly the remaining steps, in this order.

    Parameters
    ----------
    logical : int
        Number of logical partial sums (>= 1).

    Returns
    -------
    tuple of (int, int)
        ``(left, right)`` pairs, in execution order: ``partial[left] += partial[right]``.
    """
    if not isinstance(logical, (int, np.integer)) or logical < 1:
        raise ValueError(f"logical must be a positive integer, got {logical!r}")
    steps, width = [], 1
    while width < logical:
        steps += [(left, left + width) for left in range(0, logical - width, 2 * width)]
        width *= 2
    return tuple(steps)


def chip_blocks(logical: int, chips: int) -> tuple[tuple[int, int], ...]:
    """Blocks of logical ranks each chip owns so that :func:`reduction_order` is kept.

    Blocks are aligned subtrees: the smallest power of two ``b`` with ``ceil(logical / b) <=
    chips``; chip ``r`` owns ``[r b, min((r + 1) b, logical))``. Chips past the last block
    hold no partial sum of this reduction.

    Parameters
    ----------
    logical : int
        Number of logical partial sums.
    chips : int
        Chips available for the reduction.

    Returns
    -------
    tuple of (int, int)
        ``(start, stop)`` per chip that holds partial sums, in rank order.
    """
    if not isinstance(chips, (int, np.integer)) or chips < 1:
        raise ValueError(f"chips must be a positive integer, got {chips!r}")
    reduction_order(logical)  # validates logical
    block = 1
    while -(-logical // block) > chips:
        block *= 2
    return tuple((start, min(start + block, logical)) for start in range(0, logical, block))


def fixed_order_sum(partials: Sequence[np.ndarray]) -> np.ndarray:
    """Reference sum of logical partials in :func:`reduction_order` (a new array).

    Parameters
    ----------
    partials : sequence of numpy.ndarray
        One array per logical rank, all of one shape and dtype.

    Returns
    -------
    numpy.ndarray
    """
    acc = [np.array(p, copy=True) for p in partials]
    for left, right in reduction_order(len(acc)):
        acc[left] = acc[left] + acc[right]
    return acc[0]
