"""RMSNorm, optionally fused with the residual add, and Gemma's (1 + weight) variant; the
computation is the fused-op seam's (fused.py)."""

from __future__ import annotations

import torch
from torch import nn

from .fused import UsesFusedOps
from .source import CheckpointTensor, copy_checked


class RMSNorm(nn.Module, UsesFusedOps):
    gemma = False  # scale by (1 + weight), in float32 (Gemma)

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor,
                      shard_id: str | int | None = None) -> None:
        copy_checked(param, loaded.read())

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new residual); the residual is `x (+ residual)` before the norm.
        With a residual, x and residual may be overwritten (the fused kernel works in place)."""
        if residual is None:
            return self.ops.rmsnorm(x, self.weight, self.eps, self.gemma), x
        return self.ops.add_rmsnorm(x, residual, self.weight, self.eps, self.gemma)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight), in float32, then casts back."""

    gemma = True
