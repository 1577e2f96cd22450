"""The named router actor on a local Ray: one per application, fed events, answering routes."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest
import ray
from ray.serve import Application, RunTarget

from raydix.cache import EventBuffer, RadixCache
from raydix.router.actor import get_or_create_router, get_router
from raydix.router.lifetime import RouterLifetimeConfig
from tests.serve_apps import delete_apps, run_apps

pytestmark = pytest.mark.ray


def test_router_actor_routes_by_published_events(ray_local: None) -> None:
    router = get_or_create_router("unit", page_size=2)
    assert get_or_create_router("unit", page_size=2)._actor_id == router._actor_id
    assert get_router("unit")._actor_id == router._actor_id
    buffer = EventBuffer()
    cache = RadixCache(page_size=2, event_sink=buffer)
    cache.insert(list(range(100, 140)), list(range(2, 42)))
    ray.get(router.set_replicas.remote(["r0", "r1"]))
    ray.get(router.publish.remote("r1", buffer.drain()))
    decision = ray.get(router.route.remote(list(range(100, 150)), None, ["r0", "r1"]))
    assert (decision.replica, decision.matched_len) == ("r1", 40)
    stats = ray.get(router.stats.remote())
    assert stats["hit_rate:r1"] == 40 / 50 and stats["decision_p99_us"] > 0
    ray.kill(router, no_restart=True)


def test_router_actor_runs_at_normal_priority(ray_local: None) -> None:
    """Ray starts its workers at nice 15; the router actor, on every request's path, takes
    back nice 0 so busy engine replicas do not starve it."""
    def nice(_: object = None) -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    assert ray.get(ray.remote(nice).remote()) > 0  # a plain Ray worker
    router = get_or_create_router("priority", page_size=1)
    assert ray.get(router.__ray_call__.remote(nice)) == 0
    ray.kill(router, no_restart=True)


def test_reporter_feeds_events_and_load_to_the_router(ray_local: None) -> None:
    from raydix.router.reporter import LoadReport, ReplicaReporter

    router = get_or_create_router("reporter", page_size=1)
    ray.get(router.set_replicas.remote(["r0", "r1"]))
    buffers = {r: EventBuffer() for r in ("r0", "r1")}
    caches = {r: RadixCache(event_sink=buffers[r]) for r in ("r0", "r1")}
    loads = {"r0": LoadReport(0, 0, 0.0), "r1": LoadReport(0, 0, 0.0)}
    reporters = {
        r: ReplicaReporter(router, r, buffers[r].drain, lambda r=r: loads[r]) for r in buffers
    }
    caches["r0"].insert(list(range(50, 80)), list(range(1, 31)))
    # r0: the CLEARED event at start, then the insert; r1: its CLEARED. Both follow on from the
    # start, so the router asks neither for a snapshot.
    assert ray.get(reporters["r0"].report_once()) is False
    assert ray.get(reporters["r1"].report_once()) is False
    assert reporters["r0"].report_once() is None  # nothing new, and the heartbeat is not due
    decision = ray.get(router.route.remote(list(range(50, 90)), None, ["r0", "r1"]))
    assert (decision.replica, decision.matched_len) == ("r0", 30)
    # r0 becomes overloaded: the next prompt with the same prefix goes to r1
    loads["r0"] = LoadReport(60, 20, 0.9)
    reporters["r0"].report_once()
    decision = ray.get(router.route.remote(list(range(50, 90)), None, ["r0", "r1"]))
    assert decision.replica == "r1" and decision.reason == "balance"
    ray.kill(router, no_restart=True)


def test_a_restarted_router_gets_the_replicas_cache_back(ray_local: None) -> None:
    """The router actor restarts empty. The replica's next events do not follow on from
    anything it has, so it asks for the snapshot, and the tree holds the replica's cache again,
    including what was cached before the restart."""
    import asyncio

    from raydix.router.reporter import LoadReport, ReplicaReporter

    router = get_or_create_router("resync", page_size=1)
    ray.get(router.set_replicas.remote(["r0"]))
    buffer = EventBuffer()
    cache = RadixCache(event_sink=buffer)

    async def snapshot() -> None:
        cache.publish_snapshot()

    reporter = ReplicaReporter(router, "r0", buffer.drain, lambda: LoadReport(0, 0, 0.0),
                               publish_snapshot=snapshot, snapshot_interval_s=0.0)

    def report() -> None:
        asyncio.run(reporter._follow_up(reporter.report_once()))

    before = list(range(300, 340))
    cache.insert(before, list(range(1, 41)))
    report()
    assert reporter.num_snapshots == 0
    ray.kill(router, no_restart=False)  # max_restarts=-1: the same name, a fresh state
    deadline = time.monotonic() + 60
    while True:
        try:
            if ray.get(router.replica_ids.remote(), timeout=5) == []:
                break
        except ray.exceptions.RayError:
            pass
        assert time.monotonic() < deadline, "the router actor did not come back"
        time.sleep(0.2)
    # the request router registers the replicas it routes among
    assert ray.get(router.route.remote(before, None, ["r0"])).matched_len == 0
    cache.insert(list(range(500, 520)), list(range(41, 61)))
    report()  # the insert's seq does not follow on: the router asks, the snapshot is buffered
    assert reporter.num_snapshots == 1
    report()  # the snapshot reaches the router
    assert reporter.num_snapshots == 1
    assert ray.get(router.route.remote(before + [7], None, ["r0"])).matched_len == len(before)
    assert ray.get(router.route.remote(list(range(500, 520)), None, ["r0"])).matched_len == 20
    ray.kill(router, no_restart=True)


def test_a_reporter_whose_router_was_killed_finds_a_new_one(ray_local: None) -> None:
    """A router actor that died for good (ActorDiedError on the reporter's call) is taken again
    from the reporter's factory, which makes a new one, and the cache reaches it whole."""
    import asyncio

    from raydix.router.reporter import LoadReport, ReplicaReporter

    dead = get_or_create_router("reconnect", page_size=1)
    ray.kill(dead, no_restart=True)
    deadline = time.monotonic() + 30
    while True:  # the name is freed once the actor is gone
        try:
            get_router("reconnect")
        except ValueError:
            break
        assert time.monotonic() < deadline, "the killed router kept its name"
        time.sleep(0.1)

    def make_router() -> ray.actor.ActorHandle:
        router = get_or_create_router("reconnect", page_size=1)
        router.set_replicas.remote(["r0"])  # as the request router would
        return router

    buffer = EventBuffer()
    cache = RadixCache(event_sink=buffer)
    cache.insert(list(range(300, 340)), list(range(1, 41)))

    async def snapshot() -> None:
        cache.publish_snapshot()

    reporter = ReplicaReporter(dead, "r0", buffer.drain, lambda: LoadReport(0, 0, 0.0),
                               period_s=0.01, publish_snapshot=snapshot, get_router=make_router)

    async def run_until_reconnected() -> None:
        task = asyncio.create_task(reporter.run())
        while reporter.num_reconnects == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the snapshot's events go in the next report
        task.cancel()

    deadline = time.monotonic() + 30
    asyncio.run(run_until_reconnected())
    assert reporter.num_reconnects == 1 and reporter.num_snapshots == 1
    router = get_router("reconnect")
    assert ray.get(router.route.remote(list(range(300, 341)), None, ["r0"])).matched_len == 40
    ray.kill(router, no_restart=True)


@pytest.fixture(scope="module")
def noop_app(ray_local: None) -> Iterator[Application]:
    from ray import serve

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class Noop:
        def __call__(self) -> str:
            return "ok"

    yield Noop.bind()
    serve.shutdown()


def _gone(app_name: str, within_s: float) -> bool:
    """The app's router actor ended for good within `within_s` (a restart would keep the name)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            get_router(app_name)
        except ValueError:
            return True
        time.sleep(0.1)
    return False


def test_a_redeployed_app_finds_its_router(noop_app: Application) -> None:
    """Deleted and deployed again within the grace period, the app's new replica gets the same
    router actor back, and it routes."""
    lifetime = RouterLifetimeConfig(check_s=0.1, grace_s=30.0)
    run_apps(RunTarget(noop_app, name="again", route_prefix="/again"))
    router = get_or_create_router("again", page_size=1, lifetime=lifetime)
    ray.get(router.report_load.remote("r0", 0, 0, 0.0))
    delete_apps("again")
    run_apps(RunTarget(noop_app, name="again", route_prefix="/again"))
    again = get_or_create_router("again", page_size=1, lifetime=lifetime)
    assert again._actor_id == router._actor_id
    assert ray.get(again.route.remote(list(range(8)), None, ["r1"])).replica == "r1"
    delete_apps("again")
    ray.kill(again, no_restart=True)


def test_the_router_ends_with_its_app_and_not_before(noop_app: Application) -> None:
    """Silent replicas (one restarting, loading its model) leave the router alone while Serve
    has the app; once the app is deleted, or Serve shut down, the router ends within
    grace_s + check_s. A redeploy after that makes a fresh router that works."""
    from ray import serve

    lifetime = RouterLifetimeConfig(check_s=0.1, grace_s=0.5)
    run_apps(RunTarget(noop_app, name="lived", route_prefix="/lived"))
    router = get_or_create_router("lived", page_size=1, lifetime=lifetime)
    ray.get(router.set_replicas.remote(["r0"]))
    time.sleep(1.5)  # three grace periods without a report: Serve still has the app
    assert ray.get(router.replica_ids.remote()) == ["r0"]
    delete_apps("lived")
    assert _gone("lived", within_s=10), "the router outlived its deleted app"

    run_apps(RunTarget(noop_app, name="lived", route_prefix="/lived"))
    fresh = get_or_create_router("lived", page_size=1, lifetime=lifetime)
    assert fresh._actor_id != router._actor_id
    time.sleep(1.0)
    assert ray.get(fresh.route.remote(list(range(8)), None, ["r1"])).replica == "r1"
    serve.shutdown()
    assert _gone("lived", within_s=10), "the router outlived Serve"
