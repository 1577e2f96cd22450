"""The no-prefix-cache mode: the prefix-cache contract with nothing ever kept.

Used when caching is turned off, and as the simplest implementation of the contract.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator

import numpy as np
import numpy.typing as npt

from .base import CachedPrefix, MatchResult, PrefixCache, PrefixHandle, SizeInfo, TokenArray
from .req_table import SlotArray
from .tree_node import as_token_array

_EMPTY = np.zeros(0, dtype=np.int32)


class NoPrefixCache(PrefixCache):
    """Matches nothing and stores nothing; the caller keeps (and frees) every slot."""

    def __init__(self, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size

    @property
    def enabled(self) -> bool:
        return False

    def match_prefix(self, token_ids: npt.ArrayLike, extra_key: Hashable = None) -> MatchResult:
        as_token_array(token_ids)
        return MatchResult(_EMPTY, PrefixHandle(0, None))

    def insert(
        self, token_ids: npt.ArrayLike, slots: npt.ArrayLike, extra_key: Hashable = None
    ) -> int:
        """Keeps nothing. Returns 0; the caller keeps ownership of every slot."""
        key = as_token_array(token_ids)
        if len(key) != np.asarray(slots).size:
            raise ValueError(
                f"key and value lengths differ: {len(key)} token ids, {np.asarray(slots).size} slots"
            )
        return 0

    def lock(self, handle: PrefixHandle) -> None:
        if handle.locked:
            raise RuntimeError(f"{handle} is already locked")
        handle.locked = True

    def unlock(self, handle: PrefixHandle) -> None:
        if not handle.locked:
            raise RuntimeError(f"cannot unlock {handle}: it is not locked")
        handle.locked = False

    def evict(self, num_tokens: int) -> SlotArray:
        if num_tokens < 0:
            raise ValueError(f"cannot evict a negative number of tokens ({num_tokens})")
        return _EMPTY.copy()

    def reset(self) -> None:
        return None

    def publish_snapshot(self) -> None:
        return None  # no events: nothing to resend

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(0, 0)

    def iter_prefixes(self) -> Iterator[CachedPrefix]:
        return iter(())

    def evictable_len(self, handle: PrefixHandle) -> int:
        return 0

    def tokens_of(self, handle: PrefixHandle) -> TokenArray:
        return _EMPTY.copy()

    def slots_of(self, handle: PrefixHandle) -> SlotArray:
        return _EMPTY.copy()

    def check_integrity(self, locked_handles: Iterable[PrefixHandle] | None = None) -> None:
        return None
