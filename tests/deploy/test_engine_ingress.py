"""The ingress's calls to an engine replica in its own process (`engine_ingress.py`), with a
fake engine replica: outputs stream as they come, a stream left early closes the replica's
generator (which aborts the request in the engine), and a failure is an API error at once,
never sent again (there is no other replica)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import pytest

from raydix.deploy.engine_ingress import LocalEngineHandle
from raydix.deploy.errors import ApiError
from raydix.deploy.generation import Choice, ChoiceStreams
from raydix.engine.engine_errors import EngineDeadError, EngineOverloadedError
from raydix.engine.request import GenerationParams, RequestOutput, Usage


class _FakeServer:
    """Streams `num_chunks` one-token outputs per request (then finishes), or raises `fail`."""

    def __init__(self, num_chunks: int = 3, fail: BaseException | None = None) -> None:
        self.num_chunks = num_chunks
        self.fail = fail
        self.started: list[str] = []
        self.closed: list[str] = []  # requests whose generator ended (finished or aborted)
        self.pinged = 0

    async def generate(self, prompt_ids: Sequence[int], params: GenerationParams,
                       rid: str) -> AsyncIterator[list[RequestOutput]]:
        self.started.append(rid)
        try:
            if self.fail is not None:
                raise self.fail
            for i in range(self.num_chunks):
                await asyncio.sleep(0.01)
                last = i == self.num_chunks - 1
                yield [RequestOutput(rid, (i,), str(i), "length" if last else None,
                                     Usage(len(prompt_ids), 0, i + 1))]
        finally:
            self.closed.append(rid)

    async def ping(self) -> bool:
        self.pinged += 1
        return True


def _streams(server: _FakeServer, n: int = 1) -> ChoiceStreams:
    handle = LocalEngineHandle(server)  # type: ignore[arg-type]
    choices = [Choice(i, [1, 2, 3], GenerationParams(max_new_tokens=3), f"r-{i}")
               for i in range(n)]
    return ChoiceStreams(handle, choices)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [1, 3])
def test_outputs_stream_through_the_local_handle(n: int) -> None:
    server = _FakeServer()

    async def run() -> list[tuple[int, tuple[int, ...]]]:
        streams = _streams(server, n)
        await streams.start()
        return [(i, out.new_token_ids) async for i, out in streams.events()]

    got = asyncio.run(run())
    for i in range(n):
        assert [ids for j, ids in got if j == i] == [(0,), (1,), (2,)]
    assert sorted(server.closed) == sorted(server.started) == [f"r-{i}" for i in range(n)]


@pytest.mark.parametrize("n", [1, 3])
def test_a_stream_left_early_closes_the_engine_request(n: int) -> None:
    """What a client that went away does: the events stop being read and are closed."""
    server = _FakeServer(num_chunks=1000)

    async def run() -> list[str]:
        streams = _streams(server, n)
        await streams.start()
        events = streams.events()
        await events.__anext__()
        await events.aclose()  # type: ignore[attr-defined]
        for _ in range(50):  # the close runs as a task of the event loop
            if len(server.closed) == n:
                break
            await asyncio.sleep(0.01)
        return list(server.closed)  # read before asyncio.run closes what is left open

    assert sorted(asyncio.run(run())) == [f"r-{i}" for i in range(n)]


@pytest.mark.parametrize(("fail", "status", "code"), [
    (EngineDeadError("the engine loop stopped"), 503, "engine_unavailable"),
    (EngineOverloadedError(10, 1), 503, None),
    (ValueError("the prompt is too long"), 400, None),
])
def test_a_local_failure_is_an_api_error_at_once(fail: Exception, status: int,
                                                  code: str | None) -> None:
    server = _FakeServer(fail=fail)
    start = time.monotonic()
    with pytest.raises(ApiError) as refused:
        asyncio.run(_streams(server).start())
    assert refused.value.status == status
    if code is not None:
        assert refused.value.code == code
    assert server.started == ["r-0"]  # sent once: no other replica to try
    assert time.monotonic() - start < 1.0


def test_health_asks_the_local_replica() -> None:
    server = _FakeServer()
    assert asyncio.run(LocalEngineHandle(server).ping.remote()) is True  # type: ignore[arg-type]
    assert server.pinged == 1
