"""The sampler: greedy fast path, seeds, top-k / top-p / min-p filters, logprobs, the token check
after the draw."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raydix.workers.sampler import Sampler
from raydix.workers.step import SamplingParams

PROBS = torch.tensor([0.30, 0.25, 0.15, 0.10, 0.08, 0.05, 0.04, 0.03])


def _logits(rows: int) -> torch.Tensor:
    return PROBS.log().expand(rows, -1).clone()


def _sample(params: SamplingParams, rows: int, seed: int = 0) -> np.ndarray:
    sampler = Sampler("cpu", seed=seed)
    out = sampler.sample(_logits(rows), [params] * rows, np.arange(rows) + 5)
    return out.token_ids.numpy()


def test_greedy_batch_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler("cpu").sample(logits, [SamplingParams(temperature=0.0)] * 6, np.arange(6))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_top_k_1_equals_greedy_at_high_temperature() -> None:
    logits = torch.randn(32, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=5.0, top_k=1)] * 16 + [SamplingParams(temperature=5.0)]
    params += [SamplingParams(temperature=5.0, top_k=1)] * 15
    out = Sampler("cpu").sample(logits, params, np.arange(32)).token_ids
    greedy_rows = [i for i, p in enumerate(params) if p.top_k == 1]
    assert out[greedy_rows].tolist() == logits[greedy_rows].argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_whatever_the_batch() -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [Sampler("cpu", seed=s).sample(logits, [seeded], np.array([p])).token_ids.item()
             for s, p in [(0, 7), (1, 8), (2, 9)]]
    # same seed and positions, other sampler seeds, other requests around it
    batch_logits = torch.cat([torch.randn(2, 100), logits, torch.randn(1, 100)])
    other = SamplingParams(temperature=1.0)
    again = [Sampler("cpu", seed=99).sample(batch_logits, [other, other, seeded, other],
                                            np.array([3, 4, p, 5])).token_ids[2].item()
             for p in (7, 8, 9)]
    assert alone == again
    # the seed matters: 20 positions with two seeds do not all agree
    a = [Sampler("cpu").sample(logits, [SamplingParams(seed=1)], np.array([p])).token_ids.item()
         for p in range(20)]
    b = [Sampler("cpu").sample(logits, [SamplingParams(seed=2)], np.array([p])).token_ids.item()
         for p in range(20)]
    assert a != b


def test_unseeded_draws_follow_the_distribution() -> None:
    tokens = _sample(SamplingParams(temperature=1.0), 20000)
    freq = np.bincount(tokens, minlength=len(PROBS)) / len(tokens)
    np.testing.assert_allclose(freq, PROBS.numpy(), atol=0.015)


def test_top_p_keeps_the_nucleus() -> None:
    # cumulative 0.30, 0.55, 0.70, 0.80: top_p=0.6 keeps the first three tokens
    tokens = _sample(SamplingParams(temperature=1.0, top_p=0.6), 6000)
    assert set(tokens.tolist()) == {0, 1, 2}
    freq = np.bincount(tokens, minlength=3)[:3] / len(tokens)
    np.testing.assert_allclose(freq, (PROBS[:3] / PROBS[:3].sum()).numpy(), atol=0.03)


def test_top_k_and_min_p() -> None:
    assert set(_sample(SamplingParams(temperature=1.0, top_k=2), 3000).tolist()) == {0, 1}
    # min_p=0.3: keep tokens with p >= 0.09 (0.3 * 0.30)
    assert set(_sample(SamplingParams(temperature=1.0, min_p=0.3), 6000).tolist()) == {0, 1, 2, 3}


def test_mixed_batch_greedy_rows_stay_greedy() -> None:
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0 if i % 2 else 2.0) for i in range(8)]
    out = Sampler("cpu").sample(logits, params, np.arange(8)).token_ids
    assert out[1::2].tolist() == logits[1::2].argmax(-1).tolist()


def test_logprobs_of_the_chosen_tokens() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=1.0, return_logprob=True, seed=i) for i in range(4)]
    out = Sampler("cpu").sample(logits, params, np.arange(4))
    assert out.logprobs is not None
    expected = torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)


class _AllowedSets:
    """A token check allowing each row a fixed set of tokens, as a grammar does."""

    def __init__(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed  # [B, V] bool
        self.masked: list[int] = []

    def rejected(self, token_ids: torch.Tensor) -> list[int]:
        return [i for i, t in enumerate(token_ids.tolist()) if not self.allowed[i, t]]

    def mask(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        self.masked += rows
        return logits.masked_fill_(~self.allowed[rows], -math.inf)


@pytest.mark.parametrize("greedy_only", [False, True])
def test_a_token_check_draws_what_masking_first_draws(greedy_only: bool) -> None:
    """Rows drawn unmasked, then masked and drawn again with the same noise only where the check
    rejects their token, get the tokens of rows masked before the draw: greedy, seeded and
    unseeded rows, at several temperatures."""
    gen = torch.Generator().manual_seed(5)
    rows, vocab = 96, 40
    logits = torch.randn(rows, vocab, generator=gen) * 3
    allowed = torch.rand(rows, vocab, generator=gen) < 0.3
    allowed[torch.arange(rows), torch.randint(vocab, (rows,), generator=gen)] = True
    params = [SamplingParams(temperature=0.0 if greedy_only or i % 4 == 0 else 0.5 + i / rows,
                             seed=1000 + i if i % 3 else None) for i in range(rows)]
    positions = np.arange(rows) + 10
    first = Sampler("cpu").sample(logits, params, positions,
                                  lambda x: x.masked_fill(~allowed, -math.inf)).token_ids
    check = _AllowedSets(allowed)
    drawn = Sampler("cpu").sample(logits, params, positions, check=check).token_ids
    assert drawn.tolist() == first.tolist()
    assert all(allowed[i, t] for i, t in enumerate(drawn.tolist()))
    assert 0 < len(check.masked) < rows  # some rows drew an allowed token first, some did not
    unchecked = Sampler("cpu").sample(logits, params, positions).token_ids
    assert unchecked.tolist() != drawn.tolist()  # the check changed some draws


def test_rejects_bad_params() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="agree"):
        Sampler("cpu").sample(torch.zeros(2, 5), [SamplingParams()], np.arange(2))
