"""Requests routed to a replica that the replica has not reported receiving yet.

A replica's load reports count what it runs and queues; a request routed to it and still on its
way (in Serve's router, in a gRPC call, behind a busy event loop) is in neither. Counting only
the decisions since the last report covers one report period. A request slower to arrive than
that (a loaded host, a replica slow to answer Serve's queue-length probe) dropped out of the
load at the next report, and its prefix out of the decisions in flight once the replica
reported itself idle (``IDLE_GRACE_S`` later), so the next request of its group looked cold.

So each decision made for a request id is kept here until a replica reports that id among the
requests it received (its load reports carry the ids received since the last one):

- received where it was routed: from then on it is in that replica's own counts;
- received elsewhere (Serve offered it to another replica, the chosen one being full or slow to
  answer): the chosen replica never sees it, and its prefix record is dropped;
- routed again (Serve chose anew, or the ingress resent it after its replica died): the newer
  decision replaces the older, whose prefix record is dropped;
- not received within ``ttl_s`` (its client left while Serve held it, or the report was lost):
  forgotten.

A request can also be received before the router records its decision: Serve stops waiting
for a slow decision and routes by load, while the router actor still decides it later. Ids
received without a decision are kept for ``ttl_s`` (at most ``max_early`` of them), so that
such a late decision records nothing (``arrived``).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import NamedTuple

ReplicaId = Hashable
Entry = Hashable  # an `InFlightPrefixes` entry (None: the decision recorded no prefix)


class Routed(NamedTuple):
    replica: ReplicaId
    entry: Entry | None
    serial: int  # tells a decision from a newer one for the same request id


class RequestsInTransit:
    def __init__(self, ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, max_early: int = 65_536) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self.max_early = max_early
        self._clock = clock
        self._early: dict[str, float] = {}  # received before any decision: id -> deadline
        self._early_order: deque[tuple[float, str]] = deque()
        self._by_id: dict[str, Routed] = {}
        self._count: dict[ReplicaId, int] = {}
        self._entries: set[Entry] = set()
        self._serials = itertools.count()
        self._deadlines: deque[tuple[float, str, int]] = deque()

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, request_id: str, replica: ReplicaId, entry: Entry | None) -> Entry | None:
        """`request_id` was routed to `replica`; returns the prefix entry of an earlier
        decision for the same request, which this one replaces (None if none)."""
        self.expire()
        replaced = self._pop(request_id)
        routed = Routed(replica, entry, next(self._serials))
        self._by_id[request_id] = routed
        self._count[replica] = self._count.get(replica, 0) + 1
        if entry is not None:
            self._entries.add(entry)
        self._deadlines.append((self._clock() + self.ttl_s, request_id, routed.serial))
        return replaced.entry if replaced is not None else None

    def received(self, replica: ReplicaId, request_ids: Iterable[str]) -> list[Entry]:
        """`replica` reports receiving these requests; returns the prefix entries of those
        that had been routed to another replica (which will never see them)."""
        elsewhere = []
        for rid in request_ids:
            routed = self._pop(rid)
            if routed is None:  # its decision, if any, is still to come
                self._remember_early(rid)
            elif routed.replica != replica and routed.entry is not None:
                elsewhere.append(routed.entry)
        return elsewhere

    def arrived(self, request_id: str) -> bool:
        """A replica already reported receiving this request, which no decision had been
        recorded for: its decision comes late and must record nothing."""
        return self._early.pop(request_id, None) is not None

    def _remember_early(self, request_id: str) -> None:
        deadline = self._clock() + self.ttl_s
        self._early[request_id] = deadline
        self._early_order.append((deadline, request_id))
        while len(self._early) > self.max_early:
            self._early.pop(self._early_order.popleft()[1], None)

    def count(self, replica: ReplicaId) -> int:
        """Requests routed to `replica` and not received anywhere yet."""
        return self._count.get(replica, 0)

    def counts(self) -> Mapping[ReplicaId, int]:
        """`count` of every replica with requests on their way (not to be changed)."""
        return self._count

    def holds(self, entry: Entry) -> bool:
        """The prefix entry belongs to a request still on its way."""
        return entry in self._entries

    def drop_replica(self, replica: ReplicaId) -> None:
        for rid in [rid for rid, r in self._by_id.items() if r.replica == replica]:
            self._pop(rid)

    def expire(self) -> None:
        now = self._clock()
        while self._early_order and self._early_order[0][0] <= now:
            deadline, rid = self._early_order.popleft()
            if self._early.get(rid) == deadline:
                del self._early[rid]
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid, serial = self._deadlines.popleft()
            routed = self._by_id.get(rid)
            if routed is not None and routed.serial == serial:
                self._pop(rid)

    def _pop(self, request_id: str) -> Routed | None:
        routed = self._by_id.pop(request_id, None)
        if routed is None:
            return None
        left = self._count[routed.replica] - 1
        if left:
            self._count[routed.replica] = left
        else:
            del self._count[routed.replica]
        self._entries.discard(routed.entry)
        return routed
