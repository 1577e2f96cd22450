"""A YAML file of `AppConfig` options, and a validation error in one line per bad option."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError


def load_yaml(path: str | Path) -> dict[str, object]:
    """The mapping in a YAML config file (checked by `AppConfig` afterwards)."""
    data = yaml.safe_load(Path(path).read_text())
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file holds a mapping of options, got {type(data)}")
    return data


def describe_error(error: ValidationError) -> str:
    """One line naming each bad option."""
    parts = []
    for e in error.errors():
        name = ".".join(str(p) for p in e["loc"]) or "config"
        parts.append(f"{name}: {e['msg']}")
    return "; ".join(parts)
