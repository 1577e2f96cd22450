"""`ProcessEngine`: the engine stepped in a child process, streamed on the caller's event loop.

The same outputs as the engine stepped here, refusals, overload and aborts as `AsyncEngine`,
the engine's figures fresh without a call, its cache events and log lines carried over, and a
child that dies, fails to build or is shut down leaves no caller waiting and no process.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from raydix.cache import CacheEvent, EventKind, EventSink
from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.engine_errors import EngineDeadError, EngineOverloadedError
from raydix.engine.engine_process import ProcessEngine
from raydix.engine.executor import UnhealthyRanksError
from raydix.engine.request import FinishReason, GenerationParams, RequestOutput
from raydix.workers.config import WorkerConfig
from tests.deploy.test_async_engine import PARAMS, PROMPTS, _tokens

LONG = GenerationParams(max_new_tokens=400, ignore_eos=True)


# ------------------------------------------------------- factories (module-level: they pickle)
def make_engine(model: Path, event_sink: EventSink | None = None) -> Engine:
    worker = WorkerConfig(model_path=str(model), max_total_tokens=2048)
    scheduler = SchedulerConfig(max_running_requests=8, max_context_len=512)
    engine = Engine(EngineConfig.build(worker, scheduler), event_sink=event_sink)
    engine.step_hook = lambda s: s.cache.check_integrity()
    engine.collector_on_in_build = gc.isenabled()  # type: ignore[attr-defined]
    return engine


def broken_engine(model: Path, event_sink: EventSink | None = None) -> Engine:
    engine = make_engine(model, event_sink)

    def broken_step() -> list[RequestOutput]:
        raise RuntimeError("rank 1 is gone")

    engine.step = broken_step  # type: ignore[method-assign]
    return engine


def unbuildable_engine(model: Path, event_sink: EventSink | None = None) -> Engine:
    raise ValueError(f"no weights in {model}")


class ByteDecoder:
    """Each token is one printable character."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(33 + t % 90) for t in token_ids)


def byte_text_engine(model: Path, event_sink: EventSink | None = None) -> Engine:
    engine = make_engine(model, event_sink)
    engine.tokenizer = ByteDecoder()
    return engine


# ----------------------------------------------------------- functions the child runs (calls)
def rows_and_protected(engine: Engine) -> tuple[int, int]:
    engine.scheduler.cache.check_integrity()
    return engine.scheduler.cache.num_running, engine.scheduler.cache.size_info.protected_size


def process_id(engine: Engine) -> int:
    return os.getpid()


def heap_counts(engine: Engine) -> tuple[int, int]:
    """Objects frozen out of the collector's walks, and those a full collection walks."""
    return gc.get_freeze_count(), len(gc.get_objects())


def populated_and_slots(engine: Engine) -> tuple[int, int]:
    runner = engine.executor.worker.runner  # type: ignore[attr-defined]
    return runner.kv_prefault.populated, runner.kv_pool.config.num_slots


def visible_devices(engine: Engine) -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def events() -> list[CacheEvent]:
    return []


@pytest.fixture
def process_engine(tiny_llama: Path, events: list[CacheEvent]) -> Iterator[ProcessEngine]:
    engine = ProcessEngine(functools.partial(make_engine, tiny_llama), events.append,
                           max_waiting_requests=2)
    yield engine
    engine.shutdown()
    assert _gone(engine.pid)


def test_streams_equal_the_engine_stepped_here(process_engine: ProcessEngine, tiny_llama: Path,
                                               events: list[CacheEvent]) -> None:
    async def run() -> list[tuple[list[int], FinishReason | None]]:
        return await asyncio.gather(*(_tokens(process_engine, p, f"r{i}")
                                      for i, p in enumerate(PROMPTS)))

    results = asyncio.run(run())
    here: list[CacheEvent] = []
    expected = make_engine(tiny_llama, here.append).generate(PROMPTS, PARAMS)
    assert [tokens for tokens, _ in results] == expected
    assert all(reason is FinishReason.LENGTH for _, reason in results)
    assert process_engine.num_in_flight == 0
    # the cache's events crossed over, in order, each prompt's tokens among the inserts
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    inserted = [e.token_ids.tolist() for e in events if e.kind is EventKind.INSERTED]
    for prompt in PROMPTS:
        assert any(ids[:len(prompt)] == prompt for ids in inserted)
    assert len(events) == len(here)
    assert asyncio.run(process_engine.call(process_id)) == process_engine.pid != os.getpid()


def test_the_start_up_heap_is_frozen(process_engine: ProcessEngine) -> None:
    """What start-up built (torch, the model, the engine) is outside the collector's walks: a
    full collection, which holds every stream while it runs, walks only what serving allocated
    since (workers/gc_heap.py)."""
    frozen, walked = asyncio.run(process_engine.call(heap_counts))
    assert frozen > 50_000  # torch's modules alone
    assert walked < frozen / 10


def collector_states(engine: Engine) -> tuple[bool, bool]:
    return engine.collector_on_in_build, gc.isenabled()  # type: ignore[attr-defined]


def test_the_build_runs_with_the_collector_paused_and_serving_with_it_on(
        process_engine: ProcessEngine) -> None:
    """No automatic collection while the engine is built (workers/gc_heap.py:
    `collection_paused`), and the collector back on for serving (else reference cycles would
    never be freed)."""
    assert asyncio.run(process_engine.call(collector_states)) == (False, True)


def test_the_idle_process_populates_its_pool_ahead_of_use(process_engine: ProcessEngine) -> None:
    """Between commands the child populates its CPU KV pool's pages (workers/kv_prefault.py):
    the tiny pool lies within the distance ahead, so all of it."""
    def populated() -> bool:
        done, slots = asyncio.run(process_engine.call(populated_and_slots))
        return bool(done == slots)

    _wait_for(populated, within_s=20.0)
    assert populated()


def test_refusals_and_overload(process_engine: ProcessEngine) -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="empty"):
            await _tokens(process_engine, [], "empty")
        with pytest.raises(ValueError, match="context limit"):
            await _tokens(process_engine, list(range(2, 600)), "long")
        assert process_engine.num_in_flight == 0
        # fill every place: 8 running + 2 waiting; the next one is refused at once
        gens = [process_engine.generate([5, 6, 7], LONG, f"fill{i}") for i in range(10)]
        firsts = await asyncio.gather(*(g.__anext__() for g in gens))
        assert all(isinstance(f[0], RequestOutput) for f in firsts)
        with pytest.raises(EngineOverloadedError) as info:
            await process_engine.generate([5], PARAMS, "one-more").__anext__()
        assert info.value.retry_after_s >= 1
        for g in gens:
            await g.aclose()  # leaving early aborts
        tokens, _ = await _tokens(process_engine, [5, 6], "after")
        assert len(tokens) == PARAMS.max_new_tokens
        assert await process_engine.call(rows_and_protected) == (0, 0)

    asyncio.run(run())


def test_cancelled_consumer_aborts_and_frees_kv(process_engine: ProcessEngine) -> None:
    async def run() -> tuple[tuple[int, int], tuple[int, int]]:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in process_engine.generate([5, 6, 7, 8], LONG, "victim"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        during = await process_engine.call(rows_and_protected)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return during, await process_engine.call(rows_and_protected)

    during, after = asyncio.run(run())
    assert during[0] == 1
    assert after == (0, 0)
    assert process_engine.num_in_flight == 0
    # the idle engine's figures follow (they may come just after a call's result)
    _wait_for(lambda: process_engine.engine.cache_stats().num_rows == 0, within_s=1.0)
    assert process_engine.engine.cache_stats().num_rows == 0


def test_figures_are_fresh_while_it_steps(process_engine: ProcessEngine) -> None:
    """Running requests, tokens made and the KV in use move while a stream runs, without a
    call that waits for a step (the stats and the router read these)."""
    async def run() -> list[tuple[int, int, int]]:
        seen = []
        async for _ in process_engine.generate([5, 6, 7, 8], LONG, "r"):
            mirror = process_engine.engine
            seen.append((mirror.num_running, mirror.metrics().num_generated_tokens,
                         mirror.cache_stats().num_used_tokens))
        # the step that ended the stream brought its figures before its last output
        assert process_engine.engine.metrics().num_generated_tokens == LONG.max_new_tokens
        await asyncio.sleep(0.2)
        return seen

    seen = asyncio.run(run())
    assert any(running == 1 for running, _, _ in seen[5:-5])
    generated = [g for _, g, _ in seen]
    assert generated == sorted(generated) and generated[-1] > generated[0]
    assert max(used for _, _, used in seen) >= 4
    assert process_engine.running_and_waiting() == (0, 0)
    assert process_engine.engine.metrics().num_generated_tokens == LONG.max_new_tokens
    assert process_engine.engine.num_steps > 0


def test_stop_strings_end_streams_as_offline(tiny_llama: Path) -> None:
    """The output processor runs here with the engine's tokenizer, sent over at start."""
    prompt = [40, 41, 42, 43]
    free = byte_text_engine(tiny_llama)
    rid = free.add_request(prompt, GenerationParams(max_new_tokens=24, ignore_eos=True))
    text = ""
    while free.has_work:
        text += "".join(out.text for out in free.step() if out.rid == rid)
    stop = text[8:10]
    assert stop and text.find(stop) < 20
    params = GenerationParams(max_new_tokens=200, ignore_eos=True, stop_strings=(stop,))
    engine = ProcessEngine(functools.partial(byte_text_engine, tiny_llama))

    async def run() -> tuple[str, FinishReason | None, tuple[int, int]]:
        got = ""
        reason = None
        async for outputs in engine.generate(prompt, params, "s"):
            got += "".join(o.text for o in outputs)
            reason = outputs[-1].finish_reason or reason
        for _ in range(200):  # the abort reaches the engine
            rows = await engine.call(rows_and_protected)
            if rows[0] == 0:
                break
            await asyncio.sleep(0.01)
        return got, reason, rows

    try:
        got, reason, rows = asyncio.run(run())
    finally:
        engine.shutdown()
    assert got == text[: text.find(stop)] and reason is FinishReason.STOP
    assert rows == (0, 0)
    assert engine.engine.metrics().num_generated_tokens < 100


def test_the_process_sees_the_gpu_ray_gave_the_replica(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA replica with tp 1 reserves its GPU and Ray sets CUDA_VISIBLE_DEVICES in the
    replica's environment, after start: the engine process, which holds the rank, sees it."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    engine = ProcessEngine(functools.partial(make_engine, tiny_llama))
    try:
        assert asyncio.run(engine.call(visible_devices)) == "3"
    finally:
        engine.shutdown()


def test_log_lines_come_over(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="raydix"):
        engine = ProcessEngine(functools.partial(make_engine, tiny_llama))
        engine.shutdown()
    assert any(r.name == "raydix.engine.engine" and "engine ready" in r.getMessage()
               for r in caplog.records)
    assert any("KV pool: 2048 tokens" in r.getMessage() for r in caplog.records)


def test_a_broken_step_fails_every_caller(tiny_llama: Path) -> None:
    errors: list[BaseException] = []
    engine = ProcessEngine(functools.partial(broken_engine, tiny_llama), on_error=errors.append)

    async def run() -> None:
        with pytest.raises(EngineDeadError, match="rank 1 is gone"):
            await _tokens(engine, [5, 6, 7], "r")
        with pytest.raises(EngineDeadError):
            await _tokens(engine, [5, 6, 7], "r2")

    asyncio.run(run())
    assert not engine.is_alive
    _wait_for(lambda: bool(errors))  # after the callers were told
    assert len(errors) == 1 and "rank 1 is gone" in str(errors[0])
    assert _gone(engine.pid)
    engine.shutdown()


def test_a_killed_process_fails_every_caller(process_engine: ProcessEngine) -> None:
    errors: list[BaseException] = []
    process_engine._on_error = errors.append

    async def run() -> None:
        gen = process_engine.generate([5, 6, 7], LONG, "r")
        await gen.__anext__()
        os.kill(process_engine.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine process ended"):
            while True:
                await gen.__anext__()
        with pytest.raises(EngineDeadError):
            await _tokens(process_engine, [5, 6], "later")
        with pytest.raises(EngineDeadError):
            await process_engine.call(process_id)
        with pytest.raises(UnhealthyRanksError) as info:
            await process_engine.check_ranks()
        assert info.value.permanent

    asyncio.run(run())
    assert not process_engine.is_alive
    _wait_for(lambda: bool(errors))
    assert len(errors) == 1 and "exit code -9" in str(errors[0])


def test_shutdown_fails_waiting_callers_and_ends_the_process(tiny_llama: Path) -> None:
    engine = ProcessEngine(functools.partial(make_engine, tiny_llama))

    async def run() -> None:
        gen = engine.generate([5, 6, 7], LONG, "r")
        await gen.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            while True:
                await gen.__anext__()
        with pytest.raises(EngineDeadError):
            await engine.call(process_id)

    asyncio.run(run())
    assert not engine.is_alive
    assert _gone(engine.pid, within_s=0.1)


def test_a_build_error_raises_here_and_leaves_no_process(tiny_llama: Path) -> None:
    before = set(_children())
    with pytest.raises(ValueError, match="no weights in"):
        ProcessEngine(functools.partial(unbuildable_engine, tiny_llama))
    time.sleep(0.1)
    assert set(_children()) <= before


def test_the_process_ends_with_its_parent(tiny_llama: Path, tmp_path: Path) -> None:
    """A parent killed without a word (no shutdown, no closed pipe first) takes the engine
    process with it."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import functools, os, sys
        sys.path[:0] = {sys.path!r}
        from raydix.engine.engine_process import ProcessEngine
        from tests.deploy.test_engine_process import make_engine
        engine = ProcessEngine(functools.partial(make_engine, {str(tiny_llama)!r}))
        print(engine.pid, flush=True)
        os.kill(os.getpid(), 9)
    """))
    parent = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120)
    assert parent.returncode == -signal.SIGKILL, parent.stderr
    assert _gone(int(parent.stdout.split()[0]))


def _wait_for(done: Callable[[], bool], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def _children() -> list[int]:
    path = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return [int(pid) for pid in path.read_text().split()]
