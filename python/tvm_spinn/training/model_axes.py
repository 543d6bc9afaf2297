"""The axes a parallel plan splits, read from a model: attention heads (tensor parallelism)
and layers (pipeline parallelism)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import TrainingError

__all__ = ["ModelAxes", "model_axes"]

# transformers' config fields, per model family (GPT-2's names, then the Llama/BERT names)
_HEADS = ("n_head", "num_attention_heads")
_LAYERS = ("n_layer", "num_hidden_layers")


@dataclass(frozen=True)
class ModelAxes:
    """Extents of the split axes: ``heads`` (attention heads per layer), ``layers``."""

    heads: int
    layers: int


def _field(config, names) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def model_axes(model) -> ModelAxes:
    """The heads and layers of a model holding a ``transformers`` configuration (the model
    itself or a submodule, e.g. a wrapper around a ``GPT2LMHeadModel``).

    Raises
    ------
    TrainingError
        When no submodule has a configuration with both fields.
    """
    for _, sub in sorted(model.named_modules(), key=lambda item: item[0].count(".")):
        config = getattr(sub, "config", None)
        if config is None:
            continue
        heads, layers = _field(config, _HEADS), _field(config, _LAYERS)
        if heads is not None and layers is not None:
            return ModelAxes(heads, layers)
    raise TrainingError(f"parallel: tp and pp split attention heads and layers, and model {type(model).__name__} "
                        "has no transformers configuration naming them (n_head/num_attention_heads, "
                        "n_layer/num_hidden_layers)")
