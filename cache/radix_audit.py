"""The radix tree's structural audit, kept apart from the hot path."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .base import PrefixHandle
from .tree_node import TreeNode

if TYPE_CHECKING:
    from .radix import RadixCache

_ITEM = 4


def check_tree(cache: RadixCache, locked_handles: Iterable[PrefixHandle] | None) -> None:
    """Raise ``RuntimeError`` unless links, page alignment, lock counts, sizes and the
    evictable-leaf set all agree with the nodes. With ``locked_handles``, each node's lock
    count must equal the number of those handles whose path passes through it."""
    if locked_handles is not None:
        _check_locks(cache, locked_handles)
    page_bytes = cache.page_size * _ITEM
    evictable = protected = 0
    leaves: set[TreeNode] = set()
    for node in cache.iter_nodes():
        parent = node.parent
        if parent is None or node.detached:
            raise RuntimeError(f"{node} is in the tree but detached")
        if parent.children.get(node.key[:page_bytes]) is not node:
            raise RuntimeError(f"{node} is not under its first page in its parent")
        if len(node.value) == 0 and node.host_value is not None:
            pass  # host tier only (hiradix.py checks it)
        elif len(node.key) != len(node.value) * _ITEM or len(node.value) == 0:
            raise RuntimeError(f"{node} has key and value of different lengths")
        if len(node.value) % cache.page_size:
            raise RuntimeError(f"{node} is not a whole number of pages")
        if node.lock_ref < sum(child.lock_ref for child in node.children.values()):
            raise RuntimeError(f"{node} has fewer locks than its children")
        if node.lock_ref:
            protected += len(node.value)
        else:
            evictable += len(node.value)
            if len(node.value) and cache._is_leaf(node):
                leaves.add(node)
    if (evictable, protected) != tuple(cache.size_info):
        raise RuntimeError(
            f"size counters {cache.size_info} differ from the tree "
            f"(evictable={evictable}, protected={protected})"
        )
    if leaves != cache.evictable_leaves:
        raise RuntimeError("the evictable-leaf set differs from the tree")


def _check_locks(cache: RadixCache, locked_handles: Iterable[PrefixHandle]) -> None:
    expected: dict[int, int] = {}
    for handle in locked_handles:
        if not handle.locked:
            raise RuntimeError(f"{handle} is listed as locked but is not")
        node = handle.node
        if not isinstance(node, TreeNode) or node.detached:
            raise RuntimeError(f"{handle} is locked but its node left the tree")
        cur: TreeNode | None = node
        while cur is not None and cur.parent is not None:
            expected[cur.id] = expected.get(cur.id, 0) + 1
            cur = cur.parent
    for node in cache.iter_nodes():
        if node.lock_ref != expected.get(node.id, 0):
            raise RuntimeError(
                f"{node} has lock_ref {node.lock_ref}, but "
                f"{expected.get(node.id, 0)} locked handles pass through it"
            )
