"""The engine with mixture-of-experts and latent-attention models: a pool too small for the
load forces retraction and eviction, prompts share prefixes through the radix cache, pages hold
16 slots, and every request still gets transformers' greedy tokens."""

from __future__ import annotations

import pytest

from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.workers.config import WorkerConfig
from tests.engine.conftest import random_prompts
from tests.engine.test_engine import assert_drained
from tests.workers.moe_models import save_moe_model
from tests.workers.reference import HFReference

PARAMS = GenerationParams(max_new_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3"])
def test_retraction_under_a_small_pool_keeps_transformers_tokens(
        tmp_path_factory: pytest.TempPathFactory, name: str) -> None:
    folder = tmp_path_factory.mktemp(name)
    save_moe_model(name, folder)
    prompts = random_prompts(seed=5, groups=2, per_group=4, prefix_len=20, question_len=(4, 12))
    expected = HFReference(folder).greedy(prompts, PARAMS.max_new_tokens)
    worker = WorkerConfig(model_path=str(folder), dtype="float32", max_total_tokens=192)
    engine = Engine(EngineConfig.build(worker, SchedulerConfig(
        max_running_requests=8, max_context_len=128, page_size=16, chunked_prefill_size=32,
        init_new_token_ratio=0.0, min_new_token_ratio=0.0)))
    engine.step_hook = lambda sched: sched.cache.check_integrity()
    assert engine.generate(prompts, PARAMS) == expected
    metrics = engine.metrics()
    assert metrics.num_retractions > 0
    assert metrics.num_cached_tokens > 0  # the shared prefixes came from the radix cache
    assert_drained(engine)


def test_host_tier_over_the_latent_pool(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The host tier mirrors the latent pool like any other: outputs equal the tier off."""
    from tests.engine.test_engine_hicache import (
        assert_same_outputs,
        assert_tiers_drained,
        conversations,
        hicache_engine,
        run_schedule,
    )

    folder = tmp_path_factory.mktemp("deepseek_v3_host")
    save_moe_model("deepseek_v3", folder)
    schedule = conversations(seed=3, num=4, turns=3, system_len=40)
    off = hicache_engine(folder, 0)
    expected = run_schedule(off, schedule, set())
    on = hicache_engine(folder, 4)
    assert_same_outputs(run_schedule(on, schedule, set()), expected)
    host = on.scheduler.cache.host_cache
    assert host is not None and host.num_loaded_tokens > 0
    runner = on.executor.worker.runner  # type: ignore[attr-defined]
    assert [tuple(b.shape[1:]) for b in runner.host_pool.buffers] == [(1, 24)] * 2
    assert_tiers_drained(on)
