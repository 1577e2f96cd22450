"""On a CPU the engine replica computes on the threads it reserves, at the normal priority, and
its rank's torch work (loading, warming up, stepping) all happens on one thread."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from raydix.deploy.app import replica_cpu_threads
from raydix.deploy.config import AppConfig
from raydix.deploy.cpu_threads import (
    SMALL_LAYER_WEIGHTS,
    THREADS_ON_SMALL_MACHINES,
    default_cpu_threads,
    layer_weights,
    threads_for_model,
)
from raydix.deploy.replica_facts import ReplicaFacts
from raydix.deploy.server import EngineServer, ReplicaSettings
from raydix.engine.async_engine import AsyncEngine
from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.executor import LocalExecutor
from raydix.engine.request import GenerationParams
from raydix.workers.config import WorkerConfig
from raydix.workers.step import StepPlan, StepResult
from tests import uncompiled
from tests.serve_apps import delete_apps

from .conftest import MODEL_NAME, NO_DECODE_GRAPH, ServeCluster, uncompiled_app

APP = "threads"


def test_default_threads_leave_a_core_when_two_remain() -> None:
    assert [default_cpu_threads(n) for n in (4, 8, 64)] == [3, 7, 63]
    assert default_cpu_threads(3) == 2
    assert default_cpu_threads(2) == THREADS_ON_SMALL_MACHINES  # measured (README)
    assert default_cpu_threads(1) == 1


def test_replicas_share_the_cores_and_other_ranks_refuse_the_setting() -> None:
    cores = default_cpu_threads(os.cpu_count() or 1)
    assert replica_cpu_threads(AppConfig(), "cpu", None) == cores
    assert replica_cpu_threads(AppConfig(replicas=64), "cpu", None) == 1
    assert replica_cpu_threads(AppConfig(cpu_threads=3), "cpu", None) == 3
    assert replica_cpu_threads(AppConfig(), "cuda", [{"CPU": 1}, {"GPU": 1}]) is None
    with pytest.raises(ValueError, match="cpu_threads"):
        replica_cpu_threads(AppConfig(cpu_threads=2), "cuda", [{"CPU": 1}, {"GPU": 1}])
    with pytest.raises(ValueError, match="cpu_threads"):
        replica_cpu_threads(AppConfig(cpu_threads=2, tp=2), "cpu", [{"CPU": 1}] * 3)


def test_the_replica_loads_and_steps_its_rank_on_one_thread(tiny_llama: Path) -> None:
    """OpenMP keeps a team of worker threads per thread that computes; with two teams on two
    cores (the rank loaded on the event loop, stepped on the engine's loop thread) each step
    waits for sleeping workers (async_engine.py). So the thread that loads the rank steps it."""
    loaded: list[int] = []
    stepped: set[int] = set()

    def make(config: EngineConfig, settings: ReplicaSettings, sink: object) -> Engine:
        loaded.append(threading.get_ident())
        engine = Engine(config)  # the rank in this process: LocalExecutor loads the model here
        assert isinstance(engine.executor, LocalExecutor)
        worker = engine.executor.worker
        step = worker.step

        def recording_step(plan: StepPlan) -> StepResult:
            stepped.add(threading.get_ident())
            return step(plan)

        worker.step = recording_step  # type: ignore[method-assign]
        return engine

    async def run() -> tuple[int, list[int]]:
        config = EngineConfig.build(WorkerConfig(model_path=str(tiny_llama), max_total_tokens=2048),
                                    SchedulerConfig(max_running_requests=4, max_context_len=256))
        server = EngineServer(config, engine_factory=make)
        try:
            tokens = []
            params = GenerationParams(max_new_tokens=6, ignore_eos=True)
            async for outputs in server.generate([5, 6, 7, 8], params, "r"):
                tokens += [t for out in outputs for t in out.new_token_ids]
            return threading.get_ident(), tokens
        finally:
            server.engine.shutdown()

    event_loop_thread, tokens = asyncio.run(run())
    assert len(tokens) == 6
    assert len(loaded) == 1 and stepped == set(loaded)
    assert event_loop_thread not in stepped


def test_an_engine_that_fails_to_build_raises_from_the_constructor() -> None:
    def broken() -> Engine:
        raise ValueError("no such model: nowhere")

    def loop_threads() -> int:
        return sum(t.name == "raydix-engine-loop" for t in threading.enumerate())

    before = loop_threads()
    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(broken)
    assert loop_threads() == before  # its loop thread ended


def test_a_small_model_computes_on_one_thread_by_default(tiny_llama: Path, smollm2: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A layer of the tiny model (hidden 64) is too small to split: a second thread would only
    spin beside the step on the core the stream needs. The default model keeps its threads."""
    from raydix.workers.config import ModelConfig

    assert layer_weights(ModelConfig.from_folder(tiny_llama)) < SMALL_LAYER_WEIGHTS
    assert layer_weights(ModelConfig.from_folder(smollm2)) > 3 * SMALL_LAYER_WEIGHTS
    with caplog.at_level(logging.INFO, logger="raydix"):
        assert threads_for_model(2, str(tiny_llama)) == 1
    assert any("CPU threads: 1 of 2" in r.getMessage() for r in caplog.records)
    assert threads_for_model(2, str(smollm2)) == 2
    assert threads_for_model(1, str(tiny_llama)) == 1


def test_the_engine_process_takes_the_threads_and_ends_with_the_replica(tiny_llama: Path) -> None:
    """With `engine_process` the engine steps in a child process (engine_process.py): the
    thread setting (here the default, fitted to the small model) applies there, its start-up
    lines reach the replica's facts, it starts with malloc on huge pages, and it ends when the
    replica shuts its engine down."""
    config = uncompiled.uncompiled(EngineConfig.build(
        WorkerConfig(model_path=str(tiny_llama), max_total_tokens=2048),
        SchedulerConfig(max_running_requests=4, max_context_len=256)))
    settings = ReplicaSettings(cpu_threads=2, fit_threads_to_model=True, engine_process=True)

    async def run() -> tuple[ReplicaFacts, list[int], int, list[bytes]]:
        server = EngineServer(config, settings, engine_factory=uncompiled.uncompiled_engine)
        try:
            env = Path(f"/proc/{server.facts.engine_pid}/environ").read_bytes().split(b"\0")
            tokens = []
            params = GenerationParams(max_new_tokens=6, ignore_eos=True)
            async for outputs in server.generate([5, 6, 7, 8], params, "r"):
                tokens += [t for out in outputs for t in out.new_token_ids]
            stats = await server.stats()  # the figures of the step that ended the stream
            assert stats.kv_capacity == 2048 and stats.metrics.num_generated_tokens == 6
            return server.facts, tokens, os.getpid(), env
        finally:
            server.engine.shutdown()

    facts, tokens, here, env = asyncio.run(run())
    assert len(tokens) == 6
    # started with malloc on 2 MiB pages for the rank's weights (workers/huge_pages.py)
    assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in env
    assert facts.engine_pid is not None and facts.engine_pid != here
    assert facts.cpu_threads == 1  # fitted to the model, in the engine process
    assert any(line.startswith("CPU threads: 1 of 2") for line in facts.log_lines), facts
    assert any(line.startswith("KV pool: 2048 tokens") for line in facts.log_lines), facts
    assert not Path(f"/proc/{facts.engine_pid}").exists()


def test_an_engine_process_without_a_thread_setting_takes_the_normal_priority(
        tiny_llama: Path) -> None:
    """A GPU's rank in the engine process (no CPU thread setting) steps at nice 0 as well: Ray
    starts the replica at nice 15, and the rank's host work is each step's critical path. Here
    a CPU replica given no thread setting, started at nice 15, in a process of its own."""
    code = textwrap.dedent(f"""
        import asyncio, os
        os.nice(15)
        from raydix.deploy.server import EngineServer, ReplicaSettings
        from raydix.engine.config import EngineConfig, SchedulerConfig
        from raydix.workers.config import WorkerConfig
        from tests import uncompiled
        config = uncompiled.uncompiled(EngineConfig.build(
            WorkerConfig(model_path={str(tiny_llama)!r}, max_total_tokens=2048),
            SchedulerConfig(max_running_requests=4, max_context_len=256)))
        async def run():
            server = EngineServer(config, ReplicaSettings(engine_process=True),
                                  engine_factory=uncompiled.uncompiled_engine)
            try:
                pid = server.facts.engine_pid
                print(server.facts.nice, os.getpriority(os.PRIO_PROCESS, pid), pid != os.getpid())
            finally:
                server.engine.shutdown()
        asyncio.run(run())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["0", "0", "True"], out.stdout


@pytest.fixture(scope="module")
def server(serve_cluster: ServeCluster, tiny_llama: Path) -> Iterator[str]:
    from ray import serve

    config = AppConfig(model=str(tiny_llama), served_model_name=MODEL_NAME, device="cpu",
                       max_total_tokens=2048, max_context_len=256, cpu_threads=2,
                       disable_cpu_decode_graph=NO_DECODE_GRAPH)
    serve.run(uncompiled_app(config), name=APP, route_prefix="/")
    yield serve_cluster.base_url
    delete_apps(APP)


@pytest.mark.ray
@pytest.mark.slow
def test_the_thread_setting_reaches_the_replica(server: str) -> None:
    from ray import serve

    from raydix.deploy.app import ENGINE_DEPLOYMENT

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP)
    facts: ReplicaFacts = handle.start_facts.remote().result(timeout_s=30)
    assert facts.cpu_threads == 2  # torch's threads in the engine (Ray would set 1)
    assert facts.num_cpus == 2.0  # and it reserved as many of Ray's CPUs
    assert facts.nice == 0  # Ray starts its workers at nice 15
    # the engine steps in a process of its own (engine_process.py), at the same priority
    assert facts.engine_pid is not None
    assert os.getpriority(os.PRIO_PROCESS, facts.engine_pid) == 0
    assert facts.kv_pool_tokens == 2048 and facts.device == "cpu"
    assert any(line.startswith("KV pool: 2048 tokens") for line in facts.log_lines), facts
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    out = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4,
                                    temperature=0)
    assert out.usage is not None and out.usage.completion_tokens == 4




@pytest.mark.ray
@pytest.mark.slow
def test_the_one_replica_serves_http_itself_at_the_normal_priority(server: str) -> None:
    """Every request and token passes through the replica that serves HTTP. With one fixed
    replica that is the engine replica itself (`engine_ingress.py`): no ingress replica of its
    own, and the one replica at nice 0, not Ray's 15 (priority.py)."""
    import ray

    from raydix.deploy.app import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if f"{APP}#" in a["name"]]
    assert [n for n in names if f"#{INGRESS_DEPLOYMENT}#" in n] == [], names
    engines = [n for n in names if f"#{ENGINE_DEPLOYMENT}#" in n]
    assert len(engines) == 1, names

    def nice(_: object = None) -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    replica = ray.get_actor(engines[0], namespace="serve")
    assert ray.get(replica.__ray_call__.remote(nice), timeout=30) == 0
    assert ray.get(ray.remote(num_cpus=0)(nice).remote(), timeout=30) > 0  # a plain worker


def test_an_ingress_of_its_own_takes_the_normal_priority(tiny_llama: Path) -> None:
    """An ingress replica of its own (several engine replicas, or `--separate-ingress`) left at
    Ray's nice 15 beside a busy engine replica (nice 0) had its event loop stand still for
    100-300 ms at a time; its constructor takes nice 0. Here the class that `@serve.ingress`
    wraps, built in a process started at nice 15."""
    code = textwrap.dedent(f"""
        import os
        os.nice(15)
        from transformers import AutoTokenizer
        from raydix.deploy.ingress import OpenAIIngress
        wrapped = OpenAIIngress.__bases__[0]  # the class itself, under Serve's ASGI wrapper
        assert wrapped.__name__ == "OpenAIIngress", wrapped
        ingress = object.__new__(OpenAIIngress)
        tokenizer = AutoTokenizer.from_pretrained({str(tiny_llama)!r})
        wrapped.__init__(ingress, object(), object(), {str(tiny_llama)!r}, "m", 256, 1 << 20,
                         tokenizer=tokenizer)
        print(os.getpriority(os.PRIO_PROCESS, 0), ingress.engine_server is None)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["0", "True"], out.stdout
