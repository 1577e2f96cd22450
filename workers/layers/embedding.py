"""Vocab-parallel token embedding and LM head.

The vocabulary is padded up to a multiple of `tp_size`; rank r owns rows
[r * V_pad / tp, (r + 1) * V_pad / tp). Rows past the real vocabulary stay zero in the
embedding and are cut off the gathered logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import SINGLE_RANK, TPGroup
from .packed import linear
from .source import CheckpointTensor, copy_checked


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.group = group
        per_rank = padded_vocab_size(vocab_size, group.tp_size) // group.tp_size
        self.vocab_start = group.tp_rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor,
                      shard_id: str | int | None = None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"checkpoint vocab is {loaded.shape[0]}, config says "
                             f"{self.vocab_size}")
        real = max(0, min(self.vocab_end, self.vocab_size) - self.vocab_start)
        with torch.no_grad():
            param.zero_()
        if real:
            copy_checked(param.narrow(0, 0, real), loaded.narrow(0, self.vocab_start, real))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight)
        out = out * in_range.unsqueeze(-1).to(out.dtype)
        return self.group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary, gathered on every rank.

    With tied embeddings the model loads `embed_tokens.weight` into this layer too.
    """

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup = SINGLE_RANK) -> None:
        super().__init__(vocab_size, hidden_size, group)
        self.packed_weight: torch.Tensor | None = None  # see layers/packed.py

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, self.packed_weight)
        logits = self.group.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
