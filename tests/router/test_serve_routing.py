"""The cache-aware router inside the real Serve app: 3 engine replicas of a tiny random model.

Requests go through the engine deployment's handle with token ids (what the ingress sends after
tokenizing), so the test knows each request's group. Each replica's engine writes the ids of the
requests it admits to a file named after the replica, which tells where every request ran.
Requests are sent one at a time with a short pause, so the replicas' cache events (reported
every 50 ms) reach the router between them, as they do for clients arriving over time.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import ray

from raydix.router.actor import get_router

from . import routing_app
from .routing_app import APP, VOCAB, Cluster, free_port, generate, send, tiny_model

pytestmark = pytest.mark.ray

NUM_GROUPS, PER_GROUP, PREFIX_LEN = 3, 8, 64


@pytest.fixture(scope="module")
def cluster(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The package's Ray (conftest.py: one logical CPU per replica, 3 then 4; Ray's CPUs are
    only a count on this machine), Serve on it, and the app with 3 replicas."""
    from ray import cloudpickle, serve

    model = tiny_model(tmp_path_factory.mktemp("tiny-words"))
    cloudpickle.register_pickle_by_value(routing_app)  # replicas can't import tests
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        c = Cluster(model, tmp_path_factory.mktemp("placements"), port)
        c.deploy(replicas=3)
        yield c
    finally:
        serve.shutdown()


def workload(seed: int, num_groups: int, per_group: int) -> list[tuple[int, list[int]]]:
    """(group, prompt) pairs, shuffled: a 64-token prefix per group and an 8-24-token question."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(2, VOCAB, PREFIX_LEN).tolist() for _ in range(num_groups)]
    items = [(g, prefixes[g] + rng.integers(2, VOCAB, int(rng.integers(8, 25))).tolist())
             for g in range(num_groups) for _ in range(per_group)]
    return [items[i] for i in rng.permutation(len(items))]


def by_group(done: dict[str, int], placements: dict[str, str]) -> dict[int, Counter[str]]:
    out: dict[int, Counter[str]] = {}
    for rid, group in done.items():
        out.setdefault(group, Counter())[placements[rid]] += 1
    return out


def assert_affinity(groups: dict[int, Counter[str]], context: str = "") -> None:
    for group, counts in groups.items():
        _, n = counts.most_common(1)[0]
        assert n >= 0.75 * sum(counts.values()), (group, counts, context)
    homes = {counts.most_common(1)[0][0] for counts in groups.values()}
    assert len(homes) >= 2, groups  # the groups are spread, not all on one replica


def wait_until(check, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def test_shared_prefix_groups_stay_on_one_replica(cluster: Cluster) -> None:
    items = workload(0, NUM_GROUPS, PER_GROUP)
    done, num_failed = send(items, "affinity")
    assert num_failed == 0 and len(done) == len(items)
    groups = by_group(done, cluster.placements())
    assert_affinity(groups)
    assert len(cluster.router_replicas()) == 3
    text = _metrics_text(cluster)
    assert "raydix_router_decision_latency_us" in text
    hit_lines = [line for line in text.splitlines() if line.startswith("raydix_router_hit_rate{")]
    assert hit_lines and max(float(line.split()[-1]) for line in hit_lines) > 0.5
    decided = [line for line in text.splitlines()
               if line.startswith("raydix_router_decisions_total{")]
    assert len(decided) == 3 and sum(float(line.split()[-1]) for line in decided) >= len(items)


def test_a_burst_of_cold_requests_keeps_each_group_together(cluster: Cluster) -> None:
    """All requests at once, cold prefixes: no cache event can reach the router between the
    decisions, so only its record of the decisions in flight keeps a group together."""
    items = workload(4, NUM_GROUPS, 6)

    async def burst() -> dict[str, int]:
        sent = {f"burst-g{g}-{i}-{uuid.uuid4().hex[:6]}": (g, p)
                for i, (g, p) in enumerate(items)}
        await asyncio.gather(*(generate(p, rid) for rid, (_, p) in sent.items()))
        return {rid: g for rid, (g, _) in sent.items()}

    before = _decision_counts(cluster)
    done = asyncio.run(burst())
    assert_affinity(by_group(done, cluster.placements()),
                    f"router decisions before {before}, after {_decision_counts(cluster)}")
    # every replica reported the ids it received: none is left counted as on its way
    # (well inside TRANSIT_TTL_S: expiry must not be what empties it)
    wait_until(lambda: "raydix_router_requests_in_transit 0.0" in _metrics_text(cluster), 5,
               "requests the replicas received are still counted as on their way")


def _decision_counts(cluster: Cluster) -> list[str]:
    return [line for line in _metrics_text(cluster).splitlines()
            if line.startswith("raydix_router_decisions_total{")]


def _metrics_text(cluster: Cluster) -> str:
    import httpx

    return httpx.get(f"http://127.0.0.1:{cluster.port}/metrics", timeout=30).text


def test_killed_replica_traffic_moves_to_the_others(cluster: Cluster) -> None:
    items = workload(1, NUM_GROUPS, PER_GROUP)
    done, _ = send(items[:9], "before-kill")
    groups = by_group(done, cluster.placements())
    victim = max(groups.values(), key=lambda c: sum(c.values())).most_common(1)[0][0]
    actor = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                 if victim in a["name"] and a["namespace"] == "serve")
    cluster.survivors = set(cluster.router_replicas()) - {victim}
    ray.kill(ray.get_actor(actor["name"], namespace="serve"), no_restart=True)
    # until Serve notices, a request may reach the dead replica: those are retried
    send(items[:6], "noticing", retries=20)
    wait_until(lambda: victim not in cluster.router_replicas(), 60,
               "the router actor still lists the killed replica")
    done, num_failed = send(items, "after-kill")
    assert num_failed == 0 and len(done) == len(items)
    placements = cluster.placements()
    assert victim not in {placements[rid] for rid in done}
    assert_affinity(by_group(done, placements))


def test_replacement_replica_receives_traffic_next_to_running_ones(cluster: Cluster) -> None:
    """Serve replaces the killed replica while the two others keep running: the router actor
    lists the new one beside them, and cold prefixes reach all three."""
    wait_until(lambda: num_running() == 3 and len(cluster.router_replicas()) == 3, 90,
               "the killed replica was not replaced")
    now = set(cluster.router_replicas())
    assert len(cluster.survivors) == 2 and cluster.survivors < now
    items = workload(3, 9, 1)  # cold prefixes: each goes to the least loaded replica
    done, num_failed = send(items, "replaced")
    assert num_failed == 0 and len(done) == len(items)
    placements = cluster.placements()
    assert {placements[rid] for rid in done} == now


def num_running() -> int:
    from ray import serve

    from raydix.deploy.app import ENGINE_DEPLOYMENT

    app = serve.status().applications[APP]
    return int(app.deployments[ENGINE_DEPLOYMENT].replica_states.get("RUNNING", 0))


def test_scaled_up_replicas_receive_traffic(cluster: Cluster) -> None:
    """Redeploying with 4 replicas (an imperative `serve.run` replaces every replica, Serve
    gives each run a new code version): the router actor drops the old replicas, and the cold
    prefixes that follow reach every new one."""
    before = set(cluster.router_replicas())
    cluster.deploy(replicas=4)
    wait_until(lambda: len(cluster.router_replicas()) == 4
               and not before & set(cluster.router_replicas()), 60,
               "the router actor does not list exactly the 4 new replicas")
    new = set(cluster.router_replicas())
    items = workload(2, 8, 2)  # cold prefixes: each goes to the least loaded replica
    done, num_failed = send(items, "scaled")
    assert num_failed == 0 and len(done) == len(items)
    placements = cluster.placements()
    assert {placements[rid] for rid in done} == new


def test_approximate_mode_follows_the_routers_own_decisions(cluster: Cluster) -> None:
    """Events off: the replicas send none (the tree holds exactly what was routed, whole
    prompts, which a replica's events never give before its prefill), and affinity holds."""
    cluster.deploy(replicas=3, router_mode="approximate")
    wait_until(lambda: len(cluster.router_replicas()) == 3, 60, "the replicas did not register")
    router = get_router(APP)
    assert ray.get(router.stats.remote(), timeout=30)["tree_tokens"] == 0  # reset, no events
    items = workload(5, NUM_GROUPS, PER_GROUP)
    done, num_failed = send(items, "approx")
    assert num_failed == 0 and len(done) == len(items)
    assert_affinity(by_group(done, cluster.placements()))
    # the tree holds the prefixes and the questions routed: nothing from the engines' outputs
    expected = len({tuple(p[:k]) for _, p in items for k in range(1, len(p) + 1)})
    assert ray.get(router.stats.remote(), timeout=30)["tree_tokens"] == expected
