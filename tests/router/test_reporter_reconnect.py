"""A reporter whose router actor died for good (it ended itself as its app was deployed again)
takes the application's router again from its factory, reports to the new one, and sends it the
whole cache, which the new router applies as this replica's entries."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from ray.exceptions import ActorDiedError

from raydix.cache import EventBuffer, RadixCache
from raydix.router.reporter import LoadReport, ReplicaReporter
from raydix.router.state import RouterState


class _Answer:
    """What awaiting a call on a dead actor does: raise `ActorDiedError`."""

    def __await__(self) -> Any:
        raise ActorDiedError()
        yield  # a generator


class _DeadMethod:
    def remote(self, *args: Any) -> _Answer:
        return _Answer()


class _DeadRouter:
    publish = report_load = _DeadMethod()


class _Method:
    def __init__(self, router: _LiveRouter, name: str) -> None:
        self.router, self.name = router, name

    def remote(self, *args: Any) -> Any:
        result = getattr(self.router.state, self.name)(*args)
        future = asyncio.get_running_loop().create_future()
        future.set_result(result)
        return future


class _LiveRouter:
    """A new router actor: a fresh `RouterState` that lists the replica."""

    def __init__(self) -> None:
        self.state = RouterState(page_size=1)
        self.state.set_replicas(["r0"])
        self.publish = _Method(self, "publish")
        self.report_load = _Method(self, "report_load")


def test_a_reporter_whose_router_died_takes_the_new_one_and_sends_it_the_whole_cache() -> None:
    buffer = EventBuffer()
    cache = RadixCache(event_sink=buffer)
    cache.insert([5, 6, 7], [1, 2, 3])
    cache.insert([5, 6, 8, 9], [1, 2, 4, 5])
    new_router = _LiveRouter()
    made: list[_LiveRouter] = []

    def get_router() -> _LiveRouter:
        made.append(new_router)
        return new_router

    async def publish_snapshot() -> None:
        cache.publish_snapshot()

    reporter = ReplicaReporter(
        _DeadRouter(), "r0", buffer.drain, lambda: LoadReport(2, 1, 0.5, 4096),  # type: ignore[arg-type]
        period_s=0.001, publish_snapshot=publish_snapshot, heartbeat_s=0.0,
        get_router=get_router)  # type: ignore[arg-type]

    async def main() -> None:
        task = asyncio.create_task(reporter.run())
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(main())
    assert made == [new_router]  # once, and kept
    assert reporter.router is new_router and reporter.num_snapshots == 1
    state = new_router.state
    load = state.replicas["r0"]
    assert (load.num_running, load.fullness.num_waiting, load.kv_capacity) == (2, 1, 4096)
    assert not load.needs_snapshot
    for tokens in ([5, 6, 7], [5, 6, 8, 9]):  # the cache the dead router had been sent
        assert state.tree.match(np.asarray(tokens, np.int32), None) == {"r0": len(tokens)}


class _SilentMethod:
    def remote(self, *args: Any) -> Any:
        return asyncio.get_running_loop().create_future()  # never answered


class _SlowRouter:
    """A router actor still starting: its answers do not come."""

    publish = report_load = _SilentMethod()


def test_a_router_that_does_not_answer_in_time_gets_one_line_and_reports_go_on(
        caplog: Any) -> None:
    reporter = ReplicaReporter(
        _SlowRouter(), "r0", lambda: (), lambda: LoadReport(0, 0, 0.0, 4096),  # type: ignore[arg-type]
        period_s=0.001, heartbeat_s=0.0, answer_timeout_s=0.02)

    async def main() -> None:
        task = asyncio.create_task(reporter.run())
        await asyncio.sleep(0.1)
        task.cancel()

    with caplog.at_level("WARNING", logger="raydix.router.reporter"):
        asyncio.run(main())
    lines = [r for r in caplog.records if "did not answer" in r.getMessage()]
    assert len(lines) >= 2  # each timed-out report, and the loop went on after the first
    assert all(r.exc_info is None for r in caplog.records)  # no traceback in the log
