"""Prefill and decode steps of a transformers decoder as torch modules with an explicit KV cache.

``torch.export`` of a transformers model with ``use_cache=True`` returns a ``DynamicCache``
whose size grows with every token, which a static-shape compiler cannot take. These wrappers
reuse the model's own submodules (embeddings, norms, projections, MLPs, LM head) and spell out
attention with the cache as two fixed-size tensors, K^T ``(layers, batch * kv_heads, head_dim,
max_seq_len)`` and V ``(layers, batch * kv_heads, max_seq_len, head_dim)`` (the layouts the
attention GEMMs read), passed in and returned:

* prefill(ids (b, n), [positions | cos, sin]) -> logits of the last token (b, vocab), K, V:
  causal attention over the n prompt tokens; the cache is the prompt's keys/values followed by
  zeros up to ``max_seq_len``;
* decode(ids (b, 1), K, V, write (S,) bool, mask (S,) float, [positions | cos, sin]) -> logits, K, V:
  the new key/value is written at the one position where ``write`` is true (a select, so
  the other entries keep their bits) and the query attends over every slot, with ``mask``
  (0 up to the position, the dtype's minimum beyond it, as transformers' eager mask) added to
  the scores; masked slots get a probability of exactly 0.

With a sliding attention window (Mistral, Phi-3) the cache holds ``slots = min(max_seq_len,
window)`` positions (:meth:`ModelSpec.cache_slots`), a ring: position ``p`` lives in slot ``p %
slots``, so once the window is full each step overwrites the key that just left it, and the
mask admits every written slot. The prefill's causal mask admits only the last ``window`` keys
of each query, and its cache output is the prompt's last ``slots`` keys/values placed in their
ring slots. Attention does not depend on the order of the slots: rotary embeddings are applied
before caching, so each key carries its own position.

Grouped-query attention, biased q/k/v projections (Qwen2) and fused ``qkv_proj`` /
``gate_up_proj`` weights (Phi-3, sliced where transformers splits them) use the model's own
modules. Separate q, k and v projections (and a gated MLP's gate and up projections), which
read one input, run as one GEMM of their weights concatenated along the output columns, the
output sliced where each one's columns begin (``fuse``, the default: :meth:`_Step._fuse`): every
output column is the same dot product with the same weight column, so a float32 GEMM's sums
and an int8 GEMM's int32 sums and per-column scales are those of the separate projections,
and a block runs two weight GEMMs (q/k/v and gate/up).

Gemma-2 mixes local (windowed) and global layers: its cache holds every position in every
layer (slot = position), and its steps take one mask per layer kind (``(2, S)`` for a decode
step, ``(2, n, n)`` inside the prefill; row 0 global, row 1 windowed). Its attention scores and
logits are soft-capped (``cap * tanh(x / cap)``; the scores before the mask, as transformers
does), and each half of a block is normed again before it joins the residual. GPT-J and Falcon
add attention and MLP, both fed by the one LayerNorm, to the residual; GPT-J rotates the first
``rotary_dim`` channels of each head in interleaved pairs (its tables passed in, each value
repeated for its pair), Falcon's fused ``query_key_value`` is sliced as its ``_split_heads``
splits it (multi-query: the queries, then one key and one value head). Mixtral's router picks
each token's top-k experts; with static shapes every expert is evaluated and weighted by its
routing weight (0 where not picked), summed in expert order as transformers sums the picked ones.

The arithmetic follows transformers' eager attention (``softmax(q k^T * scaling + mask) v``),
so greedy tokens match ``generate``. Rotary tables (Llama) are computed by the model's own
``rotary_emb`` on the host and passed in, the exact values transformers uses.
"""

from __future__ import annotations

import torch
from torch import nn

from .spec import ModelSpec

__all__ = ["Prefill", "Decode", "LayerStep", "Head", "causal_mask", "rotary_tables"]


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x, cos, sin):
    # cos/sin: (b, n, d) -> (b, 1, n, d), broadcast over heads (transformers' apply_rotary_pos_emb)
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


def causal_mask(n: int, window: "int | None" = None) -> torch.Tensor:
    """The (n, n) additive mask of a prompt: 0 where query ``i`` sees key ``j`` (``j <= i``, and
    ``j > i - window`` with a sliding window), float32's minimum elsewhere (transformers' mask)."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    seen = j <= i
    if window is not None:
        seen = seen & (j > i - window)
    return torch.where(seen, torch.tensor(0.0), torch.tensor(torch.finfo(torch.float32).min))


def _rotate_every_two(x):
    # GPT-J's rotation of interleaved pairs (channels 2j, 2j+1): (-x[2j+1], x[2j])
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def rotary_tables(model, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (b, n, rotated channels) for integer ``positions`` (b, n), from the
    model's rotary module (GPT-J's: each value repeated for the pair it rotates, as transformers'
    ``apply_rotary_pos_emb`` repeats it)."""
    base = model.transformer if hasattr(model, "transformer") else model.model
    dummy = torch.zeros((), dtype=torch.float32)
    with torch.no_grad():
        if getattr(model.config, "model_type", "") == "gptj":
            sin, cos = base.rotary_emb(dummy, positions)
            return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        return base.rotary_emb(dummy, positions)


def _fusable(linears) -> bool:
    """Whether the ``nn.Linear`` projections ``linears`` (reading one input) can be one GEMM:
    all present, one input width, each with a bias or none with one."""
    if any(m is None or not isinstance(m, nn.Linear) for m in linears):
        return False
    return (len({int(m.weight.shape[1]) for m in linears}) == 1
            and len({m.bias is None for m in linears}) == 1)


def _concatenated(cache: dict, linears, name: str) -> nn.Parameter:
    """The ``name`` tensors (``"weight"`` or ``"bias"``) of ``linears`` concatenated along the
    output columns, built once per ``cache``: the steps given one cache (each prompt length's
    prefill and the decode step of one compiled model) share the one copy. The cache holds the
    very tensors each copy was built from and their version counters, so a weight replaced or
    changed in place is concatenated afresh; it is the caller's, not the model's, so the copies
    live as long as the steps that read them."""
    parts = tuple(getattr(m, name) for m in linears)
    versions = tuple(p._version for p in parts)
    key = (tuple(id(m) for m in linears), name)
    held = cache.get(key)
    if held is None or held[1] != versions or any(a is not b for a, b in zip(held[0], parts)):
        fused = nn.Parameter(torch.cat([p.detach() for p in parts], dim=0), requires_grad=False)
        held = cache[key] = (parts, versions, fused)
    return held[2]


class _Step(nn.Module):
    """``fuse``: the projections that read one input as one GEMM each (see :meth:`_fuse`);
    ``fused_cache``: where their concatenated weights are kept (:func:`_concatenated`; steps given
    the same dict share them; default: the step's own)."""

    def __init__(self, model, spec: ModelSpec, max_seq_len: int, fuse: bool = True,
                 fused_cache: "dict | None" = None):
        super().__init__()
        self.model = model
        self.spec = spec
        self.max_seq_len = max_seq_len
        self.gpt2 = spec.family == "gpt2"
        self.gemma2 = spec.model_type == "gemma2"
        if hasattr(model, "transformer"):  # GPT-2, GPT-J, Falcon
            base = model.transformer
            self.blocks, self.final_norm = base.h, base.ln_f
            self.embed = base.wte if hasattr(base, "wte") else base.word_embeddings
        else:
            base = model.model
            self.blocks, self.final_norm, self.embed = base.layers, base.norm, base.embed_tokens
        self.pos_embed = base.wpe if self.gpt2 else None
        #: masks per layer kind (row 0: global layers, row 1: windowed ones), set by the steps
        #: of a model mixing both (Gemma-2)
        self.mask_per_kind = False
        #: experts a step evaluates (None: all; a plan's block: those a step can read, see LayerStep)
        self.evaluated_experts = None
        self.expert_weights = None
        #: "qkv<i>" / "gate_up<i>" -> block i's projections' weights (and "...bias") concatenated
        self.fused = nn.ParameterDict()
        self._fused_cache = {} if fused_cache is None else fused_cache
        if fuse:
            self._fuse(range(spec.layers))

    def _fuse(self, layers) -> None:
        """The separate q, k and v projections of each of ``layers`` as one GEMM, and a gated MLP's
        gate and up projections as one: their weights concatenated along the output columns (and
        their biases), the output sliced where the columns of each begin. The concatenated
        weights are built once per ``fused_cache`` and shared by the steps given it
        (:func:`_concatenated`).

        Each output column is the same input row's dot product with that projection's weight
        column, so a float32 GEMM's and an int8 GEMM's sums are those of the separate
        projections, and per-channel int8 weights keep every column's scale; the projections
        share their input's quantization (one activation tensor). Such a block runs two weight
        GEMMs (q/k/v and gate/up; one barrier, one set of tiles and one hand-off each)."""
        for i in layers:
            block = self.blocks[i]
            attn = getattr(block, "self_attn", None) or getattr(block, "attn", None)
            qkv = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
            if attn is not None and _fusable(qkv):
                self.fused[f"qkv{i}"] = _concatenated(self._fused_cache, qkv, "weight")
                if qkv[0].bias is not None:
                    self.fused[f"qkv{i}bias"] = _concatenated(self._fused_cache, qkv, "bias")
            mlp = getattr(block, "mlp", None)
            gate_up = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
            if mlp is not None and not self.spec.experts and hasattr(mlp, "act_fn") and _fusable(gate_up):
                self.fused[f"gate_up{i}"] = _concatenated(self._fused_cache, gate_up, "weight")
                if gate_up[0].bias is not None:
                    self.fused[f"gate_up{i}bias"] = _concatenated(self._fused_cache, gate_up, "bias")

    def _fused_linear(self, name: str, h):
        """``h`` through the concatenated projections ``name`` (:meth:`_fuse`), or None."""
        if name not in self.fused:
            return None
        return nn.functional.linear(h, self.fused[name], self.fused[name + "bias"] if name + "bias" in self.fused else None)

    def _qkv(self, i: int, h):
        b, n, _ = h.shape
        s = self.spec
        block = self.blocks[i]
        if self.gpt2:
            attn = block.attn
            qkv = attn.c_attn(h)
            # slices, not split: a split's tuple can end up inside an offloaded region (GPT-2-XL)
            # (the heads' width: the hidden size, or one board's share of the heads when planned)
            qw = s.heads * s.head_dim
            q, k, v = qkv[:, :, :qw], qkv[:, :, qw:2 * qw], qkv[:, :, 2 * qw:]
        elif s.family == "falcon":
            attn = block.self_attention
            qkv = attn.query_key_value(h)
            if s.kv_heads == 1 and s.heads > 1:  # multi-query: the heads' queries, then one key, one value
                qw = s.heads * s.head_dim
                q, k, v = qkv[:, :, :qw], qkv[:, :, qw:qw + s.head_dim], qkv[:, :, qw + s.head_dim:]
            else:  # per head: its query, key and value side by side (transformers' _split_heads)
                qkv = qkv.view(b, n, s.heads, 3, s.head_dim)
                q, k, v = (qkv[:, :, :, j, :].reshape(b, n, s.heads * s.head_dim) for j in range(3))
        else:
            attn = block.attn if s.family == "gptj" else block.self_attn
            if hasattr(attn, "qkv_proj"):  # Phi-3: one fused projection, sliced as transformers does
                qkv = attn.qkv_proj(h)
                qw, kw = s.heads * s.head_dim, s.kv_heads * s.head_dim
                q, k, v = qkv[:, :, :qw], qkv[:, :, qw:qw + kw], qkv[:, :, qw + kw:]
            elif (qkv := self._fused_linear(f"qkv{i}", h)) is not None:  # one GEMM (_fuse)
                qw, kw = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]  # (a narrowed slice: its weights)
                q, k, v = qkv[:, :, :qw], qkv[:, :, qw:qw + kw], qkv[:, :, qw + kw:]
            else:
                q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q = q.view(b, n, s.heads, s.head_dim).transpose(1, 2)
        k = k.view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
        v = v.view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
        return attn, q, k, v

    @staticmethod
    def _to_cache(k, v):
        """(b, kv_heads, n, d) keys/values -> the cache layouts: K^T (b*kv_heads, d, n), V (b*kv_heads, n, d)."""
        b, h, n, d = k.shape
        return k.transpose(2, 3).reshape(b * h, d, n), v.reshape(b * h, n, d)

    def _attend(self, attn, q, k_t, v, mask):
        """softmax(q K^T * scaling + mask) V with K^T (b*kv_heads, d, S) and V (b*kv_heads, S, d).

        The cache is kept in the layouts the two batched GEMMs read, so the cache-sized operands
        are never transposed, broadcast or reshaped. Grouped-query attention needs no copy of the
        cache either (transformers' repeat_kv): the ``groups`` query heads sharing a KV head
        (head h uses KV head h // groups) are rows of one GEMM against that head's cache. Every
        dot product is the one transformers computes.
        """
        b, heads, n, d = q.shape
        kvh = self.spec.kv_heads
        groups = heads // kvh
        scaling = attn.scaling if hasattr(attn, "scaling") else attn.inv_norm_factor  # Falcon's name
        scores = torch.bmm(q.reshape(b * kvh, groups * n, d), k_t) * scaling
        if self.spec.attn_softcap is not None:  # Gemma-2: cap * tanh(scores / cap), before the mask
            scores = torch.tanh(scores / self.spec.attn_softcap) * self.spec.attn_softcap
        if n > 1:
            scores = scores.reshape(b * kvh, groups, n, -1)
        probs = nn.functional.softmax(scores + mask, dim=-1)
        if n > 1:
            probs = probs.reshape(b * kvh, groups * n, -1)
        out = torch.bmm(probs, v).reshape(b, heads, n, d).transpose(1, 2)
        return out.reshape(b, n, heads * d)

    def _rotate(self, x, cos, sin):
        r = self.spec.rotary_dim
        if r is None:
            return _rope(x, cos, sin)
        # GPT-J: the first r channels of each head, interleaved pairs; the rest pass unrotated
        rot = x[..., :r] * cos.unsqueeze(1) + _rotate_every_two(x[..., :r]) * sin.unsqueeze(1)
        return rot if r == x.shape[-1] else torch.cat([rot, x[..., r:]], dim=-1)

    def _mask(self, i: int, mask):
        if not self.mask_per_kind:
            return mask
        return mask[1] if self.spec.window_of(i) is not None else mask[0]

    def _layer(self, i: int, x, cache_fn, mask, cos, sin):
        block = self.blocks[i]
        s = self.spec
        h = (block.ln_1(x) if self.gpt2 or s.family == "gptj" else block.input_layernorm(x))
        attn, q, k, v = self._qkv(i, h)
        if not self.gpt2:
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        k_att, v_att, k_out, v_out = cache_fn(i, *self._to_cache(k, v))
        o = self._attend(attn, q, k_att, v_att, self._mask(i, mask))
        if self.gpt2:
            x = x + attn.c_proj(o)
            x = x + block.mlp(block.ln_2(x))
        elif s.family == "gptj":  # attention and MLP in parallel on the same normed input
            x = attn.out_proj(o) + block.mlp(h) + x
        elif s.family == "falcon":
            x = (block.mlp(h) + attn.dense(o)) + x
        elif self.gemma2:  # each half normed again before it joins the residual
            x = x + block.post_attention_layernorm(attn.o_proj(o))
            x = x + block.post_feedforward_layernorm(self._mlp(i, block.mlp, block.pre_feedforward_layernorm(x)))
        else:
            x = x + attn.o_proj(o)
            x = x + self._mlp(i, block.mlp, block.post_attention_layernorm(x))
        return x, k_out, v_out

    def _logits(self, x):
        logits = self.model.lm_head(self.final_norm(x))
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _mlp(self, i: int, mlp, h):
        if self.spec.experts:
            return self._experts(mlp, h)
        if (gate_up := self._fused_linear(f"gate_up{i}", h)) is not None:  # one GEMM (_fuse)
            cols = mlp.gate_proj.weight.shape[0]
            return mlp.down_proj(mlp.act_fn(gate_up[:, :, :cols]) * gate_up[:, :, cols:])
        if not hasattr(mlp, "gate_up_proj"):
            return mlp(h)
        # Phi-3's fused gate/up projection: slices where its forward chunks (a split's tuple can
        # end up inside an offloaded region)
        gate_up = mlp.gate_up_proj(h)
        i = self.spec.intermediate
        return mlp.down_proj(gate_up[:, :, i:] * mlp.activation_fn(gate_up[:, :, :i]))

    def _experts(self, moe, h):
        """Mixtral's sparse MLP with static shapes: the router's top-k experts of each token,
        their softmax probabilities renormalized over the k (transformers' router); every expert
        is evaluated and weighted by its token's routing weight, 0 where the router did not pick
        it, and the products summed in expert order (as transformers' index_add is: adding a
        zero-weighted expert leaves the sum's bits as they were)."""
        b, n, hd = h.shape
        s = self.spec
        x = h.reshape(b * n, hd)
        probs = nn.functional.softmax(nn.functional.linear(x, moe.gate.weight), dim=-1)
        top, index = torch.topk(probs, s.experts_per_token, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        zero = torch.zeros((), dtype=top.dtype)
        experts, i = moe.experts, s.intermediate
        out = torch.zeros_like(x)
        for e in range(self.evaluated_experts or s.experts):
            # the token's weight of expert e: its top-k entry for e (the k are distinct), else 0;
            # element-wise over the k picks (a reduction here would be left to the host's scheduler)
            weight = zero
            for j in range(s.experts_per_token):
                weight = weight + torch.where(index[:, j:j + 1] == e, top[:, j:j + 1], zero)
            w_gate_up, w_down = ((self.expert_weights[2 * e], self.expert_weights[2 * e + 1]) if self.expert_weights
                                 else (experts.gate_up_proj[e], experts.down_proj[e]))
            gate_up = nn.functional.linear(x, w_gate_up)
            y = nn.functional.linear(experts.act_fn(gate_up[:, :i]) * gate_up[:, i:], w_down)
            out = out + y * weight
        return out.reshape(b, n, hd)

    def _run(self, ids, cache_fn, mask, pos_or_cos, sin):
        x = self.embed(ids)
        cos = None
        if self.gpt2:
            x = x + self.pos_embed(pos_or_cos)
        else:
            cos = pos_or_cos
        ks, vs = [], []
        for i in range(self.spec.layers):
            x, k, v = self._layer(i, x, cache_fn, mask, cos, sin)
            ks.append(k)
            vs.append(v)
        logits = self._logits(x[:, -1:, :])[:, 0, :]
        return logits, torch.stack(ks), torch.stack(vs)


class Prefill(_Step):
    """The prompt step: ``forward(ids, pos_or_cos[, sin])`` -> (last-token logits, K, V)."""

    def __init__(self, model, spec: ModelSpec, max_seq_len: int, prompt_len: int, fuse: bool = True,
                 fused_cache: "dict | None" = None):
        super().__init__(model, spec, max_seq_len, fuse, fused_cache)
        self.mask_per_kind = _mixed(spec)
        causal = (torch.stack([causal_mask(prompt_len), causal_mask(prompt_len, spec.sliding_window)])
                  if self.mask_per_kind else causal_mask(prompt_len, spec.sliding_window))
        self.register_buffer("causal", causal, persistent=False)
        self.prompt_len = prompt_len

    def forward(self, ids, pos_or_cos, sin=None):
        n, slots = self.prompt_len, self.spec.cache_slots(self.max_seq_len)
        pad = slots - n

        def cache_fn(i, k_t, v):
            if pad == 0:
                return k_t, v, k_t, v
            if pad < 0:  # a prompt longer than the window: its last `slots` keys, in their ring slots
                shift = n % slots  # position p -> slot p % slots
                k_last, v_last = k_t[:, :, n - slots:], v[:, n - slots:, :]
                if shift:
                    k_last = torch.cat([k_last[:, :, slots - shift:], k_last[:, :, :slots - shift]], dim=2)
                    v_last = torch.cat([v_last[:, slots - shift:, :], v_last[:, :slots - shift, :]], dim=1)
                return k_t, v, k_last, v_last
            rows = k_t.shape[0]
            k_pad = torch.zeros((rows, k_t.shape[1], pad), dtype=k_t.dtype)
            v_pad = torch.zeros((rows, pad, v.shape[2]), dtype=v.dtype)
            return k_t, v, torch.cat([k_t, k_pad], dim=2), torch.cat([v, v_pad], dim=1)

        return self._run(ids, cache_fn, self.causal, pos_or_cos, sin)


def _mixed(spec: ModelSpec) -> bool:
    """Whether the model has global and windowed layers (Gemma-2): its steps take a mask per kind."""
    return spec.sliding_window is not None and bool(spec.global_layers)


class Decode(_Step):
    """One token: ``forward(ids, k_cache, v_cache, write, mask, pos_or_cos[, sin])`` -> (logits, K, V).

    ``mask``: (S,), or (2, S) for a model of global and windowed layers (rows: global, windowed)."""

    def __init__(self, model, spec: ModelSpec, max_seq_len: int, fuse: bool = True,
                 fused_cache: "dict | None" = None):
        super().__init__(model, spec, max_seq_len, fuse, fused_cache)
        self.mask_per_kind = _mixed(spec)

    def forward(self, ids, k_cache, v_cache, write, mask, pos_or_cos, sin=None):
        def cache_fn(i, k_t, v):
            # the new key/value lands in the one slot `write` selects; the others keep their bits
            k_all = torch.where(write, k_t, k_cache[i])
            v_all = torch.where(write[:, None], v, v_cache[i])
            return k_all, v_all, k_all, v_all

        return self._run(ids, cache_fn, mask, pos_or_cos, sin)


class LayerStep(_Step):
    """One transformer block, for planning (the blocks of a model share its shapes).

    A mixture-of-experts block evaluates ``experts`` of them (the router's picks weighting
    them): the experts whose weights one step reads at most.

    ``prompt_len=None``: a decode step, ``forward(x (b, 1, hidden), k_cache (b * kv_heads, head_dim,
    S), v_cache (b * kv_heads, S, head_dim), write (S,), mask (S,)[, cos, sin])``; else a prefill of ``prompt_len`` tokens,
    ``forward(x (b, n, hidden), mask (n, n)[, cos, sin])`` (the causal mask an input, so that a
    model on the meta device holds no real tensor). Returns ``(x, k, v)``.
    """

    def __init__(self, model, spec: ModelSpec, max_seq_len: int, prompt_len: "int | None" = None,
                 experts: "int | None" = None, fuse: bool = True):
        super().__init__(model, spec, max_seq_len, fuse=False)
        if fuse:  # the one block a step runs
            self._fuse([0])
        self.prompt_len = prompt_len
        if spec.experts:
            # a mixture of experts: the ``experts`` (default all) a step reads, each weight its
            # own 2-D parameter so that the planner sees every expert GEMM as a weight GEMM
            self.evaluated_experts = min(experts or spec.experts, spec.experts)
            moe = self.blocks[0].mlp.experts
            self.expert_weights = nn.ParameterList(
                [nn.Parameter(w[e].detach(), requires_grad=False) for e in range(self.evaluated_experts)
                 for w in (moe.gate_up_proj, moe.down_proj)])

    def forward(self, x, *rest):
        if self.prompt_len is None:
            k_cache, v_cache, write, mask, *rope = rest

            def cache_fn(i, k_t, v):
                k_all = torch.where(write, k_t, k_cache)
                v_all = torch.where(write[:, None], v, v_cache)
                return k_all, v_all, k_all, v_all
        else:
            mask, *rope = rest

            def cache_fn(i, k_t, v):
                return k_t, v, k_t, v
        cos, sin = (rope + [None, None])[:2]
        return self._layer(0, x, cache_fn, mask, cos, sin)


class Head(_Step):
    """The final norm and LM head: ``forward(x (b, 1, hidden))``, the last position's hidden state -> logits."""

    def __init__(self, model, spec: ModelSpec, max_seq_len: int):
        super().__init__(model, spec, max_seq_len, fuse=False)  # no block

    def forward(self, x):
        return self._logits(x)
