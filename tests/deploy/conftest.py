"""Serve fixtures: the default model converted once, one Ray + Serve for tests/deploy."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray.serve import Application

from raydix.deploy.config import AppConfig
from raydix.deploy.server import EngineFactory
from tests import uncompiled
from tests.ray_start import init_ray
from tests.tiny_models import copy_tokenizer, save_tiny_llama

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL_NAME = "smollm2"
NUM_FAKE_GPUS = 4
# The apps of these tests run without the CPU decode graph (`raydix serve` turns it on on CPU):
# what they check does not depend on how a lone token is decoded, and each replica would trace
# the graph at start (seconds; a cold compile takes ~15 s). test_cli.py's `raydix serve` test
# keeps the default and checks that its replica runs the graph.
NO_DECODE_GRAPH = True


def uncompiled_app(config: AppConfig, engine_factory: EngineFactory = uncompiled.uncompiled_engine
                   ) -> Application:
    """The app for `config`, its engine replicas compiling nothing at start (tests/uncompiled.py:
    neither the CPU decode graph, 6-7 s in each replica even from inductor's cache, nor the
    paged decode kernel). What these modules check does not depend on how a replica computes
    decode attention; tests/workers checks the compiled code, and test_cli.py's `raydix serve`
    test serves with both."""
    from ray import cloudpickle

    from raydix.deploy.app import bind_app

    cloudpickle.register_pickle_by_value(uncompiled)  # replicas can't import tests
    return bind_app(config, engine_factory=engine_factory)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> str:
    """A folder of TinyLlama-1.1B's config and the default model's tokenizer: enough for
    settings and to build an app (its builder loads the tokenizer), no weights."""
    folder = tmp_path_factory.mktemp("config-only")
    copy_tokenizer(smollm2, folder)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 2048,
        "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
        "num_key_value_heads": 4, "max_position_embeddings": 2048}))
    return str(folder)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeCluster:
    """A local Ray with Serve listening on `base_url`."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"


@pytest.fixture(scope="package")
def serve_cluster() -> Iterator[ServeCluster]:
    """One Ray + Serve for the tests of this package (starting one takes ~12 s on 2 cores),
    stopped when they are done, before other packages' tests start their own Ray. Each module
    deploys its own apps and deletes them at its end. 4 fake GPUs for the TP test."""
    import ray
    from ray import serve

    init_ray(num_cpus=2, num_gpus=NUM_FAKE_GPUS, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield ServeCluster(port)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Path:
    """A tiny random Llama with the default model's tokenizer (fast to load, real text)."""
    folder = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=1234, vocab_size=49152,
                             max_position_embeddings=2048, initializer_range=0.3,
                             eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)
    copy_tokenizer(smollm2, folder)
    return folder
