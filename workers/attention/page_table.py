"""FlashInfer's paged-KV page table (indptr, indices, last_page_len), kept in device buffers
and updated from what changed since the last step.

Request i of a step owns pages `indices[indptr[i]:indptr[i + 1]]`, and its last page holds
`last[i]` tokens (1..page_size). Page ids are read from the request->token table at positions
0, page_size, 2 * page_size, ... (the paged allocator puts position p of a request in slot
`page(p) * page_size + p % page_size`). Padding requests (CUDA-graph batches padded to a
captured size) follow the real ones: one token each, on page 0.

Between two steps of the same requests (same rows in the same order, each row untouched by the
plan's table writes and frees since: `row_versions`), a request's pages only grow at its end:
its earlier pages keep their ids, since the table entries of positions it already holds are
written once. So an update writes the last-page lengths of every request and, only where a
request crossed into a new page, the shifted tail of `indices` and the new page ids:

    before  | r0: a b | r1: c     | r2: d e | pad: 0 |
    r1 grew | r0: a b | r1: c NEW | r2: d e | pad: 0 |   (r2 and the padding move right by one)

Anything else (a request joining or leaving, another order, a row rewritten, a length that
shrank, other padding) rebuilds the whole table. Both paths keep host work per request, never
per page: the page ids are gathered on the device from the request->token table. The device
may be a CPU (the tests) or a GPU.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import torch

from ..req_table import to_device


class PageTableView(NamedTuple):
    """This step's table. `indptr` and `last` are host int32 tensors (flashinfer's `plan`
    reads them there); `indices` is a device int32 view of the first `indptr[-1]` entries."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last: torch.Tensor


def num_pages_of(seq_lens: np.ndarray, page_size: int) -> np.ndarray:
    return (seq_lens.astype(np.int64) + page_size - 1) // page_size


def page_table_from_scratch(req_to_token: torch.Tensor, row_idx: np.ndarray,
                            seq_lens: np.ndarray, page_size: int,
                            num_padding: int = 0) -> PageTableView:
    """The table built from nothing, page by page on the host: the reference the kept table is
    tested against."""
    num_pages = num_pages_of(seq_lens, page_size)
    starts = np.cumsum(num_pages) - num_pages
    owner = np.repeat(np.arange(len(row_idx)), num_pages)
    cols = (np.arange(int(num_pages.sum())) - np.repeat(starts, num_pages)) * page_size
    table = req_to_token.cpu()
    indices = (table[torch.from_numpy(row_idx[owner].astype(np.int64)),
                     torch.from_numpy(cols)] // page_size).int()
    last = seq_lens - (num_pages - 1) * page_size
    indices = torch.cat([indices, torch.zeros(num_padding, dtype=torch.int32)])
    num_pages = np.concatenate([num_pages, np.ones(num_padding, np.int64)])
    last = np.concatenate([last, np.ones(num_padding, np.int64)])
    indptr = np.concatenate([[0], np.cumsum(num_pages)]).astype(np.int32)
    return PageTableView(torch.from_numpy(indptr), indices, torch.from_numpy(last.astype(np.int32)))


class PageTable:
    """The page table of the last step, in `indptr` / `indices` / `last` buffers on the
    request->token table's device (CUDA graphs read them in place)."""

    def __init__(self, req_to_token: torch.Tensor, page_size: int, max_batch: int,
                 max_pages: int, growable: bool = False) -> None:
        self.req_to_token = req_to_token
        self.device = req_to_token.device
        self.page_size = page_size
        self.growable = growable  # a full buffer is reallocated (larger) instead of refused
        self.indptr = torch.zeros(max_batch + 1, dtype=torch.int32, device=self.device)
        self.last = torch.ones(max_batch, dtype=torch.int32, device=self.device)
        self.indices = torch.zeros(max_pages, dtype=torch.int32, device=self.device)
        self.num_rebuilds = 0  # whole tables built (the rest were updates)
        self._rows: np.ndarray | None = None  # the last step's requests; None: nothing kept
        self._versions = np.zeros(0, np.int64)
        self._num_pages = np.zeros(0, np.int64)  # per real request
        self._num_padding = 0
        self._indptr_host = np.zeros(1, np.int64)  # real and padding requests

    def invalidate(self) -> None:
        """Forget the kept table (someone else wrote the buffers): the next update rebuilds."""
        self._rows = None

    def update(self, row_idx: np.ndarray, seq_lens: np.ndarray, num_padding: int = 0,
               row_versions: np.ndarray | None = None) -> PageTableView:
        """The table of these requests (plus `num_padding` one-token padding requests), written
        into the buffers. `row_versions[i]` counts the rewrites of request i's table row; without
        them nothing is known to be unchanged and the table is rebuilt."""
        seq_lens = seq_lens.astype(np.int64)
        if len(seq_lens) and int(seq_lens.min()) < 1:
            raise ValueError("every request of a page table needs at least one token")
        num_pages = num_pages_of(seq_lens, self.page_size)
        batch = len(row_idx) + num_padding
        if batch > len(self.last):
            raise ValueError(f"a page table of {batch} requests overflows its {len(self.last)}")
        versions = None if row_versions is None else row_versions.astype(np.int64)
        last = np.concatenate([seq_lens - (num_pages - 1) * self.page_size,
                               np.ones(num_padding, np.int64)])
        if self._can_update(row_idx, versions, num_pages, num_padding):
            self._update(num_pages, last)
        else:
            self._rebuild(row_idx.astype(np.int64), num_pages, num_padding, last)
            self._rows = None if versions is None else row_idx.astype(np.int64).copy()
            self._versions = versions.copy() if versions is not None else self._versions
            self._num_padding = num_padding
        self._num_pages = num_pages
        return PageTableView(torch.from_numpy(self._indptr_host.astype(np.int32)),
                             self.indices[: int(self._indptr_host[-1])],
                             torch.from_numpy(last.astype(np.int32)))

    # ---- the two paths -------------------------------------------------------------------

    def _can_update(self, row_idx: np.ndarray, versions: np.ndarray | None,
                    num_pages: np.ndarray, num_padding: int) -> bool:
        rows = self._rows
        return (rows is not None and versions is not None and len(rows) == len(row_idx)
                and num_padding == self._num_padding and bool(np.array_equal(rows, row_idx))
                and bool(np.array_equal(versions, self._versions))
                and bool((num_pages >= self._num_pages).all()))

    def _update(self, num_pages: np.ndarray, last: np.ndarray) -> None:
        n = len(num_pages)
        grown = num_pages - self._num_pages
        growers = np.flatnonzero(grown)
        if not len(growers):  # only the last pages filled further
            self.last[:n].copy_(to_device(last[:n].astype(np.int32), self.device))
            return
        old_indptr = self._indptr_host
        new_indptr = old_indptr.copy()
        new_indptr[1: n + 1] += np.cumsum(grown)
        new_indptr[n + 1:] += new_indptr[n] - old_indptr[n]
        self._reserve(int(new_indptr[-1]))
        # the new pages, read from the request->token table (a decode adds at most one each)
        if int(grown[growers].max()) == 1:
            owner = growers
            page_no = self._num_pages[growers]
        else:
            num_new = grown[growers]
            owner = np.repeat(growers, num_new)
            page_no = self._num_pages[owner] + np.arange(len(owner)) - np.repeat(
                np.cumsum(num_new) - num_new, num_new)
        arrays = [self._rows[owner], page_no * self.page_size,  # type: ignore[index]
                  new_indptr[owner] + page_no, new_indptr, last[:n]]
        # the requests after the first that grew move right by the pages grown before them
        start, end = int(old_indptr[growers[0] + 1]), int(old_indptr[-1])
        if end > start:
            arrays += [(new_indptr - old_indptr)[growers[0] + 1: -1],
                       np.diff(old_indptr[growers[0] + 1:])]
        rows_d, cols_d, dest_d, indptr_d, last_d, *move = self._upload(*arrays)
        if move:
            dest = torch.arange(start, end, device=self.device) + torch.repeat_interleave(
                move[0], move[1], output_size=end - start)
            self.indices.index_copy_(0, dest, self.indices[start:end].clone())
        self._write_pages(rows_d, cols_d, dest_d)
        self.indptr[: len(new_indptr)].copy_(indptr_d)
        self.last[:n].copy_(last_d)
        self._indptr_host = new_indptr

    def _rebuild(self, row_idx: np.ndarray, num_pages: np.ndarray, num_padding: int,
                 last: np.ndarray) -> None:
        self.num_rebuilds += 1
        n = len(num_pages)
        all_pages = np.concatenate([num_pages, np.ones(num_padding, np.int64)])
        indptr = np.concatenate([[0], np.cumsum(all_pages)]).astype(np.int64)
        num_real, total = int(indptr[n]), int(indptr[-1])
        self._reserve(total)
        pages_d, starts_d, rows_d, indptr_d, last_d = self._upload(
            num_pages, indptr[:n], row_idx, indptr, last)
        if num_real:
            owner = torch.repeat_interleave(torch.arange(n, device=self.device), pages_d,
                                            output_size=num_real)
            page_no = torch.arange(num_real, device=self.device) - starts_d[owner]
            self._write_pages(rows_d[owner], page_no * self.page_size,
                              torch.arange(num_real, device=self.device))
        if total > num_real:
            self.indices[num_real:total] = 0
        self.indptr[: len(indptr)].copy_(indptr_d)
        self.last[: len(last)].copy_(last_d)
        self._indptr_host = indptr

    def _write_pages(self, rows: torch.Tensor, cols: torch.Tensor, dest: torch.Tensor) -> None:
        """indices[dest] = the pages of table entries (rows, cols)."""
        slots = self.req_to_token[rows, cols]
        if self.page_size > 1:
            slots = torch.div(slots, self.page_size, rounding_mode="floor")
        self.indices[dest] = slots.to(torch.int32)

    def _reserve(self, num_entries: int) -> None:
        if num_entries <= len(self.indices):
            return
        if not self.growable:
            raise ValueError(f"a page table of {num_entries} pages overflows its "
                             f"{len(self.indices)}-entry buffer")
        old = self.indices
        self.indices = torch.zeros(max(num_entries, 2 * len(old)), dtype=torch.int32,
                                   device=self.device)
        self.indices[: len(old)] = old

    def _upload(self, *arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
        """The host arrays on the device (int64), in one copy."""
        flat = to_device(np.concatenate(arrays).astype(np.int64, copy=False), self.device)
        bounds = np.cumsum([0] + [len(a) for a in arrays]).tolist()
        return tuple(flat[a:b] for a, b in itertools.pairwise(bounds))
