"""Where a CUDA replica's ranks run, as `bind_app` deploys it (no GPU needed: only the binding).

With tp 1 the replica reserves the GPU itself and its engine process holds the rank: no worker
actor, no placement group, no Ray call per step. With the engine process off, or tp > 1, the
ranks are worker actors in GPU bundles, as before. The fake-GPU set-up the tests use (device cpu
with GPU bundles) keeps its bundles."""

from __future__ import annotations

from typing import Any

import pytest

from raydix.deploy.app import bind_app
from raydix.deploy.capacity import replica_resources
from raydix.deploy.config import AppConfig
from raydix.deploy.engine_settings import engine_config
from raydix.deploy.replica_facts import replica_facts
from raydix.deploy.server import ReplicaSettings, runs_in_engine_process
from tests.serve_apps import engine_deployment, replica_settings_of


def _engine(config: AppConfig) -> tuple[dict[str, Any], list[dict[str, float]] | None,
                                         ReplicaSettings]:
    """The engine deployment's actor options, placement group bundles and replica settings."""
    app = bind_app(config)
    settings = replica_settings_of(app)
    replica = engine_deployment(app)._replica_config
    return dict(replica.ray_actor_options), replica.placement_group_bundles, settings


def test_a_cuda_replica_with_tp_1_holds_its_gpu_in_its_engine_process(model_folder: str) -> None:
    config = AppConfig(model=model_folder, device="cuda", attention_backend="torch")
    options, bundles, settings = _engine(config)
    assert options["num_gpus"] == 1 and options["num_cpus"] == 1
    assert bundles is None  # no placement group, no worker actor
    assert not settings.use_gpu_bundles and settings.engine_process
    assert settings.cpu_threads is None  # torch on the GPU's host keeps its own threads
    assert runs_in_engine_process(engine_config(config, model_folder, "cuda"), settings)
    # what the capacity check counts for it: the same as a GPU bundle's replica
    assert replica_resources(1, True, None) == {"CPU": 1.0, "GPU": 1.0}


@pytest.mark.parametrize("change", [{"disable_engine_process": True}, {"tp": 2}])
def test_otherwise_cuda_ranks_are_worker_actors_in_gpu_bundles(
        model_folder: str, change: dict[str, object]) -> None:
    config = AppConfig(model=model_folder, device="cuda", attention_backend="torch", **change)
    options, bundles, settings = _engine(config)
    assert options["num_gpus"] == 0
    assert bundles == [{"CPU": 1.0}] + [{"GPU": 1.0}] * config.tp
    assert settings.use_gpu_bundles
    assert not runs_in_engine_process(engine_config(config, model_folder, "cuda"), settings)


def test_fake_gpu_bundles_and_the_cpu_keep_their_placement(model_folder: str) -> None:
    fake = AppConfig(model=model_folder, device="cpu", use_gpu_bundles=True)
    options, bundles, settings = _engine(fake)
    assert options["num_gpus"] == 0 and bundles == [{"CPU": 1.0}, {"GPU": 1.0}]
    assert not runs_in_engine_process(engine_config(fake, model_folder, "cpu"), settings)
    cpu = AppConfig(model=model_folder, device="cpu", cpu_threads=1)
    options, bundles, settings = _engine(cpu)
    assert options["num_gpus"] == 0 and bundles is None
    assert runs_in_engine_process(engine_config(cpu, model_folder, "cpu"), settings)


def test_the_start_line_names_the_engine_process_of_a_gpu_replica(model_folder: str) -> None:
    config = engine_config(AppConfig(model=model_folder, device="cuda"), model_folder, "cuda")
    line = replica_facts("r1", config, "bfloat16", 1000, None, 1.0, [], engine_pid=42).describe()[0]
    assert f"on cuda, tp=1, dtype bfloat16, attention {config.worker.attention_backend}" in line
    assert line.split("CUDA graphs ")[1].startswith(
        f"{'on' if config.worker.cuda_graph else 'off'}, in engine process 42, ")
