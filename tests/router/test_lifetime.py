"""The router's lifetime rule (router/lifetime.py) on a fake Serve: when it asks, what ends it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from raydix.router.lifetime import AppWatch, RouterLifetimeConfig

WATCHES: list[AppWatch] = []


@pytest.fixture(autouse=True)
def stop_watches() -> Iterator[None]:
    """Each watch's thread ends with its test (a running one would log past pytest's end)."""
    yield
    while WATCHES:
        WATCHES.pop().stop()


def _watch(grace_s: float, answer: bool | None) -> tuple[AppWatch, list[str], list[float]]:
    asked: list[str] = []
    ended: list[float] = []

    def in_serve(app_name: str) -> bool | None:
        asked.append(app_name)
        return answer

    watch = AppWatch("app", RouterLifetimeConfig(check_s=0.02, grace_s=grace_s), ended.append,
                     in_serve=in_serve)
    WATCHES.append(watch)
    return watch, asked, ended


def test_a_reporting_app_never_asks_serve() -> None:
    watch, asked, ended = _watch(grace_s=0.2, answer=False)
    for _ in range(15):
        watch.heard()
        time.sleep(0.02)
    assert asked == [] and ended == []


def test_silence_asks_serve_and_ends_only_when_the_app_is_gone() -> None:
    watch, asked, ended = _watch(grace_s=0.05, answer=True)  # a replica restarting
    time.sleep(0.3)
    assert asked and ended == []
    watch, asked, ended = _watch(grace_s=0.05, answer=None)  # the controller did not answer
    time.sleep(0.3)
    assert asked and ended == []
    watch, asked, ended = _watch(grace_s=0.05, answer=False)
    time.sleep(0.3)
    assert ended and ended[0] == watch.last_heard  # the actor drops it if heard since


def test_a_stopped_watch_checks_no_more() -> None:
    watch, asked, _ = _watch(grace_s=0.0, answer=True)
    time.sleep(0.1)
    WATCHES.remove(watch)
    watch.stop()
    count = len(asked)
    time.sleep(0.1)
    assert count and len(asked) == count


def test_a_lifetime_config_refuses_a_zero_period() -> None:
    with pytest.raises(ValueError, match="check_s"):
        RouterLifetimeConfig(check_s=0)
