"""The layer rules of ARCHITECTURE.md: who may import whom.

Every module of each product package is parsed, and each import is checked against the table.
Lazy imports inside functions count too (flashinfer is the one allowed lazily in workers/).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cache", "workers", "engine", "cluster", "router", "deploy")
STDLIB = set(sys.stdlib_module_names)

# third-party top-level modules each package may import (beyond the stdlib)
THIRD_PARTY = {
    "cache": {"numpy"},
    "workers": {"torch", "transformers", "safetensors", "numpy", "flashinfer", "gguf", "tqdm",
                "xgrammar"},
    "engine": {"numpy"},  # torch- and Ray-free: the model stack loads in the ranks only
    "cluster": {"ray"},  # the engine's Ray parts
    "router": {"ray", "numpy"},
    "deploy": None,  # anything
}
# raydix subpackages each package may import
FIRST_PARTY = {
    "cache": set(),
    "workers": set(),
    "engine": {"cache", "workers"},
    "cluster": {"engine", "workers"},
    "router": {"cache"},
    "deploy": {"cache", "workers", "engine", "cluster", "router"},
}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _violations(package: str) -> list[str]:
    problems = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for lineno, module in _imports(path):
            top = module.split(".")[0]
            where = f"{path.relative_to(ROOT)}:{lineno} imports {module}"
            if top == "raydix":
                parts = module.split(".")
                target = parts[1] if len(parts) > 1 else ""
                if target != package and target not in FIRST_PARTY[package]:
                    problems.append(where)
            elif top in PACKAGES:
                problems.append(where + " (use the raydix namespace or a relative import)")
            elif top in STDLIB or top == "__future__":
                continue
            elif THIRD_PARTY[package] is not None and top not in THIRD_PARTY[package]:
                problems.append(where)
    return problems


@pytest.mark.parametrize("package", PACKAGES)
def test_package_respects_layer_rules(package: str) -> None:
    assert _violations(package) == []


@pytest.mark.parametrize("package", ["cache", "engine"])
def test_package_is_free_of_torch_and_ray(package: str) -> None:
    # lazy and type-checking-only imports count: the engine core never names Ray
    for path in (ROOT / package).rglob("*.py"):
        tops = {module.split(".")[0] for _, module in _imports(path)}
        assert not tops & {"torch", "ray"}, path


def test_checker_catches_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import torch\n    from ray import serve\n")
    assert [m for _, m in _imports(bad)] == ["torch", "ray"]


def test_no_generic_top_level_module_is_installed(tmp_path: Path) -> None:
    # run outside the checkout, so only what is installed can be imported
    probe = (
        "import importlib.util, json; "
        f"print(json.dumps([importlib.util.find_spec(n) is not None for n in {list(PACKAGES)}])); "
        "import raydix.cache, raydix.workers, raydix.engine, raydix.cluster, raydix.router, "
        "raydix.deploy"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [False] * len(PACKAGES)
