"""The named router actor on a local Ray: one per application, fed events, answering routes."""

from __future__ import annotations

import os
from collections.abc import Iterator

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest
import ray

from raydix.cache import EventBuffer, RadixCache
from raydix.router.actor import get_or_create_router, router_actor_name

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_router_actor_routes_by_published_events(ray_local: None) -> None:
    router = get_or_create_router("unit", page_size=2)
    assert get_or_create_router("unit", page_size=2)._actor_id == router._actor_id
    assert ray.get_actor(router_actor_name("unit"))._actor_id == router._actor_id
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
