"""Scripted radix-cache cases with exact slot ids, from the seeds' walkthroughs."""

from __future__ import annotations

import numpy as np
import pytest

from raydix.cache import EventBuffer, EventKind, RadixCache


def _contents(cache: RadixCache) -> list[tuple[list[int], list[int], list[int]]]:
    return sorted(
        (p.prefix_ids.tolist(), p.token_ids.tolist(), p.slots.tolist())
        for p in cache.iter_prefixes()
    )


@pytest.fixture
def seed_tree() -> RadixCache:
    """The seed's example: [1,3,6,7,9,77] cached, then [1,3,6,7,87,66] arrives."""
    cache = RadixCache(page_size=1)
    assert cache.insert([1, 3, 6, 7, 9, 77], [0, 1, 2, 3, 4, 7]) == 0
    return cache


def test_split_at_divergence(seed_tree: RadixCache) -> None:
    match = seed_tree.match_prefix([1, 3, 6, 7, 87, 66])
    assert match.slots.tolist() == [0, 1, 2, 3]
    assert match.cached_len == 4
    # the node was split where the match ended
    assert _contents(seed_tree) == [
        ([], [1, 3, 6, 7], [0, 1, 2, 3]),
        ([1, 3, 6, 7], [9, 77], [4, 7]),
    ]
    assert seed_tree.insert([1, 3, 6, 7, 87, 66], [0, 1, 2, 3, 5, 6]) == 4
    assert _contents(seed_tree) == [
        ([], [1, 3, 6, 7], [0, 1, 2, 3]),
        ([1, 3, 6, 7], [9, 77], [4, 7]),
        ([1, 3, 6, 7], [87, 66], [5, 6]),
    ]
    assert seed_tree.size_info == (8, 0)
    seed_tree.check_integrity()


def test_insert_splits_and_reports_present_length() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3, 4], [11, 12, 13, 14])
    assert cache.insert([1, 2, 9], [21, 22, 23]) == 2
    assert cache.insert([1, 2, 3, 4, 5], [31, 32, 33, 34, 35]) == 4
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == [11, 12, 13, 14, 35]
    assert cache.match_prefix([1, 2, 9]).slots.tolist() == [11, 12, 23]
    cache.check_integrity()


def test_lock_reference_counts_up_the_path(seed_tree: RadixCache) -> None:
    seed_tree.insert([1, 3, 6, 7, 87, 66], [0, 1, 2, 3, 5, 6])
    deep = seed_tree.match_prefix([1, 3, 6, 7, 9, 77]).handle
    shallow = seed_tree.match_prefix([1, 3, 6, 7, 5]).handle
    seed_tree.lock(deep)
    assert seed_tree.size_info == (2, 6)  # [87, 66] alone is evictable
    seed_tree.lock(shallow)
    refs = {tuple(p.token_ids.tolist()): None for p in seed_tree.iter_prefixes()}
    nodes = {
        tuple(np.frombuffer(n.key, dtype=np.int32).tolist()): n for n in seed_tree.iter_nodes()
    }
    assert set(nodes) == set(refs)
    assert nodes[(1, 3, 6, 7)].lock_ref == 2
    assert nodes[(9, 77)].lock_ref == 1
    assert nodes[(87, 66)].lock_ref == 0
    assert seed_tree.size_info == (2, 6)
    seed_tree.check_integrity(locked_handles=[deep, shallow])
    seed_tree.unlock(deep)
    assert nodes[(1, 3, 6, 7)].lock_ref == 1
    assert seed_tree.size_info == (4, 4)
    seed_tree.unlock(shallow)
    assert nodes[(1, 3, 6, 7)].lock_ref == 0
    assert seed_tree.size_info == (8, 0)
    seed_tree.check_integrity(locked_handles=[])


def test_lru_eviction_order(seed_tree: RadixCache) -> None:
    seed_tree.insert([1, 3, 6, 7, 87, 66], [0, 1, 2, 3, 5, 6])
    # the seed: evicting 3 tokens takes [9, 77] (older), then [87, 66]
    assert seed_tree.evict(3).tolist() == [4, 7, 5, 6]
    assert _contents(seed_tree) == [([], [1, 3, 6, 7], [0, 1, 2, 3])]
    assert seed_tree.size_info == (4, 0)
    seed_tree.check_integrity()


def test_access_refreshes_lru_and_locked_leaves_are_skipped(seed_tree: RadixCache) -> None:
    seed_tree.insert([1, 3, 6, 7, 87, 66], [0, 1, 2, 3, 5, 6])
    seed_tree.insert([2, 2], [8, 9])
    seed_tree.match_prefix([1, 3, 6, 7, 9, 77])  # [9, 77] is now the most recent
    locked = seed_tree.match_prefix([2, 2]).handle
    seed_tree.lock(locked)
    assert seed_tree.evict(1).tolist() == [5, 6]  # [87, 66]; [2, 2] is locked
    assert seed_tree.evict(1).tolist() == [4, 7]
    # the parent became a leaf and goes next; the locked leaf never does
    assert seed_tree.evict(100).tolist() == [0, 1, 2, 3]
    assert seed_tree.size_info == (0, 2)
    seed_tree.unlock(locked)
    assert seed_tree.evict(100).tolist() == [8, 9]
    assert seed_tree.size_info == (0, 0)


def test_page_aligned_keys_and_split_at_page_boundary() -> None:
    cache = RadixCache(page_size=4)
    cache.insert(list(range(12)), list(range(100, 112)))
    # diverges at token 6, inside the second page: the match stops at the page boundary 4
    match = cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 7, 8])
    assert match.cached_len == 4
    assert match.slots.tolist() == [100, 101, 102, 103]
    assert _contents(cache) == [
        ([], [0, 1, 2, 3], [100, 101, 102, 103]),
        ([0, 1, 2, 3], list(range(4, 12)), list(range(104, 112))),
    ]
    # an unaligned key matches only its whole pages
    assert cache.match_prefix(list(range(11))).cached_len == 8
    with pytest.raises(ValueError, match="multiple of page_size"):
        cache.insert(list(range(6)), list(range(6)))
    cache.check_integrity()


def test_extra_key_namespaces_never_share() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [10, 11, 12], extra_key="adapter-a")
    assert cache.match_prefix([1, 2, 3]).cached_len == 0
    assert cache.match_prefix([1, 2, 3], extra_key="adapter-b").cached_len == 0
    assert cache.match_prefix([1, 2, 3], extra_key="adapter-a").slots.tolist() == [10, 11, 12]
    assert cache.insert([1, 2, 3], [20, 21, 22]) == 0
    assert cache.match_prefix([1, 2]).slots.tolist() == [20, 21]
    cache.check_integrity()


def test_events_mirror_inserts_and_evictions() -> None:
    buffer = EventBuffer()
    cache = RadixCache(page_size=2, event_sink=buffer)
    cache.insert([1, 2, 3, 4], [2, 3, 4, 5], extra_key="x")
    cache.insert([1, 2, 5, 6], [2, 3, 6, 7], extra_key="x")
    cache.evict(1)
    cache.reset()
    events = buffer.drain()
    kinds = [(e.kind, e.extra_key, e.token_ids.tolist(), e.num_tokens) for e in events]
    assert kinds == [
        (EventKind.CLEARED, None, [], 0),
        (EventKind.INSERTED, "x", [1, 2, 3, 4], 4),
        (EventKind.INSERTED, "x", [1, 2, 5, 6], 2),
        (EventKind.EVICTED, "x", [1, 2, 3, 4], 2),
        (EventKind.CLEARED, None, [], 0),
    ]
    assert [e.seq for e in events] == list(range(5))
    assert events[2].prefix_len == 2
    assert len(buffer) == 0


def test_reset_empties_the_tree(seed_tree: RadixCache) -> None:
    seed_tree.reset()
    assert seed_tree.size_info == (0, 0)
    assert list(seed_tree.iter_prefixes()) == []
    assert seed_tree.match_prefix([1, 3, 6, 7]).cached_len == 0


def test_stale_handle_after_eviction(seed_tree: RadixCache) -> None:
    handle = seed_tree.match_prefix([1, 3, 6, 7, 9, 77]).handle
    seed_tree.evict(100)
    with pytest.raises(RuntimeError, match="stale"):
        seed_tree.lock(handle)
    seed_tree.check_integrity()
