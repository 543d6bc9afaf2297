"""Accuracy cost of int8 weights, narrow hand-overs and narrow all-reduces, measured against float32 logits.

Three effects are measured on a transformers causal LM, each against the same model in float32
(PyTorch, no rounding) on the same token sequence:

* **int8 weights**: the model compiled with ``tvm_spinn.llm.compile(quantize=True)`` (int8
  weight GEMMs: int8 weights and int8 activation operands, calibrated on seeded random prompts;
  the attention matmuls float32, as the KV cache) and run
  on the simulator. Its logits come from :func:`compiled_logits`: a prefill of the first tokens,
  then the decode step fed the sequence's further tokens one by one (teacher forcing), so every
  scored position is scored by the programs the product runs.
* **hand-over precision**: a pipeline passes the hidden state (the residual stream) from one
  stage to the next at a block boundary. :func:`handover_rounding` emulates a narrower hand-over
  by rounding each block's output with PyTorch forward hooks: ``fp16`` (round to nearest
  float16 and back) or ``int8`` (per-tensor symmetric: ``scale = max|x| / 127`` over the whole
  handed-over tensor, ``q = clip(round(x / scale), -127, 127)``, ``x' = q * scale``). By default
  every block boundary is a hand-over (one stage per block): the most hand-overs a pipeline
  makes; a split with fewer stages rounds less often.
* **all-reduce wire type**: a block tensor-parallel over ``T`` boards splits the K dimension of
  the GEMMs that end its attention and its MLP (the attention's output projection: the heads;
  the MLP's down projection: the intermediate columns), so each board holds a partial sum of
  their output, all-reduced across the boards. :func:`reduce_rounding` emulates a narrowed
  wire with PyTorch forward hooks, the roundings of the fixed schedule the plan times
  (:mod:`tvm_spinn.llm.wire`): each board's partial sum (its contiguous share of K, board ``j``
  the ``j``-th) narrowed once (:func:`narrow`: ``fp16`` or ``bf16`` round to nearest even,
  ``int8`` per chunk of :data:`~tvm_spinn.llm.wire.INT8_CHUNK` elements of the row with an
  fp32 scale each), the ``T`` narrowed sums widened and added in fp32 in board order (the
  share's owner), the total narrowed once again (the reduced row travels on narrowed), then the
  bias added once. ``int32`` (the int8 GEMMs' exact accumulators) is no rounding.

Metrics (:class:`Accuracy`): the logits' relative error (``max|d| / max|ref|`` and
``mean|d| / mean|ref|`` over all positions and vocabulary entries), the share of positions whose
top-1 token equals float32's, and the perplexity ratio (variant / float32) on the same tokens.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from .spec import LLMError

__all__ = ["Accuracy", "HANDOVERS", "REDUCES", "round_fp16", "round_bf16", "round_int8", "handover_rounding",
           "blocks_of", "split_gemms", "round_int8_chunks", "narrow", "split_sum", "reduce_rounding", "torch_logits", "compiled_logits", "compare"]

#: Hand-over precisions :func:`handover_rounding` emulates (``fp32`` is no rounding)
HANDOVERS = ("fp32", "fp16", "int8")
#: Wire types of the all-reduces across boards :func:`reduce_rounding` emulates (``int32``: the
#: exact sums, no rounding; :data:`tvm_spinn.llm.plan.REDUCE_BYTES`)
REDUCES = ("int32", "fp16", "bf16", "int8")


def round_fp16(x):
    """``x`` (a torch tensor) rounded to the nearest float16 and back to its dtype."""
    import torch

    return x.to(dtype=torch.float16).to(dtype=x.dtype)


def round_bf16(x):
    """``x`` (a torch tensor) rounded to the nearest bfloat16 (ties to even) and back to its dtype."""
    import torch

    return x.to(dtype=torch.bfloat16).to(dtype=x.dtype)


def round_int8(x):
    """``x`` (a torch tensor) through per-tensor symmetric int8 and back.

    ``scale = max|x| / 127``; ``q = clip(round(x / scale), -127, 127)``; returns ``q * scale``
    (so the error of each element is at most ``scale / 2``). An all-zero tensor is returned as is.
    """
    import torch

    amax = x.detach().abs().max()
    if amax == 0:
        return x
    scale = amax / 127
    return torch.clamp(torch.round(x / scale), -127, 127) * scale


def round_int8_chunks(x, chunk: "int | None" = None):
    """``x`` (a torch tensor, float32) through the int8 wire of the all-reduces and back
    (:mod:`tvm_spinn.llm.wire`): the last axis (a row) cut into chunks of ``chunk`` elements
    (default :data:`tvm_spinn.llm.wire.INT8_CHUNK`; the last chunk the rest), each chunk
    ``s = max|x| / 127`` (fp32), ``q = clip(rint(x / s), -127, 127)`` (ties to even), read back
    as ``q * s``; an all-zero chunk (``s = 0``) reads back as zeros.
    """
    import torch

    from .wire import INT8_CHUNK

    c = INT8_CHUNK if chunk is None else chunk
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise LLMError(f"chunk must be a positive integer, got {chunk!r}")
    n = x.shape[-1]
    pad = (-n) % c
    # zeros pad the last chunk: they change neither its max nor its elements' roundings
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    blocks = xp.reshape(*xp.shape[:-1], (n + pad) // c, c)
    scale = blocks.detach().abs().amax(dim=-1, keepdim=True) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(blocks / safe), -127, 127)
    out = torch.where(scale > 0, q * scale, torch.zeros_like(blocks)).reshape(*xp.shape)
    return out[..., :n] if pad else out


_ROUND = {"fp16": round_fp16, "bf16": round_bf16, "int8": round_int8}
#: The all-reduce wires' roundings (``int8``: per chunk, not the hand-overs' per tensor)
_WIRE_ROUND = {"fp16": round_fp16, "bf16": round_bf16, "int8": round_int8_chunks}


def narrow(x, wire: str):
    """``x`` (a torch tensor) through the all-reduce ``wire`` (:data:`REDUCES`) and back: the
    one rounding of a row each board sends or an owner sends on (``int32``: unchanged)."""
    if wire not in REDUCES:
        raise LLMError(f"reduce must be one of {list(REDUCES)}, got {wire!r}")
    return _WIRE_ROUND[wire](x) if wire != "int32" else x


def blocks_of(model) -> list:
    """The decoder blocks of a transformers GPT-2 / Llama-style causal LM, in order."""
    for path in ("transformer.h", "model.layers"):
        obj = model
        try:
            for name in path.split("."):
                obj = getattr(obj, name)
        except AttributeError:
            continue
        return list(obj)
    raise LLMError(f"{type(model).__name__} has neither transformer.h nor model.layers: no decoder blocks to hook")


@contextlib.contextmanager
def handover_rounding(model, handover: str, boundaries=None):
    """Within the ``with`` block, the hidden state after each block in ``boundaries`` is rounded.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        GPT-2 / Llama-style causal LM (see :func:`blocks_of`).
    handover : {"fp32", "fp16", "int8"}
        Precision of the hand-over (``fp32``: no rounding).
    boundaries : iterable of int, optional
        Indices of the blocks whose output is handed over; default every block but the last
        (whose output stays on the stage that holds the final norm and LM head).
    """
    if handover not in HANDOVERS:
        raise LLMError(f"handover must be one of {list(HANDOVERS)}, got {handover!r}")
    blocks = blocks_of(model)
    idx = sorted(set(range(len(blocks) - 1) if boundaries is None else boundaries))
    if any(not 0 <= i < len(blocks) for i in idx):
        raise LLMError(f"boundaries {idx} outside the model's {len(blocks)} blocks")
    handles = []
    if handover != "fp32":
        fn = _ROUND[handover]

        def hook(_module, _args, out):
            # a block returns its hidden state, alone or first in a tuple (transformers versions differ)
            if isinstance(out, tuple):
                return (fn(out[0]), *out[1:])
            return fn(out)

        handles = [blocks[i].register_forward_hook(hook) for i in idx]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


def split_gemms(model) -> list:
    """The GEMMs whose K dimension a block tensor-parallel over boards splits, in block order:
    each block's attention output projection and MLP down projection (Llama: ``self_attn.o_proj``,
    ``mlp.down_proj``; GPT-2: ``attn.c_proj``, ``mlp.c_proj``)."""
    out = []
    for i, block in enumerate(blocks_of(model)):
        for paths in (("self_attn.o_proj", "attn.c_proj"), ("mlp.down_proj", "mlp.c_proj")):
            found = [m for m in (_submodule(block, p) for p in paths) if m is not None]
            if not found:
                raise LLMError(f"block {i} ({type(block).__name__}) has none of {list(paths)}: no split GEMM to hook")
            out.append(found[0])
    return out


def _submodule(module, path: str):
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def split_sum(x, weight, bias, boards: int, wire: str, k_major: bool = False):
    """``x @ W + bias`` with K split over ``boards`` and all-reduced in the ``wire`` type.

    ``weight``: ``(out, K)`` (``torch.nn.Linear``) or, ``k_major``, ``(K, out)`` (transformers'
    ``Conv1D``). Board ``j`` holds columns ``j K / boards .. (j + 1) K / boards - 1`` of K; its
    partial sum is narrowed to ``wire`` (:func:`narrow`), the narrowed sums added in fp32 in
    board order, the total narrowed once, then ``bias`` (or None) added.
    """
    if wire not in REDUCES:
        raise LLMError(f"reduce must be one of {list(REDUCES)}, got {wire!r}")
    k = x.shape[-1]
    if isinstance(boards, bool) or not isinstance(boards, int) or boards < 1 or k % boards:
        raise LLMError(f"boards must be a positive integer dividing the GEMM's K={k}, got {boards!r}")
    w = weight if k_major else weight.t()
    def fn(t):
        return narrow(t, wire)

    step = k // boards
    total = None
    for j in range(boards):  # a fixed order: board 0 first
        part = fn(x[..., j * step:(j + 1) * step] @ w[j * step:(j + 1) * step])
        total = part if total is None else total + part
    total = fn(total)
    return total if bias is None else total + bias


@contextlib.contextmanager
def reduce_rounding(model, reduce: str, boards: int):
    """Within the ``with`` block, every :func:`split_gemms` GEMM of ``model`` sums its K over
    ``boards`` boards with a ``reduce`` wire (:func:`split_sum`); ``int32``: no hook (exact sums).

    ``boards`` must divide the heads and the intermediate size (each board a whole share, as the
    ``board_tp`` placement splits a block).
    """
    if reduce not in REDUCES:
        raise LLMError(f"reduce must be one of {list(REDUCES)}, got {reduce!r}")
    gemms = split_gemms(model)
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    if isinstance(boards, bool) or not isinstance(boards, int) or boards < 1 or (heads and heads % boards):
        raise LLMError(f"boards must be a positive integer dividing the {heads} attention heads, got {boards!r}")
    inner = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None)
    if inner and inner % boards:
        raise LLMError(f"boards must divide the intermediate size {inner}, got {boards}")
    handles = []
    if reduce != "int32":
        def hook(module, args, _out):
            k_major = not hasattr(module, "in_features")  # Conv1D keeps its weight (in, out)
            return split_sum(args[0], module.weight, module.bias, boards, reduce, k_major)

        handles = [m.register_forward_hook(hook) for m in gemms]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    """Float32 logits ``(batch, n, vocab)`` of ``model`` on token ids ``(batch, n)`` (one forward)."""
    import torch

    with torch.no_grad():
        out = model(torch.from_numpy(np.asarray(ids, dtype=np.int64)), use_cache=False)
    return out.logits.float().numpy()


def compiled_logits(compiled, ids: np.ndarray, prefill: int) -> np.ndarray:
    """Logits of a :class:`~tvm_spinn.llm.CompiledLLM` at positions ``prefill - 1 .. n - 1`` of ``ids``.

    A prefill of the first ``prefill`` tokens, then one decode step per further token of ``ids``
    (teacher forcing: the given token, not the predicted one, is fed), the KV cache staying on
    the device as in ``generate``. Returns ``(batch, n - prefill + 1, vocab)``. ``prefill`` is at
    least 2: an int8 prefill of one token is not calibrated (its attention is a constant 1).
    """
    n = np.shape(ids)[1]
    if not 2 <= prefill <= n:
        raise LLMError(f"prefill must be in [2, {n}] (the sequence's length), got {prefill}")
    return compiled.score(np.asarray(ids, dtype=np.int64), prefill)


@dataclass(frozen=True)
class Accuracy:
    """One variant's logits against float32's on the same tokens.

    ``max_rel_err`` = ``max|d| / max|ref|``; ``mean_rel_err`` = ``mean|d| / mean|ref|`` (all
    positions and vocabulary entries); ``top1`` the share of scored positions whose argmax equals
    float32's; ``ppl_ratio`` the variant's perplexity over float32's on the sequence's next tokens.
    """

    max_rel_err: float
    mean_rel_err: float
    top1: float
    positions: int
    ppl_ratio: float


def _nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean negative log-likelihood of ``targets`` under ``logits`` (float64, log-sum-exp)."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return float(-np.take_along_axis(logp, targets[..., None], axis=-1).mean())


def compare(logits: np.ndarray, ref: np.ndarray, ids: np.ndarray, top1_from: int = 0) -> Accuracy:
    """Metrics of ``logits`` against ``ref`` (both ``(batch, n, vocab)``) on token ids ``ids``.

    ``top1_from``: first position whose top-1 is counted (e.g. the prompt length minus one, to
    count only the positions that predict generated tokens). The perplexity scores every
    ``ids[:, p + 1]`` from the logits at ``p``.
    """
    logits, ref, ids = np.asarray(logits), np.asarray(ref), np.asarray(ids)
    if logits.shape != ref.shape or logits.shape[:2] != ids.shape:
        raise LLMError(f"logits {logits.shape}, reference {ref.shape} and ids {ids.shape} do not agree")
    d = np.abs(logits.astype(np.float64) - ref)
    top = logits[:, top1_from:].argmax(-1) == ref[:, top1_from:].argmax(-1)
    targets = ids[:, 1:]
    ppl_ratio = float(np.exp(_nll(logits[:, :-1], targets) - _nll(ref[:, :-1], targets)))
    return Accuracy(max_rel_err=float(d.max() / np.abs(ref).max()), mean_rel_err=float(d.mean() / np.abs(ref).mean()),
                    top1=float(top.mean()), positions=int(top.size), ppl_ratio=ppl_ratio)
