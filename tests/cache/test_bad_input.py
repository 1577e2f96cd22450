"""Bad input gets an exception that names the problem, and nothing changes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from raydix.cache import CacheConfig, KVCacheManager


def _snapshot(m: KVCacheManager) -> tuple[object, ...]:
    prefixes = sorted(
        (p.prefix_ids.tolist(), p.token_ids.tolist(), p.slots.tolist())
        for p in m.prefix_cache.iter_prefixes()
    )
    return (
        m.allocator.free_pages().tolist(),
        m.req_to_token.table.copy().tolist(),
        prefixes,
        m.size_info,
        m.num_running,
    )


@pytest.fixture(params=[1, 16])
def busy(request: pytest.FixtureRequest) -> tuple[KVCacheManager, int]:
    """A manager with a cached prefix and one running request (row returned)."""
    page_size = request.param
    m = KVCacheManager(
        CacheConfig(
            num_pages=8, max_running_requests=2, max_context_len=4 * page_size, page_size=page_size
        )
    )
    cached = list(range(page_size))
    row = m.alloc_req(m.match_prefix(cached))
    assert row is not None
    m.alloc_slots(row, page_size)
    m.cache_finished_req(row, cached)
    row = m.alloc_req(m.match_prefix(cached + [5]))
    assert row is not None
    m.alloc_slots(row, 3)
    m.check_integrity()
    return m, row


CASES: list[tuple[str, Callable[[KVCacheManager, int], object], type[Exception], str]] = [
    ("negative allocation", lambda m, r: m.allocator.alloc(-3), ValueError, "negative"),
    ("oversized allocation", lambda m, r: m.allocator.alloc(10**6), ValueError, "capacity"),
    ("negative extend", lambda m, r: m.alloc_slots(r, -1), ValueError, "negative"),
    (
        "double free",
        lambda m, r: m.allocator.free(m.allocator.free_pages()[:1] * m.page_size),
        RuntimeError,
        "double free",
    ),
    ("free of the padding page", lambda m, r: m.allocator.free([0]), ValueError, "padding"),
    (
        "unlock of an unlocked handle",
        lambda m, r: m.unlock(m.match_prefix(list(range(m.page_size))).handle),
        RuntimeError,
        "not locked",
    ),
    (
        "radix unlock of an unlocked handle",
        lambda m, r: m.prefix_cache.unlock(m.match_prefix(list(range(m.page_size))).handle),
        RuntimeError,
        "not locked",
    ),
    (
        "key and value lengths differ",
        lambda m, r: m.prefix_cache.insert(list(range(2 * m.page_size)), [1]),
        ValueError,
        "lengths differ",
    ),
    (
        "key longer than max_context_len",
        lambda m, r: m.prefix_cache.insert(
            list(range(8 * m.page_size)), list(range(8 * m.page_size))
        ),
        ValueError,
        "max_context_len",
    ),
    (
        "row grows over max_context_len",
        lambda m, r: m.alloc_slots(r, 4 * m.page_size),
        ValueError,
        "max_context_len",
    ),
    (
        "more token ids than the row holds",
        lambda m, r: m.cache_finished_req(r, list(range(10 * m.page_size))),
        ValueError,
        "holds only",
    ),
    (
        "token ids that do not start with the cached prefix",
        lambda m, r: m.cache_finished_req(r, [99] * (m.page_size + 3)),
        ValueError,
        "cached prefix",
    ),
    ("a row that is not running", lambda m, r: m.alloc_slots(r + 1, 1), RuntimeError, "not held"),
    (
        "two-dimensional token ids",
        lambda m, r: m.match_prefix(np.zeros((2, 2))),
        ValueError,
        "one-dimensional",
    ),
]


@pytest.mark.parametrize(("name", "call", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_named_and_changes_nothing(
    busy: tuple[KVCacheManager, int],
    name: str,
    call: Callable[[KVCacheManager, int], object],
    error: type[Exception],
    message: str,
) -> None:
    m, row = busy
    before = _snapshot(m)
    with pytest.raises(error, match=message):
        call(m, row)
    assert _snapshot(m) == before, name
    m.check_integrity()
    # and it keeps working
    m.cache_finished_req(row, list(range(m.page_size)) + [5])
    m.check_integrity()
