"""Windowed models through the whole engine: the radix cache keeps every token of a windowed
layer, so prefix hits, chunked prefill, eviction and retraction give transformers' tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, MistralConfig

from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.workers.config import WorkerConfig
from tests.engine.conftest import random_prompts
from tests.workers.reference import HFReference

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.2, eos_token_id=1, bos_token_id=0, pad_token_id=0)
CONFIGS = {
    "mistral": MistralConfig(**TINY, sliding_window=7),
    "gemma2": Gemma2Config(**TINY, head_dim=16, sliding_window=7, query_pre_attn_scalar=8,
                           attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
}
PARAMS = GenerationParams(max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def windowed(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFReference]:
    torch.manual_seed(99)
    model = AutoModelForCausalLM.from_config(CONFIGS[request.param])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, HFReference(folder)


def _engine(folder: Path, page_size: int, max_total_tokens: int = 4096) -> Engine:
    worker = WorkerConfig(model_path=str(folder), dtype="float32",
                          max_total_tokens=max_total_tokens)
    config = EngineConfig.build(worker, SchedulerConfig(
        max_running_requests=16, max_context_len=256, page_size=page_size,
        max_prefill_tokens=64, chunked_prefill_size=16, init_new_token_ratio=0.0,
        min_new_token_ratio=0.0))
    engine = Engine(config)
    engine.step_hook = lambda sched: sched.cache.check_integrity()
    return engine


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_hits_and_retraction_give_transformers_tokens(
        windowed: tuple[Path, HFReference], page_size: int) -> None:
    folder, hf = windowed
    prompts = random_prompts(seed=5, groups=2, per_group=4, prefix_len=33, question_len=(3, 9))
    expected = hf.greedy(prompts, PARAMS.max_new_tokens)
    engine = _engine(folder, page_size)
    assert engine.generate(prompts, PARAMS) == expected
    assert engine.metrics().num_cached_tokens > 0  # prefixes longer than the window were hit
    small = _engine(folder, page_size, max_total_tokens=160)
    assert small.generate(prompts, PARAMS) == expected
    assert small.metrics().num_retractions > 0
