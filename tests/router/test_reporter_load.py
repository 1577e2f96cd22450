"""The reporter sends the load with every batch of cache events, changed or not."""

from __future__ import annotations

from typing import Any

from raydix.cache import EventBuffer, RadixCache
from raydix.router.reporter import LoadReport, ReplicaReporter


class _Method:
    def __init__(self, calls: list[tuple[str, tuple[Any, ...]]], name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args: Any) -> None:
        self.calls.append((self.name, args))


class _Router:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.publish = _Method(self.calls, "publish")
        self.report_load = _Method(self.calls, "report_load")


def test_a_request_that_came_and_went_between_reads_still_brings_a_load_report() -> None:
    router = _Router()
    buffer = EventBuffer()
    cache = RadixCache(event_sink=buffer)
    idle = LoadReport(0, 0, 0.0, 4096)
    reporter = ReplicaReporter(router, "r0", buffer.drain, lambda: idle,  # type: ignore[arg-type]
                               heartbeat_s=60.0)
    reporter.report_once()  # the CLEARED event and the first load
    router.calls.clear()
    assert reporter.report_once() is None and router.calls == []  # nothing new: nothing sent
    cache.insert([5, 6, 7], [1, 2, 3])  # a request was computed; the load reads idle again
    reporter.report_once()
    assert [name for name, _ in router.calls] == ["publish", "report_load"]
    assert router.calls[1][1] == ("r0", 0, 0, 0.0, 4096)
