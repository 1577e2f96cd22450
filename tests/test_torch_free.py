"""The control plane is torch-free: the scheduler, the engine, the cache, the router and the HTTP
ingress import without loading torch or the model stack (only the ranks need them). The engine
core (engine/; its Ray parts are in cluster/) is Ray-free too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CONTROL_PLANE = (
    "raydix.cache",
    "raydix.workers.step",
    "raydix.engine.scheduler",
    "raydix.engine.engine",
    "raydix.engine.async_engine",
    "raydix.cluster.ray_executor",
    "raydix.router.state",
    "raydix.router.actor",
    "raydix.router.serve_router",
    "raydix.deploy.config",
    "raydix.deploy.ingress",
    "raydix.deploy.server",
    "raydix.deploy.engine_factory",
)
ROOT = Path(__file__).resolve().parents[1]
MODEL_STACK = ("torch", "transformers", "safetensors", "flashinfer")
# every module of the engine core package
ENGINE_CORE = tuple(
    f"raydix.engine.{path.stem}" for path in sorted((ROOT / "engine").glob("*.py"))
    if path.stem != "__init__"
)


def _loaded_after_import(modules: tuple[str, ...],
                         watched: tuple[str, ...] = MODEL_STACK) -> list[str]:
    probe = (
        "import importlib, json, sys\n"
        f"for name in {list(modules)!r}: importlib.import_module(name)\n"
        f"print(json.dumps([m for m in {list(watched)!r} if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_control_plane_imports_without_torch() -> None:
    assert _loaded_after_import(CONTROL_PLANE) == []


def test_probe_sees_torch_when_the_model_stack_loads() -> None:
    assert "torch" in _loaded_after_import(("raydix.workers.runner",))


def test_engine_core_imports_without_ray() -> None:
    assert _loaded_after_import(ENGINE_CORE, ("ray", *MODEL_STACK)) == []
    assert _loaded_after_import(("raydix.cluster.ray_executor",), ("ray",)) == ["ray"]


def test_the_engine_process_unpickles_the_default_factory_without_ray() -> None:
    """The replica sends its engine process `build_engine` with its config by cloudpickle; the
    child's unpickling imports the factory's module, which must not pull in Ray and Serve (about
    a second of the engine's start on 2 cores; engine_factory.py)."""
    import functools

    from ray import cloudpickle

    from raydix.deploy.engine_factory import ReplicaSettings, build_engine
    from raydix.engine.config import EngineConfig, SchedulerConfig
    from raydix.workers.config import WorkerConfig

    config = EngineConfig(worker=WorkerConfig(model_path="/nowhere"), scheduler=SchedulerConfig())
    factory = cloudpickle.dumps(functools.partial(build_engine, config, ReplicaSettings()))
    probe = (
        "import json, pickle, sys\n"
        f"factory = pickle.loads({factory!r})\n"
        "assert factory.func.__module__ == 'raydix.deploy.engine_factory', factory.func\n"
        f"print(json.dumps([m for m in ('ray', *{list(MODEL_STACK)!r}) if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
