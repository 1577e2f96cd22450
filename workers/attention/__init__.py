"""Attention backends behind one switch: `torch` (CPU, CUDA fallback) and `flashinfer` (CUDA)."""

from __future__ import annotations

import torch

from ..kv_pool import KVPool
from .base import AttentionBackend, ForwardBatch
from .torch_backend import TorchAttentionBackend


def make_backend(name: str, pool: KVPool, req_to_token: torch.Tensor, num_q_heads: int,
                 head_dim: int) -> AttentionBackend:
    """The backend called `name` ("torch" or "flashinfer"); flashinfer is imported only here."""
    if name == "torch":
        return TorchAttentionBackend(pool, req_to_token, num_q_heads, head_dim)
    if name == "flashinfer":
        if req_to_token.device.type != "cuda":
            raise ValueError("the flashinfer backend needs CUDA; use attention_backend='torch'")
        from .flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(pool, req_to_token, num_q_heads, head_dim)
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'flashinfer'")


__all__ = ["AttentionBackend", "ForwardBatch", "TorchAttentionBackend", "make_backend"]
