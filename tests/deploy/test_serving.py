"""The app under load and under clients that go away: KV is freed, streams stay whole."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from raydix.cache import EventSink
from raydix.deploy.config import AppConfig
from raydix.deploy.server import ReplicaSettings
from raydix.engine.config import EngineConfig
from raydix.engine.engine import Engine
from tests import uncompiled
from tests.serve_apps import delete_apps

from .conftest import MODEL_NAME, NO_DECODE_GRAPH, ServeCluster, uncompiled_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "serving"


def checked_engine(config: EngineConfig, settings: ReplicaSettings,
                   event_sink: EventSink | None = None) -> Engine:
    """The default engine, compiling nothing at start (tests/uncompiled.py), checking the KV
    cache's integrity after every step (a broken invariant stops the engine loop, and the
    requests in flight fail)."""
    engine = uncompiled.uncompiled_engine(config, settings, event_sink)
    engine.step_hook = lambda scheduler: scheduler.cache.check_integrity()
    return engine


@pytest.fixture(scope="module")
def server(serve_cluster: ServeCluster, smollm2: Path) -> Iterator[str]:
    from ray import cloudpickle, serve

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # replicas can't import tests
    # float32: the streams are checked token for token against completions run as another
    # batch, and these prompts' first tokens are near-ties (" a" against " edible": 0.03-0.08
    # apart in transformers' fp32 logits for three of the eight), which bf16 (`--dtype auto`
    # where the CPU has native bf16) decides differently by batch size
    config = AppConfig(model=str(smollm2), served_model_name=MODEL_NAME, device="cpu",
                       dtype="float32", max_total_tokens=8192, max_running_requests=64,
                       max_context_len=1024, debug_cache_audit=True,
                       disable_cpu_decode_graph=NO_DECODE_GRAPH)
    serve.run(uncompiled_app(config, checked_engine), name=APP, route_prefix="/")
    yield serve_cluster.base_url
    delete_apps(APP)


def engine_stats() -> object:
    from ray import serve

    from raydix.deploy.app import ENGINE_DEPLOYMENT

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP)
    return handle.stats.remote().result(timeout_s=30)


def wait_idle(timeout_s: float = 30.0) -> object:
    """The replica's stats once no request is in flight and no KV is held by one."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine_stats()
        idle = (stats.num_in_flight == 0 and stats.num_rows == 0  # type: ignore[attr-defined]
                and stats.num_protected_tokens == 0  # type: ignore[attr-defined]
                and stats.metrics.num_running == 0  # type: ignore[attr-defined]
                and stats.metrics.num_waiting == 0)  # type: ignore[attr-defined]
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def test_client_disconnect_aborts_and_frees_kv(server: str) -> None:
    before = wait_idle()
    body = {"model": MODEL_NAME, "prompt": "Count slowly: one, two, three,", "max_tokens": 900,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept open: leaving a loop over it would close the stream
        for _ in range(3):
            assert next(line for line in lines if line).startswith("data: ")
        running = engine_stats()
        assert running.num_in_flight == 1  # type: ignore[attr-defined]
        assert running.num_rows == 1  # type: ignore[attr-defined]
    # the connection is closed here, mid-stream
    after = wait_idle()
    assert after.num_in_flight == 0  # type: ignore[attr-defined]
    assert after.num_rows == 0  # type: ignore[attr-defined]
    assert after.num_protected_tokens == 0  # type: ignore[attr-defined]
    assert after.num_audits > 0  # type: ignore[attr-defined]
    assert after.integrity_error is None  # type: ignore[attr-defined]
    generated = (after.metrics.num_generated_tokens  # type: ignore[attr-defined]
                 - before.metrics.num_generated_tokens)  # type: ignore[attr-defined]
    assert 3 <= generated < 300  # stopped long before max_tokens
    assert httpx.get(server + "/health", timeout=30).json() == {"status": "ok"}


async def _stream(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None, int]:
    stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8,
                                             temperature=0, stream=True)
    text, reason, num_chunks = "", None, 0
    async for chunk in stream:
        num_chunks += 1
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason, num_chunks


def test_64_concurrent_streams_complete_in_order(server: str) -> None:
    prompts = [f"Question {i}: name a fruit that is" for i in range(8)]

    async def run() -> tuple[list[tuple[str, str | None, int]], list[str]]:
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0,
                                    timeout=300)
        streams = await asyncio.gather(*(_stream(client, prompts[i % 8]) for i in range(64)))
        whole = await asyncio.gather(*(client.completions.create(
            model=MODEL_NAME, prompt=p, max_tokens=8, temperature=0) for p in prompts))
        await client.close()
        return streams, [w.choices[0].text for w in whole]

    streams, whole = asyncio.run(run())
    assert len(streams) == 64
    for i, (text, reason, num_chunks) in enumerate(streams):
        assert reason in ("stop", "length")  # every stream ran to its end
        assert num_chunks >= 2
        assert text == whole[i % 8]  # same tokens, in order, nothing lost or repeated
    stats = wait_idle()
    assert stats.num_audits > 0  # type: ignore[attr-defined]
    assert stats.integrity_error is None  # type: ignore[attr-defined]


def test_metrics_in_prometheus_text(server: str) -> None:
    httpx.post(server + "/v1/completions", timeout=60,
               json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3, "temperature": 0})
    text = httpx.get(server + "/metrics", timeout=30).text
    lines = text.splitlines()
    assert "# TYPE raydix_requests_total counter" in lines
    assert any(line.startswith('raydix_requests_total{endpoint="completions",status="200"}')
               for line in lines)
    count = next(line for line in lines
                 if line.startswith("raydix_time_to_first_token_seconds_count"))
    assert float(count.split()[-1]) >= 1
    # the time to the first token, split at the engine replica: the replica's own part of each
    # request and the rest add up to the whole, request by request
    ttft, engine, path = (
        {suffix: metric_total(lines, f"raydix_{part}time_to_first_token_seconds_{suffix}")
         for suffix in ("count", "sum")} for part in ("", "engine_", "path_"))
    assert engine["count"] == path["count"] == ttft["count"] >= 1
    assert 0 < engine["sum"] < ttft["sum"]
    assert engine["sum"] + path["sum"] == pytest.approx(ttft["sum"], rel=1e-6, abs=1e-6)
    for name in ("raydix_num_running_requests", "raydix_num_waiting_requests",
                 "raydix_kv_usage_ratio", "raydix_cache_hit_rate",
                 "raydix_time_per_output_token_seconds_count", "raydix_generation_tokens_total"):
        assert any(line.startswith(name) for line in lines), name
    replica_lines = [line for line in lines if line.startswith("raydix_num_running_requests{")]
    assert len(replica_lines) == 1 and 'replica="' in replica_lines[0]
    assert "raydix_engine_replicas 1.0" in lines
    assert metric(lines, "raydix_kv_capacity_tokens") == 8192.0  # max_total_tokens


def metric_total(lines: list[str], name: str) -> float:
    """The value of the unlabelled series `name`."""
    (value,) = [float(line.split()[-1]) for line in lines if line.split()[0] == name]
    return value


def metric(lines: list[str], name: str) -> float:
    """The value of the one series `name` (of the one replica)."""
    (value,) = [float(line.split()[-1]) for line in lines if line.startswith(name + "{")]
    return value


def test_metrics_are_fresh_when_scraped(server: str) -> None:
    """A scrape shows the replica's state when it was made: during a stream, and right after
    it ended (a scrape asks the replicas for their stats, rather than reading what they last
    sent)."""
    wait_idle()
    before = httpx.get(server + "/metrics", timeout=30).text.splitlines()
    body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert next(line for line in lines if line).startswith("data: ")
        during = httpx.get(server + "/metrics", timeout=30).text.splitlines()
        assert metric(during, "raydix_num_running_requests") == 1.0
        assert metric(during, "raydix_kv_used_tokens") > 0
        for _ in lines:  # to its end
            pass
    after = httpx.get(server + "/metrics", timeout=30).text.splitlines()
    assert metric(after, "raydix_num_running_requests") == 0.0
    assert metric(after, "raydix_kv_used_tokens") == 0.0
    generated = "raydix_engine_generated_tokens_total"
    assert metric(after, generated) - metric(before, generated) == 40
    # alone in the engine: one step for the prompt (its first token), one for each other token
    steps = "raydix_engine_steps_total"
    assert metric(after, steps) - metric(before, steps) == 40


def test_the_replicas_froze_their_start_up_heap(server: str) -> None:
    """The app's replicas froze what their start-up built: a full collection in one, which
    holds every stream of that replica while it runs, walks only what serving allocated since
    (workers/gc_heap.py; the engine process's own: tests/deploy/test_engine_process.py)."""
    import ray

    from raydix.deploy.app import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT

    def heap_counts(replica: object) -> tuple[int, int]:  # in the replica (by value: nested)
        import gc

        return gc.get_freeze_count(), len(gc.get_objects())

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith((f"SERVE_REPLICA::{APP}#{INGRESS_DEPLOYMENT}#",
                                      f"SERVE_REPLICA::{APP}#{ENGINE_DEPLOYMENT}#"))]
    assert names
    for name in names:
        replica = ray.get_actor(name, namespace="serve")
        frozen, walked = ray.get(replica.__ray_call__.remote(heap_counts), timeout=30)
        assert frozen > 50_000 and walked < frozen / 4, name
