"""Read-only walks over the radix tree's nodes: whole paths up to a root, subtrees, stored runs.

Nothing here changes the tree, its access times, sizes, locks or events.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping

import numpy as np

from .base import CachedPrefix, TokenArray
from .req_table import SlotArray
from .tree_node import TreeNode

_EMPTY = np.zeros(0, dtype=np.int32)


def iter_nodes(roots: Iterable[TreeNode]) -> Iterator[TreeNode]:
    """Every node below the roots (the roots themselves hold nothing)."""
    for root in roots:
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def iter_prefixes(roots: Mapping[Hashable, TreeNode]) -> Iterator[CachedPrefix]:
    """Every run of tokens on the device, with the path above it; a node in a host tier only
    (hiradix.py) is left out with its subtree."""
    for extra_key, root in roots.items():
        stack: list[tuple[TreeNode, bytes]] = [(root, b"")]
        while stack:
            node, above = stack.pop()
            for child in node.children.values():
                if not len(child.value):
                    continue
                yield CachedPrefix(
                    extra_key,
                    np.frombuffer(above, dtype=np.int32),
                    np.frombuffer(child.key, dtype=np.int32),
                    child.value,
                )
                stack.append((child, above + child.key))


def leaf_paths(roots: Mapping[Hashable, TreeNode]) -> Iterator[tuple[Hashable, TokenArray]]:
    """The namespace and whole token path of every node without children."""
    for extra_key, root in roots.items():
        stack: list[tuple[TreeNode, bytes]] = [(root, b"")]
        while stack:
            node, above = stack.pop()
            for child in node.children.values():
                path = above + child.key
                if child.children:
                    stack.append((child, path))
                else:
                    yield extra_key, np.frombuffer(path, dtype=np.int32).copy()


def path_key(node: TreeNode) -> tuple[TreeNode, bytes]:
    """The root above ``node`` and the key bytes of the whole path down to it."""
    parts: list[bytes] = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return node, b"".join(reversed(parts))


def path_slots(node: TreeNode) -> SlotArray:
    """The slots of the whole path from the root down to ``node`` (a new array)."""
    parts: list[SlotArray] = []
    while node.parent is not None:
        parts.append(node.value)
        node = node.parent
    return np.concatenate(parts[::-1]) if parts else _EMPTY.copy()


def path_nodes(node: TreeNode, stop: object = None) -> list[TreeNode]:
    """Nodes from below ``stop`` (default: the root) down to ``node``, top first."""
    path = []
    while node.parent is not None and node is not stop:
        path.append(node)
        node = node.parent
    return path[::-1]


def unlocked_len(node: TreeNode) -> int:
    """Tokens on the unlocked part of the path above ``node`` (what locking it protects)."""
    total = 0
    while node.parent is not None and node.lock_ref == 0:
        total += len(node.value)
        node = node.parent
    return total
