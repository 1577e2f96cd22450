"""Replicas across nodes: placement, a replica too large for any node, and node loss.

The package's simulated cluster and app, after test_faults.py: a head node without GPUs and two
nodes with two fake GPUs each, serving two TP=2 replicas. The node-loss test runs last: it removes a node and
adds one back.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
import ray
from ray.serve.handle import DeploymentHandle

from raydix.cluster.placement import create_replica_placement
from raydix.deploy.app import build_app
from raydix.deploy.server import ReplicaStats

from .conftest import (
    APP,
    GPUS_PER_NODE,
    SimCluster,
    all_replica_stats,
    app_config,
    node_of,
    replica_ranks,
    router_of,
    router_view,
    running_replica_ids,
    wait_until,
)
from .sim_requests import (
    Outcome,
    check_outcome,
    generate,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

NUM_STREAMS = 8
STREAM_TOKENS = 400  # long enough to be mid-stream when the node goes



def test_tp2_replicas_keep_their_ranks_on_one_node_and_spread_over_nodes(
        sim_cluster: SimCluster, engine: DeploymentHandle) -> None:
    stats = all_replica_stats(APP, 2)
    ranks = replica_ranks(engine, set(stats))
    for replica_id, s in stats.items():
        # STRICT_PACK: the engine and both ranks on one node, as the worker actors report
        assert s.rank_node_ids == (s.node_id, s.node_id)
        workers = [r.worker for r in ranks[replica_id]]
        assert [ray.get(w.node_id.remote(), timeout=30) for w in workers] == [s.node_id] * 2
    # one replica on each GPU node; none on the head, which has no GPU
    assert sorted(s.node_id for s in stats.values()) == sorted(sim_cluster.gpu_nodes())


def test_replica_larger_than_any_node_is_refused_at_once(
        sim_cluster: SimCluster, tiny_model: Path) -> None:
    assert ray.cluster_resources()["GPU"] == 2 * GPUS_PER_NODE  # enough GPUs, not per node
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"tp=4 needs 4 GPUs on one node .* the largest node "
                                         r"of this cluster has 2 GPU\(s\) \(3 node\(s\) with "
                                         r"2, 2, 0\)\. Lower tp to at most 2"):
        build_app(app_config(tiny_model, tp=4, replicas=1))
    # a TP group started outside Serve is refused as fast, and leaves no placement group
    with pytest.raises(RuntimeError, match=r"a replica needs tp=4 \(STRICT_PACK needs them on "
                                           r"one node; the largest node has 2 GPU\(s\)\)\. No node is "
                                           r"large enough\."):
        create_replica_placement(4, use_gpu=True, strategy="STRICT_PACK", timeout_s=60)
    assert time.monotonic() - start < 10
    assert all(pg["state"] != "PENDING" for pg in ray.util.placement_group_table().values())


def test_node_loss_fails_only_its_replicas_requests_and_the_replica_comes_back(
        sim_cluster: SimCluster, engine: DeploymentHandle) -> None:
    stats = all_replica_stats(APP, 2)
    router = router_of(APP)
    # lose the node without the router actor (its state is what the test checks)
    router_node = node_of(router)
    victim_id, victim = next((r, s) for r, s in stats.items() if s.node_id != router_node)
    survivor_id = next(r for r in stats if r != victim_id)

    async def run() -> None:
        # through the ingress's request code, from here: Serve may have put the ingress
        # replica itself on the node that goes
        started = [asyncio.Event() for _ in range(NUM_STREAMS)]
        streams = [asyncio.create_task(generate(engine, f"stream {i}: tell me a long story",
                                                STREAM_TOKENS, started[i]))
                   for i in range(NUM_STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)

        def counted() -> dict[str, ReplicaStats] | None:  # every stream, on its replica
            stats = all_replica_stats(APP, 2)
            return stats if sum(s.num_in_flight for s in stats.values()) == NUM_STREAMS else None

        in_flight = await asyncio.to_thread(wait_until, counted, 30,
                                            "the board to count every stream")
        num_on_victim = in_flight[victim_id].num_in_flight
        assert num_on_victim >= 1  # the router spreads new prefixes by load
        known, held = await asyncio.to_thread(router_view, router, victim_id)
        assert known and held > 0
        await asyncio.to_thread(sim_cluster.cluster.remove_node,
                                sim_cluster.gpu_nodes()[victim.node_id], False)

        def node_dead() -> bool:  # its processes are gone (a request started before may still
            # have streamed from it, and then rightly fails)
            return not any(n["NodeID"] == victim.node_id and n["Alive"] for n in ray.nodes())

        await asyncio.to_thread(wait_until, node_dead, 30, "Ray to mark the lost node dead")
        # requests sent now, before Serve has noticed, go to the survivor (or are sent again)
        late = [generate(engine, f"late {i}: hello there", 8) for i in range(6)]
        outcomes = await asyncio.wait_for(asyncio.gather(*streams, *late), 90)
        ok = [check_outcome(o, STREAM_TOKENS) for o in outcomes[:NUM_STREAMS]]
        assert ok.count(False) == num_on_victim  # the lost node's streams end with a 503
        assert [o for o in outcomes[NUM_STREAMS:] if o.error_code] == []
        assert all(check_outcome(o, 8) for o in outcomes[NUM_STREAMS:])

    asyncio.run(run())
    # the router forgets the dead replica and everything its tree credited it with
    wait_until(lambda: router_view(router, victim_id) == (False, 0), 30,
               "the router to drop the dead replica")
    assert router_view(router, survivor_id)[0]
    # Serve replaces the replica once a node with room is back
    wait_until(lambda: running_replica_ids(APP) == {survivor_id}, 30,
               "Serve to list only the surviving replica")
    new_node = sim_cluster.add_gpu_node()
    stats = all_replica_stats(APP, 2, timeout_s=90)
    replacement = next(s for r, s in stats.items() if r != survivor_id)
    assert replacement.replica_id != victim_id
    assert replacement.node_id == new_node.node_id
    assert replacement.rank_node_ids == (new_node.node_id, new_node.node_id)

    def new_replica_serves() -> bool:
        # the handle learns of the new replica a little after Serve runs it: send until it
        # has served some (every request must succeed meanwhile)
        outcomes = asyncio.run(_batch(engine, "after", 4))
        assert all(check_outcome(o, 4) for o in outcomes)
        return all_replica_stats(APP, 2)[replacement.replica_id].metrics.num_finished > 0

    wait_until(new_replica_serves, 60, "the new replica to serve requests", period_s=0.5)


async def _batch(engine: DeploymentHandle, tag: str, num: int) -> list[Outcome]:
    return list(await asyncio.gather(*(generate(engine, f"{tag} {i}: {uuid.uuid4().hex}", 4)
                                       for i in range(num))))
