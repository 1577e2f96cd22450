"""A TP=2 engine on fake GPUs in Ray: the same outputs as TP=1, under concurrent load, with
penalties, logprobs, the overlapped loop and grammars."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import jsonschema
import pytest
from transformers import AutoTokenizer

from raydix.cluster.ray_executor import make_executor
from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.workers.config import WorkerConfig
from raydix.workers.step import SamplingParams
from tests.engine.conftest import TOK_EOS, random_prompts
from tests.engine.test_grammar import SCHEMA, json_params, prompts_of

pytestmark = pytest.mark.ray


def _engine(model: Path, tp_size: int, **sched: object) -> Engine:
    # the paged decode kernel is not built at a rank's start: decodes take the dense copies
    # here; the kernel's own tests are in tests/workers (test_paged_decode.py,
    # test_cpu_speed_paths.py)
    worker = WorkerConfig(model_path=str(model), tp_size=tp_size, max_total_tokens=4096,
                          cpu_compiled_attention=False)
    config = EngineConfig.build(
        worker,
        SchedulerConfig(max_running_requests=48, max_context_len=512, **sched),  # type: ignore[arg-type]
    )
    engine = Engine(config, executor=make_executor(config, startup_timeout_s=90, use_gpu=True))
    engine.step_hook = lambda s: s.cache.check_integrity()
    return engine


def test_tp2_engine_equals_tp1(ray_cluster: None, tiny_llama: Path) -> None:
    prompts = random_prompts(seed=11, groups=4, per_group=8, prefix_len=40, question_len=(3, 20))
    greedy = GenerationParams(max_new_tokens=12, ignore_eos=True)
    # every fourth request is penalised and asks for logprobs: the penalty starts ride in the
    # broadcast plan, and the likeliest tokens come back from rank 0
    extras = GenerationParams(SamplingParams(temperature=0.0, repetition_penalty=1.3,
                                             frequency_penalty=0.5, top_logprobs=3),
                              max_new_tokens=12, ignore_eos=True)
    params = [extras if i % 4 == 0 else greedy for i in range(len(prompts))]
    tp1 = _engine(tiny_llama, 1)
    expected = tp1.generate(prompts, params)
    tp2 = _engine(tiny_llama, 2, max_prefill_tokens=256, chunked_prefill_size=64)
    try:
        assert len(tp2.executor.workers) == 2  # type: ignore[attr-defined]
        bundles = tp2.executor.placement_group.bundle_specs  # type: ignore[attr-defined]
        assert bundles == [{"GPU": 1.0}, {"GPU": 1.0}]  # one fake GPU per rank
        assert tp2.generate(prompts, params) == expected
        cache = tp2.scheduler.cache
        assert cache.available_size() == cache.capacity and cache.num_running == 0
        assert tp2.metrics().num_cached_tokens > 0
    finally:
        tp2.shutdown()


def test_tp2_overlapped_loop_equals_tp1(ray_cluster: None, tiny_llama: Path) -> None:
    """Rank 0's actor runs launched steps in launch order and fills the placeholders before
    the broadcast, so the follower computes the same tokens."""
    prompts = random_prompts(seed=12, groups=3, per_group=6, prefix_len=24, question_len=(3, 12))
    params = GenerationParams(SamplingParams(temperature=0.0, frequency_penalty=0.5,
                                             top_logprobs=2), max_new_tokens=10,
                              ignore_eos=True)
    expected = _engine(tiny_llama, 1).generate(prompts, params)
    tp2 = _engine(tiny_llama, 2, chunked_prefill_size=32, overlap_schedule=True)
    try:
        assert tp2.generate(prompts, params) == expected
        cache = tp2.scheduler.cache
        assert cache.available_size() == cache.capacity and cache.num_running == 0
    finally:
        tp2.shutdown()


def test_tp2_grammar_outputs_equal_tp1(ray_cluster: None, tiny_tok: Path) -> None:
    """Only the driving rank holds matchers and masks the logits it gathered from both ranks'
    halves of the LM head; the follower runs the same plans unmasked. Seeded and greedy JSON
    requests beside free ones, in small prompt chunks: the same tokens as TP=1, every JSON
    output valid, the grammar's end ending it."""
    prompts = [p * 2 for p in prompts_of(tiny_tok, 10)]
    params = [*json_params(8), *[GenerationParams(max_new_tokens=10, ignore_eos=True)] * 2]
    expected = _engine(tiny_tok, 1).generate(prompts, params)
    tp2 = _engine(tiny_tok, 2, chunked_prefill_size=16)
    try:
        got = tp2.generate(prompts, params)
        cache = tp2.scheduler.cache
        assert cache.available_size() == cache.capacity and cache.num_running == 0
    finally:
        tp2.shutdown()
    assert got == expected
    tokenizer = AutoTokenizer.from_pretrained(tiny_tok)
    texts = [tokenizer.decode(tokens[:-1]) for tokens in got[:8]]
    assert all(tokens[-1] == TOK_EOS for tokens in got[:8])
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 2  # sampled, not one fixed string
    assert all(len(tokens) == 10 for tokens in got[8:])
