"""The Llama family (Llama 2/3, Mistral, SmolLM2), Qwen2 (bias on q/k/v) and Qwen3 (q/k norms).

Module names follow the Hugging Face checkpoints, except for the merged projections
(`qkv_proj`, `gate_up_proj`); `PACKED_MODULES` maps the checkpoint names onto them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.base import AttentionBackend
from ..config import ModelConfig
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..parallel import TPGroup

# checkpoint module name -> (our module name, shard id)
PACKED_MODULES: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, group: TPGroup) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_heads,
                                          config.num_kv_heads, config.attention_bias, group)
        heads = self.qkv_proj.heads
        self.num_q_heads = heads.num_q_heads
        self.num_kv_heads = heads.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, bias=False, group=group,
            in_shard=(heads.q_head_start * config.head_dim, self.q_size))
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rope: RotaryEmbedding,
                backend: AttentionBackend) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_q_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)[0]
            k = self.k_norm(k)[0]
        q, k = rope.apply(positions, q, k)
        out = backend.forward(self.layer_id, q, k, v.contiguous())
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, group: TPGroup) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size],
                                                       group=group)
        self.down_proj = RowParallelLinear(size, config.hidden_size, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, group: TPGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, group)
        self.mlp = LlamaMLP(config, group)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, rope: RotaryEmbedding,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rope, backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, group: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, group) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                backend: AttentionBackend) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, rope, backend)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """`forward` returns the final hidden states of all tokens; `compute_logits` applies the
    vocab-parallel head to the rows that are sampled."""

    packed_modules = PACKED_MODULES

    def __init__(self, config: ModelConfig, group: TPGroup) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, group)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, group)
        self.rope: RotaryEmbedding | None = None

    def init_buffers(self, device: torch.device | str) -> None:
        """Build the non-parameter tables on the real device (after the meta build)."""
        c = self.config
        self.rope = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta,
                                    c.rope_scaling, device=device)

    def checkpoint_aliases(self, name: str) -> list[str]:
        """Other parameters that a checkpoint tensor also fills (tied embeddings)."""
        if self.config.tie_word_embeddings and name == "model.embed_tokens.weight":
            return ["lm_head.weight"]
        return []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        if self.rope is None:
            raise RuntimeError("call init_buffers(device) before the first forward")
        return self.model(input_ids, positions, self.rope, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)
