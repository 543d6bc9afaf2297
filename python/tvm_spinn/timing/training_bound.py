"""The plan-independent lower bound of one fp32 training step of a decoder-only transformer.

A training step is described as a :class:`~tvm_spinn.timing.bounds.Workload` and bounded by
:func:`~tvm_spinn.timing.bounds.physical_bound` (the same closed formulas as an inference step,
so compute, memory and communication mean the same there and here):

* **compute**: ``6 N tokens`` FLOPs (Kaplan et al. 2020; Narayanan et al. 2021 give the same
  leading term): every weight of a GEMM takes part in one multiply-accumulate per token in the
  forward pass and two in the backward pass (the input gradient and the weight gradient), so
  ``3 N tokens`` fp32 MACs on the M4F cores of the whole system. ``N`` counts the weights of
  the GEMMs: every block's projections and the LM head (a tied head is the embedding table used
  as a GEMM). The attention's score and value matmuls, element-wise work and any recomputation
  are left out, so every plan does at least this;
* **memory**: what a step must read at least once: every parameter and every optimizer-state
  element (the update reads the state and the parameter; AdamW's two moments, SGD momentum's
  one), the token ids and labels; gradients and activations are produced inside the step and
  could stay where they are made, so they are not counted;
* **communication**: when that state does not fit one board, one sequence's residual stream
  (``seq x hidden`` fp32) must cross every board on its path (the chain of
  :func:`~tvm_spinn.timing.bounds.physical_bound`).

Nothing here reads a split, a micro-batch count or a ZeRO stage: ``efficiency = bound / time``
ranks training plans as it ranks inference plans.
"""

from __future__ import annotations

from ..target.arch import SpinnArch
from .bounds import PhysicalBound, Workload, physical_bound

__all__ = ["gemm_weights", "training_workload", "training_bound", "OPTIMIZER_STATES"]

#: fp32 state elements an optimizer keeps per parameter: AdamW the first and second moments,
#: SGD with momentum its velocity, plain SGD none.
OPTIMIZER_STATES = {"adamw": 2, "momentum": 1, "sgd": 0}
#: Bytes per token of the step's inputs: an int64 token id and an int64 label.
TOKEN_BYTES = 16


def gemm_weights(spec) -> int:
    """Weights of the GEMMs of a decoder-only transformer: every block's attention and MLP
    projections and the LM head (``vocab x hidden``, tied or not); biases, norms and the
    embedding gathers excluded.

    Parameters
    ----------
    spec
        The model's sizes (attributes ``family``, ``layers``, ``hidden``, ``heads``,
        ``kv_heads``, ``head_dim``, ``intermediate``, ``vocab``), e.g. a
        :class:`tvm_spinn.llm.ModelSpec`.
    """
    h, i = spec.hidden, spec.intermediate
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    mlp = 3 if spec.family == "llama" else 2
    return spec.layers * (h * (q + 2 * kv) + q * h + mlp * h * i) + spec.vocab * h


def training_workload(spec, tokens: int, seq: int, optimizer: str) -> Workload:
    """The :class:`Workload` of one training step of ``tokens`` tokens in sequences of ``seq``.

    Parameters
    ----------
    spec
        The model's sizes (as :func:`gemm_weights`, plus ``params``).
    tokens : int
        Tokens the step trains on (global batch x sequence length).
    seq : int
        Tokens per sequence: the residual stream one sequence hands across a board cut.
    optimizer : {"adamw", "momentum", "sgd"}
        Which state the update reads (:data:`OPTIMIZER_STATES`).

    Returns
    -------
    Workload
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    n = gemm_weights(spec)
    state = spec.params * 4 * (1 + OPTIMIZER_STATES[optimizer])
    return Workload(macs_fp32=3 * n * int(tokens), read_bytes=state + TOKEN_BYTES * int(tokens),
                    handover_bytes=int(seq) * spec.hidden * 4,
                    description={"gemm_weights": n, "tokens": int(tokens), "state_bytes": state,
                                 "flops": 6 * n * int(tokens), "optimizer": optimizer})


def training_bound(spec, tokens: int, seq: int, optimizer: str, arch: SpinnArch) -> PhysicalBound:
    """:func:`~tvm_spinn.timing.bounds.physical_bound` of :func:`training_workload` on ``arch``."""
    return physical_bound(training_workload(spec, tokens, seq, optimizer), arch)
