"""What each replica holds on its device or in its host KV tier, from its cache events.

A replica with a host tier (``cache/hiradix.py``) keeps prefixes evicted from its device in host
memory, and loads them back on a hit instead of computing them. Its holdings over both tiers
are prefix-closed too (a host-only node hangs below nodes held on the device or the host), so
one more ``GlobalPrefixTree`` records them, fed the same events:

- ``INSERTED`` (on the device) and ``HOST_INSERTED`` (a host copy made) mark the whole path;
- ``HOST_EVICTED``: the run left both tiers (the engine drops a host copy only with its node);
- ``EVICTED``: the run left the device; it stays held unless it had no host copy. Which runs
  have host copies is kept per page, as a hash of the path up to it (no token copies).

``RouterState`` asks this tree only once some replica has sent a host event, and weighs a host
hit between a device hit and a miss (``host_hit_weight``, see ``router/policy.py``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

import numpy as np

from raydix.cache import CacheEvent, EventKind

from .tree import GlobalPrefixTree, ReplicaId


class TierTree(GlobalPrefixTree):
    def __init__(self, page_size: int = 1) -> None:
        super().__init__(page_size)
        self._host_pages: set[tuple[ReplicaId, Hashable, int]] = set()

    def apply_event(self, replica: ReplicaId, event: CacheEvent) -> None:
        kind, path, key = event.kind, event.token_ids, event.extra_key
        if kind is EventKind.INSERTED:
            self.insert(replica, path, key)
        elif kind is EventKind.HOST_INSERTED:
            self.insert(replica, path, key)
            self._host_pages.update(self._run_pages(replica, event))
        elif kind is EventKind.HOST_EVICTED:
            self._host_pages.difference_update(self._run_pages(replica, event))
            self.remove(replica, path, event.prefix_len, key)
        elif kind is EventKind.EVICTED:
            first = next(self._run_pages(replica, event), None)
            if first is None or first not in self._host_pages:
                self.remove(replica, path, event.prefix_len, key)
        else:
            self.drop_replica(replica)

    def drop_replica(self, replica: ReplicaId) -> None:
        super().drop_replica(replica)
        self._host_pages = {p for p in self._host_pages if p[0] != replica}

    def _run_pages(self, replica: ReplicaId, event: CacheEvent) -> Iterator[
            tuple[ReplicaId, Hashable, int]]:
        """One key per page of the event's run: a hash of the whole path up to the page's end."""
        hashes = _prefix_hashes(np.asarray(event.token_ids, dtype=np.int32), self.page_size)
        for digest in hashes[event.prefix_len // self.page_size :].tolist():
            yield replica, event.extra_key, digest


_BASE = np.uint64(0x100000001B3)  # odd, so it has an inverse modulo 2**64
_BASE_INV = np.uint64(pow(int(_BASE), -1, 1 << 64))


def _prefix_hashes(ids: np.ndarray, page_size: int) -> np.ndarray:
    """For each page end k, the polynomial hash (mod 2**64) of ``ids[:k]``, vectorized:
    H(k) = sum over i < k of (ids[i] + 1) * BASE**(k-1-i) = BASE**k * sum (ids[i] + 1) / BASE**(i+1).
    """
    x = ids.astype(np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        powers = np.cumprod(np.full(len(x), _BASE, dtype=np.uint64))
        inverse = np.cumprod(np.full(len(x), _BASE_INV, dtype=np.uint64))
        hashes = np.cumsum(x * inverse, dtype=np.uint64) * powers
    return hashes[page_size - 1 :: page_size]
