"""Engine replica → router: cache events and load, in batches, off the request path.

A replica runs one ``ReplicaReporter`` task on its event loop. Every ``period_s`` it drains the
cache events its engine buffered and reads its load, and sends both to the router actor without
waiting for an answer. Calls from one caller reach an actor in order, so events arrive in
sequence; a lost batch shows as a gap in ``seq`` and the router rebuilds that replica's entries.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ray.actor import ActorHandle

from raydix.cache import CacheEvent

logger = logging.getLogger(__name__)


class LoadReport(NamedTuple):
    num_running: int
    num_waiting: int
    kv_usage: float
    num_received: int  # requests this replica has been sent so far


class ReplicaReporter:
    def __init__(
        self,
        router: ActorHandle,
        replica_id: str,
        drain_events: Callable[[], Sequence[CacheEvent]],
        read_load: Callable[[], LoadReport],
        period_s: float = 0.05,
    ) -> None:
        self.router = router
        self.replica_id = replica_id
        self._drain_events = drain_events
        self._read_load = read_load
        self.period_s = period_s
        self._last_load: LoadReport | None = None

    def report_once(self) -> int:
        """Send what changed since the last report; returns the number of events sent."""
        events = list(self._drain_events())
        if events:
            self.router.publish.remote(self.replica_id, events)
        load = self._read_load()
        if load != self._last_load:
            self.router.report_load.remote(self.replica_id, *load)
            self._last_load = load
        return len(events)

    async def run(self) -> None:
        """Report until cancelled; a failed report is logged and the next one goes on."""
        while True:
            try:
                self.report_once()
            except Exception:  # the router may be restarting: routing falls back meanwhile
                logger.warning("reporting to the router failed", exc_info=True)
            await asyncio.sleep(self.period_s)
