"""A cache namespace (`GenerationParams.extra_key`, the HTTP `cache_salt`): requests reuse cached
prefixes only within their own namespace, and get the same tokens as without the cache."""

from __future__ import annotations

from collections.abc import Hashable

from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from tests.engine.conftest import EngineFactory, random_prompts


def _run(engine: Engine, prompt: list[int], salt: Hashable) -> tuple[list[int], int]:
    """Output tokens and cached prompt tokens of one request run alone."""
    rid = engine.add_request(prompt, GenerationParams(max_new_tokens=6, ignore_eos=True,
                                                      extra_key=salt))
    tokens: list[int] = []
    cached = -1
    while engine.has_work:
        for out in engine.step():
            if out.rid == rid:
                tokens += out.new_token_ids
                cached = out.usage.cached_tokens
    return tokens, cached


def test_two_salts_never_share_a_prefix(make_engine: EngineFactory) -> None:
    engine = make_engine(page_size=4)
    prompt = random_prompts(seed=5, groups=1, per_group=1, prefix_len=40,
                            question_len=(4, 5))[0]
    first, cached = _run(engine, prompt, "tenant-a")
    assert cached == 0
    for salt in ("tenant-b", None):  # another salt, and no salt: both miss
        tokens, cached = _run(engine, prompt, salt)
        assert (tokens, cached) == (first, 0)
    tokens, cached = _run(engine, prompt, "tenant-a")  # the same salt hits
    assert tokens == first and cached == (len(prompt) - 1) // 4 * 4
    tokens, cached = _run(engine, prompt, None)  # unsalted requests share among themselves
    assert tokens == first and cached > 0
