"""Serve fixtures: the default model converted once, one Ray + Serve per test module."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL_NAME = "smollm2"


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model, converted from its packaged GGUF once per session."""
    from raydix.workers.gguf_convert import convert_gguf, find_packaged_gguf

    return convert_gguf(
        find_packaged_gguf(), tmp_path_factory.mktemp("smollm2"), show_progress=False
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeCluster:
    """A local Ray with Serve listening on `base_url`."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def serve_cluster() -> Iterator[ServeCluster]:
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield ServeCluster(port)
    finally:
        serve.shutdown()
        ray.shutdown()
