"""Random insert/match/lock/unlock/evict sequences: the radix cache against the reference."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raydix.cache import EventBuffer, EventKind, PrefixHandle, RadixCache
from tests.cache.reference import ReferencePrefixCache, RefHandle


@st.composite
def keys(draw: st.DrawFn, page_size: int) -> list[int]:
    """Keys built from three fixed pages, so that they share prefixes often; sometimes one
    token is changed, so that keys also diverge inside a page and inside a node."""
    page_ids = draw(st.lists(st.integers(0, 2), max_size=6))
    key = [10 * page_id + i % 3 for page_id in page_ids for i in range(page_size)]
    if key and draw(st.booleans()):
        key[draw(st.integers(0, len(key) - 1))] = 99
    if draw(st.booleans()):
        key = key + [7] * draw(st.integers(0, page_size - 1))  # an unaligned tail
    return key


def _tree_contents(cache: RadixCache, page_size: int) -> dict[tuple[int, ...], tuple[int, ...]]:
    contents = {}
    for prefix in cache.iter_prefixes():
        path = prefix.prefix_ids.tolist()
        for lo in range(0, len(prefix.token_ids), page_size):
            path = path + prefix.token_ids[lo : lo + page_size].tolist()
            contents[tuple(path)] = tuple(prefix.slots[lo : lo + page_size].tolist())
    return contents


def _check_evictions(
    ref: ReferencePrefixCache, buffer: EventBuffer, asked: int, evicted: np.ndarray
) -> None:
    evictable_before = ref.evictable_size
    removed: list[int] = []
    last_run = 0
    for event in buffer.drain():
        assert event.kind is EventKind.EVICTED
        path = tuple(event.token_ids.tolist())
        leaf = ref.pages[path]
        oldest = min(ref.pages[p].last_access for p in ref.evictable_leaves())
        assert leaf.last_access == oldest, "evicted a leaf that is not the least recently used"
        removed += ref.remove_run(path, event.num_tokens)
        last_run = event.num_tokens
    assert sorted(removed) == sorted(evicted.tolist())
    assert len(evicted) >= min(asked, evictable_before)
    if len(evicted) > asked:
        assert len(evicted) - last_run < asked, "kept evicting after enough was freed"


def _run(data: st.DataObject, page_size: int) -> None:
    buffer = EventBuffer()
    cache = RadixCache(page_size=page_size, max_context_len=16 * page_size, event_sink=buffer)
    buffer.drain()
    ref = ReferencePrefixCache(page_size)
    next_slot = itertools.count(page_size)
    handles: list[tuple[PrefixHandle, RefHandle]] = []
    key_st = keys(page_size)

    for _ in range(data.draw(st.integers(5, 40), label="steps")):
        op = data.draw(st.sampled_from(["insert", "match", "lock", "unlock", "evict"]))
        if op == "insert":
            key = data.draw(key_st, label="key")
            key = key[: len(key) // page_size * page_size]
            slots = [next(next_slot) for _ in key]
            assert cache.insert(key, slots) == ref.insert(key, slots)
            for event in buffer.drain():
                assert event.kind is EventKind.INSERTED
                assert event.token_ids.tolist() == key
        elif op == "match":
            key = data.draw(key_st, label="key")
            result = cache.match_prefix(key)
            ref_slots, ref_handle = ref.match(key)
            assert result.slots.tolist() == ref_slots
            assert result.cached_len == len(ref_handle.path)
            handles.append((result.handle, ref_handle))
            if data.draw(st.booleans(), label="lock at once"):
                cache.lock(result.handle)
                ref.lock(ref_handle, 1)
        elif op in ("lock", "unlock") and handles:
            handle, ref_handle = data.draw(st.sampled_from(handles), label="handle")
            want_locked = op == "lock"
            if handle.locked == want_locked or not ref_handle.valid:
                with pytest.raises(RuntimeError):
                    (cache.lock if want_locked else cache.unlock)(handle)
            else:
                (cache.lock if want_locked else cache.unlock)(handle)
                ref.lock(ref_handle, 1 if want_locked else -1)
        elif op == "evict":
            asked = data.draw(st.integers(0, 8 * page_size), label="evict")
            _check_evictions(ref, buffer, asked, cache.evict(asked))
        assert cache.size_info == (ref.evictable_size, ref.protected_size)
        assert _tree_contents(cache, page_size) == ref.contents()
        cache.check_integrity(locked_handles=[h for h, _ in handles if h.locked])


@pytest.mark.parametrize("page_size", [1, 16])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_radix_matches_reference(page_size: int, data: st.DataObject) -> None:
    _run(data, page_size)
