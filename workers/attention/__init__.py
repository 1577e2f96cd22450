"""Attention backends behind one switch: `torch` (CPU, CUDA fallback) and `flashinfer` (CUDA)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from ..config import MLAConfig
from ..kv_pool import KVPool, MLAKVPool
from .base import AttentionBackend, ForwardBatch, LayerAttention
from .mla_backend import MLABackend
from .torch_backend import TorchAttentionBackend


def make_backend(name: str, pool: KVPool | MLAKVPool, req_to_token: torch.Tensor,
                 num_q_heads: int, head_dim: int, layers: Sequence[LayerAttention] | None = None,
                 mla: MLAConfig | None = None, graph_plan: str = "once") -> AttentionBackend:
    """The backend called `name` ("torch" or "flashinfer"); flashinfer is imported only here.
    Latent attention (`mla`, over an `MLAKVPool`) has the torch backend only. `graph_plan`:
    how flashinfer's CUDA-graph decode is planned (flashinfer_backend.py)."""
    if mla is not None or isinstance(pool, MLAKVPool):
        if mla is None or not isinstance(pool, MLAKVPool):
            raise TypeError("latent attention needs both its config and the latent pool")
        if name != "torch":
            raise ValueError(f"attention_backend {name!r} has no latent attention (MLA, "
                             "DeepSeek); use attention_backend='torch' (--attention-backend "
                             "torch --disable-cuda-graph)")
        return MLABackend(pool, req_to_token, num_q_heads, mla, layers)
    if name == "torch":
        return TorchAttentionBackend(pool, req_to_token, num_q_heads, head_dim, layers)
    if name == "flashinfer":
        if req_to_token.device.type != "cuda":
            raise ValueError("the flashinfer backend needs CUDA; use attention_backend='torch'")
        require_flashinfer()
        from .flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(pool, req_to_token, num_q_heads, head_dim, layers,
                                          graph_plan)
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'flashinfer'")


FLASHINFER_MISSING = (
    "attention backend 'flashinfer' needs the flashinfer package, which is not installed here: "
    "install it with `pip install 'raydix[cuda]'` (the flashinfer-python wheel), or choose the "
    "slower torch attention explicitly with --attention-backend torch")


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def require_flashinfer() -> None:
    """Raise ValueError with the one-line fix when flashinfer cannot be imported."""
    if not flashinfer_installed():
        raise ValueError(FLASHINFER_MISSING)
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{FLASHINFER_MISSING} (importing it failed: {e})") from e


__all__ = ["AttentionBackend", "ForwardBatch", "LayerAttention", "MLABackend",
           "TorchAttentionBackend",
           "flashinfer_installed", "make_backend", "require_flashinfer"]
