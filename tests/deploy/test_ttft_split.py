"""The time to the first token split at the engine replica: the replica stamps its part on the
first output that carries tokens, and the ingress's metrics keep that part and the rest."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from raydix.deploy.metrics import IngressMetrics
from raydix.engine.request import FinishReason, RequestOutput, Usage, with_engine_ttft


def _out(tokens: tuple[int, ...], reason: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r", tokens, "", reason, Usage(4, 0, len(tokens)))


def test_the_stamp_goes_on_the_first_output_with_tokens() -> None:
    empty, first, second = _out(()), _out((7,)), _out((8,))
    stamped = with_engine_ttft([empty, first, second], 0.25)
    assert [o.engine_ttft_s for o in stamped] == [None, 0.25, None]
    assert stamped[1]._replace(engine_ttft_s=None) == first  # nothing else changed
    assert with_engine_ttft([empty], 0.25) == [empty]  # no tokens yet: nothing to stamp


def _sample(metrics: IngressMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


def test_the_ingress_keeps_the_engine_part_and_the_rest() -> None:
    metrics = IngressMetrics()
    tracker = metrics.track(chat=False)
    engine_part = 0.02

    async def events() -> AsyncIterator[tuple[int, RequestOutput]]:
        await asyncio.sleep(0.05)  # the whole wait for the first token: over 50 ms
        yield 0, _out((1,))._replace(engine_ttft_s=engine_part)
        yield 0, _out((2,), FinishReason.LENGTH)

    async def run() -> None:
        async for _ in tracker.watch(events()):
            pass

    start = time.perf_counter()
    asyncio.run(run())
    elapsed = time.perf_counter() - start
    whole = _sample(metrics, "raydix_time_to_first_token_seconds_sum")
    assert 0.05 <= whole <= elapsed
    assert _sample(metrics, "raydix_engine_time_to_first_token_seconds_sum") == engine_part
    assert _sample(metrics, "raydix_path_time_to_first_token_seconds_sum") == pytest.approx(
        whole - engine_part)
    for part in ("engine_", "path_"):
        assert _sample(metrics, f"raydix_{part}time_to_first_token_seconds_count") == 1


def test_an_output_without_the_stamp_leaves_the_split_empty() -> None:
    """Outputs from an engine that does not stamp (a test's stand-in) count in the whole only."""
    metrics = IngressMetrics()
    tracker = metrics.track(chat=False)

    async def events() -> AsyncIterator[tuple[int, RequestOutput]]:
        yield 0, _out((1,), FinishReason.LENGTH)

    async def run() -> None:
        async for _ in tracker.watch(events()):
            pass

    asyncio.run(run())
    assert _sample(metrics, "raydix_time_to_first_token_seconds_count") == 1
    assert _sample(metrics, "raydix_engine_time_to_first_token_seconds_count") == 0


def test_the_clock_starts_where_the_handler_started_it() -> None:
    """The ingress starts a request's clock as its handler is entered: what came before the
    engine requests (parsing, the chat template, a grammar) counts in the time to the first
    token and in the path's part."""
    metrics = IngressMetrics()
    entered = time.perf_counter() - 0.3  # a handler that spent 0.3 s before its first send
    tracker = metrics.track(chat=True, start=entered)

    async def events() -> AsyncIterator[tuple[int, RequestOutput]]:
        yield 0, _out((1,), FinishReason.LENGTH)._replace(engine_ttft_s=0.01)

    async def run() -> None:
        async for _ in tracker.watch(events()):
            pass

    asyncio.run(run())
    assert _sample(metrics, "raydix_time_to_first_token_seconds_sum") >= 0.3
    assert _sample(metrics, "raydix_path_time_to_first_token_seconds_sum") >= 0.29
    assert _sample(metrics, "raydix_request_latency_seconds_sum") >= 0.3
