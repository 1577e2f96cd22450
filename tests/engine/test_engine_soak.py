"""A mixed load under memory pressure: every request ends as if it had run alone.

Requests arrive at random steps with random sampling (greedy or seeded, penalties, top
logprobs, stop tokens, minimum and maximum lengths), some are aborted midway, and the pool is small enough that
requests are retracted and cached prefixes evicted. Each finished request must give the tokens
and logprobs it gives alone on an idle engine; afterwards nothing is held: no slot, no row, no
penalty state.
"""

from __future__ import annotations

import numpy as np
import pytest

from raydix.engine.request import FinishReason, GenerationParams, RequestOutput
from raydix.workers.step import SamplingParams
from tests.engine.conftest import EOS, VOCAB, EngineFactory, random_prompts
from tests.engine.test_engine import assert_drained

NUM_REQUESTS = 40


def _random_params(rng: np.random.Generator) -> GenerationParams:
    greedy = rng.random() < 0.5
    penalised = rng.random() < 0.5
    sampling = SamplingParams(
        temperature=0.0 if greedy else float(rng.uniform(0.5, 1.2)),
        top_k=int(rng.choice([-1, 20])),
        top_p=float(rng.choice([1.0, 0.9])),
        seed=None if greedy else int(rng.integers(1 << 30)),
        stop_token_ids=tuple(int(t) for t in rng.integers(2, VOCAB, size=int(rng.integers(0, 3)))),
        return_logprob=bool(rng.random() < 0.5),
        top_logprobs=int(rng.choice([0, 0, 3])),
        frequency_penalty=float(rng.uniform(-0.5, 1.0)) if penalised else 0.0,
        presence_penalty=float(rng.uniform(-0.5, 1.0)) if penalised else 0.0,
        repetition_penalty=float(rng.uniform(0.8, 1.4)) if penalised else 1.0,
    )
    return GenerationParams(sampling=sampling, max_new_tokens=int(rng.integers(4, 28)),
                            min_new_tokens=int(rng.choice([0, 0, 3])),
                            ignore_eos=bool(rng.random() < 0.5))


def _outputs_of(events: list[RequestOutput]) -> tuple[list[int], list[float], list[object], str]:
    tokens = [t for e in events for t in e.new_token_ids]
    logprobs = [lp for e in events for lp in e.logprobs]
    tops = [top for e in events for top in e.top_logprobs]
    reason = events[-1].finish_reason
    return tokens, logprobs, tops, reason.value if reason else "none"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_mixed_load_with_aborts_and_retraction_matches_solo_runs(
        make_engine: EngineFactory, overlap: bool) -> None:
    """With the overlapped loop too: its placeholders, its token dropped after a stop, its
    reads one step late, against solo runs of the synchronous loop."""
    rng = np.random.default_rng(2026)
    prompts = random_prompts(seed=31, groups=4, per_group=10, prefix_len=24,
                             question_len=(2, 14))[:NUM_REQUESTS]
    params = [_random_params(rng) for _ in prompts]
    arrival = np.sort(rng.integers(0, 30, size=NUM_REQUESTS))
    aborted_at = {i: int(arrival[i] + rng.integers(1, 6)) for i in
                  rng.choice(NUM_REQUESTS, size=6, replace=False).tolist()}

    engine = make_engine(max_total_tokens=320, max_running_requests=12,
                         chunked_prefill_size=16, max_prefill_tokens=48,
                         init_new_token_ratio=0.0, min_new_token_ratio=0.0,
                         overlap_schedule=overlap)
    rids: dict[int, str] = {}
    events: dict[str, list[RequestOutput]] = {}
    step = 0
    while step < 30 or engine.has_work:
        for i in np.flatnonzero(arrival == step).tolist():
            rids[i] = engine.add_request(prompts[i], params[i])
            events[rids[i]] = []
        for i, at in aborted_at.items():
            if at == step and i in rids:
                out = engine.abort(rids[i])
                if out is not None:
                    events[rids[i]].append(out)
        for out in engine.step():
            events[out.rid].append(out)
        step += 1
        assert step < 5_000, "the engine stopped making progress"
    assert engine.metrics().num_retractions > 0
    assert engine.metrics().num_cached_tokens > 0

    solo_engine = make_engine(max_total_tokens=4096)
    finished = aborted = 0
    for i, rid in rids.items():
        tokens, logprobs, tops, reason = _outputs_of(events[rid])
        if reason == FinishReason.ABORT.value:
            assert i in aborted_at
            aborted += 1
            continue
        alone = solo_engine.add_request(prompts[i], params[i])
        alone_events: list[RequestOutput] = []
        while solo_engine.has_work:
            alone_events += [o for o in solo_engine.step() if o.rid == alone]
        solo_tokens, solo_logprobs, solo_tops, solo_reason = _outputs_of(alone_events)
        assert (tokens, reason) == (solo_tokens, solo_reason), f"request {i}: {params[i]}"
        np.testing.assert_allclose(logprobs, solo_logprobs, atol=1e-4)
        assert [[t for t, _ in top] for top in tops] == [[t for t, _ in top] for top in solo_tops]
        if not params[i].ignore_eos and EOS in tokens:
            assert tokens[-1] == EOS
        finished += 1
    assert aborted >= 1 and finished + aborted == NUM_REQUESTS
    assert_drained(engine)
    engine.step()  # the last freed rows reach the ranks with the next plan
    engine.drain()
    assert engine.executor.worker.runner.penalties.num_tracked == 0  # type: ignore[attr-defined]
