"""The control plane is torch-free: the scheduler, the engine, the cache, the router and the HTTP
ingress import without loading torch or the model stack (only the ranks need them). The engine
core (cluster/ without its Ray parts: tp_group, worker_actor, placement) is Ray-free too."""

from __future__ import annotations

import json
import subprocess
import sys

CONTROL_PLANE = (
    "raydix.cache",
    "raydix.workers.step",
    "raydix.cluster.scheduler",
    "raydix.cluster.engine",
    "raydix.cluster.async_engine",
    "raydix.cluster.tp_group",
    "raydix.router.state",
    "raydix.router.actor",
    "raydix.router.serve_router",
    "raydix.deploy.config",
    "raydix.deploy.ingress",
    "raydix.deploy.server",
)
MODEL_STACK = ("torch", "transformers", "safetensors", "flashinfer")
ENGINE_CORE = (
    "raydix.cluster.scheduler",
    "raydix.cluster.admission",
    "raydix.cluster.output_processor",
    "raydix.cluster.engine",
    "raydix.cluster.async_engine",
    "raydix.cluster.executor",
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
    assert _loaded_after_import(("raydix.cluster.tp_group",), ("ray",)) == ["ray"]
