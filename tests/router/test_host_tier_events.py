"""The router's tree follows a replica with a host KV tier: the host tier's events never touch
what the tree records for the device tier."""

from __future__ import annotations

from raydix.cache import EventBuffer, EventKind, HiRadixCache
from raydix.router.tree import GlobalPrefixTree


def _device_paths(cache: HiRadixCache) -> set[tuple[None, tuple[int, ...]]]:
    out = set()
    for prefix in cache.iter_prefixes():
        above = prefix.prefix_ids.tolist()
        for end in range(1, len(prefix.token_ids) + 1):
            out.add((None, tuple(above + prefix.token_ids[:end].tolist())))
    return out


def test_host_events_leave_the_device_holdings_exact() -> None:
    buffer = EventBuffer()
    cache = HiRadixCache(page_size=1, num_host_pages=6, event_sink=buffer,
                         write_policy="write_through")
    tree = GlobalPrefixTree(page_size=1)
    kinds = set()

    def sync() -> None:
        for event in buffer.drain():
            kinds.add(event.kind)
            tree.apply_event("r1", event)
        assert tree.holdings("r1") == _device_paths(cache)
        tree.check_integrity()

    cache.insert([1, 2, 3], [11, 12, 13])
    cache.insert([1, 2, 7], [11, 12, 17])
    sync()
    cache.evict(1)  # [7] goes to the host
    sync()
    cache.insert([4, 5, 6], [14, 15, 16])  # the host tier is full: its LRU leaves go
    cache.evict(4)
    sync()
    assert cache.insert([1, 2, 3, 9], [21, 22, 23, 29]) == 0  # back from the host
    sync()
    assert {EventKind.HOST_INSERTED, EventKind.HOST_EVICTED} <= kinds
    assert tree.match([1, 2, 3, 9]) == {"r1": 4}
