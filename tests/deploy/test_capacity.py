"""A replica count the cluster can't place is refused at once, naming what is missing, unless
an autoscaler can add nodes that hold one: then the CLI waits for them, and fails in time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from raydix.deploy.capacity import (
    autoscaler_node_types,
    check_replicas_fit,
    num_replicas_that_fit,
    replica_resources,
)
from raydix.deploy.config import AppConfig
from tests.serve_apps import delete_apps

from .conftest import NUM_FAKE_GPUS, ServeCluster

pytestmark = [pytest.mark.ray]


def test_what_a_replica_reserves() -> None:
    assert replica_resources(2, True, None) == {"CPU": 1.0, "GPU": 2.0}
    assert replica_resources(1, False, 2) == {"CPU": 2.0}
    assert replica_resources(2, False, None) == {"CPU": 3.0}


def test_more_gpu_replicas_than_gpus_are_refused(serve_cluster: ServeCluster,
                                                 tiny_llama: Path) -> None:
    from raydix.deploy.app import bind_app

    # 2 CPUs and 4 fake GPUs: one CPU per replica besides its GPUs
    assert num_replicas_that_fit({"CPU": 1.0, "GPU": 1.0}) == 2
    assert num_replicas_that_fit({"CPU": 1.0, "GPU": 2.0}) == 2
    assert num_replicas_that_fit({"CPU": 1.0, "GPU": 4.0}) == 1
    check_replicas_fit(2, {"CPU": 1.0, "GPU": 2.0})  # fits: no error
    config = AppConfig(model=str(tiny_llama), device="cpu", use_gpu_bundles=True, tp=4,
                       replicas=2)
    with pytest.raises(ValueError, match=r"replicas=2 can't be placed: a replica needs 1 CPU, "
                       rf"4 GPU on one node, and this cluster \(2 CPU, {NUM_FAKE_GPUS} GPU in "
                       r"all\) holds 1\. Lower --replicas \(or --tp\)"):
        bind_app(config)


def test_more_cpu_replicas_than_cpus_are_refused(serve_cluster: ServeCluster,
                                                 tiny_llama: Path) -> None:
    from raydix.deploy.app import bind_app

    config = AppConfig(model=str(tiny_llama), device="cpu", cpu_threads=2, replicas=2)
    with pytest.raises(ValueError, match=r"replicas=2 can't be placed: a replica needs 2 CPU "
                       r"on one node, .* holds 1\. Lower --replicas \(or --cpu-threads\)"):
        bind_app(config)
    bind_app(config.model_copy(update={"cpu_threads": 1}))  # 2 x 1 CPU: placed


@contextmanager
def fake_autoscaler(**node_types: dict[str, int]) -> Iterator[None]:
    """The cluster config an autoscaler records in Ray's GCS: these node types may be added."""
    import ray._raylet
    from ray.core.generated.autoscaler_pb2 import ClusterConfig
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    config = ClusterConfig()
    for name, resources in node_types.items():
        group = config.node_group_configs.add(name=name, max_count=4)
        group.resources.update(resources)
    key, namespace = (ray._raylet.GCS_AUTOSCALER_CLUSTER_CONFIG_KEY,
                      ray._raylet.GCS_AUTOSCALER_STATE_NAMESPACE)
    _internal_kv_put(key, config.SerializeToString(), namespace=namespace)
    try:
        yield
    finally:
        _internal_kv_del(key, namespace=namespace)


def test_an_autoscaler_with_too_small_nodes_does_not_help(serve_cluster: ServeCluster) -> None:
    with fake_autoscaler(small={"CPU": 1}):
        assert autoscaler_node_types() == {"small": {"CPU": 1.0}}
        with pytest.raises(ValueError, match=r"replicas=2 can't be placed: .* holds 1, and none "
                           r"of the node types its autoscaler can add holds one \(small: 1 CPU\)"):
            check_replicas_fit(2, {"CPU": 2.0})
    assert autoscaler_node_types() is None


def test_with_an_autoscaler_the_cli_waits_for_nodes_then_fails(
        serve_cluster: ServeCluster, tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    """2 replicas of 2 CPUs on a 2-CPU cluster whose autoscaler could add 4-CPU nodes: the
    app is deployed, one replica runs, the CLI says what it waits for, and fails in time."""
    import logging

    from raydix.deploy.app import ENGINE_DEPLOYMENT, bind_app, replica_shortfall
    from raydix.deploy.cli import _deploy, replicas_running

    # the replica that runs compiles nothing at start: the wait is about placement only
    config = AppConfig(model=str(tiny_llama), device="cpu", cpu_threads=2, replicas=2,
                       max_total_tokens=4096, autoscaler_timeout_s=6,
                       disable_cpu_decode_graph=True, disable_cpu_compiled_attention=True)
    caplog.set_level(logging.INFO)
    with fake_autoscaler(head={"CPU": 1}, cpu4={"CPU": 4}):
        shortfall = replica_shortfall(config)
        assert shortfall is not None
        assert (shortfall.num_replicas, shortfall.fit, shortfall.node_types) == (2, 1, ("cpu4",))
        start = time.monotonic()
        try:
            with pytest.raises(RuntimeError, match=r"waited 6 s for the autoscaler to add "
                               r"nodes: [01] of 2 engine replicas run, and the cluster holds 1 "
                               r"\(a replica needs 2 CPU on one node\)"):
                _deploy(bind_app(config), config)
            assert time.monotonic() - start < 30
            assert replicas_running("raydix", ENGINE_DEPLOYMENT) <= 1
        finally:
            delete_apps("raydix")
    said = caplog.text
    assert ("waiting up to 6 s for the autoscaler to add nodes for 1 more engine replica(s) "
            "(the cluster holds 1 of 2; a replica needs 2 CPU on one node; node types that hold "
            "one: cpu4)") in said
