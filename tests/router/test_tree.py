"""The global prefix tree mirrors several replicas' radix caches from their events."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raydix.cache import EventBuffer, RadixCache
from raydix.router.tree import GlobalPrefixTree


def _replica_paths(cache: RadixCache) -> set[tuple[object, tuple[int, ...]]]:
    out = set()
    for prefix in cache.iter_prefixes():
        above = prefix.prefix_ids.tolist()
        tokens = prefix.token_ids.tolist()
        for end in range(1, len(tokens) + 1):
            out.add((prefix.extra_key, tuple(above + tokens[:end])))
    return out


@st.composite
def keys(draw: st.DrawFn, page_size: int) -> list[int]:
    pages = draw(st.lists(st.integers(0, 2), max_size=5))
    key = [10 * p + i % 2 for p in pages for i in range(page_size)]
    if key and draw(st.booleans()):
        key[draw(st.integers(0, len(key) - 1))] = 7
    return key


@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_tree_mirrors_replica_caches(page_size: int, data: st.DataObject) -> None:
    replicas = ["a", "b", "c"]
    buffers = {r: EventBuffer() for r in replicas}
    caches = {r: RadixCache(page_size, event_sink=buffers[r]) for r in replicas}
    tree = GlobalPrefixTree(page_size)
    slots = itertools.count(page_size)
    for _ in range(data.draw(st.integers(5, 40), label="steps")):
        replica = data.draw(st.sampled_from(replicas), label="replica")
        cache = caches[replica]
        op = data.draw(st.sampled_from(["insert", "insert", "evict", "match", "reset"]))
        extra_key = data.draw(st.sampled_from([None, None, "ns"]), label="extra_key")
        if op == "insert":
            key = data.draw(keys(page_size), label="key")
            cache.insert(key, [next(slots) for _ in key], extra_key)
        elif op == "evict":
            cache.evict(data.draw(st.integers(0, 3 * page_size), label="evict"))
        elif op == "reset" and data.draw(st.integers(0, 4)) == 0:
            cache.reset()
        elif op == "match":
            key = data.draw(keys(page_size), label="query")
            held = tree.match(key, extra_key)
            for r in replicas:
                want = caches[r].match_prefix(key, extra_key).cached_len
                assert held.get(r, 0) == want
        for r in replicas:  # events arrive in batches, as the router gets them
            for event in buffers[r].drain():
                tree.apply_event(r, event)
        tree.check_integrity()
        for r in replicas:
            assert tree.holdings(r) == _replica_paths(caches[r]), r


def test_drop_replica_removes_only_its_entries() -> None:
    tree = GlobalPrefixTree()
    tree.insert("a", [1, 2, 3, 4])
    tree.insert("b", [1, 2, 9])
    assert tree.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    tree.drop_replica("a")
    assert tree.match([1, 2, 3, 4, 5]) == {"b": 2}
    assert tree.num_tokens == 3
    tree.check_integrity()


def test_lru_cap_for_approximate_mode() -> None:
    tree = GlobalPrefixTree()
    tree.insert("a", list(range(100, 110)))
    tree.insert("b", list(range(200, 210)))
    tree.match(list(range(100, 110)))  # the first is now the most recent
    assert tree.evict_lru(max_tokens=12) == 10
    assert tree.match(list(range(200, 210))) == {}
    assert tree.match(list(range(100, 110))) == {"a": 10}
    tree.check_integrity()


def test_match_cost_does_not_grow_with_replicas_per_token() -> None:
    tree = GlobalPrefixTree()
    prefix = np.arange(1000, 3048, dtype=np.int32)
    for r in range(16):
        tree.insert(r, np.concatenate((prefix, np.full(64, r, dtype=np.int32))))
    held = tree.match(np.concatenate((prefix, np.full(64, 3, dtype=np.int32))))
    assert held[3] == 2048 + 64
    assert all(held[r] == 2048 for r in range(16) if r != 3)


def test_page_size_disagreement_is_refused() -> None:
    tree = GlobalPrefixTree(page_size=16)
    with pytest.raises(ValueError, match="disagree on the page size"):
        tree.insert("a", list(range(20)))
