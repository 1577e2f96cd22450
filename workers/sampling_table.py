"""The driving rank's sampling settings per request row, kept from the plans.

A request's `SamplingParams` travel once, in `StepPlan.new_sampling`, when it takes a request row
(and again only when they change); every later step names the row only. Freed rows forget
theirs. A plan that runs a row with no settings is refused before any rank runs it.
"""

from __future__ import annotations

from .step import SamplingParams, StepPlan


class SamplingTable:
    def __init__(self) -> None:
        self._by_row: dict[int, SamplingParams] = {}

    def check(self, plan: StepPlan) -> None:
        """Raise ValueError if a row of the batch would have no sampling settings."""
        sent = {s.row_idx for s in plan.new_sampling}
        freed = set(plan.freed_rows)
        for row in plan.row_idx.tolist():
            if row not in sent and (row in freed or row not in self._by_row):
                raise ValueError(f"request row {row} runs with no sampling settings: a plan "
                                 "must send them (new_sampling) when a request takes its row")

    def update(self, plan: StepPlan) -> tuple[SamplingParams, ...]:
        """Follow the plan (freed rows, then new settings); the batch's settings in order."""
        for row in plan.freed_rows:
            self._by_row.pop(row, None)
        for s in plan.new_sampling:
            self._by_row[s.row_idx] = s.sampling
        return tuple(self._by_row[row] for row in plan.row_idx.tolist())

    def __len__(self) -> int:
        return len(self._by_row)
