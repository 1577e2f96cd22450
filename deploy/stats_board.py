"""The stats board: every engine replica posts its `ReplicaStats` here every second, and
/metrics reads them all. A Serve handle reaches one replica per call, so replicas push.

Stats older than `max_age_s` are dropped (a replica that stopped or died).
"""

from __future__ import annotations

import time

from .replica_stats import ReplicaStats


class StatsBoard:
    def __init__(self, max_age_s: float = 10.0) -> None:
        self.max_age_s = max_age_s
        self._stats: dict[str, tuple[float, ReplicaStats]] = {}

    async def report(self, stats: ReplicaStats) -> None:
        self._stats[stats.replica_id] = (time.monotonic(), stats)

    async def snapshot(self) -> list[ReplicaStats]:
        """The latest stats of each live replica, ordered by replica id."""
        now = time.monotonic()
        self._stats = {k: v for k, v in self._stats.items() if now - v[0] <= self.max_age_s}
        return [self._stats[k][1] for k in sorted(self._stats)]
