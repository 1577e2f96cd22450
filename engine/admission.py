"""Forms the prefill part of a step (the seeds' ``get_new_batch_prefill``).

Chunked prompts already running continue first. Then waiting requests, in policy order, are
matched against the prefix cache, locked, and packed while the token budget
(``max_prefill_tokens``), the free request rows and the memory (free + evictable, minus what
the running requests are expected to still need) allow. A prompt that does not fit whole is
split into chunks of at most ``chunked_prefill_size`` tokens.

A waiting request whose prompt shares at least ``in_batch_prefix_threshold`` more tokens with a
prompt being computed right now (admitted this step, or mid-prefill) than with the cache waits
one step: computing that prefix twice would waste the step, and next step it is a cache hit.

Admission takes request rows and slots from the cache manager and adds the chunks to the batch;
it returns the requests it admitted and leaves the scheduler's queues and counters to the
scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from raydix.cache import KVCacheManager, RadixCache

from .batch import ScheduledBatch
from .config import SchedulerConfig
from .request import Request


class Admitted(NamedTuple):
    """A waiting request that took a request row this step, with its prefix-cache hit."""

    request: Request
    cached_len: int
    host_hit_len: int = 0  # of cached_len, the tokens loaded back from the host tier


@dataclass(frozen=True)
class DecodeReserve:
    """Memory held back for the running requests' future tokens: their remaining new tokens,
    times the scheduler's current new-token ratio (requests admitted now count too)."""

    remaining_new_tokens: int  # over the running requests
    new_token_ratio: float

    def tokens(self, admitted_remaining: int) -> int:
        return int((self.remaining_new_tokens + admitted_remaining) * self.new_token_ratio)


def schedule_prefill(
    config: SchedulerConfig,
    cache: KVCacheManager,
    batch: ScheduledBatch,
    prefilling: Sequence[Request],
    waiting: Sequence[Request],
    retracted: set[str],
    reserve: DecodeReserve,
) -> list[Admitted]:
    """Add running prompts' next chunks, then admit from `waiting` (in policy order)."""
    budget = config.max_prefill_tokens - batch.num_tokens
    # only waiting requests can be held back, so the in-flight tree is built only for them
    in_flight = RadixCache(page_size=1) if config.in_batch_prefix_threshold and waiting else None
    for req in prefilling:
        _note_in_flight(in_flight, req)
        if budget <= 0:
            return []
        assert req.row is not None
        num = min(req.fill_len - req.kv_len, config.chunked_prefill_size, budget)
        slots = cache.alloc_slots(req.row, num)
        if slots is None:
            return []
        batch.add(req, num, slots)
        budget -= num

    admitted: list[Admitted] = []
    admitted_remaining = 0
    for req in waiting:
        if budget <= 0 or cache.req_to_token.available_size() == 0:
            break
        if req.rid in retracted:
            continue
        fill_ids = req.fill_ids
        match = cache.match_prefix(fill_ids[:-1], req.params.extra_key)
        hit_len = match.cached_len + match.host_len  # a host-tier hit is loaded back
        if in_flight is not None:
            shared = in_flight.match_prefix(fill_ids[:-1], req.params.extra_key).cached_len
            if shared - hit_len >= config.in_batch_prefix_threshold:
                continue  # its prefix is being computed now: a cache hit next step
        extend_len = req.fill_len - hit_len
        # locking the match takes its evictable part out of what allocation can evict, and
        # loading its host part back takes device slots
        room = (
            cache.available_size()
            - cache.prefix_cache.evictable_len(match.handle)
            - match.host_len
            - reserve.tokens(admitted_remaining)
        )
        num = min(
            extend_len,
            config.chunked_prefill_size,
            budget,
            room // config.page_size * config.page_size,
        )
        if num <= 0:
            break  # no memory for even one page: wait for running requests to finish
        device_len = match.cached_len
        row = cache.alloc_req(match, req.params.extra_key)  # loads the host part back
        if row is None:
            break
        slots = cache.alloc_slots(row, num)
        if slots is None:
            cache.free_req(row)
            break
        req.row = row
        req.kv_len = match.cached_len
        admitted.append(Admitted(req, match.cached_len, match.cached_len - device_len))
        admitted_remaining += req.remaining_new_tokens
        batch.add(req, num, slots, admitted=True)
        budget -= num
        _note_in_flight(in_flight, req)
    return admitted


def _note_in_flight(in_flight: RadixCache | None, req: Request) -> None:
    if in_flight is not None:
        fill_ids = req.fill_ids
        in_flight.insert(fill_ids, np.zeros(len(fill_ids), dtype=np.int32), req.params.extra_key)
