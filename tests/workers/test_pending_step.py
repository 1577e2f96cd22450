"""A launched step's result and the next step's inputs read on the device (workers/pending_step.py):
the driving rank queues step N+1 without waiting for step N where nothing on the host needs
step N's tokens, and the tokens it reads there are the ones step N sampled."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from raydix.workers.config import WorkerConfig
from raydix.workers.pending_step import PendingStep, SampledTokens, input_ids_on_device
from raydix.workers.step import (
    GREEDY,
    PenaltyStart,
    SamplingParams,
    ScheduledRequest,
    StepPlan,
    pending_token,
)
from raydix.workers.worker import TPWorker

from .conftest import TinyModel

CPU = torch.device("cpu")
PROMPTS = [[1, 5, 9, 13, 17], [1, 5, 9, 40, 41, 42], [3, 100]]


def test_placeholders_take_the_named_tokens_on_the_device() -> None:
    sampled = SampledTokens(7, torch.tensor([70, 71, 72]))
    ids = np.array([5, pending_token(2), 6, pending_token(0)])
    assert input_ids_on_device(ids, 7, sampled, CPU).tolist() == [5, 72, 6, 70]
    assert input_ids_on_device(np.array([4, 5]), -1, None, CPU).tolist() == [4, 5]
    with pytest.raises(ValueError, match="tokens of step 6, but the last step sampled was 7"):
        input_ids_on_device(ids, 6, sampled, CPU)
    with pytest.raises(ValueError, match="takes token 3 of step 7, which had 3"):
        input_ids_on_device(np.array([pending_token(3)]), 7, sampled, CPU)
    with pytest.raises(ValueError, match="last step sampled was -1"):
        input_ids_on_device(ids, 7, None, CPU)


def _worker(folder: Path) -> TPWorker:
    return TPWorker(WorkerConfig(str(folder), max_running_requests=4, max_context_len=64,
                                 max_total_tokens=256))


def _prefill(step_id: int, sampling: SamplingParams = GREEDY) -> StepPlan:
    reqs, slot = [], 1
    for i, p in enumerate(PROMPTS):
        reqs.append(ScheduledRequest(i, 0, p, list(range(slot, slot + len(p))), sampling))
        slot += len(p)
    return StepPlan.build(step_id, reqs)


def _decode(step_id: int, tokens: list[int] | None) -> StepPlan:
    """Every request's next token (given, or the placeholders of step `step_id - 1`)."""
    first = 1 + sum(map(len, PROMPTS))
    reqs = [ScheduledRequest(i, len(p), [pending_token(i) if tokens is None else tokens[i]],
                             [first + i], None) for i, p in enumerate(PROMPTS)]
    plan = StepPlan.build(step_id, reqs)
    if tokens is None:
        plan = dataclasses.replace(plan, tokens_from_step=step_id - 1)
    return plan


class _Spy:
    """Counts the `PendingStep.result` calls that build a result (the waits for a step)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.built = 0
        finish = PendingStep.result

        def counted(pending: PendingStep) -> object:
            if pending._result is None:
                self.built += 1
            return finish(pending)

        monkeypatch.setattr(PendingStep, "result", counted)


def test_the_next_step_is_queued_without_waiting(tiny_models: dict[str, TinyModel],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tiny_models["llama"].folder
    reference = _worker(folder)
    first = reference.step(_prefill(0))
    want = reference.step(_decode(1, first.next_token_ids.tolist()))

    worker, spy = _worker(folder), _Spy(monkeypatch)
    pending = worker.launch(_prefill(0))
    second = worker.launch(_decode(1, None))
    assert spy.built == 0  # step 0 was not waited for: its tokens were read on the device
    assert pending.result().next_token_ids.tolist() == first.next_token_ids.tolist()
    got = second.result()
    assert got.next_token_ids.tolist() == want.next_token_ids.tolist()
    assert spy.built == 2


def test_penalties_take_the_tokens_on_the_host(tiny_models: dict[str, TinyModel],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A penalised request counts its output tokens on the host: the rank waits for step 0 and
    the plan reaches the runner with real tokens."""
    folder = tiny_models["llama"].folder
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    reference = _worker(folder)
    first = reference.step(_with_penalties(0, penalised))
    want = reference.step(_decode(1, first.next_token_ids.tolist()))

    worker, spy = _worker(folder), _Spy(monkeypatch)
    seen: list[StepPlan] = []
    launch = worker.runner.launch

    def recorded(plan: StepPlan, checked: bool = False) -> object:
        seen.append(plan)
        return launch(plan, checked)

    monkeypatch.setattr(worker.runner, "launch", recorded)
    worker.launch(_with_penalties(0, penalised))
    got = worker.launch(_decode(1, None)).result()
    assert spy.built == 2  # step 0 waited for before step 1 was queued, then step 1
    assert not seen[1].has_pending
    assert seen[1].input_ids.tolist() == first.next_token_ids.tolist()
    assert got.next_token_ids.tolist() == want.next_token_ids.tolist()


def _with_penalties(step_id: int, sampling: SamplingParams) -> StepPlan:
    plan = _prefill(step_id, sampling)
    starts = tuple(PenaltyStart(i, len(p), np.zeros(0, np.int64)) for i, p in enumerate(PROMPTS))
    return dataclasses.replace(plan, penalty_starts=starts)
