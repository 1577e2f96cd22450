"""The request→token table (the seeds' ``req_to_token_pool``).

A fixed ``[max_running_requests, max_context_len]`` table of slot ids. Row ``r`` holds, at
position ``i``, the slot where token ``i`` of the request on row ``r`` keeps its K/V.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import numpy.typing as npt

SlotArray = npt.NDArray[np.int32]


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

    def available_size(self) -> int:
        """Number of free request rows."""
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """Take one free row, or return None when every row is in use."""
        if not self._free_rows:
            return None
        row = self._free_rows.popleft()
        self._allocated[row] = True
        return row

    def free(self, row: int) -> None:
        """Give a row back. Freeing a row that is not allocated is an error."""
        self._check_allocated(row)
        self._allocated[row] = False
        self._free_rows.append(row)

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
        self._free_rows = deque(range(self.max_running_requests))
        self._allocated[:] = False

    def _check_allocated(self, row: int) -> None:
        if not 0 <= row < self.max_running_requests:
            raise ValueError(f"request row {row} is out of range [0, {self.max_running_requests})")
        if not self._allocated[row]:
            raise RuntimeError(f"request row {row} is not allocated")
