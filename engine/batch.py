"""A scheduled step: which requests compute which tokens, and the plan sent to the ranks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from raydix.cache import KVCopies, TableDiff
from raydix.workers.step import (
    GrammarStart,
    PenaltyStart,
    ScheduledRequest,
    SlotCopy,
    StepPlan,
    TableWrite,
)

from .request import Request


@dataclass
class ScheduledBatch:
    """Requests of one step in plan order, with the number of tokens each computes."""

    step_id: int
    requests: list[Request] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    slots: list[np.ndarray] = field(default_factory=list)
    admitted: list[bool] = field(default_factory=list)  # took its request row this step

    def add(self, req: Request, num_tokens: int, slots: np.ndarray,
            admitted: bool = False) -> None:
        self.requests.append(req)
        self.extend_lens.append(num_tokens)
        self.slots.append(slots)
        self.admitted.append(admitted)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def num_decode(self) -> int:
        return sum(
            1
            for n, req in zip(self.extend_lens, self.requests, strict=True)
            if n == 1 and req.num_output_tokens
        )

    def to_plan(self, diff: TableDiff, copies: KVCopies | None = None) -> StepPlan:
        """The step for the ranks: this batch, plus the request table's changes since the last
        plan (`diff`, drained from the cache manager), the host tier's copies (`copies`,
        drained likewise) and each request's sampling settings when they are new to its row."""
        scheduled, penalty_starts, grammar_starts = [], [], []
        for req, num, slots, admitted in zip(self.requests, self.extend_lens, self.slots,
                                             self.admitted, strict=True):
            assert req.row is not None
            if admitted and req.params.sampling.has_penalties:
                penalty_starts.append(PenaltyStart(
                    req.row, len(req.prompt_ids),
                    req.token_slice(0, req.kv_len).astype(np.int64)))
            if admitted and req.params.sampling.grammar is not None:
                prompt_len = len(req.prompt_ids)
                grammar_starts.append(GrammarStart(req.row, prompt_len, req.token_slice(
                    prompt_len, max(req.kv_len, prompt_len)).astype(np.int64)))
            sampling = req.sampling_now()
            new_sampling = sampling if sampling is not req.sent_sampling else None
            req.sent_sampling = sampling
            scheduled.append(
                ScheduledRequest(
                    row_idx=req.row,
                    prefix_len=req.kv_len,
                    input_ids=req.token_slice(req.kv_len, req.kv_len + num),
                    out_cache_loc=slots,
                    sampling=new_sampling,
                )
            )
        writes = [TableWrite(w.row_idx, w.start, w.slot_ids) for w in diff.writes]
        d2h = h2d = None
        if copies is not None:
            d2h = SlotCopy(copies.write_device_slots, copies.write_host_slots)
            h2d = SlotCopy(copies.load_host_slots, copies.load_device_slots)
        plan = StepPlan.build(self.step_id, scheduled, writes, diff.freed_rows, penalty_starts,
                              grammar_starts, device_to_host=d2h, host_to_device=h2d)
        pending_steps = {req.pending[0] for req in self.requests if req.pending is not None}
        if not pending_steps:
            return plan
        if len(pending_steps) > 1:
            raise RuntimeError(f"step {self.step_id} would take the tokens of steps "
                               f"{sorted(pending_steps)}; only the step in flight has any")
        return dataclasses.replace(plan, tokens_from_step=pending_steps.pop())
