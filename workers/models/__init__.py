"""Model definitions, chosen by the `architectures` entry of config.json (registry.py)."""

from __future__ import annotations

from .llama import LlamaForCausalLM
from .registry import ARCHITECTURES, build_model, parse_model_config, supported_table

__all__ = ["ARCHITECTURES", "LlamaForCausalLM", "build_model", "parse_model_config",
           "supported_table"]
