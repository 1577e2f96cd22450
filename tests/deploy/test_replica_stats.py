"""A replica's stats cost nothing that grows with its KV pool and never stall its streams; the
cache audit runs only behind its debug setting, and only while the replica is idle.

The replica runs outside Serve and Ray, over an executor that stands in for the ranks: a pool
of millions of slots (as on a GPU) and a step that sleeps, so that the serving path's costs
are measured without a model's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest

from raydix.cache import EventSink
from raydix.deploy.replica_stats import ReplicaStats
from raydix.deploy.server import EngineServer, ReplicaSettings
from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.engine.simulated_executor import SimulatedExecutor, StepCost
from raydix.workers.config import WorkerConfig

NUM_SLOTS = 4_000_000  # about the pool of an 80 GB GPU; the audit walks it in seconds
STEP_S = 0.02  # one step of the stand-in executor
PROMPT = list(range(10, 40))


def factory(num_slots: int, step_s: float = STEP_S
            ) -> Callable[[EngineConfig, ReplicaSettings, EventSink | None], Engine]:
    def make(config: EngineConfig, settings: ReplicaSettings,
             event_sink: EventSink | None) -> Engine:
        # the ranks' stand-in: a step sleeps `step_s` and samples token 7 for every request
        executor = SimulatedExecutor(num_slots, StepCost(step_s, 0.0, 0.0), token_id=7)
        return Engine(config, executor=executor, event_sink=event_sink)
    return make


def engine_config(model: Path) -> EngineConfig:
    return EngineConfig.build(WorkerConfig(model_path=str(model)),
                              SchedulerConfig(max_running_requests=8, max_context_len=512))


class RecordingBoard:
    """The stats board's stand-in, scraped every `scrape_s`: keeps every report."""

    def __init__(self, scrape_s: float) -> None:
        self.reports: list[ReplicaStats] = []
        self.scrape_s = scrape_s
        self.report = _Remote(self._report)  # `board.report.remote(stats, scrape)`, as on a
        self.next_scrape = _Remote(self._next_scrape)  # deployment handle

    async def _report(self, stats: ReplicaStats, scrape: int) -> None:
        self.reports.append(stats)

    async def _next_scrape(self, seen: int, timeout_s: float) -> int:
        await asyncio.sleep(self.scrape_s)
        return seen + 1


class _Remote:
    def __init__(self, fn: Callable[..., Awaitable[object]]) -> None:
        self.remote = fn


async def stream_times(server: EngineServer, rid: str, num_tokens: int) -> list[float]:
    """The arrival time of each output token of one greedy stream."""
    params = GenerationParams(max_new_tokens=num_tokens, ignore_eos=True)
    times: list[float] = []
    async for outputs in server.generate(PROMPT, params, rid):
        now = time.perf_counter()
        times += [now] * sum(len(out.new_token_ids) for out in outputs)
    return times


def test_stats_on_a_pool_of_millions_of_slots_take_milliseconds(tiny_llama: Path) -> None:
    async def run() -> tuple[list[float], ReplicaStats, ReplicaStats]:
        server = EngineServer(engine_config(tiny_llama), engine_factory=factory(NUM_SLOTS))
        try:
            await stream_times(server, "warm", 4)  # leaves its prompt in the prefix cache
            stream = asyncio.create_task(stream_times(server, "running", 200))
            while server.engine.engine.metrics().num_running == 0:
                await asyncio.sleep(0.005)
            durations = []
            for _ in range(20):
                start = time.perf_counter()
                during = await server.stats()
                durations.append(time.perf_counter() - start)
            stream.cancel()
            with pytest.raises(asyncio.CancelledError):
                await stream
            await asyncio.sleep(3 * STEP_S)  # the abort reaches the loop thread
            return durations, during, await server.stats()
        finally:
            server.engine.shutdown()

    durations, during, after = asyncio.run(run())
    assert max(durations) < 0.05, durations  # the audit of this pool takes seconds
    assert during.kv_capacity == NUM_SLOTS
    assert during.num_in_flight == 1 and during.num_rows == 1
    assert during.num_protected_tokens == len(PROMPT) - 1  # the cached prefix it locked
    assert during.num_kv_used_tokens >= len(PROMPT)  # that prefix and its own slots
    assert during.num_audits == 0 and during.integrity_error is None  # no audit by default
    assert after.num_in_flight == 0 and after.num_rows == 0
    assert after.num_protected_tokens == 0 and after.num_kv_used_tokens == 0


def test_a_stream_sees_no_gap_beyond_a_few_steps_while_reports_run(tiny_llama: Path) -> None:
    board = RecordingBoard(scrape_s=0.01)
    step_s = 0.1  # a few of them stay well under one audit of this pool (over a second)

    async def run() -> list[float]:
        server = EngineServer(engine_config(tiny_llama),
                              engine_factory=factory(NUM_SLOTS, step_s),
                              stats_board=board)  # type: ignore[arg-type]
        try:
            return await stream_times(server, "stream", 25)
        finally:
            server.engine.shutdown()

    times = asyncio.run(run())
    gaps = np.diff(times)
    assert len(times) == 25
    assert len(board.reports) >= 20  # reports ran all along (a scrape every 10 ms)
    assert gaps.max() < 4 * step_s, f"longest gap {gaps.max():.3f} s"


def test_the_audit_runs_behind_its_setting_and_only_while_idle(tiny_llama: Path) -> None:
    async def run() -> tuple[ReplicaStats, ReplicaStats, ReplicaStats, ReplicaStats]:
        server = EngineServer(engine_config(tiny_llama),
                              ReplicaSettings(debug_cache_audit=True),
                              engine_factory=factory(4096))
        try:
            stream = asyncio.create_task(stream_times(server, "a", 30))
            while server.engine.engine.metrics().num_running == 0:
                await asyncio.sleep(0.005)
            busy = await server.stats()
            await stream
            idle = await server.stats()
            again = await server.stats()  # nothing stepped since: no second audit
            # leak a page behind the manager's back; the next audit after a step names it
            await server.engine.call(lambda e: e.scheduler.cache.allocator.alloc(1))
            await stream_times(server, "b", 2)
            return busy, idle, again, await server.stats()
        finally:
            server.engine.shutdown()

    busy, idle, again, broken = asyncio.run(run())
    assert busy.num_in_flight == 1 and busy.num_audits == 0
    assert idle.num_audits == 1 and idle.integrity_error is None
    assert again.num_audits == 1
    assert broken.num_audits == 2
    assert broken.integrity_error is not None and "leaked pages" in broken.integrity_error
