"""The request→token table (the seeds' ``req_to_token_pool``).

A fixed ``[max_running_requests, max_context_len]`` table of slot ids. Row ``r`` holds, at
position ``i``, the slot where token ``i`` of the request on row ``r`` keeps its K/V.

This is the one table of the replica: each rank keeps a copy that follows it from diffs. The
pool records what a rank cannot learn from a step's own new tokens (their slots travel with
the step as ``out_cache_loc``): ``write`` (a cached prefix given to a row, a row rewritten with
the tree's slots) and ``free``. ``drain_diff`` hands out what changed since the last drain, in
the order a rank applies it: freed rows first, then the writes. A row taken and given back
between two drains was never seen by a rank, so it leaves no trace in the diff.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

SlotArray = npt.NDArray[np.int32]


class RowWrite(NamedTuple):
    """Slots written into request row ``row_idx`` at positions ``start ..``."""

    row_idx: int
    start: int
    slot_ids: SlotArray


class TableDiff(NamedTuple):
    """What changed in the table since the last drain: rows to reset, then writes."""

    freed_rows: list[int]
    writes: list[RowWrite]


class ReqToTokenPool:
    """Allocates request rows and writes slot ids into them."""

    def __init__(self, max_running_requests: int, max_context_len: int) -> None:
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        if max_context_len < 1:
            raise ValueError(f"max_context_len must be >= 1, got {max_context_len}")
        self.max_running_requests = max_running_requests
        self.max_context_len = max_context_len
        self.table: SlotArray = np.zeros((max_running_requests, max_context_len), dtype=np.int32)
        self._free_rows: deque[int] = deque(range(max_running_requests))
        self._allocated = np.zeros(max_running_requests, dtype=bool)
        self._freed_now: list[int] = []
        self._writes_now: list[RowWrite] = []
        self._taken_now: set[int] = set()  # rows taken since the last drain

    def available_size(self) -> int:
        """Number of free request rows."""
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """Take one free row, or return None when every row is in use."""
        if not self._free_rows:
            return None
        row = self._free_rows.popleft()
        self._allocated[row] = True
        self._taken_now.add(row)
        return row

    def free(self, row: int) -> None:
        """Give a row back. Freeing a row that is not allocated is an error."""
        self._check_allocated(row)
        self._allocated[row] = False
        self._free_rows.append(row)
        if self._writes_now:
            self._writes_now = [w for w in self._writes_now if w.row_idx != row]
        if row in self._taken_now:
            self._taken_now.discard(row)  # no rank saw it: nothing to reset
        else:
            self._freed_now.append(row)

    def is_allocated(self, row: int) -> bool:
        return 0 <= row < self.max_running_requests and bool(self._allocated[row])

    def write(self, row: int, start: int, slots: npt.ArrayLike) -> None:
        """Write ``slots`` into ``row`` at positions ``[start, start + len(slots))``."""
        self._check_allocated(row)
        values = np.asarray(slots)
        if values.ndim != 1:
            raise ValueError(f"slots must be one-dimensional, got shape {values.shape}")
        end = start + len(values)
        if start < 0 or end > self.max_context_len:
            raise ValueError(
                f"write of positions [{start}, {end}) to request row {row} is outside "
                f"[0, max_context_len={self.max_context_len})"
            )
        self.table[row, start:end] = values
        if end > start:
            self._writes_now.append(RowWrite(row, start, self.table[row, start:end].copy()))

    @property
    def has_diff(self) -> bool:
        return bool(self._freed_now or self._writes_now)

    def drain_diff(self) -> TableDiff:
        """What a rank's copy needs since the last drain (see the module docstring)."""
        diff = TableDiff(self._freed_now, self._writes_now)
        self._freed_now, self._writes_now, self._taken_now = [], [], set()
        return diff

    def read(self, row: int, start: int, end: int) -> SlotArray:
        """A view of ``row`` at positions ``[start, end)``."""
        self._check_allocated(row)
        if not 0 <= start <= end <= self.max_context_len:
            raise ValueError(
                f"read of positions [{start}, {end}) from request row {row} is outside "
                f"[0, max_context_len={self.max_context_len})"
            )
        return self.table[row, start:end]

    def clear(self) -> None:
        """Free every row."""
        for row in np.flatnonzero(self._allocated).tolist():
            self.free(row)
        self._free_rows = deque(range(self.max_running_requests))

    def _check_allocated(self, row: int) -> None:
        if not 0 <= row < self.max_running_requests:
            raise ValueError(f"request row {row} is out of range [0, {self.max_running_requests})")
        if not self._allocated[row]:
            raise RuntimeError(f"request row {row} is not allocated")
