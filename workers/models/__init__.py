"""Model definitions, chosen by the `architectures` entry of config.json."""

from __future__ import annotations

from ..config import ModelConfig
from ..parallel import TPGroup
from .llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def build_model(config: ModelConfig, group: TPGroup) -> LlamaForCausalLM:
    """Construct (on the current default device, e.g. meta) the model for `config`."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ValueError(f"no model class for architecture {config.architecture!r}")
    return cls(config, group)


__all__ = ["MODEL_CLASSES", "LlamaForCausalLM", "build_model"]
