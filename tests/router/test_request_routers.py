"""Serve request routers on fake replicas: the round-robin order and the cache-aware fallback."""

from __future__ import annotations

import asyncio

import pytest
import ray
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from raydix.router.serve_router import CacheAwareRequestRouter, RoundRobinRequestRouter

DEPLOYMENT = DeploymentID(name="EngineServer", app_name="unit")


class FakeReplica:
    def __init__(self, unique_id: str) -> None:
        self.replica_id = ReplicaID(unique_id, DEPLOYMENT)


def ranks(chosen: list[list[FakeReplica]]) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in chosen]


def test_round_robin_takes_replicas_in_turn() -> None:
    async def run() -> list[list[list[str]]]:
        router = RoundRobinRequestRouter(deployment_id=DEPLOYMENT,
                                         handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        replicas = [FakeReplica(u) for u in ("c", "a", "b")]
        return [ranks(await router.choose_replicas(replicas)) for _ in range(4)]  # type: ignore[arg-type]

    assert asyncio.run(run()) == [
        [["a"], ["b"], ["c"]],
        [["b"], ["c"], ["a"]],
        [["c"], ["a"], ["b"]],
        [["a"], ["b"], ["c"]],
    ]


class FakePending:
    args = ([5, 6, 7, 8], None)


def test_cache_aware_without_a_router_actor_routes_by_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The router actor does not exist: requests still get the less loaded of two random
    replicas, at once, and the blocking lookup is not repeated for every request."""
    lookups: list[str] = []

    def no_actor(name: str, namespace: str | None = None) -> None:
        lookups.append(name)
        raise ValueError(f"Failed to look up actor with name {name!r}")

    monkeypatch.setattr(ray, "get_actor", no_actor)

    async def run() -> tuple[list[list[str]], int]:
        router = CacheAwareRequestRouter(deployment_id=DEPLOYMENT,
                                         handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(decision_timeout_s=0.01)
        replicas = [FakeReplica(u) for u in ("r0", "r1", "r2")]
        chosen = ranks(await router.choose_replicas(replicas, FakePending()))  # type: ignore[arg-type]
        await router.choose_replicas(replicas, FakePending())  # type: ignore[arg-type]
        return chosen, router.num_fallbacks

    chosen, num_fallbacks = asyncio.run(run())
    assert num_fallbacks == 2
    assert lookups == ["raydix-router-unit"]  # the second request did not look again
    assert len(chosen) == 1 and len(chosen[0]) == 2 and set(chosen[0]) <= {"r0", "r1", "r2"}
