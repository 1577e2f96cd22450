"""The host tier's audit: every host page owned exactly once, sizes exact, tiers consistent."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .hiradix import HiRadixCache

_ITEM = 4


def check_host_tier(cache: HiRadixCache) -> None:
    """Raise ``RuntimeError`` unless: each node is on the device, the host or both, with whole
    pages in order; a device node's parent is on the device; a host-only node is unlocked;
    nodes being loaded are on both tiers; the host pages are owned exactly once (the host
    allocator's free list or one node) and ``host_size`` counts the nodes' host slots."""
    page_size = cache.page_size
    allocator = cache.host_allocator
    owners = np.zeros(allocator.num_pages + 1, dtype=np.int64)
    free_pages = allocator.free_pages().astype(np.int64)
    np.add.at(owners, free_pages, 1)
    host_tokens = 0
    loading = set(map(id, cache.loading_nodes()))
    for node in cache.iter_nodes():
        num = len(node.key) // _ITEM
        parent = node.parent
        assert parent is not None
        if len(node.value):
            if parent.parent is not None and not len(parent.value):
                raise RuntimeError(f"{node} is on the device below a host-only parent")
        elif node.host_value is None:
            raise RuntimeError(f"{node} is on neither tier")
        elif node.lock_ref:
            raise RuntimeError(f"{node} is host-only but locked")
        if node.loading and (id(node) not in loading or node.host_value is None):
            raise RuntimeError(f"{node} is marked loading but has no queued load")
        host = node.host_value
        if host is None:
            continue
        if len(host) != num:
            raise RuntimeError(f"{node} has {len(host)} host slots for {num} tokens")
        pages = host[::page_size].astype(np.int64) // page_size
        expected = (pages[:, None] * page_size + np.arange(page_size)).ravel()[:num]
        if not np.array_equal(expected, host):
            raise RuntimeError(f"{node} host slots do not fill their pages in order")
        np.add.at(owners, pages, 1)
        host_tokens += num
    if owners[0]:
        raise RuntimeError("the host tier's padding page 0 is owned")
    leaked = np.flatnonzero(owners[1:] == 0) + 1
    shared = np.flatnonzero(owners[1:] > 1) + 1
    if len(leaked) or len(shared):
        raise RuntimeError(
            f"host page ownership broken: leaked {leaked[:16].tolist()}, owned more than once "
            f"{shared[:16].tolist()}"
        )
    if host_tokens != cache.host_size:
        raise RuntimeError(f"host_size {cache.host_size} differs from the nodes ({host_tokens})")
    if host_tokens + allocator.available_size() != allocator.capacity:
        raise RuntimeError("host free + host copies differ from the host capacity")
