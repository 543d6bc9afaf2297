"""One block on one chunk of the prompt: the module, its example arguments, its programs
(described once per chunk size and context) and their mapping on a system smaller than a board."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..spec import ModelSpec


def _plan_module():
    # ``tvm_spinn.llm.plan`` is the function the package exports; the module by its full name
    return importlib.import_module("..plan", __package__)


def _chunk_step_class():
    from ..graphs import LayerStep

    class _Chunk(LayerStep):
        """One block on a chunk of ``C`` prompt tokens after ``P`` earlier ones:
        ``forward(x (b, C, hidden), k_cache (b * kv_heads, head_dim, P + C), v_cache (b *
        kv_heads, P + C, head_dim), mask (C, P + C)[, cos, sin])`` -> ``(x, k, v)``; the chunk's
        keys and values (``k``, ``v``) are written into the cache's last ``C`` slots, which the
        attention reads with the earlier ones (planning only: shapes, not values, matter)."""

        def forward(self, x, k_cache, v_cache, mask, *rope):
            def cache_fn(i, k_t, v):
                return k_cache, v_cache, k_t, v

            cos, sin = (list(rope) + [None, None])[:2]
            return self._layer(0, x, cache_fn, mask, cos, sin)

    return _Chunk


def ChunkStep(model, spec: ModelSpec, context: int, fuse: bool = True):
    """The block of ``model`` (a one-block model) on a chunk attending over ``context`` keys
    (see the returned module's docstring); ``fuse``: the projections that read one input as one
    GEMM each (:class:`~tvm_spinn.llm.graphs.LayerStep`), or each its own."""
    return _chunk_step_class()(model, spec, context, fuse=fuse).eval()


#: The context's axes among :func:`_chunk_args` (argument index -> {axis: symbol}): the keys of
#: the K cache, the V cache and the mask
_CONTEXT_DIMS = {1: {2: "context"}, 2: {1: "context"}, 3: {1: "context"}}


#: The chunk's and the context's axes among :func:`_chunk_args`: the hidden state's and the
#: rotary tables' tokens, the mask's rows (the chunk) and the context's axes
_CHUNK_DIMS = {0: {1: "chunk"}, 1: {2: "context"}, 2: {1: "context"}, 3: {0: "chunk", 1: "context"},
               4: {1: "chunk"}, 5: {1: "chunk"}}


#: The example sizes the block is exported at with both symbolic (distinct, so that torch keeps
#: them two symbols; a chunk of at least 2, as the sizes bound to it: torch specializes 1)
_EXAMPLE_CHUNK, _EXAMPLE_CONTEXT = 4, 12


def _chunk_args(spec: ModelSpec, chunk: int, context: int) -> tuple:
    import torch

    d, kvh = spec.head_dim, spec.kv_heads
    with torch.device("meta"):
        args = [torch.zeros(1, chunk, spec.hidden), torch.zeros(kvh, d, context), torch.zeros(kvh, context, d),
                torch.zeros(chunk, context)]
        if spec.family != "gpt2":  # rotary tables of the rotated channels (GPT-J: the first rotary_dim)
            r = spec.rotary_dim or d
            args += [torch.zeros(1, chunk, r), torch.zeros(1, chunk, r)]
    return tuple(args)


def _cfg_key(cfg: dict) -> str:
    import json

    return json.dumps(cfg, sort_keys=True, default=str)


def _describe_chunk(cfg: dict, spec: ModelSpec, target, dtype: str, chunk: int, context: int, memo: dict,
                    g: int = 1, fuse: bool = True):
    """The chunk block's programs (described once per config, slice over ``g`` boards, chip,
    dtype, chunk, context and ``fuse``: see :func:`ChunkStep`); ``spec``: the slice's
    (:func:`tvm_spinn.llm.board_tp.slice_block`)."""
    from ...target import arch_of
    from .. import board_tp
    from ..describe import bind_dims, describe, describe_imported, imported
    from ..spec import spec_of

    key = ("chunk", _cfg_key(cfg), g, repr(arch_of(target).replace(chips=1, name="")), dtype, chunk, context, fuse)
    if key not in memo:
        P = _plan_module()
        model_key = ("model", _cfg_key(cfg), g)
        if model_key not in memo:
            memo[model_key] = (P._meta_model(cfg, spec) if g == 1 else
                               board_tp.slice_block(cfg, spec_of(cfg), g)[1])
        model = memo[model_key]
        args = _chunk_args(spec, chunk, context)
        # the block imported once with the chunk and the context symbolic (the hidden state's
        # tokens, the cache's and the mask's key axis), bound to each chunk size and context:
        # the module their own import gives (the block's graph depends on neither value, from a
        # chunk of 2 on: one token's attention skips a reshape); failing that, once per chunk
        # size with the context symbolic; where torch ties the context to a constant, each
        # context is exported alone
        dims = {i: axes for i, axes in _CHUNK_DIMS.items() if i < len(args)}
        block_key = ("block-imported", _cfg_key(cfg), g, fuse)
        if block_key not in memo:
            try:
                memo[block_key] = imported(ChunkStep(model, spec, _EXAMPLE_CONTEXT, fuse),
                                           _chunk_args(spec, _EXAMPLE_CHUNK, _EXAMPLE_CONTEXT), dims=dims,
                                           derived=True)
            except Exception:  # noqa: BLE001 - torch's constraint errors have no common base
                memo[block_key] = None
        described = None
        if chunk >= 2 and memo[block_key] is not None:
            mod, n_weights = memo[block_key]
            try:
                bound = bind_dims(mod, dims, {"chunk": chunk, "context": context})
            except ValueError:  # torch kept a size constant: not this module
                bound = None
            if bound is not None:
                described = describe_imported(bound, n_weights, target, dtype)
        if described is None:
            import_key = ("chunk-imported", _cfg_key(cfg), g, chunk, fuse)
            if import_key not in memo:
                try:
                    memo[import_key] = imported(ChunkStep(model, spec, context, fuse), args, dims=_CONTEXT_DIMS)
                except Exception:  # noqa: BLE001 - torch's constraint errors have no common base
                    memo[import_key] = None
            if memo[import_key] is None:
                described = describe(ChunkStep(model, spec, context, fuse), args, target, dtype)
            else:
                mod, n_weights = memo[import_key]
                described = describe_imported(bind_dims(mod, _CONTEXT_DIMS, {"context": context}), n_weights,
                                              target, dtype)
        memo[key] = ([d.program for d in described], {tuple(int(x) for x in a.shape) for a in args[1:]})
    return memo[key]


@dataclass(frozen=True)
class _Alone:
    latency_s: float
    handoff_gather_bytes: int = 0


def _map_alone(described: list, arch, weights: str) -> _Alone:
    """Programs on the whole of a system smaller than a board, one after another
    (:func:`tvm_spinn.llm.plan._map`: no board ledger, no hand-over)."""
    return _Alone(_plan_module()._map(described, arch, weights).latency_s)
