"""A minimal engine for the worker tests: plans greedy generation as `StepPlan`s.

It allocates request rows from a counter and slots page by page, the way the engine's paged
allocator does (position p of a request sits at offset p % page_size of one of its pages; page 0 is
the padding page),
staggers arrivals so batches mix extend and decode requests, splits prompts into chunks, and lets a
request reuse the prompt slots of an earlier one (prefix reuse through `TableWrite`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from raydix.workers.step import GREEDY, ScheduledRequest, StepPlan, StepResult, TableWrite


@dataclass
class GenRequest:
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    chunk_len: int | None = None  # None: whole prompt in one extend
    reuse_from: int | None = None  # index of an earlier request whose prompt slots to reuse
    reuse_len: int = 0
    # state
    row_idx: int = -1
    slots: list[int] = field(default_factory=list)
    done_len: int = 0  # tokens whose K/V are in the pool
    output: list[int] = field(default_factory=list)


def run_greedy(step: Callable[[StepPlan], StepResult | None], requests: list[GenRequest],
               page_size: int = 1) -> list[list[int]]:
    next_page = 1
    step_id = 0
    while any(len(r.output) < r.max_new_tokens for r in requests):
        batch, writes, active = [], [], []
        for i, r in enumerate(requests):
            if r.arrival_step > step_id or len(r.output) >= r.max_new_tokens:
                continue
            if r.row_idx < 0:
                r.row_idx = i
                if r.reuse_from is not None:
                    src = requests[r.reuse_from]
                    if src.done_len < r.reuse_len:
                        raise RuntimeError("reuse source has not filled its prefix yet")
                    r.slots = src.slots[: r.reuse_len]
                    r.done_len = r.reuse_len
                    writes.append(TableWrite(r.row_idx, 0, np.array(r.slots, np.int32)))
            if r.done_len < len(r.prompt):
                n = len(r.prompt) - r.done_len
                if r.chunk_len is not None:
                    n = min(n, r.chunk_len)
                new_ids = r.prompt[r.done_len: r.done_len + n]
            else:
                new_ids = [r.output[-1]]
            loc: list[int] = []
            for pos in range(r.done_len, r.done_len + len(new_ids)):
                if pos % page_size == 0 or pos == r.reuse_len:  # a page of its own starts
                    loc.append(next_page * page_size + pos % page_size)
                    next_page += 1
                else:
                    loc.append((r.slots + loc)[-1] + 1)
            batch.append(ScheduledRequest(r.row_idx, r.done_len, new_ids, loc, GREEDY))
            active.append(r)
        plan = StepPlan.build(step_id, batch, writes)
        result = step(plan)
        if result is None:
            raise RuntimeError("the driving rank returned no result")
        for r, req, token in zip(active, batch, result.next_token_ids, strict=True):
            r.slots += list(req.out_cache_loc)
            r.done_len += len(req.input_ids)
            if r.done_len >= len(r.prompt):  # last prompt chunk or decode: keep the token
                r.output.append(int(token))
        step_id += 1
    return [r.output for r in requests]


def scenario(mode: str, prompts: list[list[int]], max_new_tokens: int,
             page_size: int = 1) -> list[GenRequest]:
    """The three cases every model is checked on.

    whole:   all prompts in one extend each, arriving together, then batched decode;
    chunked: prompts in chunks of 3 tokens, staggered so extend chunks and decodes share batches;
    prefix:  request k > 0 arrives after request 0's prefill and reuses the slots of the prompt
             prefix it shares with request 0 (the prompts are built to share one), in whole
             pages when `page_size` > 1, as the paged radix cache matches.
    """
    if mode == "whole":
        return [GenRequest(p, max_new_tokens) for p in prompts]
    if mode == "chunked":
        return [GenRequest(p, max_new_tokens, arrival_step=2 * i, chunk_len=3)
                for i, p in enumerate(prompts)]
    if mode == "prefix":
        reqs = [GenRequest(prompts[0], max_new_tokens)]
        for i, p in enumerate(prompts[1:], start=1):
            shared = 0
            while shared < min(len(p), len(prompts[0])) - 1 and p[shared] == prompts[0][shared]:
                shared += 1
            if page_size > 1:
                shared -= shared % page_size
            reqs.append(GenRequest(p, max_new_tokens, arrival_step=1 + i, reuse_from=0,
                                   reuse_len=shared))
        return reqs
    raise ValueError(mode)
