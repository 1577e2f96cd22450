"""The step protocol between the engine and the workers.

The engine holds the logical KV state (request rows, slots, radix tree). Each step it sends every
rank one `StepPlan`, which carries only ids (numpy arrays and ints, never torch tensors) and only
what changed:

- `table_writes`: slots to copy into the rank's own request->token table, e.g. a new request's
  cached prefix slots from the radix tree (row, start position, slots);
- `freed_rows`: rows of finished requests (the rank points them back at the padding slot);
- `penalty_starts`: for a request with repetition, frequency or presence penalties, when it
  takes a request row: its prompt length and the tokens of its cached prefix, which no step
  carries (penalties.py rebuilds each such request's tokens from there);
- `grammar_starts`: for a request under a grammar (structured output), when it takes a request
  row: its prompt length and the output tokens in its cached prefix, which the driving rank's
  matcher replays (`grammar/`); later output tokens reach the matcher as the steps' inputs;
- `new_sampling`: a row's `SamplingParams`, sent once when a request takes the row (and again
  only if they change, e.g. when `min_new_tokens` stops banning EOS); the driving rank keeps
  them per row until the row is freed (`sampling_table.py`);
- `device_to_host` / `host_to_device`: the host KV tier's copies (`SlotCopy`: source and
  destination slots), made on every rank before the forward: the writes to host slots first,
  then the loads back to device slots (cache/hiradix.py says why that order is safe);
- the batch itself, packed in request order: row, prefix length and new token ids per request,
  and the slot (`out_cache_loc`) for each new token. The worker writes these slots into the table
  at positions prefix_len .. prefix_len + extend_len - 1 before the forward, so the engine does
  not repeat them in `table_writes`.

With the overlapped step loop the engine forms a step before it has read the previous step's
tokens. A decode input it does not know yet is the placeholder `pending_token(i)` (a negative
id): "the token the driving rank sampled for request i of step `tokens_from_step`". The driving
rank has that step's result when the next plan reaches it, and `resolve_pending` puts the tokens
in before the plan is checked and shared, so no other rank and no other part of the step ever
sees a placeholder.

Rank 0 (the driving rank) answers with a `StepResult`; the other ranks run the same step and
return nothing. `broadcast.broadcast_plan` moves a plan from the driving rank to the others over
the CPU process group.

This module is the control plane's side of the workers: it imports numpy only, never torch,
so the scheduler, the cache, the router and the HTTP ingress load without the model stack
(`tests/test_layers.py` checks it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .sampling_params import (
    GRAMMAR_KINDS,
    GREEDY,
    MAX_TOP_LOGPROBS,
    GrammarSpec,
    SamplingParams,
)

# re-exported: the plan carries them
__all__ = ["GRAMMAR_KINDS", "GREEDY", "MAX_TOP_LOGPROBS", "GrammarSpec", "SamplingParams"]


@dataclass(frozen=True)
class TableWrite:
    """Write `slot_ids` into request row `row_idx` at positions start .. start + len - 1."""

    row_idx: int
    start: int
    slot_ids: np.ndarray  # int32


@dataclass(frozen=True)
class PenaltyStart:
    """A penalised request took request row `row_idx`: tokens at positions >= `prompt_len` are
    its output; `prefix_ids` are its tokens before this step's new ones (the cached prefix)."""

    row_idx: int
    prompt_len: int
    prefix_ids: np.ndarray  # int64


@dataclass(frozen=True)
class GrammarStart:
    """A request under a grammar took request row `row_idx`: its matcher starts anew and
    accepts `output_ids`, the output tokens already in its cached prefix (after a retraction);
    tokens at positions >= `prompt_len` that later steps carry as input are accepted as they
    come."""

    row_idx: int
    prompt_len: int
    output_ids: np.ndarray  # int64


@dataclass(frozen=True)
class RowSampling:
    """From this step on, request row `row_idx` samples with `sampling`."""

    row_idx: int
    sampling: SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's part of a step, before packing (a convenience for building plans)."""

    row_idx: int
    prefix_len: int  # tokens of this request already in the pool (cached prefix + earlier chunks)
    input_ids: Sequence[int] | np.ndarray  # the new tokens: a prompt chunk (extend) or one token (decode)
    out_cache_loc: Sequence[int] | np.ndarray  # one slot per new token
    # sent with this step (a new row, or a change); None: the row's last ones still hold
    sampling: SamplingParams | None = GREEDY


@dataclass(frozen=True)
class SlotCopy:
    """Copy the K/V of slots `src_slots` (one tier) to `dst_slots` (the other), in order."""

    src_slots: np.ndarray  # int32
    dst_slots: np.ndarray  # int32

    def __post_init__(self) -> None:
        if len(self.src_slots) != len(self.dst_slots):
            raise ValueError(f"a slot copy needs as many destinations ({len(self.dst_slots)}) "
                             f"as sources ({len(self.src_slots)})")

    def __len__(self) -> int:
        return len(self.src_slots)


@dataclass(frozen=True)
class StepPlan:
    """One forward step for every rank. Arrays are packed in request order.

    Request i has new tokens input_ids[t_i : t_i + extend_lens[i]] where t_i is the sum of the
    earlier extend_lens; their positions are prefix_lens[i] .. prefix_lens[i] + extend_lens[i] - 1.
    """

    step_id: int
    row_idx: np.ndarray  # [B] int32, request rows
    prefix_lens: np.ndarray  # [B] int32
    extend_lens: np.ndarray  # [B] int32 (1 for decode)
    input_ids: np.ndarray  # [T] int64
    out_cache_loc: np.ndarray  # [T] int32
    new_sampling: tuple[RowSampling, ...] = ()
    table_writes: tuple[TableWrite, ...] = ()
    freed_rows: tuple[int, ...] = ()
    penalty_starts: tuple[PenaltyStart, ...] = ()
    grammar_starts: tuple[GrammarStart, ...] = ()
    device_to_host: SlotCopy | None = None  # host KV tier: write backups, made first
    host_to_device: SlotCopy | None = None  # host KV tier: loads back, made second
    shutdown: bool = False  # tells follower ranks to leave their loop
    tokens_from_step: int = -1  # the step whose sampled tokens the placeholders name; -1: none

    def __post_init__(self) -> None:
        num_requests = len(self.row_idx)
        if len(self.prefix_lens) != num_requests or len(self.extend_lens) != num_requests:
            raise ValueError("row_idx, prefix_lens and extend_lens must have one entry per request")
        num_tokens = int(np.sum(self.extend_lens))
        if len(self.input_ids) != num_tokens or len(self.out_cache_loc) != num_tokens:
            raise ValueError(f"input_ids ({len(self.input_ids)}) and out_cache_loc "
                             f"({len(self.out_cache_loc)}) must both have sum(extend_lens) = "
                             f"{num_tokens} entries")
        if num_requests and int(np.min(self.extend_lens)) < 1:
            raise ValueError("every request in a step needs at least one new token")

    @property
    def batch_size(self) -> int:
        return len(self.row_idx)

    @classmethod
    def build(cls, step_id: int, requests: Sequence[ScheduledRequest],
              table_writes: Sequence[TableWrite] = (),
              freed_rows: Sequence[int] = (),
              penalty_starts: Sequence[PenaltyStart] = (),
              grammar_starts: Sequence[GrammarStart] = (),
              device_to_host: SlotCopy | None = None,
              host_to_device: SlotCopy | None = None) -> StepPlan:
        for r in requests:
            if len(r.input_ids) != len(r.out_cache_loc):
                raise ValueError(f"request row {r.row_idx}: {len(r.input_ids)} new tokens but "
                                 f"{len(r.out_cache_loc)} slots")
        return cls(
            step_id=step_id,
            row_idx=np.array([r.row_idx for r in requests], dtype=np.int32),
            prefix_lens=np.array([r.prefix_len for r in requests], dtype=np.int32),
            extend_lens=np.array([len(r.input_ids) for r in requests], dtype=np.int32),
            input_ids=np.concatenate([np.asarray(r.input_ids, dtype=np.int64) for r in requests])
            if requests else np.zeros(0, dtype=np.int64),
            out_cache_loc=np.concatenate(
                [np.asarray(r.out_cache_loc, dtype=np.int32) for r in requests])
            if requests else np.zeros(0, dtype=np.int32),
            new_sampling=tuple(RowSampling(r.row_idx, r.sampling) for r in requests
                               if r.sampling is not None),
            table_writes=tuple(table_writes),
            freed_rows=tuple(freed_rows),
            penalty_starts=tuple(penalty_starts),
            grammar_starts=tuple(grammar_starts),
            device_to_host=device_to_host if device_to_host else None,
            host_to_device=host_to_device if host_to_device else None,
        )

    @property
    def has_pending(self) -> bool:
        return bool(len(self.input_ids)) and int(self.input_ids.min()) < 0

    @classmethod
    def shutdown_plan(cls, step_id: int = -1) -> StepPlan:
        return cls(step_id, np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32),
                   np.zeros(0, np.int64), np.zeros(0, np.int32), shutdown=True)


def pending_token(index: int) -> int:
    """The placeholder input id for the token sampled for request `index` of the step before."""
    return -(index + 1)


def resolve_pending(plan: StepPlan, last_step_id: int, last_token_ids: np.ndarray) -> StepPlan:
    """`plan` with its placeholders replaced by the tokens sampled in step `last_step_id` (the
    driving rank's last step). A plan naming any other step, or an index that step did not
    have, is refused: a stale token would silently change the output."""
    if not plan.has_pending:
        return plan
    if plan.tokens_from_step != last_step_id:
        raise ValueError(f"step {plan.step_id} takes the tokens of step "
                         f"{plan.tokens_from_step}, but the last step run was {last_step_id}")
    ids = plan.input_ids.copy()
    holes = np.flatnonzero(ids < 0)
    index = -ids[holes] - 1
    if int(index.max()) >= len(last_token_ids):
        raise ValueError(f"step {plan.step_id} takes token {int(index.max())} of step "
                         f"{last_step_id}, which had {len(last_token_ids)}")
    ids[holes] = last_token_ids[index]
    return dataclasses.replace(plan, input_ids=ids, tokens_from_step=-1)


class StepResult(NamedTuple):
    """What the driving rank returns, one entry per request in plan order.

    Every request gets a token, also one whose extend is a middle chunk of its prompt: the engine
    keeps only the token of a step that reached the end of the prompt (or a decode).
    """

    step_id: int
    next_token_ids: np.ndarray  # [B] int64
    logprobs: np.ndarray | None  # [B] float32, NaN where not asked; None when nobody asked
    # [B] bool: the token is one of the request's stop_token_ids, or ends its grammar
    stopped: np.ndarray
    # the likeliest tokens under the raw distribution, [B, K] for the largest K asked in the
    # step, likeliest first; None when nobody asked
    top_ids: np.ndarray | None = None  # int64
    top_logprobs: np.ndarray | None = None  # float32
