"""The GPU tests' token check (greedy_agreement.py) on the CPU: it lets two paths part only at
a token the reference nearly ties, and refuses any other parting."""

from __future__ import annotations

import pytest

from raydix.workers.config import WorkerConfig
from raydix.workers.worker import TPWorker

from .conftest import TinyModel
from .driver import run_greedy, scenario
from .greedy_agreement import assert_greedy_agrees
from .tp_group import probe_plan

PROMPTS = [[1, 5, 9, 13, 17, 21, 25], [1, 5, 9, 100]]


def test_parting_is_allowed_only_at_a_near_tie(tiny_models: dict[str, TinyModel]) -> None:
    worker = TPWorker(WorkerConfig(str(tiny_models["llama"].folder), max_total_tokens=512))
    want = run_greedy(worker.step, scenario("whole", PROMPTS, 6))
    assert_greedy_agrees(worker, PROMPTS, want, [list(w) for w in want])
    logits = worker.runner.forward(probe_plan([PROMPTS[0] + want[0][:2]], 1))[0].float()
    order = logits.argsort(descending=True).tolist()
    assert order[0] == want[0][2]
    runner_up, last = order[1], order[-1]
    gap = float(logits[order[0]] - logits[runner_up])
    parted = [want[0][:2] + [runner_up] + want[0][3:], want[1]]
    assert_greedy_agrees(worker, PROMPTS, want, parted, tie=gap + 1e-4)
    with pytest.raises(AssertionError, match="parted at token 2"):
        assert_greedy_agrees(worker, PROMPTS, want, parted, tie=gap - 1e-4)
    wrong = [want[0][:2] + [last] + want[0][3:], want[1]]
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_greedy_agrees(worker, PROMPTS, want, wrong)
