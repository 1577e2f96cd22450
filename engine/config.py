"""The engine's settings (one replica): scheduling limits and the workers' settings.

The table shape (`TableShape`: page size, request rows, context length, step size) is set once,
on the scheduler config; `EngineConfig.build` derives the ranks' copy from it, and an
`EngineConfig` whose two halves disagree is refused, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from raydix.cache import DEFAULT_WRITE_POLICY, WRITE_POLICIES
from raydix.workers.config import DEFAULT_SHAPE, TABLE_SHAPE_FIELDS, TableShape, WorkerConfig

SCHEDULE_POLICIES = ("fcfs", "lpm", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler forms batches. Token counts are per step."""

    # the table shape (`TableShape`), the source the ranks' and the cache manager's copies follow
    max_running_requests: int = DEFAULT_SHAPE.max_running_requests
    max_context_len: int = DEFAULT_SHAPE.max_context_len
    page_size: int = DEFAULT_SHAPE.page_size
    max_prefill_tokens: int = DEFAULT_SHAPE.max_prefill_tokens  # new prompt tokens in one step
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
    hicache_write_policy: str = DEFAULT_WRITE_POLICY
    overlap_schedule: bool = False  # form step N+1 while step N runs (engine.py)

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        TableShape.of(self)  # each field >= 1
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")
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

    def __post_init__(self) -> None:
        differ = [name for name in TABLE_SHAPE_FIELDS
                  if getattr(self.worker, name) != getattr(self.scheduler, name)]
        if differ:
            raise ValueError("the worker and scheduler configs disagree on the table shape: "
                             + ", ".join(_disagreement(self.worker, self.scheduler, name)
                                         for name in differ))

    @property
    def table_shape(self) -> TableShape:
        return TableShape.of(self.scheduler)

    @classmethod
    def build(cls, worker: WorkerConfig, scheduler: SchedulerConfig | None = None) -> EngineConfig:
        """The ranks take the scheduler's table shape. A worker config that set a field of it
        to something else (not left at the default) is refused, naming the field."""
        scheduler = scheduler or SchedulerConfig()
        conflicts = [name for name in TABLE_SHAPE_FIELDS
                     if getattr(worker, name) not in (getattr(DEFAULT_SHAPE, name),
                                                      getattr(scheduler, name))]
        if conflicts:
            raise ValueError("the table shape is set on the scheduler config; the worker config "
                             "sets it otherwise: " + ", ".join(
                                 _disagreement(worker, scheduler, name) for name in conflicts))
        worker = replace(worker, **{name: getattr(scheduler, name) for name in TABLE_SHAPE_FIELDS})
        return cls(worker=worker, scheduler=scheduler)

    def rank_config(self, tp_rank: int) -> WorkerConfig:
        return replace(self.worker, tp_rank=tp_rank)


def _disagreement(worker: WorkerConfig, scheduler: SchedulerConfig, name: str) -> str:
    return f"worker {name}={getattr(worker, name)} vs scheduler {name}={getattr(scheduler, name)}"
