"""Faults inside replicas, and load: a rank's worker actor dies; a soak with a restart.

The package's simulated cluster and app (two nodes with two fake GPUs each, two TP=2 replicas);
this module runs before test_nodes.py. No node goes away here, so requests go over HTTP with
the openai client, through the proxy and the ingress.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest
import ray
from ray.serve.handle import DeploymentHandle

from raydix.deploy.server import ReplicaStats

from .conftest import (
    APP,
    SimCluster,
    all_replica_stats,
    replica_ranks,
    router_of,
    router_view,
    running_replica_ids,
    wait_until,
)
from .sim_requests import (
    Outcome,
    check_outcome,
    http_generate,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PREFIX = "You are a helpful assistant. Answer briefly: "  # shared: routed to one replica
NUM_STREAMS = 6
STREAM_TOKENS = 400
NUM_SOAK = 500
SOAK_CONCURRENCY = 32
SOAK_RESTART_AFTER = 200  # finished requests before one replica loses a rank



def _replaced(old_ids: set[str], num: int = 2) -> set[str] | None:
    """The running replica ids once there are `num` and none of `old_ids` is among them."""
    ids = running_replica_ids(APP)
    return ids if len(ids) == num and not ids & old_ids else None


def test_a_dead_rank_fails_its_replicas_streams_cleanly_and_serve_restarts_it(
        sim_cluster: SimCluster, engine: DeploymentHandle) -> None:
    stats = all_replica_stats(APP, 2)
    ranks = replica_ranks(engine, set(stats))
    router = router_of(APP)

    async def run() -> None:
        client = sim_cluster.client(APP)
        # a first request puts the shared prefix in one replica's cache: the streams follow it
        assert check_outcome(await http_generate(client, PREFIX + "hi", 2), 2)
        busy_id = await asyncio.to_thread(
            wait_until, lambda: next((r for r in stats if router_view(router, r)[1]), None), 30,
            "the router to learn the prefix")
        idle_id = next(r for r in stats if r != busy_id)
        started = [asyncio.Event() for _ in range(NUM_STREAMS)]
        streams = [asyncio.create_task(http_generate(client, f"{PREFIX}{i:03d}", STREAM_TOKENS,
                                                     stream=True, started=started[i]))
                   for i in range(NUM_STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)

        def counted() -> dict[str, ReplicaStats] | None:
            now = all_replica_stats(APP, 2)
            return now if now[busy_id].num_in_flight == NUM_STREAMS else None

        in_flight = await asyncio.to_thread(wait_until, counted, 30, "every stream counted")
        assert in_flight[idle_id].num_in_flight == 0
        # a follower of the busy replica dies mid-step; a rank of the idle one dies too, which
        # only the health check can notice (no step runs there)
        ray.kill(ranks[busy_id][1].worker)
        ray.kill(ranks[idle_id][0].worker)
        outcomes = await asyncio.wait_for(asyncio.gather(*streams), 60)
        # each stream had begun, and ends with an error event naming the lost engine
        assert [check_outcome(o, STREAM_TOKENS) for o in outcomes] == [False] * NUM_STREAMS
        await client.close()

    asyncio.run(run())
    new_ids = wait_until(lambda: _replaced(set(stats)), 90, "Serve to replace both replicas")
    fresh = all_replica_stats(APP, 2, timeout_s=30)
    assert set(fresh) == new_ids
    # each replacement took the GPUs its predecessor freed, on the same node
    assert sorted(s.node_id for s in fresh.values()) == sorted(s.node_id for s in stats.values())
    outcomes = asyncio.run(_run_all(sim_cluster, [(f"after {i}", 4) for i in range(8)], 8))
    assert all(check_outcome(o, 4) for o in outcomes)


def test_soak_with_a_replica_restart_ends_every_request_and_leaks_no_slot(
        sim_cluster: SimCluster, engine: DeploymentHandle) -> None:
    start_ids = set(all_replica_stats(APP, 2))
    rng = random.Random(11)
    prefixes = [f"system prompt {k} " * rng.randint(1, 4) for k in range(8)]
    work = [(rng.choice(prefixes) + "x" * rng.randint(1, 60) + str(i), rng.randint(1, 12))
            for i in range(NUM_SOAK)]
    victim_id = sorted(start_ids)[0]
    victim_rank0 = replica_ranks(engine, {victim_id})[victim_id][0].worker

    def kill() -> None:
        ray.kill(victim_rank0)

    outcomes = asyncio.run(_run_all(sim_cluster, work, SOAK_CONCURRENCY,
                                    (SOAK_RESTART_AFTER, kill)))
    ok = [check_outcome(o, n) for o, (_, n) in zip(outcomes, work, strict=True)]
    # only requests in flight on the replica that lost its rank may fail
    assert ok.count(False) <= SOAK_CONCURRENCY
    wait_until(lambda: _replaced({victim_id}), 90, "Serve to restart the replica")

    def settled() -> dict[str, ReplicaStats] | None:
        stats = all_replica_stats(APP, 2)
        idle = all(s.num_in_flight == 0 and s.metrics.num_running == 0
                   and s.metrics.num_waiting == 0 for s in stats.values())
        return stats if idle else None

    stats = wait_until(settled, 30, "every replica to be idle")
    survivor = next(s for r, s in stats.items() if r in start_ids)
    assert survivor.metrics.num_finished >= NUM_SOAK // 4  # it carried the load meanwhile
    for s in stats.values():
        assert s.num_audits > 0 and s.integrity_error is None
        assert s.num_rows == 0  # every finished or failed request gave its row back
        assert s.num_protected_tokens == 0  # and unlocked its cached prefix


async def _run_all(sim_cluster: SimCluster, work: list[tuple[str, int]], concurrency: int,
                   event: tuple[int, Callable[[], None]] | None = None) -> list[Outcome]:
    """Run (prompt, max_new_tokens) completions over HTTP, `concurrency` at a time, within a
    bound; after `event[0]` have ended, call `event[1]` once."""
    client = sim_cluster.client(APP)
    gate = asyncio.Semaphore(concurrency)
    num_done = 0

    async def one(prompt: str, max_new_tokens: int) -> Outcome:
        nonlocal num_done
        async with gate:
            outcome = await http_generate(client, prompt, max_new_tokens)
        num_done += 1
        if event is not None and num_done == event[0]:
            event[1]()
        return outcome

    try:
        return list(await asyncio.wait_for(asyncio.gather(*(one(p, n) for p, n in work)), 240))
    finally:
        await client.close()
