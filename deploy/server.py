"""The engine deployment: each Serve replica hosts one engine behind an `AsyncEngine`.

Placement: with GPU bundles, the replica's placement group is one CPU bundle (this actor) plus
one GPU bundle per rank, STRICT_PACK, and the ranks' worker actors go into bundles 1..tp. A
replica with tp 1 runs its one rank itself (a `LocalExecutor`, no placement group): on a machine
without GPUs, and on CUDA where the app placed it so (`engine_placement`: the replica reserves the
GPU, Ray sets its CUDA_VISIBLE_DEVICES, no worker actor and no Ray call per step); on the CPU with
tp > 1 the ranks take one CPU bundle each.

The engine itself comes from an `EngineFactory`, so tests can serve a different engine. With
`engine_process` (the app's default), a replica whose one rank would run in its own process (the
CPU's, or the GPU it reserved) runs the engine in a child process instead
(`raydix.engine.engine_process`; it inherits the replica's environment, CUDA_VISIBLE_DEVICES
included): the factory is sent there by cloudpickle and runs outside Serve (the replica's id is in
its environment as `RAYDIX_REPLICA_ID`), the thread setting applies there, and the replica streams
the outputs.

With the cache-aware router (`routing` set), a `ReplicaReporter` task on the replica's event loop
sends the replica's load to the application's router actor (made here by the first replica, so it
carries the application's name and page size). In exact mode (`router_events`) the engine also
publishes its radix-cache events into an `EventBuffer`, which the reporter sends along, and the
engine sends its whole cache again when the router asks (after a router restart or lost events);
a router actor that died for good is got again with the same arguments (`ReplicaReporter`).

Faults: a replica whose engine can't step any more (its loop stopped, or a rank died) is of no
use, and Serve's health check would notice only after several periods, while routers keep
sending it requests. So the replica fails every request in flight with `EngineDeadError`, and
a moment later (`EXIT_GRACE_S`, for those errors to reach the callers) ends its own actor:
routers drop it at once, Serve starts a replacement, and its worker actors die with it.
`check_health` also asks every rank (without blocking the event loop), so a rank that died
while the replica was idle is noticed too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import ray
from ray import cloudpickle, serve
from ray.actor import ActorHandle
from ray.serve.handle import DeploymentHandle

from raydix.cache import EventBuffer
from raydix.cluster.actor_heap import freeze_actor_heap
from raydix.engine.async_engine import AsyncEngine, EngineClient
from raydix.engine.config import EngineConfig
from raydix.engine.engine import Engine
from raydix.engine.engine_process import ProcessEngine, engine_process_pid
from raydix.engine.executor import UnhealthyRanksError
from raydix.engine.request import GenerationParams, RequestOutput, with_engine_ttft
from raydix.router.actor import get_or_create_router
from raydix.router.policy import RoutingPolicyConfig
from raydix.router.priority import take_normal_priority
from raydix.router.reporter import LoadReport, ReplicaReporter

from .cpu_threads import use_cpu_threads
from .engine_factory import (
    EngineFactory,
    ReplicaSettings,
    build_engine,
    engine_process_env,
    runs_in_engine_process,
)
from .replica_facts import ReplicaFacts, StartupLog, replica_facts
from .replica_stats import CacheAudit, ReplicaStats, read_stats, report_loop
from .serve_env import local_handle

if TYPE_CHECKING:
    from raydix.cluster.worker_actor import WorkerActor

    from .stats_board import StatsBoard

# ReplicaSettings, EngineFactory and build_engine live in engine_factory.py (the engine process
# imports them without Ray) and are named here too, where the deployment's callers look
__all__ = ["EngineFactory", "EngineServer", "RankInfo", "ReplicaSettings", "ReplicaStats",
           "build_engine"]

DEFAULT_SETTINGS = ReplicaSettings()

logger = logging.getLogger(__name__)

EXIT_GRACE_S = 1.0  # after its engine failed, the replica lives this long to send the errors
# the replica's id, in its engine process's environment (an engine factory runs there, outside
# Serve: `serve.get_replica_context()` is not available to it)
REPLICA_ID_ENV = "RAYDIX_REPLICA_ID"


class RankInfo(NamedTuple):
    """One rank of a replica, for health tools and tests."""

    replica_id: str
    tp_rank: int
    node_id: str
    worker: ActorHandle[WorkerActor] | None  # None: the rank runs inside the replica (tp 1 without Ray)


def _replica_id() -> str:
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside Serve (direct use in tests)
        return uuid.uuid4().hex[:8]


def _node_id() -> str:
    if not ray.is_initialized():  # direct use in tests: asking would start a Ray
        return ""
    return str(ray.get_runtime_context().get_node_id())


def _app_name() -> str:
    try:
        return str(serve.get_replica_context().app_name)
    except Exception:  # outside Serve
        return "default"


class EngineServer:
    """One engine replica. Streams `RequestOutput` lists per request through its handle."""

    def __init__(self, engine_config: EngineConfig,
                 settings: ReplicaSettings = DEFAULT_SETTINGS,
                 engine_factory: EngineFactory = build_engine,
                 stats_board: DeploymentHandle[StatsBoard] | None = None,
                 routing: RoutingPolicyConfig | None = None) -> None:
        self.replica_id = _replica_id()
        self._audit = CacheAudit(settings.debug_cache_audit)
        events = EventBuffer() if routing is not None and settings.router_events else None
        loop = asyncio.get_running_loop()  # the constructor runs on the replica's event loop
        self._leaving: asyncio.Task[None] | None = None

        def engine_failed(error: BaseException) -> None:  # on the engine's loop thread
            loop.call_soon_threadsafe(self._leave, f"its engine stopped: {error!r}")

        start = time.perf_counter()
        self.engine: EngineClient
        with StartupLog() as startup:
            own_process = runs_in_engine_process(engine_config, settings)
            setup = None
            was_nice = os.getpriority(os.PRIO_PROCESS, 0)
            if settings.cpu_threads is not None:
                model = engine_config.worker.model_path if settings.fit_threads_to_model else None
                if own_process:  # the threads are the child's
                    was_nice = take_normal_priority("the engine replica")
                    setup = functools.partial(use_cpu_threads, settings.cpu_threads, model)
                else:
                    was_nice = use_cpu_threads(settings.cpu_threads, model)
            elif own_process:  # a GPU's rank: its host work is each step's critical path
                was_nice = take_normal_priority("the engine replica")
            if was_nice != os.getpriority(os.PRIO_PROCESS, 0):
                logger.info("priority: nice %d -> 0", was_nice)
            if own_process:
                # the engine process inherits this process's priority (nice 0 by now)
                self.engine = ProcessEngine(
                    functools.partial(engine_factory, engine_config, settings), events, setup,
                    max_waiting_requests=settings.max_waiting_requests, on_error=engine_failed,
                    stream_interval=settings.stream_interval, dumps=cloudpickle.dumps,
                    env={REPLICA_ID_ENV: self.replica_id, **engine_process_env(engine_config)})
            else:
                # built on the engine's loop thread, which steps it: one OpenMP team
                # (async_engine.py)
                self.engine = AsyncEngine(
                    functools.partial(engine_factory, engine_config, settings, events),
                    max_waiting_requests=settings.max_waiting_requests, on_error=engine_failed,
                    stream_interval=settings.stream_interval)
        rank = self.engine.engine.rank_facts()
        self.facts = replica_facts(
            self.replica_id, engine_config, rank.dtype, rank.kv_pool_tokens,
            rank.cpu_threads if settings.cpu_threads is not None else None,
            time.perf_counter() - start, startup.lines, engine_process_pid(self.engine))
        self.node_id = _node_id()
        self.ranks_info = tuple(
            RankInfo(self.replica_id, r.tp_rank, r.node_id or self.node_id, r.worker)
            for r in self.engine.engine.ranks())
        self._reporter: asyncio.Task[None] | None = None
        if stats_board is not None:
            self._reporter = loop.create_task(report_loop(self.stats, local_handle(stats_board)))
        self._router_reporter: asyncio.Task[None] | None = None
        self._kv_capacity = 0
        # ids of the requests received since the last load read (None: no router to tell)
        self._received: list[str] | None = None
        if routing is not None:
            self._received = []
            self._kv_capacity = self.engine.engine.cache_stats().kv_capacity
            get_router = functools.partial(
                get_or_create_router, _app_name(), engine_config.scheduler.page_size, routing,
                exact=events is not None, max_approx_tokens=settings.router_approx_tokens)
            reporter = ReplicaReporter(
                get_router(), self.replica_id, events.drain if events is not None else lambda: (),
                self._load, publish_snapshot=self._publish_snapshot if events is not None else None,
                get_router=get_router)
            self._router_reporter = loop.create_task(reporter.run())
        freeze_actor_heap("the engine replica")

    async def _publish_snapshot(self) -> None:
        """The router lost track of this replica's cache: send all of it again as events."""
        await self.engine.call(Engine.publish_cache_snapshot)

    def _load(self) -> LoadReport:
        """Read on the event loop while the loop thread steps: counters and sizes, no locks;
        a torn read is off by a step and the next report corrects it. Waiting includes the
        requests not yet taken by the engine, which is busy with a step."""
        running, waiting = self.engine.running_and_waiting()
        received: tuple[str, ...] = ()
        if self._received:
            received, self._received[:] = tuple(self._received), []
        return LoadReport(running, waiting, self.engine.metrics().token_usage, self._kv_capacity,
                          received)

    async def generate(self, prompt_ids: Sequence[int], params: GenerationParams,
                       rid: str) -> AsyncIterator[list[RequestOutput]]:
        received = time.perf_counter()
        if self._received is not None:  # counted in the engine's waiting requests from here
            self._received.append(rid)
        first = True
        async for outputs in self.engine.generate(prompt_ids, params, rid):
            if first and any(out.new_token_ids for out in outputs):
                first = False
                outputs = with_engine_ttft(outputs, time.perf_counter() - received)
            yield outputs

    async def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    async def stats(self) -> ReplicaStats:
        """This replica's counters, read without waiting for a step (`replica_stats.py`);
        with `debug_cache_audit`, a call made while idle audits the cache first."""
        await self._audit.run_if_idle(self.engine)
        return read_stats(self.replica_id, self.engine, self._audit, self.node_id,
                          tuple(r.node_id for r in self.ranks_info))

    async def start_facts(self) -> ReplicaFacts:
        """What this replica started with (for the `raydix serve` process to print)."""
        return self.facts

    async def ranks(self) -> tuple[RankInfo, ...]:
        """This replica's ranks: where each runs, and its worker actor."""
        return self.ranks_info

    async def ping(self) -> bool:
        """For /health: True while the engine loop runs."""
        if not self.engine.is_alive:
            raise RuntimeError("the engine loop is not running")
        return True

    async def check_health(self) -> None:
        """Serve's health check: the engine loop must run and every rank must answer. A rank
        that died also makes the replica leave (see the module's docstring); one that is only
        slow or unreachable is left to Serve's count of failed checks."""
        if not self.engine.is_alive:
            raise RuntimeError(f"replica {self.replica_id}: the engine loop is not running")
        try:
            await self.engine.check_ranks()
        except UnhealthyRanksError as e:
            if e.permanent:
                self._leave(str(e))
            raise RuntimeError(f"replica {self.replica_id}: {e}") from e

    def _leave(self, reason: str) -> None:
        """End this replica soon (once): its engine can't serve any more."""
        if self._leaving is None:
            logger.error("replica %s is leaving: %s", self.replica_id, reason)
            self._leaving = asyncio.get_running_loop().create_task(self._exit_after_grace())

    async def _exit_after_grace(self) -> None:
        await asyncio.sleep(EXIT_GRACE_S)
        try:
            actor = ray.get_runtime_context().current_actor
        except RuntimeError:  # not inside an actor (direct use in tests)
            return
        ray.kill(actor, no_restart=True)

    def __del__(self) -> None:
        for name in ("_reporter", "_router_reporter"):
            reporter = getattr(self, name, None)
            if reporter is not None:
                with contextlib.suppress(RuntimeError):  # the loop may be closed already
                    reporter.cancel()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
