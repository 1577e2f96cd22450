"""The overlapped step loop (step N+1 formed while step N runs) gives the synchronous loop's
outputs: tokens, logprobs, likeliest tokens, finish reasons and usage, request by request."""

from __future__ import annotations

import numpy as np

from raydix.engine.engine import Engine
from raydix.engine.request import FinishReason, GenerationParams, RequestOutput
from raydix.workers.step import SamplingParams, StepPlan
from tests.engine.conftest import EOS, EngineFactory, random_prompts
from tests.engine.test_engine import assert_drained


def _params(i: int) -> GenerationParams:
    kinds = [
        GenerationParams(max_new_tokens=16, ignore_eos=True),
        GenerationParams(SamplingParams(temperature=0.9, top_k=20, seed=100 + i,
                                        return_logprob=True, top_logprobs=3),
                         max_new_tokens=14),
        GenerationParams(SamplingParams(temperature=0.0, repetition_penalty=1.3,
                                        frequency_penalty=0.4, presence_penalty=0.2),
                         max_new_tokens=12, min_new_tokens=5),
        GenerationParams(SamplingParams(temperature=0.0, stop_token_ids=(7, 9, 11)),
                         max_new_tokens=20),
    ]
    return kinds[i % len(kinds)]


def _run(engine: Engine, prompts: list[list[int]],
         params: list[GenerationParams]) -> list[list[RequestOutput]]:
    rids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    events: dict[str, list[RequestOutput]] = {rid: [] for rid in rids}
    while engine.has_work:
        for out in engine.step():
            events[out.rid].append(out)
    return [events[rid] for rid in rids]


def _count_plans(engine: Engine) -> list[StepPlan]:
    plans: list[StepPlan] = []
    launch = engine.executor.launch

    def spy(plan: StepPlan) -> object:
        plans.append(plan)
        return launch(plan)

    engine.executor.launch = spy  # type: ignore[method-assign]
    return plans


def test_overlap_gives_the_synchronous_outputs(make_engine: EngineFactory) -> None:
    prompts = random_prompts(seed=5, groups=4, per_group=6, prefix_len=32, question_len=(2, 12))
    params = [_params(i) for i in range(len(prompts))]
    options = dict(chunked_prefill_size=16, max_prefill_tokens=64)
    expected = _run(make_engine(**options), prompts, params)
    engine = make_engine(overlap_schedule=True, **options)
    plans = _count_plans(engine)
    got = _run(engine, prompts, params)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert [(o.new_token_ids, o.logprobs, o.top_logprobs, o.finish_reason, o.usage)
                for o in a] == [(o.new_token_ids, o.logprobs, o.top_logprobs, o.finish_reason,
                                 o.usage) for o in b], f"request {i}: {params[i]}"
    reasons = {evs[-1].finish_reason for evs in got}
    assert reasons == {FinishReason.STOP, FinishReason.LENGTH}  # both endings happened
    # nearly every step was formed before the previous one was read
    decoding = [p for p in plans if p.batch_size and (p.extend_lens == 1).any()]
    ahead = [p for p in plans if p.has_pending]
    assert len(ahead) >= 0.8 * len(decoding) > 0
    assert_drained(engine)


def test_a_stop_in_flight_drops_the_extra_token(make_engine: EngineFactory) -> None:
    """A request that step N ends (EOS) is already in step N+1: that token is never sent."""
    prompts = random_prompts(seed=8, groups=3, per_group=4, prefix_len=8, question_len=(2, 6))
    params = [GenerationParams(max_new_tokens=40) for _ in prompts]  # EOS ends them
    expected = _run(make_engine(), prompts, params)
    got = _run(make_engine(overlap_schedule=True), prompts, params)
    assert [[t for o in evs for t in o.new_token_ids] for evs in got] == [
        [t for o in evs for t in o.new_token_ids] for evs in expected]
    stopped = [evs for evs in got if evs[-1].finish_reason is FinishReason.STOP]
    assert stopped and all(evs[-1].new_token_ids[-1] == EOS or not evs[-1].new_token_ids
                           for evs in stopped)


def test_abort_with_a_token_in_flight(make_engine: EngineFactory) -> None:
    engine = make_engine(overlap_schedule=True)
    prompt = random_prompts(seed=9, groups=1, per_group=1, prefix_len=20, question_len=(4, 4))[0]
    rid = engine.add_request(prompt, GenerationParams(max_new_tokens=50, ignore_eos=True))
    tokens: list[int] = []
    while len(tokens) < 5:
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert engine._in_flight is not None  # a step holding this request runs now
    final = engine.abort(rid)
    assert final is not None and final.finish_reason is FinishReason.ABORT
    while engine.has_work:
        assert not [o for o in engine.step() if o.rid == rid]  # its in-flight token is dropped
    alone = make_engine().generate([prompt], GenerationParams(max_new_tokens=50,
                                                              ignore_eos=True))[0]
    assert tokens == alone[:len(tokens)]
    assert_drained(engine)
    assert np.all(engine.scheduler.cache.req_to_token.available_size()
                  == engine.config.scheduler.max_running_requests)
