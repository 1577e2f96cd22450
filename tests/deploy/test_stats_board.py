"""The stats board and the replicas' reporters: a scrape sees stats read after it began, a
replica that streams sends nothing between scrapes but its heartbeat, and a replica that does
not answer holds a scrape up for a bounded time only. (Without Ray: the reporters call the
board's methods as a Serve handle would, on one event loop.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from raydix.deploy.replica_stats import ReplicaStats, report_loop
from raydix.deploy.stats_board import StatsBoard
from raydix.engine.metrics import EngineMetrics


class _Method:
    """`handle.method.remote(...)`, as on a deployment handle, straight to the board."""

    def __init__(self, fn: Callable[..., Awaitable[Any]], calls: list[str], name: str) -> None:
        self.fn, self.calls, self.name = fn, calls, name

    def remote(self, *args: Any) -> Awaitable[Any]:
        self.calls.append(self.name)
        return self.fn(*args)


class _Handle:
    def __init__(self, board: StatsBoard) -> None:
        self.calls: list[str] = []
        self.report = _Method(board.report, self.calls, "report")
        self.next_scrape = _Method(board.next_scrape, self.calls, "next_scrape")


class _Replica:
    """A replica whose engine generates a token every millisecond: its stats change all the
    time. `reads` counts the reads of its stats."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.started = time.monotonic()
        self.reads = 0

    async def read(self) -> ReplicaStats:
        self.reads += 1
        tokens = int((time.monotonic() - self.started) * 1000)
        metrics = EngineMetrics(1, 0, 0.5, 0.0, 0.0, tokens, 10, 0, 0, 0)
        return ReplicaStats(self.replica_id, metrics, 1, 1, 0, 4096, None,
                            num_kv_used_tokens=tokens)


def test_a_scrape_sees_stats_read_after_it_began_and_streams_send_only_heartbeats() -> None:
    async def run() -> None:
        board = StatsBoard()
        replicas = [_Replica("a"), _Replica("b")]
        handles = [_Handle(board) for _ in replicas]
        reporters = [asyncio.create_task(report_loop(r.read, h, heartbeat_s=0.25))
                     for r, h in zip(replicas, handles, strict=True)]
        try:
            await asyncio.sleep(0.6)  # no scrape: a first report and a heartbeat or two
            assert all(h.calls.count("report") <= 4 for h in handles), [h.calls for h in handles]
            for _ in range(5):
                began = time.monotonic()
                stats = await board.snapshot()
                took = time.monotonic() - began
                assert [s.replica_id for s in stats] == ["a", "b"]
                for s, replica in zip(stats, replicas, strict=True):
                    read_at = replica.started + s.metrics.num_generated_tokens / 1000
                    assert read_at >= began - 0.002, "stats read before the scrape began"
                assert took < 0.05, took  # answered, not timed out
                await asyncio.sleep(0.05)
        finally:
            for task in reporters:
                task.cancel()

    asyncio.run(run())


def test_a_replica_that_does_not_answer_holds_a_scrape_for_the_timeout_only() -> None:
    async def run() -> None:
        board = StatsBoard(answer_timeout_s=0.1)
        live = _Replica("live")
        handle = _Handle(board)
        reporter = asyncio.create_task(report_loop(live.read, handle, heartbeat_s=10))
        try:
            await board.report(await _Replica("silent").read(), 0)  # then never again
            await asyncio.sleep(0.05)
            began = time.monotonic()
            stats = await board.snapshot()
            took = time.monotonic() - began
            assert [s.replica_id for s in stats] == ["live", "silent"]
            assert 0.09 < took < 0.3, took
            reads = live.reads
            await board.snapshot()
            assert live.reads == reads + 1  # each scrape: one fresh read of the live one
        finally:
            reporter.cancel()

    asyncio.run(run())
