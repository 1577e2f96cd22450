"""The Serve application: the OpenAI ingress in front of the engine deployment.

`build_app` is importable for the Serve CLI, which validates its arguments into `AppConfig`::

    serve run raydix.deploy.app:build_app model=default tp=1
"""

import logging
import os  # no `from __future__ import annotations`: `serve run` reads build_app's annotation
from typing import Any, NamedTuple, cast

import ray
from ray import serve
from ray.serve import Application, Deployment
from ray.serve.config import RequestRouterConfig

from raydix.cluster.placement import check_replica_fits
from raydix.router.serve_router import CacheAwareRequestRouter, RoundRobinRequestRouter

from .capacity import Shortfall, check_replicas_fit, replica_resources
from .config import AppConfig
from .cpu_threads import default_cpu_threads
from .engine_factory import EngineFactory, ReplicaSettings, build_engine, replica_bundles
from .engine_ingress import LocalEngine
from .engine_settings import attention_backend, engine_config, resolve_device, routing_policy
from .ingress import OpenAIIngress
from .model_path import driver_tokenizer, resolve_model_path
from .serve_env import replica_runtime_env
from .server import EngineServer
from .stats_board import StatsBoard

API_KEY_ENV = "RAYDIX_API_KEY"
ENGINE_DEPLOYMENT = "EngineServer"
INGRESS_DEPLOYMENT = "OpenAIIngress"
STATS_BOARD_DEPLOYMENT = "StatsBoard"
MAX_INGRESS_ONGOING_REQUESTS = 4096
GRACEFUL_WAIT_LOOP_S = 0.2  # a stopping replica checks this often for requests still running

logger = logging.getLogger(__name__)


def _cluster_gpus() -> float:
    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0.0))
    import torch

    return float(torch.cuda.device_count())


def build_app(config: AppConfig) -> Application:
    """The app for `config` (Serve's builder: `serve run raydix.deploy.app:build_app k=v`)."""
    return bind_app(config)


def bind_app(config: AppConfig, engine_factory: EngineFactory = build_engine) -> Application:
    """Bind the stats board, the engine deployment (engines made by `engine_factory`) and the
    ingress for `config`; with one fixed replica (`engine_serves_http`), the engine replica is
    the ingress too, and /metrics reads its stats in place: no stats board (a Ray worker
    process of its own: its memory, and CPU time taken from the engine's cores on a machine
    whose every core computes). The default model is converted here, once, before any
    replica.

    Connected to a Ray cluster, a replica that no node could hold, or more replicas than the
    nodes hold, are refused here with a ValueError (Serve would keep them pending without
    end), unless an autoscaler can add nodes."""
    where = engine_placement(config)
    device, use_gpu, bundles, cpu_threads = where
    check_attention_backend(config, device)
    shortfall = replica_shortfall(config)
    if shortfall is not None:
        logger.warning("the cluster can't hold every engine replica yet; the autoscaler can "
                       "add %s", shortfall.describe())
    model_path = resolve_model_path(config)
    engine = engine_config(config, model_path, device)
    scaling: dict[str, Any]
    if config.autoscaling is not None:
        scaling = {"autoscaling_config": config.autoscaling.model_dump()}
    else:
        scaling = {"num_replicas": config.replicas}
    placement: dict[str, Any] = {}
    if bundles is not None:
        placement = {"placement_group_bundles": bundles,
                     "placement_group_strategy": "STRICT_PACK"}
    settings = replica_settings(config, use_gpu and not where.gpu_in_replica, cpu_threads)
    ingress_args = (model_path, config.model_name, engine.scheduler.max_context_len,
                    config.max_request_bytes, api_key_of(config))
    ingress_kwargs = {"schedule_policy": engine.scheduler.schedule_policy,
                      "tool_call_parser": config.tool_call_parser,
                      "tokenizer": driver_tokenizer(model_path)}
    replica_options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "ray_actor_options": engine_actor_options(where),
        "health_check_period_s": config.health_check_period_s,
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": config.shutdown_timeout,
        "graceful_shutdown_wait_loop_s": GRACEFUL_WAIT_LOOP_S,
    }
    if engine_serves_http(config, where):  # the one engine replica is the ingress too
        return _deployment(
            OpenAIIngress, rolling_update_percentage=config.rolling_update_percentage).options(
            num_replicas=1, max_ongoing_requests=MAX_INGRESS_ONGOING_REQUESTS, **replica_options,
        ).bind(None, None, *ingress_args, **ingress_kwargs,
               local_engine=LocalEngine(engine, settings, engine_factory))
    board = _deployment(StatsBoard).options(
        name=STATS_BOARD_DEPLOYMENT, num_replicas=1,
        ray_actor_options={"num_cpus": 0, "runtime_env": replica_runtime_env(True)},
        max_ongoing_requests=1024,
        logging_config={"enable_access_log": False},  # a report per replica per second
    ).bind()
    engine_deployment = _deployment(
        EngineServer, rolling_update_percentage=config.rolling_update_percentage).options(
        # above the engine's own admission bound, so the engine answers "overloaded" (503)
        max_ongoing_requests=config.max_running_requests + config.max_waiting_requests + 64,
        **replica_options,
        **scaling,
        **placement,
        **request_router_options(config),  # type: ignore[arg-type]
    )
    # one replica that can't grow: no choice to make, so no router actor, no load reports and
    # no cache events (the request router sends everything to it: `sole_replica`)
    policy = None if one_fixed_replica(config) else routing_policy(config)
    engine_app = engine_deployment.bind(engine, settings, engine_factory, board, routing=policy)
    ingress = _deployment(OpenAIIngress).options(
        name=INGRESS_DEPLOYMENT,
        num_replicas=config.ingress_replicas,
        max_ongoing_requests=MAX_INGRESS_ONGOING_REQUESTS,
        graceful_shutdown_timeout_s=config.shutdown_timeout,  # its streams end with them
        graceful_shutdown_wait_loop_s=GRACEFUL_WAIT_LOOP_S,
        ray_actor_options={"num_cpus": 0, "runtime_env": replica_runtime_env(True)},
    )
    return ingress.bind(engine_app, board, *ingress_args, cache_aware_router=policy is not None,
                        **ingress_kwargs)


class EnginePlacement(NamedTuple):
    device: str
    use_gpu: bool  # each rank reserves a Ray GPU
    bundles: list[dict[str, float]] | None  # the replica's placement group; None: none
    cpu_threads: int | None  # the in-process rank's threads (CPU, tp 1)

    @property
    def gpu_in_replica(self) -> bool:
        """The one rank is the replica's own, on the GPU the replica reserved."""
        return self.use_gpu and self.bundles is None


def engine_placement(config: AppConfig) -> EnginePlacement:
    """Where the engine replicas run and what each reserves. On CUDA with tp 1 the replica
    reserves the GPU itself and its engine process holds the rank (no worker actor, no Ray call
    per step), unless the engine process is off: then the rank is a worker actor in a GPU
    bundle, as with tp > 1."""
    device = resolve_device(config, _cluster_gpus())
    use_gpu = config.use_gpu_bundles if config.use_gpu_bundles is not None else device == "cuda"
    gpu_in_replica = (use_gpu and device == "cuda" and config.tp == 1
                      and not config.disable_engine_process)
    bundles = None if gpu_in_replica else replica_bundles(config.tp, use_gpu)
    return EnginePlacement(device, use_gpu, bundles, replica_cpu_threads(config, device, bundles))


def engine_actor_options(placement: EnginePlacement) -> dict[str, object]:
    """The engine replica actor's own resources (beyond its placement group's bundles): its
    CPUs, where its code runs on Serve's main loop (a CPU rank's threads), and the GPU of the
    rank it holds itself."""
    return {"num_cpus": placement.cpu_threads or 1,
            "num_gpus": 1 if placement.gpu_in_replica else 0,
            "runtime_env": replica_runtime_env(placement.bundles is None)}  # serve_env.py


def replica_settings(config: AppConfig, use_gpu: bool, cpu_threads: int | None) -> ReplicaSettings:
    """What each engine replica is told beyond the engine config (placed by `engine_placement`;
    `use_gpu`: the ranks sit in GPU bundles)."""
    return ReplicaSettings(use_gpu_bundles=use_gpu,
                           max_waiting_requests=config.max_waiting_requests,
                           stream_interval=config.stream_interval,
                           startup_timeout_s=config.startup_timeout_s,
                           router_events=config.router_mode == "exact",
                           router_approx_tokens=config.router_approx_tokens,
                           debug_cache_audit=config.debug_cache_audit,
                           cpu_threads=cpu_threads,
                           engine_process=not config.disable_engine_process,
                           fit_threads_to_model=config.cpu_threads is None)


def replica_shortfall(config: AppConfig) -> Shortfall | None:
    """Connected to a Ray cluster: None when it holds every engine replica asked for (the
    minimum with autoscaling); a `Shortfall` when only an autoscaler's nodes would; a one-line
    ValueError when nothing would (see `capacity.py`)."""
    if not ray.is_initialized():
        return None
    _, use_gpu, bundles, cpu_threads = engine_placement(config)
    if bundles is not None:
        check_replica_fits(config.tp, use_gpu, num_extra_cpus=1)  # bundle 0: the engine
    return check_replicas_fit(config.autoscaling.min_replicas if config.autoscaling else
                              config.replicas, replica_resources(config.tp, use_gpu, cpu_threads))


def check_attention_backend(config: AppConfig, device: str) -> None:
    """Refuse flashinfer here when this machine has CUDA but no flashinfer, in one line, before
    any replica starts (the ranks check again where they run: a head node may have no GPU)."""
    if attention_backend(config, device) != "flashinfer":
        return
    import torch

    from raydix.workers.attention import require_flashinfer

    if torch.cuda.is_available():
        require_flashinfer()


def replica_cpu_threads(config: AppConfig, device: str,
                        bundles: list[dict[str, float]] | None) -> int | None:
    """The threads (and Ray CPUs) of an engine replica whose rank runs inside it, on a CPU
    with tp 1; None for replicas whose ranks run elsewhere. By default the replicas share the
    cores of this machine (see `cpu_threads.py`)."""
    if device != "cpu" or bundles is not None:
        if config.cpu_threads is not None:
            raise ValueError(f"cpu_threads: applies to a replica on the CPU with tp 1, whose rank "
                             f"runs inside it; this one runs on {device} with tp={config.tp}")
        return None
    if config.cpu_threads is not None:
        return config.cpu_threads
    replicas = config.autoscaling.max_replicas if config.autoscaling else config.replicas
    return max(default_cpu_threads(os.cpu_count() or 1) // replicas, 1)


def _deployment(cls: type, **options: Any) -> Deployment:
    """`serve.deployment` on a class (its overloads type the plain call as a decorator), with
    the options that `Deployment.options` does not take."""
    return cast(Deployment, serve.deployment(cls, **options))


def engine_serves_http(config: AppConfig, placement: EnginePlacement) -> bool:
    """Whether the one engine replica is its own HTTP ingress (`engine_ingress.py`): one fixed
    replica whose engine steps in its engine process, and one ingress replica."""
    return (one_fixed_replica(config) and config.ingress_replicas == 1
            and not config.separate_ingress and not config.disable_engine_process
            and placement.bundles is None)


def one_fixed_replica(config: AppConfig) -> bool:
    """One engine replica and no autoscaling: the cache-aware router has nothing to choose."""
    return config.autoscaling is None and config.replicas == 1


def request_router_options(config: AppConfig) -> dict[str, RequestRouterConfig]:
    """The engine deployment's request router. cache_aware asks the application's router actor
    (which the first engine replica creates); power_of_two is Serve's default router;
    ray_prefix is Ray Serve LLM's prefix router, fed the prompt's token ids."""
    if config.router == "cache_aware":
        kwargs = {"decision_timeout_s": config.router_decision_timeout_s,
                  "sole_replica": one_fixed_replica(config)}
        return {"request_router_config": RequestRouterConfig(
            request_router_class=CacheAwareRequestRouter,  # type: ignore[arg-type]
            request_router_kwargs=kwargs)}
    if config.router == "ray_prefix":
        from raydix.router.ray_prefix import RayPrefixAffinityRouter  # imports ray.llm

        return {"request_router_config": RequestRouterConfig(
            request_router_class=RayPrefixAffinityRouter,  # type: ignore[arg-type]
            request_router_kwargs={"imbalanced_threshold": config.ray_imbalanced_threshold})}
    if config.router == "round_robin":
        return {"request_router_config": RequestRouterConfig(
            request_router_class=RoundRobinRequestRouter)}  # type: ignore[arg-type]
    return {}


def api_key_of(config: AppConfig) -> str | None:
    """The key clients must send: `config.api_key`, else $RAYDIX_API_KEY, else none."""
    return config.api_key or os.environ.get(API_KEY_ENV) or None
