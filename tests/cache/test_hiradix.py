"""Scripted host-tier cases with exact slot ids: policies, eviction to the host, load back."""

from __future__ import annotations

import numpy as np
import pytest

from raydix.cache import CacheConfig, EventBuffer, EventKind, HiRadixCache, KVCacheManager


def _copies(cache: HiRadixCache) -> tuple[list[int], list[int], list[int], list[int]]:
    c = cache.drain_copies()
    return (c.write_device_slots.tolist(), c.write_host_slots.tolist(),
            c.load_host_slots.tolist(), c.load_device_slots.tolist())


def test_write_through_backs_up_on_insert_and_eviction_keeps_the_host_copy() -> None:
    buffer = EventBuffer()
    cache = HiRadixCache(page_size=1, num_host_pages=8, event_sink=buffer,
                         write_policy="write_through")
    buffer.drain()
    assert cache.insert([1, 2, 3], [11, 12, 13]) == 0
    assert _copies(cache) == ([11, 12, 13], [1, 2, 3], [], [])
    assert cache.host_size == 3
    assert cache.evict(3).tolist() == [11, 12, 13]
    assert cache.size_info == (0, 0)
    kinds = [e.kind for e in buffer.drain()]
    assert kinds == [EventKind.INSERTED, EventKind.HOST_INSERTED, EventKind.EVICTED]
    match = cache.match_prefix([1, 2, 3, 4])
    assert (match.cached_len, match.host_len, match.slots.tolist()) == (0, 3, [])
    cache.check_integrity()


def test_selective_writes_after_the_threshold_only() -> None:
    cache = HiRadixCache(page_size=1, num_host_pages=8)  # write_through_selective, threshold 2
    cache.insert([1, 2, 3], [11, 12, 13])
    assert cache.drain_copies().num_tokens == 0
    assert cache.insert([1, 2, 3, 4], [11, 12, 13, 14]) == 3  # the second insert covering [1,2,3]
    assert _copies(cache) == ([11, 12, 13], [1, 2, 3], [], [])
    # without a host copy the new leaf [4] leaves the tree when evicted; [1,2,3] stays on the host
    assert sorted(cache.evict(4).tolist()) == [11, 12, 13, 14]
    match = cache.match_prefix([1, 2, 3, 4])
    assert (match.cached_len, match.host_len) == (0, 3)
    cache.check_integrity()


def test_write_back_copies_on_eviction_and_insert_revives_host_nodes() -> None:
    cache = HiRadixCache(page_size=2, num_host_pages=4, write_policy="write_back")
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert cache.drain_copies().num_tokens == 0
    assert cache.evict(1).tolist() == [10, 11, 12, 13]
    assert _copies(cache) == ([10, 11, 12, 13], [2, 3, 4, 5], [], [])
    # an insert over a host-only node gives it the caller's device slots (they are past the
    # returned length: the cache owns them)
    assert cache.insert([1, 2, 3, 4, 5, 6], [20, 21, 22, 23, 24, 25]) == 0
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == [20, 21, 22, 23, 24, 25]
    assert cache.host_size == 4
    cache.check_integrity()


def test_host_lru_evicts_host_only_leaves_and_never_a_node_being_loaded() -> None:
    cache = HiRadixCache(page_size=1, num_host_pages=4, write_policy="write_through")
    cache.insert([1, 2], [11, 12])
    cache.insert([5, 6], [15, 16])
    cache.evict(4)
    cache.drain_copies()
    cache.match_prefix([5, 6])  # [5, 6] is now the more recently used
    cache.insert([8, 9], [18, 19])  # the host is full: [1, 2] goes
    assert (cache.match_prefix([1, 2]).host_len, cache.match_prefix([5, 6]).host_len) == (0, 2)
    cache.drain_copies()
    cache.evict(2)
    held = cache.match_prefix([5, 6]).handle
    cache.lock(held)
    assert cache.hold_host_path(held)
    cache.match_prefix([8, 9])  # [5, 6] is the least recently used now, but it is being loaded
    assert cache.evict_host(2) == 2
    assert cache.match_prefix([8, 9]).host_len == 0
    assert cache.match_prefix([5, 6]).host_len == 2
    cache.check_integrity()


def test_manager_loads_a_host_hit_back_and_counts_it_as_cached() -> None:
    m = KVCacheManager(CacheConfig(num_pages=4, max_running_requests=2, max_context_len=8, page_size=1,
                                   num_host_pages=8, write_policy="write_through"))
    cache = m.host_cache
    assert cache is not None
    row = m.alloc_req(m.match_prefix([1, 2, 3, 4]))
    assert row is not None
    slots = m.alloc_slots(row, 4)
    assert slots is not None and slots.tolist() == [1, 2, 3, 4]
    m.cache_finished_req(row, [1, 2, 3, 4])
    assert _copies(cache) == ([1, 2, 3, 4], [1, 2, 3, 4], [], [])
    assert m.evict(4) == 4
    match = m.match_prefix([1, 2, 3, 4, 5])
    assert (match.cached_len, match.host_len) == (0, 4)
    row = m.alloc_req(match)
    assert row is not None
    assert (match.cached_len, match.host_len) == (4, 0)
    assert m.req_to_token.read(row, 0, 4).tolist() == [1, 2, 3, 4]  # FIFO free list: reused
    assert _copies(cache) == ([], [], [1, 2, 3, 4], [1, 2, 3, 4])
    assert m.size_info == (0, 4)
    m.check_integrity()
    m.free_req(row)
    assert cache.num_loaded_tokens == 4 and cache.num_written_tokens == 4
    m.check_integrity()


def test_a_host_hit_without_device_room_is_computed_instead() -> None:
    m = KVCacheManager(CacheConfig(num_pages=4, max_running_requests=2, max_context_len=8, page_size=1,
                                   num_host_pages=8, write_policy="write_through"))
    row = m.alloc_req(m.match_prefix([1, 2, 3]))
    assert row is not None and m.alloc_slots(row, 3) is not None
    m.cache_finished_req(row, [1, 2, 3])
    m.evict(3)
    hog = m.alloc_req(m.match_prefix([9]))
    assert hog is not None and m.alloc_slots(hog, 3) is not None  # 1 free slot left
    match = m.match_prefix([1, 2, 3, 4])
    row = m.alloc_req(match)
    assert row is not None and (match.cached_len, match.host_len) == (0, 0)
    assert m.host_cache is not None and m.host_cache.drain_copies().num_tokens == 3  # the write
    m.check_integrity()


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="write_policy"):
        HiRadixCache(page_size=1, num_host_pages=4, write_policy="write_around")
    with pytest.raises(ValueError, match="radix cache"):
        CacheConfig(num_pages=4, max_running_requests=1, max_context_len=8, page_size=1, num_host_pages=4,
                    enable_prefix_cache=False)
    with pytest.raises(ValueError, match="num_host_pages"):
        CacheConfig(num_pages=4, max_running_requests=1, max_context_len=8, page_size=1, num_host_pages=-1)


def test_integrity_catches_a_leaked_host_page() -> None:
    cache = HiRadixCache(page_size=1, num_host_pages=4, write_policy="write_through")
    cache.insert([1, 2], [11, 12])
    cache.host_allocator.alloc(1)
    with pytest.raises(RuntimeError, match="host page ownership"):
        cache.check_integrity()
    assert np.array_equal(cache.match_prefix([1, 2]).slots, [11, 12])
