"""One local Ray for the router's modules that need one (test_actor.py, test_serve_routing.py):
a start and a stop take 5-10 s on 2 cores."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.ray_start import init_ray

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="package")
def ray_local() -> Iterator[None]:
    """5 logical CPUs (test_serve_routing.py's replicas take one each, 3 then 4) and 4 fake
    GPUs; Serve is started and shut down by the modules that use it."""
    import ray

    if ray.is_initialized():
        raise RuntimeError("another Ray instance is running in this process")
    init_ray(address="local", num_cpus=5, num_gpus=4, include_dashboard=False,
             log_to_driver=False)
    yield
    ray.shutdown()
