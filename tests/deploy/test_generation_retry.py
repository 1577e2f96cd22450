"""The ingress sends an engine request again while its replica is lost before answering.

A replica whose engine failed refuses every request at once for a grace period before it ends
(`server.EXIT_GRACE_S`), and routers go on choosing it until it has; a request sent meanwhile
must reach a live replica, not end in a 503. A fake handle stands in for Serve's.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from raydix.deploy import generation
from raydix.deploy.errors import ApiError
from raydix.deploy.generation import Choice, ChoiceStreams
from raydix.engine.engine_errors import EngineDeadError


class _Stream:
    def __init__(self, fail: BaseException | None) -> None:
        self._fail = fail
        self.cancelled = False

    async def __anext__(self) -> list[str]:
        await asyncio.sleep(0)
        if self._fail is not None:
            raise self._fail
        return ["first output"]

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    """Each send fails with `error(elapsed seconds)` while that is not None."""

    def __init__(self, error: Any) -> None:
        self._error = error
        self._start = time.monotonic()
        self.sends: list[_Stream] = []
        self.generate = self

    def options(self, stream: bool) -> _Handle:
        assert stream
        return self

    def remote(self, prompt_ids: list[int], params: object, rid: str) -> _Stream:
        stream = _Stream(self._error(time.monotonic() - self._start))
        self.sends.append(stream)
        return stream


def _start(handle: _Handle) -> ChoiceStreams:
    streams = ChoiceStreams(handle, [Choice(0, [1, 2, 3], None, "r-0")])  # type: ignore[arg-type]
    asyncio.run(streams.start())
    return streams


def test_a_request_outlasts_a_failed_replicas_grace() -> None:
    # the replica refuses for 1.5 s (longer than a fixed three sends spaced 0.2 and 0.4 s)
    handle = _Handle(lambda t: EngineDeadError("the engine stopped") if t < 1.5 else None)
    streams = _start(handle)
    assert streams._first == [["first output"]]
    assert len(handle.sends) >= 4
    assert all(s.cancelled for s in handle.sends[:-1])


def test_a_replica_lost_for_longer_than_the_window_ends_in_a_503(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generation, "RETRY_WINDOW_S", 0.5)
    handle = _Handle(lambda t: EngineDeadError("the engine stopped"))
    began = time.monotonic()
    with pytest.raises(ApiError) as info:
        _start(handle)
    assert time.monotonic() - began < 1.0
    assert info.value.status == 503 and info.value.code == "engine_unavailable"
    assert len(handle.sends) == 2  # at 0 and 0.2 s; the next (0.6 s) would be past the window


def test_other_errors_are_not_sent_again() -> None:
    handle = _Handle(lambda t: ValueError("prompt too long"))
    with pytest.raises(ApiError) as info:
        _start(handle)
    assert info.value.status == 400
    assert len(handle.sends) == 1
