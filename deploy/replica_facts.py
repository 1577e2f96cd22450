"""What an engine replica started with, for the `raydix serve` process to print where the user
looks: raydix's log lines inside a Ray actor reach neither that terminal nor a log file, so the
replica keeps its start-up lines (the KV pool's size and why, the warm-up) and hands them over
with the settings it runs with.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

from raydix.engine.config import EngineConfig


class ReplicaFacts(NamedTuple):
    replica_id: str
    model_path: str
    device: str
    dtype: str  # as the rank resolved it ("" when its rank runs in another actor)
    attention_backend: str
    cuda_graph: bool
    tp_size: int
    cpu_threads: int | None  # torch threads of the in-process rank; None: not set here
    nice: int  # this process's priority
    num_cpus: float  # Ray CPUs this replica reserved
    kv_pool_tokens: int
    page_size: int
    max_running_requests: int
    start_s: float  # model load, KV pool and warm-up
    log_lines: tuple[str, ...]  # raydix's own INFO lines during start-up
    engine_pid: int | None = None  # the engine's own process (None: it steps in the replica)

    def describe(self) -> list[str]:
        threads = "" if self.cpu_threads is None else f", {self.cpu_threads} CPU thread(s)"
        if self.engine_pid is not None:  # "..., 2 CPU thread(s) in" or "CUDA graphs on, in"
            threads += f"{',' if self.cpu_threads is None else ''} in engine process {self.engine_pid}"
        return [
            f"replica {self.replica_id}: {self.model_path} on {self.device}, tp={self.tp_size}, "
            f"dtype {self.dtype or 'per rank'}, attention {self.attention_backend}, CUDA graphs "
            f"{'on' if self.cuda_graph else 'off'}{threads}, {self.num_cpus:g} Ray CPU(s), "
            f"nice {self.nice}",
            f"replica {self.replica_id}: KV pool {self.kv_pool_tokens:,} tokens (page size "
            f"{self.page_size}), up to {self.max_running_requests} running requests; started "
            f"in {self.start_s:.1f} s",
            *(f"replica {self.replica_id}: {line}" for line in self.log_lines),
        ]


class StartupLog(logging.Handler):
    """Keeps raydix's INFO lines while attached (`with StartupLog() as log:`)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self._logger = logging.getLogger("raydix")
        self._level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> StartupLog:
        self._logger.addHandler(self)
        if self._logger.getEffectiveLevel() > logging.INFO:
            self._logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


def replica_facts(replica_id: str, config: EngineConfig, dtype: str, kv_pool_tokens: int,
                  cpu_threads: int | None, start_s: float,
                  log_lines: list[str], engine_pid: int | None = None) -> ReplicaFacts:
    import ray

    num_cpus = 0.0
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        num_cpus = float(ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0))
    worker = config.worker
    return ReplicaFacts(
        replica_id, worker.model_path, worker.device, dtype, worker.attention_backend,
        worker.cuda_graph, worker.tp_size, cpu_threads, os.getpriority(os.PRIO_PROCESS, 0),
        num_cpus, kv_pool_tokens, config.scheduler.page_size,
        config.scheduler.max_running_requests, start_s, tuple(log_lines), engine_pid)
