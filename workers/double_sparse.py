"""The double-sparse KV pool (`WorkerConfig.kv_pool == "double-sparse"`): its heavy channels and
its backend.

Heavy channels, per layer and KV head, come from one of two places:
- a calibration file (`ds_channel_config`): JSON mapping "model.layers.{i}.self_attn.k_proj"
  to one list of channel indices per KV head of the model, best first (the first
  `ds_heavy_channel_num` of each are used);
- without one, a calibration prompt: `CALIBRATION_TOKENS` fixed pseudo-random token ids run as
  one extend before serving, and each head keeps the channels with the largest sum over tokens
  of |q_c| * |k_c| (q summed over the query heads that share the KV head), as the DoubleSparse
  paper ranks channels by their contribution to q.k.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from .attention.base import ForwardBatch, LayerAttention
from .attention.double_sparse_backend import DoubleSparseBackend
from .config import ModelConfig, WorkerConfig
from .kv_pool import DoubleSparseKVPool, KVPoolConfig
from .parallel import HeadShard
from .warmup import CausalLM

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 256


def make_double_sparse(config: WorkerConfig, mc: ModelConfig, pool_config: KVPoolConfig,
                       heads: HeadShard, req_to_token: torch.Tensor, model: CausalLM,
                       layers: list[LayerAttention], device: torch.device
                       ) -> tuple[DoubleSparseKVPool, DoubleSparseBackend]:
    """The pool and backend, with the heavy channels set (read or calibrated here)."""
    if config.attention_backend != "torch" or mc.mla is not None:
        raise ValueError("kv_pool 'double-sparse' runs with attention_backend 'torch' and "
                         "multi-head (not latent) attention")
    pool = DoubleSparseKVPool(pool_config, device, config.ds_heavy_channel_num)
    backend = DoubleSparseBackend(pool, req_to_token, heads.num_q_heads, mc.head_dim, layers,
                                  config.ds_heavy_token_num, config.ds_sparse_decode_threshold)
    if config.ds_channel_config:
        channels = read_channels(config.ds_channel_config, mc.num_layers, heads,
                                 config.ds_heavy_channel_num)
        logger.info("double-sparse: heavy channels from %s", config.ds_channel_config)
    else:
        channels = calibrate(model, backend, req_to_token, mc.vocab_size, device,
                             config.ds_heavy_channel_num)
        logger.info("double-sparse: heavy channels measured on a %d-token calibration prompt",
                    CALIBRATION_TOKENS)
    pool.heavy_channels.copy_(channels)
    return pool, backend


def read_channels(path: str | Path, num_layers: int, heads: HeadShard,
                  num_channels: int) -> torch.Tensor:
    """[layers, this rank's KV heads, num_channels] from a calibration file."""
    raw = json.loads(Path(path).read_text())
    out = torch.zeros(num_layers, heads.num_kv_heads, num_channels, dtype=torch.long)
    for layer in range(num_layers):
        key = f"model.layers.{layer}.self_attn.k_proj"
        per_head = raw.get(key)
        if not isinstance(per_head, list):
            raise ValueError(f"double-sparse channel file {path} has no list for {key!r}")
        for h in range(heads.num_kv_heads):
            row = per_head[heads.kv_head_start + h][:num_channels]
            if len(row) < num_channels:
                raise ValueError(f"{path}: {key} head {heads.kv_head_start + h} lists "
                                 f"{len(row)} channels, {num_channels} are needed")
            out[layer, h] = torch.tensor(row)
    return out


@torch.inference_mode()
def calibrate(model: CausalLM, backend: DoubleSparseBackend, req_to_token: torch.Tensor,
              vocab_size: int, device: torch.device, num_channels: int) -> torch.Tensor:
    """Run the calibration prompt and rank each head's channels. It uses request row 0 and
    the slots right after the padding page (nothing is cached yet), and gives both back."""
    pool_config = backend.pool.config
    num_tokens = min(CALIBRATION_TOKENS, pool_config.max_num_tokens, req_to_token.shape[1])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (num_tokens,), generator=gen)
    slots = torch.arange(num_tokens) + pool_config.page_size
    req_to_token[0, :num_tokens] = slots.to(req_to_token.dtype).to(device)
    backend.calibration = [torch.zeros(pool_config.num_kv_heads, pool_config.head_dim,
                                       device=device) for _ in range(pool_config.num_layers)]
    try:
        batch = ForwardBatch(np.zeros(1, np.int64), np.zeros(1, np.int64),
                             np.array([num_tokens], np.int64), ids.to(device),
                             torch.arange(num_tokens, device=device), slots.to(device))
        backend.prepare(batch)
        model(batch.input_ids, batch.positions, backend)
        stats = torch.stack(backend.calibration)  # [layers, Hk, D]
    finally:
        backend.calibration = None
        req_to_token[0].zero_()
    return stats.topk(num_channels, dim=-1).indices.sort(dim=-1).values
