"""Which model is served: the packaged default's names, and a local folder for `config.model`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import AppConfig

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def resolve_model_path(config: AppConfig) -> str:
    """A local folder for `config.model`: the default model is converted on first use."""
    if config.model == DEFAULT_MODEL:
        from raydix.workers.gguf_convert import DEFAULT_CACHE_DIR, default_model_folder

        cache_dir = Path(config.model_cache_dir) if config.model_cache_dir else DEFAULT_CACHE_DIR
        return str(default_model_folder(cache_dir))
    if not (Path(config.model) / "config.json").is_file():
        raise FileNotFoundError(f"model folder {config.model!r} has no config.json")
    return config.model
