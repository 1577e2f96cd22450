"""Request-level operations of the KV cache manager, with exact slot ids."""

from __future__ import annotations

import pytest

from raydix.cache import CacheConfig, KVCacheManager


def _manager(num_pages: int = 16, page_size: int = 1, **kw: object) -> KVCacheManager:
    config = CacheConfig(
        num_pages=num_pages,
        max_running_requests=4,
        max_context_len=64,
        page_size=page_size,
        **kw,  # type: ignore[arg-type]
    )
    return KVCacheManager(config)


def _run(m: KVCacheManager, tokens: list[int]) -> int:
    """Admit a request with its prefix match and allocate the rest of its prompt."""
    match = m.match_prefix(tokens)
    row = m.alloc_req(match)
    assert row is not None
    assert m.alloc_slots(row, len(tokens) - match.cached_len) is not None
    m.check_integrity()
    return row


def test_seed_walkthrough_reuses_the_shared_prefix() -> None:
    m = _manager()
    a = [1, 3, 6, 7, 9, 77]
    row = _run(m, a)
    assert m.req_to_token.read(row, 0, 6).tolist() == [1, 2, 3, 4, 5, 6]
    m.cache_finished_req(row, a)
    m.check_integrity()
    assert m.available_size() == 16

    b = [1, 3, 6, 7, 87, 66]
    match = m.match_prefix(b)
    assert (match.cached_len, match.slots.tolist()) == (4, [1, 2, 3, 4])
    row = m.alloc_req(match)
    assert row is not None
    assert m.alloc_slots(row, 2).tolist() == [7, 8]  # type: ignore[union-attr]
    assert m.size_info == (2, 4)  # [9, 77] evictable, [1, 3, 6, 7] protected by the row
    m.check_integrity()
    m.cache_finished_req(row, b)
    assert m.size_info == (8, 0)
    m.check_integrity()


def test_cache_unfinished_req_frees_duplicates_and_moves_the_lock() -> None:
    m = _manager()
    prompt = [10, 11, 12, 13, 14, 15]
    a = _run(m, prompt)
    b = _run(m, prompt)  # nothing cached yet: b computes the same prompt in its own slots
    assert m.req_to_token.read(a, 0, 6).tolist() == [1, 2, 3, 4, 5, 6]
    assert m.req_to_token.read(b, 0, 6).tolist() == [7, 8, 9, 10, 11, 12]

    assert m.cache_unfinished_req(a, prompt) == 6
    assert m.cached_len(a) == 6
    assert m.size_info == (0, 6)
    m.check_integrity()

    free_before = m.allocator.available_size()
    assert m.cache_unfinished_req(b, prompt) == 6
    # b's own slots duplicated the tree: they are freed, and b's row now points at the tree's
    assert m.req_to_token.read(b, 0, 6).tolist() == [1, 2, 3, 4, 5, 6]
    assert m.allocator.available_size() == free_before + 6
    assert m.allocator.free_pages()[-6:].tolist() == [7, 8, 9, 10, 11, 12]
    node = m.match_prefix(prompt).handle.node
    assert node.lock_ref == 2  # type: ignore[attr-defined]
    m.check_integrity()

    m.cache_finished_req(a, prompt)
    m.cache_finished_req(b, prompt)
    assert m.size_info == (6, 0)
    m.check_integrity()


def test_chunked_prefill_keeps_the_unaligned_tail_with_the_request() -> None:
    m = _manager(num_pages=8, page_size=4)
    prompt = list(range(100, 110))  # 10 tokens: two whole pages and a tail of 2
    row = m.alloc_req(m.match_prefix(prompt))
    assert row is not None
    assert m.alloc_slots(row, 6).tolist() == [4, 5, 6, 7, 8, 9]  # type: ignore[union-attr]
    assert m.cache_unfinished_req(row, prompt[:6]) == 4  # one whole page goes to the tree
    assert m.size_info == (0, 4)
    m.check_integrity()
    # the next chunk continues in the partly filled page 2 (slots 8, 9 used)
    assert m.alloc_slots(row, 4).tolist() == [10, 11, 12, 13]  # type: ignore[union-attr]
    assert m.cache_unfinished_req(row, prompt) == 8
    assert m.size_info == (0, 8)
    m.check_integrity()
    m.cache_finished_req(row, prompt)
    assert m.size_info == (8, 0)
    assert m.allocator.available_size() == 6 * 4  # the tail page went back to the pool
    m.check_integrity()


def test_allocation_evicts_least_recently_used_prefixes() -> None:
    m = _manager(num_pages=8)
    for first in (1, 2):
        tokens = [first] * 4
        m.cache_finished_req(_run(m, tokens), tokens)
    assert m.allocator.available_size() == 0
    assert m.available_size() == 8
    m.match_prefix([1, 1, 1, 1])  # [2, 2, 2, 2] is now least recently used
    row = _run(m, [3, 3])
    assert m.req_to_token.read(row, 0, 2).tolist() == [5, 6]  # [2]*4 was evicted
    assert m.match_prefix([2, 2, 2, 2]).cached_len == 0
    assert m.match_prefix([1, 1, 1, 1]).cached_len == 4
    assert m.alloc_slots(row, 8) is None  # locked and held tokens cannot be evicted
    assert m.row_len(row) == 2
    m.check_integrity()


def test_no_prefix_cache_frees_everything() -> None:
    m = _manager(enable_prefix_cache=False)
    tokens = [5, 6, 7, 8]
    row = _run(m, tokens)
    assert m.cache_unfinished_req(row, tokens) == 0
    m.check_integrity()
    m.cache_finished_req(row, tokens)
    assert m.allocator.available_size() == 16
    assert m.match_prefix(tokens).cached_len == 0
    m.check_integrity()


def test_decode_slots_for_a_batch() -> None:
    m = _manager(num_pages=8, page_size=2)
    a = _run(m, [1, 2, 3])  # slots 2, 3, 4: room for one more in page 2
    b = _run(m, [4, 5])  # slots 6, 7: page 3 is full
    assert m.alloc_decode_slots([a, b]).tolist() == [5, 8]  # type: ignore[union-attr]
    assert (m.row_len(a), m.row_len(b)) == (4, 3)
    m.check_integrity()
    m.free_req(a)
    m.free_req(b)
    assert m.allocator.available_size() == 16
    m.check_integrity()


def test_reset_frees_all() -> None:
    m = _manager()
    tokens = [1, 2, 3]
    m.cache_finished_req(_run(m, tokens), tokens)
    _run(m, [4, 5])
    m.reset()
    assert m.num_running == 0
    assert m.available_size() == 16 and m.size_info == (0, 0)
    m.check_integrity()


def test_integrity_check_catches_a_leak() -> None:
    m = _manager()
    _run(m, [1, 2, 3])
    m.allocator.alloc(1)  # taken behind the manager's back: owned by nobody
    with pytest.raises(RuntimeError, match="leaked pages \\[4\\]"):
        m.check_integrity()
    m.allocator.free([4])
    m.check_integrity()
    m.prefix_cache.insert([9], [2])  # slot 2 is held by the row and now by the tree too
    with pytest.raises(RuntimeError, match="owned more than once \\[2\\]"):
        m.check_integrity()
