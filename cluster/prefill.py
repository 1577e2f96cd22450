"""Forms the prefill part of a step (the seeds' ``get_new_batch_prefill``).

Chunked prompts already running continue first. Then waiting requests, in policy order, are
matched against the prefix cache, locked, and packed while the token budget
(``max_prefill_tokens``), the free request rows and the memory (free + evictable, minus what
the running requests are expected to still need) allow. A prompt that does not fit whole is
split into chunks of at most ``chunked_prefill_size`` tokens.

A waiting request whose prompt shares at least ``in_batch_prefix_threshold`` more tokens with a
prompt being computed right now (admitted this step, or mid-prefill) than with the cache waits
one step: computing that prefix twice would waste the step, and next step it is a cache hit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from raydix.cache import RadixCache

from .batch import ScheduledBatch
from .request import Request, Status

if TYPE_CHECKING:
    from .scheduler import Scheduler


def schedule_prefill(
    sched: Scheduler, batch: ScheduledBatch, prefilling: list[Request], retracted: set[str]
) -> None:
    config = sched.config
    cache = sched.cache
    budget = config.max_prefill_tokens - batch.num_tokens
    # only waiting requests can be held back, so the in-flight tree is built only for them
    in_flight = (
        RadixCache(page_size=1) if config.in_batch_prefix_threshold and sched.waiting else None
    )
    for req in prefilling:
        _note_in_flight(in_flight, req)
        if budget <= 0:
            return
        assert req.row is not None
        num = min(req.fill_len - req.kv_len, config.chunked_prefill_size, budget)
        slots = cache.alloc_slots(req.row, num)
        if slots is None:
            return
        batch.add(req, num, slots)
        budget -= num

    for req in sched.ordered_waiting():
        if budget <= 0 or cache.req_to_token.available_size() == 0:
            return
        if req.rid in retracted:
            continue
        fill_ids = req.fill_ids
        match = cache.match_prefix(fill_ids[:-1], req.params.extra_key)
        if in_flight is not None:
            shared = in_flight.match_prefix(fill_ids[:-1], req.params.extra_key).cached_len
            if shared - match.cached_len >= config.in_batch_prefix_threshold:
                continue  # its prefix is being computed now: a cache hit next step
        extend_len = req.fill_len - match.cached_len
        # locking the match takes its evictable part out of what allocation can evict
        room = (
            cache.available_size()
            - cache.prefix_cache.evictable_len(match.handle)
            - sched.reserved_decode_tokens()
        )
        num = min(
            extend_len,
            config.chunked_prefill_size,
            budget,
            room // config.page_size * config.page_size,
        )
        if num <= 0:
            return  # no memory for even one page: wait for running requests to finish
        row = cache.alloc_req(match, req.params.extra_key)
        if row is None:
            return
        slots = cache.alloc_slots(row, num)
        if slots is None:
            cache.free_req(row)
            return
        req.row = row
        req.kv_len = match.cached_len
        if not req.admitted_once:
            req.cached_tokens = match.cached_len
            req.admitted_once = True
            sched.stats.record_admission(len(req.prompt_ids), match.cached_len)
        req.status = Status.RUNNING
        sched.waiting.remove(req)
        sched.running.append(req)
        batch.add(req, num, slots, admitted=True)
        budget -= num
        _note_in_flight(in_flight, req)


def _note_in_flight(in_flight: RadixCache | None, req: Request) -> None:
    if in_flight is not None:
        fill_ids = req.fill_ids
        in_flight.insert(fill_ids, np.zeros(len(fill_ids), dtype=np.int32), req.params.extra_key)
