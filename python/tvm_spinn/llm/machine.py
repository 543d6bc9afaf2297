"""The LLM planner on a machine as it is: stages on boards with dead chips or links.

The planner's ``pipeline`` placement (:func:`tvm_spinn.llm.plan.plan`) maps each distinct
stage once on a whole board and puts stage ``j`` on board ``order[j % boards]`` of
:func:`tvm_spinn.target.faults.chain_boards` (the usable boards, whole ones first). A stage that
lands on a board with dead chips or dead on-board links runs on that board's live chips: it is
mapped again on :func:`~tvm_spinn.target.faults.board_view` of that board (boards faulty alike
share the mapping), so its tensor-parallel degree, its collectives' routes and its SRAM are
those of the board as it is.
"""

from __future__ import annotations

from typing import Callable, Sequence

__all__ = ["remap_on_boards", "boards_used"]


def remap_on_boards(chain: list, pieces: Sequence, arch, order: Sequence[int], board, map_stage: Callable,
                    head_stages: int) -> list:
    """``chain`` with every stage whose board is not whole mapped again on that board.

    Parameters
    ----------
    chain : list
        The stages in token order (the last ``head_stages`` of them the LM head's), mapped on
        the whole board ``board``.
    pieces : sequence
        Each stage's programs (what ``map_stage`` maps).
    arch : SpinnArch
        The system.
    order : sequence of int
        The boards the chain runs on: stage ``j`` on ``order[j % len(order)]``.
    board : SpinnArch
        The whole board the stages were mapped on.
    map_stage : callable
        ``map_stage(pieces, view, is_head)`` maps one stage's programs on a board view.
    head_stages : int
        How many of the chain's last stages are the head's (no KV cache).

    Returns
    -------
    list
        The chain, the stages on boards with faults replaced.
    """
    from ..target.faults import board_view

    views: dict = {}
    out = []
    for j, (stage, programs) in enumerate(zip(chain, pieces)):
        b = order[j % len(order)]
        if b not in views:
            views[b] = board_view(arch, b)
        view = views[b]
        out.append(stage if view == board else map_stage(programs, view, j >= len(chain) - head_stages))
    return out


def boards_used(arch, stages: int) -> tuple[int, ...]:
    """The boards a chain of ``stages`` board stages runs on (sorted ids; never a dead one)."""
    from ..target.faults import chain_boards

    order = chain_boards(arch)
    return tuple(sorted({order[j % len(order)] for j in range(stages)}))
