"""Engine replica → router: cache events and load, in batches, off the request path.

A replica runs one ``ReplicaReporter`` task on its event loop. Every ``period_s`` it drains the
cache events its engine buffered and reads its load, and sends both to the router actor. Calls
from one caller reach an actor in order, so events arrive in sequence.

The load goes when its request counts changed or its KV usage moved by ``KV_USAGE_STEP`` since
the last report (a stream's every token moves it a little: reporting each costs the replica
more than the router gains), with every batch of events, and at least every ``heartbeat_s``
(the router counts requests routed since the last load report). A load read also carries the
ids of the requests received since the previous read; a read with any is sent at once. The
router answers each batch of events (an empty batch at least every ``heartbeat_s``) with
whether it needs this replica's snapshot: after a router restart, a late registration or lost
events, it no longer knows what the replica holds. The reporter then has the engine send its
whole cache again (``publish_snapshot``, at most once per ``snapshot_interval_s``), which
reaches the router through the same event stream, in order.

A router actor that died for good (``ActorDiedError``: it ended itself, its app gone, while the
app was deployed again; or it was killed) is asked for again through ``get_router`` (the
application's ``get_or_create_router``), and the cache is sent whole to the new one at once: it
knows nothing of this replica, and an idle replica's empty batches would never make it ask.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError

from raydix.cache import CacheEvent

if TYPE_CHECKING:
    from .actor import RouterActor

logger = logging.getLogger(__name__)


KV_USAGE_STEP = 0.01  # a change of the KV usage (share of the pool) worth a report of its own


class LoadReport(NamedTuple):
    num_running: int
    num_waiting: int
    kv_usage: float
    kv_capacity: int = 0  # the KV pool's tokens (0: not known)
    # the ids of the requests received since the last read (the router's `RequestsInTransit`)
    received: tuple[str, ...] = ()


class ReplicaReporter:
    def __init__(
        self,
        router: ActorHandle[RouterActor],
        replica_id: str,
        drain_events: Callable[[], Sequence[CacheEvent]],
        read_load: Callable[[], LoadReport],
        period_s: float = 0.05,
        publish_snapshot: Callable[[], Awaitable[None]] | None = None,
        heartbeat_s: float = 1.0,
        snapshot_interval_s: float = 2.0,
        answer_timeout_s: float = 2.0,
        get_router: Callable[[], ActorHandle[RouterActor]] | None = None,
    ) -> None:
        """`get_router` gives the application's router actor again when this one died."""
        self.router = router
        self._get_router = get_router
        self.replica_id = replica_id
        self._drain_events = drain_events
        self._read_load = read_load
        self.period_s = period_s
        self._publish_snapshot = publish_snapshot
        self.heartbeat_s = heartbeat_s
        self.snapshot_interval_s = snapshot_interval_s
        self.answer_timeout_s = answer_timeout_s
        self._last_load: LoadReport | None = None
        self._last_load_at = float("-inf")
        self._last_publish = float("-inf")
        self._last_snapshot = float("-inf")
        self.num_snapshots = 0
        self.num_reconnects = 0

    def report_once(self) -> Any:
        """Send what changed since the last report; returns the router's answer to the events
        (an awaitable), or None when nothing was sent."""
        events = list(self._drain_events())
        answer: Any = None
        now = time.monotonic()
        if events or now - self._last_publish >= self.heartbeat_s:
            answer = self.router.publish.remote(self.replica_id, events)
            self._last_publish = now
        load = self._read_load()
        # with events, always: a request that came and went between two reads leaves the load
        # unchanged, and the router would count it as routed-but-unreported until a heartbeat
        if events or self._moved(load) or now - self._last_load_at >= self.heartbeat_s:
            self.router.report_load.remote(self.replica_id, *load)
            self._last_load, self._last_load_at = load, now
        return answer

    def _moved(self, load: LoadReport) -> bool:
        """The load differs from the last one sent in a way the routing policy would notice."""
        last = self._last_load
        return (last is None or bool(load.received) or load.num_running != last.num_running
                or load.num_waiting != last.num_waiting or load.kv_capacity != last.kv_capacity
                or abs(load.kv_usage - last.kv_usage) >= KV_USAGE_STEP)

    async def _follow_up(self, answer: Any) -> None:
        """Wait for the router's answer (a dead router shows here), and send the snapshot when
        it asks for it."""
        if answer is None:
            return
        needs_snapshot = await asyncio.wait_for(answer, self.answer_timeout_s)
        if needs_snapshot and time.monotonic() - self._last_snapshot >= self.snapshot_interval_s:
            logger.info("replica %s: the router asked for the cache's snapshot", self.replica_id)
            await self._send_snapshot()

    async def _send_snapshot(self) -> None:
        if self._publish_snapshot is None:
            return
        self._last_snapshot = time.monotonic()
        self.num_snapshots += 1
        await self._publish_snapshot()

    async def _reconnect(self) -> None:
        """The router actor is gone for good: take the application's router again (made anew
        if none is running) and send it the whole cache. The events drained for the dead one
        are lost; the snapshot, later in the stream, covers them."""
        if self._get_router is None:
            logger.warning("replica %s: the router actor died; no way to find it again",
                           self.replica_id)
            return
        logger.warning("replica %s: the router actor died; finding the app's router again",
                       self.replica_id)
        self.router = self._get_router()
        self.num_reconnects += 1
        self._last_load, self._last_publish = None, float("-inf")  # report at once
        await self._send_snapshot()

    async def run(self) -> None:
        """Report until cancelled; a failed report is logged and the next one goes on."""
        while True:
            try:
                try:
                    await self._follow_up(self.report_once())
                except ActorDiedError:
                    await self._reconnect()
            except TimeoutError:  # starting (its process is new) or busy: no traceback
                logger.warning("replica %s: the router actor did not answer within %.1f s; "
                               "reports go on", self.replica_id, self.answer_timeout_s)
            except Exception:  # the router may be restarting: routing falls back meanwhile
                logger.warning("reporting to the router failed", exc_info=True)
            await asyncio.sleep(self.period_s)
