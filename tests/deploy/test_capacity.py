"""A replica count the cluster can't place is refused at once, naming what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from raydix.deploy.capacity import check_replicas_fit, num_replicas_that_fit, replica_resources
from raydix.deploy.config import AppConfig

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
