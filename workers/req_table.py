"""This rank's copy of the request->token table, kept in step with the engine's from plan diffs.

`table[row, pos]` is the slot holding position `pos` of the request in `row`. Entries past a
request's length are stale or 0 (the padding slot) and are never read: attention reads positions
[0, seq_len) only.

`versions[row]` counts the times a row's entries may have changed under what was read: it was
freed, written by a table write (a new request's prefix, the prefix cache swapping slots), or
given new tokens below the length it had reached (a request that restarts in a row nothing
freed). Between two changes of its version a row only gains entries past its request's length,
so whatever was read from its first entries still holds (the attention backends' page tables
rely on it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .staging import staging_for
from .step import StepPlan


class RequestTable:
    def __init__(self, max_running_requests: int, max_context_len: int, num_slots: int,
                 device: torch.device) -> None:
        self.table = torch.zeros(max_running_requests, max_context_len, dtype=torch.int32,
                                 device=device)
        self.num_slots = num_slots
        self.device = device
        self.versions = np.zeros(max_running_requests, np.int64)  # host only
        self._lengths = np.zeros(max_running_requests, np.int64)  # entries written per row

    def check(self, plan: StepPlan) -> None:
        """Raise ValueError if the plan points outside the table or the pool (host-side only)."""
        max_rows, max_len = self.table.shape
        _check_rows(plan.freed_rows, max_rows)
        _check_rows([s.row_idx for s in plan.penalty_starts], max_rows)
        for w in plan.table_writes:
            _check_rows([w.row_idx], max_rows)
            if w.start < 0 or w.start + len(w.slot_ids) > max_len:
                raise ValueError(f"table write [{w.start}, {w.start + len(w.slot_ids)}) of row "
                                 f"{w.row_idx} is outside max_context_len={max_len}")
            _check_slots(w.slot_ids, self.num_slots)
        if plan.batch_size == 0:
            return
        _check_rows(plan.row_idx, max_rows)
        if len(np.unique(plan.row_idx)) != plan.batch_size:
            raise ValueError(f"a request row appears twice in one step: {plan.row_idx.tolist()}")
        if int(np.min(plan.prefix_lens)) < 0:
            raise ValueError("prefix lengths must be >= 0")
        longest = int(np.max(plan.prefix_lens.astype(np.int64) + plan.extend_lens))
        if longest > max_len:
            raise ValueError(f"a request reaches {longest} tokens, over "
                             f"max_context_len={max_len}")
        _check_slots(plan.out_cache_loc, self.num_slots)

    def apply(self, plan: StepPlan) -> None:
        """Freed rows -> padding slot; table writes; then each new token's slot at its position.
        One indexed assignment per write, one for the whole batch."""
        if plan.freed_rows:
            freed = np.asarray(plan.freed_rows, dtype=np.int64)
            self.table[self._dev(freed)] = 0
            np.add.at(self.versions, freed, 1)
            self._lengths[freed] = 0
        for w in plan.table_writes:
            self.versions[w.row_idx] += 1
            self._lengths[w.row_idx] = max(self._lengths[w.row_idx], w.start + len(w.slot_ids))
            self.table[w.row_idx, w.start: w.start + len(w.slot_ids)] = self._dev(
                np.asarray(w.slot_ids, dtype=np.int32))
        if plan.batch_size == 0:
            return
        extend = plan.extend_lens.astype(np.int64)
        batch_rows, prefix = plan.row_idx.astype(np.int64), plan.prefix_lens.astype(np.int64)
        self.versions[batch_rows[prefix < self._lengths[batch_rows]]] += 1
        self._lengths[batch_rows] = prefix + extend
        rows = np.repeat(batch_rows, extend)
        cols = np.arange(len(rows)) + np.repeat(prefix - (np.cumsum(extend) - extend), extend)
        self.table[self._dev(rows), self._dev(cols)] = self._dev(
            plan.out_cache_loc.astype(np.int32))

    def _dev(self, arr: np.ndarray) -> torch.Tensor:
        return to_device(arr, self.device)


def to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host -> device without a sync: on CUDA a non-blocking copy through the process's ring of
    pinned buffers (staging.py), no pinned allocation per call; on CPU a zero-copy view."""
    if device.type != "cuda":
        return torch.from_numpy(np.ascontiguousarray(arr))
    return staging_for(device).to_device(arr)


def _check_rows(rows: np.ndarray | Sequence[int], max_rows: int) -> None:
    arr = np.asarray(rows)
    if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= max_rows):
        raise ValueError(f"request rows {arr.tolist()} must be in [0, {max_rows})")


def _check_slots(slots: np.ndarray, num_slots: int) -> None:
    arr = np.asarray(slots)
    if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= num_slots):
        raise ValueError(f"slot ids must be in [0, {num_slots}), got [{int(arr.min())}, "
                         f"{int(arr.max())}]")
