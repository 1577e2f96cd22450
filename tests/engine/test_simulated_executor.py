"""The simulated replica (engine/simulated_executor.py, deploy/simulated_engine.py): the real
engine and cache over steps that only take time, as the router bench uses it."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from raydix.cache import EventBuffer, EventKind
from raydix.deploy.server import ReplicaSettings
from raydix.deploy.simulated_engine import build_simulated_engine
from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams, RequestOutput
from raydix.engine.simulated_executor import SimulatedExecutor, StepCost
from raydix.workers.config import WorkerConfig
from raydix.workers.sampling_params import GrammarSpec, SamplingParams
from raydix.workers.step import RowSampling, StepPlan

from .conftest import TOK_EOS


def _plan(step_id: int, prefix_lens: list[int], extend_lens: list[int],
          new_sampling: tuple[RowSampling, ...] = ()) -> StepPlan:
    num = sum(extend_lens)
    return StepPlan(step_id=step_id, row_idx=np.arange(len(prefix_lens), dtype=np.int32),
                    prefix_lens=np.array(prefix_lens, dtype=np.int32),
                    extend_lens=np.array(extend_lens, dtype=np.int32),
                    input_ids=np.full(num, 5, dtype=np.int64),
                    out_cache_loc=np.arange(1, num + 1, dtype=np.int32), new_sampling=new_sampling)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_a_step_takes_its_cost_and_steps_run_one_at_a_time() -> None:
    cost = StepCost(base_s=0.01, token_s=0.001, kv_token_s=0.0001, scale=2.0)
    plan = _plan(0, [10, 0], [5, 1])  # 6 new tokens, 16 attended
    assert cost.seconds(plan) == pytest.approx(2.0 * (0.01 + 0.006 + 0.0016))
    clock = _Clock()
    executor = SimulatedExecutor(64, cost, token_id=7, clock=clock, sleep=clock.sleep)
    first = executor.launch(plan)
    second = executor.launch(_plan(1, [16, 1], [1, 1]))  # queued behind the first
    clock.now += 0.01  # the host's own work meanwhile
    out = first.result()
    assert clock.slept == [pytest.approx(0.0352 - 0.01)]
    assert out.next_token_ids.tolist() == [7, 7] and not out.stopped.any()
    assert out.logprobs is None
    second.result()  # starts when the first ended: 2 * (0.01 + 0.002 + 0.0019)
    assert clock.now == pytest.approx(100.0 + 0.0352 + 0.0278)
    assert executor.num_steps == 2 and executor.busy_s == pytest.approx(0.0352 + 0.0278)
    clock.now += 1.0  # an idle device: the next step starts now, not where the last one ended
    executor.launch(plan).result()
    assert clock.now == pytest.approx(101.0 + 0.0630 + 0.0352)


def test_a_row_whose_stop_token_it_samples_is_stopped() -> None:
    executor = SimulatedExecutor(64, StepCost(0, 0, 0), token_id=7)
    stops = (RowSampling(0, SamplingParams(stop_token_ids=(7,))), RowSampling(1, SamplingParams()))
    assert executor.step(_plan(0, [0, 0], [2, 3], stops)).stopped.tolist() == [True, False]
    plan = StepPlan(step_id=1, row_idx=np.array([0], np.int32), prefix_lens=np.array([2], np.int32),
                    extend_lens=np.array([1], np.int32), input_ids=np.array([7]),
                    out_cache_loc=np.array([9], np.int32), freed_rows=(0,))
    assert executor.step(plan).stopped.tolist() == [False]  # row 0 freed: a new request's


def _config(model: Path, max_total_tokens: int) -> EngineConfig:
    worker = WorkerConfig(model_path=str(model), max_total_tokens=max_total_tokens)
    return EngineConfig.build(worker, SchedulerConfig(max_running_requests=8, max_context_len=512))


def _run(engine: Engine, prompts: list[list[int]], max_new_tokens: int
         ) -> dict[str, list[RequestOutput]]:
    params = GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in rids}
    while engine.has_work:
        for out in engine.step():
            outs[out.rid].append(out)
    return outs


def test_the_engine_caches_and_evicts_over_a_simulated_device(tiny_tok: Path) -> None:
    events = EventBuffer()
    cost = StepCost(base_s=2e-3, token_s=1e-5, kv_token_s=0.0)
    engine = build_simulated_engine(cost, _config(tiny_tok, 300), ReplicaSettings(), events)
    engine.step_hook = lambda sched: sched.cache.check_integrity()
    executor = engine.executor
    assert isinstance(executor, SimulatedExecutor)
    assert executor.max_num_tokens == 300 and engine.cache_stats().kv_capacity == 300
    assert executor.token_id != TOK_EOS
    rng = np.random.default_rng(0)
    context = rng.integers(3, 40000, 120).tolist()
    start = time.perf_counter()
    first = _run(engine, [context + [11, 12]], 4)
    (outs,) = first.values()
    assert [t for o in outs for t in o.new_token_ids] == [executor.token_id] * 4
    assert outs[-1].finish_reason == "length" and outs[-1].text
    again = _run(engine, [context + [13, 14, 15]], 3)
    (usage,) = (o[-1].usage for o in again.values())
    assert usage.cached_tokens >= 120 and usage.prompt_tokens == 123
    # more than the pool holds: the first context is evicted, and the events say so
    others = [rng.integers(3, 40000, 100).tolist() for _ in range(4)]
    _run(engine, others, 2)
    kinds = [e.kind for e in events.drain()]
    assert EventKind.INSERTED in kinds and EventKind.EVICTED in kinds
    cold = _run(engine, [context + [16]], 1)
    assert next(iter(cold.values()))[-1].usage.cached_tokens < 120
    assert time.perf_counter() - start >= executor.busy_s > 0


def test_it_refuses_what_it_cannot_simulate(tiny_tok: Path) -> None:
    engine = build_simulated_engine(StepCost(0, 0, 0), _config(tiny_tok, 256), ReplicaSettings())
    grammar = GenerationParams(sampling=SamplingParams(grammar=GrammarSpec("json_object")))
    with pytest.raises(ValueError, match="no grammars"):
        engine.add_request([5, 6, 7], grammar)
    assert not engine.has_work  # refused before it was queued
    engine.add_request([5, 6, 7], GenerationParams(sampling=SamplingParams(return_logprob=True)))
    with pytest.raises(ValueError, match="logprobs"):
        engine.step()
    with pytest.raises(ValueError, match="max_total_tokens"):
        build_simulated_engine(StepCost(), EngineConfig.build(
            WorkerConfig(model_path=str(tiny_tok)), SchedulerConfig()), ReplicaSettings())
