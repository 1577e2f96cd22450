"""The engine on CPU with a tiny random model: continuous batching gives solo outputs."""

from __future__ import annotations

import pytest

from raydix.cache import EventBuffer, EventKind
from raydix.engine.engine import Engine
from raydix.engine.request import FinishReason, GenerationParams
from raydix.workers.step import SamplingParams
from tests.engine.conftest import EOS, EngineFactory, random_prompts

GREEDY_16 = GenerationParams(max_new_tokens=16, ignore_eos=True)
_SOLO: dict[tuple[tuple[int, ...], GenerationParams], list[int]] = {}


def solo(
    make_engine: EngineFactory, prompts: list[list[int]], params: GenerationParams
) -> list[list[int]]:
    """Each prompt run alone, one after another, with no prefix cache (memoized)."""
    engine = None
    outs = []
    for prompt in prompts:
        key = (tuple(prompt), params)
        if key not in _SOLO:
            engine = engine or make_engine(enable_prefix_cache=False)
            _SOLO[key] = engine.generate([prompt], params)[0]
        outs.append(_SOLO[key])
    return outs


def assert_drained(engine: Engine) -> None:
    cache = engine.scheduler.cache
    cache.check_integrity()
    assert cache.num_running == 0
    assert cache.available_size() == cache.capacity  # every slot free or evictable
    assert cache.size_info.protected_size == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_concurrent_shared_prefix_requests_match_solo(
    make_engine: EngineFactory, page_size: int
) -> None:
    prompts = random_prompts(seed=1, groups=4, per_group=8, prefix_len=40, question_len=(3, 20))
    expected = solo(make_engine, prompts, GREEDY_16)
    engine = make_engine(page_size=page_size, max_prefill_tokens=256, chunked_prefill_size=64)
    assert engine.generate(prompts, GREEDY_16) == expected
    assert engine.metrics().num_cached_tokens > 0
    assert_drained(engine)


def test_small_pool_forces_eviction_and_retraction(make_engine: EngineFactory) -> None:
    prompts = random_prompts(seed=2, groups=2, per_group=8, prefix_len=24, question_len=(8, 16))
    params = GenerationParams(max_new_tokens=24, ignore_eos=True)
    expected = solo(make_engine, prompts, params)
    events = EventBuffer()
    engine = make_engine(max_total_tokens=200, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    engine.scheduler.cache.prefix_cache._event_sink = events  # type: ignore[attr-defined]
    assert engine.generate(prompts, params) == expected
    assert engine.metrics().num_retractions > 0
    assert any(e.kind is EventKind.EVICTED for e in events.drain())
    assert_drained(engine)


def test_chunked_prefill_of_a_long_prompt(make_engine: EngineFactory) -> None:
    prompt = random_prompts(seed=3, groups=1, per_group=1, prefix_len=120, question_len=(8, 8))[0]
    expected = solo(make_engine, [prompt], GREEDY_16)
    engine = make_engine(chunked_prefill_size=16)
    rid = engine.add_request(prompt, GREEDY_16)
    steps_to_first_token = 0
    tokens: list[int] = []
    while engine.has_work:
        outs = engine.step()
        if not tokens:
            steps_to_first_token += 1
        tokens += [t for out in outs if out.rid == rid for t in out.new_token_ids]
    assert steps_to_first_token == 8  # 128 prompt tokens in chunks of 16
    assert tokens == expected[0]
    assert_drained(engine)


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_abort_frees_everything(make_engine: EngineFactory, when: str) -> None:
    long_prompt = random_prompts(seed=4, groups=1, per_group=1, prefix_len=90, question_len=(6, 6))
    other = random_prompts(seed=5, groups=1, per_group=1, prefix_len=10, question_len=(4, 4))
    expected_other = solo(make_engine, other, GREEDY_16)[0]
    engine = make_engine(chunked_prefill_size=16, max_prefill_tokens=32)
    victim = engine.add_request(
        long_prompt[0], GenerationParams(max_new_tokens=64, ignore_eos=True)
    )
    keeper = engine.add_request(other[0], GREEDY_16)
    kept: list[int] = []
    steps = 2 if when == "prefill" else 9  # 96 tokens in chunks of 16: decoding after 6 steps
    for _ in range(steps):
        for out in engine.step():
            assert not out.finished  # neither request may end before the abort
            if out.rid == keeper:
                kept += out.new_token_ids
    req = engine.scheduler.get_request(victim)
    assert req is not None and req.row is not None
    assert (len(req.output_ids) == 0) == (when == "prefill")
    final = engine.abort(victim)
    assert final is not None and final.finish_reason is FinishReason.ABORT
    engine.scheduler.cache.check_integrity()
    while engine.has_work:
        kept += [t for out in engine.step() if out.rid == keeper for t in out.new_token_ids]
    assert kept == expected_other
    assert engine.abort(victim) is None
    assert_drained(engine)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cache_hit_counts_are_exact(make_engine: EngineFactory, page_size: int) -> None:
    engine = make_engine(page_size=page_size)
    prefix = list(range(10, 10 + 37))
    first = prefix + [90, 91, 92]
    second = prefix + [100, 101]
    params = GenerationParams(max_new_tokens=5, ignore_eos=True)

    def usage(prompt: list[int]) -> tuple[int, int, int]:
        rid = engine.add_request(prompt, params)
        final = None
        while engine.has_work:
            for out in engine.step():
                if out.rid == rid and out.finished:
                    final = out
        assert final is not None
        return tuple(final.usage)  # type: ignore[return-value]

    def aligned(n: int) -> int:
        return n // page_size * page_size

    assert usage(first) == (40, 0, 5)
    assert usage(second) == (39, aligned(37), 5)  # the shared prefix only
    assert usage(first) == (40, aligned(39), 5)  # all but the last prompt token
    stats = engine.metrics()
    assert (stats.num_prompt_tokens, stats.num_cached_tokens) == (119, aligned(37) + aligned(39))


def test_stop_conditions(make_engine: EngineFactory) -> None:
    engine = make_engine(max_context_len=64)
    prompt = random_prompts(seed=6, groups=1, per_group=1, prefix_len=20, question_len=(4, 4))[0]
    free_run = engine.generate([prompt], GenerationParams(max_new_tokens=12, ignore_eos=True))[0]
    stop_id = free_run[5]
    first = free_run.index(stop_id)
    sampling = SamplingParams(temperature=0.0, stop_token_ids=(stop_id,))
    cases = {
        "max_new_tokens": (GenerationParams(max_new_tokens=7, ignore_eos=True), 7, "length"),
        "stop token id": (
            GenerationParams(max_new_tokens=12, sampling=sampling),
            first + 1,
            "stop",
        ),
        "context limit": (GenerationParams(max_new_tokens=500, ignore_eos=True), 64 - 24, "length"),
    }
    for name, (params, length, reason) in cases.items():
        rid = engine.add_request(prompt, params)
        outs = []
        while engine.has_work:
            outs += [o for o in engine.step() if o.rid == rid]
        tokens = [t for o in outs for t in o.new_token_ids]
        assert len(tokens) == length, name
        assert tokens == free_run[:length] or name == "context limit", name
        assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == reason, name
    engine.scheduler.eos_token_ids = frozenset({stop_id})  # the model's EOS, honoured by default
    rid = engine.add_request(prompt, GenerationParams(max_new_tokens=12))
    tokens = [t for o in _drain(engine) if o.rid == rid for t in o.new_token_ids]
    assert tokens == free_run[: first + 1]
    assert EOS not in prompt
    assert_drained(engine)


def _drain(engine: Engine) -> list:  # type: ignore[type-arg]
    outs = []
    while engine.has_work:
        outs += engine.step()
    return outs


def test_bad_requests_are_refused_by_name(make_engine: EngineFactory) -> None:
    engine = make_engine(max_context_len=64, max_total_tokens=128)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY_16)
    with pytest.raises(ValueError, match="context limit"):
        engine.add_request(list(range(2, 66)), GREEDY_16)
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationParams(max_new_tokens=0)
    rid = engine.add_request([5, 6, 7], GREEDY_16, rid="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5, 6, 7], GREEDY_16, rid=rid)
    _drain(engine)
    assert_drained(engine)
