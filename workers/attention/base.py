"""What every attention backend receives, and the contract it keeps."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends: a sliding window, the softmax scale, a logit soft cap."""

    window: int = 0  # positions a query sees: itself and window - 1 before it; 0 = all
    scale: float | None = None  # None: head_dim ** -0.5
    logit_softcap: float = 0.0  # scores become cap * tanh(scores / cap); 0 = off

    def softmax_scale(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else head_dim ** -0.5

    def is_plain(self, head_dim: int) -> bool:
        return not self.window and not self.logit_softcap and (
            self.scale is None or self.scale == head_dim ** -0.5)


@dataclass
class ForwardBatch:
    """One step's packed batch, in plan order.

    Request i owns packed tokens [token_starts[i], token_starts[i] + extend_lens[i]); its query
    tokens sit at positions prefix_lens[i] .. seq_lens[i] - 1 and attend to K/V at positions
    [0, seq_lens[i]) of request row row_idx[i]. Host arrays are numpy int64; tensors are on the
    rank's device.
    """

    row_idx: np.ndarray  # [B]
    prefix_lens: np.ndarray  # [B] tokens already in the pool before this step
    extend_lens: np.ndarray  # [B] new tokens this step (1 for decode)
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, the slot each new token's K/V goes to
    # [B] each row's version in the request table (req_table.py): a backend may keep what it
    # read from rows whose version did not change; None: nothing is kept between steps
    row_versions: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return len(self.row_idx)

    @property
    def num_tokens(self) -> int:
        return int(self.extend_lens.sum())

    @property
    def seq_lens(self) -> np.ndarray:
        return self.prefix_lens + self.extend_lens

    @property
    def token_starts(self) -> np.ndarray:
        return np.cumsum(self.extend_lens) - self.extend_lens

    @property
    def is_decode(self) -> bool:
        """Every request adds exactly one token."""
        return bool((self.extend_lens == 1).all())


class AttentionBackend(ABC):
    """Writes each layer's new K/V into the pool and attends through the request->token table.

    `prepare` runs once per step, before the first layer; it builds whatever index tensors and
    masks every layer shares. `forward` is called once per layer with this step's q/k/v.
    The table rows named by the batch must already hold the slots of positions [0, seq_len),
    the new tokens' slots (`out_cache_loc`) included. Layers attend as their `LayerAttention`
    says (all plain when the backend is given none); a windowed layer still finds every
    position's K/V in the pool, since the cache keeps whole prefixes.
    """

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Build the step's shared metadata."""

    @abstractmethod
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] for this rank's heads; returns [T, Hq * D]."""
