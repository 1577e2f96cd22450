"""The routing tests' Serve app (tests/router/test_serve_routing.py): engine replicas of a tiny
random model that record the requests they admit, and a client that sends token ids through
the engine deployment's handle one request at a time. The replicas cannot import the tests, so
the test module registers this module with cloudpickle by value."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import ray

from raydix.cache import EventSink
from raydix.deploy.config import AppConfig
from raydix.deploy.server import ReplicaSettings
from raydix.engine.config import EngineConfig
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.router.actor import get_router

APP = "routing"
VOCAB = 256
PARAMS = GenerationParams(max_new_tokens=2, ignore_eos=True)
PAUSE_S = 0.15  # > the replicas' 50 ms report period


class RecordingEngine(Engine):
    """The engine, appending each admitted request id to `log_path`."""

    log_path: Path | None = None

    def add_request(self, prompt_ids, params=None, rid=None, **options):  # type: ignore[no-untyped-def]
        if self.log_path is not None:
            with self.log_path.open("a") as f:
                f.write(f"{rid}\n")
        return super().add_request(prompt_ids, params, rid, **options)


def recording_factory(log_dir: str):  # type: ignore[no-untyped-def]
    def make(config: EngineConfig, settings: ReplicaSettings,
             event_sink: EventSink | None = None) -> Engine:
        from raydix.deploy.server import REPLICA_ID_ENV

        replica_id = os.environ[REPLICA_ID_ENV]  # it runs in the replica's engine process
        # nothing compiled at start (the CPU decode graph, ~8 s a replica here, and the module
        # starts 11; nor the paged decode kernel): where a request runs does not depend
        # on how a replica computes it (tests/deploy/test_cli.py serves with both)
        config = replace(config, worker=replace(config.worker, cpu_decode_graph=False,
                                                cpu_compiled_attention=False))
        engine = RecordingEngine(config, event_sink=event_sink)
        engine.log_path = Path(log_dir) / f"{replica_id}.log"
        engine.log_path.touch()
        return engine

    return make


def tiny_model(folder: Path) -> Path:
    """A tiny random Llama with a word-level tokenizer (`t0 t1 ...`), so the ingress starts."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(99)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.3,
                         eos_token_id=1, bos_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", bos_token="t0",
                            eos_token="t1").save_pretrained(folder)
    return folder


def app_config(model: Path, replicas: int, router_mode: str = "exact") -> AppConfig:
    return AppConfig(model=str(model), device="cpu", replicas=replicas, max_total_tokens=4096,
                     max_running_requests=8, max_context_len=256, router_mode=router_mode,
                     router_decision_timeout_s=2.0,  # a loaded 2-core machine answers late
                     rolling_update_percentage=1.0)  # the redeploys replace all at once


class Cluster:
    def __init__(self, model: Path, log_dir: Path, port: int) -> None:
        self.model = model
        self.log_dir = log_dir
        self.port = port
        self.survivors: set[str] = set()  # the replicas that outlived the killed one

    def deploy(self, replicas: int, router_mode: str = "exact") -> None:
        from ray import serve

        from raydix.deploy.app import bind_app

        app = bind_app(app_config(self.model, replicas, router_mode),
                       engine_factory=recording_factory(str(self.log_dir)))
        serve.run(app, name=APP, route_prefix="/")

    def placements(self) -> dict[str, str]:
        """Request id -> the replica that admitted it."""
        out = {}
        for log in self.log_dir.glob("*.log"):
            for rid in log.read_text().split():
                out[rid] = log.stem
        return out

    def router_replicas(self) -> list[str]:
        router = get_router(APP)
        return list(ray.get(router.replica_ids.remote(), timeout=30))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def generate(prompt: Sequence[int], rid: str) -> None:
    from ray import serve

    from raydix.deploy.app import ENGINE_DEPLOYMENT

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP)
    finished = False
    async for outputs in handle.options(stream=True).generate.remote(list(prompt), PARAMS, rid):
        finished = finished or any(out.finished for out in outputs)
    if not finished:
        raise RuntimeError(f"request {rid} ended without finishing")


def send(items: Sequence[tuple[int, list[int]]], tag: str, retries: int = 0
         ) -> tuple[dict[str, int], int]:
    """Send `items` one at a time; returns ({request id: group} of the successful ones, the
    number of failed attempts). A request is tried `1 + retries` times."""

    async def run() -> tuple[dict[str, int], int]:
        done: dict[str, int] = {}
        num_failed = 0
        for i, (group, prompt) in enumerate(items):
            for _ in range(1 + retries):
                rid = f"{tag}-g{group}-{i}-{uuid.uuid4().hex[:6]}"
                try:
                    await generate(prompt, rid)
                except Exception:
                    num_failed += 1
                    await asyncio.sleep(0.5)
                    continue
                done[rid] = group
                break
            await asyncio.sleep(PAUSE_S)
        return done, num_failed

    return asyncio.run(run())
