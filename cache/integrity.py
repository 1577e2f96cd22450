"""The manager's ownership audit: every usable page is owned exactly once.

Owners are the free list, the tree nodes, and the running requests' own pages (row positions
``[cached_len, row_len)``). Page 0 is reserved for padding and is owned by nobody.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from .base import PrefixHandle

if TYPE_CHECKING:
    from .manager import KVCacheManager
    from .running_row import RunningRow


def _pages_of_run(slots: npt.NDArray[np.int32], page_size: int, what: str) -> npt.NDArray[np.int64]:
    """Page ids of a run of slots that fills pages in order from a page start."""
    pages = slots[::page_size].astype(np.int64) // page_size
    expected = (pages[:, None] * page_size + np.arange(page_size)).ravel()[: len(slots)]
    if not np.array_equal(expected, slots):
        raise RuntimeError(f"{what} does not fill its pages in order: {slots[:16].tolist()}")
    return pages


def check_manager(
    manager: KVCacheManager,
    rows: Iterable[tuple[int, RunningRow]],
    pinned: list[PrefixHandle],
) -> None:
    page_size = manager.page_size
    allocator = manager.allocator
    cache = manager.prefix_cache
    table = manager.req_to_token.table
    owners = np.zeros(allocator.num_pages + 1, dtype=np.int64)

    free_pages = allocator.free_pages().astype(np.int64)
    np.add.at(owners, free_pages, 1)
    if len(free_pages) * page_size != allocator.available_size():
        raise RuntimeError("the allocator's free count differs from its free list")

    tree_tokens = 0
    for prefix in cache.iter_prefixes():
        np.add.at(owners, _pages_of_run(prefix.slots, page_size, "a tree node"), 1)
        tree_tokens += len(prefix.slots)

    held_tokens = 0
    handles = list(pinned)
    for row, state in rows:
        if not manager.req_to_token.is_allocated(row):
            raise RuntimeError(f"running request row {row} is not allocated in the table")
        cached_len = state.handle.cached_len
        if cached_len % page_size:
            raise RuntimeError(f"request row {row} has unaligned cached_len {cached_len}")
        if not np.array_equal(table[row, :cached_len], cache.slots_of(state.handle)):
            raise RuntimeError(f"request row {row} does not hold its cached prefix's slots")
        own = _pages_of_run(table[row, cached_len : state.row_len], page_size, f"row {row}")
        np.add.at(owners, own, 1)
        held_tokens += len(own) * page_size
        handles.append(state.handle)

    if owners[0]:
        raise RuntimeError("the padding page 0 is owned")
    leaked = np.flatnonzero(owners[1:] == 0) + 1
    shared = np.flatnonzero(owners[1:] > 1) + 1
    if len(leaked) or len(shared):
        raise RuntimeError(
            f"page ownership broken: leaked pages {leaked[:16].tolist()}, "
            f"pages owned more than once {shared[:16].tolist()}"
        )
    allocated = np.array([allocator.is_page_allocated(p) for p in free_pages], dtype=bool)
    if allocated.any():
        raise RuntimeError("a page on the free list is marked allocated")

    size = cache.size_info
    if size.total_size != tree_tokens:
        raise RuntimeError(f"tree size {size.total_size} differs from its nodes ({tree_tokens})")
    total = allocator.available_size() + size.evictable_size + size.protected_size + held_tokens
    if total != allocator.capacity:
        raise RuntimeError(
            f"free {allocator.available_size()} + evictable {size.evictable_size} + protected "
            f"{size.protected_size} + held {held_tokens} = {total}, not capacity "
            f"{allocator.capacity}"
        )
    cache.check_integrity(locked_handles=handles)
