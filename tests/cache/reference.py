"""A plain reference model of a page-aligned prefix cache, for differential tests.

It keeps one entry per cached page, keyed by the whole token path up to the end of that page:
no tree, no splitting, no heap. Access times, lock counts and leaves are tracked per page.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RefPage:
    slots: tuple[int, ...]
    last_access: int
    locks: int = 0
    num_children: int = 0


@dataclass
class RefHandle:
    path: tuple[int, ...]
    valid: bool = True
    locked: bool = False


@dataclass
class ReferencePrefixCache:
    page_size: int
    pages: dict[tuple[int, ...], RefPage] = field(default_factory=dict)
    tick: int = 0
    handles: list[RefHandle] = field(default_factory=list)

    def _page_paths(self, key: list[int]) -> list[tuple[int, ...]]:
        n = len(key) // self.page_size * self.page_size
        return [tuple(key[:end]) for end in range(self.page_size, n + 1, self.page_size)]

    def match(self, key: list[int]) -> tuple[list[int], RefHandle]:
        self.tick += 1
        slots: list[int] = []
        path: tuple[int, ...] = ()
        for page_path in self._page_paths(key):
            page = self.pages.get(page_path)
            if page is None:
                break
            page.last_access = self.tick
            slots.extend(page.slots)
            path = page_path
        handle = RefHandle(path)
        self.handles.append(handle)
        return slots, handle

    def insert(self, key: list[int], slots: list[int]) -> int:
        self.tick += 1
        present = 0
        parent: tuple[int, ...] | None = None
        for i, page_path in enumerate(self._page_paths(key)):
            page = self.pages.get(page_path)
            if page is None:
                lo = i * self.page_size
                self.pages[page_path] = RefPage(tuple(slots[lo : lo + self.page_size]), self.tick)
                if parent is not None:
                    self.pages[parent].num_children += 1
            else:
                page.last_access = self.tick
                if present == i * self.page_size:
                    present += self.page_size
            parent = page_path
        return present

    def lock(self, handle: RefHandle, delta: int) -> None:
        for page_path in self._page_paths(list(handle.path)):
            self.pages[page_path].locks += delta
        handle.locked = delta > 0

    def evictable_leaves(self) -> list[tuple[int, ...]]:
        return [p for p, page in self.pages.items() if page.num_children == 0 and page.locks == 0]

    def remove_run(self, path: tuple[int, ...], num_tokens: int) -> list[int]:
        """Remove the last ``num_tokens`` of ``path`` (deepest page first); return their slots."""
        removed: list[int] = []
        for end in range(len(path), len(path) - num_tokens, -self.page_size):
            page_path = path[:end]
            page = self.pages.pop(page_path)
            assert page.num_children == 0 and page.locks == 0, page_path
            removed[:0] = page.slots
            parent = page_path[: -self.page_size]
            if parent:
                self.pages[parent].num_children -= 1
        for handle in self.handles:
            num = len(handle.path)
            if len(path) - num_tokens < num <= len(path) and path[:num] == handle.path:
                handle.valid = False
        return removed

    @property
    def evictable_size(self) -> int:
        return sum(self.page_size for page in self.pages.values() if page.locks == 0)

    @property
    def protected_size(self) -> int:
        return sum(self.page_size for page in self.pages.values() if page.locks > 0)

    def contents(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        return {path: page.slots for path, page in self.pages.items()}
