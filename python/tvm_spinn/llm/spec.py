"""The architecture of a decoder-only language model, read from a transformers config.

One frozen record (:class:`ModelSpec`) holds what generation and planning need: the family
(``gpt2``, ``gptj``, ``falcon``, or ``llama`` for the Llama architecture and its relatives
``mistral``, ``qwen2``, ``phi3`` and ``gemma2``: :data:`FAMILIES`), sizes, heads, the sliding
attention window (and Gemma-2's global layers), the rotated channels, soft-capping, and the derived
parameter and KV-cache byte counts. It is read from a transformers ``PretrainedConfig``, a
model carrying one, a dict or a JSON file, and every missing or invalid field is one
:class:`LLMError` naming the field and its value.

Every field this package or transformers reads for these model types is type-checked
(:data:`FIELDS`): sizes are integers in ``[1, MAX_DIM]``, flags booleans, epsilons finite and
positive, probabilities in ``[0, 1]``. Keys that belong to another architecture (experts,
soft-capping, sliding windows, ALiBi, parallel attention, ...: :data:`FOREIGN_KEYS`) are refused
by name when set, so a Mixtral or Gemma-2 config relabelled ``llama`` is never planned as a dense
Llama; a model type that reads one of them (Gemma-2 its soft-capping, GPT-J its ``rotary_dim``,
Falcon its ``multi_query`` and ``parallel_attn``) accepts it. A model type's own options that are
not implemented (a rotary scaling other than the default one, Qwen2's sliding-window layers, a
partial rotary embedding, Falcon's new decoder architecture or ALiBi: :data:`FIXED_VALUES`) are
refused naming the field and its value. Other keys are ignored, and never passed on (:func:`transformers_kwargs`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

__all__ = ["LLMError", "ModelSpec", "BlockSplit", "BLOCK_SPLITS", "FAMILIES", "CAUSAL_LM", "FIELDS", "FIXED_VALUES", "FOREIGN_KEYS", "MAX_DIM", "spec_of",
           "load_config", "check_config", "transformers_kwargs"]

#: model_type values this package knows -> their family. Mistral, Qwen2, Phi-3 and Gemma-2 are
#: the Llama architecture (rotary embeddings, RMSNorm, gated MLP, grouped-query attention) with
#: the differences :class:`ModelSpec` records: a sliding attention window (Mistral, Phi-3), biases on
#: the q/k/v projections (Qwen2), fused q/k/v and gate/up weights (Phi-3: the same bytes), and
#: Gemma-2's soft-capped attention and logits, alternating local/global layers, GeGLU MLP and
#: four RMSNorms per block, Mixtral's mixture of experts (a router picks ``num_experts_per_tok``
#: of ``num_local_experts`` gated MLPs per token). GPT-J and Falcon are families of their own: one LayerNorm feeds
#: attention and a two-matrix MLP in parallel (both added to the residual), with rotary
#: embeddings (GPT-J: on the first ``rotary_dim`` channels, pairs interleaved; Falcon: all, with
#: one key/value head shared by every query head in its multi-query form)
FAMILIES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama", "phi3": "llama",
            "gemma2": "llama", "mixtral": "llama", "gptj": "gptj", "falcon": "falcon"}
#: model_type -> the transformers causal-LM class of that type
CAUSAL_LM = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
             "qwen2": "Qwen2ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
             "mixtral": "MixtralForCausalLM", "gptj": "GPTJForCausalLM", "falcon": "FalconForCausalLM"}
#: Mistral's attention window where its config does not say (transformers' ``MistralConfig`` default)
MISTRAL_DEFAULT_WINDOW = 4096


@dataclass(frozen=True)
class BlockSplit:
    """How one block of a family splits over the ``g`` boards of a tensor-parallel group.

    Each board holds a share of the heads (their query, key and value columns and the rows of
    the attention's output projection) and of the MLP's intermediate columns (the columns of the
    projections into it, the rows of the one out of it). ``parameters``: ``(path in the block,
    axis, width)`` of every parameter so split, ``width`` naming what the axis spans on one
    board: ``"q"`` the board's query heads x head size, ``"kv"`` its key/value heads x head
    size, ``"qkv"`` a fused projection of both (``q + 2 kv``), ``"mlp"`` its intermediate
    columns. Parameters of the block not named (norms, the output projections' biases, added
    once to the reduced sum) stay whole on every board. ``all_reduces``: partial sums reduced
    across the group a block: two where the MLP reads the residual after attention, one where
    attention and MLP read the same normed input and join the residual together (their
    partial sums are added on each board first)."""

    parameters: tuple
    all_reduces: int


#: Families whose block is split by narrowing the transformers block's parameters
#: (:func:`tvm_spinn.llm.board_tp.slice_block`); the Llama family is sliced through its config
#: (its head size is a config field: :func:`tvm_spinn.llm.board_tp.slice_config`)
BLOCK_SPLITS = {
    "gpt2": BlockSplit((("attn.c_attn.weight", 1, "qkv"), ("attn.c_attn.bias", 0, "qkv"),
                        ("attn.c_proj.weight", 0, "q"), ("mlp.c_fc.weight", 1, "mlp"),
                        ("mlp.c_fc.bias", 0, "mlp"), ("mlp.c_proj.weight", 0, "mlp")), all_reduces=2),
    "gptj": BlockSplit((("attn.q_proj.weight", 0, "q"), ("attn.k_proj.weight", 0, "kv"),
                        ("attn.v_proj.weight", 0, "kv"), ("attn.out_proj.weight", 1, "q"),
                        ("mlp.fc_in.weight", 0, "mlp"), ("mlp.fc_in.bias", 0, "mlp"),
                        ("mlp.fc_out.weight", 1, "mlp")), all_reduces=1),
    "falcon": BlockSplit((("self_attention.query_key_value.weight", 0, "qkv"),
                          ("self_attention.query_key_value.bias", 0, "qkv"),
                          ("self_attention.dense.weight", 1, "q"), ("mlp.dense_h_to_4h.weight", 0, "mlp"),
                          ("mlp.dense_h_to_4h.bias", 0, "mlp"), ("mlp.dense_4h_to_h.weight", 1, "mlp")),
                         all_reduces=1),
}


class LLMError(ValueError):
    """Bad input to the LLM flow: the message names the field (config key, argument, shape)."""


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a decoder-only transformer (GPT-2, Llama, GPT-J or Falcon architecture, :data:`FAMILIES`)."""

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    tied_embeddings: bool
    attention_bias: bool = False  # Llama: biases on the q, k, v and o projections
    mlp_bias: bool = False  # Llama: biases on the gate, up and down projections
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections (not on o)
    #: keys a query attends to: the last ``sliding_window`` positions, itself included (Mistral,
    #: Phi-3); ``None``: every earlier position
    sliding_window: "int | None" = None
    model_type: str = ""  # the config's model_type (:data:`FAMILIES`)
    #: layers that attend to every earlier position although the model has a ``sliding_window``
    #: (Gemma-2's global layers; the others are local)
    global_layers: "tuple[int, ...]" = ()
    #: rotated channels of each query/key head (GPT-J's partial, pair-interleaved rotation);
    #: ``None``: all ``head_dim`` (or none: GPT-2)
    rotary_dim: "int | None" = None
    #: ``cap * tanh(x / cap)`` of the attention scores / of the logits (Gemma-2); ``None``: none
    attn_softcap: "float | None" = None
    final_softcap: "float | None" = None
    #: Mixtral: gated MLPs (experts) per block and how many of them the router picks per token;
    #: 0: a dense MLP
    experts: int = 0
    experts_per_token: int = 0

    def window_of(self, layer: int) -> "int | None":
        """The sliding window of block ``layer`` (``None``: it attends to every earlier position)."""
        return None if layer in self.global_layers else self.sliding_window

    @property
    def params(self) -> int:
        """Number of parameters (embeddings included; a tied LM head counted once)."""
        h, i, v = self.hidden, self.intermediate, self.vocab
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        head_bias = 0
        if self.family == "gpt2":
            layer = h * (q + 2 * kv) + (q + 2 * kv) + q * h + h + 2 * h * i + i + h + 4 * h
            extra = self.max_positions * h + 2 * h
        elif self.family == "gptj":  # bias-free attention, a biased MLP, one LayerNorm; a biased LM head
            layer = h * (q + 2 * kv) + q * h + 2 * h * i + i + h + 2 * h
            extra, head_bias = 2 * h, v
        elif self.family == "falcon":  # one LayerNorm; every projection biased or none
            layer = h * (q + 2 * kv) + q * h + 2 * h * i + 2 * h
            layer += (q + 2 * kv + h + i + h) * self.attention_bias
            extra = 2 * h
        else:
            layer = h * (q + 2 * kv) + q * h + 3 * h * i * max(1, self.experts) + 2 * h
            layer += self.experts * h  # the router
            layer += (q + 2 * kv + h) * self.attention_bias + (2 * i + h) * self.mlp_bias
            layer += (q + 2 * kv) * self.qkv_bias
            layer += 2 * h * (self.model_type == "gemma2")  # the norms after attention and after the MLP
            extra = h
        head = (0 if self.tied_embeddings else v * h) + head_bias  # GPT-J's bias stays when its weight is tied
        return self.layers * layer + v * h + head + extra

    def step_params(self, batch: int = 1) -> int:
        """Parameters one decoding step of ``batch`` tokens reads: all of them, less the experts
        no token can pick (a mixture of experts: ``batch x experts_per_token`` at most)."""
        unpicked = self.experts - min(self.experts, batch * self.experts_per_token)
        return self.params - self.layers * 3 * self.hidden * self.intermediate * unpicked

    def layer_params(self) -> int:
        """Parameters of one transformer layer."""
        one = dataclasses.replace(self, layers=1, vocab=0, max_positions=0, tied_embeddings=True)
        return one.params - (self.hidden if self.family == "llama" else 2 * self.hidden)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of K and V cached per token of one sequence (all layers)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize

    def cache_slots(self, context: int) -> int:
        """KV-cache positions a sequence of ``context`` tokens keeps: all of them, or the last
        ``sliding_window`` (the only keys a query still attends to) when every layer has that
        window. A model with global layers (Gemma-2) keeps all positions in every layer: its
        local layers mask their cache to the window (one cache size for all layers)."""
        if self.sliding_window is None or self.global_layers:
            return context
        return min(context, self.sliding_window)


#: Largest value of a size field (hidden size, vocabulary, positions, ...): no model comes near,
#: and the byte counts the planner forms from products of them stay exact Python integers that
#: a float still holds (a larger value is refused as a field error, before any arithmetic).
MAX_DIM = 2**31 - 1
#: Largest ``config.json`` read: a transformers config is a few kilobytes.
MAX_CONFIG_BYTES = 16 * 2**20


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


#: (what the field must be, test) of each kind of field
_DIM = (f"an integer in [1, {MAX_DIM}]", lambda v: _is_int(v) and 1 <= v <= MAX_DIM)
_DIM_OR_NULL = (f"null or an integer in [1, {MAX_DIM}]", lambda v: v is None or _DIM[1](v))
_COUNT = (f"an integer in [0, {MAX_DIM}]", lambda v: _is_int(v) and 0 <= v <= MAX_DIM)
_BOOL = ("true or false", lambda v: isinstance(v, bool))
_POSITIVE = ("a finite number > 0", lambda v: _finite(v) and v > 0)
_NONNEGATIVE = ("a finite number >= 0", lambda v: _finite(v) and v >= 0)
_POSITIVE_OR_NULL = ("null or a finite number > 0", lambda v: v is None or _POSITIVE[1](v))
_BOOL_OR_NULL = ("null, true or false", lambda v: v is None or isinstance(v, bool))
_PROBABILITY = ("a number in [0, 1]", lambda v: _finite(v) and 0 <= v <= 1)
_TEXT = ("a string", lambda v: isinstance(v, str))
_TEXT_OR_NULL = ("null or a string", lambda v: v is None or isinstance(v, str))
_OBJECT_OR_NULL = ("null or an object", lambda v: v is None or isinstance(v, dict))
_TEXTS_OR_NULL = ("null or a list of strings",
                  lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)))
_TOKEN = ("null, a token id or a list of token ids",
          lambda v: v is None or _is_int(v) or (isinstance(v, list) and all(_is_int(x) for x in v)))
_DTYPE = ("null or a dtype name", lambda v: v is None or isinstance(v, str) or type(v).__name__ == "dtype")

#: The fields read for each family (and those every transformers config has), by kind. Other
#: keys are ignored: they are neither read here nor passed to transformers.
FIELDS = {
    "common": {
        "model_type": _TEXT, "vocab_size": _DIM, "tie_word_embeddings": _BOOL, "architectures": _TEXTS_OR_NULL,
        "_name_or_path": _TEXT, "transformers_version": _TEXT_OR_NULL, "torch_dtype": _DTYPE, "dtype": _DTYPE,
        "use_cache": _BOOL, "bos_token_id": _TOKEN, "eos_token_id": _TOKEN, "pad_token_id": _TOKEN,
        "initializer_range": _NONNEGATIVE, "output_attentions": _BOOL, "output_hidden_states": _BOOL,
        "return_dict": _BOOL, "chunk_size_feed_forward": _COUNT, "id2label": _OBJECT_OR_NULL,
        "label2id": _OBJECT_OR_NULL, "problem_type": _TEXT_OR_NULL, "task_specific_params": _OBJECT_OR_NULL,
    },
    "llama": {
        "hidden_size": _DIM, "intermediate_size": _DIM, "num_hidden_layers": _DIM, "num_attention_heads": _DIM,
        "num_key_value_heads": _DIM_OR_NULL, "head_dim": _DIM_OR_NULL, "max_position_embeddings": _DIM,
        "hidden_act": _TEXT, "rms_norm_eps": _POSITIVE, "rope_theta": _POSITIVE, "rope_scaling": _OBJECT_OR_NULL,
        "rope_parameters": _OBJECT_OR_NULL, "attention_bias": _BOOL, "mlp_bias": _BOOL,
        "attention_dropout": _PROBABILITY, "pretraining_tp": _DIM_OR_NULL,
    },
    "gpt2": {
        "n_embd": _DIM, "n_head": _DIM, "n_layer": _DIM, "n_positions": _DIM, "n_ctx": _DIM, "n_inner": _DIM_OR_NULL,
        "activation_function": _TEXT, "layer_norm_epsilon": _POSITIVE, "scale_attn_weights": _BOOL,
        "reorder_and_upcast_attn": _BOOL, "resid_pdrop": _PROBABILITY, "embd_pdrop": _PROBABILITY,
        "attn_pdrop": _PROBABILITY, "summary_type": _TEXT, "summary_use_proj": _BOOL,
        "summary_activation": _TEXT_OR_NULL, "summary_proj_to_labels": _BOOL, "summary_first_dropout": _PROBABILITY,
    },
    # a model type of the llama family: its own fields, read on top of the family's
    "mistral": {"sliding_window": _DIM_OR_NULL},
    "qwen2": {"use_sliding_window": _BOOL, "sliding_window": _DIM_OR_NULL, "max_window_layers": _COUNT,
              "layer_types": _TEXTS_OR_NULL},
    "phi3": {"sliding_window": _DIM_OR_NULL, "original_max_position_embeddings": _DIM,
             "resid_pdrop": _PROBABILITY, "embd_pdrop": _PROBABILITY, "partial_rotary_factor": _PROBABILITY},
    "gemma2": {"hidden_activation": _TEXT_OR_NULL, "query_pre_attn_scalar": _POSITIVE, "sliding_window": _DIM_OR_NULL,
               "layer_types": _TEXTS_OR_NULL, "attn_logit_softcapping": _POSITIVE_OR_NULL,
               "final_logit_softcapping": _POSITIVE_OR_NULL, "use_bidirectional_attention": _BOOL_OR_NULL},
    "mixtral": {"sliding_window": _DIM_OR_NULL, "num_local_experts": _DIM, "num_experts_per_tok": _DIM,
                "router_aux_loss_coef": _NONNEGATIVE, "output_router_logits": _BOOL, "router_jitter_noise": _NONNEGATIVE},
    # families of their own
    "gptj": {
        "n_embd": _DIM, "n_head": _DIM, "n_layer": _DIM, "n_positions": _DIM, "n_inner": _DIM_OR_NULL,
        "rotary_dim": _DIM_OR_NULL, "rotary": _BOOL, "activation_function": _TEXT, "layer_norm_epsilon": _POSITIVE,
        "resid_pdrop": _PROBABILITY, "embd_pdrop": _PROBABILITY, "attn_pdrop": _PROBABILITY,
    },
    "falcon": {
        "hidden_size": _DIM, "num_hidden_layers": _DIM, "num_attention_heads": _DIM, "num_kv_heads": _DIM_OR_NULL,
        "max_position_embeddings": _DIM, "ffn_hidden_size": _DIM_OR_NULL, "activation": _TEXT,
        "layer_norm_epsilon": _POSITIVE, "hidden_dropout": _PROBABILITY, "attention_dropout": _PROBABILITY,
        "multi_query": _BOOL, "parallel_attn": _BOOL, "new_decoder_architecture": _BOOL, "alibi": _BOOL,
        "bias": _BOOL, "apply_residual_connection_post_layernorm": _BOOL, "num_ln_in_parallel_attn": _DIM_OR_NULL,
        "rope_theta": _POSITIVE, "rope_scaling": _OBJECT_OR_NULL, "rope_parameters": _OBJECT_OR_NULL,
    },
}

#: the values of a family's architecture switches that the generation graphs and the planner
#: implement (any other value is refused naming the key): Falcon-7B's layout (parallel attention
#: and MLP after one LayerNorm, rotary embeddings, multi-query or one key/value head per query head)
FIXED_VALUES = {
    "falcon": {"new_decoder_architecture": (False,), "parallel_attn": (True,), "alibi": (False,),
               "apply_residual_connection_post_layernorm": (False,), "num_ln_in_parallel_attn": (None, 1)},
    "gptj": {"rotary": (True,)},
    "gemma2": {"use_bidirectional_attention": (None, False)},
}
#: transformers' defaults of the switches a config may leave out
FALCON_DEFAULTS = {"multi_query": True, "bias": False}

#: Keys of architectures (or options) the generation graphs and the planner do not implement,
#: refused by name when set (any value but null / false): a model with them would be computed or
#: planned as a different, dense model.
FOREIGN_KEYS = {
    **dict.fromkeys(("num_local_experts", "num_experts_per_tok", "num_experts", "n_routed_experts",
                     "n_shared_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "router_aux_loss_coef", "output_router_logits", "moe_layer_freq", "first_k_dense_replace",
                     "decoder_sparse_step", "router_jitter_noise"), "mixture of experts (Mixtral, Qwen-MoE, DeepSeek)"),
    **dict.fromkeys(("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"),
                    "logit soft-capping / query scaling (Gemma-2)"),
    **dict.fromkeys(("sliding_window", "use_sliding_window", "sliding_window_pattern", "layer_types"),
                    "sliding-window attention (Mistral, Gemma-2, Qwen2)"),
    **dict.fromkeys(("alibi", "use_alibi", "alibi_bias_max"), "ALiBi position biases (BLOOM, MPT, Falcon)"),
    **dict.fromkeys(("parallel_attn", "use_parallel_residual", "parallel_residual", "parallel_block",
                     "new_decoder_architecture", "multi_query"), "parallel attention / multi-query (Falcon, GPT-NeoX)"),
    **dict.fromkeys(("partial_rotary_factor", "rotary_pct", "rotary_dim"), "partial rotary embeddings (GPT-J, Phi)"),
    **dict.fromkeys(("qk_layernorm", "use_qk_norm", "qk_norm", "clip_qkv"), "query/key normalization or clipping "
                                                                             "(Qwen3, OLMo, Persimmon)"),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), "multi-head latent attention (DeepSeek)"),
    **dict.fromkeys(("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
                     "logit_scale"), "scaled residuals / logits (Granite, Cohere)"),
    "is_encoder_decoder": "an encoder-decoder model", "add_cross_attention": "cross-attention layers",
    "scale_attn_by_inverse_layer_idx": "GPT-2 attention scaled by the inverse layer index",
}


def _active(cfg: dict, key: str) -> bool:
    value = cfg[key]
    if value is None or value is False:
        return False
    if key == "sliding_window" and cfg.get("use_sliding_window") is False:
        return False  # Qwen2 writes a window size it does not use
    if key == "layer_types" and isinstance(value, list) and all(v == "full_attention" for v in value):
        return False
    if key == "partial_rotary_factor" and cfg.get("model_type") == "phi3" and value == 1:
        return False  # Phi-3 writes a full rotation as factor 1.0 (checked again by _check_rotary)
    return True


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_config(path: str) -> dict:
    """Read a transformers ``config.json``; a missing or malformed file is an :class:`LLMError`."""
    if not os.path.isfile(path):
        raise LLMError(f"config file {path!r} does not exist")
    size = os.path.getsize(path)
    if size > MAX_CONFIG_BYTES:
        raise LLMError(f"config file {path!r} is {size} bytes: a transformers config.json is a few "
                       f"kilobytes (at most {MAX_CONFIG_BYTES} bytes are read)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise LLMError(f"config file {path!r} is not valid JSON: {err}") from None
    except RecursionError:
        raise LLMError(f"config file {path!r} is not a config: its JSON nests too deeply") from None
    if not isinstance(data, dict):
        raise LLMError(f"config file {path!r}: expected a JSON object, got {type(data).__name__}")
    return data


def _as_dict(config) -> dict:
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        return load_config(os.fspath(config))
    inner = getattr(config, "config", None)  # a transformers model
    if inner is not None and hasattr(inner, "to_dict"):
        config = inner
    if hasattr(config, "to_dict"):
        try:
            out = config.to_dict()
            # attributes a config computes (not always serialized), e.g. head_dim
            for key in ("head_dim", "num_key_value_heads", "model_type"):
                if getattr(config, key, None) is not None:
                    out[key] = getattr(config, key)
        except Exception as err:  # a foreign object's to_dict: any failure is a bad argument
            raise LLMError(f"cannot read the config of {type(config).__name__}: {type(err).__name__}: {err}") from None
        if not isinstance(out, dict):
            raise LLMError(f"{type(config).__name__}.to_dict() returned {type(out).__name__}, not a dict")
        return out
    raise LLMError(f"expected a transformers config, model, dict or JSON path, got {type(config).__name__}")


def check_config(cfg: dict) -> str:
    """Check every field of a config dict that this package reads; returns its family.

    Raises
    ------
    LLMError
        An unknown ``model_type`` (the message lists the known ones), a known field of the wrong
        type or range (the message names the field, its value and what it must be), or keys of
        another architecture (:data:`FOREIGN_KEYS`, all listed).
    """
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise LLMError(f"config field 'model_type' is {_short(model_type)}; supported: {sorted(FAMILIES)}")
    family = FAMILIES[model_type]
    own = FIELDS.get(model_type, {}) if model_type != family else {}
    read = FIELDS.get(model_type, {})  # the keys the model type reads (its family's or its own)
    if model_type == "qwen2" and cfg.get("use_sliding_window") is True:
        raise LLMError("config field 'use_sliding_window' is True: Qwen2's sliding-window layers (those from "
                       "'max_window_layers' on) are not implemented; only use_sliding_window=false is supported")
    # the model type's own options (the window of Mistral and Phi-3, Gemma-2's soft-capping,
    # Falcon's switches) are not another architecture's
    foreign = sorted(k for k in cfg if isinstance(k, str) and k in FOREIGN_KEYS and _active(cfg, k)
                     and not (k in read and (model_type, k) not in _OWN_BUT_CHECKED))
    if foreign:
        what = sorted({FOREIGN_KEYS[k] for k in foreign})
        raise LLMError(f"config of model_type {model_type!r} has keys of another architecture: "
                       f"{', '.join(f'{k}={_short(cfg[k])}' for k in foreign)} ({'; '.join(what)}); "
                       f"only dense {model_type} models are supported")
    for key, (must, test) in {**FIELDS["common"], **FIELDS[family], **own}.items():
        if key in cfg and not (cfg[key] is None and must.startswith("null")) and not test(cfg[key]):
            raise LLMError(f"config field {key!r} must be {must}, got {_short(cfg[key])}")
    for key, allowed in FIXED_VALUES.get(model_type, {}).items():
        if key in cfg and cfg[key] not in allowed:
            raise LLMError(f"config field {key!r} is {_short(cfg[key])}: only {' or '.join(map(repr, allowed))} is "
                           f"implemented for {model_type}")
    if own or model_type == "falcon":
        _check_rotary(cfg, model_type)
    if model_type == "gemma2":
        _check_layer_types(cfg)
    return family


#: (model type, key) pairs a model type reads (:data:`FIELDS`) that stay refused as another
#: architecture's when active: Qwen2's per-layer attention kinds (a sliding layer is not implemented)
_OWN_BUT_CHECKED = frozenset({("qwen2", "layer_types")})


def _check_layer_types(cfg: dict) -> None:
    """Gemma-2's ``layer_types``: one of ``sliding_attention`` / ``full_attention`` per layer."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        return
    layers = cfg.get("num_hidden_layers")
    bad = sorted({k for k in kinds if k not in ("sliding_attention", "full_attention")})
    if bad:
        raise LLMError(f"config field 'layer_types' holds {_short(bad)}: only 'sliding_attention' and "
                       "'full_attention' layers are implemented for gemma2")
    if _is_int(layers) and len(kinds) != layers:
        raise LLMError(f"config field 'layer_types' has {len(kinds)} entries, but 'num_hidden_layers' is {layers}")


def _check_rotary(cfg: dict, model_type: str) -> None:
    """Refuse the rotary-embedding options the Mistral, Qwen2 and Phi-3 steps do not implement:
    a scaling other than the default rotation (YaRN, LongRoPE, dynamic NTK, ...: their tables
    change with the context length), or a partial rotary embedding."""
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise LLMError(f"config field {key!r} must be null or an object, got {_short(value)}")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind != "default":
            raise LLMError(f"config field {key!r} is {_short(value)}: rotary scaling {kind!r} is not implemented "
                           f"for {model_type} (only the default rotary embedding)")
        factor = value.get("partial_rotary_factor", 1.0)
        if factor != 1:
            raise LLMError(f"config field {key!r} has partial_rotary_factor={_short(factor)}: a partial rotary "
                           f"embedding is not implemented for {model_type}")
    if cfg.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise LLMError(f"config field 'partial_rotary_factor' is {_short(cfg['partial_rotary_factor'])}: a partial "
                       f"rotary embedding is not implemented for {model_type}")


def _int(cfg: dict, key: str, default=None) -> int:
    value = cfg.get(key)
    if value is None:
        value = default
    if value is None:
        raise LLMError(f"config field {key!r} is missing")
    if not _DIM[1](value):
        raise LLMError(f"config field {key!r} must be {_DIM[0]}, got {_short(value)}")
    return value


def spec_of(config) -> ModelSpec:
    """The :class:`ModelSpec` of a transformers config / model / dict / ``config.json`` path.

    Raises
    ------
    LLMError
        Unknown ``model_type`` (the message lists the known ones), keys of another architecture,
        a missing field, a field of the wrong type or range, or heads that do not divide the
        hidden size.
    """
    cfg = _as_dict(config)
    family = check_config(cfg)
    if family == "gpt2":
        hidden = _int(cfg, "n_embd")
        heads = _int(cfg, "n_head")
        spec = dict(layers=_int(cfg, "n_layer"), hidden=hidden, heads=heads, kv_heads=heads,
                    intermediate=_int(cfg, "n_inner") if cfg.get("n_inner") is not None else 4 * hidden,
                    vocab=_int(cfg, "vocab_size"), max_positions=_int(cfg, "n_positions"),
                    tied_embeddings=cfg.get("tie_word_embeddings", True), model_type="gpt2")
        if hidden % heads:
            raise LLMError(f"config field 'n_head' ({heads}) does not divide 'n_embd' ({hidden})")
        head_dim = hidden // heads
    elif family == "gptj":
        spec, head_dim = _gptj(cfg)
    elif family == "falcon":
        spec, head_dim = _falcon(cfg)
    else:
        hidden = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        kv_heads = _int(cfg, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise LLMError(f"config field 'num_key_value_heads' ({kv_heads}) does not divide "
                           f"'num_attention_heads' ({heads})")
        if cfg.get("head_dim") is None and hidden % heads:
            raise LLMError(f"config field 'num_attention_heads' ({heads}) does not divide 'hidden_size' ({hidden})")
        head_dim = _int(cfg, "head_dim", hidden // heads)
        if head_dim % 2:
            raise LLMError(f"config field 'head_dim' ({head_dim}, hidden_size // num_attention_heads if absent) "
                           "must be even: the rotary embedding rotates pairs of channels")
        model_type = cfg["model_type"]
        llama = model_type == "llama"  # the others' projections have fixed biases (transformers ignores the keys)
        spec = dict(layers=_int(cfg, "num_hidden_layers"), hidden=hidden, heads=heads, kv_heads=kv_heads,
                    intermediate=_int(cfg, "intermediate_size"), vocab=_int(cfg, "vocab_size"),
                    max_positions=_int(cfg, "max_position_embeddings"),
                    tied_embeddings=cfg.get("tie_word_embeddings", False),
                    attention_bias=llama and cfg.get("attention_bias", False),
                    mlp_bias=llama and cfg.get("mlp_bias", False), qkv_bias=model_type == "qwen2",
                    sliding_window=_window(cfg, model_type), model_type=model_type)
        if model_type == "gemma2":
            spec.update(_gemma2(cfg, spec["layers"]))
        if model_type == "mixtral":
            spec.update(_mixtral(cfg))
    return ModelSpec(family=family, head_dim=head_dim, **spec)


def _gemma2(cfg: dict, layers: int) -> dict:
    """Gemma-2's options: the global layers (``layer_types``, or transformers' default of every
    second layer global), the soft-capping values (transformers' defaults where absent)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    window = cfg["sliding_window"] if "sliding_window" in cfg else GEMMA2_DEFAULTS["sliding_window"]
    caps = {k: cfg[k] if k in cfg else GEMMA2_DEFAULTS[k] for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    return dict(sliding_window=window, global_layers=tuple(i for i, k in enumerate(kinds) if k == "full_attention"),
                attn_softcap=caps["attn_logit_softcapping"], final_softcap=caps["final_logit_softcapping"],
                tied_embeddings=cfg.get("tie_word_embeddings", True))


def _mixtral(cfg: dict) -> dict:
    """Mixtral's experts (transformers' ``MixtralConfig`` defaults where absent: 8, 2 per token)."""
    experts = _int(cfg, "num_local_experts", 8)
    per_token = _int(cfg, "num_experts_per_tok", 2)
    if per_token > experts:
        raise LLMError(f"config field 'num_experts_per_tok' ({per_token}) exceeds 'num_local_experts' ({experts})")
    return dict(experts=experts, experts_per_token=per_token)


def _gptj(cfg: dict) -> tuple:
    hidden, heads = _int(cfg, "n_embd"), _int(cfg, "n_head")
    if hidden % heads:
        raise LLMError(f"config field 'n_head' ({heads}) does not divide 'n_embd' ({hidden})")
    head_dim = hidden // heads
    if "rotary_dim" in cfg and cfg["rotary_dim"] is None:
        # transformers then builds tables of n_embd channels for heads of head_dim: not a model
        raise LLMError("config field 'rotary_dim' is None: only a rotary_dim <= the head size "
                       f"({head_dim}) is implemented for gptj")
    rotary = cfg.get("rotary_dim", GPTJ_DEFAULT_ROTARY_DIM)
    if rotary % 2 or rotary > head_dim:
        raise LLMError(f"config field 'rotary_dim' is {rotary}: it must be even (rotated pairs) and at most the "
                       f"head size n_embd // n_head = {head_dim}")
    spec = dict(layers=_int(cfg, "n_layer"), hidden=hidden, heads=heads, kv_heads=heads,
                intermediate=_int(cfg, "n_inner") if cfg.get("n_inner") is not None else 4 * hidden,
                vocab=_int(cfg, "vocab_size"), max_positions=_int(cfg, "n_positions", 2048),
                tied_embeddings=cfg.get("tie_word_embeddings", False), model_type="gptj", rotary_dim=rotary)
    return spec, head_dim


def _falcon(cfg: dict) -> tuple:
    hidden, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    if hidden % heads:
        raise LLMError(f"config field 'num_attention_heads' ({heads}) does not divide 'hidden_size' ({hidden})")
    multi_query = cfg.get("multi_query", FALCON_DEFAULTS["multi_query"])
    kv = cfg.get("num_kv_heads")
    if not multi_query and kv is not None and kv != heads:
        raise LLMError(f"config field 'num_kv_heads' is {kv}: without multi_query (and the new decoder "
                       f"architecture) every query head has its own key/value head ({heads})")
    bias = cfg.get("bias", FALCON_DEFAULTS["bias"])
    spec = dict(layers=_int(cfg, "num_hidden_layers"), hidden=hidden, heads=heads, kv_heads=1 if multi_query else heads,
                intermediate=_int(cfg, "ffn_hidden_size", 4 * hidden), vocab=_int(cfg, "vocab_size"),
                max_positions=_int(cfg, "max_position_embeddings", 2048),
                tied_embeddings=cfg.get("tie_word_embeddings", True), attention_bias=bias, mlp_bias=bias,
                model_type="falcon")
    return spec, hidden // heads


#: transformers' ``Gemma2Config`` defaults of the keys a config may leave out
GEMMA2_DEFAULTS = {"sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                   "query_pre_attn_scalar": 256}
#: transformers' ``GPTJConfig`` default rotary_dim
GPTJ_DEFAULT_ROTARY_DIM = 64


def _window(cfg: dict, model_type: str) -> "int | None":
    """The sliding attention window of a Mistral or Phi-3 config (None: full attention), as
    transformers reads it: Mistral's absent key is its 4096 default, an explicit null none."""
    if model_type == "mistral":
        return cfg["sliding_window"] if "sliding_window" in cfg else MISTRAL_DEFAULT_WINDOW
    if model_type in ("phi3", "mixtral"):
        return cfg.get("sliding_window")
    return None


def transformers_kwargs(cfg: dict, spec: ModelSpec, layers: "int | None" = None) -> dict:
    """The config fields a transformers model of ``spec`` is built from (checked by :func:`spec_of`),
    with ``layers`` blocks (default: the config's); nothing else of ``cfg`` is passed on.

    Raises
    ------
    LLMError
        An activation name transformers does not know (``hidden_act`` / ``activation_function``).
    """
    from transformers.activations import ACT2FN

    layers = spec.layers if layers is None else layers
    act_key, default = {"gpt2": ("activation_function", "gelu_new"), "gptj": ("activation_function", "gelu_new"),
                        "falcon": ("activation", None)}.get(spec.family, ("hidden_act", "silu"))
    if default is None:  # Falcon's default is its transformers config class's
        from transformers import FalconConfig

        default = FalconConfig().activation
    if spec.model_type == "gemma2":
        act_key, default = "hidden_activation", "gelu_pytorch_tanh"
    act = cfg.get(act_key) if cfg.get(act_key) is not None else default
    if act not in ACT2FN:
        raise LLMError(f"config field {act_key!r} is {_short(act)}; transformers knows {sorted(ACT2FN)}")
    if spec.family == "gptj":
        out = dict(n_embd=spec.hidden, n_head=spec.heads, n_layer=layers, n_inner=spec.intermediate,
                   n_positions=spec.max_positions, vocab_size=spec.vocab, activation_function=act,
                   rotary_dim=spec.rotary_dim, tie_word_embeddings=spec.tied_embeddings)
        keys = ("layer_norm_epsilon",)
    elif spec.family == "falcon":
        out = dict(hidden_size=spec.hidden, num_attention_heads=spec.heads, num_hidden_layers=layers,
                   ffn_hidden_size=spec.intermediate, max_position_embeddings=spec.max_positions, vocab_size=spec.vocab,
                   activation=act, multi_query=spec.kv_heads == 1 and spec.heads > 1, bias=spec.attention_bias,
                   parallel_attn=True, new_decoder_architecture=False, alibi=False,
                   tie_word_embeddings=spec.tied_embeddings)
        keys = ("layer_norm_epsilon",)
    elif spec.family == "gpt2":
        out = dict(n_embd=spec.hidden, n_head=spec.heads, n_layer=layers, n_inner=spec.intermediate,
                   n_positions=spec.max_positions, vocab_size=spec.vocab, activation_function=act,
                   tie_word_embeddings=spec.tied_embeddings)
        keys = ("layer_norm_epsilon", "scale_attn_weights", "reorder_and_upcast_attn")
    else:
        out = dict(hidden_size=spec.hidden, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                   head_dim=spec.head_dim, num_hidden_layers=layers, intermediate_size=spec.intermediate,
                   max_position_embeddings=spec.max_positions, vocab_size=spec.vocab, hidden_act=act,
                   tie_word_embeddings=spec.tied_embeddings)
        if spec.model_type in ("llama", ""):
            out.update(attention_bias=spec.attention_bias, mlp_bias=spec.mlp_bias)
        elif spec.model_type == "qwen2":
            out.update(use_sliding_window=False)
        elif spec.model_type == "gemma2":
            kinds = ["full_attention" if i in spec.global_layers else "sliding_attention" for i in range(layers)]
            out.update(sliding_window=spec.sliding_window, layer_types=kinds, hidden_activation=act,
                       attn_logit_softcapping=spec.attn_softcap, final_logit_softcapping=spec.final_softcap,
                       query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", GEMMA2_DEFAULTS["query_pre_attn_scalar"]))
        else:  # mistral, phi3, mixtral: the window (None: full attention) as spec_of read it
            out.update(sliding_window=spec.sliding_window)
            if spec.experts:
                out.update(num_local_experts=spec.experts, num_experts_per_tok=spec.experts_per_token)
        keys = ("rms_norm_eps",)
    out.update({k: cfg[k] for k in keys if cfg.get(k) is not None})
    return out


#: Largest tensor a plan maps (bytes). A planning limit, not a hardware number: the mapping
#: compiler's host memory grows with the tiles of the tensors it maps (measured: a Llama-2-7B
#: block's prefill of 8192 tokens, 8.6 GB of attention scores, plans in 1.1 GB of host memory),
#: so values past it are refused up front instead of exhausting the host.
PLAN_MAX_TENSOR_BYTES = 2**34


def check_plan_sizes(spec: ModelSpec, batch: int, seq: int, itemsize: int, cfg: "dict | None" = None) -> None:
    """Raise :class:`LLMError` when a tensor of the planned parts (one block's decode and prefill
    of ``seq`` tokens for ``batch`` users, the head) exceeds :data:`PLAN_MAX_TENSOR_BYTES`.

    The message names the tensor, the fields and arguments it is the product of (config keys
    quoted, as in ``cfg``), the bytes they imply and the limit."""
    gpt2 = spec.family in ("gpt2", "gptj")
    keys = dict(hidden="n_embd" if gpt2 else "hidden_size",
                inter="n_inner" if gpt2 else "ffn_hidden_size" if spec.family == "falcon" else "intermediate_size",
                heads="n_head" if gpt2 else "num_attention_heads", vocab="vocab_size")
    q = spec.heads * spec.head_dim
    qkv = q + 2 * spec.kv_heads * spec.head_dim
    widest = max(spec.hidden, spec.intermediate, qkv)
    wide_key = (f"'{keys['inter']}'" if widest == spec.intermediate else f"'{keys['hidden']}'" if widest == spec.hidden
                else "q/k/v width")
    weight = max((spec.vocab * spec.hidden, keys["vocab"]), (spec.hidden * spec.intermediate, keys["inter"]),
                 (spec.hidden * qkv, keys["hidden"]), (q * spec.hidden, keys["hidden"]))
    tensors = [
        ("the prefill's attention scores (batch x heads x seq x seq x 4 bytes)",
         batch * spec.heads * seq * seq * 4, [("batch", batch), ("seq", seq), (f"'{keys['heads']}'", spec.heads)]),
        ("the prefill's widest activation (batch x seq x width x 4 bytes)",
         batch * seq * widest * 4, [("batch", batch), ("seq", seq), (wide_key, widest)]),
        ("one block's KV cache (2 x batch x kv heads x cache slots x head dim x 4 bytes)",
         2 * batch * spec.kv_heads * spec.cache_slots(seq) * spec.head_dim * 4, [("batch", batch), ("seq", seq)]),
        ("the logits (batch x vocab x 4 bytes)", batch * spec.vocab * 4,
         [("batch", batch), (f"'{keys['vocab']}'", spec.vocab)]),
        (f"the largest weight ({itemsize}-byte elements)", weight[0] * itemsize,
         [(f"'{weight[1]}'", spec.vocab if weight[1] == keys["vocab"] else
           spec.intermediate if weight[1] == keys["inter"] else spec.hidden)]),
    ]
    what, nbytes, fields = max(tensors, key=lambda t: t[1])
    if nbytes > PLAN_MAX_TENSOR_BYTES:
        named = ", ".join(f"{k}={v}" for k, v in fields)
        raise LLMError(f"{named}: {what} would be {nbytes} bytes, more than the {PLAN_MAX_TENSOR_BYTES} bytes "
                       "a plan maps (its mapping would exhaust the host's memory); plan a shorter seq, a "
                       "smaller batch or a smaller model")
