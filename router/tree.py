"""The router's global radix tree: which replica holds which token prefix.

One tree over token ids serves every replica, with the replicas' page size: edges are whole
pages, so the tree splits exactly where the replicas' caches can. Each node records the replicas that hold its whole
run of tokens. A replica's holdings are prefix-closed (a cache holds a path only with all of its
ancestors), so the replica set of a child is always a subset of its parent's. Nodes that no
replica holds are removed.

In exact mode the tree is fed the replicas' own cache events (``apply_event``): an insert marks
the whole path, an eviction unmarks the evicted end of the path. In approximate mode the router
feeds it its own routing decisions (``insert``) and keeps it under ``max_tokens`` with LRU
eviction of leaves (``evict_lru``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator

import numpy as np
import numpy.typing as npt

from raydix.cache import CacheEvent, EventKind
from raydix.cache.tree_node import common_page_bytes

ReplicaId = Hashable
TokenArray = npt.NDArray[np.int32]
_ITEM = 4  # bytes per int32 token id


class _Node:
    __slots__ = ("children", "id", "key", "last_access", "parent", "replicas")

    def __init__(self, key: bytes, parent: _Node | None, tick: int, node_id: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[bytes, _Node] = {}
        self.replicas: set[ReplicaId] = set()
        self.last_access = tick
        self.id = node_id


class GlobalPrefixTree:
    def __init__(self, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._page_bytes = page_size * _ITEM
        self._ids = itertools.count()
        self._tick = 0
        self._roots: dict[Hashable, _Node] = {}
        self._num_tokens = 0  # tokens stored in nodes (each counted once)
        self._held: dict[ReplicaId, int] = {}  # tokens each replica holds

    def held_tokens(self, replica: ReplicaId) -> int:
        """How many tokens ``replica`` holds (its cache's footprint, as the tree knows it)."""
        return self._held.get(replica, 0)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    # ------------------------------------------------------------------------------ match
    def match(self, token_ids: npt.ArrayLike, extra_key: Hashable = None) -> dict[ReplicaId, int]:
        """For each replica holding any prefix of ``token_ids``, the length it holds."""
        root = self._roots.get(extra_key)
        if root is None:
            return {}
        key = np.asarray(token_ids, dtype=np.int32)
        data = key[: len(key) // self.page_size * self.page_size].tobytes()
        page = self._page_bytes
        self._tick += 1
        matched: dict[ReplicaId, int] = {}
        node, pos = root, 0
        while pos < len(data):
            child = node.children.get(data[pos : pos + page])
            if child is None:
                break
            child.last_access = self._tick
            if data.startswith(child.key, pos):
                pos += len(child.key)
                for replica in child.replicas:
                    matched[replica] = pos // _ITEM
                node = child
                continue
            num = common_page_bytes(child.key, data, pos, len(data), page)
            for replica in child.replicas:
                matched[replica] = (pos + num) // _ITEM
            break
        return matched

    # ----------------------------------------------------------------------------- update
    def apply_event(self, replica: ReplicaId, event: CacheEvent) -> None:
        """Mirror one cache event of ``replica`` (events must come in ``seq`` order)."""
        if event.kind is EventKind.INSERTED:
            self.insert(replica, event.token_ids, event.extra_key)
        elif event.kind is EventKind.EVICTED:
            self.remove(replica, event.token_ids, event.prefix_len, event.extra_key)
        elif event.kind is EventKind.CLEARED:
            self.drop_replica(replica)
        # the host tier's events (HOST_*) say nothing about the device tier this tree follows

    def insert(
        self, replica: ReplicaId, token_ids: npt.ArrayLike, extra_key: Hashable = None
    ) -> None:
        """``replica`` holds every prefix of ``token_ids``."""
        data = self._aligned(token_ids)
        page = self._page_bytes
        self._tick += 1
        node = self._roots.get(extra_key)
        if node is None:
            node = self._roots[extra_key] = _Node(b"", None, self._tick, next(self._ids))
        pos = 0
        while pos < len(data):
            child = node.children.get(data[pos : pos + page])
            if child is None:
                child = _Node(data[pos:], node, self._tick, next(self._ids))
                node.children[data[pos : pos + page]] = child
                self._num_tokens += (len(data) - pos) // _ITEM
            elif not data.startswith(child.key, pos):
                child = self._split(child, common_page_bytes(child.key, data, pos, len(data), page))
            if replica not in child.replicas:
                child.replicas.add(replica)
                self._held[replica] = self._held.get(replica, 0) + len(child.key) // _ITEM
            child.last_access = self._tick
            pos += len(child.key)
            node = child

    def remove(
        self,
        replica: ReplicaId,
        token_ids: npt.ArrayLike,
        keep_len: int,
        extra_key: Hashable = None,
    ) -> None:
        """``replica`` no longer holds ``token_ids`` past its first ``keep_len`` tokens."""
        data = self._aligned(token_ids)
        if keep_len % self.page_size:
            raise ValueError(
                f"kept length {keep_len} is not a multiple of page_size {self.page_size}"
            )
        node = self._roots.get(extra_key)
        keep = keep_len * _ITEM
        pos = 0
        while node is not None and pos < len(data):
            child = node.children.get(data[pos : pos + self._page_bytes])
            if child is None or not data.startswith(child.key[: len(data) - pos], pos):
                return  # not held: nothing to remove
            if pos < keep < pos + len(child.key):
                child = self._split(child, keep - pos)
            if pos >= keep:
                self._unmark_subtree(child, replica)
                return
            pos += len(child.key)
            node = child

    def drop_replica(self, replica: ReplicaId) -> None:
        """Forget everything ``replica`` held (it left, restarted or cleared its cache)."""
        for root in list(self._roots.values()):
            for child in list(root.children.values()):
                self._unmark_subtree(child, replica)

    def evict_lru(self, max_tokens: int) -> int:
        """Approximate mode: drop least recently used leaves until ``max_tokens`` remain."""
        if self._num_tokens <= max_tokens:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._nodes() if not n.children]
        heapq.heapify(heap)
        freed = 0
        while self._num_tokens > max_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            freed += self._delete(leaf)
            if not parent.children and parent.parent is not None:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    # ---------------------------------------------------------------------------- helpers
    def _aligned(self, token_ids: npt.ArrayLike) -> bytes:
        key = np.asarray(token_ids, dtype=np.int32)
        if len(key) % self.page_size:
            raise ValueError(
                f"a path of {len(key)} tokens is not a multiple of the router's page_size "
                f"{self.page_size}: the replica and the router disagree on the page size"
            )
        return key.tobytes()

    def _split(self, child: _Node, cut: int) -> _Node:
        parent = child.parent
        assert parent is not None
        upper = _Node(child.key[:cut], parent, child.last_access, next(self._ids))
        upper.replicas = set(child.replicas)
        child.key = child.key[cut:]
        child.parent = upper
        upper.children[child.key[: self._page_bytes]] = child
        parent.children[upper.key[: self._page_bytes]] = upper
        return upper

    def _unmark_subtree(self, node: _Node, replica: ReplicaId) -> None:
        """Take ``replica`` off ``node`` and everything below it; drop nodes nobody holds."""
        order: list[_Node] = []
        stack = [node]
        while stack:
            cur = stack.pop()
            if replica in cur.replicas:
                cur.replicas.discard(replica)
                self._held[replica] -= len(cur.key) // _ITEM
                order.append(cur)
                stack.extend(cur.children.values())
        for cur in reversed(order):  # children before parents
            if not cur.replicas and not cur.children:
                self._delete(cur)

    def _delete(self, node: _Node) -> int:
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.key[: self._page_bytes]]
        node.parent = None
        num = len(node.key) // _ITEM
        self._num_tokens -= num
        for replica in node.replicas:  # approximate mode's LRU drops held nodes
            self._held[replica] -= num
        return num

    def _nodes(self) -> Iterator[_Node]:
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def holdings(self, replica: ReplicaId) -> set[tuple[Hashable, tuple[int, ...]]]:
        """Every (namespace, path) whose last node ``replica`` holds — for tests and audits."""
        out = set()
        for extra_key, root in self._roots.items():
            stack = [(c, b"") for c in root.children.values()]
            while stack:
                node, above = stack.pop()
                path = above + node.key
                if replica in node.replicas:
                    ids = np.frombuffer(path, dtype=np.int32)
                    for end in range(len(above) // _ITEM + 1, len(ids) + 1):
                        out.add((extra_key, tuple(ids[:end].tolist())))
                stack.extend((c, path) for c in node.children.values())
        return out

    def check_integrity(self) -> None:
        total = 0
        held: dict[ReplicaId, int] = {}
        for node in self._nodes():
            for replica in node.replicas:
                held[replica] = held.get(replica, 0) + len(node.key) // _ITEM
            parent = node.parent
            if parent is None or parent.children.get(node.key[: self._page_bytes]) is not node:
                raise RuntimeError("a node is not linked under its first page")
            if len(node.key) % self._page_bytes:
                raise RuntimeError("a node is not a whole number of pages")
            if parent.parent is not None and not node.replicas <= parent.replicas:
                raise RuntimeError("a child is held by a replica that lacks its parent")
            if not node.replicas and not node.children:
                raise RuntimeError("a leaf that no replica holds was kept")
            total += len(node.key) // _ITEM
        if total != self._num_tokens:
            raise RuntimeError(f"token count {self._num_tokens} differs from the nodes ({total})")
        if {r: n for r, n in self._held.items() if n} != held:
            raise RuntimeError("the per-replica token counts differ from the nodes")
