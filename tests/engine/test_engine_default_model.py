"""The engine on the default model (SmolLM2-135M-Instruct): text, stop strings, batching."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import FinishReason, GenerationParams
from raydix.workers.config import WorkerConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm2: Path) -> Engine:
    worker = WorkerConfig(model_path=str(smollm2), max_total_tokens=8192)
    config = EngineConfig.build(
        worker, SchedulerConfig(max_running_requests=8, max_context_len=2048)
    )
    engine = Engine(config, tokenizer=AutoTokenizer.from_pretrained(smollm2))
    engine.step_hook = lambda s: s.cache.check_integrity()
    return engine


def _text(engine: Engine, prompt: str, params: GenerationParams) -> tuple[str, list[int], object]:
    ids = engine.tokenizer.encode(prompt)  # type: ignore[union-attr]
    rid = engine.add_request(ids, params)
    text, tokens, reason = "", [], None
    while engine.has_work:
        for out in engine.step():
            if out.rid == rid:
                text += out.text
                tokens += out.new_token_ids
                reason = out.finish_reason or reason
    return text, tokens, reason


def test_paris_and_streamed_text_equals_decode(engine: Engine) -> None:
    text, tokens, reason = _text(
        engine, "The capital of France is", GenerationParams(max_new_tokens=8)
    )
    assert text.startswith(" Paris.")
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)  # type: ignore[union-attr]
    assert reason in (FinishReason.LENGTH, FinishReason.STOP)


def test_stop_string_cuts_the_text(engine: Engine) -> None:
    params = GenerationParams(max_new_tokens=16, stop_strings=("ris.",))
    text, _, reason = _text(engine, "The capital of France is", params)
    assert text == " Pa"
    assert reason is FinishReason.STOP
    assert engine.scheduler.cache.num_running == 0


def test_batched_equals_solo_with_prefix_reuse(engine: Engine) -> None:
    tok = engine.tokenizer
    system = "You are a helpful assistant who answers in one short sentence. "
    prompts = [
        tok.encode(system + q) for q in ("What is 2+2?", "Name a color.", "Who wrote Hamlet?")
    ]  # type: ignore[union-attr]
    params = GenerationParams(max_new_tokens=12, ignore_eos=True)
    solo = [engine.generate([p], params)[0] for p in prompts]
    before = engine.metrics().num_cached_tokens
    assert engine.generate(prompts, params) == solo
    assert engine.metrics().num_cached_tokens - before >= 3 * len(tok.encode(system)) - 3  # type: ignore[union-attr]
