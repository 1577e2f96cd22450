"""Least-recently-used eviction over tree leaves, for the device tier (radix.py) and the host
tier (hiradix.py) alike."""

from __future__ import annotations

import heapq
from collections.abc import Callable

from .tree_node import TreeNode


def evict_lru(
    leaves: set[TreeNode],
    num_tokens: int,
    take: Callable[[TreeNode], int],
    becomes_leaf: Callable[[TreeNode], bool],
) -> int:
    """Take nodes out of ``leaves``, least recently used first (ties: the older node), until
    ``num_tokens`` are freed or none is left; returns the tokens freed (whole leaves: it may be
    more than asked).

    ``take`` removes one leaf and returns the tokens it frees. After each, the leaf's parent
    joins ``leaves`` (and the candidates) when ``becomes_leaf`` says it may go now.
    """
    heap = [(leaf.last_access, leaf.id, leaf) for leaf in leaves]
    heapq.heapify(heap)
    num_freed = 0
    while num_freed < num_tokens and heap:
        _, _, leaf = heapq.heappop(heap)
        parent = leaf.parent
        assert parent is not None
        leaves.discard(leaf)
        num_freed += take(leaf)
        if becomes_leaf(parent):
            leaves.add(parent)
            heapq.heappush(heap, (parent.last_access, parent.id, parent))
    return num_freed
