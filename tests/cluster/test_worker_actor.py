"""A follower rank whose loop fails ends the loop and its process, loudly, instead of following
again while rank 0 waits in a collective forever (no Ray needed: the actor class is plain)."""

from __future__ import annotations

import inspect

import pytest

from raydix.cluster import worker_actor
from raydix.cluster.worker_actor import WorkerActor


class _FailingWorker:
    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.num_follows = 0

    def follow(self) -> int:
        self.num_follows += 1
        raise self.error


@pytest.mark.parametrize("error", [ValueError("bad plan mid-forward"),
                                   RuntimeError("gloo: connection closed")])
def test_follower_error_ends_loop_and_process(error: BaseException,
                                              caplog: pytest.LogCaptureFixture) -> None:
    actor = WorkerActor(1)
    worker = _FailingWorker(error)
    actor._worker = worker  # type: ignore[assignment]
    exits: list[int] = []
    actor._follow(on_error=lambda: exits.append(1))
    assert worker.num_follows == 1  # never follows again after an error
    assert exits == [1]
    health = actor.health()
    assert health is not None and str(error) in health
    assert "follow loop failed" in caplog.text


def test_follower_that_is_told_to_stop_stays_quiet() -> None:
    class _Stops:
        def follow(self) -> int:
            return 3

    actor = WorkerActor(1)
    actor._worker = _Stops()  # type: ignore[assignment]
    actor._follow(on_error=lambda: pytest.fail("a clean stop is no error"))
    assert actor.health() is None


def test_the_default_on_error_ends_the_process() -> None:
    default = inspect.signature(WorkerActor._follow).parameters["on_error"].default
    assert default is worker_actor.exit_process
