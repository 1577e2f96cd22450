"""RMSNorm, optionally fused with the residual add, and Gemma's (1 + weight) variant."""

from __future__ import annotations

import torch
from torch import nn

from .source import CheckpointTensor, copy_checked


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor,
                      shard_id: str | int | None = None) -> None:
        copy_checked(param, loaded.read())

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new residual); the residual is `x (+ residual)` before the norm."""
        if residual is not None:
            x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight), in float32, then casts back."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(dtype)
