"""The scheduler: continuous batching over the logical KV state (as in the seeds).

Each step: running requests that decode get one slot each (retracting the least advanced ones
when the pool is short), chunks of prompts fill the rest of the token budget
(``get_new_batch_prefill``), the step runs, and results come back through ``process``:
finished requests go through ``cache_finished_req``, prompt chunks through
``cache_unfinished_req``. Outputs carry token ids; their text and stop strings are the output
processor's (``output_processor.py``), off the step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from raydix.cache import CacheConfig, EventSink, KVCacheManager
from raydix.workers.step import StepPlan, StepResult

from .admission import Admitted, DecodeReserve, schedule_prefill
from .batch import ScheduledBatch
from .config import SchedulerConfig
from .metrics import SchedulerStats
from .policy import order_waiting
from .request import FinishReason, Request, RequestOutput, Status

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_pages: int,
        eos_token_ids: Sequence[int] = (),
        event_sink: EventSink | None = None,
        num_host_pages: int = 0,
    ) -> None:
        self.config = config
        self.cache = KVCacheManager(
            CacheConfig(
                num_pages=num_pages,
                max_running_requests=config.max_running_requests,
                max_context_len=config.max_context_len,
                page_size=config.page_size,
                enable_prefix_cache=config.enable_prefix_cache,
                num_host_pages=num_host_pages,
                write_policy=config.hicache_write_policy,
            ),
            event_sink,
        )
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.new_token_ratio = config.init_new_token_ratio
        self._step_id = 0
        self._requests: dict[str, Request] = {}
        self._retracted_now: set[str] = set()
        self._early_outputs: list[RequestOutput] = []

    # -------------------------------------------------------------------------- requests
    def add_request(self, req: Request) -> None:
        if req.rid in self._requests:
            raise ValueError(f"request id {req.rid!r} is already in use")
        prompt_len = len(req.prompt_ids)
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        if prompt_len >= self.config.max_context_len:
            raise ValueError(
                f"the prompt has {prompt_len} tokens; the context limit is "
                f"{self.config.max_context_len}, which leaves no room for output"
            )
        if prompt_len + 1 > self.cache.capacity:
            raise ValueError(
                f"the prompt has {prompt_len} tokens, more than the KV pool holds "
                f"({self.cache.capacity})"
            )
        if req.params.min_new_tokens:
            sampling = req.params.sampling
            banned = self.eos_token_ids | set(sampling.stop_token_ids)
            req.early_sampling = replace(sampling, banned_token_ids=tuple(sorted(banned)))
        self._requests[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str) -> RequestOutput | None:
        """Stop a request wherever it is; everything it holds is freed."""
        req = self._requests.get(rid)
        if req is None:
            return None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        else:
            self._release(req, cache=True)
            self.running.remove(req)
        req.pending = None  # a token still in flight is dropped
        return self._finish(req, FinishReason.ABORT)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, rid: str) -> Request | None:
        return self._requests.get(rid)

    # -------------------------------------------------------------------------- schedule
    def schedule(self) -> tuple[ScheduledBatch, StepPlan] | None:
        """Form the next step, or None when there is nothing to run."""
        self._step_id += 1
        batch = ScheduledBatch(self._step_id)
        decoding = [r for r in self.running
                    if r.fill_len - r.kv_len == 1 and not self._ends_by_length(r)]
        prefilling = [r for r in self.running if r.fill_len - r.kv_len > 1]
        if self.config.enable_mixed_batch:
            if decoding:
                self._schedule_decode(batch, decoding)
            self._schedule_prefill(batch, prefilling)
        else:  # prefill steps come first; decode runs when no prompt can go
            self._schedule_prefill(batch, prefilling)
            if not batch.requests and decoding:
                self._schedule_decode(batch, decoding)
        self._retracted_now = set()
        if not batch.requests:
            stuck = [r for r in self.running if not self._ends_by_length(r)]
            if stuck:
                # running prompts hold memory but none can take its next chunk: make room
                self._retract(stuck[-1])
            if not self.cache.has_table_diff and not self.cache.has_copies:
                return None
        plan = batch.to_plan(self.cache.drain_table_diff(), self.cache.drain_copies())
        self.new_token_ratio = max(
            self.config.min_new_token_ratio,
            self.new_token_ratio - self.config.new_token_ratio_decay,
        )
        return batch, plan

    def _schedule_prefill(self, batch: ScheduledBatch, prefilling: list[Request]) -> None:
        reserve = DecodeReserve(sum(r.remaining_new_tokens for r in self.running),
                                self.new_token_ratio)
        admitted = schedule_prefill(self.config, self.cache, batch, prefilling,
                                    self.ordered_waiting(), self._retracted_now, reserve)
        for entry in admitted:
            self._admit(entry)

    def _admit(self, entry: Admitted) -> None:
        """A waiting request took its request row: it runs from now on."""
        req = entry.request
        if not req.admitted_once:
            req.cached_tokens = entry.cached_len
            req.admitted_once = True
            self.stats.record_admission(len(req.prompt_ids), entry.cached_len,
                                        entry.host_hit_len)
        req.status = Status.RUNNING
        self.waiting.remove(req)
        self.running.append(req)

    def _schedule_decode(self, batch: ScheduledBatch, decoding: list[Request]) -> None:
        """One slot per decoding request; retract the least advanced while the pool is short."""
        # least advanced last: fewest output tokens, then the longest prompt
        decoding.sort(key=lambda r: (r.num_output_tokens, -len(r.prompt_ids)), reverse=True)
        while decoding:
            slots = self.cache.alloc_decode_slots([r.row for r in decoding])  # type: ignore[misc]
            if slots is not None:
                for req, slot in zip(decoding, slots, strict=True):
                    batch.add(req, 1, np.asarray([slot], dtype=np.int32))
                return
            req = decoding.pop()
            if not decoding and len(self.running) == 1:
                # alone and still no room: the pool cannot hold this request's next token
                self._release(req, cache=True)
                self.running.remove(req)
                self._early_outputs.append(self._finish(req, FinishReason.LENGTH))
                return
            self._retract(req)

    def _retract(self, req: Request) -> None:
        """Send a running request back to the front of the queue, keeping its computed K/V
        in the prefix cache where it fits; it resumes with the same output."""
        self._release(req, cache=True)
        self.running.remove(req)
        req.status = Status.WAITING
        req.num_retractions += 1
        self.waiting.insert(0, req)
        self._retracted_now.add(req.rid)
        self.stats.num_retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        logger.debug("retracted %s after %d output tokens", req.rid, len(req.output_ids))

    def _release(self, req: Request, cache: bool) -> None:
        assert req.row is not None
        if cache:
            self.cache.cache_finished_req(req.row, req.fill_ids[: req.kv_len])
        else:
            self.cache.free_req(req.row)
        req.row = None
        req.kv_len = 0
        req.sent_sampling = None

    def take_early_outputs(self) -> list[RequestOutput]:
        """Requests that ended while a step was being formed (no room to grow)."""
        outputs, self._early_outputs = self._early_outputs, []
        return outputs

    def ordered_waiting(self) -> list[Request]:
        return order_waiting(
            self.waiting, self.config.schedule_policy, self.cache, self.config.max_lpm_waiting
        )

    # --------------------------------------------------------------------------- results
    def process(self, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        """A step that ran: `commit` it, then `read` its result (the synchronous loop)."""
        self.commit(batch)
        return self.read(batch, result)

    def commit(self, batch: ScheduledBatch) -> None:
        """The step is launched: its K/V will be in the pool before any later step runs, so
        count it computed now (and share finished prompt chunks); a request that samples a
        token in it has that token pending until `read`."""
        for i, (req, num) in enumerate(zip(batch.requests, batch.extend_lens, strict=True)):
            if req.status is not Status.RUNNING:
                continue  # aborted before the step was committed
            req.kv_len += num
            if req.kv_len < req.fill_len:
                self._cache_chunk(req)
                continue
            if num > 1 or not req.output_ids:
                self._cache_chunk(req)  # the whole prompt is computed: share it now
            req.pending = (batch.step_id, i)

    def read(self, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        """Apply a committed step's sampled tokens; return one output per request with news.
        A request retracted since keeps its token (it resumes with it); an aborted one is gone."""
        outputs = []
        for i, req in enumerate(batch.requests):
            if req.pending != (batch.step_id, i):
                continue  # a middle prompt chunk, or aborted
            req.pending = None
            outputs.append(self._append_token(req, result, i))
        self.stats.num_steps += 1
        return outputs

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be formed before the step in flight is read: only while
        every running request surely gets its next page, so that forming it retracts nobody
        on the strength of tokens not read yet."""
        return self.cache.available_size() >= self.config.page_size * len(self.running)

    def _ends_by_length(self, req: Request) -> bool:
        """Its pending token is its last (max_new_tokens or the context limit): nothing to
        schedule for it, `read` finishes it."""
        return req.pending is not None and (
            req.remaining_new_tokens <= 0 or req.fill_len >= self.config.max_context_len)

    def _cache_chunk(self, req: Request) -> None:
        assert req.row is not None
        self.cache.cache_unfinished_req(req.row, req.fill_ids[: req.kv_len])

    def _append_token(self, req: Request, result: StepResult, i: int) -> RequestOutput:
        token = int(result.next_token_ids[i])
        req.output_ids.append(token)
        self.stats.num_generated_tokens += 1
        sampling = req.params.sampling
        logprobs: tuple[float, ...] = ()
        top: tuple[tuple[tuple[int, float], ...], ...] = ()
        if result.logprobs is not None and sampling.return_logprob:
            logprobs = (float(result.logprobs[i]),)
        if result.top_ids is not None and result.top_logprobs is not None and sampling.top_logprobs:
            k = sampling.top_logprobs
            top = (tuple(zip(result.top_ids[i, :k].tolist(),
                             result.top_logprobs[i, :k].tolist(), strict=True)),)
        reason = None
        if (
            bool(result.stopped[i])
            or (token in self.eos_token_ids and not req.params.ignore_eos)
        ):
            reason = FinishReason.STOP
        elif req.remaining_new_tokens <= 0 or req.fill_len >= self.config.max_context_len:
            reason = FinishReason.LENGTH
        if reason is None:
            return RequestOutput(req.rid, (token,), "", None, req.usage(), logprobs, top)
        if req.status is Status.WAITING:  # retracted while its token was pending
            self.waiting.remove(req)
        else:
            self._release(req, cache=True)
            self.running.remove(req)
        final = self._finish(req, reason)
        return final._replace(new_token_ids=(token,), logprobs=logprobs, top_logprobs=top)

    def _finish(self, req: Request, reason: FinishReason) -> RequestOutput:
        req.status = Status.FINISHED
        req.finish_reason = reason
        del self._requests[req.rid]
        self.stats.num_finished += 1
        return RequestOutput(req.rid, (), "", reason, req.usage())
