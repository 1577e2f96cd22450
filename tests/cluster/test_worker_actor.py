"""A follower rank whose loop fails ends the loop and its process, loudly, instead of following
again while rank 0 waits in a collective forever; every call of a rank that runs torch work runs
on the rank's one thread, whichever of Ray's threads made it (no Ray needed: the actor class is
plain)."""

from __future__ import annotations

import inspect
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import pytest

from raydix.cluster import worker_actor
from raydix.cluster.worker_actor import WorkerActor
from raydix.workers.config import WorkerConfig


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


class _RecordingWorker:
    """Stands in for `TPWorker`: notes the thread of each call that would run torch work."""

    threads: ClassVar[list[tuple[str, int]]] = []

    def __init__(self, config: WorkerConfig, rendezvous: str) -> None:
        self.tp_rank = config.tp_rank
        self.max_num_tokens = 64
        self.launched: list[int] = []
        self._note("build")

    def _note(self, what: str) -> None:
        type(self).threads.append((what, threading.get_ident()))

    def launch(self, plan: int) -> _Pending:
        self._note("launch")
        if plan < 0:
            raise ValueError(f"bad plan {plan}")
        self.launched.append(plan)
        return _Pending(plan)

    def follow(self) -> int:
        self._note("follow")
        return 0

    def stop_followers(self) -> None:
        self._note("stop_followers")


class _Pending:
    def __init__(self, plan: int) -> None:
        self.plan = plan

    def result(self) -> int:
        return self.plan * 10


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> type[_RecordingWorker]:
    from raydix.workers import worker

    monkeypatch.setattr(worker, "TPWorker", _RecordingWorker)
    monkeypatch.setattr(_RecordingWorker, "threads", [])
    return _RecordingWorker


def test_rank_0_builds_and_launches_on_one_thread_in_launch_order(
        recording: type[_RecordingWorker]) -> None:
    """Ray runs `start` and each `step` on any of its pool threads; the rank's torch work must
    still run on one thread (workers/torch_thread.py), in launch order, and each step's result
    or error must reach its own caller."""
    actor = WorkerActor(0)
    # sent in launch order, started by Ray's threads in another order; launch 3 fails
    plans = [5, 6, 7, -1, 8, 9, 10, 11]
    order = [7, 2, 5, 0, 3, 6, 1, 4]
    with ThreadPoolExecutor(len(plans), thread_name_prefix="ray-pool") as pool:
        started = pool.submit(actor.start, WorkerConfig("unused", tp_size=2), "tcp://x:1")
        assert started.result(timeout=30) == 64
        futures = {n: pool.submit(actor.step, plans[n], n) for n in order}  # type: ignore[arg-type]
        for n, plan in enumerate(plans):
            if plan < 0:
                with pytest.raises(ValueError, match="bad plan -1"):
                    futures[n].result(timeout=30)
            else:
                assert futures[n].result(timeout=30) == plan * 10
        pool.submit(actor.stop_followers).result(timeout=30)
    assert actor._worker.launched == [p for p in plans if p >= 0]  # type: ignore[union-attr]
    calls = [what for what, _ in recording.threads]
    assert calls == ["build"] + ["launch"] * len(plans) + ["stop_followers"]
    threads = {ident for _, ident in recording.threads}
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert actor.health() is None


def test_a_follower_follows_on_the_thread_that_built_it(
        recording: type[_RecordingWorker]) -> None:
    actor = WorkerActor(1)
    with ThreadPoolExecutor(1, thread_name_prefix="ray-pool") as pool:
        pool.submit(actor.start, WorkerConfig("unused", tp_rank=1, tp_size=2), "tcp://x:1"
                    ).result(timeout=30)
    deadline = time.monotonic() + 10
    while len(recording.threads) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [what for what, _ in recording.threads] == ["build", "follow"]
    assert len({ident for _, ident in recording.threads}) == 1
