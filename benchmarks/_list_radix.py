"""Baseline for radix_bench.py: the seeds' radix tree, written plainly.

Keys are Python lists compared token by token, children are keyed by the first token (or the
first page as a tuple), and eviction collects every leaf into a heap, as in the seed
walkthroughs. It serves only as the same-run baseline of the benchmark.
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("children", "key", "last_access", "lock_ref", "parent", "value")

    def __init__(self, key: list[int], value: list[int], parent: _Node | None, tick: int) -> None:
        self.key, self.value, self.parent = key, value, parent
        self.children: dict[object, _Node] = {}
        self.lock_ref = 0
        self.last_access = tick


class ListRadixCache:
    def __init__(self, page_size: int = 1) -> None:
        self.page_size = page_size
        self.root = _Node([], [], None, 0)
        self.tick = itertools.count(1)

    def _child_key(self, key: list[int]) -> object:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n // self.page_size * self.page_size

    def _split(self, child: _Node, n: int) -> _Node:
        upper = _Node(child.key[:n], child.value[:n], child.parent, child.last_access)
        upper.lock_ref = child.lock_ref
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._child_key(child.key)] = child
        assert upper.parent is not None
        upper.parent.children[self._child_key(upper.key)] = upper
        return upper

    def _walk(self, key: list[int]) -> tuple[_Node, int, list[list[int]]]:
        key = key[: len(key) // self.page_size * self.page_size]
        tick = next(self.tick)
        node, pos, values = self.root, 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(key[pos:]))
            if child is None:
                break
            child.last_access = tick
            n = self._match_len(child.key, key[pos:])
            if n < len(child.key):
                node = self._split(child, n)
                values.append(node.value)
                pos += n
                break
            values.append(child.value)
            node, pos = child, pos + n
        return node, pos, values

    def match_prefix(self, key: list[int]) -> list[int]:
        _, _, values = self._walk(key)
        return [slot for value in values for slot in value]

    def insert(self, key: list[int], value: list[int]) -> int:
        node, pos, _ = self._walk(key)
        if pos < len(key):
            leaf = _Node(key[pos:], value[pos:], node, next(self.tick))
            node.children[self._child_key(leaf.key)] = leaf
        return pos

    def evict(self, num_tokens: int) -> int:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                leaves.append((node.last_access, id(node), node))
            stack.extend(node.children.values())
        heapq.heapify(leaves)
        evicted = 0
        while evicted < num_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            if leaf.lock_ref:
                continue
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.key)]
            evicted += len(leaf.value)
            if not parent.children and parent is not self.root:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return evicted
