"""The app's defaults are the engine's: an `AppConfig()` left alone reaches the worker, the
scheduler and the replica with the values those write as their own defaults; and a setting
changed in the app reaches the replica's settings."""

from __future__ import annotations

from dataclasses import fields

from ray.serve.deployment import Application

from raydix.deploy.app import replica_settings
from raydix.deploy.config import AppConfig
from raydix.deploy.engine_settings import engine_config
from raydix.deploy.server import ReplicaSettings
from raydix.engine.config import SchedulerConfig
from raydix.workers.config import WorkerConfig
from tests.serve_apps import engine_deployment

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


# decided where the replica is placed (`engine_placement`), not copied from the app's field
PLACEMENT_FIELDS = ("use_gpu_bundles", "cpu_threads")


def _changed(value: object) -> object:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 3
    raise TypeError(f"no other value for {value!r}")


def test_app_defaults_are_the_replicas() -> None:
    # use_gpu_bundles is left out: the app's None means "by device", decided at build time
    app, replica = AppConfig(), ReplicaSettings()
    shared = [f.name for f in fields(ReplicaSettings)
              if f.name in AppConfig.model_fields and f.name != "use_gpu_bundles"]
    assert set(shared) >= {"max_waiting_requests", "startup_timeout_s", "router_approx_tokens"}
    for name in shared:
        assert getattr(app, name) == getattr(replica, name), name


def test_app_settings_reach_the_replica() -> None:
    shared = [f.name for f in fields(ReplicaSettings)
              if f.name in AppConfig.model_fields and f.name not in PLACEMENT_FIELDS]
    assert "stream_interval" in shared
    changed = {name: _changed(getattr(AppConfig(), name)) for name in shared}
    settings = replica_settings(AppConfig.model_validate(changed), use_gpu=True, cpu_threads=3)
    for name, value in changed.items():
        assert getattr(settings, name) == value, name
    assert settings.use_gpu_bundles and settings.cpu_threads == 3 and settings.router_events
    plain = replica_settings(AppConfig(router_mode="approximate"), use_gpu=False, cpu_threads=None)
    assert not plain.use_gpu_bundles and plain.cpu_threads is None and not plain.router_events


def test_the_rolling_update_share_reaches_the_engine_deployment(model_folder: str) -> None:
    from ray.serve._private.config import DeploymentConfig

    from raydix.deploy.app import bind_app

    def engine_share(config: AppConfig) -> float:
        engine = engine_deployment(bind_app(config))
        return float(engine._deployment_config.rolling_update_percentage)

    base = AppConfig(model=model_folder, device="cpu")
    for config in (base, base.model_copy(update={"separate_ingress": True})):
        # Serve's default, whether the engine replica is its own ingress or not
        assert engine_share(config) == DeploymentConfig().rolling_update_percentage
        assert engine_share(config.model_copy(update={"rolling_update_percentage": 1.0})) == 1.0


def test_one_fixed_replica_is_its_own_ingress(model_folder: str) -> None:
    """One engine replica that can't grow, stepping in its engine process, with one ingress
    replica: the app is that replica alone (besides the stats board), with the engine's name
    and resources, and the engine built inside it (`engine_ingress.py`); any other shape keeps
    an ingress deployment of its own in front of the engine deployment."""
    from raydix.deploy.app import (
        ENGINE_DEPLOYMENT,
        INGRESS_DEPLOYMENT,
        STATS_BOARD_DEPLOYMENT,
        bind_app,
    )
    from raydix.deploy.config import AutoscalingSettings
    from raydix.deploy.engine_ingress import LocalEngine

    base = AppConfig(model=model_folder, device="cpu", cpu_threads=2)
    app = bind_app(base)
    root = app._bound_deployment
    assert root.name == ENGINE_DEPLOYMENT
    assert root.init_args[0] is None  # no handle: the engine is local
    local = root.init_kwargs["local_engine"]
    assert isinstance(local, LocalEngine) and local.settings.engine_process
    assert local.settings.cpu_threads == 2
    assert root.ray_actor_options["num_cpus"] == 2  # the engine's CPUs, not the ingress's 0
    assert root._deployment_config.num_replicas == 1
    bound = [a._bound_deployment.name for a in root.init_args if isinstance(a, Application)]
    assert bound == [] and root.init_args[1] is None  # no engine deployment, no board
    for split in ({"separate_ingress": True}, {"replicas": 2}, {"ingress_replicas": 2},
                  {"disable_engine_process": True},
                  {"autoscaling": AutoscalingSettings(max_replicas=2)}):
        app = bind_app(base.model_copy(update=split))
        assert app._bound_deployment.name == INGRESS_DEPLOYMENT, split
        assert app._bound_deployment.init_kwargs.get("local_engine") is None, split
        assert engine_deployment(app).name == ENGINE_DEPLOYMENT, split
        assert app._bound_deployment.init_args[1]._bound_deployment.name == STATS_BOARD_DEPLOYMENT


def test_one_fixed_replica_has_no_router_actor_to_feed(model_folder: str) -> None:
    """One replica that can't grow: its requests need no decision, so it reports nothing to a
    router actor (no load reports, no cache events) and /metrics shows no router series; two
    replicas, or one that may grow, do."""
    from raydix.deploy.app import bind_app
    from raydix.deploy.config import AutoscalingSettings

    def routing(config: AppConfig) -> tuple[object, bool]:
        app = bind_app(config)
        engine = next(a for a in app._bound_deployment.init_args if isinstance(a, Application))
        return (engine._bound_deployment.init_kwargs["routing"],
                app._bound_deployment.init_kwargs["cache_aware_router"])

    base = AppConfig(model=model_folder, device="cpu", cpu_threads=1, separate_ingress=True)
    assert routing(base) == (None, False)
    for grows in (base.model_copy(update={"replicas": 2}),
                  base.model_copy(update={"autoscaling": AutoscalingSettings(max_replicas=2)})):
        policy, cache_aware = routing(grows)
        assert policy is not None and cache_aware
    assert routing(base.model_copy(update={"router": "power_of_two"})) == (None, False)
