"""The reporter sends the load with every batch of cache events, changed or not, and between
them when the request counts changed or the KV usage moved by a step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raydix.cache import EventBuffer, RadixCache
from raydix.router.reporter import KV_USAGE_STEP, LoadReport, ReplicaReporter


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
    assert router.calls[1][1] == ("r0", 0, 0, 0.0, 4096, ())


def _reporting(router: _Router, read_load: Callable[[], LoadReport]) -> ReplicaReporter:
    """A reporter that has sent its first load (the router's calls cleared after it)."""
    reporter = ReplicaReporter(router, "r0", lambda: (), read_load,  # type: ignore[arg-type]
                               heartbeat_s=60.0)
    reporter.report_once()
    router.calls.clear()
    return reporter


def test_a_stream_growing_its_kv_sends_a_load_report_per_step_of_usage_not_per_token() -> None:
    router = _Router()
    load = LoadReport(1, 0, 0.5, 4096)
    reporter = _reporting(router, lambda: load)
    tick = KV_USAGE_STEP / 10  # a token's worth of a small pool
    sent = []
    for i in range(1, 31):
        load = LoadReport(1, 0, 0.5 + i * tick, 4096)
        reporter.report_once()
        sent += [args[3] for name, args in router.calls if name == "report_load"]
        router.calls.clear()
    assert len(sent) == 3  # at each whole step of usage
    assert all(abs(b - a) >= KV_USAGE_STEP * 0.999 for a, b in zip([0.5, *sent[:-1]], sent, strict=True))
    load = load._replace(num_waiting=1)  # a request queued: at once
    reporter.report_once()
    assert router.calls == [("report_load", ("r0", *load))]


def test_received_request_ids_go_at_once_though_the_counts_did_not_change() -> None:
    router = _Router()
    load = LoadReport(1, 0, 0.5, 4096)
    reporter = _reporting(router, lambda: load)
    load = LoadReport(1, 0, 0.5, 4096, ("rid-1",))  # one came, one left: the same counts
    reporter.report_once()
    assert router.calls == [("report_load", ("r0", 1, 0, 0.5, 4096, ("rid-1",)))]
