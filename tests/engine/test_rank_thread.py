"""The in-process rank does all its torch work on one thread: torch's OpenMP runtime slows every
step once a second thread has run its kernels (workers/torch_thread.py). The overlapped loop's
rank has a thread of its own; the synchronous loop's rank is the engine's thread."""

from __future__ import annotations

import logging
import threading
from typing import Any, ClassVar

import pytest

from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.workers import worker
from raydix.workers.pending_step import PendingStep
from raydix.workers.step import StepPlan, StepResult
from tests.engine.conftest import EngineFactory, random_prompts
from tests.engine.test_engine import assert_drained


class _RecordingWorker(worker.TPWorker):
    """The real rank, noting the thread of each call that runs torch work."""

    threads: ClassVar[list[tuple[str, int]]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.threads.append(("build", threading.get_ident()))
        super().__init__(*args, **kwargs)

    def step(self, plan: StepPlan) -> StepResult:
        self.threads.append(("step", threading.get_ident()))
        return super().step(plan)

    def launch(self, plan: StepPlan) -> PendingStep:
        self.threads.append(("launch", threading.get_ident()))
        return super().launch(plan)


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    monkeypatch.setattr(worker, "TPWorker", _RecordingWorker)
    monkeypatch.setattr(_RecordingWorker, "threads", [])
    return _RecordingWorker.threads


def _run(engine: Engine) -> None:
    for prompt in random_prompts(seed=3, groups=2, per_group=3, prefix_len=8,
                                 question_len=(2, 6)):
        engine.add_request(prompt, GenerationParams(max_new_tokens=6, ignore_eos=True))
    while engine.has_work:
        engine.step()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_rank_is_built_and_stepped_on_one_thread(
        make_engine: EngineFactory, recording: list[tuple[str, int]], overlap: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(overlap_schedule=overlap)
    _run(engine)
    assert_drained(engine)
    engine.shutdown()
    calls = {what for what, _ in recording}
    assert calls == {"build", "launch"} | (set() if overlap else {"step"})
    threads = {ident for _, ident in recording}
    assert len(threads) == 1
    # the overlapped loop's rank runs beside the engine; the synchronous one is the engine's
    assert (threading.get_ident() in threads) is not overlap
    assert "another thread" not in caplog.text


def test_a_synchronous_rank_stepped_on_another_thread_says_so(
        make_engine: EngineFactory, recording: list[tuple[str, int]],
        caplog: pytest.LogCaptureFixture) -> None:
    engines: list[Engine] = []
    builder = threading.Thread(target=lambda: engines.append(make_engine()))
    builder.start()
    builder.join()
    with caplog.at_level(logging.WARNING):
        _run(engines[0])
    assert caplog.text.count("stepped on another thread than the one that built it") == 1
