"""Per-request sampling on the device: greedy, temperature, top-k, top-p, min-p, seeds, logit
biases and banned tokens (applied to the logits sampled from; logprobs stay those of the model).

No `torch.multinomial`: a sample is `argmax(probs / E)` with E ~ Exponential(1) per vocabulary
entry (the exponential-race form of the Gumbel trick). A seeded request draws E from a generator
seeded by (seed, position of the sampled token), so the same seed and prompt give the same tokens
whatever else is in the batch. Greedy batches take a fast path (one argmax).

A `TokenCheck` (grammars on a CPU) names, after the draw, the rows whose token it does not allow;
only those rows are masked and drawn again, with the noise of the first draw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch

from .step import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


class SampleOutput(NamedTuple):
    token_ids: torch.Tensor  # [B] int64, on the device
    logprobs: torch.Tensor | None  # [B] float32 on the device, None when nobody asked
    # ([B, K] logprobs, [B, K] token ids) of the likeliest tokens, K the most asked; or None
    top: tuple[torch.Tensor, torch.Tensor] | None = None


class TokenCheck(Protocol):
    def rejected(self, token_ids: torch.Tensor) -> list[int]:
        """The rows whose drawn token (`token_ids` [B]) is not allowed."""

    def mask(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """`logits` [len(rows), V] of those rows with their disallowed tokens at -inf."""


class Sampler:
    def __init__(self, device: torch.device | str, seed: int = 0) -> None:
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               positions: np.ndarray,
               adjust: Callable[[torch.Tensor], torch.Tensor] | None = None,
               check: TokenCheck | None = None) -> SampleOutput:
        """logits: [B, V]; `positions[i]` is the position the sampled token will take (the
        request's seq_len), used to derive seeded noise. `adjust` (the penalties) maps the
        float32 logits to those sampled from; logprobs stay those of the raw logits. `check`
        names the rows to mask and draw again (only rows whose draw an allowed-set mask would
        not change: greedy or unfiltered)."""
        if logits.shape[0] != len(params) or len(positions) != len(params):
            raise ValueError(f"{logits.shape[0]} logit rows, {len(params)} sampling params and "
                             f"{len(positions)} positions must agree")
        raw = logits.float()
        logits = adjust(raw) if adjust is not None else raw
        if any(p.logit_bias or p.banned_token_ids for p in params):
            logits = self._bias_and_ban(logits, params)
        noise = None
        if all(p.is_greedy for p in params):
            token_ids = logits.argmax(dim=-1)
        else:
            noise = self._noise(logits, params, positions)
            token_ids = self._race(logits, params, noise)
        rows = check.rejected(token_ids) if check is not None else []
        if check is not None and rows:
            index = torch.tensor(rows, device=self.device)
            masked = check.mask(logits[index], rows)
            token_ids[index] = (masked.argmax(dim=-1) if noise is None else
                                self._race(masked, [params[i] for i in rows], noise[index]))
        logprobs = top = None
        num_top = max(p.top_logprobs for p in params)
        if num_top or any(p.return_logprob for p in params):
            log_probs = torch.log_softmax(raw, dim=-1)
            logprobs = log_probs.gather(1, token_ids[:, None]).squeeze(1)
            if num_top:
                values, ids = log_probs.topk(num_top, dim=-1)
                top = (values, ids)
        return SampleOutput(token_ids, logprobs, top)

    def _noise(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               positions: np.ndarray) -> torch.Tensor:
        """E ~ Exponential(1) per entry of `logits`; a seeded row's from its (seed, position)."""
        dev = self.device
        noise = torch.empty(logits.shape, dtype=torch.float32, device=dev).exponential_(
            generator=self._generator)
        for i, p in enumerate(params):
            if p.seed is not None and not p.is_greedy:
                g = torch.Generator(device=dev).manual_seed(_row_seed(p.seed, int(positions[i])))
                noise[i].exponential_(generator=g)
        return noise

    def _race(self, logits: torch.Tensor, params: Sequence[SamplingParams],
              noise: torch.Tensor) -> torch.Tensor:
        """Each row's token: argmax(probs / noise) after its temperature and filters (greedy
        rows: the argmax of the logits). Rows are independent: a subset of rows with their noise
        draws what they draw in the whole batch."""
        dev = self.device
        temps = torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params],
                             dtype=torch.float32, device=dev)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            probs = self._filter(probs, params)
        sampled = (probs / noise).argmax(dim=-1)
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=dev)
            sampled[rows] = logits[rows].argmax(dim=-1)
        return sampled

    def _bias_and_ban(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Logit biases added, banned tokens at -inf (a ban outweighs any bias)."""
        pairs = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        pairs += [(i, t, -math.inf) for i, p in enumerate(params) for t in p.banned_token_ids]
        rows, ids, bias = zip(*pairs, strict=True)
        index = (torch.tensor(rows, device=self.device), torch.tensor(ids, device=self.device))
        return logits.index_put(index, torch.tensor(bias, device=self.device), accumulate=True)

    def _filter(self, probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Zero the entries outside each row's top-k, top-p nucleus and min-p floor."""
        vocab = probs.shape[1]
        dev = self.device
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=dev)[None, :]
        drop = rank >= top_k[:, None]
        # top-p: keep the smallest prefix whose mass reaches top_p (the first entry always stays)
        drop |= (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p[:, None]
        drop |= sorted_p < min_p[:, None] * sorted_p[:, :1]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(1, sorted_idx, sorted_p)


def _row_seed(seed: int, position: int) -> int:
    return ((seed * _SEED_MIX) ^ (position * 0x100000001B3)) & _SEED_MASK
