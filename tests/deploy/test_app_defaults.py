"""The app's defaults are the engine's: an `AppConfig()` left alone reaches the worker, the
scheduler and the replica with the values those write as their own defaults."""

from __future__ import annotations

from dataclasses import fields

from raydix.deploy.config import AppConfig
from raydix.deploy.engine_settings import engine_config
from raydix.deploy.server import ReplicaSettings
from raydix.engine.config import SchedulerConfig
from raydix.workers.config import WorkerConfig

WORKER_FIELDS = ("mem_fraction_static", "cpu_memory_budget_bytes", "ds_heavy_channel_num",
                 "ds_heavy_token_num", "ds_sparse_decode_threshold", "page_size",
                 "max_running_requests")
SCHEDULER_FIELDS = ("page_size", "max_running_requests", "schedule_policy",
                    "hicache_write_policy")


def test_app_defaults_reach_the_worker_and_the_scheduler(model_folder: str) -> None:
    config = engine_config(AppConfig(), model_folder, "cpu")
    plain_worker = WorkerConfig(model_path=model_folder)
    for name in WORKER_FIELDS:
        assert getattr(config.worker, name) == getattr(plain_worker, name), name
    for name in SCHEDULER_FIELDS:
        assert getattr(config.scheduler, name) == getattr(SchedulerConfig(), name), name


def test_app_defaults_are_the_replicas() -> None:
    # use_gpu_bundles is left out: the app's None means "by device", decided at build time
    app, replica = AppConfig(), ReplicaSettings()
    shared = [f.name for f in fields(ReplicaSettings)
              if f.name in AppConfig.model_fields and f.name != "use_gpu_bundles"]
    assert set(shared) >= {"max_waiting_requests", "startup_timeout_s", "router_approx_tokens"}
    for name in shared:
        assert getattr(app, name) == getattr(replica, name), name
