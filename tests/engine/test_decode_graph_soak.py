"""The CPU decode graph under a mixed load: after its warm-up, no step of any shape the engine
forms makes it compile again (with dynamo's guards skipped, one would raise and stop the engine
loop). Requests of every prompt length from one token up, shared prefixes, random arrival steps,
aborts, and a pool small enough to retract and evict, so steps take every path: one request,
two, a batch through the batched graph, mixed prefill and decode steps (eager), and one-token
prompts' first steps alone, four together and beside a decoding request (eager: one key; the
graph raised there before). Every request ends with its tokens, nothing is held afterwards,
and both graphs ran.

Token equality with the eager engine is the CPU decode graph's own tests'
(tests/workers/test_cpu_decode_graph.py, test_cpu_batch_graph.py); this one is about the
shapes a real load forms."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import FinishReason, GenerationParams, RequestOutput
from raydix.workers import cpu_decode_graph
from raydix.workers.config import WorkerConfig
from tests.engine.conftest import VOCAB, random_prompts
from tests.engine.test_engine import assert_drained

NUM_REQUESTS = 36


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_mixed_load_compiles_nothing_after_the_warm_up(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    worker = WorkerConfig(model_path=str(tiny_llama), dtype=dtype, max_total_tokens=360,
                          cpu_decode_graph=True)
    engine = Engine(EngineConfig.build(worker, SchedulerConfig(
        max_running_requests=10, max_context_len=256, chunked_prefill_size=16,
        max_prefill_tokens=48, init_new_token_ratio=0.0, min_new_token_ratio=0.0)))
    engine.step_hook = lambda sched: sched.cache.check_integrity()
    graph = engine.executor.worker.runner.decode_graph  # type: ignore[attr-defined]
    assert graph is not None and graph.skip_guards and graph._batch_layers is not None
    paths: list[str] = []
    one, batch = graph._replay_one, graph._replay_batch
    monkeypatch.setattr(graph, "_replay_one", lambda *a: paths.append("one") or one(*a))
    monkeypatch.setattr(graph, "_replay_batch", lambda b: paths.append("batch") or batch(b))

    rng = np.random.default_rng(14)
    prompts = random_prompts(seed=7, groups=3, per_group=8, prefix_len=20, question_len=(1, 12))
    prompts += [rng.integers(2, VOCAB, size=n).tolist() for n in [2, 2, 3, 5]]
    prompts = [prompts[i] for i in rng.permutation(len(prompts))]
    # one-token prompts, arriving late (their first step has no key before its token; most
    # land beside a prefill here, so the idle-engine cases below take the graph's side)
    prompts += [[int(t)] for t in rng.integers(2, VOCAB, size=NUM_REQUESTS - len(prompts))]
    order = np.arange(NUM_REQUESTS)
    arrival = np.concatenate([np.sort(rng.integers(0, 16, size=28)),
                              np.sort(rng.integers(8, 24, size=NUM_REQUESTS - 28))])
    lengths = rng.integers(1, 14, size=NUM_REQUESTS)
    aborted_at = {int(i): int(arrival[i] + rng.integers(1, 5))
                  for i in rng.choice(NUM_REQUESTS, size=5, replace=False)}
    rids: dict[int, str] = {}
    events: dict[int, list[RequestOutput]] = {}
    step = 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        while step < 24 or engine.has_work:
            for i in np.flatnonzero(arrival == step).tolist():
                params = GenerationParams(max_new_tokens=int(lengths[i]), ignore_eos=True)
                rids[i] = engine.add_request(prompts[int(order[i])], params)
                events[i] = []
            for i, at in aborted_at.items():
                if at == step and i in rids:
                    out = engine.abort(rids[i])
                    if out is not None:
                        events[i].append(out)
            by_rid = {rid: i for i, rid in rids.items()}
            for out in engine.step():
                events[by_rid[out.rid]].append(out)
            step += 1
        # on the idle engine: a lone one-token prompt, then four together (their first steps
        # decode-shaped, one key each), then two beside a request that decodes
        for group in ([[5]], [[6], [7], [8], [9]]):
            outs = engine.generate(group, GenerationParams(max_new_tokens=3, ignore_eos=True))
            assert [len(o) for o in outs] == [3] * len(group)
        running = engine.add_request([10, 11, 12, 13], GenerationParams(max_new_tokens=6,
                                                                        ignore_eos=True))
        engine.step()
        late = [engine.add_request([t], GenerationParams(max_new_tokens=2, ignore_eos=True))
                for t in (14, 15)]
        done: dict[str, int] = {}
        while engine.has_work:
            for out in engine.step():
                done[out.rid] = done.get(out.rid, 0) + len(out.new_token_ids)
        assert done[late[0]] == done[late[1]] == 2 and done[running] == 5
    assert len(events) == NUM_REQUESTS
    for i, evs in events.items():
        reason = evs[-1].finish_reason
        tokens = sum(len(e.new_token_ids) for e in evs)
        if reason is FinishReason.ABORT:
            assert i in aborted_at and tokens < lengths[i]
        else:
            assert reason is FinishReason.LENGTH and tokens == lengths[i], (i, reason, tokens)
    assert_drained(engine)
    assert "one" in paths and "batch" in paths
    assert any(len(prompts[int(order[i])]) == 1 for i in range(NUM_REQUESTS))
    assert cpu_decode_graph.MAX_REQUESTS < 10  # batches above it reach the batched graph
    engine.shutdown()
