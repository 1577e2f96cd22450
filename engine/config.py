"""The engine's settings (one replica): scheduling limits and the workers' settings."""

from __future__ import annotations

from dataclasses import dataclass, replace

from raydix.cache import WRITE_POLICIES
from raydix.workers.config import WorkerConfig

SCHEDULE_POLICIES = ("fcfs", "lpm", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler forms batches. Token counts are per step."""

    max_running_requests: int = 64
    max_context_len: int = 4096
    page_size: int = 1
    max_prefill_tokens: int = 8192  # new prompt tokens in one step, over all requests
    chunked_prefill_size: int = 2048  # a prompt longer than this is computed in chunks
    schedule_policy: str = "fcfs"
    enable_prefix_cache: bool = True
    enable_mixed_batch: bool = True  # prefill chunks ride along with the decode batch
    init_new_token_ratio: float = 0.5  # share of max_new_tokens reserved for running requests
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.002
    max_lpm_waiting: int = 128  # above this many waiting requests, lpm falls back to fcfs
    in_batch_prefix_threshold: int = 32  # 0: off; see engine/admission.py
    # the host KV tier's write policy (cache/hiradix.py), when the ranks have a host pool
    hicache_write_policy: str = "write_through_selective"
    overlap_schedule: bool = False  # form step N+1 while step N runs (engine.py)

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        for name in (
            "max_running_requests",
            "max_context_len",
            "page_size",
            "max_prefill_tokens",
            "chunked_prefill_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hicache_write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {WRITE_POLICIES}, got "
                             f"{self.hicache_write_policy!r}")
        if not 0.0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0:
            raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1")


@dataclass(frozen=True)
class EngineConfig:
    """One replica: a model spread over ``tp_size`` ranks, and how it is scheduled."""

    worker: WorkerConfig
    scheduler: SchedulerConfig

    @classmethod
    def build(cls, worker: WorkerConfig, scheduler: SchedulerConfig | None = None) -> EngineConfig:
        """Make the two halves agree on the table shape and page size."""
        scheduler = scheduler or SchedulerConfig()
        worker = replace(
            worker,
            page_size=scheduler.page_size,
            max_running_requests=scheduler.max_running_requests,
            max_context_len=scheduler.max_context_len,
            max_prefill_tokens=scheduler.max_prefill_tokens,
        )
        return cls(worker=worker, scheduler=scheduler)

    def rank_config(self, tp_rank: int) -> WorkerConfig:
        return replace(self.worker, tp_rank=tp_rank)
