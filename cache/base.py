"""The prefix-cache contract shared by the radix cache and the no-cache mode."""

from __future__ import annotations

import abc
from collections.abc import Hashable, Iterable, Iterator
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from .req_table import SlotArray

TokenArray = npt.NDArray[np.int32]


class PrefixHandle:
    """What ``match_prefix`` returns besides the slots: the cached length and the last node.

    The slots returned with a handle are only safe to use while the handle is locked: an
    unlocked prefix may be evicted at the next allocation. A handle is locked at most once.

    With a host tier (``HiRadixCache``), ``host_len`` more tokens beyond ``cached_len`` are
    cached in host memory only, up to ``host_node``; the cache manager loads them back when a
    request row takes the handle, and ``cached_len`` then counts them too.
    """

    __slots__ = ("cached_len", "host_len", "host_node", "locked", "node")

    def __init__(self, cached_len: int, node: object, host_len: int = 0,
                 host_node: object = None) -> None:
        self.cached_len = cached_len
        self.node = node
        self.host_len = host_len
        self.host_node = host_node
        self.locked = False

    def __repr__(self) -> str:
        return f"PrefixHandle(cached_len={self.cached_len}, locked={self.locked})"


class MatchResult(NamedTuple):
    slots: SlotArray
    handle: PrefixHandle

    @property
    def cached_len(self) -> int:
        return self.handle.cached_len

    @property
    def host_len(self) -> int:
        """Tokens beyond ``cached_len`` cached in the host tier only (0 without one)."""
        return self.handle.host_len


class SizeInfo(NamedTuple):
    evictable_size: int
    protected_size: int

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size


class CachedPrefix(NamedTuple):
    """One stored run of tokens: the path above it, its own tokens and their slots."""

    extra_key: Hashable
    prefix_ids: TokenArray
    token_ids: TokenArray
    slots: SlotArray


class PrefixCache(abc.ABC):
    """Maps token-id prefixes to the slots holding their K/V, in whole pages.

    ``extra_key`` separates namespaces (for example a LoRA adapter or a multimodal salt):
    prefixes under different keys are never shared.
    """

    page_size: int

    @property
    @abc.abstractmethod
    def enabled(self) -> bool:
        """False for the no-cache mode, which keeps nothing."""

    @abc.abstractmethod
    def match_prefix(self, token_ids: npt.ArrayLike, extra_key: Hashable = None) -> MatchResult:
        """The longest cached page-aligned prefix of ``token_ids`` and its slots.

        Updates access times. The slots are only safe to use once the handle is locked.
        """

    @abc.abstractmethod
    def insert(
        self, token_ids: npt.ArrayLike, slots: npt.ArrayLike, extra_key: Hashable = None
    ) -> int:
        """Store a page-aligned key with its slots; return the length already present.

        The cache takes ownership of ``slots[returned:]``. The caller still owns
        ``slots[:returned]``, which duplicate what was cached, and should free them.
        """

    @abc.abstractmethod
    def lock(self, handle: PrefixHandle) -> None:
        """Protect the handle's path up to the root from eviction."""

    @abc.abstractmethod
    def unlock(self, handle: PrefixHandle) -> None:
        """Undo ``lock``. Unlocking a handle that is not locked is an error."""

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> SlotArray:
        """Evict least-recently-used unlocked leaves until ``num_tokens`` are freed.

        Returns the evicted slots, which the caller frees. It may evict more than asked (whole
        leaves), and less when not enough is evictable. ``evict(0)`` does nothing.
        """

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop everything. Slots held by the cache are forgotten, not freed."""

    @property
    @abc.abstractmethod
    def size_info(self) -> SizeInfo:
        """Evictable and protected token counts."""

    @abc.abstractmethod
    def publish_snapshot(self) -> None:
        """Send the whole content again as events: ``CLEARED``, then one ``INSERTED`` per
        leaf path. For a reader of the events that lost track (it restarted, or some were
        lost); a cache without events does nothing."""

    @abc.abstractmethod
    def iter_prefixes(self) -> Iterator[CachedPrefix]:
        """Every stored run of tokens (for integrity checks and tests)."""

    @abc.abstractmethod
    def evictable_len(self, handle: PrefixHandle) -> int:
        """Tokens on the handle's path that are evictable now (what locking it protects)."""

    @abc.abstractmethod
    def tokens_of(self, handle: PrefixHandle) -> TokenArray:
        """The token ids of the handle's whole path, without touching access times."""

    @abc.abstractmethod
    def slots_of(self, handle: PrefixHandle) -> SlotArray:
        """The slots of the handle's whole path (what ``match_prefix`` returned with it)."""

    @abc.abstractmethod
    def check_integrity(self, locked_handles: Iterable[PrefixHandle] | None = None) -> None:
        """Raise ``RuntimeError`` if the structure's own invariants do not hold.

        With ``locked_handles``, every lock count must come from exactly those handles.
        """
