"""The paged slot allocator (the seeds' ``token_to_kv_pool_allocator``).

Slot ``s`` lives in page ``s // page_size``. Page 0 is reserved for padding: its slots are
never handed out, so a worker may point unused positions at slot 0. Usable pages are
``1 .. num_pages``, and the physical pool holds ``(num_pages + 1) * page_size`` slots.

A request owns whole pages. Its last page may be partly filled; its next tokens keep filling
that page (``alloc(n, last_slot=...)``) before a new page is taken. Free pages are handed out
in FIFO order.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .req_table import SlotArray

PageArray = npt.NDArray[np.int32]

_EMPTY = np.zeros(0, dtype=np.int32)


class PagedSlotAllocator:
    """Hands out slots a page at a time, and takes them back many at once."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.capacity = num_pages * page_size
        self.num_slots = (num_pages + 1) * page_size
        self._offsets = np.arange(page_size, dtype=np.int32)
        self._high_water = 0  # the highest page handed out since the pool was made
        self.clear()

    def clear(self) -> None:
        """Make every usable page free."""
        self._free_pages: PageArray = np.arange(1, self.num_pages + 1, dtype=np.int32)
        self._released: list[PageArray] = []
        self._num_free_pages = self.num_pages
        self._owned = np.zeros(self.num_pages + 1, dtype=bool)

    # ----------------------------------------------------------------------------- queries
    def available_size(self) -> int:
        """Free slots, counted in whole free pages."""
        return self._num_free_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        return self._num_free_pages

    @property
    def high_water_slot(self) -> int:
        """One past the last slot of the highest page handed out so far: no slot from here up
        has held K/V since the pool was made (the first time round, pages go out in order)."""
        return (self._high_water + 1) * self.page_size

    def is_page_allocated(self, page: int) -> bool:
        return 1 <= page <= self.num_pages and bool(self._owned[page])

    def free_pages(self) -> PageArray:
        """Every free page id (a copy), in hand-out order."""
        self._merge_released()
        return self._free_pages.copy()

    # ------------------------------------------------------------------------------ alloc
    def alloc(self, num_tokens: int, last_slot: int | None = None) -> SlotArray | None:
        """Slots for ``num_tokens`` new tokens, or None when the pool is short.

        With ``last_slot`` (the slot of the request's last token so far), the new tokens first
        fill the rest of that slot's page, then new pages. On None nothing changes.
        """
        if num_tokens < 0:
            raise ValueError(f"cannot allocate a negative number of tokens ({num_tokens})")
        if num_tokens > self.capacity:
            raise ValueError(
                f"allocation of {num_tokens} tokens exceeds the pool capacity of "
                f"{self.capacity} tokens"
            )
        if num_tokens == 0:
            return _EMPTY.copy()
        page_size = self.page_size
        head = _EMPTY
        if last_slot is not None and page_size > 1 and (last_slot + 1) % page_size != 0:
            self._check_slot_owned(last_slot, "last_slot")
            num_head = min(page_size - 1 - last_slot % page_size, num_tokens)
            head = np.arange(last_slot + 1, last_slot + 1 + num_head, dtype=np.int32)
        num_rest = num_tokens - len(head)
        num_new_pages = -(-num_rest // page_size)
        pages = self._take_pages(num_new_pages)
        if pages is None:
            return None
        if page_size == 1:
            rest = pages
        else:
            rest = (pages[:, None] * page_size + self._offsets).ravel()[:num_rest]
        return rest if len(head) == 0 else np.concatenate((head, rest))

    def alloc_decode(self, last_slots: npt.ArrayLike) -> SlotArray | None:
        """One slot for each request, given each request's last slot; None when short."""
        last = np.asarray(last_slots, dtype=np.int32)
        if last.ndim != 1:
            raise ValueError(f"last_slots must be one-dimensional, got shape {last.shape}")
        next_slots = last + 1
        needs_page = next_slots % self.page_size == 0
        num_new_pages = int(needs_page.sum())
        if num_new_pages < len(last):
            inside = last[~needs_page]
            self._check_slot_range(inside)
            if not self._owned[inside // self.page_size].all():
                raise RuntimeError("a last_slot given to alloc_decode is in a free page")
        pages = self._take_pages(num_new_pages)
        if pages is None:
            return None
        next_slots[needs_page] = pages * self.page_size
        return next_slots

    def _take_pages(self, num_pages: int) -> PageArray | None:
        if num_pages > self._num_free_pages:
            return None
        if num_pages > len(self._free_pages):
            self._merge_released()
        pages = self._free_pages[:num_pages]
        self._free_pages = self._free_pages[num_pages:]
        self._num_free_pages -= num_pages
        self._owned[pages] = True
        if num_pages:
            self._high_water = max(self._high_water, int(pages.max()))
        return pages

    def _merge_released(self) -> None:
        if self._released:
            self._free_pages = np.concatenate([self._free_pages, *self._released])
            self._released = []

    # ------------------------------------------------------------------------------- free
    def free(self, slots: npt.ArrayLike) -> None:
        """Free every page that holds one of ``slots``.

        A request's partly filled last page is freed whole. Freeing a page that is not
        allocated (a double free) or a slot outside the pool is an error, and then nothing
        changes.
        """
        values = np.asarray(slots)
        if values.size == 0:
            return
        if values.ndim != 1:
            raise ValueError(f"slots must be one-dimensional, got shape {values.shape}")
        self._check_slot_range(values)
        pages = values // self.page_size
        unique_pages = np.unique(pages)
        if self.page_size == 1 and len(unique_pages) < len(pages):
            raise RuntimeError("double free: the same slot is given more than once")
        self.free_pages_of(unique_pages.astype(np.int32, copy=False))

    def free_pages_of(self, pages: npt.NDArray[np.int32]) -> None:
        """Free distinct allocated pages by page id (the fast path for whole pages)."""
        if len(pages) == 0:
            return
        if pages.min() < 1 or pages.max() > self.num_pages:
            raise ValueError(f"page ids must be in [1, {self.num_pages}]")
        owned = self._owned[pages]
        if not owned.all():
            bad = pages[~owned][:8].tolist()
            raise RuntimeError(f"double free: page(s) {bad} are not allocated")
        self._owned[pages] = False
        self._released.append(pages.copy())
        self._num_free_pages += len(pages)

    # ---------------------------------------------------------------------------- checks
    def _check_slot_range(self, values: npt.NDArray[np.integer]) -> None:
        if not np.issubdtype(values.dtype, np.integer):
            raise ValueError(f"slots must be integers, got dtype {values.dtype}")
        low = self.page_size
        bad = values[(values < low) | (values >= self.num_slots)]
        if len(bad):
            raise ValueError(
                f"slot(s) {bad[:8].tolist()} are outside the usable range "
                f"[{low}, {self.num_slots}) (page 0 is reserved for padding)"
            )

    def _check_slot_owned(self, slot: int, what: str) -> None:
        if not self.page_size <= slot < self.num_slots:
            raise ValueError(
                f"{what} {slot} is outside the usable range [{self.page_size}, {self.num_slots})"
            )
        if not self._owned[slot // self.page_size]:
            raise RuntimeError(f"{what} {slot} is in page {slot // self.page_size}, which is free")
