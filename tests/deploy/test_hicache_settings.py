"""The host KV tier's settings: flags from AppConfig, one-line errors, and the engine config."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from raydix.deploy.config import AppConfig, describe_error
from raydix.deploy.engine_settings import engine_config
from raydix.deploy.metrics import render_engine
from raydix.deploy.server import ReplicaStats
from raydix.engine.metrics import EngineMetrics


@pytest.fixture
def tiny_llama_folder(tmp_path: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("options", "message"), [
    ({"hicache_ratio": 1.5}, "hicache_ratio must be 0 (off) or at least 2, got 1.5"),
    ({"hicache_ratio": -2}, "hicache_ratio: Input should be greater than or equal to 0"),
    ({"hicache_ratio": 3, "hicache_size": 4}, "set hicache_ratio or hicache_size, not both"),
    ({"hicache_size": 4, "disable_radix_cache": True}, "needs the radix cache"),
    ({"hicache_write_policy": "write_around"}, "hicache_write_policy"),
])
def test_bad_settings_get_one_line_errors(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        AppConfig.model_validate(options)
    text = describe_error(info.value)
    assert message in text and "\n" not in text


def test_settings_reach_the_ranks_and_the_scheduler(tiny_llama_folder: Path) -> None:
    config = engine_config(AppConfig(hicache_ratio=3, hicache_write_policy="write_back"),
                           str(tiny_llama_folder), "cpu")
    assert config.worker.hicache_ratio == 3 and config.worker.host_tier
    assert config.scheduler.hicache_write_policy == "write_back"
    sized = engine_config(AppConfig(hicache_size=1.5), str(tiny_llama_folder), "cpu")
    assert sized.worker.hicache_size_gb == 1.5 and sized.worker.hicache_ratio == 0


def test_host_tier_series_in_metrics() -> None:
    metrics = EngineMetrics(0, 0, 0.0, 0.5, 0.0, 0, 100, 50, 0, 0, num_host_tokens=64,
                            host_capacity=256, host_token_usage=0.25, host_hit_rate=0.3,
                            num_host_hit_tokens=30, num_loaded_tokens=40, num_written_tokens=70)
    text = render_engine([ReplicaStats("r1", metrics, 0, 0, 0, 128, None)])
    assert 'raydix_host_kv_usage_ratio{replica="r1"} 0.25' in text
    assert 'raydix_host_hit_rate{replica="r1"} 0.3' in text
    assert 'raydix_engine_host_loaded_tokens_total{replica="r1"} 40.0' in text
    assert 'raydix_engine_host_written_tokens_total{replica="r1"} 70.0' in text


def test_the_router_weight_of_a_host_hit_is_a_setting() -> None:
    from raydix.deploy.engine_settings import routing_policy

    policy = routing_policy(AppConfig(host_hit_weight=0.25))
    assert policy is not None and policy.host_hit_weight == 0.25
    with pytest.raises(ValidationError, match="host_hit_weight"):
        AppConfig(host_hit_weight=1.5)
