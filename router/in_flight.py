"""Routing decisions that a replica's cache events have not confirmed yet.

In exact mode the global tree learns that a replica holds a prompt only after the replica has
computed it and reported the insert event (a report period after its prefill). Requests of one
group that arrive together would all look cold until then, and spread over the replicas. So each
decision is also recorded here, as "``replica`` will hold this prompt", until:

- the replica's events show it holds at least that much of the prompt (``confirm``);
- or ``ttl_s`` passes (the request failed, was rejected, or the events were lost);
- or the replica reports that it runs and queues nothing, ``idle_grace_s`` after the decision
  (``drop_stale``), unless the request is known to be still on its way (``transit.py``): it
  came and failed, or never reached it (Serve sent it to another replica because the chosen
  one was full or slow to answer); counted for the whole ``ttl_s``, its tokens would keep the
  replica looking busy and holding a prompt it never saw;
- or another replica reports receiving the request, or it is routed again (``remove``);
- or the replica leaves (``drop_replica``);
- or ``max_entries`` newer decisions push it out.

Each decision is its own entry in a ``GlobalPrefixTree`` (keyed ``(replica, entry id)``), so
removing one leaves the others' shared prefixes in place.

Each entry also carries the prompt tokens its replica must compute for it (what it did not
hold when routed); their sum per replica (``backlog``) is that replica's prefill queue as the
router sees it. An entry is confirmed by the insert event of a path it is a prefix of
(``confirm_path``), as well as by the tree holding it after a batch of events (``confirm``): a
replica under cache pressure may evict a prompt in the same batch that inserted it.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import cast

import numpy as np
import numpy.typing as npt

from .tree import GlobalPrefixTree

ReplicaId = Hashable
_Entry = tuple[ReplicaId, int]  # (replica, entry id): one decision's key in the tree


class InFlightPrefixes:
    def __init__(
        self,
        page_size: int = 1,
        ttl_s: float = 30.0,
        max_entries: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._tree = GlobalPrefixTree(page_size)
        self._ids = itertools.count()
        # entry -> (aligned prompt, extra key); each replica's entries; deadlines, oldest first
        self._entries: dict[_Entry, tuple[npt.NDArray[np.int32], Hashable]] = {}
        self._by_replica: dict[ReplicaId, set[_Entry]] = {}
        self._cost: dict[_Entry, float] = {}
        self._backlog: dict[ReplicaId, float] = {}
        self._added: dict[_Entry, float] = {}
        self._deadlines: deque[tuple[float, _Entry]] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, replica: ReplicaId, token_ids: npt.NDArray[np.int32],
            extra_key: Hashable = None, cost: float = 0.0) -> _Entry | None:
        """``replica`` was sent this prompt: it will hold its page-aligned part, after
        computing ``cost`` prompt tokens. Returns the entry (None: no whole page to hold)."""
        page = self._tree.page_size
        aligned = token_ids[: len(token_ids) // page * page]
        if not len(aligned):
            return None
        entry = (replica, next(self._ids))
        self._tree.insert(entry, aligned, extra_key)
        self._entries[entry] = (aligned, extra_key)
        self._by_replica.setdefault(replica, set()).add(entry)
        self._cost[entry] = cost
        self._backlog[replica] = self._backlog.get(replica, 0.0) + cost
        now = self._clock()
        self._added[entry] = now
        self._deadlines.append((now + self.ttl_s, entry))
        while len(self._entries) > self.max_entries:
            _, oldest = self._deadlines.popleft()
            if oldest in self._entries:
                self._remove(oldest)
        return entry

    def remove(self, entry: Hashable) -> None:
        """Drop one decision (its request went to another replica); gone already: nothing."""
        if entry in self._entries:
            self._remove(entry)

    def match(self, token_ids: npt.NDArray[np.int32],
              extra_key: Hashable = None) -> dict[ReplicaId, int]:
        """For each replica with a pending decision sharing a prefix with the prompt, the
        longest such prefix. Expired entries are dropped first."""
        self.expire()
        if not self._entries:
            return {}
        out: dict[ReplicaId, int] = {}
        for entry, length in self._tree.match(token_ids, extra_key).items():
            replica, _ = cast(tuple[ReplicaId, int], entry)
            if length > out.get(replica, 0):
                out[replica] = length
        return out

    def confirm(self, replica: ReplicaId,
                holds: Callable[[npt.NDArray[np.int32], Hashable], int]) -> None:
        """Drop ``replica``'s entries that it now holds: ``holds(tokens, extra_key)`` is the
        length of the prompt the exact tree says the replica holds."""
        for entry in list(self._by_replica.get(replica, ())):
            tokens, extra_key = self._entries[entry]
            if holds(tokens, extra_key) >= len(tokens):
                self._remove(entry)

    def confirm_path(self, replica: ReplicaId, path: npt.NDArray[np.int32],
                     extra_key: Hashable = None) -> None:
        """``replica`` inserted ``path``: drop its entries that are prefixes of it."""
        for entry in list(self._by_replica.get(replica, ())):
            tokens, key = self._entries[entry]
            if key == extra_key and len(tokens) <= len(path) and np.array_equal(
                    tokens, path[: len(tokens)]):
                self._remove(entry)

    def backlog(self, replica: ReplicaId) -> float:
        """The prompt tokens ``replica`` was routed and has not confirmed (entries expire as
        in ``match``, when that runs)."""
        return self._backlog.get(replica, 0.0)

    def drop_stale(self, replica: ReplicaId, idle_grace_s: float,
                   in_transit: Callable[[Hashable], bool] = lambda entry: False) -> None:
        """``replica`` reported no running and no waiting request: its entries older than
        ``idle_grace_s`` (time for the request to reach it) will never be confirmed, except
        those whose request is known to be still on its way (``in_transit``)."""
        before = self._clock() - idle_grace_s
        for entry in list(self._by_replica.get(replica, ())):
            if self._added[entry] <= before and not in_transit(entry):
                self._remove(entry)

    def drop_replica(self, replica: ReplicaId) -> None:
        for entry in list(self._by_replica.get(replica, ())):
            self._remove(entry)

    def expire(self) -> None:
        now = self._clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, entry = self._deadlines.popleft()
            if entry in self._entries:
                self._remove(entry)

    def _remove(self, entry: _Entry) -> None:
        tokens, extra_key = self._entries.pop(entry)
        del self._added[entry]
        self._tree.remove(entry, tokens, 0, extra_key)
        entries = self._by_replica[entry[0]]
        entries.discard(entry)
        left = self._backlog[entry[0]] - self._cost.pop(entry)
        if not entries:
            del self._by_replica[entry[0]]
            del self._backlog[entry[0]]
        else:
            self._backlog[entry[0]] = max(left, 0.0)

    def check_integrity(self) -> None:
        self._tree.check_integrity()
        if sum(len(v) for v in self._by_replica.values()) != len(self._entries):
            raise RuntimeError("the per-replica index disagrees with the entries")
        for replica, entries in self._by_replica.items():
            if abs(sum(self._cost[e] for e in entries) - self._backlog[replica]) > 1e-6:
                raise RuntimeError(f"the backlog of {replica!r} disagrees with its entries")
