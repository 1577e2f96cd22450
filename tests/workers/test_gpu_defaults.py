"""CUDA only: what `raydix serve` builds by default on a GPU is the fast path, its KV pool
leaves the headroom it promises, and its kernels are compiled before it says it is ready."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raydix.deploy.config import AppConfig
from raydix.deploy.engine_settings import engine_config
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.workers.runner import ModelRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def folder(gpu_model: Path) -> Path:
    return gpu_model  # head_dim 64: a precompiled flashinfer size


def serve_engine(folder: Path, **options: object) -> Engine:
    app = AppConfig(model=str(folder), max_context_len=512, **options)  # type: ignore[arg-type]
    return Engine(engine_config(app, str(folder), "cuda"))


def runner_of(engine: Engine) -> ModelRunner:
    return engine.executor.worker.runner  # type: ignore[attr-defined, no-any-return]


def test_serve_defaults_build_the_fast_path(folder: Path) -> None:
    from raydix.workers.attention.flashinfer_backend import FlashInferAttentionBackend

    engine = serve_engine(folder, mem_fraction_static=0.5)
    runner = runner_of(engine)
    assert runner.device == torch.device("cuda", torch.cuda.current_device())
    assert isinstance(runner.backend, FlashInferAttentionBackend)
    assert runner.dtype == torch.bfloat16
    graphs = runner.graph_runner
    assert graphs is not None and graphs.max_batch == engine.config.scheduler.max_running_requests
    replays = 0
    replay = graphs.replay

    def counted(batch: object) -> torch.Tensor:
        nonlocal replays
        replays += 1
        return replay(batch)  # type: ignore[arg-type]

    graphs.replay = counted  # type: ignore[method-assign]
    outs = engine.generate([[1, 5, 9, 13] * 8] * 40, GenerationParams(max_new_tokens=6,
                                                                      ignore_eos=True))
    assert [len(o) for o in outs] == [6] * 40
    assert replays >= 5  # every decode step of the 40 requests replayed a graph
    engine.shutdown()


def test_pool_leaves_the_promised_headroom(folder: Path) -> None:
    # mem_fraction_static 0.99 keeps ~1% free: the headroom estimate, not the fraction, rules
    engine = serve_engine(folder, mem_fraction_static=0.99, max_prefill_tokens=4096,
                          chunked_prefill_size=4096, max_running_requests=32)
    runner = runner_of(engine)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    prompts = [list(range(3, 3 + 480 + i)) for i in range(8)]  # ~3,900 prompt tokens in a step
    engine.generate(prompts + [[7, 8, 9]] * 24, GenerationParams(max_new_tokens=4,
                                                                  ignore_eos=True))
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - base
    assert used <= runner.headroom.activations + runner.headroom.cuda_graphs, (
        used, runner.headroom)
    engine.shutdown()


def test_kernels_are_ready_before_the_engine_is(folder: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from flashinfer.jit.core import JitSpec

    engine = serve_engine(folder, mem_fraction_static=0.5, max_running_requests=8)
    runner = runner_of(engine)
    assert runner.warm_up is not None and runner.warm_up.phases == ("prefill", "decode")
    # a first request of a new length compiles nothing (tens of seconds cold) and loads no
    # kernel module that the warm-up did not: every flashinfer module is built or loaded
    # through JitSpec.build_and_load, once per process
    loads: list[str] = []
    build_and_load = JitSpec.build_and_load

    def recorded(spec: JitSpec) -> object:
        loads.append(spec.name)
        return build_and_load(spec)

    monkeypatch.setattr(JitSpec, "build_and_load", recorded)
    with torch.compiler.set_stance("fail_on_recompile"):
        engine.generate([[2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]], GenerationParams(max_new_tokens=3))
    assert loads == []
    engine.shutdown()


def test_the_overlapped_loop_gives_the_synchronous_tokens(folder: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve's default loop on CUDA queues step N+1 while step N runs, its placeholders read on
    the device (workers/pending_step.py): greedy tokens equal the synchronous loop's, and no
    plan with placeholders went through the host path. Every request runs to the same length,
    so both loops run the same batches through the same graphs."""
    from raydix.workers import worker

    prompts = [[1 + i, 5, 9, 13, 17 + i] * 3 for i in range(6)]
    params = GenerationParams(max_new_tokens=24, ignore_eos=True)
    sync = serve_engine(folder, mem_fraction_static=0.3, overlap_schedule="off")
    want = sync.generate(prompts, params)
    sync.shutdown()
    del sync
    resolved: list[bool] = []
    resolve = worker.resolve_pending

    def recorded(plan: object, *args: object) -> object:
        resolved.append(plan.has_pending)  # type: ignore[attr-defined]
        return resolve(plan, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(worker, "resolve_pending", recorded)
    engine = serve_engine(folder, mem_fraction_static=0.3)
    assert engine.config.scheduler.overlap_schedule
    assert engine.generate(prompts, params) == want
    assert not any(resolved)
    engine.shutdown()
