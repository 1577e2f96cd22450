"""Scheduler counters and the gauges derived from them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple


class EngineMetrics(NamedTuple):
    num_running: int
    num_waiting: int
    token_usage: float  # share of the KV pool held by running requests and protected prefixes
    cache_hit_rate: float  # cached prompt tokens / prompt tokens, over admitted requests
    generation_throughput: float  # output tokens per second since start
    num_generated_tokens: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_retractions: int
    num_finished: int
    # the host KV tier (zero without one)
    num_host_tokens: int = 0  # tokens with a copy in host memory
    host_capacity: int = 0
    host_token_usage: float = 0.0  # num_host_tokens / host_capacity
    host_hit_rate: float = 0.0  # prompt tokens loaded back from the host / prompt tokens
    num_host_hit_tokens: int = 0
    num_loaded_tokens: int = 0  # host -> device since start (retracted requests' too)
    num_written_tokens: int = 0  # device -> host since start
    load_throughput: float = 0.0  # tokens loaded back per second since start
    write_throughput: float = 0.0  # tokens written to the host per second since start
    num_steps: int = 0  # steps run since start (each one batch: prompt chunks and decode rows)


@dataclass
class SchedulerStats:
    started: float = field(default_factory=time.monotonic)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_retractions: int = 0
    num_finished: int = 0
    num_steps: int = 0
    num_host_hit_tokens: int = 0  # of num_cached_tokens, those loaded back from the host

    def record_admission(self, prompt_len: int, cached_len: int, host_hit_len: int = 0) -> None:
        self.num_prompt_tokens += prompt_len
        self.num_cached_tokens += cached_len
        self.num_host_hit_tokens += host_hit_len

    @property
    def host_hit_rate(self) -> float:
        return self.num_host_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def per_second(self, count: int) -> float:
        elapsed = time.monotonic() - self.started
        return count / elapsed if elapsed > 0 else 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def throughput(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.num_generated_tokens / elapsed if elapsed > 0 else 0.0
