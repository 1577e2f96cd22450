"""Figures of a burst of streams for the serving benchmarks: per-stream token times summed up
as TTFT, time per token, throughput and the longest gap; the prompts of a burst."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Stats(NamedTuple):
    ttft_s: float  # mean over streams
    tpot_s: float  # mean over streams: (last token - first token) / (tokens - 1)
    throughput: float  # output tokens / s over the whole burst
    max_gap_s: float  # longest wait between two outputs of a stream (serve: SSE chunks)
    cpu_ms_per_token: dict[str, float] | None = None  # CPU time per output token, by process


def summarize(starts: float, token_times: list[list[float]]) -> Stats:
    ttft = [t[0] - starts for t in token_times]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times if len(t) > 1]
    end = max(t[-1] for t in token_times)
    total = sum(len(t) for t in token_times)
    gaps = [float(np.max(np.diff(t))) for t in token_times if len(t) > 1]
    return Stats(float(np.mean(ttft)), float(np.mean(tpot)) if tpot else 0.0,
                 total / (end - starts), max(gaps, default=0.0))


def prompts_for(num: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, prompt_len).tolist() for _ in range(num)]


class SeedSource:
    """A new prompt seed for every burst: no burst meets an earlier one in a prefix cache."""

    def __init__(self) -> None:
        self.next = 1000

    def __call__(self) -> int:
        self.next += 1
        return self.next


def best_of(a: dict[int, Stats], b: dict[int, Stats]) -> dict[int, Stats]:
    return {n: max((s for s in (a.get(n), b.get(n)) if s is not None),
                   key=lambda s: s.throughput) for n in a.keys() | b.keys()}
