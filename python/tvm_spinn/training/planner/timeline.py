"""A planned step's pipeline as a timeline of its passes, in the order the bits fix.

The step's pipeline term (:func:`.step._step_time`) counts ``slots - 1`` slots of the slowest
stage and each stage's fill and drain term once: the slots as independent inputs of a 1F1B
pipeline. With token chunks (:attr:`.records.Split.chunks`) a micro-batch's chunks are not
independent: its input-gradient passes run in descending chunk order once its last chunk went
forward through every stage, and its weight-gradient passes in ascending chunk order after its
chunk-0 input-gradient pass (:mod:`tvm_spinn.training.chunk_schedule`). :func:`pipeline_timeline`
runs the planned stages' passes (:attr:`.records.StepTime.passes_s`) through
:func:`~tvm_spinn.training.chunk_schedule.chunk_ends` both ways, and with each block stage's
weight-gradient passes of a micro-batch run as one GEMM pass over its tokens (the same
additions in the same order: the same bits). :func:`charge_chunk_order` charges the split search
that order: a chunked split's pipeline is the longer of its term and its passes' ordered timeline
(:func:`~tvm_spinn.training.chunk_schedule.chunk_ends`).
"""

from __future__ import annotations

import dataclasses

from ..chunk_schedule import chunk_ends
from .model import _block_gemms
from .records import Split, StepTime
from .slot import _pass_seconds


def pipeline_timeline(spec, split: Split, step: StepTime, seq: int, arch, comms) -> dict:
    """Seconds of the step's pipeline as timelines of its passes.

    Returns ``{"slots": s, "ordered": s, "joint": s}``: the slots as independent inputs (the
    planner's assumption; within a few hand-overs of :attr:`StepTime.pipeline_s`), the chunks in
    the order the bits fix, and that order with each block stage's weight-gradient passes of a
    micro-batch as one pass over its tokens: a chunk's weight-gradient pass times the ratio of
    a layer's weight-gradient GEMMs over the micro-batch's ``micro_batch x seq`` rows to those
    over a chunk's (resident weights, as the 24-board plan's stages keep them).

    A step without :attr:`StepTime.passes_s` (not the planner's): ``ValueError``."""
    if not step.passes_s:
        raise ValueError("pipeline_timeline: the step has no passes (StepTime.passes_s is empty: not a planned step)")
    f, b, w, hand_f, hand_b = (list(v) for v in zip(*step.passes_s))
    tokenwise = 1 if split.head_tp else 0
    slots = max(chunk_ends(1, split.slots, f, b, w, hand_f, hand_b, tokenwise=tokenwise, chunk_order=False))
    ordered = max(chunk_ends(split.micro_batches, split.chunks, f, b, w, hand_f, hand_b, tokenwise=tokenwise))
    tokens = split.micro_batch * seq // split.chunks
    chunk = _pass_seconds(arch, _block_gemms(spec, tokens, seq, split.tp, split.micro_batch, split.chunks)[0],
                          comms, True)[2]
    whole = _pass_seconds(arch, _block_gemms(spec, split.micro_batch * seq, seq, split.tp, split.micro_batch, 1)[0],
                          comms, True)[2]
    # a block stage's W pass over the micro-batch: its chunk's W pass times the GEMMs' ratio
    joint = [w_i * whole / chunk if i < split.pp and w_i > 0 and chunk > 0 else None for i, w_i in enumerate(w)]
    joint_s = max(chunk_ends(split.micro_batches, split.chunks, f, b, w, hand_f, hand_b, tokenwise=tokenwise,
                             joint_weight_s=joint))
    return {"slots": slots, "ordered": ordered, "joint": joint_s}


def charge_chunk_order(split: Split, step: StepTime) -> StepTime:
    """The step with its pipeline at least its passes' timeline in the chunk order the bits fix.

    A split with token chunks (:attr:`.records.Split.chunks` > 1) runs each micro-batch's
    input-gradient passes in descending chunk order after its last chunk's forward through the
    last stage, and its weight-gradient passes after the stage's chunk-0 input-gradient pass;
    the pipeline term counts its slots as independent. The step's pipeline (and its bubble) is
    the longer of the two; the other parts are the step's. A split without chunks, or a step
    without :attr:`StepTime.passes_s`, is returned as it is (its slots are independent)."""
    if split.chunks == 1 or not step.passes_s:
        return step
    f, b, w, hand_f, hand_b = (list(v) for v in zip(*step.passes_s))
    ordered = max(chunk_ends(split.micro_batches, split.chunks, f, b, w, hand_f, hand_b,
                             tokenwise=1 if split.head_tp else 0))
    if ordered <= step.pipeline_s:
        return step
    return dataclasses.replace(step, pipeline_s=ordered, bubble_s=step.bubble_s + ordered - step.pipeline_s)
