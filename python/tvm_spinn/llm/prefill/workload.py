"""The prompt's work up to the first token and its plan-independent bound."""

from __future__ import annotations

from ..spec import ModelSpec


def prefill_workload(spec: ModelSpec, prompt: int, dtype: str, handover_itemsize: int = 4):
    """The :class:`~tvm_spinn.timing.bounds.Workload` of a prompt's prefill up to the first token.

    MACs: every block's weight GEMMs for each of the ``prompt`` tokens (``dtype``; a mixture of
    experts: the router and the ``experts_per_token`` experts each token picks), the causal
    attention's two matmuls (fp32: query ``i`` against ``i + 1`` keys, at most a sliding
    window's), and the LM head for the last token. Bytes read: every weight once (a mixture of
    experts: the experts the prompt's tokens can pick, ``min(experts, prompt x experts_per_token)``
    a block, every one of them for a prompt of a few tokens), the vectors and the prompt's
    embedding rows. Hand-over: the prompt's residual stream (``prompt`` rows of
    ``hidden`` elements of ``handover_itemsize`` bytes); sync points: two norms a block and the
    final norm. Largest stretch: as :func:`tvm_spinn.timing.bounds.decode_workload` without a
    cache (the prompt's keys are computed, not read)."""
    from ...timing.bounds import Workload

    itemsize = {"int8": 1, "fp32": 4}[dtype]
    h, i, v = spec.hidden, spec.intermediate, spec.vocab
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    mlp = 3 if spec.family == "llama" else 2
    # a mixture of experts stores every expert and a router; a token runs k of them, the prompt
    # reads those its tokens pick
    stored_experts, per_token = max(1, spec.experts), max(1, spec.experts_per_token)
    read_experts = min(stored_experts, prompt * per_token)
    attn, router = h * (q + 2 * kv) + q * h, spec.experts * h
    block = attn + mlp * h * i * stored_experts + router
    read_block = attn + mlp * h * i * read_experts + router
    tables = (0 if spec.tied_embeddings else v * h) + (spec.max_positions * h if spec.family == "gpt2" else 0)
    vectors = spec.params - spec.layers * block - v * h - tables
    rows = prompt * h * ((0 if spec.tied_embeddings else 1) + (1 if spec.family == "gpt2" else 0))
    window = spec.sliding_window or prompt
    # query i sees min(i + 1, window) keys
    keys = sum(min(j + 1, window) for j in range(prompt)) if window < prompt else prompt * (prompt + 1) // 2
    attention = spec.layers * 2 * spec.heads * spec.head_dim * keys
    gemm = prompt * spec.layers * (attn + mlp * h * i * min(per_token, stored_experts) + router) + v * h
    weights = (spec.layers * read_block + v * h) * itemsize + vectors * 4 + rows * itemsize
    largest = max(attn, mlp * h * i * read_experts, v * h) * itemsize + vectors * 4 + rows * itemsize
    return Workload(macs_int8=gemm if dtype == "int8" else 0,
                    macs_fp32=attention + (gemm if dtype == "fp32" else 0),
                    read_bytes=int(weights), handover_bytes=prompt * h * handover_itemsize, handover_rows=prompt,
                    sync_points=2 * spec.layers + 1, largest_phase_bytes=int(min(largest, weights)),
                    description={"prompt": prompt, "dtype": dtype, "weight_bytes_read": int(weights),
                                 "attention_macs": attention, "gemm_macs": gemm})


def prefill_bound(spec: ModelSpec, prompt: int, dtype: str, arch, handover_itemsize: int = 4):
    """Plan-independent lower bound on the time to first token (a
    :class:`~tvm_spinn.timing.bounds.PhysicalBound` of :func:`prefill_workload` on ``arch``)."""
    from ...timing.bounds import physical_bound

    return physical_bound(prefill_workload(spec, prompt, dtype, handover_itemsize), arch)
