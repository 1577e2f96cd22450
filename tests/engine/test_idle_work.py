"""`Engine.idle_work`: with no requests the engine populates its CPU KV pool's next pages
ahead of use (workers/kv_prefault.py), a chunk per call, then says there is nothing left; with
work waiting it does nothing; the tokens are those of an engine that never did it."""

from __future__ import annotations

from pathlib import Path

from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.workers.config import WorkerConfig

PROMPTS = [[5, 9, 3, 7] * 20, [11, 4, 8] * 30, [5, 9, 3, 7] * 10 + [2, 6]]
PARAMS = GenerationParams(max_new_tokens=12, ignore_eos=True)


def _engine(model: Path, prefault: bool) -> Engine:
    worker = WorkerConfig(model_path=str(model), max_total_tokens=4096, cpu_prefault_kv=prefault)
    engine = Engine(EngineConfig.build(worker, SchedulerConfig(max_running_requests=8,
                                                               max_context_len=512)))
    engine.step_hook = lambda sched: sched.cache.check_integrity()
    return engine


def _populated(engine: Engine) -> int:
    prefault = engine.executor.worker.runner.kv_prefault  # type: ignore[attr-defined]
    return int(prefault.populated)


def test_an_idle_engine_populates_its_pool_and_gives_the_same_tokens(tiny_llama: Path) -> None:
    engine, lazy = _engine(tiny_llama, True), _engine(tiny_llama, False)
    assert lazy.executor.worker.runner.kv_prefault is None  # type: ignore[attr-defined]
    assert not lazy.idle_work()
    num_slots = engine.executor.worker.runner.kv_pool.config.num_slots  # type: ignore[attr-defined]
    calls = 0
    while engine.idle_work():
        calls += 1
        assert calls < 10_000
    assert calls > 1  # a chunk a call
    assert _populated(engine) == num_slots  # the tiny pool lies within the distance ahead
    assert engine.generate(PROMPTS, PARAMS) == lazy.generate(PROMPTS, PARAMS)


def test_no_idle_work_while_requests_wait(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, True)
    engine.add_request(PROMPTS[0], PARAMS)
    assert engine.has_work and not engine.idle_work() and _populated(engine) == 0
    while engine.has_work:
        engine.step()
    assert engine.idle_work() and _populated(engine) > 0
