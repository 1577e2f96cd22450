"""The radix prefix cache: a radix tree over token ids whose edges are whole pages.

Each node holds a run of tokens (``key``, kept as int32 bytes so that comparing runs is a
``memcmp``) and the slots of their K/V (``value``). Children are keyed by their first page.

Sizes, kept exact at every step:

    evictable_size = tokens in nodes with lock_ref == 0   (no running request uses them)
    protected_size = tokens in nodes with lock_ref  > 0   (some locked handle's path)

``lock_ref`` of a node is the number of locked handles whose path passes through it, so
``lock_ref(parent) >= lock_ref(child)``: an unlocked node has only unlocked descendants, and
eviction of leaves can reach every evictable token.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Iterator

import numpy as np
import numpy.typing as npt

from .base import CachedPrefix, MatchResult, PrefixCache, PrefixHandle, SizeInfo, TokenArray
from .events import CacheEvent, EventKind, EventSink
from .eviction import evict_lru
from .radix_audit import check_tree
from .req_table import SlotArray
from .tree_node import (
    TreeNode,
    as_token_array,
    checked_entry,
    common_page_bytes,
    detach,
    split_node,
)
from .tree_paths import iter_nodes, iter_prefixes, leaf_paths, path_key, path_slots, unlocked_len

_ITEM = 4  # bytes per int32 token id
_EMPTY = np.zeros(0, dtype=np.int32)


class RadixCache(PrefixCache):
    """SGLang-style radix cache with page-aligned keys, LRU eviction and change events."""

    def __init__(
        self,
        page_size: int = 1,
        max_context_len: int | None = None,
        event_sink: EventSink | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.max_context_len = max_context_len
        self._event_sink = event_sink
        self._page_bytes = page_size * _ITEM
        self._ids = itertools.count()
        self._event_seq = itertools.count()
        self._tick = 0
        self.reset()

    @property
    def enabled(self) -> bool:
        return True

    def reset(self) -> None:
        self._roots: dict[Hashable, TreeNode] = {}
        self._evictable_leaves: set[TreeNode] = set()
        self._evictable_size = 0
        self._protected_size = 0
        self._emit(EventKind.CLEARED, None, _EMPTY, 0)

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(self._evictable_size, self._protected_size)

    @property
    def evictable_size(self) -> int:
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        return self._protected_size

    @property
    def evictable_leaves(self) -> frozenset[TreeNode]:
        return frozenset(self._evictable_leaves)

    # ------------------------------------------------------------------------------ match
    def match_prefix(self, token_ids: npt.ArrayLike, extra_key: Hashable = None) -> MatchResult:
        key = as_token_array(token_ids)
        root = self._roots.get(extra_key)
        if root is None:
            return MatchResult(_EMPTY, PrefixHandle(0, self._root(extra_key)))
        node, matched, values = self._walk(root, key, collect=True)
        if not values:
            slots = _EMPTY
        elif len(values) == 1:
            slots = values[0]
        else:
            slots = np.concatenate(values)
        return MatchResult(slots, PrefixHandle(matched, node))

    def _walk(
        self, node: TreeNode, key: TokenArray, collect: bool
    ) -> tuple[TreeNode, int, list[SlotArray]]:
        """Follow ``key`` down from ``node``; split where the match ends inside a node.

        Returns the last matched node, the matched length, and (if ``collect``) the values.
        """
        page_bytes = self._page_bytes
        num_bytes = len(key) // self.page_size * page_bytes
        data = key.tobytes()  # the unaligned tail is never compared: keys are whole pages
        self._tick += 1
        tick = self._tick
        node.last_access = tick
        values: list[SlotArray] = []
        pos = 0
        children = node.children
        while pos < num_bytes:
            child = children.get(data[pos : pos + page_bytes])
            if child is None:
                break
            child_key = child.key
            if data.startswith(child_key, pos):  # memcmp, no copy
                child.last_access = tick
                if collect:
                    values.append(child.value)
                node = child
                children = child.children
                pos += len(child_key)
                continue
            split_len = common_page_bytes(child_key, data, pos, num_bytes, page_bytes) // _ITEM
            node = self._split(child, split_len)
            node.last_access = tick
            if collect:
                values.append(node.value)
            pos += split_len * _ITEM
            break
        return node, pos // _ITEM, values

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        """``parent -> child`` becomes ``parent -> upper -> child``; returns ``upper``."""
        return split_node(child, split_len, self._page_bytes, next(self._ids))

    # ----------------------------------------------------------------------------- insert
    def insert(
        self, token_ids: npt.ArrayLike, slots: npt.ArrayLike, extra_key: Hashable = None
    ) -> int:
        key, values = checked_entry(token_ids, slots, self.page_size, self.max_context_len)
        if len(key) == 0:
            return 0
        root = self._root(extra_key)
        node, present, _ = self._walk(root, key, collect=False)
        if present < len(key):
            was_evictable_leaf = node in self._evictable_leaves
            leaf = TreeNode(
                key[present:].tobytes(),
                np.array(values[present:], dtype=np.int32),
                node,
                self._tick,
                next(self._ids),
            )
            node.children[leaf.key[: self._page_bytes]] = leaf
            if was_evictable_leaf:
                self._evictable_leaves.discard(node)
            self._evictable_leaves.add(leaf)
            self._evictable_size += len(leaf.value)
            if self._event_sink is not None:
                self._emit(EventKind.INSERTED, extra_key, key.copy(), len(key) - present)
        return present

    # ------------------------------------------------------------------------------- lock
    def lock(self, handle: PrefixHandle) -> None:
        if handle.locked:
            raise RuntimeError(f"{handle} is already locked")
        node = self._live_node(handle)
        while node.parent is not None:
            if node.lock_ref == 0:
                num = len(node.value)
                self._evictable_size -= num
                self._protected_size += num
                if self._is_leaf(node):
                    self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent
        handle.locked = True

    def unlock(self, handle: PrefixHandle) -> None:
        if not handle.locked:
            raise RuntimeError(f"cannot unlock {handle}: it is not locked")
        node = self._live_node(handle)
        while node.parent is not None:
            if node.lock_ref == 1:
                num = len(node.value)
                self._evictable_size += num
                self._protected_size -= num
                if self._is_leaf(node):
                    self._evictable_leaves.add(node)
            node.lock_ref -= 1
            node = node.parent
        handle.locked = False

    def _live_node(self, handle: PrefixHandle) -> TreeNode:
        node = handle.node
        if not isinstance(node, TreeNode):
            raise TypeError(f"{handle} does not belong to a radix cache")
        if node.detached:
            raise RuntimeError(f"{handle} is stale: its prefix was evicted; match again")
        return node

    # ------------------------------------------------------------------------------ evict
    def evict(self, num_tokens: int) -> SlotArray:
        if num_tokens < 0:
            raise ValueError(f"cannot evict a negative number of tokens ({num_tokens})")
        if num_tokens == 0 or not self._evictable_leaves:
            return _EMPTY.copy()
        freed: list[SlotArray] = []

        def take(leaf: TreeNode) -> int:
            freed.append(self._evict_leaf(leaf))
            self._evictable_size -= len(freed[-1])
            return len(freed[-1])

        evict_lru(self._evictable_leaves, num_tokens, take,
                  lambda node: node.parent is not None and not node.lock_ref and self._is_leaf(node))
        return np.concatenate(freed) if freed else _EMPTY.copy()

    def _evict_leaf(self, leaf: TreeNode) -> SlotArray:
        """Take an unlocked device leaf off the device; returns its slots. Here it leaves the
        tree (the host tier keeps a node that has a host copy)."""
        self._emit_path(EventKind.EVICTED, leaf, len(leaf.value))
        detach(leaf, self._page_bytes)
        return leaf.value

    def publish_snapshot(self) -> None:
        if self._event_sink is None:
            return
        self._emit(EventKind.CLEARED, None, _EMPTY, 0)
        for extra_key, tokens in leaf_paths(self._roots):
            self._emit(EventKind.INSERTED, extra_key, tokens, len(tokens))

    # ---------------------------------------------------------------------------- helpers
    def _is_leaf(self, node: TreeNode) -> bool:
        """Whether eviction may take ``node`` once it is unlocked (no child holds slots)."""
        return not node.children

    def _root(self, extra_key: Hashable) -> TreeNode:
        root = self._roots.get(extra_key)
        if root is None:
            root = TreeNode(b"", _EMPTY, None, self._tick, next(self._ids))
            self._roots[extra_key] = root
        return root

    def _path_of(self, node: TreeNode) -> tuple[Hashable, TokenArray]:
        """The namespace and the whole token path from its root down to ``node``."""
        top, key = path_key(node)
        extra_key = next(k for k, root in self._roots.items() if root is top)
        return extra_key, np.frombuffer(key, dtype=np.int32).copy()

    def _emit_path(self, kind: EventKind, node: TreeNode, num_tokens: int) -> None:
        """An event naming ``node``'s whole path (looked up only when a sink listens)."""
        if self._event_sink is not None:
            self._emit(kind, *self._path_of(node), num_tokens)

    def _emit(
        self, kind: EventKind, extra_key: Hashable, token_ids: TokenArray, num_tokens: int
    ) -> None:
        if self._event_sink is not None:
            self._event_sink(
                CacheEvent(next(self._event_seq), kind, extra_key, token_ids, num_tokens)
            )

    # ----------------------------------------------------------------------- inspection
    def iter_prefixes(self) -> Iterator[CachedPrefix]:
        return iter_prefixes(self._roots)

    def iter_nodes(self) -> Iterator[TreeNode]:
        return iter_nodes(self._roots.values())

    def evictable_len(self, handle: PrefixHandle) -> int:
        return unlocked_len(self._live_node(handle))

    def tokens_of(self, handle: PrefixHandle) -> TokenArray:
        return self._path_of(self._live_node(handle))[1]

    def slots_of(self, handle: PrefixHandle) -> SlotArray:
        return path_slots(self._live_node(handle))

    def check_integrity(self, locked_handles: Iterable[PrefixHandle] | None = None) -> None:
        check_tree(self, locked_handles)
