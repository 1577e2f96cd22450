"""Serve request routers on fake replicas: the round-robin order, the cache-aware fallback, and
which request gets the replica chosen for it."""

from __future__ import annotations

import asyncio

import pytest
import ray
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

from raydix.router.serve_router import (
    HOLDER_TRIES,
    CacheAwareRequestRouter,
    RoundRobinRequestRouter,
)

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
    args = ([5, 6, 7, 8], None, "rid-5")  # EngineServer.generate's prompt, params, request id


def route_twice(decision_timeout_s: float) -> tuple[list[list[str]], int]:
    """Two requests through a fresh cache-aware router over replicas r0..r2: the first one's
    ranks, and the number of requests routed by load instead of by the router actor."""

    async def run() -> tuple[list[list[str]], int]:
        router = CacheAwareRequestRouter(deployment_id=DEPLOYMENT,
                                         handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(decision_timeout_s=decision_timeout_s)
        replicas = [FakeReplica(u) for u in ("r0", "r1", "r2")]
        chosen = ranks(await router.choose_replicas(replicas, FakePending()))  # type: ignore[arg-type]
        await router.choose_replicas(replicas, FakePending())  # type: ignore[arg-type]
        return chosen, router.num_fallbacks

    return asyncio.run(run())


def fake_router_actor(monkeypatch: pytest.MonkeyPatch, replica: str) -> list[tuple[object, ...]]:
    """A router actor that always chooses `replica`; returns the arguments of each `route`."""
    asked: list[tuple[object, ...]] = []

    class Decision:
        def __init__(self) -> None:
            self.replica = replica

    async def decided() -> Decision:
        return Decision()

    class FakeRoute:
        def remote(self, *args: object) -> object:
            asked.append(args)
            return decided()

    class FakeActor:
        route = FakeRoute()

    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: FakeActor())
    return asked


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
    chosen, num_fallbacks = route_twice(decision_timeout_s=0.01)
    assert num_fallbacks == 2
    assert lookups == ["raydix-router-unit"]  # the second request did not look again
    assert len(chosen) == 1 and len(chosen[0]) == 2 and set(chosen[0]) <= {"r0", "r1", "r2"}


def test_cache_aware_offers_the_chosen_replica_first_then_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The router actor's choice is tried `HOLDER_TRIES` times (Serve moves on when a replica
    misses its queue-length deadline or is full), then every other replica."""
    asked = fake_router_actor(monkeypatch, "r1")
    chosen, num_fallbacks = route_twice(decision_timeout_s=1.0)
    assert num_fallbacks == 0
    assert chosen == [["r1"]] * HOLDER_TRIES + [["r0", "r2"]]
    assert HOLDER_TRIES >= 2
    # the request's id goes with it: the replica that receives it reports it back
    assert [a[3] for a in asked] == ["rid-5", "rid-5"]


class QueuedReplica(FakeReplica):
    """A replica that answers Serve's queue-length probe: empty."""

    max_ongoing_requests = 8

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


class PrefixActor:
    """A router actor that sends prompt [1, ...] to r1, answering after 0.2 s, and prompt
    [7, ...] to r2 at once: the newer request is decided while the older one waits."""

    class Decision:
        def __init__(self, replica: str) -> None:
            self.replica = replica

    class Route:
        def remote(self, prompt: object, extra_key: object, candidates: object,
                   request_id: object = None) -> object:
            first = int(prompt[0])  # type: ignore[index]

            async def decide() -> PrefixActor.Decision:
                await asyncio.sleep(0.2 if first == 1 else 0.0)
                return PrefixActor.Decision({1: "r1", 7: "r2"}[first])

            return decide()

    class SetReplicas:
        def remote(self, names: object) -> None:
            return None

    route = Route()
    set_replicas = SetReplicas()


@pytest.mark.parametrize("same_api_request", [False, True])
def test_cache_aware_gives_each_request_the_replica_chosen_for_it(
    monkeypatch: pytest.MonkeyPatch, same_api_request: bool,
) -> None:
    """Two requests wait at once, through Serve's own routing loop; the newer one is decided
    first. Each must reach the replica chosen for its own prompt: not the oldest request
    (FIFOMixin gave r2 to both), and not when both are calls of one API request (n=2), which
    share Serve's internal request id (Serve's default matching gave the newer call's replica
    to the older one and left the newer one waiting for ever)."""
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: PrefixActor())

    async def run() -> tuple[list[str], int]:
        router = CacheAwareRequestRouter(deployment_id=DEPLOYMENT,
                                         handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(decision_timeout_s=5.0)
        router.update_replicas([QueuedReplica(u) for u in ("r0", "r1", "r2")])  # type: ignore[list-item]
        older, newer = (
            PendingRequest(args=[prompt, None], kwargs={},
                           metadata=RequestMetadata(f"call-{prompt[0]}", api_id))
            for prompt, api_id in (([1, 2, 3], "api-1"),
                                   ([7, 8, 9], "api-1" if same_api_request else "api-2")))
        routed = await asyncio.wait_for(asyncio.gather(
            router._choose_replica_for_request(older),
            router._choose_replica_for_request(newer)), timeout=5.0)
        return [r.replica_id.unique_id for r in routed], len(router._pending_by_metadata)

    assert asyncio.run(run()) == (["r1", "r2"], 0)


def test_ray_prefix_router_gives_each_call_of_one_api_request_its_own_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bench's baseline (Ray Serve LLM's prefix router) matches like the cache-aware one:
    two engine calls of one n=2 request share Serve's internal request id, and with Serve's
    default matching the newer call's replica went to the older call and the newer one
    waited for ever. Ray's tree is stood in for by a choice per prompt (r1 for [1, ...] after
    0.2 s, r2 for [7, ...] at once), so the newer call is decided first."""
    from raydix.router.ray_prefix import RayPrefixAffinityRouter

    async def best(self: object, pending: PendingRequest, candidates: list[FakeReplica]
                   ) -> list[list[FakeReplica]]:
        first = int(pending.args[0][0])
        await asyncio.sleep(0.2 if first == 1 else 0.0)
        wanted = {1: "r1", 7: "r2"}[first]
        return [[r for r in candidates if r.replica_id.unique_id == wanted]]

    monkeypatch.setattr(RayPrefixAffinityRouter, "_prefix_match_best_replicas", best)

    class FakeTree:  # Ray's tree actor: replicas join it as tenants
        class AddTenants:
            def remote(self, *args: object) -> None:
                return None

        add_tenants = AddTenants()

    monkeypatch.setattr(ray, "get", lambda value: value)  # the fake's answers are plain values

    class LocatedReplica(QueuedReplica):  # what Ray's locality and multiplex mixins read
        multiplexed_model_ids: frozenset[str] = frozenset()
        node_id = ""
        availability_zone = None

    async def run() -> list[str]:
        router = RayPrefixAffinityRouter(deployment_id=DEPLOYMENT,
                                         handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(tree_actor=FakeTree())  # type: ignore[arg-type]
        router.update_replicas([LocatedReplica(u) for u in ("r0", "r1", "r2")])  # type: ignore[list-item]
        older, newer = (
            PendingRequest(args=[prompt, None], kwargs={},
                           metadata=RequestMetadata(f"call-{prompt[0]}", "api-1"))
            for prompt in ([1, 2, 3], [7, 8, 9]))
        routed = await asyncio.wait_for(asyncio.gather(
            router._choose_replica_for_request(older),
            router._choose_replica_for_request(newer)), timeout=5.0)
        return [r.replica_id.unique_id for r in routed]

    assert asyncio.run(run()) == ["r1", "r2"]


@pytest.mark.parametrize("sole_replica, candidates, asks", [
    (True, ("r0",), False),  # one replica that can't grow: no choice, no round trip
    (True, ("r0", "r1"), True),  # a rolling update's second replica: a choice again
    (False, ("r0",), True),  # autoscaled, or the second of two not up yet: decisions count
])
def test_cache_aware_asks_the_actor_only_when_there_is_a_choice(
    monkeypatch: pytest.MonkeyPatch, sole_replica: bool, candidates: tuple[str, ...],
    asks: bool,
) -> None:
    asked = fake_router_actor(monkeypatch, candidates[-1])

    async def run() -> tuple[list[list[str]], int]:
        router = CacheAwareRequestRouter(deployment_id=DEPLOYMENT,
                                         handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(decision_timeout_s=1.0, sole_replica=sole_replica)
        replicas = [FakeReplica(u) for u in candidates]
        chosen = ranks(await router.choose_replicas(replicas, FakePending()))  # type: ignore[arg-type]
        return chosen, router.num_sole

    chosen, num_sole = asyncio.run(run())
    assert bool(asked) == asks and num_sole == (0 if asks else 1)
    assert chosen[0] == [candidates[-1]]
