"""The engine: one replica's scheduler driving its ranks, step by step.

``step()`` forms a batch, runs it on the executor (one call; the driving rank shares the plan
with the others over the CPU process group) and turns the sampled tokens into outputs. The
engine is synchronous; the Serve layer runs it in a loop thread.

Text and stop strings are the output processor's (`output_processor.py`). A request added with
``process_outputs=True`` (offline use) has its outputs processed inside ``step``, and a stop
string aborts it there; `AsyncEngine` adds requests without, and processes each request's
outputs on its caller's event loop instead, off the step thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from raydix.cache import EventSink
from raydix.workers.config import ModelConfig

from .batch import ScheduledBatch
from .config import EngineConfig
from .detokenizer import TokenDecoder
from .executor import Executor, LocalExecutor, RankLocation, StepHandle
from .metrics import EngineMetrics
from .output_processor import RequestOutputProcessor
from .request import GenerationParams, Request, RequestOutput
from .scheduler import Scheduler

logger = logging.getLogger(__name__)

StepHook = Callable[[Scheduler], None]


class CacheStats(NamedTuple):
    """The KV cache manager's counters, for /metrics, health tools and tests (no walk over the
    pool: each is kept as it changes)."""

    num_rows: int  # request rows held
    num_protected_tokens: int  # prefix-cache tokens locked by running requests
    kv_capacity: int
    num_used_tokens: int  # slots held by running requests and protected prefixes


class RankFacts(NamedTuple):
    """What the replica reports of its rank (for `raydix serve`'s start-up lines)."""

    dtype: str  # as an in-process rank resolved it ("" when the rank runs in another actor)
    kv_pool_tokens: int
    cpu_threads: int | None  # torch threads of an in-process rank; None: not in this process


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | None = None,
        tokenizer: TokenDecoder | None = None,
        event_sink: EventSink | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.config = config
        self.executor = executor if executor is not None else LocalExecutor(config)
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = ModelConfig.from_folder(config.worker.model_path).eos_token_ids
        num_pages = self.executor.max_num_tokens // config.scheduler.page_size
        num_host_pages = 0
        if config.worker.host_tier:
            num_host_pages = self.executor.max_host_tokens // config.scheduler.page_size
        self.scheduler = Scheduler(config.scheduler, num_pages, eos_token_ids, event_sink,
                                   num_host_pages)
        self._rids = itertools.count()
        self.forward_time = 0.0
        self.step_hook: StepHook | None = None  # called after every step (tests, metrics)
        self._processors: dict[str, RequestOutputProcessor] = {}
        self._in_flight: tuple[ScheduledBatch, StepHandle] | None = None  # overlapped loop
        logger.info(
            "engine ready: %d KV slots in %d pages of %d",
            num_pages * config.scheduler.page_size,
            num_pages,
            config.scheduler.page_size,
        )

    # -------------------------------------------------------------------------- requests
    def add_request(
        self,
        prompt_ids: Sequence[int] | npt.NDArray[np.int32],
        params: GenerationParams | None = None,
        rid: str | None = None,
        process_outputs: bool = True,
    ) -> str:
        """Queue a request. ``process_outputs``: `step` gives its outputs with text and ends it
        at a stop string; False leaves that to the caller (`output_processor`)."""
        params = params or GenerationParams()
        rid = rid if rid is not None else f"req-{next(self._rids)}"
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        if params.sampling.grammar is not None:  # compiles while the request waits its turn
            self.executor.prepare_grammar(params.sampling.grammar)  # (or refuses it)
        self.scheduler.add_request(Request(rid, prompt, params))
        if process_outputs:
            self._processors[rid] = self.output_processor(prompt.tolist(), params)
        return rid

    def output_processor(self, prompt_ids: Sequence[int],
                         params: GenerationParams) -> RequestOutputProcessor:
        """A request's output processor, with this engine's tokenizer."""
        return RequestOutputProcessor(self.tokenizer, prompt_ids, params)

    def abort(self, rid: str) -> RequestOutput | None:
        out = self.scheduler.abort(rid)
        processor = self._processors.pop(rid, None)
        if out is None or processor is None:
            return out
        return processor.process(out)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    def idle_work(self) -> bool:
        """A small piece of work for a moment without requests (the engine process calls it
        while it waits for a command): the KV pool's next pages populated ahead of their first
        use (workers/kv_prefault.py). True: there may be more."""
        if self.has_work:
            return False
        return self.executor.prefault_kv(self.scheduler.cache.allocator.high_water_slot)

    # ------------------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """One step; outputs of requests added with ``process_outputs`` carry their text."""
        outputs = self.step_core()
        return self._process_outputs(outputs) if self._processors else outputs

    def step_core(self) -> list[RequestOutput]:
        """One step of the scheduler and the ranks: token ids, no text."""
        if self.config.scheduler.overlap_schedule:
            return self._step_overlapped()
        scheduled = self.scheduler.schedule()
        outputs = self.scheduler.take_early_outputs()
        if scheduled is None:
            return outputs
        batch, plan = scheduled
        start = time.perf_counter()
        result = self.executor.step(plan)
        self.forward_time += time.perf_counter() - start
        outputs += self.scheduler.process(batch, result)
        if self.step_hook is not None:
            self.step_hook(self.scheduler)
        return outputs

    def _process_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        processed = []
        for out in outputs:
            processor = self._processors.get(out.rid)
            if processor is None:
                processed.append(out)
                continue
            final = processor.process(out)
            if final is not None:
                processed.append(final)
            if processor.finished:
                del self._processors[out.rid]
                if processor.stopped_early:  # a stop string: the core still runs it
                    self.scheduler.abort(out.rid)
        return processed

    def _step_overlapped(self) -> list[RequestOutput]:
        """Form and launch step N+1 while step N runs, then read step N's tokens.

        Step N+1's decode inputs that step N samples are placeholders, which the driving rank
        fills in (`workers/step.py`); a request that step N ends computes one token too many
        in N+1, which is dropped. When the pool is short, step N is read first, so that no
        retraction is decided on tokens not read yet.
        """
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and not self.scheduler.can_schedule_ahead():
            outputs += self._read_in_flight()
        scheduled = self.scheduler.schedule()
        outputs += self.scheduler.take_early_outputs()
        launched = None
        if scheduled is not None:
            start = time.perf_counter()
            launched = (scheduled[0], self.executor.launch(scheduled[1]))
            self.forward_time += time.perf_counter() - start
        if self._in_flight is not None:
            outputs += self._read_in_flight()
        if launched is not None:
            self.scheduler.commit(launched[0])
            self._in_flight = launched
        if self.step_hook is not None:
            self.step_hook(self.scheduler)
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Wait for the step in flight (overlapped loop) and read it; nothing runs after."""
        outputs = self._read_in_flight() if self._in_flight is not None else []
        return self._process_outputs(outputs) if self._processors else outputs

    def _read_in_flight(self) -> list[RequestOutput]:
        assert self._in_flight is not None
        batch, handle = self._in_flight
        self._in_flight = None
        start = time.perf_counter()
        result = handle.result()
        self.forward_time += time.perf_counter() - start
        return self.scheduler.read(batch, result)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: GenerationParams | Sequence[GenerationParams] | None = None,
    ) -> list[list[int]]:
        """Run prompts to completion (offline); returns each prompt's output token ids."""
        if params is None or isinstance(params, GenerationParams):
            params = [params or GenerationParams()] * len(prompts)
        rids = [self.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
        tokens: dict[str, list[int]] = {rid: [] for rid in rids}
        while self.has_work:
            for out in self.step():
                if out.rid in tokens:
                    tokens[out.rid].extend(out.new_token_ids)
        return [tokens[rid] for rid in rids]

    def metrics(self) -> EngineMetrics:
        sched = self.scheduler
        cache = sched.cache
        used = cache.capacity - cache.available_size()
        metrics = EngineMetrics(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            token_usage=used / cache.capacity,
            cache_hit_rate=sched.stats.cache_hit_rate,
            generation_throughput=sched.stats.throughput(),
            num_generated_tokens=sched.stats.num_generated_tokens,
            num_prompt_tokens=sched.stats.num_prompt_tokens,
            num_cached_tokens=sched.stats.num_cached_tokens,
            num_retractions=sched.stats.num_retractions,
            num_finished=sched.stats.num_finished,
            num_steps=sched.stats.num_steps,
        )
        return self._with_host_metrics(metrics)

    def _with_host_metrics(self, metrics: EngineMetrics) -> EngineMetrics:
        host, stats = self.scheduler.cache.host_cache, self.scheduler.stats
        if host is None:
            return metrics
        return metrics._replace(
            num_host_tokens=host.host_size, host_capacity=host.host_capacity,
            host_token_usage=host.host_size / host.host_capacity,
            host_hit_rate=stats.host_hit_rate,
            num_host_hit_tokens=stats.num_host_hit_tokens,
            num_loaded_tokens=host.num_loaded_tokens,
            num_written_tokens=host.num_written_tokens,
            load_throughput=stats.per_second(host.num_loaded_tokens),
            write_throughput=stats.per_second(host.num_written_tokens))

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_steps(self) -> int:
        return self.scheduler.stats.num_steps

    def cache_stats(self) -> CacheStats:
        cache = self.scheduler.cache
        return CacheStats(cache.num_running, cache.size_info.protected_size, cache.capacity,
                          cache.capacity - cache.available_size())

    def audit_cache(self) -> str | None:
        """The cache manager's full integrity check (it walks every page of the pool, so its
        cost grows with the pool); None when consistent, else what is wrong."""
        try:
            self.scheduler.cache.check_integrity()
        except RuntimeError as e:
            return str(e)
        return None

    def publish_cache_snapshot(self) -> None:
        """Send the prefix cache's whole content as events again (the router lost track)."""
        self.scheduler.cache.publish_snapshot()

    def rank_facts(self) -> RankFacts:
        executor = self.executor
        if not isinstance(executor, LocalExecutor):
            return RankFacts("", executor.max_num_tokens, None)
        return RankFacts(str(executor.worker.runner.dtype), executor.max_num_tokens,
                         executor.worker.cpu_threads)

    def ranks(self) -> tuple[RankLocation, ...]:
        """Where each rank runs, in rank order."""
        return self.executor.ranks()

    def check_health(self) -> None:
        """Raise `UnhealthyRanksError` when a rank died, hangs or failed (blocks)."""
        self.executor.check_health()

    async def check_health_async(self) -> None:
        """`check_health` without blocking an event loop (callable from any thread's loop:
        it reads no scheduler state)."""
        await self.executor.check_health_async()

    def shutdown(self) -> None:
        self.executor.shutdown()
