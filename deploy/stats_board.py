"""The stats board: /metrics reads every engine replica's `ReplicaStats` here. A Serve handle
reaches one replica per call, so the replicas push, and they push when someone reads.

Each replica keeps one call waiting here (`next_scrape`, a long poll). A scrape (`snapshot`)
counts itself, answers those calls at once, and waits up to `answer_timeout_s` for every
replica to report stats read after it began: a scrape sees figures a few milliseconds old, and
between scrapes a replica sends nothing but a heartbeat (its long poll ends after the
heartbeat time, and it reports then). Sending stats every time they changed cost the engine
replica a report per step or two while it streamed (`benchmarks/serve_bench.py`).

Stats older than `max_age_s` are dropped (a replica that stopped or died).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import NamedTuple

from .replica_stats import ReplicaStats

ANSWER_TIMEOUT_S = 0.1  # a scrape waits this long for the replicas' fresh stats


class _Entry(NamedTuple):
    received: float  # time.monotonic()
    stats: ReplicaStats
    scrape: int  # the scrape the stats answer (read after it began)


class StatsBoard:
    def __init__(self, max_age_s: float = 10.0,
                 answer_timeout_s: float = ANSWER_TIMEOUT_S) -> None:
        self.max_age_s = max_age_s
        self.answer_timeout_s = answer_timeout_s
        self._stats: dict[str, _Entry] = {}
        self._scrapes = 0
        self._scraped = asyncio.Event()  # set (and replaced) by each scrape
        self._reported = asyncio.Event()  # set (and replaced) by each report

    async def report(self, stats: ReplicaStats, scrape: int = 0) -> None:
        """A replica's stats, read after scrape number `scrape` began (0: none)."""
        self._stats[stats.replica_id] = _Entry(time.monotonic(), stats, scrape)
        self._reported.set()
        self._reported = asyncio.Event()

    async def next_scrape(self, seen: int, timeout_s: float) -> int:
        """The number of scrapes so far, once it is not `seen` (a scrape began, or this board
        restarted), or after `timeout_s` (the caller reports its heartbeat)."""
        if self._scrapes == seen:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._scraped.wait(), timeout_s)
        return self._scrapes

    async def snapshot(self) -> list[ReplicaStats]:
        """The stats of each live replica, read after this call began (a replica that does
        not answer within `answer_timeout_s` keeps its latest), ordered by replica id."""
        self._scrapes += 1
        scrape = self._scrapes
        self._scraped.set()
        self._scraped = asyncio.Event()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.answer_timeout_s
        while any(entry.scrape < scrape for entry in self._live().values()):
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reported.wait(), remaining)
        live = self._live()
        return [live[k].stats for k in sorted(live)]

    def _live(self) -> dict[str, _Entry]:
        now = time.monotonic()
        self._stats = {k: v for k, v in self._stats.items() if now - v.received <= self.max_age_s}
        return self._stats
