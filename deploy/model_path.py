"""Which model is served: the packaged default's names, and a local folder for `config.model`."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


@lru_cache(maxsize=4)
def driver_tokenizer(model_path: str) -> Any:
    """The folder's tokenizer (AutoTokenizer), loaded once in the process that builds apps and
    handed to the ingress replicas (see OpenAIIngress)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as e:  # refused before any replica starts, in one line
        raise ValueError(f"model folder {model_path!r}: no tokenizer could be loaded: {e}") from e


def prepare_in_background(config: AppConfig) -> Future[str]:
    """`resolve_model_path(config)` on a thread, while Ray and Serve start, and the import of
    transformers' config classes and the tokenizer that building the app then needs: on 2 cores
    they cost 4-6 s (torch, transformers) that would otherwise come before Ray starts. A
    folder without config.json is refused here at once, before anything starts."""
    if config.model != DEFAULT_MODEL:
        resolve_model_path(config)
    future: Future[str] = Future()

    def prepare() -> None:
        try:
            path = resolve_model_path(config)
            from transformers import AutoConfig

            AutoConfig.from_pretrained(path)
            driver_tokenizer(path)
        except BaseException as e:  # handed to the caller
            future.set_exception(e)
        else:
            future.set_result(path)

    threading.Thread(target=prepare, name="raydix-prepare-model", daemon=True).start()
    return future
