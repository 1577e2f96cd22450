"""Two engine replicas with TP=2 each on fake GPUs: placement, both serve, same greedy output."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from raydix.deploy.config import AppConfig
from raydix.deploy.engine_settings import engine_config
from raydix.engine.config import EngineConfig
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from tests import uncompiled
from tests.serve_apps import delete_apps

from .conftest import MODEL_NAME, NUM_FAKE_GPUS, ServeCluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "tp"
PROMPTS = [f"Tell me about item {i}" for i in range(8)]


def app_config(model: Path) -> AppConfig:
    return AppConfig(model=str(model), served_model_name=MODEL_NAME, device="cpu",
                     use_gpu_bundles=True, tp=2, replicas=2, max_total_tokens=2048,
                     max_running_requests=16, max_context_len=256,
                     # the prompts share a prefix, which cache-aware routing keeps on one
                     # replica; this module is about TP replicas, so both take turns
                     router="round_robin")


@pytest.fixture(scope="module")
def server(serve_cluster: ServeCluster, tiny_llama: Path) -> Iterator[str]:
    from ray import cloudpickle, serve

    from raydix.deploy.app import bind_app

    # the 4 ranks and the reference compile nothing at start (tests/uncompiled.py): the module
    # checks placement and that TP=2 replicas answer as one rank does, computed the same way
    cloudpickle.register_pickle_by_value(uncompiled)  # replicas can't import tests
    serve.run(bind_app(app_config(tiny_llama), engine_factory=uncompiled.uncompiled_engine),
              name=APP, route_prefix="/")
    yield serve_cluster.base_url
    delete_apps(APP)


def test_replicas_hold_their_gpu_bundles(server: str) -> None:
    import ray

    # 2 replicas x 2 ranks: every fake GPU is taken by a rank actor
    assert ray.available_resources().get("GPU", 0.0) == 0.0
    assert ray.cluster_resources()["GPU"] == NUM_FAKE_GPUS


def test_both_replicas_serve_the_same_greedy_output(server: str, tiny_llama: Path) -> None:
    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0,
                                    timeout=120)
        outs = await asyncio.gather(*(client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[i % 8], max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True}) for i in range(32)))
        await client.close()
        return [o.choices[0].text for o in outs]

    texts = asyncio.run(run())
    config = engine_config(app_config(tiny_llama), str(tiny_llama), "cpu")
    one_rank = uncompiled.uncompiled(
        EngineConfig.build(replace(config.worker, tp_size=1), config.scheduler))
    reference = Engine(one_rank, tokenizer=AutoTokenizer.from_pretrained(tiny_llama))
    tok = reference.tokenizer
    expected = reference.generate([tok.encode(p) for p in PROMPTS],  # type: ignore[union-attr]
                                  GenerationParams(max_new_tokens=6, ignore_eos=True))
    for i, text in enumerate(texts):
        assert text == tok.decode(expected[i % 8], skip_special_tokens=True)  # type: ignore[union-attr]
    # each replica finished some of them: /metrics lists both, with their counts
    deadline = time.monotonic() + 15
    while True:
        lines = httpx.get(server + "/metrics", timeout=30).text.splitlines()
        finished = [float(line.split()[-1]) for line in lines
                    if line.startswith("raydix_engine_finished_requests_total{")]
        if (len(finished) == 2 and sum(finished) == 32) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(finished) == 2
    assert sum(finished) == 32
    assert min(finished) >= 1
