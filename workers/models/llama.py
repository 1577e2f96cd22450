"""The Llama family (Llama 2/3, Mistral, SmolLM2), Qwen2 (bias on q/k/v) and Qwen3 (q/k norms);
with other norms and sandwich norms also the base of Gemma (gemma.py) and Phi-3 (phi3.py).

Module names follow the Hugging Face checkpoints, except for the merged projections
(`qkv_proj`, `gate_up_proj`); `PACKED_MODULES` maps the checkpoint names onto them. Sliding
windows, the softmax scale and logit soft caps are the attention backend's business: the runner
hands it each layer's `LayerAttention` (`layer_attention`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..attention.base import AttentionBackend, LayerAttention
from ..config import ModelConfig, RopeConfig
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.fused import TORCH_OPS, FusedOps, UsesFusedOps
from ..layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..layers.source import CheckpointTensor
from ..parallel import TPGroup

NormFactory = Callable[[int, float], RMSNorm]

# checkpoint module name -> (our module name, shard id)
PACKED_MODULES: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, group: TPGroup,
                 norm: NormFactory = RMSNorm) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_heads,
                                          config.num_kv_heads, config.qkv_bias, group)
        heads = self.qkv_proj.heads
        self.num_q_heads = heads.num_q_heads
        self.num_kv_heads = heads.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, bias=config.o_bias, group=group,
            in_shard=(heads.q_head_start * config.head_dim, self.q_size))
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = norm(config.head_dim, config.rms_norm_eps)
            self.k_norm = norm(config.head_dim, config.rms_norm_eps)

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
        out = backend.forward(self.layer_id, q, k, v)
        return self.o_proj(out)


class LlamaMLP(nn.Module, UsesFusedOps):
    def __init__(self, config: ModelConfig, group: TPGroup) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size],
                                                       bias=config.mlp_bias, group=group)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=config.mlp_bias,
                                           group=group)
        self.act = config.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.act_and_mul(self.act, self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; with `sandwich` (Gemma 2/3) the attention and MLP outputs are normed
    too (`post_attention_layernorm` then norms the attention output, `pre_feedforward_layernorm`
    the MLP input)."""

    def __init__(self, config: ModelConfig, layer_id: int, group: TPGroup,
                 norm: NormFactory = RMSNorm, sandwich: bool = False) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_id, group, norm)
        self.mlp = LlamaMLP(config, group)
        self.input_layernorm = norm(size, eps)
        self.post_attention_layernorm = norm(size, eps)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if sandwich:
            self.pre_feedforward_layernorm = norm(size, eps)
            self.post_feedforward_layernorm = norm(size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, rope: RotaryEmbedding,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rope, backend)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden = self.post_attention_layernorm(hidden)[0]
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden))[0], residual


class LlamaModel(nn.Module):
    """With `embed_scale` (Gemma) the embeddings are multiplied by sqrt(hidden_size), rounded
    to the model's dtype as transformers does."""

    def __init__(self, config: ModelConfig, group: TPGroup, norm: NormFactory = RMSNorm,
                 sandwich: bool = False, embed_scale: bool = False) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, group, norm, sandwich) for i in range(config.num_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = config.hidden_size ** 0.5 if embed_scale else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ropes: list[RotaryEmbedding], backend: AttentionBackend) -> torch.Tensor:
        hidden = self.embed(input_ids)
        residual = None
        for layer, rope in zip(self.layers, ropes, strict=True):
            hidden, residual = layer(positions, hidden, residual, rope, backend)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """`forward` returns the final hidden states of all tokens; `compute_logits` applies the
    vocab-parallel head to the rows that are sampled."""

    packed_modules = PACKED_MODULES

    def __init__(self, config: ModelConfig, group: TPGroup, norm: NormFactory = RMSNorm,
                 sandwich: bool = False, embed_scale: bool = False) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, group, norm, sandwich, embed_scale)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, group)
        self.ropes: list[RotaryEmbedding] = []  # one per layer; layers of a kind share one
        self.fused_ops: FusedOps = TORCH_OPS

    def init_buffers(self, device: torch.device | str) -> None:
        """Build the non-parameter tables on the real device (after the meta build)."""
        c = self.config
        tables = {rope: RotaryEmbedding(c.head_dim, rope, _max_positions(c, rope), device,
                                        self.fused_ops)
                  for rope in {c.layer_rope(i) for i in range(c.num_layers)}}
        self.ropes = [tables[c.layer_rope(i)] for i in range(c.num_layers)]

    def use_fused_ops(self, ops: FusedOps) -> None:
        """Run every fused step (norms, rope, activations) through `ops` (layers/fused.py)."""
        self.fused_ops = ops
        for module in self.modules():
            if isinstance(module, UsesFusedOps):
                module.ops = ops
        for rope in self.ropes:
            rope.ops = ops

    def layer_attention(self) -> list[LayerAttention]:
        """How each layer attends, for the attention backend."""
        c = self.config
        return [LayerAttention(w, c.attn_scale, c.attn_logit_softcap) for w in c.layer_windows]

    def checkpoint_parts(self, name: str,
                         tensor: CheckpointTensor) -> Iterator[tuple[str, CheckpointTensor]]:
        """The checkpoint tensors a stored tensor holds (a fused one holds several)."""
        yield name, tensor

    def checkpoint_aliases(self, name: str) -> list[str]:
        """Other parameters that a checkpoint tensor also fills (tied embeddings)."""
        if self.config.tie_word_embeddings and name == "model.embed_tokens.weight":
            return ["lm_head.weight"]
        return []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        if not self.ropes:
            raise RuntimeError("call init_buffers(device) before the first forward")
        return self.model(input_ids, positions, self.ropes, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits


def _max_positions(config: ModelConfig, rope: RopeConfig) -> int:
    """Positions the rope table covers: dynamic scaling stretches max_position_embeddings by
    its factor; the other types' max_position_embeddings already is the model's length."""
    if rope.rope_type == "dynamic":
        return int(config.max_position_embeddings * rope.factor)
    return config.max_position_embeddings
