"""DeepSeek-V2 and V3: multi-head latent attention (MLA) and a mixture of experts after the
first `first_k_dense_replace` dense layers.

Attention per token: q from the hidden state (directly, or through the `q_lora_rank` bottleneck
`q_a_proj` -> norm -> `q_b_proj`), and one latent `kv_a_proj_with_mqa(x)` = [c_kv | k_pe] shared
by every head; c_kv is normed, k_pe rotated. The latent is what the KV pool keeps (kv_pool.py,
`MLAKVPool`). `kv_b_proj` maps c_kv to each head's k_nope and v; the attention backend either
applies it to the cached latents (prefill) or folds it into the query and the output (decode;
attention/mla_backend.py).

Tensor parallelism: heads are split over the ranks (q projections, `kv_b_proj`, `o_proj`); the
latent projection is replicated, so every rank computes and keeps the whole latent.

Rotary pairs: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; q_pe and k_pe are
de-interleaved to (x0, x2, ..., x1, x3, ...) and rotated in the rotate-half layout, which
gives the same q.k products (and, for V3, the very values transformers produces).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ..attention.base import AttentionBackend
from ..config import MLAConfig, ModelConfig
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.fused import TORCH_OPS
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from ..layers.moe import ReplicatedLinear, SparseMoE
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..layers.source import CheckpointTensor
from ..parallel import TPGroup, head_shard
from .llama import LlamaForCausalLM, LlamaMLP

PACKED_MODULES: dict[str, tuple[str, str | int]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class KVUpProjection(nn.Module):
    """`kv_b_proj`: c_kv [r] -> this rank's heads' [k_nope (dn) | v (dv)]. Kept unpacked: the
    backend reads it per head (`per_head`) to fold it into the query and output at decode."""

    def __init__(self, mla: MLAConfig, q_head_start: int, num_heads: int) -> None:
        super().__init__()
        rows = mla.qk_nope_head_dim + mla.v_head_dim
        self.out_start, self.out_size = q_head_start * rows, num_heads * rows
        self.num_heads = num_heads
        self.weight = nn.Parameter(torch.empty(self.out_size, mla.kv_lora_rank),
                                   requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor,
                      shard_id: str | int | None = None) -> None:
        with torch.no_grad():
            param.copy_(loaded.narrow(0, self.out_start, self.out_size))

    def per_head(self) -> torch.Tensor:
        """[heads, dn + dv, r]."""
        return self.weight.view(self.num_heads, -1, self.weight.shape[1])


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, group: TPGroup) -> None:
        super().__init__()
        mla = config.mla
        if mla is None:
            raise ValueError("DeepSeek attention needs an MLA config")
        self.mla = mla
        self.layer_id = layer_id
        hidden, num_heads = config.hidden_size, config.num_heads
        heads = head_shard(num_heads, num_heads, group.tp_rank, group.tp_size)
        self.num_heads = heads.num_q_heads
        qk = mla.qk_head_dim
        q_shard = (heads.q_head_start * qk, self.num_heads * qk)
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ReplicatedLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, num_heads * qk, out_shard=q_shard)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, mla.q_lora_rank)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, num_heads * qk,
                                                 out_shard=q_shard)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, mla.latent_dim)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = KVUpProjection(mla, heads.q_head_start, self.num_heads)
        self.o_proj = RowParallelLinear(
            num_heads * mla.v_head_dim, hidden, group=group,
            in_shard=(heads.q_head_start * mla.v_head_dim, self.num_heads * mla.v_head_dim))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rope: RotaryEmbedding,
                backend: AttentionBackend) -> torch.Tensor:
        from ..attention.mla_backend import MLABackend

        if not isinstance(backend, MLABackend):
            raise TypeError("latent attention needs an MLA backend (attention/mla_backend.py)")
        mla = self.mla
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        elif (self.q_a_proj is not None and self.q_a_layernorm is not None
              and self.q_b_proj is not None):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))[0])
        else:
            raise RuntimeError("MLA needs q_proj or q_a_proj, q_a_layernorm and q_b_proj")
        q = q.view(-1, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)[0]
        if mla.rope_interleave:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = rope.apply(positions, q_pe, k_pe.unsqueeze(1))
        out = backend.forward_mla(self.layer_id, q_nope, q_pe, torch.cat((c_kv, k_pe[:, 0]), -1),
                                  self.kv_b_proj.per_head())
        return self.o_proj(out)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, group: TPGroup) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, layer_id, group)
        moe = config.moe
        self.mlp: nn.Module
        if moe is not None and moe.sparse_layers[layer_id]:
            self.mlp = SparseMoE(config.hidden_size, moe, config.hidden_act, group)
        else:
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


class DeepseekModel(nn.Module):
    def __init__(self, config: ModelConfig, group: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, group) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ropes: list[RotaryEmbedding], backend: AttentionBackend) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, rope in zip(self.layers, ropes, strict=True):
            hidden, residual = layer(positions, hidden, residual, rope, backend)
        return self.norm(hidden, residual)[0]


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 and V3 (their differences are config: routing, rope layout). Shares the
    Llama model's rope tables (`head_dim` is `qk_rope_head_dim`), softmax scale (`attn_scale`,
    with yarn's mscale), head and tied embeddings; its blocks are its own."""

    packed_modules = PACKED_MODULES

    def __init__(self, config: ModelConfig, group: TPGroup) -> None:
        nn.Module.__init__(self)  # not the Llama blocks
        self.config = config
        self.model = DeepseekModel(config, group)  # type: ignore[assignment]
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, group)
        self.ropes = []
        self.fused_ops = TORCH_OPS

    def checkpoint_parts(self, name: str,
                         tensor: CheckpointTensor) -> Iterator[tuple[str, CheckpointTensor]]:
        """Skips the multi-token-prediction layers stored after the last layer (V3)."""
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= self.config.num_layers:
            return
        yield name, tensor
