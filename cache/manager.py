"""The KV cache manager: owns the request→token table, the slot allocator and the prefix cache.

The slots of a running request's row, by position::

    0            cached_len             aligned_len         row_len
    |-- in the tree --|---- the request's own pages ----|--- tail ---|
      (locked handle)   after insert: [cached_len, present) duplicate the tree, freed;
                        [present, aligned_len) move into the tree

``cached_len`` is page-aligned, so the request's own slots start on a fresh page and fill whole
pages; only its last page may be partly filled. Every usable page is owned by exactly one of:
the free list, one tree node, or one running request (``check_integrity``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import numpy.typing as npt

from .allocator import PagedSlotAllocator
from .base import MatchResult, PrefixCache, PrefixHandle, SizeInfo
from .config import CacheConfig, build_prefix_cache
from .events import EventSink
from .hiradix import HiRadixCache
from .integrity import check_manager
from .kv_copies import KVCopies
from .req_table import ReqToTokenPool, SlotArray, TableDiff
from .running_row import RunningRow


class KVCacheManager:
    """Request-level KV bookkeeping: match, allocate (evicting on demand), cache and free."""

    def __init__(self, config: CacheConfig, event_sink: EventSink | None = None) -> None:
        self.config = config
        self.page_size = config.page_size
        self.req_to_token = ReqToTokenPool(config.max_running_requests, config.max_context_len)
        self.allocator = PagedSlotAllocator(config.num_pages, config.page_size)
        self.prefix_cache: PrefixCache = build_prefix_cache(config, event_sink)
        self.host_cache: HiRadixCache | None = (
            self.prefix_cache if isinstance(self.prefix_cache, HiRadixCache) else None)
        self._rows: dict[int, RunningRow] = {}
        self._pinned: dict[int, PrefixHandle] = {}

    # ----------------------------------------------------------------------------- sizes
    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def available_size(self) -> int:
        """Tokens that an allocation could get now: free plus evictable."""
        return self.allocator.available_size() + self.prefix_cache.size_info.evictable_size

    @property
    def size_info(self) -> SizeInfo:
        return self.prefix_cache.size_info

    def row_len(self, row: int) -> int:
        return self._row(row).row_len

    def cached_len(self, row: int) -> int:
        return self._row(row).handle.cached_len

    @property
    def num_running(self) -> int:
        return len(self._rows)

    # ----------------------------------------------------------------------- prefix cache
    def match_prefix(self, token_ids: npt.ArrayLike, extra_key: Hashable = None) -> MatchResult:
        return self.prefix_cache.match_prefix(token_ids, extra_key)

    def lock(self, handle: PrefixHandle) -> None:
        """Protect a matched prefix before a request row takes it (``alloc_req``)."""
        self.prefix_cache.lock(handle)
        self._pinned[id(handle)] = handle

    def unlock(self, handle: PrefixHandle) -> None:
        if id(handle) not in self._pinned:
            raise RuntimeError(f"cannot unlock {handle}: it is not locked by this manager")
        self.prefix_cache.unlock(handle)
        del self._pinned[id(handle)]

    def evict(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` (when that much is evictable); return the count."""
        slots = self.prefix_cache.evict(num_tokens)
        self.allocator.free_pages_of(slots[:: self.page_size] // self.page_size)
        return len(slots)

    # --------------------------------------------------------------------------- requests
    def alloc_req(self, match: MatchResult, extra_key: Hashable = None) -> int | None:
        """Give a request a row holding its matched prefix; None when no row is free.

        The handle is locked here unless ``lock`` already did; the row then owns that lock.
        A host-tier part of the match (``match.host_len``) is loaded back to new device slots
        here, when the device has room: the handle's ``cached_len`` then counts it.
        """
        row = self.req_to_token.alloc()
        if row is None:
            return None
        handle = match.handle
        if id(handle) in self._pinned:
            del self._pinned[id(handle)]
        else:
            self.prefix_cache.lock(handle)
        slots = match.slots
        if handle.host_len:
            slots = np.concatenate((slots, self._load_back(handle)))
        self.req_to_token.write(row, 0, slots)
        self._rows[row] = RunningRow(handle, extra_key, handle.cached_len)
        return row

    def alloc_slots(self, row: int, num_tokens: int) -> SlotArray | None:
        """Slots for the row's next ``num_tokens`` tokens (extend), written into the row.

        Evicts from the prefix cache when the free pool is short. Returns None, with the row
        unchanged, when even that is not enough.
        """
        state = self._row(row)
        end = state.row_len + num_tokens
        if num_tokens < 0:
            raise ValueError(f"cannot allocate a negative number of tokens ({num_tokens})")
        if end > self.config.max_context_len:
            raise ValueError(
                f"request row {row} would grow to {end} tokens, over max_context_len "
                f"{self.config.max_context_len}"
            )
        last_slot = self._last_slot(row, state)
        room = 0
        if last_slot is not None and (last_slot + 1) % self.page_size:
            room = self.page_size - 1 - last_slot % self.page_size
        num_pages = -(-max(num_tokens - room, 0) // self.page_size)
        self._make_room(num_pages)
        slots = self.allocator.alloc(num_tokens, last_slot)
        if slots is None:
            return None
        self.req_to_token.table[row, state.row_len : end] = slots
        state.row_len = end
        return slots

    def alloc_decode_slots(self, rows: Sequence[int]) -> SlotArray | None:
        """One slot each for a batch of decoding rows; None (nothing changed) when short."""
        states = [self._row(row) for row in rows]
        row_idx = np.asarray(rows, dtype=np.int64)
        row_lens = np.fromiter((s.row_len for s in states), dtype=np.int64, count=len(states))
        if len(states) and row_lens.min() < 1:
            raise ValueError("a decoding row must already hold at least one token")
        if len(states) and row_lens.max() >= self.config.max_context_len:
            raise ValueError(f"a decoding row is at max_context_len {self.config.max_context_len}")
        last_slots = self.req_to_token.table[row_idx, row_lens - 1]
        self._make_room(int(((last_slots + 1) % self.page_size == 0).sum()))
        slots = self.allocator.alloc_decode(last_slots)
        if slots is None:
            return None
        self.req_to_token.table[row_idx, row_lens] = slots
        for state in states:
            state.row_len += 1
        return slots

    def cache_unfinished_req(self, row: int, token_ids: npt.ArrayLike) -> int:
        """Insert the row's computed whole pages into the tree (chunked prefill).

        ``token_ids`` are the tokens whose K/V the row holds so far. Duplicates of what the
        tree already had are freed, the row is rewritten with the tree's slots, and the lock
        moves to the new last node. Returns the new cached length.
        """
        state = self._row(row)
        key = state.checked_key(row, token_ids, self.prefix_cache)
        if not self.prefix_cache.enabled:
            return state.handle.cached_len
        cached_len = state.handle.cached_len
        aligned_len = len(key) // self.page_size * self.page_size
        if aligned_len <= cached_len:
            return cached_len
        present = self._insert(row, state, key[:aligned_len])
        self._free_positions(row, cached_len, present)
        match = self.prefix_cache.match_prefix(key[:aligned_len], state.extra_key)
        # [cached_len, present) duplicated the tree: take the tree's slots there; the row's
        # own slots in [present, aligned_len) moved into the tree unchanged
        if present > cached_len:
            self.req_to_token.write(row, cached_len, match.slots[cached_len:present])
        self.prefix_cache.lock(match.handle)
        self.prefix_cache.unlock(state.handle)
        state.handle = match.handle
        return aligned_len

    def cache_finished_req(self, row: int, token_ids: npt.ArrayLike) -> None:
        """Insert the row's computed whole pages into the tree, then free everything else.

        ``token_ids`` are the tokens whose K/V was computed (may be fewer than the row holds,
        or none at all to just free the request).
        """
        state = self._row(row)
        key = state.checked_key(row, token_ids, self.prefix_cache)
        cached_len = state.handle.cached_len
        aligned_len = len(key) // self.page_size * self.page_size
        if self.prefix_cache.enabled and aligned_len > cached_len:
            present = self._insert(row, state, key[:aligned_len])
            self._free_positions(row, cached_len, present)
            self._free_positions(row, aligned_len, state.row_len)
        else:
            self._free_positions(row, cached_len, state.row_len)
        self.prefix_cache.unlock(state.handle)
        self.req_to_token.free(row)
        del self._rows[row]

    def free_req(self, row: int) -> None:
        """Free a request without caching anything it computed (abort)."""
        self.cache_finished_req(row, np.zeros(0, dtype=np.int32))

    def _load_back(self, handle: PrefixHandle) -> SlotArray:
        """Device slots for the locked handle's host-only part, its loads queued; none when
        the path is gone or the device has no room (the request computes those tokens)."""
        cache = self.host_cache
        slots = None
        if cache is not None and cache.hold_host_path(handle):
            self._make_room(handle.host_len // self.page_size)
            slots = self.allocator.alloc(handle.host_len)
        if cache is None or slots is None:
            handle.host_len, handle.host_node = 0, None
            return np.zeros(0, dtype=np.int32)
        cache.load_back(handle, slots)
        return slots

    @property
    def has_copies(self) -> bool:
        """Whether host-tier copies wait for the next step plan."""
        return self.host_cache is not None and self.host_cache.has_copies

    def drain_copies(self) -> KVCopies | None:
        """The host-tier copies queued since the last drain, for the next step plan (every
        rank makes them before that step's forward); None without a host tier."""
        return self.host_cache.drain_copies() if self.host_cache is not None else None

    @property
    def has_table_diff(self) -> bool:
        """Whether ``drain_table_diff`` has anything to hand out."""
        return self.req_to_token.has_diff

    def drain_table_diff(self) -> TableDiff:
        """The table's changes since the last drain that a rank's copy needs: freed rows, and
        the writes that no step's new tokens carry (a cached prefix given to a row, a row
        rewritten with the tree's slots). Slots from ``alloc_slots`` / ``alloc_decode_slots``
        are not in it: they travel with the step that computes those tokens."""
        return self.req_to_token.drain_diff()

    def publish_snapshot(self) -> None:
        """Send the prefix cache's whole content as events again (see `PrefixCache`)."""
        self.prefix_cache.publish_snapshot()

    def reset(self) -> None:
        """Drop every request row and every cached prefix; the whole pool is free again."""
        self._rows.clear()
        self._pinned.clear()
        self.req_to_token.clear()
        self.allocator.clear()
        self.prefix_cache.reset()

    # ---------------------------------------------------------------------------- helpers
    def _row(self, row: int) -> RunningRow:
        state = self._rows.get(row)
        if state is None:
            raise RuntimeError(f"request row {row} is not held by a running request")
        return state

    def _last_slot(self, row: int, state: RunningRow) -> int | None:
        if state.row_len == 0:
            return None
        return int(self.req_to_token.table[row, state.row_len - 1])

    def _make_room(self, num_pages: int) -> None:
        short = num_pages * self.page_size - self.allocator.available_size()
        if short > 0:
            self.evict(short)

    def _insert(self, row: int, state: RunningRow, key: npt.NDArray[np.int32]) -> int:
        slots = self.req_to_token.table[row, : len(key)]
        return self.prefix_cache.insert(key, slots, state.extra_key)

    def _free_positions(self, row: int, start: int, end: int) -> None:
        """Free the request's own pages at row positions ``[start, end)`` (page-aligned start)."""
        if end > start:
            page_starts = self.req_to_token.table[row, start : end : self.page_size]
            self.allocator.free_pages_of(page_starts // self.page_size)

    # -------------------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """free + evictable + protected + held by running requests == capacity, and every
        usable page is owned exactly once. Raises ``RuntimeError`` naming what is wrong."""
        check_manager(self, self._rows.items(), list(self._pinned.values()))
