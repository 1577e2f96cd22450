"""`AsyncEngine` without Serve: streams equal the engine's, overload, refusals, cancellation."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from raydix.engine.async_engine import (
    AsyncEngine,
    EngineClient,
    EngineDeadError,
    EngineOverloadedError,
)
from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import FinishReason, GenerationParams, RequestOutput
from raydix.workers.config import WorkerConfig

PARAMS = GenerationParams(max_new_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 12, 13], [100, 200, 300, 400, 500]]


def make_engine(model: Path, **sched: int) -> Engine:
    worker = WorkerConfig(model_path=str(model), max_total_tokens=2048)
    scheduler = SchedulerConfig(**{"max_running_requests": 8, "max_context_len": 256, **sched})
    engine = Engine(EngineConfig.build(worker, scheduler))
    engine.step_hook = lambda s: s.cache.check_integrity()
    return engine


@pytest.fixture
def async_engine(tiny_llama: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(make_engine(tiny_llama), max_waiting_requests=2)
    yield engine
    engine.shutdown()


async def _tokens(engine: EngineClient, prompt: list[int], rid: str,
                  params: GenerationParams = PARAMS) -> tuple[list[int], FinishReason | None]:
    tokens: list[int] = []
    reason = None
    async for outputs in engine.generate(prompt, params, rid):
        for out in outputs:
            assert out.rid == rid
            tokens += out.new_token_ids
            reason = out.finish_reason or reason
    return tokens, reason


def test_concurrent_streams_equal_offline_generate(async_engine: AsyncEngine,
                                                   tiny_llama: Path) -> None:
    async def run() -> list[tuple[list[int], FinishReason | None]]:
        return await asyncio.gather(*(_tokens(async_engine, p, f"r{i}")
                                      for i, p in enumerate(PROMPTS)))

    results = asyncio.run(run())
    expected = make_engine(tiny_llama).generate(PROMPTS, PARAMS)
    assert [tokens for tokens, _ in results] == expected
    assert all(reason is FinishReason.LENGTH for _, reason in results)
    assert async_engine.num_in_flight == 0


def test_refusals_and_overload(async_engine: AsyncEngine) -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="empty"):
            await _tokens(async_engine, [], "empty")
        with pytest.raises(ValueError, match="context limit"):
            await _tokens(async_engine, list(range(2, 300)), "long")
        assert async_engine.num_in_flight == 0
        # fill every place: 8 running + 2 waiting; the next one is refused at once
        long = GenerationParams(max_new_tokens=200, ignore_eos=True)
        gens = [async_engine.generate([5, 6, 7], long, f"fill{i}") for i in range(10)]
        firsts = await asyncio.gather(*(g.__anext__() for g in gens))
        assert all(isinstance(f[0], RequestOutput) for f in firsts)
        with pytest.raises(EngineOverloadedError) as info:
            await async_engine.generate([5], PARAMS, "one-more").__anext__()
        assert info.value.retry_after_s >= 1
        for g in gens:
            await g.aclose()  # leaving early aborts
        tokens, _ = await _tokens(async_engine, [5, 6], "after")
        assert len(tokens) == PARAMS.max_new_tokens

    asyncio.run(run())


def test_cancelled_consumer_aborts_and_frees_kv(async_engine: AsyncEngine) -> None:
    async def run() -> tuple[int, int, int]:
        started = asyncio.Event()

        async def consume() -> None:
            params = GenerationParams(max_new_tokens=200, ignore_eos=True)
            async for _ in async_engine.generate([5, 6, 7, 8], params, "victim"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        rows = await async_engine.call(lambda e: e.scheduler.cache.num_running)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        def idle(e: Engine) -> tuple[int, int]:
            e.scheduler.cache.check_integrity()
            return e.scheduler.cache.num_running, e.scheduler.cache.size_info.protected_size

        after_rows, protected = await async_engine.call(idle)
        return rows, after_rows, protected

    rows, after_rows, protected = asyncio.run(run())
    assert rows == 1
    assert (after_rows, protected) == (0, 0)
    assert async_engine.num_in_flight == 0
    assert not async_engine.engine.has_work


def test_requests_queued_behind_a_step_count_as_waiting(tiny_llama: Path) -> None:
    """The engine takes new requests between steps; until then they are waiting all the same
    (the router's load is built from these counts, and a CPU step can last seconds)."""
    engine = make_engine(tiny_llama)
    in_step, release = threading.Event(), threading.Event()
    step = engine.step

    def slow_step() -> list[RequestOutput]:
        in_step.set()
        release.wait(30)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine)

    async def run() -> None:
        first = asyncio.create_task(_tokens(async_engine, PROMPTS[0], "r0"))
        await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 30)
        rest = [asyncio.create_task(_tokens(async_engine, p, f"r{i}"))
                for i, p in enumerate(PROMPTS[1:], 1)]
        await asyncio.sleep(0.1)  # the three are handed over; the step still holds the engine
        assert len(engine.scheduler.waiting) == 1  # only r0 reached the engine
        assert async_engine.running_and_waiting() == (0, 4)
        release.set()
        await asyncio.gather(first, *rest)
        assert async_engine.running_and_waiting() == (0, 0)

    asyncio.run(run())
    async_engine.shutdown()


def test_broken_step_fails_every_caller(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)

    def broken_step() -> list[RequestOutput]:
        raise RuntimeError("rank 1 is gone")

    engine.step = broken_step  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine)

    async def run() -> None:
        with pytest.raises(EngineDeadError, match="rank 1 is gone"):
            await _tokens(async_engine, [5, 6, 7], "r")
        with pytest.raises(EngineDeadError):
            await _tokens(async_engine, [5, 6, 7], "r2")

    asyncio.run(run())
    assert not async_engine.is_alive
    async_engine.shutdown()


def test_shutdown_fails_waiting_callers(tiny_llama: Path) -> None:
    async_engine = AsyncEngine(make_engine(tiny_llama))

    async def run() -> None:
        params = GenerationParams(max_new_tokens=200, ignore_eos=True)
        gen = async_engine.generate([5, 6, 7], params, "r")
        await gen.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            while True:
                await gen.__anext__()
        with pytest.raises(EngineDeadError):
            await async_engine.call(lambda e: e.has_work)

    asyncio.run(run())
    assert not async_engine.is_alive


class _ByteDecoder:
    """Each token is one printable character."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(33 + t % 90) for t in token_ids)


def test_stop_strings_end_streams_off_the_step_thread_as_offline(tiny_llama: Path) -> None:
    """The output processor runs on the caller's loop: same text, tokens and usage as the
    offline engine, and the request is aborted in the engine (its KV freed)."""
    prompt = [40, 41, 42, 43]
    free = make_engine(tiny_llama)
    free.tokenizer = _ByteDecoder()
    rid = free.add_request(prompt, GenerationParams(max_new_tokens=24, ignore_eos=True))
    text = ""
    while free.has_work:
        text += "".join(out.text for out in free.step() if out.rid == rid)
    stop = text[8:10]  # ends the text early, wherever it first appears
    assert stop and text.find(stop) < 20
    # without the abort, the engine would go on to 200 tokens
    params = GenerationParams(max_new_tokens=200, ignore_eos=True, stop_strings=(stop,))

    def collect(outputs: list[RequestOutput]) -> tuple[str, list[int], object, int]:
        final = outputs[-1]
        return ("".join(o.text for o in outputs), [t for o in outputs for t in o.new_token_ids],
                final.finish_reason, final.usage.completion_tokens)

    offline = make_engine(tiny_llama)
    offline.tokenizer = _ByteDecoder()
    rid = offline.add_request(prompt, params)
    outs: list[RequestOutput] = []
    while offline.has_work:
        outs += [out for out in offline.step() if out.rid == rid]
    expected = collect(outs)
    assert expected[0] == text[: text.find(stop)] and expected[2] is FinishReason.STOP
    assert expected[3] == len(expected[1]) < 24

    engine = make_engine(tiny_llama)
    engine.tokenizer = _ByteDecoder()
    async_engine = AsyncEngine(engine)

    async def run() -> list[RequestOutput]:
        got: list[RequestOutput] = []
        async for outputs in async_engine.generate(prompt, params, "s"):
            got += outputs
        return got

    try:
        assert collect(asyncio.run(run())) == expected

        async def rows_and_tokens() -> tuple[int, int]:
            for _ in range(200):
                num = await async_engine.call(lambda e: e.cache_stats().num_rows)
                if num == 0:
                    break
                await asyncio.sleep(0.01)
            generated = await async_engine.call(lambda e: e.metrics().num_generated_tokens)
            return num, generated

        num_rows, generated = asyncio.run(rows_and_tokens())
        assert num_rows == 0 and generated < 100  # the abort reached the engine early
    finally:
        async_engine.shutdown()
