"""The host KV tier changes where K/V comes from, never what the engine outputs.

Multi-turn conversations whose total context is several times the device pool arrive turn by
turn, interleaved, with some requests aborted, through a pool small enough to evict and
retract, in chunks. The engine with the host tier must give every request the tokens and
logprobs it gives with the tier off, while loading prefixes back from the host; afterwards
nothing is held on either tier.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from raydix.cache import WRITE_POLICIES
from raydix.cluster.ray_executor import make_executor
from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import FinishReason, GenerationParams, RequestOutput
from raydix.workers.config import WorkerConfig
from raydix.workers.step import SamplingParams
from tests.engine.conftest import VOCAB
from tests.engine.test_engine import assert_drained

Schedule = list[tuple[int, list[int], GenerationParams]]  # (arrival step, prompt, params)


def conversations(seed: int, num: int, turns: int, system_len: int) -> Schedule:
    """Each conversation: a system prompt, then turns that each add a reply and a question
    to the whole history; turn t of every conversation arrives after turn t-1 of all."""
    rng = np.random.default_rng(seed)
    schedule: Schedule = []
    for c in range(num):
        history = rng.integers(2, VOCAB, size=system_len).tolist()
        for t in range(turns):
            history = history + rng.integers(2, VOCAB, size=int(rng.integers(8, 24))).tolist()
            greedy = rng.random() < 0.5
            sampling = SamplingParams(temperature=0.0 if greedy else 0.8,
                                      seed=None if greedy else int(rng.integers(1 << 30)),
                                      return_logprob=True)
            params = GenerationParams(sampling=sampling, max_new_tokens=int(rng.integers(4, 12)),
                                      ignore_eos=True)
            schedule.append((t * 12 + c + int(rng.integers(0, 3)), list(history), params))
    return schedule


def hicache_engine(model: Path, hicache_ratio: float, tp_size: int = 1,
                   **sched: object) -> Engine:
    worker = WorkerConfig(model_path=str(model), tp_size=tp_size, max_total_tokens=192,
                          hicache_ratio=hicache_ratio)
    defaults: dict[str, object] = dict(max_running_requests=8, max_context_len=512,
                                       chunked_prefill_size=32, max_prefill_tokens=64,
                                       init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    defaults.update(sched)
    config = EngineConfig.build(worker, SchedulerConfig(**defaults))  # type: ignore[arg-type]
    executor = None
    if tp_size > 1:  # the ranks are Ray actors on fake GPUs
        executor = make_executor(config, startup_timeout_s=90, use_gpu=True)
    engine = Engine(config, executor=executor)
    engine.step_hook = lambda s: s.cache.check_integrity()
    return engine


def run_schedule(engine: Engine, schedule: Schedule, aborted: set[int]) -> list[
        tuple[list[int], list[float], str]]:
    """Every request's tokens, logprobs and finish reason; `aborted` ones are aborted two steps
    after they arrive."""
    events: dict[str, list[RequestOutput]] = {}
    rids: dict[int, str] = {}
    step = 0
    last = max(at for at, _, _ in schedule)
    while step <= last + 2 or engine.has_work:
        for i, (at, prompt, params) in enumerate(schedule):
            if at == step:
                rids[i] = engine.add_request(prompt, params, rid=f"r{i}")
                events[rids[i]] = []
            if i in aborted and at + 2 == step and (out := engine.abort(f"r{i}")) is not None:
                events[f"r{i}"].append(out)
        for out in engine.step():
            events[out.rid].append(out)
        step += 1
        assert step < 5_000, "the engine stopped making progress"
    results = []
    for i in range(len(schedule)):
        evs = events[rids[i]]
        reason = evs[-1].finish_reason
        results.append(([t for e in evs for t in e.new_token_ids],
                        [lp for e in evs for lp in e.logprobs], reason.value if reason else ""))
    return results


def assert_same_outputs(on: list[tuple[list[int], list[float], str]],
                        off: list[tuple[list[int], list[float], str]]) -> None:
    for i, ((tokens, logprobs, reason), (off_tokens, off_logprobs, off_reason)) in enumerate(
            zip(on, off, strict=True)):
        if FinishReason.ABORT.value in (reason, off_reason):
            continue  # aborted midway: how far it got depends on the schedule
        assert (tokens, reason) == (off_tokens, off_reason), f"request {i}"
        np.testing.assert_allclose(logprobs, off_logprobs, atol=1e-4)


def assert_tiers_drained(engine: Engine) -> None:
    assert_drained(engine)
    engine.step()  # the last copies and freed rows reach the ranks with the next plan
    cache = engine.scheduler.cache
    host = cache.host_cache
    assert host is not None and not host.has_copies and not host.loading_nodes()
    cache.check_integrity()  # every host page free or held by exactly one node


SCHEDULE = conversations(seed=7, num=6, turns=4, system_len=40)
ABORTED = {3, 10, 17}


@pytest.fixture(scope="module")
def tier_off(tiny_llama: Path) -> tuple[Engine, list[tuple[list[int], list[float], str]]]:
    """The tier-off engine after the schedule, and its outputs (run once for every policy)."""
    off = hicache_engine(tiny_llama, 0)
    assert sum(len(p) for _, p, _ in SCHEDULE) > 4 * off.scheduler.cache.capacity
    return off, run_schedule(off, SCHEDULE, ABORTED)


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
def test_host_tier_outputs_equal_tier_off(
        tiny_llama: Path, write_policy: str,
        tier_off: tuple[Engine, list[tuple[list[int], list[float], str]]]) -> None:
    off, expected = tier_off
    schedule, aborted = SCHEDULE, ABORTED
    on = hicache_engine(tiny_llama, 4, hicache_write_policy=write_policy)
    assert on.scheduler.cache.host_cache is not None
    assert on.scheduler.cache.host_cache.host_capacity == 4 * on.scheduler.cache.capacity
    assert_same_outputs(run_schedule(on, schedule, aborted), expected)
    host = on.scheduler.cache.host_cache
    assert host.num_loaded_tokens > 0 and host.num_written_tokens > 0
    metrics = on.metrics()
    assert metrics.num_host_hit_tokens > 0 and metrics.host_hit_rate > 0
    assert metrics.num_loaded_tokens == host.num_loaded_tokens
    assert 0 < metrics.num_host_tokens == host.host_size <= metrics.host_capacity
    assert on.metrics().num_retractions + off.metrics().num_retractions > 0
    assert on.metrics().num_cached_tokens > off.metrics().num_cached_tokens
    assert_tiers_drained(on)
    assert_drained(off)


def test_a_plan_with_copies_is_refused_by_a_rank_without_a_host_tier(tiny_llama: Path) -> None:
    from raydix.workers.step import SlotCopy, StepPlan

    engine = hicache_engine(tiny_llama, 0)
    plan = StepPlan.build(1, [], device_to_host=SlotCopy(np.array([1], np.int32),
                                                         np.array([1], np.int32)))
    with pytest.raises(ValueError, match="host KV tier"):
        engine.executor.step(plan)
