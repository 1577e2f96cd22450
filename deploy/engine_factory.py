"""How an engine replica builds its engine: `ReplicaSettings`, where its ranks go, and the
default `EngineFactory` (`build_engine`).

Apart from the deployment (server.py) because the factory runs in the engine process too
(`raydix.engine.engine_process`): the child unpickles `build_engine` by reference and imports
its module, and server.py's import pulls in Ray and Serve (about a second on 2 cores, on the
engine's start-up path, for nothing the child uses). This module imports neither torch nor Ray
(`tests/test_torch_free.py`); a replica with worker actors imports Ray when it builds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from raydix.cache import EventSink
from raydix.engine.async_engine import MAX_WAITING_REQUESTS
from raydix.engine.config import EngineConfig
from raydix.engine.detokenizer import TokenDecoder
from raydix.engine.engine import Engine
from raydix.engine.executor import Executor, LocalExecutor
from raydix.router.state import MAX_APPROX_TOKENS
from raydix.workers.huge_pages import malloc_env

from .config import STARTUP_TIMEOUT_S

__all__ = ["EngineFactory", "ReplicaSettings", "build_engine", "engine_process_env",
           "replica_bundles", "runs_in_engine_process"]


@dataclass(frozen=True)
class ReplicaSettings:
    """How an engine replica runs, beyond the engine's own config."""

    use_gpu_bundles: bool = False  # ranks sit in GPU bundles (else CPU / in-process)
    max_waiting_requests: int = MAX_WAITING_REQUESTS  # admission bound beyond the running requests
    stream_interval: int = 1  # a stream's tokens go out every this many (first and last at once)
    startup_timeout_s: float = STARTUP_TIMEOUT_S  # bound on starting the ranks
    router_events: bool = True  # cache_aware: send the cache's events (exact mode)
    router_approx_tokens: int = MAX_APPROX_TOKENS  # cache_aware without events: the tree's cap
    debug_cache_audit: bool = False  # audit the KV cache manager in idle stats calls (slow)
    cpu_threads: int | None = None  # the in-process rank's threads; None: leave them be
    engine_process: bool = False  # an in-process rank's engine steps in a child process
    fit_threads_to_model: bool = False  # cpu_threads is a default: one thread for small models


EngineFactory = Callable[[EngineConfig, ReplicaSettings, EventSink | None], Engine]
"""(engine config, replica settings, where the engine's cache events go) -> engine"""


def replica_bundles(tp_size: int, use_gpu_bundles: bool) -> list[dict[str, float]] | None:
    """The engine replica's placement-group bundles; None: no placement group (CPU, tp 1)."""
    if use_gpu_bundles:
        return [{"CPU": 1.0}] + [{"GPU": 1.0}] * tp_size
    if tp_size == 1:
        return None
    return [{"CPU": 1.0}] + [{"CPU": 1.0}] * tp_size


def runs_in_engine_process(config: EngineConfig, settings: ReplicaSettings) -> bool:
    """Whether the replica's engine steps in a process of its own: with `engine_process`, when
    its one rank would run in this process (on the CPU, or on the GPU the replica reserved)."""
    return (settings.engine_process and config.worker.device in ("cpu", "cuda")
            and replica_bundles(config.worker.tp_size, settings.use_gpu_bundles) is None)


def engine_process_env(config: EngineConfig) -> dict[str, str]:
    """What the engine process's environment adds for its rank: on a CPU, malloc on 2 MiB pages
    for the weights and activations (workers/huge_pages.py), unless the config turns them off."""
    if config.worker.device == "cpu" and config.worker.cpu_huge_pages:
        return malloc_env()
    return {}


def build_engine(config: EngineConfig, settings: ReplicaSettings,
                 event_sink: EventSink | None = None) -> Engine:
    """The default factory: the model's tokenizer, and the ranks where `replica_bundles` put
    them (in-process, or worker actors in this replica's placement group)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.worker.model_path)
    executor: Executor
    if replica_bundles(config.worker.tp_size, settings.use_gpu_bundles) is None:
        executor = LocalExecutor(config)
    else:
        from ray.util import get_current_placement_group

        from raydix.cluster.ray_executor import RayExecutor

        tp = config.worker.tp_size
        executor = RayExecutor(
            [config.rank_config(r) for r in range(tp)],
            placement_group=get_current_placement_group(),
            bundle_offset=1,
            use_gpu=settings.use_gpu_bundles,
            startup_timeout_s=settings.startup_timeout_s,
        )
    return Engine(config, executor=executor, tokenizer=cast(TokenDecoder, tokenizer),
                  event_sink=event_sink)
