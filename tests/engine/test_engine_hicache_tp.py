"""The host KV tier at TP=2 (ranks as Ray actors on fake GPUs): every rank makes the same copies
in the same step, so the outputs equal the tier-off engine's at TP=1, and nothing is left held."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest

from tests.engine.test_engine_hicache import (
    assert_same_outputs,
    assert_tiers_drained,
    conversations,
    hicache_engine,
    run_schedule,
)

pytestmark = pytest.mark.ray


def test_tp2_host_tier_equals_tp1_tier_off(ray_cluster: None, tiny_llama: Path) -> None:
    schedule = conversations(seed=8, num=5, turns=3, system_len=40)
    aborted = {4, 9}
    expected = run_schedule(hicache_engine(tiny_llama, 0), schedule, aborted)
    tp2 = hicache_engine(tiny_llama, 3, tp_size=2, hicache_write_policy="write_through")
    try:
        assert_same_outputs(run_schedule(tp2, schedule, aborted), expected)
        host = tp2.scheduler.cache.host_cache
        assert host is not None and host.num_loaded_tokens > 0
        assert tp2.executor.max_host_tokens == host.host_capacity  # type: ignore[attr-defined]
        assert_tiers_drained(tp2)
    finally:
        tp2.shutdown()
