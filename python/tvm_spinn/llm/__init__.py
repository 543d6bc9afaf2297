"""Large language models on spinn systems: KV-cache generation and planning from a config.

* :func:`compile` -> :class:`CompiledLLM` with ``generate`` (greedy, KV cache on the device)
  and ``report`` (time to first token, decode latency, tokens/s, energy);
* :func:`plan` -> :class:`Plan`: timing of a model from its config alone (no weights).
"""

from .plan import Plan, plan
from .session import CompiledLLM, GenerationReport, compile
from .spec import LLMError, ModelSpec, spec_of

__all__ = ["compile", "CompiledLLM", "GenerationReport", "plan", "Plan", "LLMError", "ModelSpec", "spec_of"]
