"""The host-memory KV tier over the radix cache (the seeds' HiRadixCache).

A node's K/V is on the device (``value``: its device slots), in host memory (``host_value``:
its host slots), or both. A node whose ``value`` is empty is on the host only. Device nodes
form the top of every path: a device node's parent is on the device too, so eviction takes
device leaves (nodes without device children) and host-only nodes hang below device ones.

- ``match_prefix`` returns the device part (slots and handle, as the radix cache does) and the
  host-only length beyond it (``handle.host_len`` up to ``handle.host_node``).
- ``load_back`` gives a matched host path the device slots the cache manager allocated and
  queues the host->device copies; the locked handle then covers the loaded nodes.
- ``write_backup`` copies a device node to host slots, by the write policy: ``write_through``
  (every node when inserted), ``write_through_selective`` (when its hit count reaches
  ``write_through_threshold``; a hit is an insert that covers it), ``write_back`` (when evicted
  from the device).
- Device eviction keeps the host copy (the node stays, host only); a node without one leaves
  the tree with its host-only subtree. The host tier has its own LRU eviction of host-only
  leaves (``evict_host``).

Copies are not made here. They are queued and the cache manager drains them into the next step
plan (``drain_copies``), where every rank applies the device->host writes first, then the
host->device loads, each in the order queued, before the step's forward. So a device slot
freed and reused in that step is read by its pending write before a load or the forward writes
it. A host slot feeding a pending load must not take a later write: the nodes being loaded keep
``loading`` (the lock of nodes being copied) until the drain, and host eviction skips them.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import numpy as np
import numpy.typing as npt

from .allocator import PagedSlotAllocator
from .base import MatchResult, PrefixHandle, TokenArray
from .events import EventKind, EventSink
from .eviction import evict_lru
from .hiradix_audit import check_host_tier
from .host_tier import (
    DEFAULT_WRITE_POLICY,
    hits_to_write,
    host_evictable,
    host_only_path,
    split_tiers,
)
from .kv_copies import CopyQueue, KVCopies
from .radix import RadixCache
from .req_table import SlotArray
from .tree_node import TreeNode, as_token_array, checked_entry, detach
from .tree_paths import path_nodes

_ITEM = 4
_EMPTY = np.zeros(0, dtype=np.int32)


class HiRadixCache(RadixCache):
    """A radix cache whose nodes also live in a host tier of ``num_host_pages`` pages."""

    def __init__(
        self,
        page_size: int,
        num_host_pages: int,
        max_context_len: int | None = None,
        event_sink: EventSink | None = None,
        write_policy: str = DEFAULT_WRITE_POLICY,
        write_through_threshold: int = 2,
    ) -> None:
        self.write_through_threshold = hits_to_write(write_policy, write_through_threshold)
        self.write_policy = write_policy
        self.host_allocator = PagedSlotAllocator(num_host_pages, page_size)
        self.num_loaded_tokens = 0  # host->device, since start
        self.num_written_tokens = 0  # device->host, since start
        super().__init__(page_size, max_context_len, event_sink)

    def reset(self) -> None:
        super().reset()
        self.host_allocator.clear()
        self._host_size = 0
        self._copies = CopyQueue()

    @property
    def host_size(self) -> int:
        """Tokens with a copy in the host tier."""
        return self._host_size

    @property
    def host_capacity(self) -> int:
        return self.host_allocator.capacity

    @property
    def has_copies(self) -> bool:
        return bool(self._copies)

    # ------------------------------------------------------------------------------ match
    def match_prefix(self, token_ids: npt.ArrayLike, extra_key: Hashable = None) -> MatchResult:
        key = as_token_array(token_ids)
        root = self._roots.get(extra_key)
        if root is None:
            return MatchResult(_EMPTY, PrefixHandle(0, self._root(extra_key)))
        node, matched, values = self._walk(root, key, collect=True)
        slots, device_node, host_len = split_tiers(node, matched, values)
        return MatchResult(
            slots, PrefixHandle(len(slots), device_node, host_len, node if host_len else None)
        )

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        upper = super()._split(child, split_len)  # both tiers' slots split at the same point
        if child.loading:
            self._copies.hold(upper)
        return upper

    def _is_leaf(self, node: TreeNode) -> bool:
        return not any(len(child.value) for child in node.children.values())

    def _refresh_leaf(self, node: TreeNode) -> None:
        if node.parent is not None and len(node.value) and not node.lock_ref and self._is_leaf(
            node
        ):
            self._evictable_leaves.add(node)
        else:
            self._evictable_leaves.discard(node)

    # ----------------------------------------------------------------------------- insert
    def insert(
        self, token_ids: npt.ArrayLike, slots: npt.ArrayLike, extra_key: Hashable = None
    ) -> int:
        """As the radix cache's; nodes on the host only take their slots back from ``slots``
        (they are past the returned length, so the cache owns them)."""
        key, values = checked_entry(token_ids, slots, self.page_size, self.max_context_len)
        if len(key) == 0:
            return 0
        node, matched, _ = self._walk(self._root(extra_key), key, collect=False)
        present = pos = 0
        changed: list[TreeNode] = []
        hit: list[TreeNode] = []
        for n in path_nodes(node, None):
            num = len(n.key) // _ITEM
            if len(n.value):
                present = pos + num
                hit.append(n)
            else:  # host only: the device has it again, in the caller's slots
                n.value = np.array(values[pos : pos + num], dtype=np.int32)
                self._evictable_size += num
                changed.append(n)
            pos += num
        if matched < len(key):
            leaf = TreeNode(key[matched:].tobytes(), np.array(values[matched:], dtype=np.int32),
                            node, self._tick, next(self._ids))
            node.children[leaf.key[: self._page_bytes]] = leaf
            self._evictable_size += len(leaf.value)
            changed.append(leaf)
        if changed:
            above = changed[0].parent
            assert above is not None
            for changed_node in [above, *changed]:
                self._refresh_leaf(changed_node)
            self._emit(EventKind.INSERTED, extra_key, key.copy(), len(key) - present)
            if matched < len(key):
                hit.append(changed[-1])
        for n in hit:  # after the revival: host eviction must not take a node of this path
            self._note_hit(n)
        return present

    # ---------------------------------------------------------------------- host copies
    def _note_hit(self, node: TreeNode) -> None:
        if self.write_policy == "write_back" or node.host_value is not None:
            return
        node.hit_count += 1
        if node.hit_count >= self.write_through_threshold:
            self.write_backup(node)

    def write_backup(self, node: TreeNode) -> bool:
        """Queue a copy of a device node to new host slots; False when the host tier has no
        room even after its own eviction."""
        num = len(node.value)
        host = self._alloc_host(num)
        if host is None:
            return False
        node.host_value = host
        self._host_size += num
        self._copies.write(node.value, host)
        self.num_written_tokens += num
        self._emit_path(EventKind.HOST_INSERTED, node, num)
        return True

    def _alloc_host(self, num_tokens: int) -> SlotArray | None:
        if num_tokens > self.host_allocator.capacity:
            return None
        short = num_tokens - self.host_allocator.available_size()
        if short > 0:
            self.evict_host(short)
        return self.host_allocator.alloc(num_tokens)

    def hold_host_path(self, handle: PrefixHandle) -> bool:
        """Mark the handle's host-only path as being loaded, so that host eviction keeps it
        while the manager finds device slots for it. False when the path is gone."""
        path = host_only_path(handle)
        if path is None:
            return False
        for n in path:
            self._copies.hold(n)
        return True

    def load_back(self, handle: PrefixHandle, slots: SlotArray) -> None:
        """Give the held host path (``hold_host_path``) the device ``slots`` and queue the
        loads. The locked handle then ends at ``host_node`` and counts the loaded tokens."""
        if not handle.locked:
            raise RuntimeError(f"{handle} must be locked before its host path is loaded")
        node = handle.host_node
        assert isinstance(node, TreeNode) and isinstance(handle.node, TreeNode)
        path = path_nodes(node, handle.node)
        if len(slots) != handle.host_len or not all(n.loading for n in path):
            raise RuntimeError(f"{handle}: {len(slots)} slots for a held host path of "
                               f"{handle.host_len} tokens")
        pos = 0
        for n in path:
            assert n.host_value is not None
            num = len(n.host_value)
            n.value = np.array(slots[pos : pos + num], dtype=np.int32)
            n.lock_ref += 1  # the handle's lock now reaches it
            self._protected_size += num
            self._copies.load(n.host_value, n.value)
            pos += num
        self._refresh_leaf(handle.node)
        self.num_loaded_tokens += pos
        self._emit_path(EventKind.INSERTED, node, pos)
        handle.node, handle.host_node = node, None
        handle.cached_len += pos
        handle.host_len = 0

    def drain_copies(self) -> KVCopies:
        """The copies queued since the last drain; the nodes being loaded are free again."""
        return self._copies.drain()

    # ------------------------------------------------------------------------------ evict
    def _evict_leaf(self, leaf: TreeNode) -> SlotArray:
        """Device eviction (LRU, the radix cache's loop); a leaf with a host copy stays in the
        tree, host only."""
        if leaf.host_value is None and self.write_policy == "write_back":
            self.write_backup(leaf)
        slots = leaf.value
        self._emit_path(EventKind.EVICTED, leaf, len(slots))
        leaf.value = _EMPTY
        if leaf.host_value is None:
            self._drop(leaf)
        return slots

    def evict_host(self, num_tokens: int) -> int:
        """Drop least-recently-used host-only leaves until ``num_tokens`` host slots are free
        (or nothing more can go); returns the tokens dropped."""
        leaves = {node for node in self.iter_nodes() if host_evictable(node)}
        return evict_lru(leaves, num_tokens, self._drop, host_evictable)

    def _drop(self, node: TreeNode) -> int:
        """Take a node off the device already, and its host-only subtree, out of the tree;
        free their host slots. Returns the host tokens freed."""
        freed = 0
        for child in list(node.children.values()):
            freed += self._drop(child)
        if node.loading:
            raise RuntimeError(f"{node} is being loaded and cannot leave the tree")
        if node.host_value is not None:
            num = len(node.host_value)
            self._emit_path(EventKind.HOST_EVICTED, node, num)
            self.host_allocator.free_pages_of(node.host_value[:: self.page_size] // self.page_size)
            self._host_size -= num
            freed += num
            node.host_value = None
        detach(node, self._page_bytes)
        return freed

    # ----------------------------------------------------------------------- inspection
    def publish_snapshot(self) -> None:
        if self._event_sink is None:
            return
        self._emit(EventKind.CLEARED, None, _EMPTY, 0)
        for node in list(self.iter_nodes()):
            extra_key, path = self._path_of(node)
            if len(node.value) and self._is_leaf(node):
                self._emit(EventKind.INSERTED, extra_key, path, len(path))
            if node.host_value is not None:
                self._emit(EventKind.HOST_INSERTED, extra_key, path, len(node.host_value))

    def node_tokens(self, node: TreeNode) -> TokenArray:
        """The whole token path from the root down to the end of ``node``."""
        return self._path_of(node)[1]

    def loading_nodes(self) -> list[TreeNode]:
        return list(self._copies.loading)

    def check_integrity(self, locked_handles: Iterable[PrefixHandle] | None = None) -> None:
        super().check_integrity(locked_handles)
        check_host_tier(self)
