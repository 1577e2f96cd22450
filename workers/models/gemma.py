"""Gemma, Gemma 2 and Gemma 3 (text): the Llama block with Gemma's (1 + weight) RMSNorm and
embeddings scaled by sqrt(hidden_size); Gemma 2 and 3 add sandwich norms around attention and
MLP. Their soft caps, `query_pre_attn_scalar`, alternating windows, q/k norms (Gemma 3) and
per-layer-type rope (Gemma 3) come from the `ModelConfig` that registry.py reads."""

from __future__ import annotations

from ..config import ModelConfig
from ..layers.norm import GemmaRMSNorm
from ..parallel import TPGroup
from .llama import LlamaForCausalLM


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, group: TPGroup) -> None:
        super().__init__(config, group, norm=GemmaRMSNorm, embed_scale=True)


class Gemma2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, group: TPGroup) -> None:
        super().__init__(config, group, norm=GemmaRMSNorm, sandwich=True, embed_scale=True)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's layout; its q/k norms and per-layer-type rope are config (`qk_norm`,
    `local_rope`)."""
