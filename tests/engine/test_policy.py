"""Waiting-queue order and step forming, on the scheduler alone (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from raydix.engine.config import SchedulerConfig
from raydix.engine.request import GenerationParams, Request
from raydix.engine.scheduler import Scheduler
from raydix.workers.step import StepResult


def _req(rid: str, prompt: list[int], priority: int = 0, max_new: int = 4) -> Request:
    params = GenerationParams(max_new_tokens=max_new, ignore_eos=True, priority=priority)
    return Request(rid, np.asarray(prompt, dtype=np.int32), params)


def _run_step(sched: Scheduler, token: int = 7) -> list[str]:
    """Schedule one step, answer every request with ``token``; return the rids scheduled."""
    scheduled = sched.schedule()
    assert scheduled is not None
    batch, plan = scheduled
    n = plan.batch_size
    sched.process(batch, StepResult(plan.step_id, np.full(n, token), None, np.zeros(n, bool)))
    sched.cache.check_integrity()
    return [r.rid for r in batch.requests]


def _scheduler(**kw: object) -> Scheduler:
    config = SchedulerConfig(max_running_requests=8, max_context_len=256, **kw)  # type: ignore[arg-type]
    return Scheduler(config, num_pages=512)


def _warm(sched: Scheduler, prompt: list[int]) -> None:
    sched.add_request(_req("warm", prompt, max_new=1))
    while sched.has_work:
        _run_step(sched)


@pytest.mark.parametrize(("policy", "first"), [("lpm", "hot"), ("fcfs", "cold")])
def test_lpm_puts_the_longest_cached_prefix_first_and_fcfs_keeps_arrival_order(
    policy: str, first: str
) -> None:
    sched = _scheduler(schedule_policy=policy, max_prefill_tokens=40)
    shared = list(range(10, 40))
    _warm(sched, shared + [1])
    sched.add_request(_req("cold", list(range(100, 130))))
    sched.add_request(_req("hot", shared + [2, 3]))  # 30 cached tokens
    assert _run_step(sched)[0] == first


def test_priority_runs_larger_priority_first() -> None:
    sched = _scheduler(schedule_policy="priority", max_prefill_tokens=30)
    sched.add_request(_req("low", list(range(100, 130)), priority=0))
    sched.add_request(_req("high", list(range(200, 230)), priority=5))
    assert _run_step(sched) == ["high"]  # the budget fits one prompt


@pytest.mark.parametrize("mixed", [True, False])
def test_prefill_rides_with_decode_only_when_mixed(mixed: bool) -> None:
    sched = _scheduler(enable_mixed_batch=mixed, max_prefill_tokens=64)
    sched.add_request(_req("a", list(range(10, 20)), max_new=8))
    assert _run_step(sched) == ["a"]  # prefill
    sched.add_request(_req("b", list(range(30, 40)), max_new=8))
    rids = _run_step(sched)
    assert rids == (["a", "b"] if mixed else ["b"])


def test_row_limit_and_token_budget_bound_admission() -> None:
    sched = Scheduler(
        SchedulerConfig(max_running_requests=2, max_context_len=256, max_prefill_tokens=1000),
        num_pages=512,
    )
    for i in range(4):
        sched.add_request(_req(f"r{i}", list(range(10 + i, 20 + i))))
    assert _run_step(sched) == ["r0", "r1"]  # two rows only
    sched = _scheduler(max_prefill_tokens=25, chunked_prefill_size=1000)
    for i in range(3):
        sched.add_request(_req(f"r{i}", list(range(10 + i, 20 + i))))
    assert _run_step(sched) == ["r0", "r1", "r2"]
    batch_tokens = [len(r.prompt_ids) for r in sched.running]
    assert batch_tokens == [10, 10, 10]
    # the third prompt got only the 5 tokens left in the budget: it is still prefilling
    assert [r.kv_len for r in sched.running] == [10, 10, 5]


def test_prompts_stuck_in_chunked_prefill_make_room_and_all_finish() -> None:
    config = SchedulerConfig(
        max_running_requests=4,
        max_context_len=64,
        max_prefill_tokens=32,
        chunked_prefill_size=16,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
    )
    sched = Scheduler(config, num_pages=40)
    for i in range(3):
        sched.add_request(_req(f"r{i}", list(range(10 * i + 1, 10 * i + 31)), max_new=3))
    finished = set()
    for _ in range(60):
        if not sched.has_work:
            break
        scheduled = sched.schedule()
        if scheduled is None:
            continue
        batch, plan = scheduled
        n = plan.batch_size
        outs = sched.process(
            batch, StepResult(plan.step_id, np.full(n, 7), None, np.zeros(n, bool))
        )
        finished |= {o.rid for o in outs if o.finished}
        sched.cache.check_integrity()
    assert finished == {"r0", "r1", "r2"}
    assert sched.stats.num_retractions > 0
    assert sched.cache.available_size() == sched.cache.capacity


def test_a_prefix_being_computed_is_not_computed_twice_in_one_step() -> None:
    sched = _scheduler(max_prefill_tokens=200)
    shared = list(range(10, 74))  # 64 tokens, nothing cached yet
    sched.add_request(_req("first", shared + [1, 2]))
    sched.add_request(_req("second", shared + [3, 4]))
    sched.add_request(_req("other", list(range(100, 140))))
    assert _run_step(sched) == ["first", "other"]  # "second" waits for the shared prefix
    assert _run_step(sched)[-1] == "second"
    second = next(r for r in sched.running if r.rid == "second")
    assert second.cached_tokens == 64
    off = _scheduler(max_prefill_tokens=200, in_batch_prefix_threshold=0)
    off.add_request(_req("first", shared + [1, 2]))
    off.add_request(_req("second", shared + [3, 4]))
    assert _run_step(off) == ["first", "second"]
