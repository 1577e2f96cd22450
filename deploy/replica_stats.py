"""A replica's stats: read without stopping its engine, and sent to the stats board while fresh.

Every figure is a counter that the scheduler or the KV cache keeps as it changes, so reading
them costs the same at any pool size. They are read on the replica's event loop while the
engine's loop thread steps: no lock, and a read torn by a step is off by that step.

The cache's full audit (`check_integrity`, which walks every page of the pool: seconds at
millions of slots) runs only behind `debug_cache_audit`, and only while the replica is idle.

The reporter sends the stats to the board when someone reads the board (a /metrics scrape: the
board answers the reporter's waiting call, `stats_board.py`), and at least every `HEARTBEAT_S`
(the board drops a replica it has not heard from). A stream's steps send nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple, Protocol

from raydix.engine.async_engine import EngineClient
from raydix.engine.engine import Engine
from raydix.engine.metrics import EngineMetrics

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0


class ReplicaStats(NamedTuple):
    """One replica's state, for /metrics and for tests."""

    replica_id: str
    metrics: EngineMetrics
    num_in_flight: int  # requests handed to this replica and not finished
    num_rows: int  # request rows held in the KV cache manager
    num_protected_tokens: int  # prefix-cache tokens locked by running requests
    kv_capacity: int  # usable KV slots
    integrity_error: str | None  # from the last audit (debug_cache_audit); None: consistent
    node_id: str = ""  # the Ray node of the replica's engine
    rank_node_ids: tuple[str, ...] = ()  # the Ray node of each rank, in rank order
    num_kv_used_tokens: int = 0  # slots held by requests and protected prefixes
    num_audits: int = 0  # integrity audits run so far (debug_cache_audit)


class CacheAudit:
    """The debug audit's last result; `run_if_idle` audits when nothing is in flight and steps
    ran since the last audit (on the loop thread, between steps: no step runs while idle)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.error: str | None = None
        self.num_audits = 0
        self._audited_steps = -1

    async def run_if_idle(self, engine: EngineClient) -> None:
        if not self.enabled or engine.num_in_flight:
            return
        num_steps = engine.engine.num_steps
        if num_steps != self._audited_steps:
            self.error = await engine.call(Engine.audit_cache)
            self._audited_steps = num_steps
            self.num_audits += 1


def read_stats(replica_id: str, engine: EngineClient, audit: CacheAudit, node_id: str,
               rank_node_ids: tuple[str, ...]) -> ReplicaStats:
    cache = engine.engine.cache_stats()
    return ReplicaStats(
        replica_id, engine.metrics(), engine.num_in_flight, cache.num_rows,
        cache.num_protected_tokens, cache.kv_capacity, audit.error, node_id, rank_node_ids,
        num_kv_used_tokens=cache.num_used_tokens, num_audits=audit.num_audits)


class Board(Protocol):
    """The stats board's handle, as the reporter uses it (`board.report.remote(stats, scrape)`,
    `board.next_scrape.remote(seen, timeout_s)`)."""

    @property
    def report(self) -> _Report: ...

    @property
    def next_scrape(self) -> _NextScrape: ...


class _Report(Protocol):
    def remote(self, stats: ReplicaStats, scrape: int) -> Awaitable[object]: ...


class _NextScrape(Protocol):
    def remote(self, seen: int, timeout_s: float) -> Awaitable[int]: ...


async def report_loop(read: Callable[[], Awaitable[ReplicaStats]], board: Board,
                      retry_s: float = 0.05, heartbeat_s: float = HEARTBEAT_S) -> None:
    """Report, then wait for the board's next scrape (or the heartbeat), and again."""
    scrape = 0
    while True:
        try:
            await board.report.remote(await read(), scrape)
            scrape = await board.next_scrape.remote(scrape, heartbeat_s)
        except Exception as e:  # the board restarts or the engine stopped: try again
            logger.debug("stats not reported: %r", e)
            await asyncio.sleep(retry_s)
