"""What the planner counts of a model: its config, per-rank widths, parameters per stage, GEMMs and FLOPs."""

from __future__ import annotations

from .records import Split


def _spec(config):
    from ...llm.spec import FAMILIES, LLMError, _as_dict, spec_of  # the config reader (json only)

    cfg = _as_dict(config)
    model_type = cfg.get("model_type")
    if model_type in FAMILIES and model_type not in TRAINED_MODEL_TYPES:
        # the counts below know GPT-2's and Llama's blocks only: another block is refused, not
        # planned as one of them (an unknown type is spec_of's error)
        raise LLMError(f"config field 'model_type' is {model_type!r}: training plans model types "
                       f"{', '.join(TRAINED_MODEL_TYPES)}")
    return spec_of(cfg)


#: model types whose blocks the training planner counts (GPT-2's and the Llama family's)
TRAINED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "phi3")


def _widths(spec, tp: int = 1):
    """``(hidden, intermediate, query, key/value)`` widths on one TP rank: the heads and the MLP
    split by ``tp``; key/value heads split too, or, with more ranks than key/value heads
    (grouped-query attention), one key/value head on each rank (replicated, as Megatron does)."""
    kv_heads = spec.kv_heads // tp if spec.kv_heads % tp == 0 else 1
    return spec.hidden, spec.intermediate // tp, spec.heads // tp * spec.head_dim, kv_heads * spec.head_dim


def _layer_params(spec, tp: int) -> int:
    """Parameters of one block on one TP rank: column-parallel weights and biases split,
    row-parallel biases and norms replicated."""
    h, i, q, kv = _widths(spec, tp)
    if spec.family == "gpt2":
        split = h * (q + 2 * kv) + (q + 2 * kv) + q * h + 2 * h * i + i
        replicated = h + h + 4 * h  # the two row-parallel biases, two LayerNorms (scale, shift)
    else:
        split = h * (q + 2 * kv) + q * h + 3 * h * i
        split += (q + 2 * kv) * (spec.attention_bias or spec.qkv_bias) + 2 * i * spec.mlp_bias
        replicated = 2 * h + h * spec.attention_bias + h * spec.mlp_bias  # two RMSNorms, row biases
    return split + replicated


def _vocab_rows(spec, width: int) -> int:
    """Rows of the LM head's weight on the busiest of ``width`` vocabulary-parallel ranks of a
    spread head: its whole leaves of the vocabulary's canonical order
    (:func:`~tvm_spinn.training.tp_chain.vocab_leaves`, ``ceil(vocab / leaves)`` rows each),
    consecutive leaves a rank, some ranks one more where ``width`` does not divide them (the
    compiled step's :class:`~tvm_spinn.training.vocab_parallel.VocabShard` assignment); a
    ``1 / width`` share with more ranks than leaves."""
    from ..tp_chain import vocab_leaves

    leaves = vocab_leaves(spec.heads, spec.intermediate, spec.vocab)
    if width > leaves:
        return -(-spec.vocab // width)
    return -(-leaves // width) * -(-spec.vocab // leaves)


def _stage_params(spec, tp: int, pp: int, stage: int, head_tp: int = 0, spread: bool = False) -> int:
    """Parameters on one TP rank of pipeline stage ``stage`` (``stage == pp``: a rank of the
    head's stage of ``head_tp`` chips; ``spread``: the head's rows spread over every stage's
    ranks, :attr:`Split.spread_head`)."""
    h, v = spec.hidden, spec.vocab
    norm = 2 * h if spec.family == "gpt2" else h  # the final norm
    if head_tp and stage == pp:  # the final norm and the LM head (a tied one: the only copy)
        return norm + -(-v // head_tp) * h
    table = -(-v // tp) * h  # vocab-parallel, padded to a multiple of tp
    n = spec.layers // pp * _layer_params(spec, tp)
    if stage == 0:
        # a tied table on a head stage (or spread with the head) hands the token rows to the
        # first stage instead
        n += ((0 if (head_tp or spread) and spec.tied_embeddings else table)
              + (spec.max_positions * h if spec.family == "gpt2" else 0))
    if spread:  # a share of the head's rows on every rank; the final norm on the last stage
        return n + _vocab_rows(spec, tp * pp) * h + (norm if stage == pp - 1 else 0)
    if head_tp:
        return n
    if stage == pp - 1:
        n += 2 * h if spec.family == "gpt2" else h  # the final norm
        if not spec.tied_embeddings or pp > 1:
            n += table  # the LM head (a tied one is the embedding's copy on the last stage)
    return n


def _gathered_params(spec, split: "Split", stage: int) -> int:
    """Of a stage's parameters on one rank, the tables only gathered from (the token embedding
    on the first stage, GPT-2's position table): a pass reads the rows of its tokens only."""
    if stage != 0:
        return 0
    h = spec.hidden
    table = 0 if (split.head_tp or split.spread_head) and spec.tied_embeddings else -(-spec.vocab // split.tp) * h
    return table + (spec.max_positions * h if spec.family == "gpt2" else 0)


def _untouched_rows(spec, seq: int, stage: int, rows: "int | None" = None) -> int:
    """Parameters of a stage's gathered tables whose gradient no step can touch on a rank:
    GPT-2's position rows from ``seq`` on (every sequence of the step takes positions
    ``0 .. seq - 1``), and with sequence parallelism the rows below ``seq`` that none of the
    rank's own tokens take: a rank's embedding adds the position rows of its own tokens of each
    slot and reads no others, the same rows every step and on every replica. ``rows``: the
    distinct positions the busiest rank's tokens take over a step (:func:`_position_rows`;
    default every one below ``seq``). Their gradient is zero on every replica, so the
    data-parallel synchronisation leaves them out (its sum would be those zeros: the bits do not
    change); the update still runs over them (weight decay)."""
    if stage != 0 or spec.family != "gpt2":
        return 0
    h = spec.hidden
    touched = min(spec.max_positions, seq) if rows is None else min(spec.max_positions, seq, rows)
    return (spec.max_positions - touched) * h


def _position_share(split: "Split") -> int:
    """Ranks that split each slot's tokens (sequence parallelism over the TP ranks; 1 without)."""
    return split.tp if split.sequence_parallel and split.tp > 1 else 1


def _position_rows(split: "Split", seq: int) -> int:
    """Distinct positions the busiest rank's tokens take over a step: a slot's ``micro_batch``
    sequences (or a chunk of ``seq / chunks`` consecutive tokens of each) split into contiguous
    row blocks over the :func:`_position_share` ranks as ``np.array_split`` splits them (the
    first ranks one row more), so the first rank's block of ``ceil(tokens / share)`` rows covers
    that many consecutive positions of a chunk (all of its ``seq / chunks`` when the block is at
    least a chunk long), in every one of the ``chunks`` chunks. A rank's sync covers those rows
    whole: the synchronisation waits for its busiest rank."""
    chunks = max(1, split.chunks)
    length = -(-seq // chunks)  # a chunk's positions
    block = -(-split.micro_batch * length // _position_share(split))
    return min(seq, chunks * min(block, length))


def _block_flops(spec, tokens: int, seq: int, tp: int = 1, chunks: int = 1) -> tuple[int, int]:
    """(GEMM FLOPs of one block's forward for ``tokens`` tokens on one of ``tp`` ranks, of it
    the attention's two matmuls): over the full ``seq x seq`` scores (as Megatron counts them),
    or, for sequences cut into ``chunks`` chunks, over the keys up to each chunk's last token
    (chunk ``c`` of ``k``: ``(c + 1) seq / k`` keys), ``(k + 1) / (2 k)`` of the full count."""
    h, i, q, kv = _widths(spec, tp)
    mlp = 3 if spec.family == "llama" else 2
    weights = h * (q + 2 * kv) + q * h + mlp * h * i
    # Q K^T and (softmax) V: 2 * 2 * tokens * seq * q over the full scores
    attention = 2 * 2 * tokens * seq * q * (chunks + 1) // (2 * chunks)
    return 2 * tokens * weights + attention, attention


def _chunk_context(seq: int, chunks: int, chunk: "int | None" = None) -> int:
    """Keys a chunk's queries attend over when a sequence of ``seq`` tokens passes as ``chunks``
    chunks: chunk ``chunk`` (0-based) over the keys up to its last token, ``(chunk + 1) seq /
    chunks``; ``None``: their mean over the chunks, ``seq (chunks + 1) / (2 chunks)``. One
    chunk: ``seq``."""
    if chunk is not None and not 0 <= chunk < max(1, chunks):
        raise ValueError(f"chunk {chunk} of {chunks}")
    if chunks <= 1:
        return seq
    if chunk is None:
        return -(-seq * (chunks + 1) // (2 * chunks))
    return -(-seq * (chunk + 1) // chunks)


def _block_gemms(spec, tokens: int, seq: int, tp: int, sequences: int, chunks: int = 1,
                 chunk: "int | None" = None) -> tuple[list, list]:
    """One block's GEMMs on one of ``tp`` ranks for a slot of ``tokens`` tokens of ``sequences``
    sequences, ``[(m, k, n, batch)]``: the projections (``tokens`` rows; GPT-2's fused Q/K/V
    and its MLP, Llama's separate projections and gated MLP), and attention's two matmuls per
    head and sequence: a whole sequence over the full ``seq`` context (the causal mask applied
    to the full scores, as :func:`_block_flops` counts them); a sequence cut into ``chunks``
    chunks (:attr:`Split.chunks`) over the keys up to each chunk's last token, which are all
    the keys there are when the chunk passes (chunk ``c`` of ``k`` attends over
    ``(c + 1) seq / k``): chunk ``chunk``'s, or (``None``) their mean over the chunks, ``seq (k +
    1) / (2 k)`` (:func:`_chunk_context`). The keys a chunk leaves out are the mask's zeros, so
    the sums keep their terms and order."""
    h, i, q, kv = _widths(spec, tp)
    context = _chunk_context(seq, chunks, chunk)
    if spec.family == "gpt2":
        weights = [(tokens, h, q + 2 * kv, 1), (tokens, q, h, 1), (tokens, h, i, 1), (tokens, i, h, 1)]
    else:
        weights = [(tokens, h, q, 1), (tokens, h, kv, 1), (tokens, h, kv, 1), (tokens, q, h, 1),
                   (tokens, h, i, 1), (tokens, h, i, 1), (tokens, i, h, 1)]
    rows, heads = max(1, tokens // sequences), sequences * (q // spec.head_dim)
    attention = [(rows, spec.head_dim, context, heads), (rows, context, spec.head_dim, heads)]
    return weights, attention


def _attention_at(spec) -> int:
    """Of :func:`_block_gemms`' projections, how many run before the attention's two matmuls (the
    ones that make its queries, keys and values: GPT-2's fused Q/K/V, Llama's three)."""
    return 1 if spec.family == "gpt2" else 3


def model_flops(spec, tokens: int, seq: int, recompute: bool = False, chunks: int = 1) -> int:
    """FLOPs of one step of ``tokens`` tokens: the blocks' and the LM head's GEMMs, forward and
    backward (three passes), plus one more forward of the blocks with full recomputation.
    ``chunks`` > 1: the attention of sequences cut into that many chunks, each over the keys up
    to its last token (what such a step executes; see :func:`_block_flops`)."""
    block, _ = _block_flops(spec, tokens, seq, chunks=chunks)
    head = 2 * tokens * spec.hidden * spec.vocab
    return (4 if recompute else 3) * spec.layers * block + 3 * head
