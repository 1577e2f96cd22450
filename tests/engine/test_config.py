"""One table shape per replica: the scheduler config sets it, the ranks' config and the cache
manager's follow it, and two configs that disagree are refused by the field's name."""

from __future__ import annotations

from dataclasses import replace

import pytest

from raydix.deploy.config import AppConfig
from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.scheduler import Scheduler
from raydix.workers.config import DEFAULT_SHAPE, TABLE_SHAPE_FIELDS, TableShape, WorkerConfig

SHAPE = dict(page_size=4, max_running_requests=8, max_context_len=300, max_prefill_tokens=96)


def test_every_config_defaults_to_the_one_shape() -> None:
    assert TableShape.of(WorkerConfig(model_path="m")) == DEFAULT_SHAPE
    assert TableShape.of(SchedulerConfig()) == DEFAULT_SHAPE
    app = AppConfig()
    assert (app.page_size, app.max_running_requests) == (
        DEFAULT_SHAPE.page_size, DEFAULT_SHAPE.max_running_requests)


def test_build_derives_the_ranks_and_the_cache_from_the_scheduler() -> None:
    config = EngineConfig.build(WorkerConfig(model_path="m"), SchedulerConfig(**SHAPE))
    assert TableShape.of(config.worker) == TableShape(**SHAPE) == config.table_shape
    assert TableShape.of(config.rank_config(0)) == TableShape(**SHAPE)
    cache = Scheduler(config.scheduler, num_pages=16).cache.config
    assert (cache.page_size, cache.max_running_requests, cache.max_context_len) == (4, 8, 300)


@pytest.mark.parametrize("name", TABLE_SHAPE_FIELDS)
def test_a_worker_that_sets_the_shape_otherwise_is_refused_by_name(name: str) -> None:
    worker = replace(WorkerConfig(model_path="m"), **{name: SHAPE[name] + 1})
    with pytest.raises(ValueError, match=f"worker {name}={SHAPE[name] + 1} vs scheduler {name}"):
        EngineConfig.build(worker, SchedulerConfig(**SHAPE))
    # the same value on both sides is no conflict
    same = replace(WorkerConfig(model_path="m"), **{name: SHAPE[name]})
    assert TableShape.of(EngineConfig.build(same, SchedulerConfig(**SHAPE)).worker) == \
        TableShape(**SHAPE)


@pytest.mark.parametrize("name", TABLE_SHAPE_FIELDS)
def test_an_engine_config_whose_halves_disagree_is_refused_by_name(name: str) -> None:
    good = EngineConfig.build(WorkerConfig(model_path="m"), SchedulerConfig(**SHAPE))
    with pytest.raises(ValueError, match=f"disagree on the table shape: worker {name}="):
        EngineConfig(replace(good.worker, **{name: SHAPE[name] * 2}), good.scheduler)
    with pytest.raises(ValueError, match=f"worker {name}={SHAPE[name]} vs scheduler {name}"):
        replace(good, scheduler=replace(good.scheduler, **{name: SHAPE[name] * 2}))


@pytest.mark.parametrize("name", TABLE_SHAPE_FIELDS)
def test_a_shape_field_below_one_is_refused_by_name(name: str) -> None:
    for make in (TableShape, SchedulerConfig, lambda **kw: WorkerConfig(model_path="m", **kw)):
        with pytest.raises(ValueError, match=f"{name} must be >= 1, got 0"):
            make(**{name: 0})
