"""The architecture of a decoder-only language model, read from a transformers config.

One frozen record (:class:`ModelSpec`) holds what generation and planning need: the family
(``gpt2`` or ``llama``), sizes, heads, and the derived parameter and KV-cache byte counts. It is
read from a transformers ``PretrainedConfig``, a model carrying one, a dict or a JSON file,
and every missing or invalid field is one :class:`LLMError` naming the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

__all__ = ["LLMError", "ModelSpec", "FAMILIES", "spec_of", "load_config"]

#: model_type values this package knows, by family
FAMILIES = {"gpt2": "gpt2", "llama": "llama"}


class LLMError(ValueError):
    """Bad input to the LLM flow: the message names the field (config key, argument, shape)."""


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a decoder-only transformer (GPT-2 or Llama architecture)."""

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

    @property
    def params(self) -> int:
        """Number of parameters (embeddings included; a tied LM head counted once)."""
        h, i, v = self.hidden, self.intermediate, self.vocab
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        if self.family == "gpt2":
            layer = h * (q + 2 * kv) + (q + 2 * kv) + q * h + h + 2 * h * i + i + h + 4 * h
            extra = self.max_positions * h + 2 * h
        else:
            layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
            extra = h
        head = 0 if self.tied_embeddings else v * h
        return self.layers * layer + v * h + head + extra

    def layer_params(self) -> int:
        """Parameters of one transformer layer."""
        one = ModelSpec(self.family, 1, self.hidden, self.heads, self.kv_heads, self.head_dim,
                        self.intermediate, 0, 0, True)
        return one.params - (2 * self.hidden if self.family == "gpt2" else self.hidden)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of K and V cached per token of one sequence (all layers)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


def load_config(path: str) -> dict:
    """Read a transformers ``config.json``; a missing or malformed file is an :class:`LLMError`."""
    if not os.path.isfile(path):
        raise LLMError(f"config file {path!r} does not exist")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise LLMError(f"config file {path!r} is not valid JSON: {err}") from None
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
        out = config.to_dict()
        # attributes a config computes (not always serialized), e.g. head_dim
        for key in ("head_dim", "num_key_value_heads", "model_type"):
            if getattr(config, key, None) is not None:
                out[key] = getattr(config, key)
        return out
    raise LLMError(f"expected a transformers config, model, dict or JSON path, got {type(config).__name__}")


def _int(cfg: dict, key: str, default=None, minimum: int = 1) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise LLMError(f"config field {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LLMError(f"config field {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def spec_of(config) -> ModelSpec:
    """The :class:`ModelSpec` of a transformers config / model / dict / ``config.json`` path.

    Raises
    ------
    LLMError
        Unknown ``model_type`` (the message lists the known ones), a missing field, a field that
        is not a positive integer, or heads that do not divide the hidden size.
    """
    cfg = _as_dict(config)
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise LLMError(f"config field 'model_type' is {model_type!r}; supported: {sorted(FAMILIES)}")
    family = FAMILIES[model_type]
    if family == "gpt2":
        hidden = _int(cfg, "n_embd")
        heads = _int(cfg, "n_head")
        spec = dict(layers=_int(cfg, "n_layer"), hidden=hidden, heads=heads, kv_heads=heads,
                    intermediate=4 * hidden if cfg.get("n_inner") is None else _int(cfg, "n_inner"),
                    vocab=_int(cfg, "vocab_size"), max_positions=_int(cfg, "n_positions"),
                    tied_embeddings=bool(cfg.get("tie_word_embeddings", True)))
        if hidden % heads:
            raise LLMError(f"config field 'n_head' ({heads}) does not divide 'n_embd' ({hidden})")
        head_dim = hidden // heads
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
        spec = dict(layers=_int(cfg, "num_hidden_layers"), hidden=hidden, heads=heads, kv_heads=kv_heads,
                    intermediate=_int(cfg, "intermediate_size"), vocab=_int(cfg, "vocab_size"),
                    max_positions=_int(cfg, "max_position_embeddings"),
                    tied_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    spec.setdefault("kv_heads", spec["heads"])
    return ModelSpec(family=family, head_dim=head_dim, **spec)
